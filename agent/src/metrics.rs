//! The agent's Prometheus metrics.
//!
//! Counters are updated where things happen. Gauges of the agent's state (endpoints
//! by state, map entries, identities, connection) are read at scrape time from the
//! core's [`Status`] (published after every change, the same the admin API reads),
//! and per-identity-pair traffic straight from the pinned FLOWS map, by
//! [`AgentCollector`], so they cannot drift.
//!
//! Traffic is exported for the [`TOP_FLOWS`] busiest pairs (by bytes) with their
//! identities as labels, and everything else summed into one pair labelled `other`:
//! the number of series stays bounded however many pairs the node sees. A pair that
//! moves between the top and `other` makes `other` go down; Prometheus reads that as a
//! counter reset, which is what it is for that bucket.
//!
//! Traffic per Service (SERVICE_FLOWS4/6, both directions summed) is exported the
//! same way, as `census_agent_service_packets` and `_bytes` labelled `client`
//! (an identity) and `service` (`namespace/name:port`), for the [`TOP_FLOWS`]
//! busiest, the rest summed into `other`. Only a Service the operator names now
//! and a client identity an endpoint of this node holds now (or `host`) get
//! their own series: a deleted Service's or a released identity's series is gone
//! at the next scrape, its counts in `other` until the map evicts them.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
    sync::Arc,
};

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

use census_daemon::metrics::gauge;
use tokio::sync::watch;

use crate::{
    agent_core::{MapState, MapStatus, Status},
    bpf::{DatapathStats, Flow, Inspector, ServiceFlow},
};

/// Identity pairs exported with their own labels.
const TOP_FLOWS: usize = 50;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct KindLabels {
    pub(crate) kind: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct MapLabels {
    pub(crate) map: &'static str,
}

/// Handles to the counters and histograms.
#[derive(Debug, Clone)]
pub(crate) struct Metrics {
    pub(crate) snapshots_sent: Counter,
    pub(crate) deltas_sent: Counter,
    /// Deltas not sent because the stream was full; the next snapshot covers them.
    pub(crate) deltas_dropped: Counter,
    pub(crate) reconnects: Counter,
    pub(crate) rebinds: Counter,
    /// Entries the operator's Acks rejected, counted in every Ack that names one.
    pub(crate) rejected_entries: Counter,
    pub(crate) map_write_errors: Family<MapLabels, Counter>,
    /// Writes of a new entry refused because the map held its maximum (also
    /// counted in `map_write_errors`).
    pub(crate) map_full: Family<MapLabels, Counter>,
    pub(crate) attach_errors: Counter,
    /// Entries the periodic full pass found wrong or missing and rewrote.
    pub(crate) map_repairs: Counter,
    /// Entries the full pass removed because nothing wants them.
    pub(crate) map_removals: Counter,
    pub(crate) source_errors: Family<KindLabels, Counter>,
    allocations: Family<OutcomeLabels, Counter>,
    pub(crate) full_pass_duration: Histogram,
    /// EndpointMap batches received.
    pub(crate) map_batches: Counter,
    /// Full maps received (resync ends).
    pub(crate) map_resyncs: Counter,
    /// Map entries, nodes and removes skipped because they did not decode or named
    /// a node the stream never announced.
    pub(crate) map_malformed: Counter,
    /// EndpointMap streams opened after the first.
    pub(crate) map_reconnects: Counter,
    /// From the operator building a batch to its entries written in ENDPOINTS.
    pub(crate) map_propagation: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            snapshots_sent: Counter::default(),
            deltas_sent: Counter::default(),
            deltas_dropped: Counter::default(),
            reconnects: Counter::default(),
            rebinds: Counter::default(),
            rejected_entries: Counter::default(),
            map_write_errors: Family::default(),
            map_full: Family::default(),
            attach_errors: Counter::default(),
            map_repairs: Counter::default(),
            map_removals: Counter::default(),
            source_errors: Family::default(),
            allocations: Family::default(),
            // 10 µs .. ~40 s.
            full_pass_duration: Histogram::new(exponential_buckets(0.000_01, 2.5, 17)),
            map_batches: Counter::default(),
            map_resyncs: Counter::default(),
            map_malformed: Counter::default(),
            map_reconnects: Counter::default(),
            // 1 ms .. ~65 s.
            map_propagation: Histogram::new(exponential_buckets(0.001, 2.0, 17)),
        }
    }
}

impl Metrics {
    pub(crate) fn allocation(&self, outcome: &'static str) {
        self.allocations
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }

    pub(crate) fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("census_agent");
        self.register_sync(r);
        self.register_reconcile(r);
        self.register_endpoints(r);
        self.register_endpoint_map(r);
    }

    /// The EndpointSync stream's: what was sent to the operator, and what it answered.
    fn register_sync(&self, r: &mut Registry) {
        r.register(
            "snapshots_sent",
            "Snapshots sent to the operator",
            self.snapshots_sent.clone(),
        );
        r.register(
            "deltas_sent",
            "Endpoint upserts and deletes sent to the operator",
            self.deltas_sent.clone(),
        );
        r.register(
            "deltas_dropped",
            "Deltas left to the next snapshot because the stream was full",
            self.deltas_dropped.clone(),
        );
        r.register(
            "reconnects",
            "EndpointSync streams opened after the first",
            self.reconnects.clone(),
        );
        r.register(
            "rebinds",
            "Rebinds received from the operator",
            self.rebinds.clone(),
        );
        r.register(
            "rejected_entries",
            "Entries of snapshots and deltas the operator rejected, counted in every Ack that names one (the endpoints themselves: `census endpoint list`, state error)",
            self.rejected_entries.clone(),
        );
    }

    /// Reconcile's: writes to the BPF maps, attachments, the full pass.
    fn register_reconcile(&self, r: &mut Registry) {
        r.register(
            "map_write_errors",
            "Failed writes to the BPF maps",
            self.map_write_errors.clone(),
        );
        r.register(
            "map_full_errors",
            "Writes of a new entry refused because the map was full (ENDPOINTS: raise \
             --endpoints-max-entries; NODES: --nodes-max-entries)",
            self.map_full.clone(),
        );
        r.register(
            "attach_errors",
            "Failed attachments of the classifier to an interface",
            self.attach_errors.clone(),
        );
        r.register(
            "map_repairs",
            "ENDPOINTS and INTERFACES entries the periodic full pass found changed or missing and rewrote",
            self.map_repairs.clone(),
        );
        r.register(
            "map_removals",
            "ENDPOINTS and INTERFACES entries the periodic full pass removed because nothing wants them",
            self.map_removals.clone(),
        );
        r.register(
            "full_pass_duration_seconds",
            "Time of one full reconcile pass",
            self.full_pass_duration.clone(),
        );
    }

    /// How this node's endpoints arrive: the source's reads, the Allocate calls.
    fn register_endpoints(&self, r: &mut Registry) {
        r.register(
            "source_errors",
            "Reads of the endpoint source that failed (the last good set stayed in force), by kind",
            self.source_errors.clone(),
        );
        r.register(
            "allocations",
            "Allocate calls to the operator, by outcome",
            self.allocations.clone(),
        );
    }

    /// The EndpointMap stream's: the cluster-wide endpoint map received.
    fn register_endpoint_map(&self, r: &mut Registry) {
        r.register(
            "endpoint_map_batches",
            "Batches of the cluster-wide endpoint map received from the operator",
            self.map_batches.clone(),
        );
        r.register(
            "endpoint_map_resyncs",
            "Full endpoint maps received (each replaces the remote entries)",
            self.map_resyncs.clone(),
        );
        r.register(
            "endpoint_map_malformed",
            "Endpoint map entries, nodes and removes skipped: not decodable, or naming a node the \
             stream never announced",
            self.map_malformed.clone(),
        );
        r.register(
            "endpoint_map_reconnects",
            "EndpointMap streams opened after the first",
            self.map_reconnects.clone(),
        );
        r.register(
            "endpoint_map_propagation_seconds",
            "From the operator building an endpoint map batch (its clock) to its entries written \
             in ENDPOINTS (this node's)",
            self.map_propagation.clone(),
        );
    }
}

/// Reads the core's [`Status`] and FLOWS at scrape time.
#[derive(Debug)]
pub(crate) struct AgentCollector {
    status: watch::Receiver<Status>,
    flows: Option<Arc<Inspector>>,
}

impl AgentCollector {
    pub(crate) fn new(status: watch::Receiver<Status>, flows: Option<Arc<Inspector>>) -> Self {
        Self { status, flows }
    }
}

/// `(client, service)` label values -> (packets, bytes).
type ServiceSeries = Vec<((String, String), (u64, u64))>;

/// SERVICE_FLOWS4/6 as series: per (client, `namespace/name:port`), both
/// directions summed, for a Service `names` names and a client in `live`; the
/// busiest `top` by bytes, then the rest (the others, and everything unnamed or
/// no longer in use) summed (`None` when there is none).
fn service_series(
    flows: Vec<ServiceFlow>,
    names: &BTreeMap<IpAddr, census_proto::domain::ClusterIpService>,
    live: &BTreeSet<u32>,
    top: usize,
) -> (ServiceSeries, Option<(u64, u64)>) {
    let mut series: BTreeMap<(u32, String), (u64, u64)> = BTreeMap::new();
    let mut rest: Option<(u64, u64)> = None;
    for flow in flows {
        let named = names
            .get(&flow.service)
            .filter(|_| live.contains(&flow.client_identity));
        let sum = match named {
            Some(service) => series
                .entry((
                    flow.client_identity,
                    format!("{}:{}", service.key, flow.port),
                ))
                .or_default(),
            None => rest.get_or_insert((0, 0)),
        };
        sum.0 = sum.0.wrapping_add(flow.packets);
        sum.1 = sum.1.wrapping_add(flow.bytes);
    }
    let mut series: Vec<_> = series.into_iter().collect();
    series.sort_by(|a, b| b.1.1.cmp(&a.1.1).then(b.1.0.cmp(&a.1.0)));
    if series.len() > top {
        for (_, (packets, bytes)) in series.split_off(top) {
            let sum = rest.get_or_insert((0, 0));
            sum.0 = sum.0.wrapping_add(packets);
            sum.1 = sum.1.wrapping_add(bytes);
        }
    }
    let series = series
        .into_iter()
        .map(|((client, service), counts)| ((client.to_string(), service), counts))
        .collect();
    (series, rest)
}

/// Encodes the series of SERVICE_FLOWS4/6 (see [`service_series`]).
fn encode_service_flows(
    e: &mut DescriptorEncoder<'_>,
    flows: Vec<ServiceFlow>,
    status: &Status,
) -> Result<(), fmt::Error> {
    let (series, other) = service_series(
        flows,
        &status.service_names,
        &status.local_identities,
        TOP_FLOWS,
    );
    for (name, help, bytes) in [
        (
            "census_agent_service_packets",
            "Packets per (client identity, Service namespace/name:port), both directions, top \
             pairs and `other`",
            false,
        ),
        (
            "census_agent_service_bytes",
            "Bytes per (client identity, Service namespace/name:port), both directions, top pairs \
             and `other`",
            true,
        ),
    ] {
        let kind = ConstCounter::new(0u64).metric_type();
        let mut family = e.encode_descriptor(name, help, None, kind)?;
        let pick = |(packets, bytes_): (u64, u64)| if bytes { bytes_ } else { packets };
        for ((client, service), counts) in &series {
            let labels = [("client", client.as_str()), ("service", service.as_str())];
            ConstCounter::new(pick(*counts)).encode(family.encode_family(&labels)?)?;
        }
        if let Some(counts) = other {
            let labels = [("client", "other"), ("service", "other")];
            ConstCounter::new(pick(counts)).encode(family.encode_family(&labels)?)?;
        }
    }
    Ok(())
}

/// The busiest `top` pairs by bytes, then the rest summed (`None` when there is no rest).
fn top_flows(mut flows: Vec<Flow>, top: usize) -> (Vec<Flow>, Option<(u64, u64)>) {
    flows.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(b.packets.cmp(&a.packets)));
    if flows.len() <= top {
        return (flows, None);
    }
    let rest = flows.split_off(top);
    let other = rest.iter().fold((0u64, 0u64), |(p, b), f| {
        (p.wrapping_add(f.packets), b.wrapping_add(f.bytes))
    });
    (flows, Some(other))
}

impl Collector for AgentCollector {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> Result<(), fmt::Error> {
        let g = self.status.borrow().clone();
        encode_endpoints(&mut e, &g)?;
        encode_endpoint_map(&mut e, &g.map)?;
        encode_core(&mut e, &g)?;
        let Some(maps) = &self.flows else {
            return Ok(());
        };
        // A failed read leaves the flow series out of this scrape.
        let Ok(flows) = maps.flows() else {
            return Ok(());
        };
        let pairs = flows.len() as u64;
        gauge(
            &mut e,
            "census_agent_flow_pairs",
            "Identity pairs counted in FLOWS",
            pairs,
        )?;
        gauge(
            &mut e,
            "census_agent_flow_capacity",
            "Identity pairs FLOWS holds before it evicts the least recently used",
            u64::from(maps.flows_max_entries()),
        )?;
        if let Ok(Some(stats)) = maps.stats() {
            encode_stats(&mut e, &stats, pairs)?;
        }
        encode_flows(&mut e, flows)?;
        if let Ok(service_flows) = maps.service_flows() {
            encode_service_flows(&mut e, service_flows, &g)?;
        }
        Ok(())
    }
}

/// The operator link and the endpoints by state.
fn encode_endpoints(e: &mut DescriptorEncoder<'_>, g: &Status) -> Result<(), fmt::Error> {
    let connected = g.operator.connected;
    gauge(
        e,
        "census_agent_operator_connected",
        "1 while the EndpointSync stream to the operator is up",
        u64::from(connected),
    )?;
    let kind = ConstGauge::new(0i64).metric_type();
    let mut family = e.encode_descriptor(
        "census_agent_endpoints",
        "Endpoints managed, by state",
        None,
        kind,
    )?;
    for (state, n) in [
        ("programmed", g.programmed),
        ("waiting_for_identity", g.waiting),
        ("error", g.errors),
    ] {
        let labels = [("state", state)];
        ConstGauge::new(as_i64(n)).encode(family.encode_family(&labels)?)?;
    }
    gauge(
        e,
        "census_agent_map_entries",
        "ENDPOINTS entries written by this agent",
        g.map_entries,
    )?;
    Ok(())
}

/// The cluster-wide endpoint map as the agent wants it in ENDPOINTS and NODES.
fn encode_endpoint_map(e: &mut DescriptorEncoder<'_>, map: &MapStatus) -> Result<(), fmt::Error> {
    let kind = ConstGauge::new(0i64).metric_type();
    let mut family = e.encode_descriptor(
        "census_agent_endpoint_map_entries",
        "ENDPOINTS entries the agent wants, by kind: this node's endpoints (local) and \
         addresses (host), other nodes' endpoints (remote) and addresses (remote-node)",
        None,
        kind,
    )?;
    for (what, n) in [
        ("local", map.local),
        ("host", map.host),
        ("remote", map.remote),
        ("remote-node", map.remote_node),
    ] {
        let labels = [("kind", what)];
        ConstGauge::new(as_i64(n)).encode(family.encode_family(&labels)?)?;
    }
    gauge(
        e,
        "census_agent_endpoint_map_shadowed",
        "Remote claims not written because an endpoint or address of this node holds the address",
        map.shadowed,
    )?;
    gauge(
        e,
        "census_agent_endpoint_map_nodes",
        "Other nodes the remote entries name (NODES)",
        map.nodes,
    )?;
    gauge(
        e,
        "census_agent_endpoint_map_connected",
        "1 while the EndpointMap watch is up (when it is not, the remote entries stay in force)",
        u64::from(map.link.state == MapState::Connected),
    )?;
    gauge(
        e,
        "census_agent_endpoint_map_unsupported",
        "1 while the operator has no EndpointMap (an older operator): the agent is local-only",
        u64::from(map.link.state == MapState::Unsupported),
    )?;
    Ok(())
}

/// The identity cache, the interfaces and the datapath's health.
fn encode_core(e: &mut DescriptorEncoder<'_>, g: &Status) -> Result<(), fmt::Error> {
    gauge(
        e,
        "census_agent_identities",
        "Label sets in the identity cache (only those in use)",
        g.identities,
    )?;
    gauge(
        e,
        "census_agent_pending_allocations",
        "Label sets waiting for the operator",
        g.pending_allocations,
    )?;
    gauge(
        e,
        "census_agent_interfaces",
        "Interfaces the classifier should be attached to",
        g.interfaces,
    )?;
    gauge(
        e,
        "census_agent_interfaces_by_address",
        "Interfaces the classifier is attached to whose INTERFACES slot another interface \
         holds: their packets are counted by address, not by interface",
        g.interfaces_by_address,
    )?;
    gauge(
        e,
        "census_agent_endpoints_unattached",
        "Endpoints with an identity whose interface the classifier is not attached to \
         (none found, refused or failing): their entries are not LOCAL, so their traffic \
         is counted where it goes",
        g.unattached,
    )?;
    gauge(
        e,
        "census_agent_programs_in_front",
        "Programs found running in front of census's classifier on its interfaces (a \
         verdict they return bypasses census)",
        g.in_front.len() as u64,
    )?;
    gauge(
        e,
        "census_agent_datapath_whole",
        "0 while census's pins are gone and cannot be put back (the agent is not Ready)",
        u64::from(g.datapath_error.is_none()),
    )?;
    Ok(())
}

/// FLOWS' busiest pairs and one `other` series.
fn encode_flows(e: &mut DescriptorEncoder<'_>, flows: Vec<Flow>) -> Result<(), fmt::Error> {
    let (top, other) = top_flows(flows, TOP_FLOWS);
    for (name, help, pick) in [
        (
            "census_agent_flow_packets",
            "Packets per (source identity, destination identity), top pairs and `other`",
            (|f: &Flow| f.packets) as fn(&Flow) -> u64,
        ),
        (
            "census_agent_flow_bytes",
            "Bytes per (source identity, destination identity), top pairs and `other`",
            |f: &Flow| f.bytes,
        ),
    ] {
        let kind = ConstCounter::new(0u64).metric_type();
        let mut family = e.encode_descriptor(name, help, None, kind)?;
        for flow in &top {
            let (src, dst) = (flow.src_identity.to_string(), flow.dst_identity.to_string());
            let labels = [
                ("src_identity", src.as_str()),
                ("dst_identity", dst.as_str()),
            ];
            ConstCounter::new(pick(flow)).encode(family.encode_family(&labels)?)?;
        }
        if let Some((packets, bytes)) = other {
            let value = if name.ends_with("packets") {
                packets
            } else {
                bytes
            };
            let labels = [("src_identity", "other"), ("dst_identity", "other")];
            ConstCounter::new(value).encode(family.encode_family(&labels)?)?;
        }
    }
    Ok(())
}

/// The programs' own counters (STATS), and the evictions they imply.
fn encode_stats(
    e: &mut DescriptorEncoder<'_>,
    stats: &DatapathStats,
    pairs_present: u64,
) -> Result<(), fmt::Error> {
    let DatapathStats {
        flow_inserts,
        flow_insert_failures,
        unparsable,
        interface_misses,
        log_suppressed,
        service_marked,
        marked_counted,
        service_flow_inserts,
        service_flow_insert_failures,
    } = *stats;
    for (name, help, value) in [
        (
            "census_agent_flow_inserts",
            "Identity pairs the datapath inserted into FLOWS",
            flow_inserts,
        ),
        (
            "census_agent_flow_insert_failures",
            "FLOWS inserts the kernel refused: the packets went uncounted",
            flow_insert_failures,
        ),
        (
            "census_agent_flow_evictions",
            "Identity pairs FLOWS evicted to make room (inserted and no longer present; \
             their counters are lost)",
            stats.flow_evictions(pairs_present),
        ),
        (
            "census_agent_datapath_unparsable",
            "IPv4 and IPv6 frames too short to read their addresses (not counted)",
            unparsable,
        ),
        (
            "census_agent_datapath_interface_misses",
            "Packets counted by address because their interface had no INTERFACES entry \
             although their endpoint is LOCAL",
            interface_misses,
        ),
        (
            "census_agent_datapath_log_suppressed",
            "Datapath log events held back by the programs' rate limit",
            log_suppressed,
        ),
        (
            "census_agent_service_marked",
            "Packets endpoints sent to a Service address, marked to be counted once translated",
            service_marked,
        ),
        (
            "census_agent_marked_counted",
            "Marked packets counted once translated (entering a pod, leaving the node or reaching \
             one of its sockets)",
            marked_counted,
        ),
        (
            "census_agent_marks_lost",
            "Marked packets never counted: dropped, or stripped of the mark by a rule that \
             rewrites the whole skb mark",
            stats.marks_lost(),
        ),
        (
            "census_agent_service_flow_inserts",
            "Entries the datapath inserted into SERVICE_FLOWS4/6 (client, Service address, port, \
             protocol, direction)",
            service_flow_inserts,
        ),
        (
            "census_agent_service_flow_insert_failures",
            "SERVICE_FLOWS4/6 inserts the kernel refused: those packets went uncounted there (FLOWS \
             counted them)",
            service_flow_insert_failures,
        ),
    ] {
        let counter = ConstCounter::new(value);
        counter.encode(e.encode_descriptor(name, help, None, counter.metric_type())?)?;
    }
    Ok(())
}

fn as_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow(src: u32, dst: u32, bytes: u64) -> Flow {
        Flow {
            src_identity: src,
            dst_identity: dst,
            packets: bytes / 100,
            bytes,
        }
    }

    #[test]
    fn keeps_the_busiest_pairs_and_sums_the_rest() {
        let flows = (0..10)
            .map(|i| flow(256 + i, 300, u64::from(i) * 100))
            .collect();
        let (top, other) = top_flows(flows, 3);
        let kept: Vec<u32> = top.iter().map(|f| f.src_identity).collect();
        assert_eq!(kept, vec![265, 264, 263]);
        // 0 + 100 + ... + 600 bytes, 0 + 1 + ... + 6 packets.
        assert_eq!(other, Some((21, 2100)));
        let (top, other) = top_flows(vec![flow(1, 2, 5)], 3);
        assert_eq!((top.len(), other), (1, None));
    }

    #[test]
    fn service_series_name_live_clients_of_named_services_and_sum_the_rest()
    -> Result<(), Box<dyn std::error::Error>> {
        use crate::bpf::ServiceDirection;
        use census_proto::domain::{ClusterIpService, EndpointKey};
        let web: IpAddr = "10.96.0.10".parse()?;
        let gone: IpAddr = "10.96.0.11".parse()?;
        let flow = |client, service, direction, bytes| ServiceFlow {
            client_identity: client,
            service,
            port: 80,
            protocol: 6,
            direction,
            packets: bytes / 100,
            bytes,
        };
        let flows = vec![
            flow(1000, web, ServiceDirection::Request, 1000),
            flow(1000, web, ServiceDirection::Reply, 3000),
            flow(1001, web, ServiceDirection::Request, 500),
            // A released identity, a Service no longer named: in `other`.
            flow(1002, web, ServiceDirection::Request, 700),
            flow(1000, gone, ServiceDirection::Request, 900),
        ];
        let names = BTreeMap::from([(
            web,
            ClusterIpService {
                key: EndpointKey::new("shop", "web")?,
                ports: Box::default(),
            },
        )]);
        let live = BTreeSet::from([1000, 1001, 1]);
        let (series, other) = service_series(flows.clone(), &names, &live, 50);
        assert_eq!(
            series,
            [
                (("1000".to_owned(), "shop/web:80".to_owned()), (40, 4000)),
                (("1001".to_owned(), "shop/web:80".to_owned()), (5, 500)),
            ]
        );
        assert_eq!(other, Some((16, 1600)));
        // Over the top: the smaller pair joins `other`.
        let (series, other) = service_series(flows, &names, &live, 1);
        assert_eq!(series.len(), 1);
        assert_eq!(other, Some((21, 2100)));
        Ok(())
    }

    #[test]
    fn encodes_datapath_stats_and_derives_evictions() -> Result<(), fmt::Error> {
        let stats = DatapathStats {
            flow_inserts: 70_000,
            flow_insert_failures: 3,
            unparsable: 2,
            interface_misses: 5,
            log_suppressed: 7,
            service_marked: 30,
            marked_counted: 20,
            ..DatapathStats::default()
        };
        let mut registry = Registry::default();
        registry.register_collector(Box::new(StatsOnly(stats, 65_000)));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry)?;
        for line in [
            "census_agent_flow_inserts_total 70000",
            "census_agent_flow_insert_failures_total 3",
            "census_agent_flow_evictions_total 5000",
            "census_agent_datapath_unparsable_total 2",
            "census_agent_datapath_interface_misses_total 5",
            "census_agent_datapath_log_suppressed_total 7",
            "census_agent_service_marked_total 30",
            "census_agent_marked_counted_total 20",
            "census_agent_marks_lost_total 10",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in {text}");
        }
        // More pairs present than counted inserts (maps older than STATS): no
        // negative evictions.
        assert_eq!(stats.flow_evictions(80_000), 0);
        Ok(())
    }

    #[derive(Debug)]
    struct StatsOnly(DatapathStats, u64);

    impl Collector for StatsOnly {
        fn encode(&self, mut e: DescriptorEncoder<'_>) -> Result<(), fmt::Error> {
            encode_stats(&mut e, &self.0, self.1)
        }
    }

    #[test]
    fn encodes_gauges_without_flows() -> Result<(), fmt::Error> {
        let mut status = Status {
            programmed: 3,
            ..Status::default()
        };
        status.operator.connected = true;
        status.map.remote = 40;
        status.map.remote_node = 2;
        status.map.link.state = MapState::Connected;
        let (_publish, status) = watch::channel(status);
        let mut registry = Registry::default();
        Metrics::default().register(&mut registry);
        registry.register_collector(Box::new(AgentCollector::new(status, None)));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry)?;
        assert!(text.contains("census_agent_operator_connected 1"), "{text}");
        assert!(
            text.contains("census_agent_endpoints{state=\"programmed\"} 3"),
            "{text}"
        );
        for line in [
            "census_agent_endpoint_map_entries{kind=\"remote\"} 40",
            "census_agent_endpoint_map_entries{kind=\"remote-node\"} 2",
            "census_agent_endpoint_map_connected 1",
            "census_agent_endpoint_map_unsupported 0",
            "census_agent_endpoint_map_resyncs_total 0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in {text}");
        }
        Ok(())
    }
}
