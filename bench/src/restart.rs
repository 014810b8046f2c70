//! Restart under churn: the operator is SIGKILLed while Job pods come and go (half of
//! their delete events dropped), stays down a moment (the agents' deletes in that time
//! are lost too), and is restarted on the same store. Measured: the time until every
//! refcount (IdentityService List) and every node's endpoint count (NodeService)
//! equals the agents' truth again, and until GC deletes again. Checked over the whole
//! run: no identity deleted while an agent referenced it, and no id ever bound to two
//! label sets (the quarantine is longer than the run, so a second binding is a bug).

use std::{
    collections::BTreeMap,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use anyhow::{Context as _, bail};
use census_proto::{
    PROTOCOL_VERSION,
    pb::{self, node_service_client::NodeServiceClient},
};
use parking_lot::Mutex;
use rand::RngExt as _;
use serde::Serialize;
use tokio::time::{Instant, sleep, sleep_until};

use super::{
    agents::{Fleet, Labels, Node, NodeHandle, Pod, list_identities, pod_ip, truth_refs},
    operator::{Binary, Launch, Operator},
    plot::{Panel, Series, figure},
    presets::Restart,
    report::{Machine, Results, say, say_params},
    sample::{Metrics, Sample, Sampler},
};

#[derive(Debug, Serialize)]
struct Output<'a> {
    params: &'a Restart,
    machine: Machine,
    operator_args: Vec<String>,
    pods_created: usize,
    identities_before_kill: u64,
    restart_to_ready_seconds: f64,
    restart_to_refcounts_true_seconds: f64,
    restart_to_gc_seconds: Option<f64>,
    final_refcounts_true: bool,
    removed_while_referenced: Vec<String>,
    bound_twice: Vec<String>,
    bindings_seen: usize,
    reconnects: u64,
    rebinds: u64,
    passed: bool,
    samples: Vec<Sample>,
}

pub(crate) async fn run(binary: &Binary, results: &Results, p: Restart) -> anyhow::Result<bool> {
    say_params("preset restart", &p);
    let mut machine = Machine::now();
    say(machine.line());
    let store = tempfile::tempdir()?;
    let args = operator_args(&p);
    say(format!("operator flags: {}", args.join(" ")));
    let launch = Launch::new(store.path(), results.path("operator.log"), args.clone())?;
    let op = Operator::start(binary, launch).await?;
    let sampler = Sampler::start(op.pid, op.admin(), Duration::from_secs(1));
    let fleet = Fleet::connect(&op.grpc_url(), 2).await?;
    let nodes = start_nodes(&fleet, &p);
    let handles: Vec<NodeHandle> = nodes.iter().map(Node::handle).collect();
    let (watcher, removed_while_referenced) = check_removals(&fleet, &handles);

    sampler.set_phase("churn");
    let created = Arc::new(Mutex::new(0usize));
    let churning = Churning::start(&handles, &p, &created, 0);
    sleep(p.churn_before_kill).await;
    let before = Metrics::scrape(op.admin()).await?;
    say(format!(
        "SIGKILL after {:?} of churn ({} identities live)",
        p.churn_before_kill,
        before.identities("live")
    ));
    churning.stop();
    sampler.retarget(None);
    sampler.set_phase("down");
    let launch = op.kill().await?;
    sleep(p.downtime).await;
    let restarted = Instant::now();
    let op = Operator::start(binary, launch).await?;
    let ready = restarted.elapsed().as_secs_f64();
    sampler.retarget(Some((op.pid, op.admin())));
    sampler.set_phase("recovery");
    churning.finish().await;
    let (converged, gc) = recover(&fleet, &handles, &op, restarted).await?;
    say(format!(
        "restarted: ready after {ready:.2} s, refcounts true after {converged:.2} s, GC deleting after {}",
        gc.map_or_else(|| "(not within 60 s)".to_owned(), |g| format!("{g:.2} s"))
    ));

    // Normal operation again, then a final check.
    sampler.set_phase("churn after restart");
    let churning = Churning::start(&handles, &p, &created, 1);
    sleep(p.churn_after).await;
    churning.stop();
    churning.finish().await;
    sampler.set_phase("final");
    let final_true = final_check(&fleet, &handles).await;
    // Let a last REMOVED event, if any, reach the checker.
    sleep(Duration::from_millis(500)).await;
    watcher.abort();
    for node in nodes {
        node.stop().await;
    }
    op.stop().await?;
    let samples = sampler.stop().await;
    machine.finish();

    let bad = removed_while_referenced.lock().clone();
    let twice = fleet.observed.bound_twice.lock().clone();
    let passed = final_true && bad.is_empty() && twice.is_empty();
    let out = Output {
        params: &p,
        machine,
        operator_args: args,
        pods_created: *created.lock(),
        identities_before_kill: before.identities("live"),
        restart_to_ready_seconds: ready,
        restart_to_refcounts_true_seconds: converged,
        restart_to_gc_seconds: gc,
        final_refcounts_true: final_true,
        removed_while_referenced: bad,
        bound_twice: twice,
        bindings_seen: fleet.observed.bindings_seen(),
        reconnects: fleet.observed.reconnects.load(Ordering::Relaxed),
        rebinds: fleet.observed.rebinds.load(Ordering::Relaxed),
        passed,
        samples,
    };
    summary(&out);
    plots(results, &out.samples)?;
    results.write_json("restart.json", &out)?;
    Ok(passed)
}

/// The operator's flags: the preset's timers, every Job pod its own identity.
fn operator_args(p: &Restart) -> Vec<String> {
    let mut args = p.timers.flags();
    args.extend(
        [
            "--label-include",
            "job-name,controller-uid",
            "--adoption-window",
            "0s",
            "--log",
            "info",
        ]
        .map(String::from),
    );
    args
}

/// The preset's nodes, each with its steady pods of 100 apps over 10 namespaces.
fn start_nodes(fleet: &Fleet, p: &Restart) -> Vec<Node> {
    let apps: Vec<Labels> = (0..100)
        .map(|a| {
            Arc::new(vec![
                format!("k8s:app=service-{a}"),
                format!("k8s:io.kubernetes.pod.namespace=team-{}", a % 10),
                "k8s:io.kubernetes.pod.serviceaccount=default".into(),
            ])
        })
        .collect();
    (0..p.nodes)
        .map(|n| {
            let pods = (0..p.steady_pods_per_node)
                .map(|i| {
                    let g = n * p.steady_pods_per_node + i;
                    Pod {
                        namespace: format!("team-{}", (g % 100) % 10),
                        name: format!("service-{}-7d9f8b6c4-{g:05}", g % 100),
                        ip: pod_ip(g),
                        labels: apps[g % 100].clone(),
                    }
                })
                .collect();
            fleet.start_node(n, format!("node-{n:02}"), pods, false)
        })
        .collect()
}

/// Watches the bindings and checks every REMOVED event against the agents' state at
/// once; returns the watch's task and what it found removed while referenced.
fn check_removals(
    fleet: &Fleet,
    handles: &[NodeHandle],
) -> (tokio::task::JoinHandle<()>, Arc<Mutex<Vec<String>>>) {
    let removed_while_referenced = Arc::new(Mutex::new(Vec::new()));
    let removed = Arc::new(Mutex::new(Vec::new()));
    let watcher = {
        let bad = removed_while_referenced.clone();
        let handles = handles.to_vec();
        let fleet = fleet.clone();
        tokio::spawn(async move {
            let checker = tokio::spawn({
                let removed = removed.clone();
                async move {
                    let mut seen = 0;
                    loop {
                        let fresh: Vec<(Instant, u32)> = removed.lock()[seen..].to_vec();
                        seen += fresh.len();
                        for (_, id) in fresh {
                            if let Some(n) = handles.iter().find(|h| h.holds(id)) {
                                bad.lock().push(format!(
                                    "identity {id} removed while node {} referenced it",
                                    n.name
                                ));
                            }
                        }
                        sleep(Duration::from_millis(5)).await;
                    }
                }
            });
            let watch = super::agents::watch_bindings(&fleet, removed);
            let _ = watch.await;
            checker.abort();
        })
    };
    (watcher, removed_while_referenced)
}

/// One round of churn in the background, until stopped.
struct Churning {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Churning {
    fn start(
        handles: &[NodeHandle],
        p: &Restart,
        created: &Arc<Mutex<usize>>,
        round: usize,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(churn(
            handles.to_vec(),
            p.clone(),
            stop.clone(),
            created.clone(),
            round,
        ));
        Self { stop, task }
    }

    /// Tells the churn to stop creating.
    fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Waits for the churn to have stopped.
    async fn finish(self) {
        let _ = self.task.await;
    }
}

/// After the restart, polls (up to 60 s) until every refcount and endpoint count
/// equals the agents' truth and GC deletes again; returns the seconds from `restarted`
/// to each (GC's only if within the 60 s).
async fn recover(
    fleet: &Fleet,
    handles: &[NodeHandle],
    op: &Operator,
    restarted: Instant,
) -> anyhow::Result<(f64, Option<f64>)> {
    let mut converged = None;
    let mut gc = None;
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline && (converged.is_none() || gc.is_none()) {
        if converged.is_none() && matches_truth(fleet, handles).await.unwrap_or(false) {
            converged = Some(restarted.elapsed().as_secs_f64());
        }
        if gc.is_none()
            && let Ok(m) = Metrics::scrape(op.admin()).await
            && m.or_zero("census_gc_outcomes_total", "outcome=\"deleted\"") > 0.0
        {
            gc = Some(restarted.elapsed().as_secs_f64());
        }
        sleep(Duration::from_millis(100)).await;
    }
    let Some(converged) = converged else {
        bail!("refcounts never matched the agents' truth within 60 s of the restart");
    };
    Ok((converged, gc))
}

/// Whether the refcounts match the agents' truth again within 30 s.
async fn final_check(fleet: &Fleet, handles: &[NodeHandle]) -> bool {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if matches_truth(fleet, handles).await.unwrap_or(false) {
            return true;
        }
        sleep(Duration::from_millis(200)).await;
    }
    false
}

/// Whether the operator's refcounts and per-node endpoint counts equal the agents'.
async fn matches_truth(fleet: &Fleet, nodes: &[NodeHandle]) -> anyhow::Result<bool> {
    if !nodes.iter().all(NodeHandle::is_connected) {
        return Ok(false);
    }
    let truth = truth_refs(nodes);
    let identities = list_identities(fleet).await?;
    let refs: BTreeMap<u32, u64> = identities
        .values()
        .filter(|i| i.references > 0)
        .map(|i| (i.id, i.references))
        .collect();
    if refs != truth {
        return Ok(false);
    }
    let mut client = NodeServiceClient::new(fleet.channel(0));
    let listed = client
        .list_nodes(pb::ListNodesRequest {
            protocol_version: PROTOCOL_VERSION,
        })
        .await
        .context("ListNodes")?
        .into_inner();
    let counts: BTreeMap<String, u64> = listed
        .nodes
        .into_iter()
        .map(|n| (n.name, n.endpoints))
        .collect();
    Ok(nodes
        .iter()
        .all(|n| counts.get(&n.name).copied() == Some(n.endpoints() as u64)))
}

/// Job pods at the preset's rate over the nodes until `stop`; each is deleted after
/// its lifetime (half the delete events dropped). Returns once every pod it started is
/// gone from the agents.
async fn churn(
    nodes: Vec<NodeHandle>,
    p: Restart,
    stop: Arc<AtomicBool>,
    created: Arc<Mutex<usize>>,
    round: usize,
) {
    let every = Duration::from_secs_f64(1.0 / p.pods_per_second);
    let mut next = Instant::now();
    let mut j = 0usize;
    let mut deletes = tokio::task::JoinSet::new();
    while !stop.load(Ordering::Relaxed) {
        sleep_until(next).await;
        next += every;
        let n = j % nodes.len();
        let job = format!("r{round}-{j}");
        let uid = format!("6f1e2c3d-0000-4000-8000-{:012x}", round * 1_000_000 + j);
        let pod = Pod {
            namespace: "batch".into(),
            name: format!("backup-{job}-x2b9q"),
            ip: pod_ip(50_000 + j),
            labels: Arc::new(vec![
                "k8s:app=backup".into(),
                format!("k8s:job-name=backup-{job}"),
                format!("k8s:controller-uid={uid}"),
                "k8s:io.kubernetes.pod.namespace=batch".into(),
                "k8s:io.kubernetes.pod.serviceaccount=default".into(),
            ]),
        };
        let key = pod.key();
        let life =
            rand::rng().random_range(p.lifetime_min.as_secs_f64()..=p.lifetime_max.as_secs_f64());
        let send = (((j + 1) as f64) * p.drop_rate).floor() <= ((j as f64) * p.drop_rate).floor();
        nodes[n].create(pod);
        let node = nodes[n].clone();
        deletes.spawn(async move {
            sleep(Duration::from_secs_f64(life)).await;
            node.delete(key, send);
        });
        j += 1;
        *created.lock() += 1;
    }
    while deletes.join_next().await.is_some() {}
    for node in &nodes {
        node.flush().await;
    }
}

fn summary(o: &Output<'_>) {
    say("");
    say(format!(
        "== restart: {} nodes x {} steady pods, Job churn at {}/s ({:.0}% of deletes dropped), SIGKILL after {:?} ==",
        o.params.nodes,
        o.params.steady_pods_per_node,
        o.params.pods_per_second,
        o.params.drop_rate * 100.0,
        o.params.churn_before_kill
    ));
    say(format!(
        "Job pods created: {}; identities live before the kill: {}; agent reconnects: {}; rebinds: {}",
        o.pods_created, o.identities_before_kill, o.reconnects, o.rebinds
    ));
    say(format!(
        "after restart: ready {:.2} s, refcounts = truth {:.2} s, GC deleting again {}",
        o.restart_to_ready_seconds,
        o.restart_to_refcounts_true_seconds,
        o.restart_to_gc_seconds
            .map_or_else(|| "never (within 60 s)".to_owned(), |g| format!("{g:.2} s"))
    ));
    say(format!(
        "identities deleted while referenced: {}; ids bound to two label sets: {} (of {} bindings seen); refcounts true at the end: {}",
        o.removed_while_referenced.len(),
        o.bound_twice.len(),
        o.bindings_seen,
        o.final_refcounts_true
    ));
    for line in o
        .removed_while_referenced
        .iter()
        .chain(&o.bound_twice)
        .take(10)
    {
        say(format!("  {line}"));
    }
    say(format!(
        "result: {}",
        if o.passed { "PASSED" } else { "FAILED" }
    ));
    say(o.machine.line());
}

fn plots(results: &Results, samples: &[Sample]) -> anyhow::Result<()> {
    let t = |f: &dyn Fn(&Sample) -> f64| -> Vec<(f64, f64)> {
        samples.iter().map(|s| (s.t, f(s))).collect()
    };
    figure(
        &results.path("restart.svg"),
        "seconds",
        &[
            Panel {
                title: "identities".into(),
                y_label: "count".into(),
                series: vec![
                    Series::new("live", t(&|s| s.identities_live as f64)),
                    Series::new(
                        "released + deleting",
                        t(&|s| (s.identities_released + s.identities_deleting) as f64),
                    ),
                ],
            },
            Panel {
                title: "endpoints in views".into(),
                y_label: "count".into(),
                series: vec![Series::new("endpoints", t(&|s| s.endpoints as f64))],
            },
            Panel {
                title: "operator memory".into(),
                y_label: "MiB".into(),
                series: vec![
                    Series::new("RSS", t(&|s| s.rss_bytes as f64 / 1048576.0)),
                    Series::new(
                        "live heap",
                        t(&|s| s.heap_live_bytes.unwrap_or(0) as f64 / 1048576.0),
                    ),
                ],
            },
        ],
    )
}
