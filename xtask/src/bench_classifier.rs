//! `cargo xtask bench-classifier`: the classifier's cost per packet.
//!
//! Builds the eBPF objects (census's and the bench's cyclers) and
//! `census-agent`'s `classifier` bench (release, `harness = false`), and runs it as
//! root: it loads the programs without pinning anything, measures them with
//! `BPF_PROG_TEST_RUN` (no attachment involved, so TCX and TC modes cost the same),
//! and prints ns/packet for IPv4 and IPv6, local and remote peers, ENDPOINTS at 110
//! and 524,288 entries, with at least 10,000 peers cycled through, each as a ratio
//! to the floor (the peer cycler and an empty TC program) measured in the same
//! run, with the datapath log off and on; the paths of Service traffic among them
//! (a packet to a Service address, marked at ingress; one to the world; a marked
//! packet counted at a pod's egress and at an uplink; an unmarked one skipped at
//! the uplink), each checked against STATS; then the kernel memory of ENDPOINTS (not
//! preallocated) empty and with 550,000 entries (the map's fdinfo `memlock`), and
//! the rate of ENDPOINTS writes from userspace.

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
    /// Peers cycled through with ENDPOINTS at 524,288 entries (at least 10,000).
    #[arg(long, default_value_t = 16_384, value_parser = clap::value_parser!(u32).range(10_000..=131_072))]
    peers: u32,
    /// Do not (re)build the eBPF object first.
    #[arg(long)]
    no_build_ebpf: bool,
    /// Only the root cgroup's programs' rows.
    #[arg(long)]
    sockets_only: bool,
    /// The order the peers are visited in: `address` (each run's peer the next
    /// address) or `scattered` (each far from the last, as in real traffic).
    #[arg(long, value_enum, default_value_t = Order::Address)]
    order: Order,
}

/// The order the bench's cyclers visit the peers in.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Order {
    Address,
    Scattered,
}

impl Order {
    const fn arg(self) -> &'static str {
        match self {
            Self::Address => "address",
            Self::Scattered => "scattered",
        }
    }
}

pub(crate) fn run(options: Options) -> anyhow::Result<()> {
    let Options {
        repeat,
        rounds,
        peers,
        no_build_ebpf,
        sockets_only,
        order,
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
    let mut args: Vec<OsString> = vec![
        "--repeat".into(),
        repeat.to_string().into(),
        "--rounds".into(),
        rounds.to_string().into(),
        "--peers".into(),
        peers.to_string().into(),
        "--order".into(),
        order.arg().into(),
    ];
    if sockets_only {
        args.push("--sockets-only".into());
    }
    for executable in executables {
        cmd::run(Command::new(&executable).args(&args))?;
    }
    Ok(())
}
