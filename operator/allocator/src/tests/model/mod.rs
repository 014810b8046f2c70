//! Model-based property test: the core in a simulated world ([`world`]) of agents
//! with real endpoint state over lossy, duplicating, reordering channels both ways,
//! a store that fails, commits without saying so or late, and is edited behind
//! census's back (its own watch reporting it), agents and the operator restarting
//! (clocks stepping back), Nodes deleted, nodes going stale, and time passing, in
//! worlds ([`actions::Setup`]) with a small id range, a small hold quota, a cluster's
//! liveness rules and an adoption window.
//!
//! Safety is checked as the core acts, against what the world knows apart from the
//! core ([`truth`]):
//! - after each accepted message, the core's view of the node holds what the node
//!   told it (less what the core corrected by Rebind);
//! - no binding is deleted while a live node reports it, holds it from an Allocate,
//!   or while the restart protection covers it;
//! - no new id inside the adoption window other than ones agents claimed;
//! - a node's view is dropped only after the silence the liveness rules allow, its
//!   stream closed as replaced or gone only by a Hello or the Node's deletion;
//! - an older session is refused only while another stream of the node is open;
//! - every refusal of an Allocate (range, quota, window) is one the world explains;
//! - a message is ignored only if a newer one was delivered;
//! - no label set is bound to two ids, no id rebound within quarantine, no conflict
//!   with what census wrote itself ([`super::ModelStore`]);
//!
//! and once the world settles:
//! - one true snapshot per node makes every refcount equal the agents' truth, and
//!   every identity an agent holds is bound to its labels and persisted;
//! - after the grace period, the store holds exactly what agents hold, the core's
//!   memory equals the store, and the core's maps have given back what bursts grew
//!   (memory proportional to live state).

mod actions;
mod truth;
mod world;

use std::cell::RefCell;

use proptest::{
    prelude::*,
    test_runner::{RngAlgorithm, TestRng, TestRunner},
};

use self::{
    actions::{Action, STALE_VIEW_LIMIT, Setup, arb_action, arb_setup},
    world::{Seen, Sim},
};
use super::*;

const AGENTS: usize = 3;
/// Store writes answered in a row before a settling world is taken to loop (a
/// healthy one writes at most about a hundred).
const SETTLE_OPS: usize = 2_000;
const PODS: u8 = 6;

impl Sim {
    fn check_truth(&self, require_persisted: bool) {
        let mut truth: HashMap<IdentityId, u32> = HashMap::new();
        let mut ids_of: HashMap<LabelSet, IdentityId> = HashMap::new();
        // With every id of the range in use, a claim the core cannot adopt waits,
        // out of the view, for an id to free up.
        let full = self.range_full();
        for a in &self.agents {
            for (key, (id, l)) in &a.held {
                let info = self.h.alloc.identity(*id);
                if full && info.as_ref().and_then(|i| i.labels.as_ref()) != Some(l) {
                    continue;
                }
                *truth.entry(*id).or_default() += 1;
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
    }

    /// At rest, every map is sized by what it holds, not by the bursts it went
    /// through (a map that never shrinks keeps the capacity of its largest burst).
    fn check_capacities(&self) {
        let bound = |len: usize| (4 * len + 3).max(16);
        let a = &self.h.alloc;
        for (name, n) in &a.nodes {
            assert!(
                n.view.capacity() <= 2 * n.view.len().max(8),
                "{name}: view of {} at capacity {}",
                n.view.len(),
                n.view.capacity()
            );
            assert!(
                n.holds.capacity() <= bound(n.holds.len()),
                "{name}: {} holds at capacity {}",
                n.holds.len(),
                n.holds.capacity()
            );
        }
        assert!(
            a.nodes.capacity() <= bound(a.nodes.len()),
            "node map capacity"
        );
        let (by_labels, quarantine) = a.core.ids.capacities();
        let live = a.core.ids.entries().len();
        assert!(
            by_labels <= bound(live),
            "label index of {live} at capacity {by_labels}"
        );
        assert!(
            quarantine <= bound(a.core.ids.quarantine().len()),
            "quarantine at capacity {quarantine}"
        );
        assert!(a.core.gc.unused.capacity() <= 64, "unused list capacity");
        assert!(
            a.core.gc.released.capacity() <= 128,
            "released queue capacity {}",
            a.core.gc.released.capacity()
        );
        assert!(
            a.core.gc.cleanup_retries.capacity() <= 64,
            "cleanup retries capacity"
        );
    }
}

/// What the generated runs exercised, summed, so the test fails if the generator
/// stops reaching the interesting paths.
#[derive(Debug, Default)]
struct Coverage {
    counters: Counters,
    seen: Seen,
    operator_restarts: u64,
}

fn run_case(
    setup: Setup,
    actions: Vec<Action>,
    coverage: &RefCell<Coverage>,
) -> Result<(), TestCaseError> {
    let cluster = setup.cluster;
    let mut sim = Sim::new(setup);
    for i in 0..AGENTS {
        sim.connect(i);
    }
    let mut restarts = 0;
    let mut totals = Counters::default();
    for action in actions {
        if matches!(action, Action::RestartOperator { .. }) {
            restarts += 1;
            add(&mut totals, sim.h.alloc.counters());
        }
        sim.step(action);
    }
    // Past an adoption window (entries needing a new id wait for it to end).
    sim.step(Action::Tick {
        ms: sim.setup.window.as_millis() as u16,
    });
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
    // Past every retry backoff.
    sim.pass(ms(5_000));
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
    // Holds expire, grace passes, GC and quarantine finish (and, in a cluster, the
    // restart protection's wait for nodes that never report).
    let cfg = sim.setup.config();
    let mut rest = cfg.hold_timeout + cfg.grace + cfg.quarantine + ms(3_000);
    if cluster {
        rest += STALE_VIEW_LIMIT;
    }
    sim.pass(rest);
    sim.check_truth(true);
    add(&mut totals, sim.h.alloc.counters());
    // The store holds exactly what agents hold, and memory exactly what the store does.
    let held: BTreeMap<IdentityId, LabelSet> = sim
        .agents
        .iter()
        .flat_map(|a| a.held.values().cloned())
        .collect();
    // Objects at ids the core blocked (edited, or met by a create before the watch
    // reported them) stay, census's no longer; so do foreign bindings the core did
    // not take in (their labels were bound when the watch reported them).
    let stored: BTreeMap<IdentityId, LabelSet> = sim
        .h
        .store
        .identities
        .iter()
        .filter(|(id, l)| {
            let ids = &sim.h.alloc.core.ids;
            !ids.blocked().contains_key(id)
                && (!sim.h.store.foreign.contains(id) || ids.is_bound(**id, l))
        })
        .map(|(id, l)| (*id, l.clone()))
        .collect();
    prop_assert_eq!(&stored, &held, "store vs what agents hold");
    let in_memory: BTreeMap<IdentityId, LabelSet> = sim
        .h
        .alloc
        .core
        .ids
        .entries()
        .iter()
        .map(|(id, e)| (*id, e.labels.clone()))
        .collect();
    prop_assert_eq!(&stored, &in_memory, "store vs memory");
    // An ended tombstone a late commit wrote after the core deleted it stays (the
    // store reports no tombstone appearing; harmless: it binds nothing, and a create
    // at its id replaces it, a restart deletes it): docs/testing.md, "Still open".
    let now_ms = sim.h.now.as_millis();
    let left: BTreeMap<&IdentityId, &Tombstone> = sim
        .h
        .store
        .tombstones
        .iter()
        .filter(|(id, t)| !(sim.h.store.ended_late.contains(id) && t.until_ms <= now_ms))
        .collect();
    prop_assert!(left.is_empty(), "tombstones left: {:?}", left);
    sim.check_capacities();
    // An id is blocked only where the store held an object census did not write.
    for id in sim.h.alloc.core.ids.blocked().keys() {
        prop_assert!(
            sim.h.store.others.contains(id),
            "{} is blocked, but no one else ever wrote to it",
            id
        );
    }
    // Every node that reports is known to the store (a restart waits for it).
    for a in &sim.agents {
        prop_assert!(
            sim.h.store.nodes.contains_key(&a.name),
            "{} reports, but the store does not know it",
            a.name
        );
    }

    let mut c = coverage.borrow_mut();
    add(&mut c.counters, &totals);
    c.operator_restarts += restarts;
    let s = &sim.seen;
    let t = &mut c.seen;
    t.range_exhausted += s.range_exhausted;
    t.hold_quota += s.hold_quota;
    t.adoption_window += s.adoption_window;
    t.pending_entries += s.pending_entries;
    t.older_session_refused += s.older_session_refused;
    t.older_session_accepted += s.older_session_accepted;
    t.expired_in_cluster += s.expired_in_cluster;
    t.nodes_gone += s.nodes_gone;
    t.nodes_back += s.nodes_back;
    t.late_commits += s.late_commits;
    t.commit_then_fail += s.commit_then_fail;
    t.rebinds_dropped += s.rebinds_dropped;
    t.rebinds_delayed += s.rebinds_delayed;
    t.messages_delayed += s.messages_delayed;
    t.store_events += s.store_events;
    t.foreign += s.foreign;
    t.edited += s.edited;
    t.conflicts += s.conflicts;
    t.labels_bound += s.labels_bound;
    t.clock_steps += s.clock_steps;
    t.bursts += s.bursts;
    t.early_bursts += s.early_bursts;
    t.relabelled += s.relabelled;
    t.outages += s.outages;
    t.quarantined_claims += s.quarantined_claims;
    Ok(())
}

fn add(total: &mut Counters, now: &Counters) {
    total.corrections += now.corrections;
    total.adoptions += now.adoptions;
    total.rebinds += now.rebinds;
    total.identities_adopted += now.identities_adopted;
    total.old_seq_ignored += now.old_seq_ignored;
    total.tombstones_recreated += now.tombstones_recreated;
    total.bindings_recreated += now.bindings_recreated;
    total.bindings_taken += now.bindings_taken;
    total.blocked += now.blocked;
    total.nodes_dropped += now.nodes_dropped;
    total.holds_expired += now.holds_expired;
    total.holds_settled += now.holds_settled;
    for (k, v) in &now.gc_outcomes {
        *total.gc_outcomes.entry(k).or_default() += v;
    }
    for (k, v) in &now.store_failures {
        *total.store_failures.entry(k).or_default() += v;
    }
    for (k, v) in &now.create_failures {
        *total.create_failures.entry(k).or_default() += v;
    }
}

fn strategy() -> impl Strategy<Value = (Setup, Vec<Action>)> {
    (arb_setup(), proptest::collection::vec(arb_action(), 1..200))
}

#[test]
fn invariants_hold_under_loss_reordering_restarts_and_failures() {
    // Fresh random cases only when asked for (PROPTEST_CASES=20000 for a long run,
    // in release; docs/testing.md): the default run is the fixed set below, so the
    // suite cannot pass or fail by chance...
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut runner = TestRunner::new(ProptestConfig {
        cases,
        ..ProptestConfig::default()
    });
    let ignored = RefCell::new(Coverage::default());
    if let Err(e) = runner.run(&strategy(), |(setup, actions)| {
        run_case(setup, actions, &ignored)
    }) {
        panic!("{e}");
    }
    // ...and a fixed set whose coverage is checked, so the check cannot flake.
    let coverage = RefCell::new(Coverage::default());
    let mut runner = TestRunner::new_with_rng(
        ProptestConfig {
            cases: 160,
            ..ProptestConfig::default()
        },
        TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    );
    if let Err(e) = runner.run(&strategy(), |(setup, actions)| {
        run_case(setup, actions, &coverage)
    }) {
        panic!("{e}");
    }
    let c = coverage.into_inner();
    let (k, s) = (&c.counters, &c.seen);
    let get = |m: &BTreeMap<&'static str, u64>, k: &str| m.get(k).copied().unwrap_or(0);
    // Every path the invariants are about was taken, many times.
    for (what, n) in [
        ("corrections", k.corrections),
        ("adoptions", k.adoptions),
        ("rebinds", k.rebinds),
        ("re-adopted identities", k.identities_adopted),
        ("old seq ignored", k.old_seq_ignored),
        ("deletes", get(&k.gc_outcomes, "deleted")),
        ("store failures", k.store_failures.values().sum::<u64>()),
        ("operator restarts", c.operator_restarts),
        ("lost tombstones written again", k.tombstones_recreated),
        ("lost bindings written again", k.bindings_recreated),
        ("bindings taken from the store", k.bindings_taken),
        ("ids blocked", k.blocked),
        ("nodes dropped", k.nodes_dropped),
        ("holds expired", k.holds_expired),
        ("holds ended by a settled allocation", k.holds_settled),
        ("creates of labels bound elsewhere", s.labels_bound),
        ("store conflicts", s.conflicts),
        ("range exhausted", s.range_exhausted),
        ("hold quota reached", s.hold_quota),
        ("Allocate inside the adoption window", s.adoption_window),
        ("older sessions refused", s.older_session_refused),
        ("older sessions let in", s.older_session_accepted),
        (
            "views dropped past the stale-view limit",
            s.expired_in_cluster,
        ),
        ("Nodes deleted", s.nodes_gone),
        ("agents of deleted Nodes refused", s.nodes_back),
        ("late commits", s.late_commits),
        ("commits answered with an error", s.commit_then_fail),
        ("messages delayed", s.messages_delayed),
        ("store watch events", s.store_events),
        ("foreign bindings", s.foreign),
        ("objects edited", s.edited),
        ("clock steps", s.clock_steps),
        ("bursts", s.bursts),
        ("bursts ended before their answers", s.early_bursts),
        ("agents restarted with a pod relabelled", s.relabelled),
        ("agents down past their node's view", s.outages),
        (
            "claims of an id quarantined for other labels",
            s.quarantined_claims,
        ),
    ] {
        // The rarest paths (labels bound elsewhere) only need to be reached.
        let least = if what.starts_with("creates of labels") {
            1
        } else {
            3
        };
        assert!(
            n >= least,
            "the generated runs exercised {what} only {n} times: {c:?}"
        );
    }
}
