//! `census-bench <preset>`, run by `cargo xtask bench <preset>` (which builds it and
//! `census-operator` in release first, so the client side is never a debug build
//! sharing the cores with the operator): starts a real `census-operator` (on its
//! embedded store in a temporary directory), drives it over real gRPC from simulated
//! agents, samples it every second, and writes JSON and SVG plots to
//! `results/<preset>-<timestamp>/`. Presets and what they gate on are in [`presets`]
//! and docs/benchmarks.md.
//!
//! One module per concern: [`presets`] (what runs), [`agents`] (simulated nodes),
//! [`watchers`] (their raw endpoint map watches), [`operator`] (the process under
//! test), [`sample`] (what is measured), [`report`] and [`plot`] (what is written), and
//! one module per scenario.

#![forbid(unsafe_code)]

mod abuse;
mod agents;
mod alloc;
mod churn;
mod cmd;
mod floor;
mod gc;
mod heap;
mod map;
mod operator;
mod plot;
mod presets;
mod report;
mod restart;
mod sample;
mod scale;
mod seeds;
mod watchers;

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use clap::Parser;

use self::{operator::Binary, presets::Preset, report::say};

/// Benchmark a real census-operator with simulated agents; results in results/.
///
/// Usually run as `cargo xtask bench <preset> [options]`, which builds this and the
/// operator in release and passes `--operator` for you.
#[derive(Debug, Parser)]
#[command(name = "census-bench")]
struct Options {
    /// What to run.
    #[arg(value_enum, required_unless_present_any = ["heap_owners", "cluster_demo"])]
    preset: Option<Preset>,
    /// Instead of a preset: print the live heap by owner of a saved heap profile
    /// (a run's `heap.pb.gz`, or `curl -o heap.pb.gz <admin>/debug/pprof/heap` from an
    /// operator started with --heap-profiling), and exit.
    #[arg(long, value_name = "PROFILE")]
    heap_owners: Option<PathBuf>,
    /// Where results go (a folder per run is made inside it); relative to the
    /// workspace root.
    #[arg(long, default_value = "results")]
    out: PathBuf,
    /// Instead of a preset: `cargo xtask demo --cluster`, seed-leak's story for a
    /// user to watch (a control plane, a few Deployments, a burst of Jobs, `census
    /// identity list` beside `kubectl get identities`); as root, with --agent and
    /// --cli. Fails unless the identities come back to the live set.
    #[arg(long, conflicts_with_all = ["preset", "heap_owners"], requires_all = ["agent", "cli"])]
    cluster_demo: bool,
    /// --cluster-demo: the `census` CLI binary.
    #[arg(long)]
    cli: Option<PathBuf>,
    /// Use this census-operator binary instead of building it (release) first.
    #[arg(long)]
    operator: Option<PathBuf>,
    /// seed presets: the census-agent binary (release, with the eBPF object);
    /// `cargo xtask bench` builds and passes it.
    #[arg(long)]
    agent: Option<PathBuf>,
    /// churn presets: the retained live heap the gate allows, bytes per churned pod.
    /// Lower it to see the gate fail.
    #[arg(long, default_value_t = 64.0)]
    max_retained_bytes_per_pod: f64,
    /// churn presets: Job pods per drop rate (overrides the preset).
    #[arg(long)]
    pods: Option<usize>,
    /// churn presets: Job pods churned before the first baseline (overrides the
    /// preset's; 0 measures from a cold start, one-time growth included).
    #[arg(long)]
    warmup_pods: Option<usize>,
    /// scale and map presets: simulated nodes (overrides the preset).
    #[arg(long)]
    nodes: Option<usize>,
    /// gc preset: released identities to delete (overrides the preset's 50,000);
    /// seed-gc: one run of this many (instead of 10,000, then 50,000). At least 1.
    #[arg(long, value_parser = positive_count)]
    identities: Option<usize>,
    /// gc preset: the operator's hold timeout (overrides the preset's 600 s; a short
    /// one lets identities be released while they are still being allocated).
    #[arg(long, value_parser = humantime_secs)]
    hold_timeout: Option<std::time::Duration>,
    /// seed-leak presets: profile the operator's heap, one sample per 2^N bytes
    /// allocated (e.g. 12), and print what grew between idle and the end of the
    /// quiet period by owner. Off by default: a profile's own allocations stay in the
    /// live heap the gate measures.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(0..=30))]
    heap_sample_lg: Option<u32>,
    /// seed-leak presets: run only this phase (`default-filter`,
    /// `default-filter+deletes-lost`, `job-labels-kept`,
    /// `job-labels-kept+deletes-lost`) with the preset's other parameters.
    #[arg(long, value_name = "PHASE", value_parser = seeds::leak::parse_phase)]
    phase: Option<(bool, bool)>,
}

/// A count of at least 1: a run of 0 identities would measure nothing and report
/// a rate of nothing as a pass.
fn positive_count(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("0: at least 1".to_owned()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{s}: {e} (a count, at least 1)")),
    }
}

fn humantime_secs(s: &str) -> Result<std::time::Duration, String> {
    s.strip_suffix('s')
        .unwrap_or(s)
        .parse::<f64>()
        .map(std::time::Duration::from_secs_f64)
        .map_err(|e| format!("{s}: {e} (seconds, e.g. 3s)"))
}

/// `--cluster-demo`, stopped cleanly (every guard dropped: processes, namespaces,
/// pins, the control plane) on Ctrl-C or SIGTERM.
async fn cluster_demo_run(
    operator: Option<PathBuf>,
    agent: Option<PathBuf>,
    cli: Option<PathBuf>,
) -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    anyhow::ensure!(
        nix::unistd::geteuid().is_root(),
        "the cluster demo runs census's agents, which load BPF programs: run as root"
    );
    let bins = seeds::world::Binaries {
        operator: match operator {
            Some(path) => Binary::at(path)?,
            None => Binary::build_release()?,
        },
        agent: agent.context("--cluster-demo needs --agent")?,
    };
    let cli = cli.context("--cluster-demo needs --cli")?;
    let (mut int, mut term) = (
        signal(SignalKind::interrupt())?,
        signal(SignalKind::terminate())?,
    );
    let back = tokio::select! {
        back = seeds::demo::run(&bins, &cli) => back?,
        _ = int.recv() => anyhow::bail!("interrupted; cleaned up"),
        _ = term.recv() => anyhow::bail!("terminated; cleaned up"),
    };
    anyhow::ensure!(back, "the identities did not come back to the live set");
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let options = Options::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(run(options))
}

async fn run(options: Options) -> anyhow::Result<()> {
    let Options {
        preset,
        heap_owners,
        cluster_demo,
        cli,
        out,
        operator,
        agent,
        max_retained_bytes_per_pod,
        pods,
        warmup_pods,
        nodes,
        identities,
        hold_timeout,
        heap_sample_lg,
        phase,
    } = options;
    if cluster_demo {
        return cluster_demo_run(operator, agent, cli).await;
    }
    let preset = match (preset, heap_owners) {
        (_, Some(path)) => return print_heap_owners(&path),
        (Some(preset), None) => preset,
        (None, None) => anyhow::bail!("name a preset, or --heap-owners <profile>"),
    };
    let binary = match operator {
        Some(path) => Binary::at(path)?,
        None => Binary::build_release()?,
    };
    let results = report::Results::create(&cmd::workspace_root().join(out), preset.name())?;
    say(format!(
        "census bench {}: results in {}",
        preset.name(),
        results.dir().display()
    ));
    let passed = match preset {
        Preset::ChurnShort | Preset::ChurnLong => {
            let mut params = presets::churn(preset);
            if let Some(pods) = pods {
                params.pods = pods;
            }
            if let Some(w) = warmup_pods {
                params.warmup_pods = w;
            }
            params.max_retained_bytes_per_pod = max_retained_bytes_per_pod;
            churn::run(&binary, &results, params).await?
        }
        Preset::Scale1k | Preset::Scale5k => {
            let mut params = presets::scale(preset);
            if let Some(nodes) = nodes {
                params.nodes = nodes;
            }
            scale::run(&binary, &results, params).await?
        }
        Preset::Map1k | Preset::Map5k => {
            let mut params = presets::map(preset);
            if let Some(nodes) = nodes {
                params.nodes = nodes;
            }
            map::run(&binary, &results, params).await?
        }
        Preset::Alloc => alloc::run(&binary, &results, presets::alloc()).await?,
        Preset::Floor => floor::run(&binary, &results, presets::floor()).await?,
        Preset::Gc => {
            let mut params = presets::gc();
            if let Some(n) = identities {
                params.identities = n;
            }
            if let Some(t) = hold_timeout {
                params.hold_timeout = t;
            }
            gc::run(&binary, &results, params).await?
        }
        Preset::Restart => restart::run(&binary, &results, presets::restart()).await?,
        Preset::Abuse => abuse::run(&binary, &results).await?,
        Preset::Seeds
        | Preset::SeedLeak
        | Preset::SeedLeakShort
        | Preset::SeedGc
        | Preset::SeedCache
        | Preset::SeedUid => {
            let seeds = SeedOptions {
                heap_sample_lg,
                identities,
                phase,
            };
            run_seeds(preset, binary, agent, &results, seeds).await?
        }
    };
    say(format!("results: {}", results.dir().display()));
    if !passed {
        anyhow::bail!("bench {}: the gate failed (see above)", preset.name());
    }
    Ok(())
}

/// `--heap-owners`: a saved profile's live heap by owner.
fn print_heap_owners(path: &Path) -> anyhow::Result<()> {
    let owners = heap::owners_of_file(path)?;
    say(format!(
        "{}: {} of live heap sampled, by owner:",
        path.display(),
        report::mib(owners.total_bytes)
    ));
    heap::print(&owners, None, None);
    Ok(())
}

/// The seed presets' overrides.
struct SeedOptions {
    /// seed-leak: heap profiling in the operator.
    heap_sample_lg: Option<u32>,
    /// seed-gc: one run of this many identities.
    identities: Option<usize>,
    /// seed-leak: this phase only.
    phase: Option<(bool, bool)>,
}

/// The seed presets, on the real control plane with census's agents (as root).
async fn run_seeds(
    preset: Preset,
    binary: Binary,
    agent: Option<PathBuf>,
    results: &report::Results,
    options: SeedOptions,
) -> anyhow::Result<bool> {
    let SeedOptions {
        heap_sample_lg,
        identities,
        phase,
    } = options;
    let mut seed_gc = presets::seed_gc();
    if let Some(n) = identities {
        seed_gc.sizes = vec![n];
    }
    let agent = agent.context("the seed presets need --agent (cargo xtask bench passes it)")?;
    anyhow::ensure!(
        nix::unistd::geteuid().is_root(),
        "the seed presets run census's agents, which load BPF programs: run as root"
    );
    let bins = seeds::world::Binaries {
        operator: binary,
        agent,
    };
    let passed = match preset {
        Preset::SeedGc => seeds::gc::run(&bins, results, seed_gc).await?,
        Preset::SeedCache => seeds::cache::run(&bins, results, presets::seed_cache()).await?,
        Preset::SeedUid => seeds::uid::run(&bins, results, presets::seed_uid()).await?,
        Preset::Seeds => {
            let leak =
                seeds::leak::run(&bins, results, presets::seed_leak(Preset::SeedLeak)).await?;
            let gc = seeds::gc::run(&bins, results, seed_gc).await?;
            let cache = seeds::cache::run(&bins, results, presets::seed_cache()).await?;
            let uid = seeds::uid::run(&bins, results, presets::seed_uid()).await?;
            leak && gc && cache && uid
        }
        _ => {
            let mut params = presets::seed_leak(preset);
            params.heap_sample_lg = heap_sample_lg;
            if let Some(variant) = phase {
                params.variants = vec![variant];
            }
            seeds::leak::run(&bins, results, params).await?
        }
    };
    Ok(passed)
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::Options;

    /// What parsing `args` is refused with; empty if they are accepted.
    fn refusal(args: &[&str]) -> String {
        Options::try_parse_from(args)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    }

    #[test]
    fn a_run_of_no_identities_is_refused_by_name() {
        let error = refusal(&["census-bench", "seed-gc", "--identities", "0"]);
        assert!(
            error.contains("--identities") && error.contains("at least 1"),
            "{error}"
        );
        let args = Options::try_parse_from(["census-bench", "seed-gc", "--identities", "7"]);
        assert_eq!(args.ok().and_then(|a| a.identities), Some(7));
    }

    #[test]
    fn an_unknown_phase_is_refused_naming_the_phases() {
        let error = refusal(&["census-bench", "seed-leak", "--phase", "labels"]);
        assert!(
            error.contains("labels: not a phase") && error.contains("job-labels-kept+deletes-lost"),
            "{error}"
        );
        let args = Options::try_parse_from([
            "census-bench",
            "seed-leak",
            "--phase",
            "default-filter+deletes-lost",
        ]);
        assert_eq!(args.ok().and_then(|a| a.phase), Some((false, true)));
    }
}
