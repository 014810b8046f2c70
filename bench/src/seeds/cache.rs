//! seed-cache (seeds/004, operators that cache what they do not need), replayed on
//! the real control plane with census running and idle: the report's "little game"
//! (200 ConfigMaps and 200 Secrets of ~500 KB in a namespace `test`, each created
//! with its own kubectl as the report's loops do, then deleted), then 2,000 pods on
//! a node with no census agent, then 2,000 Services. For each census process: its
//! RSS, and the bytes it received from the API server, counted by the loopback
//! forwarder every census process reaches the API server through.

use std::time::Duration;

use anyhow::Context as _;
use serde::Serialize;
use tokio::time::{Instant, sleep};

use super::{
    leak::level,
    world::{Binaries, Census, CensusFlags, Plane, Reading},
};
use crate::{
    plot::{Panel, Series, figure},
    presets::SeedCache,
    report::{Machine, Results, kib, mib, say, say_params},
};

const REFERENCE: &str = "seeds/004 (NetObserv's little game): of ~60 operators, 13 grew and pulled from the API server when unrelated ConfigMaps and Secrets were created; the one shown grew from 72 MB to 350 MB RSS with receive spikes above 1 MB/s";

#[derive(Debug, Clone, Serialize)]
struct Phase {
    name: String,
    seconds: f64,
    /// Per process (the operator first, then each agent): RSS before and after
    /// (levels), the peak in between, bytes received from the API server.
    processes: Vec<ProcessFigures>,
    passed: Option<bool>,
}

#[derive(Debug, Clone, Serialize)]
struct ProcessFigures {
    process: String,
    rss_before_bytes: u64,
    rss_after_bytes: u64,
    rss_peak_bytes: u64,
    heap_before_bytes: u64,
    heap_after_bytes: u64,
    api_bytes_received: u64,
}

#[derive(Debug, Clone, Serialize)]
struct Sample {
    phase: String,
    t: f64,
    rss_bytes: Vec<u64>,
    api_bytes: Vec<u64>,
}

#[derive(Debug, Serialize)]
struct Output<'a> {
    params: &'a SeedCache,
    machine: Machine,
    reference: &'static str,
    phases: Vec<Phase>,
    samples: Vec<Sample>,
    passed: bool,
}

pub(crate) async fn run(bins: &Binaries, results: &Results, p: SeedCache) -> anyhow::Result<bool> {
    say_params(&format!("preset {}", p.preset), &p);
    let mut machine = Machine::now();
    say(machine.line());
    // One node more than census runs on: "no census node".
    let plane = Plane::up(p.plane_name, p.census_nodes + 1).await?;
    let flags = CensusFlags {
        operator: Vec::new(),
        drop_deletes: false,
        agent_nodes: Some(p.census_nodes as usize),
        heap_sample_lg: None,
    };
    let mut census = Census::start(&plane, bins, &flags, results.dir(), "cache").await?;
    let names: Vec<String> = std::iter::once("operator".to_owned())
        .chain(
            census
                .agent_nodes()
                .into_iter()
                .map(|n| format!("agent {n}")),
        )
        .collect();
    let other_node = plane
        .0
        .nodes()
        .last()
        .map(|n| n.name.clone())
        .context("no node")?;
    say(format!(
        "census up: operator and agents on {}; {other_node} has no agent",
        census.agent_nodes().join(", ")
    ));
    sleep(p.settle).await;
    let mut samples = Vec::new();
    let mut phases = Vec::new();
    let mut run = Phases {
        plane: &plane,
        census: &mut census,
        names: &names,
        started: Instant::now(),
        samples: &mut samples,
        p: &p,
    };
    let game = run.game().await?;
    let passed = game.passed == Some(true);
    phases.push(game);
    phases.push(run.pods_elsewhere(&other_node).await?);
    phases.push(run.services().await?);

    census.stop().await?;
    drop(plane);
    machine.finish();
    summary(&p, &phases, &machine, passed);
    plots(results, &samples, &names)?;
    results.write_json(
        "seed-cache.json",
        &Output {
            params: &p,
            machine,
            reference: REFERENCE,
            phases,
            samples,
            passed,
        },
    )?;
    Ok(passed)
}

/// Pods and Services are created this many to a `kubectl create`.
const CHUNK: usize = 200;

/// The preset's phases, over one census and one clock.
struct Phases<'a> {
    plane: &'a Plane,
    census: &'a mut Census,
    names: &'a [String],
    started: Instant,
    samples: &'a mut Vec<Sample>,
    p: &'a SeedCache,
}

impl Phases<'_> {
    /// The report's game: the ConfigMaps and Secrets of ~500 KB in `test`, each with
    /// its own kubectl, then deleted; judged against the preset's targets.
    async fn game(&mut self) -> anyhow::Result<Phase> {
        let p = self.p;
        let file = tempfile::NamedTempFile::new()?;
        std::fs::write(file.path(), large_file(p.object_bytes))?;
        let large = file.path().display().to_string();
        self.plane.namespace("test")?;
        let mut phase = measure(
            "configmaps+secrets",
            self.plane,
            self.census,
            self.names,
            self.started,
            self.samples,
            p,
            |plane, i| {
                if i < p.objects {
                    plane.0.kubectl_ok(&[
                        "create",
                        "cm",
                        &format!("test-cm-{i}"),
                        "-n",
                        "test",
                        &format!("--from-file={large}"),
                    ])?;
                } else {
                    let j = i - p.objects;
                    plane.0.kubectl_ok(&[
                        "create",
                        "secret",
                        "generic",
                        &format!("test-secret-{j}"),
                        "-n",
                        "test",
                        &format!("--from-file=key={large}"),
                    ])?;
                }
                Ok(())
            },
            2 * p.objects,
            |plane| {
                plane.0.kubectl_ok(&[
                    "-n",
                    "test",
                    "delete",
                    "configmaps,secrets",
                    "--all",
                    "--wait=false",
                ])?;
                Ok(())
            },
        )
        .await?;
        phase.passed = Some(game_passed(&phase, p));
        Ok(phase)
    }

    /// The preset's pods on `other_node`, which has no agent.
    async fn pods_elsewhere(&mut self, other_node: &str) -> anyhow::Result<Phase> {
        self.plane.namespace("elsewhere")?;
        measure(
            "pods on no census node",
            self.plane,
            self.census,
            self.names,
            self.started,
            self.samples,
            self.p,
            |plane, i| {
                let items: Vec<serde_json::Value> = (i * CHUNK..(i + 1) * CHUNK)
                    .map(|k| {
                        serde_json::json!({
                            "apiVersion": "v1", "kind": "Pod",
                            "metadata": {"name": format!("other-{k}"), "namespace": "elsewhere",
                                         "labels": {"app": "other", "n": k.to_string()}},
                            "spec": {"nodeName": other_node,
                                     "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]},
                        })
                    })
                    .collect();
                create_list(plane, &items)
            },
            self.p.pods / CHUNK,
            |plane| {
                plane.0.kubectl_ok(&[
                    "-n",
                    "elsewhere",
                    "delete",
                    "pods",
                    "--all",
                    "--wait=false",
                ])?;
                Ok(())
            },
        )
        .await
    }

    /// The preset's Services: as many ClusterIPs as the range has room for, the
    /// rest headless.
    async fn services(&mut self) -> anyhow::Result<Phase> {
        let p = self.p;
        self.plane.namespace("services")?;
        measure(
            "services",
            self.plane,
            self.census,
            self.names,
            self.started,
            self.samples,
            p,
            |plane, i| {
                let items: Vec<serde_json::Value> = (i * CHUNK..(i + 1) * CHUNK)
                    .map(|k| {
                        let mut spec = serde_json::json!({
                            "selector": {"app": format!("svc-{k}")},
                            "ports": [{"port": 80}],
                        });
                        if k >= p.cluster_ips {
                            spec["clusterIP"] = serde_json::json!("None");
                        }
                        serde_json::json!({
                            "apiVersion": "v1", "kind": "Service",
                            "metadata": {"name": format!("svc-{k}"), "namespace": "services"},
                            "spec": spec,
                        })
                    })
                    .collect();
                create_list(plane, &items)
            },
            p.services / CHUNK,
            |plane| {
                plane.0.kubectl_ok(&[
                    "-n",
                    "services",
                    "delete",
                    "services",
                    "--all",
                    "--wait=false",
                ])?;
                Ok(())
            },
        )
        .await
    }
}

/// The game's target: every process's RSS back within the bound and its bytes from
/// the API server under it.
fn game_passed(phase: &Phase, p: &SeedCache) -> bool {
    let mut passed = true;
    for pf in &phase.processes {
        let rss = pf.rss_after_bytes as i64 - pf.rss_before_bytes as i64;
        if rss.unsigned_abs() >= p.max_rss_change_bytes || pf.api_bytes_received >= p.max_api_bytes
        {
            passed = false;
        }
    }
    passed
}

/// ~`bytes` of text, as the report's `large_file`.
fn large_file(bytes: usize) -> Vec<u8> {
    (0..bytes)
        .map(|i| {
            if i % 100 == 99 {
                b'\n'
            } else {
                b'a' + (i % 26) as u8
            }
        })
        .collect()
}

fn create_list(plane: &Plane, items: &[serde_json::Value]) -> anyhow::Result<()> {
    let file = tempfile::NamedTempFile::new()?;
    std::fs::write(
        file.path(),
        serde_json::to_vec(
            &serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items}),
        )?,
    )?;
    plane.0.kubectl_ok(&[
        "create",
        "-f",
        &file.path().display().to_string(),
        "-o",
        "name",
    ])?;
    Ok(())
}

#[expect(clippy::too_many_arguments, reason = "one phase of the preset")]
async fn measure(
    name: &str,
    plane: &Plane,
    census: &mut Census,
    names: &[String],
    started: Instant,
    samples: &mut Vec<Sample>,
    p: &SeedCache,
    create: impl Fn(&Plane, usize) -> anyhow::Result<()>,
    steps: usize,
    delete: impl Fn(&Plane) -> anyhow::Result<()>,
) -> anyhow::Result<Phase> {
    say(format!("\n== {name} =="));
    let phase_start = Instant::now();
    let before = levels(census).await?;
    let (op0, agents0) = census.api_bytes();
    let mut peaks: Vec<u64> = before.iter().map(|r| r.rss_bytes).collect();
    let base = (op0, agents0.clone());
    for i in 0..steps {
        create(plane, i)?;
        if i % 10 == 9 || steps < 20 {
            sample(name, census, started, samples, &mut peaks, &base).await?;
        }
    }
    say(format!(
        "  created in {:.0} s",
        phase_start.elapsed().as_secs_f64()
    ));
    delete(plane)?;
    let deleting = Instant::now();
    while deleting.elapsed() < p.after_delete {
        sleep(Duration::from_secs(1)).await;
        sample(name, census, started, samples, &mut peaks, &base).await?;
    }
    let after = levels(census).await?;
    let (op1, agents1) = census.api_bytes();
    let received: Vec<u64> = std::iter::once(op1 - op0)
        .chain(agents1.iter().zip(&agents0).map(|(a, b)| a - b))
        .collect();
    let processes: Vec<ProcessFigures> = names
        .iter()
        .enumerate()
        .map(|(i, n)| ProcessFigures {
            process: n.clone(),
            rss_before_bytes: before[i].rss_bytes,
            rss_after_bytes: after[i].rss_bytes,
            rss_peak_bytes: peaks[i],
            heap_before_bytes: before[i].heap_live_bytes,
            heap_after_bytes: after[i].heap_live_bytes,
            api_bytes_received: received[i],
        })
        .collect();
    for pf in &processes {
        say(format!(
            "  {:<14} RSS {} -> {} (peak {}), heap {}, received from the API server {}",
            pf.process,
            mib(pf.rss_before_bytes),
            mib(pf.rss_after_bytes),
            mib(pf.rss_peak_bytes),
            kib(pf.heap_after_bytes as i64 - pf.heap_before_bytes as i64),
            kib(pf.api_bytes_received as i64)
        ));
    }
    Ok(Phase {
        name: name.to_owned(),
        seconds: phase_start.elapsed().as_secs_f64(),
        processes,
        passed: None,
    })
}

/// One sample of every process: RSS (raising the peaks) and bytes received since
/// `base`.
async fn sample(
    name: &str,
    census: &mut Census,
    started: Instant,
    samples: &mut Vec<Sample>,
    peaks: &mut [u64],
    base: &(u64, Vec<u64>),
) -> anyhow::Result<()> {
    let readings = readings_now(census).await?;
    for (peak, r) in peaks.iter_mut().zip(&readings) {
        *peak = (*peak).max(r.rss_bytes);
    }
    let (op, agents) = census.api_bytes();
    samples.push(Sample {
        phase: name.to_owned(),
        t: started.elapsed().as_secs_f64(),
        rss_bytes: readings.iter().map(|r| r.rss_bytes).collect(),
        api_bytes: std::iter::once(op - base.0)
            .chain(agents.iter().zip(&base.1).map(|(a, b)| a - b))
            .collect(),
    });
    Ok(())
}

async fn readings_now(census: &mut Census) -> anyhow::Result<Vec<Reading>> {
    let mut out = vec![census.operator_reading().await?];
    out.extend(census.agent_readings()?);
    Ok(out)
}

/// The median RSS and lowest live heap of each process over 5 readings.
async fn levels(census: &mut Census) -> anyhow::Result<Vec<Reading>> {
    let mut all: Vec<Vec<Reading>> = Vec::new();
    for _ in 0..5 {
        all.push(readings_now(census).await?);
        sleep(Duration::from_secs(1)).await;
    }
    let n = all.first().map_or(0, Vec::len);
    Ok((0..n)
        .map(|i| level(&all.iter().map(|r| r[i]).collect::<Vec<_>>()))
        .collect())
}

fn summary(p: &SeedCache, phases: &[Phase], machine: &Machine, passed: bool) {
    say("");
    say(format!(
        "== {}: census idle on {} nodes (one more node without census) ==",
        p.preset, p.census_nodes
    ));
    say(REFERENCE);
    for ph in phases {
        say(format!("  {} ({:.0} s):", ph.name, ph.seconds));
        for pf in &ph.processes {
            say(format!(
                "    {:<14} RSS change {:>12} (peak {:>10} over before), received from the API server {:>12}",
                pf.process,
                kib(pf.rss_after_bytes as i64 - pf.rss_before_bytes as i64),
                kib(pf.rss_peak_bytes as i64 - pf.rss_before_bytes as i64),
                kib(pf.api_bytes_received as i64)
            ));
        }
    }
    say(format!(
        "target (configmaps+secrets, {} MB in all): RSS change under {} and under {} received per census process: {}",
        2 * p.objects * p.object_bytes / 1_000_000,
        kib(p.max_rss_change_bytes as i64),
        kib(p.max_api_bytes as i64),
        if passed { "PASS" } else { "FAIL" }
    ));
    say(machine.line());
}

fn plots(results: &Results, samples: &[Sample], names: &[String]) -> anyhow::Result<()> {
    let series = |f: &dyn Fn(&Sample, usize) -> f64| -> Vec<Series> {
        names
            .iter()
            .enumerate()
            .map(|(i, n)| Series::new(n.clone(), samples.iter().map(|s| (s.t, f(s, i))).collect()))
            .collect()
    };
    figure(
        &results.path("seed-cache.svg"),
        "seconds",
        &[
            Panel {
                title: "RSS".into(),
                y_label: "MiB".into(),
                series: series(&|s, i| s.rss_bytes.get(i).copied().unwrap_or(0) as f64 / 1048576.0),
            },
            Panel {
                title: "bytes received from the API server in the phase".into(),
                y_label: "KiB".into(),
                series: series(&|s, i| s.api_bytes.get(i).copied().unwrap_or(0) as f64 / 1024.0),
            },
        ],
    )
}
