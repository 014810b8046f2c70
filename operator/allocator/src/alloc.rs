//! Allocate, the store's answers, and what happens when the store disagrees.

use census_proto::{
    domain::{AllocationId, EndpointKey, IdentityId, NodeName, SessionId},
    labels::LabelSet,
};

use super::{
    AgentMsg, AllocError, Allocator, ConnId, Core, Effect, Priority, RequestId, StoreError,
    StoreOp, SyncError, Timestamp, Tombstone, WatchChange, bump,
    identities::{Blocked, Entry, Phase, Tomb, Waiter},
    nodes::{Node, Persisted},
};

impl Allocator {
    /// The identity of `labels` for a pod on `node`. A known label set is answered at
    /// once (`Ok(Some(id))`); a new one gets a free id that is persisted first, and
    /// the answer comes later as [`Effect::Reply`] for `req` (`Ok(None)`). Either way
    /// the node holds the identity until it appears in its view or the hold expires.
    pub fn allocate(
        &mut self,
        req: RequestId,
        node_name: &NodeName,
        session: SessionId,
        allocation: AllocationId,
        labels: LabelSet,
        now: Timestamp,
    ) -> Result<Option<IdentityId>, AllocError> {
        let node = self
            .nodes
            .get_mut(node_name)
            .ok_or_else(|| SyncError::NoSession {
                node: node_name.clone(),
            })?;
        in_session(node, node_name, session)?;
        let core = &mut self.core;
        let max = core.cfg.max_holds_per_node;
        if let Some(id) = core.ids.id_of(&labels) {
            if !node.holds.contains_key(&id) && node.hold_load() >= max {
                return Err(AllocError::HoldQuota {
                    node: node_name.clone(),
                    max,
                });
            }
            node.heard(now);
            core.counters.allocations_known += 1;
            if core.wake(id, now) {
                core.add_hold(node, id, allocation, now);
                return Ok(Some(id));
            }
            if let Some(entry) = core.ids.get_mut(id) {
                entry.waiters.push(Waiter::Request {
                    req,
                    node: node_name.clone(),
                    allocation,
                });
                node.pending += 1;
                core.wait_for(req, id, now);
            }
            return Ok(None);
        }
        if node.hold_load() >= max {
            return Err(AllocError::HoldQuota {
                node: node_name.clone(),
                max,
            });
        }
        if now < core.new_ids_after {
            return Err(AllocError::AdoptionWindow {
                remaining_ms: core.new_ids_after.since(now).as_millis() as u64,
            });
        }
        let Some(id) = core.ids.free_id() else {
            return Err(AllocError::RangeExhausted {
                range: core.ids.range(),
                used: core.ids.used_in_range(),
            });
        };
        node.heard(now);
        core.ids.insert(
            id,
            labels,
            Phase::Creating {
                inflight: true,
                attempt: 0,
                retry_at: now,
            },
        );
        if let Some(entry) = core.ids.get_mut(id) {
            entry.waiters.push(Waiter::Request {
                req,
                node: node_name.clone(),
                allocation,
            });
        }
        node.pending += 1;
        core.wait_for(req, id, now);
        core.create_op(id);
        core.counters.allocations_new += 1;
        Ok(None)
    }

    /// The store's answer to an op this core emitted.
    pub fn store_result(&mut self, op: StoreOp, result: Result<(), StoreError>, now: Timestamp) {
        if let Err(e) = &result {
            bump(&mut self.core.counters.store_failures, e.cause());
        }
        match op {
            StoreOp::CreateIdentity { id, labels } => self.created(id, &labels, result, now),
            op @ StoreOp::DeleteIdentity { id, .. } if self.core.gc.rewriting.contains(&id) => {
                self.tombstone_rewritten(op, &result);
            }
            StoreOp::DeleteIdentity {
                id,
                labels,
                tombstone,
            } => {
                self.deleted(id, &labels, tombstone, result, now);
                // A slot in flight is free: GC goes on at the budget's pace, not the tick's.
                self.pump_gc(now);
            }
            StoreOp::PutNode { node } => {
                if let Some(n) = self.nodes.get_mut(&node) {
                    n.persisted = if result.is_ok() {
                        Persisted::Yes
                    } else {
                        Persisted::No
                    };
                }
            }
            // Retried with the next quarantine scan, if still meant by then.
            op @ (StoreOp::DeleteTombstone { .. } | StoreOp::DeleteNode { .. }) => {
                if result.is_err() {
                    self.core.gc.cleanup_retries.push(op);
                }
            }
        }
    }

    fn created(
        &mut self,
        id: IdentityId,
        labels: &LabelSet,
        result: Result<(), StoreError>,
        now: Timestamp,
    ) {
        // The labels have an identity in the store already: take it when the core can.
        let take = match &result {
            Err(StoreError::LabelsBound { bound, .. })
                if self.core.can_take_stored(*bound, labels) =>
            {
                Some(*bound)
            }
            _ => None,
        };
        let core = &mut self.core;
        let Some(entry) = core.ids.get_mut(id) else {
            core.counters.stale_results += 1;
            return;
        };
        let Phase::Creating {
            inflight: true,
            attempt,
            ..
        } = entry.phase
        else {
            core.counters.stale_results += 1;
            return;
        };
        if entry.labels != *labels {
            core.counters.stale_results += 1;
            return;
        }
        match result {
            Ok(()) => self.create_succeeded(id, now),
            Err(StoreError::Conflict { found, .. }) => {
                bump(&mut core.counters.create_failures, "conflict");
                self.rehome(id, Blocked::StoreConflict { found }, now);
            }
            Err(StoreError::IdBound { bound, .. }) => {
                bump(&mut core.counters.create_failures, "id_bound");
                self.yield_to_store(id, bound, now);
            }
            // Nothing was written, so `id` is free again, never blocked.
            Err(StoreError::LabelsBound { .. }) if let Some(bound) = take => {
                bump(&mut core.counters.create_failures, "labels_bound");
                self.take_over(id, bound, now);
            }
            Err(e) => self.create_failed(id, attempt, &e, now),
        }
    }

    /// `id`'s create was written: it is live, and whoever waited for it is answered.
    fn create_succeeded(&mut self, id: IdentityId, now: Timestamp) {
        let core = &mut self.core;
        let Some(entry) = core.ids.get_mut(id) else {
            return;
        };
        // Watch is told at the drain, with the holds added below.
        entry.phase = Phase::Live;
        entry.ended_tomb = None;
        let waiters = std::mem::take(&mut entry.waiters);
        for waiter in waiters {
            match waiter {
                Waiter::Request {
                    req,
                    node,
                    allocation,
                } => {
                    if let Some(n) = self.nodes.get_mut(&node) {
                        n.pending = n.pending.saturating_sub(1);
                        core.add_hold(n, id, allocation, now);
                    }
                    core.reply(req, Ok(id));
                }
                Waiter::Rebind { node, conn, key } => {
                    if self
                        .nodes
                        .get(&node)
                        .is_some_and(|n| rebind_due(n, conn, &key, id))
                    {
                        let msg = AgentMsg::Rebind { key, identity: id };
                        core.fx.push(Effect::Agent { node, conn, msg });
                    }
                }
            }
        }
        if core.ids.get(id).is_some_and(|e| !e.wanted()) {
            core.gc.unused.push(id);
        }
    }

    /// `id`'s create failed for `e` (attempt `attempt`): retried later on the same
    /// id; callers are told now, endpoints wait for their rebind.
    fn create_failed(&mut self, id: IdentityId, attempt: u32, e: &StoreError, now: Timestamp) {
        let core = &mut self.core;
        let Some(entry) = core.ids.get_mut(id) else {
            return;
        };
        // Also a binding of the labels that the core cannot take (its id is
        // bound to other labels here, quarantined for other labels, or its lost
        // tombstone is being written again: each passes): retried later like an
        // unavailable store, on the same id, so no id is spent on it.
        bump(&mut core.counters.create_failures, e.cause());
        let attempt = attempt + 1;
        let retry_at = now.plus(core.cfg.backoff(attempt));
        entry.phase = Phase::Creating {
            inflight: false,
            attempt,
            retry_at,
        };
        // Callers are told now and may retry; endpoints keep waiting for their rebind.
        let cause = e.cause();
        let (requests, mut rest): (Vec<_>, Vec<_>) = std::mem::take(&mut entry.waiters)
            .into_iter()
            .partition(|w| matches!(w, Waiter::Request { .. }));
        // Only endpoints still in their view at this identity, on their stream,
        // wait on: the others' Rebinds would never be sent.
        rest.retain(|w| match w {
            Waiter::Rebind { node, conn, key } => self
                .nodes
                .get(node)
                .is_some_and(|n| rebind_due(n, *conn, key, id)),
            Waiter::Request { .. } => false,
        });
        entry.waiters = rest;
        // Refused for labels bound elsewhere, nothing was written: with no one
        // left to wait for it, the binding goes (a retry could only meet the
        // same binding, for as long as the store keeps it).
        let forget = matches!(e, StoreError::LabelsBound { .. }) && !entry.wanted();
        if !forget {
            core.gc.create_retries.insert((retry_at, id));
        }
        for waiter in requests {
            if let Waiter::Request { req, node, .. } = waiter {
                if let Some(n) = self.nodes.get_mut(&node) {
                    n.pending = n.pending.saturating_sub(1);
                }
                core.reply(req, Err(AllocError::StoreUnavailable { cause }));
            }
        }
        if forget {
            core.forget_unwritten(id, now);
        }
    }

    fn deleted(
        &mut self,
        id: IdentityId,
        labels: &LabelSet,
        tombstone: Tombstone,
        result: Result<(), StoreError>,
        now: Timestamp,
    ) {
        let core = &mut self.core;
        core.gc.inflight = core.gc.inflight.saturating_sub(1);
        let Some(entry) = core.ids.get_mut(id) else {
            core.counters.stale_results += 1;
            return;
        };
        // The answer to the delete in flight for these labels, or a stale one (the
        // labels cannot differ while one write per id is in flight; checked all the
        // same, as an answer for other labels must change nothing).
        let (
            Phase::Deleting {
                inflight: true,
                attempt,
                ..
            },
            true,
        ) = (entry.phase, entry.labels == *labels)
        else {
            core.counters.stale_results += 1;
            return;
        };
        match result {
            Ok(()) if entry.wanted() => {
                // Referenced again while the delete was in flight: bind it again. The
                // store holds the delete's tombstone: if the create writes nothing (the
                // store binds the labels elsewhere), the quarantine goes on.
                bump(&mut core.counters.gc_outcomes, "recreated");
                entry.phase = Phase::Creating {
                    inflight: true,
                    attempt: 0,
                    retry_at: now,
                };
                entry.ended_tomb = Some(Tomb::of(tombstone));
                core.create_op(id);
            }
            Ok(()) => {
                bump(&mut core.counters.gc_outcomes, "deleted");
                if let Some(gone) = core.ids.remove(id) {
                    core.ids.add_tomb(id, Tomb::of(tombstone));
                    if gone.announced {
                        core.fx.push(Effect::Watch(WatchChange::Removed {
                            id,
                            labels: gone.labels,
                        }));
                    }
                }
            }
            Err(StoreError::Conflict { found, .. }) => {
                bump(&mut core.counters.gc_outcomes, "conflict");
                self.rehome(id, Blocked::StoreConflict { found }, now);
            }
            Err(StoreError::IdBound { bound, .. }) => {
                bump(&mut core.counters.gc_outcomes, "id_bound");
                self.yield_to_store(id, bound, now);
            }
            Err(e) => {
                bump(&mut core.counters.gc_outcomes, e.cause());
                if entry.wanted() {
                    // The delete may have committed, tombstone and all: as above.
                    entry.phase = Phase::Creating {
                        inflight: true,
                        attempt: 0,
                        retry_at: now,
                    };
                    entry.ended_tomb = Some(Tomb::of(tombstone));
                    core.create_op(id);
                } else {
                    let attempt = attempt + 1;
                    let retry_at = now.plus(core.cfg.backoff(attempt));
                    entry.phase = Phase::Deleting {
                        inflight: false,
                        attempt,
                        retry_at,
                    };
                    // Here too: if the identity is wanted again before the retry
                    // (`wake` writes the binding again), a create that writes nothing
                    // must leave this tombstone's quarantine in place.
                    entry.ended_tomb = Some(Tomb::of(tombstone));
                    core.gc.delete_retries.insert((retry_at, id));
                }
            }
        }
    }

    /// The store reports (from its own watch) that the binding of `id` to `labels` is
    /// gone, deleted by someone else. The binding is written again; if nothing uses
    /// it, garbage collection deletes it properly later (with its tombstone). An
    /// unwanted identity whose delete failed is not written again: its delete is
    /// retried, and records the tombstone.
    pub fn binding_lost(&mut self, id: IdentityId, labels: &LabelSet, now: Timestamp) {
        let core = &mut self.core;
        let Some(entry) = core.ids.get_mut(id).filter(|e| e.labels == *labels) else {
            return;
        };
        match entry.phase {
            // Our own write is in flight; its answer decides.
            Phase::Creating { inflight: true, .. } | Phase::Deleting { inflight: true, .. } => {}
            // Being deleted, unwanted, after a delete that failed: that delete may have
            // committed (tombstone and all), and writing the binding again would drop
            // the tombstone of a quarantine that has begun. The delete's retry finds
            // the binding gone (a success) and records the tombstone either way.
            Phase::Deleting {
                inflight: false, ..
            } if !entry.wanted() => {}
            Phase::Live
            | Phase::Released { .. }
            | Phase::Creating {
                inflight: false, ..
            }
            | Phase::Deleting {
                inflight: false, ..
            } => {
                entry.phase = Phase::Creating {
                    inflight: true,
                    attempt: 0,
                    retry_at: now,
                };
                core.counters.bindings_recreated += 1;
                core.create_op(id);
            }
        }
    }

    /// The store reports (from its own watch) that the tombstone `lost` is gone,
    /// deleted by someone else; `labels` are the labels it kept. While the id is still
    /// in quarantine for those labels the tombstone is written again (the store's
    /// DeleteIdentity creates the object and tombstones it), so the quarantine
    /// survives a restart or a failover. A tombstone without valid labels cannot be
    /// written again (the object needs them); it is counted, and the quarantine holds
    /// in this core only.
    pub fn tombstone_lost(&mut self, lost: Tombstone, labels: Option<&LabelSet>, now: Timestamp) {
        let core = &mut self.core;
        let id = lost.id;
        if core.ids.get(id).is_some() || core.gc.rewriting.contains(&id) {
            return;
        }
        let Some(tomb) = core.ids.quarantine().get(&id).copied() else {
            return;
        };
        if tomb.until <= now {
            return;
        }
        let Some(labels) = labels.filter(|l| l.stable_hash() == tomb.labels_hash) else {
            core.counters.tombstones_unrecoverable += 1;
            return;
        };
        core.counters.tombstones_recreated += 1;
        core.gc.rewriting.insert(id);
        let op = StoreOp::DeleteIdentity {
            id,
            labels: labels.clone(),
            tombstone: Tombstone {
                id,
                labels_hash: tomb.labels_hash,
                until_ms: tomb.until.as_millis(),
            },
        };
        core.store(op, Priority::Gc);
    }

    /// The answer to the re-write of a lost tombstone: a failure is retried with the
    /// next quarantine scan while the id is still in quarantine.
    fn tombstone_rewritten(&mut self, op: StoreOp, result: &Result<(), StoreError>) {
        let core = &mut self.core;
        if let StoreOp::DeleteIdentity { id, .. } = &op {
            core.gc.rewriting.remove(id);
        }
        match result {
            // The quarantine ended while the write was in flight: the tombstone goes.
            Ok(()) => {
                if let StoreOp::DeleteIdentity { id, .. } = &op
                    && core.ids.get(*id).is_none()
                    && !core.ids.quarantine().contains_key(id)
                {
                    core.store(StoreOp::DeleteTombstone { id: *id }, Priority::Gc);
                }
            }
            // The store holds something else under the id now; its watch reports it.
            Err(StoreError::Conflict { .. } | StoreError::IdBound { .. }) => {
                core.counters.stale_results += 1;
            }
            Err(_) => core.gc.cleanup_retries.push(op),
        }
    }

    /// The store holds a valid binding of `id` to `labels` that the core never loaded
    /// nor wrote (seen by the store's own watch). The core takes it in when it knows
    /// neither the id nor the labels and the id is not quarantined (out of range or
    /// blocked, it is taken all the same: census never writes such a binding, it takes
    /// what the store holds); unused, it is released and collected like any identity. Anything else is left to the answers of the
    /// core's own writes and to [`Allocator::binding_invalid`].
    pub fn binding_found(&mut self, id: IdentityId, labels: &LabelSet) {
        let core = &mut self.core;
        // Not a quarantined id either: the report may be of a binding census has
        // deleted since (the watch's events reach the core after its own answers). If
        // the store does bind it, a create of the labels meets it and takes it.
        if core.ids.id_of(labels).is_some()
            || core.ids.quarantine().contains_key(&id)
            || !core.can_take_stored(id, labels)
        {
            return;
        }
        core.take_stored(id, labels.clone());
        core.gc.unused.push(id);
    }

    /// The store binds the labels that `from` was being created for to `to` already
    /// (the caller checked the core can take `to`): `to` becomes their identity, as
    /// persisted, and whatever used `from` moves to it, answered and rebound at once.
    /// `from` was never written and is free again (or quarantined as it was).
    fn take_over(&mut self, from: IdentityId, to: IdentityId, now: Timestamp) {
        let core = &mut self.core;
        let Some(old) = core.forget_unwritten(from, now) else {
            return;
        };
        core.take_stored(to, old.labels);
        let (refs, holds) = self.move_users(from, to, true);
        let core = &mut self.core;
        if let Some(entry) = core.ids.get_mut(to) {
            entry.refs = refs;
            entry.holds = holds;
        }
        for waiter in old.waiters {
            // Rebinds are sent by `move_users` for every endpoint in a view.
            if let Waiter::Request {
                req,
                node,
                allocation,
            } = waiter
            {
                if let Some(n) = self.nodes.get_mut(&node) {
                    n.pending = n.pending.saturating_sub(1);
                    core.add_hold(n, to, allocation, now);
                }
                core.reply(req, Ok(to));
            }
        }
        if core.ids.get(to).is_some_and(|e| !e.wanted()) {
            core.gc.unused.push(to);
        }
    }

    /// Points every view entry and hold of `from` at `to`, with a Rebind for each
    /// endpoint: sent now if `to` is persisted, else queued on `to` until it is.
    /// Returns the references and holds moved.
    fn move_users(&mut self, from: IdentityId, to: IdentityId, persisted: bool) -> (u32, u32) {
        let core = &mut self.core;
        let (mut refs, mut holds) = (0, 0);
        let mut queued = Vec::new();
        for (name, node) in self.nodes.iter_mut() {
            let conn = node.conn;
            let (fx, counters) = (&mut core.fx, &mut core.counters);
            let mut rebound = 0;
            refs += node.view.reidentify(&mut core.map, name, from, to, |key| {
                let Some(conn) = conn else { return };
                rebound += 1;
                if persisted {
                    let msg = AgentMsg::Rebind {
                        key: key.clone(),
                        identity: to,
                    };
                    fx.push(Effect::Agent {
                        node: name.clone(),
                        conn,
                        msg,
                    });
                } else {
                    queued.push(Waiter::Rebind {
                        node: name.clone(),
                        conn,
                        key: key.clone(),
                    });
                }
            });
            node.counters.rebinds += rebound;
            counters.rebinds += rebound;
            if let Some(hold) = node.holds.remove(&from) {
                node.holds.insert(to, hold);
                holds += 1;
            }
        }
        if let Some(entry) = core.ids.get_mut(to) {
            entry.waiters.extend(queued);
        }
        (refs, holds)
    }

    /// The store holds, for `id`, an object census did not write or that was edited
    /// (`found` describes it): the id is blocked for good, reported, and whatever used
    /// it moves to a new id.
    pub fn binding_invalid(&mut self, id: IdentityId, found: String, now: Timestamp) {
        if self.core.ids.get(id).is_some() {
            self.rehome(id, Blocked::StoreConflict { found }, now);
        } else if !self.core.ids.blocked().contains_key(&id) {
            self.core.ids.block(id, Blocked::StoreConflict { found });
            self.core.counters.blocked += 1;
        }
    }

    /// The store binds `id` otherwise than census does: the id is blocked for good,
    /// and whatever used it (endpoints, holds, waiting calls) moves to a new id for
    /// the same labels, with Rebinds to the agents.
    pub(super) fn rehome(&mut self, id: IdentityId, why: Blocked, now: Timestamp) {
        let core = &mut self.core;
        let Some(old) = core.ids.remove(id) else {
            return;
        };
        core.ids.block(id, why);
        core.counters.blocked += 1;
        if old.announced {
            core.fx.push(Effect::Watch(WatchChange::Removed {
                id,
                labels: old.labels.clone(),
            }));
        }
        self.relocate(id, old, now);
    }

    /// The store binds `id` to `bound`, a valid binding census did not write, where
    /// the core was creating or deleting its own binding of `id`: nothing was written.
    /// The store's binding is taken, never fought: unless its labels have an identity
    /// here already (a lost tombstone being written again at `id` also waits), `id`
    /// becomes `bound`'s identity as persisted,
    /// and is collected like any other when unused. Whatever used `id` moves to
    /// another id for its labels, with Rebinds.
    fn yield_to_store(&mut self, id: IdentityId, bound: LabelSet, now: Timestamp) {
        let core = &mut self.core;
        let Some(old) = core.ids.remove(id) else {
            return;
        };
        if old.announced {
            core.fx.push(Effect::Watch(WatchChange::Removed {
                id,
                labels: old.labels.clone(),
            }));
        }
        // A quarantine the old binding ended (its own labels taking the id back) is
        // over: the store binds the id otherwise, its tombstone gone.
        if core.ids.id_of(&bound).is_none() && core.can_take_stored(id, &bound) {
            core.take_stored(id, bound);
            core.gc.unused.push(id);
        } else {
            // Its labels have another identity here (being created, or one the store
            // lost): the id is not free while the store binds it. It is blocked, and
            // taken once the store shows it is the labels' (LabelsBound, BindingFound).
            let found = format!("a binding of {bound} that census did not write");
            core.ids.block(id, Blocked::StoreConflict { found });
            core.counters.blocked += 1;
        }
        self.relocate(id, old, now);
    }

    /// Moves whatever used `id`, whose binding `old` is gone from the core, to a new
    /// id for the same labels (answering waiting calls, with Rebinds to the agents).
    fn relocate(&mut self, id: IdentityId, old: Entry, now: Timestamp) {
        let core = &mut self.core;
        if !old.wanted() {
            return;
        }
        let requests = old.waiters.into_iter().filter_map(|w| match w {
            Waiter::Request {
                req,
                node,
                allocation,
            } => Some((req, node, allocation)),
            Waiter::Rebind { .. } => None,
        });
        // No new id inside the adoption window: it could be one an agent that has
        // not reported yet still holds.
        let window = core.in_adoption_window(now);
        let fresh = if window { None } else { core.ids.free_id() };
        let Some(fresh) = fresh else {
            // Nowhere to go: the endpoints are left out of the views until ids free up,
            // or, in the window, until it ends and their nodes snapshot again.
            for (name, node) in self.nodes.iter_mut() {
                let before = node.view.len();
                node.view.retain(&mut core.map, name, |_, v| v.id != id);
                if window && node.view.len() != before {
                    core.deferred.insert(name.clone());
                }
                node.holds.remove(&id);
            }
            for (req, node, _) in requests {
                if let Some(n) = self.nodes.get_mut(&node) {
                    n.pending = n.pending.saturating_sub(1);
                }
                let err = if window {
                    AllocError::AdoptionWindow {
                        remaining_ms: core.new_ids_after.since(now).as_millis() as u64,
                    }
                } else {
                    AllocError::RangeExhausted {
                        range: core.ids.range(),
                        used: core.ids.used_in_range(),
                    }
                };
                core.reply(req, Err(err));
            }
            return;
        };
        core.ids.insert(
            fresh,
            old.labels,
            Phase::Creating {
                inflight: true,
                attempt: 0,
                retry_at: now,
            },
        );
        core.create_op(fresh);
        let requests: Vec<Waiter> = requests
            .map(|(req, node, allocation)| {
                // The call's deadline stands: it waits on `fresh` now.
                core.gc.waiting.insert(req, fresh);
                Waiter::Request {
                    req,
                    node,
                    allocation,
                }
            })
            .collect();
        if let Some(entry) = core.ids.get_mut(fresh) {
            entry.waiters = requests;
        }
        let (refs, holds) = self.move_users(id, fresh, false);
        if let Some(entry) = self.core.ids.get_mut(fresh) {
            entry.refs = refs;
            entry.holds = holds;
        }
    }
}

impl Allocator {
    /// Queues a Store op for a delete of `id`, spending from the GC budget.
    pub(super) fn issue_delete(&mut self, id: IdentityId, attempt: u32, now: Timestamp) {
        let core = &mut self.core;
        let Some(entry) = core.ids.get_mut(id) else {
            return;
        };
        entry.phase = Phase::Deleting {
            inflight: true,
            attempt,
            retry_at: now,
        };
        let tombstone = Tombstone {
            id,
            labels_hash: entry.labels.stable_hash(),
            until_ms: now.plus(core.cfg.quarantine).as_millis(),
        };
        let op = StoreOp::DeleteIdentity {
            id,
            labels: entry.labels.clone(),
            tombstone,
        };
        core.gc.inflight += 1;
        core.gc.tokens -= 1.0;
        core.store(op, Priority::Gc);
    }
}

impl Core {
    /// Unbinds `id`, whose create wrote nothing: a quarantine the create would have
    /// ended goes on (and ends as usual, its tombstone with it), and Watch is told if
    /// it showed the binding (one being written again after someone deleted it). The
    /// quarantine's tombstone is written again, as a lost one is: the store may not
    /// hold it (someone deleted it while the id was bound here, or the delete that
    /// wrote it may not have committed).
    fn forget_unwritten(&mut self, id: IdentityId, now: Timestamp) -> Option<Entry> {
        let old = self.ids.remove(id)?;
        if let Some(tomb) = old.ended_tomb {
            self.ids.add_tomb(id, tomb);
            if tomb.until > now && tomb.labels_hash == old.labels.stable_hash() {
                self.gc.rewriting.insert(id);
                let op = StoreOp::DeleteIdentity {
                    id,
                    labels: old.labels.clone(),
                    tombstone: Tombstone {
                        id,
                        labels_hash: tomb.labels_hash,
                        until_ms: tomb.until.as_millis(),
                    },
                };
                self.store(op, Priority::Gc);
            }
        }
        if old.announced {
            self.fx.push(Effect::Watch(WatchChange::Removed {
                id,
                labels: old.labels.clone(),
            }));
        }
        Some(old)
    }
}

/// Whether a queued Rebind of `key` to `id` is still to be sent: its stream is the
/// node's current one and the endpoint is in the view at `id`.
fn rebind_due(node: &Node, conn: ConnId, key: &EndpointKey, id: IdentityId) -> bool {
    node.conn == Some(conn) && node.view.get(key).is_some_and(|v| v.id == id)
}

/// Refuses a request unless `session` is `node`'s current session: without a session,
/// from an older session (stale) or from another one.
fn in_session(node: &Node, node_name: &NodeName, session: SessionId) -> Result<(), SyncError> {
    match node.session {
        None => Err(SyncError::NoSession {
            node: node_name.clone(),
        }),
        Some(current) if current > session => Err(SyncError::StaleSession {
            node: node_name.clone(),
            current,
            offered: session,
        }),
        Some(current) if current != session => Err(SyncError::WrongSession {
            node: node_name.clone(),
            current,
            offered: session,
        }),
        Some(_) => Ok(()),
    }
}
