//! A real agent reaches the operator through a masquerading path, as in clusters
//! where kube-proxy's masquerading, IPVS or an overlay network source the agent's
//! traffic from another address than its Node's: the operator binds the caller to
//! its node by its certificate (mutual TLS), never by its source address.
//!
//! Topology (`census_netlab::Masquerade`):
//!
//! ```text
//! pods ── node (agent) 198.19.1.2 ── router ── 198.19.2.2 operator
//!                                     MASQUERADE out of the operator's link:
//!                                     the operator sees 198.19.2.1
//! ```
//!
//! The operator's namespace has no route back to the agent's: the connection
//! works only because the router translates it. The operator's view of the peer
//! is read from its log ("agent connected ... peer"), the masquerade's work from
//! the rule's counter, and the agent's ENDPOINTS map with bpftool, from its bytes.

use std::{
    collections::BTreeMap,
    fs,
    net::{IpAddr, SocketAddr, TcpStream},
    path::PathBuf,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use census_agent::{
    admin::api::EndpointsResponse,
    client::{TlsFiles, endpoint},
};
use census_netlab::{ChildGuard, Lab, Masquerade, Netns, Pod};
use census_proto::{
    PROTOCOL_VERSION,
    pb::{
        self, agent_message::Body, endpoint_sync_client::EndpointSyncClient,
        identity_service_client::IdentityServiceClient, node_service_client::NodeServiceClient,
    },
};
use tonic::{Code, transport::Channel};

use crate::{
    e2e::harness::{LabCerts, SendResult, binaries, endpoint_entry, pod_labels, wait_for},
    support::{Fallible, PinDir, TestResult, attach_mode_arg, bpftool, bytes, path_str, u32_at},
};

const NODE_A: &str = "node-a";
/// Another node of the cluster: its certificate is valid, for node-b only.
const NODE_B: &str = "node-b";
/// On the operator's address in its namespace.
const OPERATOR_PORT: u16 = 9460;
/// On the agent's node's loopback.
const ADMIN_PORT: u16 = 9462;
/// Bounds a failure only.
const DEADLINE: Duration = Duration::from_secs(30);
/// ENDPOINTS flags (layout 4): the pod is on this node.
const LOCAL: u16 = 1 << 0;

const WEB: &[(&str, &str)] = &[("app", "web")];
const DB: &[(&str, &str)] = &[("app", "db")];

/// The agent's node with its pods, the operator's namespace, the masquerading
/// router between them, both processes, their pins, certificates and logs.
/// Processes are killed first when it drops, then every namespace is deleted;
/// logs are printed unless [`SnatLab::pass`] was reached.
struct SnatLab {
    agent: Option<ChildGuard>,
    operator: Option<ChildGuard>,
    nat: Masquerade,
    operator_ns: Netns,
    lab: Lab,
    pins: PinDir,
    certs: LabCerts,
    dir: tempfile::TempDir,
    agent_bin: PathBuf,
    operator_bin: PathBuf,
    passed: bool,
}

impl SnatLab {
    fn new() -> Fallible<Self> {
        let (agent_bin, operator_bin) = binaries()?;
        let lab = Lab::new()?;
        let operator_ns = Netns::create("operator")?;
        let nat = Masquerade::new(lab.node(), &operator_ns)?;
        let dir = tempfile::tempdir()?;
        let certs = LabCerts::generate(
            &operator_bin,
            dir.path().join("tls"),
            &[Masquerade::OUTSIDE_IP.into()],
            &[(NODE_A, &[]), (NODE_B, &[])],
        )?;
        Ok(Self {
            agent: None,
            operator: None,
            nat,
            operator_ns,
            lab,
            pins: PinDir::new(),
            certs,
            dir,
            agent_bin,
            operator_bin,
            passed: false,
        })
    }

    fn operator_addr() -> SocketAddr {
        SocketAddr::new(Masquerade::OUTSIDE_IP.into(), OPERATOR_PORT)
    }

    fn operator_url() -> String {
        format!("http://{}", Self::operator_addr())
    }

    fn operator_log(&self) -> PathBuf {
        self.dir.path().join("operator.log")
    }

    fn endpoints_file(&self) -> PathBuf {
        self.dir.path().join("endpoints.yaml")
    }

    fn write_endpoints(&self, text: &str) -> TestResult {
        let tmp = self.dir.path().join("endpoints.tmp");
        fs::write(&tmp, text)?;
        fs::rename(tmp, self.endpoints_file())?;
        Ok(())
    }

    /// Starts the operator in its namespace, with mutual TLS, listening on its
    /// address there only, and waits until the agent's node reaches it (through
    /// the router).
    fn start_operator(&mut self) -> TestResult {
        let log = fs::File::create(self.operator_log())?;
        let mut command = Command::new(&self.operator_bin);
        command
            .args(["--grpc-listen", &Self::operator_addr().to_string()])
            .args(self.certs.operator_args())
            .args(["--admin-listen", "127.0.0.1:9461"])
            .arg("--store-path")
            .arg(self.dir.path().join("census.redb"))
            .args(["--snapshot-interval", "1s", "--grace-period", "2s"])
            .args(["--tick-interval", "100ms", "--log", "info"])
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(log);
        self.operator = Some(self.operator_ns.spawn(&mut command)?);
        let node = self.lab.node();
        wait_for(DEADLINE, "the agent's node to reach the operator", || {
            Ok(node.run(|| TcpStream::connect(Self::operator_addr()).is_ok())?)
        })
    }

    /// Starts the agent on its node and waits until it is Ready.
    fn start_agent(&mut self) -> TestResult {
        let log = fs::File::create(self.dir.path().join("agent.log"))?;
        let mut command = Command::new(&self.agent_bin);
        command
            .args(["--node-name", NODE_A])
            .args(["--operator", &Self::operator_url()])
            .args(self.certs.agent_args(NODE_A))
            .arg("--pin-dir")
            .arg(self.pins.path())
            .args(["--admin-listen", &format!("127.0.0.1:{ADMIN_PORT}")])
            .arg("--endpoints-file")
            .arg(self.endpoints_file())
            .args(["--attach-mode", attach_mode_arg()])
            .args([
                "--reconcile-interval",
                "500ms",
                "--reconnect-max-backoff",
                "1s",
            ])
            .args(["--log", "info"])
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(log);
        self.agent = Some(self.lab.node().spawn(&mut command)?);
        wait_for(DEADLINE, "the agent to be Ready", || {
            if let Some(agent) = self.agent.as_mut()
                && let Some(status) = agent.child().try_wait()?
            {
                return Err(format!("the agent exited: {status}").into());
            }
            Ok(matches!(
                self.lab.node().http_get(ADMIN_PORT, "/readyz"),
                Ok((200, _))
            ))
        })
    }

    fn agent_endpoints(&self) -> Fallible<EndpointsResponse> {
        let (status, body) = self.lab.node().http_get(ADMIN_PORT, "/v1/endpoints")?;
        if status != 200 {
            return Err(format!("/v1/endpoints: {status}: {body}").into());
        }
        Ok(serde_json::from_str(&body)?)
    }

    /// Runs `f` in `ns` with a channel to the operator, over mutual TLS with
    /// `tls`.
    fn grpc<T, F, Fut>(ns: &Netns, tls: tonic::transport::ClientTlsConfig, f: F) -> Fallible<T>
    where
        T: Send,
        F: FnOnce(Channel) -> Fut + Send,
        Fut: Future<Output = SendResult<T>>,
    {
        let result = ns.run(|| -> SendResult<T> {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(async {
                let channel = endpoint(&Self::operator_url(), Some(&tls))?
                    .connect_timeout(Duration::from_secs(5))
                    .connect()
                    .await?;
                f(channel).await
            })
        })?;
        result.map_err(|e| e.to_string().into())
    }

    /// A read of the test's own, from the operator's namespace (not translated),
    /// as the reader `lab`.
    fn read<T, F, Fut>(&self, f: F) -> Fallible<T>
    where
        T: Send,
        F: FnOnce(Channel) -> Fut + Send,
        Fut: Future<Output = SendResult<T>>,
    {
        Self::grpc(&self.operator_ns, self.certs.reader_tls()?, f)
    }

    /// The operator's identity of a pod in namespace `default` with these labels.
    fn lookup(&self, labels: &[(&str, &str)]) -> Fallible<u32> {
        let labels = pod_labels(labels)?.to_strings();
        self.read(|channel| async move {
            let identity = IdentityServiceClient::new(channel)
                .lookup(pb::LookupRequest {
                    protocol_version: PROTOCOL_VERSION,
                    labels,
                })
                .await?
                .into_inner();
            Ok(identity.id)
        })
    }

    /// The operator's view of node A.
    fn node(&self) -> Fallible<pb::Node> {
        self.read(|channel| async move {
            Ok(NodeServiceClient::new(channel)
                .get_node(pb::GetNodeRequest {
                    protocol_version: PROTOCOL_VERSION,
                    name: NODE_A.to_owned(),
                })
                .await?
                .into_inner())
        })
    }

    /// The peer address the operator logged when node A's agent connected
    /// (`agent connected ... peer=Some(<address>)` in the span of node A's stream).
    fn connected_peer(&self) -> Fallible<SocketAddr> {
        let mut peer = None;
        wait_for(DEADLINE, "the operator to log node A's agent", || {
            let log = fs::read_to_string(self.operator_log())?;
            peer = log
                .lines()
                .filter(|line| {
                    line.contains("agent connected") && line.contains(&format!("node={NODE_A}"))
                })
                .find_map(|line| {
                    let (_, rest) = line.split_once("peer=Some(")?;
                    rest.split_once(')')?.0.parse::<SocketAddr>().ok()
                });
            Ok(peer.is_some())
        })?;
        peer.ok_or_else(|| "no peer logged".into())
    }

    /// Opens EndpointSync from the agent's node (through the router) with
    /// `cert_node`'s certificate and says Hello as `node`, with the session that
    /// would lock out every later one: the operator's answer.
    fn hello_as(&self, cert_node: &str, node: &str) -> Fallible<Result<(), tonic::Status>> {
        // The files `cert_node`'s agent would be given.
        let args = self.certs.agent_args(cert_node);
        let flag = |name: &str| -> Fallible<PathBuf> {
            args.iter()
                .position(|arg| arg == name)
                .and_then(|at| args.get(at + 1))
                .map(PathBuf::from)
                .ok_or_else(|| format!("no {name} in {args:?}").into())
        };
        let tls = TlsFiles {
            ca: Some(flag("--tls-ca")?),
            cert: Some(flag("--tls-cert")?),
            key: Some(flag("--tls-key")?),
        }
        .config()?
        .ok_or("no TLS configuration")?;
        let hello = pb::AgentMessage {
            seq: 0,
            body: Some(Body::Hello(pb::Hello {
                protocol_version: PROTOCOL_VERSION,
                node: node.to_owned(),
                session: Some(pb::Session {
                    start_time_ns: u64::MAX,
                    nonce: 1,
                }),
                agent_version: "not an agent".to_owned(),
                addresses: Vec::new(),
            })),
        };
        Self::grpc(self.lab.node(), tls, |channel| async move {
            let answer = EndpointSyncClient::new(channel)
                .sync(tokio_stream::iter([hello]))
                .await;
            Ok(answer.map(drop))
        })
    }

    /// The agent's ENDPOINTS, per bpftool: address -> (identity, flags, node).
    fn endpoints(&self) -> Fallible<BTreeMap<IpAddr, (u32, u16, u16)>> {
        let path = self.pins.join("ENDPOINTS");
        let dump = bpftool(None, &["map", "dump", "pinned", path_str(&path)?])?;
        let mut entries = BTreeMap::new();
        for entry in dump.as_array().into_iter().flatten() {
            let key = bytes(&entry["key"])?;
            let value = bytes(&entry["value"])?;
            if (key.len(), value.len()) != (20, 8) {
                return Err(format!("an ENDPOINTS entry of another layout: {entry}").into());
            }
            // Key: family u32, then 4 or 16 bytes; value: identity u32, flags u16, node u16.
            let ip: IpAddr = match u32_at(&entry["key"], 0)? {
                4 => <[u8; 4]>::try_from(&key[4..8])?.into(),
                6 => <[u8; 16]>::try_from(&key[4..20])?.into(),
                family => return Err(format!("family {family} in {entry}").into()),
            };
            let half = |at: usize| u16::from_le_bytes([value[at], value[at + 1]]);
            entries.insert(ip, (u32_at(&entry["value"], 0)?, half(4), half(6)));
        }
        Ok(entries)
    }

    fn pass(mut self) {
        self.passed = true;
    }
}

impl Drop for SnatLab {
    fn drop(&mut self) {
        // Processes first (their guards kill them); the namespaces go with the fields.
        self.agent.take();
        self.operator.take();
        if !self.passed {
            print_logs(&self.dir);
        }
    }
}

#[expect(clippy::print_stderr, reason = "a failed test's process logs")]
fn print_logs(dir: &tempfile::TempDir) {
    for name in ["operator.log", "agent.log"] {
        let Ok(text) = fs::read_to_string(dir.path().join(name)) else {
            continue;
        };
        let lines: Vec<&str> = text.lines().collect();
        let from = lines.len().saturating_sub(60);
        eprintln!("---- {name} (last {} lines) ----", lines.len() - from);
        for line in &lines[from..] {
            eprintln!("{line}");
        }
    }
}

#[expect(clippy::print_stdout, reason = "the lab's figures, for --nocapture")]
fn report(line: &str) {
    println!("snat lab: {line}");
}

/// Both addresses of `pod`.
fn ips(pod: &Pod) -> [IpAddr; 2] {
    [pod.ip(false), pod.ip(true)]
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn an_agent_behind_a_masquerading_router_connects_and_only_its_node_speaks_for_it() -> TestResult {
    let started = Instant::now();
    let mut lab = SnatLab::new()?;
    let web = lab.lab.add_pod()?;
    let db = lab.lab.add_pod()?;
    lab.write_endpoints(&(endpoint_entry("web", &web, WEB) + &endpoint_entry("db", &db, DB)))?;
    assert_eq!(lab.nat.masqueraded()?, 0, "nothing translated yet");
    lab.start_operator()?;
    let before = lab.nat.masqueraded()?;
    assert!(
        before > 0,
        "the operator is reached only through the router"
    );

    lab.start_agent()?;
    wait_for(DEADLINE, "both pods programmed", || {
        let Ok(response) = lab.agent_endpoints() else {
            return Ok(false);
        };
        let programmed: Vec<&str> = response
            .endpoints
            .iter()
            .filter(|e| e.state == census_agent::admin::api::EndpointState::Programmed)
            .map(|e| e.name.as_str())
            .collect();
        Ok(response.operator.connected && programmed == ["db", "web"])
    })?;

    // The translation is real: the operator saw the router's address, not the
    // agent's, and the rule translated the agent's connection.
    let peer = lab.connected_peer()?;
    report(&format!(
        "the operator saw node A's agent as {peer} (the agent's address is {})",
        Masquerade::INSIDE_IP
    ));
    assert_eq!(peer.ip(), IpAddr::from(Masquerade::MASQUERADE_IP));
    assert_ne!(peer.ip(), IpAddr::from(Masquerade::INSIDE_IP));
    assert!(
        lab.nat.masqueraded()? > before,
        "the agent's connection went through the masquerade"
    );

    // The agent said Hello and synced: the operator holds node A's view, its pods
    // have identities, and its pinned ENDPOINTS map holds them.
    let node = lab.node()?;
    assert!(node.connected, "{node:?}");
    assert!(node.session.is_some(), "{node:?}");
    assert_eq!(node.endpoints, 2, "both pods in node A's view: {node:?}");
    let (web_id, db_id) = (lab.lookup(WEB)?, lab.lookup(DB)?);
    assert_ne!(web_id, db_id);
    let map = lab.endpoints()?;
    for (pod, id) in [(&web, web_id), (&db, db_id)] {
        for ip in ips(pod) {
            assert_eq!(map.get(&ip), Some(&(id, LOCAL, 0)), "{ip}: {map:?}");
        }
    }
    let agent = lab.agent_endpoints()?;
    for pod in &agent.endpoints {
        let expected = if pod.name == "web" { web_id } else { db_id };
        assert_eq!(pod.identity, Some(expected), "{pod:?}");
    }

    // Through the same path, node B's (valid) certificate cannot speak for node A,
    // not even with the session that would lock node A out: nothing changes.
    let refused = lab.hello_as(NODE_B, NODE_A)?;
    let status = refused
        .err()
        .ok_or("node B's certificate said Hello as node A")?;
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert!(
        status.message().contains(NODE_B) && status.message().contains(NODE_A),
        "{status:?}"
    );
    let after = lab.node()?;
    assert_eq!(
        (after.connected, after.session, after.endpoints),
        (true, node.session, 2),
        "node A's session and view are untouched"
    );
    assert!(lab.agent_endpoints()?.operator.connected);

    report(&format!("passed in {:?}", started.elapsed()));
    lab.pass();
    Ok(())
}
