//! `cargo xtask bench <preset> [options]`: builds the load generator (`census-bench`,
//! bench/) and `census-operator` in release, and runs the one against the other. The
//! harness is always a release build: its client side (thousands of streams, hundreds
//! of concurrent Allocate calls) shares the cores with the operator it measures.

use std::ffi::{OsStr, OsString};

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
    let mut build = vec!["build", "--release", "-p", "census-bench"];
    if !own_operator {
        build.extend(["-p", "census-operator"]);
    }
    let built = cmd::build_binaries(&build)?;
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
    cmd::run(bench.args(&args))
}

/// `--operator PATH` or `--operator=PATH`.
fn is_operator_flag(arg: &OsStr) -> bool {
    arg.to_str()
        .is_some_and(|arg| arg == "--operator" || arg.starts_with("--operator="))
}
