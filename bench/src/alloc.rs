//! Allocate over gRPC: throughput and latency with 1, 16 and 256 concurrent clients,
//! for known label sets (referenced by a node's view) and new ones (each persisted
//! before it is answered), without and then with a GC storm: tens of thousands of
//! released identities being deleted at a high `--gc-rate`, which must not delay
//! allocations (DESIGN.md: allocation writes never wait behind GC deletes).
//!
//! Clients allocate for 16 live nodes (the hold timeout is long, so what the cells
//! allocate is not collected while they run). The storm's identities are allocated by
//! nodes that then go silent: the operator drops them after the node TTL, their holds
//! go, and the identities are released and deleted.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use anyhow::bail;
use census_proto::{PROTOCOL_VERSION, pb};
use rand::RngExt as _;
use serde::Serialize;
use tokio::{
    task::JoinSet,
    time::{Instant, sleep},
};

use super::{
    agents::{Fleet, Labels, Node, NodeHandle, Pod, pod_ip},
    operator::{Binary, Launch, Operator},
    plot::{Panel, Series, figure},
    presets::{Alloc, Timers},
    report::{Machine, Results, say, say_params},
    sample::{Latency, Metrics, Sample, Sampler},
};

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Cell {
    pub(crate) storm: bool,
    pub(crate) kind: &'static str,
    pub(crate) clients: usize,
    pub(crate) calls: usize,
    pub(crate) errors: u64,
    pub(crate) per_second: f64,
    pub(crate) latency: Latency,
    /// GC deletes completed per second while the cell ran.
    pub(crate) gc_deletes_per_second: f64,
    pub(crate) gc_backlog_after: u64,
}

#[derive(Debug, Serialize)]
struct Output<'a> {
    params: &'a Alloc,
    machine: Machine,
    operator_args: Vec<String>,
    cells: Vec<Cell>,
    storm_setup_seconds: f64,
    samples: Vec<Sample>,
}

/// How long one Allocate may take before the harness counts it as unanswered.
pub(crate) const CALL_TIMEOUT: Duration = Duration::from_secs(30);

pub(crate) fn known_labels(i: usize) -> Labels {
    Arc::new(vec![
        format!("k8s:app=known-{i}"),
        "k8s:tier=backend".into(),
        format!("k8s:io.kubernetes.pod.namespace=team-{}", i % 40),
        "k8s:io.kubernetes.pod.serviceaccount=default".into(),
    ])
}

pub(crate) fn new_labels(prefix: &str, i: u64) -> Vec<String> {
    vec![
        format!("k8s:app={prefix}-{i}"),
        "k8s:tier=batch".into(),
        "k8s:io.kubernetes.pod.namespace=jobs".into(),
        "k8s:io.kubernetes.pod.serviceaccount=default".into(),
    ]
}

/// A node whose view references `pool` label sets, so they stay live.
pub(crate) fn keeper(fleet: &Fleet, index: usize, pool: usize) -> Node {
    let pods = (0..pool)
        .map(|i| Pod {
            namespace: format!("team-{}", i % 40),
            name: format!("known-{i}-x2b9q"),
            ip: pod_ip(i),
            labels: known_labels(i),
        })
        .collect();
    fleet.start_node(index, "keeper".into(), pods, false)
}

pub(crate) async fn wait_connected(nodes: &[&NodeHandle]) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !nodes.iter().all(|n| n.is_connected()) {
        if Instant::now() > deadline {
            bail!("simulated nodes did not connect within 60 s");
        }
        sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// `clients` tasks calling Allocate as fast as they can for `duration`.
async fn cell(
    fleet: &Fleet,
    nodes: &[NodeHandle],
    kind: &'static str,
    clients: usize,
    duration: Duration,
    pool: usize,
    tag: &str,
) -> (Vec<Duration>, u64) {
    let errors = Arc::new(AtomicU64::new(0));
    let mut tasks = JoinSet::new();
    let deadline = Instant::now() + duration;
    for c in 0..clients {
        let mut client = fleet.identity_client(c);
        let node = nodes[c % nodes.len()].clone();
        let errors = errors.clone();
        let tag = format!("{tag}-{c}");
        tasks.spawn(async move {
            let mut lat = Vec::new();
            let mut i = 0u64;
            while Instant::now() < deadline {
                let labels = if kind == "known" {
                    let k = rand::rng().random_range(0..pool);
                    known_labels(k).as_ref().clone()
                } else {
                    new_labels(&tag, i)
                };
                i += 1;
                let request = pb::AllocateRequest {
                    protocol_version: PROTOCOL_VERSION,
                    node: node.name.clone(),
                    session: Some(node.session),
                    labels,
                    allocation: 0,
                };
                let started = Instant::now();
                match tokio::time::timeout(CALL_TIMEOUT, client.allocate(request)).await {
                    Ok(Ok(_)) => lat.push(started.elapsed()),
                    _ => {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            lat
        });
    }
    let mut all = Vec::new();
    while let Some(r) = tasks.join_next().await {
        if let Ok(lat) = r {
            all.extend(lat);
        }
    }
    (all, errors.load(Ordering::Relaxed))
}

/// Allocates `count` new label sets from `nodes` (64 at a time), then stops the nodes:
/// the operator drops them after the node TTL and their identities are released.
pub(crate) async fn make_released(
    fleet: &Fleet,
    nodes: Vec<Node>,
    count: usize,
    tag: &str,
) -> anyhow::Result<()> {
    let handles: Vec<NodeHandle> = nodes.iter().map(Node::handle).collect();
    wait_connected(&handles.iter().collect::<Vec<_>>()).await?;
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = JoinSet::new();
    for c in 0..64 {
        let mut client = fleet.identity_client(c);
        let node = handles[c % handles.len()].clone();
        let next = next.clone();
        let tag = tag.to_owned();
        tasks.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= count as u64 {
                    return;
                }
                let request = pb::AllocateRequest {
                    protocol_version: PROTOCOL_VERSION,
                    node: node.name.clone(),
                    session: Some(node.session),
                    labels: new_labels(&tag, i),
                    allocation: 0,
                };
                for attempt in 0..10u32 {
                    match tokio::time::timeout(CALL_TIMEOUT, client.allocate(request.clone())).await {
                        Ok(Ok(_)) => break,
                        Ok(Err(status)) => {
                            say(format!(
                                "  Allocate failed (attempt {attempt}): {:?}: {}",
                                status.code(),
                                status.message()
                            ));
                        }
                        Err(_) => say(format!(
                            "  Allocate of {} did not answer within {CALL_TIMEOUT:?} (attempt {attempt})",
                            request.labels.join(",")
                        )),
                    }
                    sleep(Duration::from_millis(50)).await;
                }
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    for node in nodes {
        node.stop().await;
    }
    Ok(())
}

/// An operator for Allocate measurements: holds that outlive the run, no hold
/// quota, no adoption window; its flags are said and returned for the report.
pub(crate) async fn start_for_allocation(
    binary: &Binary,
    results: &Results,
    store: &std::path::Path,
    timers: &Timers,
    id_range: &str,
) -> anyhow::Result<(Operator, Vec<String>)> {
    let mut args = timers.flags();
    args.extend(
        [
            "--hold-timeout",
            "600s",
            "--id-range",
            id_range,
            "--max-holds-per-node",
            "100000000",
            "--adoption-window",
            "0s",
            "--log",
            "info",
        ]
        .map(String::from),
    );
    say(format!("operator flags: {}", args.join(" ")));
    let op = Operator::start(
        binary,
        Launch::new(store, results.path("operator.log"), args.clone())?,
    )
    .await?;
    Ok((op, args))
}

pub(crate) async fn run(binary: &Binary, results: &Results, p: Alloc) -> anyhow::Result<bool> {
    say_params("preset alloc", &p);
    let mut machine = Machine::now();
    say(machine.line());
    let store = tempfile::tempdir()?;
    let (op, args) =
        start_for_allocation(binary, results, store.path(), &p.timers, p.id_range).await?;
    let sampler = Sampler::start(op.pid, op.admin(), Duration::from_secs(1));
    let fleet = Fleet::connect(&op.grpc_url(), p.connections).await?;
    let keeper = keeper(&fleet, 0, p.known_pool);
    let clients: Vec<Node> = (0..16)
        .map(|i| fleet.start_node(i, format!("client-{i:02}"), Vec::new(), false))
        .collect();
    let handles: Vec<NodeHandle> = clients.iter().map(Node::handle).collect();
    let mut waiting: Vec<&NodeHandle> = handles.iter().collect();
    waiting.push(&keeper);
    wait_connected(&waiting).await?;
    // The keeper's pods are allocated before its first snapshot: wait for the view.
    keeper_view_filled(&op, p.known_pool).await?;

    let rig = Rig {
        op: &op,
        fleet: &fleet,
        handles: &handles,
        sampler: &sampler,
        p: &p,
    };
    let mut cells = Vec::new();
    let mut storm_setup_seconds = 0.0;
    for storm in [false, true] {
        if storm {
            storm_setup_seconds = rig.gc_storm().await?;
        }
        for kind in ["known", "new"] {
            for &clients in &p.concurrency {
                cells.push(rig.cell(kind, clients, storm).await?);
            }
        }
    }
    sampler.set_phase("stop");
    for node in clients {
        node.stop().await;
    }
    keeper.stop().await;
    op.stop().await?;
    let samples = sampler.stop().await;
    machine.finish();
    summary(&cells, &machine);
    plots(results, &samples)?;
    results.write_json(
        "alloc.json",
        &Output {
            params: &p,
            machine,
            operator_args: args,
            cells,
            storm_setup_seconds,
            samples,
        },
    )?;
    Ok(true)
}

/// Waits (up to 60 s) for the operator to hold the keeper's `known_pool` endpoints.
pub(crate) async fn keeper_view_filled(op: &Operator, known_pool: usize) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Metrics::scrape(op.admin())
        .await
        .map_or(0.0, |m| m.or_zero("census_endpoints", ""))
        < known_pool as f64
    {
        if Instant::now() > deadline {
            bail!("the keeper's view never filled");
        }
        sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// What the cells run against.
struct Rig<'a> {
    op: &'a Operator,
    fleet: &'a Fleet,
    handles: &'a [NodeHandle],
    sampler: &'a Sampler,
    p: &'a Alloc,
}

impl Rig<'_> {
    /// The GC storm: the preset's identities allocated from nodes that then go
    /// silent, until the GC deletes (up to 60 s). Returns the seconds it took.
    async fn gc_storm(&self) -> anyhow::Result<f64> {
        let (op, fleet, p) = (self.op, self.fleet, self.p);
        self.sampler.set_phase("storm setup");
        say(format!(
            "GC storm: allocating {} identities from nodes that then go silent",
            p.storm_identities
        ));
        let started = Instant::now();
        let storm_nodes: Vec<Node> = (0..8)
            .map(|i| fleet.start_node(i, format!("storm-{i}"), Vec::new(), false))
            .collect();
        make_released(fleet, storm_nodes, p.storm_identities, "storm").await?;
        // Wait for deletes to start.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let m = Metrics::scrape(op.admin()).await?;
            if m.identities("deleting") > 0 {
                break;
            }
            if Instant::now() > deadline {
                bail!("the GC storm never started");
            }
            sleep(Duration::from_millis(100)).await;
        }
        Ok(started.elapsed().as_secs_f64())
    }

    /// One cell: `clients` calling Allocate with `kind` labels for the preset's
    /// duration, with the GC's pace beside it.
    async fn cell(&self, kind: &'static str, clients: usize, storm: bool) -> anyhow::Result<Cell> {
        let (op, p) = (self.op, self.p);
        let name = format!("{kind} x{clients}{}", if storm { " +storm" } else { "" });
        self.sampler.set_phase(name.clone());
        let before = Metrics::scrape(op.admin()).await?;
        let started = Instant::now();
        let tag = format!("{kind}-{clients}-{storm}");
        let (lat, errors) = cell(
            self.fleet,
            self.handles,
            kind,
            clients,
            p.cell_duration,
            p.known_pool,
            &tag,
        )
        .await;
        let secs = started.elapsed().as_secs_f64();
        let after = Metrics::scrape(op.admin()).await?;
        let deleted = |m: &Metrics| m.or_zero("census_gc_outcomes_total", "outcome=\"deleted\"");
        let c = Cell {
            storm,
            kind,
            clients,
            calls: lat.len(),
            errors,
            per_second: lat.len() as f64 / secs,
            latency: Latency::of(lat),
            gc_deletes_per_second: (deleted(&after) - deleted(&before)) / secs,
            gc_backlog_after: after.or_zero("census_gc_backlog", "") as u64
                + after.identities("deleting"),
        };
        say(format!(
            "  {name:<18} {:>8.0}/s  p50 {:>7.0} µs  p99 {:>7.0} µs  p99.9 {:>7.0} µs  errors {}  GC {:.0} deletes/s",
            c.per_second,
            c.latency.p50_us,
            c.latency.p99_us,
            c.latency.p999_us,
            c.errors,
            c.gc_deletes_per_second
        ));
        Ok(c)
    }
}

fn summary(cells: &[Cell], machine: &Machine) {
    say("");
    say("== alloc: Allocate over gRPC on loopback ==");
    say(format!(
        "{:<6} {:<6} {:>7} {:>10} {:>9} {:>9} {:>9} {:>7} {:>11}",
        "kind",
        "storm",
        "clients",
        "calls/s",
        "p50 µs",
        "p99 µs",
        "p99.9 µs",
        "errors",
        "GC dels/s"
    ));
    for c in cells {
        say(format!(
            "{:<6} {:<6} {:>7} {:>10.0} {:>9.0} {:>9.0} {:>9.0} {:>7} {:>11.0}",
            c.kind,
            if c.storm { "yes" } else { "no" },
            c.clients,
            c.per_second,
            c.latency.p50_us,
            c.latency.p99_us,
            c.latency.p999_us,
            c.errors,
            c.gc_deletes_per_second
        ));
    }
    say(
        "the harness and the operator share the machine's cores: client-side figures include the harness's own scheduling",
    );
    say(machine.line());
}

fn plots(results: &Results, samples: &[Sample]) -> anyhow::Result<()> {
    let t = |f: &dyn Fn(&Sample) -> f64| -> Vec<(f64, f64)> {
        samples.iter().map(|s| (s.t, f(s))).collect()
    };
    figure(
        &results.path("alloc.svg"),
        "seconds",
        &[
            Panel {
                title: "CPU (1.0 = one core)".into(),
                y_label: "share".into(),
                series: vec![
                    Series::new("operator", t(&|s| s.cpu_share)),
                    Series::new("harness", t(&|s| s.harness_cpu_share)),
                ],
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
        ],
    )
}
