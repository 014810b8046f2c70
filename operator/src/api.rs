//! What the gRPC layer asks of the operator, in domain types: the [`Api`] trait, which
//! the runtime implements, and the values that cross it. Nothing here knows the wire;
//! `grpc` decodes requests into these types and encodes the answers.
//!
//! Two kinds of call:
//! - **reads** (Get, Lookup, List, Watch, NodeService) take no caller: whoever may
//!   read is decided at the edge;
//! - **calls bound to a node** (Allocate and an EndpointSync stream) take the
//!   [`Caller`], the node the call is made for. The gRPC layer builds it, and it is
//!   the one place that decides how much of it is proven: today the node named in the
//!   request and the peer's address; with authentication, the node from the caller's
//!   credentials (a request naming another node refused before it gets here).
//!
//! A server stream fed by the runtime is a [`Feed`]: the term (so a change of role
//! starts the stream over), the changes from now on, and the full state read after
//! subscribing, so no change falls between the two. IdentityService.Watch is one; a
//! cluster-wide endpoint map would be another method returning its own `Feed`.

use std::{fmt, net::IpAddr, time::Duration};

use census_proto::{
    convert::WireLimits,
    domain::{Endpoint, EndpointKey, IdRange, IdentityId, NodeName, SessionId},
    labels::{LabelFilter, LabelSet},
};
use tokio::sync::{broadcast, mpsc, oneshot, watch};

pub use crate::{
    allocator::{
        AllocError, Applied, CloseReason, ConnId, IdentityInfo, IdentityState, NodeInfo, SyncError,
        WatchChange,
    },
    replica::{AdmissionError, Leader, NotLeader, Role},
};

/// What the services need besides the core.
#[derive(Debug, Clone)]
pub struct Settings {
    pub filter: LabelFilter,
    pub wire: WireLimits,
    pub snapshot_interval: Duration,
    pub max_message_bytes: usize,
    /// `redb`, `memory` or `kubernetes`.
    pub store_kind: &'static str,
}

/// A role of this replica: it changes on every promotion and demotion.
pub type Term = u64;

/// The node a call is made for, and where it comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub node: NodeName,
    /// The peer's address (agents use host networking: their Node's address).
    pub peer: Option<IpAddr>,
}

/// Why the operator refused a call. State is unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error(transparent)]
    NotLeader(#[from] NotLeader),
    #[error(transparent)]
    Admission(#[from] AdmissionError),
    #[error(transparent)]
    Sync(#[from] SyncError),
    #[error(transparent)]
    Alloc(#[from] AllocError),
}

/// An identity handed out by Allocate, as it was when it was handed out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocated {
    pub id: IdentityId,
    /// `None` only if the identity was gone again by the time it was answered.
    pub info: Option<IdentityInfo>,
}

/// The answer to an Allocate.
#[derive(Debug)]
pub enum Allocation {
    /// A known label set: answered at once.
    Known(Allocated),
    /// A new label set: answered once the binding is persisted (or cannot be).
    New(oneshot::Receiver<Result<Allocated, AllocError>>),
}

/// A message the operator sends an agent on its EndpointSync stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToAgent {
    /// The endpoint must use `identity` instead of the one it reported.
    Rebind {
        key: EndpointKey,
        identity: IdentityId,
    },
    /// Send a full snapshot now.
    SnapshotNow,
    /// The stream is over; nothing follows.
    End(StreamEnd),
}

/// Why the operator ended an agent's stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEnd {
    /// The core closed it.
    Closed(CloseReason),
    /// This replica stopped leading.
    NotLeader(NotLeader),
    /// The operator is stopping.
    ShuttingDown,
}

/// Where the operator sends an agent's messages (the gRPC layer encodes them).
pub type AgentTx = mpsc::Sender<ToAgent>;

/// An accepted EndpointSync stream: what its messages are applied as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connected {
    pub node: NodeName,
    pub session: SessionId,
    pub conn: ConnId,
    /// The term at Hello: after a change of role the stream is over.
    pub term: Term,
}

/// A server stream's source: see the module documentation. Read `full` first, then
/// `changes`; when `terms` changes or `changes` lags, ask for a new feed.
#[derive(Debug)]
pub struct Feed<C, S> {
    pub terms: watch::Receiver<Term>,
    pub changes: broadcast::Receiver<C>,
    pub full: Vec<S>,
}

/// The operator as the gRPC services see it.
pub trait Api: Send + Sync + fmt::Debug + 'static {
    fn settings(&self) -> &Settings;

    /// Whether this replica leads, and who does if not.
    fn role(&self) -> Role;

    /// The range ids are allocated from.
    fn id_range(&self) -> IdRange;

    fn identity(&self, id: IdentityId) -> Option<IdentityInfo>;

    fn lookup(&self, labels: &LabelSet) -> Option<IdentityInfo>;

    /// A page of identities by id after `after`, and whether more follow.
    fn list(
        &self,
        after: Option<IdentityId>,
        limit: usize,
        selector: Option<&LabelSet>,
        include_quarantined: bool,
    ) -> (Vec<IdentityInfo>, bool);

    /// IdentityService.Watch: every binding, then its changes.
    fn identity_feed(&self) -> Feed<WatchChange, IdentityInfo>;

    /// The nodes the core knows (a follower's core knows none).
    fn nodes(&self) -> Vec<NodeInfo>;

    fn node(&self, name: &NodeName) -> Option<NodeInfo>;

    /// Allocate for `caller`'s session.
    fn allocate(
        &self,
        caller: &Caller,
        session: SessionId,
        labels: LabelSet,
    ) -> Result<Allocation, Refused>;

    /// Hello: the stream is accepted in the current term, and what the operator has
    /// to say to the agent goes to `tx` from now on.
    fn hello(&self, caller: &Caller, session: SessionId, tx: AgentTx)
    -> Result<Connected, Refused>;

    fn upsert(&self, stream: &Connected, seq: u64, endpoint: Endpoint) -> Result<Applied, Refused>;

    fn delete(&self, stream: &Connected, seq: u64, key: &EndpointKey) -> Result<Applied, Refused>;

    fn snapshot(
        &self,
        stream: &Connected,
        seq: u64,
        endpoints: Vec<Endpoint>,
    ) -> Result<Applied, Refused>;

    /// The stream ended.
    fn disconnect(&self, stream: &Connected);
}
