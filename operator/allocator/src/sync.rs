//! EndpointSync events: Hello, deltas, snapshots, and the re-adoption rules that
//! decide which identity an agent's endpoint references.

use std::collections::HashMap;

use census_proto::{
    domain::{AllocationId, Endpoint, EndpointKey, IdentityId, NodeName, SessionId},
    labels::LabelSet,
};

use super::{
    Accepted, AgentMsg, Allocator, Applied, CloseReason, ConnId, Core, Effect, Priority, StoreOp,
    SyncError, Timestamp,
    identities::{Phase, Waiter},
    map::Standing,
    nodes::{Node, Persisted, ViewEntry},
};

/// The identity an endpoint's entry resolved to.
struct Resolved {
    id: Option<IdentityId>,
    rebind: bool,
    /// The entry needs a new id while the adoption window holds new ids back.
    pending: bool,
}

impl Allocator {
    /// A Hello on a new stream. A newer session replaces the current one (whose stream
    /// is told to close) and restarts `seq`; the same session reconnecting replaces
    /// the stream and keeps `seq`; an older session is refused while the current
    /// session's stream is open (a zombie cannot take over a live agent), and becomes
    /// current once it has closed, whatever the clocks say (an agent restarted after
    /// a clock step back is never locked out). The transport closes a stream whose
    /// peer stops answering keepalive pings. The view stays as it was until the
    /// session's first snapshot.
    pub fn hello(
        &mut self,
        name: &NodeName,
        session: SessionId,
        now: Timestamp,
    ) -> Result<Accepted, SyncError> {
        if self.core.gone.contains_key(name) {
            return Err(SyncError::NodeGone { node: name.clone() });
        }
        if let Some(node) = self.nodes.get(name)
            && let Some(current) = node.session
            && session < current
            && node.conn.is_some()
        {
            return Err(SyncError::StaleSession {
                node: name.clone(),
                current,
                offered: session,
            });
        }
        let conn = self.core.next_conn();
        let node = self
            .nodes
            .entry(name.clone())
            .or_insert_with(|| Node::new(now, Persisted::No));
        let replaced = node.conn.replace(conn);
        if let Some(old) = replaced {
            self.core.fx.push(Effect::Agent {
                node: name.clone(),
                conn: old,
                msg: AgentMsg::Close(CloseReason::Replaced { by: session }),
            });
        }
        if node.session != Some(session) {
            node.session = Some(session);
            node.last_seq = 0;
            node.first_snapshot_pending = true;
            // The new session numbers its allocations from 1 again: the earlier
            // session's holds only expire.
            for hold in node.holds.values_mut() {
                hold.allocation = AllocationId::NONE;
            }
        }
        node.heard(now);
        if node.persisted == Persisted::No {
            node.persisted = Persisted::InFlight;
            self.core.store(
                StoreOp::PutNode { node: name.clone() },
                Priority::Allocation,
            );
        }
        Ok(Accepted { conn, replaced })
    }

    /// A stream ended. The view and holds stay; only the connection is forgotten.
    pub fn disconnect(&mut self, name: &NodeName, conn: ConnId) {
        if let Some(node) = self.nodes.get_mut(name)
            && node.conn == Some(conn)
        {
            node.conn = None;
        }
    }

    /// An endpoint was added or changed on `name`.
    pub fn upsert(
        &mut self,
        name: &NodeName,
        conn: ConnId,
        seq: u64,
        endpoint: Endpoint,
        now: Timestamp,
    ) -> Result<Applied, SyncError> {
        let node = current(&mut self.nodes, name, conn)?;
        if let Some(ignored) = accept_seq(node, &mut self.core, seq, now) {
            return Ok(ignored);
        }
        self.core.counters.deltas += 1;
        let mut applied = Applied::default();
        let Endpoint {
            key,
            ips,
            identity,
            labels,
        } = endpoint;
        let resolved = self.core.resolve(name, conn, &key, identity, &labels, now);
        if resolved.rebind {
            applied.rebinds += 1;
            node.counters.rebinds += 1;
        }
        match resolved.id {
            Some(id) => {
                // A hold ends when an endpoint takes the id up, not when one that had
                // it already is seen again (a sibling pod must not end a fresh pod's
                // hold before the fresh pod is in the view).
                let entry = ViewEntry {
                    id,
                    seen: 0,
                    ips: ips.into(),
                };
                match node.view.insert(&mut self.core.map, name, key, entry, now) {
                    Some(prev) if prev.id == id => {}
                    Some(prev) => {
                        self.core.inc(id);
                        self.core.dec(prev.id);
                        self.core.end_hold(node, id);
                    }
                    None => {
                        self.core.inc(id);
                        self.core.end_hold(node, id);
                    }
                }
            }
            None => {
                if resolved.pending {
                    applied.pending.push(key.clone());
                } else {
                    applied.unresolved += 1;
                }
                if let Some(prev) = node.view.remove(&mut self.core.map, name, &key) {
                    self.core.dec(prev.id);
                }
            }
        }
        self.name_conflicts();
        Ok(applied)
    }

    /// An endpoint was removed from `name`.
    pub fn delete(
        &mut self,
        name: &NodeName,
        conn: ConnId,
        seq: u64,
        key: &EndpointKey,
        now: Timestamp,
    ) -> Result<Applied, SyncError> {
        let node = current(&mut self.nodes, name, conn)?;
        if let Some(ignored) = accept_seq(node, &mut self.core, seq, now) {
            return Ok(ignored);
        }
        self.core.counters.deltas += 1;
        if let Some(prev) = node.view.remove(&mut self.core.map, name, key) {
            self.core.dec(prev.id);
            node.view.shrink();
        }
        Ok(Applied::default())
    }

    /// A full snapshot of `name`: it replaces the node's view. References it adds or
    /// removes are corrections (adoptions in a session's first snapshot). The
    /// node's allocations numbered up to `settled` have been answered or given up
    /// and what took their identities up is in `endpoints`: their holds end.
    pub fn snapshot(
        &mut self,
        name: &NodeName,
        conn: ConnId,
        seq: u64,
        endpoints: Vec<Endpoint>,
        settled: AllocationId,
        now: Timestamp,
    ) -> Result<Applied, SyncError> {
        let node = current(&mut self.nodes, name, conn)?;
        if let Some(ignored) = accept_seq(node, &mut self.core, seq, now) {
            return Ok(ignored);
        }
        let core = &mut self.core;
        core.counters.snapshots += 1;
        node.last_snapshot = Some(now);
        node.awaited = false;
        let first = std::mem::replace(&mut node.first_snapshot_pending, false);

        if unchanged(node, core, &endpoints) {
            // At rest: the view gives back what a burst of deltas grew it to, so it
            // holds what a changed snapshot would have rebuilt it with.
            // No endpoint took an id up, so no hold ends (see `upsert`) but those
            // of the allocations settled.
            node.view.settle();
            core.end_settled_holds(node, settled);
            return Ok(Applied::default());
        }

        let mut applied = Applied::default();
        let mut changes = 0;
        let mut view = HashMap::with_capacity(endpoints.len());
        for Endpoint {
            key,
            ips,
            identity,
            labels,
        } in endpoints
        {
            // A key seen already in this snapshot: the first entry counts (the wire
            // layer refuses such entries; the core defines them anyway).
            if view.contains_key(&key) {
                applied.duplicates += 1;
                continue;
            }
            let resolved = core.resolve(name, conn, &key, identity, &labels, now);
            if resolved.rebind {
                applied.rebinds += 1;
                node.counters.rebinds += 1;
            }
            let Some(id) = resolved.id else {
                // Left out of the view; a previous reference is dropped below.
                if resolved.pending {
                    applied.pending.push(key);
                } else {
                    applied.unresolved += 1;
                }
                continue;
            };
            match node.view.get(&key).map(|prev| prev.id) {
                Some(prev) if prev == id => {}
                Some(prev) => {
                    core.inc(id);
                    core.dec(prev);
                    core.end_hold(node, id);
                    changes += 2;
                }
                None => {
                    core.inc(id);
                    core.end_hold(node, id);
                    changes += 1;
                }
            }
            view.insert(
                key,
                ViewEntry {
                    id,
                    seen: 0,
                    ips: ips.into(),
                },
            );
        }
        // A session's first snapshot may carry what a view dropped meanwhile no longer
        // knows to be stale: its claims do not take addresses claimed by others.
        let standing = if first {
            Standing::Oldest
        } else {
            Standing::Newest
        };
        for (key, prev) in node.view.replace(&mut core.map, name, view, standing, now) {
            if !node.view.contains_key(&key) {
                core.dec(prev.id);
                changes += 1;
            }
        }
        count_changes(node, core, &mut applied, first, changes);
        core.end_settled_holds(node, settled);
        self.name_conflicts();
        Ok(applied)
    }
}

/// The common case of a snapshot: nothing changed since the last snapshot and the
/// deltas. Each entry marks its view entry, so two entries of one key (the view then
/// lacks some other key) are never taken for an unchanged view.
fn unchanged(node: &mut Node, core: &Core, endpoints: &[Endpoint]) -> bool {
    node.snapshots = node.snapshots.wrapping_add(1).max(1);
    let mark = node.snapshots;
    endpoints.len() == node.view.len()
        && endpoints.iter().all(|ep| {
            node.view
                .mark_seen(&ep.key, mark)
                .is_some_and(|(first, v)| first && v.id == ep.identity && v.ips.is(&ep.ips))
                && core.ids.is_bound(ep.identity, &ep.labels)
        })
}

/// Counts a snapshot's `changes` as adoptions in a session's first snapshot, as
/// corrections after it.
fn count_changes(
    node: &mut Node,
    core: &mut Core,
    applied: &mut Applied,
    first: bool,
    changes: u64,
) {
    if first {
        applied.adoptions = changes;
        node.counters.adoptions += changes;
        core.counters.adoptions += changes;
    } else {
        applied.corrections = changes;
        node.counters.corrections += changes;
        core.counters.corrections += changes;
    }
}

/// The node of a message on stream `conn`, if that stream is the node's current one.
fn current<'a>(
    nodes: &'a mut HashMap<NodeName, Node>,
    name: &NodeName,
    conn: ConnId,
) -> Result<&'a mut Node, SyncError> {
    match nodes.get_mut(name) {
        Some(node) if node.conn == Some(conn) => Ok(node),
        _ => Err(SyncError::Replaced { node: name.clone() }),
    }
}

/// Records that the node was heard; returns the answer for a message older than one
/// already applied (ignored and counted), or `None` to apply it.
fn accept_seq(node: &mut Node, core: &mut Core, seq: u64, now: Timestamp) -> Option<Applied> {
    node.heard(now);
    if seq <= node.last_seq {
        node.counters.old_seq_ignored += 1;
        core.counters.old_seq_ignored += 1;
        return Some(Applied {
            ignored: true,
            ..Applied::default()
        });
    }
    node.last_seq = seq;
    None
}

impl Core {
    /// The re-adoption rules (DESIGN.md): which identity the entry "endpoint `key`
    /// holds `claimed` for `labels`" references, and whether the agent must rebind.
    fn resolve(
        &mut self,
        node: &NodeName,
        conn: ConnId,
        key: &EndpointKey,
        claimed: IdentityId,
        labels: &LabelSet,
        now: Timestamp,
    ) -> Resolved {
        // L is bound to Y: reference Y (and rebind if the agent holds another id).
        if let Some(bound) = self.ids.id_of(labels) {
            let ready = self.wake(bound, now);
            if bound == claimed {
                return Resolved {
                    id: Some(bound),
                    rebind: false,
                    pending: false,
                };
            }
            self.rebind(node, conn, key, bound, ready);
            return Resolved {
                id: Some(bound),
                rebind: true,
                pending: false,
            };
        }
        // X unknown, L unknown, X in range and not quarantined for another set: adopt.
        if self.can_take(claimed, labels) {
            self.ids.insert(
                claimed,
                labels.clone(),
                Phase::Creating {
                    inflight: true,
                    attempt: 0,
                    retry_at: now,
                },
            );
            self.create_op(claimed);
            self.counters.identities_adopted += 1;
            return Resolved {
                id: Some(claimed),
                rebind: false,
                pending: false,
            };
        }
        // X is bound to other labels, out of range or quarantined: a new id for L,
        // once agents have had the chance to re-report theirs (the lowest free id is
        // the one most likely still held by an agent that has not reported yet).
        if self.in_adoption_window(now) {
            self.deferred.insert(node.clone());
            return Resolved {
                id: None,
                rebind: false,
                pending: true,
            };
        }
        match self.ids.free_id() {
            Some(fresh) => {
                self.ids.insert(
                    fresh,
                    labels.clone(),
                    Phase::Creating {
                        inflight: true,
                        attempt: 0,
                        retry_at: now,
                    },
                );
                self.create_op(fresh);
                self.counters.allocations_new += 1;
                self.rebind(node, conn, key, fresh, false);
                Resolved {
                    id: Some(fresh),
                    rebind: true,
                    pending: false,
                }
            }
            None => {
                self.counters.unresolved += 1;
                Resolved {
                    id: None,
                    rebind: false,
                    pending: false,
                }
            }
        }
    }

    /// Tells the agent to use `id` for `key`: now if the binding is persisted,
    /// otherwise once it is.
    fn rebind(
        &mut self,
        node: &NodeName,
        conn: ConnId,
        key: &EndpointKey,
        id: IdentityId,
        ready: bool,
    ) {
        self.counters.rebinds += 1;
        if ready {
            self.fx.push(Effect::Agent {
                node: node.clone(),
                conn,
                msg: AgentMsg::Rebind {
                    key: key.clone(),
                    identity: id,
                },
            });
        } else if let Some(entry) = self.ids.get_mut(id) {
            let waiter = Waiter::Rebind {
                node: node.clone(),
                conn,
                key: key.clone(),
            };
            if !entry.waiters.contains(&waiter) {
                entry.waiters.push(waiter);
            }
        }
    }
}
