//! The pod source against the fake API server: real HTTP and a real
//! `kube::Client`, in process. Interfaces come from a fixed table (the netlink
//! lookup has its own privileged test). Every test also checks, from the request
//! log, that the source asked for this node's pods only and listed them from the
//! API server's watch cache.

use std::{
    collections::{BTreeMap, HashMap},
    io,
    net::IpAddr,
    sync::Arc,
    time::Duration,
};

use census_fake_apiserver::{
    DownMode, Failure, FakeApiServer, Gvr, ListSource, PodEnd, RateLimit, RequestFilter, Verb,
};
use census_proto::{
    domain::EndpointKey,
    labels::{LabelFilter, LabelLimits, LabelSet},
};
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::{
    sync::{mpsc, watch},
    task::JoinHandle,
};

use super::*;
use crate::source::{HostInterface, SourceEndpoint};

type Fallible<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;
type TestResult = Fallible<()>;

const WAIT: Duration = Duration::from_secs(15);
const NODE: &str = "n1";

/// Interfaces by address, editable while the source runs.
#[derive(Debug, Default)]
pub(super) struct FixedInterfaces(Mutex<HashMap<IpAddr, String>>);

impl FixedInterfaces {
    fn set(&self, ip: &str, interface: &str) {
        if let Ok(ip) = ip.parse() {
            self.0.lock().insert(ip, interface.to_owned());
        }
    }
}

impl InterfaceLookup for FixedInterfaces {
    fn host_interface(&self, ip: IpAddr) -> Result<String, RouteError> {
        self.0
            .lock()
            .get(&ip)
            .cloned()
            .ok_or(RouteError::Unroutable {
                ip,
                kind: "unreachable",
            })
    }
}

/// A pod as the API server stores it: `Running` on `node` with address `ip`.
fn pod(name: &str, node: &str, ip: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"namespace": "shop", "name": name,
                     "labels": {"app": name.split('-').next().unwrap_or(name),
                                "pod-template-hash": "7d4b9"}},
        "spec": {"nodeName": node, "serviceAccountName": "shop",
                 "containers": [{"name": "c", "image": "busybox"}]},
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]},
    })
}

fn key(name: &str) -> EndpointKey {
    EndpointKey::new("shop", name).unwrap_or_else(|e| panic!("{e}"))
}

fn pods() -> Gvr {
    Gvr::new("", "v1", "pods")
}

/// The source under test, and the agent's side of it: the set its events add
/// up to, as the agent's core keeps it.
struct Harness {
    server: FakeApiServer,
    interfaces: Arc<FixedInterfaces>,
    cached: CachedPods,
    events: mpsc::Receiver<SourceEvent>,
    set: BTreeMap<EndpointKey, SourceEndpoint>,
    failure: Option<SourceFailure>,
    /// The kinds of every failure reported.
    failures: Vec<&'static str>,
    resets: usize,
    filter: Option<watch::Sender<LabelFilter>>,
    /// The node's link changes, as the agent's link watch sends them.
    links: watch::Sender<u64>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Harness {
    /// Starts the source; `routes` are the interfaces of addresses, known from the start.
    async fn start(server: FakeApiServer, routes: &[(&str, &str)]) -> Fallible<Self> {
        let client = server.client()?;
        Self::start_with(server, client, routes).await
    }

    /// Starts the source on `client`.
    async fn start_with(
        server: FakeApiServer,
        client: Client,
        routes: &[(&str, &str)],
    ) -> Fallible<Self> {
        let timing = Timing {
            resync: Duration::from_millis(100),
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(200),
        };
        Self::launch(server, client, routes, timing).await
    }

    /// Starts the source on `client` with `timing`.
    async fn launch(
        server: FakeApiServer,
        client: Client,
        routes: &[(&str, &str)],
        timing: Timing,
    ) -> Fallible<Self> {
        let interfaces = Arc::new(FixedInterfaces::default());
        for (ip, interface) in routes {
            interfaces.set(ip, interface);
        }
        let mut source = PodSource::new(client, NodeName::new(NODE)?, interfaces.clone(), timing);
        let (links, link_changes) = watch::channel(0);
        source.watch_routes(link_changes);
        let cached = source.cached_pods();
        let filter = source.label_filter();
        let (tx, events) = mpsc::channel(64);
        let (stop, shutdown) = watch::channel(false);
        let task = tokio::spawn(Box::new(source).run(tx, shutdown));
        Ok(Self {
            server,
            interfaces,
            cached,
            events,
            set: BTreeMap::new(),
            failure: None,
            failures: Vec::new(),
            resets: 0,
            filter,
            links,
            stop,
            task,
        })
    }

    /// The next event, applied to the set.
    async fn next(&mut self) -> Fallible<SourceEvent> {
        let event = tokio::time::timeout(WAIT, self.events.recv())
            .await
            .map_err(|_| "no event from the source in time")?
            .ok_or("the source stopped")?;
        match &event {
            SourceEvent::Reset(set) => {
                self.resets += 1;
                self.failure = None;
                self.set = set.iter().map(|e| (e.key.clone(), e.clone())).collect();
            }
            SourceEvent::Upsert(endpoint) => {
                self.failure = None;
                self.set.insert(endpoint.key.clone(), endpoint.clone());
            }
            SourceEvent::Delete(key) => {
                self.failure = None;
                self.set.remove(key);
            }
            SourceEvent::Failed(failure) => {
                self.failures.push(failure.kind);
                self.failure = Some(failure.clone());
            }
        }
        Ok(event)
    }

    /// Takes events until `done` holds.
    async fn until(&mut self, what: &str, done: impl Fn(&Self) -> bool) -> TestResult {
        let deadline = tokio::time::Instant::now() + WAIT;
        while !done(self) {
            if tokio::time::Instant::now() > deadline {
                return Err(format!("{what}: not reached; set {:?}", self.names()).into());
            }
            self.next().await?;
        }
        Ok(())
    }

    fn names(&self) -> Vec<&str> {
        self.set.keys().map(EndpointKey::name).collect()
    }

    /// Waits until the source has opened `n` watches that were answered 200.
    async fn wait_for_watches(&self, n: usize) -> TestResult {
        let deadline = tokio::time::Instant::now() + WAIT;
        while self
            .server
            .requests()
            .watches_of("pods")
            .iter()
            .filter(|w| w.code == 200)
            .count()
            < n
        {
            if tokio::time::Instant::now() > deadline {
                return Err(format!("fewer than {n} watches").into());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    }

    /// Checks that no event arrives for `quiet`.
    async fn quiet(&mut self, quiet: Duration) -> TestResult {
        match tokio::time::timeout(quiet, self.events.recv()).await {
            Err(_) => Ok(()),
            Ok(event) => Err(format!("unexpected event {event:?}").into()),
        }
    }

    async fn stop(self) -> TestResult {
        let _ = self.stop.send(true);
        tokio::time::timeout(WAIT, self.task)
            .await
            .map_err(|_| "the source did not stop")??;
        Ok(())
    }
}

/// Every request the source made was a list or watch of pods, cluster-wide
/// (pods of any namespace), selecting this node's pods and nothing else; every
/// list asked for resourceVersion 0 without a limit, and the watch cache served
/// it (none read etcd).
fn assert_only_this_nodes_pods(server: &FakeApiServer) {
    let requests = server.requests();
    assert!(!requests.is_empty());
    for r in &requests {
        assert!(
            r.resource == "pods"
                && matches!(r.verb, Verb::List | Verb::Watch)
                && r.namespace.is_none()
                && r.field_selector.as_deref() == Some("spec.nodeName=n1")
                && r.label_selector.is_none(),
            "{} {} ?{:?}",
            r.verb.as_str(),
            r.path,
            r.query
        );
    }
    for r in requests.lists_of("pods") {
        assert!(
            r.param("resourceVersion") == Some("0")
                && r.param("limit").is_none()
                && r.list_source == (r.code == 200).then_some(ListSource::Cache),
            "a list not served from the watch cache: ?{:?} {:?}",
            r.query,
            r.list_source
        );
    }
    assert!(requests.storage_lists_of("pods").is_empty());
}

/// The lists of pods the source made.
fn lists(server: &FakeApiServer) -> usize {
    server.requests().lists_of("pods").len()
}

#[tokio::test]
async fn pods_of_this_node_appear_with_their_identity_labels() -> TestResult {
    let server = FakeApiServer::start().await?;
    let mut host = pod("host-0", NODE, "192.0.2.10");
    host["spec"]["hostNetwork"] = json!(true);
    let mut pending = pod("pending-0", NODE, "");
    pending["status"] = json!({"phase": "Pending"});
    let mut done = pod("job-0", NODE, "10.1.0.7");
    done["status"]["phase"] = json!("Succeeded");
    let mut failed = pod("job-1", NODE, "10.1.0.8");
    failed["status"]["phase"] = json!("Failed");
    let mut dual = pod("db-0", NODE, "10.1.0.6");
    dual["status"]["podIPs"] = json!([{"ip": "10.1.0.6"}, {"ip": "fd00::6"}]);
    dual["spec"]["serviceAccountName"] = json!(null);
    server.insert_many([
        pod("web-0", NODE, "10.1.0.5"),
        dual,
        pod("web-1", "n2", "10.2.0.5"),
        host,
        pending,
        done,
        failed,
    ])?;
    let mut h = Harness::start(server, &[("10.1.0.5", "calia1"), ("fd00::6", "calia2")]).await?;

    let SourceEvent::Reset(set) = h.next().await? else {
        return Err("the first event is the full set".into());
    };
    let names: Vec<&str> = set.iter().map(|e| e.key.name()).collect();
    assert_eq!(names, ["db-0", "web-0"], "sorted; nothing else");
    assert_eq!(h.cached.get(), 2);

    let web = &h.set[&key("web-0")];
    assert_eq!(web.interface, HostInterface::Named("calia1".into()));
    assert_eq!(
        web.labels,
        BTreeMap::from([("app".to_owned(), "web".to_owned())]),
        "filtered in the projection"
    );
    let labels = LabelSet::for_pod(
        &web.labels,
        web.key.namespace(),
        &web.service_account,
        &LabelFilter::default(),
        &LabelLimits::default(),
    )?;
    assert_eq!(
        labels.to_strings(),
        [
            "k8s:app=web",
            "k8s:io.kubernetes.pod.namespace=shop",
            "k8s:io.kubernetes.pod.serviceaccount=shop",
        ]
    );
    let db = &h.set[&key("db-0")];
    assert_eq!(db.service_account, "default");
    assert_eq!(db.ips.len(), 2);
    assert_eq!(
        db.interface,
        HostInterface::Named("calia2".into()),
        "the first address that leads somewhere"
    );

    assert_only_this_nodes_pods(&h.server);
    assert_eq!(h.server.requests().lists_of("pods").len(), 1);
    h.stop().await
}

#[tokio::test]
async fn changes_to_pods_follow() -> TestResult {
    let server = FakeApiServer::start().await?;
    server.insert_many([
        pod("web-0", NODE, "10.1.0.5"),
        pod("web-1", NODE, "10.1.0.6"),
    ])?;
    let mut h = Harness::start(server, &[("10.1.0.5", "calia1"), ("10.1.0.6", "calia2")]).await?;
    h.until("listed", |h| h.resets == 1).await?;
    assert_eq!(h.names(), ["web-0", "web-1"]);

    // A new pod, first without an address, then with one.
    let mut new = pod("api-0", NODE, "10.1.0.9");
    new["status"] = json!({"phase": "Pending"});
    h.server.insert(&new)?;
    h.server.insert(pod("web-9", "n2", "10.2.0.9"))?;
    h.interfaces.set("10.1.0.9", "calia9");
    h.server.insert(pod("api-0", NODE, "10.1.0.9"))?;
    let SourceEvent::Upsert(api) = h.next().await? else {
        return Err("the pod with an address is upserted".into());
    };
    assert_eq!(api.key, key("api-0"));
    assert_eq!(api.interface, HostInterface::Named("calia9".into()));

    // A change only to a label the filter drops says nothing; one it keeps does.
    h.server.modify(&pods(), Some("shop"), "web-0", |p| {
        p["metadata"]["labels"]["pod-template-hash"] = json!("other");
    })?;
    h.server.modify(&pods(), Some("shop"), "web-0", |p| {
        p["metadata"]["labels"]["tier"] = json!("front");
    })?;
    let SourceEvent::Upsert(web) = h.next().await? else {
        return Err("the relabelled pod is upserted".into());
    };
    assert_eq!(web.key, key("web-0"));
    assert_eq!(web.labels.get("tier").map(String::as_str), Some("front"));

    // A pod that ends its run goes; so does a deleted one.
    h.server.modify(&pods(), Some("shop"), "web-1", |p| {
        p["status"]["phase"] = json!("Succeeded");
    })?;
    assert_eq!(h.next().await?, SourceEvent::Delete(key("web-1")));
    h.server.delete(&pods(), Some("shop"), "api-0");
    assert_eq!(h.next().await?, SourceEvent::Delete(key("api-0")));
    assert_eq!(h.names(), ["web-0"]);
    assert_eq!(h.cached.get(), 1);

    // The sandbox is re-created with a new device: the periodic lookup sees it.
    h.interfaces.set("10.1.0.5", "calib7");
    let SourceEvent::Upsert(moved) = h.next().await? else {
        return Err("the new interface is upserted".into());
    };
    assert_eq!(moved.interface, HostInterface::Named("calib7".into()));
    h.quiet(Duration::from_millis(300)).await?;
    assert_eq!(h.resets, 1, "no re-list while the watch is healthy");
    assert_only_this_nodes_pods(&h.server);
    h.stop().await
}

#[tokio::test]
async fn a_pod_without_a_route_is_kept_with_the_reason() -> TestResult {
    let server = FakeApiServer::start().await?;
    server.insert(pod("web-0", NODE, "10.1.0.5"))?;
    let mut h = Harness::start(server, &[]).await?;
    h.until("listed", |h| h.resets == 1).await?;
    let HostInterface::Unknown(why) = &h.set[&key("web-0")].interface else {
        return Err("no route, no interface".into());
    };
    assert_eq!(why, "no route to 10.1.0.5 (unreachable)");
    h.interfaces.set("10.1.0.5", "calia1");
    h.until("found later", |h| {
        h.set[&key("web-0")].interface == HostInterface::Named("calia1".into())
    })
    .await?;
    h.stop().await
}

/// A pod whose device appears after it (a CNI plugin wiring it late) is looked up
/// again at the node's next link change, not only at the periodic lookup (an hour
/// here).
#[tokio::test]
async fn a_device_that_appears_after_its_pod_is_found_at_the_next_link_change() -> TestResult {
    let server = FakeApiServer::start().await?;
    server.insert(pod("web-0", NODE, "10.1.0.5"))?;
    let client = server.client()?;
    let timing = Timing {
        resync: Duration::from_secs(3600),
        initial_backoff: Duration::from_millis(20),
        max_backoff: Duration::from_millis(200),
    };
    let mut h = Harness::launch(server, client, &[], timing).await?;
    h.until("listed", |h| h.resets == 1).await?;
    assert!(
        matches!(h.set[&key("web-0")].interface, HostInterface::Unknown(_)),
        "no route yet"
    );
    h.interfaces.set("10.1.0.5", "calia1");
    h.links.send_modify(|n| *n += 1);
    h.until("found at the link change", |h| {
        h.set[&key("web-0")].interface == HostInterface::Named("calia1".into())
    })
    .await?;
    h.stop().await
}

/// The watch goes away and history is compacted while pods come and go: the
/// deletes are never seen as events, and the re-list's reset forgets them.
#[tokio::test]
async fn a_restarted_watch_forgets_what_was_deleted_meanwhile() -> TestResult {
    let server = FakeApiServer::start().await?;
    server.insert_many((0..6).map(|i| pod(&format!("web-{i}"), NODE, &format!("10.1.0.{i}"))))?;
    let mut h = Harness::start(server, &[]).await?;
    h.until("listed", |h| h.resets == 1 && h.set.len() == 6)
        .await?;

    // A dropped watch.
    h.server.faults().drop_watches();
    h.server.delete(&pods(), Some("shop"), "web-0");
    h.server.delete(&pods(), Some("shop"), "web-1");
    h.until("after a dropped watch", |h| {
        h.names() == ["web-2", "web-3", "web-4", "web-5"]
    })
    .await?;

    // An outage, with history compacted: a resume from the last resourceVersion
    // is answered 410, and only a new list can tell what is gone.
    let lists = h.server.requests().lists_of("pods").len();
    h.server.faults().go_down(DownMode::Refuse);
    h.until("the outage is seen", |h| h.failure.is_some())
        .await?;
    h.server.delete(&pods(), Some("shop"), "web-2");
    h.server.delete(&pods(), Some("shop"), "web-3");
    h.server.insert(pod("web-7", NODE, "10.1.0.7"))?;
    h.server.modify(&pods(), Some("shop"), "web-4", |p| {
        p["metadata"]["labels"]["app"] = json!("api");
    })?;
    h.server.faults().compact();
    let resets = h.resets;
    h.server.faults().come_up();
    h.until("re-listed", |h| h.resets > resets).await?;
    assert_eq!(
        h.names(),
        ["web-4", "web-5", "web-7"],
        "exactly the pods that exist"
    );
    assert_eq!(
        h.set[&key("web-4")].labels.get("app").map(String::as_str),
        Some("api")
    );
    assert_eq!(h.cached.get(), 3);
    assert!(h.failure.is_none(), "synced again");
    assert!(h.server.requests().lists_of("pods").len() > lists);
    assert_only_this_nodes_pods(&h.server);
    h.stop().await
}

/// History is compacted while the watch is being resumed: the resume gets an
/// in-stream 410, and the list that follows drops the pod deleted in between.
#[tokio::test]
async fn a_history_compaction_while_watching_ends_in_the_right_set() -> TestResult {
    let server = FakeApiServer::start().await?;
    server.insert_many((0..4).map(|i| pod(&format!("web-{i}"), NODE, &format!("10.1.0.{i}"))))?;
    let mut h = Harness::start(server, &[]).await?;
    h.until("listed", |h| h.resets == 1 && h.set.len() == 4)
        .await?;
    h.server.delete(&pods(), Some("shop"), "web-0");
    h.until("a delete seen live", |h| h.set.len() == 3).await?;

    // Watches start late: the delete and the compaction come first.
    let late = h.server.faults().delay(
        RequestFilter::resource("pods").verb(Verb::Watch),
        Duration::from_millis(300),
    );
    h.server.faults().drop_watches();
    h.server.delete(&pods(), Some("shop"), "web-1");
    h.server.faults().compact();
    h.until("re-listed", |h| h.resets == 2).await?;
    h.server.faults().remove(late);
    assert_eq!(h.failures, ["expired"], "the resume was answered 410 Gone");
    assert_eq!(h.names(), ["web-2", "web-3"]);
    assert_eq!(h.cached.get(), 2);
    assert_eq!(h.server.requests().lists_of("pods").len(), 2);
    h.quiet(Duration::from_millis(300)).await?;
    assert_only_this_nodes_pods(&h.server);
    h.stop().await
}

#[tokio::test]
async fn a_pod_that_cannot_be_read_is_skipped_with_a_warning() -> TestResult {
    let logs = CapturedLogs::default();
    let _guard = tracing::subscriber::set_default(logs.subscriber());
    let server = FakeApiServer::start().await?;
    let mut broken = pod("broken-0", NODE, "10.1.0.9");
    broken["status"]["podIPs"] = json!("10.1.0.9");
    server.insert_many([pod("web-0", NODE, "10.1.0.5"), broken])?;
    let mut h = Harness::start(server, &[]).await?;
    h.until("listed", |h| h.resets == 1).await?;
    assert_eq!(h.names(), ["web-0"], "the list is not lost for one bad pod");
    let warning = logs
        .lines()
        .into_iter()
        .find(|l| l.contains("skipping a pod that cannot be read"))
        .ok_or_else(|| format!("no warning in:\n{}", logs.text()))?;
    assert!(
        warning.contains("WARN")
            && warning.contains("pod=shop/broken-0")
            && warning.contains("problem=\"status: invalid type: string"),
        "{warning}"
    );

    // A pod that turns unreadable keeps what the agent had for it, through a
    // change and through a re-list.
    h.server.modify(&pods(), Some("shop"), "web-0", |p| {
        p["spec"]["hostNetwork"] = json!("yes");
    })?;
    h.server.insert(pod("web-1", NODE, "10.1.0.6"))?;
    h.until("the next pod", |h| h.set.len() == 2).await?;
    assert!(logs.contains("pod=shop/web-0"), "{}", logs.text());
    h.server.faults().go_down(DownMode::Refuse);
    h.until("the outage is seen", |h| h.failure.is_some())
        .await?;
    h.server.faults().come_up();
    h.until("re-listed", |h| h.resets == 2).await?;
    assert_eq!(h.names(), ["web-0", "web-1"]);
    h.stop().await
}

#[tokio::test]
async fn an_api_server_that_goes_down_keeps_the_last_set() -> TestResult {
    let server = FakeApiServer::start().await?;
    server.insert_many([
        pod("web-0", NODE, "10.1.0.5"),
        pod("web-1", NODE, "10.1.0.6"),
    ])?;
    let mut h = Harness::start(server, &[]).await?;
    h.until("listed", |h| h.resets == 1).await?;
    let before = h.set.clone();

    h.server.faults().go_down(DownMode::Refuse);
    h.until("the outage is reported", |h| h.failure.is_some())
        .await?;
    let failure = h.failure.clone().ok_or("no failure")?;
    assert!(matches!(failure.kind, "watch" | "list"), "{failure:?}");
    assert!(
        failure.detail.starts_with("not synced: the watch failed: "),
        "{}",
        failure.detail
    );
    // Retries go on (with backoff) and say nothing new; the set stays.
    tokio::time::sleep(Duration::from_millis(500)).await;
    while let Ok(event) = h.events.try_recv() {
        assert!(matches!(event, SourceEvent::Failed(_)), "{event:?}");
    }
    assert_eq!(h.set, before);
    assert_eq!(h.cached.get(), 2);

    h.server.faults().come_up();
    h.until("synced again", |h| h.resets == 2).await?;
    assert_eq!(h.set, before);
    assert!(h.failure.is_none());
    assert_eq!(lists(&h.server), 1, "the watch resumed; nothing was listed");
    assert_only_this_nodes_pods(&h.server);
    h.stop().await
}

/// The projection keeps every label of the node's pods: a new filter is applied
/// to it at once, without asking the API server.
#[tokio::test]
async fn a_new_label_filter_applies_without_a_list() -> TestResult {
    let server = FakeApiServer::start().await?;
    server.insert(pod("web-0", NODE, "10.1.0.5"))?;
    let mut h = Harness::start(server, &[]).await?;
    h.until("listed", |h| h.resets == 1).await?;
    assert!(
        !h.set[&key("web-0")]
            .labels
            .contains_key("pod-template-hash")
    );
    let filter = h.filter.clone().ok_or("the pod source takes the filter")?;
    filter.send_replace(LabelFilter::new(Vec::new(), Vec::new(), false));
    h.until("applied", |h| h.resets == 2).await?;
    assert_eq!(
        h.set[&key("web-0")]
            .labels
            .get("pod-template-hash")
            .map(String::as_str),
        Some("7d4b9"),
        "kept now"
    );
    // A filter that changes no endpoint says nothing.
    filter.send_replace(LabelFilter::new(Vec::new(), Vec::new(), false));
    h.quiet(Duration::from_millis(300)).await?;
    assert_eq!(lists(&h.server), 1, "no list for a new filter");
    assert_only_this_nodes_pods(&h.server);
    h.stop().await
}

/// A watch that breaks off (an API server restart) resumes from the last
/// resourceVersion: what happened meanwhile is replayed, nothing is listed, and
/// the agent hears of no failure.
#[tokio::test]
async fn a_dropped_watch_resumes_without_a_list() -> TestResult {
    let server = FakeApiServer::start().await?;
    server.insert_many((0..3).map(|i| pod(&format!("web-{i}"), NODE, &format!("10.1.0.{i}"))))?;
    let mut h = Harness::start(server, &[]).await?;
    h.until("listed", |h| h.resets == 1 && h.set.len() == 3)
        .await?;
    let version = h.server.resource_version();
    h.wait_for_watches(1).await?;
    // The resume comes late: the changes are made while no watch is open.
    let late = h.server.faults().delay(
        RequestFilter::resource("pods").verb(Verb::Watch),
        Duration::from_millis(200),
    );
    h.server.faults().drop_watches();
    h.server.delete(&pods(), Some("shop"), "web-0");
    h.server.insert(pod("web-9", NODE, "10.1.0.9"))?;
    h.until("the changes made while the watch was down", |h| {
        h.names() == ["web-1", "web-2", "web-9"]
    })
    .await?;
    h.server.faults().remove(late);
    h.wait_for_watches(2).await?;
    assert_eq!(
        lists(&h.server),
        1,
        "the watch resumed; nothing was listed again"
    );
    assert_eq!(h.resets, 1);
    assert!(h.failures.is_empty(), "{:?}", h.failures);
    let watches = h.server.requests().watches_of("pods");
    for w in &watches[1..] {
        let from: u64 = w
            .param("resourceVersion")
            .ok_or("a resume names its version")?
            .parse()?;
        assert!(from >= version, "resumed from {from}, listed at {version}");
    }
    assert_only_this_nodes_pods(&h.server);
    h.stop().await
}

/// A resume answered 500 is reported and tried again from the same
/// resourceVersion; the first event of the watch that works says the set is
/// whole again (a `Reset` of what the source holds, not a list).
#[tokio::test]
async fn a_failed_resume_is_retried_without_a_list() -> TestResult {
    let server = FakeApiServer::start().await?;
    server.insert_many([
        pod("web-0", NODE, "10.1.0.5"),
        pod("web-1", NODE, "10.1.0.6"),
    ])?;
    let mut h = Harness::start(server, &[]).await?;
    h.until("listed", |h| h.resets == 1).await?;
    h.wait_for_watches(1).await?;
    h.server.faults().fail_next(
        RequestFilter::resource("pods").verb(Verb::Watch),
        3,
        Failure::InternalError,
    );
    h.server.faults().drop_watches();
    h.server.delete(&pods(), Some("shop"), "web-1");
    h.until("the failure is reported", |h| h.failure.is_some())
        .await?;
    let failure = h.failure.clone().ok_or("no failure")?;
    h.until("synced again", |h| h.failure.is_none() && h.resets == 2)
        .await?;
    assert_eq!(
        lists(&h.server),
        1,
        "the resume was retried; nothing was listed"
    );
    assert_eq!(failure.kind, "watch");
    assert!(
        failure.detail.starts_with("not synced: the watch failed: "),
        "{}",
        failure.detail
    );
    h.until("the delete made meanwhile", |h| h.names() == ["web-0"])
        .await?;
    assert_eq!(h.failures, ["watch"], "reported once");
    assert_eq!(lists(&h.server), 1);
    let codes: Vec<u16> = h
        .server
        .requests()
        .watches_of("pods")
        .iter()
        .map(|w| w.code)
        .collect();
    assert_eq!(codes, [200, 500, 500, 500, 200]);
    assert_only_this_nodes_pods(&h.server);
    h.stop().await
}

/// Over the API server's rate limit, a resume is answered 429 with
/// `Retry-After`; kube's client waits that long and tries again, and the watch
/// resumes without a list.
#[tokio::test]
async fn a_throttled_resume_waits_and_resumes_without_a_list() -> TestResult {
    let server = FakeApiServer::start().await?;
    server.insert(pod("web-0", NODE, "10.1.0.5"))?;
    let mut h = Harness::start(server, &[]).await?;
    h.until("listed", |h| h.resets == 1).await?;
    h.wait_for_watches(1).await?;
    let limit = h.server.faults().limit_rate(
        RequestFilter::resource("pods").verb(Verb::Watch),
        RateLimit::after(0, 1),
    );
    h.server.faults().drop_watches();
    let throttled = h
        .server
        .wait_for_request(|r| r.verb == Verb::Watch && r.code == 429, WAIT)
        .await
        .ok_or("the resume is throttled")?;
    h.server.faults().remove(limit);
    h.server.insert(pod("web-1", NODE, "10.1.0.6"))?;
    h.until("the pod added after", |h| h.set.len() == 2).await?;
    let watches = h.server.requests().watches_of("pods");
    let after = watches
        .iter()
        .find(|w| w.at > throttled.at && w.code == 200)
        .ok_or("a watch after the 429")?;
    assert!(
        after.at - throttled.at >= Duration::from_secs(1),
        "Retry-After is honoured: {:?}",
        after.at - throttled.at
    );
    assert_eq!(lists(&h.server), 1);
    assert_only_this_nodes_pods(&h.server);
    h.stop().await
}

/// A resume answered 429 whose Status names `retryAfterSeconds` (here with
/// kube's own retries off, so the source sees it) waits at least that long,
/// however short the backoff, then resumes without a list.
#[tokio::test]
async fn a_throttled_resume_waits_the_status_retry_after_seconds() -> TestResult {
    let server = FakeApiServer::start().await?;
    server.insert(pod("web-0", NODE, "10.1.0.5"))?;
    let mut config = server.kube_config()?;
    config.default_retry = false;
    let client = Client::try_from(config)?;
    let mut h = Harness::start_with(server, client, &[]).await?;
    h.until("listed", |h| h.resets == 1).await?;
    h.wait_for_watches(1).await?;
    h.server.faults().fail_next(
        RequestFilter::resource("pods").verb(Verb::Watch),
        1,
        Failure::TooManyRequests {
            retry_after_secs: 2,
        },
    );
    h.server.faults().drop_watches();
    h.until("the throttling is reported", |h| h.failure.is_some())
        .await?;
    h.until("synced again", |h| h.failure.is_none() && h.resets == 2)
        .await?;
    assert_eq!(h.failures, ["throttled"]);
    let watches = h.server.requests().watches_of("pods");
    let codes: Vec<u16> = watches.iter().map(|w| w.code).collect();
    assert_eq!(codes, [200, 429, 200]);
    let waited = watches[2].at - watches[1].at;
    assert!(
        waited >= Duration::from_secs(2),
        "retryAfterSeconds is honoured: {waited:?}"
    );
    assert_eq!(lists(&h.server), 1);
    assert_only_this_nodes_pods(&h.server);
    h.stop().await
}

/// A pod being deleted (Terminating) keeps its endpoint through its grace
/// period, with its IP, until its kubelet confirms and it is gone; a pod that
/// has Succeeded or Failed goes at once.
#[tokio::test]
async fn a_terminating_pod_keeps_its_endpoint_until_it_is_gone() -> TestResult {
    use kube::api::DeleteParams;

    let server = FakeApiServer::start().await?;
    server.insert_many([
        pod("web-0", NODE, "10.1.0.5"),
        pod("job-0", NODE, "10.1.0.6"),
        pod("job-1", NODE, "10.1.0.7"),
    ])?;
    let mut h = Harness::start(server, &[]).await?;
    h.until("listed", |h| h.set.len() == 3).await?;
    let api: Api<PodObject> = Api::namespaced(h.server.client()?, "shop");
    api.delete("web-0", &DeleteParams::default()).await?;
    let terminating = h
        .server
        .get(&pods(), Some("shop"), "web-0")
        .ok_or("a running pod stays while it terminates")?;
    assert!(terminating["metadata"]["deletionTimestamp"].is_string());
    h.quiet(Duration::from_millis(300)).await?;
    assert!(h.set.contains_key(&key("web-0")), "still an endpoint");

    h.server.end_pod("shop", "job-0", PodEnd::Succeeded)?;
    assert_eq!(h.next().await?, SourceEvent::Delete(key("job-0")));
    h.server.end_pod("shop", "job-1", PodEnd::Failed)?;
    assert_eq!(h.next().await?, SourceEvent::Delete(key("job-1")));

    h.server
        .confirm_pod_deletion("shop", "web-0")
        .ok_or("web-0 is terminating")?;
    assert_eq!(h.next().await?, SourceEvent::Delete(key("web-0")));
    assert!(h.set.is_empty());
    assert_eq!(lists(&h.server), 1);
    assert!(h.server.requests().storage_lists_of("pods").is_empty());
    h.stop().await
}

/// The whole agent on the pod source (a real operator in process, an in-memory
/// datapath): pods get identities; while the API server is away the datapath
/// and the last set stay and `/readyz` says the source is not synced; back,
/// the re-list's reset removes what was deleted meanwhile.
#[tokio::test]
async fn the_agent_stays_fail_static_while_the_api_server_is_away() -> TestResult {
    use census_testkit::{Operator, until_some};

    use crate::{
        daemon::{self, Options},
        host::HostIps,
        reconcile::{MapKey, fake::FakeMaps},
    };

    let dir = tempfile::tempdir()?;
    let op = Operator::for_agents(dir.path(), 0).await?;
    let server = FakeApiServer::start().await?;
    server.insert_many([
        pod("web-0", NODE, "198.18.1.2"),
        pod("web-1", NODE, "198.18.2.2"),
        pod("db-0", NODE, "198.18.3.2"),
        pod("web-9", "n2", "198.18.9.2"),
    ])?;
    let interfaces = Arc::new(FixedInterfaces::default());
    let mut maps = FakeMaps::default();
    for i in 1..=3 {
        interfaces.set(&format!("198.18.{i}.2"), &format!("veth{i}"));
        maps.interfaces.insert(format!("veth{i}"));
    }
    let maps = Arc::new(Mutex::new(maps));
    let quick = Duration::from_millis(200);
    let timing = Timing {
        resync: quick,
        initial_backoff: Duration::from_millis(50),
        max_backoff: Duration::from_millis(300),
    };
    let source = PodSource::new(server.client()?, NodeName::new(NODE)?, interfaces, timing);
    let options = Options {
        node: NodeName::new(NODE)?,
        operator: format!("http://{}", op.grpc_addr),
        operator_auth: crate::client::OperatorAuth::default(),
        admin_listen: "127.0.0.1:0".parse()?,
        health_listen: None,
        admin_limits: census_daemon::http::AdminLimits::default(),
        reconcile_interval: quick,
        initial_backoff: Duration::from_millis(50),
        max_backoff: Duration::from_millis(300),
        session: daemon::new_session(),
        host_ips: HostIps::Fixed(Default::default()),
        reassert_order: false,
        endpoint_map: true,
        drop_endpoint_deletes: false,
        node_hooks: None,
    };
    let running = daemon::start(options, maps.clone(), None, Box::new(source)).await?;
    let admin = running.admin_addr;
    let readyz = || async move { get(admin, "/readyz").await.ok() };

    let ready = until_some(WAIT, || async {
        let (status, body) = readyz().await?;
        (status == 200 && body.contains("endpoints: 3 programmed")).then_some(body)
    })
    .await
    .ok_or("the three pods of n1 are programmed")?;
    assert!(
        ready.contains("kubernetes pods with spec.nodeName=n1: ok"),
        "{ready}"
    );
    let id = |ip: &str| {
        let ip: IpAddr = ip.parse().ok()?;
        maps.lock()
            .entries
            .get(&MapKey::from(ip))
            .map(|e| e.identity)
    };
    let web = id("198.18.1.2").ok_or("web-0 is written")?;
    assert_eq!(id("198.18.2.2"), Some(web), "pod-template-hash is filtered");
    assert_ne!(id("198.18.3.2"), Some(web));
    assert_eq!(id("198.18.9.2"), None, "another node's pod");
    assert_eq!(maps.lock().links.len(), 3);

    let before = maps.lock().entries.clone();
    server.faults().go_down(DownMode::Refuse);
    let away = until_some(WAIT, || async {
        let (status, body) = readyz().await?;
        (status == 200 && body.contains("not synced")).then_some(body)
    })
    .await
    .ok_or("/readyz says the source is not synced, and stays ready")?;
    assert!(
        away.contains("kubernetes pods with spec.nodeName=n1: the last read failed, the last good set stays in force: not synced: the watch failed: "),
        "{away}"
    );
    server.delete(&pods(), Some("shop"), "web-1");
    tokio::time::sleep(quick * 3).await;
    assert_eq!(
        maps.lock().entries,
        before,
        "fail-static: full passes change nothing"
    );

    server.faults().come_up();
    let back = until_some(WAIT, || async {
        let (status, body) = readyz().await?;
        (status == 200 && body.contains(": ok") && id("198.18.2.2").is_none()).then_some(body)
    })
    .await
    .ok_or("synced again, without the pod deleted meanwhile")?;
    assert!(back.contains("endpoints: 2 programmed"), "{back}");
    assert_eq!(id("198.18.1.2"), Some(web));

    running.shut_down().await;
    op.shut_down().await?;
    Ok(())
}

async fn get(addr: std::net::SocketAddr, path: &str) -> Fallible<(u16, String)> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: agent\r\n\r\n").as_bytes())
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let (head, body) = response.split_once("\r\n\r\n").ok_or("no HTTP header")?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or("no HTTP status")?;
    Ok((status, body.to_owned()))
}

/// Log lines, for tests that check a warning was given.
#[derive(Debug, Clone, Default)]
pub(super) struct CapturedLogs(Arc<Mutex<Vec<u8>>>);

impl CapturedLogs {
    fn subscriber(&self) -> impl tracing::Subscriber + Send + Sync + 'static {
        let logs = self.clone();
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing::Level::DEBUG)
            .with_writer(move || logs.clone())
            .finish()
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock()).into_owned()
    }

    fn lines(&self) -> Vec<String> {
        self.text().lines().map(str::to_owned).collect()
    }

    fn contains(&self, needle: &str) -> bool {
        self.text().contains(needle)
    }
}

impl io::Write for CapturedLogs {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.lock().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
