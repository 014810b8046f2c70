//! The identity table: id <-> canonical label set, reference and hold counts, the
//! lifecycle phase of each identity, quarantine tombstones and blocked ids.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use census_proto::{
    domain::{AllocationId, EndpointKey, IdRange, IdentityId, NodeName},
    labels::LabelSet,
};

use super::{ConnId, IdentityState, RequestId, Timestamp, capacity::shrink_map, read::state_of};

/// Where an identity is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Its binding is being persisted (`inflight`), or waits for a retry at `retry_at`.
    /// Nothing is handed out before the store confirms it.
    Creating {
        inflight: bool,
        attempt: u32,
        retry_at: Timestamp,
    },
    /// Persisted and referenced, held, or protected.
    Live,
    /// Persisted, unreferenced and unheld since `since`.
    Released { since: Timestamp },
    /// A store delete is in flight (`inflight`), or waits for a retry at `retry_at`.
    Deleting {
        inflight: bool,
        attempt: u32,
        retry_at: Timestamp,
    },
}

/// Someone waiting for an identity's binding to be persisted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Waiter {
    /// An Allocate call, answered when persisted (a hold is added for `node` then,
    /// recording the agent's `allocation`).
    Request {
        req: RequestId,
        node: NodeName,
        allocation: AllocationId,
    },
    /// An endpoint whose agent must be told to use this identity once it is persisted.
    Rebind {
        node: NodeName,
        conn: ConnId,
        key: EndpointKey,
    },
}

#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub(crate) labels: LabelSet,
    /// Endpoints (over all views) mapped to this identity.
    pub(crate) refs: u32,
    /// Nodes holding this identity.
    pub(crate) holds: u32,
    pub(crate) phase: Phase,
    pub(crate) waiters: Vec<Waiter>,
    /// Watch subscribers were told of this binding (so a Removed is owed when it goes).
    pub(crate) announced: bool,
    /// Loaded at start: kept while a node known then has not reported (an agent may
    /// be partitioned away, still using it).
    pub(crate) loaded: bool,
    /// The quarantine this binding ended when it was made (its own label set taking
    /// the id back, or a re-create after its own delete), until the store has it: if
    /// the create writes nothing (the store binds the labels elsewhere), the
    /// quarantine and its tombstone go on.
    pub(crate) ended_tomb: Option<Tomb>,
}

impl Entry {
    /// Referenced, held, or waited for by an Allocate call. A Rebind waiter does not
    /// count: its endpoint is a reference while it is in a view at this identity, and
    /// nothing once it has left (its Rebind is then never sent).
    pub(crate) fn wanted(&self) -> bool {
        self.refs > 0
            || self.holds > 0
            || self
                .waiters
                .iter()
                .any(|w| matches!(w, Waiter::Request { .. }))
    }

    fn seen(&self) -> Seen {
        Seen {
            state: state_of(self.phase),
            refs: self.refs,
            holds: self.holds,
            wanted: self.wanted(),
        }
    }
}

/// What Watch shows of an entry (its state also depends on `wanted`: an unwanted
/// live identity is shown protected while the restart fence stands), taken when
/// the entry is first touched after a drain, to tell at the next whether it changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Seen {
    state: IdentityState,
    refs: u32,
    holds: u32,
    wanted: bool,
}

/// A quarantined id: bindable again before `until` only to the label set with this hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tomb {
    pub(crate) labels_hash: u64,
    pub(crate) until: Timestamp,
}

impl Tomb {
    /// The quarantine a store tombstone records.
    pub(crate) fn of(tombstone: super::Tombstone) -> Self {
        Self {
            labels_hash: tombstone.labels_hash,
            until: Timestamp::from_millis(tombstone.until_ms),
        }
    }
}

/// Why an id is never bound again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Blocked {
    /// The store holds a binding for this id that census did not write.
    StoreConflict { found: String },
}

#[derive(Debug)]
pub(crate) struct Identities {
    range: IdRange,
    entries: BTreeMap<IdentityId, Entry>,
    by_labels: HashMap<LabelSet, IdentityId>,
    quarantine: HashMap<IdentityId, Tomb>,
    blocked: BTreeMap<IdentityId, Blocked>,
    /// The last id handed out; the search for a free one continues after it, so a
    /// freed id is reused as late as possible.
    cursor: u32,
    /// While set, the search goes down from this id instead (see
    /// [`Self::search_from_top`]).
    top: Option<u32>,
    /// Ids of the range that are bound, quarantined or blocked.
    used_in_range: u64,
    /// Every id whose entry was borrowed mutably or created since the last drain,
    /// with what Watch was shown of it before (`None`: it had no entry). The only
    /// way to change an entry is through here, so no change escapes Watch; emptied
    /// at every drain, so it is bounded by what one event touches.
    touched: BTreeMap<IdentityId, Option<Seen>>,
}

impl Identities {
    pub(crate) fn new(range: IdRange) -> Self {
        Self {
            range,
            entries: BTreeMap::new(),
            by_labels: HashMap::new(),
            quarantine: HashMap::new(),
            blocked: BTreeMap::new(),
            cursor: range.last().get(),
            top: None,
            used_in_range: 0,
            touched: BTreeMap::new(),
        }
    }

    pub(crate) fn range(&self) -> IdRange {
        self.range
    }

    pub(crate) fn used_in_range(&self) -> u64 {
        self.used_in_range
    }

    pub(crate) fn get(&self, id: IdentityId) -> Option<&Entry> {
        self.entries.get(&id)
    }

    /// The entry of `id`, to change: Watch is told at the next drain if it changed.
    pub(crate) fn get_mut(&mut self, id: IdentityId) -> Option<&mut Entry> {
        let entry = self.entries.get_mut(&id)?;
        self.touched.entry(id).or_insert_with(|| Some(entry.seen()));
        Some(entry)
    }

    /// The ids touched since the last call, with what Watch was shown of each before.
    pub(crate) fn take_touched(&mut self) -> BTreeMap<IdentityId, Option<Seen>> {
        std::mem::take(&mut self.touched)
    }

    /// Whether a touched entry shows anything else than `before`.
    pub(crate) fn changed_since(&self, id: IdentityId, before: Option<Seen>) -> bool {
        self.entries
            .get(&id)
            .is_some_and(|e| before != Some(e.seen()))
    }

    /// Records that Watch subscribers were told of `id`'s binding.
    pub(crate) fn mark_announced(&mut self, id: IdentityId) {
        if let Some(entry) = self.entries.get_mut(&id) {
            entry.announced = true;
        }
    }

    /// Marks a binding that came from the store at start.
    pub(crate) fn mark_loaded(&mut self, id: IdentityId) {
        if let Some(entry) = self.entries.get_mut(&id) {
            entry.loaded = true;
        }
    }

    #[cfg(test)]
    pub(crate) fn touched_len(&self) -> usize {
        self.touched.len()
    }

    pub(crate) fn id_of(&self, labels: &LabelSet) -> Option<IdentityId> {
        self.by_labels.get(labels).copied()
    }

    /// True if `id` is bound to exactly `labels`.
    pub(crate) fn is_bound(&self, id: IdentityId, labels: &LabelSet) -> bool {
        self.entries.get(&id).is_some_and(|e| e.labels == *labels)
    }

    pub(crate) fn entries(&self) -> &BTreeMap<IdentityId, Entry> {
        &self.entries
    }

    pub(crate) fn ids(&self) -> impl Iterator<Item = IdentityId> + '_ {
        self.entries.keys().copied()
    }

    pub(crate) fn quarantine(&self) -> &HashMap<IdentityId, Tomb> {
        &self.quarantine
    }

    pub(crate) fn blocked(&self) -> &BTreeMap<IdentityId, Blocked> {
        &self.blocked
    }

    fn occupy(&mut self, id: IdentityId) {
        if self.range.contains(id) {
            self.used_in_range += 1;
        }
    }

    fn vacate(&mut self, id: IdentityId) {
        if self.range.contains(id) {
            self.used_in_range -= 1;
        }
    }

    /// Binds `id` to `labels`. The caller has checked that both are free. Watch is
    /// told of it at the next drain, once it is not being created any more.
    pub(crate) fn insert(&mut self, id: IdentityId, labels: LabelSet, phase: Phase) {
        debug_assert!(!self.entries.contains_key(&id) && !self.by_labels.contains_key(&labels));
        let ended_tomb = self.quarantine.remove(&id);
        if ended_tomb.is_none() {
            self.occupy(id);
        }
        self.by_labels.insert(labels.clone(), id);
        self.touched.entry(id).or_insert(None);
        self.entries.insert(
            id,
            Entry {
                labels,
                refs: 0,
                holds: 0,
                phase,
                waiters: Vec::new(),
                announced: false,
                loaded: false,
                ended_tomb,
            },
        );
    }

    /// Unbinds `id`, leaving the id free (the caller quarantines or blocks it).
    pub(crate) fn remove(&mut self, id: IdentityId) -> Option<Entry> {
        let entry = self.entries.remove(&id)?;
        self.by_labels.remove(&entry.labels);
        self.vacate(id);
        Some(entry)
    }

    /// Quarantines a free id.
    pub(crate) fn add_tomb(&mut self, id: IdentityId, tomb: Tomb) {
        debug_assert!(!self.entries.contains_key(&id));
        if self.quarantine.insert(id, tomb).is_none() {
            self.occupy(id);
        }
    }

    /// Removes tombstones that ended at or before `now`, except those of `keep`,
    /// returning their ids.
    pub(crate) fn expire_tombs(
        &mut self,
        now: Timestamp,
        keep: &BTreeSet<IdentityId>,
    ) -> Vec<IdentityId> {
        let expired: Vec<IdentityId> = self
            .quarantine
            .iter()
            .filter(|(id, t)| t.until <= now && !keep.contains(id))
            .map(|(&id, _)| id)
            .collect();
        for id in &expired {
            self.quarantine.remove(id);
            self.vacate(*id);
        }
        expired
    }

    /// Blocks a free id for good.
    pub(crate) fn block(&mut self, id: IdentityId, why: Blocked) {
        debug_assert!(!self.entries.contains_key(&id));
        let was_quarantined = self.quarantine.remove(&id).is_some();
        let was_blocked = self.blocked.insert(id, why).is_some();
        if !was_quarantined && !was_blocked {
            self.occupy(id);
        }
    }

    /// Unblocks `id`: the store binds it validly now, and the core takes that binding.
    pub(crate) fn unblock(&mut self, id: IdentityId) {
        if self.blocked.remove(&id).is_some() {
            self.vacate(id);
        }
    }

    /// Whether a valid binding of `id` to `labels` that the store holds can be taken
    /// in: the id is unbound here and not quarantined for another label set. Out of
    /// range (a backup of a cluster with a wider range) or blocked (the invalid object
    /// that blocked it was replaced) does not matter: census never writes such a
    /// binding, it takes what the store holds (the labels are known to be unbound).
    pub(crate) fn can_take_stored(&self, id: IdentityId, labels: &LabelSet) -> bool {
        !self.entries.contains_key(&id)
            && self
                .quarantine
                .get(&id)
                .is_none_or(|t| t.labels_hash == labels.stable_hash())
    }

    /// Whether an agent's claim "id is bound to labels" can be adopted as a new
    /// binding: the id is in range, unbound, not blocked, and not quarantined for
    /// another label set (the labels are known to be unbound).
    pub(crate) fn can_adopt(&self, id: IdentityId, labels: &LabelSet) -> bool {
        self.range.contains(id)
            && !self.entries.contains_key(&id)
            && !self.blocked.contains_key(&id)
            && self
                .quarantine
                .get(&id)
                .is_none_or(|t| t.labels_hash == labels.stable_hash())
    }

    /// The search for a free id continues after `id` (the highest id a store kept).
    pub(crate) fn start_after(&mut self, id: Option<IdentityId>) {
        if let Some(id) = id {
            self.cursor = id.get();
        }
    }

    /// New ids are searched for from the top of the range down until
    /// [`Self::search_after_cursor`]: after a start on a store that may have lost its
    /// last bindings, which follow the cursor from the highest id it kept, while an
    /// agent that still holds them may not have reported yet.
    pub(crate) fn search_from_top(&mut self) {
        self.top = Some(self.range.last().get());
    }

    pub(crate) fn searching_from_top(&self) -> bool {
        self.top.is_some()
    }

    /// New ids are searched for after the cursor again.
    pub(crate) fn search_after_cursor(&mut self) {
        self.top = None;
    }

    /// Finds a free id of the range: not bound, quarantined or blocked.
    pub(crate) fn free_id(&mut self) -> Option<IdentityId> {
        if self.used_in_range >= self.range.size() {
            return None;
        }
        if let Some(top) = self.top {
            return self.free_id_below(top);
        }
        let mut candidate = self.range.next_after(self.cursor);
        for _ in 0..self.range.size() {
            if !self.entries.contains_key(&candidate)
                && !self.quarantine.contains_key(&candidate)
                && !self.blocked.contains_key(&candidate)
            {
                self.cursor = candidate.get();
                return Some(candidate);
            }
            candidate = self.range.next_after(candidate.get());
        }
        None
    }

    /// The highest free id at or below `top`, wrapping to the top of the range.
    fn free_id_below(&mut self, top: u32) -> Option<IdentityId> {
        let (first, last) = (self.range.first().get(), self.range.last().get());
        let below = |id: u32| if id > first { id - 1 } else { last };
        let mut candidate = top;
        for _ in 0..self.range.size() {
            let id = IdentityId::new(candidate)?;
            if !self.entries.contains_key(&id)
                && !self.quarantine.contains_key(&id)
                && !self.blocked.contains_key(&id)
            {
                self.top = Some(below(candidate));
                return Some(id);
            }
            candidate = below(candidate);
        }
        None
    }

    /// Removes every Allocate waiting on behalf of `node`, returning the requests.
    pub(crate) fn take_requests_of(&mut self, node: &NodeName) -> Vec<(RequestId, IdentityId)> {
        let mut taken = Vec::new();
        for (&id, entry) in self.entries.iter_mut() {
            let before = entry.seen();
            let had = taken.len();
            entry.waiters.retain(|w| match w {
                Waiter::Request { req, node: n, .. } if n == node => {
                    taken.push((*req, id));
                    false
                }
                _ => true,
            });
            if taken.len() > had {
                self.touched.entry(id).or_insert(Some(before));
            }
        }
        taken
    }

    /// Capacities of the hash maps (label index, quarantine), to check they shrink.
    #[cfg(test)]
    pub(crate) fn capacities(&self) -> (usize, usize) {
        (self.by_labels.capacity(), self.quarantine.capacity())
    }

    /// Gives memory back after many identities went away.
    pub(crate) fn shrink(&mut self) {
        shrink_map(&mut self.by_labels);
        shrink_map(&mut self.quarantine);
    }
}
