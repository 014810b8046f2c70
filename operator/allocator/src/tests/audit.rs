//! The allocator-core audit of 2026-12: one test per finding, each failing on the core
//! as it was before its fix.

use super::*;

/// A range of two ids, so a freed id is the next one handed out.
fn two_ids() -> Config {
    Config {
        range: match IdRange::new(256, 257) {
            Ok(r) => r,
            Err(e) => panic!("{e}"),
        },
        ..small_config()
    }
}

/// Lets time pass until GC issues the delete of `x`, left unanswered in the queue.
fn until_delete_issued(h: &mut Harness, x: IdentityId) {
    for _ in 0..20 {
        h.advance(ms(500));
        if h.pending_gc
            .iter()
            .any(|op| matches!(op, StoreOp::DeleteIdentity { id, .. } if *id == x))
        {
            return;
        }
        h.settle_store();
    }
    panic!("no delete of {x} issued");
}

/// Answers the first queued op, after `before` changed the store behind census.
fn answer_first(h: &mut Harness, before: impl FnOnce(&mut ModelStore)) {
    let Some(op) = h.pop_pending() else {
        panic!("no op queued");
    };
    let result = h.store.apply(&op, h.now);
    before(&mut h.store);
    h.alloc.store_result(op, result, h.now);
    h.route();
}

// ---- 1: a re-create after a delete that meets a foreign binding ----

#[test]
fn a_quarantine_outlives_a_recreate_after_delete_that_meets_a_foreign_binding() {
    let mut h = Harness::new(Config {
        node_ttl: ms(600_000),
        ..two_ids()
    });
    let (s, _c) = connected(&mut h, N1, 10);
    let x = ok(h.allocate_now(N1, s, "app=web"));
    assert_eq!(x, id(256));
    until_delete_issued(&mut h, x);
    // app=web is wanted again while its delete is in flight: the call waits.
    assert_eq!(h.allocate(N1, s, "app=web"), Ok(None));
    // The delete succeeds (the store holds x's tombstone); meanwhile someone binds
    // app=web at 257, so the core's re-create of x is answered LabelsBound(257).
    answer_first(&mut h, |store| {
        store.identities.insert(id(257), labels("app=web"));
        store.foreign.insert(id(257));
    });
    assert!(h.store.tombstones.contains_key(&x));
    h.settle_store();
    assert_eq!(h.replies.last().map(|(_, r)| r.clone()), Some(Ok(id(257))));
    // x stays quarantined for app=web, as its tombstone in the store says...
    assert!(
        matches!(h.state(x.get()), Some(IdentityState::Quarantined { .. })),
        "x is still quarantined for app=web: {:?}",
        h.state(x.get())
    );
    // ...so other labels do not get it inside the quarantine (the model store fails
    // the test if they did).
    let db = h.allocate_now(N1, s, "app=db");
    assert!(
        matches!(db, Err(AllocError::RangeExhausted { .. })),
        "{db:?}"
    );
}

// ---- 2: a deposed leader's late write ----

#[test]
fn a_late_foreign_write_met_by_a_create_is_taken_not_blocked() {
    let mut h = Harness::new(range_256_259());
    let (s, _c) = connected(&mut h, N1, 10);
    // A deposed leader's late create bound 256 to app=web; before the store's watch
    // reports it, this core gives 256 to app=db.
    assert_eq!(h.allocate(N1, s, "app=db"), Ok(None));
    h.store.identities.insert(id(256), labels("app=web"));
    h.store.foreign.insert(id(256));
    h.store.others.insert(id(256));
    h.settle_store();
    // The store's binding is taken, not fought: 256 is app=web's, not blocked...
    assert!(
        !h.alloc.core.ids.blocked().contains_key(&id(256)),
        "256 is blocked: {:?}",
        h.alloc.core.ids.blocked()
    );
    assert!(h.alloc.core.ids.is_bound(id(256), &labels("app=web")));
    // ...app=db got another id...
    let db = h.replies.last().map(|(_, r)| r.clone());
    assert!(matches!(db, Some(Ok(x)) if x != id(256)), "{db:?}");
    // ...and app=web is allocated at the store's id, at once.
    assert_eq!(h.allocate(N1, s, "app=web"), Ok(Some(id(256))));
    // The watch's report of it changes nothing.
    h.alloc.binding_found(id(256), &labels("app=web"));
    h.route();
    assert!(h.alloc.core.ids.is_bound(id(256), &labels("app=web")));
}

fn range_256_259() -> Config {
    Config {
        range: match IdRange::new(256, 259) {
            Ok(r) => r,
            Err(e) => panic!("{e}"),
        },
        ..small_config()
    }
}
// ---- 3: labels bound where the core could not take them ----

#[test]
fn labels_bound_out_of_range_are_adopted_and_allocated() {
    let mut h = Harness::new(range_256_259());
    let (s, _c) = connected(&mut h, N1, 10);
    // A backup from a cluster with a wider range binds app=web at 5000.
    h.store.identities.insert(id(5000), labels("app=web"));
    h.store.foreign.insert(id(5000));
    for _ in 0..3 {
        let web = h.allocate_now(N1, s, "app=web");
        assert_eq!(
            web,
            Ok(id(5000)),
            "the store's binding is app=web's identity"
        );
    }
    // No id of the range was spent on it.
    assert_eq!(h.alloc.core.ids.used_in_range(), 0);
}

#[test]
fn labels_bound_at_a_blocked_id_are_adopted_and_allocated() {
    let mut h = Harness::new(range_256_259());
    let (s, _c) = connected(&mut h, N1, 10);
    // 258 held an invalid object, so the core blocked it; then someone replaced it
    // with a valid binding of app=api (the watch's report of it may come late).
    h.store
        .invalid
        .insert(id(258), "an invalid Identity object".to_owned());
    h.store.others.insert(id(258));
    h.alloc
        .binding_invalid(id(258), "an invalid Identity object".to_owned(), h.now);
    h.route();
    assert!(h.alloc.core.ids.blocked().contains_key(&id(258)));
    h.store.invalid.remove(&id(258));
    h.store.identities.insert(id(258), labels("app=api"));
    h.store.foreign.insert(id(258));
    let api = h.allocate_now(N1, s, "app=api");
    assert_eq!(
        api,
        Ok(id(258)),
        "the store's binding is app=api's identity"
    );
    assert!(!h.alloc.core.ids.blocked().contains_key(&id(258)));
    // The watch's late report changes nothing.
    h.alloc.binding_found(id(258), &labels("app=api"));
    h.route();
    assert_eq!(h.allocate_now(N1, s, "app=api"), Ok(id(258)));
}

// ---- 4: a Rebind waiter that outlives its endpoint ----

#[test]
fn a_create_no_one_waits_for_any_more_is_dropped_once_its_endpoint_leaves() {
    let mut h = Harness::new(Config {
        node_ttl: ms(600_000),
        quarantine: ms(600_000),
        ..range_256_259()
    });
    let (s, c) = connected(&mut h, N1, 10);
    // 256 is app=old's, deleted and quarantined for it.
    let old = ok(h.allocate_now(N1, s, "app=old"));
    assert_eq!(old, id(256));
    for _ in 0..10 {
        h.advance(ms(1_000));
        h.settle_store();
    }
    assert!(h.store.tombstones.contains_key(&old));
    // Someone binds app=web at 256 inside that quarantine, so the core cannot take it.
    h.store.identities.insert(old, labels("app=web"));
    h.store.foreign.insert(old);
    // An agent's pod claims 256 for app=web: not adoptable, so app=web gets 257 and
    // the endpoint waits for its Rebind; the create meets app=web bound at 256.
    ok(h.upsert(N1, c, 1, mk_endpoint("web-0", 256, "app=web")));
    h.settle_store();
    assert_eq!(h.state(257), Some(IdentityState::Creating));
    // The pod goes: nobody uses app=web any more.
    ok(h.delete(N1, c, 2, "web-0"));
    h.settle_store();
    h.emitted.clear();
    for _ in 0..150 {
        h.advance(ms(1_000));
        h.settle_store();
    }
    let writes = h
        .emitted
        .iter()
        .filter(|(op, _)| matches!(op, StoreOp::CreateIdentity { id: x, .. } if *x == id(257)))
        .count();
    assert!(
        writes <= 1,
        "{writes} creates of 257 in 150 s with nobody using it (state {:?})",
        h.state(257)
    );
    assert_eq!(h.state(257), None, "nothing kept for app=web");
}

// ---- 7: an Allocate that never answers ----

#[test]
fn every_allocate_is_answered_by_its_deadline_even_if_its_write_is_never_answered() {
    let mut h = Harness::new(patient());
    let (s, _c) = connected(&mut h, N1, 10);
    h.settle_store();
    let req = h.next_req;
    assert_eq!(h.allocate(N1, s, "app=web"), Ok(None));
    // The create's answer never reaches the core (lost between the store and it).
    let lost = h.pop_pending();
    assert!(
        matches!(lost, Some(StoreOp::CreateIdentity { .. })),
        "{lost:?}"
    );
    // A second call for the same labels waits on the same write.
    let second = h.next_req;
    assert_eq!(h.allocate(N1, s, "app=web"), Ok(None));
    for _ in 0..30 {
        h.advance(ms(1_000));
    }
    let answer = |r: RequestId| {
        h.replies
            .iter()
            .find(|(q, _)| *q == r)
            .map(|(_, a)| a.clone())
    };
    for r in [req, second] {
        assert!(
            matches!(answer(r), Some(Err(AllocError::StoreUnavailable { .. }))),
            "request {r}: {:?} after 30 s (pending: {:?})",
            answer(r),
            h.alloc.stats().pending_allocations
        );
    }
    assert_eq!(h.alloc.stats().pending_allocations, 0);
    // Its answer comes at last (the writer answers every op, if only with a timeout):
    // the labels are allocated.
    if let Some(op) = lost {
        let result = h.store.apply(&op, h.now);
        h.alloc.store_result(op, result, h.now);
        h.route();
    }
    let web = h.allocate_now(N1, s, "app=web");
    assert!(web.is_ok(), "{web:?}");
}

fn patient() -> Config {
    Config {
        node_ttl: ms(600_000),
        hold_timeout: ms(600_000),
        ..small_config()
    }
}

// ---- 6: a failed delete, then wanted again before its retry ----

/// The long model run of 2026-12-07 (after holds began to end at a settled
/// allocation) found it: a delete commits but is answered with an error; before its
/// retry the labels are wanted again, so the binding is written again; that create
/// writes nothing (the labels are bound elsewhere by then). The delete's tombstone
/// is in the store, so the quarantine must go on: the id is not free for other
/// labels, and the tombstone is cleaned up when it ends.
#[test]
fn a_failed_delete_wanted_again_before_its_retry_keeps_its_quarantine() {
    let mut h = Harness::new(Config {
        node_ttl: ms(600_000),
        ..two_ids()
    });
    let (s, _c) = connected(&mut h, N1, 10);
    h.settle_store();
    let x = ok(h.allocate_now(N1, s, "app=web"));
    until_delete_issued(&mut h, x);
    // The delete commits (tombstone and all) but is answered with an error: nothing
    // wants x then, so its delete waits for its retry.
    let Some(op) = h.pop_pending() else {
        panic!("no delete queued");
    };
    assert!(h.store.apply(&op, h.now).is_ok());
    let err = StoreError::Unavailable {
        cause: "timeout",
        detail: "no answer".into(),
    };
    h.alloc.store_result(op, Err(err), h.now);
    h.route();
    // Someone binds app=web at 257; then app=web is wanted again: the core writes x's
    // binding again, and the store answers LabelsBound(257).
    h.store.identities.insert(id(257), labels("app=web"));
    h.store.foreign.insert(id(257));
    assert_eq!(h.allocate(N1, s, "app=web"), Ok(None));
    h.settle_store();
    assert_eq!(h.replies.last().map(|(_, r)| r.clone()), Some(Ok(id(257))));
    assert!(
        matches!(h.state(x.get()), Some(IdentityState::Quarantined { .. })),
        "x is still quarantined for app=web: {:?}",
        h.state(x.get())
    );
    // Other labels do not get x inside the quarantine (the model store fails the
    // test if they did)...
    let db = h.allocate_now(N1, s, "app=db");
    assert!(
        matches!(db, Err(AllocError::RangeExhausted { .. })),
        "{db:?}"
    );
    // ...and once it ends, its tombstone leaves the store.
    for _ in 0..30 {
        h.advance(ms(1_000));
        h.settle_store();
    }
    assert!(
        !h.store.tombstones.contains_key(&x),
        "x's tombstone outlived its quarantine: {:?}",
        h.store.tombstones
    );
}

// ---- 5: the core path the long model run found ----

#[test]
fn a_delete_that_commits_but_fails_keeps_its_tombstone_when_the_watch_reports_the_binding_gone() {
    let mut h = Harness::new(Config {
        node_ttl: ms(600_000),
        ..two_ids()
    });
    let (s, _c) = connected(&mut h, N1, 10);
    h.settle_store();
    let x = ok(h.allocate_now(N1, s, "app=web"));
    until_delete_issued(&mut h, x);
    // The delete commits (tombstone and all) but is answered with an error.
    let Some(op) = h.pop_pending() else {
        panic!("no delete queued");
    };
    assert!(h.store.apply(&op, h.now).is_ok());
    let err = StoreError::Unavailable {
        cause: "timeout",
        detail: "no answer".into(),
    };
    h.alloc.store_result(op, Err(err), h.now);
    h.route();
    // The store's watch reports the binding gone: the core's own delete did that.
    h.alloc.binding_lost(x, &labels("app=web"), h.now);
    h.route();
    h.settle_store();
    assert!(
        h.store.tombstones.contains_key(&x) && !h.store.identities.contains_key(&x),
        "x is deleted and quarantined in the store: {:?} {:?}",
        h.store.identities,
        h.store.tombstones
    );
    // Someone deletes whatever is at x, and the operator restarts: x is still in
    // quarantine for app=web, so app=db does not get it (the model store fails the
    // test if it did).
    h.store.identities.remove(&x);
    let store = h.store.clone();
    let mut h = Harness::with_store(two_ids(), store, h.now.plus(ms(1_000)));
    h.advance(ms(4_000));
    let (s, _c) = connected(&mut h, N1, 20);
    h.settle_store();
    let db = h.allocate_now(N1, s, "app=db");
    assert_ne!(db, Ok(x), "x rebound inside its quarantine");
}

#[test]
fn a_stale_report_of_a_binding_census_deleted_since_is_not_taken() {
    let mut h = Harness::new(Config {
        node_ttl: ms(600_000),
        ..two_ids()
    });
    let (s, _c) = connected(&mut h, N1, 10);
    h.settle_store();
    let x = ok(h.allocate_now(N1, s, "app=web"));
    until_delete_issued(&mut h, x);
    h.settle_store();
    assert!(matches!(
        h.state(x.get()),
        Some(IdentityState::Quarantined { .. })
    ));
    // The store's watch reports the binding as found, late: census deleted it since.
    h.alloc.binding_found(x, &labels("app=web"));
    h.route();
    assert!(
        matches!(h.state(x.get()), Some(IdentityState::Quarantined { .. })),
        "a binding the store no longer holds was taken: {:?}",
        h.state(x.get())
    );
}

// ---- 6: suspected, proved or refuted ----

#[test]
fn after_a_restart_on_a_store_that_lost_some_bindings_new_ids_go_past_the_surviving_ones() {
    // The store kept 256 (app=web) and 258 (app=api) but lost 257 (app=db), which an
    // agent that has not reported yet still holds. The store is not empty, so there
    // is no adoption window.
    let cfg = Config {
        node_ttl: ms(600_000),
        ..range_256_259()
    };
    let mut store = ModelStore::new(cfg.quarantine);
    store.identities.insert(id(256), labels("app=web"));
    store.identities.insert(id(258), labels("app=api"));
    let mut h = Harness::with_store(cfg, store, Timestamp::from_millis(2_000_000));
    let (s, _c) = connected(&mut h, N1, 10);
    h.settle_store();
    let new = h.allocate_now(N1, s, "app=new");
    assert_eq!(
        new,
        Ok(id(259)),
        "a new id in a hole below the highest surviving id may be one an agent holds"
    );
}

#[test]
fn after_a_restart_on_a_store_that_lost_its_last_bindings_no_new_id_is_one_they_held() {
    // The store kept 256..=300 but lost 301 and 302, the last ids given before the
    // backup it was restored from: node-2's agent, which has not reported yet, still
    // holds them. Both nodes are known; node-1 reports first and asks for new labels.
    let cfg = Config {
        node_ttl: ms(600_000),
        ..small_config()
    };
    let mut store = ModelStore::new(cfg.quarantine);
    for n in 256..=300 {
        store
            .identities
            .insert(id(n), labels(&format!("app=kept-{n}")));
    }
    store.nodes.insert(node(N1), ());
    store.nodes.insert(node(N2), ());
    let mut h = Harness::with_store(cfg, store, Timestamp::from_millis(2_000_000));
    let (s1, c1) = connected(&mut h, N1, 10);
    ok(h.snapshot(N1, c1, 1, vec![mk_endpoint("a", 256, "app=kept-256")]));
    h.settle_store();
    // A tick while node-2 has not reported: the search stays at the top.
    h.advance(ms(100));
    assert!(h.alloc.core.ids.searching_from_top());
    for (labels, want) in [("app=new", 1023), ("app=new-2", 1022)] {
        let new = h.allocate_now(N1, s1, labels);
        assert_eq!(
            new,
            Ok(id(want)),
            "a new id from the top of the range, not one node-2's agent may hold"
        );
    }
    // node-2 reports what it holds: both taken back as they were.
    let (_s2, c2) = connected(&mut h, N2, 10);
    let held = vec![
        mk_endpoint("b", 301, "app=lost-301"),
        mk_endpoint("c", 302, "app=lost-302"),
    ];
    ok(h.snapshot(N2, c2, 1, held));
    h.settle_store();
    for (n, l) in [(301, "app=lost-301"), (302, "app=lost-302")] {
        assert_eq!(h.store.identities.get(&id(n)), Some(&labels(l)), "{n}");
    }
    // Every known node has reported: from the next tick, new ids follow the kept
    // ones again.
    h.advance(ms(100));
    assert!(!h.alloc.core.ids.searching_from_top());
    let next = h.allocate_now(N1, s1, "app=next");
    assert_eq!(next, Ok(id(303)));
}

/// The search from the top goes down one id at a time, skipping used ones, and wraps
/// from the first id of the range to the last, never leaving it.
#[test]
fn the_search_from_the_top_goes_down_and_wraps_within_the_range() {
    let range = match IdRange::new(256, 259) {
        Ok(r) => r,
        Err(e) => panic!("{e}"),
    };
    let mut ids = Identities::new(range);
    let bind = |ids: &mut Identities, n: u32| {
        ids.insert(id(n), labels(&format!("app=x-{n}")), Phase::Live);
    };
    bind(&mut ids, 258);
    ids.search_from_top();
    let mut given = Vec::new();
    for _ in 0..3 {
        let next = ids.free_id().map(IdentityId::get);
        given.push(next);
        if let Some(n) = next {
            bind(&mut ids, n);
        }
    }
    assert_eq!(given, [Some(259), Some(257), Some(256)]);
    // 258 is free again: the search wraps past 256 to the top and finds it.
    ids.remove(id(258));
    assert_eq!(ids.free_id(), Some(id(258)));
}

#[test]
fn a_node_whose_node_object_was_deleted_is_not_brought_back_by_its_agents_hello() {
    let mut h = Harness::new(Config {
        liveness: Liveness::Cluster {
            stale_view_limit: ms(3_600_000),
        },
        ..small_config()
    });
    let (_s, c) = connected(&mut h, N1, 10);
    ok(h.snapshot(N1, c, 1, vec![mk_endpoint("a", 300, "app=a")]));
    h.settle_store();
    h.alloc.node_gone(&node(N1), h.now);
    h.route();
    assert!(h.alloc.node(&node(N1)).is_none());
    // The agent, still running, reconnects: refused, the node stays gone...
    let again = h.hello(N1, session(10));
    assert!(
        matches!(again, Err(SyncError::NodeGone { .. })),
        "{again:?}: a deleted Node's agent made the node again"
    );
    assert!(h.alloc.node(&node(N1)).is_none());
    // ...until its Node object is back.
    h.alloc.set_node_addresses(&node(N1), Vec::new(), h.now);
    h.route();
    assert!(h.hello(N1, session(10)).is_ok());
    // What is remembered goes after the stale-view limit, or with the Node's return.
    h.alloc.node_gone(&node(N1), h.now);
    h.route();
    assert_eq!(h.alloc.core.gone.len(), 1);
    h.advance(ms(3_600_000));
    assert!(h.alloc.core.gone.is_empty());
    assert!(h.hello(N1, session(10)).is_ok());
}

/// A view re-adopted after its node was dropped may be stale: its first snapshot's
/// claims stand behind the claims made meanwhile (docs/design.md, "The endpoint
/// map").
#[test]
fn a_reported_view_readopted_after_a_drop_does_not_win_addresses_claimed_since() {
    let mut h = Harness::new(small_config());
    let (_s1, c1) = connected(&mut h, N1, 10);
    let mut ep = mk_endpoint("a", 300, "app=a");
    ok(h.snapshot(N1, c1, 1, vec![ep.clone()]));
    h.settle_store();
    // node-1 goes silent and is dropped; meanwhile node-2's pod takes the address.
    let (_s2, c2) = connected(&mut h, N2, 10);
    h.advance(ms(2_000));
    let mut b = mk_endpoint("b", 301, "app=b");
    b.ips = ep.ips.clone();
    ok(h.snapshot(N2, c2, 1, vec![b.clone()]));
    h.settle_store();
    for seq in 2..4 {
        h.advance(ms(1_000));
        ok(h.snapshot(N2, c2, seq, vec![b.clone()]));
        h.settle_store();
    }
    assert!(h.alloc.node(&node(N1)).is_none(), "node-1 dropped");
    // node-1's agent comes back with its stale view.
    let (_s1, c1) = connected(&mut h, N1, 10);
    ep.identity = id(300);
    ok(h.snapshot(N1, c1, 1, vec![ep.clone()]));
    h.settle_store();
    let ip = ep.ips[0];
    let winner = h
        .alloc
        .map_lookup(ip)
        .and_then(|l| l.claims.into_iter().find(|c| c.winner))
        .map(|c| c.identity);
    assert_eq!(winner, Some(id(301)), "the fresher claim keeps the address");
}
