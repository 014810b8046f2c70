//! seed-leak (seeds/000, the retina-operator leak), replayed on the real control
//! plane: a steady workload on 3 kwok nodes, then Jobs created one `kubectl create`
//! at a time exactly as the report's script does (one pod each, `restartPolicy:
//! Never`, `ttlSecondsAfterFinished: 10`; kwok completes the pods, the real Job and
//! TTL-after-finished controllers finish and delete the Jobs), then every Identity
//! object deleted with `kubectl delete identities --all` as the report did, then a
//! quiet period. The operator's and each agent's RSS and live heap are read at the
//! report's points (idle, after 150, 300 and 450 Jobs, after the quiet period), with
//! the Identity objects and the identities beyond the live set (the distinct label
//! sets of the pods the agents hold, under the operator's filter). deploy/'s
//! admission policy refuses an administrator's `kubectl delete identities`, so the
//! delete is made as census-operator's ServiceAccount (impersonated), the one
//! account allowed to.
//!
//! Four phases, each with a fresh operator and fresh agents: the default label
//! filter (what a user gets: every run of a Job shares one identity) and the filter
//! keeping `job-name` and `controller-uid` (every pod a new identity, as in the
//! report: the leak test), each with the agents telling the operator of every pod's
//! end and with the agents dropping every such delete (the agent's test-only switch),
//! so that only the snapshots bring the identities back to the live set.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::Write as _,
    process::Stdio,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use anyhow::{Context as _, anyhow, bail};
use census_proto::labels::{KeyPattern, LabelFilter};
use parking_lot::Mutex;
use serde::Serialize;
use tokio::time::{Instant, sleep};

use super::{
    ready,
    world::{Binaries, Census, CensusFlags, Plane, Reading, poll},
};
use crate::{
    heap,
    plot::{Panel, Series, figure},
    presets::{SeedLeak, humantime},
    report::{Machine, Results, kib, mib, say, say_params},
    sample::{Latency, Metrics},
};

/// The report's operator RSS at its points (seeds/000): idle, after 150, 300, 450
/// Job pods, and 14 minutes after every identity was deleted.
pub(crate) const REPORT_RSS_MIB: [(&str, f64); 5] = [
    ("idle", 23.0),
    ("after 150", 30.0),
    ("after 300", 37.0),
    ("after 450", 44.0),
    ("quiet", 36.0),
];
const REFERENCE: &str = "seeds/000 (retina-operator v1.2.3 on kind): operator RSS 23 MiB idle, 30 / 37 / 44 MiB after 150 / 300 / 450 Job pods (+7 MiB per 150, linear), 36 MiB fourteen minutes after `kubectl delete ciliumidentities --all` (+13 MiB retained for identities that existed nowhere)";

/// The only account deploy/'s admission policy lets change or delete Identity objects.
const OPERATOR_ACCOUNT: &str = "system:serviceaccount:census-system:census-operator";

/// The namespace of the steady workload.
pub(crate) const STEADY_NS: &str = "seed-steady";
/// A probe pod for the time to identity every this many Jobs (seeds/ready.rs).
const PROBE_EVERY: usize = 3;
/// The label that gives each warm-up Job's pod an identity of its own.
const WARMUP_LABEL: &str = "warm-up";

#[derive(Debug, Clone, Serialize)]
struct Point {
    name: String,
    /// Seconds since the phase started.
    t: f64,
    operator: Reading,
    agents: Vec<Reading>,
    identity_objects: u64,
    quarantined_objects: u64,
    /// The distinct label sets of the pods the agents hold.
    live_set: u64,
    /// Identities the operator holds bound (live, creating, released, deleting) as
    /// the point was reached: released ones wait out the grace period.
    bound_at_point: u64,
    beyond_at_point: i64,
    /// The same once settled: what is left beyond the live set, and how long it took
    /// (at most the settle limit).
    beyond_settled: i64,
    settled_seconds: f64,
}

#[derive(Debug, Clone, Serialize)]
struct PhaseOut {
    name: String,
    keep_job_labels: bool,
    drop_deletes: bool,
    operator_flags: Vec<String>,
    points: Vec<Point>,
    jobs_created_seconds: f64,
    /// From the last Job created to the TTL controller having deleted every Job.
    jobs_gone_seconds: f64,
    deltas_dropped_by_agents: u64,
    corrections: u64,
    /// From a Job pod's end (seen Succeeded) to its identity's deletion (the
    /// Identity object gone or quarantined); only where each pod has its own
    /// identity. Polled every second: each value is ±1 s.
    end_to_deletion: Option<Latency>,
    heap_delta_bytes: i64,
    rss_delta_bytes: i64,
    agent_heap_delta_bytes: Vec<i64>,
    agent_rss_delta_bytes: Vec<i64>,
    /// What grew in the operator's sampled live heap from idle to after the quiet
    /// period, by owner (largest first), when profiled.
    heap_growth_by_owner: Vec<(String, i64)>,
    /// From a probe pod's IP to its identity in the maps.
    time_to_identity: ready::TimeToIdentity,
    passed: bool,
    failures: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
struct Timeline {
    phase: String,
    t: f64,
    operator_rss_bytes: u64,
    operator_heap_bytes: u64,
    agents_rss_bytes: Vec<u64>,
    identities_bound: u64,
    jobs_created: usize,
}

#[derive(Debug, Serialize)]
struct Output<'a> {
    params: &'a SeedLeak,
    machine: Machine,
    reference: &'static str,
    phases: Vec<PhaseOut>,
    timeline: Vec<Timeline>,
    passed: bool,
}

pub(crate) async fn run(bins: &Binaries, results: &Results, p: SeedLeak) -> anyhow::Result<bool> {
    say_params(&format!("preset {}", p.preset), &p);
    let mut machine = Machine::now();
    say(machine.line());
    let plane = Plane::up(p.plane_name, p.nodes).await?;
    say(format!(
        "control plane: Kubernetes {} at {}, nodes {}",
        plane.0.kubernetes(),
        plane.0.server(),
        plane
            .0
            .nodes()
            .iter()
            .map(|n| n.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    ));
    plane.namespace(STEADY_NS)?;
    for d in 0..p.steady_deployments {
        plane.0.apply(&steady_deployment(d, p.steady_replicas))?;
    }
    let steady = p.steady_deployments * p.steady_replicas;
    poll(
        "kwok runs the steady pods",
        Duration::from_secs(120),
        || (plane.0.running_pods(STEADY_NS).ok()?.len() == steady).then_some(()),
    )
    .await?;

    let mut phases = Vec::new();
    let mut timeline = Vec::new();
    for (k, &(keep, drop_deletes)) in p.variants.iter().enumerate() {
        let phase = run_phase(
            bins,
            results,
            &plane,
            &p,
            k,
            keep,
            drop_deletes,
            &mut timeline,
        )
        .await
        .with_context(|| format!("phase {}", phase_name(keep, drop_deletes)))?;
        phases.push(phase);
    }
    drop(plane);
    machine.finish();
    let passed = phases.iter().all(|ph| ph.passed);
    summary(&p, &phases, &machine, passed);
    plots(results, &timeline)?;
    results.write_json(
        "seed-leak.json",
        &Output {
            params: &p,
            machine,
            reference: REFERENCE,
            phases,
            timeline,
            passed,
        },
    )?;
    Ok(passed)
}

/// The (Job labels kept, deletes lost) of a phase's name.
pub(crate) fn parse_phase(name: &str) -> Result<(bool, bool), String> {
    let all = [(false, false), (false, true), (true, false), (true, true)];
    all.into_iter()
        .find(|&(keep, drop_deletes)| phase_name(keep, drop_deletes) == name)
        .ok_or_else(|| {
            let names: Vec<_> = all.iter().map(|&(k, d)| phase_name(k, d)).collect();
            format!("{name}: not a phase (one of {})", names.join(", "))
        })
}

fn phase_name(keep: bool, drop_deletes: bool) -> String {
    format!(
        "{}{}",
        if keep {
            "job-labels-kept"
        } else {
            "default-filter"
        },
        if drop_deletes { "+deletes-lost" } else { "" }
    )
}

pub(crate) fn steady_deployment(d: usize, replicas: usize) -> serde_json::Value {
    let name = format!("service-{d}");
    serde_json::json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": STEADY_NS},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name, "app.kubernetes.io/part-of": "shop"}},
                "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]},
            },
        },
    })
}

/// The report's Job, in `namespace`; with `label`, its pod carries that label too.
fn job_yaml(i: usize, namespace: &str, ttl: u32, label: Option<(&str, &str)>) -> String {
    let labels = label.map_or_else(String::new, |(key, value)| {
        format!("\n    metadata: {{labels: {{{key}: \"{value}\"}}}}")
    });
    format!(
        "apiVersion: batch/v1
kind: Job
metadata: {{name: churn-{i}, namespace: {namespace}}}
spec:
  ttlSecondsAfterFinished: {ttl}
  template:{labels}
    spec:
      restartPolicy: Never
      containers: [{{name: c, image: busybox:1.36, command: [\"true\"]}}]
"
    )
}

pub(crate) fn filter(keep: bool) -> anyhow::Result<LabelFilter> {
    let include: Vec<KeyPattern> = if keep {
        ["job-name", "controller-uid"]
            .iter()
            .map(|k| k.parse().map_err(|e| anyhow!("{k}: {e:?}")))
            .collect::<anyhow::Result<_>>()?
    } else {
        Vec::new()
    };
    Ok(LabelFilter::new(include, Vec::new(), true))
}

#[expect(clippy::too_many_arguments, reason = "one phase of the preset's run")]
async fn run_phase(
    bins: &Binaries,
    results: &Results,
    plane: &Plane,
    p: &SeedLeak,
    k: usize,
    keep: bool,
    drop_deletes: bool,
    timeline: &mut Vec<Timeline>,
) -> anyhow::Result<PhaseOut> {
    let (mut phase, operator_flags) =
        Phase::start(bins, results, plane, p, k, keep, drop_deletes).await?;
    let metrics_before = phase.census.operator_metrics().await?;

    let created = phase.warm_up().await?;
    let idle = phase.point("idle").await?;
    let idle_owners = owners(&phase.census, results, &phase.name, "idle", p).await?;
    let mut points = vec![idle];

    // Pod ends and identity deletions, polled in the background.
    let tracker = keep.then(|| Tracker::start(plane.0.clone(), phase.jobs_ns.clone()));
    let (jobs_created_seconds, time_to_identity) =
        phase.create_jobs(created, &mut points, timeline).await?;
    let jobs_gone_seconds = phase.jobs_gone(jobs_created_seconds).await?;
    phase.delete_identities()?;
    phase.quiet_period(timeline).await?;
    points.push(phase.point("quiet").await?);
    let quiet_owners = owners(&phase.census, results, &phase.name, "quiet", p).await?;
    let heap_growth_by_owner = heap_growth(idle_owners, quiet_owners);
    let end_to_deletion = tracker.map(|t| t.stop());
    let (corrections, dropped) = phase.counts(&metrics_before).await?;
    let Phase {
        census,
        name,
        jobs_ns,
        ..
    } = phase;
    census.stop().await?;
    let _ = plane
        .0
        .kubectl_ok(&["delete", "namespace", &jobs_ns, "--wait=false"]);

    let deltas = Deltas::of(&points)?;
    let latency = end_to_deletion.filter(|v| !v.is_empty()).map(Latency::of);
    let failures = phase_failures(&points, &deltas, latency.as_ref(), p);
    Ok(PhaseOut {
        name,
        keep_job_labels: keep,
        drop_deletes,
        operator_flags,
        points,
        jobs_created_seconds,
        jobs_gone_seconds,
        deltas_dropped_by_agents: dropped,
        corrections,
        end_to_deletion: latency,
        heap_delta_bytes: deltas.heap,
        rss_delta_bytes: deltas.rss,
        agent_heap_delta_bytes: deltas.agent_heap,
        agent_rss_delta_bytes: deltas.agent_rss,
        heap_growth_by_owner,
        time_to_identity,
        passed: failures.is_empty(),
        failures,
    })
}

/// The operator's flags for one phase: the report's intervals, and the Job labels
/// kept when `keep`.
fn phase_operator_flags(p: &SeedLeak, keep: bool) -> Vec<String> {
    let mut operator_flags = vec![
        "--snapshot-interval".to_owned(),
        humantime(p.snapshot_interval),
        "--grace-period".to_owned(),
        humantime(p.grace),
        "--quarantine".to_owned(),
        humantime(p.quarantine),
    ];
    if keep {
        operator_flags.extend([
            "--label-include".to_owned(),
            "job-name,controller-uid".to_owned(),
        ]);
    }
    operator_flags
}

/// One phase under way: its census, its Jobs' namespace and its clock.
struct Phase<'a> {
    plane: &'a Plane,
    p: &'a SeedLeak,
    census: Census,
    filter: LabelFilter,
    name: String,
    jobs_ns: String,
    started: Instant,
    settle_limit: Duration,
}

impl<'a> Phase<'a> {
    /// census started for one phase (announced with its flags), and the phase's
    /// namespace for its Jobs. Returns the phase and the operator's flags.
    async fn start(
        bins: &Binaries,
        results: &Results,
        plane: &'a Plane,
        p: &'a SeedLeak,
        k: usize,
        keep: bool,
        drop_deletes: bool,
    ) -> anyhow::Result<(Self, Vec<String>)> {
        let name = phase_name(keep, drop_deletes);
        let operator_flags = phase_operator_flags(p, keep);
        say(format!(
            "\n== phase {name}: operator flags {}{} ==",
            operator_flags.join(" "),
            if drop_deletes {
                "; agents with --test-drop-endpoint-deletes"
            } else {
                ""
            }
        ));
        let flags = CensusFlags {
            operator: operator_flags.clone(),
            drop_deletes,
            agent_nodes: None,
            heap_sample_lg: p.heap_sample_lg,
        };
        let census = Census::start(plane, bins, &flags, results.dir(), &format!("{k}")).await?;
        say(format!(
            "census up: operator pid {}, agents on {}",
            census.operator.pid,
            census.agent_nodes().join(", ")
        ));
        let filter = filter(keep)?;
        let jobs_ns = format!("seed-leak-{k}");
        plane.namespace(&jobs_ns)?;
        let phase = Phase {
            plane,
            p,
            census,
            filter,
            name,
            jobs_ns,
            started: Instant::now(),
            settle_limit: p.snapshot_interval * 3 + p.grace + Duration::from_secs(20),
        };
        Ok((phase, operator_flags))
    }

    /// The operator's corrections since `before`, and the deltas the agents dropped.
    async fn counts(&self, before: &Metrics) -> anyhow::Result<(u64, u64)> {
        let metrics_after = self.census.operator_metrics().await?;
        let corrections = (metrics_after.or_zero("census_corrections_total", "")
            - before.or_zero("census_corrections_total", "")) as u64;
        let mut dropped = 0u64;
        for agent_metrics in self.census.agent_metrics()? {
            dropped += agent_metrics.or_zero("census_agent_deltas_dropped_total", "") as u64;
        }
        Ok((corrections, dropped))
    }

    /// The levels and identities at one of the report's points, once settled.
    async fn point(&mut self, name: &str) -> anyhow::Result<Point> {
        point(
            self.plane,
            &mut self.census,
            &self.filter,
            name,
            self.started,
            self.settle_limit,
            self.p,
        )
        .await
    }

    /// A few Jobs through the whole path before the idle level is read, so one-time
    /// growth (connection pools, the first allocations of each path) is not counted
    /// as retained. Each warm-up Job's pod has a label of its own, so that with
    /// either filter each gets an identity, created and then deleted: the Identity
    /// writes the phase makes, made before the idle level (with the default filter
    /// the phase's Jobs share one identity, and its writes are its probes'). The
    /// level is read once those identities are gone, and no sooner than
    /// `warmup_min` after the operator started (the Lease's renewals). Returns how
    /// many Jobs were created.
    async fn warm_up(&self) -> anyhow::Result<usize> {
        let p = self.p;
        let mut created = 0usize;
        if p.warmup_jobs > 0 {
            say(format!(
                "warm-up: {} Jobs, each pod with a label of its own, then settle",
                p.warmup_jobs
            ));
            for _ in 0..p.warmup_jobs {
                created += 1;
                let value = created.to_string();
                let label = Some((WARMUP_LABEL, value.as_str()));
                create_labelled_job(self.plane, created, &self.jobs_ns, p.ttl_seconds, label)?;
            }
            jobs_gone(self.plane, &self.jobs_ns, Duration::from_secs(180)).await?;
        }
        let limit = self.settle_limit + p.quarantine;
        poll("the warm-up's identities to be deleted", limit, || {
            self.settled().ok().flatten()
        })
        .await?;
        let since_start = self.started.elapsed();
        if since_start < p.warmup_min {
            sleep(p.warmup_min - since_start).await;
        }
        say(format!(
            "  settled {:.0} s after the operator started",
            self.started.elapsed().as_secs_f64()
        ));
        Ok(created)
    }

    /// Whether the Identity objects are the live set, none quarantined.
    fn settled(&self) -> anyhow::Result<Option<()>> {
        let live = self.plane.live_set(&self.filter)?.len() as u64;
        let (objects, quarantined) = self.plane.identity_objects()?;
        Ok((objects == live && quarantined == 0).then_some(()))
    }

    /// The preset's Jobs, one `kubectl create` at a time, with a probe pod every
    /// PROBE_EVERY Jobs, the levels every 10 and a point at each checkpoint.
    /// Returns the seconds the creating took and the probes' time to identity.
    async fn create_jobs(
        &mut self,
        mut created: usize,
        points: &mut Vec<Point>,
        timeline: &mut Vec<Timeline>,
    ) -> anyhow::Result<(f64, ready::TimeToIdentity)> {
        let p = self.p;
        // Time to identity, on a probe pod created every PROBE_EVERY Jobs.
        let mut ready =
            ready::Tracker::start(&self.plane.0, &self.jobs_ns, self.census.probe_nodes())?;
        say(format!(
            "creating {} Jobs one `kubectl create` at a time (as the report's loop)",
            p.jobs
        ));
        let creating = Instant::now();
        for i in 1..=p.jobs {
            created += 1;
            create_job(self.plane, created, &self.jobs_ns, p.ttl_seconds)?;
            if i % PROBE_EVERY == 0 {
                ready.probe(i / PROBE_EVERY)?;
            }
            if i % 10 == 0 {
                timeline.push(self.levels(i).await?);
            }
            if p.checkpoints.contains(&i) {
                points.push(self.point(&format!("after {i}")).await?);
            }
        }
        let jobs_created_seconds = creating.elapsed().as_secs_f64();
        let time_to_identity = ready.stop()?;
        for line in time_to_identity.lines() {
            say(format!("  {line}"));
        }
        Ok((jobs_created_seconds, time_to_identity))
    }

    /// Waits for the TTL controller to delete every Job; returns the seconds it took.
    async fn jobs_gone(&self, jobs_created_seconds: f64) -> anyhow::Result<f64> {
        let gone_from = Instant::now();
        jobs_gone(self.plane, &self.jobs_ns, Duration::from_secs(300)).await?;
        let jobs_gone_seconds = gone_from.elapsed().as_secs_f64();
        say(format!(
            "  {} Jobs created in {jobs_created_seconds:.0} s; every Job deleted by its TTL {jobs_gone_seconds:.0} s after the last was created",
            self.p.jobs
        ));
        Ok(jobs_gone_seconds)
    }

    /// `kubectl delete identities --all`, as the report did. deploy/'s admission
    /// policy refuses an administrator's delete of Identity objects (403): the one
    /// account it lets delete them is census-operator's.
    fn delete_identities(&self) -> anyhow::Result<()> {
        say(format!(
            "  kubectl --as {OPERATOR_ACCOUNT} delete identities --all (as the report did; deploy/ refuses it to anyone else)"
        ));
        self.plane.0.kubectl_ok(&[
            "--as",
            OPERATOR_ACCOUNT,
            "delete",
            "identities",
            "--all",
            "--wait=false",
        ])?;
        Ok(())
    }

    /// The quiet period, with the levels every 2 s.
    async fn quiet_period(&mut self, timeline: &mut Vec<Timeline>) -> anyhow::Result<()> {
        say(format!("  quiet period: {:?}", self.p.quiet));
        let quiet_from = Instant::now();
        while quiet_from.elapsed() < self.p.quiet {
            sleep(Duration::from_secs(2)).await;
            timeline.push(self.levels(self.p.jobs).await?);
        }
        Ok(())
    }

    /// The operator's and the agents' levels now, for the timeline.
    async fn levels(&mut self, jobs_created: usize) -> anyhow::Result<Timeline> {
        let op = self.census.operator_reading().await?;
        let agents = self.census.agent_readings()?;
        let bound = self.census.operator_metrics().await?.bound();
        Ok(Timeline {
            phase: self.name.clone(),
            t: self.started.elapsed().as_secs_f64(),
            operator_rss_bytes: op.rss_bytes,
            operator_heap_bytes: op.heap_live_bytes,
            agents_rss_bytes: agents.iter().map(|a| a.rss_bytes).collect(),
            identities_bound: bound,
            jobs_created,
        })
    }
}

/// How far the levels moved from a phase's first point to its last.
struct Deltas {
    heap: i64,
    rss: i64,
    agent_heap: Vec<i64>,
    agent_rss: Vec<i64>,
}

impl Deltas {
    fn of(points: &[Point]) -> anyhow::Result<Self> {
        let first = points.first().context("no points")?;
        let last = points.last().context("no points")?;
        Ok(Self {
            heap: last.operator.heap_live_bytes as i64 - first.operator.heap_live_bytes as i64,
            rss: last.operator.rss_bytes as i64 - first.operator.rss_bytes as i64,
            agent_heap: first
                .agents
                .iter()
                .zip(&last.agents)
                .map(|(a, b)| b.heap_live_bytes as i64 - a.heap_live_bytes as i64)
                .collect(),
            agent_rss: first
                .agents
                .iter()
                .zip(&last.agents)
                .map(|(a, b)| b.rss_bytes as i64 - a.rss_bytes as i64)
                .collect(),
        })
    }
}

/// A phase judged against the preset's targets: every point's Identity objects
/// and settled identities at the live set, the operator's growth within bounds,
/// and (each Job pod with an identity of its own) a pod's end to its identity's
/// deletion.
fn phase_failures(
    points: &[Point],
    deltas: &Deltas,
    end_to_deletion: Option<&Latency>,
    p: &SeedLeak,
) -> Vec<String> {
    let mut failures = Vec::new();
    for pt in points {
        if pt.identity_objects != pt.live_set {
            failures.push(format!(
                "{}: {} Identity objects for a live set of {}",
                pt.name, pt.identity_objects, pt.live_set
            ));
        }
        if pt.beyond_settled != 0 {
            failures.push(format!(
                "{}: {} identities beyond the live set after {:.0} s",
                pt.name, pt.beyond_settled, pt.settled_seconds
            ));
        }
    }
    if deltas.heap > p.max_heap_delta_bytes {
        failures.push(format!(
            "operator live heap {} over idle after the quiet period (target: within {})",
            kib(deltas.heap),
            kib(p.max_heap_delta_bytes)
        ));
    }
    if let Some(max) = p.max_rss_delta_bytes
        && deltas.rss > max
    {
        failures.push(format!(
            "operator RSS {} over idle after the quiet period (target: within {})",
            kib(deltas.rss),
            kib(max)
        ));
    }
    if let Some(latency) = end_to_deletion
        && latency.p99_us > p.max_end_to_deletion.as_micros() as f64
    {
        failures.push(format!(
            "a Job pod's end to its identity's deletion p99 {:.1} s (target: within {:.1} s)",
            latency.p99_us / 1e6,
            p.max_end_to_deletion.as_secs_f64()
        ));
    }
    failures
}

/// The operator's live heap by owner (sampled), saved as `heap-<phase>-<when>.pb.gz`.
async fn owners(
    census: &Census,
    results: &Results,
    phase: &str,
    when: &str,
    p: &SeedLeak,
) -> anyhow::Result<Option<heap::Owners>> {
    if p.heap_sample_lg.is_none() {
        return Ok(None);
    }
    let (owners, profile) = heap::owners(census.operator.admin()).await?;
    std::fs::write(results.path(&format!("heap-{phase}-{when}.pb.gz")), profile)?;
    Ok(Some(owners))
}

/// What grew in the sampled live heap from idle to after the quiet period, by
/// owner, when profiled; the largest 8 printed.
fn heap_growth(idle: Option<heap::Owners>, quiet: Option<heap::Owners>) -> Vec<(String, i64)> {
    let heap_growth_by_owner = match (idle, quiet) {
        (Some(a), Some(b)) => growth(&a, &b),
        _ => Vec::new(),
    };
    for (owner, bytes) in heap_growth_by_owner.iter().take(8) {
        say(format!("    heap {:>12} {owner}", kib(*bytes)));
    }
    heap_growth_by_owner
}

/// `after - before` per owner, the largest growth first.
fn growth(before: &heap::Owners, after: &heap::Owners) -> Vec<(String, i64)> {
    let mut by: BTreeMap<&str, i64> = BTreeMap::new();
    for (o, b) in &after.owners {
        *by.entry(o).or_default() += *b as i64;
    }
    for (o, b) in &before.owners {
        *by.entry(o).or_default() -= *b as i64;
    }
    let mut v: Vec<(String, i64)> = by
        .into_iter()
        .filter(|(_, d)| *d != 0)
        .map(|(o, d)| (o.to_owned(), d))
        .collect();
    v.sort_by_key(|(_, d)| std::cmp::Reverse(*d));
    v
}

pub(crate) fn create_job(plane: &Plane, i: usize, namespace: &str, ttl: u32) -> anyhow::Result<()> {
    create_labelled_job(plane, i, namespace, ttl, None)
}

/// [`create_job`], its pod with `label` too.
fn create_labelled_job(
    plane: &Plane,
    i: usize,
    namespace: &str,
    ttl: u32,
    label: Option<(&str, &str)>,
) -> anyhow::Result<()> {
    let mut child = plane
        .0
        .kubectl()
        .args(["create", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("kubectl create")?;
    child
        .stdin
        .take()
        .context("kubectl's stdin")?
        .write_all(job_yaml(i, namespace, ttl, label).as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "kubectl create Job churn-{i}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

pub(crate) async fn jobs_gone(
    plane: &Plane,
    namespace: &str,
    limit: Duration,
) -> anyhow::Result<()> {
    poll("the TTL controller to delete every Job", limit, || {
        let jobs = plane
            .0
            .kubectl_json(&["-n", namespace, "get", "jobs"])
            .ok()?;
        let pods = plane
            .0
            .kubectl_json(&["-n", namespace, "get", "pods"])
            .ok()?;
        let empty = |l: &serde_json::Value| l["items"].as_array().is_some_and(Vec::is_empty);
        (empty(&jobs) && empty(&pods)).then_some(())
    })
    .await
}

/// Reads everything at one of the report's points: the levels first (the lowest
/// live heap and the median RSS over a few seconds), then how far the operator is
/// beyond the live set, then waits (at most `limit`) for it to settle.
async fn point(
    plane: &Plane,
    census: &mut Census,
    filter: &LabelFilter,
    name: &str,
    started: Instant,
    limit: Duration,
    p: &SeedLeak,
) -> anyhow::Result<Point> {
    let live = plane.live_set(filter)?.len() as u64;
    let bound_at_point = census.operator_metrics().await?.bound();
    let mut ops = Vec::new();
    let mut agents: Vec<Vec<Reading>> = Vec::new();
    for _ in 0..p.level_samples {
        ops.push(census.operator_reading().await?);
        agents.push(census.agent_readings()?);
        sleep(p.level_every).await;
    }
    let operator = level(&ops);
    let agent_levels: Vec<Reading> = (0..agents.first().map_or(0, Vec::len))
        .map(|i| level(&agents.iter().map(|a| a[i]).collect::<Vec<_>>()))
        .collect();
    let settling = Instant::now();
    let (mut beyond_settled, mut live_now, mut objects, mut quarantined);
    loop {
        live_now = plane.live_set(filter)?.len() as u64;
        let bound = census.operator_metrics().await?.bound();
        (objects, quarantined) = plane.identity_objects()?;
        beyond_settled = bound as i64 - live_now as i64;
        let settled = beyond_settled == 0 && objects == live_now;
        if settled || settling.elapsed() > limit {
            break;
        }
        sleep(Duration::from_millis(500)).await;
    }
    let pt = Point {
        name: name.to_owned(),
        t: started.elapsed().as_secs_f64(),
        operator,
        agents: agent_levels,
        identity_objects: objects,
        quarantined_objects: quarantined,
        live_set: live_now,
        bound_at_point,
        beyond_at_point: bound_at_point as i64 - live as i64,
        beyond_settled,
        settled_seconds: settling.elapsed().as_secs_f64(),
    };
    say(format!(
        "  {:<10} operator RSS {} heap {}; agents RSS {}; Identity objects {} (+{} quarantined); live set {}; beyond it {} at the point, {} after {:.1} s",
        pt.name,
        mib(pt.operator.rss_bytes),
        mib(pt.operator.heap_live_bytes),
        pt.agents
            .iter()
            .map(|a| mib(a.rss_bytes))
            .collect::<Vec<_>>()
            .join(" / "),
        pt.identity_objects,
        pt.quarantined_objects,
        pt.live_set,
        pt.beyond_at_point,
        pt.beyond_settled,
        pt.settled_seconds
    ));
    Ok(pt)
}

/// The lowest live heap (a sample is only raised by work in flight) and the median
/// RSS of some readings.
pub(crate) fn level(readings: &[Reading]) -> Reading {
    let mut rss: Vec<u64> = readings.iter().map(|r| r.rss_bytes).collect();
    rss.sort_unstable();
    Reading {
        rss_bytes: rss.get(rss.len() / 2).copied().unwrap_or(0),
        heap_live_bytes: readings
            .iter()
            .map(|r| r.heap_live_bytes)
            .min()
            .unwrap_or(0),
    }
}

/// Polls the Job pods and the Identity objects every second: when each Job's pod
/// was first seen Succeeded, and when the identity of its labels was first seen
/// gone (deleted or quarantined) after having been seen bound.
struct Tracker {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<Duration>>,
}

#[derive(Default)]
struct Seen {
    ended: BTreeMap<String, std::time::Instant>,
    bound: BTreeSet<String>,
    deleted: BTreeMap<String, std::time::Instant>,
}

impl Tracker {
    fn start(plane: census_cluster::ControlPlane, namespace: String) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let seen = Arc::new(Mutex::new(Seen::default()));
        let thread = std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                let tick = std::time::Instant::now();
                if let Ok(pods) = plane.kubectl_json(&["-n", &namespace, "get", "pods"]) {
                    let mut s = seen.lock();
                    for pod in pods["items"].as_array().into_iter().flatten() {
                        let job = pod["metadata"]["labels"]["job-name"].as_str();
                        if let Some(job) = job
                            && pod["status"]["phase"] == "Succeeded"
                        {
                            s.ended.entry(job.to_owned()).or_insert(tick);
                        }
                    }
                }
                if let Ok(list) = plane.kubectl_json(&["get", "identities"]) {
                    let mut now_bound = BTreeSet::new();
                    for o in list["items"].as_array().into_iter().flatten() {
                        if o["status"]["state"] == "Quarantined" {
                            continue;
                        }
                        let job = o["spec"]["labels"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .filter_map(serde_json::Value::as_str)
                            .find_map(|l| l.strip_prefix("k8s:job-name="));
                        if let Some(job) = job {
                            now_bound.insert(job.to_owned());
                        }
                    }
                    let mut s = seen.lock();
                    let gone: Vec<String> = s.bound.difference(&now_bound).cloned().collect();
                    for job in gone {
                        s.deleted.entry(job).or_insert(tick);
                    }
                    s.bound.extend(now_bound);
                }
                let spent = tick.elapsed();
                if spent < Duration::from_secs(1) {
                    std::thread::sleep(Duration::from_secs(1) - spent);
                }
            }
            let s = seen.lock();
            s.ended
                .iter()
                .filter_map(|(job, end)| {
                    s.deleted
                        .get(job)
                        .map(|d| d.saturating_duration_since(*end))
                })
                .collect()
        });
        Self { stop, thread }
    }

    fn stop(self) -> Vec<Duration> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

fn summary(p: &SeedLeak, phases: &[PhaseOut], machine: &Machine, passed: bool) {
    say("");
    say(format!(
        "== {}: {} kwok nodes, {} steady pods, {} Jobs per phase (ttlSecondsAfterFinished {}), quiet period {:?} ==",
        p.preset,
        p.nodes,
        p.steady_deployments * p.steady_replicas,
        p.jobs,
        p.ttl_seconds,
        p.quiet
    ));
    say(REFERENCE);
    say_rss_table(phases);
    say(
        "per phase: operator heap and RSS after the quiet period against idle; agents; identities beyond the live set (at the point / settled); pod end -> identity deleted:",
    );
    for ph in phases {
        say_phase(ph);
    }
    for ph in phases {
        let t = &ph.time_to_identity;
        say(format!(
            "  {:<30} time to identity: own node p99 {:.0} ms (target < 250 ms: {}), other nodes p99 {:.0} ms (target < 1 s: {}); {} pods, {} never written",
            ph.name,
            t.own_node.p99_us / 1e3,
            met(t.own_node.p99_us < 250e3),
            t.other_nodes.p99_us / 1e3,
            met(t.other_nodes.p99_us < 1e6),
            t.pods,
            t.never_written
        ));
    }
    say(format!(
        "targets: identities beyond the live set 0 once settled at every point; operator live heap within {} and RSS within {} of idle after the quiet period; a Job pod's end to its identity's deletion p99 within {:.0} s",
        kib(p.max_heap_delta_bytes),
        p.max_rss_delta_bytes.map_or("(not gated)".to_owned(), kib),
        p.max_end_to_deletion.as_secs_f64()
    ));
    say(machine.line());
    say(if passed {
        "seed-leak: PASS"
    } else {
        "seed-leak: FAIL"
    });
}

/// The operator's RSS at the report's points: the report's, then each phase's.
fn say_rss_table(phases: &[PhaseOut]) {
    say("operator RSS (MiB) at the report's points, the report's first:");
    let names: Vec<&str> = phases
        .first()
        .map(|ph| ph.points.iter().map(|pt| pt.name.as_str()).collect())
        .unwrap_or_default();
    let mut header = format!("  {:<30}", "");
    for n in &names {
        header.push_str(&format!(" {n:>10}"));
    }
    say(header);
    let mut report = format!("  {:<30}", "seeds/000 retina-operator");
    for n in &names {
        let v = REPORT_RSS_MIB
            .iter()
            .find(|(k, _)| k == n)
            .map_or("-".to_owned(), |(_, v)| format!("{v:.0}"));
        report.push_str(&format!(" {v:>10}"));
    }
    say(report);
    for ph in phases {
        let mut line = format!("  {:<30}", format!("census {}", ph.name));
        for pt in &ph.points {
            line.push_str(&format!(
                " {:>10.1}",
                pt.operator.rss_bytes as f64 / 1048576.0
            ));
        }
        say(line);
    }
}

/// One phase's deltas, identities beyond the live set, corrections and verdict.
fn say_phase(ph: &PhaseOut) {
    let beyond: Vec<String> = ph
        .points
        .iter()
        .map(|pt| format!("{}/{}", pt.beyond_at_point, pt.beyond_settled))
        .collect();
    let agents_heap: Vec<String> = ph.agent_heap_delta_bytes.iter().map(|d| kib(*d)).collect();
    let agents_rss: Vec<String> = ph.agent_rss_delta_bytes.iter().map(|d| kib(*d)).collect();
    say(format!(
        "  {:<30} heap {} RSS {}; agents heap {} RSS {}; beyond {}; deletes dropped {} corrections {}; end->deletion {}; {}",
        ph.name,
        kib(ph.heap_delta_bytes),
        kib(ph.rss_delta_bytes),
        agents_heap.join(" "),
        agents_rss.join(" "),
        beyond.join(" "),
        ph.deltas_dropped_by_agents,
        ph.corrections,
        ph.end_to_deletion
            .as_ref()
            .map_or("n/a (shared identity)".to_owned(), |l| format!(
                "p50 {:.1} s p99 {:.1} s ({} pods)",
                l.p50_us / 1e6,
                l.p99_us / 1e6,
                l.count
            )),
        if ph.passed {
            "PASS".to_owned()
        } else {
            format!("FAIL: {}", ph.failures.join("; "))
        }
    ));
}

fn met(yes: bool) -> &'static str {
    if yes { "met" } else { "missed" }
}

fn plots(results: &Results, timeline: &[Timeline]) -> anyhow::Result<()> {
    let phases: BTreeSet<&str> = timeline.iter().map(|t| t.phase.as_str()).collect();
    let series = |f: &dyn Fn(&Timeline) -> f64| -> Vec<Series> {
        phases
            .iter()
            .map(|ph| {
                Series::new(
                    *ph,
                    timeline
                        .iter()
                        .filter(|t| t.phase == *ph)
                        .map(|t| (t.t, f(t)))
                        .collect(),
                )
            })
            .collect()
    };
    let mib_of = |b: u64| b as f64 / 1048576.0;
    figure(
        &results.path("seed-leak.svg"),
        "seconds since the phase started",
        &[
            Panel {
                title: "operator RSS".into(),
                y_label: "MiB".into(),
                series: series(&|t| mib_of(t.operator_rss_bytes)),
            },
            Panel {
                title: "operator live heap".into(),
                y_label: "MiB".into(),
                series: series(&|t| mib_of(t.operator_heap_bytes)),
            },
            Panel {
                title: "agents' RSS (largest)".into(),
                y_label: "MiB".into(),
                series: series(&|t| mib_of(t.agents_rss_bytes.iter().copied().max().unwrap_or(0))),
            },
            Panel {
                title: "identities the operator holds".into(),
                y_label: "identities".into(),
                series: series(&|t| t.identities_bound as f64),
            },
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::presets::{Preset, seed_leak};

    /// A pod whose identity waits out a hold (three snapshot intervals) before the
    /// grace period fails the gate; one released at the next snapshot passes.
    #[test]
    fn a_job_pod_s_identity_deleted_after_its_hold_would_have_ended_fails_the_phase() {
        let p = seed_leak(Preset::SeedLeakShort);
        let deltas = Deltas {
            heap: 0,
            rss: 0,
            agent_heap: Vec::new(),
            agent_rss: Vec::new(),
        };
        let latency = |p99_s: f64| Latency {
            count: 60,
            p50_us: p99_s * 1e6,
            p99_us: p99_s * 1e6,
            p999_us: p99_s * 1e6,
            max_us: p99_s * 1e6,
        };
        assert!(phase_failures(&[], &deltas, Some(&latency(4.0)), &p).is_empty());
        assert!(phase_failures(&[], &deltas, None, &p).is_empty());
        assert_eq!(
            phase_failures(&[], &deltas, Some(&latency(8.0)), &p),
            ["a Job pod's end to its identity's deletion p99 8.0 s (target: within 6.0 s)"]
        );
    }
}
