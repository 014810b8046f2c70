//! What the core shows: the status the admin API (`/readyz`, `/v1/endpoints`) and
//! the metrics' gauges read, and each endpoint as it stands.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Arc,
};

use census_proto::{
    domain::{ClusterIpService, EndpointKey, IdentityId, ServiceKind, ServiceSet},
    labels::LabelSet,
};

use super::{Problem, StreamError};
use crate::source::SourceFailure;

/// The EndpointSync stream, as its client reports it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OperatorLink {
    /// True while a stream is up.
    pub connected: bool,
    /// The highest seq the operator acknowledged, 0 before the first.
    pub last_ack_seq: u64,
    /// Why the last stream ended or could not start.
    pub last_error: Option<StreamError>,
}

/// The agent's state, read at once: the one source of `/readyz`, the endpoints
/// API's operator and source parts, and the state gauges.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Status {
    /// The source has given its first full set.
    pub synced: bool,
    /// The source's last read failed (the last good set stays in force).
    pub source_error: Option<SourceFailure>,
    pub programmed: u64,
    pub waiting: u64,
    pub errors: u64,
    /// Label sets in the identity cache.
    pub identities: u64,
    /// Label sets waiting for the operator.
    pub pending_allocations: u64,
    /// Interfaces the classifier should be attached to.
    pub interfaces: u64,
    /// ENDPOINTS entries written by this agent.
    pub map_entries: u64,
    /// Attached interfaces whose INTERFACES slot another interface holds.
    pub interfaces_by_address: u64,
    /// Endpoints with an identity whose entries are not LOCAL: the classifier is
    /// not attached to their interface (none found, refused, or failing).
    pub unattached: u64,
    /// Why the datapath is not whole (its pins removed and not put back): the
    /// agent is not Ready while this is set.
    pub datapath_error: Option<String>,
    /// Programs that run in front of census's classifier.
    pub in_front: Vec<super::ProgramInFront>,
    /// The node's own hooks (uplinks, sockets) that are not attached: the agent
    /// stays Ready, and says so.
    pub missing_hooks: Vec<super::MissingHook>,
    /// The operator's last set of Service addresses, as ranges per kind; `None`
    /// until one came.
    pub services: Option<ServiceCounts>,
    /// The Services the operator named, by ClusterIP (what SERVICE_FLOWS4/6's
    /// addresses are shown as).
    pub service_names: Arc<BTreeMap<IpAddr, ClusterIpService>>,
    /// The identities this node's endpoints hold now, `host` among them: the
    /// clients SERVICE_FLOWS4/6 may name that are still in use.
    pub local_identities: Arc<BTreeSet<u32>>,
    pub operator: OperatorLink,
    /// The cluster-wide endpoint map.
    pub map: MapStatus,
}

/// Service address ranges per kind: the operator's set as the core holds it, or
/// what SERVICES holds (`/v1/endpoints`' `datapath.services`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ServiceCounts {
    pub cluster_ip_range: u64,
    pub load_balancer_ip: u64,
    pub external_ip: u64,
}

impl ServiceCounts {
    /// The ranges of `set`, per kind.
    pub fn of(set: &ServiceSet) -> Self {
        Self::of_kinds(set.iter().map(|(_, kind)| kind))
    }

    /// `kinds` counted per kind.
    pub fn of_kinds(kinds: impl IntoIterator<Item = ServiceKind>) -> Self {
        let mut counts = Self::default();
        for kind in kinds {
            counts.add(kind);
        }
        counts
    }

    pub fn add(&mut self, kind: ServiceKind) {
        let count = match kind {
            ServiceKind::ClusterIpRange => &mut self.cluster_ip_range,
            ServiceKind::LoadBalancerIp => &mut self.load_balancer_ip,
            ServiceKind::ExternalIp => &mut self.external_ip,
        };
        *count += 1;
    }
}

/// Where the EndpointMap watch stands, as its client reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MapState {
    /// Not connected yet since start.
    #[default]
    Connecting,
    Connected,
    /// The stream was lost: the remote entries stay in force (fail-static).
    Disconnected,
    /// The operator has no EndpointMap (an older operator): local-only, retried
    /// now and then.
    Unsupported,
    /// The watch is off (`--no-endpoint-map`): local-only.
    Disabled,
}

impl MapState {
    /// The `state` label of the metrics and the word of `/readyz`.
    pub fn label(self) -> &'static str {
        match self {
            Self::Connecting => "connecting",
            Self::Connected => "connected",
            Self::Disconnected => "disconnected",
            Self::Unsupported => "unsupported",
            Self::Disabled => "disabled",
        }
    }
}

/// The EndpointMap watch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MapLink {
    pub state: MapState,
    /// Why the last stream ended or could not start.
    pub last_error: Option<StreamError>,
}

/// The cluster-wide endpoint map as the agent holds it: the desired ENDPOINTS
/// entries by kind, and the watch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MapStatus {
    pub link: MapLink,
    /// A resync has completed since start (or the agent is local-only).
    pub complete: bool,
    /// Resyncs completed since start.
    pub resyncs: u64,
    /// The version of the last batch (the operator's count of batches).
    pub version: u64,
    /// Entries of this node's endpoints.
    pub local: u64,
    /// This node's own addresses.
    pub host: u64,
    /// Entries of other nodes' endpoints.
    pub remote: u64,
    /// Other nodes' addresses.
    pub remote_node: u64,
    /// Remote claims not written because a local endpoint or a node address of
    /// this node holds the address.
    pub shadowed: u64,
    /// Nodes the remote entries name (NODES).
    pub nodes: u64,
}

/// Where an endpoint stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointState {
    /// Its identity is known and its entries are written.
    Programmed,
    /// The operator has not given the identity of its labels yet.
    WaitingForIdentity,
    /// Something is wrong: see its problem.
    Error,
}

/// One managed endpoint.
#[derive(Debug, Clone)]
pub struct EndpointView {
    pub key: EndpointKey,
    pub ips: Box<[IpAddr]>,
    /// The host-side interface census counts on, if the source found one.
    pub interface: Option<String>,
    /// The identity written for its addresses.
    pub identity: Option<IdentityId>,
    /// Its identity labels; `None` when they are invalid.
    pub labels: Option<LabelSet>,
    pub state: EndpointState,
    /// What is wrong in state `Error`; why it still waits in `WaitingForIdentity`.
    pub problem: Option<Problem>,
}
