//! Time-driven work: holds expire, silent nodes go stale or are dropped, unused
//! identities are released and, after the grace period, deleted from the store within
//! a budget, failed writes are retried with backoff, and quarantine ends.
//!
//! Garbage collection is per item: one identity's failure never stops the pass.

use std::time::Duration;

use census_proto::domain::NodeName;

use super::{
    AgentMsg, AllocError, Allocator, CloseReason, Effect, Liveness, Priority, StoreOp, SyncError,
    Timestamp,
    capacity::{oversized, room_for, shrink_map},
    identities::{Phase, Waiter},
    nodes::{Node, Persisted},
};

/// How often quarantine tombstones are scanned for expiry.
const TOMB_SCAN_EVERY: Duration = Duration::from_secs(1);

impl Allocator {
    /// Advances time to `now`.
    pub fn tick(&mut self, now: Timestamp) {
        self.end_adoption_window(now);
        self.end_search_from_top();
        self.expire_calls(now);
        self.forget_gone(now);
        self.expire_holds(now);
        self.check_liveness(now);
        self.release_unused(now);
        self.pump_gc(now);
        self.end_quarantine(now);
        self.persist_nodes();
    }

    /// Spends the delete budget on due retries and released identities. Called on
    /// every tick and whenever a delete completes, so GC runs as fast as the budget
    /// and the store allow, not at the tick rate.
    pub(super) fn pump_gc(&mut self, now: Timestamp) {
        self.refill_budget(now);
        self.retry_due(now);
        self.delete_released(now);
    }

    /// New ids follow the cursor again once every node known at start has reported
    /// or been dropped (every id an agent held is known by then), or, if none was
    /// known, when the restart protection ends.
    fn end_search_from_top(&mut self) {
        if !self.core.ids.searching_from_top() {
            return;
        }
        let reported = self.core.known_at_start && !self.nodes.values().any(|n| n.awaited);
        if reported || self.core.protect_until.is_none() {
            self.core.ids.search_after_cursor();
        }
    }

    /// Once the adoption window has passed, every node with entries it left pending
    /// is asked for a snapshot now, which gives them their ids.
    fn end_adoption_window(&mut self, now: Timestamp) {
        if self.core.deferred.is_empty() || self.core.in_adoption_window(now) {
            return;
        }
        for name in std::mem::take(&mut self.core.deferred) {
            if let Some(conn) = self.nodes.get(&name).and_then(|n| n.conn) {
                self.core.fx.push(Effect::Agent {
                    node: name,
                    conn,
                    msg: AgentMsg::SnapshotNow,
                });
            }
        }
    }

    /// The cluster's Nodes when a new core starts (a new leader): each is waited for
    /// by the restart protection like a node known from the store (its agent may be
    /// partitioned away, still using its identities), until its first snapshot, its
    /// Node's deletion or the stale-view limit. Not shown until its agent says Hello.
    pub fn await_nodes(&mut self, names: impl IntoIterator<Item = NodeName>, now: Timestamp) {
        if self.core.protect_until.is_none() {
            return;
        }
        for name in names {
            self.core.known_at_start = true;
            self.nodes.entry(name).or_insert_with(|| {
                let mut node = Node::new(now, Persisted::Yes);
                node.awaited = true;
                node.shadow = true;
                node
            });
        }
    }

    /// The Node object of `name` is gone: its view, holds and stream go with it.
    /// Its addresses leave the endpoint map too, whether or not its agent ever said
    /// Hello.
    /// Its agent's Hello is refused from now on (it would make the node again and
    /// keep it to the stale-view limit), until the Node exists again
    /// ([`Allocator::set_node_addresses`]) or for the stale-view limit at most.
    pub fn node_gone(&mut self, name: &NodeName, now: Timestamp) {
        self.core.map.clear_addresses(name);
        self.drop_node(name, CloseReason::NodeGone);
        self.core.gone.insert(name.clone(), now);
    }

    /// Forgets deleted Nodes after the stale-view limit (node TTL embedded).
    fn forget_gone(&mut self, now: Timestamp) {
        let keep = match self.core.cfg.liveness {
            Liveness::Cluster { stale_view_limit } => stale_view_limit,
            Liveness::Embedded => self.core.cfg.node_ttl,
        };
        self.core
            .gone
            .retain(|_, &mut deleted| now.since(deleted) < keep);
    }

    /// Allocate calls past their deadline are answered with an error (the caller
    /// retries), whatever they wait for: no call waits for ever on an answer that
    /// is late or never comes. The write itself is not made again while it may still
    /// be on its way: a second create landing after a delete of the identity would
    /// bind it again behind the core's back.
    fn expire_calls(&mut self, now: Timestamp) {
        let core = &mut self.core;
        while let Some(&(at, req)) = core.gc.deadlines.first() {
            if at > now {
                break;
            }
            core.gc.deadlines.pop_first();
            let Some(id) = core.gc.waiting.remove(&req) else {
                continue;
            };
            let mut waited = None;
            if let Some(entry) = core.ids.get_mut(id) {
                entry.waiters.retain(|w| match w {
                    Waiter::Request { req: r, node, .. } if *r == req => {
                        waited = Some(node.clone());
                        false
                    }
                    _ => true,
                });
                if !entry.wanted() {
                    core.gc.unused.push(id);
                }
            }
            if let Some(node) = waited.and_then(|n| self.nodes.get_mut(&n)) {
                node.pending = node.pending.saturating_sub(1);
            }
            core.counters.allocations_expired += 1;
            core.reply(req, Err(AllocError::StoreUnavailable { cause: "deadline" }));
        }
        shrink_map(&mut core.gc.waiting);
    }

    fn refill_budget(&mut self, now: Timestamp) {
        let gc = &mut self.core.gc;
        let elapsed = now.since(gc.refilled_at).as_secs_f64();
        gc.tokens =
            (gc.tokens + elapsed * self.core.cfg.gc_rate).min(self.core.cfg.gc_burst.max(1.0));
        gc.refilled_at = now;
    }

    fn expire_holds(&mut self, now: Timestamp) {
        let core = &mut self.core;
        for node in self.nodes.values_mut() {
            if node.holds.is_empty() {
                // Holds also end when their id shows up in the view, which leaves
                // the map empty with the capacity of the burst that filled it.
                shrink_map(&mut node.holds);
                continue;
            }
            let before = node.holds.len();
            node.holds.retain(|&id, hold| {
                if hold.expires > now {
                    return true;
                }
                core.hold_gone(id);
                false
            });
            core.counters.holds_expired += (before - node.holds.len()) as u64;
            shrink_map(&mut node.holds);
        }
    }

    fn check_liveness(&mut self, now: Timestamp) {
        let ttl = self.core.cfg.node_ttl;
        let mut dropped = Vec::new();
        for (name, node) in self.nodes.iter_mut() {
            let silent_until = node.last_heard.plus(ttl);
            if now < silent_until {
                continue;
            }
            match self.core.cfg.liveness {
                Liveness::Embedded => dropped.push(name.clone()),
                Liveness::Cluster { stale_view_limit } => {
                    let since = *node.stale_since.get_or_insert(silent_until);
                    if now.since(since) >= stale_view_limit {
                        dropped.push(name.clone());
                    }
                }
            }
        }
        for name in dropped {
            self.drop_node(&name, CloseReason::Expired);
        }
    }

    fn drop_node(&mut self, name: &NodeName, reason: CloseReason) {
        let Some(mut node) = self.nodes.remove(name) else {
            return;
        };
        let core = &mut self.core;
        core.counters.nodes_dropped += 1;
        for (_, entry) in node.view.drain(&mut core.map, name) {
            core.dec(entry.id);
        }
        if core.cfg.liveness == Liveness::Embedded {
            // Embedded, the addresses came with the agent's Hello: they go with its
            // view. In a cluster they are the Node object's, and stay while it does.
            core.map.clear_addresses(name);
        }
        for (id, _) in node.holds {
            core.hold_gone(id);
        }
        if let Some(conn) = node.conn {
            core.fx.push(Effect::Agent {
                node: name.clone(),
                conn,
                msg: AgentMsg::Close(reason),
            });
        }
        if node.pending > 0 {
            // Allocations of the node still waiting for the store are answered now.
            for (req, _) in core.ids.take_requests_of(name) {
                let err = AllocError::Sync(SyncError::NoSession { node: name.clone() });
                core.reply(req, Err(err));
            }
        }
        // On the queue of PutNode, so the writes of one node land in the order they
        // were made: a node that comes straight back is not deleted after its put.
        core.store(
            StoreOp::DeleteNode { node: name.clone() },
            Priority::Allocation,
        );
        shrink_map(&mut self.nodes);
    }

    /// Identities that lost their last reference or hold become released (not during
    /// the protection window after a start, which ends with a full pass).
    fn release_unused(&mut self, now: Timestamp) {
        let core = &mut self.core;
        // A known node that has not reported since the start keeps what was loaded
        // until it does or its view would be dropped (it is, then).
        let mut waiting = false;
        if let Some(until) = core.protect_until {
            if now < until {
                core.gc.unused.clear();
                return;
            }
            waiting = self.nodes.values().any(|n| n.awaited);
            if !waiting {
                core.protect_until = None;
            }
            if !waiting || !core.gc.past_node_ttl {
                // A full pass when the node TTL ends, and again when the wait does.
                core.gc.past_node_ttl = true;
                core.gc.unused = core.ids.ids().collect();
            }
        }
        let unused = std::mem::take(&mut core.gc.unused);
        for id in unused {
            if let Some(entry) = core.ids.get_mut(id)
                && entry.phase == Phase::Live
                && !entry.wanted()
                && !(waiting && entry.loaded)
            {
                entry.phase = Phase::Released { since: now };
                core.gc.released.push_back((now, id));
                core.counters.released += 1;
            }
        }
        core.gc.unused.shrink_to(64);
    }

    /// Failed writes whose backoff ended: creates are retried at once (they are
    /// allocation writes), deletes spend from the budget like any delete.
    fn retry_due(&mut self, now: Timestamp) {
        while let Some(&(at, id)) = self.core.gc.create_retries.first() {
            if at > now {
                break;
            }
            self.core.gc.create_retries.pop_first();
            if let Some(entry) = self.core.ids.get_mut(id)
                && let Phase::Creating {
                    inflight: false,
                    attempt,
                    retry_at,
                } = entry.phase
                && retry_at == at
            {
                entry.phase = Phase::Creating {
                    inflight: true,
                    attempt,
                    retry_at,
                };
                self.core.create_op(id);
            }
        }
        while let Some(&(at, id)) = self.core.gc.delete_retries.first() {
            if at > now {
                break;
            }
            let due = self.core.ids.get(id).and_then(|e| match e.phase {
                Phase::Deleting {
                    inflight: false,
                    attempt,
                    retry_at,
                } if retry_at == at => Some((attempt, e.wanted())),
                _ => None,
            });
            match due {
                // Wanted again meanwhile: the binding is asserted again instead.
                Some((_, true)) => {
                    self.core.gc.delete_retries.pop_first();
                    self.core.wake(id, now);
                }
                Some((attempt, false)) => {
                    if !self.delete_allowed() {
                        break;
                    }
                    self.core.gc.delete_retries.pop_first();
                    self.issue_delete(id, attempt, now);
                }
                None => {
                    self.core.gc.delete_retries.pop_first();
                }
            }
        }
    }

    fn delete_allowed(&self) -> bool {
        self.core.gc.tokens >= 1.0 && self.core.gc.inflight < self.core.cfg.max_inflight_deletes
    }

    /// Released identities past the grace period are deleted, oldest first.
    fn delete_released(&mut self, now: Timestamp) {
        let grace = self.core.cfg.grace;
        while let Some(&(since, id)) = self.core.gc.released.front() {
            let Some(entry) = self
                .core
                .ids
                .get_mut(id)
                .filter(|e| e.phase == Phase::Released { since })
            else {
                self.core.gc.released.pop_front();
                continue;
            };
            if entry.wanted() {
                entry.phase = Phase::Live;
                self.core.gc.released.pop_front();
                continue;
            }
            if now.since(since) < grace || !self.delete_allowed() {
                break;
            }
            self.core.gc.released.pop_front();
            self.issue_delete(id, 0, now);
        }
        let released = &mut self.core.gc.released;
        if oversized(released.len(), released.capacity(), 64) {
            released.shrink_to(room_for(released.len()));
        }
    }

    fn end_quarantine(&mut self, now: Timestamp) {
        let core = &mut self.core;
        if now < core.gc.next_tomb_scan {
            return;
        }
        core.gc.next_tomb_scan = now.plus(TOMB_SCAN_EVERY);
        for op in std::mem::take(&mut core.gc.cleanup_retries) {
            // Only if nothing took the id or the node back in the meantime.
            let still_meant = match &op {
                StoreOp::DeleteTombstone { id } => {
                    core.ids.get(*id).is_none() && !core.ids.quarantine().contains_key(id)
                }
                StoreOp::DeleteNode { node } => !self.nodes.contains_key(node),
                // A lost tombstone, while its quarantine lasts.
                StoreOp::DeleteIdentity { id, tombstone, .. } => {
                    core.ids.get(*id).is_none()
                        && !core.gc.rewriting.contains(id)
                        && core.ids.quarantine().get(id).is_some_and(|t| {
                            t.labels_hash == tombstone.labels_hash && t.until > now
                        })
                }
                _ => false,
            };
            if still_meant {
                if let StoreOp::DeleteIdentity { id, .. } = &op {
                    core.gc.rewriting.insert(*id);
                }
                let priority = match op {
                    // Beside PutNode (see `drop_node`).
                    StoreOp::DeleteNode { .. } => Priority::Allocation,
                    _ => Priority::Gc,
                };
                core.store(op, priority);
            }
        }
        // A quarantine whose lost tombstone is being written again ends at the first
        // scan after the write's answer: ended now, its id could be bound while that
        // write, which tombstones the object, is still in flight.
        for id in core.ids.expire_tombs(now, &core.gc.rewriting) {
            core.counters.quarantine_ended += 1;
            core.store(StoreOp::DeleteTombstone { id }, Priority::Gc);
        }
        core.ids.shrink();
    }

    /// Nodes whose record failed to persist are written again.
    fn persist_nodes(&mut self) {
        for (name, node) in self.nodes.iter_mut() {
            if node.persisted == Persisted::No && node.session.is_some() {
                node.persisted = Persisted::InFlight;
                self.core.fx.push(Effect::Store {
                    op: StoreOp::PutNode { node: name.clone() },
                    priority: Priority::Allocation,
                });
            }
        }
    }
}
