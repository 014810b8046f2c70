//! Fault injection does what it says.

use std::time::{Duration, Instant};

use census_fake_apiserver::{DownMode, Failure, Gvr, RequestFilter, TOUCH_ANNOTATION, Verb};
use futures::StreamExt;
use k8s_openapi::api::{
    coordination::v1::{Lease, LeaseSpec},
    core::v1::ConfigMap,
};
use kube::{
    Api, ResourceExt,
    api::{DeleteParams, PostParams, Preconditions, WatchEvent, WatchParams},
};

use crate::common::{TestResult, WAIT, api_code, config_map, next, start};

fn lease(name: &str) -> Lease {
    Lease {
        metadata: kube::api::ObjectMeta {
            name: Some(name.to_owned()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some("a".into()),
            ..LeaseSpec::default()
        }),
    }
}

#[tokio::test]
async fn conflict_next_answers_409_without_writing() -> TestResult {
    let (server, client) = start().await?;
    let leases: Api<Lease> = Api::namespaced(client, "default");
    let created = leases
        .create(&PostParams::default(), &lease("leader"))
        .await?;
    server.faults().conflict_next(
        RequestFilter::of::<Lease>()
            .name("leader")
            .verb(Verb::Update),
        1,
    );
    let res = leases
        .replace("leader", &PostParams::default(), &created)
        .await;
    assert_eq!(api_code(&res), Some((409, "Conflict".into())));
    let mut renewed = created.clone();
    renewed
        .spec
        .get_or_insert_with(LeaseSpec::default)
        .holder_identity = Some("b".into());
    leases
        .replace("leader", &PostParams::default(), &renewed)
        .await?;

    let updates = server.requests().of(Verb::Update, "leases");
    let flags: Vec<(u16, bool)> = updates.iter().map(|r| (r.code, r.injected)).collect();
    assert_eq!(flags, [(409, true), (200, false)]);
    Ok(())
}

#[tokio::test]
async fn touch_before_write_makes_the_precondition_really_fail() -> TestResult {
    let (server, client) = start().await?;
    let cms: Api<ConfigMap> = Api::namespaced(client, "default");
    let cm = cms
        .create(&PostParams::default(), &config_map("default", "id-7", &[]))
        .await?;
    server.faults().touch_before_write(
        RequestFilter::object(&Gvr::of::<ConfigMap>(), Some("default"), "id-7").verb(Verb::Delete),
        1,
    );
    let conditional = |rv: Option<String>| DeleteParams {
        preconditions: Some(Preconditions {
            uid: cm.metadata.uid.clone(),
            resource_version: rv,
        }),
        ..DeleteParams::default()
    };
    let res = cms
        .delete("id-7", &conditional(cm.resource_version()))
        .await;
    assert_eq!(api_code(&res), Some((409, "Conflict".into())));

    // Re-read: only an annotation changed, so retry with the new version.
    let fresh = cms.get("id-7").await?;
    assert_eq!(
        fresh
            .annotations()
            .get(TOUCH_ANNOTATION)
            .map(String::as_str),
        Some("1")
    );
    assert_ne!(fresh.resource_version(), cm.resource_version());
    cms.delete("id-7", &conditional(fresh.resource_version()))
        .await?;
    assert!(cms.get_opt("id-7").await?.is_none());
    Ok(())
}

#[tokio::test]
async fn fail_fraction_is_deterministic_for_a_seed() -> TestResult {
    let (server, client) = start().await?;
    server.insert(config_map("default", "x", &[]))?;
    let cms: Api<ConfigMap> = Api::namespaced(client, "default");
    let filter = RequestFilter::resource("configmaps").verb(Verb::Get);
    let mut runs = Vec::new();
    for _ in 0..2 {
        server.faults().clear();
        server.faults().reseed(42);
        server
            .faults()
            .fail_fraction(filter.clone(), 0.3, Failure::InternalError);
        let mut outcomes = Vec::new();
        for _ in 0..60 {
            outcomes.push(cms.get("x").await.is_ok());
        }
        runs.push(outcomes);
    }
    assert_eq!(runs[0], runs[1], "same seed, same outcomes");
    let failures = runs[0].iter().filter(|ok| !**ok).count();
    assert!(
        (5..=35).contains(&failures),
        "about 30% of 60 failed: {failures}"
    );
    let injected = server
        .requests()
        .filter(|r| r.injected && r.code == 500)
        .len();
    assert_eq!(injected, 2 * failures);
    Ok(())
}

#[tokio::test]
async fn throttling_sets_retry_after_and_kube_retries_it() -> TestResult {
    let (server, client) = start().await?;
    server.insert(config_map("default", "x", &[]))?;
    let filter = RequestFilter::resource("configmaps").verb(Verb::Get);
    server.faults().fail_next(
        filter.clone(),
        2,
        Failure::TooManyRequests {
            retry_after_secs: 0,
        },
    );
    let cms: Api<ConfigMap> = Api::namespaced(client, "default");
    cms.get("x").await?;
    let codes: Vec<u16> = server
        .requests()
        .of(Verb::Get, "configmaps")
        .iter()
        .map(|r| r.code)
        .collect();
    assert_eq!(codes, [429, 429, 200], "kube 5 retries 429 by itself");

    // Without kube's retry, the answer and its header are visible.
    server.faults().fail_next(
        filter,
        1,
        Failure::TooManyRequests {
            retry_after_secs: 3,
        },
    );
    let mut config = server.kube_config()?;
    config.default_retry = false;
    let raw = kube::Client::try_from(config)?;
    let request = http::Request::get("/api/v1/namespaces/default/configmaps/x")
        .body(kube::client::Body::empty())?;
    let response = raw.send(request).await?;
    assert_eq!(response.status().as_u16(), 429);
    assert_eq!(
        response
            .headers()
            .get(http::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok()),
        Some("3")
    );
    Ok(())
}

#[tokio::test]
async fn delay_slows_matching_requests() -> TestResult {
    let (server, client) = start().await?;
    server.faults().delay(
        RequestFilter::resource("configmaps").verb(Verb::List),
        Duration::from_millis(300),
    );
    let cms: Api<ConfigMap> = Api::namespaced(client, "default");
    let started = Instant::now();
    cms.list(&Default::default()).await?;
    assert!(started.elapsed() >= Duration::from_millis(300));
    let took = server
        .requests()
        .lists_of("configmaps")
        .first()
        .map(|r| r.took);
    assert!(took.is_some_and(|t| t >= Duration::from_millis(300)));
    Ok(())
}

#[tokio::test]
async fn refusing_outage_and_recovery() -> TestResult {
    let (server, client) = start().await?;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let mut watch = cms.watch(&WatchParams::default(), "0").await?.boxed();
    server.faults().go_down(DownMode::Refuse);
    // The open watch is cut, new requests fail to connect.
    loop {
        match tokio::time::timeout(WAIT, watch.next()).await? {
            None => break,
            Some(Err(_)) => {}
            Some(Ok(event)) => return Err(format!("unexpected {event:?}").into()),
        }
    }
    assert!(cms.list(&Default::default()).await.is_err());
    server.faults().come_up();
    let mut ok = false;
    for _ in 0..100 {
        if cms.list(&Default::default()).await.is_ok() {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(ok, "serving again on the same address");
    Ok(())
}

#[tokio::test]
async fn hanging_outage_holds_requests_until_up() -> TestResult {
    let (server, client) = start().await?;
    server.faults().go_down(DownMode::Hang);
    let cms: Api<ConfigMap> = Api::namespaced(client, "default");
    let pending = tokio::spawn(async move { cms.list(&Default::default()).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!pending.is_finished(), "no answer while hanging");
    server.faults().come_up();
    let list = tokio::time::timeout(WAIT, pending).await???;
    assert!(list.items.is_empty());
    Ok(())
}

#[tokio::test]
async fn drop_watches_cuts_open_streams() -> TestResult {
    let (server, client) = start().await?;
    let cms: Api<ConfigMap> = Api::namespaced(client, "default");
    server.insert(config_map("default", "a", &[]))?;
    let mut watch = cms.watch(&WatchParams::default(), "0").await?.boxed();
    assert!(matches!(next(&mut watch).await??, WatchEvent::Added(_)));
    assert_eq!(server.open_watches(), 1);
    server.faults().drop_watches();
    loop {
        match tokio::time::timeout(WAIT, watch.next()).await? {
            None => break,
            Some(Err(_)) => {}
            Some(Ok(event)) => return Err(format!("unexpected {event:?}").into()),
        }
    }
    for _ in 0..100 {
        if server.open_watches() == 0 {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err("watch still open".into())
}
