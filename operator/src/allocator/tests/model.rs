//! Model-based property test: agents with real endpoint state talk to the core over
//! lossy, duplicating, reordering channels, while the store fails, agents and the
//! operator restart and time passes. Whatever happens, DESIGN.md's invariants hold:
//!
//! - every refcount equals the number of view entries mapped to it (after each step);
//! - no referenced or held identity is ever deleted;
//! - no label set is bound to two ids, no id rebound within quarantine (ModelStore);
//! - after one true snapshot per node, refcounts equal the agents' truth;
//! - after the grace period, the identities in memory are exactly those referenced.

use std::cell::RefCell;

use proptest::{
    prelude::*,
    test_runner::{RngAlgorithm, TestRng, TestRunner},
};

use super::*;

const AGENTS: usize = 3;
const PODS: u8 = 6;

#[derive(Debug, Clone)]
enum Fate {
    Deliver,
    Drop,
    Duplicate,
    /// Deliver the one behind it first.
    Swap,
}

#[derive(Debug, Clone)]
enum Action {
    /// The pod runs with this label set (0..4 shared, 4.. unique per run).
    Want {
        agent: usize,
        pod: u8,
        labels: u8,
    },
    Unwant {
        agent: usize,
        pod: u8,
    },
    /// The pod comes back with the labels it last had, and its agent allocates (a
    /// rollout, or a Job re-run): races GC deleting the identity it left behind.
    Rewant {
        agent: usize,
        pod: u8,
    },
    Allocate {
        agent: usize,
        pod: u8,
    },
    Send {
        agent: usize,
        fate: Fate,
    },
    Snapshot {
        agent: usize,
    },
    Reconnect {
        agent: usize,
    },
    RestartAgent {
        agent: usize,
    },
    RestartOperator {
        commit_mask: u8,
        wipe_store: bool,
    },
    /// Something rewrote the agent's map entry behind its back.
    Corrupt {
        agent: usize,
        pod: u8,
        id: u32,
    },
    /// The allocation writer (or the GC writer) answers its next ops.
    Store {
        ops: u8,
        fail: bool,
        gc: bool,
    },
    Tick {
        ms: u16,
    },
    /// Someone deletes every tombstone in the store (`kubectl delete identities
    /// --all`); the store's watch reports each to the core.
    LoseTombstones,
}

fn arb_action() -> impl Strategy<Value = Action> {
    let agent = 0..AGENTS;
    prop_oneof![
        8 => (agent.clone(), 0..PODS, 0u8..8).prop_map(|(agent, pod, labels)| Action::Want { agent, pod, labels }),
        6 => (agent.clone(), 0..PODS).prop_map(|(agent, pod)| Action::Unwant { agent, pod }),
        4 => (agent.clone(), 0..PODS).prop_map(|(agent, pod)| Action::Rewant { agent, pod }),
        8 => (agent.clone(), 0..PODS).prop_map(|(agent, pod)| Action::Allocate { agent, pod }),
        12 => (agent.clone(), prop_oneof![
            4 => Just(Fate::Deliver), 2 => Just(Fate::Drop), 1 => Just(Fate::Duplicate), 1 => Just(Fate::Swap)
        ]).prop_map(|(agent, fate)| Action::Send { agent, fate }),
        4 => agent.clone().prop_map(|agent| Action::Snapshot { agent }),
        2 => agent.clone().prop_map(|agent| Action::Reconnect { agent }),
        2 => agent.clone().prop_map(|agent| Action::RestartAgent { agent }),
        1 => (any::<u8>(), proptest::bool::weighted(0.3))
            .prop_map(|(commit_mask, wipe_store)| Action::RestartOperator { commit_mask, wipe_store }),
        2 => (agent, 0..PODS, prop_oneof![256u32..280, 1020u32..1030, 1u32..4, 5000u32..5001])
            .prop_map(|(agent, pod, id)| Action::Corrupt { agent, pod, id }),
        8 => (1u8..6, proptest::bool::weighted(0.25), any::<bool>())
            .prop_map(|(ops, fail, gc)| Action::Store { ops, fail, gc }),
        8 => (1u16..3000).prop_map(|ms| Action::Tick { ms }),
        2 => Just(Action::LoseTombstones),
    ]
}

#[derive(Debug, Clone)]
enum Msg {
    Upsert(Endpoint),
    Delete(EndpointKey),
    Snapshot(Vec<Endpoint>),
}

#[derive(Debug)]
struct Agent {
    name: NodeName,
    session: SessionId,
    conn: Option<ConnId>,
    seq: u64,
    /// What the pod source says: pod -> labels.
    wanted: BTreeMap<EndpointKey, LabelSet>,
    /// What the maps hold: pod -> (identity, labels). The truth for snapshots.
    held: BTreeMap<EndpointKey, (IdentityId, LabelSet)>,
    outbox: VecDeque<(u64, Msg)>,
    /// The labels each pod had when it was last removed.
    gone: BTreeMap<EndpointKey, LabelSet>,
    /// Allocate calls waiting for an answer: request -> pod.
    pending: HashMap<RequestId, (EndpointKey, LabelSet)>,
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
}

struct Sim {
    h: Harness,
    agents: Vec<Agent>,
    next_req: RequestId,
    clock_ns: u64,
    run: u32,
}

impl Sim {
    fn new() -> Self {
        let h = Harness::new(small_config());
        let agents = (0..AGENTS)
            .map(|i| Agent {
                name: node(&format!("node-{i}")),
                session: session(1 + i as u64),
                conn: None,
                seq: 0,
                wanted: BTreeMap::new(),
                held: BTreeMap::new(),
                outbox: VecDeque::new(),
                gone: BTreeMap::new(),
                pending: HashMap::new(),
            })
            .collect();
        Self {
            h,
            agents,
            next_req: 1_000_000,
            clock_ns: 100,
            run: 0,
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

    /// Routes the core's effects to agents (replies, rebinds, closes).
    fn route(&mut self) {
        self.h.route();
        for (req, result) in std::mem::take(&mut self.h.replies) {
            for a in &mut self.agents {
                if let Some((key, l)) = a.pending.remove(&req)
                    && let Ok(id) = result
                    && a.wanted.get(&key) == Some(&l)
                {
                    a.held.insert(key.clone(), (id, l.clone()));
                    a.send(Msg::Upsert(Agent::endpoint(&key, id, &l)));
                }
            }
        }
        for (name, conn, msg) in std::mem::take(&mut self.h.agent_msgs) {
            let Some(a) = self.agents.iter_mut().find(|a| a.name == name) else {
                continue;
            };
            if a.conn != Some(conn) {
                continue;
            }
            match msg {
                AgentMsg::Rebind { key, identity } => {
                    if let Some(entry) = a.held.get_mut(&key) {
                        entry.0 = identity;
                    }
                }
                AgentMsg::SnapshotNow => {
                    let truth = a.truth();
                    a.send(Msg::Snapshot(truth));
                }
                AgentMsg::Close(_) => a.conn = None,
            }
        }
    }

    fn connect(&mut self, i: usize) {
        let now = self.h.now;
        let a = &mut self.agents[i];
        match self.h.alloc.hello(&a.name, a.session, now) {
            Ok(acc) => {
                a.conn = Some(acc.conn);
                // After every (re)connect the agent sends a snapshot first.
                a.outbox.clear();
                let truth = a.truth();
                a.send(Msg::Snapshot(truth));
            }
            Err(e) => panic!("hello refused: {e}"),
        }
        self.route();
    }

    fn deliver(&mut self, i: usize, seq: u64, msg: Msg) {
        let now = self.h.now;
        let a = &self.agents[i];
        let Some(conn) = a.conn else { return };
        let name = a.name.clone();
        let r = match msg {
            Msg::Upsert(ep) => self.h.alloc.upsert(&name, conn, seq, ep, now),
            Msg::Delete(key) => self.h.alloc.delete(&name, conn, seq, &key, now),
            Msg::Snapshot(eps) => self.h.alloc.snapshot(&name, conn, seq, eps, now),
        };
        if r.is_err() {
            self.agents[i].conn = None;
        }
        self.route();
    }

    fn step(&mut self, action: Action) {
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
                a.wanted.insert(key, l);
                self.step(Action::Allocate { agent, pod });
            }
            Action::Allocate { agent, pod } => {
                let key = key(&format!("pod-{pod}"));
                let a = &self.agents[agent];
                let (Some(l), None) = (a.wanted.get(&key).cloned(), a.held.get(&key)) else {
                    return;
                };
                if a.conn.is_none() {
                    self.connect(agent);
                }
                let req = self.next_req;
                self.next_req += 1;
                let now = self.h.now;
                let a = &mut self.agents[agent];
                match self
                    .h
                    .alloc
                    .allocate(req, &a.name, a.session, l.clone(), now)
                {
                    Ok(Some(id)) => {
                        a.held.insert(key.clone(), (id, l.clone()));
                        a.send(Msg::Upsert(Agent::endpoint(&key, id, &l)));
                    }
                    Ok(None) => {
                        a.pending.insert(req, (key, l));
                    }
                    Err(_) => {}
                }
                self.route();
            }
            Action::Send { agent, fate } => {
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
                }
            }
            Action::Snapshot { agent } => {
                let a = &mut self.agents[agent];
                let truth = a.truth();
                a.send(Msg::Snapshot(truth));
            }
            Action::Reconnect { agent } => self.connect(agent),
            Action::RestartAgent { agent } => {
                // A new process: new session; the pinned maps (held) survive.
                self.clock_ns += 1_000;
                let a = &mut self.agents[agent];
                a.session = session(self.clock_ns);
                a.pending.clear();
                a.seq = 0;
                self.connect(agent);
            }
            Action::RestartOperator {
                commit_mask,
                wipe_store,
            } => {
                // A crash: each write in flight either committed or not.
                let ops: Vec<StoreOp> = self
                    .h
                    .pending_ops
                    .drain(..)
                    .chain(self.h.pending_gc.drain(..))
                    .collect();
                for (i, op) in ops.iter().enumerate() {
                    if commit_mask & (1 << (i % 8)) != 0 {
                        let _ = self.h.store.apply(op, self.h.now);
                    }
                }
                // Quarantines whose tombstone was deleted and not yet written again
                // are gone with the operator that remembered them.
                for id in std::mem::take(&mut self.h.store.lost_tombstones) {
                    self.h.store.deleted.remove(&id);
                }
                if wipe_store {
                    // The store is lost; agents' snapshots re-adopt what they hold. Its
                    // history of deletes is kept: quarantine is about what agents may
                    // still hold, and a lost store cannot protect that.
                    let deleted = std::mem::take(&mut self.h.store.deleted);
                    self.h.store = ModelStore::new(self.h.store.quarantine);
                    self.h.store.deleted = deleted;
                    self.h.store.lost = true;
                }
                let store = self.h.store.clone();
                let mut cfg = small_config();
                cfg.adoption_window = ms(0);
                self.h = Harness::with_store(cfg, store, self.h.now.plus(ms(50)));
                for a in &mut self.agents {
                    a.conn = None;
                    a.pending.clear();
                }
            }
            Action::Store { ops, fail, gc } => {
                for _ in 0..ops {
                    let queue = if gc {
                        &mut self.h.pending_gc
                    } else {
                        &mut self.h.pending_ops
                    };
                    let Some(op) = queue.pop_front() else { break };
                    let result = if fail {
                        Err(StoreError::Unavailable {
                            cause: "io",
                            detail: "injected".into(),
                        })
                    } else {
                        self.h.store.apply(&op, self.h.now)
                    };
                    assert!(
                        !matches!(result, Err(StoreError::Conflict { .. })),
                        "the core caused a conflict: {op:?}"
                    );
                    self.h.alloc.store_result(op, result, self.h.now);
                    self.route();
                }
            }
            Action::Corrupt {
                agent,
                pod,
                id: bogus,
            } => {
                let key = key(&format!("pod-{pod}"));
                if let Some(entry) = self.agents[agent].held.get_mut(&key) {
                    entry.0 = id(bogus);
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
                    self.h
                        .alloc
                        .tombstone_lost(tombstone, labels.as_ref(), self.h.now);
                }
                self.route();
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

    fn settle_store(&mut self) {
        while let Some(op) = self.h.pop_pending() {
            let result = self.h.store.apply(&op, self.h.now);
            assert!(result.is_ok(), "store refused {op:?}: {result:?}");
            self.h.alloc.store_result(op, result, self.h.now);
            self.route();
        }
    }

    /// Every agent (re)connects and its true snapshot is delivered; the store answers
    /// everything; rebinds reach the agents.
    fn true_snapshots(&mut self) {
        self.settle_store();
        for i in 0..AGENTS {
            if self.agents[i].conn.is_none() {
                self.connect(i);
            }
            let a = &mut self.agents[i];
            a.outbox.clear();
            let truth = a.truth();
            a.send(Msg::Snapshot(truth));
            let Some((seq, msg)) = self.agents[i].outbox.pop_front() else {
                continue;
            };
            self.deliver(i, seq, msg);
        }
        self.settle_store();
    }

    /// Time passes (past every retry backoff) with agents sending true snapshots.
    fn let_retries_finish(&mut self) {
        for _ in 0..10 {
            self.h.advance(ms(500));
            self.route();
            for i in 0..AGENTS {
                if self.agents[i].conn.is_none() {
                    self.connect(i);
                }
                let a = &mut self.agents[i];
                let truth = a.truth();
                a.send(Msg::Snapshot(truth));
                while let Some((seq, msg)) = self.agents[i].outbox.pop_front() {
                    self.deliver(i, seq, msg);
                }
            }
            self.settle_store();
        }
    }

    fn check_truth(&self, require_persisted: bool) {
        let mut truth: HashMap<IdentityId, u32> = HashMap::new();
        let mut ids_of: HashMap<LabelSet, IdentityId> = HashMap::new();
        for a in &self.agents {
            for (key, (id, l)) in &a.held {
                *truth.entry(*id).or_default() += 1;
                let info = self.h.alloc.identity(*id);
                assert_eq!(
                    info.as_ref().and_then(|i| i.labels.clone()).as_ref(),
                    Some(l),
                    "{} {key} holds {id}",
                    a.name
                );
                if let Some(other) = ids_of.insert(l.clone(), *id) {
                    assert_eq!(other, *id, "label set {l} has two ids held");
                }
                if require_persisted {
                    assert_eq!(
                        self.h.store.identities.get(id),
                        Some(l),
                        "held identity {id} is persisted"
                    );
                }
            }
        }
        for (id, entry) in self.h.alloc.core.ids.entries() {
            assert_eq!(
                entry.refs,
                truth.get(id).copied().unwrap_or(0),
                "refcount of {id} vs truth"
            );
        }
        for id in truth.keys() {
            assert!(
                self.h.alloc.identity(*id).is_some(),
                "held {id} unknown to the core"
            );
        }
    }

    /// Time passes with agents snapshotting every interval: holds expire, grace
    /// passes, GC and quarantine finish.
    fn run_out_the_clock(&mut self) {
        let cfg = small_config();
        let total = cfg.hold_timeout + cfg.grace + cfg.quarantine + ms(3_000);
        let mut elapsed = Duration::ZERO;
        while elapsed < total {
            self.h.advance(ms(500));
            self.route();
            elapsed += ms(500);
            for i in 0..AGENTS {
                if self.agents[i].conn.is_none() {
                    self.connect(i);
                }
                let a = &mut self.agents[i];
                let truth = a.truth();
                a.send(Msg::Snapshot(truth));
                while let Some((seq, msg)) = self.agents[i].outbox.pop_front() {
                    self.deliver(i, seq, msg);
                }
            }
            self.settle_store();
        }
    }
}

/// What the generated runs exercised, summed, so the test fails if the generator
/// stops reaching the interesting paths.
#[derive(Debug, Default)]
struct Coverage {
    corrections: u64,
    adoptions: u64,
    rebinds: u64,
    identities_adopted: u64,
    old_seq_ignored: u64,
    deleted: u64,
    recreated: u64,
    store_failures: u64,
    operator_restarts: u64,
    tombstones_recreated: u64,
}

fn run_case(actions: Vec<Action>, coverage: &RefCell<Coverage>) -> Result<(), TestCaseError> {
    let mut sim = Sim::new();
    for i in 0..AGENTS {
        sim.connect(i);
    }
    let mut restarts = 0;
    let mut before = Counters::default();
    let mut totals = Counters::default();
    for action in actions {
        if matches!(action, Action::RestartOperator { .. }) {
            restarts += 1;
            add(&mut totals, sim.h.alloc.counters(), &before);
            before = Counters::default();
        }
        sim.step(action);
    }
    sim.true_snapshots();
    sim.check_truth(false);
    // With the store answering, every Allocate has its answer: none hangs.
    for a in &sim.agents {
        prop_assert!(a.pending.is_empty(), "{} waits for {:?}", a.name, a.pending);
    }
    for (id, entry) in sim.h.alloc.core.ids.entries() {
        prop_assert!(
            !entry
                .waiters
                .iter()
                .any(|w| matches!(w, identities::Waiter::Request { .. })),
            "identity {} ({:?}) keeps Allocate calls waiting",
            id,
            entry.phase
        );
    }
    sim.let_retries_finish();
    sim.check_truth(true);
    // Every quarantine the core holds is in the store, so it survives a restart:
    // also those whose tombstone someone deleted.
    for (id, tomb) in sim.h.alloc.core.ids.quarantine() {
        prop_assert!(
            sim.h
                .store
                .tombstones
                .get(id)
                .is_some_and(|t| t.labels_hash == tomb.labels_hash),
            "identity {} is quarantined in memory only (the store has {:?})",
            id,
            sim.h.store.tombstones.get(id)
        );
    }
    sim.run_out_the_clock();
    sim.check_truth(true);
    add(&mut totals, sim.h.alloc.counters(), &before);
    // Only referenced identities remain: no holds are left after the hold timeout.
    for (id, entry) in sim.h.alloc.core.ids.entries() {
        prop_assert!(
            entry.refs > 0,
            "identity {} ({}) remains unreferenced: {:?}",
            id,
            entry.labels,
            entry.phase
        );
    }
    // The store agrees with memory.
    let in_memory: BTreeMap<IdentityId, LabelSet> = sim
        .h
        .alloc
        .core
        .ids
        .entries()
        .iter()
        .map(|(id, e)| (*id, e.labels.clone()))
        .collect();
    prop_assert_eq!(&sim.h.store.identities, &in_memory);
    prop_assert!(
        sim.h.store.tombstones.is_empty(),
        "tombstones left: {:?}",
        sim.h.store.tombstones
    );

    let mut c = coverage.borrow_mut();
    c.corrections += totals.corrections;
    c.adoptions += totals.adoptions;
    c.rebinds += totals.rebinds;
    c.identities_adopted += totals.identities_adopted;
    c.old_seq_ignored += totals.old_seq_ignored;
    c.deleted += totals.gc_outcomes.get("deleted").copied().unwrap_or(0);
    c.recreated += totals.gc_outcomes.get("recreated").copied().unwrap_or(0);
    c.store_failures += totals.store_failures.values().sum::<u64>();
    c.operator_restarts += restarts;
    c.tombstones_recreated += totals.tombstones_recreated;
    Ok(())
}

fn add(total: &mut Counters, now: &Counters, before: &Counters) {
    total.corrections += now.corrections - before.corrections;
    total.adoptions += now.adoptions - before.adoptions;
    total.rebinds += now.rebinds - before.rebinds;
    total.identities_adopted += now.identities_adopted - before.identities_adopted;
    total.old_seq_ignored += now.old_seq_ignored - before.old_seq_ignored;
    total.tombstones_recreated += now.tombstones_recreated - before.tombstones_recreated;
    for (k, v) in &now.gc_outcomes {
        *total.gc_outcomes.entry(k).or_default() += v;
    }
    for (k, v) in &now.store_failures {
        *total.store_failures.entry(k).or_default() += v;
    }
}

#[test]
fn invariants_hold_under_loss_reordering_restarts_and_failures() {
    let strategy = proptest::collection::vec(arb_action(), 1..200);
    // Fresh random cases on every run (PROPTEST_CASES=40000 for a long run, about
    // 15 s in release)...
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    let mut runner = TestRunner::new(ProptestConfig {
        cases,
        ..ProptestConfig::default()
    });
    let ignored = RefCell::new(Coverage::default());
    if let Err(e) = runner.run(&strategy, |actions| run_case(actions, &ignored)) {
        panic!("{e}");
    }
    // ...and a fixed set whose coverage is checked, so the check cannot flake.
    let coverage = RefCell::new(Coverage::default());
    let mut runner = TestRunner::new_with_rng(
        ProptestConfig {
            cases: 256,
            ..ProptestConfig::default()
        },
        TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    );
    if let Err(e) = runner.run(&strategy, |actions| run_case(actions, &coverage)) {
        panic!("{e}");
    }
    let c = coverage.into_inner();
    // Every path the invariants are about was taken, many times.
    for (what, n) in [
        ("corrections", c.corrections),
        ("adoptions", c.adoptions),
        ("rebinds", c.rebinds),
        ("re-adopted identities", c.identities_adopted),
        ("old seq ignored", c.old_seq_ignored),
        ("deletes", c.deleted),
        ("re-created during delete", c.recreated),
        ("store failures", c.store_failures),
        ("operator restarts", c.operator_restarts),
        ("lost tombstones written again", c.tombstones_recreated),
    ] {
        assert!(
            n >= 5,
            "the generated runs exercised {what} only {n} times: {c:?}"
        );
    }
}
