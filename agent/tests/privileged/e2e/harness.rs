//! Real processes for the end-to-end suite: a census-operator and a census-agent
//! started inside a lab's node namespace, their logs, and clients that reach them
//! from inside that namespace.

use std::{
    fs,
    net::{SocketAddr, TcpStream},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use census_agent::admin::api::{EndpointState, EndpointsResponse};
use census_netlab::{ChildGuard, Lab, Pod, certs::Certs};
use census_proto::{
    PROTOCOL_VERSION,
    labels::{LabelFilter, LabelLimits, LabelSet},
    pb::{
        self, identity_service_client::IdentityServiceClient,
        node_service_client::NodeServiceClient,
    },
};
use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};

use crate::support::{Fallible, PinDir};

/// A result whose error can cross threads.
pub(crate) type SendResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Inside the node namespace: its own loopback, so every test can use these.
pub(crate) const OPERATOR_PORT: u16 = 9460;
pub(crate) const ADMIN_PORT: u16 = 9462;
pub(crate) const NODE: &str = "e2e-node";

/// The binaries under test: `CENSUS_AGENT_BIN` / `CENSUS_OPERATOR_BIN`, else the
/// ones cargo built beside this test (`cargo xtask test-privileged` builds both).
pub(crate) fn binaries() -> Fallible<(PathBuf, PathBuf)> {
    let agent = std::env::var_os("CENSUS_AGENT_BIN").map_or_else(
        || PathBuf::from(env!("CARGO_BIN_EXE_census-agent")),
        PathBuf::from,
    );
    let operator = std::env::var_os("CENSUS_OPERATOR_BIN")
        .map_or_else(|| agent.with_file_name("census-operator"), PathBuf::from);
    for binary in [&agent, &operator] {
        if !binary.is_file() {
            return Err(format!(
                "{} is missing: build it with `cargo build -p census-operator --bins` \
                 (cargo xtask test-privileged does)",
                binary.display()
            )
            .into());
        }
    }
    Ok((agent, operator))
}

/// Certificates for mutual TLS, written by `census-operator certs` into `dir`: the
/// CA, a serving certificate for `ips`, a client certificate per node of `nodes`
/// naming the node's addresses given beside it, and a reader's (`lab`) for the
/// test's own calls.
#[derive(Debug, Clone)]
pub(crate) struct LabCerts(Certs);

/// The reader certificate of the test's own calls.
const READER: &str = "lab";

impl LabCerts {
    pub(crate) fn generate(
        operator_bin: &Path,
        dir: PathBuf,
        ips: &[std::net::IpAddr],
        nodes: &[(&str, &[std::net::IpAddr])],
    ) -> Fallible<Self> {
        let names: Vec<&str> = nodes.iter().map(|(node, _)| *node).collect();
        let certs = Certs::generate(operator_bin, dir, ips, &names, &[READER])?;
        // A node's certificate names its own addresses: what its Hello may claim.
        for (node, addresses) in nodes.iter().filter(|(_, a)| !a.is_empty()) {
            certs.vouch(operator_bin, node, addresses)?;
        }
        Ok(Self(certs))
    }

    /// The operator's flags: its serving certificate, and the CA of its clients.
    pub(crate) fn operator_args(&self) -> Vec<std::ffi::OsString> {
        self.0.operator_args()
    }

    /// An agent's flags: the operator's CA, and its node's certificate.
    pub(crate) fn agent_args(&self, node: &str) -> Vec<std::ffi::OsString> {
        self.0.agent_args(node)
    }

    /// The TLS of the test's own calls: the reader's certificate.
    pub(crate) fn reader_tls(&self) -> Fallible<tonic::transport::ClientTlsConfig> {
        let (cert, key) = self.0.reader(READER);
        let files = census_agent::client::TlsFiles {
            ca: Some(self.0.ca()),
            cert: Some(cert),
            key: Some(key),
        };
        Ok(files.config()?.ok_or("no TLS configuration")?)
    }
}

/// One test's world: a lab, a pin directory, a temporary directory with the
/// endpoints file, the operator's store and both processes' logs. Logs are
/// printed when the test does not reach [`World::pass`].
pub(crate) struct World {
    pub(crate) lab: Lab,
    pub(crate) pins: PinDir,
    pub(crate) dir: tempfile::TempDir,
    pub(crate) operator: Option<ChildGuard>,
    pub(crate) agent: Option<ChildGuard>,
    /// The agent's `--reconcile-interval` (the full pass): short by default, so
    /// that tests of what the full pass repairs do not wait.
    pub(crate) reconcile_interval: &'static str,
    passed: bool,
    agent_bin: PathBuf,
    operator_bin: PathBuf,
    /// The agent and the operator speak mutual TLS, as in every lab.
    certs: LabCerts,
    starts: u32,
}

impl World {
    pub(crate) fn new() -> Fallible<Self> {
        let (agent_bin, operator_bin) = binaries()?;
        let dir = tempfile::tempdir()?;
        let certs = LabCerts::generate(
            &operator_bin,
            dir.path().join("tls"),
            &[std::net::IpAddr::from([127, 0, 0, 1])],
            &[(NODE, &[])],
        )?;
        Ok(Self {
            certs,
            lab: Lab::new()?,
            pins: PinDir::new(),
            dir,
            operator: None,
            agent: None,
            reconcile_interval: "500ms",
            passed: false,
            agent_bin,
            operator_bin,
            starts: 0,
        })
    }

    pub(crate) fn endpoints_file(&self) -> PathBuf {
        self.dir.path().join("endpoints.yaml")
    }

    /// Writes the endpoints file, renamed into place.
    pub(crate) fn write_endpoints(&self, text: &str) -> Fallible<()> {
        let tmp = self.dir.path().join("endpoints.tmp");
        fs::write(&tmp, text)?;
        fs::rename(tmp, self.endpoints_file())?;
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

    /// Starts the operator (on its store in the temporary directory) and waits
    /// until it accepts connections.
    pub(crate) fn start_operator(&mut self) -> Fallible<()> {
        let log = self.log("operator")?;
        let store = self.dir.path().join("census.redb");
        let mut command = Command::new(&self.operator_bin);
        command
            .args(["--grpc-listen", &format!("127.0.0.1:{OPERATOR_PORT}")])
            .args(self.certs.operator_args())
            .args(["--admin-listen", "127.0.0.1:9461"])
            .arg("--store-path")
            .arg(&store)
            .args(["--snapshot-interval", "1s", "--grace-period", "2s"])
            .args(["--tick-interval", "100ms", "--log", "info"])
            .stdout(Stdio::null())
            .stderr(log);
        self.operator = Some(self.lab.node().spawn(&mut command)?);
        let addr = SocketAddr::from(([127, 0, 0, 1], OPERATOR_PORT));
        wait_for(Duration::from_secs(20), "the operator to listen", || {
            Ok(self.lab.node().run(|| TcpStream::connect(addr).is_ok())?)
        })
    }

    /// Starts the agent and waits until it is Ready.
    pub(crate) fn start_agent(&mut self) -> Fallible<()> {
        let log = self.log("agent")?;
        let mut command = Command::new(&self.agent_bin);
        command
            .args(["--node-name", NODE])
            .args(["--operator", &format!("http://127.0.0.1:{OPERATOR_PORT}")])
            .args(self.certs.agent_args(NODE))
            .arg("--pin-dir")
            .arg(self.pins.path())
            .args(["--admin-listen", &format!("127.0.0.1:{ADMIN_PORT}")])
            .arg("--endpoints-file")
            .arg(self.endpoints_file())
            .args(["--attach-mode", crate::support::attach_mode_arg()])
            .args([
                "--reconcile-interval",
                self.reconcile_interval,
                "--reconnect-max-backoff",
                "1s",
            ])
            .args(["--log", "info,census_agent=debug"])
            .stdout(Stdio::null())
            .stderr(log);
        self.agent = Some(self.lab.node().spawn(&mut command)?);
        wait_for(Duration::from_secs(20), "the agent to be Ready", || {
            if let Some(agent) = self.agent.as_mut()
                && let Some(status) = agent.child().try_wait()?
            {
                return Err(format!("the agent exited: {status}").into());
            }
            Ok(matches!(self.http_get(ADMIN_PORT, "/readyz"), Ok((200, _))))
        })
    }

    /// Sends `signal` to a process and reaps it.
    pub(crate) fn stop(guard: &mut Option<ChildGuard>, signal: Signal) -> Fallible<()> {
        if let Some(mut guard) = guard.take() {
            let pid = i32::try_from(guard.child().id())?;
            kill(Pid::from_raw(pid), signal)?;
            let status = guard.child().wait()?;
            if signal == Signal::SIGTERM && !status.success() {
                return Err(format!("stopped with SIGTERM, exited {status}").into());
            }
        }
        Ok(())
    }

    pub(crate) fn kill_agent(&mut self) -> Fallible<()> {
        Self::stop(&mut self.agent, Signal::SIGKILL)
    }

    pub(crate) fn stop_agent(&mut self) -> Fallible<()> {
        Self::stop(&mut self.agent, Signal::SIGTERM)
    }

    pub(crate) fn stop_operator(&mut self) -> Fallible<()> {
        Self::stop(&mut self.operator, Signal::SIGTERM)
    }

    /// An HTTP/1.0 GET to `port` on the node's loopback: (status, body).
    pub(crate) fn http_get(&self, port: u16, path: &str) -> Fallible<(u16, String)> {
        Ok(self.lab.node().http_get(port, path)?)
    }

    pub(crate) fn endpoints(&self) -> Fallible<EndpointsResponse> {
        let (status, body) = self.http_get(ADMIN_PORT, "/v1/endpoints")?;
        if status != 200 {
            return Err(format!("/v1/endpoints: {status}: {body}").into());
        }
        Ok(serde_json::from_str(&body)?)
    }

    /// Waits until the agent lists exactly `names`, every one programmed.
    pub(crate) fn wait_programmed(&self, names: &[&str]) -> Fallible<EndpointsResponse> {
        let mut last = None;
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(response) = self.endpoints() {
                let listed: Vec<&str> =
                    response.endpoints.iter().map(|e| e.name.as_str()).collect();
                let mut wanted = names.to_vec();
                wanted.sort_unstable();
                if listed == wanted
                    && response
                        .endpoints
                        .iter()
                        .all(|e| e.state == EndpointState::Programmed)
                {
                    return Ok(response);
                }
                last = Some(response);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(
            format!("not every endpoint of {names:?} was programmed in time; last: {last:#?}")
                .into(),
        )
    }

    /// Runs `f` with a gRPC channel to the operator, from inside the node namespace.
    pub(crate) fn grpc<T, F, Fut>(&self, f: F) -> Fallible<T>
    where
        T: Send,
        F: FnOnce(tonic::transport::Channel) -> Fut + Send,
        Fut: Future<Output = SendResult<T>>,
    {
        let tls = self.certs.reader_tls()?;
        let result = self.lab.node().run(|| -> SendResult<T> {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(async {
                let channel = census_agent::client::endpoint(
                    &format!("http://127.0.0.1:{OPERATOR_PORT}"),
                    Some(&tls),
                )?
                .connect_timeout(Duration::from_secs(5))
                .connect()
                .await?;
                f(channel).await
            })
        })?;
        result.map_err(|e| e.to_string().into())
    }

    /// The operator's identity of a pod in namespace `default` with these labels.
    pub(crate) fn lookup(&self, labels: &[(&str, &str)]) -> Fallible<u32> {
        let set = pod_labels(labels)?;
        self.grpc(|channel| async move {
            let identity = IdentityServiceClient::new(channel)
                .lookup(pb::LookupRequest {
                    protocol_version: PROTOCOL_VERSION,
                    labels: set.to_strings(),
                })
                .await?
                .into_inner();
            Ok(identity.id)
        })
    }

    /// The operator's reference count of `id`.
    pub(crate) fn references(&self, id: u32) -> Fallible<u64> {
        self.grpc(|channel| async move {
            let identity = IdentityServiceClient::new(channel)
                .get(pb::GetRequest {
                    protocol_version: PROTOCOL_VERSION,
                    id,
                })
                .await?
                .into_inner();
            Ok(identity.references)
        })
    }

    /// The operator's view of the node.
    pub(crate) fn node(&self) -> Fallible<pb::Node> {
        self.grpc(|channel| async move {
            Ok(NodeServiceClient::new(channel)
                .get_node(pb::GetNodeRequest {
                    protocol_version: PROTOCOL_VERSION,
                    name: NODE.to_owned(),
                })
                .await?
                .into_inner())
        })
    }

    /// Marks the test passed: logs are not printed.
    pub(crate) fn pass(mut self) {
        self.passed = true;
    }

    fn print_logs(&self) {
        let Ok(entries) = fs::read_dir(self.dir.path()) else {
            return;
        };
        let mut logs: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "log"))
            .collect();
        logs.sort();
        for log in logs {
            print_tail(&log);
        }
    }
}

impl Drop for World {
    fn drop(&mut self) {
        // Processes first (their guards kill them), then the rest.
        self.agent.take();
        self.operator.take();
        if !self.passed {
            self.print_logs();
        }
    }
}

#[expect(clippy::print_stderr, reason = "a failed test's process logs")]
fn print_tail(path: &Path) {
    let Ok(text) = fs::read_to_string(path) else {
        return;
    };
    let lines: Vec<&str> = text.lines().collect();
    let from = lines.len().saturating_sub(80);
    eprintln!(
        "---- {} (last {} lines) ----",
        path.display(),
        lines.len() - from
    );
    for line in &lines[from..] {
        eprintln!("{line}");
    }
}

/// A pod's identity labels as the agent builds them (default filter).
pub(crate) fn pod_labels(labels: &[(&str, &str)]) -> Fallible<LabelSet> {
    let map = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    Ok(LabelSet::for_pod(
        &map,
        "default",
        "default",
        &LabelFilter::default(),
        &LabelLimits::default(),
    )?)
}

/// One YAML entry of the endpoints file for `pod`.
pub(crate) fn endpoint_entry(name: &str, pod: &Pod, labels: &[(&str, &str)]) -> String {
    let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}: {v}")).collect();
    format!(
        "- {{namespace: default, name: {name}, ips: [{}, '{}'], labels: {{{}}}, interface: {}}}\n",
        pod.ipv4,
        pod.ipv6,
        labels.join(", "),
        pod.host_interface
    )
}

/// Polls `check` every 100 ms until it holds, for at most `timeout`.
pub(crate) fn wait_for(
    timeout: Duration,
    what: &str,
    mut check: impl FnMut() -> Fallible<bool>,
) -> Fallible<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if check()? {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("timed out waiting for {what}").into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
