//! census on a real control plane, as in a cluster: a control plane started for the
//! run (census-cluster: etcd, kube-apiserver, the controllers, kwok playing
//! `kwok-0..`), `deploy/` applied, one `census-operator` in Kubernetes mode as the
//! first pod of its Deployment (a token of its ServiceAccount bound to that pod, the
//! Identity CRD as its store) and one `census-agent` per kwok node with the
//! Kubernetes pod source (tokens bound to its node's DaemonSet pod, for the API
//! server and for the operator), each in a network namespace of its own standing for
//! its node, reaching the API server and the operator through loopback forwarders.
//! Everything is stopped and removed when the world drops; the control plane too.

use std::{
    collections::BTreeSet,
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, anyhow, bail};
use census_cluster::ControlPlane;
use census_netlab::{ChildGuard, Forward, Netns};
use census_proto::labels::{LabelFilter, LabelLimits, LabelSet};
use serde::Serialize;
use tokio::time::{Instant, sleep};

use crate::{
    cmd,
    operator::{Binary, Launch, Operator},
    report::say,
    sample::{Metrics, Proc},
};

/// The operator's port as the agents reach it, on their node's loopback.
const OPERATOR_PORT: u16 = 9460;
const AGENT_ADMIN_PORT: u16 = 9462;
const OPERATOR_NS: &str = "census-system";
const AGENT_NS: &str = "census-agent";

/// The census binaries under test.
#[derive(Debug, Clone)]
pub(crate) struct Binaries {
    pub(crate) operator: Binary,
    pub(crate) agent: PathBuf,
}

/// A control plane stopped when dropped.
#[derive(Debug)]
pub(crate) struct Plane(pub(crate) ControlPlane);

impl Drop for Plane {
    fn drop(&mut self) {
        say(format!(
            "stopping the control plane at {}",
            self.0.dir().display()
        ));
        self.0.stop();
    }
}

impl Plane {
    /// A fresh control plane named `name` with `nodes` kwok nodes, `deploy/` applied,
    /// and kwok running census's pods.
    pub(crate) async fn up(name: &str, nodes: u32) -> anyhow::Result<Self> {
        let plane = Self::up_bare(name, nodes).await?;
        census_testkit::cluster::apply_deploy(&plane.0).map_err(|e| anyhow!("{e}"))?;
        let want = nodes as usize;
        poll("kwok runs census's pods", Duration::from_secs(120), || {
            let operators = plane.0.running_pods(OPERATOR_NS).ok()?;
            let agents = plane.0.running_pods(AGENT_NS).ok()?;
            (!operators.is_empty() && agents.len() == want).then_some(())
        })
        .await?;
        Ok(plane)
    }

    /// A fresh control plane with nothing of census applied.
    pub(crate) async fn up_bare(name: &str, nodes: u32) -> anyhow::Result<Self> {
        let root = cmd::workspace_root();
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .map(|t| if t.is_absolute() { t } else { root.join(t) })
            .unwrap_or_else(|| root.join("target"));
        let say_line = |line: &str| say(line);
        let plane = ControlPlane::up(
            &root,
            &target,
            &census_cluster::Options {
                name: name.to_owned(),
                nodes,
            },
            &say_line,
        )?;
        Ok(Self(plane))
    }

    /// The distinct identity label sets of the pods the agents hold: Running, with
    /// an IP, not host-network, on a kwok node; under `filter`, as the operator
    /// canonicalizes them.
    pub(crate) fn live_set(&self, filter: &LabelFilter) -> anyhow::Result<BTreeSet<String>> {
        let pods = self.0.kubectl_json(&["get", "pods", "-A"])?;
        let limits = LabelLimits::default();
        let mut sets = BTreeSet::new();
        for pod in pods["items"].as_array().into_iter().flatten() {
            let running = pod["status"]["phase"] == "Running";
            let ip = pod["status"]["podIP"]
                .as_str()
                .is_some_and(|s| !s.is_empty());
            let host = pod["spec"]["hostNetwork"].as_bool().unwrap_or(false);
            let on_kwok = pod["spec"]["nodeName"]
                .as_str()
                .is_some_and(|n| n.starts_with("kwok-"));
            if !(running && ip && !host && on_kwok) {
                continue;
            }
            let labels = pod["metadata"]["labels"]
                .as_object()
                .map(|m| {
                    m.iter()
                        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                        .collect()
                })
                .unwrap_or_default();
            let namespace = pod["metadata"]["namespace"].as_str().unwrap_or_default();
            let account = pod["spec"]["serviceAccountName"]
                .as_str()
                .unwrap_or("default");
            let set = LabelSet::for_pod(&labels, namespace, account, filter, &limits)
                .map_err(|e| anyhow!("{namespace} pod labels: {e}"))?;
            sets.insert(set.as_str().to_owned());
        }
        Ok(sets)
    }

    /// Identity objects by state: (bound, quarantined tombstones).
    pub(crate) fn identity_objects(&self) -> anyhow::Result<(u64, u64)> {
        let list = self.0.kubectl_json(&["get", "identities"])?;
        let (mut bound, mut quarantined) = (0, 0);
        for o in list["items"].as_array().into_iter().flatten() {
            if o["status"]["state"] == "Quarantined" {
                quarantined += 1;
            } else {
                bound += 1;
            }
        }
        Ok((bound, quarantined))
    }

    /// A namespace of the workload's, created now.
    pub(crate) fn namespace(&self, name: &str) -> anyhow::Result<()> {
        self.0.apply(&serde_json::json!({
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name},
        }))?;
        let plane = &self.0;
        // The ServiceAccount controller makes `default`; pods need it.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while plane
            .kubectl_ok(&["-n", name, "get", "serviceaccount", "default"])
            .is_err()
        {
            if std::time::Instant::now() > deadline {
                bail!("namespace {name} got no default ServiceAccount");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok(())
    }
}

/// How census is run for one phase.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct CensusFlags {
    /// The operator's own flags (timers, label filter), on top of the in-cluster ones.
    pub(crate) operator: Vec<String>,
    /// The agents drop every endpoint delete (the test-only switch
    /// `--test-drop-endpoint-deletes`): the operator learns of an end from the next
    /// snapshot only.
    pub(crate) drop_deletes: bool,
    /// Agents on the first this many nodes (`None`: every node); a node without one
    /// is "no census node".
    pub(crate) agent_nodes: Option<usize>,
    /// Heap profiling in the operator, one sample per 2^this bytes (`None`: off).
    pub(crate) heap_sample_lg: Option<u32>,
}

/// One agent: its node's namespace, forwarders, process and pins.
struct Agent {
    node: String,
    ns: Netns,
    child: Option<ChildGuard>,
    /// To the API server (counting what the agent receives), and to the operator.
    api: Forward,
    _operator: Forward,
    pins: PathBuf,
    agent_bin: PathBuf,
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.child = None;
        // The agent's own uninstall detaches what it attached (the cgroup program
        // included) and removes its pins.
        let _ = Command::new(&self.agent_bin)
            .arg("uninstall")
            .arg("--pin-dir")
            .arg(&self.pins)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.pins);
    }
}

/// census running on the plane: one operator, one agent per node.
pub(crate) struct Census {
    pub(crate) operator: Operator,
    /// The operator's way to the API server, counting what it receives.
    operator_api: Forward,
    agents: Vec<Agent>,
    certs: census_testkit::tls::Certs,
    dir: tempfile::TempDir,
}

/// One reading of a process.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub(crate) struct Reading {
    pub(crate) rss_bytes: u64,
    pub(crate) heap_live_bytes: u64,
}

impl Census {
    pub(crate) async fn start(
        plane: &Plane,
        bins: &Binaries,
        flags: &CensusFlags,
        logs: &Path,
        tag: &str,
    ) -> anyhow::Result<Self> {
        let p = &plane.0;
        let dir = tempfile::tempdir()?;
        let certs = census_testkit::tls::Certs::generate(&[], &[]).map_err(|e| anyhow!("{e}"))?;
        let operators = p.running_pods(OPERATOR_NS)?;
        let pod = operators.first().context("no operator pod")?;
        let token = p.token(OPERATOR_NS, "census-operator", None, Some(&pod.name), 3600)?;
        let api_port: u16 = p
            .server()
            .rsplit(':')
            .next()
            .and_then(|s| s.parse().ok())
            .context("the API server's URL has no port")?;
        let api_addr = SocketAddr::from((Ipv4Addr::LOCALHOST, api_port));
        // The operator reaches the API server through a counting forwarder too (the
        // API server's certificate names 127.0.0.1, whatever the port).
        let operator_api = Forward::start_here(Forward::to(api_addr))?;
        let kubeconfig = dir.path().join("operator.kubeconfig");
        std::fs::write(
            &kubeconfig,
            census_cluster::token_kubeconfig(
                &p.dir().join("pki"),
                &format!("https://{}", operator_api.addr()),
                &token,
            ),
        )?;
        let args = operator_args(pod, &kubeconfig, &certs, flags)?;
        let mut launch = Launch::new(dir.path(), logs.join(format!("operator-{tag}.log")), args)?;
        if let Some(lg) = flags.heap_sample_lg {
            // One heap sample per 2^lg bytes allocated (census's jemalloc default is
            // 2^19): fine enough to name the owners of a few hundred KiB.
            launch.env.push((
                "_RJEM_MALLOC_CONF".to_owned(),
                format!("lg_prof_sample:{lg}"),
            ));
            launch.args.push("--heap-profiling".to_owned());
        }
        let operator = Operator::start(&bins.operator, launch).await?;
        let holder = pod.name.clone();
        poll("the operator to lead", Duration::from_secs(60), || {
            let lease = p
                .kubectl_json(&["-n", OPERATOR_NS, "get", "lease", "census-operator"])
                .ok()?;
            (lease["spec"]["holderIdentity"] == holder.as_str()).then_some(())
        })
        .await?;

        let setup = AgentSetup {
            plane: p,
            bins,
            certs: &certs,
            dir: dir.path(),
            logs,
            tag,
            api_port,
            api_addr,
            grpc: operator.launch.grpc,
            drop_deletes: flags.drop_deletes,
        };
        let agent_pods = p.running_pods(AGENT_NS)?;
        let mut agents = Vec::new();
        let with_agents = flags.agent_nodes.unwrap_or(p.nodes().len());
        for node in p.nodes().iter().take(with_agents) {
            let pod = agent_pods
                .iter()
                .find(|a| a.node == node.name)
                .with_context(|| format!("no agent pod on {}", node.name))?;
            agents.push(setup.start(&node.name, &pod.name)?);
        }
        let census = Self {
            operator,
            operator_api,
            agents,
            certs,
            dir,
        };
        census.agents_ready().await?;
        Ok(census)
    }

    /// Waits (up to 60 s each) for every agent to answer Ready.
    async fn agents_ready(&self) -> anyhow::Result<()> {
        for agent in &self.agents {
            let ns = &agent.ns;
            poll(
                &format!("{}'s agent to be Ready", agent.node),
                Duration::from_secs(60),
                || matches!(ns.http_get(AGENT_ADMIN_PORT, "/readyz"), Ok((200, _))).then_some(()),
            )
            .await?;
        }
        Ok(())
    }

    /// Bytes received from the API server so far: the operator's, each agent's.
    pub(crate) fn api_bytes(&self) -> (u64, Vec<u64>) {
        (
            self.operator_api.received(),
            self.agents.iter().map(|a| a.api.received()).collect(),
        )
    }

    /// The flags `census` (the CLI) reads from the operator with, as it would in the
    /// first node's agent pod: the operator's address and CA, and that agent's token.
    pub(crate) fn cli_flags(&self) -> anyhow::Result<Vec<std::ffi::OsString>> {
        let agent = self.agents.first().context("no agent")?;
        Ok(vec![
            "--operator".into(),
            self.operator.grpc_url().into(),
            "--tls-ca".into(),
            self.certs.dir().join("ca.pem").into(),
            "--token-file".into(),
            token_file(self.dir.path(), &agent.node).into(),
        ])
    }

    pub(crate) fn agent_nodes(&self) -> Vec<String> {
        self.agents.iter().map(|a| a.node.clone()).collect()
    }

    /// Each agent's node and pin directory, in node order.
    /// Each agent's node, pins and network namespace, in the agents' order.
    pub(crate) fn probe_nodes(&self) -> Vec<super::ready::Node> {
        self.agents
            .iter()
            .map(|a| super::ready::Node {
                name: a.node.clone(),
                pins: a.pins.clone(),
                netns: a.ns.name().to_owned(),
            })
            .collect()
    }

    pub(crate) async fn operator_metrics(&self) -> anyhow::Result<Metrics> {
        Metrics::scrape(self.operator.admin()).await
    }

    /// The operator's RSS and live heap now.
    pub(crate) async fn operator_reading(&self) -> anyhow::Result<Reading> {
        let rss = Proc::read(self.operator.pid)?.rss;
        let heap = self.operator_metrics().await?.heap().unwrap_or(0);
        Ok(Reading {
            rss_bytes: rss,
            heap_live_bytes: heap,
        })
    }

    /// Each agent's RSS and live heap now, in node order.
    pub(crate) fn agent_readings(&mut self) -> anyhow::Result<Vec<Reading>> {
        let (mut out, mut pids) = (Vec::new(), Vec::new());
        for agent in &mut self.agents {
            let child = agent.child.as_mut().context("agent stopped")?;
            if let Some(status) = child.child().try_wait()? {
                bail!("{}'s agent exited: {status}", agent.node);
            }
            pids.push(child.child().id());
        }
        let metrics = self.agent_metrics()?;
        for (pid, m) in pids.into_iter().zip(metrics) {
            out.push(Reading {
                rss_bytes: Proc::read(pid)?.rss,
                heap_live_bytes: m.heap().unwrap_or(0),
            });
        }
        Ok(out)
    }

    /// Each agent's `/metrics`, in node order.
    pub(crate) fn agent_metrics(&self) -> anyhow::Result<Vec<Metrics>> {
        self.agents
            .iter()
            .map(|agent| {
                let (status, body) = agent
                    .ns
                    .http_get(AGENT_ADMIN_PORT, "/metrics")
                    .map_err(|e| anyhow!("{}'s agent /metrics: {e}", agent.node))?;
                if status != 200 {
                    bail!("{}'s agent /metrics answered {status}", agent.node);
                }
                Ok(Metrics::parse(&body))
            })
            .collect()
    }

    pub(crate) async fn stop(self) -> anyhow::Result<()> {
        let Self {
            operator, agents, ..
        } = self;
        drop(agents);
        operator.stop().await
    }
}

/// The operator's flags in Kubernetes mode, as the first pod of its Deployment, with
/// its TLS and the phase's own flags.
fn operator_args(
    pod: &census_cluster::RunningPod,
    kubeconfig: &Path,
    certs: &census_testkit::tls::Certs,
    flags: &CensusFlags,
) -> anyhow::Result<Vec<String>> {
    let mut args = in_cluster_flags(
        OPERATOR_NS,
        &pod.name,
        &pod.ip.to_string(),
        kubeconfig,
        certs,
    )?;
    args.extend(flags.operator.iter().cloned());
    Ok(args)
}

/// The operator's flags for Kubernetes mode as pod `pod_name` (address `pod_ip`) of
/// `namespace`, reaching the API server with `kubeconfig`, serving gRPC with the TLS
/// of `certs`; logging at info.
pub(crate) fn in_cluster_flags(
    namespace: &str,
    pod_name: &str,
    pod_ip: &str,
    kubeconfig: &Path,
    certs: &census_testkit::tls::Certs,
) -> anyhow::Result<Vec<String>> {
    let mut args: Vec<String> = [
        "--store",
        "kubernetes",
        "--namespace",
        namespace,
        "--pod-name",
        pod_name,
        "--pod-ip",
        pod_ip,
        "--kubeconfig",
        &kubeconfig.display().to_string(),
        "--log",
        "info",
    ]
    .map(String::from)
    .to_vec();
    // The server's certificate and key: TLS without client certificates (the agents
    // present tokens).
    args.extend(
        certs
            .operator_flags()
            .map_err(|e| anyhow!("{e}"))?
            .into_iter()
            .take(4),
    );
    Ok(args)
}

/// What every agent of one census starts with.
struct AgentSetup<'a> {
    plane: &'a ControlPlane,
    bins: &'a Binaries,
    certs: &'a census_testkit::tls::Certs,
    /// Where the agents' token files go.
    dir: &'a Path,
    logs: &'a Path,
    tag: &'a str,
    api_port: u16,
    api_addr: SocketAddr,
    /// The operator's gRPC address.
    grpc: SocketAddr,
    drop_deletes: bool,
}

impl AgentSetup<'_> {
    /// The agent of `node` (its DaemonSet pod `pod`) in a network namespace of its
    /// own, with its forwarders, tokens and pins.
    fn start(&self, node: &str, pod: &str) -> anyhow::Result<Agent> {
        let (p, tag) = (self.plane, self.tag);
        let ns = Netns::create_with_prefix("seeds", node)?;
        let api = Forward::start(&ns, self.api_port, Forward::to(self.api_addr))?;
        let to_operator = Forward::start(&ns, OPERATOR_PORT, Forward::to(self.grpc))?;
        let api_token = p.token(AGENT_NS, "census-agent", None, Some(pod), 3600)?;
        let kubeconfig =
            p.write_token_kubeconfig(&format!("seeds-agent-{tag}-{node}"), &api_token)?;
        let census_token = p.token(AGENT_NS, "census-agent", Some("census"), Some(pod), 3600)?;
        let token_file = token_file(self.dir, node);
        std::fs::write(&token_file, census_token)?;
        let pins = PathBuf::from("/sys/fs/bpf")
            .join(format!("seeds-{}-{tag}-{node}", std::process::id(),));
        let log = std::fs::File::create(self.logs.join(format!("agent-{tag}-{node}.log")))?;
        let mut command = Command::new(&self.bins.agent);
        command
            .args(["--node-name", node])
            .args(["--endpoint-source", "kubernetes"])
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .args(["--operator", &format!("http://127.0.0.1:{OPERATOR_PORT}")])
            .arg("--tls-ca")
            .arg(self.certs.dir().join("ca.pem"))
            .arg("--token-file")
            .arg(&token_file)
            .arg("--pin-dir")
            .arg(&pins)
            .args(["--admin-listen", &format!("127.0.0.1:{AGENT_ADMIN_PORT}")])
            .args(["--log", "info"])
            .env("NO_COLOR", "1")
            .env_remove("CENSUS_HEAP_PROFILING")
            .stdout(Stdio::null())
            .stderr(log);
        if self.drop_deletes {
            command.env("CENSUS_TEST_DROP_ENDPOINT_DELETES", "true");
        }
        let child = ns.spawn(&mut command)?;
        Ok(Agent {
            node: node.to_owned(),
            ns,
            child: Some(child),
            api,
            _operator: to_operator,
            pins,
            agent_bin: self.bins.agent.clone(),
        })
    }
}

/// Where the token an agent presents to the operator is written.
fn token_file(dir: &Path, node: &str) -> PathBuf {
    dir.join(format!("{node}.token"))
}

/// Polls `f` every 200 ms until it answers, for at most `limit`.
pub(crate) async fn poll<T>(
    what: &str,
    limit: Duration,
    mut f: impl FnMut() -> Option<T>,
) -> anyhow::Result<T> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("timed out after {limit:?} waiting for {what}");
        }
        sleep(Duration::from_millis(200)).await;
    }
}
