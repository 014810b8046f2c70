//! watch: raw streams and kube's watcher.

use std::time::Duration;

use census_fake_apiserver::{Gvr, ServerConfig, Verb};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use kube::{
    Api, ResourceExt,
    api::{PostParams, WatchEvent, WatchParams},
    runtime::{WatchStreamExt, watcher},
};
use serde_json::json;

use crate::common::{TestResult, WAIT, config_map, next, pod, start, start_with};

fn quiet() -> ServerConfig {
    // No bookmarks during the test unless it wants them.
    ServerConfig {
        bookmark_interval: Duration::from_secs(3600),
        ..ServerConfig::default()
    }
}

#[tokio::test]
async fn watch_resumes_from_a_resource_version_and_sees_deletes() -> TestResult {
    let (server, client) = start_with(quiet()).await?;
    let cms: Api<ConfigMap> = Api::namespaced(client, "default");
    cms.create(&PostParams::default(), &config_map("default", "a", &[]))
        .await?;
    let after_a = server.resource_version();
    cms.create(&PostParams::default(), &config_map("default", "b", &[]))
        .await?;

    let mut stream = cms
        .watch(&WatchParams::default(), &after_a.to_string())
        .await?
        .boxed();
    match next(&mut stream).await?? {
        WatchEvent::Added(cm) => {
            assert_eq!(cm.name_any(), "b", "history after the given version only");
        }
        other => return Err(format!("unexpected {other:?}").into()),
    }
    cms.delete("a", &Default::default()).await?;
    match next(&mut stream).await?? {
        WatchEvent::Deleted(cm) => {
            assert_eq!(cm.name_any(), "a");
            assert_eq!(
                cm.resource_version(),
                Some(server.resource_version().to_string())
            );
        }
        other => return Err(format!("unexpected {other:?}").into()),
    }
    Ok(())
}

#[tokio::test]
async fn watch_from_zero_starts_with_synthetic_adds() -> TestResult {
    let (server, client) = start_with(quiet()).await?;
    server.insert_many([
        config_map("default", "a", &[]),
        config_map("default", "b", &[]),
    ])?;
    let cms: Api<ConfigMap> = Api::namespaced(client, "default");
    let mut stream = cms.watch(&WatchParams::default(), "0").await?.boxed();
    for want in ["a", "b"] {
        match next(&mut stream).await?? {
            WatchEvent::Added(cm) => assert_eq!(cm.name_any(), want),
            other => return Err(format!("unexpected {other:?}").into()),
        }
    }
    Ok(())
}

#[tokio::test]
async fn expired_resume_gets_in_stream_410() -> TestResult {
    let (server, client) = start_with(quiet()).await?;
    server.insert(config_map("default", "a", &[]))?;
    let old = server.resource_version();
    server.insert(config_map("default", "b", &[]))?;
    server.faults().compact();
    let cms: Api<ConfigMap> = Api::namespaced(client, "default");
    let mut stream = cms
        .watch(&WatchParams::default(), &old.to_string())
        .await?
        .boxed();
    match next(&mut stream).await?? {
        WatchEvent::Error(status) => {
            assert_eq!(status.code, 410);
            assert_eq!(status.reason, "Expired");
        }
        other => return Err(format!("unexpected {other:?}").into()),
    }
    assert!(
        tokio::time::timeout(WAIT, stream.next()).await?.is_none(),
        "stream ends"
    );
    let watches = server.requests().watches_of("configmaps");
    assert_eq!(
        watches.first().map(|r| r.code),
        Some(200),
        "the watch itself starts fine"
    );
    Ok(())
}

#[tokio::test]
async fn bookmarks_arrive_when_allowed() -> TestResult {
    let (server, client) = start_with(ServerConfig {
        bookmark_interval: Duration::from_millis(100),
        ..ServerConfig::default()
    })
    .await?;
    let cms: Api<ConfigMap> = Api::namespaced(client, "default");
    let rv = server.resource_version().to_string();
    let mut stream = cms.watch(&WatchParams::default(), &rv).await?.boxed();
    // Writes elsewhere move the bookmark's version on.
    server.insert(pod("default", "p", None, &[]))?;
    let now = server.resource_version();
    loop {
        match next(&mut stream).await?? {
            WatchEvent::Bookmark(b) if b.metadata.resource_version == now.to_string() => break,
            WatchEvent::Bookmark(_) => {}
            other => return Err(format!("unexpected {other:?}").into()),
        }
    }
    let watch = server.requests().watches_of("configmaps").first().cloned();
    assert_eq!(
        watch.as_ref().and_then(|w| w.param("allowWatchBookmarks")),
        Some("true")
    );
    Ok(())
}

#[tokio::test]
async fn selectors_turn_transitions_into_added_and_deleted() -> TestResult {
    let (server, client) = start_with(quiet()).await?;
    let pods: Api<Pod> = Api::namespaced(client, "default");
    let rv = server.resource_version().to_string();
    let mut on_n1 = pods
        .watch(&WatchParams::default().fields("spec.nodeName=n1"), &rv)
        .await?
        .boxed();
    let mut web = pods
        .watch(&WatchParams::default().labels("app=web"), &rv)
        .await?
        .boxed();

    // Created unscheduled, then bound to n1: the node's watch sees ADDED.
    pods.create(
        &PostParams::default(),
        &pod("default", "p", None, &[("app", "web")]),
    )
    .await?;
    server.modify(&Gvr::of::<Pod>(), Some("default"), "p", |p| {
        p["spec"]["nodeName"] = json!("n1");
    })?;
    match next(&mut on_n1).await?? {
        WatchEvent::Added(p) => assert_eq!(p.spec.and_then(|s| s.node_name).as_deref(), Some("n1")),
        other => return Err(format!("unexpected {other:?}").into()),
    }
    // Moved away (only possible behind the API's back): DELETED for n1.
    server.modify(&Gvr::of::<Pod>(), Some("default"), "p", |p| {
        p["spec"]["nodeName"] = json!("n2");
    })?;
    match next(&mut on_n1).await?? {
        WatchEvent::Deleted(p) => {
            // The previous state, with the new version.
            assert_eq!(p.spec.and_then(|s| s.node_name).as_deref(), Some("n1"));
            assert_eq!(
                p.metadata.resource_version,
                Some(server.resource_version().to_string())
            );
        }
        other => return Err(format!("unexpected {other:?}").into()),
    }

    // The label watch: ADDED, MODIFIED, MODIFIED, then DELETED when the label changes.
    let mut kinds = Vec::new();
    for _ in 0..3 {
        kinds.push(match next(&mut web).await?? {
            WatchEvent::Added(_) => "ADDED",
            WatchEvent::Modified(_) => "MODIFIED",
            other => return Err(format!("unexpected {other:?}").into()),
        });
    }
    assert_eq!(kinds, ["ADDED", "MODIFIED", "MODIFIED"]);
    let relabel = json!({"metadata": {"labels": {"app": "db"}}});
    pods.patch("p", &Default::default(), &kube::api::Patch::Merge(&relabel))
        .await?;
    assert!(matches!(next(&mut web).await??, WatchEvent::Deleted(_)));
    let back = json!({"metadata": {"labels": {"app": "web"}}});
    pods.patch("p", &Default::default(), &kube::api::Patch::Merge(&back))
        .await?;
    assert!(matches!(next(&mut web).await??, WatchEvent::Added(_)));

    let watches = server.requests().watches_of("pods");
    assert!(
        watches
            .iter()
            .any(|w| w.field_selector.as_deref() == Some("spec.nodeName=n1"))
    );
    assert!(
        watches
            .iter()
            .any(|w| w.label_selector.as_deref() == Some("app=web"))
    );
    Ok(())
}

#[tokio::test]
async fn watcher_lists_then_watches_and_resumes_after_a_dropped_watch() -> TestResult {
    let (server, client) = start_with(quiet()).await?;
    server.insert_many([
        pod("default", "a", Some("n1"), &[]),
        pod("default", "b", Some("n1"), &[]),
        pod("default", "c", Some("n2"), &[]),
    ])?;
    let rv_at_list = server.resource_version();
    let pods: Api<Pod> = Api::all(client.clone());
    let config = watcher::Config::default().fields("spec.nodeName=n1");
    let mut events = watcher(pods, config).boxed();

    assert!(matches!(next(&mut events).await??, watcher::Event::Init));
    let mut initial = Vec::new();
    loop {
        match next(&mut events).await?? {
            watcher::Event::InitApply(p) => initial.push(p.name_any()),
            watcher::Event::InitDone => break,
            other => return Err(format!("unexpected {other:?}").into()),
        }
    }
    assert_eq!(initial, ["a", "b"]);

    // The watch starts when the stream is polled again.
    server.insert(pod("default", "d", Some("n1"), &[]))?;
    match next(&mut events).await?? {
        watcher::Event::Apply(p) => assert_eq!(p.name_any(), "d"),
        other => return Err(format!("unexpected {other:?}").into()),
    }
    let seen_rv = server.resource_version();

    // kube 5 defaults: a paginated list (limit 500), then a watch from the
    // list's version with bookmarks.
    let list = server
        .wait_for_request(|r| r.verb == Verb::List && r.resource == "pods", WAIT)
        .await
        .ok_or("no list")?;
    assert_eq!(list.param("limit"), Some("500"));
    let first_watch = server
        .wait_for_request(|r| r.verb == Verb::Watch && r.resource == "pods", WAIT)
        .await
        .ok_or("no watch")?;
    assert_eq!(
        first_watch.field_selector.as_deref(),
        Some("spec.nodeName=n1")
    );
    assert_eq!(first_watch.param("allowWatchBookmarks"), Some("true"));
    assert_eq!(first_watch.param("timeoutSeconds"), Some("290"));
    assert_eq!(
        first_watch.param("resourceVersion"),
        Some(rv_at_list.to_string().as_str())
    );

    server.faults().drop_watches();
    server.insert(pod("default", "e", Some("n1"), &[]))?;
    let mut saw_e = false;
    while !saw_e {
        match next(&mut events).await? {
            Ok(watcher::Event::Apply(p)) => saw_e = p.name_any() == "e",
            Ok(other) => return Err(format!("resumed, so no re-list expected: {other:?}").into()),
            // The broken connection may surface as an error before the resume.
            Err(_) => {}
        }
    }
    let seen_rv = seen_rv.to_string();
    let resume = server
        .wait_for_request(
            |r| r.verb == Verb::Watch && r.param("resourceVersion") == Some(seen_rv.as_str()),
            WAIT,
        )
        .await;
    assert!(resume.is_some(), "resumed from the last version seen");
    assert_eq!(
        server.requests().lists_of("pods").len(),
        1,
        "resumed without a re-list"
    );
    Ok(())
}

#[tokio::test]
async fn watcher_relists_after_410() -> TestResult {
    let (server, client) = start_with(quiet()).await?;
    server.insert(config_map("default", "a", &[]))?;
    let cms: Api<ConfigMap> = Api::namespaced(client, "default");
    let mut events = watcher(cms, watcher::Config::default()).boxed();
    assert!(matches!(next(&mut events).await??, watcher::Event::Init));
    assert!(matches!(
        next(&mut events).await??,
        watcher::Event::InitApply(_)
    ));
    assert!(matches!(
        next(&mut events).await??,
        watcher::Event::InitDone
    ));

    // Writes elsewhere, then compaction: the watcher's version is too old.
    server.insert(pod("default", "p", None, &[]))?;
    server.faults().compact();
    server.faults().drop_watches();
    let mut saw_410 = false;
    loop {
        match next(&mut events).await? {
            Err(watcher::Error::WatchError(status)) if status.code == 410 => saw_410 = true,
            Err(_) => {}
            Ok(watcher::Event::Init) => break,
            Ok(other) => return Err(format!("unexpected {other:?}").into()),
        }
    }
    assert!(saw_410, "the 410 came in the stream");
    assert!(matches!(
        next(&mut events).await??,
        watcher::Event::InitApply(_)
    ));
    assert!(matches!(
        next(&mut events).await??,
        watcher::Event::InitDone
    ));
    assert_eq!(
        server.requests().lists_of("configmaps").len(),
        2,
        "re-listed"
    );
    Ok(())
}

#[tokio::test]
async fn watcher_streaming_lists_use_initial_events() -> TestResult {
    let (server, client) = start().await?;
    server.insert_many([
        serde_json::from_value::<Node>(json!({"metadata": {"name": "n1"}}))?,
        serde_json::from_value::<Node>(json!({"metadata": {"name": "n2"}}))?,
    ])?;
    let nodes: Api<Node> = Api::all(client);
    let stream = watcher(nodes, watcher::Config::default().streaming_lists())
        .default_backoff()
        .applied_objects();
    let mut stream = stream.boxed();
    let mut seen = vec![
        next(&mut stream).await??.name_any(),
        next(&mut stream).await??.name_any(),
    ];
    seen.sort();
    assert_eq!(seen, ["n1", "n2"]);
    server.insert(serde_json::from_value::<Node>(
        json!({"metadata": {"name": "n3"}}),
    )?)?;
    assert_eq!(next(&mut stream).await??.name_any(), "n3");
    let requests = server.requests();
    assert!(requests.lists_of("nodes").is_empty(), "no list call");
    let watch = requests
        .watches_of("nodes")
        .first()
        .cloned()
        .ok_or("no watch")?;
    assert_eq!(watch.param("sendInitialEvents"), Some("true"));
    assert_eq!(watch.param("resourceVersionMatch"), Some("NotOlderThan"));
    Ok(())
}

#[tokio::test]
async fn watch_options_are_validated_like_the_real_server() -> TestResult {
    let (_server, client) = start().await?;
    // kube refuses these client-side, so send them raw.
    for query in [
        "watch=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan",
        "watch=true&sendInitialEvents=true&allowWatchBookmarks=true",
        "watch=true&resourceVersion=1&resourceVersionMatch=NotOlderThan",
    ] {
        let request = http::Request::get(format!("/api/v1/nodes?{query}")).body(Vec::new())?;
        let res = client.request_text(request).await;
        assert_eq!(
            crate::common::api_code(&res),
            Some((422, "Invalid".into())),
            "{query}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn watch_times_out_cleanly() -> TestResult {
    let (server, client) = start_with(quiet()).await?;
    let cms: Api<ConfigMap> = Api::namespaced(client, "default");
    let mut stream = cms
        .watch(&WatchParams::default().timeout(1), "0")
        .await?
        .boxed();
    assert!(
        tokio::time::timeout(WAIT, stream.try_next())
            .await??
            .is_none()
    );
    for _ in 0..100 {
        if server.open_watches() == 0 {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err("the watch task did not end".into())
}
