//! The EndpointSync client: one stream to the operator per connection, for the
//! whole life of the process's session.
//!
//! - Hello first (protocol version, node, the session: agent start time in ns and a
//!   random nonce, one per process), then the operator's HelloReply: its label
//!   filter and limits go to the core, its interval paces snapshots.
//! - A full Snapshot at once after every (re)connect, then every interval (jittered
//!   ±10%); Upsert/Delete deltas as the core reports changes. Every message after
//!   Hello carries the next `seq` of the session (from 1, across reconnects).
//! - The core's reports are applied to a mirror of what the agent holds, connected or
//!   not, so a snapshot is always "the state after every delta up to its seq". A
//!   delta that does not fit in the outgoing queue is dropped and covered by a
//!   snapshot sent as soon as there is room: the stream never blocks the agent.
//! - Acks record the last seq applied, Rebinds go to the core, a SnapshotRequest
//!   sends one now. An Ack's rejected and pending entries go to the core as a
//!   [`Verdict`] on what its message carried (a snapshot: every endpoint; a delta:
//!   its own), so an endpoint the operator rejected is marked until it is fixed; the
//!   entry is still sent (the operator rejects it alone, the stream stays up).
//! - When the stream fails the agent reconnects after a capped, jittered,
//!   exponential backoff. Meanwhile nothing else changes: the datapath keeps its
//!   state (fail-static) and the agent stays Ready; the status says it is
//!   disconnected.
//! - No snapshot is sent before the core has the source's first full set, so a
//!   restarted agent never tells the operator its node is empty while it is merely
//!   still reading its source.

use std::{
    collections::{BTreeMap, BTreeSet, VecDeque},
    sync::Arc,
    time::{Duration, SystemTime},
};

use census_proto::{
    PROTOCOL_VERSION,
    convert::{
        endpoint_key_from_wire, endpoint_to_wire, filter_from_wire, identity_from_wire,
        session_to_wire,
    },
    domain::{Endpoint, EndpointKey, IdentityId, NodeName, SessionId},
    labels::LabelLimits,
    pb::{self, agent_message::Body, endpoint_sync_client::EndpointSyncClient, operator_message},
    status::code_label,
};
use parking_lot::Mutex;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Streaming, transport::Channel};
use tracing::{Instrument as _, debug, info, info_span, warn};

use crate::{
    backoff::{Backoff, jittered},
    endpoints::{LabelSettings, Verdict, VerdictScope},
    metrics::Metrics,
    shutdown::stopped,
};

/// A change of what the agent holds, from the core.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Report {
    Upsert(Endpoint),
    Delete(EndpointKey),
}

/// What the operator tells the core.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SyncEvent {
    Settings(LabelSettings),
    Rebind {
        key: EndpointKey,
        id: IdentityId,
    },
    /// What an Ack said of the entries of its message.
    Verdict(Verdict),
}

/// The stream's state, for `/readyz`, the endpoints API and metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SyncStatus {
    pub connected: bool,
    pub last_ack_seq: u64,
    /// Why the last stream ended or could not start.
    pub last_error: Option<String>,
    /// Since when the stream has been up, or down.
    pub since: Option<SystemTime>,
    pub snapshots_sent: u64,
}

/// Messages queued towards the operator.
const OUTBOUND: usize = 256;
/// How long the operator may take to answer Hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(15);
/// The interval until the operator says otherwise.
const DEFAULT_INTERVAL: Duration = Duration::from_secs(30);
/// Largest message accepted from the operator.
const MAX_DECODING: usize = 16 * 1024 * 1024;
/// Messages sent and not acked yet that are remembered, to know what an Ack speaks
/// for; an operator that does not ack costs no more than this.
const MAX_UNACKED: usize = 4 * OUTBOUND;

/// What a message sent carried, for its Ack.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Sent {
    Snapshot,
    Delta(EndpointKey),
}

/// The client; see the module documentation.
#[derive(Debug)]
pub(crate) struct SyncClient {
    pub channel: Channel,
    pub node: NodeName,
    pub session: SessionId,
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    pub metrics: Metrics,
    pub status: Arc<Mutex<SyncStatus>>,
    /// True while a stream is up (the operator knows this session: Allocate works).
    pub connected: watch::Sender<bool>,
}

/// What woke the connected loop.
enum Step<'a> {
    Stop,
    Report(Option<Report>),
    ReadyChanged(bool),
    Message(Result<Option<pb::OperatorMessage>, tonic::Status>),
    Timer,
    Room(Option<mpsc::Permit<'a, pb::AgentMessage>>),
}

/// How a stream ended.
enum Ended {
    Shutdown,
    Failed(String),
}

/// The limits the operator set in HelloReply.
#[derive(Debug, Clone, Copy)]
struct Limits {
    max_snapshot_endpoints: usize,
}

/// Everything that outlives one stream.
struct State {
    reports: mpsc::UnboundedReceiver<Report>,
    events: mpsc::Sender<SyncEvent>,
    ready: watch::Receiver<bool>,
    shutdown: watch::Receiver<bool>,
    mirror: BTreeMap<EndpointKey, pb::Endpoint>,
    seq: u64,
    streams: u64,
    interval: Duration,
    limits: Limits,
    /// This stream's messages not acked yet, by seq.
    unacked: VecDeque<(u64, Sent)>,
    /// Endpoints the operator's last Acks left rejected or pending: an Ack that
    /// neither names one nor speaks for one of these changes nothing in the core.
    flagged: BTreeSet<EndpointKey>,
}

impl State {
    fn apply(&mut self, report: &Report) {
        match report {
            Report::Upsert(endpoint) => {
                self.mirror
                    .insert(endpoint.key.clone(), endpoint_to_wire(endpoint));
            }
            Report::Delete(key) => {
                self.mirror.remove(key);
            }
        }
    }

    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    fn sent(&mut self, seq: u64, sent: Sent) {
        if self.unacked.len() >= MAX_UNACKED {
            // Its verdict is lost; the next snapshot's Ack says it again.
            self.unacked.pop_front();
        }
        self.unacked.push_back((seq, sent));
    }

    /// What the message acked by `seq` carried; older ones were never acked.
    fn acked(&mut self, seq: u64) -> Option<Sent> {
        while let Some((front, _)) = self.unacked.front() {
            if *front > seq {
                return None;
            }
            let (front, sent) = self.unacked.pop_front()?;
            if front == seq {
                return Some(sent);
            }
        }
        None
    }
}

impl SyncClient {
    /// Runs until `shutdown`. `reports` come from the core, `events` go to it;
    /// `ready` turns true once the core has the source's first full set.
    pub(crate) async fn run(
        self,
        reports: mpsc::UnboundedReceiver<Report>,
        events: mpsc::Sender<SyncEvent>,
        ready: watch::Receiver<bool>,
        shutdown: watch::Receiver<bool>,
    ) {
        let span = info_span!("sync", node = %self.node, session = %self.session);
        self.run_inner(reports, events, ready, shutdown)
            .instrument(span)
            .await;
    }

    async fn run_inner(
        self,
        reports: mpsc::UnboundedReceiver<Report>,
        events: mpsc::Sender<SyncEvent>,
        ready: watch::Receiver<bool>,
        shutdown: watch::Receiver<bool>,
    ) {
        let mut state = State {
            reports,
            events,
            ready,
            shutdown,
            mirror: BTreeMap::new(),
            seq: 0,
            streams: 0,
            interval: DEFAULT_INTERVAL,
            limits: Limits {
                max_snapshot_endpoints: usize::MAX,
            },
            unacked: VecDeque::new(),
            flagged: BTreeSet::new(),
        };
        let mut backoff = Backoff::new(self.initial_backoff, self.max_backoff);
        loop {
            let error = match self.stream(&mut state, &mut backoff).await {
                Ended::Shutdown => return,
                Ended::Failed(error) => error,
            };
            self.connected.send_replace(false);
            let was_connected = {
                let mut status = self.status.lock();
                let was = status.connected;
                status.connected = false;
                status.last_error = Some(error.clone());
                if was || status.since.is_none() {
                    status.since = Some(SystemTime::now());
                }
                was
            };
            let delay = backoff.next_delay();
            if was_connected {
                warn!(%error, retry_in = ?delay, "lost the operator; the datapath keeps its state");
            } else {
                debug!(%error, retry_in = ?delay, "cannot reach the operator");
            }
            // Keep the mirror current while waiting.
            let sleep = tokio::time::sleep(delay);
            tokio::pin!(sleep);
            loop {
                let report = tokio::select! {
                    () = &mut sleep => break,
                    report = state.reports.recv() => report,
                    () = stopped(&mut state.shutdown) => return,
                };
                match report {
                    Some(report) => state.apply(&report),
                    None => return,
                }
            }
        }
    }

    /// One stream, from Hello to its end.
    async fn stream(&self, state: &mut State, backoff: &mut Backoff) -> Ended {
        // What the last stream sent and did not get acked is gone with it.
        state.unacked.clear();
        let (tx, rx) = mpsc::channel::<pb::AgentMessage>(OUTBOUND);
        let hello = pb::AgentMessage {
            seq: 0,
            body: Some(Body::Hello(pb::Hello {
                protocol_version: PROTOCOL_VERSION,
                node: self.node.to_string(),
                session: Some(session_to_wire(self.session)),
                agent_version: env!("CARGO_PKG_VERSION").to_owned(),
            })),
        };
        if tx.try_send(hello).is_err() {
            return Ended::Failed("cannot queue Hello".to_owned());
        }
        let mut client =
            EndpointSyncClient::new(self.channel.clone()).max_decoding_message_size(MAX_DECODING);
        let opened = tokio::select! {
            opened = tokio::time::timeout(HELLO_TIMEOUT, async {
                let mut inbound = client.sync(ReceiverStream::new(rx)).await?.into_inner();
                let first = inbound.message().await?;
                Ok::<_, tonic::Status>((inbound, first))
            }) => opened,
            () = stopped(&mut state.shutdown) => return Ended::Shutdown,
        };
        let (mut inbound, first) = match opened {
            Err(_) => return Ended::Failed("the operator did not answer Hello in time".to_owned()),
            Ok(Err(status)) => return Ended::Failed(describe(&status)),
            Ok(Ok(opened)) => opened,
        };
        let reply = match first.and_then(|m| m.body) {
            Some(operator_message::Body::HelloReply(reply)) => reply,
            other => {
                return Ended::Failed(format!(
                    "the operator's first message is not HelloReply: {other:?}"
                ));
            }
        };
        if let Err(error) = self.apply_hello_reply(state, &reply).await {
            return Ended::Failed(error);
        }
        state.streams += 1;
        if state.streams > 1 {
            self.metrics.reconnects.inc();
        }
        backoff.reset();
        {
            let mut status = self.status.lock();
            status.connected = true;
            status.last_error = None;
            status.since = Some(SystemTime::now());
        }
        self.connected.send_replace(true);
        info!(operator_version = %reply.operator_version, interval = ?state.interval, "connected to the operator");
        self.connected(state, &tx, &mut inbound).await
    }

    async fn apply_hello_reply(
        &self,
        state: &mut State,
        reply: &pb::HelloReply,
    ) -> Result<(), String> {
        if reply.protocol_version != PROTOCOL_VERSION {
            return Err(format!(
                "the operator speaks protocol version {}, this agent {PROTOCOL_VERSION}",
                reply.protocol_version
            ));
        }
        let filter = filter_from_wire(reply.filter.as_ref()).map_err(|e| e.to_string())?;
        let limits = reply.limits.unwrap_or_default();
        let positive = |n: u32, default: usize| {
            usize::try_from(n)
                .ok()
                .filter(|&n| n > 0)
                .unwrap_or(default)
        };
        let settings = LabelSettings {
            filter,
            limits: LabelLimits {
                max_labels: positive(limits.max_labels, LabelLimits::default().max_labels),
            },
            max_ips: positive(limits.max_ips_per_endpoint, 16),
        };
        state.limits = Limits {
            max_snapshot_endpoints: positive(limits.max_snapshot_endpoints, usize::MAX),
        };
        state.interval = match reply.snapshot_interval_ms {
            0 => DEFAULT_INTERVAL,
            ms => Duration::from_millis(ms),
        };
        state
            .events
            .send(SyncEvent::Settings(settings))
            .await
            .map_err(|_| "the agent is stopping".to_owned())
    }

    /// The connected stream's loop.
    async fn connected(
        &self,
        state: &mut State,
        tx: &mpsc::Sender<pb::AgentMessage>,
        inbound: &mut Streaming<pb::OperatorMessage>,
    ) -> Ended {
        let mut snapshot_due = true;
        let timer = tokio::time::sleep(jittered(state.interval, 0.1));
        tokio::pin!(timer);
        loop {
            let ready = *state.ready.borrow();
            let step = tokio::select! {
                () = stopped(&mut state.shutdown) => Step::Stop,
                report = state.reports.recv() => Step::Report(report),
                changed = state.ready.changed() => Step::ReadyChanged(changed.is_ok()),
                message = inbound.message() => Step::Message(message),
                () = &mut timer => Step::Timer,
                permit = tx.reserve(), if ready && snapshot_due => Step::Room(permit.ok()),
            };
            match step {
                Step::Stop | Step::Report(None) | Step::ReadyChanged(false) => {
                    return Ended::Shutdown;
                }
                Step::Report(Some(report)) => {
                    state.apply(&report);
                    if ready && !snapshot_due {
                        self.send_delta(state, tx, report, &mut snapshot_due);
                    }
                }
                Step::ReadyChanged(true) => {}
                Step::Message(Ok(Some(message))) => {
                    if let Some(ended) = self.handle(state, message, &mut snapshot_due).await {
                        return ended;
                    }
                }
                Step::Message(Ok(None)) => {
                    return Ended::Failed("the operator ended the stream".to_owned());
                }
                Step::Message(Err(status)) => return Ended::Failed(describe(&status)),
                Step::Timer => {
                    snapshot_due = true;
                    timer
                        .as_mut()
                        .reset(tokio::time::Instant::now() + jittered(state.interval, 0.1));
                }
                Step::Room(None) => return Ended::Failed("the stream closed".to_owned()),
                Step::Room(Some(permit)) => {
                    if let Some(snapshot) = self.snapshot(state) {
                        permit.send(snapshot);
                        self.metrics.snapshots_sent.inc();
                        self.status.lock().snapshots_sent += 1;
                    }
                    snapshot_due = false;
                    timer
                        .as_mut()
                        .reset(tokio::time::Instant::now() + jittered(state.interval, 0.1));
                }
            }
        }
    }

    fn send_delta(
        &self,
        state: &mut State,
        tx: &mpsc::Sender<pb::AgentMessage>,
        report: Report,
        snapshot_due: &mut bool,
    ) {
        let (key, body) = match report {
            Report::Upsert(endpoint) => (
                endpoint.key.clone(),
                Body::Upsert(pb::EndpointUpsert {
                    endpoint: Some(endpoint_to_wire(&endpoint)),
                }),
            ),
            Report::Delete(key) => {
                let body = Body::Delete(pb::EndpointDelete {
                    namespace: key.namespace().to_owned(),
                    name: key.name().to_owned(),
                });
                (key, body)
            }
        };
        match tx.try_reserve() {
            Ok(permit) => {
                let seq = state.next_seq();
                state.sent(seq, Sent::Delta(key));
                permit.send(pb::AgentMessage {
                    seq,
                    body: Some(body),
                });
                self.metrics.deltas_sent.inc();
            }
            Err(_) => {
                self.metrics.deltas_dropped.inc();
                *snapshot_due = true;
            }
        }
    }

    /// The mirror as a snapshot message, or `None` (and an error log) when it is
    /// over the operator's limit, which would end the stream.
    fn snapshot(&self, state: &mut State) -> Option<pb::AgentMessage> {
        let count = state.mirror.len();
        if count > state.limits.max_snapshot_endpoints {
            warn!(
                endpoints = count,
                limit = state.limits.max_snapshot_endpoints,
                "more endpoints than the operator accepts in a snapshot; not sending it"
            );
            return None;
        }
        let seq = state.next_seq();
        state.sent(seq, Sent::Snapshot);
        debug!(seq, endpoints = count, "sending a snapshot");
        Some(pb::AgentMessage {
            seq,
            body: Some(Body::Snapshot(pb::Snapshot {
                endpoints: state.mirror.values().cloned().collect(),
            })),
        })
    }

    /// One message from the operator; `Some` ends the stream.
    async fn handle(
        &self,
        state: &mut State,
        message: pb::OperatorMessage,
        snapshot_due: &mut bool,
    ) -> Option<Ended> {
        match message.body {
            Some(operator_message::Body::Ack(ack)) => {
                {
                    let mut status = self.status.lock();
                    status.last_ack_seq = status.last_ack_seq.max(ack.seq);
                }
                if ack.corrections > 0 {
                    debug!(
                        seq = ack.seq,
                        corrections = ack.corrections,
                        "the operator corrected its view"
                    );
                }
                if let Some(verdict) = self.verdict(state, &ack)
                    && state
                        .events
                        .send(SyncEvent::Verdict(verdict))
                        .await
                        .is_err()
                {
                    return Some(Ended::Shutdown);
                }
            }
            Some(operator_message::Body::Rebind(rebind)) => {
                self.metrics.rebinds.inc();
                let key = endpoint_key_from_wire(&rebind.namespace, &rebind.name, "rebind");
                let id = identity_from_wire(rebind.identity, "rebind.identity");
                match (key, id) {
                    (Ok(key), Ok(id)) => {
                        if state
                            .events
                            .send(SyncEvent::Rebind { key, id })
                            .await
                            .is_err()
                        {
                            return Some(Ended::Shutdown);
                        }
                    }
                    (Err(error), _) | (_, Err(error)) => {
                        warn!(%error, "ignoring an invalid Rebind");
                    }
                }
            }
            Some(operator_message::Body::SnapshotRequest(_)) => *snapshot_due = true,
            Some(operator_message::Body::HelloReply(reply)) => {
                if let Err(error) = self.apply_hello_reply(state, &reply).await {
                    return Some(Ended::Failed(error));
                }
            }
            None => debug!("ignoring an empty message from the operator"),
        }
        None
    }

    /// What `ack` says of the entries of its message, if that can change a mark.
    fn verdict(&self, state: &mut State, ack: &pb::Ack) -> Option<Verdict> {
        if !ack.ignored {
            self.metrics
                .rejected_entries
                .inc_by(ack.rejected.len() as u64);
        }
        let sent = state.acked(ack.seq)?;
        if ack.ignored {
            return None;
        }
        let key = |namespace: &str, name: &str| {
            endpoint_key_from_wire(namespace, name, "ack")
                .inspect_err(
                    |error| debug!(%error, "the Ack names an endpoint this agent never sent"),
                )
                .ok()
        };
        let mut rejected = BTreeMap::new();
        for entry in &ack.rejected {
            if let Some(key) = key(&entry.namespace, &entry.name) {
                // Of two reasons for one key (a duplicate), the first.
                rejected.entry(key).or_insert_with(|| entry.reason.clone());
            }
        }
        let pending: BTreeSet<EndpointKey> = ack
            .pending
            .iter()
            .filter_map(|p| key(&p.namespace, &p.name))
            .collect();
        let named = rejected.keys().chain(&pending);
        let scope = match sent {
            Sent::Snapshot => {
                let flagged: BTreeSet<EndpointKey> = named.cloned().collect();
                if flagged.is_empty() && state.flagged.is_empty() {
                    return None;
                }
                state.flagged = flagged;
                VerdictScope::All
            }
            Sent::Delta(key) => {
                let now = rejected.contains_key(&key) || pending.contains(&key);
                let before = if now {
                    !state.flagged.insert(key.clone())
                } else {
                    state.flagged.remove(&key)
                };
                if !now && !before {
                    return None;
                }
                VerdictScope::One(key)
            }
        };
        Some(Verdict {
            scope,
            rejected,
            pending,
        })
    }
}

fn describe(status: &tonic::Status) -> String {
    format!("{}: {}", code_label(status.code()), status.message())
}

#[cfg(test)]
mod tests {
    use std::{collections::BTreeMap, time::Duration};

    use census_proto::{
        domain::canonical_ips,
        labels::{LabelFilter, LabelSet},
        pb::identity_service_client::IdentityServiceClient,
    };
    use census_testkit::{
        Operator, TestResult, identity, lazy_channel, node, node as node_info, until_some,
    };
    use tokio::task::JoinHandle;

    use super::*;
    use crate::{
        admin::api,
        daemon::new_session,
        endpoints::{Effects, Endpoints},
        source::{HostInterface, SourceEndpoint, SourceEvent},
    };

    const WAIT: Duration = Duration::from_secs(10);

    struct Client {
        reports: mpsc::UnboundedSender<Report>,
        events: mpsc::Receiver<SyncEvent>,
        ready: watch::Sender<bool>,
        stop: watch::Sender<bool>,
        status: Arc<Mutex<SyncStatus>>,
        metrics: Metrics,
        session: SessionId,
        task: JoinHandle<()>,
    }

    fn start(
        channel: Channel,
        node: &str,
    ) -> Result<Client, Box<dyn std::error::Error + Send + Sync>> {
        let (reports, reports_rx) = mpsc::unbounded_channel();
        let (events_tx, events) = mpsc::channel(16);
        let (ready, ready_rx) = watch::channel(false);
        let (stop, stop_rx) = watch::channel(false);
        let status = Arc::new(Mutex::new(SyncStatus::default()));
        let metrics = Metrics::default();
        let session = new_session();
        let client = SyncClient {
            channel,
            node: NodeName::new(node)?,
            session,
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_millis(200),
            metrics: metrics.clone(),
            status: status.clone(),
            connected: watch::channel(false).0,
        };
        let task = tokio::spawn(client.run(reports_rx, events_tx, ready_rx, stop_rx));
        Ok(Client {
            reports,
            events,
            ready,
            stop,
            status,
            metrics,
            session,
            task,
        })
    }

    fn labels(app: &str) -> Result<LabelSet, census_proto::labels::LabelError> {
        LabelSet::for_pod(
            &BTreeMap::from([("app".to_owned(), app.to_owned())]),
            "default",
            "default",
            &LabelFilter::default(),
            &LabelLimits::default(),
        )
    }

    async fn allocate(
        channel: &Channel,
        node: &str,
        session: SessionId,
        labels: &LabelSet,
    ) -> Result<IdentityId, Box<dyn std::error::Error + Send + Sync>> {
        let response = IdentityServiceClient::new(channel.clone())
            .allocate(pb::AllocateRequest {
                protocol_version: PROTOCOL_VERSION,
                node: node.to_owned(),
                session: Some(session_to_wire(session)),
                labels: labels.to_strings(),
            })
            .await?
            .into_inner();
        let id = response.identity.map(|i| i.id).unwrap_or_default();
        Ok(IdentityId::new(id).ok_or("no identity")?)
    }

    fn endpoint(
        name: &str,
        ip: &str,
        id: IdentityId,
        labels: &LabelSet,
    ) -> Result<Endpoint, Box<dyn std::error::Error + Send + Sync>> {
        Ok(Endpoint {
            key: EndpointKey::new("default", name)?,
            ips: canonical_ips(vec![ip.parse()?]),
            identity: id,
            labels: labels.clone(),
        })
    }

    async fn refs(channel: &Channel, id: IdentityId) -> u64 {
        identity(channel, id.get())
            .await
            .map_or(0, |i| i.references)
    }

    #[tokio::test]
    async fn hello_snapshot_deltas_and_rebind() -> TestResult {
        let dir = tempfile::tempdir()?;
        let op = Operator::for_agents(dir.path(), 0).await?;
        let ch = lazy_channel(op.grpc_addr)?;
        let mut client = start(ch.clone(), "n1")?;

        let Some(SyncEvent::Settings(settings)) = client.events.recv().await else {
            return Err("HelloReply's settings come first".into());
        };
        assert_eq!(settings.filter, LabelFilter::default());

        let web = labels("web")?;
        let web_id = allocate(&ch, "n1", client.session, &web).await?;
        client.reports.send(Report::Upsert(endpoint(
            "web-0",
            "198.18.1.2",
            web_id,
            &web,
        )?))?;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let before = node(&ch, "n1").await.ok_or("the node said Hello")?;
        assert_eq!(
            before.last_snapshot_ms, 0,
            "no snapshot before the source is read"
        );

        client.ready.send(true)?;
        let seen = until_some(WAIT, || async {
            node(&ch, "n1")
                .await
                .filter(|n| n.endpoints == 1 && n.last_snapshot_ms > 0)
        })
        .await;
        assert!(seen.is_some(), "the snapshot reached the operator");
        assert_eq!(refs(&ch, web_id).await, 1);

        // Deltas.
        client.reports.send(Report::Upsert(endpoint(
            "web-1",
            "198.18.2.2",
            web_id,
            &web,
        )?))?;
        let two = until_some(WAIT, || async {
            (refs(&ch, web_id).await == 2).then_some(())
        })
        .await;
        assert!(two.is_some(), "the upsert counted");
        client
            .reports
            .send(Report::Delete(EndpointKey::new("default", "web-0")?))?;
        let one = until_some(WAIT, || async {
            (refs(&ch, web_id).await == 1).then_some(())
        })
        .await;
        assert!(one.is_some(), "the delete counted");

        // An endpoint claiming web's id for other labels is rebound.
        let db = labels("db")?;
        client
            .reports
            .send(Report::Upsert(endpoint("db-0", "198.18.3.2", web_id, &db)?))?;
        let rebind = tokio::time::timeout(WAIT, async {
            loop {
                match client.events.recv().await {
                    Some(SyncEvent::Rebind { key, id }) => return Some((key, id)),
                    Some(SyncEvent::Settings(_) | SyncEvent::Verdict(_)) => {}
                    None => return None,
                }
            }
        })
        .await?
        .ok_or("no Rebind")?;
        assert_eq!(rebind.0.as_str(), "default/db-0");
        assert_ne!(rebind.1, web_id);
        assert_eq!(client.metrics.rebinds.get(), 1);

        let status = client.status.lock().clone();
        assert!(status.connected);
        assert!(status.last_ack_seq >= 3, "{status:?}");
        assert!(client.metrics.deltas_sent.get() >= 3);

        client.stop.send(true)?;
        client.task.await?;
        op.shut_down().await?;
        Ok(())
    }

    fn pod(name: &str, ip: &str, labels: &[(&str, &str)]) -> TestResult<SourceEndpoint> {
        Ok(SourceEndpoint {
            key: EndpointKey::new("default", name)?,
            ips: canonical_ips(vec![ip.parse()?]),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            service_account: "default".to_owned(),
            interface: HostInterface::Named(format!("veth{name}")),
        })
    }

    /// The agent's core wired to the client as the daemon wires them, logging to a
    /// file the test reads.
    struct Node {
        core: Endpoints,
        logs: tracing::Dispatch,
        log: tempfile::NamedTempFile,
        verdicts: usize,
    }

    impl Node {
        fn new() -> TestResult<Self> {
            let log = tempfile::NamedTempFile::new()?;
            let logs = tracing_subscriber::fmt()
                .with_ansi(false)
                .with_writer(Arc::new(log.reopen()?))
                .finish();
            Ok(Self {
                core: Endpoints::new(&BTreeMap::new()),
                logs: tracing::Dispatch::new(logs),
                log,
                verdicts: 0,
            })
        }

        /// Runs `event` through the core; its allocations are answered `id`.
        fn source(&mut self, client: &Client, event: SourceEvent, id: u32) -> TestResult {
            let mut fx = Effects::default();
            self.core.on_source(event, &mut fx);
            for request in std::mem::take(&mut fx.allocations) {
                let id = IdentityId::new(id).ok_or("id 0")?;
                self.core.allocated(&request.labels, id, &mut fx);
            }
            for report in fx.reports {
                client.reports.send(report)?;
            }
            Ok(())
        }

        /// Feeds the client's events to the core until `done`.
        async fn until(
            &mut self,
            client: &mut Client,
            done: impl Fn(&Self, &Client) -> bool,
        ) -> TestResult {
            let deadline = tokio::time::Instant::now() + WAIT;
            while !done(self, client) {
                let event = tokio::time::timeout_at(deadline, client.events.recv())
                    .await
                    .map_err(|_| "timed out")?
                    .ok_or("the client stopped")?;
                match event {
                    SyncEvent::Verdict(verdict) => {
                        self.verdicts += 1;
                        tracing::dispatcher::with_default(&self.logs, || {
                            self.core.on_verdict(verdict);
                        });
                    }
                    // Not this core's: its label limit stays the default, above the
                    // operator's, as in an agent built with other limits.
                    SyncEvent::Settings(_) | SyncEvent::Rebind { .. } => {}
                }
            }
            Ok(())
        }

        fn state(&self, name: &str) -> Option<(api::EndpointState, Option<String>)> {
            let view = self.core.view();
            let status = view.into_iter().find(|e| e.name == name)?;
            Some((status.state, status.error))
        }

        fn logged(&self, needle: &str) -> TestResult<usize> {
            Ok(std::fs::read_to_string(self.log.path())?
                .lines()
                .filter(|line| line.contains(needle))
                .count())
        }
    }

    /// Issue 10: an entry the operator rejects costs the agent neither its stream nor
    /// its other endpoints; the endpoint is marked, and said once, until it is fixed.
    #[tokio::test]
    async fn an_endpoint_the_operator_rejects_is_marked_and_logged_once_until_fixed() -> TestResult
    {
        let dir = tempfile::tempdir()?;
        let op = Operator::start_in(
            dir.path(),
            &["--max-labels", "3", "--snapshot-interval", "1s"],
        )
        .await?;
        let ch = lazy_channel(op.grpc_addr)?;
        let mut client = start(ch.clone(), "n1")?;
        let mut node = Node::new()?;
        // web-0 has four identity labels (app, tier, namespace, service account).
        let web = [("app", "web"), ("tier", "front")];
        let pods = vec![
            pod("web-0", "198.18.1.2", &web)?,
            pod("db-0", "198.18.3.2", &[("app", "db")])?,
        ];
        node.source(&client, SourceEvent::Reset(pods), 300)?;
        client.ready.send(true)?;

        let marked = |node: &Node, _: &Client| {
            node.state("web-0")
                .is_some_and(|(s, _)| s == api::EndpointState::Error)
        };
        node.until(&mut client, marked).await?;
        let (_, error) = node.state("web-0").ok_or("web-0")?;
        assert_eq!(
            error.as_deref(),
            Some("the operator rejected it: labels: 4 labels exceed the limit of 3")
        );
        assert_eq!(
            node.state("db-0"),
            Some((api::EndpointState::Programmed, None))
        );
        let seen = until_some(WAIT, || async {
            node_info(&ch, "n1").await.filter(|n| n.endpoints == 1)
        })
        .await;
        assert!(seen.is_some(), "db-0 is counted");

        // The snapshots that follow still carry it: rejected again, said once.
        let first = node.verdicts;
        node.until(&mut client, |node, _| node.verdicts >= first + 2)
            .await?;
        assert!(marked(&node, &client));
        assert_eq!(node.logged("the operator rejected the endpoint")?, 1);
        assert_eq!(node.logged("endpoint=default/web-0")?, 1);
        assert!(client.metrics.rejected_entries.get() >= 3);
        assert_eq!(client.metrics.reconnects.get(), 0, "the stream stayed up");

        // Its labels fixed, the operator takes it and the mark goes.
        let fixed = pod("web-0", "198.18.1.2", &[("app", "web")])?;
        node.source(&client, SourceEvent::Upsert(fixed), 301)?;
        node.until(&mut client, |node, _| {
            node.state("web-0") == Some((api::EndpointState::Programmed, None))
        })
        .await?;
        assert_eq!(node.logged("the operator accepts the endpoint now")?, 1);
        let seen = until_some(WAIT, || async {
            node_info(&ch, "n1").await.filter(|n| n.endpoints == 2)
        })
        .await;
        assert!(seen.is_some(), "web-0 is counted");

        client.stop.send(true)?;
        client.task.await?;
        op.shut_down().await?;
        Ok(())
    }

    #[tokio::test]
    async fn reconnects_and_sends_a_snapshot_when_the_operator_is_back() -> TestResult {
        let dir = tempfile::tempdir()?;
        let op = Operator::for_agents(dir.path(), 0).await?;
        let addr = op.grpc_addr;
        let ch = lazy_channel(addr)?;
        let mut client = start(ch.clone(), "n1")?;
        client.ready.send(true)?;
        let Some(SyncEvent::Settings(_)) = client.events.recv().await else {
            return Err("HelloReply's settings come first".into());
        };
        let web = labels("web")?;
        let web_id = allocate(&ch, "n1", client.session, &web).await?;
        client.reports.send(Report::Upsert(endpoint(
            "web-0",
            "198.18.1.2",
            web_id,
            &web,
        )?))?;
        let seen = until_some(WAIT, || async {
            (refs(&ch, web_id).await == 1).then_some(())
        })
        .await;
        assert!(seen.is_some());

        op.shut_down().await?;
        let down = until_some(WAIT, || async {
            (!client.status.lock().connected).then_some(())
        })
        .await;
        assert!(down.is_some(), "the client noticed");
        assert!(client.status.lock().last_error.is_some());
        // A change while the operator is away.
        client.reports.send(Report::Upsert(endpoint(
            "web-1",
            "198.18.2.2",
            web_id,
            &web,
        )?))?;

        let op = Operator::for_agents(dir.path(), addr.port()).await?;
        let back = until_some(WAIT, || async {
            node(&ch, "n1")
                .await
                .filter(|n| n.connected && n.endpoints == 2)
        })
        .await;
        assert!(
            back.is_some(),
            "the snapshot after reconnecting holds both endpoints"
        );
        assert_eq!(refs(&ch, web_id).await, 2);
        assert!(client.metrics.reconnects.get() >= 1);
        assert!(client.status.lock().connected);

        client.stop.send(true)?;
        client.task.await?;
        op.shut_down().await?;
        Ok(())
    }
}
