//! Direct seeding at the scale census's tests need.

use std::time::Instant;

use census_fake_apiserver::Gvr;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use kube::{Api, api::ListParams, runtime::watcher};

use crate::common::{TestResult, config_map, next, pod, start};

#[tokio::test]
async fn seeds_thousands_of_objects_and_serves_them() -> TestResult {
    let (server, client) = start().await?;
    let started = Instant::now();
    server.insert_many((0..5_000).map(|i| config_map("default", &format!("cm-{i}"), &[])))?;
    server.insert_many((0..5_000).map(|i| {
        let mut s = Secret::default();
        s.metadata.name = Some(format!("s-{i}"));
        s.metadata.namespace = Some("default".into());
        s
    }))?;
    server.insert_many((0..2_000).map(|i| {
        let node = format!("node-{}", i % 20);
        pod("apps", &format!("p-{i}"), Some(&node), &[("app", "load")])
    }))?;
    tracing::info!(took = ?started.elapsed(), "seeded 12,000 objects");
    assert_eq!(server.count(&Gvr::of::<ConfigMap>()), 5_000);
    assert_eq!(server.count(&Gvr::of::<Secret>()), 5_000);
    assert_eq!(server.count(&Gvr::of::<Pod>()), 2_000);
    assert!(
        server
            .get(&Gvr::new("", "v1", "namespaces"), None, "apps")
            .is_some(),
        "namespace made"
    );

    let pods: Api<Pod> = Api::namespaced(client.clone(), "apps");
    let on_node = pods
        .list(&ListParams::default().fields("spec.nodeName=node-3"))
        .await?;
    assert_eq!(on_node.items.len(), 100);

    // A watcher pages through 5,000 ConfigMaps (limit 500).
    let cms: Api<ConfigMap> = Api::all(client);
    let mut events = watcher(cms, watcher::Config::default()).boxed();
    let mut applied = 0;
    loop {
        match next(&mut events).await?? {
            watcher::Event::InitApply(_) => applied += 1,
            watcher::Event::InitDone => break,
            _ => {}
        }
    }
    assert_eq!(applied, 5_000);
    assert_eq!(server.requests().lists_of("configmaps").len(), 10);
    Ok(())
}
