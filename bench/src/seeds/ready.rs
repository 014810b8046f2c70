//! Time to identity, measured from outside under seed-leak's churn: from a pod
//! getting its IP (kwok marks it Running) to its `ENDPOINTS` entry carrying its
//! identity on its own node and on each other node, with the stages between.
//!
//! The pods measured are probes created among the Jobs ([`Tracker::probe`]): kwok
//! completes a Job's pod the moment it runs, so most Job pods end before any agent
//! could write them, and the few written would be the fastest. A probe stays
//! Running until a few later probes exist, and has a label of its own
//! (`census-probe=<n>`), so each is a new identity: the agent's Allocate waits for
//! the operator to store it, the slowest path.
//!
//! Three threads, none inside census:
//!
//! - a pod watch (`kubectl get pods --watch`): when each probe was first seen
//!   Running with an IP, on which node (T0);
//! - an Identity watch (`kubectl get identities --watch`): when the Identity object
//!   of each probe's labels was first seen, and its id (T1: the operator has stored
//!   it);
//! - a poller looking up the pending pods' addresses in every agent's pinned
//!   `ENDPOINTS` (read-only, as `census bpf endpoints` does) every
//!   [`POLL`]: when the entry first carries the pod's id on its own node (T2) and on
//!   each other node (T3), and when its own node's entry is LOCAL with it (T4: the
//!   agent found the pod's device and attached to it).
//!
//! A pod whose entry shows up before its Identity object's watch event is counted
//! from the moment the id is known: the figures can only err long, by the watch's
//! lag (milliseconds).
//!
//! **Each probe gets a network namespace** with its kwok address, as a CNI plugin
//! gives a pod: a fourth thread, on the pod watch's word, creates it with a veth
//! whose host side is in the probe's node's namespace (the agent's) and a /32 (or
//! /128) route to the address through it, and deletes it when the probe is deleted.
//! On a real node the device exists before the pod is Running; kwok gives the
//! address only then, so here it comes a few milliseconds after (T0 -> wired, in
//! the stages). The agent writes an endpoint's entry, identity included, before it
//! attaches to its device (docs/agent.md): T2 does not wait for the device, T4 does.

use std::{
    collections::HashMap,
    io::BufReader,
    net::IpAddr,
    path::PathBuf,
    process::{Child, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use census_agent::bpf::Inspector;
use census_netlab::Netns;
use parking_lot::Mutex;
use serde::Serialize;
use serde_json::Value;

use crate::sample::Latency;

/// How often the pending pods' entries are looked up.
const POLL: Duration = Duration::from_millis(2);
/// A pod not written everywhere this long after it ran is no longer looked up (it
/// has ended, or its node's agent is behind: it counts as never written there).
const GIVE_UP: Duration = Duration::from_secs(30);
/// The label that names a probe, and makes its identity its own.
const PROBE_LABEL: &str = "census-probe";
/// Probes kept Running at once; the oldest is deleted when a new one exceeds it.
const PROBES_ALIVE: usize = 3;

/// A pod seen Running with an IP.
#[derive(Debug)]
struct Pod {
    probe: String,
    ip: IpAddr,
    /// Its node's index among the agents' nodes.
    node: usize,
    running: Instant,
    /// When each node's entry first carried its identity.
    written: Vec<Option<Instant>>,
    /// When its network namespace was wired behind its node.
    wired: Option<Instant>,
    /// When its own node's entry first was LOCAL with its identity.
    attached: Option<Instant>,
}

/// One node the figures look at: its name, the agent's pins and its network
/// namespace (where the host side of each probe's veth goes).
#[derive(Debug, Clone)]
pub(crate) struct Node {
    pub(crate) name: String,
    pub(crate) pins: PathBuf,
    pub(crate) netns: String,
}

/// What the wiring thread is told.
enum Wiring {
    /// A probe runs at `ip` on node `node`: give it a network namespace.
    Wire {
        probe: String,
        ip: IpAddr,
        node: usize,
    },
    /// The probe is deleted: its namespace goes.
    Unwire { probe: String },
}

#[derive(Debug, Default)]
struct Seen {
    pods: HashMap<String, Pod>,
    /// Probe -> (id, when its Identity object was first seen).
    identities: HashMap<String, (u32, Instant)>,
}

/// The figures, in microseconds.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct TimeToIdentity {
    /// Probes that got their identity on their own node within the run.
    pub(crate) pods: usize,
    /// Probes seen Running whose entry never carried their identity.
    pub(crate) never_written: usize,
    pub(crate) own_node: Latency,
    /// One sample per (pod, other node).
    pub(crate) other_nodes: Latency,
    /// T0 -> T1: the agent's watch, its Allocate and the operator's store write.
    pub(crate) running_to_stored: Latency,
    /// T1 -> T2: the Allocate answer and the agent's map write.
    pub(crate) stored_to_own_map: Latency,
    /// T2 -> T3: the agent's report, the operator's map stream, the other agent's
    /// write.
    pub(crate) own_map_to_other_maps: Latency,
    /// T0 -> T4: Running to the own node's entry LOCAL with the identity.
    pub(crate) attached: Latency,
    /// T0 -> the probe's namespace wired (this harness, not census).
    pub(crate) running_to_wired: Latency,
    /// Wired -> T4: the agent's link event, route lookup, attachment and write.
    pub(crate) wired_to_attached: Latency,
    /// Probes whose own entry never became LOCAL with their identity.
    pub(crate) never_attached: usize,
}

/// The watches and the poller, running until [`Tracker::stop`].
pub(crate) struct Tracker {
    plane: census_cluster::ControlPlane,
    namespace: String,
    /// Probes created and not yet deleted, oldest first.
    probes: std::collections::VecDeque<String>,
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Seen>>,
    watches: Vec<Child>,
    threads: Vec<JoinHandle<()>>,
    wiring: std::sync::mpsc::Sender<Wiring>,
}

impl Tracker {
    /// Starts watching the probes of `namespace` and the Identity objects, wiring
    /// each probe's namespace behind its node, and polling the pins of `nodes` (in
    /// the agents' order).
    pub(crate) fn start(
        plane: &census_cluster::ControlPlane,
        namespace: &str,
        nodes: Vec<Node>,
    ) -> anyhow::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Seen::default()));
        let mut pods = plane
            .kubectl()
            .args(["-n", namespace, "get", "pods", "-l", PROBE_LABEL])
            .args(["--watch", "-o", "json"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("kubectl get pods --watch")?;
        let mut identities = plane
            .kubectl()
            .args(["get", "identities", "--watch", "-o", "json"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("kubectl get identities --watch")?;
        let names: Vec<String> = nodes.iter().map(|n| n.name.clone()).collect();
        let pod_out = pods.stdout.take().context("the pod watch's stdout")?;
        let id_out = identities
            .stdout
            .take()
            .context("the Identity watch's stdout")?;
        let (wiring, orders) = std::sync::mpsc::channel();
        let wire = wiring.clone();
        let threads = vec![
            watch(pod_out, seen.clone(), move |seen, object| {
                if let Some(order) = pod_event(seen, object, &names) {
                    let _ = wire.send(order);
                }
            }),
            watch(id_out, seen.clone(), identity_event),
            wirer(&nodes, orders, seen.clone()),
            poller(&nodes, seen.clone(), stop.clone())?,
        ];
        Ok(Self {
            plane: plane.clone(),
            namespace: namespace.to_owned(),
            probes: std::collections::VecDeque::new(),
            stop,
            seen,
            watches: vec![pods, identities],
            threads,
            wiring,
        })
    }

    /// Creates probe `n` (a pod that stays Running, with an identity of its own),
    /// deleting the oldest if more than [`PROBES_ALIVE`] would run.
    pub(crate) fn probe(&mut self, n: usize) -> anyhow::Result<()> {
        let name = format!("probe-{n}");
        let pod = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": {PROBE_LABEL: name},
            },
            "spec": {"containers": [{"name": "c", "image": "busybox:1.36"}]},
        });
        self.plane
            .apply(&pod)
            .map_err(|e| anyhow::anyhow!("creating {name}: {e}"))?;
        self.probes.push_back(name);
        while self.probes.len() > PROBES_ALIVE {
            if let Some(old) = self.probes.pop_front() {
                self.delete(&old)?;
            }
        }
        Ok(())
    }

    fn delete(&self, name: &str) -> anyhow::Result<()> {
        self.plane
            .kubectl_ok(&["-n", &self.namespace, "delete", "pod", name, "--wait=false"])
            .map_err(|e| anyhow::anyhow!("deleting {name}: {e}"))?;
        let _ = self.wiring.send(Wiring::Unwire {
            probe: name.to_owned(),
        });
        Ok(())
    }

    /// Waits (at most [`GIVE_UP`]) for every probe seen to be written on every node,
    /// deletes the probes left, stops the watches and the poller; the figures.
    pub(crate) fn stop(mut self) -> anyhow::Result<TimeToIdentity> {
        let waiting = Instant::now();
        while waiting.elapsed() < GIVE_UP
            && self.seen.lock().pods.values().any(|p| {
                p.running.elapsed() < GIVE_UP && (p.written.contains(&None) || p.attached.is_none())
            })
        {
            std::thread::sleep(Duration::from_millis(50));
        }
        for name in std::mem::take(&mut self.probes) {
            self.delete(&name)?;
        }
        self.stop.store(true, Ordering::Relaxed);
        for w in &mut self.watches {
            let _ = w.kill();
            let _ = w.wait();
        }
        // The wiring thread ends with its last sender, and deletes what it wired.
        let (closed, _) = std::sync::mpsc::channel();
        drop(std::mem::replace(&mut self.wiring, closed));
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        Ok(figures(&self.seen.lock()))
    }
}

/// Reads `kubectl ... --watch -o json`'s stream of objects, handing each to `each`.
fn watch(
    out: impl std::io::Read + Send + 'static,
    seen: Arc<Mutex<Seen>>,
    each: impl Fn(&mut Seen, &Value) + Send + 'static,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let stream =
            serde_json::Deserializer::from_reader(BufReader::new(out)).into_iter::<Value>();
        for object in stream {
            let Ok(object) = object else { return };
            each(&mut seen.lock(), &object);
        }
    })
}

/// Records a probe first seen Running with an IP; the order to wire it.
fn pod_event(seen: &mut Seen, pod: &Value, nodes: &[String]) -> Option<Wiring> {
    let now = Instant::now();
    let uid = pod["metadata"]["uid"].as_str()?;
    if seen.pods.contains_key(uid) || pod["status"]["phase"] != "Running" {
        return None;
    }
    let ip = pod["status"]["podIP"].as_str().and_then(|s| s.parse().ok());
    let probe = pod["metadata"]["labels"][PROBE_LABEL].as_str();
    let node = pod["spec"]["nodeName"]
        .as_str()
        .and_then(|n| nodes.iter().position(|m| m == n));
    let (ip, probe, node) = (ip?, probe?, node?);
    seen.pods.insert(
        uid.to_owned(),
        Pod {
            probe: probe.to_owned(),
            ip,
            node,
            running: now,
            written: vec![None; nodes.len()],
            wired: None,
            attached: None,
        },
    );
    Some(Wiring::Wire {
        probe: probe.to_owned(),
        ip,
        node,
    })
}

/// Carries out the wiring orders until every sender is gone, then deletes the
/// namespaces left. A probe whose wiring fails is reported and left unwired (its
/// T4 never comes).
fn wirer(
    nodes: &[Node],
    orders: std::sync::mpsc::Receiver<Wiring>,
    seen: Arc<Mutex<Seen>>,
) -> JoinHandle<()> {
    let netns: Vec<String> = nodes.iter().map(|n| n.netns.clone()).collect();
    std::thread::spawn(move || {
        let mut wired: HashMap<String, Netns> = HashMap::new();
        for order in orders {
            match order {
                Wiring::Wire { probe, ip, node } => match wire(&netns[node], &probe, ip) {
                    Ok(ns) => {
                        let at = Instant::now();
                        if let Some(pod) = seen.lock().pods.values_mut().find(|p| p.probe == probe)
                        {
                            pod.wired = Some(at);
                        }
                        wired.insert(probe, ns);
                    }
                    Err(e) => crate::report::say(format!("wiring {probe}'s namespace: {e:#}")),
                },
                Wiring::Unwire { probe } => drop(wired.remove(&probe)),
            }
        }
    })
}

/// A network namespace for `probe` at `ip`: `eth0` in it, the veth's other end in
/// the node's namespace `node` with a route to `ip` (as a CNI plugin wires a pod).
fn wire(node: &str, probe: &str, ip: IpAddr) -> anyhow::Result<Netns> {
    let ns = Netns::create_with_prefix("seeds", probe)?;
    // Interface names are at most 15 bytes: `p` and the probe's number.
    let host = format!("p{}", probe.trim_start_matches("probe-"));
    let prefix = if ip.is_ipv4() { 32 } else { 128 };
    census_netlab::add_veth(node, &host, &ns)?;
    ns.ip(&["addr", "add", &format!("{ip}/{prefix}"), "dev", "eth0"])?;
    ns.ip(&["link", "set", "eth0", "up"])?;
    census_netlab::ip_in(node, &["link", "set", &host, "up"])?;
    census_netlab::ip_in(
        node,
        &["route", "replace", &format!("{ip}/{prefix}"), "dev", &host],
    )?;
    Ok(ns)
}

fn identity_event(seen: &mut Seen, object: &Value) {
    let now = Instant::now();
    let id = object["metadata"]["name"]
        .as_str()
        .and_then(|n| n.parse::<u32>().ok());
    let prefix = format!("k8s:{PROBE_LABEL}=");
    let probe = object["spec"]["labels"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .find_map(|l| l.strip_prefix(&prefix));
    if let (Some(id), Some(probe)) = (id, probe)
        && object["status"]["tombstone"].is_null()
    {
        seen.identities.entry(probe.to_owned()).or_insert((id, now));
    }
}

/// Every [`POLL`], looks up the entry of each pod not yet written everywhere whose
/// id is known, on each node not yet carrying it.
fn poller(
    nodes: &[Node],
    seen: Arc<Mutex<Seen>>,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<JoinHandle<()>> {
    let maps = nodes
        .iter()
        .map(|n| {
            Inspector::open(&n.pins)
                .with_context(|| format!("{}'s pins at {}", n.name, n.pins.display()))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            let tick = Instant::now();
            {
                let mut seen = seen.lock();
                let Seen { pods, identities } = &mut *seen;
                for pod in pods.values_mut() {
                    if tick.duration_since(pod.running) > GIVE_UP {
                        continue;
                    }
                    let Some(&(id, _)) = identities.get(&pod.probe) else {
                        continue;
                    };
                    for (k, map) in maps.iter().enumerate() {
                        let own = k == pod.node;
                        if pod.written[k].is_some() && !(own && pod.attached.is_none()) {
                            continue;
                        }
                        if let Ok(Some(entry)) = map.endpoint(pod.ip)
                            && entry.identity == id
                        {
                            pod.written[k].get_or_insert(tick);
                            if own && entry.is_local() {
                                pod.attached = Some(tick);
                            }
                        }
                    }
                }
            }
            std::thread::sleep(POLL.saturating_sub(tick.elapsed()));
        }
    }))
}

fn figures(seen: &Seen) -> TimeToIdentity {
    let mut own = Vec::new();
    let mut others = Vec::new();
    let mut stored = Vec::new();
    let mut own_write = Vec::new();
    let mut spread = Vec::new();
    let mut attached = Vec::new();
    let mut to_wired = Vec::new();
    let mut wired_to_attached = Vec::new();
    let mut never = 0;
    let mut never_attached = 0;
    for pod in seen.pods.values() {
        if let Some(wired) = pod.wired {
            to_wired.push(wired.saturating_duration_since(pod.running));
        }
        match pod.attached {
            Some(at) => {
                attached.push(at.saturating_duration_since(pod.running));
                if let Some(wired) = pod.wired {
                    wired_to_attached.push(at.saturating_duration_since(wired));
                }
            }
            None => never_attached += 1,
        }
        let Some(Some(own_at)) = pod.written.get(pod.node).copied() else {
            never += 1;
            continue;
        };
        own.push(own_at.saturating_duration_since(pod.running));
        if let Some(&(_, at)) = seen.identities.get(&pod.probe) {
            stored.push(at.saturating_duration_since(pod.running));
            own_write.push(own_at.saturating_duration_since(at.max(pod.running)));
        }
        for (k, at) in pod.written.iter().enumerate() {
            if let (true, Some(at)) = (k != pod.node, at) {
                others.push(at.saturating_duration_since(pod.running));
                spread.push(at.saturating_duration_since(own_at));
            }
        }
    }
    TimeToIdentity {
        pods: own.len(),
        never_written: never,
        own_node: Latency::of(own),
        other_nodes: Latency::of(others),
        running_to_stored: Latency::of(stored),
        stored_to_own_map: Latency::of(own_write),
        own_map_to_other_maps: Latency::of(spread),
        attached: Latency::of(attached),
        running_to_wired: Latency::of(to_wired),
        wired_to_attached: Latency::of(wired_to_attached),
        never_attached,
    }
}

impl TimeToIdentity {
    /// One line per figure, in milliseconds.
    pub(crate) fn lines(&self) -> Vec<String> {
        let ms = |l: &Latency| {
            format!(
                "p50 {:.1} ms  p99 {:.1} ms  max {:.1} ms  ({} samples)",
                l.p50_us / 1e3,
                l.p99_us / 1e3,
                l.max_us / 1e3,
                l.count
            )
        };
        vec![
            format!(
                "time to identity: {} pods ({} never written)",
                self.pods, self.never_written
            ),
            format!("  own node     {}", ms(&self.own_node)),
            format!("  other nodes  {}", ms(&self.other_nodes)),
            format!(
                "  stages: Running -> Identity stored  {}",
                ms(&self.running_to_stored)
            ),
            format!(
                "          stored -> own node's map    {}",
                ms(&self.stored_to_own_map)
            ),
            format!(
                "          own map -> other nodes' maps {}",
                ms(&self.own_map_to_other_maps)
            ),
            format!(
                "  attached (own entry LOCAL) {}  ({} never)",
                ms(&self.attached),
                self.never_attached
            ),
            format!(
                "  stages: Running -> namespace wired  {}",
                ms(&self.running_to_wired)
            ),
            format!(
                "          wired -> attached           {}",
                ms(&self.wired_to_attached)
            ),
        ]
    }
}
