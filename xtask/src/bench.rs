//! `cargo xtask bench <preset> [options]`: builds the load generator (`census-bench`,
//! bench/) and `census-operator` in release, and runs the one against the other. The
//! harness is always a release build: its client side (thousands of streams, hundreds
//! of concurrent Allocate calls) shares the cores with the operator it measures.
//!
//! The seed presets (`seeds`, `seed-leak`, ...) run census as in a cluster on a real
//! control plane, agents included: for them the eBPF object and `census-agent` are
//! built too (release), and passed as `--agent`.

use std::{
    collections::BTreeMap,
    ffi::{OsStr, OsString},
    path::PathBuf,
};

use anyhow::Context as _;

use crate::{cmd, ebpf};

#[derive(Debug, clap::Args)]
#[command(disable_help_flag = true)]
pub(crate) struct Options {
    /// census-bench's arguments, passed on as they are: a preset and its overrides
    /// (`cargo xtask bench --help` shows census-bench's own help). `--operator` is
    /// added unless given here.
    #[arg(
        value_name = "ARGS",
        trailing_var_arg = true,
        allow_hyphen_values = true,
        num_args = 0..
    )]
    pub(crate) args: Vec<OsString>,
}

pub(crate) fn run(options: Options) -> anyhow::Result<()> {
    let Options { args } = options;
    let own_operator = args.iter().any(|arg| is_operator_flag(arg));
    let agent = args.iter().any(|arg| is_seed_preset(arg));
    if agent {
        ebpf::build(ebpf::Profile::Release)?;
    }
    let built = cmd::build_binaries(&build_args(own_operator, agent))?;
    Built(built).run(own_operator, &args)
}

/// The release build of the harness, the operator and the agent (its eBPF object
/// built already), started in the background at the lowest CPU priority, so that it takes only the cores
/// the work in the foreground leaves idle (`cargo xtask test` runs it while the tests
/// run, most of which wait on timers and the network). Its cargo output goes to a log
/// file, shown only when the build fails.
pub(crate) struct Background {
    build: std::thread::JoinHandle<anyhow::Result<BTreeMap<String, PathBuf>>>,
    log: PathBuf,
}

impl Background {
    pub(crate) fn start() -> anyhow::Result<Self> {
        let log = cmd::workspace_root().join("target/xtask-bench-build.log");
        if let Some(dir) = log.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let file =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let mut command = std::process::Command::new("nice");
        command
            .args(["-n", "19"])
            .arg(cmd::host_cargo_program())
            .stderr(file);
        let build =
            std::thread::spawn(move || cmd::build_binaries_with(command, &build_args(false, true)));
        Ok(Self { build, log })
    }

    /// Waits for the build.
    pub(crate) fn finish(self) -> anyhow::Result<Built> {
        let Self { build, log } = self;
        let built = build
            .join()
            .map_err(|_| anyhow::anyhow!("the background build's thread panicked"))?
            .with_context(|| {
                let output = std::fs::read_to_string(&log).unwrap_or_default();
                let tail: Vec<_> = output.lines().rev().take(40).collect();
                let tail: Vec<_> = tail.into_iter().rev().collect();
                format!(
                    "the release build (log: {}):\n{}",
                    log.display(),
                    tail.join("\n")
                )
            })?;
        Ok(Built(built))
    }
}

/// The release binaries, by name.
pub(crate) struct Built(BTreeMap<String, PathBuf>);

impl Built {
    /// Runs census-bench with `args`, against the operator built (unless `args` name
    /// one), and the agent built for a seed preset.
    pub(crate) fn run(&self, own_operator: bool, args: &[OsString]) -> anyhow::Result<()> {
        let path = |name: &str| {
            self.0
                .get(name)
                .cloned()
                .with_context(|| format!("cargo built no {name}"))
        };
        let mut bench = std::process::Command::new(path("census-bench")?);
        if !own_operator {
            bench.arg("--operator").arg(path("census-operator")?);
        }
        if args.iter().any(|arg| is_seed_preset(arg)) {
            bench.arg("--agent").arg(path("census-agent")?);
        }
        cmd::run(bench.args(args))
    }
}

fn build_args(own_operator: bool, agent: bool) -> Vec<&'static str> {
    let mut build = vec!["build", "--release", "-p", "census-bench"];
    if !own_operator {
        build.extend(["-p", "census-operator"]);
    }
    if agent {
        build.extend(["-p", "census-agent"]);
    }
    build
}

/// A preset that replays a field report on a real control plane (`seeds`,
/// `seed-leak`, ...).
fn is_seed_preset(arg: &OsStr) -> bool {
    arg.to_str().is_some_and(|arg| arg.starts_with("seed"))
}

/// `--operator PATH` or `--operator=PATH`.
fn is_operator_flag(arg: &OsStr) -> bool {
    arg.to_str()
        .is_some_and(|arg| arg == "--operator" || arg.starts_with("--operator="))
}
