//! What the invariants and the model cannot see: counters, the configuration's
//! arithmetic, stream ids. Each test pins down a figure that mutation testing
//! showed no other test checks.

use super::*;

#[test]
fn defaults_scale_with_the_snapshot_interval() {
    let cfg = Config::with_snapshot_interval(ms(10_000));
    assert_eq!(cfg.snapshot_interval, ms(10_000));
    assert_eq!(cfg.node_ttl, ms(30_000));
    assert_eq!(cfg.hold_timeout, ms(30_000));
    assert_eq!(cfg.adoption_window, ms(30_000));
    assert_eq!(cfg.grace, Config::default().grace);
}

#[test]
fn retries_back_off_doubling_up_to_the_maximum() {
    let cfg = small_config();
    let waits: Vec<Duration> = (1..=5).map(|n| cfg.backoff(n)).collect();
    assert_eq!(waits, [ms(500), ms(1_000), ms(2_000), ms(4_000), ms(4_000)]);
}

#[test]
fn each_stream_has_its_own_number() {
    let mut h = Harness::new(small_config());
    let (_, c1) = connected(&mut h, N1, 10);
    let (_, c2) = connected(&mut h, "node-2", 10);
    assert!(c1.get() >= 1 && c2.get() == c1.get() + 1, "{c1:?} {c2:?}");
}

#[test]
fn bindings_taken_from_the_store_and_the_rebinds_they_cost_are_counted() {
    let mut cfg = small_config();
    cfg.range = IdRange::new(256, 300).unwrap_or_default();
    // Seen by the store's watch.
    let mut h = Harness::new(cfg.clone());
    h.store.identities.insert(id(280), labels("app=web"));
    h.alloc.binding_found(id(280), &labels("app=web"));
    h.route();
    assert_eq!(h.alloc.counters().bindings_taken, 1);
    // Met by a create, with an endpoint that used the id tried: moved with a Rebind.
    let mut h = Harness::new(cfg);
    let (_, c1) = connected(&mut h, N1, 10);
    h.store.identities.insert(id(280), labels("app=web"));
    h.store.foreign.insert(id(280));
    let applied = h.snapshot(N1, c1, 1, vec![mk_endpoint("web-0", 290, "app=web")]);
    assert!(applied.is_ok());
    let rebinds = h.alloc.counters().rebinds;
    h.settle_store();
    let c = h.alloc.counters();
    assert_eq!(c.bindings_taken, 1);
    assert_eq!(c.rebinds, rebinds + 1, "the endpoint moved to 280");
    assert_eq!(h.rebinds(), [("web-0".to_owned(), 280)]);
    let node = h.alloc.node(&node(N1)).map(|n| n.rebinds);
    assert_eq!(node, Some(1));
}

#[test]
fn a_rehomed_identity_moves_its_holds() {
    let mut h = Harness::new(small_config());
    let (s1, _) = connected(&mut h, N1, 10);
    let web = match h.allocate_now(N1, s1, "app=web") {
        Ok(id) => id,
        Err(e) => panic!("{e}"),
    };
    // Someone edits the object's labels.
    h.store.identities.remove(&web);
    let found = "labels k8s:app=edited".to_owned();
    h.store.invalid.insert(web, found.clone());
    h.alloc.binding_invalid(web, found, h.now);
    h.route();
    h.settle_store();
    let moved = h.alloc.lookup(&labels("app=web"));
    assert!(
        moved.as_ref().is_some_and(|i| i.id != web && i.holds == 1),
        "the hold moved with the labels: {moved:?}"
    );
}

#[test]
fn the_range_usage_ratio_is_used_over_size_and_zero_for_an_empty_range() {
    let stats = |range_size, range_used| Stats {
        range_size,
        range_used,
        ..Stats::default()
    };
    assert_eq!(stats(0, 0).range_usage_ratio(), 0.0);
    assert_eq!(stats(8, 2).range_usage_ratio(), 0.25);
    assert_eq!(stats(8, 8).range_usage_ratio(), 1.0);
}

#[test]
fn store_ops_and_errors_name_themselves_for_logs_and_metrics() {
    let web = labels("app=web");
    let tombstone = Tombstone {
        id: id(300),
        labels_hash: web.stable_hash(),
        until_ms: 1,
    };
    let kinds: Vec<&str> = [
        StoreOp::CreateIdentity {
            id: id(300),
            labels: web.clone(),
        },
        StoreOp::DeleteIdentity {
            id: id(300),
            labels: web,
            tombstone,
        },
        StoreOp::DeleteTombstone { id: id(300) },
        StoreOp::PutNode { node: node(N1) },
        StoreOp::DeleteNode { node: node(N1) },
    ]
    .iter()
    .map(StoreOp::kind)
    .collect();
    assert_eq!(
        kinds,
        [
            "create_identity",
            "delete_identity",
            "delete_tombstone",
            "put_node",
            "delete_node"
        ]
    );
    // Only an unavailable store may answer otherwise later.
    let unavailable = StoreError::Unavailable {
        cause: "io",
        detail: "disk full".to_owned(),
    };
    let conflict = StoreError::Conflict {
        id: id(300),
        expected: "app=web".to_owned(),
        found: "app=db".to_owned(),
    };
    assert!(unavailable.is_transient());
    assert!(!conflict.is_transient());
    assert_eq!(Timestamp::from_millis(1_500).to_string(), "1500ms");
}

#[test]
fn allocations_are_counted_known_or_new() {
    let mut h = Harness::new(small_config());
    let (s, _) = connected(&mut h, N1, 10);
    ok(h.allocate_now(N1, s, "app=a"));
    ok(h.allocate_now(N1, s, "app=a"));
    ok(h.allocate_now(N1, s, "app=a"));
    ok(h.allocate_now(N1, s, "app=b"));
    let c = h.alloc.counters();
    assert_eq!((c.allocations_new, c.allocations_known), (2, 2));
}

#[test]
fn store_answers_that_match_nothing_are_counted_stale_and_change_nothing() {
    let mut h = Harness::new(small_config());
    let (s, c) = connected(&mut h, N1, 10);
    let web = ok(h.allocate_now(N1, s, "app=web"));
    ok(h.upsert(N1, c, 1, mk_endpoint("web-0", web.get(), "app=web")));
    // One create waits for its answer.
    assert_eq!(ok(h.allocate(N1, s, "app=db")), None);
    let db = match h.alloc.lookup(&labels("app=db")) {
        Some(info) => info.id,
        None => panic!("app=db has no identity"),
    };
    let create = |n: IdentityId, l: &str| StoreOp::CreateIdentity {
        id: n,
        labels: labels(l),
    };
    let delete = |n: IdentityId, l: &str| StoreOp::DeleteIdentity {
        id: n,
        labels: labels(l),
        tombstone: Tombstone {
            id: n,
            labels_hash: labels(l).stable_hash(),
            until_ms: 1,
        },
    };
    let answers = [
        (
            create(id(900), "app=x"),
            "a create of an id the core does not know",
        ),
        (
            create(web, "app=web"),
            "a create of an identity live already",
        ),
        (
            create(db, "app=other"),
            "a create of other labels than the id's",
        ),
        (
            delete(id(900), "app=x"),
            "a delete of an id the core does not know",
        ),
        (
            delete(web, "app=web"),
            "a delete of an identity not being deleted",
        ),
    ];
    for (n, (op, what)) in answers.into_iter().enumerate() {
        let before = h.alloc.list(None, usize::MAX, None, true);
        h.alloc.store_result(op, Ok(()), h.now);
        h.route();
        assert_eq!(h.alloc.counters().stale_results, n as u64 + 1, "{what}");
        assert_eq!(h.alloc.list(None, usize::MAX, None, true), before, "{what}");
    }
    h.settle_store();
    assert!(matches!(h.state(db.get()), Some(IdentityState::Live)));
}
