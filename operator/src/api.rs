//! What the gRPC layer asks of the operator, in domain types: the [`Api`] trait, which
//! the runtime implements, and the values that cross it. Nothing here knows the wire;
//! `grpc` decodes requests into these types and encodes the answers.
//!
//! Two kinds of call:
//! - **reads** (Get, Lookup, List, Watch, NodeService) take no caller: whoever may
//!   read is decided at the edge;
//! - **calls bound to a node** (Allocate and an EndpointSync stream) take the
//!   [`Caller`], the node the call is made for and the peer's address. The gRPC
//!   layer builds it after authentication: the node is one the caller's credentials
//!   speak for (a request naming another node is refused before it gets here; on
//!   loopback without TLS any node), and a Hello's node addresses are those the
//!   credentials vouch for (`grpc::auth`).
//!
//! A server stream fed by the runtime is a [`Feed`]: the term (so a change of role
//! starts the stream over), the changes from now on, and the full state read after
//! subscribing, so no change falls between the two. IdentityService.Watch is one.
//!
//! EndpointMap.Watch is fed differently, because its full state is large and every
//! watcher gets the same bytes: batches are encoded once ([`MapEncoder`], which the
//! gRPC layer provides) and shared as [`MapBatch`]es; a watcher subscribes with
//! [`Api::map_watch`] (checked like Allocate), waits its turn on the shared
//! semaphore, and takes a [`MapResync`] (the full map, shared by every watcher
//! resyncing at its version, and the batches after it).

use std::{fmt, net::IpAddr, sync::Arc, time::Duration};

use bytes::Bytes;

use census_proto::{
    convert::WireLimits,
    domain::{
        AllocationId, Endpoint, EndpointKey, IdRange, IdentityId, NodeName, ServiceSet, SessionId,
    },
    labels::{LabelFilter, LabelSet},
};
use tokio::sync::{Semaphore, broadcast, mpsc, oneshot, watch};

pub use crate::{
    allocator::{
        AllocError, Applied, ClaimSource, CloseReason, ConnId, IdentityInfo, IdentityState,
        MapClaim, MapConflict, MapEntry, MapLookup, MapNode, MapNodeIndex, NodeInfo, SyncError,
        Timestamp, WatchChange,
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
    #[error("this operator does not serve the endpoint map")]
    MapNotServed,
    #[error("the endpoint map changed faster than a full copy could be built; retry")]
    MapBusy,
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
    /// This replica stopped leading. Boxed: every stream's channel of [`ToAgent`]
    /// is allocated a block of 32 slots when the stream starts, and this variant
    /// (two strings) would make each slot 48 bytes instead of 32.
    NotLeader(Box<NotLeader>),
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

/// One batch of the endpoint map as the wire carries it (an encoded
/// `EndpointMapBatch`), shared by every watcher: cloning it copies no bytes.
#[derive(Debug, Clone)]
pub struct MapBatch {
    pub version: u64,
    pub bytes: Bytes,
}

/// What one batch says, for the [`MapEncoder`]. Within a batch every address is
/// named once, nodes come before the entries naming them, and removed nodes are
/// named by no entry.
#[derive(Debug, Clone, Copy)]
pub struct MapBatchParts<'a> {
    pub resync_start: bool,
    pub resync_end: bool,
    pub nodes: &'a [MapNode],
    pub upserts: &'a [MapEntry],
    pub removes: &'a [IpAddr],
    pub removed_nodes: &'a [MapNodeIndex],
    /// The cluster's Service addresses, the whole set: in the first chunk of a full
    /// map (once they are known) and in the first batch after the set changed;
    /// `None` otherwise.
    pub services: Option<&'a ServiceSet>,
    pub built_at_ms: u64,
    pub version: u64,
}

impl MapBatchParts<'_> {
    /// Nodes, entries and addresses in the batch.
    pub fn items(&self) -> usize {
        self.nodes.len() + self.upserts.len() + self.removes.len() + self.removed_nodes.len()
    }
}

/// Encodes map batches for the wire; the gRPC layer provides it, so the runtime
/// never names the wire types.
pub trait MapEncoder: Send + Sync + fmt::Debug + 'static {
    fn encode(&self, batch: &MapBatchParts<'_>) -> Bytes;
}

/// The whole map at `version`, encoded in chunks (the first with `resync_start`, the
/// last with `resync_end`), shared by every watcher that resyncs from it.
#[derive(Debug)]
pub struct FullMap {
    pub version: u64,
    pub chunks: Vec<Bytes>,
    pub entries: usize,
    pub bytes: usize,
}

/// An accepted EndpointMap.Watch: the term it was accepted in (a change of term
/// ends or restarts it), and the semaphore every full map is sent under.
#[derive(Debug)]
pub struct MapWatch {
    pub term: Term,
    pub terms: watch::Receiver<Term>,
    pub resyncs: Arc<Semaphore>,
}

/// What a watcher sends to be equal to the operator's map: `full`, then the batches
/// of `catch_up` (built after `full`, before the subscription), then those of
/// `changes` with a version above the last one sent.
#[derive(Debug)]
pub struct MapResync {
    pub full: Arc<FullMap>,
    pub catch_up: Vec<MapBatch>,
    pub changes: broadcast::Receiver<MapBatch>,
}

/// The operator as the gRPC services see it.
pub trait Api: Send + Sync + fmt::Debug + 'static {
    fn settings(&self) -> &Settings;

    /// Whether this replica leads, and who does if not.
    fn role(&self) -> Role;

    /// The cluster's Service addresses as the operator knows them now (HelloReply);
    /// `None` until their sources have been read in full.
    fn services(&self) -> Option<Arc<ServiceSet>>;

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

    /// Allocate for `caller`'s session, the agent's `allocation` (its number).
    fn allocate(
        &self,
        caller: &Caller,
        session: SessionId,
        allocation: AllocationId,
        labels: LabelSet,
    ) -> Result<Allocation, Refused>;

    /// Hello: the stream is accepted in the current term, and what the operator has
    /// to say to the agent goes to `tx` from now on. `addresses` are the node's own
    /// (the endpoint map's `remote-node` entries in embedded mode; in a cluster the
    /// Node object's are used instead).
    fn hello(
        &self,
        caller: &Caller,
        session: SessionId,
        addresses: Vec<IpAddr>,
        tx: AgentTx,
    ) -> Result<Connected, Refused>;

    fn upsert(&self, stream: &Connected, seq: u64, endpoint: Endpoint) -> Result<Applied, Refused>;

    fn delete(&self, stream: &Connected, seq: u64, key: &EndpointKey) -> Result<Applied, Refused>;

    /// A snapshot, with the highest of the agent's allocation numbers settled.
    fn snapshot(
        &self,
        stream: &Connected,
        seq: u64,
        endpoints: Vec<Endpoint>,
        settled: AllocationId,
    ) -> Result<Applied, Refused>;

    /// The stream ended.
    fn disconnect(&self, stream: &Connected);

    /// EndpointMap.Watch for `caller`'s current session: refused on a follower, or
    /// when the node has no such session.
    fn map_watch(&self, caller: &Caller, session: SessionId) -> Result<MapWatch, Refused>;

    /// The full map and the subscription to what follows, for a watch of `term`
    /// holding a permit of its semaphore. May encode the full map: call it where
    /// blocking is allowed.
    fn map_resync(&self, term: Term) -> Result<MapResync, Refused>;

    /// EndpointMap.Lookup: the claims of `ip` (`None`: nothing is known of it).
    fn map_lookup(&self, ip: IpAddr) -> Result<Option<MapLookup>, Refused>;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every EndpointSync stream's channel of messages to its agent allocates a
    /// block of 32 slots when the stream starts, idle or not.
    #[test]
    fn a_message_to_an_agent_fits_32_bytes() {
        assert!(size_of::<ToAgent>() <= 32, "{} bytes", size_of::<ToAgent>());
    }
}
