//! The shell around the allocator core: it owns the core behind a mutex, gives it the
//! time, and routes its effects: store writes to the writer queues, Allocate answers
//! to their callers, messages to agents' streams, changes to Watch subscribers.
//!
//! Effects are dispatched under the lock with non-blocking sends, so they leave in
//! the order the core produced them.

use std::{
    collections::HashMap,
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
use tokio::sync::{broadcast, mpsc, oneshot};
use tonic::Status;

use crate::{
    allocator::{
        Accepted, AgentMsg, AllocError, Allocator, CloseReason, ConnId, Effect, Priority,
        RequestId, SyncError, Timestamp, WatchChange,
    },
    metrics::Metrics,
    store::{StoreError, StoreOp},
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

#[derive(Debug)]
struct Inner {
    alloc: Allocator,
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
    pub settings: Settings,
    pub metrics: Metrics,
}

impl Runtime {
    pub fn new(
        alloc: Allocator,
        clock: Clock,
        settings: Settings,
        metrics: Metrics,
    ) -> (Arc<Self>, WriterQueues) {
        let (alloc_tx, alloc_rx) = mpsc::channel(WRITER_QUEUE);
        let (gc_tx, gc_rx) = mpsc::channel(WRITER_QUEUE);
        let (watch, _) = broadcast::channel(WATCH_BUFFER);
        let runtime = Arc::new(Self {
            inner: Mutex::new(Inner {
                alloc,
                replies: HashMap::new(),
                streams: HashMap::new(),
                writers: Some(Writers {
                    allocation: alloc_tx,
                    gc: gc_tx,
                }),
                next_req: 1,
            }),
            clock,
            watch,
            settings,
            metrics,
        });
        // Effects of loading (expired tombstones to delete) go out now.
        runtime.with(|_, _| ());
        (
            runtime,
            WriterQueues {
                allocation: alloc_rx,
                gc: gc_rx,
            },
        )
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
    ) -> Result<Result<IdentityId, oneshot::Receiver<Result<IdentityId, AllocError>>>, AllocError>
    {
        let mut inner = self.inner.lock();
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
            Err(e) => Err(e),
        };
        self.dispatch(&mut inner, now);
        answer
    }

    /// Hello: registers the stream's sender under the new connection.
    pub fn hello(
        &self,
        node: &NodeName,
        session: SessionId,
        tx: AgentTx,
    ) -> Result<Accepted, SyncError> {
        let mut inner = self.inner.lock();
        let now = self.clock.now();
        let accepted = inner.alloc.hello(node, session, now);
        if let Ok(acc) = &accepted {
            inner.streams.insert(acc.conn, tx);
        }
        self.dispatch(&mut inner, now);
        accepted
    }

    /// A stream ended.
    pub fn disconnect(&self, node: &NodeName, conn: ConnId) {
        let mut inner = self.inner.lock();
        inner.streams.remove(&conn);
        inner.alloc.disconnect(node, conn);
        let now = self.clock.now();
        self.dispatch(&mut inner, now);
    }

    /// The writers' answers.
    pub fn store_results(
        &self,
        results: impl IntoIterator<Item = (StoreOp, Result<(), StoreError>)>,
    ) {
        let mut inner = self.inner.lock();
        let now = self.clock.now();
        for (op, result) in results {
            inner.alloc.store_result(op, result, now);
        }
        self.dispatch(&mut inner, now);
    }

    /// Subscribes to identity changes. Subscribe before reading the full list, so no
    /// change falls between the two.
    pub fn subscribe(&self) -> broadcast::Receiver<WatchChange> {
        self.watch.subscribe()
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
