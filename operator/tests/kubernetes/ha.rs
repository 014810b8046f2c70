//! Two real operator processes against the fake API server (over loopback TCP, through
//! a kubeconfig): the leader is SIGKILLed, the other takes over within the lease
//! duration plus the retry period and publishes itself in the leader EndpointSlice
//! over the dead leader's address, agents (which find the leader there, as the
//! Service routes them) reconnect with jitter and snapshot again, no id is ever bound
//! to two label sets, nor a label set to two ids, and no request touches a pod.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::Path,
    process::Command,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use census_fake_apiserver::{FakeApiServer, Gvr};
use census_testkit::process::Spawned;
use tokio::task::JoinSet;
use tonic::Status;

use crate::{
    common::{TestResult, WAIT, eventually, fail, fake, identities, node},
    leader_slice::{no_pod_requests, slice_leader, slice_names},
    operator::{Agent, NAMESPACE, allocate, replica_args, seed_cluster, session},
};

const LEASE: Duration = Duration::from_secs(2);
const RETRY: Duration = Duration::from_millis(250);
const NODES: [&str; 3] = ["node-1", "node-3", "node-4"];

/// A `census-operator` process, killed when dropped.
struct Process {
    process: Spawned,
    grpc: SocketAddr,
}

impl Process {
    fn spawn(kubeconfig: &Path, pod: &str) -> TestResult<Self> {
        let process = Spawned::start(
            Command::new(env!("CARGO_BIN_EXE_census-operator")).args(replica_args(
                kubeconfig,
                pod,
                &[("--grace-period", "60s"), ("--node-ttl", "3s")],
            )),
            WAIT,
        )
        .map_err(|e| format!("operator {pod}: {e}"))?;
        Ok(Self {
            grpc: process.grpc,
            process,
        })
    }

    fn kill(&mut self) -> TestResult {
        self.process.kill();
        Ok(())
    }
}

fn holder(server: &FakeApiServer) -> Option<String> {
    server
        .get(
            &Gvr::new("coordination.k8s.io", "v1", "leases"),
            Some(NAMESPACE),
            "census-operator",
        )
        .and_then(|l| l["spec"]["holderIdentity"].as_str().map(str::to_owned))
}

/// Every answer seen: an id must stay with one label set and a label set with one id.
#[derive(Default)]
struct Bindings {
    by_id: BTreeMap<u32, String>,
    by_labels: BTreeMap<String, u32>,
}

impl Bindings {
    fn record(&mut self, id: u32, app: &str) -> TestResult {
        if let Some(was) = self.by_id.insert(id, app.to_owned())
            && was != app
        {
            return fail(format!("id {id} was bound to {was} and to {app}"));
        }
        if let Some(was) = self.by_labels.insert(app.to_owned(), id)
            && was != id
        {
            return fail(format!("{app} got ids {was} and {id}"));
        }
        Ok(())
    }
}

fn apps(node: &str) -> Vec<String> {
    let mut apps = vec!["shared-0".to_owned(), "shared-1".to_owned()];
    apps.extend((0..3).map(|k| format!("{node}-own-{k}")));
    apps
}

/// An agent's Hello, its Allocates and its snapshot, to the leader at `addr`; the
/// gRPC status of the first call refused.
async fn first_session(
    addr: SocketAddr,
    node: &str,
    bindings: &Mutex<Bindings>,
) -> TestResult<Result<FirstSession, Status>> {
    let mut stream = match Agent::connect(addr, node, session(7)).await? {
        Ok(stream) => stream,
        Err(status) => return Ok(Err(status)),
    };
    let mut ids = Vec::new();
    for app in apps(node) {
        let id = match allocate(addr, node, session(7), &app).await? {
            Ok(id) => id,
            Err(status) => return Ok(Err(status)),
        };
        bindings.lock().map_err(|_| "poisoned")?.record(id, &app)?;
        ids.push((format!("{node}-{app}"), id, app));
    }
    match stream.snapshot(&borrowed(&ids)).await? {
        Ok(rebinds) if rebinds.is_empty() => Ok(Ok((stream, ids))),
        Ok(rebinds) => fail(format!("{node}: the leader rebound {rebinds:?}")),
        Err(status) => Ok(Err(status)),
    }
}

/// The agent's stream and its `(pod, id, app)` endpoints.
type FirstSession = (Agent, Vec<(String, u32, String)>);

fn borrowed(ids: &[(String, u32, String)]) -> Vec<(&str, u32, &str)> {
    ids.iter()
        .map(|(p, i, a)| (p.as_str(), *i, a.as_str()))
        .collect()
}

/// `None` for UNAVAILABLE (try again), the test's failure for any other refusal.
fn unavailable_is_none<T>(node: &str, answer: Result<T, Status>) -> TestResult<Option<T>> {
    match answer {
        Ok(found) => Ok(Some(found)),
        Err(status) if status.code() == tonic::Code::Unavailable => {
            tracing::info!(node, %status, "unavailable; the agent starts over");
            Ok(None)
        }
        Err(status) => fail(format!("{node}: refused: {status}")),
    }
}

/// An agent's life across the failover: Hello, Allocate, Snapshot; then, when its
/// stream ends, a jittered wait, Hello to the new leader, the same snapshot, the same
/// ids again, and a new one.
async fn agent(
    server: Arc<FakeApiServer>,
    node: &'static str,
    bindings: Arc<Mutex<Bindings>>,
    killed: Arc<tokio::sync::Notify>,
) -> TestResult<Duration> {
    // Where the Service sends agents: the one endpoint of the leader slice.
    let leader_addr =
        |server: &FakeApiServer| slice_leader(server).ok().flatten().map(|(_, addr)| addr);
    // Under load a leader may still be reading the nodes when it publishes itself, or
    // lose the Lease again: it says UNAVAILABLE, and an agent starts over from the
    // slice, as census-agent does.
    let (mut stream, ids) = eventually("the agent's first session", WAIT, || {
        let (server, bindings) = (server.clone(), bindings.clone());
        let leader_addr = &leader_addr;
        async move {
            let Some(addr) = leader_addr(&server) else {
                return Ok(None);
            };
            let first = first_session(addr, node, &bindings).await?;
            unavailable_is_none(node, first)
        }
    })
    .await?;
    killed.notified().await;
    // The stream breaks with the leader.
    while stream.next().await?.is_ok() {}
    let jitter = Duration::from_millis(rand::random_range(0..500));
    tokio::time::sleep(jitter).await;
    let reconnected = Instant::now();
    let (addr, mut stream) = eventually("the agent finds the new leader", WAIT, || {
        let server = server.clone();
        let leader_addr = &leader_addr;
        async move {
            let Some(addr) = leader_addr(&server) else {
                return Ok(None);
            };
            // The slice may still hold the dead leader's address: refused, try again.
            let connected = Agent::connect(addr, node, session(7)).await;
            Ok(connected.ok().and_then(Result::ok).map(|s| (addr, s)))
        }
    })
    .await?;
    let rebinds = stream.snapshot(&borrowed(&ids)).await??;
    assert!(
        rebinds.is_empty(),
        "{node}: the new leader rebound {rebinds:?}"
    );
    for (_, id, app) in &ids {
        let again = allocate(addr, node, session(7), app).await??;
        assert_eq!(again, *id, "{node}: {app} changed id across the failover");
    }
    let fresh = format!("{node}-after");
    let id = allocate(addr, node, session(7), &fresh).await??;
    bindings
        .lock()
        .map_err(|_| "poisoned")?
        .record(id, &fresh)?;
    Ok(reconnected.elapsed() + jitter)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_is_killed_and_the_other_process_takes_over() -> TestResult {
    let server = Arc::new(fake().await?);
    seed_cluster(&server, &["op-a", "op-b"])?;
    for name in &NODES[1..] {
        server.insert(node(name, "127.0.0.1"))?;
    }
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    server.write_kubeconfig(&kubeconfig)?;
    let mut a = Process::spawn(&kubeconfig, "op-a")?;
    let mut b = Process::spawn(&kubeconfig, "op-b")?;
    let addrs: BTreeMap<String, SocketAddr> =
        [("op-a".to_owned(), a.grpc), ("op-b".to_owned(), b.grpc)].into();
    let first = eventually("a leader is elected and published", WAIT, || async {
        Ok(holder(&server).filter(|h| slice_names(&server, h)))
    })
    .await?;
    assert_eq!(
        slice_leader(&server)?.map(|(_, addr)| addr),
        Some(addrs[&first])
    );

    let bindings = Arc::new(Mutex::new(Bindings::default()));
    let killed = Arc::new(tokio::sync::Notify::new());
    let mut agents = JoinSet::new();
    for name in NODES {
        agents.spawn(agent(
            server.clone(),
            name,
            bindings.clone(),
            killed.clone(),
        ));
    }
    // Let every agent allocate and snapshot before the leader dies. An agent waits for
    // the kill, so one that ends now has failed: its error is the test's.
    let allocated = eventually("every agent allocated", WAIT, || async {
        let count = bindings.lock().map_err(|_| "poisoned")?.by_id.len();
        Ok((count == 2 + 3 * NODES.len()).then_some(()))
    });
    tokio::select! {
        done = allocated => done?,
        Some(ended) = agents.join_next() => {
            ended??;
            return fail("an agent ended before the leader was killed");
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    // The process that leads now (under load the Lease may have changed hands already).
    let first = holder(&server).ok_or("no one holds the Lease")?;
    let leader = if first == "op-a" { &mut a } else { &mut b };
    let killed_at = Instant::now();
    leader.kill()?;
    killed.notify_waiters();
    let second = eventually("the other replica takes the Lease", WAIT, || async {
        Ok(holder(&server).filter(|h| *h != first))
    })
    .await?;
    let takeover = killed_at.elapsed();
    // The test polls the fake every 20 ms: allow that, and nothing else.
    assert!(
        takeover <= LEASE + RETRY + Duration::from_millis(150),
        "takeover took {takeover:?}, more than the lease duration + retry period"
    );
    eventually(
        "the new leader publishes itself over the dead one's address",
        WAIT,
        || async { Ok(slice_names(&server, &second).then_some(())) },
    )
    .await?;
    assert_eq!(
        slice_leader(&server)?.map(|(_, addr)| addr),
        Some(addrs[&second])
    );
    while let Some(done) = agents.join_next().await {
        done??;
    }

    // The store agrees with every answer: one object per id, one id per label set.
    let objects = server.list(&identities());
    let bindings = bindings.lock().map_err(|_| "poisoned")?;
    let mut seen = BTreeMap::new();
    for obj in &objects {
        let name: u32 = obj["metadata"]["name"].as_str().ok_or("no name")?.parse()?;
        let labels = obj["spec"]["labels"].to_string();
        if let Some(other) = seen.insert(labels.clone(), name) {
            return fail(format!("ids {other} and {name} are both bound to {labels}"));
        }
    }
    assert_eq!(objects.len(), bindings.by_id.len());
    for (id, app) in &bindings.by_id {
        let obj = objects
            .iter()
            .find(|o| o["metadata"]["name"].as_str() == Some(id.to_string().as_str()))
            .ok_or(format!("no object for {id}"))?;
        assert_eq!(
            obj["spec"]["labels"],
            serde_json::json!(crate::operator::wire_labels(app))
        );
        assert!(obj["status"].is_null(), "{id} is a tombstone");
    }
    tracing::info!(?takeover, "failover");
    no_pod_requests(&server)
}
