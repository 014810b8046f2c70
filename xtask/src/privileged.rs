//! `cargo xtask test-privileged`: the tests that need root.
//!
//! Builds `census-agent`'s `privileged` test target as the calling user would
//! (`cargo test --no-run --message-format=json`), then runs its executables
//! with `--ignored --test-threads=1`. Only these tests need root: nothing sets a
//! global `runner = "sudo -E"`.

use std::{ffi::OsString, process::Command};

use anyhow::bail;

use crate::{cmd, ebpf};

#[derive(Debug, clap::Args)]
pub(crate) struct Options {
    /// Do not (re)build the eBPF object first.
    #[arg(long)]
    pub(crate) no_build_ebpf: bool,
    /// Passed to the test executables (a test name filter, `--nocapture`, …).
    #[arg(last = true)]
    pub(crate) test_args: Vec<OsString>,
}

pub(crate) fn run(options: Options) -> anyhow::Result<()> {
    let Options {
        no_build_ebpf,
        test_args,
    } = options;
    if !cmd::is_root() {
        bail!(
            "the privileged tests load BPF programs and create network namespaces: run \
             `sudo -E cargo xtask test-privileged` (or as root)"
        );
    }
    if !no_build_ebpf {
        ebpf::build(ebpf::Profile::Release)?;
    }
    let executables = cmd::build_test_executables(&[
        "test",
        "--no-run",
        "--package",
        "census-agent",
        "--test",
        "privileged",
    ])?;
    for executable in executables {
        cmd::run(
            Command::new(&executable)
                .args(["--ignored", "--test-threads=1"])
                .args(&test_args),
        )?;
    }
    Ok(())
}
