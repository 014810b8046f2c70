//! What the shells tell the core: allocation answers, the operator's word, and what
//! reconcile did.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    num::NonZeroU32,
};

use census_proto::{
    domain::{EndpointKey, IdentityId, NodeName, ServiceSet},
    labels::{LabelFilter, LabelLimits, LabelSet},
};

use super::{AllocateFailure, AllocationId, DatapathError};

/// The operator's settings that shape identity labels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabelSettings {
    pub filter: LabelFilter,
    pub limits: LabelLimits,
    pub max_ips: usize,
}

impl Default for LabelSettings {
    /// The operator's defaults, in force until its HelloReply says otherwise.
    fn default() -> Self {
        Self {
            filter: LabelFilter::default(),
            limits: LabelLimits::default(),
            max_ips: 16,
        }
    }
}

/// Progress of an allocation, from the allocate client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllocationEvent {
    Allocated {
        request: AllocationId,
        labels: LabelSet,
        id: IdentityId,
    },
    /// An attempt failed; the client retries after a backoff.
    Failed {
        request: AllocationId,
        labels: LabelSet,
        failure: AllocateFailure,
    },
}

/// What the operator tells the core, from the EndpointSync client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OperatorEvent {
    Settings(LabelSettings),
    Rebind {
        key: EndpointKey,
        id: IdentityId,
    },
    /// What an Ack said of the entries of its message.
    Verdict(Verdict),
    /// The cluster's Service addresses, from HelloReply.
    Services(ServiceSet),
}

/// What the operator's Acks say about the endpoints it was sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub scope: VerdictScope,
    /// Entries the operator rejected, with its reason.
    pub rejected: BTreeMap<EndpointKey, String>,
    /// Entries whose identity the operator decides after its adoption window.
    pub pending: BTreeSet<EndpointKey>,
}

/// Whom a [`Verdict`] speaks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VerdictScope {
    /// Every endpoint: a snapshot's Ack. An endpoint it does not name is accepted.
    All,
    /// One endpoint: a delta's Ack.
    One(EndpointKey),
}

/// What reconcile did, with a batch of effects or in a full pass: the entries and
/// interfaces it brought up to date, the failures among them, and what the
/// datapath holds since.
#[derive(Debug, Default)]
pub struct Reconciled {
    pub entries: BTreeSet<IpAddr>,
    pub entry_failures: Vec<(IpAddr, DatapathError)>,
    pub interfaces: BTreeSet<String>,
    pub interface_failures: Vec<(String, DatapathError)>,
    /// The interfaces of `interfaces` the classifier is attached to (both hooks)
    /// now; the others of `interfaces` have none.
    pub attached: BTreeSet<String>,
    /// The datapath as a whole, as a full pass found it (`None`: not looked at).
    pub datapath: Option<DatapathHealth>,
    /// ENDPOINTS entries of this node's endpoints and addresses this agent has
    /// written.
    pub local_entries: usize,
    /// REMOTE entries the core wants whose write failed (the others are written).
    pub remote_unwritten: usize,
    /// Attached interfaces whose INTERFACES slot another interface holds.
    pub interfaces_by_address: usize,
}

/// What a full pass found of the datapath as a whole.
#[derive(Debug, Clone, Default)]
pub struct DatapathHealth {
    /// Why it is not whole (its pins gone and not put back).
    pub error: Option<DatapathError>,
    /// Programs that run before census's classifier.
    pub in_front: Vec<ProgramInFront>,
    /// The node's own hooks that are not attached.
    pub missing: Vec<MissingHook>,
}

/// One of the node's own hooks (an uplink's, the node's sockets') that is not
/// attached: what it alone counts goes uncounted until a full pass attaches it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MissingHook {
    pub hook: NodeHook,
    /// Why it is not attached.
    pub error: String,
    /// What goes uncounted meanwhile.
    pub uncounted: &'static str,
}

impl MissingHook {
    pub fn new(hook: NodeHook, error: &dyn std::fmt::Display, uncounted: &'static str) -> Self {
        Self {
            hook,
            error: error.to_string(),
            uncounted,
        }
    }
}

/// One of the node's own hooks.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum NodeHook {
    /// The egress hook of this uplink or tunnel device.
    Uplink(String),
    /// The uplinks, when none could be listed.
    Uplinks,
    /// The sockets' hooks at this cgroup v2 root, or where none could be found.
    Sockets(Option<std::path::PathBuf>),
}

impl std::fmt::Display for NodeHook {
    /// `uplink eth0`, `uplinks`, `sockets /sys/fs/cgroup`, `sockets`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Uplink(interface) => write!(f, "uplink {interface}"),
            Self::Uplinks => f.write_str("uplinks"),
            Self::Sockets(Some(root)) => write!(f, "sockets {}", root.display()),
            Self::Sockets(None) => f.write_str("sockets"),
        }
    }
}

/// Which of an interface's hooks a program runs at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum HookDirection {
    /// What the endpoint sends.
    Ingress,
    /// What the endpoint receives.
    Egress,
    /// What leaves the node by an uplink.
    Uplink,
}

impl HookDirection {
    pub const fn name(self) -> &'static str {
        match self {
            Self::Ingress => "ingress",
            Self::Egress => "egress",
            Self::Uplink => "uplink",
        }
    }
}

impl std::fmt::Display for HookDirection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A program attached in front of census's classifier: a verdict it returns
/// bypasses census.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProgramInFront {
    pub interface: String,
    pub direction: HookDirection,
    /// Its name (or a TC filter's kind).
    pub program: String,
    pub program_id: u32,
}

/// What the EndpointMap client tells the core.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MapEvent {
    /// One batch of the cluster-wide map, decoded (its malformed entries left out).
    Batch(MapBatch),
    /// There is no map to watch (the watch is off, or the operator has none): the
    /// agent is local-only, and remote entries go.
    LocalOnly,
}

/// One batch of the cluster-wide map (`EndpointMapBatch`), in domain terms.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MapBatch {
    /// Forget everything received so far: the full map follows, up to the batch
    /// with `resync_end`.
    pub resync_start: bool,
    pub resync_end: bool,
    pub nodes: Vec<MapNode>,
    pub upserts: Vec<MapEntry>,
    pub removes: Vec<IpAddr>,
    pub removed_nodes: Vec<NonZeroU32>,
    /// When the operator built it, ms since the Unix epoch (0: unknown); the core
    /// has no clock and does not read it.
    pub built_at_ms: u64,
    pub version: u64,
    /// The cluster's Service addresses, the whole set, when the batch carries it.
    pub services: Option<ServiceSet>,
}

/// A node of the map, by the operator's index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapNode {
    pub index: NonZeroU32,
    pub name: NodeName,
}

/// One address of the map: an endpoint of `node`, or `node`'s own address
/// (identity `remote-node`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapEntry {
    pub ip: IpAddr,
    pub identity: IdentityId,
    /// The operator's index of the node.
    pub node: NonZeroU32,
}
