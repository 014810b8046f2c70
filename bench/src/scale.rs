//! Scale: thousands of simulated nodes x 110 endpoints with 30 s snapshots, as DESIGN.md
//! sizes one leader for (5,000 nodes: ~170 snapshots and ~18,000 entries a second).
//!
//! The nodes ramp up in batches (each Allocates what no node allocated before, then
//! sends its first snapshot), then the harness measures a few snapshot intervals of
//! steady state: the operator's CPU share, RSS and live heap, snapshot handling as the
//! operator times it (`census_snapshot_apply_duration_seconds`: the core's apply, under
//! its lock) and as the agents see it (send to Ack: encode, transport, decode,
//! validation, filter and apply), and memory per endpoint.

use std::{sync::Arc, time::Duration};

use anyhow::bail;
use serde::Serialize;
use tokio::time::{Instant, sleep};

use super::{
    agents::{Fleet, Labels, Node, Pod, pod_ip},
    operator::{Binary, Launch, Operator},
    plot::{Panel, Series, figure},
    presets::Scale,
    report::{Machine, Results, mib, say, say_params},
    sample::{Latency, Metrics, Sample, Sampler, histogram_quantile, median},
};

#[derive(Debug, Serialize)]
struct Output<'a> {
    params: &'a Scale,
    machine: Machine,
    operator_args: Vec<String>,
    connections: usize,
    endpoints: u64,
    identities: u64,
    ramp_seconds: f64,
    window_seconds: f64,
    snapshots_per_second: f64,
    entries_per_second: f64,
    operator_cpu_share: f64,
    harness_cpu_share: f64,
    baseline_rss_bytes: u64,
    rss_bytes: u64,
    peak_rss_bytes: u64,
    baseline_heap_bytes: u64,
    heap_bytes: u64,
    heap_bytes_per_endpoint: f64,
    rss_bytes_per_endpoint: f64,
    apply_p50_us: Option<f64>,
    apply_p99_us: Option<f64>,
    snapshot_ack: Latency,
    allocate: Latency,
    samples: Vec<Sample>,
}

pub(crate) async fn run(binary: &Binary, results: &Results, p: Scale) -> anyhow::Result<bool> {
    say_params(&format!("preset {}", p.preset), &p);
    let mut machine = Machine::now();
    say(machine.line());
    let store = tempfile::tempdir()?;
    let args: Vec<String> = [
        "--snapshot-interval",
        &format!("{}ms", p.snapshot_interval.as_millis()),
        "--adoption-window",
        "0s",
        "--log",
        "warn",
    ]
    .map(String::from)
    .to_vec();
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

    let connections = p.nodes.div_ceil(p.nodes_per_connection.max(1));
    let fleet = Fleet::connect(&op.grpc_url(), connections).await?;
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

    say(format!(
        "ramp: {} nodes over {connections} HTTP/2 connections, {} at a time",
        p.nodes, p.ramp_concurrency
    ));
    sampler.set_phase("ramp");
    let ramp = Instant::now();
    let mut nodes: Vec<Node> = Vec::with_capacity(p.nodes);
    for n in 0..p.nodes {
        let pods = (0..p.endpoints_per_node)
            .map(|e| {
                let i = n * p.endpoints_per_node + e;
                let l = i % pool;
                Pod {
                    namespace: format!("team-{}", l % 40),
                    name: format!("service-{l}-7d9f8b6c4-n{n:05}e{e:03}"),
                    ip: pod_ip(i),
                    labels: labels[l].clone(),
                }
            })
            .collect();
        nodes.push(fleet.start_node(n, format!("node-{n:05}"), pods, true));
        if nodes.len().is_multiple_of(p.ramp_concurrency) {
            let batch = &nodes[nodes.len() - p.ramp_concurrency..];
            let deadline = Instant::now() + Duration::from_secs(120);
            while !batch.iter().all(|n| n.is_connected()) {
                if Instant::now() > deadline {
                    bail!("nodes did not connect within 120 s");
                }
                sleep(Duration::from_millis(20)).await;
            }
        }
    }
    let expected = (p.nodes * p.endpoints_per_node) as u64;
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        if let Ok(m) = Metrics::scrape(op.admin()).await
            && m.or_zero("census_endpoints", "") as u64 == expected
        {
            break;
        }
        if Instant::now() > deadline {
            bail!("the operator never saw all {expected} endpoints");
        }
        sleep(Duration::from_millis(200)).await;
    }
    let ramp_seconds = ramp.elapsed().as_secs_f64();
    say(format!(
        "ramp done in {ramp_seconds:.1} s; measuring {} intervals",
        p.intervals
    ));
    let allocate = Latency::of(fleet.observed.take_allocate_latency());

    // One interval to settle (every node past its first jittered timer), then measure.
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
    let steady: Vec<Sample> = sampler.samples_since(from);

    let hist = "census_snapshot_apply_duration_seconds";
    let (hb, ha) = (before.histogram(hist), after.histogram(hist));
    let snapshots =
        after.or_zero("census_snapshots_total", "") - before.or_zero("census_snapshots_total", "");
    let mean = |f: &dyn Fn(&Sample) -> f64| {
        if steady.is_empty() {
            0.0
        } else {
            steady.iter().map(f).sum::<f64>() / steady.len() as f64
        }
    };
    let rss = median(steady.iter().map(|s| s.rss_bytes).collect());
    let heap = median(steady.iter().filter_map(|s| s.heap_live_bytes).collect());
    let endpoints = after.or_zero("census_endpoints", "") as u64;
    let out = Output {
        params: &p,
        machine: machine.clone(),
        operator_args: args,
        connections,
        endpoints,
        identities: after.identities("live"),
        ramp_seconds,
        window_seconds,
        snapshots_per_second: snapshots / window_seconds,
        entries_per_second: snapshots * p.endpoints_per_node as f64 / window_seconds,
        operator_cpu_share: mean(&|s| s.cpu_share),
        harness_cpu_share: mean(&|s| s.harness_cpu_share),
        baseline_rss_bytes: baseline_rss,
        rss_bytes: rss,
        peak_rss_bytes: sampler
            .samples()
            .iter()
            .map(|s| s.rss_bytes)
            .max()
            .unwrap_or(0),
        baseline_heap_bytes: baseline_heap,
        heap_bytes: heap,
        heap_bytes_per_endpoint: (heap as f64 - baseline_heap as f64) / endpoints.max(1) as f64,
        rss_bytes_per_endpoint: (rss as f64 - baseline_rss as f64) / endpoints.max(1) as f64,
        apply_p50_us: histogram_quantile(&hb, &ha, 0.5).map(|s| s * 1e6),
        apply_p99_us: histogram_quantile(&hb, &ha, 0.99).map(|s| s * 1e6),
        snapshot_ack: acks,
        allocate,
        samples: Vec::new(),
    };
    sampler.set_phase("stop");
    for node in nodes {
        node.stop().await;
    }
    op.stop().await?;
    let samples = sampler.stop().await;
    machine.finish();
    let out = Output {
        machine,
        samples,
        ..out
    };
    summary(&out);
    plots(results, &out.samples)?;
    results.write_json("scale.json", &out)?;
    Ok(true)
}

fn summary(o: &Output<'_>) {
    let opt = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.0} µs"));
    say("");
    say(format!(
        "== {}: {} nodes x {} endpoints, {} ms snapshots ==",
        o.params.preset,
        o.params.nodes,
        o.params.endpoints_per_node,
        o.params.snapshot_interval.as_millis()
    ));
    say(format!(
        "endpoints {}, live identities {}, ramp {:.1} s ({} Allocate calls, p50 {:.0} µs p99 {:.0} µs)",
        o.endpoints,
        o.identities,
        o.ramp_seconds,
        o.allocate.count,
        o.allocate.p50_us,
        o.allocate.p99_us
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
        "RSS {} (idle {}, peak {}), live heap {} (idle {})",
        mib(o.rss_bytes),
        mib(o.baseline_rss_bytes),
        mib(o.peak_rss_bytes),
        mib(o.heap_bytes),
        mib(o.baseline_heap_bytes)
    ));
    say(format!(
        "per endpoint (views, identities, streams, everything): live heap {:.0} B, RSS {:.0} B",
        o.heap_bytes_per_endpoint, o.rss_bytes_per_endpoint
    ));
    say(o.machine.line());
}

fn plots(results: &Results, samples: &[Sample]) -> anyhow::Result<()> {
    let t = |f: &dyn Fn(&Sample) -> f64| -> Vec<(f64, f64)> {
        samples.iter().map(|s| (s.t, f(s))).collect()
    };
    let mb = 1024.0 * 1024.0;
    figure(
        &results.path("scale.svg"),
        "seconds",
        &[
            Panel {
                title: "operator memory".into(),
                y_label: "MiB".into(),
                series: vec![
                    Series::new("RSS", t(&|s| s.rss_bytes as f64 / mb)),
                    Series::new(
                        "live heap",
                        t(&|s| s.heap_live_bytes.unwrap_or(0) as f64 / mb),
                    ),
                ],
            },
            Panel {
                title: "CPU (1.0 = one core)".into(),
                y_label: "share".into(),
                series: vec![
                    Series::new("operator", t(&|s| s.cpu_share)),
                    Series::new("harness", t(&|s| s.harness_cpu_share)),
                ],
            },
            Panel {
                title: "endpoints in views".into(),
                y_label: "count".into(),
                series: vec![Series::new("endpoints", t(&|s| s.endpoints as f64))],
            },
        ],
    )
}
