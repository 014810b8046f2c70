use census_proto::{
    domain::{EndpointKey, IdRange, IdentityId, NodeName, SessionId},
    labels::LabelSet,
};

use super::{IdentityInfo, StoreOp};

/// Identifies one Allocate call while its answer is pending.
pub type RequestId = u64;

/// Identifies one accepted EndpointSync stream. Messages name the stream they came
/// on, so those of a replaced stream are refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConnId(pub(super) u64);

impl ConnId {
    pub fn get(self) -> u64 {
        self.0
    }
}

/// Which writer queue a store op goes to. Allocation writes never wait behind GC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Priority {
    Allocation,
    Gc,
}

/// What the core asks its shell to do. Drained in order with [`super::Allocator::drain_effects`].
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Apply this write and report with `store_result`.
    Store { op: StoreOp, priority: Priority },
    /// The answer to a pending Allocate.
    Reply {
        req: RequestId,
        result: Result<IdentityId, AllocError>,
    },
    /// A message to the agent on stream `conn` of `node`.
    Agent {
        node: NodeName,
        conn: ConnId,
        msg: AgentMsg,
    },
    /// A change for IdentityService.Watch: at most one per identity per drain.
    Watch(WatchChange),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentMsg {
    /// The endpoint must use `identity` instead of the one it reported.
    Rebind {
        key: EndpointKey,
        identity: IdentityId,
    },
    /// Send a full snapshot now.
    SnapshotNow,
    /// End the stream.
    Close(CloseReason),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseReason {
    /// A Hello with a newer session (or a reconnect) took over.
    Replaced { by: SessionId },
    /// The node was silent too long (embedded mode) and its view was dropped.
    Expired,
    /// The node is gone from the cluster.
    NodeGone,
}

/// What IdentityService.Watch is told. Changes between two drains of the effects
/// are coalesced per identity: one Upsert with the state at the drain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchChange {
    /// A persisted binding appeared, or its state, references or holds changed: the
    /// identity as it is now.
    Upsert(IdentityInfo),
    /// A binding is gone.
    Removed { id: IdentityId, labels: LabelSet },
}

/// Why an EndpointSync message or an Allocate was refused. State is unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SyncError {
    #[error("node {node}: session {offered} is older than the current session {current}")]
    StaleSession {
        node: NodeName,
        current: SessionId,
        offered: SessionId,
    },
    #[error("node {node}: this stream's session was replaced by a newer Hello")]
    Replaced { node: NodeName },
    #[error("node {node} has no session: send Hello on EndpointSync first")]
    NoSession { node: NodeName },
    #[error("node {node}: session {offered} is not the current session {current}")]
    WrongSession {
        node: NodeName,
        current: SessionId,
        offered: SessionId,
    },
    #[error(
        "node {node}: its Node object was deleted; its agent is taken back once the Node exists again"
    )]
    NodeGone { node: NodeName },
}

/// Why an allocation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    #[error(transparent)]
    Sync(#[from] SyncError),
    #[error(
        "identity range {range} is exhausted ({used} ids live, deleting, quarantined or blocked); ids become free as identities are released and their quarantine ends"
    )]
    RangeExhausted { range: IdRange, used: u64 },
    #[error("node {node} holds {max} identities not yet seen in its view, the per-node limit")]
    HoldQuota { node: NodeName, max: usize },
    #[error(
        "the store was empty at start: no new identity is handed out until agents have re-reported theirs (in {remaining_ms} ms)"
    )]
    AdoptionWindow { remaining_ms: u64 },
    #[error("the identity could not be persisted ({cause}); retry")]
    StoreUnavailable { cause: &'static str },
}

/// What applying a delta or snapshot did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Applied {
    /// The message was older than one already applied: nothing changed.
    pub ignored: bool,
    /// References a snapshot added or removed that the deltas had not.
    pub corrections: u64,
    /// References taken over from a session's first snapshot.
    pub adoptions: u64,
    /// Rebinds sent (or queued until the identity is persisted).
    pub rebinds: u64,
    /// Endpoints left out of the view because no identity could be found for them.
    pub unresolved: u64,
    /// Endpoints whose identity is decided later: they need a new id while new ids
    /// wait for the adoption window to end. They are left out of the view until then;
    /// the agent is sent a Rebind when each is resolved.
    pub pending: Vec<EndpointKey>,
    /// Entries of a snapshot whose key an earlier entry had: only the first counts.
    pub duplicates: u64,
}

/// The outcome of an accepted Hello.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accepted {
    pub conn: ConnId,
    /// The stream this Hello replaced, already told to close.
    pub replaced: Option<ConnId>,
}
