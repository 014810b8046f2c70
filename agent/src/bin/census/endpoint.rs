//! `census endpoint list`: the endpoints the local agent manages, from its admin port
//! (`GET /v1/endpoints`). `census endpoint map <ip>`: the operator's view of one
//! address of the cluster-wide endpoint map (EndpointMap.Lookup): every claim, the
//! one that wins, and its conflicts.

use std::time::SystemTime;

use census_agent::admin::api::{
    DatapathStatus, EndpointState, EndpointsResponse, OperatorStatus, ServiceCounts, SourceStatus,
};
use census_proto::pb;
use clap::Subcommand;
use serde::Serialize;

use super::{
    Ctx,
    args::parse_ip,
    error::CliError,
    operator::IdentityLabels,
    output::{Table, ago, nonzero},
};

#[derive(Debug, Subcommand)]
pub(crate) enum EndpointCommand {
    /// Every endpoint on this node: addresses, interface, identity, labels, state.
    List,
    /// One address in the operator's cluster-wide endpoint map: the endpoints and
    /// nodes claiming it, the winner, and the conflicts seen for it.
    Map {
        /// An IPv4 or IPv6 address.
        ip: String,
    },
}

pub(crate) async fn run(command: EndpointCommand, ctx: &mut Ctx) -> Result<String, CliError> {
    let ip = match command {
        EndpointCommand::List => return list(ctx).await,
        EndpointCommand::Map { ip } => parse_ip(&ip)?,
    };
    let operator = ctx.operator().await?;
    let Some(found) = operator.map_lookup(ip).await? else {
        return Err(CliError::UnmappedAddress {
            ip,
            addr: operator.addr().clone(),
        });
    };
    let view = MapView::from(found);
    let labels = ctx.labels(view.claims.iter().map(|c| c.identity)).await;
    ctx.render(&view, || map_table(&view, &labels, ctx.now))
}

/// One claim of an address, as `-o json` prints it (docs/cli.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct ClaimView {
    pub(crate) node: String,
    /// `endpoint`, or `node_address` for one of the node's own addresses.
    pub(crate) kind: &'static str,
    /// The endpoint's namespace and name (none for a node address, or an endpoint
    /// the operator no longer names).
    pub(crate) namespace: Option<String>,
    pub(crate) name: Option<String>,
    pub(crate) identity: u32,
    pub(crate) claimed_at_ms: Option<u64>,
    pub(crate) winner: bool,
}

/// A conflict: the claim that won the address, and the one it displaced.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct ConflictView {
    pub(crate) at_ms: u64,
    pub(crate) won: Option<ClaimView>,
    pub(crate) displaced: Option<ClaimView>,
}

/// `census endpoint map <ip> -o json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct MapView {
    pub(crate) ip: String,
    /// The winner first, then the other claims, most recent first.
    pub(crate) claims: Vec<ClaimView>,
    /// Conflicts counted for the address.
    pub(crate) conflicts: u64,
    /// The most recent conflicts, most recent first.
    pub(crate) history: Vec<ConflictView>,
}

fn claim_view(claim: pb::EndpointClaim) -> ClaimView {
    let pb::EndpointClaim {
        node,
        namespace,
        name,
        identity,
        claimed_at_ms,
        winner,
    } = claim;
    let some = |s: String| (!s.is_empty()).then_some(s);
    ClaimView {
        kind: if namespace.is_empty() && identity == 6 {
            "node_address"
        } else {
            "endpoint"
        },
        node,
        namespace: some(namespace),
        name: some(name),
        identity,
        claimed_at_ms: nonzero(claimed_at_ms),
        winner,
    }
}

impl From<pb::EndpointMapLookupResponse> for MapView {
    fn from(found: pb::EndpointMapLookupResponse) -> Self {
        let pb::EndpointMapLookupResponse {
            ip,
            claims,
            conflicts,
            history,
        } = found;
        Self {
            ip,
            claims: claims.into_iter().map(claim_view).collect(),
            conflicts,
            history: history
                .into_iter()
                .map(|c| ConflictView {
                    at_ms: c.at_ms,
                    won: c.won.map(claim_view),
                    displaced: c.displaced.map(claim_view),
                })
                .collect(),
        }
    }
}

/// `shop/web-0`, `node address`, or `-`.
fn claimant(claim: &ClaimView) -> String {
    match (&claim.namespace, &claim.name) {
        (Some(ns), Some(name)) => format!("{ns}/{name}"),
        _ if claim.kind == "node_address" => "node address".to_owned(),
        _ => "-".to_owned(),
    }
}

fn map_table(view: &MapView, labels: &IdentityLabels, now: SystemTime) -> Table {
    let mut header = vec!["WINNER", "NODE", "CLAIMANT", "IDENTITY", "CLAIMED"];
    if labels.shown() {
        header.push("LABELS");
    }
    let mut table = Table::new(header);
    table.preamble(format!(
        "{}: {} claim{}, {} conflict{}",
        view.ip,
        view.claims.len(),
        if view.claims.len() == 1 { "" } else { "s" },
        view.conflicts,
        if view.conflicts == 1 { "" } else { "s" },
    ));
    for conflict in &view.history {
        let side = |c: &Option<ClaimView>| {
            c.as_ref().map_or_else(
                || "?".to_owned(),
                |c| format!("{} on {} (identity {})", claimant(c), c.node, c.identity),
            )
        };
        table.preamble(format!(
            "conflict {}: {} took it from {}",
            ago(now, conflict.at_ms),
            side(&conflict.won),
            side(&conflict.displaced)
        ));
    }
    for claim in &view.claims {
        let mut row = vec![
            if claim.winner { "*" } else { "" }.to_owned(),
            claim.node.clone(),
            claimant(claim),
            claim.identity.to_string(),
            ago(now, claim.claimed_at_ms.unwrap_or(0)),
        ];
        if labels.shown() {
            row.push(labels.cell(claim.identity));
        }
        table.row(row);
    }
    table
}

async fn list(ctx: &mut Ctx) -> Result<String, CliError> {
    let mut answer = ctx.agent().endpoints().await?;
    answer
        .endpoints
        .sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    ctx.render(&answer, || table(&answer))
}

fn link_line(node: &str, link: &OperatorStatus) -> String {
    let OperatorStatus {
        address,
        connected,
        session,
        last_ack_seq,
        error,
        extra: _,
    } = link;
    let mut line = format!(
        "node {node}, operator {address} {}, session {session}, last ack seq {last_ack_seq}",
        if *connected {
            "connected"
        } else {
            "disconnected"
        }
    );
    if let Some(error) = error {
        line.push_str(&format!(" ({error})"));
    }
    line
}

fn source_line(source: &SourceStatus) -> String {
    let SourceStatus {
        source,
        synced,
        error,
        extra: _,
    } = source;
    let mut line = format!(
        "endpoints from {source}, {}",
        if *synced { "synced" } else { "not synced yet" }
    );
    if let Some(error) = error {
        line.push_str(&format!(", last read failed: {error}"));
    }
    line
}

/// The datapath's lines: each hook of the node that is missing, then the
/// Service ranges the operator sent and those SERVICES holds.
fn datapath_lines(datapath: &DatapathStatus) -> Vec<String> {
    let DatapathStatus {
        missing_hooks,
        services,
        extra: _,
    } = datapath;
    let mut lines: Vec<String> = missing_hooks
        .iter()
        .map(|hook| {
            format!(
                "datapath: {} is not attached ({}): {}",
                hook.hook, hook.error, hook.uncounted
            )
        })
        .collect();
    let ranges = |c: &ServiceCounts| {
        format!(
            "{} cluster-ip-range, {} load-balancer-ip, {} external-ip",
            c.cluster_ip_range, c.load_balancer_ip, c.external_ip
        )
    };
    let operator = services.operator.as_ref().map_or_else(
        || "the operator has sent none yet".to_owned(),
        |c| format!("the operator sent {}", ranges(c)),
    );
    let map = match (&services.map, &services.error) {
        (Some(c), _) => format!("SERVICES holds {}", ranges(c)),
        (None, Some(error)) => format!("SERVICES unread: {error}"),
        (None, None) => "SERVICES unread".to_owned(),
    };
    lines.push(format!("service ranges: {operator}; {map}"));
    lines
}

/// `unknown`: a state of a newer agent than this `census`.
fn state_name(state: EndpointState) -> &'static str {
    match state {
        EndpointState::Programmed => "programmed",
        EndpointState::WaitingForIdentity => "waiting for identity",
        EndpointState::Error => "error",
        EndpointState::Unknown => "unknown",
    }
}

fn table(answer: &EndpointsResponse) -> Table {
    let mut table = Table::new([
        "NAMESPACE",
        "NAME",
        "IPS",
        "INTERFACE",
        "IDENTITY",
        "STATE",
        "LABELS",
    ]);
    table.preamble(link_line(&answer.node, &answer.operator));
    if let Some(source) = &answer.source {
        table.preamble(source_line(source));
    }
    for line in answer.datapath.iter().flat_map(datapath_lines) {
        table.preamble(line);
    }
    for endpoint in &answer.endpoints {
        let mut state = state_name(endpoint.state).to_owned();
        if let Some(error) = &endpoint.error {
            state.push_str(": ");
            state.push_str(error);
        }
        table.row(vec![
            endpoint.namespace.clone(),
            endpoint.name.clone(),
            endpoint.ips.join(","),
            if endpoint.interface.is_empty() {
                "-".to_owned()
            } else {
                endpoint.interface.clone()
            },
            endpoint
                .identity
                .map_or_else(|| "-".to_owned(), |id| id.to_string()),
            state,
            endpoint.labels.join(","),
        ]);
    }
    table
}

#[cfg(test)]
mod tests {
    use census_agent::admin::api::Extra;

    use super::*;
    use crate::output::{Format, from_millis, render};

    fn lookup_fixture() -> MapView {
        let claim = |node: &str, ns: &str, name: &str, identity, at, winner| pb::EndpointClaim {
            node: node.into(),
            namespace: ns.into(),
            name: name.into(),
            identity,
            claimed_at_ms: at,
            winner,
        };
        MapView::from(pb::EndpointMapLookupResponse {
            ip: "198.18.0.2".into(),
            claims: vec![
                claim("node-b", "shop", "db-0", 257, 88_000, true),
                claim("node-a", "shop", "web-0", 256, 40_000, false),
            ],
            conflicts: 1,
            history: vec![pb::EndpointConflict {
                at_ms: 88_000,
                won: Some(claim("node-b", "shop", "db-0", 257, 0, true)),
                displaced: Some(claim("node-a", "", "", 256, 0, false)),
            }],
        })
    }

    #[test]
    fn a_map_lookup_shows_the_claims_winner_first_and_the_conflicts()
    -> Result<(), Box<dyn std::error::Error>> {
        let view = lookup_fixture();
        let labels = IdentityLabels::fixed(&[(256, &["k8s:app=web"]), (257, &["k8s:app=db"])]);
        let now = from_millis(100_000);
        let out = render(Format::Table, false, &view, || {
            map_table(&view, &labels, now)
        })?;
        assert_eq!(
            out,
            "\
198.18.0.2: 2 claims, 1 conflict
conflict 12s ago: shop/db-0 on node-b (identity 257) took it from - on node-a (identity 256)
WINNER  NODE    CLAIMANT    IDENTITY  CLAIMED   LABELS
*       node-b  shop/db-0   257       12s ago   k8s:app=db
        node-a  shop/web-0  256       1m0s ago  k8s:app=web
"
        );
        let json: serde_json::Value =
            serde_json::from_str(&render(Format::Json, false, &view, || unreachable!())?)?;
        assert_eq!(json["claims"][0]["winner"], true);
        assert_eq!(json["claims"][0]["kind"], "endpoint");
        assert_eq!(json["claims"][1]["name"], "web-0");
        assert_eq!(
            json["history"][0]["displaced"]["namespace"],
            serde_json::Value::Null
        );
        assert_eq!(json["conflicts"], 1);
        Ok(())
    }

    #[test]
    fn a_node_address_is_named_as_such() {
        let view = MapView::from(pb::EndpointMapLookupResponse {
            ip: "10.0.0.7".into(),
            claims: vec![pb::EndpointClaim {
                node: "node-a".into(),
                identity: 6,
                winner: true,
                ..pb::EndpointClaim::default()
            }],
            ..pb::EndpointMapLookupResponse::default()
        });
        assert_eq!(view.claims[0].kind, "node_address");
        assert_eq!(claimant(&view.claims[0]), "node address");
    }

    /// What the agent's `GET /v1/endpoints` answers (docs/cli.md).
    const AGENT_JSON: &str = r#"{
  "node": "n1",
  "operator": {"address": "http://10.0.0.1:9460", "connected": true, "session": "1700000000000000000-0000000000000007", "last_ack_seq": 12, "error": null},
  "source": {"source": "file /etc/census/endpoints.yaml", "synced": true, "error": "line 3: bad label", "checked_ms": 17},
  "datapath": {"missing_hooks": [{"hook": "uplink vxlan0", "error": "interface vxlan0 does not exist in this network namespace", "uncounted": "Service requests leaving the node by it go uncounted"}],
               "services": {"operator": {"cluster_ip_range": 2, "load_balancer_ip": 1, "external_ip": 0}, "map": {"cluster_ip_range": 2, "load_balancer_ip": 0, "external_ip": 0}, "error": null}},
  "endpoints": [
    {"namespace": "shop", "name": "web-0", "ips": ["198.18.0.2", "2001:db8::2"], "interface": "lxc1", "identity": 256,
     "labels": ["k8s:app=web", "k8s:io.kubernetes.pod.namespace=shop"], "state": "programmed", "error": null},
    {"namespace": "shop", "name": "db-0", "ips": ["198.18.0.3"], "interface": "lxc2", "identity": null,
     "labels": ["k8s:app=db"], "state": "waiting_for_identity", "error": null},
    {"namespace": "kube-system", "name": "dns", "ips": ["198.18.0.4"], "interface": "", "identity": 300,
     "labels": [], "state": "error", "error": "interface not found"}
  ]
}"#;

    fn fixture() -> Result<EndpointsResponse, serde_json::Error> {
        let mut answer: EndpointsResponse = serde_json::from_str(AGENT_JSON)?;
        answer
            .endpoints
            .sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        Ok(answer)
    }

    #[test]
    fn table_with_the_operator_link() -> Result<(), Box<dyn std::error::Error>> {
        let answer = fixture()?;
        let out = render(Format::Table, false, &answer, || table(&answer))?;
        assert_eq!(
            out,
            "\
node n1, operator http://10.0.0.1:9460 connected, session 1700000000000000000-0000000000000007, last ack seq 12
endpoints from file /etc/census/endpoints.yaml, synced, last read failed: line 3: bad label
datapath: uplink vxlan0 is not attached (interface vxlan0 does not exist in this network namespace): Service requests leaving the node by it go uncounted
service ranges: the operator sent 2 cluster-ip-range, 1 load-balancer-ip, 0 external-ip; SERVICES holds 2 cluster-ip-range, 0 load-balancer-ip, 0 external-ip
NAMESPACE    NAME   IPS                     INTERFACE  IDENTITY  STATE                       LABELS
kube-system  dns    198.18.0.4              -          300       error: interface not found
shop         db-0   198.18.0.3              lxc2       -         waiting for identity        k8s:app=db
shop         web-0  198.18.0.2,2001:db8::2  lxc1       256       programmed                  k8s:app=web,k8s:io.kubernetes.pod.namespace=shop
"
        );
        let out = render(Format::Table, true, &answer, || table(&answer))?;
        assert!(out.starts_with("kube-system  dns"), "{out}");
        Ok(())
    }

    #[test]
    fn json_is_the_agents_shape() -> Result<(), Box<dyn std::error::Error>> {
        let answer = fixture()?;
        let json = render(Format::Json, false, &answer, || unreachable!())?;
        let reparsed: serde_json::Value = serde_json::from_str(&json)?;
        let original: serde_json::Value = serde_json::from_str(AGENT_JSON)?;
        assert_eq!(reparsed["node"], original["node"]);
        assert_eq!(reparsed["operator"], original["operator"]);
        assert_eq!(
            reparsed["source"], original["source"],
            "unknown fields are kept"
        );
        assert_eq!(reparsed["datapath"], original["datapath"]);
        assert_eq!(
            reparsed["datapath"]["services"]["operator"]["cluster_ip_range"],
            2
        );
        assert_eq!(reparsed["endpoints"][2], original["endpoints"][0]);
        assert_eq!(reparsed["endpoints"][0], original["endpoints"][2]);
        let yaml = render(Format::Yaml, false, &answer.operator, || unreachable!())?;
        assert_eq!(
            yaml,
            "\
address: http://10.0.0.1:9460
connected: true
session: 1700000000000000000-0000000000000007
last_ack_seq: 12
error: null
"
        );
        Ok(())
    }
    #[test]
    fn a_newer_agents_answer() -> Result<(), Box<dyn std::error::Error>> {
        let mut newer: serde_json::Value = serde_json::from_str(AGENT_JSON)?;
        newer["endpoints"][0]["state"] = "draining".into();
        newer["endpoints"][0]["weight"] = 3.into();
        let answer: EndpointsResponse = serde_json::from_value(newer)?;
        let out = render(Format::Table, false, &answer, || table(&answer))?;
        let row = "shop         web-0  198.18.0.2,2001:db8::2  lxc1       256       \
                   unknown                     k8s:app=web,k8s:io.kubernetes.pod.namespace=shop";
        assert!(out.lines().any(|line| line == row), "{out}");
        let json: serde_json::Value =
            serde_json::from_str(&render(Format::Json, false, &answer, || unreachable!())?)?;
        assert_eq!(json["endpoints"][0]["weight"], 3, "what it adds is kept");
        assert_eq!(
            answer.endpoints[0].extra,
            Extra::from([("weight".to_owned(), 3.into())])
        );
        Ok(())
    }
}
