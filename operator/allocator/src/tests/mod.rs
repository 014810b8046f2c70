//! Tests of the allocator core: one module of focused unit tests per concern, a
//! model-based property test of the invariants, and the small builders they share.

mod accounting;
mod audit;
mod capacity;
mod gc;
mod invariants;
mod map;
mod model;
mod reads;
mod unit;

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, VecDeque},
    net::{IpAddr, Ipv4Addr},
    time::Duration,
};

use census_proto::{
    domain::{AllocationId, Endpoint, EndpointKey, IdRange, IdentityId, NodeName, SessionId},
    labels::{LabelLimits, LabelSet},
};

use super::*;
use crate::{Loaded, StoreError, StoreOp, StoredIdentity, Tombstone};

/// The nodes of the focused tests.
pub(super) const N1: &str = "node-1";
pub(super) const N2: &str = "node-2";

pub(super) fn labels(text: &str) -> LabelSet {
    let list: Vec<String> = text
        .split(',')
        .map(|l| format!("k8s:{}", l.trim()))
        .collect();
    match LabelSet::parse(&list, &LabelLimits::default()) {
        Ok(set) => set,
        Err(e) => panic!("test labels {text:?}: {e}"),
    }
}

pub(super) fn node(name: &str) -> NodeName {
    match NodeName::new(name) {
        Ok(n) => n,
        Err(e) => panic!("test node {name:?}: {e}"),
    }
}

pub(super) fn key(name: &str) -> EndpointKey {
    match EndpointKey::new("default", name) {
        Ok(k) => k,
        Err(e) => panic!("test key {name:?}: {e}"),
    }
}

pub(super) fn id(n: u32) -> IdentityId {
    match IdentityId::new(n) {
        Some(id) => id,
        None => panic!("id 0"),
    }
}

pub(super) fn session(start: u64) -> SessionId {
    SessionId {
        start_time_ns: start,
        nonce: 7,
    }
}

pub(super) fn mk_endpoint(name: &str, identity: u32, label_text: &str) -> Endpoint {
    let n = name.bytes().fold(0u8, |a, b| a.wrapping_add(b));
    Endpoint {
        key: key(name),
        ips: vec![IpAddr::V4(Ipv4Addr::new(198, 18, 0, n))].into_boxed_slice(),
        identity: id(identity),
        labels: labels(label_text),
    }
}

/// Node `n` connected with session `start`: the session and the stream.
pub(super) fn connected(h: &mut Harness, n: &str, start: u64) -> (SessionId, ConnId) {
    let s = session(start);
    match h.hello(n, s) {
        Ok(conn) => (s, conn),
        Err(e) => panic!("hello {n}: {e}"),
    }
}

/// The value of a result a test expects to succeed.
pub(super) fn ok<T, E: std::fmt::Display>(r: Result<T, E>) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("unexpected error: {e}"),
    }
}

pub(super) fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A store in memory with the semantics of `StoreOp`, applied synchronously, that
/// also checks what no store may ever see: one label set bound to two ids, or an id
/// rebound to other labels inside its quarantine.
#[derive(Debug, Default, Clone)]
pub(super) struct ModelStore {
    pub(super) identities: BTreeMap<IdentityId, LabelSet>,
    pub(super) nodes: BTreeMap<NodeName, ()>,
    pub(super) tombstones: BTreeMap<IdentityId, Tombstone>,
    /// Each deleted id's labels and the end of its quarantine (which runs from the
    /// moment the delete was issued, when nothing referenced or held the id).
    pub(super) deleted: HashMap<IdentityId, (LabelSet, Timestamp)>,
    pub(super) quarantine: Duration,
    /// The store was lost once: ids may legitimately be rebound inside a quarantine
    /// nobody remembers.
    pub(super) lost: bool,
    /// Bindings census did not write (a restored backup, an object applied by hand):
    /// a create of their labels at another id is refused as a real store refuses it.
    /// Any other second binding of one label set is a core bug.
    pub(super) foreign: BTreeSet<IdentityId>,
    /// Tombstones someone deleted that census has not written again yet: an operator
    /// that restarts before it does cannot know those quarantines.
    pub(super) lost_tombstones: BTreeSet<IdentityId>,
    /// Bindings written by census ops whose success the core was never told (a write
    /// that committed but answered an error, or committed late): like foreign ones,
    /// the core may not know them, and the store answers as a real store would.
    pub(super) unreported: BTreeSet<IdentityId>,
    /// Objects someone edited so they bind no valid label set (or other labels than
    /// census wrote): every write census makes to them conflicts.
    pub(super) invalid: BTreeMap<IdentityId, String>,
    /// How far the operator's clock has stepped back since the store was made:
    /// `deleted` keeps the end of each quarantine in real time (the core's clock
    /// plus this), as a quarantine that ended before a step back has ended.
    pub(super) skew_ms: u64,
    /// Every id where an object census did not write (or did not hear back about)
    /// ever appeared: the only ids the core may block.
    pub(super) others: BTreeSet<IdentityId>,
    /// Tombstones written by a late commit whose quarantine had ended when it landed
    /// (after the core deleted the tombstone it knew): nothing tells the core of them.
    pub(super) ended_late: BTreeSet<IdentityId>,
}

impl ModelStore {
    pub(super) fn new(quarantine: Duration) -> Self {
        Self {
            quarantine,
            ..Self::default()
        }
    }

    pub(super) fn load(&self) -> Loaded {
        Loaded {
            identities: self
                .identities
                .iter()
                .map(|(&id, labels)| StoredIdentity {
                    id,
                    labels: labels.clone(),
                })
                .collect(),
            nodes: self.nodes.keys().cloned().collect(),
            tombstones: self.tombstones.values().copied().collect(),
        }
    }

    pub(super) fn apply(&mut self, op: &StoreOp, now: Timestamp) -> Result<(), StoreError> {
        match op {
            StoreOp::CreateIdentity { id, labels } => {
                if let Some(found) = self.invalid.get(id) {
                    return Err(StoreError::Conflict {
                        id: *id,
                        expected: labels.to_string(),
                        found: found.clone(),
                    });
                }
                if let Some(bound) = self.identities.get(id) {
                    return if bound == labels {
                        Ok(())
                    } else {
                        Err(conflict(*id, labels, bound))
                    };
                }
                if let Some((&other, _)) = self.identities.iter().find(|(_, l)| *l == labels) {
                    if self.foreign.contains(&other) || self.unreported.contains(&other) {
                        return Err(StoreError::LabelsBound {
                            id: *id,
                            labels: labels.to_string(),
                            bound: other,
                        });
                    }
                    panic!("label set {labels} would be bound to {id} while bound to {other}");
                }
                let now = Timestamp::from_millis(now.as_millis() + self.skew_ms);
                if let Some((old, until)) = self.deleted.get(id)
                    && !self.lost
                    && old != labels
                    && now < *until
                {
                    panic!(
                        "id {id} rebound from {old} to {labels} {}ms before its quarantine ends",
                        until.since(now).as_millis()
                    );
                }
                self.tombstones.remove(id);
                self.lost_tombstones.remove(id);
                self.ended_late.remove(id);
                self.identities.insert(*id, labels.clone());
                Ok(())
            }
            StoreOp::DeleteIdentity {
                id,
                labels,
                tombstone,
            } => {
                if let Some(found) = self.invalid.get(id) {
                    return Err(StoreError::Conflict {
                        id: *id,
                        expected: labels.to_string(),
                        found: found.clone(),
                    });
                }
                match self.identities.get(id) {
                    Some(bound) if bound != labels => return Err(conflict(*id, labels, bound)),
                    Some(_) => {
                        self.identities.remove(id);
                        self.foreign.remove(id);
                        self.unreported.remove(id);
                        let until = Timestamp::from_millis(tombstone.until_ms + self.skew_ms);
                        self.deleted.insert(*id, (labels.clone(), until));
                    }
                    // Gone already (someone deleted it): the tombstone object still
                    // keeps the labels it quarantines.
                    None => {
                        // What an older delete of the id kept is replaced, as the
                        // tombstone object is.
                        let until = Timestamp::from_millis(tombstone.until_ms + self.skew_ms);
                        self.deleted.insert(*id, (labels.clone(), until));
                    }
                }
                self.tombstones.insert(*id, *tombstone);
                self.lost_tombstones.remove(id);
                Ok(())
            }
            StoreOp::DeleteTombstone { id } => {
                self.tombstones.remove(id);
                self.ended_late.remove(id);
                Ok(())
            }
            StoreOp::PutNode { node } => {
                self.nodes.insert(node.clone(), ());
                Ok(())
            }
            StoreOp::DeleteNode { node } => {
                self.nodes.remove(node);
                Ok(())
            }
        }
    }
}

/// The id holds another valid binding (an invalid object answers `Conflict`).
fn conflict(id: IdentityId, expected: &LabelSet, found: &LabelSet) -> StoreError {
    StoreError::IdBound {
        id,
        labels: expected.to_string(),
        bound: found.clone(),
    }
}

/// A core, a model store and a clock, with effects routed: store ops are queued
/// until `settle_store`, everything else is collected for the test to inspect.
pub(super) struct Harness {
    pub(super) alloc: Allocator,
    pub(super) store: ModelStore,
    pub(super) now: Timestamp,
    /// Store ops waiting, one queue per writer, as in the daemon.
    pub(super) pending_ops: VecDeque<StoreOp>,
    pub(super) pending_gc: VecDeque<StoreOp>,
    pub(super) replies: Vec<(RequestId, Result<IdentityId, AllocError>)>,
    pub(super) agent_msgs: Vec<(NodeName, ConnId, AgentMsg)>,
    pub(super) watch: Vec<WatchChange>,
    /// What a Watch subscriber holds: the full list at start, then every change.
    watched: BTreeMap<IdentityId, IdentityInfo>,
    /// Every delete emitted, with the identity's refs and holds at the time.
    pub(super) deletes_issued: Vec<(IdentityId, u32, u32)>,
    /// Every store op emitted, with whether its id was bound in the core then (a
    /// DeleteIdentity of an unbound id writes a lost tombstone again), for the
    /// model test's checks; whoever reads it empties it.
    pub(super) emitted: Vec<(StoreOp, bool)>,
    /// What an endpoint map watcher holds, if every event's delta is taken (and
    /// checked against the map) as it is routed; `None` for tests that take them.
    pub(super) replay: Option<map::Replayed>,
    next_req: RequestId,
}

pub(super) fn small_config() -> Config {
    Config {
        range: match IdRange::new(256, 1023) {
            Ok(r) => r,
            Err(e) => panic!("{e}"),
        },
        snapshot_interval: ms(1_000),
        node_ttl: ms(3_000),
        hold_timeout: ms(3_000),
        grace: ms(2_000),
        quarantine: ms(10_000),
        adoption_window: ms(3_000),
        liveness: Liveness::Embedded,
        max_holds_per_node: 64,
        gc_rate: 1000.0,
        gc_burst: 100.0,
        max_inflight_deletes: 50,
        retry_base: ms(500),
        retry_max: ms(4_000),
        allocate_deadline: ms(10_000),
    }
}

impl Harness {
    /// A core over an empty store whose start windows have passed.
    pub(super) fn new(cfg: Config) -> Self {
        let window = cfg.node_ttl.max(cfg.adoption_window);
        let store = ModelStore::new(cfg.quarantine);
        let mut h = Self::with_store(cfg, store, Timestamp::from_millis(1_000_000));
        h.advance(window);
        h
    }

    pub(super) fn with_store(cfg: Config, store: ModelStore, now: Timestamp) -> Self {
        let alloc = Allocator::new(cfg, store.load(), now);
        let watched = alloc.bindings().into_iter().map(|i| (i.id, i)).collect();
        let mut h = Self {
            alloc,
            store,
            now,
            pending_ops: VecDeque::new(),
            pending_gc: VecDeque::new(),
            replies: Vec::new(),
            agent_msgs: Vec::new(),
            watch: Vec::new(),
            watched,
            deletes_issued: Vec::new(),
            emitted: Vec::new(),
            replay: Some(map::Replayed::default()),
            next_req: 1,
        };
        h.route();
        h
    }

    /// Moves the core's effects to where they go.
    pub(super) fn route(&mut self) {
        for effect in self.alloc.drain_effects() {
            match effect {
                Effect::Store { op, priority } => {
                    if let StoreOp::DeleteIdentity { id, .. } = &op {
                        let (refs, holds) = self
                            .alloc
                            .identity(*id)
                            .map_or((0, 0), |i| (i.refs, i.holds));
                        self.deletes_issued.push((*id, refs, holds));
                    }
                    let bound = match &op {
                        StoreOp::CreateIdentity { id, .. } | StoreOp::DeleteIdentity { id, .. } => {
                            self.alloc.identity(*id).is_some_and(|i| i.labels.is_some())
                        }
                        _ => false,
                    };
                    self.emitted.push((op.clone(), bound));
                    match priority {
                        Priority::Allocation => self.pending_ops.push_back(op),
                        Priority::Gc => self.pending_gc.push_back(op),
                    }
                }
                Effect::Reply { req, result } => self.replies.push((req, result)),
                Effect::Agent { node, conn, msg } => self.agent_msgs.push((node, conn, msg)),
                Effect::Watch(change) => {
                    match &change {
                        WatchChange::Upsert(info) => {
                            self.watched.insert(info.id, info.clone());
                        }
                        WatchChange::Removed { id, labels } => {
                            let gone = self.watched.remove(id);
                            assert_eq!(
                                gone.and_then(|i| i.labels).as_ref(),
                                Some(labels),
                                "Removed {id} was not shown with these labels"
                            );
                        }
                    }
                    self.watch.push(change);
                }
            }
        }
        invariants::check(&self.alloc);
        reads::check(&self.alloc);
        map::check(&self.alloc);
        if let Some(replay) = &mut self.replay {
            replay.apply(self.alloc.take_map_delta());
            assert_eq!(
                *replay,
                map::Replayed::of(&self.alloc),
                "what the map's deltas told differs from the map"
            );
        }
        // Watch tells the truth: after every event, a subscriber that got the full
        // list once and every change since holds every binding exactly as it is.
        let truth: BTreeMap<IdentityId, IdentityInfo> = self
            .alloc
            .bindings()
            .into_iter()
            .map(|i| (i.id, i))
            .collect();
        assert_eq!(self.watched, truth, "what Watch told differs from the core");
    }

    /// Applies every queued store op (and those they cause) successfully.
    /// Every store op waiting, allocation writes first.
    pub(super) fn pending(&self) -> impl Iterator<Item = &StoreOp> {
        self.pending_ops.iter().chain(&self.pending_gc)
    }

    pub(super) fn pop_pending(&mut self) -> Option<StoreOp> {
        self.pending_ops
            .pop_front()
            .or_else(|| self.pending_gc.pop_front())
    }

    pub(super) fn settle_store(&mut self) {
        while let Some(op) = self.pop_pending() {
            let result = self.store.apply(&op, self.now);
            self.alloc.store_result(op, result, self.now);
            self.route();
        }
    }

    /// Fails every queued store op with a transient error.
    pub(super) fn fail_store(&mut self) {
        let ops: Vec<StoreOp> = self
            .pending_ops
            .drain(..)
            .chain(self.pending_gc.drain(..))
            .collect();
        for op in ops {
            let err = StoreError::Unavailable {
                cause: "io",
                detail: "injected".into(),
            };
            self.alloc.store_result(op, Err(err), self.now);
            self.route();
        }
    }

    pub(super) fn advance(&mut self, d: Duration) {
        self.now = self.now.plus(d);
        self.alloc.tick(self.now);
        self.route();
    }

    pub(super) fn hello(&mut self, node_name: &str, s: SessionId) -> Result<ConnId, SyncError> {
        let r = self
            .alloc
            .hello(&node(node_name), s, self.now)
            .map(|a| a.conn);
        self.route();
        r
    }

    /// Allocate from an agent that numbers no allocation.
    pub(super) fn allocate(
        &mut self,
        node_name: &str,
        s: SessionId,
        l: &str,
    ) -> Result<Option<IdentityId>, AllocError> {
        self.allocate_numbered(node_name, s, 0, l)
    }

    /// Allocate as the agent's allocation `n`.
    pub(super) fn allocate_numbered(
        &mut self,
        node_name: &str,
        s: SessionId,
        n: u64,
        l: &str,
    ) -> Result<Option<IdentityId>, AllocError> {
        let req = self.next_req;
        self.next_req += 1;
        let now = self.now;
        let r = self.alloc.allocate(
            req,
            &node(node_name),
            s,
            AllocationId::new(n),
            labels(l),
            now,
        );
        self.route();
        r
    }

    /// Allocate, settling the store if the answer is pending.
    pub(super) fn allocate_now(
        &mut self,
        node_name: &str,
        s: SessionId,
        l: &str,
    ) -> Result<IdentityId, AllocError> {
        let req = self.next_req;
        match self.allocate(node_name, s, l)? {
            Some(id) => Ok(id),
            None => {
                self.settle_store();
                let pos = self.replies.iter().position(|(r, _)| *r == req);
                match pos {
                    Some(i) => self.replies.remove(i).1,
                    None => panic!("no reply for request {req}"),
                }
            }
        }
    }

    pub(super) fn snapshot(
        &mut self,
        node_name: &str,
        conn: ConnId,
        seq: u64,
        eps: Vec<Endpoint>,
    ) -> Result<Applied, SyncError> {
        self.snapshot_settled(node_name, conn, seq, eps, 0)
    }

    /// A snapshot saying the agent's allocations up to `settled` have settled.
    pub(super) fn snapshot_settled(
        &mut self,
        node_name: &str,
        conn: ConnId,
        seq: u64,
        eps: Vec<Endpoint>,
        settled: u64,
    ) -> Result<Applied, SyncError> {
        let now = self.now;
        let r = self.alloc.snapshot(
            &node(node_name),
            conn,
            seq,
            eps,
            AllocationId::new(settled),
            now,
        );
        self.route();
        r
    }

    pub(super) fn upsert(
        &mut self,
        node_name: &str,
        conn: ConnId,
        seq: u64,
        ep: Endpoint,
    ) -> Result<Applied, SyncError> {
        let r = self.alloc.upsert(&node(node_name), conn, seq, ep, self.now);
        self.route();
        r
    }

    pub(super) fn delete(
        &mut self,
        node_name: &str,
        conn: ConnId,
        seq: u64,
        name: &str,
    ) -> Result<Applied, SyncError> {
        let r = self
            .alloc
            .delete(&node(node_name), conn, seq, &key(name), self.now);
        self.route();
        r
    }

    pub(super) fn refs(&self, n: u32) -> u32 {
        self.alloc.identity(id(n)).map_or(0, |i| i.refs)
    }

    pub(super) fn state(&self, n: u32) -> Option<IdentityState> {
        self.alloc.identity(id(n)).map(|i| i.state)
    }

    pub(super) fn rebinds(&self) -> Vec<(String, u32)> {
        self.agent_msgs
            .iter()
            .filter_map(|(_, _, m)| match m {
                AgentMsg::Rebind { key, identity } => Some((key.name().to_owned(), identity.get())),
                _ => None,
            })
            .collect()
    }
}
