//! `cargo xtask bench <preset> [options]`: builds the load generator (`census-bench`,
//! bench/) and `census-operator` in release, and runs the one against the other. The
//! harness is always a release build: its client side (thousands of streams, hundreds
//! of concurrent Allocate calls) shares the cores with the operator it measures.

use std::{
    collections::BTreeMap,
    ffi::{OsStr, OsString},
    path::PathBuf,
};

use anyhow::Context as _;

use crate::cmd;

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
    let built = cmd::build_binaries(&build_args(own_operator))?;
    run_built(&built, own_operator, &args)
}

/// The release build of the harness (and of the operator unless the arguments name one),
/// started in the background at the lowest CPU priority, so that it takes only the cores
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
            std::thread::spawn(move || cmd::build_binaries_with(command, &build_args(false)));
        Ok(Self { build, log })
    }

    /// Waits for the build, then runs census-bench with `args` against its operator.
    pub(crate) fn run(self, args: &[OsString]) -> anyhow::Result<()> {
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
        run_built(&built, false, args)
    }
}

fn build_args(own_operator: bool) -> Vec<&'static str> {
    let mut build = vec!["build", "--release", "-p", "census-bench"];
    if !own_operator {
        build.extend(["-p", "census-operator"]);
    }
    build
}

fn run_built(
    built: &BTreeMap<String, PathBuf>,
    own_operator: bool,
    args: &[OsString],
) -> anyhow::Result<()> {
    let path = |name: &str| {
        built
            .get(name)
            .cloned()
            .with_context(|| format!("cargo built no {name}"))
    };
    let mut bench = std::process::Command::new(path("census-bench")?);
    if !own_operator {
        bench.arg("--operator").arg(path("census-operator")?);
    }
    cmd::run(bench.args(args))
}

/// `--operator PATH` or `--operator=PATH`.
fn is_operator_flag(arg: &OsStr) -> bool {
    arg.to_str()
        .is_some_and(|arg| arg == "--operator" || arg.starts_with("--operator="))
}
