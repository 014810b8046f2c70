use std::{
    net::{IpAddr, Ipv4Addr},
    sync::Arc,
    time::Duration,
};

use census_proto::{
    convert::WireLimits,
    domain::{
        AllocationId, Endpoint, EndpointKey, IdRange, IdentityId, NodeName, ServiceKind, SessionId,
    },
    labels::{LabelFilter, LabelSet},
};
use tokio::sync::{broadcast, mpsc};

use super::*;
use crate::{
    allocator::SyncError,
    allocator::{IdentityInfo, IdentityState},
    api::{Allocation, Api, Caller, MapResync, Refused},
    replica::{Admission, AdmissionError, Leader, NotLeader, ReadModel},
    store::StoreError,
};

/// A read model with one binding, and an admission that lets everyone in.
#[derive(Debug)]
struct Fixed(IdentityId, LabelSet, broadcast::Sender<WatchChange>);

impl ReadModel for Fixed {
    fn identity(&self, id: IdentityId) -> Option<IdentityInfo> {
        (id == self.0).then(|| IdentityInfo {
            id,
            labels: Some(self.1.clone()),
            state: IdentityState::Live,
            refs: 0,
            holds: 0,
        })
    }
    fn lookup(&self, labels: &LabelSet) -> Option<IdentityInfo> {
        (*labels == self.1).then(|| self.identity(self.0)).flatten()
    }
    fn list(
        &self,
        _: Option<IdentityId>,
        _: usize,
        _: Option<&LabelSet>,
        _: bool,
    ) -> (Vec<IdentityInfo>, bool) {
        (self.identity(self.0).into_iter().collect(), false)
    }
    fn bindings(&self) -> Vec<IdentityInfo> {
        self.identity(self.0).into_iter().collect()
    }
    fn subscribe(&self) -> broadcast::Receiver<WatchChange> {
        self.2.subscribe()
    }
}

#[derive(Debug)]
struct Anyone;

impl Admission for Anyone {
    fn admit(&self, _: &NodeName, _: Option<IpAddr>) -> Result<(), AdmissionError> {
        Ok(())
    }
}

fn settings() -> Settings {
    Settings {
        filter: LabelFilter::default(),
        wire: WireLimits::default(),
        snapshot_interval: Duration::from_secs(30),
        max_message_bytes: 4 << 20,
        store_kind: "test",
    }
}

fn cfg() -> Result<Config, Box<dyn std::error::Error>> {
    Ok(Config {
        range: IdRange::new(256, 300)?,
        adoption_window: Duration::ZERO,
        ..Config::default()
    })
}

const SESSION: SessionId = SessionId {
    start_time_ns: 1,
    nonce: 1,
};

fn caller() -> Result<Caller, Box<dyn std::error::Error>> {
    Ok(Caller {
        node: NodeName::new("n1")?,
        peer: Some(IpAddr::from(Ipv4Addr::LOCALHOST)),
    })
}

#[tokio::test]
async fn roles_change_in_terms_and_followers_refuse_writes()
-> Result<(), Box<dyn std::error::Error>> {
    let web: LabelSet = "k8s:app=web".parse()?;
    let stored = IdentityId::new(4000).ok_or("id")?;
    let replica = Replica {
        reads: Arc::new(Fixed(stored, web.clone(), broadcast::channel(4).0)),
        admission: Arc::new(Anyone),
    };
    let runtime = Runtime::new_replica(
        cfg()?,
        Clock::new(),
        settings(),
        Metrics::default(),
        replica,
    );
    let caller = caller()?;

    // A follower: reads from the read model, writes refused naming the leader.
    assert_eq!(runtime.lookup(&web).map(|i| i.id), Some(stored));
    assert_eq!(runtime.identity_feed().full.len(), 1);
    let leader = Leader {
        name: "op-b".into(),
        address: Some("10.0.0.2:9460".into()),
    };
    runtime.set_leader(Some(leader.clone()));
    let (tx, _rx) = mpsc::channel(8);
    match runtime.hello(&caller, SESSION, Vec::new(), tx) {
        Err(Refused::NotLeader(NotLeader { leader: Some(l) })) => assert_eq!(l, leader),
        other => return Err(format!("expected NotLeader, got {other:?}").into()),
    }
    assert!(matches!(
        runtime.allocate(&caller, SESSION, AllocationId::NONE, web.clone()),
        Err(Refused::NotLeader(_))
    ));

    // Leading: the core answers; its bindings, not the read model's.
    let mut terms = runtime.terms();
    let _queues = runtime.lead(Allocator::new(cfg()?, Loaded::default(), runtime.now()));
    assert!(terms.has_changed()?);
    let _ = terms.borrow_and_update();
    let (tx, mut rx) = mpsc::channel(8);
    let stream = runtime.hello(&caller, SESSION, Vec::new(), tx)?;
    assert!(runtime.lookup(&web).is_none());
    assert!(runtime.identity_feed().full.is_empty());
    assert!(runtime.node(&caller.node).is_some());

    // Stepping down: the stream is ended naming the leader, the old term is over,
    // and late store answers are dropped.
    runtime.follow(Some(leader.clone()));
    assert!(terms.has_changed()?);
    assert_eq!(
        rx.recv().await,
        Some(ToAgent::End(StreamEnd::NotLeader(Box::new(NotLeader {
            leader: Some(leader)
        }))))
    );
    let key = EndpointKey::new("default", "web-1")?;
    assert!(matches!(
        runtime.delete(&stream, 1, &key),
        Err(Refused::NotLeader(_))
    ));
    runtime.disconnect(&stream);
    runtime.store_results(
        stream.term,
        [(
            StoreOp::DeleteTombstone { id: stored },
            Err(StoreError::Unavailable {
                cause: "late",
                detail: String::new(),
            }),
        )],
    );
    assert_eq!(runtime.read(|a| a.counters().store_failures.len()), 0);
    assert_eq!(runtime.lookup(&web).map(|i| i.id), Some(stored));
    Ok(())
}

#[tokio::test]
async fn a_new_term_never_hears_of_an_old_terms_writes() -> Result<(), Box<dyn std::error::Error>> {
    let replica = Replica {
        reads: Arc::new(Fixed(
            IdentityId::new(4000).ok_or("id")?,
            "k8s:app=web".parse()?,
            broadcast::channel(4).0,
        )),
        admission: Arc::new(Anyone),
    };
    let runtime = Runtime::new_replica(
        cfg()?,
        Clock::new(),
        settings(),
        Metrics::default(),
        replica,
    );
    let _first = runtime.lead(Allocator::new(cfg()?, Loaded::default(), runtime.now()));
    let old = *runtime.terms().borrow();
    runtime.follow(None);
    let _second = runtime.lead(Allocator::new(cfg()?, Loaded::default(), runtime.now()));
    let failed = || {
        [(
            StoreOp::DeleteTombstone {
                id: IdentityId::new(260).unwrap_or(IdentityId::WORLD),
            },
            Err(StoreError::Unavailable {
                cause: "late",
                detail: String::new(),
            }),
        )]
    };
    runtime.store_results(old, failed());
    assert_eq!(runtime.read(|a| a.counters().store_failures.len()), 0);
    runtime.store_results(*runtime.terms().borrow(), failed());
    assert_eq!(runtime.read(|a| a.counters().store_failures.len()), 1);
    Ok(())
}

#[tokio::test]
async fn a_known_label_set_is_answered_at_once_with_its_identity()
-> Result<(), Box<dyn std::error::Error>> {
    let web: LabelSet = "k8s:app=web".parse()?;
    let (runtime, _queues) = Runtime::new(
        Allocator::new(cfg()?, Loaded::default(), Clock::new().now()),
        Clock::new(),
        settings(),
        Metrics::default(),
    );
    let caller = caller()?;
    let (tx, _rx) = mpsc::channel(8);
    runtime.hello(&caller, SESSION, Vec::new(), tx)?;
    let Allocation::New(pending) =
        runtime.allocate(&caller, SESSION, AllocationId::NONE, web.clone())?
    else {
        return Err("a new label set is persisted first".into());
    };
    // The writer's answer, as it would come back from the store.
    let op = StoreOp::CreateIdentity {
        id: IdentityId::new(256).ok_or("id")?,
        labels: web.clone(),
    };
    runtime.store_results(0, [(op, Ok(()))]);
    let new = pending.await??;
    assert_eq!(new.info.as_ref().map(|i| i.id), Some(new.id));
    match runtime.allocate(&caller, SESSION, AllocationId::NONE, web)? {
        Allocation::Known(known) => {
            assert_eq!(known.id, new.id);
            assert_eq!(known.info.map(|i| i.holds), Some(1));
        }
        Allocation::New(_) => return Err("a known label set is answered at once".into()),
    }
    Ok(())
}

/// Records what it encodes; the bytes name the batch's version.
#[derive(Debug, Default)]
struct Recorder(Mutex<Vec<RecordedBatch>>);

#[derive(Debug, Clone)]
struct RecordedBatch {
    version: u64,
    resync: (bool, bool),
    upserts: Vec<IpAddr>,
    removes: Vec<IpAddr>,
    services: Option<ServiceSet>,
}

impl crate::api::MapEncoder for Recorder {
    fn encode(&self, batch: &crate::api::MapBatchParts<'_>) -> bytes::Bytes {
        self.0.lock().push(RecordedBatch {
            version: batch.version,
            resync: (batch.resync_start, batch.resync_end),
            upserts: batch.upserts.iter().map(|e| e.ip).collect(),
            removes: batch.removes.to_vec(),
            services: batch.services.cloned(),
        });
        bytes::Bytes::copy_from_slice(&batch.version.to_be_bytes())
    }
}

impl Recorder {
    /// The batch (not a full-map chunk) of `version`.
    fn batch(&self, version: u64) -> Option<RecordedBatch> {
        self.0
            .lock()
            .iter()
            .find(|b| b.version == version && b.resync == (false, false))
            .cloned()
    }

    /// The addresses of the full map of `version`.
    fn full(&self, version: u64) -> Vec<IpAddr> {
        let all = self.0.lock();
        let mut ips: Vec<IpAddr> = all
            .iter()
            .filter(|b| b.version == version && b.resync != (false, false))
            .flat_map(|b| b.upserts.clone())
            .collect();
        ips.sort();
        ips
    }
}

fn web(name: &str, ip: [u8; 4], id: u32) -> Result<Endpoint, Box<dyn std::error::Error>> {
    Ok(Endpoint {
        key: EndpointKey::new("shop", name)?,
        ips: vec![IpAddr::from(ip)].into(),
        identity: IdentityId::new(id).ok_or("id")?,
        labels: "k8s:app=web".parse()?,
    })
}

/// What a watcher holds after `resync` and the batches up to `upto`.
fn watcher_state(rec: &Recorder, resync: &MapResync, upto: u64) -> Vec<IpAddr> {
    let mut ips = rec.full(resync.full.version);
    for version in resync.full.version + 1..=upto {
        if let Some(batch) = rec.batch(version) {
            ips.retain(|ip| !batch.removes.contains(ip));
            ips.extend(batch.upserts);
        }
    }
    ips.sort();
    ips.dedup();
    ips
}

#[tokio::test]
async fn a_full_map_is_exact_at_its_version_so_no_later_change_is_lost()
-> Result<(), Box<dyn std::error::Error>> {
    let (runtime, _queues) = Runtime::new(
        Allocator::new(cfg()?, Loaded::default(), Clock::new().now()),
        Clock::new(),
        settings(),
        Metrics::default(),
    );
    let rec = Arc::new(Recorder::default());
    let (_stop_tx, stop) = watch::channel(false);
    let cfg = MapConfig {
        // Ticks only when the test calls them.
        tick: Duration::from_secs(3600),
        ..MapConfig::default()
    };
    let _ticker = runtime.serve_map(cfg, rec.clone(), stop);
    let caller = caller()?;
    let (tx, _rx) = mpsc::channel(8);
    let stream = runtime.hello(&caller, SESSION, Vec::new(), tx)?;
    let watch = runtime.map_watch(&caller, SESSION)?;
    runtime.snapshot(
        &stream,
        1,
        vec![web("web-0", [198, 18, 0, 2], 300)?],
        AllocationId::NONE,
    )?;
    runtime.map_tick();
    // Added after the last tick, then read by a full map, then removed again before
    // the next tick: the watcher must still hear of the removal.
    runtime.snapshot(
        &stream,
        2,
        vec![
            web("web-0", [198, 18, 0, 2], 300)?,
            web("web-1", [198, 18, 0, 3], 300)?,
        ],
        AllocationId::NONE,
    )?;
    let mut resync = runtime.map_resync(watch.term)?;
    assert_eq!(
        rec.full(resync.full.version),
        [IpAddr::from([198, 18, 0, 2]), IpAddr::from([198, 18, 0, 3])]
    );
    runtime.snapshot(
        &stream,
        3,
        vec![web("web-0", [198, 18, 0, 2], 300)?],
        AllocationId::NONE,
    )?;
    runtime.map_tick();
    let mut last = resync.full.version;
    while let Ok(batch) = resync.changes.try_recv() {
        last = last.max(batch.version);
    }
    assert!(last > resync.full.version, "the removal came as a batch");
    assert_eq!(
        watcher_state(&rec, &resync, last),
        runtime.read(|a| {
            let mut ips: Vec<IpAddr> = a.map_full().1.iter().map(|e| e.ip).collect();
            ips.sort();
            ips
        }),
        "the watcher equals the operator's map"
    );

    // A second resync at the same version shares the full map: built once.
    let again = runtime.map_resync(watch.term)?;
    assert!(Arc::ptr_eq(&again.full, &resync.full) || again.full.version > resync.full.version);
    assert!(
        again
            .catch_up
            .iter()
            .all(|b| b.version > again.full.version),
        "{:?}",
        again.catch_up
    );
    Ok(())
}

#[tokio::test]
async fn a_follower_refuses_map_watches_and_a_change_of_term_ends_them()
-> Result<(), Box<dyn std::error::Error>> {
    let replica = Replica {
        reads: Arc::new(Fixed(
            IdentityId::new(4000).ok_or("id")?,
            "k8s:app=web".parse()?,
            broadcast::channel(4).0,
        )),
        admission: Arc::new(Anyone),
    };
    let runtime = Runtime::new_replica(
        cfg()?,
        Clock::new(),
        settings(),
        Metrics::default(),
        replica,
    );
    let caller = caller()?;
    // Not served yet: refused as such (the gRPC layer answers UNIMPLEMENTED).
    assert!(matches!(
        runtime.map_watch(&caller, SESSION),
        Err(Refused::MapNotServed)
    ));
    let (_stop_tx, stop) = watch::channel(false);
    let _ticker = runtime.serve_map(MapConfig::default(), Arc::new(Recorder::default()), stop);
    let leader = Leader {
        name: "op-b".into(),
        address: Some("10.0.0.2:9460".into()),
    };
    runtime.set_leader(Some(leader.clone()));
    match runtime.map_watch(&caller, SESSION) {
        Err(Refused::NotLeader(NotLeader { leader: Some(l) })) => assert_eq!(l, leader),
        other => return Err(format!("expected NotLeader, got {other:?}").into()),
    }
    assert!(matches!(
        runtime.map_lookup(IpAddr::from([198, 18, 0, 2])),
        Err(Refused::NotLeader(_))
    ));

    let _queues = runtime.lead(Allocator::new(cfg()?, Loaded::default(), runtime.now()));
    // Leading, but the node has not said Hello in this term.
    assert!(matches!(
        runtime.map_watch(&caller, SESSION),
        Err(Refused::Sync(SyncError::NoSession { .. }))
    ));
    let (tx, _rx) = mpsc::channel(8);
    runtime.hello(&caller, SESSION, Vec::new(), tx)?;
    let mut watch = runtime.map_watch(&caller, SESSION)?;
    let resync = runtime.map_resync(watch.term)?;
    assert_eq!(resync.full.chunks.len(), 1, "an empty map is one batch");

    runtime.follow(Some(leader));
    assert!(
        watch.terms.has_changed()?,
        "the watch hears of the new term"
    );
    assert!(matches!(
        runtime.map_resync(watch.term),
        Err(Refused::NotLeader(_))
    ));
    assert!(matches!(
        runtime.map_watch(&caller, SESSION),
        Err(Refused::NotLeader(_))
    ));
    let _ = watch.terms.borrow_and_update();
    Ok(())
}

#[tokio::test]
async fn service_addresses_go_whole_in_a_full_maps_first_chunk_and_after_each_change()
-> Result<(), Box<dyn std::error::Error>> {
    let (runtime, _queues) = Runtime::new(
        Allocator::new(cfg()?, Loaded::default(), Clock::new().now()),
        Clock::new(),
        settings(),
        Metrics::default(),
    );
    let rec = Arc::new(Recorder::default());
    let (_stop_tx, stop) = watch::channel(false);
    let cfg = MapConfig {
        tick: Duration::from_secs(3600),
        batch_entries: 1,
        ..MapConfig::default()
    };
    let _ticker = runtime.serve_map(cfg, rec.clone(), stop);
    let caller = caller()?;
    let (tx, _rx) = mpsc::channel(8);
    let stream = runtime.hello(&caller, SESSION, Vec::new(), tx)?;
    let watch = runtime.map_watch(&caller, SESSION)?;
    assert_eq!(runtime.services(), None, "not known before a source says");
    let first: ServiceSet = [("10.96.0.0/12".parse()?, ServiceKind::ClusterIpRange)]
        .into_iter()
        .collect();
    assert!(runtime.set_services(first.clone()));
    assert!(
        !runtime.set_services(first.clone()),
        "the same set is no change"
    );
    assert_eq!(runtime.services().as_deref(), Some(&first));
    runtime.map_tick();
    let batch = rec.batch(1).ok_or("no batch for the changed set")?;
    assert_eq!(batch.services.as_ref(), Some(&first));
    assert!(batch.upserts.is_empty());
    // Nothing changed: no batch.
    runtime.map_tick();
    assert!(rec.batch(2).is_none());

    // A full map of two chunks (one entry each): the first carries the set.
    runtime.snapshot(
        &stream,
        1,
        vec![
            web("web-0", [198, 18, 0, 2], 300)?,
            web("web-1", [198, 18, 0, 3], 300)?,
        ],
        AllocationId::NONE,
    )?;
    let resync = runtime.map_resync(watch.term)?;
    let chunks: Vec<RecordedBatch> = rec
        .0
        .lock()
        .iter()
        .filter(|b| b.version == resync.full.version && b.resync != (false, false))
        .cloned()
        .collect();
    assert_eq!(chunks.len(), 2);
    assert_eq!(chunks[0].services.as_ref(), Some(&first));
    assert_eq!(chunks[1].services, None);

    // A change with map changes: the set rides on the first batch only.
    let second: ServiceSet = [
        ("10.96.0.0/12".parse()?, ServiceKind::ClusterIpRange),
        ("203.0.113.7/32".parse()?, ServiceKind::LoadBalancerIp),
    ]
    .into_iter()
    .collect();
    runtime.set_services(second.clone());
    runtime.snapshot(&stream, 2, Vec::new(), AllocationId::NONE)?;
    runtime.map_tick();
    let after: Vec<RecordedBatch> = rec
        .0
        .lock()
        .iter()
        .filter(|b| b.version > resync.full.version && b.resync == (false, false))
        .cloned()
        .collect();
    // Two removals and the node's index, one item a batch.
    assert!(after.len() >= 2, "{after:?}");
    assert_eq!(after[0].services.as_ref(), Some(&second));
    assert!(after[1..].iter().all(|b| b.services.is_none()), "{after:?}");
    Ok(())
}

/// Encodes every batch and chunk as `0` bytes of a fixed size, so a test can tell
/// how much the map keeps.
#[derive(Debug)]
struct Padded(usize);

impl crate::api::MapEncoder for Padded {
    fn encode(&self, _: &crate::api::MapBatchParts<'_>) -> bytes::Bytes {
        bytes::Bytes::from(vec![0; self.0])
    }
}

fn cache_bytes(metrics: &Metrics, kind: &'static str) -> i64 {
    metrics
        .map_cache_bytes
        .get_or_create(&crate::metrics::KindLabels { kind })
        .get()
}

/// A runtime serving the map with an encoder, ticking only when the test says, a
/// node's stream to change the map with, and a watch's term.
struct MapLab {
    runtime: Arc<Runtime>,
    metrics: Metrics,
    stream: crate::api::Connected,
    term: Term,
    /// What must live as long as the lab: the writer queues, the ticker's stop, the
    /// node's outbound queue.
    _keep: Vec<Box<dyn std::any::Any>>,
}

impl MapLab {
    fn new(
        encoder: Arc<dyn crate::api::MapEncoder>,
        cache_idle: Duration,
    ) -> Result<Self, Box<dyn std::error::Error>> {
        let metrics = Metrics::default();
        let (runtime, queues) = Runtime::new(
            Allocator::new(cfg()?, Loaded::default(), Clock::new().now()),
            Clock::new(),
            settings(),
            metrics.clone(),
        );
        let (stop_tx, stop) = watch::channel(false);
        let cfg = MapConfig {
            tick: Duration::from_secs(3600),
            cache_idle,
            ..MapConfig::default()
        };
        let _ticker = runtime.serve_map(cfg, encoder, stop);
        let caller = caller()?;
        let (tx, rx) = mpsc::channel(8);
        let stream = runtime.hello(&caller, SESSION, Vec::new(), tx)?;
        let term = runtime.map_watch(&caller, SESSION)?.term;
        Ok(Self {
            runtime,
            metrics,
            stream,
            term,
            _keep: vec![Box::new(queues), Box::new(stop_tx), Box::new(rx)],
        })
    }

    /// Snapshot `seq` of the node: web-0 alone on odd, none on even, so every one is a
    /// change; then a tick, so it goes out as a batch.
    fn change(&self, seq: u64) -> Result<(), Box<dyn std::error::Error>> {
        let endpoints = if seq % 2 == 1 {
            vec![web("web-0", [198, 18, 0, 2], 300)?]
        } else {
            Vec::new()
        };
        self.runtime
            .snapshot(&self.stream, seq, endpoints, AllocationId::NONE)?;
        self.runtime.map_tick();
        Ok(())
    }

    fn kept(&self, kind: &'static str) -> i64 {
        cache_bytes(&self.metrics, kind)
    }
}

#[tokio::test(start_paused = true)]
async fn the_full_map_and_its_history_are_freed_once_no_resync_has_used_them_for_a_while()
-> Result<(), Box<dyn std::error::Error>> {
    let lab = MapLab::new(Arc::new(Padded(1000)), Duration::from_secs(10))?;
    let first = lab.runtime.map_resync(lab.term)?;
    assert_eq!(lab.kept("full"), 1000, "one chunk");
    lab.change(1)?;
    assert_eq!(lab.kept("history"), 1000, "the batch after the map");

    // Used again 6 s later: kept 10 s from then, not from when it was built.
    tokio::time::advance(Duration::from_secs(6)).await;
    let again = lab.runtime.map_resync(lab.term)?;
    assert!(Arc::ptr_eq(&again.full, &first.full), "shared");
    assert_eq!(again.catch_up.len(), 1);
    tokio::time::advance(Duration::from_secs(6)).await;
    lab.runtime.map_tick();
    assert_eq!((lab.kept("full"), lab.kept("history")), (1000, 1000));

    tokio::time::advance(Duration::from_secs(5)).await;
    lab.runtime.map_tick();
    assert_eq!((lab.kept("full"), lab.kept("history")), (0, 0), "freed");
    lab.change(2)?;
    assert_eq!(lab.kept("history"), 0, "no history without a cached map");

    // The next resync builds a new map, exact at the latest version.
    let later = lab.runtime.map_resync(lab.term)?;
    assert!(!Arc::ptr_eq(&later.full, &first.full), "built anew");
    assert_eq!(Some(later.full.version), lab.runtime.map_version());
    assert!(later.catch_up.is_empty());
    Ok(())
}

#[tokio::test]
async fn the_history_keeps_no_more_bytes_than_a_resync_may_catch_up_and_then_a_new_map_is_built()
-> Result<(), Box<dyn std::error::Error>> {
    // A full map of one 16 KiB chunk: a resync may catch up 64 KiB (the floor) of
    // 16 KiB batches, four of them.
    let lab = MapLab::new(Arc::new(Padded(16 << 10)), Duration::from_secs(3600))?;
    let first = lab.runtime.map_resync(lab.term)?;
    for seq in 1..=4 {
        lab.change(seq)?;
    }
    assert_eq!(lab.kept("history"), 64 << 10);
    let again = lab.runtime.map_resync(lab.term)?;
    assert!(
        Arc::ptr_eq(&again.full, &first.full),
        "four batches behind: shared"
    );
    assert_eq!(again.catch_up.len(), 4);

    // A fifth pushes the first out: the map can no longer be caught up from, and the
    // tick that sent it frees both.
    lab.change(5)?;
    assert_eq!((lab.kept("full"), lab.kept("history")), (0, 0));
    let later = lab.runtime.map_resync(lab.term)?;
    assert!(!Arc::ptr_eq(&later.full, &first.full), "built anew");
    assert!(later.catch_up.is_empty());
    assert_eq!(lab.kept("full"), 16 << 10);
    Ok(())
}
