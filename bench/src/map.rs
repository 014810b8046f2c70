//! The cluster-wide endpoint map: every simulated node has its EndpointSync stream (110
//! pods) and an EndpointMap.Watch, and pods churn at 100 changes a second cluster-wide
//! (a delete and a create every 20 ms, each on a random node).
//!
//! Measured:
//! - the herd: every watcher starts at once (as after an operator restart), so every
//!   one waits for and receives a full map: the operator's CPU share, its RSS over the
//!   baseline per watcher (sampled every 50 ms while the herd lasts), how long until
//!   the last watcher has its full map;
//! - steady state: propagation latency (a pod created on one node, to its address in
//!   another node's watch; from the harness's command, so it includes the known-labels
//!   Allocate and the Upsert), bytes a second per watcher, and that each batch is
//!   encoded once (`census_map_batches_built` against `census_map_messages_sent`);
//! - one full resync alone: its time and bytes.
//!
//! Watchers read the stream as raw bytes and scan only a batch's flags and version
//! (thousands of full decodes of a 110k-entry map would measure the harness); a few
//! probe watchers decode batches of changes fully to time propagation (see
//! [`super::watchers`]).

use std::{
    net::Ipv4Addr,
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use anyhow::bail;
use rand::RngExt as _;
use serde::Serialize;
use tokio::time::{Instant, sleep};

use super::{
    agents::{Fleet, Labels, Node, NodeHandle, Pod, wide_pod_ip},
    operator::{Binary, Launch, Operator},
    presets::Map,
    report::{Machine, Results, mib, say, say_params},
    sample::{Latency, Metrics, Proc, Sample, Sampler, median},
    watchers::{Pending, Watched, spawn_watchers, watch},
};

#[derive(Debug, Serialize)]
struct Output<'a> {
    params: &'a Map,
    machine: Machine,
    operator_args: Vec<String>,
    map_entries: u64,
    baseline_rss_bytes: u64,
    herd_peak_rss_bytes: u64,
    herd_rss_bytes_per_watcher: f64,
    herd_seconds: f64,
    herd_operator_cpu_share: f64,
    herd_full_maps_built: f64,
    herd_bytes_per_watcher: f64,
    propagation: Latency,
    steady_seconds: f64,
    steady_operator_cpu_share: f64,
    steady_bytes_per_second_per_watcher: f64,
    batches_built: f64,
    batch_messages_sent: f64,
    batch_bytes_encoded: f64,
    batch_bytes_sent: f64,
    resyncs_lagged: f64,
    single_resync_seconds: f64,
    single_resync_bytes: u64,
    single_resync_entries: u64,
    watcher_gaps: u64,
    samples: Vec<Sample>,
}

/// Pods of every node, for the churn: the labels to create with, the live keys.
struct Churn {
    nodes: Vec<NodeHandle>,
    labels: Vec<Labels>,
    live: Vec<Vec<String>>,
    next_ip: usize,
    pending: Pending,
}

impl Churn {
    /// One delete and one create, each on a random node.
    fn step(&mut self, n: u64) {
        let mut rng = rand::rng();
        let victim = rng.random_range(0..self.nodes.len());
        if !self.live[victim].is_empty() {
            let key = self.live[victim].remove(0);
            self.nodes[victim].delete(key, true);
        }
        let at = rng.random_range(0..self.nodes.len());
        let ip = wide_pod_ip(self.next_ip);
        self.next_ip += 1;
        let l = self.next_ip % self.labels.len();
        let pod = Pod {
            namespace: format!("team-{}", l % 40),
            name: format!("churn-{n}-n{at:05}"),
            ip: ip.clone(),
            labels: self.labels[l].clone(),
        };
        self.live[at].push(pod.key());
        if let Ok(addr) = ip.parse::<Ipv4Addr>() {
            self.pending
                .lock()
                .insert(addr.octets().to_vec(), Instant::now());
        }
        self.nodes[at].create(pod);
    }
}

pub(crate) async fn run(binary: &Binary, results: &Results, p: Map) -> anyhow::Result<bool> {
    say_params(&format!("preset {}", p.preset), &p);
    let mut machine = Machine::now();
    say(machine.line());
    let store = tempfile::tempdir()?;
    let args = operator_args(&p);
    say(format!("operator flags: {}", args.join(" ")));
    let op = Operator::start(
        binary,
        Launch::new(store.path(), results.path("operator.log"), args.clone())?,
    )
    .await?;
    let sampler = Sampler::start(op.pid, op.admin(), Duration::from_secs(1));
    sampler.set_phase("ramp");

    let connections = p.nodes.div_ceil(p.nodes_per_connection.max(1));
    let fleet = Fleet::connect(&op.grpc_url(), connections).await?;
    let labels = label_pool(p.nodes * p.label_sets_per_node);
    say(format!(
        "ramp: {} nodes x {} pods over {connections} HTTP/2 connections",
        p.nodes, p.pods_per_node
    ));
    let (nodes, live) = ramp(&op, &fleet, &labels, &p).await?;
    sampler.set_phase("ramped");
    sleep(Duration::from_secs(3)).await;
    let baseline_rss = baseline_rss(&op).await?;

    say(format!("herd: {} watchers start at once", p.nodes));
    sampler.set_phase("herd");
    let herd = herd(&op, &fleet, &nodes, baseline_rss, &p).await?;

    sampler.set_phase("steady");
    herd.pending.lock().clear();
    herd.watched.latencies.lock().clear();
    let churn = Churn {
        nodes: nodes.iter().map(Node::handle).collect(),
        labels,
        live,
        next_ip: p.nodes * p.pods_per_node,
        pending: herd.pending.clone(),
    };
    let steady = steady(&op, churn, &herd.watched, &p).await?;
    let (single_resync_seconds, single_resync_bytes) = single_resync(&fleet, &nodes[0]).await?;
    let after = &steady.after;
    let entries = after.or_zero("census_map_entries", "kind=\"endpoint\"")
        + after.or_zero("census_map_entries", "kind=\"node_address\"");

    sampler.set_phase("stop");
    for w in herd.watchers {
        w.abort();
    }
    for node in nodes {
        node.stop().await;
    }
    op.stop().await?;
    let samples = sampler.stop().await;
    machine.finish();
    let watchers_n = p.nodes as f64;
    let delta = |name: &str, labels: &str| {
        steady.after.or_zero(name, labels) - steady.before.or_zero(name, labels)
    };
    let out = Output {
        params: &p,
        machine,
        operator_args: args,
        map_entries: entries as u64,
        baseline_rss_bytes: baseline_rss,
        herd_peak_rss_bytes: herd.peak_rss,
        herd_rss_bytes_per_watcher: (herd.peak_rss as f64 - baseline_rss as f64) / watchers_n,
        herd_seconds: herd.seconds,
        herd_operator_cpu_share: herd.cpu_share,
        herd_full_maps_built: herd.full_maps_built,
        herd_bytes_per_watcher: herd.bytes as f64 / watchers_n,
        propagation: steady.propagation,
        steady_seconds: steady.seconds,
        steady_operator_cpu_share: steady.cpu_share,
        steady_bytes_per_second_per_watcher: steady.bytes as f64 / steady.seconds / watchers_n,
        batches_built: delta("census_map_batches_built_total", ""),
        batch_messages_sent: delta("census_map_messages_sent_total", "kind=\"batch\""),
        batch_bytes_encoded: delta("census_map_encoded_bytes_total", "kind=\"batch\""),
        batch_bytes_sent: delta("census_map_sent_bytes_total", ""),
        resyncs_lagged: after.or_zero("census_map_resyncs_total", "reason=\"lagged\""),
        single_resync_seconds,
        single_resync_bytes,
        single_resync_entries: entries as u64,
        watcher_gaps: herd.watched.gaps.load(Ordering::Relaxed),
        samples,
    };
    summary(&out);
    results.write_json("map.json", &out)?;
    Ok(out.watcher_gaps == 0)
}

/// The operator's flags: the preset's map tick and resync limit, snapshots out of the way.
fn operator_args(p: &Map) -> Vec<String> {
    [
        "--snapshot-interval",
        "30s",
        "--adoption-window",
        "0s",
        "--map-tick-interval",
        &format!("{}ms", p.tick.as_millis()),
        "--map-max-resyncs",
        &p.max_resyncs.to_string(),
        "--log",
        "warn",
    ]
    .map(String::from)
    .to_vec()
}

/// `pool` label sets, spread over 40 namespaces.
fn label_pool(pool: usize) -> Vec<Labels> {
    (0..pool)
        .map(|i| {
            Arc::new(vec![
                format!("k8s:app=service-{i}"),
                "k8s:tier=backend".into(),
                format!("k8s:io.kubernetes.pod.namespace=team-{}", i % 40),
            ])
        })
        .collect()
}

/// The ramp: every node with its pods, until the operator's map holds them all.
async fn ramp(
    op: &Operator,
    fleet: &Fleet,
    labels: &[Labels],
    p: &Map,
) -> anyhow::Result<(Vec<Node>, Vec<Vec<String>>)> {
    let ramp = Instant::now();
    let (nodes, live) = start_nodes(fleet, labels, p).await?;
    map_holds(op, (p.nodes * p.pods_per_node) as f64).await?;
    say(format!(
        "ramp done in {:.1} s",
        ramp.elapsed().as_secs_f64()
    ));
    Ok((nodes, live))
}

/// Every node with its pods, started 64 at a time (each 64 connected before the
/// next); returns the nodes and the keys of each node's live pods.
async fn start_nodes(
    fleet: &Fleet,
    labels: &[Labels],
    p: &Map,
) -> anyhow::Result<(Vec<Node>, Vec<Vec<String>>)> {
    let pool = labels.len();
    let mut nodes: Vec<Node> = Vec::with_capacity(p.nodes);
    let mut live = Vec::with_capacity(p.nodes);
    for n in 0..p.nodes {
        let pods: Vec<Pod> = (0..p.pods_per_node)
            .map(|e| {
                let i = n * p.pods_per_node + e;
                let l = (n * p.label_sets_per_node + e % p.label_sets_per_node) % pool;
                Pod {
                    namespace: format!("team-{}", l % 40),
                    name: format!("service-{l}-n{n:05}e{e:03}"),
                    ip: wide_pod_ip(i),
                    labels: labels[l].clone(),
                }
            })
            .collect();
        live.push(pods.iter().map(Pod::key).collect::<Vec<_>>());
        nodes.push(fleet.start_node(n, format!("node-{n:05}"), pods, true));
        if nodes.len().is_multiple_of(64) {
            let deadline = Instant::now() + Duration::from_secs(120);
            while !nodes[nodes.len() - 64..].iter().all(|n| n.is_connected()) {
                if Instant::now() > deadline {
                    bail!("nodes did not connect within 120 s");
                }
                sleep(Duration::from_millis(20)).await;
            }
        }
    }
    Ok((nodes, live))
}

/// Waits (up to 900 s) for the operator's map to hold `expected` endpoints.
async fn map_holds(op: &Operator, expected: f64) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(900);
    loop {
        if let Ok(m) = Metrics::scrape(op.admin()).await
            && m.or_zero("census_map_entries", "kind=\"endpoint\"") >= expected
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the map never held all {expected} endpoints");
        }
        sleep(Duration::from_millis(200)).await;
    }
}

/// The operator's RSS before the herd: the median of 10 readings 100 ms apart.
async fn baseline_rss(op: &Operator) -> anyhow::Result<u64> {
    let mut rss = Vec::new();
    for _ in 0..10 {
        rss.push(Proc::read(op.pid)?.rss);
        sleep(Duration::from_millis(100)).await;
    }
    Ok(median(rss))
}

/// What the herd cost, and the watchers it left running.
struct Herd {
    watched: Arc<Watched>,
    pending: Pending,
    watchers: Vec<tokio::task::JoinHandle<()>>,
    seconds: f64,
    cpu_share: f64,
    peak_rss: u64,
    full_maps_built: f64,
    bytes: u64,
}

/// The herd: every watcher at once, until each has its full map (up to 900 s), the
/// operator's RSS sampled every 50 ms (its peak told against `baseline_rss`).
async fn herd(
    op: &Operator,
    fleet: &Fleet,
    nodes: &[Node],
    baseline_rss: u64,
    p: &Map,
) -> anyhow::Result<Herd> {
    let before_herd = Metrics::scrape(op.admin()).await?;
    let watched = Arc::new(Watched::default());
    let pending: Pending = Arc::default();
    let herd = Instant::now();
    let cpu_before = Proc::read(op.pid)?.cpu;
    let watchers = spawn_watchers(fleet, nodes, &watched, &pending, p.probes);
    let mut peak = 0;
    let deadline = Instant::now() + Duration::from_secs(900);
    while watched.synced.load(Ordering::Relaxed) < p.nodes {
        peak = peak.max(Proc::read(op.pid)?.rss);
        if Instant::now() > deadline {
            bail!(
                "only {} of {} watchers had their full map after 900 s",
                watched.synced.load(Ordering::Relaxed),
                p.nodes
            );
        }
        sleep(Duration::from_millis(50)).await;
    }
    let seconds = herd.elapsed().as_secs_f64();
    let cpu_share = (Proc::read(op.pid)?.cpu - cpu_before).as_secs_f64() / seconds;
    let after_herd = Metrics::scrape(op.admin()).await?;
    let bytes = watched.bytes.load(Ordering::Relaxed);
    say(format!(
        "herd done in {seconds:.1} s: RSS peak {} over a baseline of {}",
        mib(peak),
        mib(baseline_rss)
    ));
    Ok(Herd {
        full_maps_built: after_herd.or_zero("census_map_full_maps_built_total", "")
            - before_herd.or_zero("census_map_full_maps_built_total", ""),
        watched,
        pending,
        watchers,
        seconds,
        cpu_share,
        peak_rss: peak,
        bytes,
    })
}

/// What the steady state under churn cost.
struct Steady {
    before: Metrics,
    after: Metrics,
    seconds: f64,
    cpu_share: f64,
    bytes: u64,
    propagation: Latency,
}

/// Steady state: the churn for the preset's window, then 1 s for the last changes
/// to arrive before counting.
async fn steady(
    op: &Operator,
    mut churn: Churn,
    watched: &Watched,
    p: &Map,
) -> anyhow::Result<Steady> {
    let before = Metrics::scrape(op.admin()).await?;
    let bytes_before = watched.bytes.load(Ordering::Relaxed);
    let cpu_before = Proc::read(op.pid)?.cpu;
    let window = Instant::now();
    // One delete and one create per step: 100 changes a second at 20 ms.
    let every = Duration::from_secs_f64(2.0 / p.changes_per_second);
    let mut next = Instant::now();
    let mut n = 0u64;
    while window.elapsed() < p.steady {
        churn.step(n);
        n += 1;
        next += every;
        tokio::time::sleep_until(next).await;
    }
    let seconds = window.elapsed().as_secs_f64();
    // Let the last changes arrive before counting.
    sleep(Duration::from_secs(1)).await;
    let after = Metrics::scrape(op.admin()).await?;
    let cpu_share = (Proc::read(op.pid)?.cpu - cpu_before).as_secs_f64() / (seconds + 1.0);
    let bytes = watched.bytes.load(Ordering::Relaxed) - bytes_before;
    let propagation = Latency::of(std::mem::take(&mut *watched.latencies.lock()));
    Ok(Steady {
        before,
        after,
        seconds,
        cpu_share,
        bytes,
        propagation,
    })
}

/// One full resync alone, as `node`: its seconds and bytes.
async fn single_resync(fleet: &Fleet, node: &Node) -> anyhow::Result<(f64, u64)> {
    let alone = Arc::new(Watched::default());
    let started = Instant::now();
    let single = watch(
        fleet.channel(0),
        node.name.clone(),
        node.session,
        alone.clone(),
        None,
    );
    let single = tokio::spawn(single);
    while alone.synced.load(Ordering::Relaxed) == 0 {
        if started.elapsed() > Duration::from_secs(120) {
            bail!("a lone watcher had no full map after 120 s");
        }
        sleep(Duration::from_millis(1)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    single.abort();
    Ok((seconds, alone.bytes.load(Ordering::Relaxed)))
}

fn summary(o: &Output<'_>) {
    say("");
    say(format!(
        "== {}: {} nodes x {} pods, every node watching the map, {} changes/s ==",
        o.params.preset, o.params.nodes, o.params.pods_per_node, o.params.changes_per_second
    ));
    say(format!("map entries {}", o.map_entries));
    say(format!(
        "herd (every watcher resyncs at once, {} at a time): {:.1} s, {} full map(s) built, {:.0} KiB sent per watcher",
        o.params.max_resyncs,
        o.herd_seconds,
        o.herd_full_maps_built,
        o.herd_bytes_per_watcher / 1024.0
    ));
    say(format!(
        "  operator CPU {:.0}% of one core, RSS peak {} (baseline {}): {:.1} KiB per watcher",
        o.herd_operator_cpu_share * 100.0,
        mib(o.herd_peak_rss_bytes),
        mib(o.baseline_rss_bytes),
        o.herd_rss_bytes_per_watcher / 1024.0
    ));
    say(format!(
        "steady {:.0} s: propagation (create on one node -> upsert in another's watch) p50 {:.1} ms p99 {:.1} ms ({} samples)",
        o.steady_seconds,
        o.propagation.p50_us / 1000.0,
        o.propagation.p99_us / 1000.0,
        o.propagation.count
    ));
    say(format!(
        "  {:.0} B/s per watcher, operator CPU {:.0}% of one core",
        o.steady_bytes_per_second_per_watcher,
        o.steady_operator_cpu_share * 100.0
    ));
    say(format!(
        "  encoded once: {} batches built ({:.0} B encoded), {} batch messages sent ({:.0} B), {:.0} per batch",
        o.batches_built,
        o.batch_bytes_encoded,
        o.batch_messages_sent,
        o.batch_bytes_sent,
        o.batch_messages_sent / o.batches_built.max(1.0)
    ));
    say(format!(
        "one full resync alone: {} entries, {:.0} ms, {:.1} MiB ({:.1} B per entry)",
        o.single_resync_entries,
        o.single_resync_seconds * 1000.0,
        o.single_resync_bytes as f64 / (1024.0 * 1024.0),
        o.single_resync_bytes as f64 / o.single_resync_entries.max(1) as f64
    ));
    say(format!(
        "lagged resyncs {}, version gaps seen by watchers {}",
        o.resyncs_lagged, o.watcher_gaps
    ));
    say(o.machine.line());
}
