//! seed-uid (seeds/002, controllers that keep objects keyed by UID), replayed on the
//! real control plane: the same pod name deleted and re-created on one node (each
//! time a new UID, `kubectl replace --force --grace-period=0`), then a Deployment
//! rolled again and again (each roll a new ReplicaSet, new pods, new UIDs). census
//! keys what it keeps by namespace/name, never by UID: the agents' and the
//! operator's live heap must come back flat, and no identity be left beyond the
//! live set.

use std::{io::Write as _, process::Stdio, time::Duration};

use anyhow::{Context as _, bail};
use serde::Serialize;
use tokio::time::{Instant, sleep};

use super::{
    leak::level,
    world::{Binaries, Census, CensusFlags, Plane, Reading},
};
use crate::{
    presets::SeedUid,
    report::{Machine, Results, kib, mib, say, say_params},
};

const REFERENCE: &str = "seeds/002: a controller caching reconcile results by object UID grew to 3 GB over two weeks of churn (fifty thousand objects) and was OOM-killed; keyed by namespace/name it stayed at 400 MB";
const NS: &str = "seed-uid";

#[derive(Debug, Clone, Serialize)]
struct Phase {
    name: String,
    repetitions: usize,
    seconds: f64,
    /// The operator first, then each agent.
    before: Vec<Reading>,
    after: Vec<Reading>,
    heap_delta_bytes: Vec<i64>,
    heap_delta_bytes_per_repetition: Vec<f64>,
    identities_beyond_live_set: i64,
    passed: bool,
}

#[derive(Debug, Serialize)]
struct Output<'a> {
    params: &'a SeedUid,
    machine: Machine,
    reference: &'static str,
    phases: Vec<Phase>,
    passed: bool,
}

pub(crate) async fn run(bins: &Binaries, results: &Results, p: SeedUid) -> anyhow::Result<bool> {
    say_params(&format!("preset {}", p.preset), &p);
    let mut machine = Machine::now();
    say(machine.line());
    let plane = Plane::up(p.plane_name, p.nodes).await?;
    let flags = CensusFlags {
        operator: vec![
            "--snapshot-interval".to_owned(),
            "5s".to_owned(),
            "--grace-period".to_owned(),
            "5s".to_owned(),
            "--quarantine".to_owned(),
            "30s".to_owned(),
        ],
        drop_deletes: false,
        agent_nodes: None,
        heap_sample_lg: None,
    };
    let mut census = Census::start(&plane, bins, &flags, results.dir(), "uid").await?;
    plane.namespace(NS)?;
    let phases = vec![
        same_name_recreated(&plane, &mut census, &p).await?,
        deployment_rolled(&plane, &mut census, &p).await?,
    ];
    census.stop().await?;
    drop(plane);
    machine.finish();
    let passed = phases.iter().all(|ph| ph.passed);
    summary(&p, &phases, &machine);
    results.write_json(
        "seed-uid.json",
        &Output {
            params: &p,
            machine,
            reference: REFERENCE,
            phases,
            passed,
        },
    )?;
    Ok(passed)
}

/// One pod on the first node, then (after the warm-up) the same name re-created the
/// preset's times.
async fn same_name_recreated(
    plane: &Plane,
    census: &mut Census,
    p: &SeedUid,
) -> anyhow::Result<Phase> {
    let node = plane
        .0
        .nodes()
        .first()
        .map(|n| n.name.clone())
        .context("no node")?;
    let pod = pod_yaml(&node);
    apply_stdin(plane, &["create", "-f", "-"], &pod)?;
    for _ in 0..p.warmup {
        apply_stdin(
            plane,
            &["replace", "--force", "--grace-period=0", "-f", "-"],
            &pod,
        )?;
    }
    let before = levels(census).await?;
    let started = Instant::now();
    for i in 0..p.recreations {
        apply_stdin(
            plane,
            &["replace", "--force", "--grace-period=0", "-f", "-"],
            &pod,
        )?;
        if i % 500 == 499 {
            say(format!("  {} re-creations", i + 1));
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    finish(
        plane,
        census,
        "same pod name re-created",
        p.recreations,
        seconds,
        before,
        p,
    )
    .await
}

/// A Deployment rolled the preset's times (after the warm-up): each roll a new
/// ReplicaSet and new pods.
async fn deployment_rolled(
    plane: &Plane,
    census: &mut Census,
    p: &SeedUid,
) -> anyhow::Result<Phase> {
    plane.0.apply(&deployment(0))?;
    plane.0.kubectl_ok(&[
        "-n",
        NS,
        "rollout",
        "status",
        "deployment/rolled",
        "--timeout=120s",
    ])?;
    for r in 1..=p.warmup.min(10) {
        roll(plane, r)?;
    }
    let before = levels(census).await?;
    let started = Instant::now();
    for r in 0..p.rolls {
        roll(plane, 100 + r)?;
        if r % 50 == 49 {
            say(format!("  {} rolls", r + 1));
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    finish(
        plane,
        census,
        "Deployment rolled",
        p.rolls,
        seconds,
        before,
        p,
    )
    .await
}

fn summary(p: &SeedUid, phases: &[Phase], machine: &Machine) {
    say("");
    say(format!(
        "== {}: keyed by namespace/name, never by UID ==",
        p.preset
    ));
    say(REFERENCE);
    for ph in phases {
        say(format!(
            "  {:<26} x{:<5} {:>5.0} s: heap change operator {} agents {}; beyond the live set {}; {}",
            ph.name,
            ph.repetitions,
            ph.seconds,
            kib(ph.heap_delta_bytes[0]),
            ph.heap_delta_bytes[1..]
                .iter()
                .map(|d| kib(*d))
                .collect::<Vec<_>>()
                .join(" "),
            ph.identities_beyond_live_set,
            if ph.passed { "PASS" } else { "FAIL" }
        ));
    }
    say(format!(
        "target: every process's live heap within {} of before; no identity beyond the live set",
        kib(p.max_heap_delta_bytes)
    ));
    say(machine.line());
}

fn pod_yaml(node: &str) -> String {
    format!(
        "apiVersion: v1
kind: Pod
metadata: {{name: same-name, namespace: {NS}, labels: {{app: same-name}}}}
spec:
  nodeName: {node}
  containers: [{{name: c, image: registry.k8s.io/pause:3.10}}]
"
    )
}

fn deployment(roll: usize) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "rolled", "namespace": NS},
        "spec": {
            "replicas": 3,
            "selector": {"matchLabels": {"app": "rolled"}},
            "template": {
                "metadata": {"labels": {"app": "rolled"},
                             "annotations": {"seeds.census.dev/roll": roll.to_string()}},
                "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]},
            },
        },
    })
}

fn roll(plane: &Plane, r: usize) -> anyhow::Result<()> {
    plane.0.apply(&deployment(r))?;
    plane.0.kubectl_ok(&[
        "-n",
        NS,
        "rollout",
        "status",
        "deployment/rolled",
        "--timeout=120s",
    ])?;
    Ok(())
}

fn apply_stdin(plane: &Plane, args: &[&str], yaml: &str) -> anyhow::Result<()> {
    let mut child = plane
        .0
        .kubectl()
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("kubectl")?;
    child
        .stdin
        .take()
        .context("kubectl's stdin")?
        .write_all(yaml.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "kubectl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

async fn levels(census: &mut Census) -> anyhow::Result<Vec<Reading>> {
    let mut all: Vec<Vec<Reading>> = Vec::new();
    for _ in 0..5 {
        let mut r = vec![census.operator_reading().await?];
        r.extend(census.agent_readings()?);
        all.push(r);
        sleep(Duration::from_secs(1)).await;
    }
    let n = all.first().map_or(0, Vec::len);
    Ok((0..n)
        .map(|i| level(&all.iter().map(|r| r[i]).collect::<Vec<_>>()))
        .collect())
}

async fn finish(
    plane: &Plane,
    census: &mut Census,
    name: &str,
    repetitions: usize,
    seconds: f64,
    before: Vec<Reading>,
    p: &SeedUid,
) -> anyhow::Result<Phase> {
    // Settled: the operator holds exactly the live set (released identities wait out
    // the grace period and quarantine).
    let filter = census_proto::labels::LabelFilter::default();
    let deadline = Instant::now() + Duration::from_secs(90);
    let beyond = loop {
        let live = plane.live_set(&filter)?.len() as i64;
        let beyond = census.operator_metrics().await?.bound() as i64 - live;
        if beyond == 0 || Instant::now() > deadline {
            break beyond;
        }
        sleep(Duration::from_millis(500)).await;
    };
    sleep(p.settle).await;
    let after = levels(census).await?;
    let heap_delta_bytes: Vec<i64> = before
        .iter()
        .zip(&after)
        .map(|(b, a)| a.heap_live_bytes as i64 - b.heap_live_bytes as i64)
        .collect();
    let passed = beyond == 0
        && heap_delta_bytes
            .iter()
            .all(|d| *d <= p.max_heap_delta_bytes);
    say(format!(
        "  {name}: {repetitions} in {seconds:.0} s; operator RSS {} -> {}, heap {}",
        mib(before[0].rss_bytes),
        mib(after[0].rss_bytes),
        kib(heap_delta_bytes[0])
    ));
    Ok(Phase {
        name: name.to_owned(),
        repetitions,
        seconds,
        heap_delta_bytes_per_repetition: heap_delta_bytes
            .iter()
            .map(|d| *d as f64 / repetitions.max(1) as f64)
            .collect(),
        heap_delta_bytes,
        before,
        after,
        identities_beyond_live_set: beyond,
        passed,
    })
}
