//! What the core must not contradict, kept apart from the core: what each node told
//! it (in the messages it accepted), what Allocate handed each node, when each node
//! was last heard, what a restart loaded. The safety checks compare the core's
//! effects with this, never with the core's own reference counts.
//!
//! Where the model cannot know what the core knows (a message it may not have
//! seen), it protects less, never more: a check that fires is a core bug.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::Duration,
};

use census_proto::{
    domain::{AllocationId, Endpoint, EndpointKey, IdRange, IdentityId, SessionId},
    labels::LabelSet,
};

use super::super::{Applied, Config, Liveness, Timestamp};

/// One node as the core must see it.
#[derive(Debug, Default)]
pub(super) struct NodeTruth {
    /// Endpoint -> the identity the node told the core it holds, in an accepted
    /// message, and the core did not answer as pending or unresolved.
    pub(super) told: BTreeMap<EndpointKey, (IdentityId, LabelSet)>,
    /// Identity -> (labels, expiry, the allocation's number) of Allocate answers
    /// not yet taken up by an endpoint of the node's view nor settled by a snapshot
    /// of the session. The number is `NONE` once the session that asked has been
    /// replaced (a new one numbers from 1), and stays so while the hold is renewed.
    pub(super) holds: BTreeMap<IdentityId, (LabelSet, Timestamp, AllocationId)>,
    /// Every Allocate answer's hold expiry (never ended early): an upper bound of
    /// the node's holds.
    pub(super) answered: BTreeMap<IdentityId, Timestamp>,
    /// The last time the core certainly heard from the node (it may have later).
    pub(super) heard: Option<Timestamp>,
    /// The Node object was deleted and the agent has not said Hello since.
    pub(super) gone: bool,
    /// The session the messages below belong to, and the highest seq delivered in it.
    pub(super) session: Option<SessionId>,
    pub(super) max_seq: u64,
    /// An accepted snapshot since the operator's last start.
    pub(super) snapshotted: bool,
    /// The core may have dropped the node's view since the operator's last start.
    pub(super) dropped: bool,
}

/// What an operator start loaded, for the restart protection.
#[derive(Debug)]
pub(super) struct Start {
    pub(super) at: Timestamp,
    pub(super) loaded: BTreeSet<(IdentityId, LabelSet)>,
    /// Agents (by index) whose node the store knew.
    pub(super) awaited: BTreeSet<usize>,
    /// The store held no identity: no new id before `at + window`.
    pub(super) empty: bool,
    /// Bindings `(id, labels)` agents claimed or the store showed the core since the
    /// start (and those it wrote): the only ones it may write inside the adoption
    /// window.
    pub(super) claims: BTreeSet<(IdentityId, LabelSet)>,
    /// Ids the core wrote a binding for since the start.
    pub(super) created: BTreeSet<IdentityId>,
    /// Ids the store's watch showed the core a binding at since the start (one it
    /// takes in is its own from then on: deleting it, it is in use until its delete
    /// lands, also after someone else deleted the object).
    pub(super) taken: BTreeSet<IdentityId>,
}

#[derive(Debug)]
pub(super) struct Truth {
    pub(super) cfg: Config,
    pub(super) nodes: Vec<NodeTruth>,
    pub(super) start: Start,
}

impl Truth {
    pub(super) fn new(cfg: Config, agents: usize, start: Start) -> Self {
        Self {
            cfg,
            nodes: (0..agents).map(|_| NodeTruth::default()).collect(),
            start,
        }
    }

    /// A new core: nothing it was told survives, but every node known from the store
    /// counts as heard at the start (the core gives each a node TTL).
    pub(super) fn restart(&mut self, cfg: Config, start: Start) {
        for (i, n) in self.nodes.iter_mut().enumerate() {
            *n = NodeTruth {
                heard: start.awaited.contains(&i).then_some(start.at),
                ..NodeTruth::default()
            };
        }
        self.cfg = cfg;
        self.start = start;
    }

    /// How long after it was last heard a node's view may be dropped.
    fn keep_for(&self) -> Duration {
        match self.cfg.liveness {
            Liveness::Embedded => self.cfg.node_ttl,
            Liveness::Cluster { stale_view_limit } => self.cfg.node_ttl + stale_view_limit,
        }
    }

    /// Whether the core must still have node `i`'s view.
    pub(super) fn alive(&self, i: usize, now: Timestamp) -> bool {
        let n = &self.nodes[i];
        !n.gone && n.heard.is_some_and(|h| now < h.plus(self.keep_for()))
    }

    /// Forgets what the core may have forgotten: the views and holds of nodes it may
    /// have dropped.
    pub(super) fn refresh(&mut self, now: Timestamp) {
        for i in 0..self.nodes.len() {
            if !self.alive(i, now) {
                let n = &mut self.nodes[i];
                n.told.clear();
                n.holds.clear();
                n.dropped = true;
            }
        }
    }

    pub(super) fn heard(&mut self, i: usize, now: Timestamp) {
        self.refresh(now);
        let n = &mut self.nodes[i];
        n.heard = Some(now);
    }

    pub(super) fn hello(&mut self, i: usize, session: SessionId, now: Timestamp) {
        self.heard(i, now);
        let n = &mut self.nodes[i];
        n.gone = false;
        if n.session != Some(session) {
            n.session = Some(session);
            n.max_seq = 0;
            for (_, _, number) in n.holds.values_mut() {
                *number = AllocationId::NONE;
            }
        }
    }

    pub(super) fn node_gone(&mut self, i: usize) {
        let n = &mut self.nodes[i];
        n.gone = true;
        n.dropped = true;
        n.told.clear();
        n.holds.clear();
    }

    /// An Allocate of node `i` answered `id` for `labels`.
    /// (An answer the store's write completes does not mean the node was heard.)
    /// `number` is the agent's number of the allocation.
    pub(super) fn answered(
        &mut self,
        i: usize,
        id: IdentityId,
        labels: &LabelSet,
        number: AllocationId,
        now: Timestamp,
    ) {
        self.refresh(now);
        let expires = now.plus(self.cfg.hold_timeout);
        let n = &mut self.nodes[i];
        // The core keeps the larger number of a hold it still has, or none if
        // either has none; the model cannot know whether it still has it (it may
        // have expired or moved), so it keeps the new number: the hold it records
        // ends no later than the core's.
        n.holds.insert(id, (labels.clone(), expires, number));
        n.answered.insert(id, expires);
    }

    /// A message of node `i` with `seq` reached the core, which answered `applied`.
    /// `entries` are the endpoints it carried (a snapshot replaces, an upsert adds,
    /// a delete carries the key alone). Returns a contradiction, if any.
    pub(super) fn delivered(
        &mut self,
        i: usize,
        seq: u64,
        now: Timestamp,
        msg: Delivered<'_>,
        applied: &Applied,
        bound: impl Fn(IdentityId, &LabelSet) -> bool,
    ) -> Result<(), String> {
        self.heard(i, now);
        let n = &mut self.nodes[i];
        let newest = n.max_seq;
        n.max_seq = n.max_seq.max(seq);
        if applied.ignored {
            // Only a message older than one already delivered may be ignored.
            return if seq <= newest {
                Ok(())
            } else {
                Err(format!(
                    "node {i}: message {seq} ignored, but the newest delivered was {newest}"
                ))
            };
        }
        // An entry the core left out, or referenced at another id than the one the
        // node holds (a Rebind sent or waiting for the store), is not what the node
        // told: the model does not protect it until the node reports it again.
        let accepted = |key: &EndpointKey, id: IdentityId, labels: &LabelSet| {
            !applied.pending.contains(key)
                && ((applied.unresolved == 0 && applied.rebinds == 0) || bound(id, labels))
        };
        let mut taken_up = Vec::new();
        match msg {
            Delivered::Snapshot(entries, settled) => {
                // The agent's allocations up to `settled` need no hold: what took
                // their identities up is in the snapshot.
                if settled.get() > 0 {
                    n.holds
                        .retain(|_, (_, _, number)| number.get() == 0 || *number > settled);
                }
                let old = std::mem::take(&mut n.told);
                for Endpoint {
                    key,
                    identity: id,
                    labels,
                    ..
                } in entries
                {
                    if n.told.contains_key(key) || !accepted(key, *id, labels) {
                        continue;
                    }
                    if old.get(key).map(|(o, _)| *o) != Some(*id) {
                        taken_up.push(*id);
                    }
                    n.told.insert(key.clone(), (*id, labels.clone()));
                }
                n.snapshotted = true;
                self.start
                    .claims
                    .extend(entries.iter().map(|e| (e.identity, e.labels.clone())));
            }
            Delivered::Upsert(Endpoint {
                key,
                identity,
                labels,
                ..
            }) => {
                let id = *identity;
                self.start.claims.insert((id, labels.clone()));
                let old = n.told.remove(key);
                if accepted(key, id, labels) {
                    if old.map(|(o, _)| o) != Some(id) {
                        taken_up.push(id);
                    }
                    n.told.insert(key.clone(), (id, labels.clone()));
                }
            }
            Delivered::Delete(key) => {
                n.told.remove(key);
            }
        }
        for id in taken_up {
            n.holds.remove(&id);
        }
        Ok(())
    }

    /// The agent applied a Rebind of `key`: the core's view had it corrected before;
    /// until the node reports it again, the model does not protect it.
    pub(super) fn rebound(&mut self, i: usize, key: &EndpointKey) {
        self.nodes[i].told.remove(key);
    }

    /// The core deleted the binding of `id` to `labels` from the store.
    pub(super) fn check_delete(
        &mut self,
        id: IdentityId,
        labels: &LabelSet,
        now: Timestamp,
    ) -> Result<(), String> {
        self.refresh(now);
        for (i, n) in self.nodes.iter().enumerate() {
            if !self.alive(i, now) {
                continue;
            }
            if let Some((key, _)) = n.told.iter().find(|(_, v)| v.0 == id && v.1 == *labels) {
                return Err(format!(
                    "delete of {id} ({labels}) while node {i} reports {key} holding it"
                ));
            }
            if let Some((_, until, _)) = n
                .holds
                .get(&id)
                .filter(|(l, until, _)| l == labels && now < *until)
            {
                return Err(format!(
                    "delete of {id} ({labels}) while node {i} holds it from an Allocate until {until}"
                ));
            }
        }
        let s = &self.start;
        if s.loaded.contains(&(id, labels.clone())) {
            if now < s.at.plus(self.cfg.node_ttl) {
                return Err(format!(
                    "delete of loaded {id} ({labels}) inside the restart protection (start {})",
                    s.at
                ));
            }
            if let Some(i) = s.awaited.iter().copied().find(|&i| {
                let n = &self.nodes[i];
                !n.snapshotted && !n.dropped && self.alive(i, now)
            }) {
                return Err(format!(
                    "delete of loaded {id} ({labels}) while node {i}, known at the start, has \
                     neither snapshotted nor been dropped"
                ));
            }
        }
        Ok(())
    }

    /// The core wrote a binding of `id` to `labels`.
    pub(super) fn check_create(
        &mut self,
        id: IdentityId,
        labels: &LabelSet,
        now: Timestamp,
    ) -> Result<(), String> {
        let s = &mut self.start;
        s.created.insert(id);
        let pair = (id, labels.clone());
        if s.empty
            && now < s.at.plus(self.cfg.adoption_window)
            && !s.claims.contains(&pair)
            && !s.loaded.contains(&pair)
        {
            return Err(format!(
                "new id {id} for {labels} inside the adoption window (start {}): no agent claimed it",
                s.at
            ));
        }
        s.claims.insert(pair);
        Ok(())
    }

    /// The core closed node `i`'s stream as expired (its view dropped).
    pub(super) fn check_expired(&self, i: usize, now: Timestamp) -> Result<(), String> {
        match self.nodes[i].heard {
            Some(h) if now < h.plus(self.keep_for()) => Err(format!(
                "node {i} dropped at {now}, heard at {h}: its view is kept for {:?}",
                self.keep_for()
            )),
            _ => Ok(()),
        }
    }

    /// The core refused a new id to node `i` for its hold quota.
    pub(super) fn check_hold_quota(
        &self,
        i: usize,
        pending: usize,
        now: Timestamp,
    ) -> Result<(), String> {
        let holds = self.nodes[i]
            .answered
            .values()
            .filter(|&&e| now < e)
            .count();
        if holds + pending < self.cfg.max_holds_per_node {
            return Err(format!(
                "node {i} refused for its hold quota {} with at most {holds} holds and {pending} pending",
                self.cfg.max_holds_per_node
            ));
        }
        Ok(())
    }

    /// The core refused a new id inside the adoption window.
    pub(super) fn check_window(&self, now: Timestamp) -> Result<(), String> {
        let s = &self.start;
        if s.empty && now < s.at.plus(self.cfg.adoption_window) {
            Ok(())
        } else {
            Err(format!(
                "Allocate refused for the adoption window at {now} (start {}, store empty: {})",
                s.at, s.empty
            ))
        }
    }

    /// The core said the range is exhausted; `used` are the ids of the range the store
    /// model holds, quarantines or blocks, plus every id loaded, created or taken
    /// from the store since the start.
    pub(super) fn check_exhausted(
        &self,
        range: IdRange,
        used: &BTreeSet<IdentityId>,
    ) -> Result<(), String> {
        let used = used
            .iter()
            .chain(&self.start.created)
            .chain(&self.start.taken)
            .chain(self.start.loaded.iter().map(|(id, _)| id))
            .filter(|id| range.contains(**id))
            .collect::<BTreeSet<_>>()
            .len() as u64;
        if used < range.size() {
            return Err(format!(
                "range {range} reported exhausted with at most {used} of {} ids used",
                range.size()
            ));
        }
        Ok(())
    }
}

/// The content of a delivered message.
pub(super) enum Delivered<'a> {
    /// The endpoints, and the highest allocation number settled.
    Snapshot(&'a [Endpoint], AllocationId),
    Upsert(&'a Endpoint),
    Delete(&'a EndpointKey),
}
