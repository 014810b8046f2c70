//! The Identity store against the fake API server: paginated load, conditional writes
//! and the re-read on 409, bounded failure causes, the watch's events and its resets.

use std::{sync::Arc, time::Duration};

use census_fake_apiserver::{DownMode, Failure, RequestFilter, TOUCH_ANNOTATION, Verb};
use census_operator::{
    replica::Fence,
    store::{
        Store, StoreError, StoreEvent, StoreOp, Tombstone,
        kubernetes::{EventsConfig, KubeStoreConfig, crd::Identity},
    },
};
use census_proto::labels::LabelSet;
use kube::api::{DeleteParams, Patch, PatchParams};
use prometheus_client::registry::Registry;
use serde_json::json;

use crate::common::{
    TestResult, WAIT, binding, client, eventually, fail, fake, id, identities, labels, now_ms,
    object, store, synced, tombstone,
};

fn tomb_of(n: u32, app: &str) -> Tombstone {
    Tombstone {
        id: id(n),
        labels_hash: labels(app).stable_hash(),
        until_ms: now_ms() + 600_000,
    }
}

async fn next_event(
    events: &mut tokio::sync::mpsc::Receiver<StoreEvent>,
) -> TestResult<StoreEvent> {
    tokio::time::timeout(WAIT, events.recv())
        .await
        .map_err(|_| "no store event")?
        .ok_or_else(|| "the store's events ended".into())
}

#[tokio::test]
async fn load_lists_every_page_and_malformed_objects_are_reported_not_fatal() -> TestResult {
    let server = fake().await?;
    let bindings: Vec<_> = (1000..2100)
        .map(|n| binding(n, &labels(&format!("a{n}"))))
        .collect();
    server.insert_many(bindings)?;
    let until = now_ms() + 600_000;
    server.insert_many((3000..3050).map(|n| tombstone(n, &labels(&format!("t{n}")), until)))?;
    let mut bad_labels = binding(5000, &labels("x"));
    bad_labels["spec"]["labels"] = json!(["k8s:-bad=x"]);
    let mut not_a_list = binding(5001, &labels("x"));
    not_a_list["spec"]["labels"] = json!("oops");
    let mut bad_tomb = tombstone(5002, &labels("y"), until);
    bad_tomb["status"]["tombstone"]["labelsHash"] = json!("nothex");
    let mut bad_name = binding(1, &labels("z"));
    bad_name["metadata"]["name"] = json!("web");
    // Two objects claim one label set: the older keeps it.
    let mut younger = binding(6000, &labels("dup"));
    younger["metadata"]["creationTimestamp"] = json!("2026-01-02T00:00:00Z");
    let mut older = binding(6001, &labels("dup"));
    older["metadata"]["creationTimestamp"] = json!("2026-01-01T00:00:00Z");
    server.insert_many([bad_labels, not_a_list, bad_tomb, bad_name, younger, older])?;

    let store = store(
        &server,
        Arc::new(Fence::always_open()),
        KubeStoreConfig::default(),
    )?;
    let mut events = store.events().ok_or("no events")?;
    synced(&store).await?;
    let loaded = store.load().await?;
    assert_eq!(loaded.identities.len(), 1100 + 1);
    assert_eq!(loaded.tombstones.len(), 50);
    assert!(loaded.nodes.is_empty(), "nodes are not stored");
    assert!(loaded.identities.iter().any(|s| s.id == id(6001)));
    for n in [5000, 5001, 5002, 6000] {
        assert!(
            loaded.identities.iter().all(|s| s.id != id(n)),
            "{n} loaded"
        );
    }
    // The load asked etcd for pages and followed the continue tokens; the watch
    // listed once from the watch cache (resourceVersion 0, no limit).
    let lists = server.requests().lists_of("identities");
    let load_pages = lists
        .iter()
        .filter(|r| r.param("limit") == Some("500"))
        .count();
    assert!(load_pages >= 3, "{load_pages} list pages of the load");
    assert!(
        lists
            .iter()
            .any(|r| r.param("resourceVersion") == Some("0") && r.param("limit").is_none()),
        "the watch did not list from the watch cache"
    );

    let mut invalid: Vec<u32> = store
        .invalid_objects()
        .into_iter()
        .map(|(i, _)| i.get())
        .collect();
    invalid.sort_unstable();
    assert_eq!(invalid, [5000, 5001, 5002, 6000]);
    let mut reported = Vec::new();
    for _ in 0..4 {
        match next_event(&mut events).await? {
            StoreEvent::BindingInvalid { id, found } => reported.push((id.get(), found)),
            other => return fail(format!("unexpected {other:?}")),
        }
    }
    reported.sort();
    assert!(
        reported[0].1.contains("spec.labels[0]"),
        "{:?}",
        reported[0]
    );
    assert!(reported[1].1.contains("spec:"), "{:?}", reported[1]);
    assert!(reported[2].1.contains("labelsHash"), "{:?}", reported[2]);
    assert!(reported[3].1.contains("identity 6001"), "{:?}", reported[3]);

    let mut registry = Registry::default();
    registry.register_collector(store.collector());
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry)?;
    assert!(text.contains("census_invalid_identity_objects 5"), "{text}");

    // The watch goes on after the malformed objects.
    server.insert(binding(7000, &labels("later")))?;
    let reads = store.read_model();
    eventually("the watch sees a later object", WAIT, || async {
        Ok(reads.identity(id(7000)))
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn a_conflict_is_reread_and_retried_when_only_an_annotation_changed() -> TestResult {
    let server = fake().await?;
    let web = labels("web");
    server.insert(binding(300, &web))?;
    let store = store(
        &server,
        Arc::new(Fence::always_open()),
        KubeStoreConfig::default(),
    )?;
    synced(&store).await?;
    let gvr = identities();

    // Someone annotates the object right before census's tombstone write: its
    // resourceVersion precondition really is stale.
    server.faults().touch_before_write(
        RequestFilter::object(&gvr, None, "300").verb(Verb::Patch),
        1,
    );
    let op = StoreOp::DeleteIdentity {
        id: id(300),
        labels: web.clone(),
        tombstone: tomb_of(300, "web"),
    };
    assert_eq!(store.apply(vec![op]).await, [Ok(())]);
    let obj = object(&server, 300).ok_or("300 is gone")?;
    assert_eq!(obj["status"]["state"], "Quarantined");
    assert_eq!(
        obj["status"]["tombstone"]["labelsHash"],
        format!("{:016x}", web.stable_hash())
    );
    assert!(obj["metadata"]["annotations"][TOUCH_ANNOTATION].is_string());
    let log = server.requests();
    let writes: Vec<(Verb, u16, bool)> = log
        .iter()
        .filter(|r| r.resource == "identities" && r.name.as_deref() == Some("300"))
        .map(|r| (r.verb, r.code, r.injected))
        .collect();
    assert_eq!(
        writes,
        [
            (Verb::Patch, 409, false),
            (Verb::Get, 200, false),
            (Verb::Patch, 200, false)
        ],
        "a real precondition failure, a re-read, a retry"
    );

    // The same for the delete of the tombstone: uid and resourceVersion preconditions.
    server.clear_requests();
    server.faults().touch_before_write(
        RequestFilter::object(&gvr, None, "300").verb(Verb::Delete),
        1,
    );
    assert_eq!(
        store
            .apply(vec![StoreOp::DeleteTombstone { id: id(300) }])
            .await,
        [Ok(())]
    );
    assert!(object(&server, 300).is_none());
    let verbs: Vec<(Verb, u16)> = server
        .requests()
        .iter()
        .filter(|r| r.resource == "identities" && r.name.is_some())
        .map(|r| (r.verb, r.code))
        .collect();
    assert_eq!(
        verbs,
        [(Verb::Delete, 409), (Verb::Get, 200), (Verb::Delete, 200)]
    );

    // Each 409 is counted by the op it delayed, although both ops succeeded.
    let mut registry = Registry::default();
    registry.register_collector(store.collector());
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry)?;
    for line in [
        "census_kubernetes_conflicts_total{op=\"tombstone\"} 1",
        "census_kubernetes_conflicts_total{op=\"delete_tombstone\"} 1",
        "census_kubernetes_conflicts_total{op=\"create\"} 0",
    ] {
        assert!(text.contains(line), "no {line:?} in:\n{text}");
    }

    // 404 on a delete is success.
    assert_eq!(
        store
            .apply(vec![StoreOp::DeleteTombstone { id: id(300) }])
            .await,
        [Ok(())]
    );
    Ok(())
}

#[tokio::test]
async fn create_is_idempotent_and_refuses_only_other_labels() -> TestResult {
    let server = fake().await?;
    let (web, db, api, cache, queue) = (
        labels("web"),
        labels("db"),
        labels("api"),
        labels("cache"),
        labels("queue"),
    );
    server.insert(binding(400, &web))?;
    server.insert(binding(401, &db))?;
    server.insert(tombstone(402, &cache, now_ms() + 600_000))?;
    server.insert(tombstone(403, &db, now_ms() - 1))?;
    // The store's first list comes late, so it writes knowing nothing: every answer
    // below comes from the API (409 AlreadyExists and a re-read).
    let slow = server.faults().delay(
        RequestFilter::resource("identities").verbs([Verb::List, Verb::Watch]),
        Duration::from_secs(3),
    );
    let store = store(
        &server,
        Arc::new(Fence::always_open()),
        KubeStoreConfig::default(),
    )?;
    let create = |n: u32, labels: &LabelSet| StoreOp::CreateIdentity {
        id: id(n),
        labels: labels.clone(),
    };
    let ops = vec![
        create(400, &web),
        create(401, &api),
        create(402, &cache),
        create(403, &queue),
    ];
    let results = store.apply(ops).await;
    server.faults().remove(slow);
    assert_eq!(results[0], Ok(()), "same labels: success");
    match &results[1] {
        Err(StoreError::IdBound { bound, .. }) => {
            assert_eq!(bound, &db);
        }
        other => return fail(format!("401 bound to other labels: {other:?}")),
    }
    assert_eq!(
        results[2],
        Ok(()),
        "a tombstone of the same labels is revived"
    );
    assert_eq!(
        results[3],
        Ok(()),
        "an expired tombstone of other labels is replaced"
    );
    // Labels the store binds to another id (the re-reads above showed web bound to
    // 400 and db to 401): refused with that id, nothing written. (The ops of one
    // batch may run concurrently, so these come in a batch of their own.)
    let results = store.apply(vec![create(404, &db), create(405, &web)]).await;
    for (k, bound) in [(0, 401), (1, 400)] {
        match &results[k] {
            Err(StoreError::LabelsBound { bound: b, .. }) if *b == id(bound) => {}
            other => {
                return fail(format!(
                    "labels bound to {bound} already: {other:?} (op {k})"
                ));
            }
        }
    }
    let revived = object(&server, 402).ok_or("402 is gone")?;
    assert!(revived["status"].is_null(), "{revived}");
    let replaced = object(&server, 403).ok_or("403 is gone")?;
    assert_eq!(replaced["spec"]["labels"], json!(queue.to_strings()));
    assert!(replaced["status"].is_null());
    assert!(object(&server, 404).is_none(), "no second object for db");
    assert!(object(&server, 405).is_none(), "no second object for web");
    Ok(())
}

#[tokio::test]
async fn a_binding_census_did_not_write_is_reported_and_a_create_of_its_labels_refused()
-> TestResult {
    // The scenario at the store: the core never loaded 280 -> web (it appears
    // after the first list: a backup restored, `kubectl apply`).
    let server = fake().await?;
    let store = store(
        &server,
        Arc::new(Fence::always_open()),
        KubeStoreConfig::default(),
    )?;
    let mut events = store.events().ok_or("no events")?;
    synced(&store).await?;
    let web = labels("web");
    server.insert(binding(280, &web))?;
    match next_event(&mut events).await? {
        StoreEvent::BindingFound { id: found, labels } if found == id(280) && labels == web => {}
        other => return fail(format!("expected BindingFound for 280: {other:?}")),
    }
    let results = store
        .apply(vec![StoreOp::CreateIdentity {
            id: id(256),
            labels: web.clone(),
        }])
        .await;
    match &results[..] {
        [Err(StoreError::LabelsBound { bound, .. })] if *bound == id(280) => {}
        other => return fail(format!("expected LabelsBound(280): {other:?}")),
    }
    assert!(object(&server, 256).is_none(), "no object written");
    Ok(())
}

#[tokio::test]
async fn failures_are_retryable_with_bounded_causes() -> TestResult {
    let server = fake().await?;
    let fence = Arc::new(Fence::always_open());
    let cfg = KubeStoreConfig {
        request_timeout: Duration::from_millis(500),
        ..KubeStoreConfig::default()
    };
    let store = store(&server, fence.clone(), cfg)?;
    synced(&store).await?;
    let create = |n| StoreOp::CreateIdentity {
        id: id(n),
        labels: labels(&format!("f{n}")),
    };
    let cause = |r: &Result<(), StoreError>| match r {
        Err(e @ StoreError::Unavailable { .. }) => e.cause(),
        _ => "none",
    };
    let writes = RequestFilter::resource("identities").verb(Verb::Create);
    server
        .faults()
        .fail_next(writes.clone(), 1, Failure::InternalError);
    assert_eq!(
        cause(&store.apply(vec![create(500)]).await[0]),
        "server_error"
    );
    server.clear_requests();
    server.faults().fail_next(
        writes.clone(),
        1,
        Failure::TooManyRequests {
            retry_after_secs: 30,
        },
    );
    assert_eq!(cause(&store.apply(vec![create(501)]).await[0]), "throttled");
    assert_eq!(
        server.requests().writes_of("identities").len(),
        1,
        "kube's own retries are off for writes: the core's backoff governs"
    );
    let slow = server
        .faults()
        .delay(writes.clone(), Duration::from_secs(2));
    assert_eq!(cause(&store.apply(vec![create(502)]).await[0]), "timeout");
    server.faults().remove(slow);
    server.faults().go_down(DownMode::Refuse);
    assert_eq!(cause(&store.apply(vec![create(503)]).await[0]), "transport");
    server.faults().come_up();
    fence.close();
    server.clear_requests();
    assert_eq!(
        cause(&store.apply(vec![create(504)]).await[0]),
        "not_leader"
    );
    assert!(
        server.requests().writes_of("identities").is_empty(),
        "a closed fence sends nothing"
    );
    Ok(())
}

#[tokio::test]
async fn foreign_deletes_and_edits_become_events_and_a_kubernetes_event() -> TestResult {
    let server = fake().await?;
    let (web, db) = (labels("web"), labels("db"));
    server.insert(binding(500, &web))?;
    server.insert(binding(501, &db))?;
    let cfg = KubeStoreConfig {
        events: Some(EventsConfig {
            instance: "op-test".into(),
        }),
        ..KubeStoreConfig::default()
    };
    let store = store(&server, Arc::new(Fence::always_open()), cfg)?;
    let mut events = store.events().ok_or("no events")?;
    synced(&store).await?;
    let gvr = identities();
    server.modify(&gvr, None, "500", |obj| {
        obj["spec"]["labels"] = json!(labels("edited").to_strings());
    })?;
    match next_event(&mut events).await? {
        StoreEvent::BindingInvalid { id: i, found } => {
            assert_eq!(i, id(500));
            assert!(found.contains("edited"), "{found}");
        }
        other => return fail(format!("expected BindingInvalid, got {other:?}")),
    }
    server.delete(&gvr, None, "501");
    assert_eq!(
        next_event(&mut events).await?,
        StoreEvent::BindingLost {
            id: id(501),
            labels: db
        }
    );
    let event_gvr = census_fake_apiserver::Gvr::new("events.k8s.io", "v1", "events");
    let event = eventually("a Kubernetes Event about 500", WAIT, || async {
        Ok(server
            .list(&event_gvr)
            .into_iter()
            .find(|e| e["regarding"]["name"] == "500"))
    })
    .await?;
    assert_eq!(event["reason"], "InvalidIdentityObject");
    // The objects are cluster-scoped: their Events are accepted only in `default`.
    assert_eq!(event["metadata"]["namespace"], "default");
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["regarding"]["kind"], "Identity");
    assert!(
        event["note"]
            .as_str()
            .is_some_and(|n| n.contains("blocks id 500"))
    );
    Ok(())
}

#[tokio::test]
async fn a_watch_restart_forgets_what_disappeared_during_the_gap() -> TestResult {
    let server = fake().await?;
    let (web, db) = (labels("web"), labels("db"));
    server.insert(binding(600, &web))?;
    server.insert(binding(601, &db))?;
    let store = store(
        &server,
        Arc::new(Fence::always_open()),
        KubeStoreConfig::default(),
    )?;
    let mut events = store.events().ok_or("no events")?;
    synced(&store).await?;
    let reads = store.read_model();
    let mut changes = reads.subscribe();
    server.faults().go_down(DownMode::Refuse);
    server.delete(&identities(), None, "601");
    server.faults().compact();
    server.faults().come_up();
    // The watch resumes from a compacted version, gets 410, lists again: one reset.
    assert_eq!(
        next_event(&mut events).await?,
        StoreEvent::BindingLost {
            id: id(601),
            labels: db.clone()
        }
    );
    assert!(reads.identity(id(601)).is_none());
    assert!(reads.lookup(&web).is_some());
    let change = tokio::time::timeout(WAIT, changes.recv()).await??;
    assert_eq!(
        change,
        census_operator::allocator::WatchChange::Removed {
            id: id(601),
            labels: db
        }
    );
    Ok(())
}

#[tokio::test]
async fn the_read_model_answers_reads() -> TestResult {
    let server = fake().await?;
    let (web, db) = (labels("web"), labels("db"));
    let until = now_ms() + 60_000;
    server.insert(binding(700, &web))?;
    server.insert(tombstone(701, &db, until))?;
    let mut bad = binding(702, &labels("x"));
    bad["spec"]["labels"] = json!(["nope"]);
    server.insert(bad)?;
    let store = store(
        &server,
        Arc::new(Fence::always_open()),
        KubeStoreConfig::default(),
    )?;
    synced(&store).await?;
    let reads = store.read_model();
    use census_operator::allocator::IdentityState;
    let info = reads.lookup(&web).ok_or("no lookup")?;
    assert_eq!((info.id, info.state), (id(700), IdentityState::Live));
    assert_eq!(
        reads.identity(id(701)).map(|i| i.state),
        Some(IdentityState::Quarantined {
            until: census_operator::allocator::Timestamp::from_millis(until)
        })
    );
    assert_eq!(
        reads.identity(id(702)).map(|i| i.state),
        Some(IdentityState::Blocked)
    );
    let (page, more) = reads.list(None, 2, None, true);
    assert_eq!(
        page.iter().map(|i| i.id.get()).collect::<Vec<_>>(),
        [700, 701]
    );
    assert!(more);
    let (page, more) = reads.list(None, 10, None, false);
    assert_eq!(page.len(), 1);
    assert!(!more);
    let bindings: Vec<_> = reads
        .bindings()
        .into_iter()
        .map(|i| (i.id, i.labels))
        .collect();
    assert_eq!(bindings, [(id(700), Some(web))]);
    Ok(())
}

fn cause_of(r: &Result<(), StoreError>) -> &'static str {
    match r {
        Ok(()) => "ok",
        Err(e @ StoreError::Unavailable { .. }) => e.cause(),
        Err(_) => "other",
    }
}

#[tokio::test]
async fn an_object_being_deleted_is_waited_for_neither_reused_nor_looped_on() -> TestResult {
    let server = fake().await?;
    let (web, old) = (labels("web"), labels("old"));
    // Someone else's finalizer on a binding and on an expired tombstone.
    let mut held = binding(500, &web);
    held["metadata"]["finalizers"] = json!(["example.com/hold"]);
    server.insert(held)?;
    let mut tomb = tombstone(501, &old, now_ms() - 1_000);
    tomb["metadata"]["finalizers"] = json!(["example.com/hold"]);
    server.insert(tomb)?;
    let store = store(
        &server,
        Arc::new(Fence::always_open()),
        KubeStoreConfig::default(),
    )?;
    let mut events = store.events().ok_or("no events")?;
    synced(&store).await?;
    let api: kube::Api<Identity> = kube::Api::all(client(&server, true)?);

    // `kubectl delete identity 500`: it stays, being deleted; the binding is lost.
    let answer = api.delete("500", &DeleteParams::default()).await?;
    assert!(
        answer
            .left()
            .is_some_and(|o| o.metadata.deletion_timestamp.is_some()),
        "a finalizer holds it: 200 with the object"
    );
    assert_eq!(
        next_event(&mut events).await?,
        StoreEvent::BindingLost {
            id: id(500),
            labels: web.clone()
        }
    );

    // Writing the binding again (as the core does for a lost one), or tombstoning it,
    // waits until it is gone: one fresh read each, no write, a retryable cause.
    server.clear_requests();
    let ops = vec![
        StoreOp::CreateIdentity {
            id: id(500),
            labels: web.clone(),
        },
        StoreOp::DeleteIdentity {
            id: id(500),
            labels: web.clone(),
            tombstone: tomb_of(500, "web"),
        },
    ];
    let results = store.apply(ops.clone()).await;
    assert_eq!(
        results.iter().map(cause_of).collect::<Vec<_>>(),
        ["terminating", "terminating"]
    );
    assert!(
        server.requests().writes_of("identities").is_empty(),
        "nothing is written over an object being deleted"
    );
    assert_eq!(server.requests().of(Verb::Get, "identities").len(), 2);

    // A DELETE answered 200 with the object is not a deleted object: the expired
    // tombstone stays (another finalizer), and so does its quarantine in the core.
    server.clear_requests();
    let forget = || vec![StoreOp::DeleteTombstone { id: id(501) }];
    assert_eq!(cause_of(&store.apply(forget()).await[0]), "terminating");
    assert!(object(&server, 501).is_some_and(|o| o["metadata"]["deletionTimestamp"].is_string()));
    // Bound to other labels in the meantime: no AlreadyExists / re-read loop either.
    let rebind = StoreOp::CreateIdentity {
        id: id(501),
        labels: labels("new"),
    };
    assert_eq!(
        cause_of(&store.apply(vec![rebind.clone()]).await[0]),
        "terminating"
    );
    let named: Vec<(Verb, u16)> = server
        .requests()
        .iter()
        .filter(|r| r.resource == "identities" && r.name.is_some())
        .map(|r| (r.verb, r.code))
        .collect();
    assert_eq!(
        named,
        [(Verb::Delete, 200), (Verb::Get, 200)],
        "the delete, then one fresh read before giving up"
    );

    // The finalizers are removed: the objects go, and the ops succeed.
    let clear = json!({"metadata": {"finalizers": null}});
    for name in ["500", "501"] {
        api.patch(name, &PatchParams::default(), &Patch::Merge(&clear))
            .await?;
    }
    eventually("the ops succeed once the objects are gone", WAIT, || {
        let store = &store;
        let ops = vec![ops[0].clone(), rebind.clone()];
        async move {
            let results = store.apply(ops).await;
            Ok(results.iter().all(Result::is_ok).then_some(()))
        }
    })
    .await?;
    let obj = object(&server, 500).ok_or("500 is not there")?;
    assert!(obj["metadata"]["deletionTimestamp"].is_null());
    assert_eq!(obj["spec"]["labels"], json!(web.to_strings()));
    let obj = object(&server, 501).ok_or("501 is not there")?;
    assert_eq!(obj["spec"]["labels"], json!(labels("new").to_strings()));
    Ok(())
}

#[tokio::test]
async fn one_deadline_covers_an_op_and_the_reread_after_a_conflict() -> TestResult {
    let server = fake().await?;
    let web = labels("web");
    server.insert(binding(600, &web))?;
    let cfg = KubeStoreConfig {
        request_timeout: Duration::from_millis(500),
        ..KubeStoreConfig::default()
    };
    let store = store(&server, Arc::new(Fence::always_open()), cfg)?;
    synced(&store).await?;
    // The tombstone write conflicts, and the re-read is slower than the op's timeout.
    server.faults().conflict_next(
        RequestFilter::object(&identities(), None, "600").verb(Verb::Patch),
        1,
    );
    server.faults().delay(
        RequestFilter::object(&identities(), None, "600").verb(Verb::Get),
        Duration::from_secs(3),
    );
    let op = StoreOp::DeleteIdentity {
        id: id(600),
        labels: web,
        tombstone: tomb_of(600, "web"),
    };
    assert_eq!(cause_of(&store.apply(vec![op]).await[0]), "timeout");
    Ok(())
}
