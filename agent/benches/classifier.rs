//! Cost of census's classifier per packet, measured in the kernel with
//! `BPF_PROG_TEST_RUN`: the mean the kernel reports over `repeat` runs on one
//! skb, median of `rounds` such means.
//!
//! That mean includes the test loop's own per-run cost (an indirect call into
//! the program, the loop's time checks). The non-IP scenario, where the program
//! returns after one comparison, measures it; `net` subtracts it. (The kernel's
//! run-time statistics, `BPF_ENABLE_STATS`, are no better here: they add two
//! clock reads per run, which cost more than the program on a virtual machine.)
//!
//! A test run's packet is on the loopback (`skb->ifindex` 1): each scenario
//! gives the loopback the INTERFACES entry of the endpoint whose host-side
//! interface the packet is on, and sets the interface it arrived on
//! (`skb->ingress_ifindex`), which the program only looks up. The fallback
//! scenarios run without those entries: both sides by address, as for an
//! interface whose entry is missing.
//!
//! Needs root: run it with `cargo xtask bench-classifier`. Without root (as in
//! `cargo bench --workspace`) it says so and exits successfully.
//!
//! Arguments (after `--`): `--repeat N` runs per measurement (default
//! 1,000,000), `--rounds N` measurements per scenario, the median is reported
//! (default 5). Run without `--bench` (by `cargo test --benches`), it only
//! checks that every scenario runs, with a few repetitions.

use std::{net::IpAddr, path::PathBuf, process::ExitCode, time::Duration};

use census_agent::bpf::{
    Datapath, Direction, Endpoint, Interface, TestContext, object_is_embedded, uninstall,
};
use census_netlab::{packet, unique_name};

/// What census aims for, per packet.
const TARGET: Duration = Duration::from_nanos(100);

/// The interface a test run's packet is on (`skb->ifindex`).
const LOOPBACK: u32 = 1;
/// Pod A's host-side interface, as the interface a packet arrived on.
const POD_A_INTERFACE: u32 = 50;
/// An interface without an entry (the node's uplink, say).
const UPLINK: u32 = 2;

struct Scenario {
    name: &'static str,
    direction: Direction,
    frame: Vec<u8>,
    context: TestContext,
    /// The INTERFACES entries during the scenario, besides the node's others.
    interfaces: Vec<Interface>,
    /// Judged against the target (the steady state), or shown for information.
    judged: bool,
}

/// Removes the bench's pin directory, also on failure.
struct PinDir(PathBuf);

impl Drop for PinDir {
    fn drop(&mut self) {
        if let Err(error) = uninstall(&self.0) {
            #[expect(
                clippy::print_stderr,
                reason = "a guard's drop cannot return its error"
            )]
            {
                eprintln!("uninstalling {}: {error}", self.0.display());
            }
        }
    }
}

#[expect(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a benchmark's report"
)]
fn main() -> ExitCode {
    if !nix::unistd::geteuid().is_root() {
        println!("classifier bench skipped: it needs root (run `cargo xtask bench-classifier`)");
        return ExitCode::SUCCESS;
    }
    if !object_is_embedded() {
        println!(
            "classifier bench skipped: the eBPF object is not built (`cargo xtask build-ebpf`)"
        );
        return ExitCode::SUCCESS;
    }
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("classifier bench failed: {error}");
            ExitCode::FAILURE
        }
    }
}

#[expect(clippy::print_stdout, reason = "a benchmark's report")]
fn run() -> Result<(), Box<dyn std::error::Error>> {
    let (repeat, rounds) = parse_args()?;
    let pins = PinDir(PathBuf::from("/sys/fs/bpf").join(unique_name("census-bench")));
    let mut datapath = Datapath::open(&pins.0)?;

    let a: IpAddr = "198.18.1.2".parse()?;
    let b: IpAddr = "198.18.2.2".parse()?;
    let a6: IpAddr = "2001:2:0:1::2".parse()?;
    let b6: IpAddr = "2001:2:0:2::2".parse()?;
    let outside: IpAddr = "198.19.0.9".parse()?;
    let outside6: IpAddr = "2001:3::9".parse()?;
    for (ip, identity) in [(a, 1000), (b, 1001), (a6, 1000), (b6, 1001)] {
        datapath.upsert_endpoint(ip, Endpoint::local(identity))?;
    }
    // A realistic map: a node's worth of other endpoints.
    for i in 0..110u8 {
        let ip: IpAddr = [198, 18, 100, i].into();
        datapath.upsert_endpoint(ip, Endpoint::local(2000 + u32::from(i)))?;
    }

    // A node's worth of other interfaces.
    for i in 0..110u32 {
        datapath.set_interface(Interface {
            ifindex: 100 + i,
            identity: Some(2000 + i),
        })?;
    }

    let udp = |src, dst| packet::udp_frame(src, dst, 64).ok_or("mixed address families");
    let on = |ifindex, identity| Interface {
        ifindex,
        identity: Some(identity),
    };
    let leaving_a = TestContext::default();
    let from_a = TestContext {
        ingress_ifindex: POD_A_INTERFACE,
        ..TestContext::default()
    };
    let from_uplink = TestContext {
        ingress_ifindex: UPLINK,
        ..TestContext::default()
    };
    let scenarios = [
        Scenario {
            name: "ingress  IPv4 pod -> pod (counted)",
            direction: Direction::Ingress,
            frame: udp(a, b)?,
            context: leaving_a,
            interfaces: vec![on(LOOPBACK, 1000)],
            judged: true,
        },
        Scenario {
            name: "egress   IPv4 pod -> pod (skipped: from a census interface)",
            direction: Direction::Egress,
            frame: udp(a, b)?,
            context: from_a,
            interfaces: vec![on(LOOPBACK, 1001), on(POD_A_INTERFACE, 1000)],
            judged: true,
        },
        Scenario {
            name: "egress   IPv4 world -> pod (counted)",
            direction: Direction::Egress,
            frame: udp(outside, b)?,
            context: from_uplink,
            interfaces: vec![on(LOOPBACK, 1001)],
            judged: true,
        },
        Scenario {
            name: "ingress  IPv6 pod -> pod (counted)",
            direction: Direction::Ingress,
            frame: udp(a6, b6)?,
            context: leaving_a,
            interfaces: vec![on(LOOPBACK, 1000)],
            judged: true,
        },
        Scenario {
            name: "egress   IPv6 world -> pod (counted)",
            direction: Direction::Egress,
            frame: udp(outside6, b6)?,
            context: from_uplink,
            interfaces: vec![on(LOOPBACK, 1001)],
            judged: true,
        },
        Scenario {
            name: "fallback: ingress IPv4 pod -> pod, by address",
            direction: Direction::Ingress,
            frame: udp(a, b)?,
            context: leaving_a,
            interfaces: vec![],
            judged: false,
        },
        Scenario {
            name: "fallback: egress IPv4 pod -> pod (skipped: local source)",
            direction: Direction::Egress,
            frame: udp(a, b)?,
            context: from_a,
            interfaces: vec![],
            judged: false,
        },
        Scenario {
            name: "fallback: egress IPv4 world -> pod, by address",
            direction: Direction::Egress,
            frame: udp(outside, b)?,
            context: from_uplink,
            interfaces: vec![],
            judged: false,
        },
    ];
    let baseline = Scenario {
        name: "ingress  ARP (not IP: returns at once)",
        direction: Direction::Ingress,
        frame: packet::arp_frame(),
        context: leaving_a,
        interfaces: vec![],
        judged: false,
    };

    println!(
        "census classifier, BPF_PROG_TEST_RUN, {repeat} runs x {rounds} rounds, median ns/packet:"
    );
    println!("  {:<60} {:>8} {:>8}", "scenario", "measured", "net");
    let harness = measure(&mut datapath, &baseline, repeat, rounds)?;
    println!("  {:<60} {:>8}", baseline.name, harness.as_nanos());
    let mut worst = (Duration::ZERO, Duration::ZERO);
    for scenario in &scenarios {
        let measured = measure(&mut datapath, scenario, repeat, rounds)?;
        let net = measured.saturating_sub(harness);
        if scenario.judged {
            worst = worst.max((net, measured));
        }
        println!(
            "  {:<60} {:>8} {:>8}",
            scenario.name,
            measured.as_nanos(),
            net.as_nanos()
        );
    }
    let (net, measured) = worst;
    let verdict = if measured < TARGET { "under" } else { "OVER" };
    println!(
        "worst case (INTERFACES entries in place): {} ns/packet measured ({} ns net of the test loop): {verdict} the {} ns target",
        measured.as_nanos(),
        net.as_nanos(),
        TARGET.as_nanos()
    );
    Ok(())
}

/// The median of `rounds` kernel-reported means of `repeat` runs.
fn measure(
    datapath: &mut Datapath,
    scenario: &Scenario,
    repeat: u32,
    rounds: usize,
) -> Result<Duration, Box<dyn std::error::Error>> {
    for ifindex in [LOOPBACK, POD_A_INTERFACE] {
        datapath.delete_interface(ifindex)?;
    }
    for interface in &scenario.interfaces {
        datapath.set_interface(*interface)?;
    }
    let (direction, frame, context) = (scenario.direction, &scenario.frame, scenario.context);
    // Warm up: the flow entry exists from here on, as in steady state.
    datapath.test_run(direction, frame, context, 1_000)?;
    let mut means = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let run = datapath.test_run(direction, frame, context, repeat)?;
        if run.return_value != -1 {
            return Err(format!(
                "{}: returned {} instead of TC_ACT_UNSPEC",
                scenario.name, run.return_value
            )
            .into());
        }
        means.push(run.mean_duration);
    }
    Ok(median(&mut means))
}

fn median(values: &mut [Duration]) -> Duration {
    values.sort();
    values.get(values.len() / 2).copied().unwrap_or_default()
}

fn parse_args() -> Result<(u32, usize), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // `cargo bench` passes `--bench`; `cargo test --benches` does not: smoke test.
    let benchmarking = args.iter().any(|arg| arg == "--bench" || arg == "--repeat");
    let (mut repeat, mut rounds) = if benchmarking {
        (1_000_000, 5)
    } else {
        (100, 1)
    };
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--repeat" => repeat = args.next().ok_or("--repeat needs a value")?.parse()?,
            "--rounds" => rounds = args.next().ok_or("--rounds needs a value")?.parse()?,
            // Anything else (a filter) is ignored.
            _ => {}
        }
    }
    if repeat == 0 || rounds == 0 {
        return Err("--repeat and --rounds must be positive".into());
    }
    Ok((repeat, rounds))
}
