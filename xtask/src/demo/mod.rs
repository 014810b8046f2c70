//! `cargo xtask demo`: census on this machine, end to end, in about a minute.
//!
//! As root: set-up and the eBPF build (idempotent), then the binaries; an operator
//! on its embedded store (a temporary directory) and an agent on an endpoints file,
//! both inside a "node" network namespace; four labelled pods (network namespaces
//! with veth pairs, 198.18.0.0/15, no route out): two `app=web`, one `app=db`, one
//! `app=batch` carrying a per-run `job-name` that the operator's label filter drops;
//! and a second node, simulated over gRPC ([`remote`]), whose pod the agent learns
//! from the cluster-wide endpoint map (`census bpf endpoints list --remote`).
//! It sends a little traffic between the pods, and from a pod to the other node's
//! pod, and prints the identities (from the
//! operator, over gRPC) and the per-identity-pair counters (from the kernel's FLOWS
//! map, through the agent). Then a Service: the operator is started with a
//! `--service-cidr`, which reaches the agent's SERVICES map, and the node namespace
//! has kube-proxy's iptables rules for a ClusterIP whose backend is `db-0`
//! ([`census_netlab::kube_proxy`]); `web-1` exchanges datagrams with the ClusterIP,
//! and the demo prints what that exchange added to FLOWS: the requests as (web, db)
//! and the replies as (db, web), after kube-proxy's DNAT, not (web, world) (see
//! docs/design.md, "Counting traffic once"). Then it removes everything: processes,
//! pins, namespaces, files, also on Ctrl-C or failure.
//!
//! Without root it says so and runs what needs none: an operator, a session, a few
//! identities allocated and reported over gRPC.
//!
//! `--cluster` tells the story on a local Kubernetes control plane instead ([`cluster`]).

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    net::{IpAddr, SocketAddr, SocketAddrV4, TcpStream},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use census_netlab::{
    ChildGuard, Lab, Netns, Pod, UdpReceiver, UdpSender, exchange_udp,
    kube_proxy::{self, Protocol, Service, service_ip},
    udp_echo_through,
};
use census_proto::{
    PROTOCOL_VERSION,
    pb::{
        self, agent_message, endpoint_sync_client::EndpointSyncClient,
        identity_service_client::IdentityServiceClient, operator_message,
    },
};
use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};

use crate::{cmd, ebpf, setup};

mod cluster;
mod remote;
mod tls;

const OPERATOR_PORT: u16 = 9460;
const OPERATOR_ADMIN_PORT: u16 = 9461;
const AGENT_ADMIN_PORT: u16 = 9462;
const NODE: &str = "demo-node";
/// The demo's Service range (`--service-cidr`): the ClusterIPs of netlab's
/// kube-proxy rules, in 198.18.0.0/15 like everything else the demo addresses.
const SERVICE_RANGE_BITS: u8 = 24;
/// The ClusterIP's last octet, its port, and the port its backend listens on.
const SERVICE_HOST: u8 = 10;
const SERVICE_PORT: u16 = 8053;
const TARGET_PORT: u16 = 5353;
/// The Service's client and backend (indices into [`PODS`]), and the exchanges.
const SERVICE_CLIENT: usize = 1;
const SERVICE_BACKEND: usize = 2;
const SERVICE_EXCHANGES: usize = 6;
/// The reserved identity of addresses no endpoint lists.
const WORLD: u32 = 2;

#[derive(Debug, Clone, Copy, clap::Args)]
pub(crate) struct Options {
    /// Skip set-up and the eBPF build (they are idempotent, but take a few seconds).
    #[arg(long)]
    no_setup: bool,
    /// Run only the part that needs no root (the operator and identities over gRPC),
    /// as the demo does without root.
    #[arg(long, conflicts_with = "cluster")]
    operator_only: bool,
    /// The same story on a local Kubernetes control plane (needs Go and root):
    /// census deployed from deploy/, a few Deployments and a burst of Jobs, `census
    /// identity list` beside `kubectl get identities`, the operator's memory beside
    /// the seed report's; fails unless the identities come back to the live set.
    #[arg(long)]
    cluster: bool,
}

pub(crate) fn run(options: Options) -> anyhow::Result<()> {
    let Options {
        no_setup,
        operator_only,
        cluster,
    } = options;
    if cluster {
        return cluster::run(no_setup);
    }
    let interrupted = watch_for_interrupt();
    if operator_only {
        unprivileged(&interrupted)
    } else if cmd::is_root() {
        privileged(no_setup, &interrupted)
    } else {
        say(
            "not running as root: the datapath part of the demo (BPF programs and maps, network\n\
             namespaces) needs root (CAP_BPF, CAP_NET_ADMIN, CAP_PERFMON, CAP_SYS_ADMIN).\n\
             Running the part that needs no privileges: the operator and identities over gRPC.\n\
             For everything, run `cargo xtask demo` as root.",
        );
        unprivileged(&interrupted)
    }
}

/// Set by Ctrl-C or SIGTERM: every wait checks it, and the guards clean up.
type Interrupted = Arc<AtomicBool>;

fn watch_for_interrupt() -> Interrupted {
    let flag = Arc::new(AtomicBool::new(false));
    let set = flag.clone();
    thread::spawn(move || {
        let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        runtime.block_on(async {
            use tokio::signal::unix::{SignalKind, signal};
            let (Ok(mut int), Ok(mut term)) = (
                signal(SignalKind::interrupt()),
                signal(SignalKind::terminate()),
            ) else {
                return;
            };
            tokio::select! {
                _ = int.recv() => {},
                _ = term.recv() => {},
            }
            set.store(true, Ordering::SeqCst);
        });
    });
    flag
}

fn check(interrupted: &Interrupted) -> anyhow::Result<()> {
    if interrupted.load(Ordering::SeqCst) {
        bail!("interrupted; cleaning up");
    }
    Ok(())
}

fn wait_until(
    interrupted: &Interrupted,
    timeout: Duration,
    what: &str,
    mut done: impl FnMut() -> anyhow::Result<bool>,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        check(interrupted)?;
        if done()? {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        thread::sleep(Duration::from_millis(100));
    }
}

#[expect(clippy::print_stdout, reason = "the demo's report")]
fn say(text: &str) {
    println!("{text}");
}

#[expect(clippy::print_stdout, reason = "the demo's report")]
fn step(text: &str) {
    println!("\n==> {text}");
}

/// A daemon of the demo: stopped with SIGTERM (then killed) on drop; its log is
/// shown if the demo fails.
struct Daemon {
    name: &'static str,
    child: Option<Proc>,
    log: PathBuf,
}

/// A child spawned in a namespace (netlab's guard) or here.
enum Proc {
    InNamespace(ChildGuard),
    Here(std::process::Child),
}

impl Proc {
    fn child(&mut self) -> &mut std::process::Child {
        match self {
            Self::InNamespace(guard) => guard.child(),
            Self::Here(child) => child,
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Self::Here(child) = self {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Daemon {
    fn stop(&mut self) {
        let Some(mut guard) = self.child.take() else {
            return;
        };
        if let Ok(pid) = i32::try_from(guard.child().id()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if matches!(guard.child().try_wait(), Ok(Some(_))) {
                return;
            }
            thread::sleep(Duration::from_millis(50));
        }
        // The guard kills it.
    }

    fn exited(&mut self) -> Option<String> {
        let status = self.child.as_mut()?.child().try_wait().ok()??;
        Some(format!(
            "{} exited ({status}); its log:\n{}",
            self.name,
            tail(&self.log)
        ))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

fn tail(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// Removes the demo's pins with `census-agent uninstall` on drop.
struct Pins {
    agent: PathBuf,
    dir: PathBuf,
}

impl Drop for Pins {
    fn drop(&mut self) {
        if !self.dir.exists() {
            return;
        }
        let output = Command::new(&self.agent)
            .arg("uninstall")
            .arg("--pin-dir")
            .arg(&self.dir)
            .output();
        match output {
            Ok(output) if output.status.success() => {
                let text = String::from_utf8_lossy(&output.stdout);
                let removed = text.lines().count();
                say(&format!(
                    "    census-agent uninstall: {removed} pins and links removed from {}",
                    self.dir.display()
                ));
            }
            Ok(output) => say(&format!(
                "    census-agent uninstall failed: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            )),
            Err(error) => say(&format!("    cannot run census-agent uninstall: {error}")),
        }
    }
}

struct DemoPod {
    name: &'static str,
    labels: &'static [(&'static str, &'static str)],
    pod: Pod,
}

const PODS: [(&str, &[(&str, &str)]); 4] = [
    ("web-0", &[("app", "web")]),
    ("web-1", &[("app", "web"), ("pod-template-hash", "7d4b9")]),
    ("db-0", &[("app", "db")]),
    (
        "batch-28871",
        &[("app", "batch"), ("job-name", "nightly-28871")],
    ),
];

fn privileged(no_setup: bool, interrupted: &Interrupted) -> anyhow::Result<()> {
    let binaries = prepare(no_setup, interrupted)?;
    let (operator_bin, agent_bin, cli_bin) = (&binaries[0], &binaries[1], &binaries[2]);
    check(interrupted)?;

    let started = Instant::now();
    // Dropped in reverse: agent, operator, pins, pods, node namespace, files.
    let dir = tempfile::Builder::new().prefix("census-demo-").tempdir()?;
    step("network namespaces: a node and four pods (198.18.0.0/15, no route out)");
    let mut lab = Lab::new().context("creating the node namespace")?;
    let pods = add_pods(&mut lab)?;
    let pins = Pins {
        agent: agent_bin.clone(),
        dir: PathBuf::from("/sys/fs/bpf").join(census_netlab::unique_name("census-demo")),
    };
    let endpoints = dir.path().join("endpoints.yaml");
    fs::write(&endpoints, endpoints_file(&pods))?;
    let certs = certificates(operator_bin, dir.path())?;
    let mut operator = start_operator(&lab, dir.path(), operator_bin, &certs, interrupted)?;
    let mut agent = start_agent(&lab, dir.path(), agent_bin, &certs, &pins, &endpoints)?;
    let listed = wait_programmed(&lab, &mut agent, interrupted)?;
    print_endpoints(&listed);
    show_services(cli_bin, &pins, interrupted)?;
    let service = add_service(&lab, &pods)?;
    let remote = second_node(&lab, &certs)?;
    show_remote_endpoints(cli_bin, &pins, interrupted)?;
    traffic(&pods, interrupted)?;
    let identities = show_identities(&lab, &certs, &listed, remote.identity)?;
    let names = identity_names(&identities);
    let before = show_flows(&lab, &names)?;
    through_service(&lab, &pods, &service, &listed, &names, &before, interrupted)?;

    step("cleaning up: agent, pins, operator, namespaces, files");
    drop(remote);
    agent.stop();
    drop(agent);
    drop(pins);
    operator.stop();
    drop(operator);
    drop(pods);
    drop(lab);
    drop(dir);
    say(&format!(
        "\ndone in {:.1?} after the build. The agent left the datapath in place when it \
         stopped (fail-static); `census-agent uninstall` removed it.",
        started.elapsed()
    ));
    Ok(())
}

/// Set-up and the eBPF build (unless `no_setup`), then the operator's, the agent's and
/// the CLI's binaries, in that order.
fn prepare(no_setup: bool, interrupted: &Interrupted) -> anyhow::Result<Vec<PathBuf>> {
    if !no_setup {
        step("set-up (idempotent)");
        setup::run(setup::Options {})?;
        check(interrupted)?;
        step("eBPF build");
        ebpf::build(ebpf::Profile::Release)?;
    } else {
        // The agent pins under /sys/fs/bpf: the one set-up `--no-setup` still does.
        setup::mount_bpffs()?;
    }
    check(interrupted)?;
    step("building census-operator, census-agent and census");
    build(&["census-operator", "census-agent", "census"])
}

/// A pod namespace in `lab` for each of [`PODS`].
fn add_pods(lab: &mut Lab) -> anyhow::Result<Vec<DemoPod>> {
    let mut pods = Vec::new();
    for (name, labels) in PODS {
        let pod = lab.add_pod().context("creating a pod namespace")?;
        say(&format!(
            "    {name:<12} {:<12} {:<17} {}",
            pod.ipv4.to_string(),
            pod.host_interface,
            labels
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(",")
        ));
        pods.push(DemoPod { name, labels, pod });
    }
    Ok(pods)
}

/// The demo's certificates, in `dir`'s `tls`.
fn certificates(operator_bin: &Path, dir: &Path) -> anyhow::Result<tls::DemoCerts> {
    step(
        "certificates (census-operator certs): a CA, the operator's, one per node (the other's naming its address), a reader's",
    );
    let certs = tls::DemoCerts::generate(operator_bin, dir.join("tls"), &[NODE, remote::NODE])?;
    certs.vouch(
        operator_bin,
        remote::NODE,
        &[IpAddr::V4(remote::NODE_ADDRESS)],
    )?;
    say(&format!("    in {}", dir.join("tls").display()));
    Ok(certs)
}

/// The operator on its embedded store, in the node namespace, once it listens.
fn start_operator(
    lab: &Lab,
    dir: &Path,
    operator_bin: &Path,
    certs: &tls::DemoCerts,
    interrupted: &Interrupted,
) -> anyhow::Result<Daemon> {
    step("census-operator on its embedded store, in the node namespace");
    let mut operator = spawn(
        lab.node(),
        "census-operator",
        dir,
        Command::new(operator_bin)
            .args(["--grpc-listen", &format!("127.0.0.1:{OPERATOR_PORT}")])
            .args(certs.operator_args())
            .args([
                "--admin-listen",
                &format!("127.0.0.1:{OPERATOR_ADMIN_PORT}"),
            ])
            .arg("--store-path")
            .arg(dir.join("census.redb"))
            .args(["--snapshot-interval", "5s"])
            // A new store in a demo: no agent has identities to re-report first.
            .args(["--adoption-window", "0s"])
            // No cluster to list ServiceCIDRs from: the range is given.
            .args(["--service-cidr", &service_range()]),
    )?;
    wait_until(interrupted, Duration::from_secs(20), "the operator", || {
        if let Some(exit) = operator.exited() {
            bail!(exit);
        }
        let addr = SocketAddr::from(([127, 0, 0, 1], OPERATOR_PORT));
        Ok(lab.node().run(|| TcpStream::connect(addr).is_ok())?)
    })?;
    say(&format!(
        "    listening on 127.0.0.1:{OPERATOR_PORT}, mutual TLS: a caller is the node its certificate names (store {})",
        dir.join("census.redb").display()
    ));
    Ok(operator)
}

/// The agent on the endpoints file, in the node namespace.
fn start_agent(
    lab: &Lab,
    dir: &Path,
    agent_bin: &Path,
    certs: &tls::DemoCerts,
    pins: &Pins,
    endpoints: &Path,
) -> anyhow::Result<Daemon> {
    step("census-agent on the endpoints file, in the node namespace");
    spawn(
        lab.node(),
        "census-agent",
        dir,
        Command::new(agent_bin)
            .args(["--node-name", NODE])
            .args(["--operator", &format!("http://127.0.0.1:{OPERATOR_PORT}")])
            .args(certs.agent_args(NODE))
            .arg("--pin-dir")
            .arg(&pins.dir)
            .args(["--admin-listen", &format!("127.0.0.1:{AGENT_ADMIN_PORT}")])
            .arg("--endpoints-file")
            .arg(endpoints)
            .args(["--reconcile-interval", "2s"]),
    )
}

/// The agent's `/v1/endpoints` once every endpoint is programmed.
fn wait_programmed(
    lab: &Lab,
    agent: &mut Daemon,
    interrupted: &Interrupted,
) -> anyhow::Result<serde_json::Value> {
    let mut listed = serde_json::Value::Null;
    wait_until(
        interrupted,
        Duration::from_secs(30),
        "every endpoint to be programmed",
        || {
            if let Some(exit) = agent.exited() {
                bail!(exit);
            }
            let Ok((200, body)) = http_get(lab.node(), AGENT_ADMIN_PORT, "/v1/endpoints") else {
                return Ok(false);
            };
            listed = serde_json::from_str(&body)?;
            let endpoints = listed["endpoints"].as_array().cloned().unwrap_or_default();
            Ok(endpoints.len() == PODS.len()
                && endpoints.iter().all(|e| e["state"] == "programmed"))
        },
    )?;
    Ok(listed)
}

/// Waits for the operator's Service range in the agent's SERVICES map, and lists it.
fn show_services(cli_bin: &Path, pins: &Pins, interrupted: &Interrupted) -> anyhow::Result<()> {
    step("Service addresses: the operator's --service-cidr in the agent's SERVICES map");
    let mut services = Vec::new();
    wait_until(
        interrupted,
        Duration::from_secs(20),
        "the Service range in SERVICES",
        || {
            let output = Command::new(cli_bin)
                .arg("--bpffs")
                .arg(&pins.dir)
                .args(["bpf", "services", "list", "-o", "json"])
                .output()?;
            if !output.status.success() {
                return Ok(false);
            }
            let listed: serde_json::Value = serde_json::from_slice(&output.stdout)?;
            services = listed.as_array().cloned().unwrap_or_default();
            Ok(services
                .iter()
                .any(|s| s["range"].as_str() == Some(service_range().as_str())))
        },
    )?;
    say("    census bpf services list:");
    for service in &services {
        say(&format!(
            "    {:<18} {}",
            service["range"].as_str().unwrap_or("?"),
            service["kind"].as_str().unwrap_or("?")
        ));
    }
    Ok(())
}

/// A ClusterIP Service in front of the backend pod, as kube-proxy's iptables mode
/// makes it in the node namespace.
fn add_service(lab: &Lab, pods: &[DemoPod]) -> anyhow::Result<Service> {
    let service = Service {
        name: "db".to_owned(),
        address: SocketAddrV4::new(service_ip(SERVICE_HOST), SERVICE_PORT),
        protocol: Protocol::Udp,
        endpoints: vec![SocketAddrV4::new(
            pods[SERVICE_BACKEND].pod.ipv4,
            TARGET_PORT,
        )],
        masquerade_all: false,
        node_port: None,
    };
    kube_proxy::install(lab.node()).context("installing kube-proxy's chains")?;
    kube_proxy::add(lab.node(), &service).context("adding the Service's rules")?;
    say(&format!(
        "    a ClusterIP, as kube-proxy's iptables mode makes it in the node namespace: \
         {} (udp) -> {} {}",
        service.address, pods[SERVICE_BACKEND].name, service.endpoints[0]
    ));
    Ok(service)
}

/// The other node, simulated over gRPC.
fn second_node(lab: &Lab, certs: &tls::DemoCerts) -> anyhow::Result<remote::RemoteNode> {
    step("a second node, over gRPC: Hello with its address, Allocate, a Snapshot of one pod");
    let remote = remote::RemoteNode::start(&lab.node().path(), OPERATOR_PORT, certs.clone())?;
    say(&format!(
        "    {} ({}): {} {} identity {}",
        remote::NODE,
        remote::NODE_ADDRESS,
        remote::POD,
        remote::POD_IP,
        remote.identity
    ));
    Ok(remote)
}

/// Waits for the other node's pod in this node's ENDPOINTS, and lists the other
/// nodes' entries.
fn show_remote_endpoints(
    cli_bin: &Path,
    pins: &Pins,
    interrupted: &Interrupted,
) -> anyhow::Result<()> {
    step(
        "the cluster-wide endpoint map: the other node's pod and address in this node's ENDPOINTS",
    );
    let mut remote_entries = Vec::new();
    wait_until(
        interrupted,
        Duration::from_secs(20),
        "the other node's pod in ENDPOINTS",
        || {
            let output = Command::new(cli_bin)
                .arg("--bpffs")
                .arg(&pins.dir)
                .args(["bpf", "endpoints", "list", "--remote", "-o", "json"])
                .output()?;
            if !output.status.success() {
                return Ok(false);
            }
            let listed: serde_json::Value = serde_json::from_slice(&output.stdout)?;
            remote_entries = listed.as_array().cloned().unwrap_or_default();
            let pod_ip = remote::POD_IP.to_string();
            Ok(remote_entries
                .iter()
                .any(|e| e["address"].as_str() == Some(pod_ip.as_str())))
        },
    )?;
    say("    census bpf endpoints list --remote:");
    say(&format!(
        "    {:<16} {:<9} {:<8} node",
        "address", "identity", "flags"
    ));
    for entry in &remote_entries {
        say(&format!(
            "    {:<16} {:<9} {:<8} {}",
            entry["address"].as_str().unwrap_or("?"),
            entry["identity"].to_string(),
            entry["flags"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|f| f.as_str())
                .collect::<Vec<_>>()
                .join(","),
            node_cell(entry)
        ));
    }
    Ok(())
}

/// UDP between the pods, and from web-0 to the other node's pod.
fn traffic(pods: &[DemoPod], interrupted: &Interrupted) -> anyhow::Result<()> {
    step("traffic between the pods (UDP, 100-byte payloads)");
    let plan: [(usize, usize, usize); 4] = [(0, 2, 10), (2, 0, 10), (3, 1, 5), (1, 0, 3)];
    for (from, to, count) in plan {
        check(interrupted)?;
        let (from, to) = (&pods[from], &pods[to]);
        let receiver = UdpReceiver::bind(&to.pod.ns, to.pod.ipv4.into())?;
        let sender = UdpSender::bind(&from.pod.ns, from.pod.ipv4.into())?;
        let arrived = exchange_udp(&sender, &receiver, count, 100)?;
        say(&format!(
            "    {:<12} -> {:<12} {arrived}/{count} datagrams",
            from.name, to.name
        ));
    }

    check(interrupted)?;
    // No receiver: the other node is simulated. The datagrams are counted as they
    // leave web-0, then dropped by the node (no route to the other node).
    let web = &pods[0];
    let sender = UdpSender::bind(&web.pod.ns, web.pod.ipv4.into())?;
    sender.send_many(SocketAddr::from((remote::POD_IP, 7)), 7, 100)?;
    say(&format!(
        "    {:<12} -> {:<12} 7 datagrams (to the other node's pod)",
        web.name,
        remote::POD
    ));
    Ok(())
}

/// The identities of the agent's endpoints and of the other node's pod, as the
/// operator tells them.
fn show_identities(
    lab: &Lab,
    certs: &tls::DemoCerts,
    listed: &serde_json::Value,
    remote_identity: u32,
) -> anyhow::Result<Vec<pb::Identity>> {
    step("identities, from the operator (IdentityService.Get)");
    let ids: BTreeSet<u32> = listed["endpoints"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e["identity"].as_u64())
        .filter_map(|id| u32::try_from(id).ok())
        .chain([remote_identity])
        .collect();
    let identities = lab.node().run(|| get_identities(certs, &ids))??;
    say(&format!(
        "    {:<6} {:<5} {:<6} labels",
        "id", "refs", "holds"
    ));
    for identity in &identities {
        say(&format!(
            "    {:<6} {:<5} {:<6} {}",
            identity.id,
            identity.references,
            identity.holds,
            identity.labels.join(" ")
        ));
    }
    say("    (web-1's pod-template-hash and batch's job-name are dropped by the operator's");
    say("     label filter: every replica and every run of the job share one identity)");
    Ok(identities)
}

/// The short name of each identity, the host's and the world's.
fn identity_names(identities: &[pb::Identity]) -> BTreeMap<u32, String> {
    identities
        .iter()
        .map(|i| (i.id, short_name(&i.labels)))
        .chain([(1, "host".to_owned()), (WORLD, "world".to_owned())])
        .collect()
}

/// The kernel's FLOWS map by identity pair, printed; what it holds now.
fn show_flows(lab: &Lab, names: &BTreeMap<u32, String>) -> anyhow::Result<Flows> {
    step("traffic per identity pair, from the kernel's FLOWS map (agent: /v1/flows)");
    let before = flows(lab.node())?;
    print_flows(names, &before);
    say("    (each packet counted once, on the host side of the sender's veth; api is the");
    say("     other node's pod, known from the cluster-wide endpoint map. `host` is the");
    say("     node's own addresses; `world` is any address no endpoint lists: here IPv6");
    say("     neighbour discovery between link-local and multicast addresses)");
    Ok(before)
}

/// Requests from the client pod to the Service and their replies, and what they
/// added to FLOWS (counted client to backend, else the demo fails).
fn through_service(
    lab: &Lab,
    pods: &[DemoPod],
    service: &Service,
    listed: &serde_json::Value,
    names: &BTreeMap<u32, String>,
    before: &Flows,
    interrupted: &Interrupted,
) -> anyhow::Result<()> {
    let (client, backend) = (&pods[SERVICE_CLIENT], &pods[SERVICE_BACKEND]);
    step(&format!(
        "through the Service: {} -> {} (ClusterIP) -> {} {}, and back",
        client.name, service.address, backend.name, service.endpoints[0]
    ));
    check(interrupted)?;
    let replies = udp_echo_through(
        &client.pod.ns,
        IpAddr::V4(client.pod.ipv4),
        SocketAddr::V4(service.address),
        &backend.pod.ns,
        SocketAddr::V4(service.endpoints[0]),
        SERVICE_EXCHANGES,
        100,
        Duration::from_secs(1),
    )?;
    say(&format!(
        "    {replies}/{SERVICE_EXCHANGES} requests answered (the replies come back from {}: \
         conntrack reverses the DNAT)",
        service.address
    ));
    let added = added_flows(before, &flows(lab.node())?);
    say("    what the exchange added to FLOWS:");
    print_flows(names, &added);
    service_counted(client, backend, listed, names, &added, replies)
}

/// Fails unless the Service exchange's `replies` requests were counted client to
/// backend and its replies backend to client; says how they were counted.
fn service_counted(
    client: &DemoPod,
    backend: &DemoPod,
    listed: &serde_json::Value,
    names: &BTreeMap<u32, String>,
    added: &Flows,
    replies: usize,
) -> anyhow::Result<()> {
    let identity_of = |pod: &DemoPod| {
        listed["endpoints"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|e| e["name"].as_str() == Some(pod.name))
            .and_then(|e| e["identity"].as_u64())
            .and_then(|id| u32::try_from(id).ok())
            .with_context(|| format!("the agent lists no identity for {}", pod.name))
    };
    let (client_id, backend_id) = (identity_of(client)?, identity_of(backend)?);
    let packets = |pair| added.get(&pair).map_or(0, |&(packets, _)| packets);
    let (requests, answers, as_world) = (
        packets((client_id, backend_id)),
        packets((backend_id, client_id)),
        packets((client_id, WORLD)),
    );
    let name = |id: u32| names.get(&id).map_or("?", String::as_str);
    let (client_name, backend_name) = (name(client_id), name(backend_id));
    let exchanged = u64::try_from(replies)?;
    if requests != exchanged || answers != exchanged {
        bail!(
            "the Service exchange was not counted client to backend: {requests} requests as \
             ({client_name}, {backend_name}) and {answers} replies as ({backend_name}, \
             {client_name}), for {replies} exchanges"
        );
    }
    say(&format!(
        "    the {replies} requests were counted as ({client_name}, {backend_name}), client to \
         backend: marked where they left {} (a Service\n     address is not counted there), \
         counted on {}'s veth after the DNAT. The {replies} replies were counted as \
         ({backend_name}, {client_name})\n     where they left {}; {} sees them from the \
         ClusterIP and skips them. As ({client_name}, world): {as_world}.",
        client.name, backend.name, backend.name, client.name
    ));
    Ok(())
}

fn endpoints_file(pods: &[DemoPod]) -> String {
    let mut text = String::from("# Written by `cargo xtask demo`.\n");
    for pod in pods {
        let labels: Vec<String> = pod
            .labels
            .iter()
            .map(|(k, v)| format!("{k}: {v}"))
            .collect();
        text.push_str(&format!(
            "- namespace: default\n  name: {}\n  ips: [{}, '{}']\n  labels: {{{}}}\n  interface: {}\n",
            pod.name,
            pod.pod.ipv4,
            pod.pod.ipv6,
            labels.join(", "),
            pod.pod.host_interface
        ));
    }
    text
}

/// `198.19.96.0/24`: the range of the demo's ClusterIPs.
fn service_range() -> String {
    format!("{}/{SERVICE_RANGE_BITS}", service_ip(0))
}

/// (source identity, destination identity) -> (packets, bytes).
type Flows = BTreeMap<(u32, u32), (u64, u64)>;

/// The kernel's FLOWS, through the agent's `/v1/flows` (summed over CPUs).
fn flows(node: &Netns) -> anyhow::Result<Flows> {
    let (status, body) = http_get(node, AGENT_ADMIN_PORT, "/v1/flows")?;
    if status != 200 {
        bail!("GET /v1/flows: {status}: {body}");
    }
    let listed: serde_json::Value = serde_json::from_str(&body)?;
    let number = |flow: &serde_json::Value, key: &str| {
        flow[key]
            .as_u64()
            .with_context(|| format!("a flow without {key}: {flow}"))
    };
    let mut flows = Flows::new();
    for flow in listed["flows"].as_array().into_iter().flatten() {
        let pair = (
            u32::try_from(number(flow, "src_identity")?)?,
            u32::try_from(number(flow, "dst_identity")?)?,
        );
        let sum = flows.entry(pair).or_default();
        sum.0 += number(flow, "packets")?;
        sum.1 += number(flow, "bytes")?;
    }
    Ok(flows)
}

/// What `after` counts beyond `before`, pair by pair (pairs that did not grow
/// left out).
fn added_flows(before: &Flows, after: &Flows) -> Flows {
    after
        .iter()
        .filter_map(|(pair, &(packets, bytes))| {
            let (p0, b0) = before.get(pair).copied().unwrap_or_default();
            (packets > p0).then(|| (*pair, (packets - p0, bytes.saturating_sub(b0))))
        })
        .collect()
}

fn print_flows(names: &BTreeMap<u32, String>, flows: &Flows) {
    say(&format!(
        "    {:<18} {:<18} {:>8} {:>8}",
        "source", "destination", "packets", "bytes"
    ));
    let name = |id: u32| format!("{id} {}", names.get(&id).map_or("?", String::as_str));
    for (&(src, dst), (packets, bytes)) in flows {
        say(&format!(
            "    {:<18} {:<18} {packets:>8} {bytes:>8}",
            name(src),
            name(dst)
        ));
    }
}

fn print_endpoints(listed: &serde_json::Value) {
    say(&format!(
        "    operator connected: {}, session {}",
        listed["operator"]["connected"],
        listed["operator"]["session"].as_str().unwrap_or("?")
    ));
    say(&format!(
        "    {:<22} {:<12} {:<8} {:<9} {}",
        "endpoint", "address", "iface", "identity", "state"
    ));
    for e in listed["endpoints"].as_array().into_iter().flatten() {
        say(&format!(
            "    {:<22} {:<12} {:<8} {:<9} {}",
            format!(
                "{}/{}",
                e["namespace"].as_str().unwrap_or(""),
                e["name"].as_str().unwrap_or("")
            ),
            e["ips"][0].as_str().unwrap_or(""),
            e["interface"].as_str().unwrap_or(""),
            e["identity"].to_string(),
            e["state"].as_str().unwrap_or("")
        ));
    }
}

/// `app=web` for an identity with an `app` label, else its labels.
fn short_name(labels: &[String]) -> String {
    labels
        .iter()
        .find_map(|l| l.strip_prefix("k8s:app="))
        .map_or_else(|| labels.join(","), |app| format!("app={app}"))
}

/// Builds the named binaries (dev profile) and returns their paths, in order.
fn build(names: &[&str]) -> anyhow::Result<Vec<PathBuf>> {
    let mut args = vec!["build"];
    for name in names {
        args.extend(["--bin", name]);
    }
    let built = cmd::build_binaries(&args)?;
    names
        .iter()
        .map(|name| {
            built
                .get(*name)
                .cloned()
                .with_context(|| format!("cargo built no {name}"))
        })
        .collect()
}

/// Spawns `command` in `ns` (or here) with its stderr in `<dir>/<name>.log`.
fn spawn(
    ns: &Netns,
    name: &'static str,
    dir: &Path,
    command: &mut Command,
) -> anyhow::Result<Daemon> {
    let log = dir.join(format!("{name}.log"));
    let file = fs::File::create(&log)?;
    command
        .stdout(Stdio::null())
        .stderr(file)
        .stdin(Stdio::null());
    let child = ns
        .spawn(command)
        .with_context(|| format!("starting {name}"))?;
    Ok(Daemon {
        name,
        child: Some(Proc::InNamespace(child)),
        log,
    })
}

/// An HTTP/1.0 GET to `port` on the loopback of `ns`.
fn http_get(ns: &Netns, port: u16, path: &str) -> anyhow::Result<(u16, String)> {
    Ok(ns.http_get(port, path)?)
}

/// The operator's identities `ids` (called from a thread in the node namespace).
fn get_identities(
    certs: &tls::DemoCerts,
    ids: &BTreeSet<u32>,
) -> anyhow::Result<Vec<pb::Identity>> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        // As the demo's reader: it may read, never speak for a node.
        let channel = certs.channel(OPERATOR_PORT, None).await?;
        let mut client = IdentityServiceClient::new(channel);
        let mut identities = Vec::new();
        for id in ids {
            let identity = client
                .get(pb::GetRequest {
                    protocol_version: PROTOCOL_VERSION,
                    id: *id,
                })
                .await?
                .into_inner();
            identities.push(identity);
        }
        Ok(identities)
    })
}

/// Without root: the operator, a session, identities over gRPC.
fn unprivileged(interrupted: &Interrupted) -> anyhow::Result<()> {
    step("building census-operator");
    let binaries = build(&["census-operator"])?;
    check(interrupted)?;
    let dir = tempfile::Builder::new().prefix("census-demo-").tempdir()?;
    let port = free_port()?;
    let admin = free_port()?;
    step("certificates (census-operator certs): a CA, the operator's, a node's");
    let certs = tls::DemoCerts::generate(&binaries[0], dir.path().join("tls"), &[NODE])?;
    step("census-operator on its embedded store, mutual TLS");
    let log = dir.path().join("census-operator.log");
    let child = Command::new(&binaries[0])
        .args(["--grpc-listen", &format!("127.0.0.1:{port}")])
        .args(certs.operator_args())
        .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
        .arg("--store-path")
        .arg(dir.path().join("census.redb"))
        .args(["--adoption-window", "0s"])
        .stdout(Stdio::null())
        .stderr(fs::File::create(&log)?)
        .stdin(Stdio::null())
        .spawn()
        .context("starting census-operator")?;
    let mut operator = Daemon {
        name: "census-operator",
        child: Some(Proc::Here(child)),
        log,
    };
    wait_until(interrupted, Duration::from_secs(20), "the operator", || {
        if let Some(exit) = operator.exited() {
            bail!(exit);
        }
        Ok(TcpStream::connect(("127.0.0.1", port)).is_ok())
    })?;
    say(&format!("    listening on 127.0.0.1:{port}"));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(identities_over_grpc(port, &certs))?;
    step("stopping the operator");
    operator.stop();
    say(
        "done. For the datapath (programs, maps, traffic counters), run `cargo xtask demo` as root",
    );
    Ok(())
}

fn free_port() -> anyhow::Result<u16> {
    Ok(census_cluster::listen_port()?)
}

async fn identities_over_grpc(port: u16, certs: &tls::DemoCerts) -> anyhow::Result<()> {
    // As the node `NODE`: its certificate is what lets it say Hello as that node.
    let channel = certs.channel(port, Some(NODE)).await?;
    step("an agent's session: EndpointSync Hello");
    let session = pb::Session {
        start_time_ns: u64::try_from(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)?
                .as_nanos(),
        )?,
        nonce: rand::random(),
    };
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    tx.send(pb::AgentMessage {
        seq: 0,
        body: Some(agent_message::Body::Hello(pb::Hello {
            protocol_version: PROTOCOL_VERSION,
            node: NODE.to_owned(),
            session: Some(session),
            agent_version: "demo".to_owned(),
            addresses: Vec::new(),
        })),
    })
    .await?;
    let mut inbound = EndpointSyncClient::new(channel.clone())
        .sync(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await?
        .into_inner();
    let Some(operator_message::Body::HelloReply(reply)) =
        inbound.message().await?.and_then(|m| m.body)
    else {
        bail!("the operator did not answer HelloReply");
    };
    let filter = reply.filter.unwrap_or_default();
    say(&format!(
        "    HelloReply: operator {}, snapshots every {} ms, label filter drops {} key patterns ({}, ...)",
        reply.operator_version,
        reply.snapshot_interval_ms,
        filter.exclude.len(),
        filter
            .exclude
            .iter()
            .take(3)
            .cloned()
            .collect::<Vec<_>>()
            .join(", ")
    ));

    step("IdentityService.Allocate for three pods' labels");
    let mut identities = IdentityServiceClient::new(channel);
    let allocated = allocate_pods(&mut identities, session).await?;
    print_identities(&mut identities, &allocated).await?;

    step("EndpointSync Snapshot: the node's endpoints, which the operator counts");
    tx.send(pb::AgentMessage {
        seq: 1,
        body: Some(agent_message::Body::Snapshot(pb::Snapshot {
            endpoints: allocated
                .iter()
                .enumerate()
                .map(|(i, (name, labels, id))| pb::Endpoint {
                    namespace: "default".to_owned(),
                    name: (*name).to_owned(),
                    ips: vec![format!("198.18.{}.2", i + 1)],
                    identity: *id,
                    labels: labels.clone(),
                })
                .collect(),
            allocations_settled: 0,
        })),
    })
    .await?;
    match inbound.message().await?.and_then(|m| m.body) {
        Some(operator_message::Body::Ack(ack)) => say(&format!("    Ack seq {}", ack.seq)),
        other => bail!("expected an Ack, got {other:?}"),
    }
    print_identities(&mut identities, &allocated).await?;
    say("    (holds turned into references: the snapshot is the truth of the node's endpoints)");
    Ok(())
}

/// Allocates the identities of three pods' labels as the node `NODE` in `session`:
/// each pod's name, its labels and its identity.
async fn allocate_pods(
    identities: &mut IdentityServiceClient<tonic::transport::Channel>,
    session: pb::Session,
) -> anyhow::Result<Vec<(&'static str, Vec<String>, u32)>> {
    let pods: [(&str, &[&str]); 3] = [
        ("web-0", &["k8s:app=web"]),
        ("db-0", &["k8s:app=db"]),
        (
            "batch-28871",
            &["k8s:app=batch", "k8s:job-name=nightly-28871"],
        ),
    ];
    let mut allocated = Vec::new();
    for (name, labels) in pods {
        let mut labels: Vec<String> = labels.iter().map(|l| (*l).to_owned()).collect();
        labels.push("k8s:io.kubernetes.pod.namespace=default".to_owned());
        labels.push("k8s:io.kubernetes.pod.serviceaccount=default".to_owned());
        let identity = identities
            .allocate(pb::AllocateRequest {
                protocol_version: PROTOCOL_VERSION,
                node: NODE.to_owned(),
                session: Some(session),
                labels: labels.clone(),
                allocation: 0,
            })
            .await?
            .into_inner()
            .identity
            .context("Allocate answered no identity")?;
        say(&format!("    {name:<12} -> {}", identity.id));
        allocated.push((name, labels, identity.id));
    }
    Ok(allocated)
}

async fn print_identities(
    client: &mut IdentityServiceClient<tonic::transport::Channel>,
    allocated: &[(&str, Vec<String>, u32)],
) -> anyhow::Result<()> {
    say(&format!(
        "    {:<6} {:<5} {:<6} labels",
        "id", "refs", "holds"
    ));
    for (_, _, id) in allocated {
        let identity = client
            .get(pb::GetRequest {
                protocol_version: PROTOCOL_VERSION,
                id: *id,
            })
            .await?
            .into_inner();
        say(&format!(
            "    {:<6} {:<5} {:<6} {}",
            identity.id,
            identity.references,
            identity.holds,
            identity.labels.join(" ")
        ));
    }
    Ok(())
}

/// The node of a `census bpf endpoints list -o json` entry as the CLI's table shows
/// it: its name, or `#<index>` when NODES does not name it.
fn node_cell(entry: &serde_json::Value) -> String {
    match (entry["node_name"].as_str(), entry["node"].as_u64()) {
        (Some(name), _) => name.to_owned(),
        (None, Some(index)) => format!("#{index}"),
        (None, None) => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn a_remote_entry_shows_its_node_name_or_index_never_a_question_mark() {
        assert_eq!(
            super::node_cell(&json!({"node": 1, "node_name": "node-b"})),
            "node-b"
        );
        assert_eq!(
            super::node_cell(&json!({"node": 1, "node_name": null})),
            "#1"
        );
        assert_eq!(
            super::node_cell(&json!({"node": null, "node_name": null})),
            ""
        );
    }
}
