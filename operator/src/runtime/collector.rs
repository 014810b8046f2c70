//! The core's live state and cumulative counters as metrics, read at scrape time so
//! they cannot drift from the core.

use std::{fmt, sync::Arc};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{counter::ConstCounter, gauge::ConstGauge},
};

use census_daemon::metrics::gauge;

use super::Runtime;
use crate::allocator::{Counters, MapStats, Stats};

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
        let (stats, c, map) = self
            .runtime
            .read(|a| (a.stats(), a.counters().clone(), a.map_stats()));
        encode_state(&mut e, &stats)?;
        encode_map(&mut e, &map)?;
        encode_counters(&mut e, &c)?;
        encode_outcomes(&mut e, &c)
    }
}

/// The core's state now: identities, the id range, nodes, endpoints, GC.
fn encode_state(e: &mut DescriptorEncoder<'_>, stats: &Stats) -> Result<(), fmt::Error> {
    labelled(
        e,
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
        e,
        "census_id_range_size",
        "Ids in the allocation range",
        stats.range_size,
    )?;
    gauge(
        e,
        "census_id_range_used",
        "Ids of the range bound, quarantined or blocked",
        stats.range_used,
    )?;
    ratio(
        e,
        "census_id_range_usage_ratio",
        "Share of the id range in use",
        stats.range_usage_ratio(),
    )?;
    gauge(e, "census_nodes", "Nodes known", stats.nodes)?;
    gauge(
        e,
        "census_stale_nodes",
        "Nodes silent longer than the node TTL",
        stats.stale_nodes,
    )?;
    gauge(
        e,
        "census_connected_nodes",
        "Nodes with an open EndpointSync stream",
        stats.connected_nodes,
    )?;
    gauge(
        e,
        "census_endpoints",
        "Endpoints in all views",
        stats.endpoints,
    )?;
    gauge(
        e,
        "census_holds",
        "Identities held for nodes, not yet in their views",
        stats.holds,
    )?;
    gauge(
        e,
        "census_pending_allocations",
        "Allocations waiting for the store",
        stats.pending_allocations,
    )?;
    gauge(
        e,
        "census_gc_backlog",
        "Released identities and failed deletes waiting for GC",
        stats.gc_backlog,
    )?;
    gauge(
        e,
        "census_gc_inflight",
        "Store deletes in flight",
        stats.gc_inflight,
    )?;
    Ok(())
}

/// The cluster-wide endpoint map's index.
fn encode_map(e: &mut DescriptorEncoder<'_>, map: &MapStats) -> Result<(), fmt::Error> {
    labelled(
        e,
        "census_map_entries",
        "Addresses in the cluster-wide endpoint map, by the kind of their winning claim",
        "kind",
        [
            ("endpoint", map.endpoint_entries),
            ("node_address", map.node_address_entries),
        ],
        false,
    )?;
    gauge(
        e,
        "census_map_claims",
        "Claims of addresses in the endpoint map, winners and losers",
        map.claims,
    )?;
    gauge(
        e,
        "census_map_contested_addresses",
        "Addresses of the endpoint map claimed more than once now",
        map.contested,
    )?;
    gauge(
        e,
        "census_map_nodes",
        "Nodes named by the endpoint map",
        map.nodes,
    )?;
    counter(
        e,
        "census_map_conflicts",
        "Claims of an address that met an existing claim (the newer wins)",
        map.conflicts_total,
    )?;
    Ok(())
}

/// What the core did since start.
fn encode_counters(e: &mut DescriptorEncoder<'_>, c: &Counters) -> Result<(), fmt::Error> {
    labelled(
        e,
        "census_allocations",
        "Identities handed out by Allocate, by kind",
        "kind",
        [("known", c.allocations_known), ("new", c.allocations_new)],
        true,
    )?;
    counter(
        e,
        "census_identities_adopted",
        "Identities bound from agents' reports",
        c.identities_adopted,
    )?;
    counter(e, "census_snapshots", "Snapshots applied", c.snapshots)?;
    counter(e, "census_deltas", "Upserts and deletes applied", c.deltas)?;
    counter(
        e,
        "census_corrections",
        "References snapshots added or removed that deltas had not",
        c.corrections,
    )?;
    counter(
        e,
        "census_adoptions",
        "References taken over from sessions' first snapshots",
        c.adoptions,
    )?;
    counter(
        e,
        "census_rebinds",
        "Endpoints told to use another identity",
        c.rebinds,
    )?;
    counter(
        e,
        "census_old_seq_ignored",
        "Messages ignored for an old seq",
        c.old_seq_ignored,
    )?;
    counter(
        e,
        "census_allocations_expired",
        "Allocate calls answered with an error at their deadline, the store's answer not come",
        c.allocations_expired,
    )?;
    Ok(())
}

/// What became of identities and of the store's writes since start.
fn encode_outcomes(e: &mut DescriptorEncoder<'_>, c: &Counters) -> Result<(), fmt::Error> {
    counter(
        e,
        "census_unresolved_endpoints",
        "Endpoints no identity could be found for",
        c.unresolved,
    )?;
    counter(
        e,
        "census_holds_expired",
        "Holds that expired unseen",
        c.holds_expired,
    )?;
    counter(
        e,
        "census_holds_settled",
        "Holds ended by a snapshot saying their allocation had settled",
        c.holds_settled,
    )?;
    counter(
        e,
        "census_nodes_dropped",
        "Node views dropped (silence, or node gone)",
        c.nodes_dropped,
    )?;
    counter(
        e,
        "census_identities_released",
        "Identities that lost their last reference",
        c.released,
    )?;
    counter(
        e,
        "census_quarantine_ended",
        "Quarantined ids freed",
        c.quarantine_ended,
    )?;
    counter(
        e,
        "census_ids_blocked",
        "Ids blocked because the store disagreed",
        c.blocked,
    )?;
    labelled(
        e,
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
        e,
        "census_gc_outcomes",
        "Garbage-collection deletes by outcome",
        "outcome",
        c.gc_outcomes.iter().map(|(k, v)| (*k, *v)),
        true,
    )?;
    labelled(
        e,
        "census_store_failures",
        "Failed store writes by cause",
        "cause",
        c.store_failures.iter().map(|(k, v)| (*k, *v)),
        true,
    )?;
    Ok(())
}
