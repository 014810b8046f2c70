//! The cluster-wide endpoint map as watchers get it (DESIGN.md, "The cluster-wide
//! endpoint map").
//!
//! A ticker takes the core's map delta every `tick` (under the core lock) and turns it
//! into batches with the next versions; each batch is encoded once, by the
//! [`MapEncoder`] the gRPC layer gives, and shared by every watcher through a bounded
//! broadcast: a watcher that falls further behind than the buffer is sent the full map
//! again, never queued without bound.
//!
//! Consistency: versions are taken under the core lock and batches are sent in
//! version order under the hub's `sent` lock (always taken after the core lock). A
//! full map is read right after taking the delta, under the same lock, so it is
//! exactly the state at its version (a delta coalesces per address, so a full map read
//! between two takes could hold an address that the next delta, having seen it come
//! and go, never mentions). A watcher then gets the full map, the batches sent after
//! its version (kept in a bounded history) and, from the broadcast it subscribed to
//! under the same `sent` lock, every later one: no gap, no change lost.
//!
//! Cost: the full map is encoded in chunks of at most `batch_entries` items, built once
//! and shared (`Arc`) by every watcher that resyncs while the history still covers
//! what followed it, so a thousand agents reconnecting at once cost one full map; and
//! full maps are sent under a semaphore of `resyncs` permits, so a herd waits its
//! turn instead of multiplying buffers.
//!
//! Memory at rest: the cached full map and its history serve resync herds only, so
//! both are freed once no resync has used them for `cache_idle`, and the history holds
//! only the batches after the cached map, no more bytes than the map itself (past
//! that, a new full map is cheaper to send than the catch-up). An idle operator keeps
//! neither: at 5,000 nodes that is a 8 MiB map and up to as much history.

use std::{
    collections::VecDeque,
    net::IpAddr,
    sync::{Arc, OnceLock},
    time::Duration,
};

use parking_lot::Mutex;
use tokio::{
    sync::{Semaphore, broadcast, watch},
    task::JoinHandle,
    time::Instant,
};

use super::{Inner, Runtime, term};
use crate::{
    allocator::{MapChange, MapDelta, MapEntry, MapNode, MapNodeIndex, SyncError},
    api::{
        Caller, FullMap, MapBatch, MapBatchParts, MapEncoder, MapLookup, MapResync, MapWatch,
        Refused, Term,
    },
};
use census_proto::domain::{NodeName, ServiceSet, SessionId};

/// How the map is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapConfig {
    /// How often changes are taken from the core and sent as one batch.
    pub tick: Duration,
    /// Items (nodes, entries, removed addresses) in one message at most.
    pub batch_entries: usize,
    /// Batches a watcher may fall behind before it is sent the full map again.
    pub buffer: usize,
    /// Full maps sent at once; other watchers wait for their turn.
    pub resyncs: usize,
    /// How long the last full map built is kept for further resyncs after the last
    /// one it served.
    pub cache_idle: Duration,
}

impl Default for MapConfig {
    fn default() -> Self {
        Self {
            tick: Duration::from_millis(100),
            batch_entries: 4096,
            buffer: 64,
            resyncs: 32,
            cache_idle: Duration::from_secs(10),
        }
    }
}

/// Batches kept after the full map last built, so that it serves later resyncs too.
const HISTORY_BATCHES: usize = 1024;
/// Bytes of catch-up a resync is given at least, however small the full map: below
/// this, a catch-up is cheaper than building a new map whatever their sizes.
const MIN_CATCH_UP_BYTES: usize = 64 << 10;

/// What the ticker and the watchers share.
#[derive(Debug)]
pub(super) struct MapHub {
    cfg: MapConfig,
    encoder: Arc<dyn MapEncoder>,
    resyncs: Arc<Semaphore>,
    /// Taken after the core lock, never before it.
    sent: Mutex<Sent>,
    /// The last full map built; builders wait for each other here (before the core
    /// lock).
    full: Mutex<Option<Cached>>,
}

#[derive(Debug)]
struct Sent {
    tx: broadcast::Sender<MapBatch>,
    /// The latest batches after `keep.after`, in version order without a gap; empty
    /// while no full map is cached.
    history: VecDeque<MapBatch>,
    history_bytes: usize,
    /// What the history keeps, set with the cached full map.
    keep: Option<Keep>,
    /// The version of the last batch sent.
    latest: u64,
}

/// The history a cached full map needs: the batches after its version, as many bytes
/// as a resync may be given to catch up from it.
#[derive(Debug, Clone, Copy)]
struct Keep {
    after: u64,
    bytes: usize,
}

#[derive(Debug)]
struct Cached {
    term: Term,
    map: Arc<FullMap>,
    /// When it last served a resync (or was built).
    used: Instant,
}

impl Sent {
    /// Whether the history holds every batch after `version`.
    fn covers(&self, version: u64) -> bool {
        version >= self.latest
            || self
                .history
                .front()
                .is_some_and(|first| first.version <= version + 1)
    }

    /// Keeps the batches after `after` from now on, `bytes` of them at most.
    fn keep(&mut self, keep: Keep) {
        self.keep = Some(keep);
        while let Some(old) = self.history.front()
            && old.version <= keep.after
        {
            self.history_bytes -= old.bytes.len();
            self.history.pop_front();
        }
        self.trim();
    }

    /// Keeps no history: no full map is cached.
    fn forget(&mut self) {
        self.keep = None;
        self.history = VecDeque::new();
        self.history_bytes = 0;
    }

    fn trim(&mut self) {
        let budget = self.keep.map_or(0, |k| k.bytes);
        while self.history.len() > HISTORY_BATCHES || self.history_bytes > budget {
            match self.history.pop_front() {
                Some(old) => self.history_bytes -= old.bytes.len(),
                None => break,
            }
        }
    }

    /// The batches after `version`, if the history still holds all of them.
    fn after(&self, version: u64) -> Option<Vec<MapBatch>> {
        if version >= self.latest {
            return Some(Vec::new());
        }
        self.covers(version).then(|| {
            self.history
                .iter()
                .filter(|b| b.version > version)
                .cloned()
                .collect()
        })
    }
}

/// One batch before encoding.
#[derive(Debug, Default)]
struct Piece {
    version: u64,
    nodes: Vec<MapNode>,
    upserts: Vec<MapEntry>,
    removes: Vec<IpAddr>,
    removed_nodes: Vec<MapNodeIndex>,
    /// The whole set of Service addresses, when the batch carries it.
    services: Option<Arc<ServiceSet>>,
}

impl Piece {
    fn items(&self) -> usize {
        self.nodes.len() + self.upserts.len() + self.removes.len() + self.removed_nodes.len()
    }
}

/// `delta` as batches of at most `max` items: nodes first, removed nodes last.
fn split(delta: MapDelta, max: usize) -> Vec<Piece> {
    let max = max.max(1);
    let MapDelta {
        nodes,
        changes,
        removed_nodes,
    } = delta;
    let mut pieces = vec![Piece::default()];
    let room = |pieces: &mut Vec<Piece>| -> usize {
        if pieces.last().is_some_and(|p| p.items() >= max) {
            pieces.push(Piece::default());
        }
        pieces.len() - 1
    };
    for node in nodes {
        let i = room(&mut pieces);
        pieces[i].nodes.push(node);
    }
    for change in changes {
        let i = room(&mut pieces);
        match change {
            MapChange::Upsert(entry) => pieces[i].upserts.push(entry),
            MapChange::Remove(ip) => pieces[i].removes.push(ip),
        }
    }
    for index in removed_nodes {
        let i = room(&mut pieces);
        pieces[i].removed_nodes.push(index);
    }
    pieces
}

impl MapHub {
    fn encode(&self, piece: &Piece, resync: (bool, bool), built_at_ms: u64) -> MapBatch {
        let bytes = self.encoder.encode(&MapBatchParts {
            resync_start: resync.0,
            resync_end: resync.1,
            nodes: &piece.nodes,
            upserts: &piece.upserts,
            removes: &piece.removes,
            removed_nodes: &piece.removed_nodes,
            services: piece.services.as_deref(),
            built_at_ms,
            version: piece.version,
        });
        MapBatch {
            version: piece.version,
            bytes,
        }
    }

    fn push(sent: &mut Sent, batch: MapBatch) {
        sent.latest = batch.version;
        if sent.keep.is_some_and(|k| batch.version > k.after) {
            sent.history_bytes += batch.bytes.len();
            sent.history.push_back(batch.clone());
            sent.trim();
        }
        // No receiver is not an error: nobody watches yet.
        let _ = sent.tx.send(batch);
    }
}

impl Runtime {
    /// Serves the endpoint map with `encoder` from now on: the ticker runs until
    /// `stop` turns true. Before this, Watch is refused as not served.
    pub fn serve_map(
        self: &Arc<Self>,
        cfg: MapConfig,
        encoder: Arc<dyn MapEncoder>,
        mut stop: watch::Receiver<bool>,
    ) -> JoinHandle<()> {
        let (tx, _) = broadcast::channel(cfg.buffer.max(1));
        let _ = self.map.set(MapHub {
            cfg,
            encoder,
            resyncs: Arc::new(Semaphore::new(cfg.resyncs.max(1))),
            sent: Mutex::new(Sent {
                tx,
                history: VecDeque::new(),
                history_bytes: 0,
                keep: None,
                latest: 0,
            }),
            full: Mutex::new(None),
        });
        let runtime = Arc::clone(self);
        tokio::spawn(async move {
            let mut interval = tokio::time::interval(cfg.tick);
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = interval.tick() => runtime.map_tick(),
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
        })
    }

    /// Sends what changed in the map since the last tick as batches.
    pub fn map_tick(&self) {
        let Some(hub) = self.map.get() else { return };
        let mut inner = self.inner.lock();
        let pieces = self.take_pieces(&mut inner, hub);
        if !pieces.is_empty() {
            let built_at = self.clock.now().as_millis();
            let mut sent = hub.sent.lock();
            drop(inner);
            for piece in &pieces {
                self.send_piece(hub, &mut sent, piece, built_at);
            }
            drop(sent);
        } else {
            drop(inner);
        }
        // A full map the history no longer covers serves nobody, nor one no resync
        // has wanted for a while: free it and its history.
        if let Some(mut cache) = hub.full.try_lock() {
            let done = cache.as_ref().is_some_and(|c| {
                c.used.elapsed() >= hub.cfg.cache_idle || !hub.sent.lock().covers(c.map.version)
            });
            if done {
                *cache = None;
                hub.sent.lock().forget();
                self.note_cache("full", 0);
                self.note_cache("history", 0);
            }
        }
    }

    /// The core's delta as numbered pieces, under the core lock; the first carries
    /// the Service addresses if they changed since the last take (then there is at
    /// least one piece).
    fn take_pieces(&self, inner: &mut Inner, hub: &MapHub) -> Vec<Piece> {
        let delta = inner.alloc.take_map_delta();
        let services = std::mem::take(&mut inner.services_changed);
        if delta.is_empty() && !services {
            return Vec::new();
        }
        let mut pieces = split(delta, hub.cfg.batch_entries);
        if services {
            pieces[0].services = inner.services.clone();
        }
        for piece in &mut pieces {
            inner.map_version += 1;
            piece.version = inner.map_version;
        }
        pieces
    }

    fn send_piece(&self, hub: &MapHub, sent: &mut Sent, piece: &Piece, built_at: u64) {
        let batch = hub.encode(piece, (false, false), built_at);
        self.metrics.map_batches_built.inc();
        self.metrics
            .map_bytes_encoded
            .get_or_create(&crate::metrics::KindLabels { kind: "batch" })
            .inc_by(batch.bytes.len() as u64);
        MapHub::push(sent, batch);
        self.note_cache("history", sent.history_bytes);
    }

    /// Sets the gauge of bytes kept for resyncs of `kind`.
    fn note_cache(&self, kind: &'static str, bytes: usize) {
        self.metrics
            .map_cache_bytes
            .get_or_create(&crate::metrics::KindLabels { kind })
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// The full map at the current version, encoded in chunks.
    fn build_full(&self, hub: &MapHub, term: Term) -> Result<Arc<FullMap>, Refused> {
        let mut inner = self.inner.lock();
        term::current(&inner, term)?;
        let pieces = self.take_pieces(&mut inner, hub);
        let (nodes, entries) = inner.alloc.map_full();
        let services = inner.services.clone();
        let version = inner.map_version;
        let built_at = self.clock.now().as_millis();
        let mut sent = hub.sent.lock();
        drop(inner);
        for piece in &pieces {
            self.send_piece(hub, &mut sent, piece, built_at);
        }
        // From here on the history serves this map (the caller holds the `full` lock
        // and caches it); its size is not known before it is encoded.
        sent.keep(Keep {
            after: version,
            bytes: usize::MAX,
        });
        drop(sent);

        let count = entries.len();
        let mut chunks = split(
            MapDelta {
                nodes,
                changes: entries.into_iter().map(MapChange::Upsert).collect(),
                removed_nodes: Vec::new(),
            },
            hub.cfg.batch_entries,
        );
        let last = chunks.len() - 1;
        chunks[0].services = services;
        let mut encoded = Vec::with_capacity(chunks.len());
        for (i, chunk) in chunks.iter_mut().enumerate() {
            chunk.version = version;
            encoded.push(hub.encode(chunk, (i == 0, i == last), built_at).bytes);
        }
        let bytes = encoded.iter().map(bytes::Bytes::len).sum();
        let mut sent = hub.sent.lock();
        sent.keep(Keep {
            after: version,
            bytes: catch_up_budget(bytes),
        });
        self.note_cache("history", sent.history_bytes);
        drop(sent);
        self.note_cache("full", bytes);
        self.metrics.map_full_maps_built.inc();
        self.metrics
            .map_bytes_encoded
            .get_or_create(&crate::metrics::KindLabels { kind: "full" })
            .inc_by(bytes as u64);
        Ok(Arc::new(FullMap {
            version,
            chunks: encoded,
            entries: count,
            bytes,
        }))
    }

    pub(super) fn map_watch(
        &self,
        caller: &Caller,
        session: SessionId,
    ) -> Result<MapWatch, Refused> {
        let hub = self.map.get().ok_or(Refused::MapNotServed)?;
        // Before the term is read: a change after it is seen.
        let terms = self.terms.subscribe();
        let inner = self.inner.lock();
        if let Some(refusal) = term::refusal(&inner) {
            return Err(refusal.into());
        }
        current_session(&inner, &caller.node, session)?;
        Ok(MapWatch {
            term: inner.term,
            terms,
            resyncs: Arc::clone(&hub.resyncs),
        })
    }

    pub(super) fn map_resync(&self, term: Term) -> Result<MapResync, Refused> {
        let hub = self.map.get().ok_or(Refused::MapNotServed)?;
        let mut cache = hub.full.lock();
        // A full map just built is only missed by what follows it if the history
        // overflowed in between: then again, a few times at most.
        for _ in 0..3 {
            if let Some(cached) = cache.as_mut().filter(|c| c.term == term)
                && *self.terms.borrow() == term
            {
                let sent = hub.sent.lock();
                if let Some(catch_up) = sent.after(cached.map.version) {
                    let behind: usize = catch_up.iter().map(|b| b.bytes.len()).sum();
                    // Past the size of a new full map, a new one is cheaper to send.
                    if behind <= catch_up_budget(cached.map.bytes) {
                        cached.used = Instant::now();
                        return Ok(MapResync {
                            full: Arc::clone(&cached.map),
                            catch_up,
                            changes: sent.tx.subscribe(),
                        });
                    }
                }
            }
            let map = self.build_full(hub, term)?;
            *cache = Some(Cached {
                term,
                map,
                used: Instant::now(),
            });
        }
        Err(Refused::MapBusy)
    }

    pub(super) fn map_lookup(&self, ip: IpAddr) -> Result<Option<MapLookup>, Refused> {
        let inner = self.inner.lock();
        if let Some(refusal) = term::refusal(&inner) {
            return Err(refusal.into());
        }
        Ok(inner.alloc.map_lookup(ip))
    }

    /// Batches built so far (the map's version), and whether the map is served.
    pub fn map_version(&self) -> Option<u64> {
        self.map.get().map(|hub| hub.sent.lock().latest)
    }
}

/// Bytes of batches a resync from a full map of `map_bytes` may be given to catch up:
/// past the map's own size, a new full map is cheaper to send.
fn catch_up_budget(map_bytes: usize) -> usize {
    map_bytes.max(MIN_CATCH_UP_BYTES)
}

/// Whether `session` is `node`'s current session, as Allocate checks it.
fn current_session(inner: &Inner, node: &NodeName, session: SessionId) -> Result<(), SyncError> {
    let no_session = || SyncError::NoSession { node: node.clone() };
    let current = inner
        .alloc
        .node(node)
        .and_then(|n| n.session)
        .ok_or_else(no_session)?;
    if current > session {
        return Err(SyncError::StaleSession {
            node: node.clone(),
            current,
            offered: session,
        });
    }
    if current != session {
        return Err(SyncError::WrongSession {
            node: node.clone(),
            current,
            offered: session,
        });
    }
    Ok(())
}

/// The map's parts of the runtime: set once, by [`Runtime::serve_map`].
pub(super) type Hub = OnceLock<MapHub>;

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use census_proto::domain::IdentityId;

    use super::*;

    fn entry(i: u8) -> MapEntry {
        MapEntry {
            ip: IpAddr::from([10, 0, 0, i]),
            identity: IdentityId::WORLD,
            node: MapNodeIndex(NonZeroU32::MIN),
        }
    }

    #[test]
    fn a_delta_splits_into_bounded_batches_nodes_first_removed_nodes_last()
    -> Result<(), Box<dyn std::error::Error>> {
        let node = MapNode {
            index: MapNodeIndex(NonZeroU32::MIN),
            name: NodeName::new("n1")?,
        };
        let delta = MapDelta {
            nodes: vec![node.clone()],
            changes: vec![
                MapChange::Upsert(entry(1)),
                MapChange::Remove(IpAddr::from([10, 0, 0, 2])),
                MapChange::Upsert(entry(3)),
            ],
            removed_nodes: vec![MapNodeIndex(NonZeroU32::MAX)],
        };
        let pieces = split(delta.clone(), 2);
        assert_eq!(
            pieces.iter().map(Piece::items).collect::<Vec<_>>(),
            [2, 2, 1]
        );
        assert_eq!(pieces[0].nodes, [node]);
        assert_eq!(pieces[0].upserts, [entry(1)]);
        assert_eq!(pieces[1].removes, [IpAddr::from([10, 0, 0, 2])]);
        assert_eq!(pieces[1].upserts, [entry(3)]);
        assert_eq!(pieces[2].removed_nodes, [MapNodeIndex(NonZeroU32::MAX)]);
        assert_eq!(split(delta, 4096).len(), 1);
        assert_eq!(split(MapDelta::default(), 10).len(), 1, "one empty batch");
        Ok(())
    }
}
