//! The allocator core: plain synchronous Rust, no I/O. Events in (Hello, deltas,
//! snapshots, Allocate, store results, ticks), effects out (store writes, Allocate
//! answers, messages to agents, Watch changes). Everything else is a shell around it.
//!
//! Reference counts are derived from each node's **view** (endpoint -> identity).
//! Deltas edit a view; a snapshot replaces it, so the latest snapshot of each node is
//! the truth and a lost delete costs one snapshot interval, never memory.
//!
//! The code is split by concept: [`sync`] (sessions, deltas, snapshots and the
//! re-adoption rules), [`alloc`] (Allocate and store results), [`gc`] (holds, node
//! liveness, release, delete, quarantine), [`read`] (what the services and metrics show).

mod alloc;
mod capacity;
mod config;
mod effects;
mod gc;
mod identities;
mod map;
mod nodes;
mod ops;
mod read;
mod sync;
mod time;
mod watch;

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque, hash_map};

use census_proto::domain::{AllocationId, IdentityId, NodeName};

pub use self::{
    config::{Config, Liveness},
    effects::{
        Accepted, AgentMsg, AllocError, Applied, CloseReason, ConnId, Effect, Priority, RequestId,
        SyncError, WatchChange,
    },
    map::{
        ClaimSource, MapChange, MapClaim, MapConflict, MapDelta, MapEntry, MapLookup, MapNode,
        MapNodeIndex, MapStats,
    },
    ops::{Loaded, StoreError, StoreEvent, StoreOp, StoredIdentity, Tombstone},
    read::{Counters, IdentityInfo, IdentityState, NodeInfo, Stats},
    time::Timestamp,
};
use self::{
    identities::{Identities, Phase, Tomb},
    nodes::{Hold, Node, Persisted},
};

/// The identity allocator. See the module documentation.
#[derive(Debug)]
pub struct Allocator {
    nodes: HashMap<NodeName, Node>,
    core: Core,
}

/// Everything but the nodes, so node state and the rest can be borrowed apart.
#[derive(Debug)]
struct Core {
    cfg: Config,
    ids: Identities,
    fx: Vec<Effect>,
    counters: Counters,
    gc: Gc,
    /// Nothing is released before this (after a restart, every node gets a node TTL
    /// to snapshot first). `None` once passed.
    protect_until: Option<Timestamp>,
    /// Nodes were known at start (from the store, or the cluster's Nodes): the search
    /// for new ids from the top ends once all have reported, not only with
    /// `protect_until`.
    known_at_start: bool,
    /// No new id is handed out before this (the store was empty at start): not to
    /// Allocate, nor to snapshot entries or rehomed endpoints.
    new_ids_after: Timestamp,
    /// Nodes with entries left pending by the adoption window; each is asked for a
    /// snapshot when it ends, which resolves them. Bounded by the nodes.
    deferred: BTreeSet<NodeName>,
    /// Nodes whose Node object was deleted, and when: their agents' Hellos are
    /// refused until the Node exists again, for at most the stale-view limit.
    gone: BTreeMap<NodeName, Timestamp>,
    next_conn: u64,
    /// The cluster-wide endpoint map, kept in step with the views (see
    /// [`map::view::View`]).
    map: map::EndpointIndex,
}

#[derive(Debug)]
struct Gc {
    /// The delete budget, in deletes.
    tokens: f64,
    refilled_at: Timestamp,
    inflight: usize,
    /// Identities whose references or holds dropped to zero since the last tick.
    unused: Vec<IdentityId>,
    /// Released identities in release order (entries are re-checked when popped).
    released: VecDeque<(Timestamp, IdentityId)>,
    /// Failed creates waiting for their retry time (re-checked when due). Kept apart
    /// from deletes, so a create never waits behind deletes the budget holds back.
    create_retries: BTreeSet<(Timestamp, IdentityId)>,
    delete_retries: BTreeSet<(Timestamp, IdentityId)>,
    /// Failed tombstone and node deletes, and failed re-writes of lost tombstones,
    /// retried with the next quarantine scan.
    cleanup_retries: Vec<StoreOp>,
    /// Quarantined ids whose lost tombstone is being written again (the binding the
    /// store creates on the way is census's own, not one to take in).
    rewriting: BTreeSet<IdentityId>,
    next_tomb_scan: Timestamp,
    /// The restart protection's node TTL has passed (it may still wait for nodes).
    past_node_ttl: bool,
    /// Allocate calls waiting for a write, by deadline (entries of calls answered
    /// since are dropped as they come up), and the identity each waits on.
    deadlines: BTreeSet<(Timestamp, RequestId)>,
    waiting: HashMap<RequestId, IdentityId>,
}

impl Allocator {
    /// A core over the store's contents, as the operator starts.
    ///
    /// Every loaded identity is held until `now + node_ttl`, so every known node can
    /// snapshot before GC may release anything; after that, the loaded identities
    /// are kept for as long as a known node has neither snapshotted nor had its view
    /// dropped (a partitioned agent keeps its view up to the stale-view limit in a
    /// cluster, so it keeps its identities that long across a restart too), while
    /// identities made since are collected as usual; if the store holds no identity
    /// at all, no new id is handed out for the adoption window either.
    pub fn new(cfg: Config, loaded: Loaded, now: Timestamp) -> Self {
        let mut ids = Identities::new(cfg.range);
        let mut fx = Vec::new();
        let store_was_empty = loaded.identities.is_empty();
        for stored in loaded.identities {
            if ids.get(stored.id).is_some() || ids.id_of(&stored.labels).is_some() {
                // A store never holds these (its index is unique); skip rather than trust.
                continue;
            }
            ids.insert(stored.id, stored.labels, Phase::Live);
            ids.mark_announced(stored.id);
            ids.mark_loaded(stored.id);
        }
        // What was loaded is the full list Watch subscribers start from, not news.
        ids.take_touched();
        // New ids go past the highest id the store kept: a store that lost some
        // bindings (not all, so no adoption window) most likely lost them below it,
        // and an agent that has not reported yet may still hold one of those.
        let kept = loaded
            .tombstones
            .iter()
            .map(|t| t.id)
            .chain(ids.ids())
            .filter(|&id| cfg.range.contains(id))
            .max();
        ids.start_after(kept);
        // Those it lost last follow the highest it kept: until every node known at
        // start has reported (or, none known, for the restart protection), new ids
        // come from the top.
        if kept.is_some() {
            ids.search_from_top();
        }
        for tomb in loaded.tombstones {
            let until = Timestamp::from_millis(tomb.until_ms);
            if until <= now || ids.get(tomb.id).is_some() {
                fx.push(Effect::Store {
                    op: StoreOp::DeleteTombstone { id: tomb.id },
                    priority: Priority::Gc,
                });
            } else {
                ids.add_tomb(
                    tomb.id,
                    Tomb {
                        labels_hash: tomb.labels_hash,
                        until,
                    },
                );
            }
        }
        let known_at_start = !loaded.nodes.is_empty();
        let nodes = loaded
            .nodes
            .into_iter()
            .map(|name| {
                let mut node = Node::new(now, Persisted::Yes);
                node.awaited = true;
                (name, node)
            })
            .collect();
        let new_ids_after = if store_was_empty {
            now.plus(cfg.adoption_window)
        } else {
            now
        };
        Self {
            nodes,
            core: Core {
                protect_until: Some(now.plus(cfg.node_ttl)),
                known_at_start,
                new_ids_after,
                deferred: BTreeSet::new(),
                gone: BTreeMap::new(),
                gc: Gc {
                    tokens: cfg.gc_burst,
                    refilled_at: now,
                    inflight: 0,
                    unused: Vec::new(),
                    released: VecDeque::new(),
                    create_retries: BTreeSet::new(),
                    delete_retries: BTreeSet::new(),
                    cleanup_retries: Vec::new(),
                    rewriting: BTreeSet::new(),
                    next_tomb_scan: now,
                    past_node_ttl: false,
                    deadlines: BTreeSet::new(),
                    waiting: HashMap::new(),
                },
                cfg,
                ids,
                fx,
                counters: Counters::default(),
                next_conn: 1,
                map: map::EndpointIndex::default(),
            },
        }
    }

    pub fn config(&self) -> &Config {
        &self.core.cfg
    }

    /// Takes the effects queued so far, in the order they were produced.
    pub fn drain_effects(&mut self) -> Vec<Effect> {
        self.core.flush_watch();
        std::mem::take(&mut self.core.fx)
    }
}

impl Core {
    /// Whether `id` can be taken as the binding of `labels` (see
    /// [`identities::Identities::can_adopt`]); not while its lost tombstone is being
    /// written again, whose write would end such a binding.
    fn can_take(&self, id: IdentityId, labels: &census_proto::labels::LabelSet) -> bool {
        self.ids.can_adopt(id, labels) && !self.gc.rewriting.contains(&id)
    }

    /// Whether the store's valid binding of `id` to `labels` can be taken in (see
    /// [`identities::Identities::can_take_stored`]); not while its lost tombstone is
    /// being written again.
    fn can_take_stored(&self, id: IdentityId, labels: &census_proto::labels::LabelSet) -> bool {
        self.ids.can_take_stored(id, labels) && !self.gc.rewriting.contains(&id)
    }

    /// Takes in the store's valid binding of `id` to `labels` (the caller checked
    /// [`Core::can_take_stored`] and that the labels are unbound here), as persisted.
    fn take_stored(&mut self, id: IdentityId, labels: census_proto::labels::LabelSet) {
        self.ids.unblock(id);
        self.ids.insert(id, labels, Phase::Live);
        self.counters.bindings_taken += 1;
    }

    fn store(&mut self, op: StoreOp, priority: Priority) {
        self.fx.push(Effect::Store { op, priority });
    }

    /// Whether new ids wait for agents to re-report theirs (an empty store at start).
    fn in_adoption_window(&self, now: Timestamp) -> bool {
        now < self.new_ids_after
    }

    fn create_op(&mut self, id: IdentityId) {
        if let Some(entry) = self.ids.get(id) {
            let labels = entry.labels.clone();
            self.store(StoreOp::CreateIdentity { id, labels }, Priority::Allocation);
        }
    }

    /// Makes a wanted identity usable again: a released one becomes live; one whose
    /// failed delete waits for a retry is re-created. Returns true if the binding is
    /// persisted and may be handed out now.
    fn wake(&mut self, id: IdentityId, now: Timestamp) -> bool {
        let Some(entry) = self.ids.get_mut(id) else {
            return false;
        };
        match entry.phase {
            Phase::Live => true,
            Phase::Released { .. } => {
                entry.phase = Phase::Live;
                true
            }
            Phase::Creating {
                inflight: false,
                attempt,
                retry_at,
            } => {
                // Someone is waiting: retry the failed create now rather than at its backoff.
                entry.phase = Phase::Creating {
                    inflight: true,
                    attempt,
                    retry_at,
                };
                self.create_op(id);
                false
            }
            Phase::Creating { inflight: true, .. } | Phase::Deleting { inflight: true, .. } => {
                false
            }
            Phase::Deleting {
                inflight: false, ..
            } => {
                // The failed delete may have happened after all: assert the binding again.
                entry.phase = Phase::Creating {
                    inflight: true,
                    attempt: 0,
                    retry_at: now,
                };
                self.create_op(id);
                false
            }
        }
    }

    fn inc(&mut self, id: IdentityId) {
        if let Some(entry) = self.ids.get_mut(id) {
            entry.refs += 1;
        }
    }

    fn dec(&mut self, id: IdentityId) {
        if let Some(entry) = self.ids.get_mut(id) {
            debug_assert!(entry.refs > 0, "refcount of {id} below zero");
            entry.refs = entry.refs.saturating_sub(1);
            if !entry.wanted() {
                self.gc.unused.push(id);
            }
        }
    }

    /// Holds `id` for `node`, for the agent's `allocation` (see [`Hold`]).
    fn add_hold(
        &mut self,
        node: &mut Node,
        id: IdentityId,
        allocation: AllocationId,
        now: Timestamp,
    ) {
        let expires = now.plus(self.cfg.hold_timeout);
        match node.holds.entry(id) {
            hash_map::Entry::Occupied(mut held) => {
                let hold = held.get_mut();
                *hold = hold.renewed(expires, allocation);
            }
            hash_map::Entry::Vacant(slot) => {
                slot.insert(Hold {
                    expires,
                    allocation,
                });
                if let Some(entry) = self.ids.get_mut(id) {
                    entry.holds += 1;
                }
            }
        }
    }

    /// Ends `node`'s holds of the allocations its agent says have settled up to
    /// `settled` (a snapshot's: what took their identities up is in the view, and
    /// nothing else needs them).
    fn end_settled_holds(&mut self, node: &mut Node, settled: AllocationId) {
        if !settled.is_some() || node.holds.is_empty() {
            return;
        }
        let before = node.holds.len();
        node.holds.retain(|&id, hold| {
            if !hold.settled_by(settled) {
                return true;
            }
            self.hold_gone(id);
            false
        });
        self.counters.holds_settled += (before - node.holds.len()) as u64;
    }

    /// Ends `node`'s hold on `id`, if it has one (an endpoint of its view took the id
    /// up).
    fn end_hold(&mut self, node: &mut Node, id: IdentityId) {
        if !node.holds.is_empty() && node.holds.remove(&id).is_some() {
            self.hold_gone(id);
        }
    }

    fn hold_gone(&mut self, id: IdentityId) {
        if let Some(entry) = self.ids.get_mut(id) {
            entry.holds = entry.holds.saturating_sub(1);
            if !entry.wanted() {
                self.gc.unused.push(id);
            }
        }
    }

    /// Records that Allocate call `req` waits on `id` from `now` on.
    fn wait_for(&mut self, req: RequestId, id: IdentityId, now: Timestamp) {
        self.gc
            .deadlines
            .insert((now.plus(self.cfg.allocate_deadline), req));
        self.gc.waiting.insert(req, id);
    }

    /// Answers Allocate call `req`.
    fn reply(&mut self, req: RequestId, result: Result<IdentityId, AllocError>) {
        self.gc.waiting.remove(&req);
        self.fx.push(Effect::Reply { req, result });
    }

    fn next_conn(&mut self) -> ConnId {
        let conn = ConnId(self.next_conn);
        self.next_conn += 1;
        conn
    }
}

/// Counts by `&'static str` cause, for metrics.
fn bump(map: &mut BTreeMap<&'static str, u64>, cause: &'static str) {
    *map.entry(cause).or_default() += 1;
}
