//! The agent's admin HTTP port: `/metrics`, `/healthz`, `/readyz`, the JSON API
//! the `census` CLI reads (`/v1/endpoints`, with the datapath's missing hooks and
//! Service ranges; `/v1/version`, `/v1/flows`, `/v1/services`; see [`api`]), and `/debug/pprof/heap` (a heap profile with `--heap-profiling`).
//! It is unauthenticated and listens on loopback by default (the CLI runs on the
//! node); `--health-listen` adds a listener with only `/healthz`, `/readyz` and
//! `/metrics` ([`health_router`]) for the kubelet's probes and Prometheus, which
//! reach the node from outside. Both are served by `census_daemon::http::serve`,
//! each with its own connection cap and the same timeouts (`--admin-max-connections`,
//! `--admin-header-timeout`, `--admin-idle-timeout`).
//!
//! The agent is Ready once its datapath is loaded and its endpoint source has given
//! a first full set. It stays Ready while the operator is away (fail-static) and
//! while the source's input is broken (the last good set stays in force), and
//! while the cluster-wide endpoint map is away (its remote entries stay in force),
//! and while one of the node's own hooks (an uplink's, the sockets') cannot be
//! attached (only what it alone counts is lost); `/readyz` says each in its detail.

pub mod api;

use std::{sync::Arc, time::Duration};

use axum::{
    Json, Router,
    extract::State,
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::get,
};
use prometheus_client::registry::Registry;
use tokio::{
    net::TcpListener,
    sync::{mpsc, oneshot, watch},
};

use crate::{
    agent_core::{EndpointState, EndpointView, MapState, MapStatus, ServiceCounts, Status},
    bpf::{Inspector, protocol_name},
};

/// A question for the core, answered on its task.
#[derive(Debug)]
pub(crate) enum Query {
    Endpoints(oneshot::Sender<Vec<EndpointView>>),
}

/// Everything the handlers read.
#[derive(Debug, Clone)]
pub(crate) struct AdminState {
    pub(crate) registry: Arc<Registry>,
    pub(crate) node: String,
    pub(crate) operator_address: String,
    pub(crate) session: String,
    pub(crate) source: String,
    /// The core's status, as it published it last.
    pub(crate) status: watch::Receiver<Status>,
    pub(crate) queries: mpsc::Sender<Query>,
    pub(crate) maps: Option<Arc<Inspector>>,
}

/// How long a handler waits for the core.
const QUERY_TIMEOUT: Duration = Duration::from_secs(5);

pub(crate) fn router(state: AdminState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route(api::ENDPOINTS_PATH, get(endpoints))
        .route(api::VERSION_PATH, get(version))
        .route(api::FLOWS_PATH, get(flows))
        .route(api::SERVICES_PATH, get(services))
        .with_state(state)
        .merge(census_daemon::profiling::routes())
}

/// The second listener's routes: what the kubelet's probes and Prometheus need
/// from outside the node, none of the `/v1` API or the heap profiles.
pub(crate) fn health_router(state: AdminState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(state)
}

/// Binds a listener; its address (the port chosen for port 0).
pub(crate) async fn bind(
    addr: std::net::SocketAddr,
) -> std::io::Result<(TcpListener, std::net::SocketAddr)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    Ok((listener, local))
}

async fn metrics(State(state): State<AdminState>, headers: HeaderMap) -> Response {
    census_daemon::metrics::response(&state.registry, &headers)
}

async fn readyz(State(state): State<AdminState>) -> Response {
    let core = state.status.borrow().clone();
    let sync = &core.operator;
    let source = match &core.source_error {
        None => format!("{}: ok", state.source),
        Some(error) => format!(
            "{}: the last read failed, the last good set stays in force: {error}",
            state.source
        ),
    };
    let operator = if sync.connected {
        format!("operator {}: connected", state.operator_address)
    } else {
        let why = sync
            .last_error
            .as_ref()
            .map_or_else(|| "not connected yet".to_owned(), ToString::to_string);
        format!(
            "operator {}: disconnected ({why}); the datapath keeps its state",
            state.operator_address
        )
    };
    let endpoints = format!(
        "endpoints: {} programmed, {} waiting for identity, {} in error",
        core.programmed, core.waiting, core.errors
    );
    let operator = format!("{operator}\n{}", map_detail(&core.map));
    let mut datapath = String::new();
    for p in &core.in_front {
        datapath.push_str(&format!(
            "datapath: {} ({}) runs {} (id {}) in front of census's classifier: a verdict it returns bypasses census\n",
            p.interface, p.direction, p.program, p.program_id
        ));
    }
    for hook in &core.missing_hooks {
        datapath.push_str(&format!(
            "datapath: {} is not attached ({}): {}\n",
            hook.hook, hook.error, hook.uncounted
        ));
    }
    if core.unattached > 0 {
        datapath.push_str(&format!(
            "datapath: {} endpoints without census's classifier (counted where their traffic goes)\n",
            core.unattached
        ));
    }
    let lost = state
        .maps
        .as_ref()
        .and_then(|maps| maps.stats().ok().flatten())
        .map_or(0, |stats| stats.marks_lost());
    if let Some(line) = marks_lost_detail(lost) {
        datapath.push_str(&line);
    }
    if let Some(error) = &core.datapath_error {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: the datapath is not whole: {error}\n{endpoints}\n{datapath}{source}\n{operator}\n"),
        )
            .into_response()
    } else if core.synced {
        (
            StatusCode::OK,
            format!("ready\n{endpoints}\n{datapath}{source}\n{operator}\n"),
        )
            .into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "not ready: waiting for the first full set of endpoints\n{source}\n{operator}\n"
            ),
        )
            .into_response()
    }
}

/// `/readyz`'s line for Service packets marked and never counted translated: the
/// only report of a rule that rewrites the whole `skb->mark` (it never makes the
/// agent unready: the rest is counted as before).
fn marks_lost_detail(lost: u64) -> Option<String> {
    (lost > 0).then(|| {
        format!(
            "datapath: {lost} packets to Service addresses were marked and never counted \
             translated (census_agent_marks_lost): dropped between the hooks, or a rule \
             that rewrites the whole skb->mark (a CONNMARK --restore-mark without a mask) \
             took census's mark bit off; those requests go uncounted\n"
        )
    })
}

/// The cluster-wide endpoint map's line of `/readyz`: being away from it never
/// makes the agent unready (the remote entries stay in force).
fn map_detail(map: &MapStatus) -> String {
    let entries = format!(
        "{} remote entries, {} node addresses, {} nodes",
        map.remote, map.remote_node, map.nodes
    );
    match map.link.state {
        MapState::Connected if map.complete => format!("endpoint map: connected; {entries}"),
        MapState::Connected => {
            format!("endpoint map: connected, waiting for the full map; {entries}")
        }
        MapState::Connecting | MapState::Disconnected => {
            let why = map
                .link
                .last_error
                .as_ref()
                .map_or_else(|| "not connected yet".to_owned(), ToString::to_string);
            format!(
                "endpoint map: {} ({why}); the remote entries stay in force: {entries}",
                map.link.state.label()
            )
        }
        MapState::Unsupported => {
            "endpoint map: the operator has none (an older operator); local-only".to_owned()
        }
        MapState::Disabled => "endpoint map: off (--no-endpoint-map); local-only".to_owned(),
    }
}

async fn endpoints(State(state): State<AdminState>) -> Response {
    let (tx, rx) = oneshot::channel();
    if state.queries.send(Query::Endpoints(tx)).await.is_err() {
        return unavailable("the agent is stopping");
    }
    let endpoints = match tokio::time::timeout(QUERY_TIMEOUT, rx).await {
        Ok(Ok(endpoints)) => endpoints.into_iter().map(endpoint_status).collect(),
        Ok(Err(_)) => return unavailable("the agent is stopping"),
        Err(_) => return unavailable("the agent's core did not answer in time"),
    };
    let pinned = pinned_services(state.maps.clone()).await;
    let core = state.status.borrow().clone();
    let datapath = datapath_status(&core, pinned);
    let sync = core.operator;
    Json(api::EndpointsResponse {
        node: state.node.clone(),
        operator: api::OperatorStatus {
            address: state.operator_address.clone(),
            connected: sync.connected,
            session: state.session.clone(),
            last_ack_seq: sync.last_ack_seq,
            error: if sync.connected {
                None
            } else {
                sync.last_error.map(|e| e.to_string())
            },
            extra: api::Extra::new(),
        },
        endpoints,
        source: Some(api::SourceStatus {
            source: state.source.clone(),
            synced: core.synced,
            error: core.source_error.map(|f| f.detail),
            extra: api::Extra::new(),
        }),
        datapath: Some(datapath),
        extra: api::Extra::new(),
    })
    .into_response()
}

/// Why SERVICES' ranges could not be read from the pins.
#[derive(Debug, thiserror::Error)]
enum PinnedError {
    #[error("reading SERVICES failed: {0}")]
    Read(#[source] crate::bpf::InspectError),
    #[error("reading SERVICES was interrupted")]
    Interrupted,
}

/// SERVICES' ranges per kind, read from the pins now; `None` without pinned
/// maps (an in-memory datapath), else the count or why it cannot be read.
async fn pinned_services(
    maps: Option<Arc<Inspector>>,
) -> Option<Result<ServiceCounts, PinnedError>> {
    let maps = maps?;
    let read = tokio::task::spawn_blocking(move || maps.services()).await;
    Some(match read {
        Ok(Ok(services)) => Ok(ServiceCounts::of_kinds(services.into_values())),
        Ok(Err(error)) => Err(PinnedError::Read(error)),
        Err(_) => Err(PinnedError::Interrupted),
    })
}

fn datapath_status(
    core: &Status,
    pinned: Option<Result<ServiceCounts, PinnedError>>,
) -> api::DatapathStatus {
    let (map, error) = match pinned {
        Some(Ok(map)) => (Some(map), None),
        Some(Err(error)) => (None, Some(error.to_string())),
        None => (
            None,
            Some("this agent has no pinned SERVICES map to read".to_owned()),
        ),
    };
    api::DatapathStatus {
        missing_hooks: core
            .missing_hooks
            .iter()
            .map(|hook| api::MissingHookStatus {
                hook: hook.hook.to_string(),
                error: hook.error.clone(),
                uncounted: hook.uncounted.to_owned(),
                extra: api::Extra::new(),
            })
            .collect(),
        services: api::ServicesStatus {
            operator: core.services,
            map,
            error,
            extra: api::Extra::new(),
        },
        extra: api::Extra::new(),
    }
}

async fn version() -> Json<api::VersionResponse> {
    Json(api::VersionResponse {
        agent_version: env!("CARGO_PKG_VERSION").to_owned(),
        protocol_version: census_proto::PROTOCOL_VERSION,
        layout_version: crate::bpf::LAYOUT_VERSION,
    })
}

async fn flows(State(state): State<AdminState>) -> Response {
    let Some(maps) = state.maps.clone() else {
        return unavailable("this agent has no pinned FLOWS map to read");
    };
    let read = tokio::task::spawn_blocking(move || maps.flows()).await;
    match read {
        Ok(Ok(flows)) => Json(api::FlowsResponse {
            node: state.node.clone(),
            flows: flows
                .into_iter()
                .map(|f| api::FlowEntry {
                    src_identity: f.src_identity,
                    dst_identity: f.dst_identity,
                    packets: f.packets,
                    bytes: f.bytes,
                })
                .collect(),
        })
        .into_response(),
        Ok(Err(error)) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("reading FLOWS failed: {error}\n"),
        )
            .into_response(),
        Err(_) => unavailable("reading FLOWS was interrupted"),
    }
}

async fn services(State(state): State<AdminState>) -> Response {
    let Some(maps) = state.maps.clone() else {
        return unavailable(
            "this agent has no pinned SERVICE_FLOWS4 and SERVICE_FLOWS6 maps to read",
        );
    };
    let names = state.status.borrow().service_names.clone();
    let read = tokio::task::spawn_blocking(move || maps.service_flows()).await;
    match read {
        Ok(Ok(flows)) => Json(api::ServicesResponse {
            node: state.node.clone(),
            flows: flows
                .into_iter()
                .map(|f| api::ServiceFlowEntry {
                    client_identity: f.client_identity,
                    address: f.service,
                    port: f.port,
                    protocol: protocol_name(f.protocol).into_owned(),
                    direction: f.direction.name().to_owned(),
                    service: names.get(&f.service).map(|s| s.key.to_string()),
                    packets: f.packets,
                    bytes: f.bytes,
                })
                .collect(),
            cluster_ips: names
                .iter()
                .map(|(address, service)| api::NamedClusterIp {
                    address: *address,
                    service: service.key.to_string(),
                    ports: service
                        .ports
                        .iter()
                        .map(|p| format!("{}/{}", p.port, protocol_name(p.protocol)))
                        .collect(),
                })
                .collect(),
        })
        .into_response(),
        Ok(Err(error)) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("reading SERVICE_FLOWS4/6 failed: {error}\n"),
        )
            .into_response(),
        Err(_) => unavailable("reading SERVICE_FLOWS4/6 was interrupted"),
    }
}

/// One endpoint as the JSON API shows it.
fn endpoint_status(view: EndpointView) -> api::EndpointStatus {
    let EndpointView {
        key,
        ips,
        interface,
        identity,
        labels,
        state,
        problem,
    } = view;
    api::EndpointStatus {
        namespace: key.namespace().to_owned(),
        name: key.name().to_owned(),
        ips: ips.iter().map(ToString::to_string).collect(),
        interface: interface.unwrap_or_default(),
        identity: identity.map(|id| id.get()),
        labels: labels.map(|l| l.to_strings()).unwrap_or_default(),
        state: match state {
            EndpointState::Programmed => api::EndpointState::Programmed,
            EndpointState::WaitingForIdentity => api::EndpointState::WaitingForIdentity,
            EndpointState::Error => api::EndpointState::Error,
        },
        error: problem.map(|p| p.to_string()),
        extra: api::Extra::new(),
    }
}

fn unavailable(why: &str) -> Response {
    (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")).into_response()
}

#[cfg(test)]
mod marks_tests {
    #[test]
    fn lost_marks_are_said_in_readyz_only_when_there_are_some() {
        assert_eq!(super::marks_lost_detail(0), None);
        let line = super::marks_lost_detail(2945).unwrap_or_default();
        assert!(
            line.starts_with("datapath: 2945 packets to Service addresses"),
            "{line}"
        );
        assert!(
            line.contains("census_agent_marks_lost") && line.contains("CONNMARK"),
            "{line}"
        );
    }
}
