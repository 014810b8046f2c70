//! Which layer of the API server serves a list (the watch cache or etcd), as
//! recorded in the request log, and `limit` at resourceVersion "0".

use census_fake_apiserver::ListSource;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::{
    Api,
    api::{ListParams, VersionMatch},
    core::ObjectList,
    runtime::watcher,
};

use crate::common::{TestResult, config_map, start};

#[tokio::test]
async fn each_list_is_served_by_the_layer_the_real_server_picks() -> TestResult {
    let (server, client) = start().await?;
    server.insert_many((0..12).map(|i| config_map("default", &format!("cm-{i:02}"), &[])))?;
    let rv = server.resource_version().to_string();
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");

    // resourceVersion unset with a limit: a consistent read from etcd, paginated.
    let first = cms.list(&ListParams::default().limit(5)).await?;
    assert_eq!(first.items.len(), 5);
    let token = first.metadata.continue_.clone().ok_or("no continue")?;
    cms.list(&ListParams::default().limit(5).continue_token(&token))
        .await?;
    // resourceVersion "0": the watch cache, which ignores the limit. (kube's
    // `ListParams` drops resourceVersion "0" when a limit is set, so this list is
    // asked for by hand, as client-go's reflector asks.)
    let any: ObjectList<ConfigMap> = client
        .request(
            http::Request::get(
                "/api/v1/namespaces/default/configmaps?resourceVersion=0&resourceVersionMatch=NotOlderThan&limit=5",
            )
            .body(Vec::new())?,
        )
        .await?;
    assert_eq!(
        any.items.len(),
        12,
        "the limit is ignored at resourceVersion 0"
    );
    assert!(any.metadata.continue_.is_none());
    assert!(any.metadata.remaining_item_count.is_none());
    let at = |version_match, limit| ListParams {
        resource_version: Some(rv.clone()),
        version_match,
        limit,
        ..ListParams::default()
    };
    cms.list(&at(Some(VersionMatch::NotOlderThan), None))
        .await?;
    cms.list(&at(None, None)).await?;
    cms.list(&at(Some(VersionMatch::NotOlderThan), Some(5)))
        .await?;
    cms.list(&at(None, Some(5))).await?;
    cms.list(&at(Some(VersionMatch::Exact), None)).await?;
    cms.list(&ListParams::default()).await?;

    assert_eq!(
        server
            .requests()
            .lists_of("configmaps")
            .iter()
            .map(|r| r.list_source)
            .collect::<Vec<_>>(),
        [
            Some(ListSource::Storage), // unset, limit
            Some(ListSource::Storage), // continue
            Some(ListSource::Cache),   // "0", limit ignored
            Some(ListSource::Cache),   // n, NotOlderThan
            Some(ListSource::Cache),   // n, no match, no limit
            Some(ListSource::Storage), // n, NotOlderThan, limit (v1.30 hasLimit)
            Some(ListSource::Storage), // n, no match, limit: legacy exact
            Some(ListSource::Storage), // n, Exact
            Some(ListSource::Storage), // unset, no limit: consistent read
        ]
    );
    assert_eq!(server.requests().storage_lists_of("configmaps").len(), 6);
    Ok(())
}

/// kube's watcher lists from the cache only with the `Any` list semantic and no
/// page size: its default (most recent, pages of 500) lists from etcd, and so
/// does `Any` with the default page size, since kube's `ListParams` leaves
/// resourceVersion "0" out of a list with a limit.
#[tokio::test]
async fn kube_watcher_list_semantics_choose_the_layer() -> TestResult {
    use futures::StreamExt as _;

    let (server, client) = start().await?;
    server.insert(config_map("default", "a", &[]))?;
    let cms: Api<ConfigMap> = Api::namespaced(client, "default");
    let cache = watcher::Config {
        page_size: None,
        ..watcher::Config::default().any_semantic()
    };
    for config in [
        watcher::Config::default(),
        watcher::Config::default().any_semantic(),
        cache,
    ] {
        let mut stream = std::pin::pin!(watcher(cms.clone(), config));
        while let Some(event) = stream.next().await {
            if matches!(event?, watcher::Event::InitDone) {
                break;
            }
        }
    }
    let sources: Vec<_> = server
        .requests()
        .lists_of("configmaps")
        .iter()
        .map(|r| (r.param("resourceVersion").map(str::to_owned), r.list_source))
        .collect();
    assert_eq!(
        sources,
        [
            (None, Some(ListSource::Storage)),
            (None, Some(ListSource::Storage)),
            (Some("0".to_owned()), Some(ListSource::Cache)),
        ]
    );
    Ok(())
}

/// A list that fails records no source.
#[tokio::test]
async fn a_refused_list_has_no_source() -> TestResult {
    let (server, client) = start().await?;
    let cms: Api<ConfigMap> = Api::namespaced(client, "default");
    let bad = ListParams {
        resource_version: Some("x".into()),
        ..ListParams::default()
    };
    assert!(cms.list(&bad).await.is_err());
    let lists = server.requests().lists_of("configmaps");
    assert_eq!(lists.len(), 1);
    assert_eq!(lists[0].code, 400);
    assert_eq!(lists[0].list_source, None);
    Ok(())
}
