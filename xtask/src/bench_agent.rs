//! `cargo xtask bench-agent`: the agent's reconcile throughput, source-to-map
//! latency and memory.
//!
//! Builds `census-agent`'s `agent` bench (release, `harness = false`) and runs it
//! as root; it works in a network namespace and a pin directory of its own, prints
//! its figures and removes everything.

use std::process::Command;

use anyhow::bail;

use crate::{cmd, ebpf};

#[derive(Debug, Clone, Copy, clap::Args)]
pub(crate) struct Options {
    /// Endpoints of the throughput measurement.
    #[arg(long, default_value_t = 1000)]
    endpoints: usize,
    /// Samples per latency case.
    #[arg(long, default_value_t = 200)]
    samples: usize,
    /// Endpoints of the memory measurement.
    #[arg(long, default_value_t = 110)]
    rss_endpoints: usize,
    /// Do not (re)build the eBPF object first.
    #[arg(long)]
    no_build_ebpf: bool,
}

pub(crate) fn run(options: Options) -> anyhow::Result<()> {
    let Options {
        endpoints,
        samples,
        rss_endpoints,
        no_build_ebpf,
    } = options;
    if !cmd::is_root() {
        bail!(
            "the benchmark loads BPF programs and creates a network namespace: run \
             `cargo xtask bench-agent` as root"
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
        "agent",
    ])?;
    for executable in executables {
        cmd::run(Command::new(&executable).args([
            "--endpoints".to_owned(),
            endpoints.to_string(),
            "--samples".to_owned(),
            samples.to_string(),
            "--rss-endpoints".to_owned(),
            rss_endpoints.to_string(),
        ]))?;
    }
    Ok(())
}
