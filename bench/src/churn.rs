//! CronJob churn with lost deletes: the leak census exists to prevent.
//!
//! 3 nodes run steady pods; Job pods with unique labels (the operator keeps
//! `job-name` and `controller-uid`, so each gets a new identity) start and finish on
//! them, and a share of their delete events is dropped. Each drop rate is one phase in
//! the same operator process: churn, then drain (holds expire, the grace period and
//! the quarantine pass), then measure. The gate: after every drain no identity is left
//! beyond the live set, and the live heap is back within
//! `max_retained_bytes_per_pod` of the phase's baseline per churned pod.

use std::{
    cmp::Reverse,
    collections::BinaryHeap,
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use anyhow::bail;
use rand::RngExt as _;
use serde::Serialize;
use tokio::time::{Instant, sleep, sleep_until};

use super::{
    agents::{Fleet, Labels, Node, Pod, pod_ip, truth_refs},
    operator::{Binary, Launch, Operator},
    plot::{Panel, Series, figure},
    presets::Churn,
    report::{Machine, Results, kib, mib, say, say_params},
    sample::{Latency, Metrics, Sample, Sampler, median},
};

/// What users measured on the operator census replaces (seeds/000).
const REFERENCE: &str = "for comparison, the operator census replaces grew +7 MiB per 150 churned Job pods (23 -> 44 MiB after 450), linearly, and never gave it back (36 MiB 14 minutes after every identity was deleted)";

#[derive(Debug, Clone, Serialize)]
struct Phase {
    name: String,
    drop_rate: f64,
    pods: usize,
    deletes_dropped: u64,
    corrections: u64,
    churn_seconds: f64,
    /// Job pods started per second, as achieved (each node allocates serially).
    achieved_pods_per_second: f64,
    drain_seconds: f64,
    baseline_heap_bytes: u64,
    peak_heap_bytes: u64,
    after_heap_bytes: u64,
    baseline_rss_bytes: u64,
    peak_rss_bytes: u64,
    after_rss_bytes: u64,
    retained_heap_bytes_per_pod: f64,
    retained_rss_bytes_per_pod: f64,
    live_set: u64,
    peak_live_identities: u64,
    identities_beyond_live_set: i64,
    allocate: Latency,
    snapshot_ack: Latency,
    /// Where the operator spent an Allocate's time, from its metrics.
    allocate_time: AllocateTime,
    passed: bool,
}

/// An Allocate's time inside the operator over one phase, from the deltas of its
/// histograms' sums and counts (exact means; the buckets are too coarse for
/// percentiles): a new label set waits for its binding's store write, which the
/// allocation writer commits with whatever else is queued (one redb transaction,
/// made durable before it answers).
#[derive(Debug, Clone, Default, Serialize)]
struct AllocateTime {
    new_calls: u64,
    new_mean_us: f64,
    known_calls: u64,
    known_mean_us: f64,
    /// Allocation-writer batches, their mean duration (the commit) and size.
    batches: u64,
    batch_mean_us: f64,
    ops_per_batch: f64,
}

impl AllocateTime {
    fn between(before: &Metrics, after: &Metrics) -> Self {
        let delta =
            |name: &str, labels: &str| after.or_zero(name, labels) - before.or_zero(name, labels);
        let mean_us = |name: &str, labels: &str| {
            let n = delta(&format!("{name}_count"), labels);
            if n > 0.0 {
                delta(&format!("{name}_sum"), labels) / n * 1e6
            } else {
                0.0
            }
        };
        let allocate = "census_allocate_duration_seconds";
        let batch = "census_store_batch_duration_seconds";
        let (new, known, queue) = ("kind=\"new\"", "kind=\"known\"", "queue=\"allocation\"");
        let batches = delta(&format!("{batch}_count"), queue);
        Self {
            new_calls: delta(&format!("{allocate}_count"), new) as u64,
            new_mean_us: mean_us(allocate, new),
            known_calls: delta(&format!("{allocate}_count"), known) as u64,
            known_mean_us: mean_us(allocate, known),
            batches: batches as u64,
            batch_mean_us: mean_us(batch, queue),
            ops_per_batch: if batches > 0.0 {
                delta("census_store_ops_total", queue) / batches
            } else {
                0.0
            },
        }
    }
}

#[derive(Debug, Serialize)]
struct Output<'a> {
    params: &'a Churn,
    machine: Machine,
    operator_args: Vec<String>,
    phases: Vec<Phase>,
    overall_retained_heap_bytes_per_pod: f64,
    reference: &'static str,
    passed: bool,
    samples: Vec<Sample>,
}

pub(crate) async fn run(binary: &Binary, results: &Results, p: Churn) -> anyhow::Result<bool> {
    say_params(&format!("preset {}", p.preset), &p);
    let mut machine = Machine::now();
    say(machine.line());
    let store = tempfile::tempdir()?;
    let args = operator_args(&p);
    say(format!("operator flags: {}", args.join(" ")));
    let launch = Launch::new(store.path(), results.path("operator.log"), args.clone())?;
    let op = Operator::start(binary, launch).await?;
    let sampler = Sampler::start(op.pid, op.admin(), Duration::from_secs(1));
    let fleet = Fleet::connect(&op.grpc_url(), 1).await?;

    sampler.set_phase("steady");
    let nodes = start_steady(&fleet, &p);
    steady_state(&op, &nodes, &p).await?;

    let mut job_counter = 0usize;
    if p.warmup_pods > 0 {
        say(format!(
            "warm-up: {} Job pods (50% of deletes dropped), then drain",
            p.warmup_pods
        ));
        sampler.set_phase("warm-up");
        churn(&nodes, &p, "warmup", p.warmup_pods, 0.5, &mut job_counter).await;
        drain(&op, &nodes, drain_limit(&p)).await?;
    }
    // Baseline: the level over a few quiet seconds.
    let mut baseline = measure(&sampler, Duration::from_secs(5)).await;
    let first_baseline = baseline;
    let rig = Rig {
        op: &op,
        fleet: &fleet,
        nodes: &nodes,
        sampler: &sampler,
        p: &p,
    };
    let mut phases = Vec::new();
    for &rate in &p.drop_rates {
        let (phase, after) = rig.phase(rate, baseline, &mut job_counter).await?;
        phases.push(phase);
        baseline = after;
    }
    sampler.set_phase("stop");
    for node in nodes {
        node.stop().await;
    }
    op.stop().await?;
    let samples = sampler.stop().await;
    machine.finish();

    let total_pods = (p.pods * p.drop_rates.len()) as f64;
    let overall = (baseline.heap as f64 - first_baseline.heap as f64) / total_pods;
    let passed = phases.iter().all(|ph| ph.passed);
    summary(&p, &phases, overall, &machine, passed);
    plots(results, &samples)?;
    results.write_json(
        "churn.json",
        &Output {
            params: &p,
            machine,
            operator_args: args,
            phases,
            overall_retained_heap_bytes_per_pod: overall,
            reference: REFERENCE,
            passed,
            samples,
        },
    )?;
    Ok(passed)
}

/// The operator's flags: the preset's timers and store cache, every Job pod its own
/// identity.
fn operator_args(p: &Churn) -> Vec<String> {
    let mut args = p.timers.flags();
    args.extend(
        [
            "--label-include",
            "job-name,controller-uid",
            "--adoption-window",
            "0s",
            "--store-cache-bytes",
            &p.store_cache_bytes.to_string(),
            "--log",
            "info",
        ]
        .map(String::from),
    );
    args
}

/// The nodes with their steady pods: deployments of 5 replicas spread over the nodes.
fn start_steady(fleet: &Fleet, p: &Churn) -> Vec<Node> {
    let apps: Vec<Labels> = (0..p.steady_apps)
        .map(|a| {
            Arc::new(vec![
                format!("k8s:app=service-{a}"),
                "k8s:app.kubernetes.io/part-of=shop".into(),
                format!("k8s:io.kubernetes.pod.namespace=team-{}", a % 5),
                "k8s:io.kubernetes.pod.serviceaccount=default".into(),
                "k8s:pod-template-hash=7d9f8b6c4".into(),
            ])
        })
        .collect();
    let mut nodes: Vec<Node> = Vec::new();
    for n in 0..p.nodes {
        let pods = (0..p.steady_pods)
            .filter(|i| i % p.nodes == n)
            .map(|i| Pod {
                namespace: format!("team-{}", (i % p.steady_apps) % 5),
                name: format!("service-{}-7d9f8b6c4-{i:05}", i % p.steady_apps),
                ip: pod_ip(i),
                labels: apps[i % p.steady_apps].clone(),
            })
            .collect();
        nodes.push(fleet.start_node(n, format!("node-{n}"), pods, false));
    }
    nodes
}

/// Waits for the steady pods to show in the operator's views, then for the steady
/// state: holds seen in views, nothing released.
async fn steady_state(op: &Operator, nodes: &[Node], p: &Churn) -> anyhow::Result<()> {
    let steady = wait_for(op, Duration::from_secs(30), |m| {
        m.or_zero("census_endpoints", "") as usize == p.steady_pods
    })
    .await;
    if steady.is_err() {
        bail!("the steady pods never all showed in the operator's views");
    }
    drain(op, nodes, Duration::from_secs(30)).await
}

/// What a phase runs against.
struct Rig<'a> {
    op: &'a Operator,
    fleet: &'a Fleet,
    nodes: &'a [Node],
    sampler: &'a Sampler,
    p: &'a Churn,
}

impl Rig<'_> {
    /// One drop rate's phase: churn, drain, measure, judged against `baseline`.
    /// Returns the phase and the level after it (the next phase's baseline).
    async fn phase(
        &self,
        rate: f64,
        baseline: Level,
        job_counter: &mut usize,
    ) -> anyhow::Result<(Phase, Level)> {
        let (op, fleet, nodes, sampler, p) =
            (self.op, self.fleet, self.nodes, self.sampler, self.p);
        let name = format!("drop-{:.0}%", rate * 100.0);
        say(format!(
            "{name}: {} Job pods at {}/s, {:.0}% of delete events dropped",
            p.pods,
            p.pods_per_second,
            rate * 100.0
        ));
        sampler.set_phase(name.clone());
        let phase_start = sampler.elapsed();
        let before = Metrics::scrape(op.admin()).await?;
        let dropped_before = fleet.observed.deletes_dropped.load(Ordering::Relaxed);
        fleet.observed.take_allocate_latency();
        fleet.observed.take_snapshot_acks();
        let started = Instant::now();
        churn(nodes, p, &name, p.pods, rate, job_counter).await;
        let churn_seconds = started.elapsed().as_secs_f64();
        let drained = Instant::now();
        let drain_result = drain(op, nodes, drain_limit(p)).await;
        let drain_seconds = drained.elapsed().as_secs_f64();
        let live_set = truth_refs(nodes).len() as u64;
        let after = measure(sampler, Duration::from_secs(5)).await;
        let metrics = Metrics::scrape(op.admin()).await?;
        let peaks = Peaks::of(&sampler.samples_since(phase_start));
        let retained = (after.heap as f64 - baseline.heap as f64) / p.pods as f64;
        let beyond = metrics.bound() as i64 - live_set as i64;
        let passed = drain_result.is_ok() && beyond == 0 && retained < p.max_retained_bytes_per_pod;
        let phase = Phase {
            name: name.clone(),
            drop_rate: rate,
            pods: p.pods,
            deletes_dropped: fleet.observed.deletes_dropped.load(Ordering::Relaxed)
                - dropped_before,
            corrections: (metrics.or_zero("census_corrections_total", "")
                - before.or_zero("census_corrections_total", "")) as u64,
            churn_seconds,
            achieved_pods_per_second: p.pods as f64 / churn_seconds,
            drain_seconds,
            baseline_heap_bytes: baseline.heap,
            peak_heap_bytes: peaks.heap,
            after_heap_bytes: after.heap,
            baseline_rss_bytes: baseline.rss,
            peak_rss_bytes: peaks.rss,
            after_rss_bytes: after.rss,
            retained_heap_bytes_per_pod: retained,
            retained_rss_bytes_per_pod: (after.rss as f64 - baseline.rss as f64) / p.pods as f64,
            live_set,
            peak_live_identities: peaks.live_identities,
            identities_beyond_live_set: beyond,
            allocate: Latency::of(fleet.observed.take_allocate_latency()),
            snapshot_ack: Latency::of(fleet.observed.take_snapshot_acks()),
            allocate_time: AllocateTime::between(&before, &metrics),
            passed,
        };
        if let Err(e) = &drain_result {
            say(format!("  {name}: {e}"));
        }
        say(format!(
            "  done in {churn_seconds:.1} s ({:.0} pods/s) + {drain_seconds:.1} s drain: heap {:+.1} B/pod, {beyond} identities beyond the live set",
            p.pods as f64 / churn_seconds,
            retained
        ));
        Ok((phase, after))
    }
}

/// The highest levels sampled over a phase.
struct Peaks {
    heap: u64,
    rss: u64,
    live_identities: u64,
}

impl Peaks {
    fn of(samples: &[Sample]) -> Self {
        Self {
            heap: samples
                .iter()
                .filter_map(|s| s.heap_live_bytes)
                .max()
                .unwrap_or(0),
            rss: samples.iter().map(|s| s.rss_bytes).max().unwrap_or(0),
            live_identities: samples
                .iter()
                .map(|s| s.identities_live + s.identities_creating)
                .max()
                .unwrap_or(0),
        }
    }
}

fn drain_limit(p: &Churn) -> Duration {
    let t = &p.timers;
    // Hold timeout (3 intervals) + grace + deletes + quarantine, and a margin.
    t.snapshot_interval * 4 + t.grace + t.quarantine + Duration::from_secs(30)
}

/// Starts `count` Job pods at the preset's rate, round-robin over the nodes, each
/// deleted after its lifetime with its delete event dropped at `drop_rate`
/// (deterministically: exactly that share). Returns once every pod is gone from the
/// agents.
async fn churn(
    nodes: &[Node],
    p: &Churn,
    phase: &str,
    count: usize,
    drop_rate: f64,
    counter: &mut usize,
) {
    let start = Instant::now();
    let every = Duration::from_secs_f64(1.0 / p.pods_per_second);
    let mut deletes: BinaryHeap<Reverse<(Instant, usize, String, bool)>> = BinaryHeap::new();
    let mut next = 0usize;
    while next < count || !deletes.is_empty() {
        let create_at = (next < count).then(|| start + every * next as u32);
        let delete_at = deletes.peek().map(|Reverse((t, ..))| *t);
        match (create_at, delete_at) {
            (Some(c), d) if d.is_none_or(|d| c <= d) => {
                sleep_until(c).await;
                let j = *counter;
                *counter += 1;
                let n = next % nodes.len();
                let job = format!("{phase}-{j}").replace('%', "");
                let uid = format!("6f1e2c3d-0000-4000-8000-{j:012x}");
                let labels = Arc::new(vec![
                    "k8s:app=backup".to_owned(),
                    format!("k8s:job-name=backup-{job}"),
                    format!("k8s:controller-uid={uid}"),
                    format!("k8s:batch.kubernetes.io/job-name=backup-{job}"),
                    format!("k8s:batch.kubernetes.io/controller-uid={uid}"),
                    "k8s:io.kubernetes.pod.namespace=batch".to_owned(),
                    "k8s:io.kubernetes.pod.serviceaccount=default".to_owned(),
                ]);
                let pod = Pod {
                    namespace: "batch".into(),
                    name: format!("backup-{job}-x2b9q"),
                    ip: pod_ip(10_000 + j),
                    labels,
                };
                let life = rand::rng()
                    .random_range(p.lifetime_min.as_secs_f64()..=p.lifetime_max.as_secs_f64());
                let dropped =
                    (((next + 1) as f64) * drop_rate).floor() > ((next as f64) * drop_rate).floor();
                deletes.push(Reverse((
                    Instant::now() + Duration::from_secs_f64(life),
                    n,
                    pod.key(),
                    !dropped,
                )));
                nodes[n].create(pod);
                next += 1;
            }
            (_, Some(d)) => {
                sleep_until(d).await;
                if let Some(Reverse((_, n, key, send))) = deletes.pop() {
                    nodes[n].delete(key, send);
                }
            }
            (_, None) => break,
        }
    }
    for node in nodes {
        node.flush().await;
    }
}

/// Waits until the operator holds exactly the agents' live set: nothing creating,
/// released, deleting or quarantined, and the live identities are those the agents
/// reference.
async fn drain(op: &Operator, nodes: &[Node], limit: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        let expected = truth_refs(nodes).len() as u64;
        if let Ok(m) = Metrics::scrape(op.admin()).await {
            let rest = m.identities("creating")
                + m.identities("released")
                + m.identities("deleting")
                + m.identities("quarantined");
            if rest == 0 && m.identities("live") == expected {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "not drained after {limit:?}: {} live (live set {expected}), {} creating, {} released, {} deleting, {} quarantined",
                    m.identities("live"),
                    m.identities("creating"),
                    m.identities("released"),
                    m.identities("deleting"),
                    m.identities("quarantined")
                );
            }
        } else if Instant::now() > deadline {
            bail!("not drained after {limit:?}: /metrics does not answer");
        }
        sleep(Duration::from_millis(250)).await;
    }
}

async fn wait_for(
    op: &Operator,
    limit: Duration,
    ok: impl Fn(&Metrics) -> bool,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Ok(m) = Metrics::scrape(op.admin()).await
            && ok(&m)
        {
            return Ok(());
        }
        sleep(Duration::from_millis(100)).await;
    }
    bail!("timed out after {limit:?}")
}

#[derive(Debug, Clone, Copy)]
struct Level {
    heap: u64,
    rss: u64,
}

/// The level over the next `window`: the lowest live heap (what is retained; a
/// sample can only be raised by work in flight as it is taken, such as a snapshot
/// being decoded or the scrape itself) and the median RSS.
async fn measure(sampler: &Sampler, window: Duration) -> Level {
    let from = sampler.elapsed();
    sleep(window).await;
    let samples = sampler.samples_since(from);
    Level {
        heap: samples
            .iter()
            .filter_map(|s| s.heap_live_bytes)
            .min()
            .unwrap_or(0),
        rss: median(samples.iter().map(|s| s.rss_bytes).collect()),
    }
}

fn summary(p: &Churn, phases: &[Phase], overall: f64, machine: &Machine, passed: bool) {
    say("");
    say(format!(
        "== {}: {} nodes, {} steady pods, {} Job pods per drop rate ==",
        p.preset, p.nodes, p.steady_pods, p.pods
    ));
    say(format!(
        "{:<10} {:>9} {:>9} {:>9} {:>10} {:>9} {:>9} {:>9} {:>8} {:>7} {:>6}",
        "phase",
        "heap base",
        "heap peak",
        "heap end",
        "heap B/pod",
        "RSS base",
        "RSS peak",
        "RSS end",
        "beyond",
        "correct",
        "gate"
    ));
    for ph in phases {
        say(format!(
            "{:<10} {:>9} {:>9} {:>9} {:>10.1} {:>9} {:>9} {:>9} {:>8} {:>7} {:>6}",
            ph.name,
            mib(ph.baseline_heap_bytes),
            mib(ph.peak_heap_bytes),
            mib(ph.after_heap_bytes),
            ph.retained_heap_bytes_per_pod,
            mib(ph.baseline_rss_bytes),
            mib(ph.peak_rss_bytes),
            mib(ph.after_rss_bytes),
            ph.identities_beyond_live_set,
            ph.corrections,
            if ph.passed { "ok" } else { "FAIL" }
        ));
    }
    for ph in phases {
        say(format!(
            "  {}: {} deletes dropped, {} corrections; RSS {} over the phase ({:+.0} B/pod); peak {} live identities (live set {}); Allocate p50 {:.0} µs p99 {:.0} µs; snapshot send-to-Ack p50 {:.0} µs p99 {:.0} µs (includes the simulated agent's own queue)",
            ph.name,
            ph.deletes_dropped,
            ph.corrections,
            kib(ph.after_rss_bytes as i64 - ph.baseline_rss_bytes as i64),
            ph.retained_rss_bytes_per_pod,
            ph.peak_live_identities,
            ph.live_set,
            ph.allocate.p50_us,
            ph.allocate.p99_us,
            ph.snapshot_ack.p50_us,
            ph.snapshot_ack.p99_us
        ));
        let t = &ph.allocate_time;
        say(format!(
            "  {}: in the operator, {} new Allocates took {:.0} µs on average and {} known ones {:.0} µs; the allocation writer committed {} batches of {:.1} ops in {:.0} µs on average (a durable redb transaction: a new label set's answer waits for it)",
            ph.name,
            t.new_calls,
            t.new_mean_us,
            t.known_calls,
            t.known_mean_us,
            t.batches,
            t.ops_per_batch,
            t.batch_mean_us
        ));
    }
    say(format!(
        "over all {} Job pods: live heap {:+.1} B/pod from the first baseline",
        p.pods * p.drop_rates.len(),
        overall
    ));
    say(format!(
        "gate: 0 identities beyond the live set and < {} B of live heap retained per churned pod, at every drop rate: {}",
        p.max_retained_bytes_per_pod,
        if passed { "PASSED" } else { "FAILED" }
    ));
    say(format!(
        "memory settings: jemalloc background_thread:true, dirty_decay_ms:1000, muzzy_decay_ms:0; redb cache {} (--store-cache-bytes)",
        mib(p.store_cache_bytes as u64)
    ));
    say(REFERENCE);
    say(machine.line());
}

fn plots(results: &Results, samples: &[Sample]) -> anyhow::Result<()> {
    let t = |f: &dyn Fn(&Sample) -> f64| -> Vec<(f64, f64)> {
        samples.iter().map(|s| (s.t, f(s))).collect()
    };
    let mb = 1024.0 * 1024.0;
    figure(
        &results.path("memory.svg"),
        "seconds",
        &[
            Panel {
                title: "operator RSS".into(),
                y_label: "MiB".into(),
                series: vec![Series::new("RSS", t(&|s| s.rss_bytes as f64 / mb))],
            },
            Panel {
                title: "operator live heap".into(),
                y_label: "MiB".into(),
                series: vec![Series::new(
                    "live heap",
                    t(&|s| s.heap_live_bytes.unwrap_or(0) as f64 / mb),
                )],
            },
            Panel {
                title: "identities".into(),
                y_label: "count".into(),
                series: vec![
                    Series::new("live", t(&|s| s.identities_live as f64)),
                    Series::new(
                        "released + deleting",
                        t(&|s| (s.identities_released + s.identities_deleting) as f64),
                    ),
                    Series::new("quarantined", t(&|s| s.identities_quarantined as f64)),
                ],
            },
            Panel {
                title: "corrections (cumulative)".into(),
                y_label: "count".into(),
                series: vec![Series::new("corrections", t(&|s| s.corrections as f64))],
            },
        ],
    )
}
