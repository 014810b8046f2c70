//! seed-gc (seeds/003, the GC that abandons its pass on one conflicting delete),
//! replayed on the real control plane: 10,000 Identity objects that no pod uses,
//! written as census writes them, then census's operator started on them in
//! Kubernetes mode; it holds what it loads for one node TTL, releases it, and
//! deletes it within its budget, while a second writer keeps annotating the objects
//! the GC is about to delete (the lowest ids first, several `kubectl annotate` at a
//! time), so deletes meet conflicts. The operator must finish every pass: every
//! object deleted, the conflicts retried, deletes per second beside Cilium's
//! default budget (2,500 a minute).
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
use serde::Serialize;
use tokio::time::{Instant, sleep};

use super::world::{Binaries, Plane};
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
    annotations_written: u64,
    annotations_per_second: f64,
    annotations_failed: u64,
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
        "== {}: released Identity objects on a real control plane, a second writer annotating them, GC budget {}/s ==",
        p.preset, p.gc_rate
    ));
    say(REFERENCE);
    say(format!(
        "  {:>10} {:>9} {:>11} {:>10} {:>9} {:>6} {:>22} {:>12} {:>9}",
        "identities",
        "create s",
        "1st delete",
        "delete s",
        "deletes/s",
        "left",
        "GC outcomes",
        "annotations",
        "RSS peak"
    ));
    for r in &runs {
        let outcomes: Vec<String> = r
            .gc_outcomes
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        say(format!(
            "  {:>10} {:>9.0} {:>10.1}s {:>10.1} {:>9.0} {:>6} {:>22} {:>6} {:>3.0}/s {:>9}",
            r.identities,
            r.create_seconds,
            r.first_delete_seconds,
            r.delete_seconds,
            r.deletes_per_second,
            r.left,
            outcomes.join(", "),
            r.annotations_written,
            r.annotations_per_second,
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
    let args = operator_args(plane, p)?;
    say(format!("  operator flags: {}", args.join(" ")));
    let launch = Launch::new(
        dir.path(),
        results.path(&format!("operator-gc-{n}.log")),
        args,
    )?;
    let started = Instant::now();
    let op = Operator::start(&bins.operator, launch).await?;

    let writer = SecondWriter::start(plane, n, p.writers);
    let limit = Duration::from_secs(p.limit_seconds);
    let gc = watch_gc(plane, &op, started, limit).await?;
    let written = writer.stop();
    let m = Metrics::scrape(op.admin()).await?;
    let gc_outcomes = m.labelled("census_gc_outcomes_total", "outcome");
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
        annotations_written: written.written,
        annotations_per_second: written.written as f64 / written.seconds,
        annotations_failed: written.failed,
        peak_rss_bytes: samples.iter().map(|s| s.rss_bytes).max().unwrap_or(0),
        peak_heap_bytes: samples.iter().map(|s| s.heap_bytes).max().unwrap_or(0),
        passed: left == 0 && delete_seconds < max,
    };
    say(format!(
        "  first GC delete {first:.1} s after the operator started; every object gone {delete_seconds:.1} s later ({:.0}/s); {} annotations written ({:.0}/s, {} failed: the object was gone)",
        run.deletes_per_second,
        run.annotations_written,
        run.annotations_per_second,
        run.annotations_failed
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
fn operator_args(plane: &Plane, p: &SeedGc) -> anyhow::Result<Vec<String>> {
    let certs = census_testkit::tls::Certs::generate(&[], &[]).map_err(|e| anyhow!("{e}"))?;
    let mut args: Vec<String> = [
        "--store",
        "kubernetes",
        "--namespace",
        "default",
        "--pod-name",
        "seed-gc-operator",
        // An address of the cluster's pod range, as the downward API would give
        // (the leader publishes it in its EndpointSlice).
        "--pod-ip",
        "198.18.255.250",
        "--kubeconfig",
        &plane.0.kubeconfig().display().to_string(),
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
        "--log",
        "info",
    ]
    .map(String::from)
    .to_vec();
    args.extend(
        certs
            .operator_flags()
            .map_err(|e| anyhow!("{e}"))?
            .into_iter()
            .take(4),
    );
    Ok(args)
}

/// The second writer: threads annotating the lowest ids still there, `writers` at
/// a time, until stopped or every object is gone.
struct SecondWriter {
    stop: Arc<AtomicBool>,
    written: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    threads: Vec<std::thread::JoinHandle<()>>,
    writing: Instant,
}

/// What the second writer wrote: annotations written and failed, over how long.
struct Written {
    written: u64,
    failed: u64,
    seconds: f64,
}

impl SecondWriter {
    fn start(plane: &Plane, n: usize, writers: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let written = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let mut threads = Vec::new();
        for w in 0..writers {
            let (stop, written, failed) = (stop.clone(), written.clone(), failed.clone());
            let plane = plane.0.clone();
            threads.push(std::thread::spawn(move || {
                let mut round = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    round += 1;
                    let mut any = false;
                    for i in (w..n).step_by(writers) {
                        if stop.load(Ordering::Relaxed) {
                            return;
                        }
                        let id = (FIRST_ID + i as u64).to_string();
                        let note = format!("seeds.census.dev/touched={round}");
                        match plane.kubectl_ok(&["annotate", "identity", &id, &note, "--overwrite"])
                        {
                            Ok(_) => {
                                written.fetch_add(1, Ordering::Relaxed);
                                any = true;
                            }
                            Err(_) => {
                                failed.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    if !any {
                        return;
                    }
                }
            }));
        }
        Self {
            stop,
            written,
            failed,
            threads,
            writing: Instant::now(),
        }
    }

    fn stop(self) -> Written {
        self.stop.store(true, Ordering::Relaxed);
        let seconds = self.writing.elapsed().as_secs_f64();
        for t in self.threads {
            let _ = t.join();
        }
        Written {
            written: self.written.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            seconds,
        }
    }
}

/// The GC as watched: a sample a second, when the first delete came and when the
/// last object went.
struct Gc {
    samples: Vec<Sample>,
    first_delete: Option<f64>,
    done_at: Option<f64>,
}

/// Samples the operator and counts the objects every second until none is left or
/// `limit` from `started`.
async fn watch_gc(
    plane: &Plane,
    op: &Operator,
    started: Instant,
    limit: Duration,
) -> anyhow::Result<Gc> {
    let mut samples = Vec::new();
    let mut first_delete: Option<f64> = None;
    let mut done_at: Option<f64> = None;
    while started.elapsed() < limit {
        sleep(Duration::from_secs(1)).await;
        let m = Metrics::scrape(op.admin()).await?;
        let objects = count_objects(plane)?;
        let deleted = m.or_zero("census_gc_outcomes_total", "outcome=\"deleted\"") as u64;
        let t = started.elapsed().as_secs_f64();
        if deleted > 0 && first_delete.is_none() {
            first_delete = Some(t);
        }
        samples.push(Sample {
            t,
            objects,
            deleted,
            conflicts: m.or_zero("census_gc_outcomes_total", "outcome=\"conflict\"") as u64,
            rss_bytes: Proc::read(op.pid)?.rss,
            heap_bytes: m.heap().unwrap_or(0),
        });
        if objects == 0 {
            done_at = Some(t);
            break;
        }
    }
    Ok(Gc {
        samples,
        first_delete,
        done_at,
    })
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
                title: "GC conflicts (retried)".into(),
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
