//! The EndpointSync client: one stream to the operator per connection, for the
//! whole life of the process's session.
//!
//! - Hello first (protocol version, node, the session: agent start time in ns and a
//!   random nonce, one per process; the node's own addresses, at most
//!   [`MAX_HELLO_ADDRESSES`], which an operator without Node objects maps to the
//!   `remote-node` identity), then the operator's HelloReply: its label
//!   filter and limits go to the core, its interval paces snapshots.
//! - A full Snapshot at once after every (re)connect, then every interval (jittered
//!   ±10%); Upsert/Delete deltas as the core reports changes. Every message after
//!   Hello carries the next `seq` of the session (from 1, across reconnects).
//! - The core's reports are applied to a mirror of what the agent holds, connected or
//!   not, so a snapshot is always "the state after every delta up to its seq". A
//!   delta that does not fit in the outgoing queue is dropped and covered by a
//!   snapshot sent as soon as there is room: the stream never blocks the agent.
//! - The core's last word on which allocations are settled ([`Report::Settled`]) is
//!   kept beside the mirror for the whole session and goes in every snapshot
//!   (`allocations_settled`), never as a delta. It comes after the reports of the
//!   endpoints that took the identities up, so the mirror it goes out with holds
//!   them.
//! - Acks record the last seq applied, Rebinds go to the core, a SnapshotRequest
//!   sends one now. The stream's state ([`OperatorLink`]) goes to the core too, which
//!   holds the agent's one status. An Ack's rejected and pending entries go to the core as a
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
    time::Duration,
};

use census_proto::{
    PROTOCOL_VERSION,
    convert::{
        endpoint_key_from_wire, endpoint_to_wire, filter_from_wire, identity_from_wire,
        services_from_wire, session_to_wire,
    },
    domain::{EndpointKey, NodeName, SessionId, check_usable_ip},
    labels::LabelLimits,
    pb::{self, agent_message::Body, endpoint_sync_client::EndpointSyncClient, operator_message},
    status::code_label,
};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

use crate::client::OperatorChannel;
use tracing::{Instrument as _, debug, info, info_span, warn};

use crate::{
    agent_core::{
        AllocationId, LabelSettings, OperatorEvent, OperatorLink, Report, StreamError, Verdict,
        VerdictScope,
    },
    backoff::{Backoff, jittered},
    host::HostIps,
    metrics::Metrics,
    shutdown::stopped,
};

/// Messages queued towards the operator.
const OUTBOUND: usize = 256;
/// How long the operator may take to answer Hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(15);
/// The interval until the operator says otherwise.
const DEFAULT_INTERVAL: Duration = Duration::from_secs(30);
/// Largest message accepted from the operator.
const MAX_DECODING: usize = 16 * 1024 * 1024;
/// The node's addresses a Hello carries at most (the operator refuses more).
const MAX_HELLO_ADDRESSES: usize = 16;
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
    pub channel: OperatorChannel,
    pub node: NodeName,
    pub session: SessionId,
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    pub metrics: Metrics,
    /// The stream's state, for the core.
    pub status: watch::Sender<OperatorLink>,
    /// True while a stream is up (the operator knows this session: Allocate works).
    pub connected: watch::Sender<bool>,
    /// The node's own addresses, read for every Hello.
    pub host_ips: HostIps,
    /// Test only: Delete deltas are not sent (counted as dropped), as if the
    /// operator had missed every pod delete; the snapshots repair them.
    pub drop_deletes: bool,
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
    Failed(StreamError),
}

/// The limits the operator set in HelloReply.
#[derive(Debug, Clone, Copy)]
struct Limits {
    max_snapshot_endpoints: usize,
}

/// Everything that outlives one stream.
struct State {
    reports: mpsc::UnboundedReceiver<Report>,
    events: mpsc::Sender<OperatorEvent>,
    ready: watch::Receiver<bool>,
    shutdown: watch::Receiver<bool>,
    mirror: BTreeMap<EndpointKey, pb::Endpoint>,
    /// The core's last [`Report::Settled`], for every snapshot of the session.
    settled: AllocationId,
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
            Report::Settled(upto) => self.settled = *upto,
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
        events: mpsc::Sender<OperatorEvent>,
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
        events: mpsc::Sender<OperatorEvent>,
        ready: watch::Receiver<bool>,
        shutdown: watch::Receiver<bool>,
    ) {
        let mut state = State {
            reports,
            events,
            ready,
            shutdown,
            mirror: BTreeMap::new(),
            settled: AllocationId::NONE,
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
            let mut was_connected = false;
            self.status.send_modify(|status| {
                was_connected = status.connected;
                status.connected = false;
                status.last_error = Some(error.clone());
            });
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
                addresses: self.hello_addresses(),
            })),
        };
        if tx.try_send(hello).is_err() {
            return Ended::Failed(StreamError::QueueHello);
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
            Err(_) => return Ended::Failed(StreamError::HelloTimeout),
            Ok(Err(status)) => return Ended::Failed(describe(&status)),
            Ok(Ok(opened)) => opened,
        };
        let reply = match first.and_then(|m| m.body) {
            Some(operator_message::Body::HelloReply(reply)) => reply,
            other => {
                return Ended::Failed(StreamError::NotHelloReply {
                    got: body_name(other.as_ref()),
                });
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
        self.status.send_modify(|status| {
            status.connected = true;
            status.last_error = None;
        });
        self.connected.send_replace(true);
        info!(operator_version = %reply.operator_version, interval = ?state.interval, "connected to the operator");
        self.connected(state, &tx, &mut inbound).await
    }

    /// The node's addresses for Hello: the first [`MAX_HELLO_ADDRESSES`] others
    /// can reach it at. What no node can be reached at by another is left out
    /// (`check_usable_ip`: link-local ones, of which every node has its own in the
    /// same range, loopback, multicast, ...): the operator refuses a Hello naming one.
    fn hello_addresses(&self) -> Vec<String> {
        let ips = match self.host_ips.read() {
            Ok(ips) => ips,
            Err(error) => {
                debug!(%error, "cannot read the node's addresses; Hello carries none");
                return Vec::new();
            }
        };
        ips.into_iter()
            .filter(|ip| check_usable_ip(*ip).is_ok())
            .take(MAX_HELLO_ADDRESSES)
            .map(|ip| ip.to_string())
            .collect()
    }

    async fn apply_hello_reply(
        &self,
        state: &mut State,
        reply: &pb::HelloReply,
    ) -> Result<(), StreamError> {
        if reply.protocol_version != PROTOCOL_VERSION {
            return Err(StreamError::ProtocolVersion {
                operator: reply.protocol_version,
                agent: PROTOCOL_VERSION,
            });
        }
        let filter = filter_from_wire(reply.filter.as_ref())?;
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
            .send(OperatorEvent::Settings(settings))
            .await
            .map_err(|_| StreamError::Stopping)?;
        // An operator that sends none leaves SERVICES as it is.
        let Some(services) = reply.services.as_ref() else {
            return Ok(());
        };
        match services_from_wire(services, "hello_reply.services") {
            Ok((set, refused)) => {
                for error in &refused {
                    warn!(%error, "refused a Service range of the operator's");
                }
                state
                    .events
                    .send(OperatorEvent::Services(set))
                    .await
                    .map_err(|_| StreamError::Stopping)
            }
            Err(error) => {
                warn!(%error, "refused the operator's Service addresses; SERVICES stays as it is");
                Ok(())
            }
        }
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
                    return Ended::Failed(StreamError::EndedByOperator);
                }
                Step::Message(Err(status)) => return Ended::Failed(describe(&status)),
                Step::Timer => {
                    snapshot_due = true;
                    timer
                        .as_mut()
                        .reset(tokio::time::Instant::now() + jittered(state.interval, 0.1));
                }
                Step::Room(None) => return Ended::Failed(StreamError::Closed),
                Step::Room(Some(permit)) => {
                    if let Some(snapshot) = self.snapshot(state) {
                        permit.send(snapshot);
                        self.metrics.snapshots_sent.inc();
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
            // Snapshots carry it.
            Report::Settled(_) => return,
            Report::Delete(_) if self.drop_deletes => {
                self.metrics.deltas_dropped.inc();
                return;
            }
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
                allocations_settled: state.settled.get(),
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
                self.status.send_if_modified(|status| {
                    let before = status.last_ack_seq;
                    status.last_ack_seq = before.max(ack.seq);
                    status.last_ack_seq != before
                });
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
                        .send(OperatorEvent::Verdict(verdict))
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
                            .send(OperatorEvent::Rebind { key, id })
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

fn describe(status: &tonic::Status) -> StreamError {
    StreamError::Status {
        code: code_label(status.code()),
        message: status.message().to_owned(),
    }
}

/// The kind of an operator message, for an error that names it.
fn body_name(body: Option<&operator_message::Body>) -> &'static str {
    match body {
        None => "an empty message",
        Some(operator_message::Body::HelloReply(_)) => "HelloReply",
        Some(operator_message::Body::Ack(_)) => "Ack",
        Some(operator_message::Body::Rebind(_)) => "Rebind",
        Some(operator_message::Body::SnapshotRequest(_)) => "SnapshotRequest",
    }
}

#[cfg(test)]
mod tests;
