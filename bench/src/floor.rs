//! Allocate of a known label set, and the snapshot round trip, each against the
//! transport floor measured in the same run: the same operator process, the same
//! connections (plain HTTP/2 on loopback, as every preset), the same server layers
//! (metrics, request limits, authentication) and the same codec, with the calls
//! interleaved in alternating batches so drift on the shared cores falls on both.
//!
//! The floor is IdentityService.Lookup of the same label set, its request padded to
//! the Allocate's encoded size with a field LookupRequest does not have (protobuf
//! decoders skip unknown fields: the bytes cross the transport, the limit and the
//! decoder, and nothing else). Lookup validates and canonicalizes the labels as
//! Allocate does and reads the core under the same lock; it does not take the
//! allocation path (session check, hold bookkeeping, effects). Its answer is the
//! Identity itself, a few bytes shorter than the AllocateResponse that wraps it (the
//! sizes are printed).
//!
//! The snapshot round trip (a snapshot of the node's endpoints, unchanged since the
//! last one, as an agent sends it every interval, to its Ack on the EndpointSync
//! stream) has as its floor the same Lookup padded to the snapshot's size, on the
//! same connection, while the snapshot fits under the operator's request limit. That
//! floor carries the bytes but not their decoding into endpoints, and is a unary call
//! (its own HTTP/2 stream, headers and trailers) where the snapshot rides an open
//! stream: the ratio counts decoding, validation, the label filter, the core's apply
//! and the Ack against moving the bytes. No target is set for it; Allocate's is its
//! p50 and p99 within 1.5x of the floor's, printed PASS or MISS (a report: the run
//! never fails on it).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, bail};
use census_proto::{
    PROTOCOL_VERSION,
    pb::{self, agent_message::Body, endpoint_sync_client::EndpointSyncClient, operator_message},
};
use prost::Message as _;
use rand::RngExt as _;
use serde::Serialize;
use tokio::{sync::mpsc, task::JoinSet, time::Instant};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{
    GrpcMethod, Request, Status, client::Grpc, codegen::http::uri::PathAndQuery, transport::Channel,
};

use super::{
    agents::{Fleet, Node, NodeHandle, pod_ip},
    alloc::{
        CALL_TIMEOUT, keeper, keeper_view_filled, known_labels, start_for_allocation,
        wait_connected,
    },
    operator::Binary,
    presets::Floor,
    report::{Machine, Results, say, say_params},
    sample::Latency,
};

/// The operator's request limit at its default `--max-labels 64`: 64 x 512 + 4096
/// bytes (operator/transport/src/codec.rs, `request_limit`). A floor for a bigger
/// snapshot would be refused.
const DEFAULT_REQUEST_LIMIT: usize = 64 * 512 + 4096;

/// LookupRequest as the operator decodes it, plus `padding`, a field it does not
/// have: the decoder skips it.
#[derive(Clone, PartialEq, prost::Message)]
struct PaddedLookup {
    #[prost(uint32, tag = "1")]
    protocol_version: u32,
    #[prost(string, repeated, tag = "2")]
    labels: Vec<String>,
    #[prost(bytes = "vec", tag = "15")]
    padding: Vec<u8>,
}

impl PaddedLookup {
    /// A Lookup of `labels` whose encoding is `size` bytes, never longer; up to 2
    /// bytes short when the padding field cannot land on it exactly (an empty field
    /// is not encoded, and its length prefix grows a byte at 128 and 16,384).
    fn sized(labels: Vec<String>, size: usize) -> Self {
        let mut m = Self {
            protocol_version: PROTOCOL_VERSION,
            labels,
            padding: Vec::new(),
        };
        let gap = size.saturating_sub(m.encoded_len());
        // The field takes a 1-byte tag, its length's varint and the bytes.
        let mut n = gap.saturating_sub(2);
        while n > 0 && 1 + prost::encoding::encoded_len_varint(n as u64) + n > gap {
            n -= 1;
        }
        if n > 0 {
            m.padding = vec![0; n];
        }
        m
    }
}

/// IdentityService.Lookup with a padded request, called as the generated client
/// calls Allocate (same channel, codec and readiness wait).
async fn lookup_padded(
    grpc: &mut Grpc<Channel>,
    request: PaddedLookup,
) -> Result<pb::Identity, Status> {
    grpc.ready()
        .await
        .map_err(|e| Status::unknown(format!("Service was not ready: {e}")))?;
    let mut request = Request::new(request);
    request
        .extensions_mut()
        .insert(GrpcMethod::new("census.v1.IdentityService", "Lookup"));
    let codec = tonic_prost::ProstCodec::<PaddedLookup, pb::Identity>::default();
    let path = PathAndQuery::from_static("/census.v1.IdentityService/Lookup");
    grpc.unary(request, path, codec)
        .await
        .map(tonic::Response::into_inner)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum Kind {
    Allocate,
    AllocateFloor,
}

/// What a batch (or all batches of one kind) measured.
#[derive(Debug, Default)]
struct Tally {
    lat: Vec<Duration>,
    errors: u64,
    first_error: Option<String>,
    request_bytes: u64,
    answer_bytes: u64,
}

impl Tally {
    fn add(&mut self, other: Self) {
        self.lat.extend(other.lat);
        self.errors += other.errors;
        self.request_bytes += other.request_bytes;
        self.answer_bytes += other.answer_bytes;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
    }

    fn error(&mut self, e: String) {
        self.errors += 1;
        if self.first_error.is_none() {
            self.first_error = Some(e);
        }
    }

    fn measured(self, name: &str, clients: usize, seconds: f64) -> Measured {
        let calls = self.lat.len();
        let per_call = |b: u64| {
            if calls == 0 {
                0.0
            } else {
                b as f64 / calls as f64
            }
        };
        if let Some(e) = &self.first_error {
            say(format!(
                "  {name} x{clients}: {} errors, first: {e}",
                self.errors
            ));
        }
        Measured {
            name: name.to_owned(),
            clients,
            calls,
            errors: self.errors,
            per_second: calls as f64 / seconds,
            request_bytes: per_call(self.request_bytes),
            answer_bytes: per_call(self.answer_bytes),
            latency: Latency::of(self.lat),
        }
    }
}

/// One kind of call, over every batch.
#[derive(Debug, Clone, Serialize)]
struct Measured {
    name: String,
    clients: usize,
    calls: usize,
    errors: u64,
    /// Calls per second of the batches' own time.
    per_second: f64,
    /// Mean encoded message sizes (without the 5-byte gRPC prefix and HTTP/2 framing).
    request_bytes: f64,
    answer_bytes: f64,
    latency: Latency,
}

/// A measured call against its floor.
#[derive(Debug, Clone, Serialize)]
struct Against {
    call: Measured,
    floor: Option<Measured>,
    /// Why there is no floor, when there is none.
    no_floor: Option<String>,
    p50_ratio: Option<f64>,
    p99_ratio: Option<f64>,
    /// The target both ratios are held to (Allocate's), if any.
    target: Option<f64>,
    /// Both ratios within the target.
    within_target: Option<bool>,
    /// Snapshot only: the snapshot's bytes a second over the batches' time.
    bytes_per_second: Option<f64>,
}

impl Against {
    fn new(call: Measured, floor: Result<Measured, String>, target: Option<f64>) -> Self {
        let (floor, no_floor) = match floor {
            Ok(f) => (Some(f), None),
            Err(why) => (None, Some(why)),
        };
        let ratio = |a: f64, b: f64| (b > 0.0).then(|| a / b);
        let p50_ratio = floor
            .as_ref()
            .and_then(|f| ratio(call.latency.p50_us, f.latency.p50_us));
        let p99_ratio = floor
            .as_ref()
            .and_then(|f| ratio(call.latency.p99_us, f.latency.p99_us));
        let within_target = target
            .zip(p50_ratio.zip(p99_ratio))
            .map(|(t, (a, b))| a <= t && b <= t);
        Self {
            call,
            floor,
            no_floor,
            p50_ratio,
            p99_ratio,
            target,
            within_target,
            bytes_per_second: None,
        }
    }
}

#[derive(Debug, Serialize)]
struct Output<'a> {
    params: &'a Floor,
    machine: Machine,
    operator_args: Vec<String>,
    allocate: Vec<Against>,
    snapshot: Against,
}

pub(crate) async fn run(binary: &Binary, results: &Results, p: Floor) -> anyhow::Result<bool> {
    say_params("preset floor", &p);
    let mut machine = Machine::now();
    say(machine.line());
    let store = tempfile::tempdir()?;
    let (op, args) =
        start_for_allocation(binary, results, store.path(), &p.timers, p.id_range).await?;
    let fleet = Fleet::connect(&op.grpc_url(), p.connections).await?;
    let keeper = keeper(&fleet, 0, p.known_pool);
    let clients: Vec<Node> = (0..16)
        .map(|i| fleet.start_node(i, format!("client-{i:02}"), Vec::new(), false))
        .collect();
    let handles: Vec<NodeHandle> = clients.iter().map(Node::handle).collect();
    let mut waiting: Vec<&NodeHandle> = handles.iter().collect();
    waiting.push(&keeper);
    wait_connected(&waiting).await?;
    keeper_view_filled(&op, p.known_pool).await?;

    let mut allocate = Vec::new();
    for &n in &p.concurrency {
        let a = allocate_against_floor(&fleet, &handles, n, &p).await;
        say_against(&a);
        allocate.push(a);
    }

    say(format!(
        "snapshot round trip ({} endpoints, unchanged) and its floor: {} rounds of {} ms batches, alternating",
        p.snapshot_endpoints,
        p.rounds,
        p.batch.as_millis()
    ));
    let snapshot = snapshot_round_trip(&fleet, &p).await?;
    say_against(&snapshot);

    for node in clients {
        node.stop().await;
    }
    keeper.stop().await;
    op.stop().await?;
    machine.finish();
    summary(&allocate, &snapshot, &machine);
    results.write_json(
        "floor.json",
        &Output {
            params: &p,
            machine,
            operator_args: args,
            allocate,
            snapshot,
        },
    )?;
    // A report, not a gate: a miss is printed, the run still succeeds.
    Ok(true)
}

/// Allocate (known labels) against its floor with `n` clients: one untimed round,
/// then the preset's rounds of batches, the order alternating each round.
async fn allocate_against_floor(
    fleet: &Fleet,
    handles: &[NodeHandle],
    n: usize,
    p: &Floor,
) -> Against {
    say(format!(
        "Allocate (known labels) and its floor, {n} clients: {} rounds of {} ms batches, alternating",
        p.rounds,
        p.batch.as_millis()
    ));
    // One untimed round: connections, caches and the operator's holds warm.
    for kind in [Kind::Allocate, Kind::AllocateFloor] {
        batch(fleet, handles, kind, n, p.batch, p.known_pool).await;
    }
    let (mut call, mut floor) = (Tally::default(), Tally::default());
    let (mut call_secs, mut floor_secs) = (0.0, 0.0);
    for round in 0..p.rounds {
        let order = if round % 2 == 0 {
            [Kind::Allocate, Kind::AllocateFloor]
        } else {
            [Kind::AllocateFloor, Kind::Allocate]
        };
        for kind in order {
            let started = Instant::now();
            let t = batch(fleet, handles, kind, n, p.batch, p.known_pool).await;
            let secs = started.elapsed().as_secs_f64();
            match kind {
                Kind::Allocate => {
                    call.add(t);
                    call_secs += secs;
                }
                Kind::AllocateFloor => {
                    floor.add(t);
                    floor_secs += secs;
                }
            }
        }
    }
    Against::new(
        call.measured("Allocate (known labels)", n, call_secs),
        Ok(floor.measured("floor: Lookup, padded", n, floor_secs)),
        Some(p.target_ratio),
    )
}

/// `clients` tasks calling `kind` as fast as they can for `duration`, client `c` on
/// connection `c % connections` for node `c % 16`, a random known label set each call.
async fn batch(
    fleet: &Fleet,
    nodes: &[NodeHandle],
    kind: Kind,
    clients: usize,
    duration: Duration,
    pool: usize,
) -> Tally {
    let mut tasks = JoinSet::new();
    let deadline = Instant::now() + duration;
    for c in 0..clients {
        let mut identity = fleet.identity_client(c);
        let mut grpc = Grpc::new(fleet.channel(c));
        let node = nodes[c % nodes.len()].clone();
        tasks.spawn(async move {
            let mut t = Tally::default();
            while Instant::now() < deadline {
                let k = rand::rng().random_range(0..pool);
                let request = pb::AllocateRequest {
                    protocol_version: PROTOCOL_VERSION,
                    node: node.name.clone(),
                    session: Some(node.session),
                    labels: known_labels(k).as_ref().clone(),
                    allocation: 0,
                };
                let size = request.encoded_len();
                let (started, sent, answer) = match kind {
                    Kind::Allocate => {
                        let started = Instant::now();
                        let answer = tokio::time::timeout(CALL_TIMEOUT, identity.allocate(request))
                            .await
                            .map(|r| r.map(|r| r.into_inner().encoded_len()));
                        (started, size, answer)
                    }
                    Kind::AllocateFloor => {
                        let floor = PaddedLookup::sized(request.labels, size);
                        let sent = floor.encoded_len();
                        let started = Instant::now();
                        let answer =
                            tokio::time::timeout(CALL_TIMEOUT, lookup_padded(&mut grpc, floor))
                                .await
                                .map(|r| r.map(|r| r.encoded_len()));
                        (started, sent, answer)
                    }
                };
                match answer {
                    Ok(Ok(bytes)) => {
                        t.lat.push(started.elapsed());
                        t.request_bytes += sent as u64;
                        t.answer_bytes += bytes as u64;
                    }
                    Ok(Err(status)) => {
                        t.error(format!("{:?}: {}", status.code(), status.message()));
                    }
                    Err(_) => t.error(format!("no answer within {CALL_TIMEOUT:?}")),
                }
            }
            t
        });
    }
    let mut all = Tally::default();
    while let Some(r) = tasks.join_next().await {
        match r {
            Ok(t) => all.add(t),
            Err(e) => all.error(format!("a client task failed: {e}")),
        }
    }
    all
}

/// An EndpointSync stream of its own (on connection 0): Hello, an Allocate for each of
/// its endpoints (known label sets), then snapshots sent one at a time, each timed to
/// its Ack, in batches alternating with batches of the padded Lookup of the same size
/// on the same connection.
async fn snapshot_round_trip(fleet: &Fleet, p: &Floor) -> anyhow::Result<Against> {
    let channel = fleet.channel(0);
    let mut stream = SnapshotStream::open(channel.clone()).await?;
    let endpoints = snapshot_endpoints(fleet, &stream.node, stream.session, p).await?;
    let snapshot = Body::Snapshot(pb::Snapshot {
        endpoints,
        allocations_settled: 0,
    });
    let size = pb::AgentMessage {
        seq: 1,
        body: Some(snapshot.clone()),
    }
    .encoded_len();
    let floor_possible = snapshot_floor_possible(size);
    let labels = known_labels(0).as_ref().clone();
    let mut grpc = Grpc::new(channel);
    // Untimed: the first snapshot builds the view; the ones after it are unchanged.
    stream.send(&snapshot).await?;
    let (mut call, mut floor) = (Tally::default(), Tally::default());
    let (mut call_secs, mut floor_secs) = (0.0, 0.0);
    for round in 0..p.rounds {
        let floor_first = round % 2 == 1;
        for is_floor in [floor_first, !floor_first] {
            if is_floor && floor_possible.is_err() {
                continue;
            }
            let started = Instant::now();
            let deadline = started + p.batch;
            while Instant::now() < deadline {
                if is_floor {
                    let request = PaddedLookup::sized(labels.clone(), size);
                    let bytes = request.encoded_len() as u64;
                    let t0 = Instant::now();
                    match lookup_padded(&mut grpc, request).await {
                        Ok(answer) => {
                            floor.lat.push(t0.elapsed());
                            floor.request_bytes += bytes;
                            floor.answer_bytes += answer.encoded_len() as u64;
                        }
                        Err(status) => {
                            floor.error(format!("{:?}: {}", status.code(), status.message()));
                        }
                    }
                } else {
                    let (took, bytes) = stream.send(&snapshot).await?;
                    call.lat.push(took);
                    call.request_bytes += size as u64;
                    call.answer_bytes += bytes as u64;
                }
            }
            if is_floor {
                floor_secs += started.elapsed().as_secs_f64();
            } else {
                call_secs += started.elapsed().as_secs_f64();
            }
        }
    }
    drop(stream);
    let name = format!("snapshot ({} endpoints) to Ack", p.snapshot_endpoints);
    let call = call.measured(&name, 1, call_secs);
    let bytes_per_second = call.per_second * size as f64;
    let floor = floor_possible.map(|()| floor.measured("floor: Lookup, padded", 1, floor_secs));
    // The target is Allocate's: the snapshot's ratio is reported, not judged.
    let mut a = Against::new(call, floor, None);
    a.bytes_per_second = Some(bytes_per_second);
    Ok(a)
}

/// Whether a floor exists for a snapshot of `size` bytes: none when it is over the
/// request limit of every unary call, with the reason.
fn snapshot_floor_possible(size: usize) -> Result<(), String> {
    if size > DEFAULT_REQUEST_LIMIT {
        Err(format!(
            "the snapshot is {size} B; no unary call of the operator accepts a request over {DEFAULT_REQUEST_LIMIT} B (the request limit), and no message on the stream does less work than a snapshot"
        ))
    } else {
        Ok(())
    }
}

/// The snapshot node's EndpointSync stream, its Hello answered.
struct SnapshotStream {
    node: String,
    session: pb::Session,
    tx: mpsc::Sender<pb::AgentMessage>,
    inbound: tonic::Streaming<pb::OperatorMessage>,
    seq: u64,
}

impl SnapshotStream {
    async fn open(channel: Channel) -> anyhow::Result<Self> {
        let node = "snapshot-node".to_owned();
        let session = pb::Session {
            start_time_ns: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64),
            nonce: rand::rng().random(),
        };
        let (tx, rx) = mpsc::channel(4);
        tx.send(pb::AgentMessage {
            seq: 0,
            body: Some(Body::Hello(pb::Hello {
                protocol_version: PROTOCOL_VERSION,
                node: node.clone(),
                session: Some(session),
                agent_version: "census-bench".into(),
                addresses: Vec::new(),
            })),
        })
        .await?;
        let mut client = EndpointSyncClient::new(channel)
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20);
        let mut inbound = client
            .sync(ReceiverStream::new(rx))
            .await
            .context("EndpointSync.Sync")?
            .into_inner();
        match inbound.message().await?.and_then(|m| m.body) {
            Some(operator_message::Body::HelloReply(_)) => {}
            other => bail!("the snapshot node's Hello was answered {other:?}"),
        }
        Ok(Self {
            node,
            session,
            tx,
            inbound,
            seq: 0,
        })
    }

    /// One snapshot to its Ack: the time, and the encoded size of the Ack's message.
    async fn send(&mut self, snapshot: &Body) -> anyhow::Result<(Duration, usize)> {
        self.seq += 1;
        let seq = self.seq;
        let message = pb::AgentMessage {
            seq,
            body: Some(snapshot.clone()),
        };
        let started = Instant::now();
        self.tx
            .send(message)
            .await
            .context("the EndpointSync stream closed")?;
        loop {
            let m = tokio::time::timeout(CALL_TIMEOUT, self.inbound.message())
                .await
                .context("no Ack within the call timeout")??
                .context("the EndpointSync stream ended")?;
            let bytes = m.encoded_len();
            if let Some(operator_message::Body::Ack(ack)) = m.body
                && ack.seq == seq
            {
                if !ack.rejected.is_empty() || !ack.pending.is_empty() {
                    bail!(
                        "the snapshot was not applied whole: {} rejected, {} pending",
                        ack.rejected.len(),
                        ack.pending.len()
                    );
                }
                return Ok((started.elapsed(), bytes));
            }
        }
    }
}

/// The snapshot's endpoints, each with its identity from an Allocate as `node`.
async fn snapshot_endpoints(
    fleet: &Fleet,
    node: &str,
    session: pb::Session,
    p: &Floor,
) -> anyhow::Result<Vec<pb::Endpoint>> {
    let mut identity = fleet.identity_client(0);
    let mut endpoints = Vec::with_capacity(p.snapshot_endpoints);
    for i in 0..p.snapshot_endpoints {
        let labels = known_labels(i % p.known_pool).as_ref().clone();
        let answer = identity
            .allocate(pb::AllocateRequest {
                protocol_version: PROTOCOL_VERSION,
                node: node.to_owned(),
                session: Some(session),
                labels: labels.clone(),
                allocation: 0,
            })
            .await
            .context("the snapshot node's Allocate")?
            .into_inner();
        endpoints.push(pb::Endpoint {
            namespace: format!("team-{}", i % 40),
            name: format!("snap-{i}-x2b9q"),
            // Addresses no keeper pod has, so the cluster-wide map sees no conflict.
            ips: vec![pod_ip(p.known_pool + i)],
            identity: answer.identity.map_or(0, |id| id.id),
            labels,
        });
    }
    Ok(endpoints)
}

fn ratio_text(r: Option<f64>, target: Option<f64>) -> String {
    match (r, target) {
        (Some(r), Some(t)) => format!("{r:.2}x {}", if r <= t { "PASS" } else { "MISS" }),
        (Some(r), None) => format!("{r:.2}x"),
        (None, _) => "-".into(),
    }
}

fn say_line(m: &Measured) {
    say(format!(
        "  {:<34} {:>7} {:>9.0} {:>8.0} {:>8} {:>9.0} {:>9.0} {:>9.0} {:>7}",
        m.name,
        m.clients,
        m.request_bytes,
        m.answer_bytes,
        m.calls,
        m.latency.p50_us,
        m.latency.p99_us,
        m.latency.p999_us,
        m.errors
    ));
}

fn say_against(a: &Against) {
    say_line(&a.call);
    match (&a.floor, &a.no_floor) {
        (Some(f), _) => {
            say_line(f);
            let target = a
                .target
                .map_or_else(|| "no target".to_owned(), |t| format!("target {t}x"));
            say(format!(
                "  {:<34} p50 {}  p99 {}  ({target})",
                "ratio to the floor",
                ratio_text(a.p50_ratio, a.target),
                ratio_text(a.p99_ratio, a.target)
            ));
        }
        (None, Some(why)) => say(format!("  no floor: {why}")),
        (None, None) => {}
    }
    if let Some(b) = a.bytes_per_second {
        say(format!(
            "  snapshots: {:.0}/s, {:.1} MB/s of snapshot bytes",
            a.call.per_second,
            b / 1e6
        ));
    }
}

fn summary(allocate: &[Against], snapshot: &Against, machine: &Machine) {
    say("");
    say("== floor: Allocate and the snapshot round trip against the transport floor ==");
    say(format!(
        "  {:<34} {:>7} {:>9} {:>8} {:>8} {:>9} {:>9} {:>9} {:>7}",
        "call", "clients", "req B", "answer B", "calls", "p50 µs", "p99 µs", "p99.9 µs", "errors"
    ));
    for a in allocate.iter().chain([snapshot]) {
        say_against(a);
    }
    say(
        "the floor: IdentityService.Lookup of the same labels, padded to the request's size, on the same connection, interleaved in alternating batches",
    );
    say(
        "the harness and the operator share the machine's cores: client-side figures include the harness's own scheduling",
    );
    say(machine.line());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_padded_lookup_takes_the_size_asked() -> anyhow::Result<()> {
        let labels = known_labels(7).as_ref().clone();
        let bare = PaddedLookup::sized(labels.clone(), 0).encoded_len();
        for size in [
            bare,
            bare + 1,
            bare + 2,
            bare + 3,
            bare + 33,
            bare + 130,
            22_000,
        ] {
            let m = PaddedLookup::sized(labels.clone(), size);
            let len = m.encoded_len();
            assert!(len <= size && len + 2 >= size, "asked {size}, got {len}");
        }
        // Exactly, where a padding field can take the gap.
        for size in [bare + 3, bare + 33, bare + 129, 18_220] {
            assert_eq!(
                PaddedLookup::sized(labels.clone(), size).encoded_len(),
                size
            );
        }
        // The operator decodes it as a LookupRequest of the same labels.
        let m = PaddedLookup::sized(labels.clone(), 500);
        let decoded = pb::LookupRequest::decode(m.encode_to_vec().as_slice())?;
        assert_eq!(decoded.labels, labels);
        assert_eq!(decoded.protocol_version, PROTOCOL_VERSION);
        Ok(())
    }
}
