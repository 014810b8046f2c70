//! The same scenarios against a real cluster, for what the fake cannot show (real
//! admission and schema validation of the CRD, real RBAC, real etcd timing):
//!
//! ```sh
//! kubectl apply -f deploy/crds/identity.yaml
//! CENSUS_TEST_KUBECONFIG=~/.kube/config \
//!   cargo test -p census-operator --test kubernetes real:: -- --ignored --test-threads 1
//! ```
//!
//! They create and delete Identity objects with ids 60000-60999 and a namespace
//! `census-test-*` (removed at the end): use a test cluster.

use std::{sync::Arc, time::Duration};

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
    config::{KubeConfigOptions, Kubeconfig},
};
use serde_json::json;

use crate::common::{TestResult, WAIT, fail, id, labels, now_ms};

const FIRST: u32 = 60_000;

async fn real_client(retry: bool) -> TestResult<Client> {
    let path = std::env::var("CENSUS_TEST_KUBECONFIG")
        .map_err(|_| "set CENSUS_TEST_KUBECONFIG to a test cluster's kubeconfig")?;
    let kubeconfig = Kubeconfig::read_from(path)?;
    let mut config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    config.default_retry = retry;
    Ok(Client::try_from(config)?)
}

fn api(client: &Client) -> Api<DynamicObject> {
    Api::all_with(
        client.clone(),
        &kube::api::ApiResource::erase::<census_operator::store::kubernetes::crd::Identity>(&()),
    )
}

/// Removes the test's Identity objects (before and after a run).
async fn clean(client: &Client) -> TestResult {
    let api = api(client);
    for obj in api.list(&ListParams::default()).await?.items {
        let name = obj.metadata.name.clone().unwrap_or_default();
        if name
            .parse::<u32>()
            .is_ok_and(|n| (FIRST..FIRST + 1000).contains(&n))
        {
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
#[ignore = "needs a real cluster: CENSUS_TEST_KUBECONFIG"]
async fn real_store_writes_conditionally_and_watches_itself() -> TestResult {
    let client = real_client(true).await?;
    clean(&client).await?;
    let store = store(Arc::new(Fence::always_open())).await?;
    let mut events = store.events().ok_or("no events")?;
    let (web, db) = (labels("real-web"), labels("real-db"));
    let n = FIRST;
    let results = store
        .apply(vec![StoreOp::CreateIdentity {
            id: id(n),
            labels: web.clone(),
        }])
        .await;
    assert_eq!(results, [Ok(())]);
    // An annotation added behind census's back: the tombstone write meets a real 409,
    // re-reads and retries.
    let api = api(&client);
    api.patch(
        &n.to_string(),
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"annotations": {"test.census.dev/touched": "1"}}})),
    )
    .await?;
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
    // Someone else's binding (named, for the core to take), then an edit: blocked, reported.
    let other = DynamicObject::new(&(n + 1).to_string(), &census_operator_resource())
        .data(json!({"spec": {"labels": db.to_strings()}}));
    api.create(&PostParams::default(), &other).await?;
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
    api.patch(
        &(n + 1).to_string(),
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"labels": labels("real-edited").to_strings()}})),
    )
    .await?;
    // Events come in order: the conflict's re-read saw the foreign binding (nothing to
    // report), the edit is the first invalid object.
    let event = loop {
        match tokio::time::timeout(WAIT, events.recv()).await? {
            Some(StoreEvent::BindingInvalid { id: i, found }) => {
                break StoreEvent::BindingInvalid { id: i, found };
            }
            Some(_) => {}
            None => return fail("the store's events ended"),
        }
    };
    match event {
        StoreEvent::BindingInvalid { id: i, .. } if i == id(n + 1) => {}
        other => {
            return fail(format!(
                "expected BindingInvalid for {}, got {other:?}",
                n + 1
            ));
        }
    }
    clean(&client).await
}

fn census_operator_resource() -> kube::api::ApiResource {
    kube::api::ApiResource::erase::<census_operator::store::kubernetes::crd::Identity>(&())
}

#[tokio::test]
#[ignore = "needs a real cluster: CENSUS_TEST_KUBECONFIG"]
async fn real_gc_of_500_identities() -> TestResult {
    let client = real_client(true).await?;
    clean(&client).await?;
    let store = store(Arc::new(Fence::always_open())).await?;
    let create: Vec<StoreOp> = (FIRST..FIRST + 500)
        .map(|n| StoreOp::CreateIdentity {
            id: id(n),
            labels: labels(&format!("real-gc-{n}")),
        })
        .collect();
    assert!(store.apply(create).await.iter().all(Result::is_ok));
    let delete: Vec<StoreOp> = (FIRST..FIRST + 500)
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
    let forget: Vec<StoreOp> = (FIRST..FIRST + 500)
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
                .is_some_and(|n| (FIRST..FIRST + 500).contains(&n))
        })
        .count();
    assert_eq!(left, 0);
    Ok(())
}

#[tokio::test]
#[ignore = "needs a real cluster: CENSUS_TEST_KUBECONFIG"]
async fn real_leader_election_hands_over() -> TestResult {
    use census_operator::k8s::lease::{Elector, LeaseConfig, Outcome};
    let client = real_client(false).await?;
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
#[ignore = "needs a real cluster: CENSUS_TEST_KUBECONFIG"]
async fn real_crd_rules_are_within_the_cost_budget_and_refuse_bad_objects() -> TestResult {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;

    let client = real_client(true).await?;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let shipped = census_operator::store::kubernetes::crd::crd_yaml()?;
    let crd: CustomResourceDefinition = serde_yaml_ng::from_str(&shipped)?;
    // Server-side apply: a CRD whose rules exceed the budget is refused here.
    crds.patch(
        "identities.census.dev",
        &PatchParams::apply("census-test").force(),
        &Patch::Apply(&crd),
    )
    .await?;
    clean(&client).await?;
    let api = api(&client);
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
            &*FIRST.to_string(),
            json!(["k8s:a=1", "k8s:a=1"]),
            "Duplicate value",
        ),
        (&*FIRST.to_string(), json!([]), "spec.labels"),
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
    let created = refused(&FIRST.to_string(), json!(["k8s:app=web"])).await?;
    let edited = api
        .patch(
            &FIRST.to_string(),
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
    clean(&client).await
}
