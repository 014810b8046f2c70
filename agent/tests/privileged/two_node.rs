//! The cluster-wide endpoint map between two nodes, on the real kernel: two node
//! namespaces routed to each other (`census_netlab::Cluster`), pods behind each, a
//! `census-agent` per node (its own pin directory, an endpoints file, its node's
//! name) and one `census-operator` (in node A's namespace, its redb store in a
//! temporary directory) that both reach over the lab's network.
//!
//! What each node's maps say is read with bpftool, from their bytes, independently
//! of census's types; FLOWS with the agent's own reader. Latencies are printed
//! (`--nocapture`); the deadlines only bound a failure.
//!
//! A delete event is lost the way it is lost in a cluster: the pod goes while its
//! node's agent is down (SIGKILLed), so no Delete is ever sent and only the agent's
//! next snapshot tells the operator. The operator's node TTL is long, so nothing
//! else (a silent node's view dropped) can remove the pod's entries.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    net::{IpAddr, SocketAddr, SocketAddrV4, TcpStream},
    path::PathBuf,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use census_agent::{
    admin::api::{EndpointState, EndpointsResponse, ServiceCounts},
    bpf::{Inspector, identity},
};
use census_netlab::{
    ChildGuard, Cluster, Pod, Side, UPLINK, kube_proxy, udp_echo, udp_echo_through,
};
use census_proto::{
    PROTOCOL_VERSION,
    pb::{self, identity_service_client::IdentityServiceClient},
};
use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};

use crate::{
    e2e::harness::{LabCerts, SendResult, binaries, endpoint_entry, pod_labels},
    support::{
        Fallible, PinDir, TestResult, attach_mode_arg, bpftool, bytes, frame_len, path_str, u32_at,
    },
};

const NODE_A: &str = "node-a";
const NODE_B: &str = "node-b";
/// In node A's namespace; node B reaches it on A's uplink address.
const OPERATOR_PORT: u16 = 9460;
/// In each node's namespace.
const ADMIN_PORT: u16 = 9462;
/// The operator's snapshot interval, which the agents follow.
const SNAPSHOT_INTERVAL: Duration = Duration::from_secs(1);
/// Bounds a failure only.
const DEADLINE: Duration = Duration::from_secs(30);
const COUNT: usize = 25;
const PAYLOAD: usize = 100;

const LOCAL: u16 = 1 << 0;
const REMOTE: u16 = 1 << 1;
const HOST: u16 = 1 << 2;

const WEB: &[(&str, &str)] = &[("app", "web")];
const DB: &[(&str, &str)] = &[("app", "db")];
const GONE: &[(&str, &str)] = &[("app", "gone")];
const OLD: &[(&str, &str)] = &[("app", "old")];
const NEW: &[(&str, &str)] = &[("app", "new")];

/// One ENDPOINTS value, from its bytes (layout 4: identity u32, flags u16, node u16).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    identity: u32,
    flags: u16,
    node: u16,
}

impl Entry {
    const fn local(identity: u32) -> Self {
        Self {
            identity,
            flags: LOCAL,
            node: 0,
        }
    }

    const fn remote(identity: u32, node: u16) -> Self {
        Self {
            identity,
            flags: REMOTE,
            node,
        }
    }
}

/// One NODES value, from its bytes: name, addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
struct NodeEntry {
    name: String,
    addresses: Vec<IpAddr>,
}

/// The lab: the cluster, both agents, the operator, their pins, files and logs.
/// Processes are killed first when it drops; logs are printed unless
/// [`TwoNodes::pass`] was reached.
struct TwoNodes {
    cluster: Cluster,
    pins: [PinDir; 2],
    agents: [Option<ChildGuard>; 2],
    operator: Option<ChildGuard>,
    dir: tempfile::TempDir,
    agent_bin: PathBuf,
    operator_bin: PathBuf,
    /// Node B reaches the operator over the lab's network: mutual TLS.
    certs: LabCerts,
    starts: u32,
    passed: bool,
    /// Added to the operator's command line.
    operator_args: Vec<String>,
    /// Added to each agent's command line.
    agent_args: Vec<String>,
}

fn at(side: Side) -> usize {
    match side {
        Side::A => 0,
        Side::B => 1,
    }
}

/// `side`'s uplink addresses (both families): what its certificate names as the
/// node's own.
fn uplink_ips(cluster: &Cluster, side: Side) -> [IpAddr; 2] {
    let node = cluster.node(side);
    [node.uplink_ip(false), node.uplink_ip(true)]
}

impl TwoNodes {
    fn new() -> Fallible<Self> {
        let (agent_bin, operator_bin) = binaries()?;
        let cluster = Cluster::new(NODE_A, NODE_B)?;
        let dir = tempfile::tempdir()?;
        let certs = LabCerts::generate(
            &operator_bin,
            dir.path().join("tls"),
            &[
                IpAddr::from([127, 0, 0, 1]),
                cluster.node(Side::A).uplink_ip(false),
            ],
            &[
                (NODE_A, &uplink_ips(&cluster, Side::A)),
                (NODE_B, &uplink_ips(&cluster, Side::B)),
            ],
        )?;
        Ok(Self {
            cluster,
            pins: [PinDir::new(), PinDir::new()],
            agents: [None, None],
            operator: None,
            dir,
            agent_bin,
            operator_bin,
            certs,
            starts: 0,
            passed: false,
            operator_args: Vec::new(),
            agent_args: Vec::new(),
        })
    }

    fn name(&self, side: Side) -> &str {
        self.cluster.node(side).name()
    }

    fn endpoints_file(&self, side: Side) -> PathBuf {
        self.dir.path().join(format!("{}.yaml", self.name(side)))
    }

    /// Writes `side`'s endpoints file, renamed into place.
    fn write_endpoints(&self, side: Side, text: &str) -> TestResult {
        let tmp = self.dir.path().join("endpoints.tmp");
        fs::write(&tmp, text)?;
        fs::rename(tmp, self.endpoints_file(side))?;
        Ok(())
    }

    fn log(&mut self, name: &str) -> Fallible<fs::File> {
        self.starts += 1;
        let path = self
            .dir
            .path()
            .join(format!("{:02}-{name}.log", self.starts));
        Ok(fs::File::create(path)?)
    }

    /// The operator's address as `side`'s agent reaches it.
    fn operator_url(&self, side: Side) -> String {
        match side {
            Side::A => format!("http://127.0.0.1:{OPERATOR_PORT}"),
            Side::B => format!(
                "http://{}:{OPERATOR_PORT}",
                self.cluster.node(Side::A).uplink_ip(false)
            ),
        }
    }

    /// Starts the operator in node A's namespace, listening on every address
    /// there, and waits until node B can connect to it.
    fn start_operator(&mut self) -> TestResult {
        let log = self.log("operator")?;
        let store = self.dir.path().join("census.redb");
        let interval = format!("{}ms", SNAPSHOT_INTERVAL.as_millis());
        let mut command = Command::new(&self.operator_bin);
        command
            .args(["--grpc-listen", &format!("0.0.0.0:{OPERATOR_PORT}")])
            .args(self.certs.operator_args())
            .args(["--admin-listen", "127.0.0.1:9461"])
            .arg("--store-path")
            .arg(&store)
            .args(["--snapshot-interval", &interval])
            // A silent node keeps its view: only snapshots remove its entries here.
            .args(["--node-ttl", "120s", "--adoption-window", "1s"])
            .args(["--grace-period", "2s", "--tick-interval", "100ms"])
            .args(&self.operator_args)
            .args(["--log", "info"])
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(log);
        self.operator = Some(self.cluster.node(Side::A).ns().spawn(&mut command)?);
        let addr = SocketAddr::new(self.cluster.node(Side::A).uplink_ip(false), OPERATOR_PORT);
        let b = self.cluster.node(Side::B).ns();
        wait_for("node B to reach the operator", || {
            Ok(b.run(|| TcpStream::connect(addr).is_ok())?)
        })
    }

    /// Starts `side`'s agent and waits until it is Ready.
    fn start_agent(&mut self, side: Side) -> TestResult {
        let name = self.name(side).to_owned();
        let log = self.log(&format!("agent-{name}"))?;
        let mut command = Command::new(&self.agent_bin);
        command
            .args(["--node-name", &name])
            .args(["--operator", &self.operator_url(side)])
            .args(self.certs.agent_args(&name))
            .arg("--pin-dir")
            .arg(self.pins[at(side)].path())
            .args(["--admin-listen", &format!("127.0.0.1:{ADMIN_PORT}")])
            .arg("--endpoints-file")
            .arg(self.endpoints_file(side))
            .args(["--attach-mode", attach_mode_arg()])
            .args([
                "--reconcile-interval",
                "500ms",
                "--reconnect-max-backoff",
                "1s",
            ])
            .args(&self.agent_args)
            .args(["--log", "info"])
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(log);
        self.agents[at(side)] = Some(self.cluster.node(side).ns().spawn(&mut command)?);
        wait_for(&format!("{name}'s agent to be Ready"), || {
            if let Some(agent) = self.agents[at(side)].as_mut()
                && let Some(status) = agent.child().try_wait()?
            {
                return Err(format!("{name}'s agent exited: {status}").into());
            }
            Ok(matches!(self.http_get(side, "/readyz"), Ok((200, _))))
        })
    }

    fn kill_agent(&mut self, side: Side) -> TestResult {
        sigkill(&mut self.agents[at(side)])
    }

    fn kill_operator(&mut self) -> TestResult {
        sigkill(&mut self.operator)
    }

    /// An HTTP/1.0 GET to `side`'s agent (its admin listener, on the node's
    /// loopback): (status, body).
    fn http_get(&self, side: Side, path: &str) -> Fallible<(u16, String)> {
        Ok(self.cluster.node(side).ns().http_get(ADMIN_PORT, path)?)
    }

    fn agent_endpoints(&self, side: Side) -> Fallible<EndpointsResponse> {
        let (status, body) = self.http_get(side, "/v1/endpoints")?;
        if status != 200 {
            return Err(format!("/v1/endpoints: {status}: {body}").into());
        }
        Ok(serde_json::from_str(&body)?)
    }

    /// Waits until `side`'s agent lists exactly `names`, every one programmed.
    fn wait_programmed(&self, side: Side, names: &[&str]) -> TestResult {
        let mut wanted = names.to_vec();
        wanted.sort_unstable();
        wait_for(&format!("{wanted:?} programmed on {side:?}"), || {
            let Ok(response) = self.agent_endpoints(side) else {
                return Ok(false);
            };
            let listed: Vec<&str> = response.endpoints.iter().map(|e| e.name.as_str()).collect();
            Ok(listed == wanted
                && response
                    .endpoints
                    .iter()
                    .all(|e| e.state == EndpointState::Programmed))
        })
    }

    /// The operator's identity of a pod in namespace `default` with these labels.
    fn lookup(&self, labels: &[(&str, &str)]) -> Fallible<u32> {
        let set = pod_labels(labels)?;
        let url = self.operator_url(Side::A);
        let tls = self.certs.reader_tls()?;
        let result = self.cluster.node(Side::A).ns().run(|| -> SendResult<u32> {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(async {
                let channel = census_agent::client::endpoint(&url, Some(&tls))?
                    .connect_timeout(Duration::from_secs(5))
                    .connect()
                    .await?;
                let identity = IdentityServiceClient::new(channel)
                    .lookup(pb::LookupRequest {
                        protocol_version: PROTOCOL_VERSION,
                        labels: set.to_strings(),
                    })
                    .await?
                    .into_inner();
                Ok(identity.id)
            })
        })?;
        result.map_err(|e| e.to_string().into())
    }

    /// `side`'s ENDPOINTS, per bpftool: address -> entry.
    fn endpoints(&self, side: Side) -> Fallible<BTreeMap<IpAddr, Entry>> {
        let path = self.pins[at(side)].join("ENDPOINTS");
        let dump = bpftool(None, &["map", "dump", "pinned", path_str(&path)?])?;
        let mut entries = BTreeMap::new();
        for entry in dump.as_array().into_iter().flatten() {
            let key = bytes(&entry["key"])?;
            let value = bytes(&entry["value"])?;
            if (key.len(), value.len()) != (20, 8) {
                return Err(format!("an ENDPOINTS entry of another layout: {entry}").into());
            }
            let ip = address(&key)?;
            entries.insert(
                ip,
                Entry {
                    identity: u32_at(&entry["value"], 0)?,
                    flags: u16::from_le_bytes([value[4], value[5]]),
                    node: u16::from_le_bytes([value[6], value[7]]),
                },
            );
        }
        Ok(entries)
    }

    /// `side`'s NODES, per bpftool: index -> node (layout 4: name_len u16,
    /// address_count u16, 256 bytes of name, 16 addresses of 20 bytes).
    /// The addresses of `side`'s node namespace the way its agent discovers them:
    /// every interface's, but loopback ones.
    fn node_addresses(&self, side: Side) -> Fallible<BTreeSet<IpAddr>> {
        let addresses = self.cluster.node(side).ns().run(|| {
            nix::ifaddrs::getifaddrs().map(|interfaces| {
                interfaces
                    .filter_map(|interface| {
                        let address = interface.address?;
                        let ip: IpAddr = match (address.as_sockaddr_in(), address.as_sockaddr_in6())
                        {
                            (Some(v4), _) => v4.ip().into(),
                            (_, Some(v6)) => v6.ip().into(),
                            _ => return None,
                        };
                        Some(ip).filter(|ip| !ip.is_loopback() && !ip.is_unspecified())
                    })
                    .collect::<BTreeSet<IpAddr>>()
            })
        })??;
        Ok(addresses)
    }

    /// Waits until `side`'s map flags exactly its node's current addresses HOST:
    /// the agent re-reads them on its full pass, so an interface that came up
    /// since (a new pod's host side, its link-local address) shows there later.
    fn wait_host_addresses(&self, side: Side) -> TestResult {
        let addresses = self.node_addresses(side)?;
        wait_until(
            &format!("node {side:?}'s map to flag its node's addresses {addresses:?} HOST"),
            || self.endpoints(side),
            |map| {
                map.iter()
                    .filter(|(_, entry)| entry.flags & HOST != 0)
                    .map(|(ip, _)| *ip)
                    .eq(addresses.iter().copied())
            },
        )
        .map(drop)
    }

    fn nodes(&self, side: Side) -> Fallible<BTreeMap<u32, NodeEntry>> {
        let path = self.pins[at(side)].join("NODES");
        let dump = bpftool(None, &["map", "dump", "pinned", path_str(&path)?])?;
        let mut nodes = BTreeMap::new();
        for entry in dump.as_array().into_iter().flatten() {
            let value = bytes(&entry["value"])?;
            let field = |offset: usize| -> Fallible<usize> {
                let word = value.get(offset..offset + 2).ok_or("short NODES value")?;
                Ok(usize::from(u16::from_le_bytes([word[0], word[1]])))
            };
            let (name_len, count) = (field(0)?, field(2)?);
            let name = value.get(4..4 + name_len).ok_or("NODES name too long")?;
            let addresses = (0..count)
                .map(|i| {
                    let at = 260 + 20 * i;
                    address(value.get(at..at + 20).ok_or("short NODES value")?)
                })
                .collect::<Fallible<_>>()?;
            nodes.insert(
                u32_at(&entry["key"], 0)?,
                NodeEntry {
                    name: String::from_utf8(name.to_vec())?,
                    addresses,
                },
            );
        }
        Ok(nodes)
    }

    /// Packets and bytes of one identity pair in `side`'s FLOWS.
    fn flow(&self, side: Side, src: u32, dst: u32) -> Fallible<(u64, u64)> {
        let maps = Inspector::open(self.pins[at(side)].path())?;
        Ok(maps
            .flows()?
            .into_iter()
            .find(|f| f.src_identity == src && f.dst_identity == dst)
            .map_or((0, 0), |f| (f.packets, f.bytes)))
    }

    /// The pairs' counters on both nodes: `[pair][node]`.
    fn counters(&self, pairs: &[(u32, u32)]) -> Fallible<Vec<[(u64, u64); 2]>> {
        pairs
            .iter()
            .map(|&(src, dst)| Ok([self.flow(Side::A, src, dst)?, self.flow(Side::B, src, dst)?]))
            .collect()
    }

    fn pass(mut self) {
        self.passed = true;
    }
}

impl Drop for TwoNodes {
    fn drop(&mut self) {
        // Processes first (their guards kill them), then the rest.
        self.agents = [None, None];
        self.operator.take();
        if !self.passed {
            print_logs(&self.dir);
        }
    }
}

/// The address of a 20-byte ENDPOINTS key (family u32, then 4 or 16 bytes).
fn address(key: &[u8]) -> Fallible<IpAddr> {
    let family = u32::from_le_bytes(key.get(..4).ok_or("short key")?.try_into()?);
    Ok(match family {
        4 => <[u8; 4]>::try_from(key.get(4..8).ok_or("short key")?)?.into(),
        6 => <[u8; 16]>::try_from(key.get(4..20).ok_or("short key")?)?.into(),
        other => return Err(format!("address family {other} in {key:?}").into()),
    })
}

fn sigkill(guard: &mut Option<ChildGuard>) -> TestResult {
    if let Some(mut guard) = guard.take() {
        kill(
            Pid::from_raw(i32::try_from(guard.child().id())?),
            Signal::SIGKILL,
        )?;
        guard.child().wait()?;
    }
    Ok(())
}

/// Polls `check` every 50 ms until it holds; fails after [`DEADLINE`].
pub(crate) fn wait_for(what: &str, mut check: impl FnMut() -> Fallible<bool>) -> TestResult {
    let deadline = Instant::now() + DEADLINE;
    loop {
        if check()? {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("timed out after {DEADLINE:?} waiting for {what}").into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Like [`wait_for`], with the last state seen in the failure.
pub(crate) fn wait_until<T: std::fmt::Debug>(
    what: &str,
    mut read: impl FnMut() -> Fallible<T>,
    mut done: impl FnMut(&T) -> bool,
) -> Fallible<T> {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let state = read()?;
        if done(&state) {
            return Ok(state);
        }
        if Instant::now() > deadline {
            return Err(format!(
                "timed out after {DEADLINE:?} waiting for {what}; last: {state:#?}"
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[expect(clippy::print_stdout, reason = "the lab's figures, for --nocapture")]
pub(crate) fn report(line: &str) {
    println!("two-node lab: {line}");
}

#[expect(clippy::print_stderr, reason = "a failed test's process logs")]
pub(crate) fn print_logs(dir: &tempfile::TempDir) {
    let Ok(entries) = fs::read_dir(dir.path()) else {
        return;
    };
    let mut logs: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .collect();
    logs.sort();
    for log in logs {
        let Ok(text) = fs::read_to_string(&log) else {
            continue;
        };
        let lines: Vec<&str> = text.lines().collect();
        let from = lines.len().saturating_sub(60);
        eprintln!(
            "---- {} (last {} lines) ----",
            log.display(),
            lines.len() - from
        );
        for line in &lines[from..] {
            eprintln!("{line}");
        }
    }
}

/// Both addresses of `pod`.
fn ips(pod: &Pod) -> [IpAddr; 2] {
    [pod.ip(false), pod.ip(true)]
}

/// One exchange each way between `a` and `b` (v4 and v6), waiting as long as
/// neighbour discovery takes: nothing in flight afterwards.
fn warm_up(a: &Pod, b: &Pod) -> TestResult {
    for v6 in [false, true] {
        let answered = udp_echo(
            &a.ns,
            a.ip(v6),
            &b.ns,
            b.ip(v6),
            1,
            0,
            Duration::from_secs(5),
        )?;
        if answered != 1 {
            return Err(format!("{} cannot reach {} (v6: {v6})", a.ip(v6), b.ip(v6)).into());
        }
    }
    Ok(())
}

/// `COUNT` request/reply exchanges from `client` to `server` (v4, then v6): the
/// sum over both nodes' FLOWS is exactly `COUNT` each way, with both
/// identities, and nothing is counted as `world`.
fn counted_once_across_nodes(
    lab: &TwoNodes,
    client: &Pod,
    server: &Pod,
    ids: (u32, u32),
) -> TestResult {
    for v6 in [false, true] {
        exchange_counted_once(lab, ids, v6, "exchanges", || {
            Ok(udp_echo(
                &client.ns,
                client.ip(v6),
                &server.ns,
                server.ip(v6),
                COUNT,
                PAYLOAD,
                Duration::from_secs(1),
            )?)
        })?;
    }
    Ok(())
}

/// Runs `exchange` (`COUNT` request/reply exchanges of `PAYLOAD` bytes between
/// the pods of identities `c` and `s`, IPv6 if `v6`) and checks the sum over both
/// nodes' FLOWS: exactly `COUNT` each way, as (c, s) and (s, c), and nothing
/// counted as `world`.
fn exchange_counted_once(
    lab: &TwoNodes,
    (c, s): (u32, u32),
    v6: bool,
    what: &str,
    exchange: impl FnOnce() -> Fallible<usize>,
) -> TestResult {
    let world = identity::WORLD;
    let pairs = [
        (c, s),
        (s, c),
        (c, world),
        (world, s),
        (s, world),
        (world, c),
    ];
    let before = lab.counters(&pairs)?;
    let answered = exchange()?;
    assert_eq!(answered, COUNT, "every request answered (v6: {v6})");
    let after = lab.counters(&pairs)?;
    let delta: Vec<[(u64, u64); 2]> = after
        .iter()
        .zip(&before)
        .map(|(after, before)| [0, 1].map(|n| (after[n].0 - before[n].0, after[n].1 - before[n].1)))
        .collect();
    let sum = |pair: usize| {
        let [a, b] = delta[pair];
        (a.0 + b.0, a.1 + b.1)
    };
    let bytes = COUNT as u64 * frame_len(PAYLOAD, v6);
    report(&format!(
        "{COUNT} {what} (v6: {v6}): ({c} -> {s}) A {:?} B {:?}; ({s} -> {c}) A {:?} B {:?}",
        delta[0][0], delta[0][1], delta[1][0], delta[1][1]
    ));
    assert_eq!(
        sum(0),
        (COUNT as u64, bytes),
        "requests counted once in the cluster, as ({c}, {s}) (v6: {v6}): {delta:?}"
    );
    assert_eq!(
        sum(1),
        (COUNT as u64, bytes),
        "replies counted once in the cluster, as ({s}, {c}) (v6: {v6}): {delta:?}"
    );
    for (pair, (src, dst)) in pairs.iter().enumerate().skip(2) {
        assert_eq!(
            sum(pair),
            (0, 0),
            "nothing counted as ({src}, {dst}): world (v6: {v6}): {delta:?}"
        );
    }
    Ok(())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn two_nodes_share_the_endpoint_map_and_count_each_packet_once() -> TestResult {
    let mut lab = TwoNodes::new()?;
    let web = lab.cluster.add_pod(Side::A)?;
    let gone = lab.cluster.add_pod(Side::A)?;
    let old = lab.cluster.add_pod(Side::A)?;
    let db = lab.cluster.add_pod(Side::B)?;
    let a_file = endpoint_entry("web", &web, WEB)
        + &endpoint_entry("gone", &gone, GONE)
        + &endpoint_entry("old", &old, OLD);
    lab.write_endpoints(Side::A, &a_file)?;
    lab.write_endpoints(Side::B, &endpoint_entry("db", &db, DB))?;

    // The lab itself: pods reach each other across the nodes; the operator is
    // reachable from both; both agents come up Ready, every pod programmed.
    warm_up(&web, &db)?;
    warm_up(&old, &db)?;
    lab.start_operator()?;
    let started = Instant::now();
    lab.start_agent(Side::A)?;
    lab.start_agent(Side::B)?;
    lab.wait_programmed(Side::A, &["gone", "old", "web"])?;
    lab.wait_programmed(Side::B, &["db"])?;
    report(&format!(
        "both agents Ready, every pod programmed, {:?} after they were started",
        started.elapsed()
    ));
    let (web_id, db_id) = (lab.lookup(WEB)?, lab.lookup(DB)?);
    let (gone_id, old_id) = (lab.lookup(GONE)?, lab.lookup(OLD)?);

    // Each node's map holds the other node's pods, REMOTE, naming that node; its
    // own pods stay LOCAL.
    let (b_map, b_nodes) = wait_until(
        "node B's map to hold node A's pods",
        || Ok((lab.endpoints(Side::B)?, lab.nodes(Side::B)?)),
        |(map, nodes)| {
            let node = map.get(&web.ip(false)).map_or(0, |e| e.node);
            nodes
                .get(&u32::from(node))
                .is_some_and(|n| n.name == NODE_A)
                && [(&web, web_id), (&gone, gone_id), (&old, old_id)]
                    .iter()
                    .flat_map(|(pod, id)| ips(pod).map(|ip| (ip, *id)))
                    .all(|(ip, id)| map.get(&ip) == Some(&Entry::remote(id, node)))
        },
    )?;
    report(&format!(
        "node A's pods in node B's map {:?} after the agents were started",
        started.elapsed()
    ));
    let a_index = b_map[&web.ip(false)].node;
    assert_ne!(a_index, 0);
    assert_eq!(b_nodes[&u32::from(a_index)].name, NODE_A, "{b_nodes:?}");
    for ip in ips(&db) {
        assert_eq!(b_map.get(&ip), Some(&Entry::local(db_id)), "{ip}");
    }
    let (a_map, a_nodes) = wait_until(
        "node A's map to hold node B's pod",
        || Ok((lab.endpoints(Side::A)?, lab.nodes(Side::A)?)),
        |(map, nodes)| {
            let node = map.get(&db.ip(false)).map_or(0, |e| e.node);
            nodes
                .get(&u32::from(node))
                .is_some_and(|n| n.name == NODE_B)
                && ips(&db)
                    .iter()
                    .all(|ip| map.get(ip) == Some(&Entry::remote(db_id, node)))
        },
    )?;
    let b_index = a_map[&db.ip(false)].node;
    for (pod, id) in [(&web, web_id), (&gone, gone_id), (&old, old_id)] {
        for ip in ips(pod) {
            assert_eq!(a_map.get(&ip), Some(&Entry::local(id)), "{ip} on A");
        }
    }
    report(&format!(
        "node indexes: A is {a_index} on B ({:?}), B is {b_index} on A ({:?})",
        b_nodes.get(&u32::from(a_index)),
        a_nodes.get(&u32::from(b_index))
    ));

    // Node A's agent dies as two of its pods are deleted: their delete events are
    // never sent. One pod's addresses are taken by a new pod on node B.
    lab.kill_agent(Side::A)?;
    let (gone_ips, old_ips) = (ips(&gone), (old.ipv4, old.ipv6));
    drop(gone);
    drop(old);
    lab.write_endpoints(Side::A, &endpoint_entry("web", &web, WEB))?;
    let new = lab.cluster.add_pod_at(Side::B, old_ips.0, old_ips.1)?;
    lab.write_endpoints(
        Side::B,
        &(endpoint_entry("db", &db, DB) + &endpoint_entry("new", &new, NEW)),
    )?;
    lab.wait_programmed(Side::B, &["db", "new"])?;
    let new_id = lab.lookup(NEW)?;
    assert_ne!(new_id, old_id);
    // On B the new pod is local at once, whatever the operator still says of A.
    wait_until(
        "the new pod local on node B",
        || lab.endpoints(Side::B),
        |map| {
            ips(&new)
                .iter()
                .all(|ip| map.get(ip) == Some(&Entry::local(new_id)))
        },
    )?;
    let b_map = lab.endpoints(Side::B)?;
    for ip in gone_ips {
        assert_eq!(
            b_map.get(&ip),
            Some(&Entry::remote(gone_id, a_index)),
            "the operator cannot know yet that {ip} is gone"
        );
    }

    // Node A's agent is back: its first snapshot is the truth.
    lab.start_agent(Side::A)?;
    let back = Instant::now();
    wait_until(
        "the deleted pod to leave node B's map",
        || lab.endpoints(Side::B),
        |map| gone_ips.iter().all(|ip| !map.contains_key(ip)),
    )?;
    report(&format!(
        "a pod deleted while its agent was down left node B's map {:?} after the agent \
         was Ready again (snapshot interval {SNAPSHOT_INTERVAL:?})",
        back.elapsed()
    ));
    lab.wait_programmed(Side::A, &["web"])?;
    let a_map = wait_until(
        "the reused addresses on node A as node B's new pod",
        || lab.endpoints(Side::A),
        |map| {
            ips(&new)
                .iter()
                .all(|ip| map.get(ip) == Some(&Entry::remote(new_id, b_index)))
        },
    )?;
    report(&format!(
        "the reused address reached node A's map {:?} after its agent was Ready again",
        back.elapsed()
    ));
    for ip in gone_ips {
        assert!(!a_map.contains_key(&ip), "{ip} left node A's map too");
    }
    let b_map = lab.endpoints(Side::B)?;
    for ip in ips(&new) {
        assert_eq!(b_map.get(&ip), Some(&Entry::local(new_id)), "{ip} on B");
    }
    assert_eq!(
        b_map.get(&web.ip(false)),
        Some(&Entry::remote(web_id, a_index))
    );

    // Traffic between the nodes: each packet once in the cluster, both identities.
    warm_up(&web, &db)?;
    counted_once_across_nodes(&lab, &web, &db, (web_id, db_id))?;
    counted_once_across_nodes(&lab, &db, &web, (db_id, web_id))?;

    // The operator goes away: both maps stay as they are (fail-static), and the
    // datapath keeps counting once. (Each map first catches up with its node's
    // own addresses, which change with the node's interfaces, not the operator.)
    for side in [Side::A, Side::B] {
        lab.wait_host_addresses(side)?;
    }
    let before = [
        (lab.endpoints(Side::A)?, lab.nodes(Side::A)?),
        (lab.endpoints(Side::B)?, lab.nodes(Side::B)?),
    ];
    lab.kill_operator()?;
    for side in [Side::A, Side::B] {
        wait_for(
            &format!("{side:?}'s agent to see the operator gone"),
            || Ok(!lab.agent_endpoints(side)?.operator.connected),
        )?;
    }
    // Several full passes and reconnection attempts later, nothing changed.
    std::thread::sleep(Duration::from_millis(2500));
    for (side, before) in [Side::A, Side::B].into_iter().zip(before) {
        assert_eq!(
            (lab.endpoints(side)?, lab.nodes(side)?),
            before,
            "{side:?}'s maps are intact without the operator"
        );
        assert_eq!(
            lab.http_get(side, "/readyz")?.0,
            200,
            "{side:?} stays Ready"
        );
    }
    counted_once_across_nodes(&lab, &web, &db, (web_id, db_id))?;

    // Node addresses are `remote-node`, on the other node's index.
    let a_uplink = lab.cluster.node(Side::A).uplink_ip(false);
    wait_until(
        "node A's address in node B's map as remote-node",
        || {
            lab.endpoints(Side::B)
                .map(|map| map.get(&a_uplink).copied())
        },
        |entry| *entry == Some(Entry::remote(identity::REMOTE_NODE, a_index)),
    )?;
    let b_nodes = lab.nodes(Side::B)?;
    assert!(
        b_nodes
            .get(&u32::from(a_index))
            .is_some_and(|node| node.name == NODE_A && node.addresses.contains(&a_uplink)),
        "node B's NODES names node A with its address {a_uplink}: {b_nodes:?}"
    );
    lab.pass();
    Ok(())
}

const CLIENT: &[(&str, &str)] = &[("app", "client")];
const BACKEND: &[(&str, &str)] = &[("app", "backend")];
/// The operator's `--service-cidr`: the lab's Service addresses.
const SERVICE_CIDR: &str = "198.19.96.0/24";
const SERVICE_PORT: u16 = 8053;
const TARGET_PORT: u16 = 5353;

/// Counting after NAT with real processes: the operator's `--service-cidr` reaches
/// both agents, which write it into SERVICES and attach the uplink program
/// (`--uplink`) and the socket program themselves; with kube-proxy's rules on both
/// nodes, `COUNT` exchanges from a pod on node A through a ClusterIP to its
/// backend on node B are counted (client, backend) once and (backend, client)
/// once over both nodes' FLOWS, nothing as `world`.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_service_request_to_another_node_is_counted_once_with_the_agents_own_service_set_and_uplinks()
-> TestResult {
    let mut lab = TwoNodes::new()?;
    lab.operator_args = vec!["--service-cidr".to_owned(), SERVICE_CIDR.to_owned()];
    lab.agent_args = vec!["--uplink".to_owned(), UPLINK.to_owned()];
    let client = lab.cluster.add_pod(Side::A)?;
    let backend = lab.cluster.add_pod(Side::B)?;
    lab.write_endpoints(Side::A, &endpoint_entry("client", &client, CLIENT))?;
    lab.write_endpoints(Side::B, &endpoint_entry("backend", &backend, BACKEND))?;
    let service = kube_proxy::Service {
        name: "svc".to_owned(),
        address: SocketAddrV4::new(kube_proxy::service_ip(1), SERVICE_PORT),
        protocol: kube_proxy::Protocol::Udp,
        endpoints: vec![SocketAddrV4::new(backend.ipv4, TARGET_PORT)],
        masquerade_all: false,
        node_port: None,
    };
    for side in [Side::A, Side::B] {
        let node = lab.cluster.node(side).ns();
        kube_proxy::install(node)?;
        kube_proxy::add(node, &service)?;
    }
    warm_up(&client, &backend)?;
    lab.start_operator()?;
    lab.start_agent(Side::A)?;
    lab.start_agent(Side::B)?;
    lab.wait_programmed(Side::A, &["client"])?;
    lab.wait_programmed(Side::B, &["backend"])?;
    let (client_id, backend_id) = (lab.lookup(CLIENT)?, lab.lookup(BACKEND)?);

    // Operator -> agent -> SERVICES on both nodes, and nothing of the agent's own
    // hooks missing (U on the uplink, S at the root cgroup).
    let one_range = ServiceCounts {
        cluster_ip_range: 1,
        load_balancer_ip: 0,
        external_ip: 0,
    };
    for side in [Side::A, Side::B] {
        let datapath = wait_until(
            &format!("{side:?}'s agent to hold the operator's Service range"),
            || Ok(lab.agent_endpoints(side)?.datapath),
            |datapath| {
                datapath.as_ref().is_some_and(|d| {
                    d.services.operator == Some(one_range)
                        && d.services.map == Some(one_range)
                        && d.missing_hooks.is_empty()
                })
            },
        )?;
        let path = lab.pins[at(side)].join("SERVICES");
        let dumped = bpftool(None, &["map", "dump", "pinned", path_str(&path)?])?;
        let entries = dumped.as_array().ok_or("not an array")?;
        assert_eq!(entries.len(), 1, "{side:?}: {dumped}");
        // prefix length (the family's 32 bits and the range's 24), IPv4, 198.19.96.0.
        let key = bytes(&entries[0]["key"])?;
        assert_eq!(
            (
                u32_at(&entries[0]["key"], 0)?,
                u32_at(&entries[0]["key"], 4)?
            ),
            (32 + 24, 4),
            "{side:?}: {dumped}"
        );
        assert_eq!(key.get(8..12), Some(&[198, 19, 96, 0][..]), "{dumped}");
        report(&format!("{side:?}: {datapath:?}"));
    }
    // Each node knows the other's pod (the endpoint map).
    wait_until(
        "each node's map to hold the other node's pod",
        || Ok((lab.endpoints(Side::A)?, lab.endpoints(Side::B)?)),
        |(a, b)| {
            a.get(&backend.ip(false))
                .is_some_and(|e| e.identity == backend_id && e.flags & REMOTE != 0)
                && b.get(&client.ip(false))
                    .is_some_and(|e| e.identity == client_id && e.flags & REMOTE != 0)
        },
    )?;

    exchange_counted_once(
        &lab,
        (client_id, backend_id),
        false,
        "exchanges through a ClusterIP",
        || {
            Ok(udp_echo_through(
                &client.ns,
                client.ip(false),
                SocketAddr::V4(service.address),
                &backend.ns,
                SocketAddr::new(backend.ip(false), TARGET_PORT),
                COUNT,
                PAYLOAD,
                Duration::from_secs(1),
            )?)
        },
    )?;
    lab.pass();
    Ok(())
}
