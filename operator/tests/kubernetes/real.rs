//! The same scenarios against a real control plane (census-cluster: upstream etcd and
//! kube-apiserver), for what the fake cannot show (real admission and schema
//! validation of the CRD, real RBAC, real etcd timing). They run in every test run:
//! `cargo xtask test` starts the control plane; a plain `cargo test` starts one named
//! `cargo-test`, or uses the one `CENSUS_TEST_KUBECONFIG` names.
//!
//! Identity objects are cluster-scoped: each test owns ids of its own within
//! 60000-60999 and removes them before and after it runs.

use std::{ops::Range, sync::Arc, time::Duration};

use census_operator::{
    replica::Fence,
    store::{
        Store, StoreError, StoreEvent, StoreOp, Tombstone,
        kubernetes::{KubeStore, KubeStoreConfig},
    },
};
use k8s_openapi::api::core::v1::Namespace;
use kube::{
    Api, Client,
    api::{DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams},
};
use serde_json::json;

use crate::common::{TestResult, WAIT, fail, id, labels, now_ms};

/// Each test's ids: the store's, the GC's (500), the CRD rules' and the Events'.
const STORE_IDS: Range<u32> = 60_000..60_010;
const GC_IDS: Range<u32> = 60_100..60_600;
const CRD_IDS: Range<u32> = 60_700..60_710;
const EVENT_IDS: Range<u32> = 60_800..60_810;

/// A client of the real control plane as census-operator's ServiceAccount (a token
/// of it), with deploy/ applied: its RBAC, and the ValidatingAdmissionPolicy that lets
/// only that account change or delete Identity objects.
async fn real_client(retry: bool) -> TestResult<Client> {
    let plane = crate::in_cluster::applied().await?;
    let token = plane.token("census-system", "census-operator", None, None, 3600)?;
    let kubeconfig = plane.write_token_kubeconfig("real-census-operator", &token)?;
    census_testkit::cluster::kubeconfig_client(&kubeconfig, retry).await
}

/// A client as the administrator (`system:masters`), with deploy/ applied: what
/// someone other than census does.
async fn admin(retry: bool) -> TestResult<Client> {
    crate::in_cluster::applied().await?;
    census_testkit::cluster::admin_client(retry).await
}

/// What the shipped ValidatingAdmissionPolicy answers an administrator who changes
/// or deletes an Identity object.
fn refused_by_the_policy<T: std::fmt::Debug>(result: Result<T, kube::Error>) -> TestResult {
    match result {
        Err(kube::Error::Api(status))
            if status.code == 403 && status.message.contains("only census-operator") =>
        {
            Ok(())
        }
        other => fail(format!(
            "expected the admission policy's 403, got {other:?}"
        )),
    }
}

fn api(client: &Client) -> Api<DynamicObject> {
    Api::all_with(
        client.clone(),
        &kube::api::ApiResource::erase::<census_operator::store::kubernetes::crd::Identity>(&()),
    )
}

/// Removes the test's Identity objects (before and after a run).
async fn clean(client: &Client, ids: Range<u32>) -> TestResult {
    let api = api(client);
    for obj in api.list(&ListParams::default()).await?.items {
        let name = obj.metadata.name.clone().unwrap_or_default();
        if name.parse::<u32>().is_ok_and(|n| ids.contains(&n)) {
            let _ = api.delete(&name, &DeleteParams::default()).await;
        }
    }
    Ok(())
}

async fn store(fence: Arc<Fence>) -> TestResult<KubeStore> {
    let store = KubeStore::new(
        real_client(false).await?,
        real_client(true).await?,
        fence,
        KubeStoreConfig::default(),
    );
    tokio::time::timeout(WAIT, store.wait_synced())
        .await
        .map_err(|_| "the watch did not list the Identity objects (is the CRD installed?)")?;
    Ok(store)
}

#[tokio::test]
async fn real_store_writes_conditionally_and_watches_itself() -> TestResult {
    let client = real_client(true).await?;
    clean(&client, STORE_IDS).await?;
    let store = store(Arc::new(Fence::always_open())).await?;
    let mut events = store.events().ok_or("no events")?;
    let (web, db) = (labels("real-web"), labels("real-db"));
    let n = STORE_IDS.start;
    let results = store
        .apply(vec![StoreOp::CreateIdentity {
            id: id(n),
            labels: web.clone(),
        }])
        .await;
    assert_eq!(results, [Ok(())]);
    // An annotation added behind census's back: with deploy/'s admission policy no one
    // but census-operator may, and census-operator's own ServiceAccount may not patch
    // the object itself (only its status), so on a cluster with deploy/ the real 409
    // of a tombstone write cannot come from there (the fake's store tests cover it,
    // for a cluster without the policy).
    let admin_api = api(&admin(true).await?);
    let api = api(&client);
    refused_by_the_policy(
        admin_api
            .patch(
                &n.to_string(),
                &PatchParams::default(),
                &Patch::Merge(
                    json!({"metadata": {"annotations": {"test.census.dev/touched": "1"}}}),
                ),
            )
            .await,
    )?;
    let tomb = Tombstone {
        id: id(n),
        labels_hash: web.stable_hash(),
        until_ms: now_ms() + 60_000,
    };
    let results = store
        .apply(vec![StoreOp::DeleteIdentity {
            id: id(n),
            labels: web.clone(),
            tombstone: tomb,
        }])
        .await;
    assert_eq!(results, [Ok(())]);
    let obj = api.get(&n.to_string()).await?;
    assert_eq!(obj.data["status"]["state"], "Quarantined");
    assert_eq!(
        store
            .apply(vec![StoreOp::DeleteTombstone { id: id(n) }])
            .await,
        [Ok(())]
    );
    // Someone else's binding: the create is answered with it (named, for the core
    // to take).
    let other = DynamicObject::new(&(n + 1).to_string(), &census_operator_resource())
        .data(json!({"spec": {"labels": db.to_strings()}}));
    admin_api.create(&PostParams::default(), &other).await?;
    let conflict = store
        .apply(vec![StoreOp::CreateIdentity {
            id: id(n + 1),
            labels: web.clone(),
        }])
        .await;
    assert!(
        matches!(conflict[0], Err(StoreError::IdBound { .. })),
        "{conflict:?}"
    );
    // An edit of its labels is refused by the CRD's rules (the fake's tests edit
    // through a back door, as a CRD without its rules would allow), and a delete by
    // anyone but census by the admission policy: what is left is census's own account
    // deleting the object and someone creating it again with other labels, which the
    // watch reports as the binding lost, then another found.
    let edited = labels("real-edited");
    match admin_api
        .patch(
            &(n + 1).to_string(),
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"labels": edited.to_strings()}})),
        )
        .await
    {
        Err(kube::Error::Api(status))
            if status.code == 422 && status.message.contains("immutable") => {}
        other => return fail(format!("a labels edit: expected 422, got {other:?}")),
    }
    refused_by_the_policy(
        admin_api
            .delete(&(n + 1).to_string(), &DeleteParams::default())
            .await,
    )?;
    api.delete(&(n + 1).to_string(), &DeleteParams::default())
        .await?;
    let again = DynamicObject::new(&(n + 1).to_string(), &census_operator_resource())
        .data(json!({"spec": {"labels": edited.to_strings()}}));
    admin_api.create(&PostParams::default(), &again).await?;
    let (mut lost, mut found) = (false, false);
    while !(lost && found) {
        match tokio::time::timeout(WAIT, events.recv()).await? {
            Some(StoreEvent::BindingLost { id: i, labels }) if i == id(n + 1) => {
                assert_eq!(labels, db);
                lost = true;
            }
            Some(StoreEvent::BindingFound { id: i, labels }) if i == id(n + 1) && lost => {
                assert_eq!(labels, edited);
                found = true;
            }
            Some(StoreEvent::BindingInvalid { id: i, found }) => {
                return fail(format!("{i} reported invalid ({found}): it was re-created"));
            }
            Some(_) => {}
            None => return fail("the store's events ended"),
        }
    }
    clean(&client, STORE_IDS).await
}

fn census_operator_resource() -> kube::api::ApiResource {
    kube::api::ApiResource::erase::<census_operator::store::kubernetes::crd::Identity>(&())
}

#[tokio::test]
async fn real_gc_of_500_identities() -> TestResult {
    let client = real_client(true).await?;
    clean(&client, GC_IDS).await?;
    let store = store(Arc::new(Fence::always_open())).await?;
    let create: Vec<StoreOp> = GC_IDS
        .map(|n| StoreOp::CreateIdentity {
            id: id(n),
            labels: labels(&format!("real-gc-{n}")),
        })
        .collect();
    assert!(store.apply(create).await.iter().all(Result::is_ok));
    let delete: Vec<StoreOp> = GC_IDS
        .map(|n| {
            let labels = labels(&format!("real-gc-{n}"));
            StoreOp::DeleteIdentity {
                id: id(n),
                tombstone: Tombstone {
                    id: id(n),
                    labels_hash: labels.stable_hash(),
                    until_ms: now_ms(),
                },
                labels,
            }
        })
        .collect();
    assert!(store.apply(delete).await.iter().all(Result::is_ok));
    let forget: Vec<StoreOp> = GC_IDS
        .map(|n| StoreOp::DeleteTombstone { id: id(n) })
        .collect();
    assert!(store.apply(forget).await.iter().all(Result::is_ok));
    let left = api(&client)
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|o| {
            o.metadata
                .name
                .as_deref()
                .and_then(|n| n.parse::<u32>().ok())
                .is_some_and(|n| GC_IDS.contains(&n))
        })
        .count();
    assert_eq!(left, 0);
    Ok(())
}

#[tokio::test]
async fn real_leader_election_hands_over() -> TestResult {
    use census_operator::k8s::lease::{Elector, LeaseConfig, Outcome};
    let client = admin(false).await?;
    let namespace = format!("census-test-{:06x}", rand::random::<u32>() & 0xff_ffff);
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": namespace}}))?,
        )
        .await?;
    let cfg = |identity: &str| LeaseConfig {
        namespace: namespace.clone(),
        name: "census-operator".into(),
        identity: identity.into(),
        address: Some(format!("{identity}:9460")),
        duration: Duration::from_secs(4),
        renew_deadline: Duration::from_secs(3),
        retry_period: Duration::from_millis(500),
    };
    let mut a = Elector::new(client.clone(), cfg("a"));
    let mut b = Elector::new(client.clone(), cfg("b"));
    let outcome = async {
        assert!(matches!(
            a.try_acquire_or_renew().await?,
            Outcome::Leading { .. }
        ));
        assert!(matches!(
            b.try_acquire_or_renew().await?,
            Outcome::Following(Some(_))
        ));
        // `a` stops renewing (as if killed): `b` takes over after the lease duration.
        let started = std::time::Instant::now();
        loop {
            if let Outcome::Leading { previous } = b.try_acquire_or_renew().await? {
                assert_eq!(previous.as_deref(), Some("a"));
                break;
            }
            if started.elapsed() > Duration::from_secs(10) {
                return fail("b did not take over");
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        assert!(started.elapsed() >= Duration::from_secs(3));
        assert!(matches!(
            a.try_acquire_or_renew().await?,
            Outcome::Following(Some(_))
        ));
        b.release().await?;
        assert!(matches!(
            a.try_acquire_or_renew().await?,
            Outcome::Leading { .. }
        ));
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    }
    .await;
    let _ = namespaces
        .delete(&namespace, &DeleteParams::default())
        .await;
    outcome
}

/// The API server accepts the shipped CRD, whose CEL rules it checks against its cost
/// budget when the CRD is created or updated (a rule over an unbounded list is
/// refused there: the fake does not estimate costs), and refuses what the rules
/// refuse, with the same field errors as the fake.
#[tokio::test]
async fn real_crd_rules_are_within_the_cost_budget_and_refuse_bad_objects() -> TestResult {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;

    let client = real_client(true).await?;
    let admin = admin(true).await?;
    let crds: Api<CustomResourceDefinition> = Api::all(admin.clone());
    let shipped = census_operator::store::kubernetes::crd::crd_yaml()?;
    let crd: CustomResourceDefinition = serde_yaml_ng::from_str(&shipped)?;
    // Server-side apply: a CRD whose rules exceed the budget is refused here.
    crds.patch(
        "identities.census.dev",
        &PatchParams::apply("census-test").force(),
        &Patch::Apply(&crd),
    )
    .await?;
    clean(&client, CRD_IDS).await?;
    let api = api(&admin);
    let refused = |name: &str, labels: serde_json::Value| {
        let obj: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "census.dev/v1", "kind": "Identity",
            "metadata": {"name": name}, "spec": {"labels": labels},
        }))
        .unwrap_or_else(|_| {
            DynamicObject::new(
                name,
                &kube::api::ApiResource::erase::<census_operator::store::kubernetes::crd::Identity>(
                    &(),
                ),
            )
        });
        let api = api.clone();
        async move { api.create(&PostParams::default(), &obj).await }
    };
    for (name, labels, needle) in [
        (
            "web",
            json!(["k8s:app=web"]),
            "metadata.name must be the numeric id",
        ),
        ("200", json!(["k8s:app=web"]), "1-255 are reserved"),
        (
            &*CRD_IDS.start.to_string(),
            json!(["k8s:a=1", "k8s:a=1"]),
            "Duplicate value",
        ),
        (&*CRD_IDS.start.to_string(), json!([]), "spec.labels"),
    ] {
        match refused(name, labels).await {
            Err(kube::Error::Api(status))
                if status.code == 422 && status.message.contains(needle) => {}
            other => {
                return fail(format!(
                    "{name}: expected 422 naming {needle:?}, got {other:?}"
                ));
            }
        }
    }
    let created = refused(&CRD_IDS.start.to_string(), json!(["k8s:app=web"])).await?;
    let edited = api
        .patch(
            &CRD_IDS.start.to_string(),
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"labels": ["k8s:app=db"]}})),
        )
        .await;
    match edited {
        Err(kube::Error::Api(status))
            if status.code == 422 && status.message.contains("immutable") => {}
        other => {
            return fail(format!(
                "an edit of the labels: expected 422, got {other:?}"
            ));
        }
    }
    drop(created);
    clean(&client, CRD_IDS).await
}

/// A second object binding a label set another already binds is invalid: the store
/// reports it, and the Warning Event it writes about the cluster-scoped object, in
/// `default` as census-operator's ServiceAccount (deploy/'s Role there), is accepted.
#[tokio::test]
async fn real_events_about_invalid_objects_are_accepted_in_default() -> TestResult {
    use census_operator::store::kubernetes::EventsConfig;
    let client = real_client(true).await?;
    clean(&client, EVENT_IDS).await?;
    let store = KubeStore::new(
        real_client(false).await?,
        client.clone(),
        Arc::new(Fence::always_open()),
        KubeStoreConfig {
            events: Some(EventsConfig {
                instance: "real-events".into(),
            }),
            ..KubeStoreConfig::default()
        },
    );
    tokio::time::timeout(WAIT, store.wait_synced()).await?;
    let mut events = store.events().ok_or("no events")?;
    let admin_api = api(&admin(true).await?);
    let dup = labels("real-duplicate");
    let (first, second) = (EVENT_IDS.start, EVENT_IDS.start + 1);
    for n in [first, second] {
        let obj = DynamicObject::new(&n.to_string(), &census_operator_resource())
            .data(json!({"spec": {"labels": dup.to_strings()}}));
        admin_api.create(&PostParams::default(), &obj).await?;
        tokio::time::sleep(Duration::from_millis(1100)).await;
    }
    loop {
        match tokio::time::timeout(WAIT, events.recv()).await? {
            Some(StoreEvent::BindingInvalid { id: i, .. }) if i == id(second) => break,
            Some(StoreEvent::BindingInvalid { id: i, found }) => {
                return fail(format!("{i} reported invalid ({found}), not {second}"));
            }
            Some(_) => {}
            None => return fail("the store's events ended"),
        }
    }
    let plane = census_testkit::cluster::plane()?;
    let name = second.to_string();
    let event = crate::common::eventually("the Warning Event in default", WAIT, || async {
        let list = plane.kubectl_json(&["-n", "default", "get", "events.events.k8s.io"])?;
        Ok(list["items"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|e| e["regarding"]["name"] == name.as_str())
            .cloned())
    })
    .await?;
    assert_eq!(event["type"], "Warning", "{event}");
    assert_eq!(event["regarding"]["kind"], "Identity", "{event}");
    assert!(
        event["note"].as_str().is_some_and(|n| n.contains(&name)),
        "{event}"
    );
    clean(&client, EVENT_IDS).await
}
