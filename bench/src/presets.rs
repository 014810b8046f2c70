//! The named presets and their parameters. Each scenario prints its parameters
//! before it starts, so a result can always be traced back to what produced it.

use std::time::Duration;

use clap::ValueEnum;
use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Preset {
    /// CronJob churn with lost deletes, 1,000 Job pods per drop rate, short timers
    /// (the CI gate, under 2 minutes).
    ChurnShort,
    /// The same with 10,000 Job pods per drop rate.
    ChurnLong,
    /// 1,000 simulated nodes x 110 endpoints, 30 s snapshots, each node on its own
    /// connection watching the map; steady state, then an operator restart that every
    /// node reconnects and resyncs after at once.
    #[value(name = "scale-1k")]
    Scale1k,
    /// The same with 5,000 nodes, gated: steady RSS at most 256 MiB, the reconnect's
    /// RSS peak at most 384 MiB.
    #[value(name = "scale-5k")]
    Scale5k,
    /// The endpoint map: 1,000 simulated nodes x 110 pods, each watching the map, 100
    /// pod changes/s.
    #[value(name = "map-1k")]
    Map1k,
    /// The same with 5,000 nodes.
    #[value(name = "map-5k")]
    Map5k,
    /// Allocate throughput and latency: 1, 16, 256 clients, known and new label sets,
    /// with and without a GC storm.
    Alloc,
    /// Allocate (known labels) and the snapshot round trip against the transport
    /// floor (a Lookup of the same size on the same server), 1 and 16 clients.
    Floor,
    /// Deleting 50,000 released identities at several GC budgets.
    Gc,
    /// SIGKILL the operator mid-churn and restart it.
    Restart,
    /// Transport attacks before authentication (oversize and stalled messages,
    /// half-open and stalled connections, huge strings): memory, descriptors, a
    /// concurrent Get's latency.
    Abuse,
    /// The field reports replayed on a real control plane: seed-leak, seed-gc,
    /// seed-cache, seed-uid; as root.
    Seeds,
    /// seeds/000 replayed on a real control plane with census's real operator and
    /// agents: 450 Jobs created as the report's loop does, `kubectl delete
    /// identities --all`, a quiet period; default filter and Job labels kept, each
    /// with and without lost deletes. As root (the agents load BPF).
    SeedLeak,
    /// The same, short (the CI gate): 60 Jobs, Job labels kept, deletes lost.
    SeedLeakShort,
    /// seeds/003 replayed on a real control plane: 10,000 released Identity objects
    /// deleted by census's GC while a second writer annotates them (conflicts), and
    /// 50,000.
    SeedGc,
    /// seeds/004 replayed on a real control plane: census idle while 200 ConfigMaps
    /// and 200 Secrets of ~500 KB come and go, then 2,000 pods on a node without an
    /// agent, then 2,000 Services: RSS and bytes received from the API server.
    SeedCache,
    /// seeds/002 replayed on a real control plane: the same pod name re-created 2,000
    /// times on one node, a Deployment rolled 200 times: memory flat, nothing kept
    /// per UID.
    SeedUid,
}

impl Preset {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::ChurnShort => "churn-short",
            Self::ChurnLong => "churn-long",
            Self::Scale1k => "scale-1k",
            Self::Scale5k => "scale-5k",
            Self::Map1k => "map-1k",
            Self::Map5k => "map-5k",
            Self::Alloc => "alloc",
            Self::Floor => "floor",
            Self::Gc => "gc",
            Self::Restart => "restart",
            Self::Abuse => "abuse",
            Self::Seeds => "seeds",
            Self::SeedLeak => "seed-leak",
            Self::SeedLeakShort => "seed-leak-short",
            Self::SeedGc => "seed-gc",
            Self::SeedCache => "seed-cache",
            Self::SeedUid => "seed-uid",
        }
    }
}

/// Operator timers shared by the short presets.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Timers {
    #[serde(with = "millis", rename = "snapshot_interval_ms")]
    pub(crate) snapshot_interval: Duration,
    #[serde(with = "millis", rename = "grace_ms")]
    pub(crate) grace: Duration,
    #[serde(with = "millis", rename = "quarantine_ms")]
    pub(crate) quarantine: Duration,
    pub(crate) gc_rate: f64,
}

impl Timers {
    pub(crate) fn flags(&self) -> Vec<String> {
        vec![
            "--snapshot-interval".into(),
            humantime(self.snapshot_interval),
            "--grace-period".into(),
            humantime(self.grace),
            "--quarantine".into(),
            humantime(self.quarantine),
            "--gc-rate".into(),
            self.gc_rate.to_string(),
        ]
    }
}

pub(crate) fn humantime(d: Duration) -> String {
    format!("{}ms", d.as_millis())
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Churn {
    pub(crate) preset: &'static str,
    pub(crate) nodes: usize,
    pub(crate) steady_pods: usize,
    /// Distinct label sets among the steady pods (deployments of 5 replicas).
    pub(crate) steady_apps: usize,
    /// Job pods per drop rate.
    pub(crate) pods: usize,
    /// Job pods started per second.
    pub(crate) pods_per_second: f64,
    /// How long a Job pod lives, uniformly between these.
    #[serde(with = "millis", rename = "lifetime_min_ms")]
    pub(crate) lifetime_min: Duration,
    #[serde(with = "millis", rename = "lifetime_max_ms")]
    pub(crate) lifetime_max: Duration,
    /// Shares of delete events dropped, one phase each.
    pub(crate) drop_rates: Vec<f64>,
    /// Job pods churned and drained before the first baseline, so one-time growth
    /// (bounded caches reaching their working size) is not counted as retained.
    pub(crate) warmup_pods: usize,
    pub(crate) timers: Timers,
    pub(crate) store_cache_bytes: usize,
    pub(crate) max_retained_bytes_per_pod: f64,
}

pub(crate) fn churn(preset: Preset) -> Churn {
    let long = preset == Preset::ChurnLong;
    Churn {
        preset: preset.name(),
        nodes: 3,
        steady_pods: 170,
        steady_apps: 34,
        pods: if long { 10_000 } else { 1_000 },
        pods_per_second: if long { 200.0 } else { 150.0 },
        lifetime_min: Duration::from_millis(500),
        lifetime_max: Duration::from_millis(1500),
        drop_rates: vec![0.0, 0.5, 1.0],
        // As many as a phase keeps in flight at its peak (Job pods alive, released and
        // quarantined: about 15 s of churn), capped by the phase's own size.
        warmup_pods: if long { 3000 } else { 1_000 },
        timers: Timers {
            snapshot_interval: Duration::from_secs(1),
            grace: Duration::from_secs(2),
            quarantine: Duration::from_secs(10),
            gc_rate: 500.0,
        },
        store_cache_bytes: 4 * 1024 * 1024,
        max_retained_bytes_per_pod: 64.0,
    }
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Scale {
    pub(crate) preset: &'static str,
    pub(crate) nodes: usize,
    pub(crate) endpoints_per_node: usize,
    /// Distinct label sets, per node.
    pub(crate) label_sets_per_node: usize,
    #[serde(with = "millis", rename = "snapshot_interval_ms")]
    pub(crate) snapshot_interval: Duration,
    /// Snapshot intervals measured after every node has sent its first snapshot.
    pub(crate) intervals: u32,
    /// Agents' streams (EndpointSync and EndpointMap.Watch) share one HTTP/2
    /// connection per this many nodes.
    pub(crate) nodes_per_connection: usize,
    /// Nodes connecting at once during the ramp.
    pub(crate) ramp_concurrency: usize,
    /// The gate on the operator's median RSS in the steady window.
    pub(crate) max_steady_rss_bytes: Option<u64>,
    /// The gate on the operator's RSS peak while every node reconnects and every
    /// watcher resyncs after a restart.
    pub(crate) max_reconnect_peak_rss_bytes: Option<u64>,
}

pub(crate) fn scale(preset: Preset) -> Scale {
    let large = preset == Preset::Scale5k;
    Scale {
        preset: preset.name(),
        nodes: if large { 5_000 } else { 1_000 },
        endpoints_per_node: 110,
        label_sets_per_node: 10,
        snapshot_interval: Duration::from_secs(30),
        intervals: 3,
        // Each simulated agent on its own connection, as real agents are: what the
        // operator holds per connection is part of what it must fit in.
        nodes_per_connection: 1,
        ramp_concurrency: 64,
        max_steady_rss_bytes: large.then_some(256 << 20),
        max_reconnect_peak_rss_bytes: large.then_some(384 << 20),
    }
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Map {
    pub(crate) preset: &'static str,
    pub(crate) nodes: usize,
    pub(crate) pods_per_node: usize,
    pub(crate) label_sets_per_node: usize,
    /// Pod changes (a create or a delete) per second, cluster-wide.
    pub(crate) changes_per_second: f64,
    #[serde(with = "millis", rename = "tick_ms")]
    pub(crate) tick: Duration,
    pub(crate) max_resyncs: usize,
    /// Watchers that decode batches of changes fully, to time propagation.
    pub(crate) probes: usize,
    #[serde(with = "millis", rename = "steady_ms")]
    pub(crate) steady: Duration,
    pub(crate) nodes_per_connection: usize,
}

pub(crate) fn map(preset: Preset) -> Map {
    Map {
        preset: preset.name(),
        nodes: if preset == Preset::Map5k {
            5_000
        } else {
            1_000
        },
        pods_per_node: 110,
        label_sets_per_node: 10,
        changes_per_second: 100.0,
        tick: Duration::from_millis(100),
        max_resyncs: 32,
        probes: 8,
        steady: Duration::from_secs(20),
        nodes_per_connection: 100,
    }
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Alloc {
    pub(crate) concurrency: Vec<usize>,
    #[serde(with = "millis", rename = "cell_duration_ms")]
    pub(crate) cell_duration: Duration,
    /// Label sets referenced by a node's view, for "known" allocations.
    pub(crate) known_pool: usize,
    /// Released identities deleted during the storm cells.
    pub(crate) storm_identities: usize,
    pub(crate) storm_gc_rate: f64,
    pub(crate) connections: usize,
    pub(crate) timers: Timers,
    pub(crate) id_range: &'static str,
}

pub(crate) fn alloc() -> Alloc {
    Alloc {
        concurrency: vec![1, 16, 256],
        cell_duration: Duration::from_secs(4),
        known_pool: 1000,
        storm_identities: 60_000,
        storm_gc_rate: 2000.0,
        connections: 4,
        timers: Timers {
            snapshot_interval: Duration::from_secs(1),
            grace: Duration::from_secs(1),
            quarantine: Duration::from_secs(600),
            gc_rate: 2000.0,
        },
        id_range: "256-4000000",
    }
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Floor {
    pub(crate) concurrency: Vec<usize>,
    /// Rounds of one batch of the call and one of its floor, the order alternating.
    pub(crate) rounds: usize,
    #[serde(with = "millis", rename = "batch_ms")]
    pub(crate) batch: Duration,
    /// Label sets referenced by a node's view (known to the operator).
    pub(crate) known_pool: usize,
    /// Endpoints in the timed snapshot.
    pub(crate) snapshot_endpoints: usize,
    pub(crate) connections: usize,
    /// Allocate p50 and p99 within this multiple of the floor's: PASS, else MISS.
    pub(crate) target_ratio: f64,
    pub(crate) timers: Timers,
    pub(crate) id_range: &'static str,
}

pub(crate) fn floor() -> Floor {
    let a = alloc();
    Floor {
        concurrency: vec![1, 16],
        rounds: 20,
        batch: Duration::from_millis(250),
        known_pool: a.known_pool,
        snapshot_endpoints: 110,
        connections: a.connections,
        target_ratio: 1.5,
        timers: a.timers,
        id_range: a.id_range,
    }
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Gc {
    pub(crate) identities: usize,
    /// Long, so nothing is released while the identities are being allocated: they
    /// are released together when their nodes go silent and are dropped.
    #[serde(with = "millis", rename = "hold_timeout_ms")]
    pub(crate) hold_timeout: Duration,
    pub(crate) budgets: Vec<f64>,
    /// Allocate calls per second while GC runs (half known, half new label sets).
    pub(crate) probe_rate: f64,
    pub(crate) timers: Timers,
    pub(crate) id_range: &'static str,
}

pub(crate) fn gc() -> Gc {
    Gc {
        identities: 50_000,
        hold_timeout: Duration::from_secs(600),
        budgets: vec![100.0, 1000.0, 5000.0],
        probe_rate: 200.0,
        timers: Timers {
            snapshot_interval: Duration::from_secs(1),
            grace: Duration::from_secs(1),
            quarantine: Duration::from_secs(600),
            gc_rate: 0.0,
        },
        id_range: "256-4000000",
    }
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Restart {
    pub(crate) nodes: usize,
    pub(crate) steady_pods_per_node: usize,
    pub(crate) pods_per_second: f64,
    pub(crate) drop_rate: f64,
    #[serde(with = "millis", rename = "lifetime_min_ms")]
    pub(crate) lifetime_min: Duration,
    #[serde(with = "millis", rename = "lifetime_max_ms")]
    pub(crate) lifetime_max: Duration,
    /// Churn before the SIGKILL.
    #[serde(with = "millis", rename = "churn_before_kill_ms")]
    pub(crate) churn_before_kill: Duration,
    /// How long the operator stays down.
    #[serde(with = "millis", rename = "downtime_ms")]
    pub(crate) downtime: Duration,
    /// Churn after the restart, once refcounts match the truth again.
    #[serde(with = "millis", rename = "churn_after_ms")]
    pub(crate) churn_after: Duration,
    pub(crate) timers: Timers,
}

pub(crate) fn restart() -> Restart {
    Restart {
        nodes: 20,
        steady_pods_per_node: 50,
        pods_per_second: 40.0,
        drop_rate: 0.5,
        lifetime_min: Duration::from_millis(500),
        lifetime_max: Duration::from_millis(3000),
        churn_before_kill: Duration::from_secs(20),
        downtime: Duration::from_secs(2),
        churn_after: Duration::from_secs(15),
        timers: Timers {
            snapshot_interval: Duration::from_secs(1),
            grace: Duration::from_secs(2),
            // Longer than the run: any id bound to two label sets is a violation.
            quarantine: Duration::from_secs(3600),
            gc_rate: 500.0,
        },
    }
}

pub(crate) mod millis {
    use std::time::Duration;

    use serde::Serializer;

    pub(crate) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_millis() as u64)
    }
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct SeedLeak {
    pub(crate) preset: &'static str,
    /// The control plane's name (its directory under `<target>/cluster/`).
    pub(crate) plane_name: &'static str,
    pub(crate) nodes: u32,
    pub(crate) steady_deployments: usize,
    pub(crate) steady_replicas: usize,
    /// Jobs per phase, each created with its own `kubectl create`.
    pub(crate) jobs: usize,
    /// Where the report read the operator's memory: after this many Jobs.
    pub(crate) checkpoints: Vec<usize>,
    pub(crate) ttl_seconds: u32,
    /// Jobs run through the whole path before the idle level is read.
    pub(crate) warmup_jobs: usize,
    /// The idle level is read no sooner than this after the operator started.
    #[serde(with = "millis", rename = "warmup_min_ms")]
    pub(crate) warmup_min: Duration,
    /// After `kubectl delete identities --all`.
    #[serde(with = "millis", rename = "quiet_ms")]
    pub(crate) quiet: Duration,
    /// (Job labels kept, deletes lost) per phase.
    pub(crate) variants: Vec<(bool, bool)>,
    #[serde(with = "millis", rename = "snapshot_interval_ms")]
    pub(crate) snapshot_interval: Duration,
    #[serde(with = "millis", rename = "grace_ms")]
    pub(crate) grace: Duration,
    #[serde(with = "millis", rename = "quarantine_ms")]
    pub(crate) quarantine: Duration,
    /// Readings a level is taken from, and the time between two.
    pub(crate) level_samples: usize,
    #[serde(with = "millis", rename = "level_every_ms")]
    pub(crate) level_every: Duration,
    pub(crate) max_heap_delta_bytes: i64,
    pub(crate) max_rss_delta_bytes: Option<i64>,
    /// Where each Job pod has its own identity: the p99 from a pod's end to its
    /// identity's deletion.
    #[serde(with = "millis", rename = "max_end_to_deletion_ms")]
    pub(crate) max_end_to_deletion: Duration,
    /// The operator's heap profiled (one sample per 2^this bytes): its live heap by
    /// owner at idle and after the quiet period, and what grew in between.
    pub(crate) heap_sample_lg: Option<u32>,
}

pub(crate) fn seed_leak(preset: Preset) -> SeedLeak {
    let short = preset == Preset::SeedLeakShort;
    let snapshot_interval = Duration::from_secs(if short { 2 } else { 5 });
    let grace = Duration::from_secs(if short { 2 } else { 5 });
    SeedLeak {
        preset: preset.name(),
        plane_name: if short { "seed-gate" } else { "seeds" },
        nodes: 3,
        steady_deployments: 6,
        steady_replicas: 5,
        jobs: if short { 60 } else { 450 },
        checkpoints: if short {
            vec![30, 60]
        } else {
            vec![150, 300, 450]
        },
        ttl_seconds: 10,
        warmup_jobs: if short { 30 } else { 50 },
        // Some of what the operator allocates once is kept by its first 33 uses, not
        // by its first: a long-lived tokio channel gets a second block of 32 slots at
        // its 33rd message and keeps it for reuse (kube's client queues every request
        // in one, and hyper each request of a kept-alive connection). The Lease is
        // renewed every 2 s over one such connection, so its 33rd renewal comes about
        // 66 s after the operator starts: the idle level waits for it.
        warmup_min: Duration::from_secs(80),
        quiet: Duration::from_secs(if short { 100 } else { 60 }),
        variants: if short {
            vec![(true, true)]
        } else {
            vec![(false, false), (false, true), (true, false), (true, true)]
        },
        snapshot_interval,
        grace,
        quarantine: Duration::from_secs(if short { 5 } else { 30 }),
        level_samples: 5,
        // 12 s between the first and last readings, longer than the API server
        // clients' idle timeout (10 s): a connection a periodic request opened (the
        // leader EndpointSlice's recheck every 30 s, a token review) is closed by the
        // last reading, unless another has opened one.
        level_every: Duration::from_secs(3),
        // The target is 64 KiB (the full preset gates on it). The CI gate allows
        // 128 KiB: with the API server pool fixed, five clean runs read -118.7 to
        // +61.7 KiB, the idle reading's own spread; a leak of an identity's state
        // per Job (60 Jobs) is what the gate is for, and lands far above either.
        max_heap_delta_bytes: if short { 128 * 1024 } else { 64 * 1024 },
        max_rss_delta_bytes: (!short).then_some(2 * 1024 * 1024),
        // One snapshot interval (the agent's next snapshot releases the identity,
        // its delete event lost or not) plus the grace period, and 2 s for the
        // once-a-second poll, the interval's jitter and the GC's delete. A pod that
        // ended before its Allocate was answered once waited out the hold timeout
        // too (three intervals): 20-21 s in the full preset, so 8 s or more in the
        // gate.
        max_end_to_deletion: snapshot_interval + grace + Duration::from_secs(2),
        // Off (`--heap-sample-lg` turns it on): the first profile's symbol tables
        // stay in the live heap it would explain (+119 MiB in a gate run).
        heap_sample_lg: None,
    }
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct SeedGc {
    pub(crate) preset: &'static str,
    pub(crate) plane_name: &'static str,
    /// Released identities per run.
    pub(crate) sizes: Vec<usize>,
    /// The second writer's tasks (merge patches of one annotation), half on the ids
    /// the GC tombstones next, half on the ids whose delete comes next.
    pub(crate) writers: usize,
    /// The second writer's writes a second at most, all tasks together.
    pub(crate) writer_rate: f64,
    /// Ids each half of the second writer cycles through, from where the GC is.
    pub(crate) writer_window: u64,
    /// The operator's GC budget, deletes per second.
    pub(crate) gc_rate: f64,
    #[serde(with = "millis", rename = "snapshot_interval_ms")]
    pub(crate) snapshot_interval: Duration,
    #[serde(with = "millis", rename = "quarantine_ms")]
    pub(crate) quarantine: Duration,
    /// A run ends after this long even if objects are left (and fails).
    pub(crate) limit_seconds: u64,
    pub(crate) max_delete_seconds_per_10k: f64,
}

pub(crate) fn seed_gc() -> SeedGc {
    SeedGc {
        preset: "seed-gc",
        plane_name: "seed-gc",
        sizes: vec![10_000, 50_000],
        writers: 8,
        writer_rate: 200.0,
        writer_window: 64,
        gc_rate: 500.0,
        snapshot_interval: Duration::from_secs(2),
        quarantine: Duration::from_secs(1),
        limit_seconds: 900,
        max_delete_seconds_per_10k: 60.0,
    }
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct SeedCache {
    pub(crate) preset: &'static str,
    pub(crate) plane_name: &'static str,
    /// Nodes with census's agent; the control plane has one more, without.
    pub(crate) census_nodes: u32,
    /// ConfigMaps, and as many Secrets.
    pub(crate) objects: usize,
    pub(crate) object_bytes: usize,
    pub(crate) pods: usize,
    pub(crate) services: usize,
    /// Services given a ClusterIP (the range is a /24); the rest are headless.
    pub(crate) cluster_ips: usize,
    #[serde(with = "millis", rename = "settle_ms")]
    pub(crate) settle: Duration,
    /// Sampled after the deletes, before the level is read.
    #[serde(with = "millis", rename = "after_delete_ms")]
    pub(crate) after_delete: Duration,
    pub(crate) max_rss_change_bytes: u64,
    pub(crate) max_api_bytes: u64,
}

pub(crate) fn seed_cache() -> SeedCache {
    SeedCache {
        preset: "seed-cache",
        plane_name: "seed-cache",
        census_nodes: 3,
        objects: 200,
        object_bytes: 500_000,
        pods: 2_000,
        services: 2_000,
        cluster_ips: 240,
        settle: Duration::from_secs(10),
        after_delete: Duration::from_secs(30),
        max_rss_change_bytes: 1 << 20,
        max_api_bytes: 1 << 20,
    }
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct SeedUid {
    pub(crate) preset: &'static str,
    pub(crate) plane_name: &'static str,
    pub(crate) nodes: u32,
    /// The same pod name deleted and re-created this many times.
    pub(crate) recreations: usize,
    /// A Deployment of 3 rolled this many times (each roll waited for).
    pub(crate) rolls: usize,
    /// Re-creations before the first level.
    pub(crate) warmup: usize,
    #[serde(with = "millis", rename = "settle_ms")]
    pub(crate) settle: Duration,
    pub(crate) max_heap_delta_bytes: i64,
}

pub(crate) fn seed_uid() -> SeedUid {
    SeedUid {
        preset: "seed-uid",
        plane_name: "seed-uid",
        nodes: 3,
        recreations: 2_000,
        rolls: 200,
        warmup: 50,
        settle: Duration::from_secs(5),
        max_heap_delta_bytes: 64 * 1024,
    }
}
