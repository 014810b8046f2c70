//! `cargo xtask test`: the whole test suite, as CI runs it (`.ci/run`).
//!
//! Set-up first (Debian packages and bpf-linker, idempotent), then the eBPF build,
//! formatting and lint checks (clippy for the host and, on the kernel-side crates, for
//! the BPF target), every unit, property and component test of the workspace and of
//! the types it shares with the kernel (census-common), fresh random cases of the
//! allocator's model test, as root the privileged end-to-end suite against the real
//! kernel, the churn benchmark's gate (no identity left beyond the live set, under
//! 64 bytes of live heap retained per churned pod), and, as root, the seed-leak gate
//! (seeds/000's Jobs on a real control plane with census's real agents: identities
//! back to the live set, the operator's live heap flat). The gates' release build
//! starts before the tests, at the lowest CPU priority, and so takes only the CPU
//! they leave idle.

use std::{
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::{bench, cluster, cmd, disk, ebpf, mutants, privileged, setup};

/// What a cold run writes under the target directory (debug and release builds,
/// the eBPF objects, test and bench binaries, the control plane's Go binaries), with
/// room to spare: `.ci/run` on a clean clone left 9.9 GiB there (`du -s target`,
/// 2026-12-07), so 12 GiB. A larger figure refused runs that had the room.
const NEEDED_GIB: u64 = 12;

#[derive(Debug, Clone, Copy, clap::Args)]
pub(crate) struct Options {
    /// Skip the privileged suite (it needs root; without this flag, not being root is an error).
    #[arg(long)]
    no_privileged: bool,
    /// Skip the benchmark gates (`cargo xtask bench churn-short` and, as root,
    /// `cargo xtask bench seed-leak-short`).
    #[arg(long)]
    no_bench_gate: bool,
}

pub(crate) fn run(options: Options) -> anyhow::Result<()> {
    let Options {
        no_privileged,
        no_bench_gate,
    } = options;
    if !no_privileged && !cmd::is_root() {
        bail!(
            "the privileged suite loads BPF programs and creates network namespaces: run \
             `cargo xtask test` as root, or `cargo xtask test --no-privileged` to skip it"
        );
    }
    let root = cmd::workspace_root();
    let mut steps = Steps::default();
    prepare(&mut steps, &root)?;
    lint(&mut steps, &root)?;
    // The gate's release build takes whatever CPU the tests leave idle.
    let gate_build = if no_bench_gate {
        None
    } else {
        Some(bench::Background::start()?)
    };
    // One real control plane for the whole run (built if its pins changed), stopped
    // at the end whatever happens; every test that needs one finds it through
    // CENSUS_TEST_KUBECONFIG and works in namespaces of its own.
    let mut plane = None;
    steps.run("control plane", &mut || {
        plane = Some(cluster::Running(cluster::up(cluster::TEST_NAME, 2)?));
        Ok(())
    })?;
    let kubeconfig = plane
        .as_ref()
        .map(|p| p.0.kubeconfig())
        .context("the control plane is up")?;
    tests(&mut steps, &root, &kubeconfig, no_privileged)?;
    drop(plane);
    gates(&mut steps, gate_build, no_privileged)?;
    steps.report();
    Ok(())
}

/// The steps run so far, and how long each took.
#[derive(Default)]
struct Steps(Vec<(&'static str, Duration)>);

impl Steps {
    /// Runs step `name`, announced; its failure is the run's.
    #[expect(clippy::print_stdout, reason = "xtask reports each step")]
    fn run(
        &mut self,
        name: &'static str,
        f: &mut dyn FnMut() -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        println!("\n==> {name}");
        let started = Instant::now();
        f().with_context(|| format!("step `{name}` failed"))?;
        self.0.push((name, started.elapsed()));
        Ok(())
    }

    #[expect(clippy::print_stdout, reason = "xtask reports each step")]
    fn report(self) {
        println!("\nall steps passed:");
        for (name, took) in self.0 {
            println!("  {name:<20} {:>8.1?}", took);
        }
    }
}

/// Disk space and Go checked, set-up, the eBPF build.
#[expect(clippy::print_stdout, reason = "xtask reports each step")]
fn prepare(steps: &mut Steps, root: &Path) -> anyhow::Result<()> {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| root.join("target"), std::path::PathBuf::from);
    steps.run("disk space", &mut || {
        disk::require_free(&target, NEEDED_GIB, "a cold `cargo xtask test`")
    })?;
    // The real control plane's components are built with Go: without a Go new enough
    // for their modules, stop now, naming what to install, rather than skip them.
    steps.run("Go", &mut || {
        let go = census_cluster::go::check(root)?;
        println!("{go}");
        Ok(())
    })?;
    steps.run("set-up", &mut || setup::run(setup::Options {}))?;
    steps.run("eBPF build", &mut || ebpf::build(ebpf::Profile::Release))
}

/// Formatting and clippy, on the host's workspace and the kernel-side crates.
fn lint(steps: &mut Steps, root: &Path) -> anyhow::Result<()> {
    steps.run("format", &mut || {
        cmd::run(
            cmd::host_cargo()
                .current_dir(root)
                .args(["fmt", "--all", "--", "--check"]),
        )?;
        cmd::run(cmd::host_cargo().current_dir(root).args([
            "fmt",
            "--manifest-path",
            "agent-ebpf/Cargo.toml",
            "--all",
            "--",
            "--check",
        ]))
    })?;
    steps.run("clippy", &mut || {
        cmd::run(cmd::host_cargo().current_dir(root).args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]))
    })?;
    // The kernel-side crates (census-common among them), for their own target.
    steps.run("eBPF clippy", &mut ebpf::clippy)
}

/// The workspace's tests on the control plane at `kubeconfig`, the allocator's model
/// on random cases, its mutants, and (unless `no_privileged`) the privileged suite.
#[expect(clippy::print_stdout, reason = "xtask reports each step")]
fn tests(
    steps: &mut Steps,
    root: &Path,
    kubeconfig: &Path,
    no_privileged: bool,
) -> anyhow::Result<()> {
    steps.run("tests", &mut || {
        // census-common belongs to the eBPF workspace, so `--workspace` leaves it out;
        // its tests run on the host, as the agent builds it.
        cmd::run(
            cmd::host_cargo()
                .current_dir(root)
                .env("CENSUS_TEST_KUBECONFIG", kubeconfig)
                .args(["test", "--workspace"]),
        )?;
        cmd::run(
            cmd::host_cargo()
                .current_dir(root)
                .args(["test", "--package", "census-common"]),
        )
    })?;
    // The suite runs the allocator's model test on its fixed cases only (it cannot
    // pass or fail by chance); here it also meets 3,000 fresh random ones, about 70 s,
    // in the executable `cargo test --workspace` has just built (overflow checks on;
    // a release build of its own took longer to build than the cases take to run).
    // The seed is printed, so a failure is reproduced with PROPTEST_RNG_SEED
    // (docs/testing.md); shrinking is bounded.
    steps.run("allocator model, random cases", &mut || {
        let built = cmd::build_artifacts(
            cmd::host_cargo(),
            &["test", "--workspace", "--lib", "--no-run"],
        )?;
        let allocator = built
            .tests
            .iter()
            .find(|(name, _)| name == "census_allocator")
            .map(|(_, path)| path)
            .context("cargo built no census-allocator unit tests")?;
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_secs());
        println!("PROPTEST_RNG_SEED={seed}");
        cmd::run(
            std::process::Command::new(allocator)
                .current_dir(root.join("operator/allocator"))
                .env("PROPTEST_CASES", "3000")
                .env("PROPTEST_RNG_SEED", seed.to_string())
                .env("PROPTEST_MAX_SHRINK_TIME", "60000")
                .arg("tests::model"),
        )
    })?;
    // Mutation testing of the allocator lines the change touches (against `main`),
    // bounded to 10 minutes; nothing to do when no allocator source file changed.
    steps.run(
        "allocator mutants in the change",
        &mut mutants::in_diff_step,
    )?;
    if no_privileged {
        println!("\n==> privileged suite: skipped (--no-privileged)");
    } else {
        steps.run("privileged suite", &mut || {
            privileged::run(privileged::Options {
                no_build_ebpf: true,
                test_args: Vec::new(),
                kubeconfig: Some(kubeconfig.to_path_buf()),
                selection: privileged::Selection::Workspace,
            })
        })?;
    }
    Ok(())
}

/// The benchmark gates on the release build `gate_build` (none: skipped).
#[expect(clippy::print_stdout, reason = "xtask reports each step")]
fn gates(
    steps: &mut Steps,
    gate_build: Option<bench::Background>,
    no_privileged: bool,
) -> anyhow::Result<()> {
    if let Some(build) = gate_build {
        let built = build.finish()?;
        steps.run("churn benchmark gate", &mut || {
            built.run(false, &["churn-short".into()])
        })?;
        // seeds/000's recipe, short, on a control plane of its own with census's
        // real agents (which need root): identities back to the live set and the
        // operator's live heap flat after lost deletes.
        if no_privileged {
            println!("\n==> seed-leak gate: skipped (--no-privileged: the agents load BPF)");
        } else {
            steps.run("seed-leak gate", &mut || {
                built.run(false, &["seed-leak-short".into()])
            })?;
        }
    } else {
        println!("\n==> churn benchmark gate: skipped (--no-bench-gate)");
    }
    Ok(())
}
