//! The simulated world around the core: agents with real endpoint state over lossy,
//! duplicating, reordering channels (both ways), a store that fails, commits late and
//! is edited behind census's back (its own watch reports what changed), operator and
//! agent restarts, Nodes deleted, and time passing. Every effect the core emits is
//! checked against [`Truth`] as it is emitted.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use census_proto::{
    domain::{AllocationId, Endpoint, EndpointKey, IdentityId, NodeName, SessionId},
    labels::LabelSet,
};

use super::{
    super::{
        AgentMsg, AllocError, CloseReason, ConnId, Harness, IpAddr, Ipv4Addr, ModelStore,
        RequestId, StoreError, StoreOp, SyncError, Timestamp, key, labels, ms, node, session,
    },
    AGENTS, SETTLE_OPS,
    actions::{Action, Answer, Fate, RebindFate, STALE_VIEW_LIMIT, Setup},
    truth::{Delivered, Start, Truth},
};
use crate::{Allocator, Applied, Counters, StoreEvent, nodes::NodeCounters};

#[derive(Debug, Clone)]
pub(super) enum Msg {
    Upsert(Endpoint),
    Delete(EndpointKey),
    /// The endpoints, and the highest allocation number settled.
    Snapshot(Vec<Endpoint>, AllocationId),
}

#[derive(Debug)]
pub(super) struct Agent {
    pub(super) name: NodeName,
    session: SessionId,
    /// The stream of the running process.
    pub(super) conn: Option<ConnId>,
    /// A dead process's stream the core may still think open (no FIN, no keepalive
    /// answers yet).
    zombie: Option<ConnId>,
    seq: u64,
    /// What the pod source says: pod -> labels.
    wanted: BTreeMap<EndpointKey, LabelSet>,
    /// What the maps hold: pod -> (identity, labels). The truth for snapshots.
    pub(super) held: BTreeMap<EndpointKey, (IdentityId, LabelSet)>,
    outbox: VecDeque<(u64, Msg)>,
    /// Rebinds on their way from the core: (stream, endpoint, identity).
    inbox: VecDeque<(ConnId, EndpointKey, IdentityId)>,
    /// The labels each pod had when it was last removed.
    gone: BTreeMap<EndpointKey, LabelSet>,
    /// Allocate calls waiting for an answer: request -> pod, and the allocation's
    /// number.
    pub(super) pending: HashMap<RequestId, (EndpointKey, LabelSet, AllocationId)>,
    /// The last allocation number of the process (from 1 in each session).
    allocations: AllocationId,
}

impl Agent {
    fn endpoint(key: &EndpointKey, id: IdentityId, labels: &LabelSet) -> Endpoint {
        let n = key.name().bytes().fold(0u8, |a, b| a.wrapping_add(b));
        Endpoint {
            key: key.clone(),
            ips: vec![IpAddr::V4(Ipv4Addr::new(198, 18, 1, n))].into_boxed_slice(),
            identity: id,
            labels: labels.clone(),
        }
    }

    fn truth(&self) -> Vec<Endpoint> {
        self.held
            .iter()
            .map(|(k, (id, l))| Self::endpoint(k, *id, l))
            .collect()
    }

    fn send(&mut self, msg: Msg) {
        self.seq += 1;
        self.outbox.push_back((self.seq, msg));
    }

    fn send_snapshot(&mut self) {
        let truth = self.truth();
        let settled = self.settled();
        self.send(Msg::Snapshot(truth, settled));
    }

    /// Every allocation up to this number is answered (and what took its identity
    /// up is in `held`) or given up: the lowest waiting for an answer, less one.
    fn settled(&self) -> AllocationId {
        self.pending
            .values()
            .map(|(_, _, n)| AllocationId::new(n.get() - 1))
            .min()
            .unwrap_or(self.allocations)
    }

    /// The number of a new allocation.
    fn next_allocation(&mut self) -> AllocationId {
        self.allocations = self.allocations.next();
        self.allocations
    }
}

/// What the world did that the core's counters do not show, for coverage.
#[derive(Debug, Default, Clone)]
pub(super) struct Seen {
    /// Agents of deleted Nodes refused, let in once their Node was back.
    pub(super) nodes_back: u64,
    pub(super) range_exhausted: u64,
    pub(super) hold_quota: u64,
    pub(super) adoption_window: u64,
    pub(super) pending_entries: u64,
    pub(super) older_session_refused: u64,
    pub(super) older_session_accepted: u64,
    pub(super) expired_in_cluster: u64,
    pub(super) nodes_gone: u64,
    pub(super) late_commits: u64,
    pub(super) commit_then_fail: u64,
    pub(super) rebinds_dropped: u64,
    pub(super) rebinds_delayed: u64,
    pub(super) messages_delayed: u64,
    pub(super) store_events: u64,
    pub(super) foreign: u64,
    pub(super) edited: u64,
    pub(super) conflicts: u64,
    pub(super) labels_bound: u64,
    pub(super) clock_steps: u64,
    pub(super) bursts: u64,
    /// Bursts whose pods ended before their Allocates were answered.
    pub(super) early_bursts: u64,
    /// Late creates dropped because their labels were bound elsewhere since.
    pub(super) late_duplicates: u64,
    /// Agents restarted with a pod's labels changed under its pinned identity.
    pub(super) relabelled: u64,
    /// Agents down past their node's view.
    pub(super) outages: u64,
    /// Entries delivered claiming an id quarantined for other labels, their own
    /// labels bound nowhere: the core must give them a new id, not adopt the claim.
    pub(super) quarantined_claims: u64,
}

pub(super) struct Sim {
    pub(super) h: Harness,
    pub(super) agents: Vec<Agent>,
    pub(super) truth: Truth,
    pub(super) setup: Setup,
    /// Changes the store's watch has seen and not yet reported to the core.
    events: VecDeque<StoreEvent>,
    /// Writes answered with an error that will still land, with what the store held
    /// for their id then: like every census write (a resourceVersion precondition in
    /// Kubernetes, commits in call order in redb), one lands only on what it was
    /// written against.
    late: VecDeque<(StoreOp, IdState)>,
    next_req: RequestId,
    clock_ns: u64,
    run: u32,
    /// The agent whose Hello (or whose Node's deletion) is being handled: only then
    /// may the core close its stream as replaced (or gone).
    hello_of: Option<usize>,
    gone_of: Option<usize>,
    pub(super) seen: Seen,
    /// Every Allocate not yet answered -> its agent (also those of agent processes
    /// that died meanwhile: the core still counts them against the quota).
    outstanding: BTreeMap<RequestId, (usize, AllocationId)>,
}

/// What the store holds for one id.
type IdState = (Option<LabelSet>, Option<crate::Tombstone>, Option<String>);

fn id_state(s: &ModelStore, op: &StoreOp) -> IdState {
    match op {
        StoreOp::CreateIdentity { id, .. }
        | StoreOp::DeleteIdentity { id, .. }
        | StoreOp::DeleteTombstone { id } => (
            s.identities.get(id).cloned(),
            s.tombstones.get(id).copied(),
            s.invalid.get(id).cloned(),
        ),
        StoreOp::PutNode { .. } | StoreOp::DeleteNode { .. } => (None, None, None),
    }
}

/// What one node's message may change in the core's counters, and the node's view
/// (key -> identity), read before and after the core handles it: the counters a
/// message moves must move by what its answer says, and the references a snapshot
/// changes are the difference between the views.
struct Accounts {
    core: Counters,
    node: Option<(NodeCounters, bool, HashMap<EndpointKey, IdentityId>)>,
    /// The node's holds: identity -> the allocation's number.
    holds: BTreeMap<IdentityId, AllocationId>,
}

impl Accounts {
    fn of(alloc: &Allocator, name: &NodeName) -> Self {
        Self {
            core: alloc.counters().clone(),
            node: alloc.nodes.get(name).map(|n| {
                let view = n.view.iter().map(|(k, v)| (k.clone(), v.id)).collect();
                (n.counters, n.first_snapshot_pending, view)
            }),
            holds: alloc.nodes.get(name).map_or_else(BTreeMap::new, |n| {
                n.holds.iter().map(|(id, h)| (*id, h.allocation)).collect()
            }),
        }
    }

    fn account(&self, after: &Self, msg: &Msg, applied: Option<&Applied>) -> Result<(), String> {
        let Some(applied) = applied else {
            return if after.core == self.core
                && after.node.as_ref().map(|n| n.0) == self.node.as_ref().map(|n| n.0)
            {
                Ok(())
            } else {
                Err("a refused message changed the counters".to_owned())
            };
        };
        let (Some((n0, first, v0)), Some((n1, _, v1))) = (&self.node, &after.node) else {
            return Err("a message was applied to a node the core does not know".to_owned());
        };
        let (c0, c1) = (&self.core, &after.core);
        let mut want = c0.clone();
        let mut node = *n0;
        if applied.ignored {
            want.old_seq_ignored += 1;
            node.old_seq_ignored += 1;
        } else {
            match msg {
                Msg::Upsert(_) | Msg::Delete(_) => want.deltas += 1,
                Msg::Snapshot(..) => want.snapshots += 1,
            }
        }
        want.adoptions += applied.adoptions;
        want.corrections += applied.corrections;
        want.rebinds += applied.rebinds;
        want.unresolved += applied.unresolved;
        node.adoptions += applied.adoptions;
        node.corrections += applied.corrections;
        node.rebinds += applied.rebinds;
        // What resolving entries may add besides: identities adopted or made.
        want.identities_adopted = c1.identities_adopted;
        want.allocations_new = c1.allocations_new;
        // A hold ends when an endpoint takes its identity up; an accepted snapshot
        // also ends those of the allocations it says have settled, and no other.
        let taken_up: BTreeSet<IdentityId> = v1
            .iter()
            .filter(|(key, id)| v0.get(*key) != Some(*id))
            .map(|(_, id)| *id)
            .collect();
        let settled = match msg {
            Msg::Snapshot(_, settled) if !applied.ignored => *settled,
            _ => AllocationId::NONE,
        };
        let settles = |id: &IdentityId, n: &AllocationId| {
            !taken_up.contains(id) && n.is_some() && *n <= settled
        };
        let mut holds = self.holds.clone();
        holds.retain(|id, n| !taken_up.contains(id) && !settles(id, n));
        want.holds_settled += self.holds.iter().filter(|(id, n)| settles(id, n)).count() as u64;
        if holds != after.holds {
            return Err(format!(
                "holds after {applied:?} (settled {settled:?}): core {:?}; expected {holds:?}",
                after.holds
            ));
        }
        if *c1 != want || *n1 != node {
            return Err(format!(
                "counters after {applied:?}: core {c1:?}, node {n1:?}; \
                 expected core {want:?}, node {node:?}"
            ));
        }
        if let Msg::Snapshot(..) = msg
            && !applied.ignored
        {
            let changed = v0
                .iter()
                .map(|(key, id)| match v1.get(key) {
                    Some(now) if now == id => 0,
                    Some(_) => 2,
                    None => 1,
                })
                .sum::<u64>()
                + v1.keys().filter(|key| !v0.contains_key(*key)).count() as u64;
            let (counted, other) = if *first {
                (applied.adoptions, applied.corrections)
            } else {
                (applied.corrections, applied.adoptions)
            };
            if counted != changed || other != 0 {
                return Err(format!(
                    "a snapshot changed {changed} references (first of its session: \
                     {first}), and answered {applied:?}"
                ));
            }
        }
        Ok(())
    }
}

/// Fails the run with what the core contradicted.
fn check(r: Result<(), String>) {
    if let Err(e) = r {
        panic!("{e}");
    }
}

impl Sim {
    pub(super) fn new(setup: Setup) -> Self {
        let cfg = setup.config();
        let start = Timestamp::from_millis(1_000_000);
        let mut h = Harness::with_store(cfg.clone(), ModelStore::new(cfg.quarantine), start);
        h.advance(cfg.node_ttl.max(cfg.adoption_window));
        let agents = (0..AGENTS)
            .map(|i| Agent {
                name: node(&format!("node-{i}")),
                session: session(1_000 + i as u64),
                conn: None,
                zombie: None,
                seq: 0,
                wanted: BTreeMap::new(),
                held: BTreeMap::new(),
                outbox: VecDeque::new(),
                inbox: VecDeque::new(),
                gone: BTreeMap::new(),
                pending: HashMap::new(),
                allocations: AllocationId::NONE,
            })
            .collect();
        let truth = Truth::new(
            cfg,
            AGENTS,
            Start {
                at: start,
                loaded: BTreeSet::new(),
                awaited: BTreeSet::new(),
                empty: true,
                claims: BTreeSet::new(),
                created: BTreeSet::new(),
                taken: BTreeSet::new(),
            },
        );
        Self {
            h,
            agents,
            truth,
            setup,
            events: VecDeque::new(),
            late: VecDeque::new(),
            next_req: 1_000_000,
            clock_ns: 1_000_000,
            run: 0,
            hello_of: None,
            gone_of: None,
            seen: Seen::default(),
            outstanding: BTreeMap::new(),
        }
    }

    fn label_set(&mut self, n: u8) -> LabelSet {
        if n < 4 {
            labels(&format!("app=shared-{n}"))
        } else {
            // A Job pod: unique labels per run.
            self.run += 1;
            labels(&format!("app=job,job-name=run-{}", self.run))
        }
    }

    fn agent_of(&self, name: &NodeName) -> Option<usize> {
        self.agents.iter().position(|a| a.name == *name)
    }

    /// Routes the core's effects (store ops are checked and queued, replies, rebinds
    /// and closes go to the agents).
    fn route(&mut self) {
        self.h.route();
        let now = self.h.now;
        for (op, bound) in std::mem::take(&mut self.h.emitted) {
            match &op {
                StoreOp::DeleteIdentity { id, labels, .. } if bound => {
                    check(self.truth.check_delete(*id, labels, now));
                }
                StoreOp::CreateIdentity { id, labels } => {
                    check(self.truth.check_create(*id, labels, now));
                }
                _ => {}
            }
        }
        for (req, result) in std::mem::take(&mut self.h.replies) {
            let asked_by = self.outstanding.remove(&req);
            let Some(i) = self
                .agents
                .iter()
                .position(|a| a.pending.contains_key(&req))
            else {
                // An answer to a process that died: its node holds the id all the same.
                if let (Some((i, n)), Ok(id)) = (asked_by, &result) {
                    let labels = self.h.alloc.identity(*id).and_then(|info| info.labels);
                    if let Some(l) = labels {
                        self.truth.answered(i, *id, &l, n, now);
                    }
                }
                continue;
            };
            let Some((key, l, n)) = self.agents[i].pending.remove(&req) else {
                continue;
            };
            match result {
                Ok(id) => {
                    self.truth.answered(i, id, &l, n, now);
                    let a = &mut self.agents[i];
                    if a.wanted.get(&key) == Some(&l) && !a.held.contains_key(&key) {
                        a.held.insert(key.clone(), (id, l.clone()));
                        a.send(Msg::Upsert(Agent::endpoint(&key, id, &l)));
                    }
                }
                Err(e) => self.alloc_error(i, &e),
            }
        }
        for (name, conn, msg) in std::mem::take(&mut self.h.agent_msgs) {
            let Some(i) = self.agent_of(&name) else {
                continue;
            };
            let a = &mut self.agents[i];
            match msg {
                AgentMsg::Rebind { key, identity } => {
                    // The core corrected its view: from now on the model does not
                    // hold it to what the node told it of this endpoint.
                    self.truth.rebound(i, &key);
                    if a.conn == Some(conn) {
                        a.inbox.push_back((conn, key, identity));
                    }
                }
                AgentMsg::SnapshotNow => {
                    if a.conn == Some(conn) {
                        a.send_snapshot();
                    }
                }
                AgentMsg::Close(reason) => {
                    if a.zombie == Some(conn) {
                        a.zombie = None;
                    }
                    if a.conn != Some(conn) {
                        continue;
                    }
                    a.conn = None;
                    match reason {
                        CloseReason::Expired => {
                            if self.setup.cluster {
                                self.seen.expired_in_cluster += 1;
                            }
                            check(self.truth.check_expired(i, now));
                        }
                        CloseReason::NodeGone => {
                            assert_eq!(self.gone_of, Some(i), "node {i} closed as gone");
                        }
                        CloseReason::Replaced { .. } => {
                            assert_eq!(self.hello_of, Some(i), "node {i} closed as replaced");
                        }
                    }
                }
            }
        }
    }

    /// An Allocate refused: each refusal must be one the world explains.
    fn alloc_error(&mut self, i: usize, e: &AllocError) {
        let now = self.h.now;
        match e {
            AllocError::RangeExhausted { .. } => {
                self.seen.range_exhausted += 1;
                let used = self.store_used();
                check(self.truth.check_exhausted(self.h.alloc.range(), &used));
            }
            AllocError::HoldQuota { .. } => {
                self.seen.hold_quota += 1;
                let pending = self.outstanding.values().filter(|&&(a, _)| a == i).count();
                check(self.truth.check_hold_quota(i, pending, now));
            }
            AllocError::AdoptionWindow { .. } => {
                self.seen.adoption_window += 1;
                check(self.truth.check_window(now));
            }
            AllocError::StoreUnavailable { .. } | AllocError::Sync(_) => {}
        }
    }

    /// Whether every id of the range may be in use (as [`Sim::store_used`] counts).
    pub(super) fn range_full(&self) -> bool {
        self.truth
            .check_exhausted(self.h.alloc.range(), &self.store_used())
            .is_ok()
    }

    /// Every id the store binds, quarantines, blocks or may still write.
    fn store_used(&self) -> BTreeSet<IdentityId> {
        let s = &self.h.store;
        let now = self.h.now;
        let mut used: BTreeSet<IdentityId> = s
            .identities
            .keys()
            .chain(s.tombstones.keys())
            .chain(&s.lost_tombstones)
            .chain(s.invalid.keys())
            .copied()
            .collect();
        used.extend(
            s.deleted
                .iter()
                .filter(|(_, (_, until))| now.plus(ms(s.skew_ms)) < *until)
                .map(|(id, _)| *id),
        );
        // Bindings someone deleted that the core has not been told of yet.
        for event in &self.events {
            if let StoreEvent::BindingLost { id, .. } = event {
                used.insert(*id);
            }
        }
        for op in self.h.pending().chain(self.late.iter().map(|(op, _)| op)) {
            if let StoreOp::CreateIdentity { id, .. } | StoreOp::DeleteIdentity { id, .. } = op {
                used.insert(*id);
            }
        }
        used
    }

    pub(super) fn connect(&mut self, i: usize) {
        let now = self.h.now;
        let a = &mut self.agents[i];
        self.hello_of = Some(i);
        let mut hello = self.h.alloc.hello(&a.name, a.session, now);
        if let Err(SyncError::NodeGone { .. }) = hello {
            // A deleted Node's agent is refused until the Node exists again: here it
            // comes back (a node re-joining under its name) and the agent is let in.
            self.seen.nodes_back += 1;
            self.h.alloc.set_node_addresses(&a.name, Vec::new(), now);
            hello = self.h.alloc.hello(&a.name, a.session, now);
        }
        match hello {
            Ok(acc) => {
                if a.zombie.is_some() {
                    self.seen.older_session_accepted += 1;
                }
                a.conn = Some(acc.conn);
                // After every (re)connect the agent sends a snapshot first.
                a.outbox.clear();
                a.send_snapshot();
                let s = a.session;
                self.truth.hello(i, s, now);
            }
            Err(SyncError::StaleSession { .. }) => {
                // Only while the older process's stream is still open.
                assert!(
                    a.zombie.is_some(),
                    "{}: an older session is refused though no stream of the node is open",
                    a.name
                );
                self.seen.older_session_refused += 1;
            }
            Err(e) => panic!("hello refused: {e}"),
        }
        self.route();
        self.hello_of = None;
    }

    fn deliver(&mut self, i: usize, seq: u64, msg: Msg) {
        let now = self.h.now;
        let a = &self.agents[i];
        let Some(conn) = a.conn else { return };
        let name = a.name.clone();
        let claims: &[Endpoint] = match &msg {
            Msg::Upsert(ep) => std::slice::from_ref(ep),
            Msg::Snapshot(eps, _) => eps,
            Msg::Delete(_) => &[],
        };
        let ids = &self.h.alloc.core.ids;
        self.seen.quarantined_claims += claims
            .iter()
            .filter(|e| {
                ids.id_of(&e.labels).is_none()
                    && ids
                        .quarantine()
                        .get(&e.identity)
                        .is_some_and(|t| t.labels_hash != e.labels.stable_hash())
            })
            .count() as u64;
        let before = Accounts::of(&self.h.alloc, &name);
        let r = match msg.clone() {
            Msg::Upsert(ep) => self.h.alloc.upsert(&name, conn, seq, ep, now),
            Msg::Delete(key) => self.h.alloc.delete(&name, conn, seq, &key, now),
            Msg::Snapshot(eps, settled) => {
                self.h.alloc.snapshot(&name, conn, seq, eps, settled, now)
            }
        };
        check(before.account(&Accounts::of(&self.h.alloc, &name), &msg, r.as_ref().ok()));
        match r {
            Ok(applied) => {
                self.seen.pending_entries += applied.pending.len() as u64;
                let alloc = &self.h.alloc;
                let bound = |id: IdentityId, l: &LabelSet| {
                    alloc.identity(id).and_then(|i| i.labels).as_ref() == Some(l)
                };
                let delivered = match &msg {
                    Msg::Upsert(ep) => Delivered::Upsert(ep),
                    Msg::Delete(key) => Delivered::Delete(key),
                    Msg::Snapshot(eps, settled) => Delivered::Snapshot(eps, *settled),
                };
                check(
                    self.truth
                        .delivered(i, seq, now, delivered, &applied, bound),
                );
            }
            Err(_) => self.agents[i].conn = None,
        }
        self.route();
        check(self.view_holds_what_was_told(i));
    }

    /// Every endpoint node `i` told the core of (in the messages it accepted, less
    /// what the core has corrected since by Rebind) is in the core's view of the node
    /// with the identity the node told. A core that drops or ignores what it accepted
    /// fails here, at once, before a later snapshot could mend it.
    fn view_holds_what_was_told(&self, i: usize) -> Result<(), String> {
        let now = self.h.now;
        if !self.truth.alive(i, now) {
            return Ok(());
        }
        let name = &self.agents[i].name;
        let view = self.h.alloc.nodes.get(name).map(|n| &n.view);
        let ids = &self.h.alloc.core.ids;
        for (key, (id, labels)) in &self.truth.nodes[i].told {
            let has = view.and_then(|v| v.get(key)).map(|e| e.id);
            // The core may move an endpoint before its Rebind is sent (queued until the
            // new identity is persisted): to another identity of the same labels, or out
            // of the view when the binding it held went (blocked, or taken by the
            // store's) with no id to move to.
            let moved = match has {
                Some(other) => other != *id && ids.is_bound(other, labels),
                None => !ids.is_bound(*id, labels),
            };
            if has != Some(*id) && !moved {
                return Err(format!(
                    "node {i} told the core {key} holds {id} ({labels}), and the core's view \
                     has {has:?}"
                ));
            }
        }
        Ok(())
    }

    fn allocate(&mut self, agent: usize, key: &EndpointKey) {
        let a = &self.agents[agent];
        let (Some(l), None) = (a.wanted.get(key).cloned(), a.held.get(key)) else {
            return;
        };
        if a.conn.is_none() {
            self.connect(agent);
        }
        let req = self.next_req;
        self.next_req += 1;
        let now = self.h.now;
        let a = &mut self.agents[agent];
        let n = a.next_allocation();
        match self
            .h
            .alloc
            .allocate(req, &a.name, a.session, n, l.clone(), now)
        {
            Ok(Some(id)) => {
                a.held.insert(key.clone(), (id, l.clone()));
                a.send(Msg::Upsert(Agent::endpoint(key, id, &l)));
                self.truth.heard(agent, now);
                self.truth.answered(agent, id, &l, n, now);
            }
            Ok(None) => {
                a.pending.insert(req, (key.clone(), l, n));
                self.outstanding.insert(req, (agent, n));
                self.truth.heard(agent, now);
            }
            Err(e) => self.alloc_error(agent, &e),
        }
        self.route();
    }

    fn deliver_all(&mut self, agent: usize) {
        while let Some((seq, msg)) = self.agents[agent].outbox.pop_front() {
            self.deliver(agent, seq, msg);
        }
    }

    /// The store answers one op of a writer queue.
    fn answer(&mut self, op: StoreOp, answer: Answer) {
        let now = self.h.now;
        let timeout = || StoreError::Unavailable {
            cause: "timeout",
            detail: "injected".into(),
        };
        // Node records are written in call order (one writer queue; redb commits in
        // order): one that commits late lands before the next.
        let answer = match (&op, answer) {
            (StoreOp::PutNode { .. } | StoreOp::DeleteNode { .. }, Answer::Late) => {
                Answer::CommitThenFail
            }
            _ => answer,
        };
        let result = match answer {
            Answer::Fail => Err(StoreError::Unavailable {
                cause: "io",
                detail: "injected".into(),
            }),
            Answer::Late => {
                let state = id_state(&self.h.store, &op);
                self.late.push_back((op.clone(), state));
                Err(timeout())
            }
            Answer::Ok | Answer::CommitThenFail => {
                let before = self.h.store.clone();
                let result = self.h.store.apply(&op, now);
                if let Err(StoreError::Conflict { id, .. } | StoreError::IdBound { id, .. }) =
                    &result
                {
                    let s = &self.h.store;
                    assert!(
                        s.foreign.contains(id)
                            || s.unreported.contains(id)
                            || s.invalid.contains_key(id),
                        "the core caused a conflict: {op:?}"
                    );
                    self.seen.conflicts += 1;
                }
                if matches!(result, Err(StoreError::LabelsBound { .. })) {
                    self.seen.labels_bound += 1;
                }
                match (answer, &result) {
                    (Answer::CommitThenFail, Ok(())) => {
                        self.seen.commit_then_fail += 1;
                        self.observe(&before, &op);
                        Err(timeout())
                    }
                    (_, Ok(())) => {
                        if let StoreOp::CreateIdentity { id, .. } = &op {
                            self.h.store.unreported.remove(id);
                            self.h.store.foreign.remove(id);
                        }
                        result
                    }
                    _ => result,
                }
            }
        };
        self.h.alloc.store_result(op, result, now);
        self.route();
    }

    /// A write of census's that the core was not told of landed: the store's watch
    /// sees it as a change like anyone's (the Kubernetes index learns it from the
    /// watch, not from an answer).
    fn observe(&mut self, before: &ModelStore, op: &StoreOp) {
        let after = &mut self.h.store;
        match op {
            StoreOp::CreateIdentity { id, labels } => {
                if before.identities.get(id) != Some(labels)
                    && after.identities.get(id) == Some(labels)
                {
                    after.unreported.insert(*id);
                    after.others.insert(*id);
                    self.events.push_back(StoreEvent::BindingFound {
                        id: *id,
                        labels: labels.clone(),
                    });
                }
            }
            StoreOp::DeleteIdentity { id, labels, .. } => {
                if before.identities.get(id) == Some(labels) && !after.identities.contains_key(id) {
                    self.events.push_back(StoreEvent::BindingLost {
                        id: *id,
                        labels: labels.clone(),
                    });
                }
            }
            StoreOp::DeleteTombstone { .. }
            | StoreOp::PutNode { .. }
            | StoreOp::DeleteNode { .. } => {}
        }
    }

    fn late_commit(&mut self) {
        let Some((op, state)) = self.late.pop_front() else {
            return;
        };
        if id_state(&self.h.store, &op) != state {
            return;
        }
        // A create that lands late after its labels were bound at another id since
        // (its id looks as it did when written: a lost tombstone) would bind them
        // twice. The Kubernetes store checks the labels are free when it writes, not
        // when a delayed write commits; it then finds a younger duplicate by its
        // index, which this model does not play. Such a commit is dropped here
        // (docs/testing.md, "Still open").
        if let StoreOp::CreateIdentity { id, labels } = &op
            && self
                .h
                .store
                .identities
                .iter()
                .any(|(other, bound)| other != id && bound == labels)
        {
            self.seen.late_duplicates += 1;
            return;
        }
        let before = self.h.store.clone();
        if self.h.store.apply(&op, self.h.now).is_ok() {
            self.seen.late_commits += 1;
            self.observe(&before, &op);
            if let StoreOp::DeleteIdentity { id, tombstone, .. } = &op
                && tombstone.until_ms <= self.h.now.as_millis()
            {
                self.h.store.ended_late.insert(*id);
            }
        }
    }

    fn store_event(&mut self) {
        let Some(event) = self.events.pop_front() else {
            return;
        };
        self.seen.store_events += 1;
        let now = self.h.now;
        let alloc = &mut self.h.alloc;
        match event {
            StoreEvent::BindingLost { id, labels } => alloc.binding_lost(id, &labels, now),
            StoreEvent::BindingInvalid { id, found } => alloc.binding_invalid(id, found, now),
            StoreEvent::BindingFound { id, labels } => {
                alloc.binding_found(id, &labels);
                self.truth.start.taken.insert(id);
                self.truth.start.claims.insert((id, labels));
            }
            StoreEvent::TombstoneLost { tombstone, labels } => {
                alloc.tombstone_lost(tombstone, labels.as_ref(), now);
            }
        }
        self.route();
    }

    fn rebind(&mut self, agent: usize, fate: RebindFate) {
        let a = &mut self.agents[agent];
        let Some((conn, key, identity)) = a.inbox.pop_front() else {
            return;
        };
        match fate {
            RebindFate::Drop => self.seen.rebinds_dropped += 1,
            RebindFate::Delay => {
                self.seen.rebinds_delayed += 1;
                a.inbox.push_back((conn, key, identity));
            }
            RebindFate::Deliver => {
                // A stream that closed took its messages with it.
                if a.conn == Some(conn)
                    && let Some(entry) = a.held.get_mut(&key)
                {
                    entry.0 = identity;
                    self.truth.rebound(agent, &key);
                }
            }
        }
    }

    fn restart_operator(&mut self, commit_mask: u8, wipe_store: bool, step_back_ms: u16) {
        // A crash: each write in flight either committed or not; late ones first (they
        // were made first), and only over what they were written against.
        let late: Vec<(StoreOp, IdState)> = self.late.drain(..).collect();
        let ops: Vec<StoreOp> = self
            .h
            .pending_ops
            .drain(..)
            .chain(self.h.pending_gc.drain(..))
            .collect();
        for (i, (op, state)) in late.iter().enumerate() {
            if commit_mask & (1 << (i % 8)) != 0 && id_state(&self.h.store, op) == *state {
                let _ = self.h.store.apply(op, self.h.now);
            }
        }
        for (i, op) in ops.iter().enumerate() {
            if commit_mask & (1 << ((i + late.len()) % 8)) != 0 {
                let _ = self.h.store.apply(op, self.h.now);
            }
        }
        // Quarantines whose tombstone was deleted and not yet written again are gone
        // with the operator that remembered them.
        for id in std::mem::take(&mut self.h.store.lost_tombstones) {
            self.h.store.deleted.remove(&id);
        }
        if wipe_store {
            // The store is lost; agents' snapshots re-adopt what they hold. Its history
            // of deletes is kept: quarantine is about what agents may still hold, and a
            // lost store cannot protect that.
            let deleted = std::mem::take(&mut self.h.store.deleted);
            let skew_ms = self.h.store.skew_ms;
            let others = std::mem::take(&mut self.h.store.others);
            self.h.store = ModelStore::new(self.h.store.quarantine);
            self.h.store.others = others;
            self.h.store.deleted = deleted;
            self.h.store.skew_ms = skew_ms;
            self.h.store.lost = true;
        }
        // The new core loads everything: nothing is unknown to it.
        self.h.store.foreign.clear();
        self.h.store.unreported.clear();
        self.events.clear();
        if step_back_ms > 0 {
            self.seen.clock_steps += 1;
        }
        self.h.store.skew_ms += u64::from(step_back_ms);
        let now =
            Timestamp::from_millis(self.h.now.plus(ms(50)).as_millis() - u64::from(step_back_ms));
        let store = self.h.store.clone();
        let cfg = self.setup.config();
        let start = Start {
            at: now,
            loaded: store
                .identities
                .iter()
                .map(|(id, l)| (*id, l.clone()))
                .collect(),
            awaited: (0..AGENTS)
                .filter(|&i| store.nodes.contains_key(&self.agents[i].name))
                .collect(),
            empty: store.identities.is_empty(),
            claims: BTreeSet::new(),
            created: BTreeSet::new(),
            taken: BTreeSet::new(),
        };
        self.truth.restart(cfg.clone(), start);
        self.h = Harness::with_store(cfg, store, now);
        // The new leader is told of the invalid objects its list found.
        for (id, found) in self.h.store.invalid.clone() {
            self.h.alloc.binding_invalid(id, found, now);
        }
        self.outstanding.clear();
        for a in &mut self.agents {
            a.conn = None;
            a.zombie = None;
            a.pending.clear();
            a.inbox.clear();
        }
        self.route();
    }

    pub(super) fn step(&mut self, action: Action) {
        match action {
            Action::Want { agent, pod, labels } => {
                let key = key(&format!("pod-{pod}"));
                let l = self.label_set(labels);
                let a = &mut self.agents[agent];
                if a.held.get(&key).is_some_and(|(_, held)| *held != l) {
                    a.held.remove(&key);
                    a.send(Msg::Delete(key.clone()));
                }
                a.wanted.insert(key, l);
            }
            Action::Unwant { agent, pod } => {
                let key = key(&format!("pod-{pod}"));
                let a = &mut self.agents[agent];
                if let Some(l) = a.wanted.remove(&key) {
                    a.gone.insert(key.clone(), l);
                }
                if a.held.remove(&key).is_some() {
                    a.send(Msg::Delete(key));
                }
            }
            Action::Rewant { agent, pod } => {
                let key = key(&format!("pod-{pod}"));
                let a = &mut self.agents[agent];
                if a.wanted.contains_key(&key) {
                    return;
                }
                let Some(l) = a.gone.get(&key).cloned() else {
                    return;
                };
                a.wanted.insert(key.clone(), l);
                self.allocate(agent, &key);
            }
            Action::Allocate { agent, pod } => {
                self.allocate(agent, &key(&format!("pod-{pod}")));
            }
            Action::Burst { agent, pods, early } => {
                self.seen.bursts += 1;
                let mut keys = Vec::new();
                for _ in 0..pods {
                    self.run += 1;
                    let k = key(&format!("burst-{}", self.run));
                    let l = labels(&format!("app=burst,run=b{}", self.run));
                    self.agents[agent].wanted.insert(k.clone(), l);
                    self.allocate(agent, &k);
                    keys.push(k);
                }
                if early {
                    // Done before the answers: the agent uses none of them.
                    for k in &keys {
                        self.agents[agent].wanted.remove(k);
                    }
                    self.seen.early_bursts += 1;
                }
                while let Some(op) = self.h.pending_ops.pop_front() {
                    self.answer(op, Answer::Ok);
                }
                self.deliver_all(agent);
                let a = &mut self.agents[agent];
                for k in keys {
                    a.wanted.remove(&k);
                    if a.held.remove(&k).is_some() {
                        a.send(Msg::Delete(k));
                    }
                }
                if early {
                    a.send_snapshot();
                }
                self.deliver_all(agent);
            }
            Action::Send { agent, fate } => {
                // The stream back to the agent is as lossy.
                let back = match fate {
                    Fate::Drop => RebindFate::Drop,
                    Fate::Delay(_) => RebindFate::Delay,
                    Fate::Deliver | Fate::Duplicate | Fate::Swap => RebindFate::Deliver,
                };
                self.rebind(agent, back);
                let Some((seq, msg)) = self.agents[agent].outbox.pop_front() else {
                    return;
                };
                match fate {
                    Fate::Deliver => self.deliver(agent, seq, msg),
                    Fate::Drop => {}
                    Fate::Duplicate => {
                        self.deliver(agent, seq, msg.clone());
                        self.deliver(agent, seq, msg);
                    }
                    Fate::Swap => {
                        if let Some((seq2, msg2)) = self.agents[agent].outbox.pop_front() {
                            self.deliver(agent, seq2, msg2);
                        }
                        self.deliver(agent, seq, msg);
                    }
                    Fate::Delay(behind) => {
                        self.seen.messages_delayed += 1;
                        let outbox = &mut self.agents[agent].outbox;
                        let at = behind.min(outbox.len());
                        outbox.insert(at, (seq, msg));
                    }
                }
            }
            Action::Rebind { agent, fate } => self.rebind(agent, fate),
            Action::Snapshot { agent, duplicate } => {
                let a = &mut self.agents[agent];
                let mut truth = a.truth();
                if duplicate && let Some(last) = truth.last().cloned() {
                    truth.push(last);
                }
                let settled = a.settled();
                a.send(Msg::Snapshot(truth, settled));
            }
            Action::Reconnect { agent } => self.connect(agent),
            Action::RestartAgent {
                agent,
                step_back,
                half_open,
                down,
                relabel,
            } => {
                if down {
                    self.outage(agent);
                }
                // A new process: new session (older if the clock stepped back); the
                // pinned maps (held) survive.
                self.clock_ns += 1_000;
                if step_back {
                    self.seen.clock_steps += 1;
                }
                let start = if step_back {
                    self.clock_ns - 900_000
                } else {
                    self.clock_ns
                };
                if let Some((pick, labels)) = relabel {
                    let held = &self.agents[agent].held;
                    let pod = held
                        .keys()
                        .nth(usize::from(pick) % held.len().max(1))
                        .cloned();
                    if let Some(pod) = pod {
                        let l = self.label_set(labels);
                        self.agents[agent].wanted.insert(pod, l);
                    }
                }
                let a = &mut self.agents[agent];
                // The new process rebuilds its endpoints from the pod source and the
                // pinned maps: each pod the source still lists with the identity the
                // map has for it and the labels the source gives it now. A pod that
                // changed labels while the agent was down is claimed at its old id
                // with its new labels, which the core must check, not simply adopt.
                let wanted = &a.wanted;
                a.held.retain(|key, _| wanted.contains_key(key));
                for (key, (_, labels)) in &mut a.held {
                    if let Some(now) = wanted.get(key).filter(|w| *w != labels) {
                        *labels = now.clone();
                        self.seen.relabelled += 1;
                    }
                }
                if let Some(old) = a.conn.take() {
                    if half_open {
                        a.zombie = Some(old);
                    } else {
                        self.h.alloc.disconnect(&a.name, old);
                    }
                }
                a.session = session(start);
                a.pending.clear();
                a.allocations = AllocationId::NONE;
                a.inbox.clear();
                a.seq = 0;
                self.connect(agent);
            }
            Action::KeepaliveTimeout { agent } => {
                let a = &mut self.agents[agent];
                if let Some(old) = a.zombie.take() {
                    self.h.alloc.disconnect(&a.name, old);
                }
            }
            Action::RestartOperator {
                commit_mask,
                wipe_store,
                step_back_ms,
            } => self.restart_operator(commit_mask, wipe_store, step_back_ms),
            Action::Store { ops, answer, gc } => {
                for _ in 0..ops {
                    let queue = if gc {
                        &mut self.h.pending_gc
                    } else {
                        &mut self.h.pending_ops
                    };
                    let Some(op) = queue.pop_front() else { break };
                    self.answer(op, answer);
                }
            }
            Action::LateCommit => self.late_commit(),
            Action::StoreWatch { events } => {
                for _ in 0..events {
                    self.store_event();
                }
            }
            Action::DeleteObject { pick } => {
                let s = &mut self.h.store;
                let Some((&id, l)) = s
                    .identities
                    .iter()
                    .nth(usize::from(pick) % s.identities.len().max(1))
                else {
                    return;
                };
                let labels = l.clone();
                s.identities.remove(&id);
                s.foreign.remove(&id);
                s.unreported.remove(&id);
                self.events
                    .push_back(StoreEvent::BindingLost { id, labels });
            }
            Action::EditObject { pick } => {
                let s = &mut self.h.store;
                let Some((&id, _)) = s
                    .identities
                    .iter()
                    .nth(usize::from(pick) % s.identities.len().max(1))
                else {
                    return;
                };
                self.seen.edited += 1;
                s.identities.remove(&id);
                s.foreign.remove(&id);
                s.unreported.remove(&id);
                let found = "labels k8s:app=edited".to_owned();
                s.invalid.insert(id, found.clone());
                s.others.insert(id);
                self.events
                    .push_back(StoreEvent::BindingInvalid { id, found });
            }
            Action::ForeignBinding { offset, labels: n } => {
                let range = self.h.alloc.range();
                let first = range.first().get();
                let x = super::super::id(first + u32::from(offset) % range.size() as u32);
                let l = if n < 4 {
                    labels(&format!("app=shared-{n}"))
                } else {
                    labels(&format!("app=restored-{n}"))
                };
                let s = &mut self.h.store;
                if s.identities.contains_key(&x)
                    || s.identities.values().any(|b| *b == l)
                    || s.tombstones.contains_key(&x)
                    || s.invalid.contains_key(&x)
                    // Over a quarantine whose tombstone someone deleted: the core
                    // cannot take it in then, and nothing reports it again later.
                    || s.lost_tombstones.contains(&x)
                {
                    return;
                }
                self.seen.foreign += 1;
                s.identities.insert(x, l.clone());
                s.foreign.insert(x);
                s.others.insert(x);
                self.events
                    .push_back(StoreEvent::BindingFound { id: x, labels: l });
            }
            Action::NodeGone { agent } => {
                if !self.setup.cluster {
                    return;
                }
                self.seen.nodes_gone += 1;
                let name = self.agents[agent].name.clone();
                self.gone_of = Some(agent);
                self.h.alloc.node_gone(&name, self.h.now);
                self.truth.node_gone(agent);
                self.route();
                self.gone_of = None;
            }
            Action::Corrupt {
                agent,
                pod,
                id: bogus,
            } => {
                let key = key(&format!("pod-{pod}"));
                let bogus = match bogus {
                    0 => match self.h.store.tombstones.keys().next() {
                        Some(id) => *id,
                        None => return,
                    },
                    n => super::super::id(n),
                };
                // The pod's entry, or if it has none the first one the agent has.
                let held = &mut self.agents[agent].held;
                let key = if held.contains_key(&key) {
                    Some(key)
                } else {
                    held.keys().next().cloned()
                };
                if let Some(entry) = key.and_then(|k| held.get_mut(&k)) {
                    entry.0 = bogus;
                }
            }
            Action::Tick { ms: step } => {
                self.h.advance(ms(u64::from(step)));
                self.route();
            }
            Action::LoseTombstones => {
                let lost = std::mem::take(&mut self.h.store.tombstones);
                self.h.store.lost_tombstones.extend(lost.keys().copied());
                for tombstone in lost.into_values() {
                    // The labels the object kept in its spec.
                    let labels = self
                        .h
                        .store
                        .deleted
                        .get(&tombstone.id)
                        .map(|(l, _)| l.clone());
                    self.events
                        .push_back(StoreEvent::TombstoneLost { tombstone, labels });
                }
            }
        }
        for &(id, refs, holds) in &self.h.deletes_issued {
            assert!(
                refs == 0 && holds == 0,
                "delete of {id} issued with {refs} refs and {holds} holds"
            );
        }
        self.h.deletes_issued.clear();
    }

    /// Everything in flight lands: late writes, the store's watch, every queued op
    /// (successfully), every Rebind; streams of dead processes time out.
    pub(super) fn settle(&mut self) {
        for _ in 0..20 {
            for a in &mut self.agents {
                if let Some(old) = a.zombie.take() {
                    self.h.alloc.disconnect(&a.name, old);
                }
            }
            while !self.late.is_empty() {
                self.late_commit();
            }
            while !self.events.is_empty() {
                self.store_event();
            }
            let mut answered = 0;
            while let Some(op) = self.h.pop_pending() {
                self.answer(op, Answer::Ok);
                answered += 1;
                assert!(
                    answered <= SETTLE_OPS,
                    "the world does not settle: {answered} store writes in a row, each answered"
                );
            }
            for i in 0..AGENTS {
                while !self.agents[i].inbox.is_empty() {
                    self.rebind(i, RebindFate::Deliver);
                }
            }
            if self.late.is_empty()
                && self.events.is_empty()
                && self.h.pending().next().is_none()
                && self.agents.iter().all(|a| a.inbox.is_empty())
            {
                return;
            }
        }
        panic!("the world does not settle: the core keeps writing");
    }

    /// Every agent (re)connects and its true snapshot is delivered; everything in
    /// flight lands.
    pub(super) fn true_snapshots(&mut self) {
        self.true_snapshots_but(None);
    }

    /// [`Self::true_snapshots`] of every agent but `down`, whose process is dead.
    fn true_snapshots_but(&mut self, down: Option<usize>) {
        self.settle();
        for i in (0..AGENTS).filter(|&i| Some(i) != down) {
            if self.agents[i].conn.is_none() {
                self.connect(i);
            }
            let a = &mut self.agents[i];
            a.outbox.clear();
            a.send_snapshot();
            self.deliver_all(i);
        }
        self.settle();
    }

    /// Agent `down`'s process is dead, its stream closed, for longer than the core
    /// keeps a silent node's view: time passes in 500 ms steps, the store answering
    /// and the other agents sending true snapshots, so the core drops the node's
    /// view and collects what only it referenced (deleted, then quarantined).
    fn outage(&mut self, down: usize) {
        self.seen.outages += 1;
        let a = &mut self.agents[down];
        a.zombie = None;
        if let Some(old) = a.conn.take() {
            self.h.alloc.disconnect(&a.name, old);
        }
        let cfg = self.setup.config();
        let mut total = cfg.node_ttl + cfg.hold_timeout + cfg.grace + ms(2_000);
        if self.setup.cluster {
            total += STALE_VIEW_LIMIT;
        }
        self.pass_but(total, Some(down));
    }

    /// Time passes, `total`, with agents sending true snapshots every 500 ms.
    pub(super) fn pass(&mut self, total: std::time::Duration) {
        self.pass_but(total, None);
    }

    /// [`Self::pass`] with agent `down`'s process dead: it sends nothing.
    fn pass_but(&mut self, total: std::time::Duration, down: Option<usize>) {
        let mut elapsed = std::time::Duration::ZERO;
        while elapsed < total {
            self.h.advance(ms(500));
            self.route();
            elapsed += ms(500);
            self.true_snapshots_but(down);
        }
    }
}
