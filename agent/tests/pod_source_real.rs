//! The pod source against a real control plane (census-cluster: upstream etcd,
//! kube-apiserver, controllers, and kwok playing the nodes), for what the fake API
//! server cannot show: real pod IPs and phases from a node, real field-selector and
//! watch-cache behaviour. It runs in every test run (`cargo xtask test` starts the
//! control plane; a plain `cargo test` starts or reuses one named `cargo-test`, or
//! uses the one `CENSUS_TEST_KUBECONFIG` names).
//!
//! It creates a namespace `census-test-*` (removed at the end, also when the test
//! fails) with two pods bound to one node: `CENSUS_TEST_NODE`, or the first Ready
//! node. Their image is `CENSUS_TEST_IMAGE` (default `registry.k8s.io/pause:3.10`;
//! kwok runs no container). The test does not run on that node, so interfaces are
//! not looked up by route: every pod gets the interface `from-test`.
//!
//! The same scenario also runs, in every test run, against the fake API server with
//! a stand-in kubelet that gives bound pods an address and the Running phase.

use std::{net::IpAddr, sync::Arc, time::Duration};

use census_agent::source::{
    EndpointSource as _, HostInterface, SourceEndpoint, SourceEvent,
    kubernetes::{InterfaceLookup, PodSource, RouteError, Timing},
};
use census_fake_apiserver::{FakeApiServer, Gvr, ListSource, Verb};
use census_proto::domain::{EndpointKey, NodeName};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::{
    Api, Client,
    api::{DeleteParams, ListParams, PostParams},
};
use serde_json::json;
use tokio::{
    sync::{mpsc, watch},
    time::{Instant, timeout_at},
};

type TestResult<T = ()> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Long enough for a real kubelet to pull a small image and start a pod.
const WAIT: Duration = Duration::from_secs(180);

struct FromTest;

impl InterfaceLookup for FromTest {
    fn host_interface(&self, _ip: IpAddr) -> Result<String, RouteError> {
        Ok("from-test".to_owned())
    }
}

async fn real_client() -> TestResult<Client> {
    census_testkit::cluster::admin_client(true).await
}

/// `CENSUS_TEST_NODE`, or the first node whose Ready condition is True.
async fn test_node(client: &Client) -> TestResult<String> {
    if let Ok(node) = std::env::var("CENSUS_TEST_NODE") {
        return Ok(node);
    }
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .find(|n| {
            n.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        })
        .and_then(|n| n.metadata.name)
        .ok_or_else(|| "the cluster has no Ready node".into())
}

fn pod(name: &str, node: &str, image: &str, host_network: bool) -> TestResult<Pod> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name,
                     "labels": {"app": "census-test", "pod-template-hash": "7d4b9"}},
        "spec": {"nodeName": node, "hostNetwork": host_network,
                 "terminationGracePeriodSeconds": 0,
                 "tolerations": [{"operator": "Exists"}],
                 "containers": [{"name": "pause", "image": image}]},
    }))?)
}

/// What the source's events add up to, and the keys it ever reported.
#[derive(Default)]
struct Seen {
    set: std::collections::BTreeMap<EndpointKey, SourceEndpoint>,
    ever: std::collections::BTreeSet<EndpointKey>,
    resets: usize,
    /// Failures the source reported (it retries by itself), for a timeout's message.
    failures: Vec<String>,
}

impl Seen {
    fn apply(&mut self, event: SourceEvent) {
        match event {
            SourceEvent::Reset(all) => {
                self.resets += 1;
                self.set = all.into_iter().map(|e| (e.key.clone(), e)).collect();
            }
            SourceEvent::Upsert(e) => {
                self.set.insert(e.key.clone(), e);
            }
            SourceEvent::Delete(key) => {
                self.set.remove(&key);
            }
            SourceEvent::Failed(failure) => self.failures.push(failure.detail),
        }
        self.ever.extend(self.set.keys().cloned());
    }

    /// Applies events until `done` holds.
    async fn until(
        &mut self,
        events: &mut mpsc::Receiver<SourceEvent>,
        what: &str,
        done: impl Fn(&Self) -> bool,
    ) -> TestResult {
        let deadline = Instant::now() + WAIT;
        while !done(self) {
            match timeout_at(deadline, events.recv()).await {
                Ok(Some(event)) => self.apply(event),
                Ok(None) => return Err("the source stopped".into()),
                Err(_) => {
                    return Err(format!(
                        "timed out waiting until {what}; the source reported: {:?}",
                        self.failures
                    )
                    .into());
                }
            }
        }
        Ok(())
    }
}

#[tokio::test]
async fn real_pod_source_follows_its_nodes_pods() -> TestResult {
    follows_its_nodes_pods(&real_client().await?).await
}

#[tokio::test]
async fn pod_source_follows_its_nodes_pods_on_the_fake() -> TestResult {
    let server = Arc::new(FakeApiServer::start().await?);
    server.insert(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "n1"},
        "status": {"conditions": [{"type": "Ready", "status": "True"}],
                   "addresses": [{"type": "InternalIP", "address": "198.18.0.1"}]},
    }))?;
    let kubelet = tokio::spawn(stand_in_kubelet(Arc::clone(&server)));
    let result = follows_its_nodes_pods(&server.client()?).await;
    kubelet.abort();
    result?;
    // The source's lists (resourceVersion 0, no limit) came from the watch cache.
    let requests = server.requests();
    let source_lists = requests.filter(|r| {
        r.verb == Verb::List
            && r.resource == "pods"
            && r.field_selector.as_deref() == Some("spec.nodeName=n1")
    });
    assert_eq!(
        source_lists.len(),
        1,
        "one list; the watch never started over"
    );
    for r in &source_lists {
        assert_eq!(
            (r.param("resourceVersion"), r.param("limit"), r.list_source),
            (Some("0"), None, Some(ListSource::Cache)),
            "{:?}",
            r.query
        );
    }
    Ok(())
}

/// What a kubelet does for the scenario: a bound pod gets an address (the node's
/// own for a host-network pod) and the Running phase.
async fn stand_in_kubelet(server: Arc<FakeApiServer>) {
    let pods = Gvr::new("", "v1", "pods");
    let mut next = 10u8;
    loop {
        for p in server.list(&pods) {
            let bound = p["spec"]["nodeName"].is_string();
            if !bound || p["status"]["podIP"].is_string() {
                continue;
            }
            let ip = if p["spec"]["hostNetwork"] == json!(true) {
                "198.18.0.1".to_owned()
            } else {
                next = next.wrapping_add(1);
                format!("198.18.1.{next}")
            };
            let namespace = p["metadata"]["namespace"].as_str().unwrap_or_default();
            let name = p["metadata"]["name"].as_str().unwrap_or_default();
            let _ = server.modify(&pods, Some(namespace), name, |p| {
                p["status"] = json!({"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]});
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn follows_its_nodes_pods(client: &Client) -> TestResult {
    let node = test_node(client).await?;
    let namespace = format!("census-test-{:06x}", rand::random::<u32>() & 0xff_ffff);
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": namespace}}))?,
        )
        .await?;
    let result = async {
        service_account_ready(client, &namespace).await?;
        scenario(client, &node, &namespace).await
    }
    .await;
    let _ = namespaces
        .delete(&namespace, &DeleteParams::default())
        .await;
    result
}

/// A real API server refuses a pod whose ServiceAccount does not exist yet (the
/// ServiceAccount admission plugin), and kube-controller-manager creates `default`
/// just after the namespace: wait for it where there is a controller manager to.
async fn service_account_ready(client: &Client, namespace: &str) -> TestResult {
    use k8s_openapi::api::core::v1::ServiceAccount;
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    let deadline = Instant::now() + Duration::from_secs(10);
    while accounts.get_opt("default").await?.is_none() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

async fn scenario(client: &Client, node: &str, namespace: &str) -> TestResult {
    let image = std::env::var("CENSUS_TEST_IMAGE")
        .unwrap_or_else(|_| "registry.k8s.io/pause:3.10".to_owned());
    let source = PodSource::new(
        client.clone(),
        NodeName::new(node)?,
        Arc::new(FromTest),
        Timing::default(),
    );
    let (tx, mut events) = mpsc::channel(256);
    let (stop, shutdown) = watch::channel(false);
    let task = tokio::spawn(Box::new(source).run(tx, shutdown));
    let mut seen = Seen::default();
    seen.until(&mut events, "the first list is complete", |s| s.resets > 0)
        .await?;

    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    pods.create(&PostParams::default(), &pod("web", node, &image, false)?)
        .await?;
    pods.create(
        &PostParams::default(),
        &pod("host-net", node, &image, true)?,
    )
    .await?;
    let web = EndpointKey::new(namespace, "web")?;
    let host_net = EndpointKey::new(namespace, "host-net")?;
    seen.until(&mut events, "the web pod has an address", |s| {
        s.set.get(&web).is_some_and(|e| !e.ips.is_empty())
    })
    .await?;
    // By then the host-network pod is running too, or close to it.
    let deadline = Instant::now() + WAIT;
    loop {
        let p = pods.get("host-net").await?;
        let running = p
            .status
            .as_ref()
            .and_then(|s| s.phase.as_deref())
            .is_some_and(|phase| phase == "Running");
        if running || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    // Whatever the watch has for it by now.
    while let Ok(Some(event)) = tokio::time::timeout(Duration::from_secs(3), events.recv()).await {
        seen.apply(event);
    }

    let endpoint = seen.set.get(&web).ok_or("the web pod is gone")?;
    let status_ip: IpAddr = pods
        .get("web")
        .await?
        .status
        .and_then(|s| s.pod_ip)
        .ok_or("the web pod has no podIP")?
        .parse()?;
    assert!(endpoint.ips.contains(&status_ip), "{:?}", endpoint.ips);
    assert_eq!(
        endpoint.labels.get("app").map(String::as_str),
        Some("census-test")
    );
    assert!(
        !endpoint.labels.contains_key("pod-template-hash"),
        "the default filter drops pod-template-hash: {:?}",
        endpoint.labels
    );
    assert_eq!(endpoint.service_account, "default");
    assert_eq!(endpoint.interface, HostInterface::Named("from-test".into()));
    assert!(
        !seen.ever.contains(&host_net),
        "a host-network pod is not an endpoint"
    );
    assert!(
        seen.ever
            .iter()
            .all(|k| k.namespace() != namespace || k == &web),
        "only the web pod of the test namespace: {:?}",
        seen.ever
    );

    pods.delete("web", &DeleteParams::default().grace_period(0))
        .await?;
    seen.until(&mut events, "the web pod is gone", |s| {
        !s.set.contains_key(&web)
    })
    .await?;

    let _ = stop.send(true);
    task.await?;
    Ok(())
}
