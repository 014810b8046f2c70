//! Garbage collection on the embedded store: 50,000 released identities deleted at
//! several budgets (`--gc-rate`, deletes per second), each in a fresh operator, with
//! Allocate latency measured meanwhile (half known label sets, half new ones, at a
//! steady rate): deletes are spent from a budget and must not delay allocations.

use std::{sync::Arc, time::Duration};

use anyhow::bail;
use census_proto::{PROTOCOL_VERSION, pb};
use rand::RngExt as _;
use serde::Serialize;
use tokio::time::{Instant, sleep};

use super::{
    agents::{Fleet, Node, NodeHandle},
    alloc::{CALL_TIMEOUT, keeper, known_labels, make_released, new_labels, wait_connected},
    operator::{Binary, Launch, Operator},
    plot::{Panel, Series, figure},
    presets::Gc,
    report::{Machine, Results, mib, say, say_params},
    sample::{Latency, Metrics, Sample, Sampler},
};

const KNOWN_POOL: usize = 200;

#[derive(Debug, Serialize)]
struct Budget {
    gc_rate: f64,
    identities: usize,
    setup_seconds: f64,
    delete_seconds: f64,
    deletes_per_second: f64,
    allocate_known: Latency,
    allocate_new: Latency,
    allocate_errors: u64,
    peak_rss_bytes: u64,
    peak_heap_bytes: u64,
    samples: Vec<Sample>,
}

#[derive(Debug, Serialize)]
struct Output<'a> {
    params: &'a Gc,
    machine: Machine,
    budgets: Vec<Budget>,
}

pub(crate) async fn run(binary: &Binary, results: &Results, p: Gc) -> anyhow::Result<bool> {
    say_params("preset gc", &p);
    let mut machine = Machine::now();
    say(machine.line());
    let mut budgets = Vec::new();
    for &rate in &p.budgets {
        budgets.push(one(binary, results, &p, rate).await?);
    }
    machine.finish();
    say("");
    say(format!(
        "== gc: {} released identities on the embedded store ==",
        p.identities
    ));
    say(format!(
        "{:>8} {:>10} {:>10} {:>22} {:>22} {:>9} {:>9}",
        "budget/s",
        "delete s",
        "deletes/s",
        "known p50/p99/p99.9 µs",
        "new p50/p99/p99.9 µs",
        "RSS peak",
        "heap peak"
    ));
    for b in &budgets {
        say(format!(
            "{:>8.0} {:>10.1} {:>10.0} {:>22} {:>22} {:>9} {:>9}",
            b.gc_rate,
            b.delete_seconds,
            b.deletes_per_second,
            format!(
                "{:.0}/{:.0}/{:.0}",
                b.allocate_known.p50_us, b.allocate_known.p99_us, b.allocate_known.p999_us
            ),
            format!(
                "{:.0}/{:.0}/{:.0}",
                b.allocate_new.p50_us, b.allocate_new.p99_us, b.allocate_new.p999_us
            ),
            mib(b.peak_rss_bytes),
            mib(b.peak_heap_bytes)
        ));
    }
    say(machine.line());
    let t = |b: &Budget, f: &dyn Fn(&Sample) -> f64| -> Vec<(f64, f64)> {
        b.samples.iter().map(|s| (s.t, f(s))).collect()
    };
    figure(
        &results.path("gc.svg"),
        "seconds",
        &[
            Panel {
                title: "released + deleting identities".into(),
                y_label: "count".into(),
                series: budgets
                    .iter()
                    .map(|b| {
                        Series::new(
                            format!("--gc-rate {}", b.gc_rate),
                            t(b, &|s| {
                                (s.identities_released + s.identities_deleting) as f64
                            }),
                        )
                    })
                    .collect(),
            },
            Panel {
                title: "operator CPU (1.0 = one core)".into(),
                y_label: "share".into(),
                series: budgets
                    .iter()
                    .map(|b| {
                        Series::new(format!("--gc-rate {}", b.gc_rate), t(b, &|s| s.cpu_share))
                    })
                    .collect(),
            },
        ],
    )?;
    results.write_json(
        "gc.json",
        &Output {
            params: &p,
            machine,
            budgets,
        },
    )?;
    Ok(true)
}

async fn one(binary: &Binary, results: &Results, p: &Gc, rate: f64) -> anyhow::Result<Budget> {
    say(format!(
        "--gc-rate {rate}: allocating {} identities",
        p.identities
    ));
    let store = tempfile::tempdir()?;
    let op = Operator::start(
        binary,
        Launch::new(
            store.path(),
            results.path(&format!("operator-gc{rate}.log")),
            operator_args(p, rate),
        )?,
    )
    .await?;
    let sampler = Sampler::start(op.pid, op.admin(), Duration::from_secs(1));
    let fleet = Fleet::connect(&op.grpc_url(), 4).await?;
    let keeper = keeper(&fleet, 0, KNOWN_POOL);
    let probe = fleet.start_node(1, "probe".into(), Vec::new(), false);
    wait_connected(&[&keeper, &probe]).await?;
    let setup = Instant::now();
    sampler.set_phase("setup");
    let storm: Vec<Node> = (0..8)
        .map(|i| fleet.start_node(i, format!("storm-{i}"), Vec::new(), false))
        .collect();
    make_released(&fleet, storm, p.identities, "gc").await?;
    let base = gc_started(&op).await?;
    let setup_seconds = setup.elapsed().as_secs_f64();
    sampler.set_phase("deleting");
    let started = Instant::now();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let prober = tokio::spawn(probe_allocations(
        fleet.clone(),
        probe.handle(),
        p.probe_rate,
        stop.clone(),
    ));
    all_deleted(&op, p, rate, base, started).await?;
    let delete_seconds = started.elapsed().as_secs_f64();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (known, new, errors) = prober.await.unwrap_or_default();
    say(format!(
        "  deleted in {delete_seconds:.1} s ({:.0}/s); Allocate known p99 {:.0} µs, new p99 {:.0} µs",
        p.identities as f64 / delete_seconds,
        known.p99_us,
        new.p99_us
    ));
    keeper.stop().await;
    probe.stop().await;
    op.stop().await?;
    let samples = sampler.stop().await;
    Ok(Budget {
        gc_rate: rate,
        identities: p.identities,
        setup_seconds,
        delete_seconds,
        deletes_per_second: p.identities as f64 / delete_seconds,
        allocate_known: known,
        allocate_new: new,
        allocate_errors: errors,
        peak_rss_bytes: samples.iter().map(|s| s.rss_bytes).max().unwrap_or(0),
        peak_heap_bytes: samples
            .iter()
            .filter_map(|s| s.heap_live_bytes)
            .max()
            .unwrap_or(0),
        samples,
    })
}

/// The operator's flags: the preset's timers at GC budget `rate`, its hold timeout
/// and id range, no limit on holds.
fn operator_args(p: &Gc, rate: f64) -> Vec<String> {
    let mut timers = p.timers.clone();
    timers.gc_rate = rate;
    let mut args = timers.flags();
    args.extend([
        "--hold-timeout".to_owned(),
        super::presets::humantime(p.hold_timeout),
    ]);
    args.extend(
        [
            "--id-range",
            p.id_range,
            "--max-holds-per-node",
            "100000000",
            "--adoption-window",
            "0s",
            "--log",
            "info",
        ]
        .map(String::from),
    );
    args
}

/// The GC's deletes so far.
fn gc_deleted(m: &Metrics) -> usize {
    m.or_zero("census_gc_outcomes_total", "outcome=\"deleted\"") as usize
}

/// Waits (up to 120 s) for the GC to start deleting: deletes start once the silent
/// nodes are dropped and the grace period passed. Returns the deletes counted then.
async fn gc_started(op: &Operator) -> anyhow::Result<usize> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let before_setup = gc_deleted(&Metrics::scrape(op.admin()).await?);
    loop {
        let m = Metrics::scrape(op.admin()).await?;
        // At a low budget a delete is in flight only for the moment of its batch:
        // watch the counter, not the state.
        if m.identities("deleting") > 0 || gc_deleted(&m) > before_setup {
            return Ok(gc_deleted(&m));
        }
        if Instant::now() > deadline {
            bail!("GC never started");
        }
        sleep(Duration::from_millis(50)).await;
    }
}

/// Waits for the GC to have deleted the preset's identities from `base` on, within
/// 1.5 times what the budget `rate` allows, plus a minute.
async fn all_deleted(
    op: &Operator,
    p: &Gc,
    rate: f64,
    base: usize,
    started: Instant,
) -> anyhow::Result<()> {
    let limit = Duration::from_secs_f64(p.identities as f64 / rate * 1.5 + 60.0);
    loop {
        let m = Metrics::scrape(op.admin()).await?;
        if gc_deleted(&m) - base + 1 >= p.identities
            || (m.identities("released") == 0 && m.identities("deleting") == 0)
        {
            return Ok(());
        }
        if started.elapsed() > limit {
            bail!("--gc-rate {rate}: not all deleted after {limit:?}");
        }
        sleep(Duration::from_millis(100)).await;
    }
}

/// Allocate at `rate` per second, alternating known and new label sets, until `stop`.
async fn probe_allocations(
    fleet: Fleet,
    node: NodeHandle,
    rate: f64,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> (Latency, Latency, u64) {
    let mut client = fleet.identity_client(1);
    let every = Duration::from_secs_f64(1.0 / rate.max(1.0));
    let (mut known, mut new, mut errors) = (Vec::new(), Vec::new(), 0);
    let mut next = Instant::now();
    let mut i = 0u64;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        tokio::time::sleep_until(next).await;
        next += every;
        let is_new = i % 2 == 1;
        let labels = if is_new {
            new_labels("probe", i)
        } else {
            known_labels(rand::rng().random_range(0..KNOWN_POOL))
                .as_ref()
                .clone()
        };
        i += 1;
        let started = Instant::now();
        let call = client.allocate(pb::AllocateRequest {
            protocol_version: PROTOCOL_VERSION,
            node: node.name.clone(),
            session: Some(node.session),
            labels,
            allocation: 0,
        });
        match tokio::time::timeout(CALL_TIMEOUT, call).await {
            Ok(Ok(_)) if is_new => new.push(started.elapsed()),
            Ok(Ok(_)) => known.push(started.elapsed()),
            _ => errors += 1,
        }
    }
    (Latency::of(known), Latency::of(new), errors)
}
