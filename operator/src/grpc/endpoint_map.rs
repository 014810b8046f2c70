//! EndpointMap: Watch (the cluster-wide map, pre-encoded) and Lookup.
//!
//! Every watcher is sent the same bytes: batches and full-map chunks are encoded and
//! framed once ([`WireMap`], the runtime's [`MapEncoder`]) and the Watch stream hands
//! them to the transport as they are, without a copy per watcher ([`wire::Answers`]).
//! On the wire they are ordinary `EndpointMapBatch` messages; clients decode them with
//! prost. The service is built by hand, as tonic's generated server would be, because
//! the generated one encodes every answer itself.
//!
//! A watch's stream is lazy: it takes the next batch only when the transport has room
//! for it, so a watcher that does not read holds no queue of its own; when it has
//! fallen further behind than the shared buffer, it is sent the full map again.

use std::{
    collections::VecDeque,
    convert::Infallible,
    net::IpAddr,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use bytes::Bytes;
use census_proto::{
    convert::{check_version, node_from_wire, services_to_wire, session_from_wire},
    domain::{ServiceSet, SessionId},
    pb,
};
use prometheus_client::metrics::{family::Family, gauge::Gauge};
use tokio::sync::{OwnedSemaphorePermit, broadcast, watch};
use tonic::{
    Request, Response, Status,
    body::Body,
    server::{Grpc, NamedService, UnaryService},
};
use tracing::debug;

use census_transport::wire;

use super::{
    Operator, auth,
    quota::{Held, Quotas},
    status::{field, refused, version},
    untrusted::untrusted,
};
use crate::{
    api::{
        Caller, ClaimSource, FullMap, MapBatch, MapBatchParts, MapClaim, MapConflict, MapEncoder,
        MapLookup, MapWatch,
    },
    metrics::{KindLabels, Metrics, ReasonLabels},
};

/// Requests of both methods are small: a node name, a session, an address.
const MAX_REQUEST_BYTES: usize = 4096;

/// Bytes of one encoded item at most: an IPv6 entry, or a node of the longest name.
const MAX_ITEM_BYTES: usize = 300;

/// Bytes of a batch's Service addresses at most: the largest set, IPv6 ranges
/// (a range is 16 address bytes, a prefix length and a kind, with their tags).
const MAX_SERVICES_BYTES: usize = ServiceSet::MAX_RANGES * 32;

/// Encodes map batches as `EndpointMapBatch`.
#[derive(Debug, Default)]
pub(crate) struct WireMap;

fn ip_bytes(ip: &IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    }
}

impl MapEncoder for WireMap {
    /// The batch as an `EndpointMapBatch` message framed for the wire.
    fn encode(&self, batch: &MapBatchParts<'_>) -> Bytes {
        let message = pb::EndpointMapBatch {
            resync_start: batch.resync_start,
            resync_end: batch.resync_end,
            nodes: batch
                .nodes
                .iter()
                .map(|n| pb::MapNode {
                    index: n.index.0.get(),
                    name: n.name.as_str().to_owned(),
                })
                .collect(),
            upserts: batch
                .upserts
                .iter()
                .map(|e| pb::MapEntry {
                    ip: ip_bytes(&e.ip),
                    identity: e.identity.get(),
                    node: e.node.0.get(),
                })
                .collect(),
            removes: batch.removes.iter().map(ip_bytes).collect(),
            removed_nodes: batch.removed_nodes.iter().map(|n| n.0.get()).collect(),
            built_at_ms: batch.built_at_ms,
            version: batch.version,
            services: batch.services.map(services_to_wire),
        };
        wire::frame(&message)
    }
}

/// The largest message a watcher is sent: a batch of `batch_entries` items.
pub(crate) fn max_batch_bytes(batch_entries: usize) -> usize {
    batch_entries
        .saturating_mul(MAX_ITEM_BYTES)
        .max(4 * 1024 * 1024)
        .saturating_add(MAX_SERVICES_BYTES)
}

/// The EndpointMap service.
#[derive(Debug, Clone)]
pub(crate) struct EndpointMapService {
    operator: Operator,
    metrics: Metrics,
    shutdown: watch::Receiver<bool>,
    max_message_bytes: usize,
    quotas: Arc<Quotas>,
}

impl EndpointMapService {
    pub(crate) fn new(
        operator: Operator,
        metrics: Metrics,
        shutdown: watch::Receiver<bool>,
        max_message_bytes: usize,
        quotas: Arc<Quotas>,
    ) -> Self {
        Self {
            operator,
            metrics,
            shutdown,
            max_message_bytes,
            quotas,
        }
    }

    fn watch(&self, request: Request<pb::EndpointMapWatchRequest>) -> Result<WatchStream, Status> {
        let principal = auth::caller(&request)?;
        let peer = request.remote_addr().map(|p| p.ip().to_canonical());
        let req = request.into_inner();
        check_version(req.protocol_version).map_err(version)?;
        let node = node_from_wire(&req.node, "node").map_err(field)?;
        auth::speaks_for(&principal, &node)?;
        let session = session_from_wire(req.session.as_ref(), "session").map_err(field)?;
        let quota = self.quotas.watch(&principal, Some(&node))?;
        let caller = Caller { node, peer };
        let watch = self.operator.map_watch(&caller, session).map_err(refused)?;
        let watcher = Watcher {
            _quota: quota,
            operator: Arc::clone(&self.operator),
            open: Open::new(&self.metrics),
            metrics: self.metrics.clone(),
            caller,
            session,
            watch,
            shutdown: self.shutdown.clone(),
            phase: Phase::Resync("new_watcher"),
        };
        let stream = futures::stream::unfold(watcher, |mut watcher| async move {
            watcher.next().await.map(|item| (item, watcher))
        });
        Ok(auth::until_expired(stream, principal.expires()))
    }

    fn lookup(
        &self,
        request: pb::EndpointMapLookupRequest,
    ) -> Result<pb::EndpointMapLookupResponse, Status> {
        check_version(request.protocol_version).map_err(version)?;
        let text = request.ip.trim();
        let ip: IpAddr = text.parse().map_err(|_| {
            Status::invalid_argument(format!(
                "ip: \"{}\" is not an IPv4 or IPv6 address",
                untrusted(text)
            ))
        })?;
        let ip = ip.to_canonical();
        match self.operator.map_lookup(ip).map_err(refused)? {
            Some(found) => Ok(lookup_to_wire(&found)),
            None => Err(Status::not_found(format!(
                "no endpoint or node claims {ip}"
            ))),
        }
    }
}

fn claim_to_wire(node: &str, source: &ClaimSource) -> pb::EndpointClaim {
    let (namespace, name) = match source {
        ClaimSource::Endpoint(key) => (key.namespace().to_owned(), key.name().to_owned()),
        // A node's own address, or an endpoint whose key is no longer known.
        ClaimSource::NodeAddress | ClaimSource::Gone => (String::new(), String::new()),
    };
    pb::EndpointClaim {
        node: node.to_owned(),
        namespace,
        name,
        ..pb::EndpointClaim::default()
    }
}

fn lookup_to_wire(found: &MapLookup) -> pb::EndpointMapLookupResponse {
    let claims = found
        .claims
        .iter()
        .map(|c: &MapClaim| pb::EndpointClaim {
            identity: c.identity.get(),
            claimed_at_ms: c.claimed_at.as_millis(),
            winner: c.winner,
            ..claim_to_wire(c.node.as_str(), &c.source)
        })
        .collect();
    let history = found
        .history
        .iter()
        .map(|c: &MapConflict| pb::EndpointConflict {
            at_ms: c.at.as_millis(),
            won: Some(pb::EndpointClaim {
                identity: c.winner_identity.get(),
                winner: true,
                ..claim_to_wire(c.winner.as_str(), &c.winner_source)
            }),
            displaced: Some(pb::EndpointClaim {
                identity: c.loser_identity.get(),
                ..claim_to_wire(c.loser.as_str(), &c.loser_source)
            }),
        })
        .collect();
    pb::EndpointMapLookupResponse {
        ip: found.ip.to_string(),
        claims,
        conflicts: found.conflicts,
        history,
    }
}

type WatchStream = wire::Framed;

/// Counts an open watch while it lives.
#[derive(Debug)]
struct Open(Metrics);

impl Open {
    fn new(metrics: &Metrics) -> Self {
        metrics.map_watchers.inc();
        Self(metrics.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.map_watchers.dec();
    }
}

/// Counts a resync in progress (waiting for its turn, or being sent) while it lives.
#[derive(Debug)]
struct InProgress(Family<ReasonLabels, Gauge>, &'static str);

impl InProgress {
    fn new(metrics: &Metrics, reason: &'static str) -> Self {
        let labels = ReasonLabels { reason };
        metrics.map_resyncs.get_or_create(&labels).inc();
        metrics.map_resyncs_in_progress.get_or_create(&labels).inc();
        Self(metrics.map_resyncs_in_progress.clone(), reason)
    }
}

impl Drop for InProgress {
    fn drop(&mut self) {
        self.0.get_or_create(&ReasonLabels { reason: self.1 }).dec();
    }
}

enum Phase {
    /// A full map is due, for this reason.
    Resync(&'static str),
    /// Sending the full map, then what was built after it.
    Full {
        full: Arc<FullMap>,
        next: usize,
        catch_up: VecDeque<MapBatch>,
        changes: broadcast::Receiver<MapBatch>,
        /// Held until the last chunk is taken.
        turn: Option<(OwnedSemaphorePermit, InProgress)>,
    },
    /// Sending the batches built after the full map, before the subscription.
    CatchUp {
        catch_up: VecDeque<MapBatch>,
        changes: broadcast::Receiver<MapBatch>,
        last: u64,
    },
    /// Sending batches as they are built.
    Live {
        changes: broadcast::Receiver<MapBatch>,
        last: u64,
    },
    Done,
}

/// One watch's state: what it sends next.
struct Watcher {
    operator: Operator,
    metrics: Metrics,
    caller: Caller,
    session: SessionId,
    watch: MapWatch,
    shutdown: watch::Receiver<bool>,
    phase: Phase,
    open: Open,
    /// Counted against the caller's watch quota and the cap while the watch lives.
    _quota: Held,
}

/// What ends a wait.
enum Woken<T> {
    Value(T),
    TermChanged,
    ShuttingDown,
}

impl Watcher {
    /// Waits for `future` unless the term changes or the operator stops first.
    async fn until<T>(&mut self, future: impl Future<Output = T>) -> Woken<T> {
        tokio::select! {
            biased;
            _ = self.shutdown.changed() => Woken::ShuttingDown,
            changed = self.watch.terms.changed() => match changed {
                Ok(()) => Woken::TermChanged,
                Err(_) => Woken::ShuttingDown,
            },
            value = future => Woken::Value(value),
        }
    }

    /// After a change of term: a full map again if this replica still leads and the
    /// node's session is still current, else the refusal that ends the stream.
    fn new_term(&mut self) -> Result<(), Status> {
        debug!(node = %self.caller.node, "the replica's role changed: sending the full map again");
        self.watch = self
            .operator
            .map_watch(&self.caller, self.session)
            .map_err(refused)?;
        self.phase = Phase::Resync("term");
        Ok(())
    }

    fn end(&mut self, status: Status) -> Option<Result<Bytes, Status>> {
        self.phase = Phase::Done;
        Some(Err(status))
    }

    fn sent(&self, kind: &'static str, bytes: &Bytes) {
        self.metrics
            .map_messages_sent
            .get_or_create(&KindLabels { kind })
            .inc();
        self.metrics.map_bytes_sent.inc_by(bytes.len() as u64);
    }

    /// The next message of the stream; `None` ends it.
    async fn next(&mut self) -> Option<Result<Bytes, Status>> {
        let _ = &self.open;
        loop {
            match std::mem::replace(&mut self.phase, Phase::Done) {
                Phase::Done => return None,
                Phase::Resync(reason) => {
                    if let Err(end) = self.resync(reason).await {
                        return end;
                    }
                }
                Phase::Full {
                    full,
                    next,
                    catch_up,
                    changes,
                    mut turn,
                } => {
                    if let Some(chunk) = full.chunks.get(next).cloned() {
                        if next + 1 == full.chunks.len() {
                            turn = None;
                        }
                        self.phase = Phase::Full {
                            full,
                            next: next + 1,
                            catch_up,
                            changes,
                            turn,
                        };
                        self.sent("full", &chunk);
                        return Some(Ok(chunk));
                    }
                    drop(turn);
                    self.phase = Phase::CatchUp {
                        catch_up,
                        changes,
                        last: full.version,
                    };
                }
                Phase::CatchUp {
                    mut catch_up,
                    changes,
                    last,
                } => match catch_up.pop_front() {
                    Some(batch) if batch.version <= last => {
                        self.phase = Phase::CatchUp {
                            catch_up,
                            changes,
                            last,
                        };
                    }
                    Some(batch) => {
                        self.phase = Phase::CatchUp {
                            catch_up,
                            changes,
                            last: batch.version,
                        };
                        self.sent("batch", &batch.bytes);
                        return Some(Ok(batch.bytes));
                    }
                    None => self.phase = Phase::Live { changes, last },
                },
                Phase::Live { changes, last } => {
                    if let Some(sent) = self.live(changes, last).await {
                        return sent;
                    }
                }
            }
        }
    }

    /// Waits for its turn, builds the full map (off the async workers) and starts
    /// sending it; `Err` with the stream's end when it cannot.
    async fn resync(&mut self, reason: &'static str) -> Result<(), Option<Result<Bytes, Status>>> {
        let progress = InProgress::new(&self.metrics, reason);
        let resyncs = Arc::clone(&self.watch.resyncs);
        let permit = match self.until(resyncs.acquire_owned()).await {
            Woken::Value(Ok(permit)) => permit,
            Woken::Value(Err(_)) | Woken::ShuttingDown => return Err(self.end(shutting_down())),
            Woken::TermChanged => {
                return match self.new_term() {
                    Ok(()) => Ok(()),
                    Err(status) => Err(self.end(status)),
                };
            }
        };
        let operator = Arc::clone(&self.operator);
        let term = self.watch.term;
        let built = tokio::task::spawn_blocking(move || operator.map_resync(term));
        let resync = match built.await {
            Ok(Ok(resync)) => resync,
            Ok(Err(refusal)) => return Err(self.end(refused(refusal))),
            Err(_) => return Err(self.end(shutting_down())),
        };
        self.phase = Phase::Full {
            full: resync.full,
            next: 0,
            catch_up: resync.catch_up.into(),
            changes: resync.changes,
            turn: Some((permit, progress)),
        };
        Ok(())
    }

    /// The next batch of changes after `last`, when one comes (`Some`: what the
    /// stream sends or its end); `None` when the phase changed instead (a new
    /// term, a resync for a watcher that fell behind).
    async fn live(
        &mut self,
        mut changes: broadcast::Receiver<MapBatch>,
        last: u64,
    ) -> Option<Option<Result<Bytes, Status>>> {
        let received = match self.until(changes.recv()).await {
            Woken::Value(received) => received,
            Woken::ShuttingDown => return Some(self.end(shutting_down())),
            Woken::TermChanged => {
                return self.new_term().err().map(|status| self.end(status));
            }
        };
        match received {
            Ok(batch) if batch.version <= last => {
                self.phase = Phase::Live { changes, last };
                None
            }
            Ok(batch) if batch.version == last + 1 => {
                self.metrics.map_watcher_lag.observe(changes.len() as f64);
                self.phase = Phase::Live {
                    changes,
                    last: batch.version,
                };
                self.sent("batch", &batch.bytes);
                Some(Some(Ok(batch.bytes)))
            }
            // A gap cannot happen by construction; a full map repairs one.
            Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {
                debug!(node = %self.caller.node, "map watcher fell behind: sending the full map again");
                self.phase = Phase::Resync("lagged");
                None
            }
            Err(broadcast::error::RecvError::Closed) => Some(None),
        }
    }
}

fn shutting_down() -> Status {
    Status::unavailable("the operator is shutting down")
}

// ---------------------------------------------------------------------------
// The service, as tonic-build would generate it, with the pre-encoded codec for Watch
// ---------------------------------------------------------------------------

/// The gRPC service name.
const SERVICE_NAME: &str = "census.v1.EndpointMap";

/// The server of [`EndpointMapService`].
#[derive(Debug, Clone)]
pub(crate) struct EndpointMapServer {
    inner: Arc<EndpointMapService>,
}

impl EndpointMapServer {
    pub(crate) fn new(service: EndpointMapService) -> Self {
        Self {
            inner: Arc::new(service),
        }
    }
}

impl NamedService for EndpointMapServer {
    const NAME: &'static str = SERVICE_NAME;
}

struct LookupMethod(Arc<EndpointMapService>);

impl UnaryService<pb::EndpointMapLookupRequest> for LookupMethod {
    type Response = pb::EndpointMapLookupResponse;
    type Future = Pin<
        Box<dyn Future<Output = Result<Response<pb::EndpointMapLookupResponse>, Status>> + Send>,
    >;

    fn call(&mut self, request: Request<pb::EndpointMapLookupRequest>) -> Self::Future {
        let answer = auth::caller(&request)
            .and_then(|_| self.0.lookup(request.into_inner()))
            .map(Response::new);
        Box::pin(async move { answer })
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<B> tower::Service<http::Request<B>> for EndpointMapServer
where
    B: tonic::codegen::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<tonic::codegen::StdError> + Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let inner = Arc::clone(&self.inner);
        let max = inner.max_message_bytes;
        match req.uri().path() {
            "/census.v1.EndpointMap/Watch" => Box::pin(async move {
                let (parts, body) = req.into_parts();
                let req = http::Request::from_parts(parts, Body::new(body));
                let answer = wire::single(req, MAX_REQUEST_BYTES)
                    .await
                    .and_then(|request| inner.watch(request));
                Ok(match answer {
                    Ok(stream) => wire::Answers::response(stream),
                    Err(status) => wire::Answers::refused(status),
                })
            }),
            "/census.v1.EndpointMap/Lookup" => Box::pin(async move {
                let mut grpc = Grpc::new(tonic_prost::ProstCodec::default())
                    .apply_max_message_size_config(Some(MAX_REQUEST_BYTES), Some(max));
                Ok(grpc.unary(LookupMethod(inner), req).await)
            }),
            _ => Box::pin(async move {
                Ok(Status::unimplemented("no such method of census.v1.EndpointMap").into_http())
            }),
        }
    }
}
