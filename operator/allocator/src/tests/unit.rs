//! One test per rule of DESIGN.md's allocator section.

use super::*;

/// Nodes that stay alive however long a test lets time pass without snapshots.
fn patient_config() -> Config {
    Config {
        node_ttl: ms(600_000),
        ..small_config()
    }
}

// ---- sessions and ordering ----

#[test]
fn newer_session_replaces_older_is_refused() {
    let mut h = Harness::new(small_config());
    let (_, c1) = connected(&mut h, N1, 10);
    let (_, c2) = connected(&mut h, N1, 20);
    assert_ne!(c1, c2);
    assert!(matches!(
        h.agent_msgs.last(),
        Some((_, conn, AgentMsg::Close(CloseReason::Replaced { .. }))) if *conn == c1
    ));
    let err = h.hello(N1, session(15));
    assert!(
        matches!(err, Err(SyncError::StaleSession { .. })),
        "{err:?}"
    );
    // Messages on the replaced stream are refused and change nothing.
    let r = h.snapshot(N1, c1, 1, vec![mk_endpoint("a", 300, "app=a")]);
    assert!(matches!(r, Err(SyncError::Replaced { .. })));
    assert_eq!(h.alloc.node(&node(N1)).map(|n| n.endpoints), Some(0));
}

#[test]
fn reconnect_with_same_session_keeps_seq() {
    let mut h = Harness::new(small_config());
    let (s, c1) = connected(&mut h, N1, 10);
    ok(h.snapshot(N1, c1, 5, vec![]));
    let c2 = ok(h.hello(N1, s));
    let applied = ok(h.snapshot(N1, c2, 3, vec![]));
    assert!(applied.ignored, "seq 3 after 5 in the same session is old");
    let applied = ok(h.snapshot(N1, c2, 6, vec![]));
    assert!(!applied.ignored);
}

#[test]
fn old_seq_is_ignored_and_counted_gap_is_fine() {
    let mut h = Harness::new(small_config());
    let (s, c) = connected(&mut h, N1, 10);
    let x = ok(h.allocate_now(N1, s, "app=a"));
    ok(h.upsert(N1, c, 1, mk_endpoint("a", x.get(), "app=a")));
    // Gap: 2 and 3 are lost.
    ok(h.delete(N1, c, 4, "a"));
    assert_eq!(h.refs(x.get()), 0);
    // A late duplicate of seq 1 is ignored.
    let r = ok(h.upsert(N1, c, 1, mk_endpoint("a", x.get(), "app=a")));
    assert!(r.ignored);
    assert_eq!(h.refs(x.get()), 0);
    assert_eq!(h.alloc.node(&node(N1)).map(|n| n.old_seq_ignored), Some(1));
    assert_eq!(h.alloc.counters().old_seq_ignored, 1);
}

#[test]
fn new_session_keeps_view_until_its_first_snapshot() {
    let mut h = Harness::new(small_config());
    let (s, c) = connected(&mut h, N1, 10);
    let x = ok(h.allocate_now(N1, s, "app=a"));
    ok(h.snapshot(N1, c, 1, vec![mk_endpoint("a", x.get(), "app=a")]));
    let (_, c2) = connected(&mut h, N1, 20);
    assert_eq!(h.refs(x.get()), 1, "the view survives the new Hello");
    let applied = ok(h.snapshot(N1, c2, 1, vec![]));
    assert_eq!(
        applied.adoptions, 1,
        "the first snapshot's differences are adoptions"
    );
    assert_eq!(applied.corrections, 0);
    assert_eq!(h.refs(x.get()), 0);
}

// ---- allocation ----

#[test]
fn known_labels_are_answered_at_once_new_ones_after_persisting() {
    let mut h = Harness::new(small_config());
    let (s, _) = connected(&mut h, N1, 10);
    assert_eq!(
        ok(h.allocate(N1, s, "app=a")),
        None,
        "a new label set waits for the store"
    );
    assert!(h.store.identities.is_empty());
    assert!(
        h.replies.is_empty(),
        "nothing is handed out before it is persisted"
    );
    h.settle_store();
    let (_, reply) = h.replies.pop().unwrap_or_else(|| panic!("no reply"));
    let x = ok(reply);
    assert_eq!(h.store.identities.get(&x), Some(&labels("app=a")));
    assert_eq!(ok(h.allocate(N1, s, "app=a")), Some(x));
    assert_eq!(
        h.alloc.identity(x).map(|i| i.holds),
        Some(1),
        "one hold per node, however many calls"
    );
    assert!(matches!(h.watch.as_slice(), [WatchChange::Upsert(info)] if info.id == x));
}

#[test]
fn allocate_needs_the_current_session() {
    let mut h = Harness::new(small_config());
    assert!(matches!(
        h.allocate(N1, session(1), "app=a"),
        Err(AllocError::Sync(SyncError::NoSession { .. }))
    ));
    connected(&mut h, N1, 10);
    assert!(matches!(
        h.allocate(N1, session(5), "app=a"),
        Err(AllocError::Sync(SyncError::StaleSession { .. }))
    ));
    assert!(matches!(
        h.allocate(N1, session(50), "app=a"),
        Err(AllocError::Sync(SyncError::WrongSession { .. }))
    ));
    assert!(
        h.pending()
            .all(|op| !matches!(op, StoreOp::CreateIdentity { .. }))
    );
}

#[test]
fn store_failure_is_reported_and_the_id_is_not_lost() {
    let mut h = Harness::new(small_config());
    let (s, _) = connected(&mut h, N1, 10);
    assert_eq!(ok(h.allocate(N1, s, "app=a")), None);
    h.fail_store();
    assert!(matches!(
        h.replies.pop(),
        Some((_, Err(AllocError::StoreUnavailable { cause: "io" })))
    ));
    // The binding is retried in the background; asking again gets the same id.
    h.advance(ms(600));
    h.settle_store();
    let x = ok(h.allocate_now(N1, s, "app=a"));
    assert_eq!(h.store.identities.get(&x), Some(&labels("app=a")));
    assert_eq!(h.store.identities.len(), 1);
}

#[test]
fn hold_quota_and_hold_expiry() {
    let mut cfg = small_config();
    cfg.max_holds_per_node = 2;
    let mut h = Harness::new(cfg);
    let (s, c) = connected(&mut h, N1, 10);
    let a = ok(h.allocate_now(N1, s, "app=a"));
    ok(h.allocate_now(N1, s, "app=b"));
    let err = h.allocate(N1, s, "app=c");
    assert!(
        matches!(err, Err(AllocError::HoldQuota { max: 2, .. })),
        "{err:?}"
    );
    assert_eq!(
        err.err().map(|e| e.to_string()).unwrap_or_default(),
        "node node-1 holds 2 identities not yet seen in its view, the per-node limit"
    );
    // Re-asking for a held identity is fine; a view entry ends its hold.
    assert_eq!(ok(h.allocate(N1, s, "app=a")), Some(a));
    ok(h.upsert(N1, c, 1, mk_endpoint("a", a.get(), "app=a")));
    ok(h.allocate_now(N1, s, "app=c"));
    // Holds expire after the hold timeout (the node stays alive by snapshotting).
    for seq in 2..6 {
        h.advance(ms(1_000));
        ok(h.snapshot(N1, c, seq, vec![mk_endpoint("a", a.get(), "app=a")]));
    }
    assert_eq!(h.alloc.node(&node(N1)).map(|n| n.holds), Some(0));
    assert!(h.alloc.counters().holds_expired >= 2);
}

fn holds_of(h: &Harness) -> Option<u32> {
    h.alloc.node(&node(N1)).map(|n| n.holds)
}

/// The pod ended before its Allocate was answered: the agent gave the allocation
/// up, and its next snapshot says so. The hold ends then, not at the hold timeout,
/// and the identity is released at once.
#[test]
fn a_snapshot_that_settles_an_allocation_no_endpoint_took_up_ends_its_hold() {
    let mut h = Harness::new(small_config());
    let (s, c) = connected(&mut h, N1, 10);
    ok(h.snapshot(N1, c, 1, vec![]));
    ok(h.allocate_numbered(N1, s, 1, "app=a"));
    h.settle_store();
    let x = h
        .alloc
        .lookup(&labels("app=a"))
        .map_or_else(|| panic!("app=a has no identity"), |info| info.id);
    assert_eq!(holds_of(&h), Some(1));
    // A snapshot that settles nothing yet (an old agent's, or the answer still on
    // its way) ends nothing.
    ok(h.snapshot_settled(N1, c, 2, vec![], 0));
    assert_eq!(holds_of(&h), Some(1));
    // Unchanged view, allocation 1 settled: the hold ends.
    ok(h.snapshot_settled(N1, c, 3, vec![], 1));
    assert_eq!(holds_of(&h), Some(0));
    assert_eq!(h.alloc.counters().holds_settled, 1);
    assert_eq!(h.alloc.counters().holds_expired, 0);
    h.advance(ms(10));
    assert!(
        matches!(h.state(x.get()), Some(IdentityState::Released { .. })),
        "{:?}",
        h.state(x.get())
    );
}

/// Only the allocations the snapshot covers: a later one still in flight keeps
/// its hold, in a snapshot that changes the view too.
#[test]
fn a_hold_of_an_allocation_not_yet_settled_stays() {
    let mut h = Harness::new(small_config());
    let (s, c) = connected(&mut h, N1, 10);
    let a = ok(h.allocate_numbered(N1, s, 1, "app=a"));
    let b = ok(h.allocate_numbered(N1, s, 2, "app=b"));
    h.settle_store();
    assert_eq!(holds_of(&h), Some(2), "{a:?} {b:?}");
    let c_id = ok(h.allocate_now(N1, s, "app=c"));
    ok(h.snapshot_settled(N1, c, 1, vec![mk_endpoint("c", c_id.get(), "app=c")], 1));
    // c was taken up by the view; a (allocation 1) settled; b (2) stays.
    assert_eq!(holds_of(&h), Some(1));
    assert_eq!(h.alloc.counters().holds_settled, 1);
    ok(h.snapshot_settled(N1, c, 2, vec![mk_endpoint("c", c_id.get(), "app=c")], 2));
    assert_eq!(holds_of(&h), Some(0));
    assert_eq!(h.alloc.counters().holds_settled, 2);
}

/// An agent that numbers no allocation: its holds only expire, whatever a
/// snapshot says.
#[test]
fn holds_of_an_agent_that_numbers_none_only_expire() {
    let mut h = Harness::new(small_config());
    let (s, c) = connected(&mut h, N1, 10);
    ok(h.allocate_now(N1, s, "app=a"));
    ok(h.snapshot_settled(N1, c, 1, vec![], 7));
    assert_eq!(holds_of(&h), Some(1));
    for seq in 2..6 {
        h.advance(ms(1_000));
        ok(h.snapshot_settled(N1, c, seq, vec![], 7));
    }
    assert_eq!(holds_of(&h), Some(0));
    assert_eq!(h.alloc.counters().holds_settled, 0);
    assert_eq!(h.alloc.counters().holds_expired, 1);
}

/// A new session numbers from 1 again: its snapshots do not end the holds of the
/// session before it, and a hold renewed by its allocations still only expires.
#[test]
fn a_new_session_s_numbers_do_not_end_the_last_session_s_holds() {
    let mut h = Harness::new(small_config());
    let (s1, _) = connected(&mut h, N1, 10);
    ok(h.allocate_numbered(N1, s1, 5, "app=a"));
    ok(h.allocate_numbered(N1, s1, 6, "app=b"));
    h.settle_store();
    let (s2, c2) = connected(&mut h, N1, 20);
    // The new session asks for app=b again as its allocation 1.
    ok(h.allocate_numbered(N1, s2, 1, "app=b"));
    ok(h.snapshot_settled(N1, c2, 1, vec![], 9));
    assert_eq!(holds_of(&h), Some(2));
    assert_eq!(h.alloc.counters().holds_settled, 0);
}

/// Two allocations of one identity: the hold protects the later one.
#[test]
fn a_renewed_hold_ends_with_its_latest_allocation() {
    let mut h = Harness::new(small_config());
    let (s, c) = connected(&mut h, N1, 10);
    ok(h.allocate_numbered(N1, s, 1, "app=a"));
    h.settle_store();
    ok(h.allocate_numbered(N1, s, 3, "app=a"));
    ok(h.snapshot_settled(N1, c, 1, vec![], 2));
    assert_eq!(holds_of(&h), Some(1));
    ok(h.snapshot_settled(N1, c, 2, vec![], 3));
    assert_eq!(holds_of(&h), Some(0));
}

#[test]
fn exhausted_range_recovers_when_quarantine_ends() {
    let mut cfg = small_config();
    cfg.range = IdRange::new(256, 258).unwrap_or_default();
    let mut h = Harness::new(cfg);
    let (s, c) = connected(&mut h, N1, 10);
    for l in ["app=a", "app=b", "app=c"] {
        ok(h.allocate_now(N1, s, l));
    }
    let err = h.allocate(N1, s, "app=d");
    assert!(
        matches!(err, Err(AllocError::RangeExhausted { used: 3, .. })),
        "{err:?}"
    );
    // Nothing references them: holds expire, grace passes, they are deleted and quarantined.
    for seq in 1..=8 {
        h.advance(ms(1_000));
        h.settle_store();
        ok(h.snapshot(N1, c, seq, vec![]));
    }
    assert_eq!(h.alloc.stats().quarantined, 3);
    assert!(matches!(
        h.allocate(N1, s, "app=d"),
        Err(AllocError::RangeExhausted { .. })
    ));
    // Once quarantine is over the ids are free again.
    for seq in 9..=20 {
        h.advance(ms(1_000));
        h.settle_store();
        ok(h.snapshot(N1, c, seq, vec![]));
    }
    ok(h.allocate_now(N1, s, "app=d"));
}

// ---- re-adoption ----

#[test]
fn readoption_bound_unknown_rebind_and_conflict() {
    let mut h = Harness::new(small_config());
    let (s, c) = connected(&mut h, N1, 10);
    let y = ok(h.allocate_now(N1, s, "app=y"));
    let other = ok(h.allocate_now(N1, s, "app=other"));
    let eps = vec![
        // X bound to L: reference it.
        mk_endpoint("bound", y.get(), "app=y"),
        // X unknown, L unknown, in range: adopt.
        mk_endpoint("adopt", 700, "app=adopted"),
        // L bound to Y != X: reference Y, rebind.
        mk_endpoint("moved", 701, "app=y"),
        // X bound to other labels: a new id for L, rebind.
        mk_endpoint("clash", other.get(), "app=new"),
        // X out of range: a new id for L, rebind.
        mk_endpoint("outside", 5000, "app=far"),
    ];
    let applied = ok(h.snapshot(N1, c, 1, eps));
    assert_eq!(applied.rebinds, 3);
    assert_eq!(h.refs(y.get()), 2);
    assert_eq!(h.refs(700), 1);
    assert_eq!(
        h.state(700),
        Some(IdentityState::Creating),
        "adopted ids are persisted first"
    );
    assert_eq!(
        h.rebinds(),
        vec![("moved".to_owned(), y.get())],
        "rebinds to unpersisted ids wait"
    );
    h.settle_store();
    assert_eq!(
        h.store.identities.get(&id(700)),
        Some(&labels("app=adopted"))
    );
    let rebinds = h.rebinds();
    assert_eq!(rebinds.len(), 3);
    for (name, target) in &rebinds[1..] {
        let want = if name == "clash" {
            "app=new"
        } else {
            "app=far"
        };
        assert_eq!(
            h.alloc.identity(id(*target)).and_then(|i| i.labels),
            Some(labels(want)),
            "{name}"
        );
    }
    assert_eq!(h.alloc.counters().identities_adopted, 1);
}

#[test]
fn first_claim_of_an_unknown_id_wins() {
    let mut h = Harness::new(small_config());
    let (_, c1) = connected(&mut h, N1, 10);
    let (_, c2) = connected(&mut h, N2, 10);
    ok(h.snapshot(N1, c1, 1, vec![mk_endpoint("a", 600, "app=first")]));
    let applied = ok(h.snapshot(N2, c2, 1, vec![mk_endpoint("b", 600, "app=second")]));
    assert_eq!(applied.rebinds, 1);
    h.settle_store();
    assert_eq!(h.store.identities.get(&id(600)), Some(&labels("app=first")));
    let rebinds = h.rebinds();
    assert_eq!(rebinds.len(), 1);
    assert_eq!(rebinds[0].0, "b");
    assert_ne!(rebinds[0].1, 600);
}

#[test]
fn quarantined_id_is_adopted_only_by_its_own_labels() {
    let mut h = Harness::new(small_config());
    let (s, c) = connected(&mut h, N1, 10);
    let x = ok(h.allocate_now(N1, s, "app=a"));
    // Let it be released, deleted and quarantined.
    for seq in 1..=8 {
        h.advance(ms(1_000));
        h.settle_store();
        ok(h.snapshot(N1, c, seq, vec![]));
    }
    assert!(matches!(
        h.state(x.get()),
        Some(IdentityState::Quarantined { .. })
    ));
    // Another label set claiming it is rebound elsewhere.
    ok(h.snapshot(N1, c, 9, vec![mk_endpoint("b", x.get(), "app=b")]));
    h.settle_store();
    assert!(matches!(
        h.state(x.get()),
        Some(IdentityState::Quarantined { .. })
    ));
    assert_eq!(h.rebinds().len(), 1);
    // Its own label set may take it back (an agent that kept it through a lost event).
    ok(h.snapshot(N1, c, 10, vec![mk_endpoint("a", x.get(), "app=a")]));
    h.settle_store();
    assert_eq!(h.state(x.get()), Some(IdentityState::Live));
    assert_eq!(h.store.identities.get(&x), Some(&labels("app=a")));
    assert!(!h.store.tombstones.contains_key(&x));
}

// ---- snapshots ----

#[test]
fn snapshot_replaces_view_and_counts_corrections() {
    let mut h = Harness::new(small_config());
    let (s, c) = connected(&mut h, N1, 10);
    let a = ok(h.allocate_now(N1, s, "app=a"));
    let b = ok(h.allocate_now(N1, s, "app=b"));
    ok(h.snapshot(N1, c, 1, vec![mk_endpoint("a", a.get(), "app=a")]));
    // A delta for b is lost; the delete for a is lost.
    let applied = ok(h.snapshot(N1, c, 4, vec![mk_endpoint("b", b.get(), "app=b")]));
    assert_eq!(applied.corrections, 2);
    assert_eq!((h.refs(a.get()), h.refs(b.get())), (0, 1));
    // The same snapshot again changes nothing.
    let applied = ok(h.snapshot(N1, c, 5, vec![mk_endpoint("b", b.get(), "app=b")]));
    assert_eq!(applied, Applied::default());
    assert_eq!(h.alloc.counters().corrections, 2);
}

#[test]
fn relabelled_endpoint_moves_its_reference() {
    let mut h = Harness::new(small_config());
    let (s, c) = connected(&mut h, N1, 10);
    let a = ok(h.allocate_now(N1, s, "app=a"));
    let b = ok(h.allocate_now(N1, s, "app=b"));
    ok(h.upsert(N1, c, 1, mk_endpoint("p", a.get(), "app=a")));
    ok(h.upsert(N1, c, 2, mk_endpoint("p", b.get(), "app=b")));
    assert_eq!((h.refs(a.get()), h.refs(b.get())), (0, 1));
}

// ---- garbage collection ----

#[test]
fn unreferenced_identity_is_released_then_deleted_after_grace() {
    let mut h = Harness::new(patient_config());
    let (s, c) = connected(&mut h, N1, 10);
    let x = ok(h.allocate_now(N1, s, "app=a"));
    ok(h.upsert(N1, c, 1, mk_endpoint("a", x.get(), "app=a")));
    ok(h.delete(N1, c, 2, "a"));
    h.advance(ms(10));
    assert!(matches!(
        h.state(x.get()),
        Some(IdentityState::Released { .. })
    ));
    h.advance(ms(1_000));
    assert!(h.deletes_issued.is_empty(), "not before the grace period");
    // Referenced again while released: live again, nothing deleted.
    ok(h.upsert(N1, c, 3, mk_endpoint("a", x.get(), "app=a")));
    h.advance(ms(5_000));
    assert_eq!(h.state(x.get()), Some(IdentityState::Live));
    ok(h.delete(N1, c, 4, "a"));
    h.advance(ms(10));
    h.advance(ms(2_000));
    assert_eq!(h.deletes_issued.len(), 1);
    h.settle_store();
    assert!(matches!(
        h.state(x.get()),
        Some(IdentityState::Quarantined { .. })
    ));
    assert!(!h.store.identities.contains_key(&x));
    assert!(h.store.tombstones.contains_key(&x));
    assert!(matches!(h.watch.last(), Some(WatchChange::Removed { id, .. }) if *id == x));
}

#[test]
fn referenced_during_delete_is_recreated() {
    let mut h = Harness::new(patient_config());
    let (s, c) = connected(&mut h, N1, 10);
    let x = ok(h.allocate_now(N1, s, "app=a"));
    h.advance(ms(3_100));
    ok(h.snapshot(N1, c, 1, vec![]));
    h.advance(ms(2_100));
    assert_eq!(h.deletes_issued.len(), 1);
    // The delete is in flight when the label set is wanted again.
    assert_eq!(ok(h.allocate(N1, s, "app=a")), None);
    h.settle_store();
    assert_eq!(
        h.store.identities.get(&x),
        Some(&labels("app=a")),
        "re-created after the delete"
    );
    assert!(matches!(h.replies.last(), Some((_, Ok(got))) if *got == x));
    assert_eq!(h.alloc.counters().gc_outcomes.get("recreated"), Some(&1));
}

#[test]
fn failed_deletes_are_retried_per_item_and_the_pass_goes_on() {
    let mut cfg = patient_config();
    cfg.gc_rate = 5.0;
    cfg.gc_burst = 5.0;
    let mut h = Harness::new(cfg);
    let (s, c) = connected(&mut h, N1, 10);
    let names: Vec<String> = (0..20).map(|i| format!("app=a{i}")).collect();
    for l in &names {
        ok(h.allocate_now(N1, s, l));
    }
    h.advance(ms(3_100));
    ok(h.snapshot(N1, c, 1, vec![]));
    h.advance(ms(2_100));
    assert_eq!(
        h.deletes_issued.len(),
        5,
        "the budget allows 5 deletes in one burst"
    );
    // The first batch fails; the next ticks go on with the others.
    h.fail_store();
    for seq in 2..42 {
        h.advance(ms(250));
        h.settle_store();
        ok(h.snapshot(N1, c, seq, vec![]));
    }
    assert!(
        h.store.identities.is_empty(),
        "left: {:?}",
        h.store.identities
    );
    assert_eq!(h.alloc.counters().gc_outcomes.get("io"), Some(&5));
    assert_eq!(h.alloc.counters().gc_outcomes.get("deleted"), Some(&20));
    // The budget was respected: never more than 5 deletes per second after the burst.
    assert!(
        h.deletes_issued
            .iter()
            .all(|&(_, refs, holds)| refs == 0 && holds == 0)
    );
}

#[test]
fn store_conflict_blocks_the_id_and_rehomes_its_users() {
    let mut h = Harness::new(small_config());
    let (s, c) = connected(&mut h, N1, 10);
    // Someone else wrote an invalid object at 700 behind census's back (a valid
    // binding there would be taken instead: tests/audit.rs).
    h.store
        .invalid
        .insert(id(700), "an invalid Identity object".to_owned());
    h.store.others.insert(id(700));
    ok(h.snapshot(N1, c, 1, vec![mk_endpoint("a", 700, "app=a")]));
    h.settle_store();
    assert_eq!(h.state(700), Some(IdentityState::Blocked));
    let moved = h.alloc.lookup(&labels("app=a")).map(|i| (i.id, i.refs));
    let Some((new_id, 1)) = moved else {
        panic!("app=a should have moved: {moved:?}")
    };
    assert_eq!(h.rebinds(), vec![("a".to_owned(), new_id.get())]);
    assert_eq!(h.store.identities.get(&new_id), Some(&labels("app=a")));
    assert_eq!(h.alloc.counters().blocked, 1);
    let _ = s;
}

// ---- node liveness ----

#[test]
fn embedded_silent_node_is_dropped_and_readopted() {
    let mut h = Harness::new(small_config());
    let (s, c) = connected(&mut h, N1, 10);
    let x = ok(h.allocate_now(N1, s, "app=a"));
    ok(h.snapshot(N1, c, 1, vec![mk_endpoint("a", x.get(), "app=a")]));
    h.advance(ms(3_000));
    assert!(
        h.alloc.node(&node(N1)).is_none(),
        "dropped after the node TTL"
    );
    assert!(
        h.agent_msgs
            .iter()
            .any(|(_, _, m)| *m == AgentMsg::Close(CloseReason::Expired))
    );
    assert_eq!(h.refs(x.get()), 0);
    assert!(
        h.store.nodes.is_empty()
            || h.pending()
                .any(|op| matches!(op, StoreOp::DeleteNode { .. }))
    );
    // The agent comes back within the grace period and re-adopts.
    let (_, c2) = connected(&mut h, N1, 10);
    ok(h.snapshot(N1, c2, 2, vec![mk_endpoint("a", x.get(), "app=a")]));
    assert_eq!(h.refs(x.get()), 1);
    assert_eq!(h.state(x.get()), Some(IdentityState::Live));
}

#[test]
fn cluster_silent_node_goes_stale_and_keeps_its_view() {
    let mut cfg = small_config();
    cfg.liveness = Liveness::Cluster {
        stale_view_limit: ms(10_000),
    };
    let mut h = Harness::new(cfg);
    let (s, c) = connected(&mut h, N1, 10);
    let x = ok(h.allocate_now(N1, s, "app=a"));
    ok(h.snapshot(N1, c, 1, vec![mk_endpoint("a", x.get(), "app=a")]));
    h.advance(ms(4_000));
    assert_eq!(h.alloc.node(&node(N1)).map(|n| n.stale), Some(true));
    assert_eq!(h.alloc.stats().stale_nodes, 1);
    assert_eq!(
        h.refs(x.get()),
        1,
        "a partitioned agent keeps its identities"
    );
    ok(h.snapshot(N1, c, 2, vec![mk_endpoint("a", x.get(), "app=a")]));
    assert_eq!(h.alloc.node(&node(N1)).map(|n| n.stale), Some(false));
    // Stale beyond the limit: dropped as a last resort.
    h.advance(ms(3_000));
    h.advance(ms(10_000));
    assert!(h.alloc.node(&node(N1)).is_none());
    // Or at once when the Node object is deleted.
    let (_, c2) = connected(&mut h, N2, 10);
    ok(h.snapshot(N2, c2, 1, vec![mk_endpoint("b", x.get(), "app=a")]));
    h.alloc.node_gone(&node(N2), h.now);
    h.route();
    assert_eq!(h.refs(x.get()), 0);
}

// ---- restart ----

#[test]
fn restart_holds_loaded_identities_until_nodes_can_report() {
    let mut h = Harness::new(small_config());
    let (s, c) = connected(&mut h, N1, 10);
    let a = ok(h.allocate_now(N1, s, "app=a"));
    let b = ok(h.allocate_now(N1, s, "app=b"));
    ok(h.snapshot(
        N1,
        c,
        1,
        vec![
            mk_endpoint("a", a.get(), "app=a"),
            mk_endpoint("b", b.get(), "app=b"),
        ],
    ));
    h.settle_store();
    // Restart: a fresh core over the same store.
    let store = h.store.clone();
    let start = h.now.plus(ms(100));
    let mut h = Harness::with_store(small_config(), store, start);
    let fenced = Some(IdentityState::Protected {
        until: start.plus(small_config().node_ttl),
    });
    assert_eq!(h.state(a.get()), fenced);
    h.advance(ms(2_900));
    assert!(h.deletes_issued.is_empty());
    assert_eq!(h.state(a.get()), fenced, "held until start + node TTL");
    // The agent reconnects and snapshots only b: a is released after the window.
    let (_, c) = connected(&mut h, N1, 10);
    let applied = ok(h.snapshot(N1, c, 1, vec![mk_endpoint("b", b.get(), "app=b")]));
    assert_eq!(applied.adoptions, 1);
    h.advance(ms(200));
    assert!(matches!(
        h.state(a.get()),
        Some(IdentityState::Released { .. })
    ));
    assert_eq!(h.state(b.get()), Some(IdentityState::Live));
}

#[test]
fn empty_store_adopts_first_and_hands_out_nothing_new_in_the_window() {
    let cfg = small_config();
    let mut h = Harness::with_store(
        cfg.clone(),
        ModelStore::new(cfg.quarantine),
        Timestamp::from_millis(5_000),
    );
    let (s, c) = connected(&mut h, N1, 10);
    let err = h.allocate(N1, s, "app=new");
    assert!(
        matches!(err, Err(AllocError::AdoptionWindow { .. })),
        "{err:?}"
    );
    // Agents' snapshots re-adopt what they hold.
    ok(h.snapshot(N1, c, 1, vec![mk_endpoint("a", 400, "app=a")]));
    h.settle_store();
    assert_eq!(h.store.identities.get(&id(400)), Some(&labels("app=a")));
    assert_eq!(
        ok(h.allocate(N1, s, "app=a")),
        Some(id(400)),
        "known label sets are served"
    );
    h.advance(ms(2_000));
    ok(h.snapshot(N1, c, 2, vec![mk_endpoint("a", 400, "app=a")]));
    h.advance(ms(1_000));
    ok(h.allocate_now(N1, s, "app=new"));
}

#[test]
fn no_snapshot_entry_gets_a_new_id_inside_the_adoption_window() {
    // Empty store: node-1 holds 400 for app=a, node-2 claims 400 for app=b, and a
    // second later node-3 reports 256 for app=c. app=b must not take 256 (the first
    // free id, still held by node-3): it waits for the window, then gets an id nobody
    // claimed.
    let cfg = small_config();
    let mut h = Harness::with_store(
        cfg.clone(),
        ModelStore::new(cfg.quarantine),
        Timestamp::from_millis(5_000),
    );
    let (_, c1) = connected(&mut h, N1, 10);
    let (_, c2) = connected(&mut h, N2, 10);
    let (_, c3) = connected(&mut h, "node-3", 10);
    ok(h.snapshot(N1, c1, 1, vec![mk_endpoint("a", 400, "app=a")]));
    let b = ok(h.snapshot(N2, c2, 1, vec![mk_endpoint("b", 400, "app=b")]));
    assert_eq!(b.pending, vec![key("b")], "app=b waits: {b:?}");
    assert_eq!(b.unresolved, 0);
    assert!(h.rebinds().is_empty(), "no Rebind before the window ends");
    h.settle_store();
    h.advance(ms(1_000));
    ok(h.snapshot("node-3", c3, 1, vec![mk_endpoint("c", 256, "app=c")]));
    h.settle_store();
    assert_eq!(h.store.identities.get(&id(256)), Some(&labels("app=c")));
    assert_eq!(h.store.identities.get(&id(400)), Some(&labels("app=a")));
    assert_eq!(h.store.identities.len(), 2, "nothing new in the window");
    // Still pending on a resend inside the window; no SnapshotNow yet.
    let again = ok(h.snapshot(N2, c2, 2, vec![mk_endpoint("b", 400, "app=b")]));
    assert_eq!(again.pending, vec![key("b")]);
    let asked = |h: &Harness| {
        h.agent_msgs
            .iter()
            .filter(|(n, c, m)| *n == node(N2) && *c == c2 && matches!(m, AgentMsg::SnapshotNow))
            .count()
    };
    assert_eq!(asked(&h), 0);
    // The window ends: node-2 is asked for a snapshot, which resolves app=b.
    h.advance(ms(2_000));
    assert_eq!(asked(&h), 1, "node-2 is asked to snapshot now");
    let resolved = ok(h.snapshot(N2, c2, 3, vec![mk_endpoint("b", 400, "app=b")]));
    assert!(resolved.pending.is_empty(), "{resolved:?}");
    h.settle_store();
    let (name, fresh) = h.rebinds().last().cloned().unwrap_or_default();
    assert_eq!(name, "b");
    assert!(
        ![256, 400].contains(&fresh),
        "a fresh id nobody claimed: {fresh}"
    );
    assert_eq!(h.store.identities.get(&id(fresh)), Some(&labels("app=b")));
    assert_eq!(h.refs(fresh), 1);
}

#[test]
fn a_node_that_comes_straight_back_stays_in_the_store() {
    // Embedded: silence past the node TTL drops the node (DeleteNode); its Hello
    // right after puts it back (PutNode). The two writes must land in that order.
    let mut h = Harness::new(small_config());
    connected(&mut h, N1, 10);
    h.settle_store();
    assert!(h.store.nodes.contains_key(&node(N1)));
    h.advance(ms(3_500));
    assert!(h.alloc.node(&node(N1)).is_none(), "dropped after the TTL");
    connected(&mut h, N1, 20);
    let node_ops: Vec<&StoreOp> = h
        .pending()
        .filter(|op| matches!(op, StoreOp::PutNode { .. } | StoreOp::DeleteNode { .. }))
        .collect();
    assert!(
        matches!(
            node_ops[..],
            [StoreOp::DeleteNode { .. }, StoreOp::PutNode { .. }]
        ),
        "{node_ops:?}"
    );
    // Both on one writer's queue, which applies them in order.
    assert!(
        h.pending_gc
            .iter()
            .all(|op| !matches!(op, StoreOp::DeleteNode { .. }))
    );
    h.settle_store();
    assert!(
        h.store.nodes.contains_key(&node(N1)),
        "the node's record survives"
    );
}

#[test]
fn a_duplicate_key_in_a_snapshot_counts_once() {
    let mut h = Harness::new(small_config());
    let (s1, c1) = connected(&mut h, N1, 10);
    let web = ok(h.allocate_now(N1, s1, "app=web"));
    let db = ok(h.allocate_now(N1, s1, "app=db"));
    let a = mk_endpoint("a", web.get(), "app=web");
    // Changed view: the first entry of the key counts, the second is counted apart.
    let applied = ok(h.snapshot(N1, c1, 1, vec![a.clone(), a.clone()]));
    assert_eq!(applied.duplicates, 1);
    assert_eq!(h.refs(web.get()), 1, "refcount 1, view 1");
    // A view of {a, b} and a snapshot of [a, a]: same length, every key known, yet
    // not unchanged: b goes.
    let b = mk_endpoint("b", db.get(), "app=db");
    ok(h.snapshot(N1, c1, 2, vec![a.clone(), b]));
    assert_eq!((h.refs(web.get()), h.refs(db.get())), (1, 1));
    let applied = ok(h.snapshot(N1, c1, 3, vec![a.clone(), a]));
    assert_eq!(applied.duplicates, 1);
    assert_eq!((h.refs(web.get()), h.refs(db.get())), (1, 0));
    assert_eq!(h.alloc.node(&node(N1)).map(|n| n.endpoints), Some(1));
}

#[test]
fn an_older_session_is_refused_only_while_the_current_stream_is_open() {
    // The agent restarts after its wall clock stepped back: its new session is older.
    let mut h = Harness::new(small_config());
    let (_, c1) = connected(&mut h, N1, 100);
    ok(h.snapshot(N1, c1, 1, vec![mk_endpoint("a", 300, "app=a")]));
    assert!(
        matches!(
            h.hello(N1, session(50)),
            Err(SyncError::StaleSession { .. })
        ),
        "a zombie cannot take over a live stream"
    );
    h.alloc.disconnect(&node(N1), c1);
    h.route();
    let c2 = ok(h.hello(N1, session(50)));
    assert_eq!(
        h.alloc.node(&node(N1)).and_then(|n| n.session),
        Some(session(50))
    );
    // The view stays until the new session's first snapshot, which starts at seq 1
    // and counts its differences as adoptions.
    assert_eq!(h.refs(300), 1);
    let applied = ok(h.snapshot(N1, c2, 1, vec![mk_endpoint("b", 300, "app=a")]));
    assert!(!applied.ignored);
    assert_eq!(applied.adoptions, 2, "{applied:?}");
    assert_eq!(h.refs(300), 1);
    // And now a Hello of the older clock's session would be a newer one: it replaces.
    assert!(h.hello(N1, session(100)).is_ok());
}

#[test]
fn identities_made_and_dropped_in_the_restart_fence_go_while_a_known_node_is_awaited() {
    // The fence keeps what was loaded for a node not heard yet; an identity made
    // after the start and unused before the fence ends is not that node's to keep.
    let cfg = Config {
        liveness: Liveness::Cluster {
            stale_view_limit: ms(20_000),
        },
        ..small_config()
    };
    let mut store = ModelStore::new(cfg.quarantine);
    store.identities.insert(id(300), labels("app=partitioned"));
    store.nodes.insert(node(N1), ());
    store.nodes.insert(node(N2), ());
    let mut h = Harness::with_store(cfg, store, Timestamp::from_millis(50_000));
    let (s2, c2) = connected(&mut h, N2, 10);
    let fresh = ok(h.allocate_now(N2, s2, "app=fresh"));
    ok(h.upsert(N2, c2, 1, mk_endpoint("fresh-0", fresh.get(), "app=fresh")));
    ok(h.delete(N2, c2, 2, "fresh-0"));
    assert!(
        matches!(h.state(fresh.get()), Some(IdentityState::Protected { .. })),
        "until the fence's node TTL, the fence keeps {fresh} too"
    );
    for seq in 3..13 {
        ok(h.snapshot(N2, c2, seq, vec![]));
        h.advance(ms(1_000));
        h.settle_store();
    }
    assert!(
        matches!(h.state(300), Some(IdentityState::Protected { .. })),
        "N1 may still use 300"
    );
    assert!(
        !h.store.identities.contains_key(&fresh),
        "{fresh} was deleted once the fence's node TTL passed"
    );
}

#[test]
fn after_a_restart_a_partitioned_nodes_identities_live_as_long_as_its_view_would() {
    // In a cluster a silent node keeps its view up to the stale-view limit; across a
    // restart (views are rebuilt from snapshots) its identities must last as long.
    let cfg = Config {
        liveness: Liveness::Cluster {
            stale_view_limit: ms(20_000),
        },
        ..small_config()
    };
    let mut store = ModelStore::new(cfg.quarantine);
    store.identities.insert(id(300), labels("app=partitioned"));
    store.identities.insert(id(301), labels("app=here"));
    store.nodes.insert(node(N1), ());
    store.nodes.insert(node(N2), ());
    let mut h = Harness::with_store(cfg, store.clone(), Timestamp::from_millis(50_000));
    let (_, c2) = connected(&mut h, N2, 10);
    let mut seq = 0;
    let mut second = |h: &mut Harness| {
        seq += 1;
        ok(h.snapshot(N2, c2, seq, vec![mk_endpoint("here", 301, "app=here")]));
        h.advance(ms(1_000));
        h.settle_store();
    };
    // Well past node TTL + grace: N1 has not reported, and nothing is released.
    for _ in 0..10 {
        second(&mut h);
    }
    assert!(
        matches!(h.state(300), Some(IdentityState::Protected { .. })),
        "N1 may still use 300"
    );
    assert!(h.store.identities.contains_key(&id(300)));
    // Past the stale-view limit N1's view would be dropped: now 300 goes.
    for _ in 0..16 {
        second(&mut h);
    }
    assert!(
        h.alloc.node(&node(N1)).is_none(),
        "N1 dropped at the stale-view limit"
    );
    assert!(
        !h.store.identities.contains_key(&id(300)),
        "300 deleted after that"
    );
    assert!(
        h.store.identities.contains_key(&id(301)),
        "301 is referenced"
    );

    // Embedded, the view of a silent node goes after the node TTL: so does the
    // protection.
    let cfg = small_config();
    let mut h = Harness::with_store(cfg, store, Timestamp::from_millis(50_000));
    for _ in 0..8 {
        h.advance(ms(1_000));
        h.settle_store();
    }
    assert!(!h.store.identities.contains_key(&id(300)));
}

#[test]
fn a_siblings_reference_does_not_end_a_fresh_pods_hold() {
    // web-0 references X; a fresh pod web-1 on the same node allocates X (a hold).
    // web-0 seen again (unchanged or by upsert) must not end web-1's hold: if web-0
    // then goes before web-1 is reported, X is still held, never released.
    let mut h = Harness::new(small_config());
    let (s1, c1) = connected(&mut h, N1, 10);
    let x = ok(h.allocate_now(N1, s1, "app=web"));
    let web0 = mk_endpoint("web-0", x.get(), "app=web");
    ok(h.snapshot(N1, c1, 1, vec![web0.clone()]));
    assert_eq!(h.alloc.identity(x).map(|i| i.holds), Some(0));
    assert_eq!(
        ok(h.allocate(N1, s1, "app=web")),
        Some(x),
        "web-1's Allocate"
    );
    assert_eq!(h.alloc.identity(x).map(|i| i.holds), Some(1));
    ok(h.snapshot(N1, c1, 2, vec![web0.clone()]));
    ok(h.upsert(N1, c1, 3, web0));
    assert_eq!(h.alloc.identity(x).map(|i| i.holds), Some(1), "still held");
    ok(h.delete(N1, c1, 4, "web-0"));
    h.advance(ms(2_500));
    assert_eq!(
        h.state(x.get()),
        Some(IdentityState::Live),
        "held, not released"
    );
    // web-1 shows up: the hold ends, the reference keeps X.
    ok(h.upsert(N1, c1, 5, mk_endpoint("web-1", x.get(), "app=web")));
    assert_eq!(h.alloc.identity(x).map(|i| (i.refs, i.holds)), Some((1, 0)));
}

#[test]
fn a_new_leader_waits_for_every_node_of_the_cluster_and_shows_only_those_that_spoke() {
    // The Kubernetes store keeps no node records: a new leader learns the cluster's
    // Nodes from their objects, and waits for each like a node from the store.
    let cfg = Config {
        liveness: Liveness::Cluster {
            stale_view_limit: ms(20_000),
        },
        ..small_config()
    };
    let mut store = ModelStore::new(cfg.quarantine);
    store.identities.insert(id(300), labels("app=partitioned"));
    let mut h = Harness::with_store(cfg, store, Timestamp::from_millis(50_000));
    h.alloc.await_nodes([node(N1), node(N2)], h.now);
    assert!(
        h.alloc.nodes().is_empty(),
        "Nodes whose agents never spoke are not listed"
    );
    let (s2, c2) = connected(&mut h, N2, 10);
    assert_eq!(h.alloc.nodes().len(), 1, "N2 said Hello");
    // An identity made since the start is collected as usual meanwhile.
    h.advance(ms(3_500));
    let new = ok(h.allocate_now(N2, s2, "app=new"));
    for seq in 1..=10 {
        ok(h.snapshot(N2, c2, seq, Vec::new()));
        h.advance(ms(1_000));
        h.settle_store();
    }
    assert!(
        h.store.identities.contains_key(&id(300)),
        "N1 may still use 300"
    );
    assert!(
        !h.store.identities.contains_key(&new),
        "unused since it was made: collected"
    );
    assert_eq!(
        h.alloc.stats().stale_nodes,
        0,
        "an agentless Node is not stale"
    );
    for seq in 11..=36 {
        ok(h.snapshot(N2, c2, seq, Vec::new()));
        h.advance(ms(1_000));
        h.settle_store();
    }
    assert!(
        !h.store.identities.contains_key(&id(300)),
        "after the stale-view limit"
    );
}

#[test]
fn loaded_tombstones_keep_quarantine_across_restart() {
    let cfg = small_config();
    let mut store = ModelStore::new(cfg.quarantine);
    store.identities.insert(id(300), labels("app=keep"));
    store.tombstones.insert(
        id(256),
        Tombstone {
            id: id(256),
            labels_hash: labels("app=old").stable_hash(),
            until_ms: 20_000,
        },
    );
    store.tombstones.insert(
        id(257),
        Tombstone {
            id: id(257),
            labels_hash: 1,
            until_ms: 1_000,
        },
    );
    let mut h = Harness::with_store(cfg, store, Timestamp::from_millis(10_000));
    assert!(matches!(
        h.state(256),
        Some(IdentityState::Quarantined { .. })
    ));
    assert_eq!(
        h.state(257),
        None,
        "an expired tombstone is dropped at load"
    );
    assert!(
        h.pending()
            .any(|op| *op == StoreOp::DeleteTombstone { id: id(257) })
    );
    let (s, _) = connected(&mut h, N1, 10);
    let got = ok(h.allocate_now(N1, s, "app=x"));
    assert_ne!(got, id(256));
    assert_ne!(got, id(300));
}

// ---- memory ----

#[test]
fn churn_leaves_only_live_identities_and_shrinks_maps() {
    let mut cfg = small_config();
    cfg.range = IdRange::new(256, 100_000).unwrap_or_default();
    cfg.quarantine = ms(1_000);
    cfg.gc_burst = 1_000.0;
    let mut h = Harness::new(cfg);
    let (s, c) = connected(&mut h, N1, 10);
    let keep = ok(h.allocate_now(N1, s, "app=keep"));
    ok(h.upsert(N1, c, 1, mk_endpoint("keep", keep.get(), "app=keep")));
    let mut seq = 2;
    // Enough for every map to grow well past the bounds checked below (every event
    // re-checks the invariants, so each one costs time proportional to the state).
    for i in 0..300 {
        let l = format!("app=job-{i}");
        let x = ok(h.allocate_now(N1, s, &l));
        ok(h.upsert(N1, c, seq, mk_endpoint(&format!("job-{i}"), x.get(), &l)));
        seq += 1;
        // Every delete event is lost.
    }
    assert_eq!(h.alloc.stats().live, 301);
    ok(h.snapshot(
        N1,
        c,
        seq,
        vec![mk_endpoint("keep", keep.get(), "app=keep")],
    ));
    seq += 1;
    for _ in 0..30 {
        h.advance(ms(500));
        h.settle_store();
        ok(h.snapshot(
            N1,
            c,
            seq,
            vec![mk_endpoint("keep", keep.get(), "app=keep")],
        ));
        seq += 1;
    }
    let stats = h.alloc.stats();
    assert_eq!(
        (
            stats.live,
            stats.released,
            stats.deleting,
            stats.quarantined
        ),
        (1, 0, 0, 0),
        "{stats:?}"
    );
    assert_eq!(h.store.identities.len(), 1);
    assert!(h.alloc.core.ids.entries().len() == 1);
    let n = h
        .alloc
        .nodes
        .get(&node(N1))
        .map(|n| (n.view.capacity(), n.holds.capacity()));
    assert!(
        n.is_some_and(|(v, hl)| v < 64 && hl < 64),
        "node maps shrank: {n:?}"
    );
    assert!(h.alloc.core.gc.released.capacity() <= 128);
    let (by_labels, quarantine) = h.alloc.core.ids.capacities();
    assert!(
        by_labels < 64 && quarantine < 64,
        "identity maps shrank: {by_labels}, {quarantine}"
    );
}

#[test]
fn a_view_at_rest_has_the_capacity_of_its_length_whatever_changed_it_last() {
    let mut h = Harness::new(small_config());
    let (s1, c1) = connected(&mut h, N1, 10);
    let (_, c2) = connected(&mut h, N2, 10);
    let web = ok(h.allocate_now(N1, s1, "app=web"));
    let steady: Vec<_> = (0..60)
        .map(|i| mk_endpoint(&format!("web-{i}"), web.get(), "app=web"))
        .collect();
    // N1 reaches its steady set through a burst of deltas: grown, then emptied.
    let mut seq = 1;
    for ep in steady.iter().cloned() {
        ok(h.upsert(N1, c1, seq, ep));
        seq += 1;
    }
    for i in 0..100 {
        ok(h.upsert(
            N1,
            c1,
            seq,
            mk_endpoint(&format!("job-{i}"), web.get(), "app=web"),
        ));
        seq += 1;
    }
    for i in 0..100 {
        ok(h.delete(N1, c1, seq, &format!("job-{i}")));
        seq += 1;
    }
    // N2 reaches the same set through a snapshot, which builds its view to size.
    ok(h.snapshot(N2, c2, 1, steady.clone()));
    let capacity = |h: &Harness, n: &str| h.alloc.nodes.get(&node(n)).map(|n| n.view.capacity());
    let (grown, built) = (capacity(&h, N1), capacity(&h, N2));
    assert!(
        grown > built,
        "the burst grew N1's view: {grown:?} vs {built:?}"
    );
    // An unchanged snapshot finds N1 at rest.
    ok(h.snapshot(N1, c1, seq, steady.clone()));
    assert_eq!(capacity(&h, N1), built, "N1's view settled to its length");
    ok(h.snapshot(N1, c1, seq + 1, steady));
    assert_eq!(capacity(&h, N1), built, "and stays there");
}

#[test]
fn a_nodes_hold_map_shrinks_when_its_holds_end_in_the_view() {
    // A burst of Allocates fills the hold map; the snapshot that shows every id in
    // the view ends every hold, and the map at rest must not keep its capacity.
    let mut h = Harness::new(small_config());
    let (s1, c1) = connected(&mut h, N1, 10);
    let endpoints: Vec<_> = (0..60)
        .map(|i| {
            let app = format!("app=burst-{i}");
            let id = ok(h.allocate_now(N1, s1, &app));
            mk_endpoint(&format!("pod-{i}"), id.get(), &app)
        })
        .collect();
    let holds = |h: &Harness| {
        h.alloc
            .nodes
            .get(&node(N1))
            .map(|n| (n.holds.len(), n.holds.capacity()))
    };
    assert!(
        holds(&h).is_some_and(|(len, capacity)| len == 60 && capacity >= 60),
        "{:?}",
        holds(&h)
    );
    ok(h.snapshot(N1, c1, 1, endpoints));
    h.advance(ms(10));
    assert_eq!(holds(&h), Some((0, 0)), "no hold left, no capacity kept");
}

// ---- bindings census did not write ----

fn range_256_300() -> Config {
    Config {
        range: match IdRange::new(256, 300) {
            Ok(r) => r,
            Err(e) => panic!("{e}"),
        },
        ..small_config()
    }
}

/// A stray `280 -> app=web` in the store that the core never loaded.
fn stray_web(h: &mut Harness) {
    h.store.identities.insert(id(280), labels("app=web"));
    h.store.foreign.insert(id(280));
}

#[test]
fn a_foreign_binding_met_by_a_create_is_taken_and_burns_no_id() {
    let mut h = Harness::new(range_256_300());
    let (s1, c1) = connected(&mut h, N1, 10);
    stray_web(&mut h);
    let web = ok(h.allocate_now(N1, s1, "app=web"));
    assert_eq!(
        web,
        id(280),
        "the store's binding is the identity of app=web"
    );
    assert!(h.alloc.core.ids.blocked().is_empty(), "no id blocked");
    assert_eq!(h.alloc.counters().blocked, 0);
    assert_eq!(
        h.store.identities.keys().copied().collect::<Vec<_>>(),
        [id(280)],
        "no other object written"
    );
    assert_eq!(
        h.alloc.identity(id(280)).map(|i| (i.refs, i.holds)),
        Some((0, 1))
    );
    // The id tried first is free again: only 280 is used of the range.
    assert_eq!(h.alloc.core.ids.used_in_range(), 1);
    // And the taken identity is referenced like any other.
    ok(h.snapshot(N1, c1, 1, vec![mk_endpoint("web-0", 280, "app=web")]));
    assert_eq!(h.refs(280), 1);
}

#[test]
fn an_endpoint_moved_to_a_foreign_binding_is_rebound_to_it() {
    // An agent's claim that needs a fresh id for app=web: the create of that fresh id
    // meets the stray, and the endpoint is rebound to 280, once the store answered.
    let mut h = Harness::new(range_256_300());
    let (s1, c1) = connected(&mut h, N1, 10);
    let db = ok(h.allocate_now(N1, s1, "app=db"));
    stray_web(&mut h);
    // web-0 claims db's id for app=web: L unknown to the core, X bound to other labels.
    ok(h.snapshot(N1, c1, 1, vec![mk_endpoint("web-0", db.get(), "app=web")]));
    h.settle_store();
    assert_eq!(h.rebinds().last(), Some(&("web-0".to_owned(), 280)));
    assert_eq!(h.refs(280), 1);
    assert!(h.alloc.core.ids.blocked().is_empty());
    assert_eq!(
        h.store.identities.len(),
        2,
        "db and the stray: {:?}",
        h.store.identities
    );
}

#[test]
fn a_foreign_binding_seen_by_the_stores_watch_is_taken_in_and_collected_if_unused() {
    let mut h = Harness::new(range_256_300());
    let (s1, _) = connected(&mut h, N1, 10);
    stray_web(&mut h);
    h.alloc.binding_found(id(280), &labels("app=web"));
    h.route();
    assert!(matches!(h.watch.last(), Some(WatchChange::Upsert(info)) if info.id == id(280)));
    assert_eq!(
        h.allocate(N1, s1, "app=web").ok().flatten(),
        Some(id(280)),
        "answered at once"
    );
    // A binding nobody uses goes the way of any unused identity.
    let mut h = Harness::new(range_256_300());
    stray_web(&mut h);
    h.alloc.binding_found(id(280), &labels("app=web"));
    h.route();
    for _ in 0..20 {
        h.advance(ms(1_000));
        h.settle_store();
    }
    assert_eq!(h.state(280), None, "deleted after the grace period");
    assert!(!h.store.identities.contains_key(&id(280)));
    assert!(
        h.store.deleted.contains_key(&id(280)),
        "deleted with its quarantine"
    );
    // A binding of labels the core has at another id, or of an id it binds to other
    // labels, is not taken (the store's index reports those as invalid).
    let mut h = Harness::new(range_256_300());
    let (s1, _) = connected(&mut h, N1, 10);
    let web = ok(h.allocate_now(N1, s1, "app=web"));
    h.alloc.binding_found(id(290), &labels("app=web"));
    h.alloc.binding_found(web, &labels("app=other"));
    h.route();
    assert_eq!(h.state(290), None);
    assert_eq!(
        h.alloc.identity(web).and_then(|i| i.labels),
        Some(labels("app=web"))
    );
}

// ---- the store's own watch ----

#[test]
fn a_binding_deleted_behind_our_back_is_recreated() {
    let mut h = Harness::new(small_config());
    let (s, c) = connected(&mut h, N1, 10);
    let x = ok(h.allocate_now(N1, s, "app=a"));
    ok(h.upsert(N1, c, 1, mk_endpoint("a", x.get(), "app=a")));
    // Someone deletes the object; the store's watch reports it.
    h.store.identities.remove(&x);
    h.alloc.binding_lost(x, &labels("app=a"), h.now);
    h.route();
    assert_eq!(h.state(x.get()), Some(IdentityState::Creating));
    h.settle_store();
    assert_eq!(h.store.identities.get(&x), Some(&labels("app=a")));
    assert_eq!(h.state(x.get()), Some(IdentityState::Live));
    assert_eq!(h.alloc.counters().bindings_recreated, 1);
    // A report about other labels, or while our own write is in flight, changes nothing.
    h.alloc.binding_lost(x, &labels("app=b"), h.now);
    h.route();
    assert!(h.pending().next().is_none());
}

#[test]
fn a_tombstone_deleted_by_someone_else_is_written_again_while_its_quarantine_lasts() {
    let cfg = small_config();
    let now = Timestamp::from_millis(1_000_000);
    let web = labels("app=web");
    let mut store = ModelStore::new(cfg.quarantine);
    let until = now.plus(ms(5_000)).as_millis();
    for (n, l) in [(300, &web), (301, &labels("app=db"))] {
        store.tombstones.insert(
            id(n),
            Tombstone {
                id: id(n),
                labels_hash: l.stable_hash(),
                until_ms: until,
            },
        );
    }
    let mut h = Harness::with_store(cfg, store, now);
    let tomb = |n: u32| h_tomb(&h, n);
    let (t300, t301) = (tomb(300), tomb(301));
    // `kubectl delete identities --all`: both go, the watch reports them.
    h.store.tombstones.clear();
    h.alloc.tombstone_lost(t300, Some(&web), h.now);
    // Labels that do not match the quarantine (or none) cannot be written back.
    h.alloc
        .tombstone_lost(t301, Some(&labels("app=other")), h.now);
    h.route();
    let ops: Vec<&StoreOp> = h.pending().collect();
    assert!(
        matches!(ops.as_slice(), [StoreOp::DeleteIdentity { id: i, labels: l, tombstone }]
            if *i == id(300) && *l == web && *tombstone == t300),
        "{ops:?}"
    );
    assert_eq!(h.alloc.counters().tombstones_recreated, 1);
    assert_eq!(h.alloc.counters().tombstones_unrecoverable, 1);
    // While the write is in flight, a second report, and the binding the store
    // creates on the way (seen by its watch), change nothing.
    h.alloc.tombstone_lost(t300, Some(&web), h.now);
    h.alloc.binding_found(id(300), &web);
    h.route();
    assert_eq!(h.pending().count(), 1);
    assert_eq!(h.state(300).map(|s| s.name()), Some("quarantined"));
    // A failure is retried at the next quarantine scan.
    h.fail_store();
    assert!(h.pending().next().is_none());
    h.advance(ms(1_100));
    assert_eq!(h.pending().count(), 1);
    h.settle_store();
    assert_eq!(h.store.tombstones.get(&id(300)), Some(&t300));
    // After a restart the quarantine is still there.
    let store = h.store.clone();
    let h = Harness::with_store(small_config(), store, h.now);
    assert_eq!(h.state(300).map(|s| s.name()), Some("quarantined"));
    // A report after the quarantine ended, or for an id no longer quarantined, is
    // nothing to write.
    let mut h = h;
    h.advance(ms(10_000));
    h.settle_store();
    h.alloc.tombstone_lost(t300, Some(&web), h.now);
    h.route();
    assert!(h.pending().next().is_none());
}

fn h_tomb(h: &Harness, n: u32) -> Tombstone {
    match h.alloc.core.ids.quarantine().get(&id(n)) {
        Some(t) => Tombstone {
            id: id(n),
            labels_hash: t.labels_hash,
            until_ms: t.until.as_millis(),
        },
        None => panic!("{n} is not quarantined"),
    }
}

#[test]
fn an_edited_object_blocks_its_id_and_moves_its_users() {
    let mut h = Harness::new(small_config());
    let (s, c) = connected(&mut h, N1, 10);
    let x = ok(h.allocate_now(N1, s, "app=a"));
    ok(h.upsert(N1, c, 1, mk_endpoint("a", x.get(), "app=a")));
    h.store.identities.insert(x, labels("app=evil"));
    h.alloc
        .binding_invalid(x, "labels edited to k8s:app=evil".into(), h.now);
    h.route();
    h.settle_store();
    assert_eq!(h.state(x.get()), Some(IdentityState::Blocked));
    let moved = h.alloc.lookup(&labels("app=a")).map(|i| (i.id, i.refs));
    assert!(matches!(moved, Some((y, 1)) if y != x), "{moved:?}");
    assert_eq!(h.rebinds().len(), 1);
    // An unknown id found invalid is blocked too, and never handed out.
    h.alloc
        .binding_invalid(id(900), "labels \"not a label\"".into(), h.now);
    h.route();
    assert_eq!(h.state(900), Some(IdentityState::Blocked));
    assert_eq!(h.alloc.counters().blocked, 2);
}

// ---- Watch ----

/// The Watch changes since the last call, for people: `upsert 256 live refs=0 holds=1`.
fn told(h: &mut Harness) -> Vec<String> {
    std::mem::take(&mut h.watch)
        .into_iter()
        .map(|change| match change {
            WatchChange::Upsert(i) => format!(
                "upsert {} {} refs={} holds={}",
                i.id,
                i.state.name(),
                i.refs,
                i.holds
            ),
            WatchChange::Removed { id, labels } => format!("removed {id} {labels}"),
        })
        .collect()
}

#[test]
fn watch_follows_an_identity_through_its_life_one_event_per_change() {
    let mut h = Harness::new(small_config());
    let (s, c) = connected(&mut h, N1, 10);
    let x = ok(h.allocate_now(N1, s, "app=a"));
    assert_eq!(
        told(&mut h),
        [format!("upsert {x} live refs=0 holds=1")],
        "shown once persisted, with the caller's hold"
    );
    assert_eq!(ok(h.allocate(N1, s, "app=a")), Some(x));
    assert_eq!(told(&mut h), Vec::<String>::new(), "the same hold again");

    let pods: Vec<Endpoint> = (0..110)
        .map(|i| mk_endpoint(&format!("pod-{i}"), x.get(), "app=a"))
        .collect();
    ok(h.snapshot(N1, c, 1, pods));
    assert_eq!(
        told(&mut h),
        [format!("upsert {x} live refs=110 holds=0")],
        "110 references and the hold's end: one event"
    );
    ok(h.snapshot(N1, c, 2, vec![]));
    assert_eq!(told(&mut h), [format!("upsert {x} live refs=0 holds=0")]);
    h.advance(ms(100));
    assert_eq!(
        told(&mut h),
        [format!("upsert {x} released refs=0 holds=0")]
    );
    h.advance(small_config().grace);
    assert_eq!(
        told(&mut h),
        [format!("upsert {x} deleting refs=0 holds=0")]
    );
    h.settle_store();
    assert_eq!(
        told(&mut h),
        [format!("removed {x} k8s:app=a")],
        "Removed: the id and its labels"
    );
}

#[test]
fn watch_coalesces_a_burst_per_identity_and_a_change_undone_costs_nothing() {
    let mut h = Harness::new(small_config());
    let (s, c) = connected(&mut h, N1, 10);
    let a = ok(h.allocate_now(N1, s, "app=a"));
    let b = ok(h.allocate_now(N1, s, "app=b"));
    told(&mut h);
    let pods = |first: &str, second: &str| -> Vec<Endpoint> {
        let mut pods: Vec<Endpoint> = (0..60)
            .map(|i| mk_endpoint(&format!("a-{i}"), a.get(), "app=a"))
            .chain((0..50).map(|i| mk_endpoint(&format!("b-{i}"), b.get(), "app=b")))
            .collect();
        pods.push(mk_endpoint("swing-1", a.get(), first));
        pods.push(mk_endpoint("swing-2", b.get(), second));
        pods
    };
    ok(h.snapshot(N1, c, 1, pods("app=a", "app=b")));
    assert_eq!(
        told(&mut h),
        [
            format!("upsert {a} live refs=61 holds=0"),
            format!("upsert {b} live refs=51 holds=0"),
        ]
    );
    // One pod moves from a to b and another from b to a: nothing to tell.
    let mut swapped = pods("app=a", "app=b");
    let n = swapped.len();
    swapped[n - 2] = mk_endpoint("swing-1", b.get(), "app=b");
    swapped[n - 1] = mk_endpoint("swing-2", a.get(), "app=a");
    ok(h.snapshot(N1, c, 2, swapped));
    assert_eq!(h.refs(a.get()), 61);
    assert_eq!(told(&mut h), Vec::<String>::new());
}

#[test]
fn the_restart_fence_is_shown_as_protected_and_counted() {
    let cfg = small_config();
    let mut h = Harness::new(cfg.clone());
    let (s, c) = connected(&mut h, N1, 10);
    let a = ok(h.allocate_now(N1, s, "app=a"));
    let b = ok(h.allocate_now(N1, s, "app=b"));
    ok(h.snapshot(N1, c, 1, vec![mk_endpoint("b", b.get(), "app=b")]));
    h.settle_store();
    let start = h.now.plus(ms(100));
    let mut h = Harness::with_store(cfg.clone(), h.store.clone(), start);
    let until = start.plus(cfg.node_ttl);
    for x in [a, b] {
        assert_eq!(
            h.alloc.identity(x).map(|i| i.state),
            Some(IdentityState::Protected { until }),
            "{x}: loaded, neither referenced nor held"
        );
    }
    let stats = h.alloc.stats();
    assert_eq!((stats.live, stats.protected), (0, 2), "{stats:?}");
    assert_eq!(
        told(&mut h),
        Vec::<String>::new(),
        "the load is the full list"
    );

    let (_, c) = connected(&mut h, N1, 10);
    ok(h.snapshot(N1, c, 1, vec![mk_endpoint("b", b.get(), "app=b")]));
    assert_eq!(told(&mut h), [format!("upsert {b} live refs=1 holds=0")]);
    let stats = h.alloc.stats();
    assert_eq!((stats.live, stats.protected), (1, 1), "{stats:?}");
    h.advance(cfg.node_ttl - ms(100));
    ok(h.snapshot(N1, c, 2, vec![mk_endpoint("b", b.get(), "app=b")]));
    assert_eq!(told(&mut h), Vec::<String>::new());
    // The fence ends: what it protected is released, and Watch is told.
    h.advance(ms(100));
    assert_eq!(
        told(&mut h),
        [format!("upsert {a} released refs=0 holds=0")]
    );
    assert_eq!(h.alloc.stats().protected, 0);
}

#[test]
fn a_quarantine_outlives_an_adoption_that_meets_a_foreign_binding() {
    let mut h = Harness::new(range_256_300());
    let (s, c) = connected(&mut h, N1, 10);
    let x = ok(h.allocate_now(N1, s, "app=web"));
    // Released, deleted and quarantined for app=web.
    for seq in 1..=8 {
        h.advance(ms(1_000));
        h.settle_store();
        ok(h.snapshot(N1, c, seq, vec![]));
    }
    assert!(h.store.tombstones.contains_key(&x));
    // Someone binds app=web at 280; before the watch reports it, an agent that kept
    // x claims it for app=web: its own labels may take it back, but the create meets
    // the stray and the endpoint moves to 280. Nothing was written at x.
    stray_web(&mut h);
    ok(h.snapshot(N1, c, 9, vec![mk_endpoint("web-0", x.get(), "app=web")]));
    h.settle_store();
    assert_eq!(h.rebinds().last(), Some(&("web-0".to_owned(), 280)));
    assert!(
        matches!(h.state(x.get()), Some(IdentityState::Quarantined { .. })),
        "x is still quarantined for app=web: {:?}",
        h.state(x.get())
    );
    // So a new label set does not get x inside the quarantine (the model store fails
    // the run if it did)...
    let other = ok(h.allocate_now(N1, s, "app=db"));
    assert_ne!(other, x);
    // ...and when the quarantine ends, its tombstone goes from the store too.
    for seq in 10..=22 {
        h.advance(ms(1_000));
        h.settle_store();
        ok(h.snapshot(
            N1,
            c,
            seq,
            vec![
                mk_endpoint("web-0", 280, "app=web"),
                mk_endpoint("db-0", other.get(), "app=db"),
            ],
        ));
    }
    assert_eq!(h.state(x.get()), None);
    assert!(
        !h.store.tombstones.contains_key(&x),
        "tombstones left: {:?}",
        h.store.tombstones
    );
}

#[test]
fn a_create_refused_for_labels_bound_at_an_id_it_cannot_take_leaves_nothing_behind() {
    let mut h = Harness::new(Config {
        range: match IdRange::new(256, 257) {
            Ok(r) => r,
            Err(e) => panic!("{e}"),
        },
        ..small_config()
    });
    let (s, c) = connected(&mut h, N1, 10);
    // app=web is created at 256 and app=db at 257, while someone binds app=web at
    // 257: web's create finds its labels bound at the id the core is creating db at,
    // so it cannot take it; db's create finds 257 bound to app=web, a binding census
    // did not write, which the core takes (never blocks) before db moves on.
    assert_eq!(h.allocate(N1, s, "app=web"), Ok(None));
    assert_eq!(h.allocate(N1, s, "app=db"), Ok(None));
    h.store.identities.insert(id(257), labels("app=web"));
    h.store.foreign.insert(id(257));
    h.settle_store();
    assert!(!h.alloc.core.ids.blocked().contains_key(&id(257)));
    assert!(h.alloc.core.ids.is_bound(id(257), &labels("app=web")));
    // Nothing was written at 256 and nothing waits for it: the id is free again for
    // db, not kept (and written again and again) for a label set the store binds
    // elsewhere.
    let answers: Vec<_> = h.replies.drain(..).map(|(_, r)| r).collect();
    assert!(
        matches!(answers[..], [Err(AllocError::StoreUnavailable { .. }), Ok(x)] if x == id(256)),
        "web refused, db rehomed to 256: {answers:?}"
    );
    h.alloc.binding_found(id(257), &labels("app=web"));
    h.route();
    for seq in 1..=10 {
        h.advance(ms(1_000));
        h.settle_store();
        ok(h.snapshot(N1, c, seq, vec![mk_endpoint("db-0", 256, "app=db")]));
    }
    assert_eq!(h.alloc.core.ids.id_of(&labels("app=web")), None);
    assert_eq!(h.store.identities.get(&id(256)), Some(&labels("app=db")));
    assert_eq!(h.refs(256), 1);
}

// ---- edges mutation testing found ----

fn snapshot_asks(h: &Harness, n: &str) -> usize {
    h.agent_msgs
        .iter()
        .filter(|(to, _, m)| *to == node(n) && matches!(m, AgentMsg::SnapshotNow))
        .count()
}

#[test]
fn an_identity_moved_inside_the_adoption_window_asks_only_its_users_to_snapshot_again() {
    let cfg = small_config();
    let mut h = Harness::with_store(
        cfg.clone(),
        ModelStore::new(cfg.quarantine),
        Timestamp::from_millis(5_000),
    );
    let (_, c1) = connected(&mut h, N1, 10);
    let (_, c2) = connected(&mut h, N2, 10);
    ok(h.snapshot(N1, c1, 1, vec![mk_endpoint("a", 400, "app=a")]));
    ok(h.snapshot(N2, c2, 1, vec![]));
    h.settle_store();
    // 400's object is edited: app=a needs another id, which the window withholds.
    h.store.identities.insert(id(400), labels("app=evil"));
    h.alloc
        .binding_invalid(id(400), "labels edited to k8s:app=evil".into(), h.now);
    h.route();
    assert_eq!(h.alloc.node(&node(N1)).map(|n| n.endpoints), Some(0));
    h.advance(cfg.adoption_window);
    assert_eq!(snapshot_asks(&h, N1), 1, "node-1 lost an endpoint");
    assert_eq!(snapshot_asks(&h, N2), 0, "node-2 lost nothing");
}

#[test]
fn an_identity_moved_with_the_range_full_after_the_window_asks_nobody_to_snapshot() {
    let mut h = Harness::new(Config {
        range: match IdRange::new(256, 256) {
            Ok(r) => r,
            Err(e) => panic!("{e}"),
        },
        ..small_config()
    });
    let (s, c1) = connected(&mut h, N1, 10);
    connected(&mut h, N2, 10);
    let x = ok(h.allocate_now(N1, s, "app=a"));
    ok(h.upsert(N1, c1, 1, mk_endpoint("a", x.get(), "app=a")));
    h.store.identities.insert(x, labels("app=evil"));
    h.alloc
        .binding_invalid(x, "labels edited to k8s:app=evil".into(), h.now);
    h.route();
    assert_eq!(h.alloc.node(&node(N1)).map(|n| n.endpoints), Some(0));
    h.advance(ms(100));
    assert_eq!(snapshot_asks(&h, N1) + snapshot_asks(&h, N2), 0);
}

#[test]
fn an_upsert_that_rebinds_or_cannot_resolve_says_so_and_counts_it() {
    let mut h = Harness::new(Config {
        range: match IdRange::new(256, 257) {
            Ok(r) => r,
            Err(e) => panic!("{e}"),
        },
        ..small_config()
    });
    let (s, c) = connected(&mut h, N1, 10);
    let x = ok(h.allocate_now(N1, s, "app=a"));
    // Claims x for other labels: a new id, and a Rebind.
    let applied = ok(h.upsert(N1, c, 1, mk_endpoint("b", x.get(), "app=b")));
    assert_eq!((applied.rebinds, applied.unresolved), (1, 0), "{applied:?}");
    assert_eq!(h.alloc.node(&node(N1)).map(|n| n.rebinds), Some(1));
    assert_eq!(h.alloc.counters().allocations_new, 2, "x, then b's id");
    // The range is full now: no id for a third label set.
    let applied = ok(h.upsert(N1, c, 2, mk_endpoint("c", x.get(), "app=c")));
    assert_eq!((applied.rebinds, applied.unresolved), (0, 1), "{applied:?}");
    assert_eq!(h.alloc.counters().unresolved, 1);
    assert_eq!(h.alloc.node(&node(N1)).map(|n| n.rebinds), Some(1));
}

#[test]
fn a_node_known_at_start_is_not_stale_until_its_agent_says_hello() {
    let cfg = Config {
        liveness: Liveness::Cluster {
            stale_view_limit: ms(60_000),
        },
        ..small_config()
    };
    let mut store = ModelStore::new(cfg.quarantine);
    store.nodes.insert(node(N1), ());
    let mut h = Harness::with_store(cfg, store, Timestamp::from_millis(1_000_000));
    h.advance(ms(4_000));
    assert_eq!(h.alloc.node(&node(N1)).map(|n| n.stale), Some(false));
    assert_eq!(h.alloc.stats().stale_nodes, 0);
    // Its Hello (no snapshot yet) makes it a node like any other: silent, stale.
    if let Err(e) = h.hello(N1, session(10)) {
        panic!("hello: {e}");
    }
    h.advance(ms(4_000));
    assert_eq!(h.alloc.node(&node(N1)).map(|n| n.stale), Some(true));
    assert_eq!(h.alloc.stats().stale_nodes, 1);
}

#[test]
fn blocking_a_quarantined_or_blocked_id_uses_it_once() {
    let cfg = small_config();
    let now = Timestamp::from_millis(1_000_000);
    let mut store = ModelStore::new(cfg.quarantine);
    store.tombstones.insert(
        id(300),
        Tombstone {
            id: id(300),
            labels_hash: labels("app=web").stable_hash(),
            until_ms: now.plus(ms(5_000)).as_millis(),
        },
    );
    let mut h = Harness::with_store(cfg, store, now);
    assert_eq!(h.alloc.stats().range_used, 1);
    for _ in 0..2 {
        h.alloc
            .binding_invalid(id(300), "labels \"not a label\"".into(), h.now);
        h.route();
        assert_eq!(h.state(300), Some(IdentityState::Blocked));
        assert_eq!(h.alloc.stats().range_used, 1);
    }
}
