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
pub(crate) struct OperatorLink {
    /// True while a stream is up.
    pub(crate) connected: bool,
    /// The highest seq the operator acknowledged, 0 before the first.
    pub(crate) last_ack_seq: u64,
    /// Why the last stream ended or could not start.
    pub(crate) last_error: Option<StreamError>,
}

/// The agent's state, read at once: the one source of `/readyz`, the endpoints
/// API's operator and source parts, and the state gauges.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Status {
    /// The source has given its first full set.
    pub(crate) synced: bool,
    /// The source's last read failed (the last good set stays in force).
    pub(crate) source_error: Option<SourceFailure>,
    pub(crate) programmed: u64,
    pub(crate) waiting: u64,
    pub(crate) errors: u64,
    /// Label sets in the identity cache.
    pub(crate) identities: u64,
    /// Label sets waiting for the operator.
    pub(crate) pending_allocations: u64,
    /// Interfaces the classifier should be attached to.
    pub(crate) interfaces: u64,
    /// ENDPOINTS entries written by this agent.
    pub(crate) map_entries: u64,
    /// Attached interfaces whose INTERFACES slot another interface holds.
    pub(crate) interfaces_by_address: u64,
    /// Endpoints with an identity whose entries are not LOCAL: the classifier is
    /// not attached to their interface (none found, refused, or failing).
    pub(crate) unattached: u64,
    /// Why the datapath is not whole (its pins removed and not put back): the
    /// agent is not Ready while this is set.
    pub(crate) datapath_error: Option<String>,
    /// Programs that run in front of census's classifier.
    pub(crate) in_front: Vec<super::ProgramInFront>,
    /// The node's own hooks (uplinks, sockets) that are not attached: the agent
    /// stays Ready, and says so.
    pub(crate) missing_hooks: Vec<super::MissingHook>,
    /// The operator's last set of Service addresses, as ranges per kind; `None`
    /// until one came.
    pub(crate) services: Option<ServiceCounts>,
    /// The Services the operator named, by ClusterIP (what SERVICE_FLOWS'
    /// addresses are shown as).
    pub(crate) service_names: Arc<BTreeMap<IpAddr, ClusterIpService>>,
    /// The identities this node's endpoints hold now, `host` among them: the
    /// clients SERVICE_FLOWS may name that are still in use.
    pub(crate) local_identities: Arc<BTreeSet<u32>>,
    pub(crate) operator: OperatorLink,
    /// The cluster-wide endpoint map.
    pub(crate) map: MapStatus,
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
    pub(crate) fn of(set: &ServiceSet) -> Self {
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

    pub(crate) fn add(&mut self, kind: ServiceKind) {
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
pub(crate) enum MapState {
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
    pub(crate) fn label(self) -> &'static str {
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
pub(crate) struct MapLink {
    pub(crate) state: MapState,
    /// Why the last stream ended or could not start.
    pub(crate) last_error: Option<StreamError>,
}

/// The cluster-wide endpoint map as the agent holds it: the desired ENDPOINTS
/// entries by kind, and the watch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct MapStatus {
    pub(crate) link: MapLink,
    /// A resync has completed since start (or the agent is local-only).
    pub(crate) complete: bool,
    /// Resyncs completed since start.
    pub(crate) resyncs: u64,
    /// The version of the last batch (the operator's count of batches).
    pub(crate) version: u64,
    /// Entries of this node's endpoints.
    pub(crate) local: u64,
    /// This node's own addresses.
    pub(crate) host: u64,
    /// Entries of other nodes' endpoints.
    pub(crate) remote: u64,
    /// Other nodes' addresses.
    pub(crate) remote_node: u64,
    /// Remote claims not written because a local endpoint or a node address of
    /// this node holds the address.
    pub(crate) shadowed: u64,
    /// Nodes the remote entries name (NODES).
    pub(crate) nodes: u64,
}

/// Where an endpoint stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EndpointState {
    /// Its identity is known and its entries are written.
    Programmed,
    /// The operator has not given the identity of its labels yet.
    WaitingForIdentity,
    /// Something is wrong: see its problem.
    Error,
}

/// One managed endpoint.
#[derive(Debug, Clone)]
pub(crate) struct EndpointView {
    pub(crate) key: EndpointKey,
    pub(crate) ips: Box<[IpAddr]>,
    /// The host-side interface census counts on, if the source found one.
    pub(crate) interface: Option<String>,
    /// The identity written for its addresses.
    pub(crate) identity: Option<IdentityId>,
    /// Its identity labels; `None` when they are invalid.
    pub(crate) labels: Option<LabelSet>,
    pub(crate) state: EndpointState,
    /// What is wrong in state `Error`; why it still waits in `WaitingForIdentity`.
    pub(crate) problem: Option<Problem>,
}
