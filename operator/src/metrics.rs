//! Prometheus metrics. Counters and histograms are updated where things happen;
//! the core's live state (identities by state, nodes, range usage) and its
//! cumulative counters are read from the core at scrape time by [`CoreCollector`], so
//! they cannot drift from it.

use std::{fmt, sync::Arc};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric},
    metrics::{
        counter::{ConstCounter, Counter},
        family::Family,
        gauge::ConstGauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};

use crate::runtime::Runtime;

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

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

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
    /// Entries of EndpointSync messages rejected alone, by the kind of problem.
    pub rejected_entries: Family<ReasonLabels, Counter>,
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
        }
    }
}

impl Metrics {
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("census");
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
            "Entries of EndpointSync snapshots and deltas rejected alone (the rest of the message was applied), by reason",
            self.rejected_entries.clone(),
        );
    }
}

/// Reads the core at scrape time.
#[derive(Debug)]
pub struct CoreCollector {
    runtime: Arc<Runtime>,
}

impl CoreCollector {
    pub fn new(runtime: Arc<Runtime>) -> Self {
        Self { runtime }
    }
}

fn gauge(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), fmt::Error> {
    let g = ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX));
    g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)
}

fn ratio(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    value: f64,
) -> Result<(), fmt::Error> {
    let g = ConstGauge::new(value);
    g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)
}

fn counter(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), fmt::Error> {
    let c = ConstCounter::new(value);
    c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)
}

fn labelled<'a, I>(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    label: &'static str,
    values: I,
    is_counter: bool,
) -> Result<(), fmt::Error>
where
    I: IntoIterator<Item = (&'a str, u64)>,
{
    let kind = if is_counter {
        ConstCounter::new(0u64).metric_type()
    } else {
        ConstGauge::new(0i64).metric_type()
    };
    let mut family = encoder.encode_descriptor(name, help, None, kind)?;
    for (value, n) in values {
        let labels = [(label, value)];
        let metric = family.encode_family(&labels)?;
        if is_counter {
            ConstCounter::new(n).encode(metric)?;
        } else {
            ConstGauge::new(n as i64).encode(metric)?;
        }
    }
    Ok(())
}

impl Collector for CoreCollector {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> Result<(), fmt::Error> {
        let now = self.runtime.now();
        let (stats, c) = self.runtime.read(|a| (a.stats(now), a.counters().clone()));
        labelled(
            &mut e,
            "census_identities",
            "Identities in memory by state (protected: neither referenced nor held, kept by the restart fence)",
            "state",
            [
                ("creating", stats.creating),
                ("live", stats.live),
                ("protected", stats.protected),
                ("released", stats.released),
                ("deleting", stats.deleting),
                ("quarantined", stats.quarantined),
                ("blocked", stats.blocked),
            ],
            false,
        )?;
        gauge(
            &mut e,
            "census_id_range_size",
            "Ids in the allocation range",
            stats.range_size,
        )?;
        gauge(
            &mut e,
            "census_id_range_used",
            "Ids of the range bound, quarantined or blocked",
            stats.range_used,
        )?;
        ratio(
            &mut e,
            "census_id_range_usage_ratio",
            "Share of the id range in use",
            stats.range_usage_ratio(),
        )?;
        gauge(&mut e, "census_nodes", "Nodes known", stats.nodes)?;
        gauge(
            &mut e,
            "census_stale_nodes",
            "Nodes silent longer than the node TTL",
            stats.stale_nodes,
        )?;
        gauge(
            &mut e,
            "census_connected_nodes",
            "Nodes with an open EndpointSync stream",
            stats.connected_nodes,
        )?;
        gauge(
            &mut e,
            "census_endpoints",
            "Endpoints in all views",
            stats.endpoints,
        )?;
        gauge(
            &mut e,
            "census_holds",
            "Identities held for nodes, not yet in their views",
            stats.holds,
        )?;
        gauge(
            &mut e,
            "census_pending_allocations",
            "Allocations waiting for the store",
            stats.pending_allocations,
        )?;
        gauge(
            &mut e,
            "census_gc_backlog",
            "Released identities and failed deletes waiting for GC",
            stats.gc_backlog,
        )?;
        gauge(
            &mut e,
            "census_gc_inflight",
            "Store deletes in flight",
            stats.gc_inflight,
        )?;

        labelled(
            &mut e,
            "census_allocations",
            "Identities handed out by Allocate, by kind",
            "kind",
            [("known", c.allocations_known), ("new", c.allocations_new)],
            true,
        )?;
        counter(
            &mut e,
            "census_identities_adopted",
            "Identities bound from agents' reports",
            c.identities_adopted,
        )?;
        counter(&mut e, "census_snapshots", "Snapshots applied", c.snapshots)?;
        counter(
            &mut e,
            "census_deltas",
            "Upserts and deletes applied",
            c.deltas,
        )?;
        counter(
            &mut e,
            "census_corrections",
            "References snapshots added or removed that deltas had not",
            c.corrections,
        )?;
        counter(
            &mut e,
            "census_adoptions",
            "References taken over from sessions' first snapshots",
            c.adoptions,
        )?;
        counter(
            &mut e,
            "census_rebinds",
            "Endpoints told to use another identity",
            c.rebinds,
        )?;
        counter(
            &mut e,
            "census_old_seq_ignored",
            "Messages ignored for an old seq",
            c.old_seq_ignored,
        )?;
        counter(
            &mut e,
            "census_unresolved_endpoints",
            "Endpoints no identity could be found for",
            c.unresolved,
        )?;
        counter(
            &mut e,
            "census_holds_expired",
            "Holds that expired unseen",
            c.holds_expired,
        )?;
        counter(
            &mut e,
            "census_nodes_dropped",
            "Node views dropped (silence, or node gone)",
            c.nodes_dropped,
        )?;
        counter(
            &mut e,
            "census_identities_released",
            "Identities that lost their last reference",
            c.released,
        )?;
        counter(
            &mut e,
            "census_quarantine_ended",
            "Quarantined ids freed",
            c.quarantine_ended,
        )?;
        counter(
            &mut e,
            "census_ids_blocked",
            "Ids blocked because the store disagreed",
            c.blocked,
        )?;
        labelled(
            &mut e,
            "census_store_repairs",
            "Objects of the store census wrote again or took in after someone else changed them, by kind",
            "kind",
            [
                ("binding_recreated", c.bindings_recreated),
                ("tombstone_recreated", c.tombstones_recreated),
                ("tombstone_unrecoverable", c.tombstones_unrecoverable),
                ("binding_taken", c.bindings_taken),
            ],
            true,
        )?;
        labelled(
            &mut e,
            "census_gc_outcomes",
            "Garbage-collection deletes by outcome",
            "outcome",
            c.gc_outcomes.iter().map(|(k, v)| (*k, *v)),
            true,
        )?;
        labelled(
            &mut e,
            "census_store_failures",
            "Failed store writes by cause",
            "cause",
            c.store_failures.iter().map(|(k, v)| (*k, *v)),
            true,
        )?;
        Ok(())
    }
}
