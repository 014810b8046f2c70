//! Simulated agents: many nodes in this process, each with its own EndpointSync
//! stream, behaving as census-agent does towards the operator:
//!
//! - Hello with its session (start time, random nonce), then a full snapshot at once,
//!   and one every interval (the operator's, from HelloReply) jittered by ±10%;
//! - one `seq` per session, shared by deltas and snapshots, kept across reconnects;
//! - a new pod: Allocate its labels (held for this node), then an Upsert delta; a
//!   deleted pod: a Delete delta, unless the scenario drops that event (the pod is
//!   gone from the agent's state either way, so the next snapshot tells the truth);
//! - Rebind: the endpoint takes the identity it is told; SnapshotRequest: a snapshot now;
//! - a broken stream (operator killed): reconnect with jittered backoff, same session,
//!   snapshot first.
//!
//! Nodes share `connections` HTTP/2 connections (node `i` uses connection
//! `i % connections`): the scale presets give every node its own, as real agents
//! have; the others share a few, as many agents behind one proxy would.
//!
//! Every identity binding the harness ever sees (Allocate answers, Watch events) is
//! recorded, so scenarios can check that no id was bound to two label sets.

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::Context as _;
use census_proto::{
    PROTOCOL_VERSION,
    pb::{
        self, agent_message::Body, endpoint_sync_client::EndpointSyncClient,
        identity_service_client::IdentityServiceClient, operator_message,
    },
};
use parking_lot::Mutex;
use rand::RngExt as _;
use tokio::{
    sync::{mpsc, oneshot},
    task::JoinHandle,
    time::{Instant, sleep, sleep_until},
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, transport::Channel};

/// A label set as the agent sends it (`source:key=value`), shared by pods.
pub(crate) type Labels = Arc<Vec<String>>;

/// A pod to create on a node.
#[derive(Debug, Clone)]
pub(crate) struct Pod {
    pub(crate) namespace: String,
    pub(crate) name: String,
    pub(crate) ip: String,
    pub(crate) labels: Labels,
}

impl Pod {
    pub(crate) fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// An endpoint as the agent holds it.
#[derive(Debug, Clone)]
struct Held {
    pod: Pod,
    identity: u32,
}

/// What the harness saw and counted, over all nodes.
#[derive(Debug, Default)]
pub(crate) struct Observed {
    /// Every id -> canonical label set the operator ever handed out or announced.
    bindings: Mutex<HashMap<u32, String>>,
    /// Ids seen bound to two different label sets.
    pub(crate) bound_twice: Mutex<Vec<String>>,
    /// Send-to-Ack latency of snapshots.
    snapshot_acks: Mutex<Vec<Duration>>,
    /// Allocate latency (as the agent sees it, retries included).
    allocate_latency: Mutex<Vec<Duration>>,
    pub(crate) rebinds: AtomicU64,
    pub(crate) reconnects: AtomicU64,
    pub(crate) allocate_retries: AtomicU64,
    pub(crate) snapshots_sent: AtomicU64,
    pub(crate) deletes_dropped: AtomicU64,
    pub(crate) deletes_sent: AtomicU64,
    pub(crate) acks_ignored: AtomicU64,
}

impl Observed {
    /// Records that `id` is bound to `labels` (canonical, as the operator answers).
    pub(crate) fn bind(&self, id: u32, labels: &[String]) {
        let canonical = labels.join(",");
        let mut bindings = self.bindings.lock();
        match bindings.get(&id) {
            Some(existing) if *existing != canonical => {
                self.bound_twice
                    .lock()
                    .push(format!("id {id}: [{existing}] and then [{canonical}]"));
            }
            Some(_) => {}
            None => {
                bindings.insert(id, canonical);
            }
        }
    }

    pub(crate) fn take_snapshot_acks(&self) -> Vec<Duration> {
        std::mem::take(&mut *self.snapshot_acks.lock())
    }

    pub(crate) fn take_allocate_latency(&self) -> Vec<Duration> {
        std::mem::take(&mut *self.allocate_latency.lock())
    }

    pub(crate) fn bindings_seen(&self) -> usize {
        self.bindings.lock().len()
    }
}

enum Cmd {
    Create(Pod),
    Delete {
        key: String,
        send_event: bool,
    },
    /// Answers once every command before it was handled.
    Flush(oneshot::Sender<()>),
    Stop,
}

/// One simulated node.
#[derive(Debug)]
pub(crate) struct Node {
    handle: NodeHandle,
    task: Option<JoinHandle<()>>,
}

/// What other tasks may hold of a node: its commands and its state.
#[derive(Debug, Clone)]
pub(crate) struct NodeHandle {
    pub(crate) name: String,
    pub(crate) session: pb::Session,
    cmd: mpsc::UnboundedSender<Cmd>,
    state: Arc<Mutex<BTreeMap<String, Held>>>,
    connected: Arc<std::sync::atomic::AtomicBool>,
}

impl std::fmt::Debug for Cmd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Create(p) => write!(f, "Create({})", p.key()),
            Self::Delete { key, send_event } => write!(f, "Delete({key}, {send_event})"),
            Self::Flush(_) => f.write_str("Flush"),
            Self::Stop => f.write_str("Stop"),
        }
    }
}

/// Where nodes connect, and what they share.
#[derive(Debug, Clone)]
pub(crate) struct Fleet {
    channels: Arc<Mutex<Vec<Channel>>>,
    url: Arc<Mutex<String>>,
    pub(crate) observed: Arc<Observed>,
    /// Label set -> id known to any node, so a node whose labels another node already
    /// allocated does not Allocate again (the operator's answer would be the same).
    /// Used by the scale scenario only: ramping up 5,000 nodes.
    known: Arc<Mutex<HashMap<Labels, u32>>>,
}

impl Fleet {
    /// `connections` HTTP/2 connections to the operator at `url`, shared by the nodes.
    pub(crate) async fn connect(url: &str, connections: usize) -> anyhow::Result<Self> {
        let fleet = Self {
            channels: Arc::new(Mutex::new(Vec::new())),
            url: Arc::new(Mutex::new(url.to_owned())),
            observed: Arc::new(Observed::default()),
            known: Arc::new(Mutex::new(HashMap::new())),
        };
        fleet.reconnect(url, connections).await?;
        Ok(fleet)
    }

    /// New connections (after an operator restart on other ports; the same ports need
    /// no call: tonic channels reconnect by themselves).
    pub(crate) async fn reconnect(&self, url: &str, connections: usize) -> anyhow::Result<()> {
        let mut channels = Vec::with_capacity(connections);
        for _ in 0..connections.max(1) {
            let channel = Channel::from_shared(url.to_owned())?
                .connect_timeout(Duration::from_secs(5))
                .http2_adaptive_window(true)
                .connect_lazy();
            channels.push(channel);
        }
        *self.channels.lock() = channels;
        *self.url.lock() = url.to_owned();
        Ok(())
    }

    pub(crate) fn channel(&self, i: usize) -> Channel {
        let channels = self.channels.lock();
        channels[i % channels.len()].clone()
    }

    pub(crate) fn identity_client(&self, i: usize) -> IdentityServiceClient<Channel> {
        IdentityServiceClient::new(self.channel(i))
    }

    /// Starts node `name` on connection `i % connections`, with `pods` already running
    /// (allocated before its first snapshot, as an agent starting on a busy node).
    pub(crate) fn start_node(
        &self,
        index: usize,
        name: String,
        pods: Vec<Pod>,
        share_known: bool,
    ) -> Node {
        let (cmd, rx) = mpsc::unbounded_channel();
        let state = Arc::new(Mutex::new(BTreeMap::new()));
        let connected = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let agent = Agent {
            fleet: self.clone(),
            index,
            node: name.clone(),
            session: pb::Session {
                start_time_ns: SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(1, |d| d.as_nanos() as u64),
                nonce: rand::rng().random(),
            },
            seq: 0,
            state: state.clone(),
            connected: connected.clone(),
            share_known,
        };
        let session = agent.session;
        let task = tokio::spawn(agent.run(rx, pods));
        Node {
            handle: NodeHandle {
                name,
                session,
                cmd,
                state,
                connected,
            },
            task: Some(task),
        }
    }
}

impl Node {
    pub(crate) fn handle(&self) -> NodeHandle {
        self.handle.clone()
    }

    pub(crate) async fn stop(mut self) {
        let _ = self.handle.cmd.send(Cmd::Stop);
        if let Some(task) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
    }
}

impl std::ops::Deref for Node {
    type Target = NodeHandle;

    fn deref(&self) -> &NodeHandle {
        &self.handle
    }
}

impl AsRef<NodeHandle> for Node {
    fn as_ref(&self) -> &NodeHandle {
        &self.handle
    }
}

impl AsRef<NodeHandle> for NodeHandle {
    fn as_ref(&self) -> &NodeHandle {
        self
    }
}

impl NodeHandle {
    pub(crate) fn create(&self, pod: Pod) {
        let _ = self.cmd.send(Cmd::Create(pod));
    }

    pub(crate) fn delete(&self, key: String, send_event: bool) {
        let _ = self.cmd.send(Cmd::Delete { key, send_event });
    }

    /// Waits until every command sent so far was handled.
    pub(crate) async fn flush(&self) {
        let (tx, rx) = oneshot::channel();
        if self.cmd.send(Cmd::Flush(tx)).is_ok() {
            let _ = rx.await;
        }
    }

    pub(crate) fn is_connected(&self) -> bool {
        self.connected.load(Ordering::Relaxed)
    }

    /// The node's truth: endpoint key -> identity (0: not allocated yet).
    pub(crate) fn truth(&self) -> Vec<(String, u32)> {
        self.state
            .lock()
            .iter()
            .map(|(k, h)| (k.clone(), h.identity))
            .collect()
    }

    /// Whether one of this node's endpoints uses `id`.
    pub(crate) fn holds(&self, id: u32) -> bool {
        self.state.lock().values().any(|h| h.identity == id)
    }

    pub(crate) fn endpoints(&self) -> usize {
        self.state.lock().len()
    }
}

/// Identity -> endpoints referencing it, over all nodes: what refcounts must be.
pub(crate) fn truth_refs<N: AsRef<NodeHandle>>(nodes: &[N]) -> BTreeMap<u32, u64> {
    let mut refs = BTreeMap::new();
    for node in nodes {
        for (_, id) in node.as_ref().truth() {
            if id != 0 {
                *refs.entry(id).or_insert(0) += 1;
            }
        }
    }
    refs
}

struct Agent {
    fleet: Fleet,
    index: usize,
    node: String,
    session: pb::Session,
    seq: u64,
    state: Arc<Mutex<BTreeMap<String, Held>>>,
    connected: Arc<std::sync::atomic::AtomicBool>,
    share_known: bool,
}

/// Why a connection ended.
enum Ended {
    Stop,
    Broken,
}

/// An open EndpointSync stream.
struct Stream {
    tx: mpsc::Sender<pb::AgentMessage>,
    inbound: tonic::Streaming<pb::OperatorMessage>,
    interval: Duration,
    next_snapshot: Instant,
    sent: HashMap<u64, Instant>,
}

fn jittered(interval: Duration) -> Duration {
    interval.mul_f64(rand::rng().random_range(0.9..1.1))
}

impl Agent {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Cmd>, pods: Vec<Pod>) {
        for pod in pods {
            let key = pod.key();
            // Allocated before the stream exists: the node is not known yet, so the
            // first Allocate would be refused. Done after Hello, below.
            self.state.lock().insert(key, Held { pod, identity: 0 });
        }
        let mut pending: VecDeque<Cmd> = VecDeque::new();
        let mut backoff = Duration::from_millis(100);
        loop {
            let Some(mut stream) = self.open().await else {
                self.connected.store(false, Ordering::Relaxed);
                sleep(jittered(backoff)).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            };
            backoff = Duration::from_millis(100);
            if !self.allocate_unresolved().await {
                self.connected.store(false, Ordering::Relaxed);
                continue;
            }
            if self.send_snapshot(&mut stream).await.is_err() {
                continue;
            }
            self.connected.store(true, Ordering::Relaxed);
            match self.serve(&mut stream, &mut rx, &mut pending).await {
                Ended::Stop => {
                    self.connected.store(false, Ordering::Relaxed);
                    return;
                }
                Ended::Broken => {
                    self.connected.store(false, Ordering::Relaxed);
                    self.fleet
                        .observed
                        .reconnects
                        .fetch_add(1, Ordering::Relaxed);
                    sleep(jittered(Duration::from_millis(200))).await;
                }
            }
        }
    }

    async fn open(&mut self) -> Option<Stream> {
        let (tx, rx) = mpsc::channel(64);
        let hello = pb::AgentMessage {
            seq: 0,
            body: Some(Body::Hello(pb::Hello {
                protocol_version: PROTOCOL_VERSION,
                node: self.node.clone(),
                session: Some(self.session),
                agent_version: "census-bench".into(),
                addresses: Vec::new(),
            })),
        };
        tx.send(hello).await.ok()?;
        let mut client = EndpointSyncClient::new(self.fleet.channel(self.index))
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20);
        let mut inbound = client
            .sync(ReceiverStream::new(rx))
            .await
            .ok()?
            .into_inner();
        let first = inbound.message().await.ok()??;
        let Some(operator_message::Body::HelloReply(reply)) = first.body else {
            return None;
        };
        let interval = Duration::from_millis(reply.snapshot_interval_ms.max(100));
        Some(Stream {
            tx,
            inbound,
            interval,
            next_snapshot: Instant::now() + jittered(interval),
            sent: HashMap::new(),
        })
    }

    /// Allocates identities for pods that have none yet (the start-up pods).
    async fn allocate_unresolved(&mut self) -> bool {
        let missing: Vec<(String, Labels)> = self
            .state
            .lock()
            .iter()
            .filter(|(_, h)| h.identity == 0)
            .map(|(k, h)| (k.clone(), h.pod.labels.clone()))
            .collect();
        for (key, labels) in missing {
            let known = if self.share_known {
                self.fleet.known.lock().get(&labels).copied()
            } else {
                None
            };
            let id = match known {
                Some(id) => id,
                None => match self.allocate(&labels).await {
                    Ok(id) => id,
                    Err(_) => return false,
                },
            };
            if let Some(h) = self.state.lock().get_mut(&key) {
                h.identity = id;
            }
        }
        true
    }

    /// One Allocate, retried while the operator says to retry later. An error means
    /// the connection is broken (or this node's session is unknown there: the
    /// operator restarted), so the caller reconnects first.
    async fn allocate(&self, labels: &Labels) -> Result<u32, tonic::Status> {
        let started = Instant::now();
        let mut client = IdentityServiceClient::new(self.fleet.channel(self.index));
        let mut attempt = 0u32;
        loop {
            let request = pb::AllocateRequest {
                protocol_version: PROTOCOL_VERSION,
                node: self.node.clone(),
                session: Some(self.session),
                labels: labels.as_ref().clone(),
                allocation: 0,
            };
            match client.allocate(request).await {
                Ok(resp) => {
                    let identity = resp.into_inner().identity.unwrap_or_default();
                    self.fleet.observed.bind(identity.id, &identity.labels);
                    if self.share_known {
                        self.fleet.known.lock().insert(labels.clone(), identity.id);
                    }
                    self.fleet
                        .observed
                        .allocate_latency
                        .lock()
                        .push(started.elapsed());
                    return Ok(identity.id);
                }
                Err(status)
                    if matches!(status.code(), Code::Unavailable | Code::ResourceExhausted)
                        && attempt < 20 =>
                {
                    attempt += 1;
                    self.fleet
                        .observed
                        .allocate_retries
                        .fetch_add(1, Ordering::Relaxed);
                    sleep(jittered(Duration::from_millis(50) * attempt)).await;
                }
                Err(status) => return Err(status),
            }
        }
    }

    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    async fn send(&mut self, stream: &mut Stream, body: Body) -> Result<u64, ()> {
        let seq = self.next_seq();
        stream
            .tx
            .send(pb::AgentMessage {
                seq,
                body: Some(body),
            })
            .await
            .map_err(|_| ())?;
        Ok(seq)
    }

    async fn send_snapshot(&mut self, stream: &mut Stream) -> Result<(), ()> {
        let endpoints: Vec<pb::Endpoint> = self
            .state
            .lock()
            .values()
            .filter(|h| h.identity != 0)
            .map(|h| wire(&h.pod, h.identity))
            .collect();
        let seq = self
            .send(
                stream,
                Body::Snapshot(pb::Snapshot {
                    endpoints,
                    allocations_settled: 0,
                }),
            )
            .await?;
        stream.sent.insert(seq, Instant::now());
        stream.next_snapshot = Instant::now() + jittered(stream.interval);
        self.fleet
            .observed
            .snapshots_sent
            .fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    async fn serve(
        &mut self,
        stream: &mut Stream,
        rx: &mut mpsc::UnboundedReceiver<Cmd>,
        pending: &mut VecDeque<Cmd>,
    ) -> Ended {
        loop {
            if let Some(cmd) = pending.pop_front() {
                match self.handle(stream, cmd, pending).await {
                    Ok(true) => continue,
                    Ok(false) => return Ended::Stop,
                    Err(()) => return Ended::Broken,
                }
            }
            tokio::select! {
                cmd = rx.recv() => match cmd {
                    Some(cmd) => pending.push_back(cmd),
                    None => return Ended::Stop,
                },
                () = sleep_until(stream.next_snapshot) => {
                    if self.send_snapshot(stream).await.is_err() {
                        return Ended::Broken;
                    }
                }
                msg = stream.inbound.message() => match msg {
                    Ok(Some(msg)) => {
                        if self.on_message(stream, msg).await.is_err() {
                            return Ended::Broken;
                        }
                    }
                    Ok(None) | Err(_) => return Ended::Broken,
                },
            }
        }
    }

    /// `Ok(false)`: stop. `Err`: the connection broke; the command is kept.
    async fn handle(
        &mut self,
        stream: &mut Stream,
        cmd: Cmd,
        pending: &mut VecDeque<Cmd>,
    ) -> Result<bool, ()> {
        match cmd {
            Cmd::Stop => return Ok(false),
            Cmd::Flush(done) => {
                let _ = done.send(());
            }
            Cmd::Create(pod) => {
                let id = match self.allocate(&pod.labels).await {
                    Ok(id) => id,
                    Err(_) => {
                        pending.push_front(Cmd::Create(pod));
                        return Err(());
                    }
                };
                let endpoint = wire(&pod, id);
                self.state
                    .lock()
                    .insert(pod.key(), Held { pod, identity: id });
                let upsert = Body::Upsert(pb::EndpointUpsert {
                    endpoint: Some(endpoint),
                });
                self.send(stream, upsert).await?;
            }
            Cmd::Delete { key, send_event } => {
                let removed = self.state.lock().remove(&key);
                let Some(held) = removed else { return Ok(true) };
                if send_event {
                    self.fleet
                        .observed
                        .deletes_sent
                        .fetch_add(1, Ordering::Relaxed);
                    let delete = Body::Delete(pb::EndpointDelete {
                        namespace: held.pod.namespace,
                        name: held.pod.name,
                    });
                    self.send(stream, delete).await?;
                } else {
                    self.fleet
                        .observed
                        .deletes_dropped
                        .fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        Ok(true)
    }

    async fn on_message(
        &mut self,
        stream: &mut Stream,
        msg: pb::OperatorMessage,
    ) -> Result<(), ()> {
        match msg.body {
            Some(operator_message::Body::Ack(ack)) => {
                if let Some(sent) = stream.sent.remove(&ack.seq) {
                    self.fleet
                        .observed
                        .snapshot_acks
                        .lock()
                        .push(sent.elapsed());
                }
                if ack.ignored {
                    self.fleet
                        .observed
                        .acks_ignored
                        .fetch_add(1, Ordering::Relaxed);
                }
            }
            Some(operator_message::Body::Rebind(rebind)) => {
                self.fleet.observed.rebinds.fetch_add(1, Ordering::Relaxed);
                let key = format!("{}/{}", rebind.namespace, rebind.name);
                if let Some(h) = self.state.lock().get_mut(&key) {
                    h.identity = rebind.identity;
                }
            }
            Some(operator_message::Body::SnapshotRequest(_)) => {
                self.send_snapshot(stream).await?;
            }
            Some(operator_message::Body::HelloReply(_)) | None => {}
        }
        Ok(())
    }
}

fn wire(pod: &Pod, identity: u32) -> pb::Endpoint {
    pb::Endpoint {
        namespace: pod.namespace.clone(),
        name: pod.name.clone(),
        ips: vec![pod.ip.clone()],
        identity,
        labels: pod.labels.as_ref().clone(),
    }
}

/// An address in 198.18.0.0/15 (benchmarking range; nothing is ever sent to it).
pub(crate) fn pod_ip(n: usize) -> String {
    let n = n % (1 << 17);
    format!("198.{}.{}.{}", 18 + (n >> 16), (n >> 8) & 0xff, n & 0xff)
}

/// The address of pod `n` in 10.0.0.0/8: unique for every pod of 5,000 nodes and their
/// churn, so the endpoint map holds one entry per pod (nothing is ever sent to it).
pub(crate) fn wide_pod_ip(n: usize) -> String {
    std::net::Ipv4Addr::from(0x0a00_0000 | (n as u32 & 0x00ff_ffff)).to_string()
}

/// Keeps a Watch on the operator (reconnecting across restarts) and records every
/// binding it announces, and every id it removes.
pub(crate) fn watch_bindings(
    fleet: &Fleet,
    removed: Arc<Mutex<Vec<(Instant, u32)>>>,
) -> JoinHandle<()> {
    let fleet = fleet.clone();
    tokio::spawn(async move {
        loop {
            let mut client = fleet.identity_client(0);
            let request = pb::WatchRequest {
                protocol_version: PROTOCOL_VERSION,
            };
            if let Ok(resp) = client.watch(request).await {
                let mut events = resp.into_inner();
                while let Ok(Some(event)) = events.message().await {
                    let Some(identity) = event.identity else {
                        continue;
                    };
                    match pb::watch_event::Kind::try_from(event.kind) {
                        Ok(pb::watch_event::Kind::Upsert) => {
                            fleet.observed.bind(identity.id, &identity.labels);
                        }
                        Ok(pb::watch_event::Kind::Removed) => {
                            removed.lock().push((Instant::now(), identity.id));
                        }
                        _ => {}
                    }
                }
            }
            sleep(Duration::from_millis(200)).await;
        }
    })
}

/// The operator's identities, via List: id -> (references, state, labels).
pub(crate) async fn list_identities(fleet: &Fleet) -> anyhow::Result<BTreeMap<u32, pb::Identity>> {
    let mut client = fleet.identity_client(0);
    let mut out = BTreeMap::new();
    let mut token = String::new();
    loop {
        let page = client
            .list(pb::ListRequest {
                protocol_version: PROTOCOL_VERSION,
                page_size: 5000,
                page_token: token,
                selector: Vec::new(),
                include_quarantined: false,
            })
            .await
            .context("List")?
            .into_inner();
        for identity in page.identities {
            out.insert(identity.id, identity);
        }
        if page.next_page_token.is_empty() {
            return Ok(out);
        }
        token = page.next_page_token;
    }
}
