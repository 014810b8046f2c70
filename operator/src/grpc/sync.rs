//! EndpointSync: one bidirectional stream per agent.
//!
//! The first message must be Hello; the operator answers HelloReply (its label filter,
//! the snapshot interval, the limits), then one Ack per message. Every message is
//! decoded and validated off the core's lock. One bad entry never costs the node its
//! stream: an entry that fails validation is rejected alone (named in the Ack,
//! counted, logged once) and the rest of the message is applied. A message malformed
//! as a whole ends the stream with a precise status and changes nothing.
//!
//! What the operator tells the agent (Rebind, SnapshotNow, the end of the stream)
//! comes as domain values on a channel of the stream's own; the stream's task encodes
//! it, and sends what the operator said while applying a message before its Ack.

use std::{
    collections::{HashMap, hash_map::Entry},
    net::SocketAddr,
    sync::Arc,
    time::Duration,
};

use bytes::Bytes;
use census_proto::{
    PROTOCOL_VERSION,
    convert::{
        Rejected, SentKey, addresses_from_wire, check_version, delete_from_wire, filter_to_wire,
        node_from_wire, pending_to_wire, services_to_wire, session_from_wire, snapshot_from_wire,
        upsert_from_wire,
    },
    domain::AllocationId,
    pb::{self, agent_message::Body, endpoint_sync_server::SERVICE_NAME},
};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Status, server::NamedService};
use tracing::{Instrument, debug, info, info_span, warn};

use census_transport::{
    codec::{self, StreamLimit},
    wire::{self, Messages},
};

use super::{
    Operator, auth,
    convert::to_agent,
    quota::{Held, Quotas},
    status::{field, refused, version},
    untrusted::untrusted,
};
use crate::{
    api::{Applied, Caller, Connected, ToAgent},
    metrics::{KindLabels, Metrics, ReasonLabels},
};

/// Messages buffered towards one agent.
const OUTBOUND: usize = 1024;
/// How long a new stream may stay silent before its Hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
pub(crate) struct EndpointStreams {
    operator: Operator,
    metrics: Metrics,
    shutdown: watch::Receiver<bool>,
    refusals: Arc<Refusals>,
    quotas: Arc<Quotas>,
}

impl EndpointStreams {
    pub(crate) fn new(
        operator: Operator,
        metrics: Metrics,
        shutdown: watch::Receiver<bool>,
        quotas: Arc<Quotas>,
    ) -> Self {
        Self {
            operator,
            metrics,
            shutdown,
            refusals: Arc::default(),
            quotas,
        }
    }
}

/// Refused streams, logged once per caller and cause: an agent that retries with
/// backoff is not a line per attempt, and the line comes again when the cause
/// changes or after the caller got in. Keyed by node (or the peer's address before
/// the node is known); bounded, and forgotten when full.
#[derive(Debug, Default)]
struct Refusals(parking_lot::Mutex<HashMap<String, (tonic::Code, String)>>);

/// Callers whose last refusal is remembered.
const REFUSALS_REMEMBERED: usize = 10_000;

impl Refusals {
    /// Logs `status` for `caller` unless it was the last thing logged for it.
    fn note(&self, caller: &str, status: Status) -> Status {
        if self.is_news(caller, &status) {
            info!(
                caller,
                code = census_proto::status::code_label(status.code()),
                "refused an EndpointSync stream: {}",
                untrusted(status.message())
            );
        }
        status
    }

    fn is_news(&self, caller: &str, status: &Status) -> bool {
        let seen = (status.code(), untrusted(status.message()).to_string());
        let mut last = self.0.lock();
        if last.get(caller) == Some(&seen) {
            return false;
        }
        if last.len() >= REFUSALS_REMEMBERED {
            last.clear();
        }
        last.insert(caller.to_owned(), seen);
        true
    }

    fn accepted(&self, caller: &str) {
        let mut last = self.0.lock();
        if !last.is_empty() && last.remove(caller).is_some() && last.is_empty() {
            last.shrink_to_fit();
        }
    }
}

impl EndpointStreams {
    /// One agent's stream: its Hello judged, then a task of its own; the answers.
    async fn sync(
        &self,
        request: Request<Messages<pb::AgentMessage>>,
    ) -> Result<auth::Expiring<Bytes>, Status> {
        let principal = auth::caller(&request)?;
        let peer = request.remote_addr();
        let caller = peer.map_or_else(|| "an unknown peer".to_owned(), |p| p.ip().to_string());
        let refusals = Arc::clone(&self.refusals);
        let refuse = |who: &str, status: Status| refusals.note(who, status);
        // A node's credentials count its streams from the start (a stream waiting for
        // its Hello holds a connection slot and a buffer too); a loopback caller's
        // count by the node its Hello names.
        let early = match &principal {
            auth::Principal::Node { node, .. } => {
                Some(self.quotas.stream(node).map_err(|e| refuse(&caller, e))?)
            }
            auth::Principal::Reader { .. } | auth::Principal::Loopback => None,
        };
        // Raised once the Hello is accepted: before, only Hello-sized messages come in.
        let limit = request.extensions().get::<Arc<StreamLimit>>().cloned();
        let mut inbound = request.into_inner();
        let hello = self.hello(&mut inbound, &caller).await?;
        let who = untrusted(&hello.node).to_string();
        check_version(hello.protocol_version).map_err(|e| refuse(&who, version(e)))?;
        let node =
            node_from_wire(&hello.node, "hello.node").map_err(|e| refuse(&caller, field(e)))?;
        // Before the session is even read: a Hello for another node changes nothing.
        auth::speaks_for(&principal, &node).map_err(|e| refuse(&caller, e))?;
        let quota = match early {
            Some(quota) => quota,
            None => self.quotas.stream(&node).map_err(|e| refuse(&who, e))?,
        };
        let session = session_from_wire(hello.session.as_ref(), "hello.session")
            .map_err(|e| refuse(&who, field(e)))?;
        // The node's own addresses (the endpoint map's `remote-node` entries in
        // embedded mode): checked here, so a bad list refuses the Hello as a whole.
        let addresses = addresses_from_wire(&hello.addresses, "hello.addresses")
            .map_err(|e| refuse(&who, field(e)))?;
        // Under mutual TLS, only those the node's certificate vouches for: one node
        // cannot make another's addresses (or its pods') its own.
        let addresses = self.vouched(&principal, &node, addresses);
        let (tx, rx) = mpsc::channel(OUTBOUND);
        let reply = self.hello_reply();
        // The reply is queued before the stream is registered, so it is always first.
        tx.try_send(Ok(wire::frame(&reply)))
            .map_err(|_| Status::internal("cannot queue HelloReply"))?;
        // Agents use host networking: the peer is their Node's address.
        let caller = Caller {
            node,
            peer: peer.map(|p| p.ip().to_canonical()),
        };
        let (to_agent_tx, from_operator) = mpsc::channel(OUTBOUND);
        let connected = self
            .operator
            .hello(&caller, session, addresses.clone(), to_agent_tx)
            .map_err(|e| refuse(&who, refused(e)))?;
        self.refusals.accepted(&who);
        if let Some(limit) = &limit {
            limit.raise();
        }
        let span =
            info_span!("sync", node = %connected.node, %session, conn = connected.conn.get());
        span.in_scope(
            || info!(agent_version = %untrusted(&hello.agent_version), peer = ?peer, ?addresses, "agent connected"),
        );
        let stream = Stream {
            operator: self.operator.clone(),
            metrics: self.metrics.clone(),
            _quota: quota,
            connected,
            tx,
            from_operator,
            peer,
            rejected: HashMap::new(),
        };
        tokio::spawn(stream.run(inbound, self.shutdown.clone()).instrument(span));
        // Ending the answers at expiry closes `tx`, which ends the stream's task.
        Ok(auth::until_expired(
            ReceiverStream::new(rx),
            principal.expires(),
        ))
    }

    /// The stream's first message, which must be a Hello and come within
    /// [`HELLO_TIMEOUT`]; a refusal is logged for `caller`.
    async fn hello(
        &self,
        inbound: &mut Messages<pb::AgentMessage>,
        caller: &str,
    ) -> Result<pb::Hello, Status> {
        let refuse = |who: &str, status: Status| self.refusals.note(who, status);
        let first = tokio::time::timeout(HELLO_TIMEOUT, inbound.message())
            .await
            .map_err(|_| {
                self.invalid("no_hello");
                Status::deadline_exceeded(format!(
                    "no Hello within {HELLO_TIMEOUT:?} of opening the stream"
                ))
            })
            .map_err(|status| refuse(caller, status))?
            .map_err(|status| refuse(caller, codec::client_fault(status)))?
            .ok_or_else(|| {
                refuse(
                    caller,
                    Status::failed_precondition("the stream ended before Hello"),
                )
            })?;
        let Some(Body::Hello(hello)) = first.body else {
            self.invalid("no_hello");
            return Err(refuse(
                caller,
                Status::failed_precondition("the first message on EndpointSync must be Hello"),
            ));
        };
        Ok(hello)
    }

    /// Of the node addresses a Hello names, those `principal`'s credentials vouch
    /// for; the rest are counted and logged.
    fn vouched(
        &self,
        principal: &auth::Principal,
        node: &census_proto::domain::NodeName,
        addresses: Vec<std::net::IpAddr>,
    ) -> Vec<std::net::IpAddr> {
        let (addresses, unvouched) = principal.vouched().split(addresses);
        if !unvouched.is_empty() {
            self.metrics
                .rejected_entries
                .get_or_create(&ReasonLabels {
                    reason: "uncertified_address",
                })
                .inc_by(unvouched.len() as u64);
            warn!(
                %node,
                ?unvouched,
                "Hello addresses the node's certificate does not name are not claimed as the node's: \
                 write its certificate with census-operator certs --node {node} --node-ip ADDRESS"
            );
        }
        addresses
    }

    /// The answer to an accepted Hello: the protocol, the filter, the interval, the
    /// limits and the Service set.
    fn hello_reply(&self) -> pb::OperatorMessage {
        let settings = self.operator.settings();
        pb::OperatorMessage {
            body: Some(pb::operator_message::Body::HelloReply(pb::HelloReply {
                protocol_version: PROTOCOL_VERSION,
                operator_version: env!("CARGO_PKG_VERSION").to_owned(),
                filter: Some(filter_to_wire(&settings.filter)),
                snapshot_interval_ms: settings.snapshot_interval.as_millis() as u64,
                limits: Some(pb::Limits {
                    max_snapshot_endpoints: settings.wire.max_snapshot_endpoints as u32,
                    max_labels: settings.wire.labels.max_labels as u32,
                    max_ips_per_endpoint: settings.wire.max_ips_per_endpoint as u32,
                    max_message_bytes: settings.max_message_bytes as u64,
                }),
                services: self.operator.services().map(|s| services_to_wire(&s)),
            })),
        }
    }

    fn invalid(&self, kind: &'static str) {
        self.metrics
            .invalid_messages
            .get_or_create(&KindLabels { kind })
            .inc();
    }
}

struct Stream {
    operator: Operator,
    metrics: Metrics,
    /// Counted against the node's stream quota while the stream lives.
    _quota: Held,
    connected: Connected,
    /// Towards the agent: the HelloReply, Acks, and what the operator says.
    /// Framed as they are queued: a slot is a `Bytes`, not a message, so the
    /// channel's blocks (32 slots each, one at least per stream) stay small.
    tx: mpsc::Sender<Result<Bytes, Status>>,
    /// What the operator says to the agent (Rebind, SnapshotNow, the end).
    from_operator: mpsc::Receiver<ToAgent>,
    peer: Option<SocketAddr>,
    /// The node's rejected entries as last logged, with their reasons: replaced by
    /// each snapshot's, edited by each delta's. A rejection is logged once however
    /// often the agent resends it, and this holds no more keys than a snapshot may.
    rejected: HashMap<SentKey, Vec<String>>,
}

/// What an Ack's rejections speak for.
enum Covers {
    /// Every entry of the node: a snapshot's.
    All,
    /// One entry: a delta's.
    One(SentKey),
}

/// What a stream's task waits for.
enum Event {
    Agent(Result<Option<pb::AgentMessage>, Status>),
    Operator(Option<ToAgent>),
    Closed,
    Stopping,
}

impl Stream {
    async fn run(
        mut self,
        mut inbound: Messages<pb::AgentMessage>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let mut operator_open = true;
        loop {
            let event = tokio::select! {
                m = inbound.message() => Event::Agent(m),
                m = self.from_operator.recv(), if operator_open => Event::Operator(m),
                () = self.tx.closed() => Event::Closed,
                _ = shutdown.changed() => Event::Stopping,
            };
            let open = match event {
                Event::Agent(Ok(Some(msg))) => {
                    let answer = self.handle(msg);
                    // What the operator said while applying the message goes first.
                    self.forward_queued().await
                        && match answer {
                            Ok(ack) => self.tx.send(Ok(wire::frame(&ack))).await.is_ok(),
                            Err(status) => {
                                warn!(code = ?status.code(), message = status.message(), "ending the stream");
                                let _ = self.tx.send(Err(status)).await;
                                false
                            }
                        }
                }
                Event::Agent(Ok(None)) => {
                    debug!("agent closed the stream");
                    false
                }
                Event::Agent(Err(status)) => {
                    // An oversize, late or malformed message: the agent is told why
                    // (a stream that just ended would look like success).
                    let status = codec::client_fault(status);
                    debug!(code = ?status.code(), message = %untrusted(status.message()), "stream failed");
                    let _ = self.tx.try_send(Err(status));
                    false
                }
                Event::Operator(Some(msg)) => self.forward(msg).await,
                // The operator forgot the stream without ending it: the next message
                // it sends is refused.
                Event::Operator(None) => {
                    operator_open = false;
                    true
                }
                Event::Closed => false,
                Event::Stopping => {
                    // Said here too: once this task has disconnected, the operator no
                    // longer holds the stream.
                    let _ = self.tx.try_send(Err(Status::unavailable(
                        "the operator is shutting down; reconnect",
                    )));
                    false
                }
            };
            if !open {
                break;
            }
        }
        info!(peer = ?self.peer, session = %self.connected.session, "agent disconnected");
        self.operator.disconnect(&self.connected);
    }

    /// Sends the agent what the operator said; false once the stream is over.
    async fn forward(&self, msg: ToAgent) -> bool {
        match to_agent(&self.connected.node, msg) {
            Ok(msg) => self.tx.send(Ok(wire::frame(&msg))).await.is_ok(),
            Err(end) => {
                let _ = self.tx.send(Err(end)).await;
                false
            }
        }
    }

    /// [`Stream::forward`]s everything the operator has said so far.
    async fn forward_queued(&mut self) -> bool {
        while let Ok(msg) = self.from_operator.try_recv() {
            if !self.forward(msg).await {
                return false;
            }
        }
        true
    }

    fn invalid(&self, kind: &'static str, status: Status) -> Status {
        self.metrics
            .invalid_messages
            .get_or_create(&KindLabels { kind })
            .inc();
        status
    }

    /// Validates and applies one message, answering with its Ack.
    fn handle(&mut self, msg: pb::AgentMessage) -> Result<pb::OperatorMessage, Status> {
        let seq = msg.seq;
        // Hello carries seq 0: a second Hello is refused as such below, not for its seq.
        if seq == 0 && !matches!(msg.body, Some(Body::Hello(_))) {
            return Err(self.invalid(
                "seq",
                Status::invalid_argument("seq: must be above 0 after Hello"),
            ));
        }
        let settings = self.operator.settings();
        let (applied, rejected, covers): (Applied, Vec<Rejected>, Covers) = match msg.body {
            None => {
                return Err(
                    self.invalid("empty", Status::invalid_argument("the message has no body"))
                );
            }
            Some(Body::Hello(_)) => {
                return Err(self.invalid(
                    "hello",
                    Status::failed_precondition("Hello may only be the first message"),
                ));
            }
            Some(Body::Upsert(upsert)) => {
                match upsert_from_wire(&upsert, &settings.wire, &settings.filter)
                    .map_err(|e| self.invalid("upsert", field(e)))?
                {
                    Ok(endpoint) => {
                        let key = SentKey::from(&endpoint.key);
                        let applied = self
                            .operator
                            .upsert(&self.connected, seq, endpoint)
                            .map_err(refused)?;
                        (applied, Vec::new(), Covers::One(key))
                    }
                    // Changes nothing: the core never sees it.
                    Err(rejected) => {
                        let key = rejected.key.clone();
                        (Applied::default(), vec![rejected], Covers::One(key))
                    }
                }
            }
            Some(Body::Delete(delete)) => match delete_from_wire(&delete) {
                Ok(key) => {
                    let applied = self
                        .operator
                        .delete(&self.connected, seq, &key)
                        .map_err(refused)?;
                    (applied, Vec::new(), Covers::One(SentKey::from(&key)))
                }
                Err(rejected) => {
                    let key = rejected.key.clone();
                    (Applied::default(), vec![rejected], Covers::One(key))
                }
            },
            Some(Body::Snapshot(snapshot)) => {
                let entries = snapshot_from_wire(&snapshot, &settings.wire, &settings.filter)
                    .map_err(|e| self.invalid("snapshot", field(e)))?;
                let applied = self
                    .operator
                    .snapshot(
                        &self.connected,
                        seq,
                        entries.endpoints,
                        AllocationId::new(snapshot.allocations_settled),
                    )
                    .map_err(refused)?;
                (applied, entries.rejected, Covers::All)
            }
        };
        if applied.corrections > 0 {
            debug!(
                seq,
                corrections = applied.corrections,
                "snapshot corrected the view"
            );
        }
        // An old message changed nothing: its entries are not judged either.
        let rejected = if applied.ignored {
            Vec::new()
        } else {
            self.note_rejections(covers, &rejected);
            rejected.iter().map(Rejected::to_wire).collect()
        };
        Ok(pb::OperatorMessage {
            body: Some(pb::operator_message::Body::Ack(pb::Ack {
                seq,
                ignored: applied.ignored,
                corrections: applied.corrections,
                rejected,
                pending: pending_to_wire(&applied.pending),
            })),
        })
    }

    /// Counts every rejection and logs those not logged before for this node.
    fn note_rejections(&mut self, covers: Covers, rejected: &[Rejected]) {
        let mut now: HashMap<SentKey, Vec<String>> = HashMap::with_capacity(rejected.len());
        for r in rejected {
            self.metrics
                .rejected_entries
                .get_or_create(&ReasonLabels { reason: r.kind() })
                .inc();
            let reasons = now.entry(r.key.clone()).or_default();
            let reason = untrusted(&r.error.to_string()).to_string();
            let known = self
                .rejected
                .get(&r.key)
                .is_some_and(|logged| logged.contains(&reason));
            if !known && !reasons.contains(&reason) {
                warn!(endpoint = %untrusted(&r.key.to_string()), %reason, "rejected an entry; the rest of the message is applied");
            }
            reasons.push(reason);
        }
        match covers {
            Covers::All => {
                for key in self.rejected.keys().filter(|k| !now.contains_key(*k)) {
                    info!(endpoint = %untrusted(&key.to_string()), "a rejected entry is accepted now");
                }
                self.rejected = now;
            }
            Covers::One(key) => match now.remove(&key) {
                Some(reasons) => {
                    let room =
                        self.rejected.len() < self.operator.settings().wire.max_snapshot_endpoints;
                    match self.rejected.entry(key) {
                        Entry::Occupied(mut logged) => *logged.get_mut() = reasons,
                        // Past the bound it is logged again when resent, never kept.
                        Entry::Vacant(slot) if room => {
                            slot.insert(reasons);
                        }
                        Entry::Vacant(_) => {}
                    }
                }
                None => {
                    if self.rejected.remove(&key).is_some() {
                        info!(endpoint = %untrusted(&key.to_string()), "a rejected entry is accepted now");
                    }
                }
            },
        }
    }
}

#[cfg(test)]
mod refusal_tests {
    use super::*;

    #[test]
    fn a_refusal_is_news_once_per_caller_and_cause_until_the_caller_gets_in() {
        let refusals = Refusals::default();
        let stale = || Status::failed_precondition("node-1: session 5 is older than 9");
        assert!(refusals.is_news("node-1", &stale()));
        assert!(!refusals.is_news("node-1", &stale()), "a retry is not news");
        assert!(refusals.is_news("node-2", &stale()), "another caller is");
        assert!(
            refusals.is_news("node-1", &Status::unavailable("follower")),
            "another cause is"
        );
        assert!(refusals.is_news("node-1", &stale()));
        refusals.accepted("node-1");
        assert!(
            refusals.is_news("node-1", &stale()),
            "again after it got in"
        );
    }
}

/// The EndpointSync server, built by hand as tonic's generated one would be, with the
/// stream's messages decoded and framed by [`wire`]: a stream holds no buffer sized by
/// the largest snapshot it carried.
#[derive(Debug, Clone)]
pub(crate) struct EndpointSyncServer {
    inner: Arc<EndpointStreams>,
    /// The outer bound of a message either way (the request body's limits are tighter).
    max_message_bytes: usize,
}

impl EndpointSyncServer {
    pub(crate) fn new(streams: EndpointStreams, max_message_bytes: usize) -> Self {
        Self {
            inner: Arc::new(streams),
            max_message_bytes,
        }
    }
}

impl NamedService for EndpointSyncServer {
    const NAME: &'static str = SERVICE_NAME;
}

type BoxFuture<T> = std::pin::Pin<Box<dyn Future<Output = T> + Send>>;

impl<B> tower::Service<http::Request<B>> for EndpointSyncServer
where
    B: tonic::codegen::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<tonic::codegen::StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let inner = Arc::clone(&self.inner);
        let max = self.max_message_bytes;
        if req.uri().path() != "/census.v1.EndpointSync/Sync" {
            return Box::pin(async move {
                Ok(Status::unimplemented("no such method of census.v1.EndpointSync").into_http())
            });
        }
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let req = http::Request::from_parts(parts, tonic::body::Body::new(body));
            Ok(match inner.sync(wire::request(req, max)).await {
                Ok(answers) => wire::Answers::response(Box::pin(futures::StreamExt::map(
                    answers,
                    move |answer| answer.and_then(|framed| wire::within(framed, max)),
                ))),
                Err(status) => wire::Answers::refused(status),
            })
        })
    }
}
