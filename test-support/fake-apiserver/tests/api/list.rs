//! list: resourceVersion, pagination, selectors.

use census_fake_apiserver::{FakeApiServer, Gvr};
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::{
    Api, ResourceExt,
    api::{ListParams, VersionMatch},
};

use crate::common::{TestResult, api_code, config_map, pod, start};

fn names<K: ResourceExt>(items: &[K]) -> Vec<String> {
    items.iter().map(ResourceExt::name_any).collect()
}

#[tokio::test]
async fn pagination_with_limit_and_continue_is_a_snapshot() -> TestResult {
    let (server, client) = start().await?;
    server.insert_many((0..25).map(|i| config_map("default", &format!("cm-{i:02}"), &[])))?;
    let cms: Api<ConfigMap> = Api::namespaced(client, "default");

    let first = cms.list(&ListParams::default().limit(10)).await?;
    assert_eq!(first.items.len(), 10);
    assert_eq!(first.metadata.remaining_item_count, Some(15));
    let list_rv = first
        .metadata
        .resource_version
        .clone()
        .ok_or("no list rv")?;
    assert_eq!(list_rv, server.resource_version().to_string());
    let token = first.metadata.continue_.clone().ok_or("no continue")?;

    // Writes between pages do not show: pages read the first page's snapshot.
    server.delete(&Gvr::of::<ConfigMap>(), Some("default"), "cm-15");
    server.insert(config_map("default", "cm-99", &[]))?;

    let second = cms
        .list(&ListParams::default().limit(10).continue_token(&token))
        .await?;
    assert_eq!(
        second.metadata.resource_version.as_deref(),
        Some(list_rv.as_str())
    );
    let token = second.metadata.continue_.clone().ok_or("no continue")?;
    let third = cms
        .list(&ListParams::default().limit(10).continue_token(&token))
        .await?;
    assert_eq!(third.items.len(), 5);
    assert!(third.metadata.continue_.is_none());
    let all: Vec<String> = [first.items, second.items, third.items]
        .iter()
        .flat_map(|items| names(items))
        .collect();
    let expected: Vec<String> = (0..25).map(|i| format!("cm-{i:02}")).collect();
    assert_eq!(all, expected);

    // Once the snapshot is compacted the token expires with 410.
    server.faults().compact();
    let expired = cms
        .list(&ListParams::default().limit(10).continue_token(&token))
        .await;
    assert_eq!(api_code(&expired), Some((410, "Expired".into())));
    let garbage = cms
        .list(&ListParams::default().limit(10).continue_token("zzz"))
        .await;
    assert_eq!(api_code(&garbage).map(|c| c.0), Some(400));
    Ok(())
}

#[tokio::test]
async fn list_resource_version_semantics() -> TestResult {
    let (server, client) = start().await?;
    server.insert(config_map("default", "a", &[]))?;
    let at_a = server.resource_version();
    server.insert(config_map("default", "b", &[]))?;
    let cms: Api<ConfigMap> = Api::namespaced(client, "default");

    let any = cms.list(&ListParams::default().match_any()).await?;
    assert_eq!(any.items.len(), 2);

    let exact = ListParams {
        resource_version: Some(at_a.to_string()),
        version_match: Some(VersionMatch::Exact),
        ..ListParams::default()
    };
    let old = cms.list(&exact).await?;
    assert_eq!(names(&old.items), ["a"]);
    assert_eq!(old.metadata.resource_version, Some(at_a.to_string()));

    let future = ListParams {
        resource_version: Some((server.resource_version() + 100).to_string()),
        version_match: Some(VersionMatch::NotOlderThan),
        ..ListParams::default()
    };
    // kube retries 504 (with long backoff) by default; ask once.
    let mut config = server.kube_config()?;
    config.default_retry = false;
    let once: Api<ConfigMap> = Api::namespaced(kube::Client::try_from(config)?, "default");
    assert_eq!(api_code(&once.list(&future).await).map(|c| c.0), Some(504));

    server.faults().compact();
    assert_eq!(
        api_code(&cms.list(&exact).await),
        Some((410, "Expired".into()))
    );
    Ok(())
}

async fn seeded_pods() -> Result<(FakeApiServer, Api<Pod>), Box<dyn std::error::Error + Send + Sync>>
{
    let (server, client) = start().await?;
    server.insert_many([
        pod(
            "default",
            "web-1",
            Some("n1"),
            &[("app", "web"), ("tier", "front")],
        ),
        pod("default", "web-2", Some("n2"), &[("app", "web")]),
        pod(
            "default",
            "db-1",
            Some("n1"),
            &[("app", "db"), ("tier", "back")],
        ),
        pod("other", "job-1", None, &[]),
    ])?;
    Ok((server, Api::all(client)))
}

#[tokio::test]
async fn label_selectors_on_list() -> TestResult {
    let (_server, pods) = seeded_pods().await?;
    let cases: [(&str, &[&str]); 8] = [
        ("app=web", &["web-1", "web-2"]),
        ("app==web,tier=front", &["web-1"]),
        ("app!=web", &["db-1", "job-1"]),
        ("app in (db,web),tier", &["db-1", "web-1"]),
        ("app notin (web)", &["db-1", "job-1"]),
        ("tier", &["db-1", "web-1"]),
        ("!tier", &["job-1", "web-2"]),
        ("app=nothing", &[]),
    ];
    for (selector, want) in cases {
        let list = pods.list(&ListParams::default().labels(selector)).await?;
        let mut got = names(&list.items);
        got.sort();
        assert_eq!(got, want, "selector {selector}");
    }
    let bad = pods.list(&ListParams::default().labels("app in ()")).await;
    assert_eq!(api_code(&bad), Some((400, "BadRequest".into())));
    Ok(())
}

#[tokio::test]
async fn field_selectors_on_list() -> TestResult {
    let (server, pods) = seeded_pods().await?;
    let on_n1 = pods
        .list(&ListParams::default().fields("spec.nodeName=n1"))
        .await?;
    assert_eq!(
        names(&on_n1.items),
        ["db-1", "web-1"],
        "sorted by namespace and name"
    );
    let unscheduled = pods
        .list(&ListParams::default().fields("spec.nodeName="))
        .await?;
    assert_eq!(names(&unscheduled.items), ["job-1"]);
    let not_n1 = pods
        .list(&ListParams::default().fields("spec.nodeName!=n1,metadata.namespace=default"))
        .await?;
    assert_eq!(names(&not_n1.items), ["web-2"]);
    let by_name = pods
        .list(&ListParams::default().fields("metadata.name=db-1"))
        .await?;
    assert_eq!(names(&by_name.items), ["db-1"]);

    let unsupported = pods
        .list(&ListParams::default().fields("spec.hostname=x"))
        .await;
    assert_eq!(api_code(&unsupported), Some((400, "BadRequest".into())));
    if let Err(kube::Error::Api(status)) = &unsupported {
        assert_eq!(status.message, "field label not supported: spec.hostname");
    }

    // The log records what was asked.
    let lists = server.requests().lists_of("pods");
    assert!(
        lists
            .iter()
            .any(|r| r.field_selector.as_deref() == Some("spec.nodeName=n1"))
    );
    assert!(lists.iter().any(|r| r.code == 400));
    Ok(())
}

#[tokio::test]
async fn metadata_only_lists_and_gets() -> TestResult {
    let (server, client) = start().await?;
    server.insert(config_map("default", "m", &[("a", "1")]))?;
    let cms: Api<ConfigMap> = Api::namespaced(client, "default");
    let list = cms.list_metadata(&ListParams::default()).await?;
    assert_eq!(list.items.len(), 1);
    assert_eq!(
        list.items[0].labels().get("a").map(String::as_str),
        Some("1")
    );
    let one = cms.get_metadata("m").await?;
    assert_eq!(
        one.types.map(|t| t.kind).as_deref(),
        Some("PartialObjectMetadata")
    );
    Ok(())
}
