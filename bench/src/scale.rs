//! Scale: thousands of simulated nodes x 110 endpoints with 30 s snapshots, as DESIGN.md
//! sizes one leader for (5,000 nodes: ~170 snapshots and ~18,000 entries a second),
//! each node connected as a real agent is: its own HTTP/2 connection, carrying its
//! EndpointSync stream and its EndpointMap.Watch (a raw watcher, [`super::watchers`]).
//!
//! The nodes ramp up in batches (each Allocates what no node allocated before, sends its
//! first snapshot, then opens its watch and receives the full map). Once every watcher
//! holds the whole map, the harness measures a few snapshot intervals of steady
//! state: the operator's CPU share, RSS and live heap, snapshot handling as the
//! operator times it (`census_snapshot_apply_duration_seconds`: the core's apply, under
//! its lock) and as the agents see it (send to Ack: encode, transport, decode,
//! validation, filter and apply), and memory per endpoint.
//!
//! Then the reconnect: the operator is SIGKILLed and started again on the same store
//! and ports, every node reconnects at once (Hello, snapshot) and every watcher
//! resyncs its full map. Sampled every 50 ms until every snapshot is applied and every
//! watcher holds the whole map again: the RSS and live heap peaks, in two phases
//! ("reconnect" until the last snapshot is applied, "resync" from then until the last
//! watcher has the whole map), how long each took, and the RSS one snapshot interval
//! later.
//!
//! The gate, where the preset sets bounds: the steady RSS and the reconnect's RSS peak.

use std::{
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use anyhow::{Context as _, bail};
use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
use serde::Serialize;
use tokio::{
    task::JoinHandle,
    time::{Instant, sleep},
};

use super::{
    agents::{Fleet, Labels, Node, Pod, wide_pod_ip},
    heap::{self, Owners},
    operator::{Binary, Launch, Operator},
    plot::{Panel, Series, figure},
    presets::Scale,
    report::{Machine, Results, mib, say, say_params},
    sample::{Latency, Metrics, Proc, Sample, Sampler, histogram_quantile, median},
    watchers::{Watched, keep_watching},
};

/// Descriptors a process needs besides one per connection: the store, admin scrapes,
/// the log, the runtime's own.
const SPARE_FILES: u64 = 256;

/// How often the reconnect is sampled.
const RECONNECT_SAMPLING: Duration = Duration::from_millis(50);

#[derive(Debug, Serialize)]
struct Output<'a> {
    params: &'a Scale,
    machine: Machine,
    operator_args: Vec<String>,
    connections: usize,
    /// RLIMIT_NOFILE of the harness and the operator (which inherits it).
    open_files_limit: u64,
    endpoints: u64,
    identities: u64,
    ramp_seconds: f64,
    /// From the start of the ramp until every watcher held the whole map.
    ramp_watchers_synced_seconds: f64,
    ramp_watch_bytes: u64,
    window_seconds: f64,
    snapshots_per_second: f64,
    entries_per_second: f64,
    operator_cpu_share: f64,
    harness_cpu_share: f64,
    baseline_rss_bytes: u64,
    rss_bytes: u64,
    /// Before the restart: over the ramp and the steady window.
    peak_rss_bytes: u64,
    baseline_heap_bytes: u64,
    heap_bytes: u64,
    heap_bytes_per_endpoint: f64,
    rss_bytes_per_endpoint: f64,
    apply_p50_us: Option<f64>,
    apply_p99_us: Option<f64>,
    snapshot_ack: Latency,
    allocate: Latency,
    /// The steady live heap by owner (a heap profile at the end of the steady window).
    heap_owners: Owners,
    reconnect: Reconnect,
    /// Batches a watcher saw out of version order (outside a resync), over the run.
    watcher_gaps: u64,
    gates: Vec<Gate>,
    passed: bool,
    wall_seconds: f64,
    samples: Vec<Sample>,
}

/// The operator restarted under every node and watcher.
#[derive(Debug, Serialize)]
struct Reconnect {
    /// When the restart began, in seconds of the 1 s samples (`samples[].t`).
    at_seconds: f64,
    /// From the SIGKILL until every node and watcher saw its stream end.
    down_seconds: f64,
    /// From starting the new process until it answered /readyz.
    ready_seconds: f64,
    /// From starting the new process until every node's snapshot was applied
    /// (`census_endpoints` back at every endpoint, every node connected).
    snapshots_applied_seconds: f64,
    /// From starting the new process until every watcher held the whole map again.
    seconds: f64,
    /// From every snapshot applied until the last watcher held the whole map.
    resync_seconds: f64,
    peak_rss_bytes: u64,
    peak_heap_bytes: u64,
    /// The peaks of the "resync" phase alone (`None`: it ended before a sample).
    resync_peak_rss_bytes: Option<u64>,
    resync_peak_heap_bytes: Option<u64>,
    /// Median RSS and live heap over the last 5 s of the snapshot interval after.
    settled_rss_bytes: u64,
    settled_heap_bytes: u64,
    /// The new process's CPU time over `seconds` (its start included).
    operator_cpu_share: f64,
    full_maps_built: f64,
    watch_bytes: u64,
    node_reconnects: u64,
    /// Every 50 ms, `t` from when the new process was ready.
    samples: Vec<Sample>,
}

/// A figure against its bound.
#[derive(Debug, Clone, Serialize)]
struct Gate {
    figure: &'static str,
    bound_bytes: u64,
    measured_bytes: u64,
    passed: bool,
}

pub(crate) async fn run(binary: &Binary, results: &Results, p: Scale) -> anyhow::Result<bool> {
    let wall = Instant::now();
    say_params(&format!("preset {}", p.preset), &p);
    let connections = p.nodes.div_ceil(p.nodes_per_connection.max(1));
    let open_files_limit = raise_open_files(p.preset, connections)?;
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
    sampler.set_phase("idle");
    sleep(Duration::from_secs(3)).await;
    let idle = sampler.samples();
    let baseline_rss = median(idle.iter().map(|s| s.rss_bytes).collect());
    let baseline_heap = median(idle.iter().filter_map(|s| s.heap_live_bytes).collect());

    let fleet = Fleet::connect(&op.grpc_url(), connections).await?;
    let expected = (p.nodes * p.endpoints_per_node) as u64;
    let watched = Arc::new(Watched::complete_at(expected));
    say(format!(
        "ramp: {} nodes over {connections} HTTP/2 connections, {} at a time, each watching the map",
        p.nodes, p.ramp_concurrency
    ));
    sampler.set_phase("ramp");
    let ramp = ramp(&op, &fleet, &watched, &p).await?;
    let allocate = Latency::of(fleet.observed.take_allocate_latency());
    let steady = steady(&op, &sampler, &fleet, results, &p).await?;

    say(format!(
        "reconnect: SIGKILL, restart on the same store; {} nodes reconnect and {} watchers resync at once",
        p.nodes, p.nodes
    ));
    let (op, reconnect) = restart(binary, op, &sampler, &fleet, &ramp.nodes, &watched, &p).await?;

    let (rss, heap, endpoints) = (steady.rss, steady.heap, steady.endpoints);
    let gates = gates(&p, rss, reconnect.peak_rss_bytes);
    let passed = gates.iter().all(|g| g.passed);

    sampler.set_phase("stop");
    for w in ramp.watchers {
        w.abort();
    }
    for node in ramp.nodes {
        node.stop().await;
    }
    op.stop().await?;
    let samples = sampler.stop().await;
    machine.finish();
    let window_seconds = steady.window_seconds;
    let out = Output {
        params: &p,
        machine,
        operator_args: args,
        connections,
        open_files_limit,
        endpoints,
        identities: steady.identities,
        ramp_seconds: ramp.seconds,
        ramp_watchers_synced_seconds: ramp.watchers_synced_seconds,
        ramp_watch_bytes: ramp.watch_bytes,
        window_seconds,
        snapshots_per_second: steady.snapshots / window_seconds,
        entries_per_second: steady.snapshots * p.endpoints_per_node as f64 / window_seconds,
        operator_cpu_share: steady.operator_cpu_share,
        harness_cpu_share: steady.harness_cpu_share,
        baseline_rss_bytes: baseline_rss,
        rss_bytes: rss,
        peak_rss_bytes: steady.peak_rss,
        baseline_heap_bytes: baseline_heap,
        heap_bytes: heap,
        heap_bytes_per_endpoint: (heap as f64 - baseline_heap as f64) / endpoints.max(1) as f64,
        rss_bytes_per_endpoint: (rss as f64 - baseline_rss as f64) / endpoints.max(1) as f64,
        apply_p50_us: steady.apply_p50_us,
        apply_p99_us: steady.apply_p99_us,
        snapshot_ack: steady.acks,
        allocate,
        heap_owners: steady.heap_owners,
        reconnect,
        watcher_gaps: watched.gaps.load(Ordering::Relaxed),
        gates,
        passed,
        wall_seconds: wall.elapsed().as_secs_f64(),
        samples,
    };
    summary(&out);
    plots(results, &out.samples, &out.reconnect.samples)?;
    results.write_json("scale.json", &out)?;
    report_gates(&out);
    let wall = wall.elapsed().as_secs_f64();
    say(format!("wall time {wall:.0} s ({:.1} min)", wall / 60.0));
    Ok(passed)
}

/// The operator's flags: the preset's snapshot interval, heap profiling on for the
/// owners of the live heap at steady state (sampling costs little).
fn operator_args(p: &Scale) -> Vec<String> {
    [
        "--snapshot-interval",
        &format!("{}ms", p.snapshot_interval.as_millis()),
        "--adoption-window",
        "0s",
        "--log",
        "warn",
        "--heap-profiling",
    ]
    .map(String::from)
    .to_vec()
}

/// The ramp as it went: the nodes and their watchers, and how long until the
/// endpoints and then every watcher's full map were there.
struct Ramp {
    nodes: Vec<Node>,
    watchers: Vec<JoinHandle<()>>,
    seconds: f64,
    watchers_synced_seconds: f64,
    watch_bytes: u64,
}

/// Every node started, each watching the map, until the operator holds every
/// endpoint and every watcher the whole map.
async fn ramp(
    op: &Operator,
    fleet: &Fleet,
    watched: &Arc<Watched>,
    p: &Scale,
) -> anyhow::Result<Ramp> {
    let expected = (p.nodes * p.endpoints_per_node) as u64;
    let ramp = Instant::now();
    let (nodes, watchers) = start_nodes(fleet, p, watched).await?;
    wait_for_endpoints(op, expected, Duration::from_secs(900)).await?;
    let seconds = ramp.elapsed().as_secs_f64();
    say(format!(
        "ramp done in {seconds:.1} s; waiting for every watcher's full map"
    ));
    wait_for_watchers(watched, p.nodes, Duration::from_secs(900)).await?;
    let watchers_synced_seconds = ramp.elapsed().as_secs_f64();
    let watch_bytes = watched.bytes.load(Ordering::Relaxed);
    say(format!(
        "every watcher holds the whole map after {watchers_synced_seconds:.1} s ({:.1} MiB received per watcher); measuring {} intervals",
        watch_bytes as f64 / p.nodes.max(1) as f64 / (1024.0 * 1024.0),
        p.intervals
    ));
    Ok(Ramp {
        nodes,
        watchers,
        seconds,
        watchers_synced_seconds,
        watch_bytes,
    })
}

/// The steady state as measured over the preset's intervals.
struct Steady {
    window_seconds: f64,
    /// Snapshots applied in the window.
    snapshots: f64,
    /// The operator's endpoints and live identities at the window's end.
    endpoints: u64,
    identities: u64,
    /// Median RSS and live heap over the window.
    rss: u64,
    heap: u64,
    /// Mean CPU shares over the window.
    operator_cpu_share: f64,
    harness_cpu_share: f64,
    apply_p50_us: Option<f64>,
    apply_p99_us: Option<f64>,
    acks: Latency,
    heap_owners: Owners,
    /// The highest RSS sampled so far (the ramp included).
    peak_rss: u64,
}

/// One interval to settle (every node past its first jittered timer), then the
/// preset's intervals measured, and the live heap's owners saved as `heap.pb.gz`.
async fn steady(
    op: &Operator,
    sampler: &Sampler,
    fleet: &Fleet,
    results: &Results,
    p: &Scale,
) -> anyhow::Result<Steady> {
    sampler.set_phase("settle");
    sleep(p.snapshot_interval).await;
    sampler.set_phase("steady");
    fleet.observed.take_snapshot_acks();
    let before = Metrics::scrape(op.admin()).await?;
    let from = sampler.elapsed();
    let window = Instant::now();
    sleep(p.snapshot_interval * p.intervals).await;
    let after = Metrics::scrape(op.admin()).await?;
    let window_seconds = window.elapsed().as_secs_f64();
    let acks = Latency::of(fleet.observed.take_snapshot_acks());
    let samples: Vec<Sample> = sampler.samples_since(from);
    let (heap_owners, profile) = heap::owners(op.admin()).await?;
    std::fs::write(results.path("heap.pb.gz"), profile)?;
    let peak_rss = sampler
        .samples()
        .iter()
        .map(|s| s.rss_bytes)
        .max()
        .unwrap_or(0);
    let hist = "census_snapshot_apply_duration_seconds";
    let (hb, ha) = (before.histogram(hist), after.histogram(hist));
    let mean = |f: &dyn Fn(&Sample) -> f64| {
        if samples.is_empty() {
            0.0
        } else {
            samples.iter().map(f).sum::<f64>() / samples.len() as f64
        }
    };
    Ok(Steady {
        window_seconds,
        snapshots: after.or_zero("census_snapshots_total", "")
            - before.or_zero("census_snapshots_total", ""),
        endpoints: after.or_zero("census_endpoints", "") as u64,
        identities: after.identities("live"),
        rss: median(samples.iter().map(|s| s.rss_bytes).collect()),
        heap: median(samples.iter().filter_map(|s| s.heap_live_bytes).collect()),
        operator_cpu_share: mean(&|s| s.cpu_share),
        harness_cpu_share: mean(&|s| s.harness_cpu_share),
        apply_p50_us: histogram_quantile(&hb, &ha, 0.5).map(|s| s * 1e6),
        apply_p99_us: histogram_quantile(&hb, &ha, 0.99).map(|s| s * 1e6),
        acks,
        heap_owners,
        peak_rss,
    })
}

/// Raises RLIMIT_NOFILE to its hard limit (the operator, started from this process,
/// inherits it), and fails unless it allows `connections` and some to spare: the
/// harness holds one descriptor per connection and so does the operator.
fn raise_open_files(preset: &str, connections: usize) -> anyhow::Result<u64> {
    let needed = connections as u64 + SPARE_FILES;
    let limit = getrlimit(Resource::Nofile);
    let soft = limit.current.unwrap_or(u64::MAX);
    let raised = match limit.maximum {
        Some(hard) if hard > soft => hard,
        // No hard limit: as many as needed (the kernel still caps it, at fs.nr_open).
        None if soft < needed => needed,
        _ => soft,
    };
    if raised > soft {
        setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some(raised),
                maximum: limit.maximum,
            },
        )
        .with_context(|| format!("raising RLIMIT_NOFILE from {soft} to {raised}"))?;
    }
    if raised < needed {
        let hard = limit
            .maximum
            .map_or_else(|| "unlimited".to_owned(), |h| h.to_string());
        bail!(
            "{preset} needs {needed} open files ({connections} connections + {SPARE_FILES}, in the harness and in the operator), but RLIMIT_NOFILE is {raised} (hard limit {hard}): raise the hard limit, e.g. `ulimit -Hn {needed}` as root, or LimitNOFILE= for a service"
        );
    }
    say(format!(
        "open files: RLIMIT_NOFILE {raised} (was {soft}), {needed} needed"
    ));
    Ok(raised)
}

/// Starts every node, `ramp_concurrency` at a time, each with its watch.
async fn start_nodes(
    fleet: &Fleet,
    p: &Scale,
    watched: &Arc<Watched>,
) -> anyhow::Result<(Vec<Node>, Vec<JoinHandle<()>>)> {
    let pool = p.nodes * p.label_sets_per_node;
    let label_set = |i: usize| -> Labels {
        Arc::new(vec![
            format!("k8s:app=service-{i}"),
            "k8s:app.kubernetes.io/part-of=shop".into(),
            "k8s:tier=backend".into(),
            format!("k8s:io.kubernetes.pod.namespace=team-{}", i % 40),
            "k8s:io.kubernetes.pod.serviceaccount=default".into(),
            "k8s:pod-template-hash=7d9f8b6c4".into(),
        ])
    };
    let labels: Vec<Labels> = (0..pool).map(label_set).collect();
    let mut nodes: Vec<Node> = Vec::with_capacity(p.nodes);
    let mut watchers = Vec::with_capacity(p.nodes);
    for n in 0..p.nodes {
        let pods = (0..p.endpoints_per_node)
            .map(|e| {
                let i = n * p.endpoints_per_node + e;
                let l = i % pool;
                Pod {
                    namespace: format!("team-{}", l % 40),
                    name: format!("service-{l}-7d9f8b6c4-n{n:05}e{e:03}"),
                    // Unique: the map holds one entry per endpoint.
                    ip: wide_pod_ip(i),
                    labels: labels[l].clone(),
                }
            })
            .collect();
        let node = fleet.start_node(n, format!("node-{n:05}"), pods, true);
        watchers.push(keep_watching(fleet, n, node.handle(), watched.clone()));
        nodes.push(node);
        if nodes.len().is_multiple_of(p.ramp_concurrency) {
            let batch = &nodes[nodes.len() - p.ramp_concurrency..];
            // Every node connected so far is sent the map, and the full map grows:
            // later batches wait longer.
            let deadline = Instant::now() + Duration::from_secs(300);
            while !batch.iter().all(|n| n.is_connected()) {
                if Instant::now() > deadline {
                    bail!("nodes did not connect within 300 s");
                }
                sleep(Duration::from_millis(20)).await;
            }
        }
    }
    Ok((nodes, watchers))
}

async fn wait_for_endpoints(op: &Operator, expected: u64, limit: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        if let Ok(m) = Metrics::scrape(op.admin()).await
            && m.or_zero("census_endpoints", "") as u64 == expected
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the operator never saw all {expected} endpoints");
        }
        sleep(Duration::from_millis(200)).await;
    }
}

async fn wait_for_watchers(
    watched: &Watched,
    watchers: usize,
    limit: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    while watched.complete.load(Ordering::Relaxed) < watchers {
        if Instant::now() > deadline {
            bail!(
                "only {} of {watchers} watchers held the whole map after {limit:?}",
                watched.complete.load(Ordering::Relaxed)
            );
        }
        sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// The highest RSS and live heap seen in one phase of the reconnect.
#[derive(Debug, Default, Clone, Copy)]
struct Peak {
    rss: Option<u64>,
    heap: Option<u64>,
}

impl Peak {
    fn rss(&mut self, rss: u64) {
        self.rss = self.rss.max(Some(rss));
    }

    fn sample(&mut self, s: &Sample) {
        self.rss(s.rss_bytes);
        self.heap = self.heap.max(s.heap_live_bytes);
    }
}

/// SIGKILLs the operator, waits until every node and watcher saw it go, starts it
/// again on the same store and ports (the nodes' channels reconnect by themselves)
/// and samples it until every node's snapshot is applied and every watcher holds the
/// whole map; then one snapshot interval more, to see where it settles.
async fn restart(
    binary: &Binary,
    op: Operator,
    sampler: &Sampler,
    fleet: &Fleet,
    nodes: &[Node],
    watched: &Watched,
    p: &Scale,
) -> anyhow::Result<(Operator, Reconnect)> {
    let expected = (p.nodes * p.endpoints_per_node) as u64;
    let at_seconds = sampler.elapsed();
    sampler.set_phase("down");
    sampler.retarget(None);
    let reconnects_before = fleet.observed.reconnects.load(Ordering::Relaxed);
    let killed = Instant::now();
    let launch = op.kill().await?;
    streams_ended(nodes, watched).await?;
    let down_seconds = killed.elapsed().as_secs_f64();
    let bytes_before = watched.bytes.load(Ordering::Relaxed);

    let started = Instant::now();
    let op = Operator::start(binary, launch).await?;
    let ready_seconds = started.elapsed().as_secs_f64();
    let fast = Sampler::start(op.pid, op.admin(), RECONNECT_SAMPLING);
    fast.set_phase("reconnect");
    sampler.retarget(Some((op.pid, op.admin())));
    sampler.set_phase("reconnect");

    let recovery = Recovery {
        op: &op,
        fast: &fast,
        sampler,
        nodes,
        watched,
        expected,
        started,
    };
    let (applied, mut reconnecting, mut resyncing) = recovery.watch().await?;
    fast.set_phase("settled");
    let seconds = started.elapsed().as_secs_f64();
    let snapshots_applied_seconds = applied.unwrap_or(seconds);
    let cpu = Proc::read(op.pid)
        .map(|p| p.cpu.as_secs_f64())
        .unwrap_or(0.0);
    let metrics = Metrics::scrape(op.admin()).await?;
    let mut samples = fast.stop().await;
    samples.retain(|s| s.phase != "settled");
    for s in &samples {
        if s.phase == "resync" {
            resyncing.sample(s);
        } else {
            reconnecting.sample(s);
        }
    }
    let watch_bytes = watched.bytes.load(Ordering::Relaxed) - bytes_before;

    let settled = settled_samples(sampler, p).await;
    let peak = |a: Option<u64>, b: Option<u64>| a.max(b).unwrap_or(0);
    let reconnect = Reconnect {
        at_seconds,
        down_seconds,
        ready_seconds,
        snapshots_applied_seconds,
        seconds,
        resync_seconds: seconds - snapshots_applied_seconds,
        peak_rss_bytes: peak(reconnecting.rss, resyncing.rss),
        peak_heap_bytes: peak(reconnecting.heap, resyncing.heap),
        resync_peak_rss_bytes: resyncing.rss,
        resync_peak_heap_bytes: resyncing.heap,
        settled_rss_bytes: median(settled.iter().map(|s| s.rss_bytes).collect()),
        settled_heap_bytes: median(settled.iter().filter_map(|s| s.heap_live_bytes).collect()),
        operator_cpu_share: cpu / seconds.max(1e-9),
        full_maps_built: metrics.or_zero("census_map_full_maps_built_total", ""),
        watch_bytes,
        node_reconnects: fleet.observed.reconnects.load(Ordering::Relaxed) - reconnects_before,
        samples,
    };
    Ok((op, reconnect))
}

/// Waits (up to 30 s) for every node and watcher to see its stream end. Called
/// before the new process exists: once it does, a watcher found still counting as
/// complete would be one that never saw its stream end.
async fn streams_ended(nodes: &[Node], watched: &Watched) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while nodes.iter().any(|n| n.is_connected()) || watched.complete.load(Ordering::Relaxed) > 0 {
        if Instant::now() > deadline {
            bail!(
                "30 s after the SIGKILL, {} nodes still count as connected and {} watchers as complete",
                nodes.iter().filter(|n| n.is_connected()).count(),
                watched.complete.load(Ordering::Relaxed)
            );
        }
        sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// The restarted operator, watched until every watcher holds the whole map again.
struct Recovery<'a> {
    op: &'a Operator,
    /// Sampling every RECONNECT_SAMPLING.
    fast: &'a Sampler,
    sampler: &'a Sampler,
    nodes: &'a [Node],
    watched: &'a Watched,
    expected: u64,
    started: Instant,
}

impl Recovery<'_> {
    /// Polls (up to 900 s) until every node is connected with its snapshot applied,
    /// then until every watcher is complete, the RSS peaks of each part kept apart.
    /// Returns when the snapshots were applied (seconds from `started`) and the peaks
    /// of reconnecting and resyncing.
    async fn watch(&self) -> anyhow::Result<(Option<f64>, Peak, Peak)> {
        let (nodes, expected) = (self.nodes, self.expected);
        let (mut reconnecting, mut resyncing) = (Peak::default(), Peak::default());
        let mut applied: Option<f64> = None;
        let mut seen = 0.0;
        let mut endpoints = 0;
        let deadline = Instant::now() + Duration::from_secs(900);
        loop {
            let phase = if applied.is_some() {
                &mut resyncing
            } else {
                &mut reconnecting
            };
            // RSS straight from /proc as well: a scrape may take longer than 50 ms.
            if let Ok(proc) = Proc::read(self.op.pid) {
                phase.rss(proc.rss);
            }
            if let Some(last) = self.fast.samples_since(seen).last() {
                endpoints = last.endpoints;
                seen = last.t + 1e-6;
            }
            let connected = nodes.iter().filter(|n| n.is_connected()).count();
            if applied.is_none() && connected == nodes.len() && endpoints == expected {
                applied = Some(self.started.elapsed().as_secs_f64());
                self.fast.set_phase("resync");
                self.sampler.set_phase("resync");
            }
            let complete = self.watched.complete.load(Ordering::Relaxed);
            if applied.is_some() && complete == nodes.len() {
                return Ok((applied, reconnecting, resyncing));
            }
            if Instant::now() > deadline {
                bail!(
                    "900 s after the restart: {connected} of {} nodes connected, {endpoints} of {expected} endpoints, {complete} watchers holding the whole map",
                    nodes.len()
                );
            }
            sleep(RECONNECT_SAMPLING).await;
        }
    }
}

/// The samples of the last 5 s of the snapshot interval after the restart.
async fn settled_samples(sampler: &Sampler, p: &Scale) -> Vec<Sample> {
    sampler.set_phase("settled");
    sleep(p.snapshot_interval.saturating_sub(Duration::from_secs(5))).await;
    let from = sampler.elapsed();
    sleep(Duration::from_secs(5)).await;
    sampler.samples_since(from)
}

/// The preset's bounds against what was measured.
fn gates(p: &Scale, steady_rss: u64, reconnect_peak_rss: u64) -> Vec<Gate> {
    [
        ("steady RSS", p.max_steady_rss_bytes, steady_rss),
        (
            "reconnect RSS peak",
            p.max_reconnect_peak_rss_bytes,
            reconnect_peak_rss,
        ),
    ]
    .into_iter()
    .filter_map(|(figure, bound, measured)| {
        bound.map(|bound| Gate {
            figure,
            bound_bytes: bound,
            measured_bytes: measured,
            passed: measured <= bound,
        })
    })
    .collect()
}

fn report_gates(o: &Output<'_>) {
    if o.gates.is_empty() {
        say(format!(
            "gate: none for {} (the preset sets no bounds)",
            o.params.preset
        ));
    }
    for g in &o.gates {
        if g.passed {
            say(format!(
                "gate: {} {} within its bound of {}: passed",
                g.figure,
                mib(g.measured_bytes),
                mib(g.bound_bytes)
            ));
        } else {
            say(format!(
                "gate: {} {} exceeds its bound of {}: FAILED",
                g.figure,
                mib(g.measured_bytes),
                mib(g.bound_bytes)
            ));
        }
    }
}

fn summary(o: &Output<'_>) {
    let opt = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.0} µs"));
    let r = &o.reconnect;
    say("");
    say(format!(
        "== {}: {} nodes x {} endpoints, {} ms snapshots, {} connections, every node watching the map ==",
        o.params.preset,
        o.params.nodes,
        o.params.endpoints_per_node,
        o.params.snapshot_interval.as_millis(),
        o.connections
    ));
    say(format!(
        "endpoints {}, live identities {}, ramp {:.1} s ({} Allocate calls, p50 {:.0} µs p99 {:.0} µs), every watcher's full map after {:.1} s",
        o.endpoints,
        o.identities,
        o.ramp_seconds,
        o.allocate.count,
        o.allocate.p50_us,
        o.allocate.p99_us,
        o.ramp_watchers_synced_seconds
    ));
    say(format!(
        "steady window {:.0} s: {:.1} snapshots/s, {:.0} entries/s",
        o.window_seconds, o.snapshots_per_second, o.entries_per_second
    ));
    say(format!(
        "operator CPU {:.1}% of one core (harness {:.1}% on the same 2 cores)",
        o.operator_cpu_share * 100.0,
        o.harness_cpu_share * 100.0
    ));
    say(format!(
        "snapshot apply (operator, core under lock): p50 {} p99 {} (histogram buckets x2.5 apart: coarse)",
        opt(o.apply_p50_us),
        opt(o.apply_p99_us)
    ));
    say(format!(
        "snapshot send to Ack (agent side): p50 {:.0} µs p99 {:.0} µs p99.9 {:.0} µs ({} snapshots)",
        o.snapshot_ack.p50_us, o.snapshot_ack.p99_us, o.snapshot_ack.p999_us, o.snapshot_ack.count
    ));
    say(format!(
        "steady RSS {} (idle {}, peak before the restart {}), live heap {} (idle {})",
        mib(o.rss_bytes),
        mib(o.baseline_rss_bytes),
        mib(o.peak_rss_bytes),
        mib(o.heap_bytes),
        mib(o.baseline_heap_bytes)
    ));
    say(format!(
        "per endpoint (views, identities, map, streams, everything): live heap {:.0} B, RSS {:.0} B",
        o.heap_bytes_per_endpoint, o.rss_bytes_per_endpoint
    ));
    let h = &o.heap_owners;
    say(format!(
        "steady live heap by owner (heap profile, {} sampled; per node = per agent connection with its two streams):",
        mib(h.total_bytes)
    ));
    heap::print(h, Some(o.params.nodes), Some(o.endpoints));
    say(format!(
        "reconnect: down {:.2} s, ready {:.2} s after the start, every snapshot applied after {:.1} s, every watcher's map after {:.1} s ({} node reconnects, {} full maps built, {:.1} MiB received per watcher)",
        r.down_seconds,
        r.ready_seconds,
        r.snapshots_applied_seconds,
        r.seconds,
        r.node_reconnects,
        r.full_maps_built,
        r.watch_bytes as f64 / o.params.nodes.max(1) as f64 / (1024.0 * 1024.0)
    ));
    say(format!(
        "  RSS peak {}, live heap peak {}, operator CPU {:.0}% of one core; settled one interval later: RSS {}, live heap {}",
        mib(r.peak_rss_bytes),
        mib(r.peak_heap_bytes),
        r.operator_cpu_share * 100.0,
        mib(r.settled_rss_bytes),
        mib(r.settled_heap_bytes)
    ));
    say(format!(
        "  full map resync of every watcher (after the last snapshot applied): {:.1} s, RSS peak {}, live heap peak {}",
        r.resync_seconds,
        r.resync_peak_rss_bytes.map_or_else(|| "-".to_owned(), mib),
        r.resync_peak_heap_bytes.map_or_else(|| "-".to_owned(), mib)
    ));
    say(format!("version gaps seen by watchers {}", o.watcher_gaps));
    say(o.machine.line());
}

fn plots(results: &Results, samples: &[Sample], reconnect: &[Sample]) -> anyhow::Result<()> {
    let mb = 1024.0 * 1024.0;
    let memory = |samples: &[Sample]| Panel {
        title: "operator memory".into(),
        y_label: "MiB".into(),
        series: vec![
            Series::new(
                "RSS",
                samples
                    .iter()
                    .map(|s| (s.t, s.rss_bytes as f64 / mb))
                    .collect(),
            ),
            Series::new(
                "live heap",
                samples
                    .iter()
                    .map(|s| (s.t, s.heap_live_bytes.unwrap_or(0) as f64 / mb))
                    .collect(),
            ),
        ],
    };
    let t = |samples: &[Sample], f: &dyn Fn(&Sample) -> f64| -> Vec<(f64, f64)> {
        samples.iter().map(|s| (s.t, f(s))).collect()
    };
    figure(
        &results.path("scale.svg"),
        "seconds",
        &[
            memory(samples),
            Panel {
                title: "CPU (1.0 = one core)".into(),
                y_label: "share".into(),
                series: vec![
                    Series::new("operator", t(samples, &|s| s.cpu_share)),
                    Series::new("harness", t(samples, &|s| s.harness_cpu_share)),
                ],
            },
            Panel {
                title: "endpoints in views".into(),
                y_label: "count".into(),
                series: vec![Series::new(
                    "endpoints",
                    t(samples, &|s| s.endpoints as f64),
                )],
            },
        ],
    )?;
    figure(
        &results.path("reconnect.svg"),
        "seconds since the restart",
        &[
            memory(reconnect),
            Panel {
                title: "endpoints in views".into(),
                y_label: "count".into(),
                series: vec![Series::new(
                    "endpoints",
                    t(reconnect, &|s| s.endpoints as f64),
                )],
            },
        ],
    )
}
