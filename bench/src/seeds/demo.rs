//! `cargo xtask demo --cluster`: seed-leak's story told to a user who watches it. On
//! the same world as the seed presets ([`world`]: a local control plane, `deploy/`
//! applied, census's operator in Kubernetes mode and one agent per kwok node), a few
//! Deployments, then a burst of Jobs as seeds/000's loop makes them, with the
//! operator keeping `job-name` and `controller-uid` as the report's cluster did (every
//! Job pod an identity of its own: the case that leaked there). While the Jobs come
//! and go it shows `census identity list` and `kubectl get identities` side by side
//! and the operator's memory beside the report's; it ends when the identities are
//! back to the live set, and fails if they are not.
//!
//! [`world`]: super::world

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
    process::Command,
    time::Duration,
};

use anyhow::{Context as _, bail};
use census_proto::labels::LabelFilter;
use tokio::time::{Instant, sleep};

use super::{
    leak::{REPORT_RSS_MIB, STEADY_NS, create_job, filter, jobs_gone, level, steady_deployment},
    world::{Binaries, Census, CensusFlags, Plane, Reading},
};
use crate::{
    presets::Timers,
    report::{mib, say},
};

const PLANE: &str = "demo";
const NODES: u32 = 3;
const DEPLOYMENTS: usize = 3;
const REPLICAS: usize = 2;
/// The report's first point: its operator had grown by 7 MiB after 150 Job pods.
const JOBS: usize = 150;
const JOBS_NS: &str = "demo-jobs";
const TTL_SECONDS: u32 = 10;
/// How often a progress line is printed while waiting.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);
/// The width of the tables' label columns (`app.kubernetes.io/name=census-operator`).
const LABELS_WIDTH: usize = 38;
/// Rows of each table shown; the rest are counted.
const ROWS: usize = 12;
/// From the last Job's end, the time the identities have to come back to the live
/// set: a few snapshot intervals and the grace period, with room for a slow machine.
const SETTLE_LIMIT: Duration = Duration::from_secs(90);

/// The operator's timers, shortened so the story fits in a few minutes (defaults:
/// snapshots every 30 s, deletion 60 s after release, ids reusable after 10 min).
fn timers() -> Timers {
    Timers {
        snapshot_interval: Duration::from_secs(2),
        grace: Duration::from_secs(2),
        quarantine: Duration::from_secs(5),
        gc_rate: 100.0,
    }
}

fn step(text: &str) {
    say(format!("\n==> {text}"));
}

/// Runs the demo; whether the identities came back to the live set.
pub(crate) async fn run(bins: &Binaries, cli: &Path) -> anyhow::Result<bool> {
    let started = Instant::now();
    step(&format!(
        "a Kubernetes control plane on this machine: etcd, kube-apiserver, \
         kube-controller-manager, kube-scheduler, and kwok playing {NODES} nodes \
         (built from the pinned upstream modules the first time)"
    ));
    let plane = Plane::up(PLANE, NODES).await?;
    say(format!(
        "    Kubernetes {} at {}; deploy/ applied (the Identity CRD, RBAC, the \
         operator's Deployment, the agent's DaemonSet), and kwok runs their pods:",
        plane.0.kubernetes(),
        plane.0.server()
    ));
    show(&plane.0.kubectl_ok(&["get", "pods", "-A", "-o", "wide"])?);
    let logs = plane.0.dir().join("census-logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    let census = start_census(&plane, bins, &logs).await?;
    let demo = Demo {
        plane: &plane,
        census,
        cli,
        filter: filter(true)?,
    };
    let back = demo.story().await?;
    demo.census.stop().await?;
    say(format!(
        "\n{} in {:.0?}; census's logs are in {}",
        if back {
            "done"
        } else {
            "FAILED: the identities did not come back to the live set"
        },
        started.elapsed(),
        logs.display()
    ));
    Ok(back)
}

async fn start_census(plane: &Plane, bins: &Binaries, logs: &Path) -> anyhow::Result<Census> {
    step(
        "census in those pods' places (kwok runs no containers): census-operator with its \
         pod's ServiceAccount token, the Identity CRD as its store; one census-agent per \
         node in a network namespace of its own, with its DaemonSet pod's tokens",
    );
    let mut operator = timers().flags();
    operator.extend([
        "--label-include".to_owned(),
        "job-name,controller-uid".to_owned(),
    ]);
    say(format!("    operator flags: {}", operator.join(" ")));
    say(
        "    (timers shortened for the demo; `job-name` and `controller-uid` kept, as in the \
         report's cluster: every Job pod gets an identity of its own, the case that leaked there)",
    );
    let flags = CensusFlags {
        operator,
        drop_deletes: false,
        agent_nodes: None,
        heap_sample_lg: None,
    };
    let census = Census::start(plane, bins, &flags, logs, "demo").await?;
    say(format!(
        "    operator pid {}, leading (the Lease is its pod's); agents Ready on {}",
        census.operator.pid,
        census.agent_nodes().join(", ")
    ));
    Ok(census)
}

/// Prints a command's output, indented.
fn show(text: &str) {
    for line in text.lines() {
        say(format!("    {line}"));
    }
}

struct Demo<'a> {
    plane: &'a Plane,
    census: Census,
    cli: &'a Path,
    /// The operator's label filter, for the live set.
    filter: LabelFilter,
}

/// The operator's memory at the demo's points.
struct Memory {
    idle: Reading,
    burst: Reading,
    back: Reading,
}

impl Demo<'_> {
    async fn story(&self) -> anyhow::Result<bool> {
        self.deployments().await?;
        let idle = self.memory().await?;
        let from = Instant::now();
        self.burst(from).await?;
        let burst = self.memory().await?;
        let back = self.until_back(from).await?;
        step("the identities now, side by side");
        self.side_by_side().await?;
        let memory = Memory {
            idle,
            burst,
            back: self.memory().await?,
        };
        memory_line(&memory);
        Ok(back)
    }

    async fn deployments(&self) -> anyhow::Result<()> {
        step(&format!(
            "{DEPLOYMENTS} Deployments of {REPLICAS} replicas in namespace {STEADY_NS}"
        ));
        self.plane.namespace(STEADY_NS)?;
        for d in 0..DEPLOYMENTS {
            self.plane.0.apply(&steady_deployment(d, REPLICAS))?;
        }
        let want = DEPLOYMENTS * REPLICAS;
        super::world::poll(
            "kwok runs the Deployments' pods",
            Duration::from_secs(120),
            || (self.plane.0.running_pods(STEADY_NS).ok()?.len() == want).then_some(()),
        )
        .await?;
        let (live, since) = (self.live_set()?, Instant::now());
        while self.bound_now().await? != live {
            if since.elapsed() > Duration::from_secs(60) {
                bail!("the operator did not hold the live set ({live} identities) within 60 s");
            }
            sleep(Duration::from_millis(500)).await;
        }
        say(format!(
            "    {want} pods Running; each Deployment's replicas share one identity (the \
             operator's filter drops pod-template-hash); {live} identities in all, \
             census-operator's own two pods (one identity) included"
        ));
        self.side_by_side().await
    }

    /// Creates the Jobs (progress lines timed `from`).
    async fn burst(&self, from: Instant) -> anyhow::Result<()> {
        step(&format!(
            "a burst of {JOBS} Jobs, one `kubectl create` each as the report's loop: one pod \
             each, restartPolicy Never, ttlSecondsAfterFinished {TTL_SECONDS} (kwok completes \
             the pods; the Job and TTL controllers delete the Jobs)"
        ));
        self.plane.namespace(JOBS_NS)?;
        for i in 1..=JOBS {
            create_job(self.plane, i, JOBS_NS, TTL_SECONDS)?;
            if i % 50 == 0 {
                self.progress(from, &format!("{i} Jobs created")).await?;
            }
        }
        step("at the end of the burst, side by side");
        self.side_by_side().await
    }

    /// Waits for every Job to be gone and the identities to be back to the live set,
    /// with a line every few seconds (timed `from` the burst's start); whether they
    /// came back.
    async fn until_back(&self, from: Instant) -> anyhow::Result<bool> {
        step(&format!(
            "the Jobs go: each pod ends, the TTL controller deletes its Job {TTL_SECONDS} s \
             later; the agents tell the operator, whose snapshots also correct whatever a \
             delete missed"
        ));
        let gone = jobs_gone(self.plane, JOBS_NS, Duration::from_secs(300));
        tokio::pin!(gone);
        loop {
            tokio::select! {
                r = &mut gone => break r?,
                () = sleep(PROGRESS_EVERY) => self.progress(from, "Jobs finishing").await?,
            }
        }
        let (since, live) = (Instant::now(), self.live_set()?);
        let mut shown = Instant::now();
        loop {
            let bound = self.bound_now().await?;
            let (objects, _) = self.plane.identity_objects()?;
            let back = bound == live && objects == live;
            if back || since.elapsed() > SETTLE_LIMIT {
                self.progress(from, "every Job gone").await?;
                say(if back {
                    format!(
                        "    back to the live set: {live} identities, {live} Identity objects \
                         bound, {:.0?} after the last Job went",
                        since.elapsed()
                    )
                } else {
                    format!(
                        "    NOT back to the live set after {SETTLE_LIMIT:?}: the operator \
                         holds {bound} identities, {objects} Identity objects are bound, the \
                         live set is {live}"
                    )
                });
                return Ok(back);
            }
            if shown.elapsed() >= PROGRESS_EVERY {
                self.progress(from, "every Job gone").await?;
                shown = Instant::now();
            }
            sleep(Duration::from_millis(500)).await;
        }
    }

    /// One line: the Job pods, the identities as census and the API server see
    /// them, and the operator's RSS.
    async fn progress(&self, from: Instant, what: &str) -> anyhow::Result<()> {
        let pods = self.plane.0.kubectl_json(&["-n", JOBS_NS, "get", "pods"])?;
        let mut phases: BTreeMap<String, usize> = BTreeMap::new();
        for pod in pods["items"].as_array().into_iter().flatten() {
            let phase = pod["status"]["phase"].as_str().unwrap_or("Unknown");
            *phases.entry(phase.to_owned()).or_default() += 1;
        }
        let metrics = self.census.operator_metrics().await?;
        let (objects, quarantined) = self.plane.identity_objects()?;
        let rss = self.census.operator_reading().await?.rss_bytes;
        say(format!(
            "    {:>5.0?} {what:<16} Job pods {:<26} census: {} live, {} released \
             | Identity objects: {objects} (+{quarantined} quarantined) | operator RSS {}",
            from.elapsed(),
            if phases.is_empty() {
                "none".to_owned()
            } else {
                phases
                    .iter()
                    .map(|(p, n)| format!("{n} {p}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            },
            metrics.identities("live"),
            metrics.identities("released") + metrics.identities("deleting"),
            mib(rss)
        ));
        Ok(())
    }

    fn live_set(&self) -> anyhow::Result<u64> {
        Ok(self.plane.live_set(&self.filter)?.len() as u64)
    }

    /// The identities the operator holds bound (released ones included: they wait
    /// out the grace period).
    async fn bound_now(&self) -> anyhow::Result<u64> {
        Ok(self.census.operator_metrics().await?.bound())
    }

    /// The operator's level: the median RSS and lowest live heap over a few seconds.
    async fn memory(&self) -> anyhow::Result<Reading> {
        let mut readings = Vec::new();
        for _ in 0..3 {
            readings.push(self.census.operator_reading().await?);
            sleep(Duration::from_secs(1)).await;
        }
        Ok(level(&readings))
    }

    /// `census identity list` and `kubectl get identities`, one row per id.
    async fn side_by_side(&self) -> anyhow::Result<()> {
        let census = self.census_identities()?;
        let objects = kubectl_identities(self.plane)?;
        say(format!(
            "    {:<63}| {}",
            "$ census identity list --include-quarantined", "$ kubectl get identities"
        ));
        say(format!(
            "    {:<6} {:<11} {:>4}  {:<LABELS_WIDTH$}| {:<6} {:<12} {}",
            "ID", "STATE", "REFS", "LABELS", "NAME", "STATE", "LABELS"
        ));
        let ids: BTreeSet<u32> = census.keys().chain(objects.keys()).copied().collect();
        for id in ids.iter().take(ROWS) {
            let left = census.get(id).map_or(String::new(), |c| {
                format!(
                    "{id:<6} {:<11} {:>4}  {:<LABELS_WIDTH$}",
                    c.state, c.references, c.labels
                )
            });
            let right = objects.get(id).map_or(String::new(), |o| {
                format!("{id:<6} {:<12} {}", o.state, o.labels)
            });
            say(format!("    {left:<63}| {right}"));
        }
        if ids.len() > ROWS {
            say(format!("    ... and {} more ids", ids.len() - ROWS));
        }
        say(format!(
            "    census: {} bound, {} quarantined | kubectl: {} bound, {} quarantined",
            census.values().filter(|c| c.state != "quarantined").count(),
            census.values().filter(|c| c.state == "quarantined").count(),
            objects.values().filter(|o| o.state.is_empty()).count(),
            objects.values().filter(|o| !o.state.is_empty()).count(),
        ));
        Ok(())
    }

    /// `census identity list -o json`, as run in the first node's agent pod.
    fn census_identities(&self) -> anyhow::Result<BTreeMap<u32, Listed>> {
        let output = Command::new(self.cli)
            .args(self.census.cli_flags()?)
            .args(["identity", "list", "--include-quarantined", "-o", "json"])
            .output()
            .with_context(|| format!("running {}", self.cli.display()))?;
        if !output.status.success() {
            bail!(
                "census identity list: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        let listed: serde_json::Value = serde_json::from_slice(&output.stdout)?;
        Ok(listed
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|i| {
                let id = u32::try_from(i["id"].as_u64()?).ok()?;
                Some((
                    id,
                    Listed {
                        state: i["state"].as_str().unwrap_or("?").to_owned(),
                        references: i["references"].as_u64().unwrap_or(0),
                        labels: short_labels(&i["labels"]),
                    },
                ))
            })
            .collect())
    }
}

/// One identity as `census identity list` shows it.
struct Listed {
    state: String,
    references: u64,
    labels: String,
}

/// One Identity object as `kubectl get identities` shows it.
struct Object {
    /// Empty for a bound id, `Quarantined` for a tombstone.
    state: String,
    labels: String,
}

/// `kubectl get identities -o json`: the objects by id.
fn kubectl_identities(plane: &Plane) -> anyhow::Result<BTreeMap<u32, Object>> {
    let list = plane.0.kubectl_json(&["get", "identities"])?;
    Ok(list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|o| {
            let id = o["metadata"]["name"].as_str()?.parse().ok()?;
            Some((
                id,
                Object {
                    state: o["status"]["state"].as_str().unwrap_or("").to_owned(),
                    labels: short_labels(&o["spec"]["labels"]),
                },
            ))
        })
        .collect())
}

/// An identity's labels in a few characters: its `job-name`, else its `app`, else
/// its `app.kubernetes.io/name`, else its namespace; at most [`LABELS_WIDTH`]
/// characters, the last an ellipsis where it is cut.
fn short_labels(labels: &serde_json::Value) -> String {
    let labels: Vec<&str> = labels
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(serde_json::Value::as_str)
        .collect();
    [
        "k8s:job-name=",
        "k8s:app=",
        "k8s:app.kubernetes.io/name=",
        "k8s:io.kubernetes.pod.namespace=",
    ]
    .iter()
    .find_map(|prefix| labels.iter().find(|l| l.starts_with(prefix)))
    .map(|l| {
        let label = l.trim_start_matches("k8s:");
        if label.chars().count() <= LABELS_WIDTH {
            label.to_owned()
        } else {
            let kept: String = label.chars().take(LABELS_WIDTH - 1).collect();
            format!("{kept}…")
        }
    })
    .unwrap_or_default()
}

/// The operator's RSS at the demo's points beside the report's at its own.
fn memory_line(m: &Memory) {
    let report = |point: &str| {
        REPORT_RSS_MIB
            .iter()
            .find(|(p, _)| *p == point)
            .map_or(f64::NAN, |(_, v)| *v)
    };
    let mib_of = |r: &Reading| r.rss_bytes as f64 / 1048576.0;
    step("the operator's memory beside seeds/000's retina-operator (RSS, MiB)");
    say(format!(
        "    {:<27} {:>6} {:>16} {:>12}",
        "", "idle", "after 150 Jobs", "at the end"
    ));
    say(format!(
        "    {:<27} {:>6.1} {:>16.1} {:>12.1}",
        "seeds/000 retina-operator",
        report("idle"),
        report("after 150"),
        report("quiet")
    ));
    say(format!(
        "    {:<27} {:>6.1} {:>16.1} {:>12.1}",
        "census-operator (this run)",
        mib_of(&m.idle),
        mib_of(&m.burst),
        mib_of(&m.back)
    ));
    say(
        "    (the report's end: after 450 Jobs, +7 MiB per 150, then every identity deleted \
         and 14 minutes: 13 MiB kept for identities that existed nowhere. census's end: the \
         Jobs gone, the identities back to the live set)",
    );
    say(format!(
        "    census-operator's live heap: {} idle, {} after the burst, {} at the end (the \
         API server connections a burst of Identity writes opened stay pooled, idle, for \
         up to 10 s after it: docs/benchmarks.md, seed-leak-short)",
        mib(m.idle.heap_live_bytes),
        mib(m.burst.heap_live_bytes),
        mib(m.back.heap_live_bytes)
    ));
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::{LABELS_WIDTH, short_labels};

    #[test]
    fn a_job_pod_is_named_by_its_job_then_app_then_namespace() {
        let ns = "k8s:io.kubernetes.pod.namespace=seed-steady";
        let job = json!(["k8s:app=x", "k8s:job-name=churn-7", ns]);
        assert_eq!(short_labels(&job), "job-name=churn-7");
        assert_eq!(short_labels(&json!(["k8s:app=web", ns])), "app=web");
        let operator = json!(["k8s:app.kubernetes.io/name=census-operator", ns]);
        assert_eq!(
            short_labels(&operator),
            "app.kubernetes.io/name=census-operator"
        );
        let long = short_labels(&json!([ns]));
        assert_eq!(long.chars().count(), LABELS_WIDTH);
        assert!(long.ends_with('…'), "{long}");
        assert_eq!(short_labels(&json!([])), "");
    }
}
