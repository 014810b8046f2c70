//! GC's edges, to the millisecond and the unit: when a hold, a grace period, a
//! retry's backoff and a quarantine scan are due, how many deletes the budget and
//! the in-flight limit let through, what each counts, and which failed cleanups
//! are written again. Mutation testing found each of these edges movable with no
//! other test noticing.

use super::*;

/// A node that stays alive however long a test lets time pass.
fn patient() -> Config {
    Config {
        node_ttl: ms(600_000),
        ..small_config()
    }
}

/// Advances the clock to exactly `at`.
fn advance_to(h: &mut Harness, at: Timestamp) {
    assert!(at >= h.now, "{at} is in the past ({})", h.now);
    h.advance(at.since(h.now));
}

/// A millisecond before `at`.
fn before(at: Timestamp) -> Timestamp {
    Timestamp::from_millis(at.as_millis() - 1)
}

fn holds(h: &Harness) -> usize {
    h.alloc.nodes.get(&node(N1)).map_or(0, |n| n.holds.len())
}

fn hold_expiry(h: &Harness, id: IdentityId) -> Option<Timestamp> {
    h.alloc
        .nodes
        .get(&node(N1))?
        .holds
        .get(&id)
        .map(|hold| hold.expires)
}

/// `n` identities allocated on node-1 and released once their holds ended: the
/// ids, and when they were released.
fn released(h: &mut Harness, n: usize) -> (Vec<IdentityId>, Timestamp) {
    let (s, c) = connected(h, N1, 10);
    let ids: Vec<IdentityId> = (0..n)
        .map(|i| ok(h.allocate_now(N1, s, &format!("app=r{i}"))))
        .collect();
    h.advance(h.alloc.config().hold_timeout);
    ok(h.snapshot(N1, c, 1, vec![]));
    let since = ids.iter().map(|id| match h.state(id.get()) {
        Some(IdentityState::Released { since }) => since,
        other => panic!("{id} is {other:?}, not released"),
    });
    let since = since.max().unwrap_or(h.now);
    (ids, since)
}

fn deleted(h: &Harness) -> Vec<IdentityId> {
    h.deletes_issued.iter().map(|&(id, _, _)| id).collect()
}

fn pending_kinds(h: &Harness) -> Vec<&'static str> {
    h.pending().map(StoreOp::kind).collect()
}

#[test]
fn a_hold_ends_at_its_timeout_to_the_millisecond_and_each_is_counted() {
    let mut h = Harness::new(patient());
    let (s, _) = connected(&mut h, N1, 10);
    let a = ok(h.allocate_now(N1, s, "app=a"));
    let b = ok(h.allocate_now(N1, s, "app=b"));
    h.advance(ms(1_000));
    ok(h.allocate_now(N1, s, "app=c"));
    let Some(expires) = hold_expiry(&h, a) else {
        panic!("{a} is not held");
    };
    assert_eq!(hold_expiry(&h, b), Some(expires));
    advance_to(&mut h, before(expires));
    assert_eq!(holds(&h), 3, "a millisecond before the timeout");
    advance_to(&mut h, expires);
    assert_eq!(holds(&h), 1, "at the timeout, the two older holds end");
    assert_eq!(h.alloc.counters().holds_expired, 2);
}

#[test]
fn a_released_identity_is_deleted_when_its_grace_ends_not_a_tick_later() {
    let mut h = Harness::new(patient());
    let (ids, since) = released(&mut h, 1);
    assert_eq!(h.alloc.counters().released, 1);
    let due = since.plus(h.alloc.config().grace);
    advance_to(&mut h, before(due));
    assert_eq!(deleted(&h), [], "a millisecond before the grace ends");
    advance_to(&mut h, due);
    assert_eq!(deleted(&h), ids, "when the grace ends");
}

#[test]
fn the_delete_budget_refills_at_its_rate_after_the_burst() {
    let mut cfg = patient();
    cfg.gc_rate = 2.0;
    cfg.gc_burst = 5.0;
    let mut h = Harness::new(cfg);
    let (_, since) = released(&mut h, 10);
    let due = since.plus(h.alloc.config().grace);
    advance_to(&mut h, due);
    assert_eq!(deleted(&h).len(), 5, "the burst");
    h.settle_store();
    assert_eq!(deleted(&h).len(), 5, "completing deletes adds no budget");
    // Two deletes a second: one per half second, none in a quarter.
    h.advance(ms(250));
    assert_eq!(deleted(&h).len(), 5, "half a delete of budget");
    h.advance(ms(250));
    assert_eq!(deleted(&h).len(), 6, "one delete of budget");
    h.advance(ms(1_000));
    assert_eq!(deleted(&h).len(), 8, "two more in a second");
}

#[test]
fn deletes_in_flight_stop_at_their_limit() {
    let mut cfg = patient();
    cfg.max_inflight_deletes = 2;
    let mut h = Harness::new(cfg);
    let (_, since) = released(&mut h, 5);
    let due = since.plus(h.alloc.config().grace);
    advance_to(&mut h, due);
    assert_eq!(deleted(&h).len(), 2, "the in-flight limit");
    assert_eq!(h.alloc.stats().gc_inflight, 2);
    // Each answer lets the next one go.
    match h.pop_pending() {
        Some(op) => {
            let result = h.store.apply(&op, h.now);
            h.alloc.store_result(op, result, h.now);
            h.route();
        }
        None => panic!("no delete in flight"),
    }
    assert_eq!(deleted(&h).len(), 3);
    h.settle_store();
    assert_eq!(deleted(&h).len(), 5);
}

#[test]
fn a_failed_create_is_written_again_when_its_backoff_ends_not_before() {
    let mut h = Harness::new(patient());
    let (s, _) = connected(&mut h, N1, 10);
    h.settle_store();
    assert_eq!(ok(h.allocate(N1, s, "app=a")), None, "waits for the store");
    h.fail_store();
    let Some(&(due, _)) = h.alloc.core.gc.create_retries.first() else {
        panic!("no create retry queued");
    };
    advance_to(&mut h, before(due));
    assert_eq!(
        pending_kinds(&h),
        Vec::<&str>::new(),
        "before the backoff ends"
    );
    advance_to(&mut h, due);
    assert_eq!(pending_kinds(&h), ["create_identity"], "when it ends");
}

#[test]
fn a_failed_delete_is_issued_again_when_its_backoff_ends_not_before() {
    let mut h = Harness::new(patient());
    let (ids, since) = released(&mut h, 1);
    let due = since.plus(h.alloc.config().grace);
    advance_to(&mut h, due);
    assert_eq!(deleted(&h), ids);
    h.fail_store();
    let Some(&(due, _)) = h.alloc.core.gc.delete_retries.first() else {
        panic!("no delete retry queued");
    };
    advance_to(&mut h, before(due));
    assert_eq!(deleted(&h).len(), 1, "before the backoff ends");
    advance_to(&mut h, due);
    assert_eq!(deleted(&h), [ids[0], ids[0]], "when it ends");
}

#[test]
fn quarantine_ends_at_the_scan_due_and_a_failed_tombstone_delete_goes_again() {
    let mut h = Harness::new(patient());
    let (_, since) = released(&mut h, 1);
    let due = since.plus(h.alloc.config().grace);
    advance_to(&mut h, due);
    h.settle_store();
    let until = match h.alloc.list(None, 1, None, true).0.first().map(|i| i.state) {
        Some(IdentityState::Quarantined { until }) => until,
        other => panic!("not quarantined: {other:?}"),
    };
    // Scans run every second: not before one is due, exactly when it is.
    let next = h.alloc.core.gc.next_tomb_scan;
    advance_to(&mut h, before(next));
    assert_eq!(
        h.alloc.core.gc.next_tomb_scan, next,
        "a scan before it was due"
    );
    let mut scans = 0;
    while h.alloc.core.gc.next_tomb_scan < until {
        let next = h.alloc.core.gc.next_tomb_scan;
        advance_to(&mut h, next);
        assert_eq!(
            h.alloc.core.gc.next_tomb_scan,
            next.plus(ms(1_000)),
            "no scan when one was due"
        );
        scans += 1;
        assert!(scans < 100, "the scans never reach the quarantine's end");
    }
    assert_eq!(h.alloc.counters().quarantine_ended, 0);
    let scan = h.alloc.core.gc.next_tomb_scan;
    advance_to(&mut h, scan);
    assert_eq!(h.alloc.counters().quarantine_ended, 1);
    assert_eq!(pending_kinds(&h), ["delete_tombstone"]);
    // A failed tombstone delete goes again with the next scan.
    h.fail_store();
    let scan = h.alloc.core.gc.next_tomb_scan;
    advance_to(&mut h, scan);
    assert_eq!(pending_kinds(&h), ["delete_tombstone"], "retried");
    h.settle_store();
    assert!(h.store.tombstones.is_empty());
}

#[test]
fn a_dropped_nodes_failed_delete_goes_again_unless_the_node_is_back() {
    for back in [false, true] {
        let mut h = Harness::new(small_config());
        connected(&mut h, N1, 10);
        h.settle_store();
        assert!(h.store.nodes.contains_key(&node(N1)));
        // Silent past its TTL: dropped (embedded), and its record deleted.
        h.advance(h.alloc.config().node_ttl);
        assert!(h.alloc.node(&node(N1)).is_none(), "node dropped");
        assert_eq!(pending_kinds(&h), ["delete_node"]);
        h.fail_store();
        if back {
            connected(&mut h, N1, 20);
            h.settle_store();
        }
        let scan = h.alloc.core.gc.next_tomb_scan;
        advance_to(&mut h, scan);
        let want: &[&str] = if back { &[] } else { &["delete_node"] };
        assert_eq!(pending_kinds(&h), want, "node back: {back}");
        h.settle_store();
        assert_eq!(h.store.nodes.contains_key(&node(N1)), back);
    }
}

#[test]
fn failed_creates_and_deletes_back_off_doubling() {
    let mut h = Harness::new(patient());
    let (s, _) = connected(&mut h, N1, 10);
    h.settle_store();
    assert_eq!(ok(h.allocate(N1, s, "app=a")), None, "waits for the store");
    let mut waits = Vec::new();
    for _ in 0..3 {
        h.fail_store();
        let Some(&(due, _)) = h.alloc.core.gc.create_retries.first() else {
            panic!("no create retry queued");
        };
        waits.push(due.since(h.now));
        advance_to(&mut h, due);
    }
    assert_eq!(waits, [ms(500), ms(1_000), ms(2_000)], "creates");
    h.settle_store();

    let mut h = Harness::new(patient());
    let (_, since) = released(&mut h, 1);
    let due = since.plus(h.alloc.config().grace);
    advance_to(&mut h, due);
    let mut waits = Vec::new();
    for _ in 0..3 {
        h.fail_store();
        let Some(&(due, _)) = h.alloc.core.gc.delete_retries.first() else {
            panic!("no delete retry queued");
        };
        waits.push(due.since(h.now));
        advance_to(&mut h, due);
    }
    assert_eq!(waits, [ms(500), ms(1_000), ms(2_000)], "deletes");
}

#[test]
fn the_release_queue_gives_its_memory_back_after_a_burst() {
    let mut h = Harness::new(Config {
        max_holds_per_node: 1_000,
        ..patient()
    });
    let (ids, since) = released(&mut h, 500);
    assert!(h.alloc.core.gc.released.capacity() >= ids.len());
    let due = since.plus(h.alloc.config().grace);
    advance_to(&mut h, due);
    for _ in 0..40 {
        h.settle_store();
        h.advance(ms(250));
    }
    assert_eq!(deleted(&h).len(), ids.len());
    assert!(h.alloc.core.gc.released.is_empty());
    let capacity = h.alloc.core.gc.released.capacity();
    assert!(capacity <= 64, "the queue kept a capacity of {capacity}");
}

/// A core over a store whose id 300 is quarantined for app=web until `until`, its
/// tombstone then deleted by someone else and reported lost: the write that puts
/// it back is queued.
fn tombstone_rewrite(until: Duration) -> (Harness, Tombstone) {
    let cfg = patient();
    let now = Timestamp::from_millis(1_000_000);
    let web = labels("app=web");
    let tombstone = Tombstone {
        id: id(300),
        labels_hash: web.stable_hash(),
        until_ms: now.plus(until).as_millis(),
    };
    let mut store = ModelStore::new(cfg.quarantine);
    store.tombstones.insert(id(300), tombstone);
    let mut h = Harness::with_store(cfg, store, now);
    h.store.tombstones.clear();
    h.alloc.tombstone_lost(tombstone, Some(&web), h.now);
    h.route();
    assert_eq!(pending_kinds(&h), ["delete_identity"]);
    (h, tombstone)
}

#[test]
fn a_lost_tombstones_rewrite_that_meets_another_binding_is_counted_and_not_retried() {
    let (mut h, _) = tombstone_rewrite(ms(5_000));
    // Someone binds the id to other labels before the write lands: its own watch
    // reports that binding; the rewrite is a stale answer.
    h.store.identities.insert(id(300), labels("app=evil"));
    let stale = h.alloc.counters().stale_results;
    h.settle_store();
    assert_eq!(h.alloc.counters().stale_results, stale + 1);
    let scan = h.alloc.core.gc.next_tomb_scan;
    advance_to(&mut h, scan);
    assert_eq!(pending_kinds(&h), Vec::<&str>::new(), "not written again");
}

#[test]
fn a_failed_tombstone_rewrite_goes_again_while_its_quarantine_lasts_and_not_when_it_ends() {
    let (mut h, tombstone) = tombstone_rewrite(ms(5_000));
    let until = Timestamp::from_millis(tombstone.until_ms);
    h.fail_store();
    let mut scans = 0;
    while h.alloc.core.gc.next_tomb_scan < until {
        let scan = h.alloc.core.gc.next_tomb_scan;
        advance_to(&mut h, scan);
        assert_eq!(pending_kinds(&h), ["delete_identity"], "retried at {scan}");
        h.fail_store();
        scans += 1;
        assert!(scans < 100, "the scans never reach the quarantine's end");
    }
    assert_eq!(
        h.alloc.core.gc.next_tomb_scan, until,
        "a scan falls on the quarantine's end"
    );
    advance_to(&mut h, until);
    assert_eq!(
        pending_kinds(&h),
        ["delete_tombstone"],
        "at the quarantine's end, nothing to put back, its tombstone to delete"
    );
    assert_eq!(h.state(300), None, "the quarantine ended");
}

#[test]
fn a_failed_tombstone_delete_is_not_retried_once_the_id_is_bound_again() {
    let mut h = Harness::new(patient());
    let (ids, since) = released(&mut h, 1);
    let x = ids[0];
    let due = since.plus(h.alloc.config().grace);
    advance_to(&mut h, due);
    h.settle_store();
    let until = match h.state(x.get()) {
        Some(IdentityState::Quarantined { until }) => until,
        other => panic!("{x} is not quarantined: {other:?}"),
    };
    while !pending_kinds(&h).contains(&"delete_tombstone") {
        assert!(h.now <= until.plus(ms(2_000)), "the quarantine never ended");
        h.advance(ms(100));
    }
    h.fail_store();
    // An agent reports the id for other labels, which it may take now.
    let (_, c) = connected(&mut h, N1, 20);
    ok(h.snapshot(N1, c, 1, vec![mk_endpoint("b", x.get(), "app=b")]));
    assert_eq!(pending_kinds(&h), ["create_identity"]);
    h.settle_store();
    let scan = h.alloc.core.gc.next_tomb_scan;
    advance_to(&mut h, scan);
    assert_eq!(
        pending_kinds(&h),
        Vec::<&str>::new(),
        "the id is bound again"
    );
}

#[test]
fn a_delete_retry_left_from_an_earlier_failure_does_not_hurry_a_later_one() {
    let mut h = Harness::new(Config {
        grace: ms(1),
        retry_base: ms(4_000),
        retry_max: ms(8_000),
        ..patient()
    });
    let (ids, _) = released(&mut h, 1);
    let x = ids[0];
    h.advance(ms(1));
    assert_eq!(deleted(&h), [x]);
    h.fail_store();
    let Some(&(first, _)) = h.alloc.core.gc.delete_retries.first() else {
        panic!("no delete retry queued");
    };
    // Wanted again at once: the binding is asserted again, then dropped again, and
    // its delete fails again, with a backoff that ends after the first one's.
    let (s, c) = connected(&mut h, N1, 20);
    assert_eq!(ok(h.allocate(N1, s, "app=r0")), None, "waits for the store");
    h.settle_store();
    assert_eq!(h.state(x.get()), Some(IdentityState::Live));
    h.advance(h.alloc.config().hold_timeout);
    ok(h.snapshot(N1, c, 1, vec![]));
    h.advance(ms(1));
    assert_eq!(deleted(&h), [x, x]);
    h.fail_store();
    let second = h.alloc.core.gc.delete_retries.last().map(|&(at, _)| at);
    assert!(
        second.is_some_and(|s| s > first),
        "{second:?} after {first}"
    );
    advance_to(&mut h, first);
    assert_eq!(deleted(&h), [x, x], "the first backoff is not this one's");
    if let Some(second) = second {
        advance_to(&mut h, second);
    }
    assert_eq!(deleted(&h), [x, x, x], "when its own backoff ends");
}
