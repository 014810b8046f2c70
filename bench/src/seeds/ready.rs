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
//!   each other node (T3).
//!
//! A pod whose entry shows up before its Identity object's watch event is counted
//! from the moment the id is known: the figures can only err long, by the watch's
//! lag (milliseconds).
//!
//! The probes have no network namespace: their entries are written without LOCAL,
//! as for any endpoint whose device the agent has not found. The agent writes an
//! endpoint's entry, identity included, before it attaches to its device (see
//! docs/agent.md), so the time to identity is the same; the attachment after it
//! (about 26 ms per interface with TCX) is `cargo xtask bench-agent`'s figure.

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
}

impl Tracker {
    /// Starts watching the probes of `namespace` and the Identity objects, and
    /// polling the pins of `nodes` (name, pin directory, in the agents' order).
    pub(crate) fn start(
        plane: &census_cluster::ControlPlane,
        namespace: &str,
        nodes: Vec<(String, PathBuf)>,
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
        let names: Vec<String> = nodes.iter().map(|(n, _)| n.clone()).collect();
        let pod_out = pods.stdout.take().context("the pod watch's stdout")?;
        let id_out = identities
            .stdout
            .take()
            .context("the Identity watch's stdout")?;
        let threads = vec![
            watch(pod_out, seen.clone(), move |seen, object| {
                pod_event(seen, object, &names);
            }),
            watch(id_out, seen.clone(), identity_event),
            poller(nodes, seen.clone(), stop.clone())?,
        ];
        Ok(Self {
            plane: plane.clone(),
            namespace: namespace.to_owned(),
            probes: std::collections::VecDeque::new(),
            stop,
            seen,
            watches: vec![pods, identities],
            threads,
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
        Ok(())
    }

    /// Waits (at most [`GIVE_UP`]) for every probe seen to be written on every node,
    /// deletes the probes left, stops the watches and the poller; the figures.
    pub(crate) fn stop(mut self) -> anyhow::Result<TimeToIdentity> {
        let waiting = Instant::now();
        while waiting.elapsed() < GIVE_UP
            && self
                .seen
                .lock()
                .pods
                .values()
                .any(|p| p.written.contains(&None))
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

fn pod_event(seen: &mut Seen, pod: &Value, nodes: &[String]) {
    let now = Instant::now();
    let Some(uid) = pod["metadata"]["uid"].as_str() else {
        return;
    };
    if seen.pods.contains_key(uid) || pod["status"]["phase"] != "Running" {
        return;
    }
    let ip = pod["status"]["podIP"].as_str().and_then(|s| s.parse().ok());
    let probe = pod["metadata"]["labels"][PROBE_LABEL].as_str();
    let node = pod["spec"]["nodeName"]
        .as_str()
        .and_then(|n| nodes.iter().position(|m| m == n));
    if let (Some(ip), Some(probe), Some(node)) = (ip, probe, node) {
        seen.pods.insert(
            uid.to_owned(),
            Pod {
                probe: probe.to_owned(),
                ip,
                node,
                running: now,
                written: vec![None; nodes.len()],
            },
        );
    }
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
    nodes: Vec<(String, PathBuf)>,
    seen: Arc<Mutex<Seen>>,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<JoinHandle<()>> {
    let maps = nodes
        .iter()
        .map(|(node, pins)| {
            Inspector::open(pins).with_context(|| format!("{node}'s pins at {}", pins.display()))
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
                        if pod.written[k].is_some() {
                            continue;
                        }
                        if let Ok(Some(entry)) = map.endpoint(pod.ip)
                            && entry.identity == id
                        {
                            pod.written[k] = Some(tick);
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
    let mut never = 0;
    for pod in seen.pods.values() {
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
        ]
    }
}
