//! Prometheus metrics the shell updates where things happen: gRPC calls, store
//! batches, messages to agents. The core's live state (identities by state, nodes,
//! range usage) and its cumulative counters are read from the core at scrape time
//! (`runtime::CoreCollector`), so they cannot drift from it.

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GrpcLabels {
    pub method: &'static str,
    pub code: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MethodLabels {
    pub method: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabels {
    pub queue: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: &'static str,
}

/// Why: one label, from a bounded set (the transport's, shared by every server).
pub use census_transport::ReasonLabels;
use census_transport::accept::ConnectionMetrics;

fn latency_histogram() -> Histogram {
    // 10 µs .. ~40 s.
    Histogram::new(exponential_buckets(0.000_01, 2.5, 17))
}

/// Handles to the metrics the shell updates.
#[derive(Debug, Clone)]
pub struct Metrics {
    pub grpc_requests: Family<GrpcLabels, Counter>,
    pub grpc_duration: Family<MethodLabels, Histogram>,
    /// Time the core takes to apply a snapshot (decoded input), by size class.
    pub snapshot_apply: Histogram,
    /// Allocate latency as the caller sees it, `known` or `new`.
    pub allocate_latency: Family<KindLabels, Histogram>,
    pub store_batch_duration: Family<QueueLabels, Histogram>,
    pub store_batch_ops: Family<QueueLabels, Counter>,
    pub rebinds_sent: Counter,
    pub agent_messages_dropped: Counter,
    pub invalid_messages: Family<KindLabels, Counter>,
    /// Entries of EndpointSync messages rejected alone, and Hello addresses the
    /// node's certificate does not name, by the kind of problem.
    pub rejected_entries: Family<ReasonLabels, Counter>,
    /// Endpoint map batches of changes built (each encoded once for every watcher).
    pub map_batches_built: Counter,
    /// Full copies of the endpoint map built (each shared by the watchers resyncing).
    pub map_full_maps_built: Counter,
    /// Bytes encoded for the endpoint map, `batch` or `full`.
    pub map_bytes_encoded: Family<KindLabels, Counter>,
    /// Messages sent to watchers (one per watcher per batch or chunk), `batch` or `full`.
    pub map_messages_sent: Family<KindLabels, Counter>,
    /// Bytes sent to watchers, all watchers together.
    pub map_bytes_sent: Counter,
    /// Open EndpointMap.Watch streams.
    pub map_watchers: Gauge,
    /// Bytes kept to serve resyncs: the cached full map (`full`) and the batches
    /// after it (`history`).
    pub map_cache_bytes: Family<KindLabels, Gauge>,
    /// Full maps sent (or to be sent) to a watcher, by reason: `new_watcher`, `lagged`, `term`.
    pub map_resyncs: Family<ReasonLabels, Counter>,
    /// Resyncs waiting for their turn or being sent, by reason.
    pub map_resyncs_in_progress: Family<ReasonLabels, Gauge>,
    /// Batches a watcher was behind the latest when it was sent one.
    pub map_watcher_lag: Histogram,
    /// gRPC connections: open, closed at once because --max-connections were open,
    /// closed by the operator by reason (`handshake_timeout`, `idle_timeout`).
    pub grpc_connections: ConnectionMetrics,
    /// gRPC request messages refused, by reason (`oversize`, `timeout`, `budget`).
    pub grpc_messages_refused: Family<ReasonLabels, Counter>,
    /// Calls refused by a quota or cap, by quota.
    pub quota_refusals: Family<ReasonLabels, Counter>,
    /// Bytes of large messages reserved now (`--max-inflight-message-bytes`).
    pub inflight_message_bytes: Gauge,
    /// Bearer tokens checked, by result (`cached`, `authenticated`, or why not).
    pub token_reviews: Family<ResultLabels, Counter>,
    /// Token review answers cached now.
    pub token_review_cache_entries: Gauge,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: &'static str,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            grpc_requests: Family::default(),
            grpc_duration: Family::new_with_constructor(latency_histogram),
            snapshot_apply: latency_histogram(),
            allocate_latency: Family::new_with_constructor(latency_histogram),
            store_batch_duration: Family::new_with_constructor(latency_histogram),
            store_batch_ops: Family::default(),
            rebinds_sent: Counter::default(),
            agent_messages_dropped: Counter::default(),
            invalid_messages: Family::default(),
            rejected_entries: Family::default(),
            map_batches_built: Counter::default(),
            map_full_maps_built: Counter::default(),
            map_bytes_encoded: Family::default(),
            map_messages_sent: Family::default(),
            map_bytes_sent: Counter::default(),
            map_watchers: Gauge::default(),
            map_cache_bytes: Family::default(),
            map_resyncs: Family::default(),
            map_resyncs_in_progress: Family::default(),
            map_watcher_lag: Histogram::new(exponential_buckets(1.0, 2.0, 8)),
            grpc_connections: ConnectionMetrics::default(),
            grpc_messages_refused: Family::default(),
            quota_refusals: Family::default(),
            inflight_message_bytes: Gauge::default(),
            token_reviews: Family::default(),
            token_review_cache_entries: Gauge::default(),
        }
    }
}

impl Metrics {
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("census");
        self.register_calls(r);
        self.register_map(r);
        self.register_connections(r);
    }

    /// Calls, the core's and the store's work for them, what agents sent.
    fn register_calls(&self, r: &mut Registry) {
        r.register(
            "grpc_requests",
            "gRPC calls by method and status code",
            self.grpc_requests.clone(),
        );
        r.register(
            "grpc_request_duration_seconds",
            "gRPC call latency by method (streams: until the response starts)",
            self.grpc_duration.clone(),
        );
        r.register(
            "snapshot_apply_duration_seconds",
            "Time the allocator core takes to apply one snapshot",
            self.snapshot_apply.clone(),
        );
        r.register(
            "allocate_duration_seconds",
            "Allocate latency by kind (known label set, or new and persisted first)",
            self.allocate_latency.clone(),
        );
        r.register(
            "store_batch_duration_seconds",
            "Time to apply one batch of store writes",
            self.store_batch_duration.clone(),
        );
        r.register(
            "store_ops",
            "Store ops applied, by writer queue",
            self.store_batch_ops.clone(),
        );
        r.register(
            "rebinds_sent",
            "Rebind messages sent to agents",
            self.rebinds_sent.clone(),
        );
        r.register(
            "agent_messages_dropped",
            "Messages to agents dropped because the agent was not reading",
            self.agent_messages_dropped.clone(),
        );
        r.register(
            "invalid_messages",
            "Refused EndpointSync messages and calls, by kind",
            self.invalid_messages.clone(),
        );
        r.register(
            "rejected_entries",
            "Entries of EndpointSync snapshots and deltas rejected alone (the rest of the message was applied), and Hello addresses not claimed, by reason",
            self.rejected_entries.clone(),
        );
    }

    /// The endpoint map's batches, full maps and watchers.
    fn register_map(&self, r: &mut Registry) {
        r.register(
            "map_batches_built",
            "Endpoint map batches of changes built, each encoded once for every watcher",
            self.map_batches_built.clone(),
        );
        r.register(
            "map_full_maps_built",
            "Full copies of the endpoint map built, each shared by every watcher resyncing from it",
            self.map_full_maps_built.clone(),
        );
        r.register(
            "map_encoded_bytes",
            "Bytes encoded for the endpoint map as framed for the wire, by kind (batch of changes, full map)",
            self.map_bytes_encoded.clone(),
        );
        r.register(
            "map_messages_sent",
            "Endpoint map messages sent to watchers (one per watcher and message), by kind",
            self.map_messages_sent.clone(),
        );
        r.register(
            "map_sent_bytes",
            "Endpoint map bytes sent to watchers, all watchers together",
            self.map_bytes_sent.clone(),
        );
        r.register(
            "map_watchers",
            "Open EndpointMap.Watch streams",
            self.map_watchers.clone(),
        );
        r.register(
            "map_cache_bytes",
            "Bytes kept to serve resyncs, by kind (the cached full map, the batches of changes after it); freed when no resync has used them for --map-cache-idle",
            self.map_cache_bytes.clone(),
        );
        r.register(
            "map_resyncs",
            "Full endpoint maps sent to watchers, by reason (new_watcher, lagged, term)",
            self.map_resyncs.clone(),
        );
        r.register(
            "map_resyncs_in_progress",
            "Full endpoint maps waiting for their turn or being sent, by reason",
            self.map_resyncs_in_progress.clone(),
        );
        r.register(
            "map_watcher_lag_batches",
            "Batches a watcher was behind the latest when it was sent one",
            self.map_watcher_lag.clone(),
        );
    }

    /// Connections, message limits, quotas and authentication.
    fn register_connections(&self, r: &mut Registry) {
        r.register(
            "grpc_connections",
            "Open gRPC connections",
            self.grpc_connections.open.clone(),
        );
        r.register(
            "grpc_connections_refused",
            "gRPC connections closed on accept because --max-connections were open",
            self.grpc_connections.refused.clone(),
        );
        r.register(
            "grpc_connections_closed",
            "gRPC connections closed by the operator, by reason (handshake_timeout, idle_timeout)",
            self.grpc_connections.closed.clone(),
        );
        r.register(
            "grpc_messages_refused",
            "gRPC request messages refused, by reason (oversize: over the method's limit; timeout: not in full within --message-timeout; budget: no room in --max-inflight-message-bytes within it)",
            self.grpc_messages_refused.clone(),
        );
        r.register(
            "quota_refusals",
            "gRPC calls refused with RESOURCE_EXHAUSTED by a quota, by quota (streams_per_node, watches_per_caller, watches)",
            self.quota_refusals.clone(),
        );
        r.register(
            "inflight_message_bytes",
            "Bytes of large gRPC messages (snapshots) reserved while they are received, of --max-inflight-message-bytes",
            self.inflight_message_bytes.clone(),
        );
        r.register(
            "token_reviews",
            "Bearer tokens checked, by result (cached: answered from the cache; authenticated: a TokenReview said yes; else why it was refused or could not be checked)",
            self.token_reviews.clone(),
        );
        r.register(
            "token_review_cache_entries",
            "TokenReview answers cached now",
            self.token_review_cache_entries.clone(),
        );
    }
}
