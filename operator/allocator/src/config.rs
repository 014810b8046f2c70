use std::time::Duration;

use census_proto::domain::IdRange;

/// How the core treats a node it stops hearing from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// No cluster: silence longer than the node TTL drops the node's view. The agent's
    /// next snapshot re-adopts what it still holds.
    Embedded,
    /// In a cluster: silence longer than the node TTL only marks the node stale; its
    /// view is dropped when its Node object is deleted (`node_gone`), or after
    /// `stale_view_limit` of staleness as a last resort.
    Cluster { stale_view_limit: Duration },
}

/// The allocator's parameters. Defaults follow DESIGN.md.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub range: IdRange,
    /// Base interval between an agent's snapshots (sent to agents in HelloReply).
    pub snapshot_interval: Duration,
    /// Silence after which a node is stale (embedded: dropped). Also how long loaded
    /// identities are held after a restart, so every node can snapshot first.
    pub node_ttl: Duration,
    /// How long an identity handed out by Allocate is held for its node without
    /// appearing in the node's view.
    pub hold_timeout: Duration,
    /// How long an unreferenced identity is kept before it is deleted.
    pub grace: Duration,
    /// How long a deleted id is not bound to another label set.
    pub quarantine: Duration,
    /// When the store was empty at start, Allocate hands out no new id for this long
    /// (agents' snapshots re-adopt the ids they hold first).
    pub adoption_window: Duration,
    pub liveness: Liveness,
    /// Holds (plus allocations in flight) a node may have at once.
    pub max_holds_per_node: usize,
    /// Store deletes per second, and the burst the budget may accumulate.
    pub gc_rate: f64,
    pub gc_burst: f64,
    /// Store deletes in flight at once.
    pub max_inflight_deletes: usize,
    /// Backoff of a failed store write: doubles from `retry_base` up to `retry_max`.
    pub retry_base: Duration,
    pub retry_max: Duration,
    /// How long an Allocate call waits for the store's answer before it is answered
    /// with an error (the caller retries, and is answered when the write's answer has
    /// come). Shorter than the agent's call timeout, so it hears why.
    pub allocate_deadline: Duration,
}

impl Default for Config {
    fn default() -> Self {
        let snapshot_interval = Duration::from_secs(30);
        let node_ttl = snapshot_interval * 3;
        Self {
            range: IdRange::default(),
            snapshot_interval,
            node_ttl,
            hold_timeout: node_ttl,
            grace: Duration::from_secs(60),
            quarantine: Duration::from_secs(600),
            adoption_window: node_ttl,
            liveness: Liveness::Embedded,
            max_holds_per_node: 1024,
            gc_rate: 100.0,
            gc_burst: 100.0,
            max_inflight_deletes: 256,
            retry_base: Duration::from_secs(1),
            retry_max: Duration::from_secs(60),
            allocate_deadline: Duration::from_secs(10),
        }
    }
}

impl Config {
    /// Defaults scaled to a snapshot interval: node TTL 3 intervals, hold timeout and
    /// adoption window one node TTL.
    pub fn with_snapshot_interval(interval: Duration) -> Self {
        let node_ttl = interval * 3;
        Self {
            snapshot_interval: interval,
            node_ttl,
            hold_timeout: node_ttl,
            adoption_window: node_ttl,
            ..Self::default()
        }
    }

    /// The wait before retry number `attempt` (1 for the first retry).
    pub(super) fn backoff(&self, attempt: u32) -> Duration {
        let factor = 1u32
            .checked_shl(attempt.saturating_sub(1).min(20))
            .unwrap_or(u32::MAX);
        self.retry_base.saturating_mul(factor).min(self.retry_max)
    }
}
