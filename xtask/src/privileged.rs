//! `cargo xtask test-privileged`: the tests that need root.
//!
//! Builds `census-agent`'s `privileged` (the datapath against the kernel) and `e2e`
//! (real operator and agent processes, network namespaces, traffic) test targets as
//! the calling user would (`cargo test --no-run --message-format=json`), and the
//! `census-operator` and `census-agent` binaries the end-to-end tests run, then runs
//! the test executables with `--ignored --test-threads=1`, once per attach mode
//! (`CENSUS_TEST_ATTACH_MODE=tcx`, then `tc`). Only these tests need
//! root: nothing sets a global `runner = "sudo -E"`.

use std::{ffi::OsString, process::Command};

use anyhow::{Context as _, bail};

use crate::{cmd, ebpf, setup};

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
             `cargo xtask test-privileged` as root"
        );
    }
    // The tests pin under /sys/fs/bpf, as the agent does on a node.
    setup::mount_bpffs()?;
    if !no_build_ebpf {
        ebpf::build(ebpf::Profile::Release)?;
    }
    let binaries = cmd::build_binaries(&[
        "build",
        "--package",
        "census-operator",
        "--package",
        "census-agent",
        "--bins",
    ])?;
    let binary = |name: &str| {
        binaries
            .get(name)
            .cloned()
            .with_context(|| format!("cargo built no {name} binary"))
    };
    let (operator, agent) = (binary("census-operator")?, binary("census-agent")?);
    let executables = cmd::build_test_executables(&[
        "test",
        "--no-run",
        "--package",
        "census-agent",
        "--test",
        "privileged",
        "--test",
        "e2e",
    ])?;
    // Every test in both attach modes: TCX, and TC filters forced (the path of
    // kernels before 6.6), on this kernel.
    for mode in ["tcx", "tc"] {
        for executable in &executables {
            cmd::run(
                Command::new(executable)
                    .args(["--ignored", "--test-threads=1"])
                    // Devices this kernel may lack (ipvlan, netkit, wireguard).
                    .args(["--skip", "needs_other_kernel::"])
                    .args(&test_args)
                    .env("CENSUS_TEST_ATTACH_MODE", mode)
                    .env("CENSUS_OPERATOR_BIN", &operator)
                    .env("CENSUS_AGENT_BIN", &agent),
            )?;
        }
    }
    Ok(())
}
