//! Raw EndpointMap.Watch clients, as many as there are simulated nodes: each reads
//! the stream as bytes and scans only a batch's flags, version and entry counts
//! (thousands of full decodes of a 110k-entry map would measure the harness). A probe
//! watcher also decodes batches of changes fully, to time propagation.
//!
//! [`spawn_watchers`] starts one watch per node at once, each ending with its stream
//! (the map presets' herd); [`keep_watching`] watches as an agent does, opening the
//! watch again after the stream ends, once its node is connected again (the scale
//! presets, across an operator restart).

use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use anyhow::Context as _;
use bytes::{Buf as _, Bytes};
use census_proto::{PROTOCOL_VERSION, pb};
use parking_lot::Mutex;
use prost::Message as _;
use rand::RngExt as _;
use tokio::{
    task::JoinHandle,
    time::{Instant, sleep},
};
use tonic::{
    Status,
    codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder},
    codegen::http::uri::PathAndQuery,
    transport::Channel,
};

use super::agents::{Fleet, Node, NodeHandle};

/// What a batch says about itself, read without decoding its entries.
#[derive(Debug, Default, Clone, Copy)]
struct Header {
    resync_start: bool,
    resync_end: bool,
    upserts: u64,
    removes: u64,
    version: u64,
}

fn varint(buf: &mut &[u8]) -> Option<u64> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let (&byte, rest) = buf.split_first()?;
        *buf = rest;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Some(value);
        }
    }
    None
}

/// Scans the top-level fields of an encoded `EndpointMapBatch`.
fn scan(mut buf: &[u8]) -> Option<Header> {
    let mut h = Header::default();
    while !buf.is_empty() {
        let key = varint(&mut buf)?;
        match key & 7 {
            0 => {
                let v = varint(&mut buf)?;
                match key >> 3 {
                    1 => h.resync_start = v != 0,
                    2 => h.resync_end = v != 0,
                    8 => h.version = v,
                    _ => {}
                }
            }
            2 => {
                let len = usize::try_from(varint(&mut buf)?).ok()?;
                if len > buf.len() {
                    return None;
                }
                match key >> 3 {
                    4 => h.upserts += 1,
                    5 => h.removes += 1,
                    _ => {}
                }
                buf = &buf[len..];
            }
            _ => return None,
        }
    }
    Some(h)
}

/// A Watch client that keeps the bytes as they came.
#[derive(Debug, Clone, Copy, Default)]
struct RawCodec;

impl Encoder for RawCodec {
    type Item = pb::EndpointMapWatchRequest;
    type Error = Status;

    fn encode(&mut self, item: Self::Item, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        item.encode(dst)
            .map_err(|e| Status::internal(format!("encoding the request: {e}")))
    }
}

impl Decoder for RawCodec {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        let len = src.remaining();
        Ok(Some(src.copy_to_bytes(len)))
    }
}

impl Codec for RawCodec {
    type Encode = pb::EndpointMapWatchRequest;
    type Decode = Bytes;
    type Encoder = Self;
    type Decoder = Self;

    fn encoder(&mut self) -> Self {
        *self
    }

    fn decoder(&mut self) -> Self {
        *self
    }
}

/// Addresses created by the churn, waiting to be seen by a probe watcher.
pub(crate) type Pending = Arc<Mutex<HashMap<Vec<u8>, Instant>>>;

/// What every watcher counts.
#[derive(Debug, Default)]
pub(crate) struct Watched {
    /// Streams that delivered their full map (with [`spawn_watchers`], one per
    /// watcher: the watchers with their first full map).
    pub(crate) synced: AtomicUsize,
    /// Watchers whose open stream delivered its full map and holds at least
    /// `complete_at` entries since.
    pub(crate) complete: AtomicUsize,
    /// Entries a watcher's map must hold to count as complete (0: any full map).
    complete_at: u64,
    pub(crate) bytes: AtomicU64,
    pub(crate) resyncs: AtomicU64,
    pub(crate) gaps: AtomicU64,
    pub(crate) latencies: Mutex<Vec<Duration>>,
}

impl Watched {
    /// Counters for watchers whose map is complete once it holds `entries` entries.
    /// A watcher counts its entries as upserts less removes since its full map
    /// started: exact while no address is upserted again without a remove in between,
    /// as when pods do not change.
    pub(crate) fn complete_at(entries: u64) -> Self {
        Self {
            complete_at: entries,
            ..Self::default()
        }
    }
}

/// Counts a watcher in [`Watched::complete`] for as long as it lives.
struct Complete<'a>(&'a AtomicUsize);

impl<'a> Complete<'a> {
    fn new(complete: &'a AtomicUsize) -> Self {
        complete.fetch_add(1, Ordering::Relaxed);
        Self(complete)
    }
}

impl Drop for Complete<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One watch until it ends; `pending` for a probe.
pub(crate) async fn watch(
    channel: Channel,
    node: String,
    session: pb::Session,
    watched: Arc<Watched>,
    pending: Option<Pending>,
) -> anyhow::Result<()> {
    let mut synced = false;
    watch_stream(channel, node, session, &watched, pending, &mut synced).await
}

/// [`watch`], telling through `synced` whether the stream delivered its full map,
/// also when it ends in an error.
async fn watch_stream(
    channel: Channel,
    node: String,
    session: pb::Session,
    watched: &Watched,
    pending: Option<Pending>,
    synced: &mut bool,
) -> anyhow::Result<()> {
    let mut grpc = tonic::client::Grpc::new(channel).max_decoding_message_size(64 << 20);
    grpc.ready().await.context("connecting")?;
    let request = pb::EndpointMapWatchRequest {
        protocol_version: PROTOCOL_VERSION,
        node,
        session: Some(session),
    };
    let mut stream = grpc
        .server_streaming(
            tonic::Request::new(request),
            PathAndQuery::from_static("/census.v1.EndpointMap/Watch"),
            RawCodec,
        )
        .await
        .context("EndpointMap.Watch")?
        .into_inner();
    let mut in_resync = false;
    let mut version = 0u64;
    let mut entries = 0u64;
    let mut complete = None;
    while let Some(bytes) = stream.message().await? {
        watched
            .bytes
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        let h = scan(&bytes).context("a batch that does not parse")?;
        if h.resync_start {
            in_resync = true;
            entries = 0;
            watched.resyncs.fetch_add(1, Ordering::Relaxed);
        }
        entries = (entries + h.upserts).saturating_sub(h.removes);
        if !in_resync {
            if h.version != version + 1 {
                watched.gaps.fetch_add(1, Ordering::Relaxed);
            }
            if let Some(pending) = &pending
                && h.upserts > 0
            {
                let batch = pb::EndpointMapBatch::decode(bytes)?;
                let now = Instant::now();
                let mut pending = pending.lock();
                for entry in batch.upserts {
                    if let Some(created) = pending.remove(&entry.ip) {
                        watched.latencies.lock().push(now - created);
                    }
                }
            }
        }
        if in_resync && h.resync_end {
            in_resync = false;
            if !*synced {
                *synced = true;
                watched.synced.fetch_add(1, Ordering::Relaxed);
            }
        }
        if *synced && complete.is_none() && entries >= watched.complete_at {
            complete = Some(Complete::new(&watched.complete));
        }
        if !in_resync {
            version = h.version;
        }
    }
    Ok(())
}

/// One watch per node, all started at once, each ending with its stream; about
/// `probes` of them are probes.
pub(crate) fn spawn_watchers(
    fleet: &Fleet,
    nodes: &[Node],
    watched: &Arc<Watched>,
    pending: &Pending,
    probes: usize,
) -> Vec<JoinHandle<()>> {
    nodes
        .iter()
        .enumerate()
        .map(|(i, node)| {
            let probe = (i % (nodes.len() / probes.max(1)).max(1) == 0).then(|| pending.clone());
            let task = watch(
                fleet.channel(i),
                node.name.clone(),
                node.session,
                watched.clone(),
                probe,
            );
            tokio::spawn(async move {
                let _ = task.await;
            })
        })
        .collect()
}

/// The watch of node `index`, on the node's channel, as its agent keeps it: opened
/// once the node is connected (the operator accepts a watch for the node's current
/// session only), and again with jittered backoff whenever it ends, until aborted.
pub(crate) fn keep_watching(
    fleet: &Fleet,
    index: usize,
    node: NodeHandle,
    watched: Arc<Watched>,
) -> JoinHandle<()> {
    let fleet = fleet.clone();
    tokio::spawn(async move {
        let mut backoff = Duration::from_millis(100);
        loop {
            while !node.is_connected() {
                sleep(Duration::from_millis(50)).await;
            }
            let mut synced = false;
            let _ = watch_stream(
                fleet.channel(index),
                node.name.clone(),
                node.session,
                &watched,
                None,
                &mut synced,
            )
            .await;
            // A stream that got as far as its full map was a working one: start over.
            if synced {
                backoff = Duration::from_millis(100);
            }
            let jittered = backoff.mul_f64(rand::rng().random_range(0.9..1.1));
            sleep(jittered).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    })
}
