//! The JSON the agent's admin port serves, for scripts and for the `census` CLI, which
//! reads its answers into these same types.
//!
//! Fields are only ever added, and a reader of another release copes with both sides
//! of that:
//! - a field that may be absent (one added after the first release, and every
//!   nullable one) is `#[serde(default)]`, so an older agent's answer still reads;
//! - the objects `census endpoint list -o json` prints keep the fields of a newer
//!   agent that this build does not know ([`Extra`]) and write them back as they
//!   came; a `state` this build does not know reads as [`EndpointState::Unknown`].
//!
//! A field every agent has sent since the first release (`session`, `last_ack_seq`,
//! `interface`, ...) stays required, in the type it has on the agent: an answer
//! without it is not a census agent's, and a reader must not print a default it
//! made up as the agent's.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub const ENDPOINTS_PATH: &str = "/v1/endpoints";
pub const VERSION_PATH: &str = "/v1/version";
pub const FLOWS_PATH: &str = "/v1/flows";
pub const SERVICES_PATH: &str = "/v1/services";

/// The fields of a newer agent that this build does not know, by name, written back
/// after the known ones; empty (and writing nothing) on the agent itself. Never a
/// known field's name.
pub type Extra = BTreeMap<String, serde_json::Value>;

/// `GET /v1/endpoints`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointsResponse {
    pub node: String,
    pub operator: OperatorStatus,
    /// Sorted by namespace, then name.
    pub endpoints: Vec<EndpointStatus>,
    /// Where the endpoints come from, and whether its last read failed.
    #[serde(default)]
    pub source: Option<SourceStatus>,
    /// The node's hooks and the cluster's Service addresses (`null` from an
    /// agent before layout 5).
    #[serde(default)]
    pub datapath: Option<DatapathStatus>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// The datapath beyond the endpoints' entries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatapathStatus {
    /// The node's own hooks (an uplink's, the node's sockets') that the last full
    /// pass could not attach; empty when every one is in place.
    #[serde(default)]
    pub missing_hooks: Vec<MissingHookStatus>,
    pub services: ServicesStatus,
    #[serde(flatten)]
    pub extra: Extra,
}

/// A hook of the node that is not attached.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MissingHookStatus {
    /// `uplink eth0`, `uplinks` (none could be listed), `sockets /sys/fs/cgroup`.
    pub hook: String,
    /// Why the last full pass could not attach it.
    pub error: String,
    /// What goes uncounted meanwhile.
    pub uncounted: String,
    #[serde(flatten)]
    pub extra: Extra,
}

/// The cluster's Service addresses: what the operator last sent and what the
/// SERVICES map holds, as ranges per kind. They differ for a moment after a
/// change, and while SERVICES cannot be written (the agent's log says why).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServicesStatus {
    /// The operator's last set; `null` until one came (SERVICES keeps what a
    /// previous run wrote until then).
    #[serde(default)]
    pub operator: Option<ServiceCounts>,
    /// What SERVICES holds; `null` if it could not be read (`error` says why).
    #[serde(default)]
    pub map: Option<ServiceCounts>,
    #[serde(default)]
    pub error: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// Ranges per kind.
pub use crate::agent_core::ServiceCounts;

/// The EndpointSync stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OperatorStatus {
    /// The operator's gRPC address, as configured.
    pub address: String,
    pub connected: bool,
    /// This agent's session, `<start time ns>-<nonce, 16 hex digits>`: it has one
    /// from its start, connected or not.
    pub session: String,
    /// The highest seq the operator acknowledged, 0 before the first.
    pub last_ack_seq: u64,
    /// Why the stream last ended or could not start; `null` while connected.
    #[serde(default)]
    pub error: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// Where endpoints come from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceStatus {
    /// `file /path/to/endpoints.yaml`, `kubernetes`.
    pub source: String,
    /// Whether the first full set has been read.
    pub synced: bool,
    /// The last read's failure (the last good set stays in force); `null` if it succeeded.
    #[serde(default)]
    pub error: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// One endpoint the agent manages.
///
/// `interface` is the host-side interface census counts on, empty when the endpoint
/// has none (its `state` is then `error`, and `error` says why). `identity` is the
/// identity written to ENDPOINTS for the endpoint's addresses, `null` while it has
/// none. While `state` is `waiting_for_identity` it is `null`, or, when the
/// endpoint's labels changed (or the agent restarted and found its entries in the
/// maps), the identity still in force until the operator answers. `labels` are the
/// endpoint's identity labels (after the operator's label filter), empty when they
/// are invalid. `error` says what is wrong in state `error`, and why the operator has
/// not answered yet in `waiting_for_identity`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointStatus {
    pub namespace: String,
    pub name: String,
    pub ips: Vec<String>,
    pub interface: String,
    #[serde(default)]
    pub identity: Option<u32>,
    #[serde(default)]
    pub labels: Vec<String>,
    pub state: EndpointState,
    #[serde(default)]
    pub error: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EndpointState {
    /// Its identity is known and its entries are written.
    Programmed,
    /// The operator has not given the identity of its labels yet.
    WaitingForIdentity,
    /// Something is wrong (labels, addresses, map writes, its interface): see `error`.
    Error,
    /// A state of a newer agent that this build does not know. No agent sends it:
    /// it is what a reader makes of such a state, and writes back as `unknown`.
    #[serde(other)]
    Unknown,
}

/// `GET /v1/version`. A reader ignores the fields it does not know.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionResponse {
    pub agent_version: String,
    pub protocol_version: u32,
    /// The layout version of the pinned maps this agent reads and writes.
    pub layout_version: u32,
}

/// `GET /v1/flows`: FLOWS, summed over CPUs, ordered by pair.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlowsResponse {
    pub node: String,
    pub flows: Vec<FlowEntry>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlowEntry {
    pub src_identity: u32,
    pub dst_identity: u32,
    /// GSO segments counted one by one.
    pub packets: u64,
    /// Link-layer bytes.
    pub bytes: u64,
}

/// `GET /v1/services`: SERVICE_FLOWS4/6, summed over CPUs, each address named by
/// the Service whose ClusterIP it is (as the operator last said), and the
/// Services the operator named.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServicesResponse {
    pub node: String,
    /// Ordered by client, address, port, protocol, direction.
    pub flows: Vec<ServiceFlowEntry>,
    /// Every ClusterIP the operator named, by address.
    pub cluster_ips: Vec<NamedClusterIp>,
}

/// One SERVICE_FLOWS4/6 entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceFlowEntry {
    /// The client's identity (1, `host`, for the node's own sockets).
    pub client_identity: u32,
    /// The Service address the client dialled.
    pub address: std::net::IpAddr,
    /// Its port; 0 when the packets carry none.
    pub port: u16,
    /// `TCP`, `UDP`, `SCTP`, or the IP protocol's number.
    pub protocol: String,
    /// `request` (client to Service) or `reply`.
    pub direction: String,
    /// `namespace/name` of the Service whose ClusterIP `address` is; `null`
    /// when the operator named none (a LoadBalancer or external IP, a Service
    /// deleted since, an operator that sends no names).
    pub service: Option<String>,
    /// GSO segments counted one by one.
    pub packets: u64,
    /// Link-layer bytes of every segment.
    pub bytes: u64,
}

/// A ClusterIP and the Service it belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamedClusterIp {
    pub address: std::net::IpAddr,
    /// `namespace/name`.
    pub service: String,
    /// `80/TCP`, sorted.
    pub ports: Vec<String>,
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn response() -> EndpointsResponse {
        EndpointsResponse {
            node: "n1".into(),
            operator: OperatorStatus {
                address: "http://127.0.0.1:9460".into(),
                connected: true,
                session: "1700000000000000000-00000000000000ff".into(),
                last_ack_seq: 12,
                error: None,
                extra: Extra::new(),
            },
            endpoints: vec![EndpointStatus {
                namespace: "default".into(),
                name: "web-0".into(),
                ips: vec!["198.18.0.2".into()],
                interface: "vethweb0".into(),
                identity: None,
                labels: vec!["k8s:app=web".into()],
                state: EndpointState::WaitingForIdentity,
                error: None,
                extra: Extra::new(),
            }],
            source: Some(SourceStatus {
                source: "file /etc/census/endpoints.yaml".into(),
                synced: true,
                error: Some("line 3: bad label".into()),
                extra: Extra::new(),
            }),
            datapath: Some(DatapathStatus {
                missing_hooks: vec![MissingHookStatus {
                    hook: "uplink vxlan0".into(),
                    error: "interface vxlan0 does not exist".into(),
                    uncounted: "Service requests leaving the node by it go uncounted".into(),
                    extra: Extra::new(),
                }],
                services: ServicesStatus {
                    operator: Some(ServiceCounts {
                        cluster_ip_range: 2,
                        load_balancer_ip: 1,
                        external_ip: 0,
                    }),
                    map: None,
                    error: Some("SERVICES: permission denied".into()),
                    extra: Extra::new(),
                },
                extra: Extra::new(),
            }),
            extra: Extra::new(),
        }
    }

    #[test]
    fn endpoints_serialize_as_the_contract_says() -> Result<(), serde_json::Error> {
        let response = response();
        // Every field, in this order, nulls written out: what scripts and older
        // `census` builds read.
        assert_eq!(
            serde_json::to_string(&response)?,
            concat!(
                r#"{"node":"n1","#,
                r#""operator":{"address":"http://127.0.0.1:9460","connected":true,"#,
                r#""session":"1700000000000000000-00000000000000ff","last_ack_seq":12,"error":null},"#,
                r#""endpoints":[{"namespace":"default","name":"web-0","ips":["198.18.0.2"],"#,
                r#""interface":"vethweb0","identity":null,"labels":["k8s:app=web"],"#,
                r#""state":"waiting_for_identity","error":null}],"#,
                r#""source":{"source":"file /etc/census/endpoints.yaml","synced":true,"#,
                r#""error":"line 3: bad label"},"#,
                r#""datapath":{"missing_hooks":[{"hook":"uplink vxlan0","#,
                r#""error":"interface vxlan0 does not exist","#,
                r#""uncounted":"Service requests leaving the node by it go uncounted"}],"#,
                r#""services":{"operator":{"cluster_ip_range":2,"load_balancer_ip":1,"external_ip":0},"#,
                r#""map":null,"error":"SERVICES: permission denied"}}}"#,
            )
        );
        let back: EndpointsResponse = serde_json::from_value(serde_json::to_value(&response)?)?;
        assert_eq!(back, response);
        for (state, name) in [
            (EndpointState::Programmed, "programmed"),
            (EndpointState::WaitingForIdentity, "waiting_for_identity"),
            (EndpointState::Error, "error"),
        ] {
            assert_eq!(serde_json::to_value(state)?, name);
        }
        Ok(())
    }

    #[test]
    fn a_newer_agents_fields_are_kept() -> Result<(), serde_json::Error> {
        let mut newer = serde_json::to_value(response())?;
        newer["zone"] = json!("eu-1");
        newer["operator"]["rtt_ms"] = json!(3);
        newer["source"]["checked_ms"] = json!(17);
        newer["endpoints"][0]["weight"] = json!({"a": [1, 2]});
        let read: EndpointsResponse = serde_json::from_value(newer.clone())?;
        assert_eq!(read.extra["zone"], "eu-1");
        assert_eq!(read.operator.extra["rtt_ms"], 3);
        assert_eq!(read.endpoints[0].extra["weight"]["a"][1], 2);
        assert_eq!(read.endpoints[0].state, EndpointState::WaitingForIdentity);
        assert_eq!(
            serde_json::to_value(&read)?,
            newer,
            "written back as it came"
        );

        newer["endpoints"][0]["state"] = json!("draining");
        let read: EndpointsResponse = serde_json::from_value(newer)?;
        assert_eq!(read.endpoints[0].state, EndpointState::Unknown);
        assert_eq!(
            serde_json::to_value(&read)?["endpoints"][0]["state"],
            "unknown"
        );
        Ok(())
    }

    #[test]
    fn an_older_agents_answer_reads() -> Result<(), serde_json::Error> {
        // No `source`, and every nullable or list field left out.
        let older = json!({
            "node": "n1",
            "operator": {"address": "http://127.0.0.1:9460", "connected": false,
                         "session": "1700000000000000000-00000000000000ff", "last_ack_seq": 0},
            "endpoints": [{"namespace": "default", "name": "web-0", "ips": ["198.18.0.2"],
                           "interface": "vethweb0", "state": "programmed"}],
        });
        let read: EndpointsResponse = serde_json::from_value(older)?;
        assert_eq!(read.source, None);
        assert_eq!(read.datapath, None);
        assert_eq!(read.operator.error, None);
        let endpoint = &read.endpoints[0];
        assert_eq!(endpoint.identity, None);
        assert!(endpoint.labels.is_empty());
        assert_eq!(endpoint.error, None);
        assert!(read.extra.is_empty() && endpoint.extra.is_empty());
        let source: SourceStatus =
            serde_json::from_value(json!({"source": "kubernetes", "synced": false}))?;
        assert_eq!(source.error, None);
        Ok(())
    }

    #[test]
    fn a_field_every_agent_sends_is_required() {
        let without_session = json!({"address": "http://127.0.0.1:9460", "connected": true,
                                     "last_ack_seq": 1});
        assert!(serde_json::from_value::<OperatorStatus>(without_session).is_err());
    }
}
