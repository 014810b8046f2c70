//! `cargo xtask bench-classifier`: the classifier's cost per packet.
//!
//! Builds `census-agent`'s `classifier` bench (release, `harness = false`) and
//! runs it as root; it loads the programs into a pin directory of its own,
//! measures them with `BPF_PROG_TEST_RUN`, prints ns/packet and removes
//! everything.

use std::{ffi::OsString, process::Command};

use anyhow::bail;

use crate::{cmd, ebpf};

#[derive(Debug, Clone, Copy, clap::Args)]
pub(crate) struct Options {
    /// Runs per measurement.
    #[arg(long, default_value_t = 1_000_000)]
    repeat: u32,
    /// Measurements per scenario (the median is reported).
    #[arg(long, default_value_t = 5)]
    rounds: u32,
    /// Do not (re)build the eBPF object first.
    #[arg(long)]
    no_build_ebpf: bool,
}

pub(crate) fn run(options: Options) -> anyhow::Result<()> {
    let Options {
        repeat,
        rounds,
        no_build_ebpf,
    } = options;
    if !cmd::is_root() {
        bail!(
            "the benchmark loads BPF programs: run `cargo xtask bench-classifier` as \
             root"
        );
    }
    if !no_build_ebpf {
        ebpf::build(ebpf::Profile::Release)?;
    }
    let executables = cmd::build_test_executables(&[
        "bench",
        "--no-run",
        "--package",
        "census-agent",
        "--bench",
        "classifier",
    ])?;
    let args: [OsString; 4] = [
        "--repeat".into(),
        repeat.to_string().into(),
        "--rounds".into(),
        rounds.to_string().into(),
    ];
    for executable in executables {
        cmd::run(Command::new(&executable).args(&args))?;
    }
    Ok(())
}
