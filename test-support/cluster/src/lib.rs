//! A real Kubernetes control plane on loopback, for census's tests, benchmarks and
//! `cargo xtask cluster`: upstream etcd, kube-apiserver, kube-controller-manager,
//! kube-scheduler and kwok (which plays the nodes: Node heartbeats, pod IPs from the
//! node's podCIDR, Running pods, completed Job pods), built by [`go::build`] from the
//! pinning modules under `test-support/control-plane/`. Nothing of Kubernetes is
//! re-implemented; only the kubelet's container runtime is missing.
//!
//! A control plane lives in `<target>/cluster/<name>/`: its PKI, etcd's data, one log
//! per component, `state.json` (ports and pids), the admin `kubeconfig` and an `env`
//! file to source. Its processes are detached: they outlive the command that started
//! them until [`ControlPlane::down`], which stops exactly the pids it started (and
//! only while they still run the program it started).

pub mod go;
mod pki;
mod process;

use std::{
    net::{IpAddr, Ipv4Addr},
    path::{Path, PathBuf},
    process::{Command, ExitStatus, Output},
    time::Duration,
};

use serde_json::{Value, json};

pub use crate::{
    go::{Binaries, Program},
    pki::token_kubeconfig,
    process::{Component, listen_port},
};

/// Where progress goes (`println!` in xtask, the test's output in tests).
pub type Say<'a> = &'a dyn Fn(&str);

/// The Pod network, split by kube-controller-manager into one /24 per node (kwok
/// gives pods addresses from their node's): the benchmarking range, never routed,
/// and apart from the blocks the network-namespace lab uses (198.18.1-2.0/24, the
/// uplinks 198.19.0-1.0/24), so kwok's pods can be given namespaces there.
pub const CLUSTER_CIDR: &str = "198.18.128.0/17";
/// ClusterIPs; the API server's own is the first.
pub const SERVICE_CIDR: &str = "198.19.128.0/24";
/// The first node's InternalIP; node `i` has the `i`-th after it.
const FIRST_NODE_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 255, 1);
/// The label and annotation kwok's nodes carry (kwok manages the annotated ones).
pub const KWOK_NODE: (&str, &str) = ("kwok.x-k8s.io/node", "fake");

/// How long each component may take to become ready.
const READY_WITHIN: Duration = Duration::from_secs(90);

/// How many times etcd or kube-apiserver is started on newly picked ports when another
/// process took a port first.
const PORT_ATTEMPTS: u32 = 3;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "Go is not installed (running `go`: {source}); install Go 1.26 or newer \
         (Debian 12's golang is too old; see docs/testing.md)"
    )]
    GoMissing { source: std::io::Error },
    #[error(
        "Go {found} is older than the control plane's modules need (go {need}); install \
         Go {need} or newer"
    )]
    GoTooOld { found: String, need: String },
    #[error("{file}: {what}")]
    Pin { file: PathBuf, what: &'static str },
    #[error("cannot {what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot start {what}: {source}")]
    Spawn {
        what: &'static str,
        source: std::io::Error,
    },
    #[error("{what} failed ({status}){}", if detail.is_empty() { String::new() } else { format!(": {detail}") })]
    Failed {
        what: &'static str,
        status: ExitStatus,
        detail: String,
    },
    #[error("making the control plane's certificates: {0}")]
    Pki(rcgen::Error),
    #[error("{component} exited; the end of {}:\n{tail}", log.display())]
    Died {
        component: String,
        log: PathBuf,
        tail: String,
    },
    #[error("{component} was not ready ({what}) within {waited:?}; the end of {}:\n{tail}", log.display())]
    NotReady {
        component: String,
        what: &'static str,
        waited: Duration,
        log: PathBuf,
        tail: String,
    },
    #[error(
        "no control plane named {name} is running (start it with `cargo xtask cluster up --name {name}`)"
    )]
    NotRunning { name: String },
    #[error("the control plane has no component {name}")]
    NoComponent { name: String },
    #[error("etcd did not {what}")]
    Etcd { what: &'static str },
    #[error("{path}: not a control plane's state ({why})")]
    BadState { path: PathBuf, why: String },
}

/// The kubectl the control plane's pins build (built now if it is not), for tests
/// that use kubectl as an independent client.
pub fn kubectl(repo: &Path, target: &Path, say: Say<'_>) -> Result<PathBuf, Error> {
    Ok(go::build(repo, target, say)?.path(Program::Kubectl))
}

/// What `up` starts.
#[derive(Debug, Clone)]
pub struct Options {
    /// The directory under `<target>/cluster/`.
    pub name: String,
    /// kwok nodes, named `kwok-0`, `kwok-1`, ...
    pub nodes: u32,
}

/// A running control plane (started by [`ControlPlane::up`] or found again by
/// [`ControlPlane::find`]).
#[derive(Debug, Clone)]
pub struct ControlPlane {
    dir: PathBuf,
    server: String,
    kubectl: PathBuf,
    kubernetes: String,
    /// etcd's client URL (`http://127.0.0.1:<port>`).
    etcd: String,
    nodes: Vec<Node>,
    components: Vec<Component>,
}

/// A Running pod: its name, its node and its IP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunningPod {
    pub name: String,
    pub node: String,
    pub ip: IpAddr,
}

/// A kwok node: its name and InternalIP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    pub name: String,
    pub ip: IpAddr,
}

impl ControlPlane {
    fn dir_of(target: &Path, name: &str) -> PathBuf {
        target.join("cluster").join(name)
    }

    /// Builds what is missing, then starts a fresh control plane named
    /// `options.name`, stopping one of that name first, and waits until every
    /// component is ready and every node Ready.
    pub fn up(repo: &Path, target: &Path, options: &Options, say: Say<'_>) -> Result<Self, Error> {
        let binaries = go::build(repo, target, say)?;
        let dir = Self::dir_of(target, &options.name);
        if let Ok(Some(old)) = Self::find(target, &options.name) {
            say(&format!(
                "stopping the control plane already at {}",
                dir.display()
            ));
            old.stop();
        }
        for pid in process::stop_strays(&dir) {
            say(&format!(
                "stopped pid {pid}, a component of an earlier control plane at {}",
                dir.display()
            ));
        }
        let _ = std::fs::remove_dir_all(&dir);
        let pki_dir = dir.join("pki");
        pki::write_all(&pki_dir, IpAddr::from([198, 19, 128, 1]))?;
        let mut plane = Self {
            dir,
            server: String::new(),
            kubectl: binaries.path(Program::Kubectl),
            kubernetes: binaries.kubernetes.clone(),
            etcd: String::new(),
            nodes: (0..options.nodes)
                .map(|i| Node {
                    name: format!("kwok-{i}"),
                    ip: IpAddr::V4(Ipv4Addr::from(u32::from(FIRST_NODE_IP) + i)),
                })
                .collect(),
            components: Vec::new(),
        };
        let result = plane.start(&binaries, say);
        if let Err(e) = result {
            plane.stop();
            return Err(e);
        }
        Ok(plane)
    }

    fn start(&mut self, bin: &Binaries, say: Say<'_>) -> Result<(), Error> {
        let etcd_url = self.start_etcd(bin, say)?;
        self.start_apiserver(bin, &etcd_url, say)?;
        let kcm = self.start_controller_manager(bin)?;
        self.components.push(kcm.clone());
        let scheduler = self.start_scheduler(bin)?;
        self.components.push(scheduler.clone());
        let kwok = self.start_kwok(bin)?;
        self.components.push(kwok.clone());
        self.save()?;
        self.wait_leading(&kcm, &scheduler, bin, say)?;
        self.add_nodes(&kwok, bin, say)?;
        go::write(&self.dir.join("env"), &self.env())?;
        Ok(())
    }

    /// etcd on free ports, once it answers healthy; its client URL. Started again on
    /// new ports if another process took one first.
    fn start_etcd(&mut self, bin: &Binaries, say: Say<'_>) -> Result<String, Error> {
        self.on_free_ports(|plane| plane.start_etcd_once(bin, say))
    }

    /// Runs `start` (which starts one component, pushed last, on ports it picks) up to
    /// [`PORT_ATTEMPTS`] times while the component exits because a port it picked was
    /// taken before it bound it.
    fn on_free_ports<T>(
        &mut self,
        mut start: impl FnMut(&mut Self) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let mut attempt = 1;
        loop {
            match start(self) {
                Err(e) if process::port_taken(&e) && attempt < PORT_ATTEMPTS => {
                    if let Some(dead) = self.components.pop() {
                        dead.stop(Duration::from_secs(5));
                    }
                    attempt += 1;
                }
                result => return result,
            }
        }
    }

    fn start_etcd_once(&mut self, bin: &Binaries, say: Say<'_>) -> Result<String, Error> {
        let dir = self.dir.clone();
        // A start that failed on a taken port may have begun a data directory.
        let data = dir.join("etcd");
        if data.exists() {
            std::fs::remove_dir_all(&data).map_err(|source| Error::Io {
                what: "remove",
                path: data.clone(),
                source,
            })?;
        }
        let (client, peer) = (listen_port()?, listen_port()?);
        let etcd_url = format!("http://127.0.0.1:{client}");
        self.etcd.clone_from(&etcd_url);
        let peer_url = format!("http://127.0.0.1:{peer}");
        let etcd = Component::start(
            &dir,
            "etcd",
            &bin.path(Program::Etcd),
            &strings(&[
                "--name=census-test",
                &format!("--data-dir={}", data.display()),
                &format!("--listen-client-urls={etcd_url}"),
                &format!("--advertise-client-urls={etcd_url}"),
                &format!("--listen-peer-urls={peer_url}"),
                &format!("--initial-advertise-peer-urls={peer_url}"),
                &format!("--initial-cluster=census-test={peer_url}"),
                "--unsafe-no-fsync=true",
                "--quota-backend-bytes=8589934592",
                "--log-level=warn",
            ]),
        )?;
        self.components.push(etcd.clone());
        self.save()?;
        process::wait_ready(&etcd, "GET /health", READY_WITHIN, || {
            http_get(client, "/health").is_some_and(|body| body.contains("\"health\":\"true\""))
        })?;
        say(&format!("etcd {} ready on {etcd_url}", bin.etcd));
        Ok(etcd_url)
    }

    /// kube-apiserver on etcd, the components' and the admin's kubeconfigs, once it is
    /// ready. Started again on a new port if another process took it first.
    fn start_apiserver(
        &mut self,
        bin: &Binaries,
        etcd_url: &str,
        say: Say<'_>,
    ) -> Result<(), Error> {
        self.on_free_ports(|plane| plane.start_apiserver_once(bin, etcd_url, say))
    }

    fn start_apiserver_once(
        &mut self,
        bin: &Binaries,
        etcd_url: &str,
        say: Say<'_>,
    ) -> Result<(), Error> {
        let dir = self.dir.clone();
        let pki = dir.join("pki");
        let p = |f: &str| pki.join(f).display().to_string();
        let port = listen_port()?;
        self.server = format!("https://127.0.0.1:{port}");
        go::write(&dir.join("audit-policy.yaml"), AUDIT_POLICY)?;
        let apiserver = Component::start(
            &dir,
            "kube-apiserver",
            &bin.path(Program::KubeApiserver),
            &strings(&[
                &format!("--etcd-servers={etcd_url}"),
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                &format!("--secure-port={port}"),
                &format!("--tls-cert-file={}", p("apiserver.pem")),
                &format!("--tls-private-key-file={}", p("apiserver-key.pem")),
                &format!("--client-ca-file={}", p("ca.pem")),
                &format!("--service-account-key-file={}", p("sa.pem")),
                &format!("--service-account-signing-key-file={}", p("sa-key.pem")),
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                "--api-audiences=https://kubernetes.default.svc.cluster.local",
                &format!("--service-cluster-ip-range={SERVICE_CIDR}"),
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction,ServiceAccount,PodSecurity,ValidatingAdmissionPolicy",
                "--allow-privileged=true",
                "--endpoint-reconciler-type=lease",
                // Every request of the components' users and of ServiceAccounts, for
                // tests to assert on (verbs, resources, codes): the real server's
                // request log.
                &format!(
                    "--audit-policy-file={}",
                    self.dir.join("audit-policy.yaml").display()
                ),
                &format!("--audit-log-path={}", self.audit_log().display()),
                "--audit-log-format=json",
                "--profiling=false",
                "--v=1",
            ]),
        )?;
        self.components.push(apiserver.clone());
        self.save()?;
        for (client, _, _) in clients() {
            go::write(
                &dir.join(format!("{client}.kubeconfig")),
                &pki::cert_kubeconfig(&pki, &self.server, client),
            )?;
        }
        go::write(
            &self.kubeconfig(),
            &pki::cert_kubeconfig(&pki, &self.server, "admin"),
        )?;
        process::wait_ready(&apiserver, "GET /readyz", READY_WITHIN, || {
            self.kubectl_output(&["get", "--raw", "/readyz"])
                .is_ok_and(|o| o.status.success())
        })?;
        say(&format!(
            "kube-apiserver {} ready on {}",
            bin.kubernetes, self.server
        ));
        Ok(())
    }

    /// The path of component `c`'s kubeconfig.
    fn component_kubeconfig(&self, c: &str) -> String {
        self.dir
            .join(format!("{c}.kubeconfig"))
            .display()
            .to_string()
    }

    fn start_controller_manager(&self, bin: &Binaries) -> Result<Component, Error> {
        let pki = self.dir.join("pki");
        let p = |f: &str| pki.join(f).display().to_string();
        let kubeconfig = |c: &str| self.component_kubeconfig(c);
        Component::start(
            &self.dir,
            "kube-controller-manager",
            &bin.path(Program::KubeControllerManager),
            &strings(&[
                &format!("--kubeconfig={}", kubeconfig("controller-manager")),
                &format!(
                    "--authentication-kubeconfig={}",
                    kubeconfig("controller-manager")
                ),
                &format!(
                    "--authorization-kubeconfig={}",
                    kubeconfig("controller-manager")
                ),
                // No health port: nothing reads it (readiness is the leader Lease,
                // `wait_leading`), and a port picked ahead of the bind can be taken.
                "--secure-port=0",
                "--use-service-account-credentials=true",
                &format!("--service-account-private-key-file={}", p("sa-key.pem")),
                &format!("--root-ca-file={}", p("ca.pem")),
                "--allocate-node-cidrs=true",
                &format!("--cluster-cidr={CLUSTER_CIDR}"),
                "--node-cidr-mask-size=24",
                &format!("--service-cluster-ip-range={SERVICE_CIDR}"),
                "--controllers=*",
                "--profiling=false",
                "--v=1",
            ]),
        )
    }

    fn start_scheduler(&self, bin: &Binaries) -> Result<Component, Error> {
        let kubeconfig = |c: &str| self.component_kubeconfig(c);
        Component::start(
            &self.dir,
            "kube-scheduler",
            &bin.path(Program::KubeScheduler),
            &strings(&[
                &format!("--kubeconfig={}", kubeconfig("scheduler")),
                &format!("--authentication-kubeconfig={}", kubeconfig("scheduler")),
                &format!("--authorization-kubeconfig={}", kubeconfig("scheduler")),
                // As kube-controller-manager's: no health port.
                "--secure-port=0",
                "--profiling=false",
                "--v=1",
            ]),
        )
    }

    fn start_kwok(&self, bin: &Binaries) -> Result<Component, Error> {
        let kubeconfig = |c: &str| self.component_kubeconfig(c);
        Component::start(
            &self.dir,
            "kwok",
            &bin.path(Program::Kwok),
            &strings(&[
                &format!("--kubeconfig={}", kubeconfig("kwok")),
                &format!("--config={}", bin.dir.join("kwok-stages.yaml").display()),
                &format!(
                    "--manage-nodes-with-annotation-selector={}={}",
                    KWOK_NODE.0, KWOK_NODE.1
                ),
                &format!("--cidr={CLUSTER_CIDR}"),
                // Heartbeats by node Lease, as kubelets send them (the stage updates
                // a node's status only every few minutes): without the Lease the node
                // lifecycle controller marks the nodes NotReady and evicts pods.
                "--node-lease-duration-seconds=40",
                &format!("--node-ip={FIRST_NODE_IP}"),
            ]),
        )
    }

    /// Waits until kube-controller-manager and kube-scheduler each hold their leader
    /// Lease.
    fn wait_leading(
        &self,
        kcm: &Component,
        scheduler: &Component,
        bin: &Binaries,
        say: Say<'_>,
    ) -> Result<(), Error> {
        for (component, lease) in [
            (kcm, "kube-controller-manager"),
            (scheduler, "kube-scheduler"),
        ] {
            process::wait_ready(component, "holding its leader Lease", READY_WITHIN, || {
                self.kubectl_output(&[
                    "-n",
                    "kube-system",
                    "get",
                    "lease",
                    lease,
                    "-o",
                    "jsonpath={.spec.holderIdentity}",
                ])
                .is_ok_and(|o| o.status.success() && !o.stdout.is_empty())
            })?;
            say(&format!("{lease} {} leading", bin.kubernetes));
        }
        Ok(())
    }

    /// Creates the Node objects kwok plays, with their status, and waits until every
    /// one is Ready.
    fn add_nodes(&self, kwok: &Component, bin: &Binaries, say: Say<'_>) -> Result<(), Error> {
        for node in &self.nodes {
            self.apply(&node_object(node))?;
            // Status is not applied with the object: set it on its subresource.
            self.kubectl_ok(&[
                "patch",
                "node",
                &node.name,
                "--subresource=status",
                "--type=merge",
                "-p",
                &node_status(node).to_string(),
            ])?;
        }
        process::wait_ready(kwok, "every node Ready", READY_WITHIN, || {
            self.nodes_ready().unwrap_or(false)
        })?;
        say(&format!(
            "kwok {} plays {} node(s): {}",
            bin.kwok,
            self.nodes.len(),
            self.nodes
                .iter()
                .map(|n| format!("{} ({})", n.name, n.ip))
                .collect::<Vec<_>>()
                .join(", ")
        ));
        Ok(())
    }

    fn nodes_ready(&self) -> Result<bool, Error> {
        let out = self.kubectl_json(&[
            "get",
            "nodes",
            "-l",
            &format!("{}={}", KWOK_NODE.0, KWOK_NODE.1),
        ])?;
        let items = out["items"].as_array().cloned().unwrap_or_default();
        let ready = items
            .iter()
            .filter(|n| {
                let cidr = n["spec"]["podCIDR"].as_str().is_some();
                let ready = n["status"]["conditions"].as_array().is_some_and(|c| {
                    c.iter()
                        .any(|c| c["type"] == "Ready" && c["status"] == "True")
                });
                cidr && ready
            })
            .count();
        Ok(ready == self.nodes.len())
    }

    /// The control plane named `name` under `target`, if its state is there (its
    /// components may have died since: see [`ControlPlane::dead`]).
    pub fn find(target: &Path, name: &str) -> Result<Option<Self>, Error> {
        Self::at(&Self::dir_of(target, name))
    }

    /// The control plane whose admin kubeconfig is `kubeconfig` (what
    /// `CENSUS_TEST_KUBECONFIG` names), if census-cluster started it.
    pub fn of_kubeconfig(kubeconfig: &Path) -> Result<Option<Self>, Error> {
        match kubeconfig.parent() {
            Some(dir) => Self::at(dir),
            None => Ok(None),
        }
    }

    fn at(dir: &Path) -> Result<Option<Self>, Error> {
        let dir = dir.to_owned();
        let path = dir.join("state.json");
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(Error::Io {
                    what: "read",
                    path,
                    source,
                });
            }
        };
        let bad = |why: &str| Error::BadState {
            path: path.clone(),
            why: why.to_owned(),
        };
        let state: Value = serde_json::from_str(&text).map_err(|e| bad(&e.to_string()))?;
        let string = |v: &Value, what: &str| {
            v.as_str()
                .map(str::to_owned)
                .ok_or_else(|| bad(&format!("no {what}")))
        };
        let components = state["components"]
            .as_array()
            .ok_or_else(|| bad("no components"))?
            .iter()
            .map(|c| {
                Ok(Component {
                    name: string(&c["name"], "name")?,
                    program: PathBuf::from(string(&c["program"], "program")?),
                    pid: c["pid"]
                        .as_u64()
                        .and_then(|p| u32::try_from(p).ok())
                        .ok_or_else(|| bad("no pid"))?,
                    log: PathBuf::from(string(&c["log"], "log")?),
                    args: c["args"]
                        .as_array()
                        .ok_or_else(|| bad("no args"))?
                        .iter()
                        .map(|a| string(a, "an argument"))
                        .collect::<Result<_, _>>()?,
                })
            })
            .collect::<Result<Vec<_>, Error>>()?;
        let nodes = state["nodes"]
            .as_array()
            .ok_or_else(|| bad("no nodes"))?
            .iter()
            .map(|n| {
                Ok(Node {
                    name: string(&n["name"], "node name")?,
                    ip: string(&n["ip"], "node ip")?
                        .parse()
                        .map_err(|_| bad("a node ip"))?,
                })
            })
            .collect::<Result<Vec<_>, Error>>()?;
        Ok(Some(Self {
            dir,
            server: string(&state["server"], "server")?,
            kubectl: PathBuf::from(string(&state["kubectl"], "kubectl")?),
            kubernetes: string(&state["kubernetes"], "kubernetes")?,
            etcd: string(&state["etcd"], "etcd")?,
            nodes,
            components,
        }))
    }

    /// The running control plane named `name`, or why there is none.
    pub fn running(target: &Path, name: &str) -> Result<Self, Error> {
        match Self::find(target, name)? {
            Some(plane) if plane.dead().is_empty() => Ok(plane),
            _ => Err(Error::NotRunning {
                name: name.to_owned(),
            }),
        }
    }

    fn save(&self) -> Result<(), Error> {
        let state = json!({
            "server": self.server,
            "kubectl": self.kubectl,
            "kubernetes": self.kubernetes,
            "etcd": self.etcd,
            "nodes": self.nodes.iter().map(|n| json!({"name": n.name, "ip": n.ip.to_string()})).collect::<Vec<_>>(),
            "components": self.components.iter().map(|c| json!({
                "name": c.name, "program": c.program, "pid": c.pid, "log": c.log, "args": c.args,
            })).collect::<Vec<_>>(),
        });
        go::write(&self.dir.join("state.json"), &format!("{state:#}\n"))
    }

    /// Stops every component it started (the reverse of their start order) and
    /// forgets them; the logs stay.
    pub fn stop(&self) {
        for component in self.components.iter().rev() {
            component.stop(Duration::from_secs(10));
        }
        let _ = std::fs::remove_file(self.dir.join("state.json"));
    }

    /// Stops the control plane named `name`, if one was started; whether there was.
    /// Also stops any component whose command line names this control plane's
    /// directory though its state no longer lists it (a state file lost or from an
    /// older census-cluster): only its own processes name that directory.
    pub fn down(target: &Path, name: &str) -> Result<bool, Error> {
        let found = Self::find(target, name);
        let stopped = matches!(&found, Ok(Some(_)));
        if let Ok(Some(plane)) = &found {
            plane.stop();
        }
        let strays = process::stop_strays(&Self::dir_of(target, name));
        found?;
        Ok(stopped || !strays.is_empty())
    }

    /// The API server's audit log: one JSON object per request (metadata only) of
    /// every user but the control plane's own components.
    pub fn audit_log(&self) -> PathBuf {
        self.dir.join("logs").join("audit.log")
    }

    /// The audit log's events whose stage is `ResponseComplete`, parsed.
    pub fn audit(&self) -> Result<Vec<Value>, Error> {
        let path = self.audit_log();
        let text = std::fs::read_to_string(&path).map_err(|source| Error::Io {
            what: "read",
            path,
            source,
        })?;
        Ok(text
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|e| e["stage"] == "ResponseComplete")
            .collect())
    }

    /// Stops one component (the others go on), e.g. the API server for a test of
    /// what census does without it.
    pub fn stop_component(&mut self, name: &str) -> Result<(), Error> {
        let component = self.component(name)?;
        component.stop(Duration::from_secs(10));
        Ok(())
    }

    /// Starts a stopped component again with the same arguments and waits until it
    /// is ready (the API server: `/readyz`).
    pub fn start_component(&mut self, name: &str) -> Result<(), Error> {
        let old = self.component(name)?.clone();
        if old.alive() {
            return Ok(());
        }
        let new = old.restart(&self.dir)?;
        if let Some(slot) = self.components.iter_mut().find(|c| c.name == name) {
            *slot = new.clone();
        }
        self.save()?;
        if name == "kube-apiserver" {
            process::wait_ready(&new, "GET /readyz", READY_WITHIN, || {
                self.kubectl_output(&["get", "--raw", "/readyz"])
                    .is_ok_and(|o| o.status.success())
            })?;
        }
        Ok(())
    }

    fn component(&self, name: &str) -> Result<&Component, Error> {
        self.components
            .iter()
            .find(|c| c.name == name)
            .ok_or_else(|| Error::NoComponent {
                name: name.to_owned(),
            })
    }

    /// Compacts etcd's history up to its current revision (through etcd's JSON
    /// gateway): a watch that resumes from before it is answered 410 Gone.
    pub fn compact_etcd(&self) -> Result<u64, Error> {
        let port: u16 = self
            .etcd
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| Error::BadState {
                path: self.dir.join("state.json"),
                why: format!("etcd URL {}", self.etcd),
            })?;
        let range = http_post(port, "/v3/kv/range", r#"{"key":"AA=="}"#)
            .and_then(|body| serde_json::from_str::<Value>(&body).ok())
            .and_then(|v| v["header"]["revision"].as_str()?.parse::<u64>().ok())
            .ok_or(Error::Etcd {
                what: "read its revision",
            })?;
        http_post(
            port,
            "/v3/kv/compaction",
            &format!(r#"{{"revision":"{range}","physical":true}}"#),
        )
        .ok_or(Error::Etcd { what: "compact" })?;
        Ok(range)
    }

    /// The components that have exited.
    pub fn dead(&self) -> Vec<&Component> {
        self.components.iter().filter(|c| !c.alive()).collect()
    }

    pub fn components(&self) -> &[Component] {
        &self.components
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The API server's URL (`https://127.0.0.1:<port>`).
    pub fn server(&self) -> &str {
        &self.server
    }

    /// The Kubernetes release it runs.
    pub fn kubernetes(&self) -> &str {
        &self.kubernetes
    }

    /// The cluster's CA certificate (PEM).
    pub fn ca(&self) -> PathBuf {
        self.dir.join("pki/ca.pem")
    }

    /// An administrator's kubeconfig (group `system:masters`).
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.join("kubeconfig")
    }

    /// Shell lines that point kubectl and census's tests at it.
    pub fn env(&self) -> String {
        let bin = self
            .kubectl
            .parent()
            .map(Path::to_owned)
            .unwrap_or_default();
        format!(
            "export KUBECONFIG={k}\nexport CENSUS_TEST_KUBECONFIG={k}\nexport PATH={}:$PATH\n",
            bin.display(),
            k = self.kubeconfig().display()
        )
    }

    /// kubectl as the administrator.
    pub fn kubectl(&self) -> Command {
        let mut cmd = Command::new(&self.kubectl);
        cmd.arg("--kubeconfig").arg(self.kubeconfig());
        cmd
    }

    /// The path of the kubectl it built.
    pub fn kubectl_path(&self) -> &Path {
        &self.kubectl
    }

    fn kubectl_output(&self, args: &[&str]) -> Result<Output, Error> {
        self.kubectl()
            .args(args)
            .output()
            .map_err(|source| Error::Spawn {
                what: "kubectl",
                source,
            })
    }

    /// Runs kubectl as the administrator; its stdout, or an error with its stderr.
    pub fn kubectl_ok(&self, args: &[&str]) -> Result<String, Error> {
        let out = self.kubectl_output(args)?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(Error::Failed {
                what: "kubectl",
                status: out.status,
                detail: format!(
                    "kubectl {}: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            })
        }
    }

    /// `kubectl ... -o json`, parsed.
    pub fn kubectl_json(&self, args: &[&str]) -> Result<Value, Error> {
        let mut all = args.to_vec();
        all.extend(["-o", "json"]);
        let text = self.kubectl_ok(&all)?;
        serde_json::from_str(&text).map_err(|e| Error::BadState {
            path: self.kubectl.clone(),
            why: format!("kubectl printed no JSON: {e}"),
        })
    }

    /// The pods of `namespace` that are Running and not being deleted, as kwok runs
    /// them: name, node and pod IP.
    pub fn running_pods(&self, namespace: &str) -> Result<Vec<RunningPod>, Error> {
        let pods = self.kubectl_json(&["-n", namespace, "get", "pods"])?;
        Ok(pods["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|p| {
                p["status"]["phase"] == "Running" && p["metadata"]["deletionTimestamp"].is_null()
            })
            .filter_map(|p| {
                Some(RunningPod {
                    name: p["metadata"]["name"].as_str()?.to_owned(),
                    node: p["spec"]["nodeName"].as_str()?.to_owned(),
                    ip: p["status"]["podIP"].as_str()?.parse().ok()?,
                })
            })
            .collect())
    }

    /// Server-side apply of one object, as the administrator.
    pub fn apply(&self, object: &Value) -> Result<(), Error> {
        use std::io::Write as _;
        let mut child = self
            .kubectl()
            .args([
                "apply",
                "--server-side",
                "--force-conflicts",
                "--field-manager=census-test",
                "-f",
                "-",
            ])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|source| Error::Spawn {
                what: "kubectl apply",
                source,
            })?;
        if let Some(mut stdin) = child.stdin.take() {
            let _ = stdin.write_all(object.to_string().as_bytes());
        }
        let out = child.wait_with_output().map_err(|source| Error::Spawn {
            what: "kubectl apply",
            source,
        })?;
        if out.status.success() {
            Ok(())
        } else {
            Err(Error::Failed {
                what: "kubectl apply",
                status: out.status,
                detail: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            })
        }
    }

    /// A token of ServiceAccount `namespace/name` (TokenRequest), for `audience`
    /// (the API server's when `None`), bound to `pod` when given, valid `seconds`.
    pub fn token(
        &self,
        namespace: &str,
        name: &str,
        audience: Option<&str>,
        pod: Option<&str>,
        seconds: u32,
    ) -> Result<String, Error> {
        let duration = format!("--duration={seconds}s");
        let mut args = vec!["-n", namespace, "create", "token", name, &duration];
        if let Some(audience) = audience {
            args.extend(["--audience", audience]);
        }
        if let Some(pod) = pod {
            args.extend(["--bound-object-kind", "Pod", "--bound-object-name", pod]);
        }
        Ok(self.kubectl_ok(&args)?.trim().to_owned())
    }

    /// A kubeconfig file under the control plane's directory that sends `token`.
    pub fn write_token_kubeconfig(&self, file: &str, token: &str) -> Result<PathBuf, Error> {
        let path = self.dir.join(format!("{file}.kubeconfig"));
        go::write(
            &path,
            &token_kubeconfig(&self.dir.join("pki"), &self.server, token),
        )?;
        Ok(path)
    }
}

fn clients() -> impl Iterator<Item = (&'static str, &'static str, Option<&'static str>)> {
    pki::CLIENTS.iter().map(|c| (c.file, c.user, c.group))
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| (*s).to_owned()).collect()
}

/// A kwok node: annotated for kwok to manage it.
fn node_object(node: &Node) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": node.name,
            "annotations": {KWOK_NODE.0: KWOK_NODE.1, "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                KWOK_NODE.0: KWOK_NODE.1,
                "kubernetes.io/hostname": node.name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
            },
        },
    })
}

/// The node's addresses (kwok keeps an InternalIP a node already has) and room for
/// pods.
fn node_status(node: &Node) -> Value {
    let resources = json!({"cpu": "32", "memory": "256Gi", "pods": "110"});
    json!({"status": {
        "addresses": [
            {"type": "InternalIP", "address": node.ip.to_string()},
            {"type": "Hostname", "address": node.name},
        ],
        "allocatable": resources,
        "capacity": resources,
    }})
}

/// `GET path` over plain HTTP on loopback (etcd's client port); the response.
fn http_get(port: u16, path: &str) -> Option<String> {
    http(
        port,
        &format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n"),
    )
}

/// `POST path` with a JSON body; the response's body if it is a 200.
fn http_post(port: u16, path: &str, body: &str) -> Option<String> {
    let response = http(
        port,
        &format!(
            "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ),
    )?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    (head.starts_with("HTTP/1.1 200") || head.starts_with("HTTP/1.0 200")).then(|| body.to_owned())
}

fn http(port: u16, request: &str) -> Option<String> {
    use std::io::{Read as _, Write as _};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    stream.write_all(request.as_bytes()).ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    Some(response)
}

/// Metadata of every request but the control plane's own components' and kwok's
/// (their node and pod status updates would drown the rest).
const AUDIT_POLICY: &str = "apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: None
  users: [system:kube-controller-manager, system:kube-scheduler, system:apiserver, kwok]
- level: None
  userGroups: [system:serviceaccounts:kube-system, system:nodes]
- level: Metadata
";

#[cfg(test)]
mod tests {
    use super::*;

    fn plane() -> ControlPlane {
        ControlPlane {
            dir: PathBuf::from("/nonexistent"),
            server: String::new(),
            kubectl: PathBuf::new(),
            kubernetes: String::new(),
            etcd: String::new(),
            nodes: Vec::new(),
            components: Vec::new(),
        }
    }

    fn died(tail: &str) -> Error {
        Error::Died {
            component: "etcd".to_owned(),
            log: PathBuf::from("etcd.log"),
            tail: tail.to_owned(),
        }
    }

    /// A component that lost its port is started again, up to PORT_ATTEMPTS times;
    /// any other failure is returned at once.
    #[test]
    fn a_taken_port_is_picked_again_and_nothing_else_is_retried() {
        let taken = "listen tcp 127.0.0.1:24123: bind: address already in use";
        let mut starts = 0;
        let result = plane().on_free_ports(|_| {
            starts += 1;
            if starts < PORT_ATTEMPTS {
                Err(died(taken))
            } else {
                Ok(starts)
            }
        });
        assert_eq!(result.ok(), Some(PORT_ATTEMPTS));

        starts = 0;
        let result: Result<(), Error> = plane().on_free_ports(|_| {
            starts += 1;
            Err(died(taken))
        });
        assert!(result.is_err_and(|e| process::port_taken(&e)));
        assert_eq!(starts, PORT_ATTEMPTS);

        starts = 0;
        let result: Result<(), Error> = plane().on_free_ports(|_| {
            starts += 1;
            Err(died("etcdmain: open wal: permission denied"))
        });
        assert!(result.is_err_and(|e| !process::port_taken(&e)));
        assert_eq!(starts, 1);
    }
}
