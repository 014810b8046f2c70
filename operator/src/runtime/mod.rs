//! The shell around the allocator core: it owns the core behind a mutex, gives it the
//! time ([`Clock`]), and routes its effects: store writes to the writer queues,
//! Allocate answers to their callers, messages to agents' streams, changes to Watch
//! subscribers. It implements [`crate::api::Api`] for the gRPC layer in domain types;
//! it knows nothing of the wire.
//!
//! Effects are dispatched under the lock with non-blocking sends, so they leave in
//! the order the core produced them. Every call takes the lock once.
//!
//! In a cluster, every replica has a runtime, and only the leader's holds a real core:
//! a follower's core is empty, its reads come from the [`Replica`]'s read model, and it
//! refuses Allocate and Hello naming the leader. Each change of role starts a new
//! **term**: what a stream or a writer did under an older term never reaches the core
//! of a newer one.
//!
//! The code is split by concept: `term` (role and term), `dispatch` (effects),
//! `reads` (the leader's core or the follower's read model), `service` (the calls of
//! the gRPC layer), `feed` (what comes back from the store), `map` (the cluster-wide
//! endpoint map for watchers), `collector` (scrape-time metrics) and `clock`.

mod clock;
mod collector;
mod dispatch;
mod feed;
mod map;
mod reads;
mod service;
mod term;
#[cfg(test)]
mod tests;

use std::{collections::HashMap, sync::Arc};

use census_proto::domain::ServiceSet;
use parking_lot::Mutex;
use tokio::sync::{broadcast, mpsc, oneshot, watch};

pub use self::{clock::Clock, collector::CoreCollector, feed::feed_store_events, map::MapConfig};
use crate::{
    allocator::{AllocError, Allocator, Config, ConnId, RequestId, Timestamp, WatchChange},
    api::{AgentTx, Allocated, Settings, StreamEnd, Term, ToAgent},
    metrics::Metrics,
    replica::{Replica, Role},
    store::{Loaded, StoreOp},
    writer::WriterQueues,
};

/// Watch changes buffered per subscriber before it is sent the full list again.
const WATCH_BUFFER: usize = 4096;

#[derive(Debug)]
struct Inner {
    alloc: Allocator,
    role: Role,
    term: Term,
    replies: HashMap<RequestId, oneshot::Sender<Result<Allocated, AllocError>>>,
    streams: HashMap<ConnId, AgentTx>,
    writers: Option<Writers>,
    next_req: RequestId,
    /// The endpoint map's last batch version, taken with the core's delta.
    map_version: u64,
    /// The cluster's Service addresses (not the core's: every replica has them,
    /// whatever its role), `None` until their sources have been read in full, and
    /// whether they changed since the last map batch.
    services: Option<Arc<ServiceSet>>,
    services_changed: bool,
}

/// The sending ends of the current term's writer queues.
#[derive(Debug)]
struct Writers {
    allocation: mpsc::Sender<StoreOp>,
    gc: mpsc::Sender<StoreOp>,
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
    settings: Settings,
    pub metrics: Metrics,
    /// The endpoint map's watchers: set once it is served.
    map: map::Hub,
}

impl Runtime {
    /// The runtime of a lone operator: it leads from the start, for good. Returns the
    /// queues for its writers (`crate::writer::spawn`); must run inside a tokio
    /// runtime, which takes the writers' outcomes back to the core.
    pub fn new(
        alloc: Allocator,
        clock: Clock,
        settings: Settings,
        metrics: Metrics,
    ) -> (Arc<Self>, WriterQueues) {
        let runtime = Arc::new(Self::build(
            alloc,
            Role::Leader,
            clock,
            settings,
            metrics,
            None,
        ));
        let queues = {
            let mut inner = runtime.inner.lock();
            let queues = runtime.writer_queues(&mut inner);
            // Effects of loading (expired tombstones to delete) go out now.
            let now = runtime.clock.now();
            runtime.dispatch(&mut inner, now);
            queues
        };
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
            clock,
            settings,
            metrics,
            Some(replica),
        ))
    }

    fn build(
        alloc: Allocator,
        role: Role,
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
                writers: None,
                next_req: 1,
                map_version: 0,
                services: None,
                services_changed: false,
            }),
            clock,
            watch,
            terms: watch::Sender::new(0),
            replica,
            settings,
            metrics,
            map: map::Hub::new(),
        }
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

    /// The cluster's Service addresses are `services` from now on: HelloReplies
    /// carry them, and the endpoint map's next batch if they changed.
    pub fn set_services(&self, services: ServiceSet) -> bool {
        let mut inner = self.inner.lock();
        if inner.services.as_deref() == Some(&services) {
            return false;
        }
        inner.services = Some(Arc::new(services));
        inner.services_changed = true;
        true
    }

    /// The cluster's Service addresses as they are now; `None` until their sources
    /// have been read in full (agents are then told nothing, and keep theirs).
    pub fn services(&self) -> Option<Arc<ServiceSet>> {
        self.inner.lock().services.clone()
    }

    pub fn tick(&self) {
        self.with(|alloc, now| alloc.tick(now));
    }

    /// Ends every agent stream and closes the writer queues (they drain, then stop).
    pub fn shut_down(&self) {
        let mut inner = self.inner.lock();
        for (_, tx) in inner.streams.drain() {
            let _ = tx.try_send(ToAgent::End(StreamEnd::ShuttingDown));
        }
        inner.writers = None;
        for (_, tx) in inner.replies.drain() {
            let _ = tx.send(Err(AllocError::StoreUnavailable { cause: "shutdown" }));
        }
    }
}
