//! The shell around the allocator core: it owns the core behind a mutex, gives it the
//! time, and routes its effects: store writes to the writer queues, Allocate answers
//! to their callers, messages to agents' streams, changes to Watch subscribers.
//!
//! Effects are dispatched under the lock with non-blocking sends, so they leave in
//! the order the core produced them.
//!
//! In a cluster, every replica has a runtime, and only the leader's holds a real core:
//! a follower's core is empty, its reads come from the [`Replica`]'s read model, and it
//! refuses Allocate and Hello with the leader's address. Each change of role starts a
//! new **term**: what a stream or a writer did under an older term never reaches the
//! core of a newer one.

use std::{
    collections::HashMap,
    net::IpAddr,
    sync::Arc,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use census_proto::{
    convert::WireLimits,
    domain::{IdentityId, NodeName, SessionId},
    labels::{LabelFilter, LabelSet},
    pb,
};
use parking_lot::Mutex;
use tokio::sync::{broadcast, mpsc, oneshot, watch};
use tonic::Status;

use crate::{
    allocator::{
        Accepted, AgentMsg, AllocError, Allocator, CloseReason, Config, ConnId, Effect,
        IdentityInfo, Priority, RequestId, SyncError, Timestamp, WatchChange,
    },
    metrics::Metrics,
    replica::{AdmissionError, Leader, NotLeader, Replica, Role},
    store::{Loaded, StoreError, StoreEvent, StoreOp},
};

/// Wall-clock milliseconds that never go backwards within the process: a monotonic
/// clock anchored at the wall-clock time of start.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    start: Instant,
    start_ms: u64,
}

impl Clock {
    pub fn new() -> Self {
        let start_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        Self {
            start: Instant::now(),
            start_ms,
        }
    }

    pub fn now(&self) -> Timestamp {
        Timestamp::from_millis(self.start_ms + self.start.elapsed().as_millis() as u64)
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

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

/// The sending half of an agent's stream.
pub type AgentTx = mpsc::Sender<Result<pb::OperatorMessage, Status>>;

/// Capacity of each writer queue. The core bounds what is in flight (one op per
/// identity, a capped number of deletes), so a full queue means a stuck store.
const WRITER_QUEUE: usize = 65_536;
/// Watch changes buffered per subscriber before it is sent the full list again.
const WATCH_BUFFER: usize = 4096;

/// Why the runtime refused an Allocate or a Hello. State is unchanged.
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

/// A role of this replica: it changes on every promotion and demotion.
pub type Term = u64;

#[derive(Debug)]
struct Inner {
    alloc: Allocator,
    role: Role,
    term: Term,
    replies: HashMap<RequestId, oneshot::Sender<Result<IdentityId, AllocError>>>,
    streams: HashMap<ConnId, AgentTx>,
    writers: Option<Writers>,
    next_req: RequestId,
}

#[derive(Debug)]
struct Writers {
    allocation: mpsc::Sender<StoreOp>,
    gc: mpsc::Sender<StoreOp>,
}

/// The receiving ends of the writer queues, for the writer tasks.
#[derive(Debug)]
pub struct WriterQueues {
    pub allocation: mpsc::Receiver<StoreOp>,
    pub gc: mpsc::Receiver<StoreOp>,
}

#[derive(Debug)]
pub struct Runtime {
    inner: Mutex<Inner>,
    clock: Clock,
    watch: broadcast::Sender<WatchChange>,
    /// The current term, for Watch streams (they send the full list again when it changes).
    terms: watch::Sender<Term>,
    /// A cluster replica's read model and admission; `None` without a cluster.
    replica: Option<Replica>,
    pub settings: Settings,
    pub metrics: Metrics,
}

fn writer_queues() -> (Writers, WriterQueues) {
    let (alloc_tx, alloc_rx) = mpsc::channel(WRITER_QUEUE);
    let (gc_tx, gc_rx) = mpsc::channel(WRITER_QUEUE);
    (
        Writers {
            allocation: alloc_tx,
            gc: gc_tx,
        },
        WriterQueues {
            allocation: alloc_rx,
            gc: gc_rx,
        },
    )
}

impl Runtime {
    /// The runtime of a lone operator: it leads from the start, for good.
    pub fn new(
        alloc: Allocator,
        clock: Clock,
        settings: Settings,
        metrics: Metrics,
    ) -> (Arc<Self>, WriterQueues) {
        let (writers, queues) = writer_queues();
        let runtime = Arc::new(Self::build(
            alloc,
            Role::Leader,
            Some(writers),
            clock,
            settings,
            metrics,
            None,
        ));
        // Effects of loading (expired tombstones to delete) go out now.
        runtime.with(|_, _| ());
        (runtime, queues)
    }

    /// The runtime of a replica in a cluster: a follower until [`Runtime::lead`].
    pub fn new_replica(
        cfg: Config,
        clock: Clock,
        settings: Settings,
        metrics: Metrics,
        replica: Replica,
    ) -> Arc<Self> {
        let alloc = Allocator::new(cfg, Loaded::default(), clock.now());
        let role = Role::Follower { leader: None };
        Arc::new(Self::build(
            alloc,
            role,
            None,
            clock,
            settings,
            metrics,
            Some(replica),
        ))
    }

    fn build(
        alloc: Allocator,
        role: Role,
        writers: Option<Writers>,
        clock: Clock,
        settings: Settings,
        metrics: Metrics,
        replica: Option<Replica>,
    ) -> Self {
        let (watch, _) = broadcast::channel(WATCH_BUFFER);
        Self {
            inner: Mutex::new(Inner {
                alloc,
                role,
                term: 0,
                replies: HashMap::new(),
                streams: HashMap::new(),
                writers,
                next_req: 1,
            }),
            clock,
            watch,
            terms: watch::Sender::new(0),
            replica,
            settings,
            metrics,
        }
    }

    /// This replica leads from now on with `alloc` (built from the store): a new term.
    /// Returns the writer queues for the term's writers.
    pub fn lead(&self, alloc: Allocator) -> WriterQueues {
        let mut inner = self.inner.lock();
        let (writers, queues) = writer_queues();
        inner.alloc = alloc;
        inner.role = Role::Leader;
        inner.writers = Some(writers);
        inner.term += 1;
        self.terms.send_replace(inner.term);
        let now = self.clock.now();
        self.dispatch(&mut inner, now);
        queues
    }

    /// This replica stops leading: a new term. Agent streams are ended (they reconnect
    /// to the leader), Allocate calls waiting for the store are answered, the writer
    /// queues close and the core is dropped. The caller stops the old term's writers
    /// first, so none of their answers reaches a later core.
    pub fn follow(&self, leader: Option<Leader>) {
        let mut inner = self.inner.lock();
        let refusal = NotLeader {
            leader: leader.clone(),
        };
        for (_, tx) in inner.streams.drain() {
            let _ = tx.try_send(Err(not_leader_status(&refusal)));
        }
        for (_, tx) in inner.replies.drain() {
            let _ = tx.send(Err(AllocError::StoreUnavailable {
                cause: "not_leader",
            }));
        }
        inner.writers = None;
        let cfg = inner.alloc.config().clone();
        inner.alloc = Allocator::new(cfg, Loaded::default(), self.clock.now());
        if inner.role.is_leader() {
            inner.term += 1;
            self.terms.send_replace(inner.term);
        }
        inner.role = Role::Follower { leader };
    }

    /// A follower learnt who leads now.
    pub fn set_leader(&self, leader: Option<Leader>) {
        let mut inner = self.inner.lock();
        if let Role::Follower { leader: known } = &mut inner.role {
            *known = leader;
        }
    }

    pub fn role(&self) -> Role {
        self.inner.lock().role.clone()
    }

    /// Changes of term, for streams that must start over when the role changes.
    pub fn terms(&self) -> watch::Receiver<Term> {
        self.terms.subscribe()
    }

    /// A follower's refusal, if this replica does not lead.
    fn refusal(inner: &Inner) -> Option<NotLeader> {
        match &inner.role {
            Role::Leader => None,
            Role::Follower { leader } => Some(NotLeader {
                leader: leader.clone(),
            }),
        }
    }

    /// The read model, while this replica follows.
    fn follower_reads(&self) -> Option<&Replica> {
        let replica = self.replica.as_ref()?;
        (!self.inner.lock().role.is_leader()).then_some(replica)
    }

    pub fn identity(&self, id: IdentityId) -> Option<IdentityInfo> {
        match self.follower_reads() {
            Some(r) => r.reads.identity(id),
            None => self.read(|a| a.identity(id)),
        }
    }

    pub fn lookup(&self, labels: &LabelSet) -> Option<IdentityInfo> {
        match self.follower_reads() {
            Some(r) => r.reads.lookup(labels),
            None => self.read(|a| a.lookup(labels)),
        }
    }

    /// As [`Allocator::list`].
    pub fn list(
        &self,
        after: Option<IdentityId>,
        limit: usize,
        selector: Option<&LabelSet>,
        include_quarantined: bool,
    ) -> (Vec<IdentityInfo>, bool) {
        match self.follower_reads() {
            Some(r) => r.reads.list(after, limit, selector, include_quarantined),
            None => self.read(|a| a.list(after, limit, selector, include_quarantined)),
        }
    }

    /// Every binding announced to Watch subscribers, as it is now.
    pub fn bindings(&self) -> Vec<IdentityInfo> {
        match self.follower_reads() {
            Some(r) => r.reads.bindings(),
            None => self.read(Allocator::bindings),
        }
    }

    /// A change the store reported; it reaches the core only while this replica leads.
    /// Returns whether it was applied.
    pub fn store_event(&self, event: StoreEvent) -> bool {
        let mut inner = self.inner.lock();
        if !inner.role.is_leader() {
            return false;
        }
        let now = self.clock.now();
        match event {
            StoreEvent::BindingLost { id, labels } => inner.alloc.binding_lost(id, &labels, now),
            StoreEvent::BindingInvalid { id, found } => {
                inner.alloc.binding_invalid(id, found, now);
            }
            StoreEvent::BindingFound { id, labels } => inner.alloc.binding_found(id, &labels),
            StoreEvent::TombstoneLost { tombstone, labels } => {
                inner.alloc.tombstone_lost(tombstone, labels.as_ref(), now);
            }
        }
        self.dispatch(&mut inner, now);
        true
    }

    /// Runs `f` on the core if it is still the core of `term`.
    pub fn with_term<R>(
        &self,
        term: Term,
        f: impl FnOnce(&mut Allocator, Timestamp) -> R,
    ) -> Result<R, NotLeader> {
        let mut inner = self.inner.lock();
        if inner.term != term || !inner.role.is_leader() {
            return Err(Self::refusal(&inner).unwrap_or(NotLeader { leader: None }));
        }
        let now = self.clock.now();
        let r = f(&mut inner.alloc, now);
        self.dispatch(&mut inner, now);
        Ok(r)
    }

    pub fn now(&self) -> Timestamp {
        self.clock.now()
    }

    /// Runs `f` on the core at the current time, then dispatches its effects.
    pub fn with<R>(&self, f: impl FnOnce(&mut Allocator, Timestamp) -> R) -> R {
        let mut inner = self.inner.lock();
        let now = self.clock.now();
        let r = f(&mut inner.alloc, now);
        self.dispatch(&mut inner, now);
        r
    }

    /// Reads the core.
    pub fn read<R>(&self, f: impl FnOnce(&Allocator) -> R) -> R {
        f(&self.inner.lock().alloc)
    }

    pub fn tick(&self) {
        self.with(|alloc, now| alloc.tick(now));
    }

    /// Allocate: the identity now, or a receiver for the answer once it is persisted.
    pub fn allocate(
        &self,
        node: &NodeName,
        session: SessionId,
        labels: LabelSet,
    ) -> Result<Result<IdentityId, oneshot::Receiver<Result<IdentityId, AllocError>>>, Refused>
    {
        let mut inner = self.inner.lock();
        if let Some(refusal) = Self::refusal(&inner) {
            return Err(refusal.into());
        }
        let now = self.clock.now();
        let req = inner.next_req;
        inner.next_req += 1;
        let result = inner.alloc.allocate(req, node, session, labels, now);
        let answer = match result {
            Ok(Some(id)) => Ok(Ok(id)),
            Ok(None) => {
                let (tx, rx) = oneshot::channel();
                inner.replies.insert(req, tx);
                Ok(Err(rx))
            }
            Err(e) => Err(e.into()),
        };
        self.dispatch(&mut inner, now);
        answer
    }

    /// Hello from `peer`: registers the stream's sender under the new connection, in
    /// the current term.
    pub fn hello(
        &self,
        node: &NodeName,
        session: SessionId,
        peer: Option<IpAddr>,
        tx: AgentTx,
    ) -> Result<(Accepted, Term), Refused> {
        if let Some(replica) = &self.replica {
            replica.admission.admit(node, peer)?;
        }
        let mut inner = self.inner.lock();
        if let Some(refusal) = Self::refusal(&inner) {
            return Err(refusal.into());
        }
        let now = self.clock.now();
        let accepted = inner.alloc.hello(node, session, now);
        if let Ok(acc) = &accepted {
            inner.streams.insert(acc.conn, tx);
        }
        self.dispatch(&mut inner, now);
        let term = inner.term;
        accepted.map(|a| (a, term)).map_err(Refused::from)
    }

    /// A stream of `term` ended.
    pub fn disconnect(&self, term: Term, node: &NodeName, conn: ConnId) {
        let mut inner = self.inner.lock();
        if inner.term != term {
            return;
        }
        inner.streams.remove(&conn);
        inner.alloc.disconnect(node, conn);
        let now = self.clock.now();
        self.dispatch(&mut inner, now);
    }

    /// The writers' answers. A follower has no writes in flight: answers that arrive
    /// anyway (from a term that ended) are dropped.
    pub fn store_results(
        &self,
        results: impl IntoIterator<Item = (StoreOp, Result<(), StoreError>)>,
    ) {
        let mut inner = self.inner.lock();
        if !inner.role.is_leader() {
            return;
        }
        let now = self.clock.now();
        for (op, result) in results {
            inner.alloc.store_result(op, result, now);
        }
        self.dispatch(&mut inner, now);
    }

    /// Subscribes to identity changes. Subscribe before reading the full list, so no
    /// change falls between the two; and watch [`Runtime::terms`]: a follower's changes
    /// come from its read model, a leader's from its core.
    pub fn subscribe(&self) -> broadcast::Receiver<WatchChange> {
        match self.follower_reads() {
            Some(r) => r.reads.subscribe(),
            None => self.watch.subscribe(),
        }
    }

    /// Ends every agent stream and closes the writer queues (they drain, then stop).
    pub fn shut_down(&self) {
        let mut inner = self.inner.lock();
        for (_, tx) in inner.streams.drain() {
            let _ = tx.try_send(Err(Status::unavailable(
                "the operator is shutting down; reconnect",
            )));
        }
        inner.writers = None;
        for (_, tx) in inner.replies.drain() {
            let _ = tx.send(Err(AllocError::StoreUnavailable { cause: "shutdown" }));
        }
    }

    fn dispatch(&self, inner: &mut Inner, now: Timestamp) {
        loop {
            let effects = inner.alloc.drain_effects();
            if effects.is_empty() {
                return;
            }
            for effect in effects {
                match effect {
                    Effect::Store { op, priority } => {
                        let queue = inner.writers.as_ref().map(|w| match priority {
                            Priority::Allocation => &w.allocation,
                            Priority::Gc => &w.gc,
                        });
                        let sent = match queue {
                            Some(q) => q.try_send(op).map_err(|e| match e {
                                mpsc::error::TrySendError::Full(op) => (op, "queue_full"),
                                mpsc::error::TrySendError::Closed(op) => (op, "shutdown"),
                            }),
                            None => Err((op, "shutdown")),
                        };
                        if let Err((op, cause)) = sent {
                            // The core retries with backoff, like any failed write.
                            let err = StoreError::Unavailable {
                                cause,
                                detail: "the writer queue refused the op".into(),
                            };
                            inner.alloc.store_result(op, Err(err), now);
                        }
                    }
                    Effect::Reply { req, result } => {
                        if let Some(tx) = inner.replies.remove(&req) {
                            let _ = tx.send(result);
                        }
                    }
                    Effect::Agent { node, conn, msg } => self.to_agent(inner, &node, conn, msg),
                    Effect::Watch(change) => {
                        let _ = self.watch.send(change);
                    }
                }
            }
        }
    }

    fn to_agent(&self, inner: &mut Inner, node: &NodeName, conn: ConnId, msg: AgentMsg) {
        use pb::operator_message::Body;
        let Some(tx) = inner.streams.get(&conn) else {
            return;
        };
        let item = match msg {
            AgentMsg::Rebind { key, identity } => {
                self.metrics.rebinds_sent.inc();
                Ok(pb::OperatorMessage {
                    body: Some(Body::Rebind(pb::Rebind {
                        namespace: key.namespace().to_owned(),
                        name: key.name().to_owned(),
                        identity: identity.get(),
                    })),
                })
            }
            AgentMsg::SnapshotNow => Ok(pb::OperatorMessage {
                body: Some(Body::SnapshotRequest(pb::SnapshotRequest {})),
            }),
            AgentMsg::Close(reason) => {
                let status = match reason {
                    CloseReason::Replaced { by } => Status::failed_precondition(format!(
                        "node {node}: this stream was replaced by a newer stream (session {by})"
                    )),
                    CloseReason::Expired => Status::failed_precondition(format!(
                        "node {node}: silent longer than the node TTL; its view was dropped: reconnect and send a snapshot"
                    )),
                    CloseReason::NodeGone => {
                        Status::failed_precondition(format!("node {node} is gone from the cluster"))
                    }
                };
                let _ = tx.try_send(Err(status));
                inner.streams.remove(&conn);
                return;
            }
        };
        if tx.try_send(item).is_err() {
            // The agent is not reading. Rebinds are sent again after its next snapshot.
            self.metrics.agent_messages_dropped.inc();
        }
    }
}

/// Feeds a store's [`StoreEvent`]s to the core (while this replica leads) until the
/// store stops sending.
pub async fn feed_store_events(runtime: Arc<Runtime>, mut events: mpsc::Receiver<StoreEvent>) {
    while let Some(event) = events.recv().await {
        runtime.store_event(event);
    }
}

/// How a follower ends an agent stream or refuses a call: UNAVAILABLE naming the
/// leader, with its address also in the `census-leader` metadata for clients.
pub fn not_leader_status(refusal: &NotLeader) -> Status {
    let mut status = Status::unavailable(refusal.to_string());
    if let Some(address) = refusal.leader.as_ref().and_then(|l| l.address.as_deref())
        && let Ok(value) = address.parse()
    {
        status.metadata_mut().insert(LEADER_METADATA, value);
    }
    status
}

/// The gRPC metadata key with the leader's address, on a follower's UNAVAILABLE.
pub const LEADER_METADATA: &str = "census-leader";

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use census_proto::domain::IdRange;

    use super::*;
    use crate::replica::{Admission, ReadModel};

    /// A read model with one binding, and an admission that lets everyone in.
    #[derive(Debug)]
    struct Fixed(IdentityId, LabelSet, broadcast::Sender<WatchChange>);

    impl ReadModel for Fixed {
        fn identity(&self, id: IdentityId) -> Option<IdentityInfo> {
            (id == self.0).then(|| IdentityInfo {
                id,
                labels: Some(self.1.clone()),
                state: crate::allocator::IdentityState::Live,
                refs: 0,
                holds: 0,
            })
        }
        fn lookup(&self, labels: &LabelSet) -> Option<IdentityInfo> {
            (*labels == self.1).then(|| self.identity(self.0)).flatten()
        }
        fn list(
            &self,
            _: Option<IdentityId>,
            _: usize,
            _: Option<&LabelSet>,
            _: bool,
        ) -> (Vec<IdentityInfo>, bool) {
            (self.identity(self.0).into_iter().collect(), false)
        }
        fn bindings(&self) -> Vec<IdentityInfo> {
            self.identity(self.0).into_iter().collect()
        }
        fn subscribe(&self) -> broadcast::Receiver<WatchChange> {
            self.2.subscribe()
        }
    }

    #[derive(Debug)]
    struct Anyone;

    impl Admission for Anyone {
        fn admit(&self, _: &NodeName, _: Option<IpAddr>) -> Result<(), AdmissionError> {
            Ok(())
        }
    }

    fn settings() -> Settings {
        Settings {
            filter: LabelFilter::default(),
            wire: WireLimits::default(),
            snapshot_interval: Duration::from_secs(30),
            max_message_bytes: 4 << 20,
            store_kind: "test",
        }
    }

    #[tokio::test]
    async fn roles_change_in_terms_and_followers_refuse_writes()
    -> Result<(), Box<dyn std::error::Error>> {
        let web: LabelSet = "k8s:app=web".parse()?;
        let stored = IdentityId::new(4000).ok_or("id")?;
        let cfg = Config {
            range: IdRange::new(256, 300)?,
            adoption_window: Duration::ZERO,
            ..Config::default()
        };
        let replica = Replica {
            reads: Arc::new(Fixed(stored, web.clone(), broadcast::channel(4).0)),
            admission: Arc::new(Anyone),
        };
        let runtime = Runtime::new_replica(
            cfg.clone(),
            Clock::new(),
            settings(),
            Metrics::default(),
            replica,
        );
        let node = NodeName::new("n1")?;
        let session = SessionId {
            start_time_ns: 1,
            nonce: 1,
        };
        let peer = Some(IpAddr::from(Ipv4Addr::LOCALHOST));

        // A follower: reads from the read model, writes refused naming the leader.
        assert_eq!(runtime.lookup(&web).map(|i| i.id), Some(stored));
        let leader = Leader {
            name: "op-b".into(),
            address: Some("10.0.0.2:9460".into()),
        };
        runtime.set_leader(Some(leader.clone()));
        let (tx, _rx) = mpsc::channel(8);
        match runtime.hello(&node, session, peer, tx) {
            Err(Refused::NotLeader(NotLeader { leader: Some(l) })) => assert_eq!(l, leader),
            other => return Err(format!("expected NotLeader, got {other:?}").into()),
        }
        assert!(matches!(
            runtime.allocate(&node, session, web.clone()),
            Err(Refused::NotLeader(_))
        ));

        // Leading: the core answers; its bindings, not the read model's.
        let mut terms = runtime.terms();
        let _queues = runtime.lead(Allocator::new(cfg, Loaded::default(), runtime.now()));
        assert!(terms.has_changed()?);
        let _ = terms.borrow_and_update();
        let (tx, mut rx) = mpsc::channel(8);
        let (accepted, term) = runtime.hello(&node, session, peer, tx)?;
        assert!(runtime.lookup(&web).is_none());
        assert!(runtime.with_term(term, |a, _| a.node(&node).is_some())?);

        // Stepping down: the stream is ended naming the leader, the old term is over,
        // and late store answers are dropped.
        runtime.follow(Some(leader));
        assert!(terms.has_changed()?);
        let ended = rx.recv().await.ok_or("no message")?;
        let status = ended.err().ok_or("expected the stream to end")?;
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert_eq!(
            status
                .metadata()
                .get(LEADER_METADATA)
                .and_then(|v| v.to_str().ok()),
            Some("10.0.0.2:9460")
        );
        assert!(runtime.with_term(term, |_, _| ()).is_err());
        runtime.disconnect(term, &node, accepted.conn);
        runtime.store_results([(
            StoreOp::DeleteTombstone { id: stored },
            Err(StoreError::Unavailable {
                cause: "late",
                detail: String::new(),
            }),
        )]);
        assert_eq!(runtime.read(|a| a.counters().store_failures.len()), 0);
        assert_eq!(runtime.lookup(&web).map(|i| i.id), Some(stored));
        Ok(())
    }
}
