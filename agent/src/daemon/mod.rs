//! Assembles the agent: the endpoint source, the core (endpoints, identities and
//! reconcile against the datapath), the allocation client, the EndpointSync client
//! and the admin server; and stops it.
//!
//! Stopping never touches the datapath: maps, links and counters stay as they are
//! for the next agent to adopt (fail-static across restarts). `census-agent
//! uninstall` is the only way they go.

use std::{
    collections::BTreeSet,
    net::{IpAddr, SocketAddr},
    sync::Arc,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use census_proto::{
    domain::{NodeName, SessionId},
    labels::LabelFilter,
};
use parking_lot::Mutex;
use prometheus_client::registry::Registry;
use tokio::{
    net::TcpListener,
    sync::{mpsc, watch},
    task::JoinHandle,
};
use tonic::transport::{Channel, Endpoint};
use tracing::{Instrument as _, debug, error, info, info_span, warn};

use crate::{
    admin::{self, AdminState, CoreStatus, Query},
    bpf::{self, Inspector},
    endpoints::{Effects, Endpoints},
    host::HostIps,
    identities::{AllocationEvent, IdentityClient},
    metrics::{AgentCollector, Gauges, KindLabels, Metrics},
    reconcile::{DatapathPort, Reconciler},
    shutdown::stopped,
    source::{EndpointSource, SourceEvent},
    sync::{SyncClient, SyncEvent, SyncStatus},
};

/// How the agent runs (the command line, resolved).
#[derive(Debug, Clone)]
pub struct Options {
    pub node: NodeName,
    /// The operator's gRPC URI (`http://host:port`).
    pub operator: String,
    pub admin_listen: SocketAddr,
    pub reconcile_interval: Duration,
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    pub session: SessionId,
    pub host_ips: HostIps,
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("operator address {address:?}: {source}")]
    Operator {
        address: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("cannot listen on {addr} (admin): {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("reading ENDPOINTS at start failed: {0}")]
    ReadMaps(#[source] bpf::Error),
}

/// A new session: this process's start time in ns and a random nonce.
pub fn new_session() -> SessionId {
    let start_time_ns = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    SessionId {
        start_time_ns,
        nonce: rand::random(),
    }
}

/// A running agent.
#[derive(Debug)]
pub struct Running {
    pub admin_addr: SocketAddr,
    pub sync_status: Arc<Mutex<SyncStatus>>,
    pub core_status: Arc<Mutex<CoreStatus>>,
    queries: mpsc::Sender<Query>,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Running {
    /// The endpoints as the core sees them now.
    pub async fn endpoints(&self) -> Option<Vec<admin::api::EndpointStatus>> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.queries.send(Query::Endpoints(tx)).await.ok()?;
        rx.await.ok()
    }

    /// Stops every task; the datapath stays as it is.
    pub async fn shut_down(self) {
        let _ = self.shutdown.send(true);
        for task in self.tasks {
            let _ = task.await;
        }
        info!("stopped; the datapath stays in place");
    }
}

/// Starts the agent on `maps` (the loaded [`bpf::Datapath`] in production), with
/// `pinned` for reading FLOWS at scrape time, and endpoints from `source`.
pub async fn start<M>(
    options: Options,
    maps: M,
    pinned: Option<Inspector>,
    source: Box<dyn EndpointSource>,
) -> Result<Running, StartError>
where
    M: DatapathPort + Send + 'static,
{
    let Options {
        node,
        operator,
        admin_listen,
        reconcile_interval,
        initial_backoff,
        max_backoff,
        session,
        host_ips,
    } = options;
    let channel = operator_channel(&operator)?;
    let found = maps.read_endpoints().map_err(StartError::ReadMaps)?;
    info!(%node, %session, operator, entries = found.len(), "starting");

    let metrics = Metrics::default();
    let gauges = Arc::new(Mutex::new(Gauges::default()));
    let sync_status = Arc::new(Mutex::new(SyncStatus::default()));
    let core_status = Arc::new(Mutex::new(CoreStatus::default()));
    let pinned = pinned.map(Arc::new);
    let mut registry = Registry::default();
    metrics.register(&mut registry);
    registry.register_collector(Box::new(AgentCollector::new(
        gauges.clone(),
        sync_status.clone(),
        pinned.clone(),
    )));
    registry.register_collector(Box::new(census_daemon::ProcessCollector::new()));

    let (shutdown, stop) = watch::channel(false);
    let (source_tx, source_rx) = mpsc::channel(64);
    let (alloc_tx, alloc_rx) = mpsc::channel(1024);
    let (sync_tx, sync_rx) = mpsc::channel(1024);
    let (reports_tx, reports_rx) = mpsc::unbounded_channel();
    let (ready_tx, ready_rx) = watch::channel(false);
    let (query_tx, query_rx) = mpsc::channel(16);
    let (connected_tx, connected_rx) = watch::channel(false);

    let listener = TcpListener::bind(admin_listen)
        .await
        .map_err(|source| StartError::Listen {
            addr: admin_listen,
            source,
        })?;
    let admin_addr = listener.local_addr().map_err(|source| StartError::Listen {
        addr: admin_listen,
        source,
    })?;

    let description = source.describe();
    let source_filter = source.label_filter();
    let mut tasks = Vec::new();
    tasks.push(tokio::spawn(source.run(source_tx, stop.clone())));

    let sync = SyncClient {
        channel: channel.clone(),
        node: node.clone(),
        session,
        initial_backoff,
        max_backoff,
        metrics: metrics.clone(),
        status: sync_status.clone(),
        connected: connected_tx,
    };
    tasks.push(tokio::spawn(sync.run(
        reports_rx,
        sync_tx,
        ready_rx,
        stop.clone(),
    )));

    let core = Core {
        endpoints: Endpoints::new(&found),
        reconciler: Reconciler::new(metrics.clone()),
        maps,
        identities: IdentityClient::new(
            channel,
            node.clone(),
            session,
            alloc_tx,
            connected_rx,
            max_backoff,
            metrics.clone(),
        ),
        reports: reports_tx,
        source_filter,
        ready: ready_tx,
        metrics,
        gauges,
        status: core_status.clone(),
        host_ips,
        reconcile_interval,
    };
    let span = info_span!("core", %node, %session);
    tasks.push(tokio::spawn(
        core.run(source_rx, alloc_rx, sync_rx, query_rx, stop.clone())
            .instrument(span),
    ));

    let router = admin::router(AdminState {
        registry: Arc::new(registry),
        node: node.to_string(),
        operator_address: operator,
        session: session.to_string(),
        source: description,
        sync: sync_status.clone(),
        core: core_status.clone(),
        queries: query_tx.clone(),
        maps: pinned,
    });
    let admin_stop = stop.clone();
    tasks.push(tokio::spawn(async move {
        if let Err(e) = admin::serve(listener, router, admin_stop).await {
            error!(error = %e, "the admin server failed");
        }
    }));
    info!(%admin_addr, "admin server listening");
    Ok(Running {
        admin_addr,
        sync_status,
        core_status,
        queries: query_tx,
        shutdown,
        tasks,
    })
}

/// A lazily connected channel to the operator: calls fail fast while it is away,
/// and it reconnects by itself.
fn operator_channel(address: &str) -> Result<Channel, StartError> {
    let endpoint =
        Endpoint::from_shared(address.to_owned()).map_err(|source| StartError::Operator {
            address: address.to_owned(),
            source,
        })?;
    Ok(endpoint
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(10))
        .keep_alive_while_idle(true)
        .connect_lazy())
}

/// What woke the core.
enum Step {
    Source(Option<SourceEvent>),
    Allocation(AllocationEvent),
    Sync(SyncEvent),
    Query(Query),
    Tick,
}

struct Core<M> {
    endpoints: Endpoints,
    reconciler: Reconciler,
    maps: M,
    identities: IdentityClient,
    reports: mpsc::UnboundedSender<crate::sync::Report>,
    /// The source's copy of the operator's label filter, if it filters labels itself.
    source_filter: Option<watch::Sender<LabelFilter>>,
    ready: watch::Sender<bool>,
    metrics: Metrics,
    gauges: Arc<Mutex<Gauges>>,
    status: Arc<Mutex<CoreStatus>>,
    host_ips: HostIps,
    reconcile_interval: Duration,
}

impl<M: DatapathPort> Core<M> {
    async fn run(
        mut self,
        mut source: mpsc::Receiver<SourceEvent>,
        mut allocations: mpsc::Receiver<AllocationEvent>,
        mut sync: mpsc::Receiver<SyncEvent>,
        mut queries: mpsc::Receiver<Query>,
        mut stop: watch::Receiver<bool>,
    ) {
        let mut tick = tokio::time::interval(self.reconcile_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let mut fx = Effects::default();
            let was_synced = self.endpoints.synced();
            let step = tokio::select! {
                event = source.recv() => Step::Source(event),
                Some(event) = allocations.recv() => Step::Allocation(event),
                Some(event) = sync.recv() => Step::Sync(event),
                Some(query) = queries.recv() => Step::Query(query),
                _ = tick.tick() => Step::Tick,
                () = stopped(&mut stop) => return,
            };
            match step {
                Step::Source(Some(event)) => self.on_source(event, &mut fx),
                Step::Source(None) => {
                    warn!("the endpoint source stopped; the last set stays in force");
                    stopped(&mut stop).await;
                    return;
                }
                Step::Allocation(AllocationEvent::Allocated { labels, id }) => {
                    debug!(%labels, %id, "identity allocated");
                    self.endpoints.allocated(&labels, id, &mut fx);
                }
                Step::Allocation(AllocationEvent::Retrying {
                    labels,
                    error,
                    refused,
                }) => self.endpoints.allocation_failed(&labels, &error, refused),
                Step::Sync(SyncEvent::Settings(settings)) => {
                    if let Some(filter) = &self.source_filter {
                        filter.send_if_modified(|f| {
                            let changed = *f != settings.filter;
                            if changed {
                                f.clone_from(&settings.filter);
                            }
                            changed
                        });
                    }
                    self.endpoints.set_settings(settings, &mut fx);
                }
                Step::Sync(SyncEvent::Rebind { key, id }) => {
                    if !self.endpoints.rebind(&key, id, &mut fx) {
                        debug!(endpoint = %key, "Rebind for an endpoint this agent does not hold");
                    }
                }
                Step::Sync(SyncEvent::Verdict(verdict)) => self.endpoints.on_verdict(verdict),
                Step::Query(Query::Endpoints(reply)) => {
                    let _ = reply.send(self.endpoints.view());
                }
                Step::Tick => self.full_pass(),
            }
            self.apply(fx);
            if !was_synced && self.endpoints.synced() {
                // The first full set: what it does not list can go now.
                self.full_pass();
                let _ = self.ready.send(true);
                info!(
                    endpoints = self.endpoints.len(),
                    "the first full set of endpoints is in place"
                );
            }
            self.publish();
        }
    }

    fn on_source(&mut self, event: SourceEvent, fx: &mut Effects) {
        if let SourceEvent::Failed(failure) = &event {
            self.metrics
                .source_errors
                .get_or_create(&KindLabels { kind: failure.kind })
                .inc();
        }
        self.endpoints.on_source(event, fx);
    }

    fn apply(&mut self, fx: Effects) {
        let Effects {
            allocations,
            reports,
            ips,
            interfaces,
        } = fx;
        for request in allocations {
            self.identities.spawn(request);
        }
        for report in reports {
            // The sync task lives as long as this one.
            let _ = self.reports.send(report);
        }
        let prune = self.endpoints.synced();
        if !ips.is_empty() {
            let endpoints = &self.endpoints;
            let failures = self.reconciler.apply_ips(
                &mut self.maps,
                ips.iter().copied(),
                |ip| endpoints.desired(ip),
                prune,
            );
            for (ip, error) in &failures {
                warn!(%ip, %error, "writing ENDPOINTS failed; the full pass retries");
            }
            self.endpoints.record_entry_results(&ips, &failures);
        }
        if !interfaces.is_empty() {
            let endpoints = &self.endpoints;
            let identities = endpoints.interface_identities();
            let failures = self.reconciler.apply_interfaces(
                &mut self.maps,
                interfaces.iter().cloned(),
                |i| endpoints.interface_wanted(i),
                |i| identities.get(i).copied(),
                prune,
            );
            for (interface, error) in &failures {
                warn!(interface, %error, "attaching the classifier or writing its INTERFACES entry failed; the full pass retries");
            }
            self.endpoints
                .record_interface_results(&interfaces, &failures);
        }
    }

    fn full_pass(&mut self) {
        let started = Instant::now();
        match self.host_ips.read() {
            Ok(ips) => {
                // The pass below writes every entry these effects would name.
                let mut fx = Effects::default();
                self.endpoints.set_host_ips(ips, &mut fx);
            }
            Err(error) => warn!(%error, "cannot read the node's addresses"),
        }
        let desired = self.endpoints.desired_all();
        let prune = self.endpoints.synced();
        let report = self.reconciler.full_pass(&mut self.maps, &desired, prune);
        let all_ips: BTreeSet<IpAddr> = desired.entries.keys().copied().collect();
        self.endpoints
            .record_entry_results(&all_ips, &report.entry_errors);
        self.endpoints
            .record_interface_results(&desired.interfaces, &report.interface_errors);
        let took = started.elapsed();
        self.metrics.full_pass_duration.observe(took.as_secs_f64());
        if report.repaired + report.removed + report.pruned > 0 {
            info!(
                repaired = report.repaired,
                removed = report.removed,
                pruned_links = report.pruned,
                "full pass repaired the datapath"
            );
        }
        debug!(
            ?took,
            entries = desired.entries.len(),
            written = report.written,
            "full pass"
        );
        // A full pass re-reads the endpoints file too (the source's own timer).
    }

    fn publish(&self) {
        let (programmed, waiting, errors) = self.endpoints.counts();
        let cache = self.endpoints.cache();
        *self.gauges.lock() = Gauges {
            endpoints_programmed: programmed,
            endpoints_waiting: waiting,
            endpoints_error: errors,
            map_entries: self.reconciler.entries() as u64,
            identities: cache.len() as u64,
            pending_allocations: cache.pending() as u64,
            interfaces: self.endpoints.desired_interfaces() as u64,
            interfaces_by_address: self.reconciler.crowded_interfaces() as u64,
        };
        *self.status.lock() = CoreStatus {
            synced: self.endpoints.synced(),
            source_error: self.endpoints.source_error().map(|f| f.detail.clone()),
            programmed,
            waiting,
            errors,
        };
    }
}

#[cfg(test)]
mod tests;
