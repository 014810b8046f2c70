//! The JSON the agent's admin port serves, for the `census` CLI and scripts. Fields
//! are only ever added.

use serde::{Deserialize, Serialize};

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
}

/// The EndpointSync stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OperatorStatus {
    /// The operator's gRPC address, as configured.
    pub address: String,
    pub connected: bool,
    /// This agent's session, `<start time ns>-<nonce, 16 hex digits>`.
    pub session: String,
    /// The highest seq the operator acknowledged.
    pub last_ack_seq: u64,
    /// Why the stream last ended or could not start; `null` while connected.
    #[serde(default)]
    pub error: Option<String>,
}

/// Where endpoints come from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceStatus {
    /// `file /path/to/endpoints.yaml`.
    pub source: String,
    /// Whether the first full set has been read.
    pub synced: bool,
    /// The last read's failure (the last good set stays in force); `null` if it succeeded.
    pub error: Option<String>,
}

/// One endpoint the agent manages.
///
/// `identity` is the identity written to ENDPOINTS for the endpoint's addresses,
/// `null` while it has none. While `state` is `waiting_for_identity` it is
/// `null`, or, when the endpoint's labels changed (or the agent restarted and found
/// its entries in the maps), the identity still in force until the operator
/// answers. `labels` are the endpoint's identity labels (after the operator's label
/// filter), empty when they are invalid. `error` says what is wrong in state
/// `error`, and why the operator has not answered yet in `waiting_for_identity`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointStatus {
    pub namespace: String,
    pub name: String,
    pub ips: Vec<String>,
    pub interface: String,
    pub identity: Option<u32>,
    pub labels: Vec<String>,
    pub state: EndpointState,
    pub error: Option<String>,
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
}

/// `GET /v1/version`.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_serialize_as_the_contract_says() -> Result<(), serde_json::Error> {
        let response = EndpointsResponse {
            node: "n1".into(),
            operator: OperatorStatus {
                address: "http://127.0.0.1:9460".into(),
                connected: true,
                session: "1700000000000000000-00000000000000ff".into(),
                last_ack_seq: 12,
                error: None,
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
            }],
            source: None,
        };
        let value = serde_json::to_value(&response)?;
        assert_eq!(value["operator"]["connected"], true);
        assert_eq!(value["operator"]["last_ack_seq"], 12);
        let endpoint = &value["endpoints"][0];
        assert_eq!(endpoint["state"], "waiting_for_identity");
        assert!(
            endpoint["identity"].is_null(),
            "null, not absent: {endpoint}"
        );
        assert!(endpoint["error"].is_null());
        assert_eq!(endpoint["ips"][0], "198.18.0.2");
        let back: EndpointsResponse = serde_json::from_value(value)?;
        assert_eq!(back, response);
        Ok(())
    }
}
