//! What the services, the CLI and the metrics read from the core.

use std::collections::BTreeMap;

use census_proto::{
    domain::{IdRange, IdentityId, NodeName, SessionId},
    labels::LabelSet,
};

use super::{
    Allocator, Core, Timestamp,
    identities::{Entry, Phase},
};

/// Cumulative counters (monotonic), exported as Prometheus counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counters {
    /// Allocate answered with an identity that existed.
    pub allocations_known: u64,
    /// New identities bound (for Allocate or to rehome an endpoint).
    pub allocations_new: u64,
    /// Identities bound from an agent's report (re-adoption).
    pub identities_adopted: u64,
    pub snapshots: u64,
    pub deltas: u64,
    pub corrections: u64,
    pub adoptions: u64,
    pub rebinds: u64,
    pub old_seq_ignored: u64,
    /// Allocate calls answered with an error at their deadline, the store's answer
    /// not come.
    pub allocations_expired: u64,
    /// Endpoints left out of a view because no identity could be found for them.
    pub unresolved: u64,
    pub holds_expired: u64,
    /// Holds ended by a snapshot saying their allocation had settled.
    pub holds_settled: u64,
    pub nodes_dropped: u64,
    pub released: u64,
    pub quarantine_ended: u64,
    /// Ids blocked because the store disagreed with census.
    pub blocked: u64,
    /// Bindings written again after someone else deleted them from the store.
    pub bindings_recreated: u64,
    /// Quarantine tombstones written again after someone else deleted them from the
    /// store.
    pub tombstones_recreated: u64,
    /// Lost tombstones that could not be written again (they kept no valid labels).
    pub tombstones_unrecoverable: u64,
    /// Bindings taken from the store that census had not written (a backup restored,
    /// an object applied by hand): seen by its watch, or met by a create of the same
    /// labels.
    pub bindings_taken: u64,
    /// Store answers for ops that no longer matched the core's state.
    pub stale_results: u64,
    /// GC delete outcomes by cause (`deleted`, `recreated`, `conflict`, `io`, ...).
    pub gc_outcomes: BTreeMap<&'static str, u64>,
    /// Failed creates by cause.
    pub create_failures: BTreeMap<&'static str, u64>,
    /// Every failed store op by cause.
    pub store_failures: BTreeMap<&'static str, u64>,
}

/// The state of an identity as shown to users.
///
/// `Protected`: neither referenced nor held, but kept by the restart fence (after a
/// start, every node has a node TTL to snapshot before anything is released).
/// `until` is the fence's earliest end; it stands longer while a node known before
/// the start has not reported (at most until that node's view would have been dropped).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdentityState {
    Creating,
    Live,
    Protected { until: Timestamp },
    Released { since: Timestamp },
    Deleting,
    Quarantined { until: Timestamp },
    Blocked,
}

impl IdentityState {
    pub fn name(self) -> &'static str {
        match self {
            Self::Creating => "creating",
            Self::Live => "live",
            Self::Protected { .. } => "protected",
            Self::Released { .. } => "released",
            Self::Deleting => "deleting",
            Self::Quarantined { .. } => "quarantined",
            Self::Blocked => "blocked",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdentityInfo {
    pub id: IdentityId,
    /// `None` for a quarantined or blocked id.
    pub labels: Option<LabelSet>,
    pub state: IdentityState,
    pub refs: u32,
    pub holds: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    pub name: NodeName,
    pub session: Option<SessionId>,
    pub connected: bool,
    pub last_seq: u64,
    pub last_heard: Option<Timestamp>,
    pub last_snapshot: Option<Timestamp>,
    pub stale: bool,
    pub endpoints: u64,
    pub holds: u32,
    pub corrections: u64,
    pub adoptions: u64,
    pub old_seq_ignored: u64,
    pub rebinds: u64,
}

/// Live state, computed when asked (at scrape time), so it cannot drift.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stats {
    pub creating: u64,
    pub live: u64,
    /// Live only because of the restart fence: neither referenced nor held.
    pub protected: u64,
    pub released: u64,
    pub deleting: u64,
    pub quarantined: u64,
    pub blocked: u64,
    pub range_size: u64,
    pub range_used: u64,
    pub nodes: u64,
    pub stale_nodes: u64,
    pub connected_nodes: u64,
    pub endpoints: u64,
    pub holds: u64,
    pub pending_allocations: u64,
    pub gc_inflight: u64,
    pub gc_backlog: u64,
}

impl Stats {
    pub fn range_usage_ratio(&self) -> f64 {
        if self.range_size == 0 {
            0.0
        } else {
            self.range_used as f64 / self.range_size as f64
        }
    }
}

impl Allocator {
    pub fn identity(&self, id: IdentityId) -> Option<IdentityInfo> {
        if let Some(entry) = self.core.ids.get(id) {
            return Some(self.core.info(id, entry));
        }
        if let Some(tomb) = self.core.ids.quarantine().get(&id) {
            return Some(IdentityInfo {
                id,
                labels: None,
                state: IdentityState::Quarantined { until: tomb.until },
                refs: 0,
                holds: 0,
            });
        }
        if self.core.ids.blocked().contains_key(&id) {
            return Some(IdentityInfo {
                id,
                labels: None,
                state: IdentityState::Blocked,
                refs: 0,
                holds: 0,
            });
        }
        None
    }

    /// Every binding announced to Watch subscribers (persisted at least once), by id.
    pub fn bindings(&self) -> Vec<IdentityInfo> {
        self.core
            .ids
            .entries()
            .iter()
            .filter(|(_, e)| e.announced)
            .map(|(&id, e)| self.core.info(id, e))
            .collect()
    }

    pub fn lookup(&self, labels: &LabelSet) -> Option<IdentityInfo> {
        self.core.ids.id_of(labels).and_then(|id| self.identity(id))
    }

    /// Identities with an id above `after`, in id order, at most `limit`, carrying
    /// every label of `selector`; quarantined and blocked ids too if asked. Returns the
    /// page and whether more follow.
    pub fn list(
        &self,
        after: Option<IdentityId>,
        limit: usize,
        selector: Option<&LabelSet>,
        include_quarantined: bool,
    ) -> (Vec<IdentityInfo>, bool) {
        let start = after.map_or(0, |id| id.get().saturating_add(1));
        let bound = self
            .core
            .ids
            .entries()
            .range(IdentityId::new(start.max(1)).unwrap_or(IdentityId::HOST)..)
            .filter(|(_, e)| selector.is_none_or(|s| e.labels.contains_all(s)))
            .map(|(&id, _)| id);
        let mut ids: Vec<IdentityId> = bound.take(limit.saturating_add(1)).collect();
        if include_quarantined && selector.is_none() {
            let mut gone: Vec<IdentityId> = self
                .core
                .ids
                .quarantine()
                .keys()
                .chain(self.core.ids.blocked().keys())
                .copied()
                .filter(|id| id.get() >= start)
                .collect();
            gone.sort_unstable();
            gone.truncate(limit.saturating_add(1));
            ids.extend(gone);
            ids.sort_unstable();
            ids.truncate(limit.saturating_add(1));
        }
        let more = ids.len() > limit;
        ids.truncate(limit);
        (
            ids.into_iter().filter_map(|id| self.identity(id)).collect(),
            more,
        )
    }

    pub fn node(&self, name: &NodeName) -> Option<NodeInfo> {
        self.nodes
            .get(name)
            .filter(|n| !n.hidden())
            .map(|node| NodeInfo {
                name: name.clone(),
                session: node.session,
                connected: node.conn.is_some(),
                last_seq: node.last_seq,
                last_heard: node.last_message,
                last_snapshot: node.last_snapshot,
                stale: node.stale(),
                endpoints: node.view.len() as u64,
                holds: node.holds.len() as u32,
                corrections: node.counters.corrections,
                adoptions: node.counters.adoptions,
                old_seq_ignored: node.counters.old_seq_ignored,
                rebinds: node.counters.rebinds,
            })
    }

    /// Every node, by name.
    pub fn nodes(&self) -> Vec<NodeInfo> {
        let mut names: Vec<&NodeName> = self.nodes.keys().collect();
        names.sort_unstable();
        names.into_iter().filter_map(|n| self.node(n)).collect()
    }

    pub fn counters(&self) -> &Counters {
        &self.core.counters
    }

    pub fn range(&self) -> IdRange {
        self.core.ids.range()
    }

    pub fn stats(&self) -> Stats {
        let mut stats = Stats::default();
        for entry in self.core.ids.entries().values() {
            match entry.phase {
                Phase::Creating { .. } => stats.creating += 1,
                Phase::Live if self.core.protects(entry) => stats.protected += 1,
                Phase::Live => stats.live += 1,
                Phase::Released { .. } => stats.released += 1,
                Phase::Deleting { .. } => stats.deleting += 1,
            }
        }
        stats.quarantined = self.core.ids.quarantine().len() as u64;
        stats.blocked = self.core.ids.blocked().len() as u64;
        stats.range_size = self.core.ids.range().size();
        stats.range_used = self.core.ids.used_in_range();
        for node in self.nodes.values().filter(|n| !n.hidden()) {
            stats.nodes += 1;
            stats.stale_nodes += u64::from(node.stale());
            stats.connected_nodes += u64::from(node.conn.is_some());
            stats.endpoints += node.view.len() as u64;
            stats.holds += node.holds.len() as u64;
            stats.pending_allocations += u64::from(node.pending);
        }
        stats.gc_inflight = self.core.gc.inflight as u64;
        stats.gc_backlog = self.core.gc.released.len() as u64
            + self.core.gc.create_retries.len() as u64
            + self.core.gc.delete_retries.len() as u64;
        stats
    }
}

impl Core {
    /// A bound identity as the services and Watch show it.
    pub(super) fn info(&self, id: IdentityId, entry: &Entry) -> IdentityInfo {
        let state = match self.protect_until {
            Some(until) if self.protects(entry) => IdentityState::Protected { until },
            _ => state_of(entry.phase),
        };
        IdentityInfo {
            id,
            labels: Some(entry.labels.clone()),
            state,
            refs: entry.refs,
            holds: entry.holds,
        }
    }

    /// Whether only the restart fence keeps this identity live.
    fn protects(&self, entry: &Entry) -> bool {
        self.protect_until.is_some()
            && entry.phase == Phase::Live
            && !entry.wanted()
            // Past the node TTL only what was loaded is kept (for nodes not heard yet).
            && (entry.loaded || !self.gc.past_node_ttl)
    }
}

/// The state an entry's phase shows, the restart fence aside.
pub(super) fn state_of(phase: Phase) -> IdentityState {
    match phase {
        Phase::Creating { .. } => IdentityState::Creating,
        Phase::Live => IdentityState::Live,
        Phase::Released { since } => IdentityState::Released { since },
        Phase::Deleting { .. } => IdentityState::Deleting,
    }
}
