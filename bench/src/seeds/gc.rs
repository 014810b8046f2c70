//! seed-gc (seeds/003, the GC that abandons its pass on one conflicting delete),
//! replayed on the real control plane: 10,000 Identity objects that no pod uses,
//! written as census writes them, then census's operator started on them in
//! Kubernetes mode; it holds what it loads for one node TTL, releases it, and
//! deletes it within its budget, while a second writer keeps annotating the objects
//! the GC is about to write, so its writes meet conflicts. The operator must finish
//! every pass: every object deleted, the conflicts retried, deletes per second
//! beside Cilium's default budget (2,500 a minute).
//!
//! The GC writes each identity twice, lowest ids first: a merge patch of its
//! tombstone on `/status`, then, once the quarantine has ended, the object's delete;
//! both carry the resourceVersion census last saw (the delete also the UID), so an
//! annotation that lands after census saw the object and before its write makes the
//! write a 409. The second writer ([`SecondWriter`]) is in-process: tasks sending
//! unconditional merge patches of one annotation at a capped rate, half on the ids the
//! GC tombstones next and half on the ids whose delete comes next, both read from the
//! operator's own counters ten times a second; it counts its writes, 404s (gone)
//! and 409s apart. The operator counts the 409s it met and retried
//! (`census_kubernetes_conflicts_total`).
//!
//! deploy/'s ValidatingAdmissionPolicy refuses every write to Identity objects but
//! census-operator's own (an administrator's annotation is a 403 there), so this
//! preset applies the CRD alone and runs the operator as the administrator: the
//! conflicts of seeds/003 need a second writer that is allowed to write. No agent
//! runs: the identities are nobody's, and the control plane's node is deleted before
//! the operator starts (an operator keeps what it loaded until every node it knows
//! has reported, its restart protection).

use std::{
    collections::BTreeMap,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use anyhow::{Context as _, anyhow};
use census_proto::labels::{LabelLimits, LabelSet};
use kube::{
    api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams},
    config::KubeConfigOptions,
};
use serde::Serialize;
use tokio::{
    task::JoinSet,
    time::{Instant, MissedTickBehavior, interval, sleep},
};

use super::world::{Binaries, Plane, in_cluster_flags};
use crate::{
    operator::{Launch, Operator},
    plot::{Panel, Series, figure},
    presets::{SeedGc, humantime},
    report::{Machine, Results, mib, say, say_params},
    sample::{Metrics, Proc},
};

const REFERENCE: &str = "seeds/003 (Cilium 1.15.3): the GC pass returns on the first conflicting delete; close to 65k CiliumIdentity objects piled up and new pods could not get network. Cilium's default GC budget is 2,500 identities a minute: 10,000 take 4 minutes with no conflict at all";
/// The first id the objects take (census's cluster-local range starts at 256).
const FIRST_ID: u64 = 1000;
/// The annotation the second writer writes.
const ANNOTATION: &str = "seeds.census.dev/touched";

#[derive(Debug, Clone, Serialize)]
struct Run {
    identities: usize,
    create_seconds: f64,
    /// From the operator's start to its first GC delete (it holds what it loads for
    /// one node TTL, then the grace period).
    first_delete_seconds: f64,
    /// From the first GC delete to the last object gone.
    delete_seconds: f64,
    deletes_per_second: f64,
    /// Identity objects left when the run ended (0: every pass finished).
    left: u64,
    gc_outcomes: BTreeMap<String, u64>,
    /// 409s the operator's store met and retried, by op.
    conflicts_retried: BTreeMap<String, u64>,
    writer: Written,
    /// The GC writer's store batches: count, mean ops and mean seconds.
    gc_batches: u64,
    gc_batch_mean_ops: f64,
    gc_batch_mean_seconds: f64,
    /// CPU seconds from the first GC delete to the last object gone, by process.
    cpu_seconds: BTreeMap<String, f64>,
    peak_rss_bytes: u64,
    peak_heap_bytes: u64,
    passed: bool,
}

#[derive(Debug, Clone, Serialize)]
struct Sample {
    t: f64,
    objects: u64,
    deleted: u64,
    conflicts: u64,
    rss_bytes: u64,
    heap_bytes: u64,
}

#[derive(Debug, Serialize)]
struct Output<'a> {
    params: &'a SeedGc,
    machine: Machine,
    reference: &'static str,
    runs: Vec<Run>,
    samples: BTreeMap<usize, Vec<Sample>>,
    passed: bool,
}

pub(crate) async fn run(bins: &Binaries, results: &Results, p: SeedGc) -> anyhow::Result<bool> {
    say_params(&format!("preset {}", p.preset), &p);
    let mut machine = Machine::now();
    say(machine.line());
    let plane = Plane::up_bare(p.plane_name, 1).await?;
    census_testkit::cluster::apply_crd(&plane.0).map_err(|e| anyhow!("{e}"))?;
    let mut runs = Vec::new();
    let mut all_samples = BTreeMap::new();
    for &n in &p.sizes {
        let (run, samples) = one(bins, results, &plane, &p, n).await?;
        all_samples.insert(n, samples);
        runs.push(run);
    }
    drop(plane);
    machine.finish();
    let passed = runs.iter().all(|r| r.passed);
    say("");
    say(format!(
        "== {}: released Identity objects on a real control plane, a second writer annotating them ({} tasks, at most {}/s), GC budget {}/s ==",
        p.preset, p.writers, p.writer_rate, p.gc_rate
    ));
    say(REFERENCE);
    say(format!(
        "  {:>10} {:>9} {:>11} {:>10} {:>9} {:>6} {:>15} {:>22} {:>28} {:>9}",
        "identities",
        "create s",
        "1st delete",
        "delete s",
        "deletes/s",
        "left",
        "GC outcomes",
        "conflicts retried",
        "annotations/s (409, 404)",
        "RSS peak"
    ));
    for r in &runs {
        let w = &r.writer;
        say(format!(
            "  {:>10} {:>9.0} {:>10.1}s {:>10.1} {:>9.0} {:>6} {:>15} {:>22} {:>28} {:>9}",
            r.identities,
            r.create_seconds,
            r.first_delete_seconds,
            r.delete_seconds,
            r.deletes_per_second,
            r.left,
            joined(&r.gc_outcomes),
            joined(&r.conflicts_retried),
            format!(
                "{:.0} ({:.1}, {:.0})",
                w.per_second(w.written),
                w.per_second(w.conflicts),
                w.per_second(w.gone)
            ),
            mib(r.peak_rss_bytes)
        ));
        say(format!(
            "    Cilium's default budget (2,500/min) alone: {:.0} s for {}; census: {:.1} s; target under {:.0} s for 10,000: {}",
            r.identities as f64 / 2500.0 * 60.0,
            r.identities,
            r.delete_seconds,
            p.max_delete_seconds_per_10k,
            if r.passed { "PASS" } else { "FAIL" }
        ));
        say(format!(
            "    CPU seconds over the {:.1} s of deletes: {}",
            r.delete_seconds,
            r.cpu_seconds
                .iter()
                .map(|(k, v)| format!("{k} {v:.1}"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    say(machine.line());
    plots(results, &all_samples)?;
    results.write_json(
        "seed-gc.json",
        &Output {
            params: &p,
            machine,
            reference: REFERENCE,
            runs,
            samples: all_samples,
            passed,
        },
    )?;
    say(if passed {
        "seed-gc: PASS"
    } else {
        "seed-gc: FAIL"
    });
    Ok(passed)
}

fn joined(counts: &BTreeMap<String, u64>) -> String {
    if counts.is_empty() {
        return "none".to_owned();
    }
    counts
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The objects as census writes them: name the id, spec.labels the canonical set.
fn write_objects(plane: &Plane, dir: &std::path::Path, n: usize) -> anyhow::Result<()> {
    let limits = LabelLimits::default();
    let per_file = 1000;
    for chunk in 0..n.div_ceil(per_file) {
        let mut items = Vec::new();
        for i in chunk * per_file..((chunk + 1) * per_file).min(n) {
            let set = LabelSet::parse(
                [
                    format!("k8s:app=gc-{i}"),
                    "k8s:io.kubernetes.pod.namespace=seed-gc".to_owned(),
                    "k8s:io.kubernetes.pod.serviceaccount=default".to_owned(),
                ],
                &limits,
            )
            .map_err(|e| anyhow!("labels: {e}"))?;
            items.push(serde_json::json!({
                "apiVersion": "census.dev/v1", "kind": "Identity",
                "metadata": {"name": (FIRST_ID + i as u64).to_string()},
                "spec": {"labels": set.to_strings()},
            }));
        }
        let file = dir.join(format!("identities-{chunk}.json"));
        std::fs::write(
            &file,
            serde_json::to_vec(
                &serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items}),
            )?,
        )?;
        plane
            .0
            .kubectl_ok(&["create", "-f", &file.display().to_string(), "-o", "name"])?;
    }
    Ok(())
}

async fn one(
    bins: &Binaries,
    results: &Results,
    plane: &Plane,
    p: &SeedGc,
    n: usize,
) -> anyhow::Result<(Run, Vec<Sample>)> {
    say(format!("\n== {n} released identities ==",));
    let dir = tempfile::tempdir()?;
    let created = Instant::now();
    write_objects(plane, dir.path(), n)?;
    let create_seconds = created.elapsed().as_secs_f64();
    say(format!(
        "  {n} Identity objects created in {create_seconds:.0} s"
    ));

    delete_nodes(plane);
    let certs = census_testkit::tls::Certs::generate(&[], &[]).map_err(|e| anyhow!("{e}"))?;
    let args = operator_args(plane, &certs, p)?;
    say(format!("  operator flags: {}", args.join(" ")));
    let launch = Launch::new(
        dir.path(),
        results.path(&format!("operator-gc-{n}.log")),
        args,
    )?;
    let started = Instant::now();
    let op = Operator::start(&bins.operator, launch).await?;

    let api = identities(plane).await?;
    let writer = SecondWriter::start(&api, &op, p);
    let limit = Duration::from_secs(p.limit_seconds);
    let gc = watch_gc(plane, &api, &op, started, limit).await?;
    let writer = writer.stop().await;
    let m = Metrics::scrape(op.admin()).await?;
    let gc_outcomes = m.labelled("census_gc_outcomes_total", "outcome");
    let conflicts_retried = m.labelled("census_kubernetes_conflicts_total", "op");
    let batches = m.or_zero("census_store_batch_duration_seconds_count", "queue=\"gc\"");
    let batch_seconds = m.or_zero("census_store_batch_duration_seconds_sum", "queue=\"gc\"");
    let batch_ops = m.or_zero("census_store_ops_total", "queue=\"gc\"");
    op.stop().await?;
    let left = count_objects(plane)?;
    if left > 0 {
        say(format!(
            "  {left} objects left after {limit:?}; removing them for the next run"
        ));
        let _ = plane.0.kubectl_ok(&["delete", "identities", "--all"]);
    }
    let samples = gc.samples;
    let first = gc.first_delete.unwrap_or(0.0);
    let delete_seconds = gc.done_at.map_or(f64::NAN, |d| d - first);
    let max = p.max_delete_seconds_per_10k * n as f64 / 10_000.0;
    let run = Run {
        identities: n,
        create_seconds,
        first_delete_seconds: first,
        delete_seconds,
        deletes_per_second: n as f64 / delete_seconds,
        left,
        gc_outcomes,
        conflicts_retried,
        writer,
        gc_batches: batches as u64,
        gc_batch_mean_ops: batch_ops / batches.max(1.0),
        gc_batch_mean_seconds: batch_seconds / batches.max(1.0),
        cpu_seconds: gc.cpu_seconds,
        peak_rss_bytes: samples.iter().map(|s| s.rss_bytes).max().unwrap_or(0),
        peak_heap_bytes: samples.iter().map(|s| s.heap_bytes).max().unwrap_or(0),
        passed: left == 0 && delete_seconds < max,
    };
    let w = &run.writer;
    say(format!(
        "  first GC delete {first:.1} s after the operator started; every object gone {delete_seconds:.1} s later ({:.0}/s)",
        run.deletes_per_second,
    ));
    say(format!(
        "  second writer over {:.1} s: {} annotations written ({:.0}/s), {} 404 (gone, {:.0}/s), {} 409 ({:.1}/s), {} other failures",
        w.seconds,
        w.written,
        w.per_second(w.written),
        w.gone,
        w.per_second(w.gone),
        w.conflicts,
        w.per_second(w.conflicts),
        w.failed
    ));
    say(format!(
        "  GC outcomes: {}; conflicts the store met and retried: {}; GC store batches: {} of {:.0} ops in {:.3} s on average",
        joined(&run.gc_outcomes),
        joined(&run.conflicts_retried),
        run.gc_batches,
        run.gc_batch_mean_ops,
        run.gc_batch_mean_seconds
    ));
    Ok((run, samples))
}

/// No agent runs here, and an operator that knows a node (from its Node object)
/// keeps what it loaded until that node's agent has reported (the restart
/// protection): the control plane's one node goes first.
fn delete_nodes(plane: &Plane) {
    for node in plane.0.nodes() {
        let _ = plane
            .0
            .kubectl_ok(&["delete", "node", &node.name, "--ignore-not-found"]);
    }
}

/// The operator's flags: Kubernetes mode on the plane as its administrator, one
/// snapshot interval of node TTL, no grace, the preset's quarantine and GC rate.
fn operator_args(
    plane: &Plane,
    certs: &census_testkit::tls::Certs,
    p: &SeedGc,
) -> anyhow::Result<Vec<String>> {
    // An address of the cluster's pod range, as the downward API would give (the
    // leader publishes it in its EndpointSlice).
    let mut args = in_cluster_flags(
        "default",
        "seed-gc-operator",
        "198.18.255.250",
        &plane.0.kubeconfig(),
        certs,
    )?;
    args.extend(
        [
            "--snapshot-interval",
            &humantime(p.snapshot_interval),
            "--node-ttl",
            &humantime(p.snapshot_interval),
            "--grace-period",
            "0s",
            "--quarantine",
            &humantime(p.quarantine),
            "--gc-rate",
            &p.gc_rate.to_string(),
        ]
        .map(String::from),
    );
    Ok(args)
}

/// Where the GC is, as ids: the next it tombstones, and the next whose tombstone it
/// deletes. It goes lowest id first, so its own counters say where: the tombstones
/// written (GC outcome `deleted`) and the quarantines ended, from [`FIRST_ID`] on.
#[derive(Debug, Default)]
struct Frontier {
    tombstone: AtomicU64,
    delete: AtomicU64,
    /// The GC has started.
    started: AtomicBool,
}

impl Frontier {
    async fn follow(&self, op: std::net::SocketAddr) -> anyhow::Result<()> {
        let m = Metrics::scrape(op).await?;
        let tombstoned = m.or_zero("census_gc_outcomes_total", "outcome=\"deleted\"") as u64;
        let inflight = m.or_zero("census_gc_inflight", "") as u64;
        let ended = m.or_zero("census_quarantine_ended_total", "") as u64;
        self.tombstone
            .store(FIRST_ID + tombstoned, Ordering::Relaxed);
        self.delete.store(FIRST_ID + ended, Ordering::Relaxed);
        if tombstoned + inflight > 0 {
            self.started.store(true, Ordering::Relaxed);
        }
        Ok(())
    }
}

/// The second writer: `p.writers` tasks sending merge patches of one annotation (no
/// precondition: each lands unless the object is gone), together at most
/// `p.writer_rate` a second, from the GC's first write until stopped. Even tasks
/// write the `p.writer_window` ids the GC tombstones next, odd tasks the ones whose
/// delete comes next (from the last quarantine ended on), each cycling through its
/// window.
struct SecondWriter {
    stop: Arc<AtomicBool>,
    counts: Arc<Counts>,
    tasks: JoinSet<()>,
    began: Instant,
}

#[derive(Debug, Default)]
struct Counts {
    written: AtomicU64,
    gone: AtomicU64,
    conflicts: AtomicU64,
    failed: AtomicU64,
    /// When the first write went, in ms since the writer started (0: none yet).
    first_ms: AtomicU64,
}

/// What the second writer did: annotations written, 404s (the object was gone), 409s,
/// other failures, over how long (from its first write).
#[derive(Debug, Clone, Serialize)]
struct Written {
    written: u64,
    gone: u64,
    conflicts: u64,
    failed: u64,
    seconds: f64,
}

impl Written {
    fn per_second(&self, n: u64) -> f64 {
        n as f64 / self.seconds.max(f64::EPSILON)
    }
}

impl SecondWriter {
    fn start(api: &Api<DynamicObject>, op: &Operator, p: &SeedGc) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let counts = Arc::new(Counts::default());
        let frontier = Arc::new(Frontier::default());
        let began = Instant::now();
        let mut tasks = JoinSet::new();
        {
            let (stop, frontier, admin) = (stop.clone(), frontier.clone(), op.admin());
            tasks.spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let _ = frontier.follow(admin).await;
                    sleep(Duration::from_millis(100)).await;
                }
            });
        }
        let each = Duration::from_secs_f64(p.writers as f64 / p.writer_rate);
        let window = p.writer_window.max(1);
        let stride = p.writers.div_ceil(2) as u64;
        for task in 0..p.writers {
            let (stop, counts, frontier, api) =
                (stop.clone(), counts.clone(), frontier.clone(), api.clone());
            tasks.spawn(async move {
                let mut tick = interval(each);
                tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
                // The tasks of one window take turns through it.
                let mut next = task as u64 / 2;
                while !stop.load(Ordering::Relaxed) {
                    tick.tick().await;
                    if !frontier.started.load(Ordering::Relaxed) {
                        continue;
                    }
                    let base = if task % 2 == 0 {
                        frontier.tombstone.load(Ordering::Relaxed)
                    } else {
                        frontier.delete.load(Ordering::Relaxed)
                    };
                    let id = base + next % window;
                    next += stride;
                    let _ = counts.first_ms.compare_exchange(
                        0,
                        began.elapsed().as_millis().max(1) as u64,
                        Ordering::Relaxed,
                        Ordering::Relaxed,
                    );
                    let patch = serde_json::json!({
                        "metadata": {"annotations": {ANNOTATION: began.elapsed().as_millis().to_string()}},
                    });
                    let counter = match api
                        .patch(&id.to_string(), &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                    {
                        Ok(_) => &counts.written,
                        Err(kube::Error::Api(s)) if s.code == 404 => &counts.gone,
                        Err(kube::Error::Api(s)) if s.code == 409 => &counts.conflicts,
                        Err(_) => &counts.failed,
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        Self {
            stop,
            counts,
            tasks,
            began,
        }
    }

    async fn stop(self) -> Written {
        let Self {
            stop,
            counts,
            mut tasks,
            began,
        } = self;
        stop.store(true, Ordering::Relaxed);
        let seconds =
            began.elapsed().as_secs_f64() - counts.first_ms.load(Ordering::Relaxed) as f64 / 1e3;
        while tasks.join_next().await.is_some() {}
        Written {
            written: counts.written.load(Ordering::Relaxed),
            gone: counts.gone.load(Ordering::Relaxed),
            conflicts: counts.conflicts.load(Ordering::Relaxed),
            failed: counts.failed.load(Ordering::Relaxed),
            seconds,
        }
    }
}

/// The GC as watched: a sample a second, when the first delete came and when the
/// last object went, and the CPU each process used in between.
struct Gc {
    samples: Vec<Sample>,
    first_delete: Option<f64>,
    done_at: Option<f64>,
    cpu_seconds: BTreeMap<String, f64>,
}

/// CPU time so far of the processes the deletes go through: the control plane's
/// etcd and kube-apiserver, the operator, this harness (the second writer), and
/// every process on the machine (`/proc/stat`; the 2 cores are shared).
fn cpu_now(plane: &Plane, op: &Operator) -> BTreeMap<String, f64> {
    let mut cpu = BTreeMap::new();
    for c in plane.0.components() {
        if matches!(c.name.as_str(), "etcd" | "kube-apiserver")
            && let Ok(p) = Proc::read(c.pid)
        {
            cpu.insert(c.name.clone(), p.cpu.as_secs_f64());
        }
    }
    if let Ok(p) = Proc::read(op.pid) {
        cpu.insert("census-operator".to_owned(), p.cpu.as_secs_f64());
    }
    if let Ok(own) = Proc::own_cpu() {
        cpu.insert("census-bench (second writer)".to_owned(), own.as_secs_f64());
    }
    if let Some(all) = machine_busy() {
        cpu.insert("machine (all processes)".to_owned(), all);
    }
    cpu
}

/// Busy CPU seconds of the whole machine since boot, from `/proc/stat`.
fn machine_busy() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let fields: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal: all but idle and iowait.
    let busy: u64 = fields
        .iter()
        .take(8)
        .enumerate()
        .filter(|(i, _)| !matches!(i, 3 | 4))
        .map(|(_, v)| v)
        .sum();
    let hz = rustix::param::clock_ticks_per_second().max(1);
    Some(busy as f64 / hz as f64)
}

/// Samples the operator and counts the objects every second until none is left or
/// `limit` from `started`.
async fn watch_gc(
    plane: &Plane,
    api: &Api<DynamicObject>,
    op: &Operator,
    started: Instant,
    limit: Duration,
) -> anyhow::Result<Gc> {
    let mut samples = Vec::new();
    let mut first_delete: Option<f64> = None;
    let mut done_at: Option<f64> = None;
    let mut cpu_first = BTreeMap::new();
    while started.elapsed() < limit {
        sleep(Duration::from_secs(1)).await;
        let m = Metrics::scrape(op.admin()).await?;
        let objects = left(api).await?;
        let deleted = m.or_zero("census_gc_outcomes_total", "outcome=\"deleted\"") as u64;
        let t = started.elapsed().as_secs_f64();
        if deleted > 0 && first_delete.is_none() {
            first_delete = Some(t);
            cpu_first = cpu_now(plane, op);
        }
        samples.push(Sample {
            t,
            objects,
            deleted,
            conflicts: m
                .labelled("census_kubernetes_conflicts_total", "op")
                .values()
                .sum(),
            rss_bytes: Proc::read(op.pid)?.rss,
            heap_bytes: m.heap().unwrap_or(0),
        });
        if objects == 0 {
            done_at = Some(t);
            break;
        }
    }
    let cpu_seconds = cpu_now(plane, op)
        .into_iter()
        .filter_map(|(k, v)| Some((k.clone(), v - cpu_first.get(&k)?)))
        .collect();
    Ok(Gc {
        samples,
        first_delete,
        done_at,
        cpu_seconds,
    })
}

/// The Identity objects, as the administrator reaches them.
async fn identities(plane: &Plane) -> anyhow::Result<Api<DynamicObject>> {
    let kubeconfig = kube::config::Kubeconfig::read_from(plane.0.kubeconfig())?;
    let config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("census.dev", "v1", "Identity"),
        "identities",
    );
    Ok(Api::all_with(kube::Client::try_from(config)?, &resource))
}

/// Objects left, as the API server counts them: a list of one and the count of the
/// rest (a full list every second would cost the API server more than the deletes).
async fn left(api: &Api<DynamicObject>) -> anyhow::Result<u64> {
    let page = api
        .list_metadata(&ListParams::default().limit(1))
        .await
        .context("listing one Identity object")?;
    Ok(page.items.len() as u64 + page.metadata.remaining_item_count.unwrap_or(0).max(0) as u64)
}

fn count_objects(plane: &Plane) -> anyhow::Result<u64> {
    let out = plane
        .0
        .kubectl_ok(&["get", "identities", "-o", "name"])
        .context("listing Identity objects")?;
    Ok(out.lines().filter(|l| !l.trim().is_empty()).count() as u64)
}

fn plots(results: &Results, samples: &BTreeMap<usize, Vec<Sample>>) -> anyhow::Result<()> {
    let series = |f: &dyn Fn(&Sample) -> f64| -> Vec<Series> {
        samples
            .iter()
            .map(|(n, s)| {
                Series::new(
                    format!("{n} identities"),
                    s.iter().map(|x| (x.t, f(x))).collect(),
                )
            })
            .collect()
    };
    figure(
        &results.path("seed-gc.svg"),
        "seconds since the operator started",
        &[
            Panel {
                title: "Identity objects left".into(),
                y_label: "objects".into(),
                series: series(&|s| s.objects as f64),
            },
            Panel {
                title: "409s the operator met and retried".into(),
                y_label: "conflicts".into(),
                series: series(&|s| s.conflicts as f64),
            },
            Panel {
                title: "operator RSS".into(),
                y_label: "MiB".into(),
                series: series(&|s| s.rss_bytes as f64 / 1048576.0),
            },
        ],
    )
}
