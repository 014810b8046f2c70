//! The agent's benchmarks, against the real kernel:
//!
//! 1. **Reconcile throughput** at 1,000 endpoints (two addresses each, one dummy
//!    interface each): the agent's core and reconciler writing a full set into a
//!    real ENDPOINTS map and attaching the classifier (identities already known),
//!    then a full pass with nothing to change, then every endpoint moving to
//!    another identity.
//! 2. **Latency** from an endpoint appearing in the endpoints file to its
//!    ENDPOINTS entry, p50/p99: the whole agent (in process: file watcher, core,
//!    allocation over gRPC to a real operator in process, map write), an endpoint
//!    at a time, for a label set whose identity the agent knows and for a new one.
//! 3. **RSS** of a `census-agent` process (release build) managing 110 endpoints,
//!    connected to an operator, after it settled.
//!
//! Everything runs in a network namespace of its own with veth interfaces, and a
//! pin directory of its own; both are removed at the end, also on failure.
//!
//! Needs root: run it with `cargo xtask bench-agent`. Without root (as in `cargo
//! bench --workspace`) it says so and exits successfully. Arguments (after `--`):
//! `--endpoints N` (default 1000), `--samples N` per latency case (default 200),
//! `--rss-endpoints N` (default 110). Run without `--bench` (by `cargo test
//! --benches`), it only checks that everything runs, with small numbers.

use std::{
    collections::BTreeMap,
    error::Error,
    fs,
    io::{Read as _, Write as _},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream},
    path::{Path, PathBuf},
    process::{Command, ExitCode, Stdio},
    time::{Duration, Instant},
};

use census_agent::{
    bench::Reconcile,
    bpf::{Datapath, Inspector, object_is_embedded, uninstall},
    daemon::{self, Options},
    host::HostIps,
    source::{FileSource, HostInterface, SourceEndpoint, SourceEvent},
};
use census_netlab::{Netns, unique_name};
use census_proto::domain::{EndpointKey, IdentityId, NodeName, canonical_ips};
use census_testkit::Operator;

type Fallible<T> = Result<T, Box<dyn Error + Send + Sync>>;

/// Removes a pin directory, also on failure.
struct PinDir(PathBuf);

impl PinDir {
    fn new() -> Self {
        Self(PathBuf::from("/sys/fs/bpf").join(unique_name("census-bench")))
    }
}

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

struct Args {
    endpoints: usize,
    samples: usize,
    rss_endpoints: usize,
}

#[expect(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a benchmark's report"
)]
fn main() -> ExitCode {
    if !nix::unistd::geteuid().is_root() {
        println!("agent bench skipped: it needs root (run `cargo xtask bench-agent`)");
        return ExitCode::SUCCESS;
    }
    if !object_is_embedded() {
        println!("agent bench skipped: the eBPF object is not built (`cargo xtask build-ebpf`)");
        return ExitCode::SUCCESS;
    }
    match parse_args().and_then(run) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("agent bench failed: {error}");
            ExitCode::FAILURE
        }
    }
}

fn parse_args() -> Fallible<Args> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let benchmarking = args
        .iter()
        .any(|a| a == "--bench" || a.starts_with("--endpoints"));
    let mut parsed = if benchmarking {
        Args {
            endpoints: 1000,
            samples: 200,
            rss_endpoints: 110,
        }
    } else {
        Args {
            endpoints: 20,
            samples: 5,
            rss_endpoints: 5,
        }
    };
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--endpoints" => parsed.endpoints = value()?.parse()?,
            "--samples" => parsed.samples = value()?.parse()?,
            "--rss-endpoints" => parsed.rss_endpoints = value()?.parse()?,
            _ => {}
        }
    }
    Ok(parsed)
}

fn run(args: Args) -> Fallible<()> {
    let ns = Netns::create("bench")?;
    let interfaces = args.endpoints.max(args.rss_endpoints) + args.samples * 2 + 10;
    dummies(&ns, interfaces)?;
    let agent_bin = PathBuf::from(env!("CARGO_BIN_EXE_census-agent"));
    ns.run(|| -> Fallible<()> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        report(&format!(
            "census-agent benchmarks ({} endpoints, {} latency samples per case, RSS at {} endpoints)",
            args.endpoints, args.samples, args.rss_endpoints
        ));
        throughput(args.endpoints)?;
        runtime.block_on(latency(args.samples))?;
        rss(&runtime, &agent_bin, args.rss_endpoints)?;
        Ok(())
    })?
}

#[expect(clippy::print_stdout, reason = "a benchmark's report")]
fn report(line: &str) {
    println!("{line}");
}

/// `dummy0`, `dummy1`, ... in `ns`, up: one end of a veth pair each (the kernels
/// this runs on may lack the dummy driver), like a pod's host side.
fn dummies(ns: &Netns, count: usize) -> Fallible<()> {
    let mut batch = String::new();
    for i in 0..count {
        batch.push_str(&format!(
            "link add dummy{i} type veth peer name peer{i}\nlink set dummy{i} up\n"
        ));
    }
    let mut child = Command::new("ip")
        .args(["-n", ns.name(), "-batch", "-"])
        .stdin(Stdio::piped())
        .spawn()?;
    child
        .stdin
        .take()
        .ok_or("ip's stdin")?
        .write_all(batch.as_bytes())?;
    let status = child.wait()?;
    if !status.success() {
        return Err(format!("ip -batch: {status}").into());
    }
    Ok(())
}

fn ipv4(i: usize) -> IpAddr {
    let i = u32::try_from(i).unwrap_or(0) + 2;
    Ipv4Addr::from(0xc612_0000 | i).into() // 198.18.0.0/15
}

fn ipv6(i: usize) -> IpAddr {
    let i = u128::try_from(i).unwrap_or(0) + 2;
    Ipv6Addr::from(0x2001_0002_0000_0000_0000_0000_0000_0000 | i).into()
}

fn source_endpoint(i: usize, app: &str) -> Fallible<SourceEndpoint> {
    Ok(SourceEndpoint {
        key: EndpointKey::new("bench", &format!("pod-{i}"))?,
        ips: canonical_ips(vec![ipv4(i), ipv6(i)]),
        labels: BTreeMap::from([("app".to_owned(), app.to_owned())]),
        service_account: "default".to_owned(),
        interface: HostInterface::Named(format!("dummy{i}")),
    })
}

fn throughput(count: usize) -> Fallible<()> {
    let pins = PinDir::new();
    let mut node = Reconcile::new(Datapath::open(&pins.0)?);
    let set: Vec<SourceEndpoint> = (0..count)
        .map(|i| source_endpoint(i, &format!("app-{}", i % 100)))
        .collect::<Fallible<_>>()?;

    // The agent's core: the set in, one identity per label set.
    let started = Instant::now();
    let labels = node.source(SourceEvent::Reset(set));
    for (n, labels) in labels.iter().enumerate() {
        let id = IdentityId::new(1000 + u32::try_from(n)?).ok_or("id")?;
        node.allocated(labels, id);
    }
    let core = started.elapsed();

    let started = Instant::now();
    node.write_entries()?;
    let writes = started.elapsed();
    let started = Instant::now();
    node.attach_interfaces()?;
    let attaches = started.elapsed();
    let entries = Inspector::open(&pins.0)?.endpoints()?.len();
    if entries != 2 * count {
        return Err(format!("{entries} entries in ENDPOINTS, expected {}", 2 * count).into());
    }

    let started = Instant::now();
    let pass = node.full_pass();
    let full_pass = started.elapsed();
    if pass.written + pass.repaired + pass.removed != 0 {
        return Err(format!("the full pass found work: {pass:?}").into());
    }

    // Every label set rebound: each endpoint's two ENDPOINTS entries and its
    // INTERFACES entry rewritten.
    let started = Instant::now();
    for (n, labels) in labels.iter().enumerate() {
        let id = IdentityId::new(5000 + u32::try_from(n)?).ok_or("id")?;
        node.allocated(labels, id);
    }
    node.write_entries()?;
    // And each interface's INTERFACES entry.
    node.attach_interfaces()?;
    let rebind = started.elapsed();

    let per_second = |d: Duration| count as f64 / d.as_secs_f64();
    report(&format!(
        "\nreconcile, {count} endpoints (2 addresses and 1 interface each), identities known:"
    ));
    report(&format!(
        "  core (source set -> desired state)       {:>9.1?}  {:>10.0} endpoints/s",
        core,
        per_second(core)
    ));
    report(&format!(
        "  ENDPOINTS writes ({} entries)           {:>9.1?}  {:>10.0} endpoints/s",
        2 * count,
        writes,
        per_second(writes)
    ));
    report(&format!(
        "  TCX attach + pin (2 links per interface) {:>9.1?}  {:>10.0} endpoints/s",
        attaches,
        per_second(attaches)
    ));
    let total = core + writes + attaches;
    report(&format!(
        "  all of it, cold                          {:>9.1?}  {:>10.0} endpoints/s",
        total,
        per_second(total)
    ));
    report(&format!(
        "  full pass, nothing to change             {:>9.1?}  {:>10.0} endpoints/s",
        full_pass,
        per_second(full_pass)
    ));
    report(&format!(
        "  every endpoint to a new identity         {:>9.1?}  {:>10.0} endpoints/s",
        rebind,
        per_second(rebind)
    ));
    Ok(())
}

fn yaml_entry(i: usize, app: &str) -> String {
    format!(
        "- {{namespace: bench, name: pod-{i}, ips: [{}, '{}'], labels: {{app: {app}}}, interface: dummy{i}}}\n",
        ipv4(i),
        ipv6(i)
    )
}

fn write_file(path: &Path, text: &str) -> Fallible<()> {
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, text)?;
    fs::rename(tmp, path)?;
    Ok(())
}

async fn start_operator(dir: &Path) -> Fallible<Operator> {
    Operator::start_in(dir, &["--snapshot-interval", "5s"]).await
}

/// Waits until `ip` has an ENDPOINTS entry; how long that took from `since`.
fn until_written(maps: &Inspector, ip: IpAddr, since: Instant) -> Fallible<Duration> {
    loop {
        if maps.endpoint(ip)?.is_some() {
            return Ok(since.elapsed());
        }
        if since.elapsed() > Duration::from_secs(30) {
            return Err(format!("{ip} was not written within 30 s").into());
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}

async fn latency(samples: usize) -> Fallible<()> {
    let dir = tempfile::tempdir()?;
    let pins = PinDir::new();
    let operator = start_operator(dir.path()).await?;
    let file = dir.path().join("endpoints.yaml");
    let base = 100;
    let mut text: String = (0..base)
        .map(|i| yaml_entry(i, &format!("app-{}", i % 10)))
        .collect();
    write_file(&file, &text)?;
    let datapath = Datapath::open(&pins.0)?;
    let pinned = Inspector::open(&pins.0)?;
    let options = Options {
        node: NodeName::new("bench-node")?,
        operator: format!("http://{}", operator.grpc_addr),
        operator_auth: census_agent::client::OperatorAuth::default(),
        admin_listen: "127.0.0.1:0".parse()?,
        health_listen: None,
        admin_limits: census_daemon::http::AdminLimits::default(),
        reconcile_interval: Duration::from_secs(10),
        initial_backoff: Duration::from_millis(50),
        max_backoff: Duration::from_secs(1),
        session: daemon::new_session(),
        host_ips: HostIps::Fixed(Default::default()),
        reassert_order: false,
        endpoint_map: true,
        drop_endpoint_deletes: false,
        node_hooks: None,
    };
    let source = FileSource::new(&file, Duration::from_secs(10))?;
    let agent = daemon::start(
        options,
        datapath,
        Some(Inspector::open(&pins.0)?),
        Box::new(source),
    )
    .await?;
    let maps = pinned;
    until_written(&maps, ipv4(base - 1), Instant::now())?;

    let mut next = base;
    let mut measure = |app: &dyn Fn(usize) -> String| -> Fallible<Vec<Duration>> {
        let mut times = Vec::with_capacity(samples);
        for _ in 0..samples {
            let i = next;
            next += 1;
            text.push_str(&yaml_entry(i, &app(i)));
            let written = {
                write_file(&file, &text)?;
                Instant::now()
            };
            times.push(until_written(&maps, ipv4(i), written)?);
        }
        times.sort();
        Ok(times)
    };
    let known = measure(&|i| format!("app-{}", i % 10))?;
    let new = measure(&|i| format!("new-{i}"))?;
    agent.shut_down().await;
    operator.shut_down().await?;

    let pct = |times: &[Duration], p: f64| {
        let index = ((times.len() as f64 - 1.0) * p).round() as usize;
        times.get(index).copied().unwrap_or_default()
    };
    report(&format!(
        "\nendpoints file -> ENDPOINTS entry (whole agent, {base}..{next} endpoints in the file), {samples} samples each:"
    ));
    for (case, times) in [
        ("label set with a known identity", &known),
        ("new label set (Allocate to the operator)", &new),
    ] {
        report(&format!(
            "  {case:<42} p50 {:>8.2?}  p99 {:>8.2?}  max {:>8.2?}",
            pct(times, 0.5),
            pct(times, 0.99),
            times.last().copied().unwrap_or_default()
        ));
    }
    Ok(())
}

fn rss(runtime: &tokio::runtime::Runtime, agent_bin: &Path, count: usize) -> Fallible<()> {
    let dir = tempfile::tempdir()?;
    let pins = PinDir::new();
    let operator = runtime.block_on(start_operator(dir.path()))?;
    let file = dir.path().join("endpoints.yaml");
    let text: String = (0..count)
        .map(|i| yaml_entry(i, &format!("app-{}", i % 20)))
        .collect();
    write_file(&file, &text)?;
    let admin = 9470;
    let mut child = Command::new(agent_bin)
        .args(["--node-name", "rss-node"])
        .args(["--operator", &format!("http://{}", operator.grpc_addr)])
        .arg("--pin-dir")
        .arg(&pins.0)
        .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
        .arg("--endpoints-file")
        .arg(&file)
        .args(["--log", "warn"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let result = (|| -> Fallible<(u64, u64)> {
        let started = Instant::now();
        loop {
            if let Ok(body) = http_get(admin, "/v1/endpoints") {
                let value: serde_json::Value = serde_json::from_str(&body)?;
                let all = value["endpoints"].as_array().cloned().unwrap_or_default();
                if all.len() == count && all.iter().all(|e| e["state"] == "programmed") {
                    break;
                }
            }
            if started.elapsed() > Duration::from_secs(60) {
                return Err("the agent did not program its endpoints in 60 s".into());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // Settle: a few scrapes, full passes and snapshots.
        for _ in 0..5 {
            let _ = http_get(admin, "/metrics");
            std::thread::sleep(Duration::from_millis(400));
        }
        let status = fs::read_to_string(format!("/proc/{}/status", child.id()))?;
        let field = |name: &str| -> Fallible<u64> {
            let line = status
                .lines()
                .find(|l| l.starts_with(name))
                .ok_or(format!("no {name} in /proc/<pid>/status"))?;
            Ok(line.split_whitespace().nth(1).ok_or("no value")?.parse()?)
        };
        Ok((field("VmRSS:")?, field("VmHWM:")?))
    })();
    let _ = child.kill();
    let _ = child.wait();
    runtime.block_on(operator.shut_down())?;
    let (rss, peak) = result?;
    report(&format!(
        "\ncensus-agent process (release), {count} endpoints programmed, connected, settled:"
    ));
    report(&format!(
        "  RSS {:.1} MiB (peak {:.1} MiB); target under 30 MiB",
        rss as f64 / 1024.0,
        peak as f64 / 1024.0
    ));
    Ok(())
}

fn http_get(port: u16, path: &str) -> Fallible<String> {
    let mut stream = TcpStream::connect(SocketAddr::from(([127, 0, 0, 1], port)))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(format!("GET {path} HTTP/1.0\r\nHost: bench\r\n\r\n").as_bytes())?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (_, body) = response.split_once("\r\n\r\n").ok_or("no HTTP header")?;
    Ok(body.to_owned())
}
