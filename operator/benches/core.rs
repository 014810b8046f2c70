//! Benchmarks of the allocator core, printing figures (run with
//! `cargo bench -p census-operator --bench core`):
//!
//! - Allocate of a known label set (target: well under 1 µs);
//! - a 110-endpoint snapshot with no changes, on decoded input (target: under 20 µs);
//! - memory at 50,000 identities and 5,000 nodes x 110 endpoints (target: under 300
//!   bytes per endpoint);
//! - 100,000 unique short-lived label sets with every delete event lost, then true
//!   snapshots and the grace period: only live identities remain and the live heap
//!   comes back within 64 bytes per churned label set;
//! - an edit storm: identities whose objects are edited (each blocked, its users moved
//!   to a new id) at 1,000 and 5,000 nodes x 110 endpoints. Moving an identity scans
//!   every view under the core's lock, so its cost grows with the endpoints, not with
//!   the identity's users (no target: the figure is for docs/benchmarks.md).
//!
//! Heap figures come from a counting global allocator (bytes requested and not yet
//! freed), so they are exact and independent of the malloc in use.

#![allow(clippy::print_stdout)]

use std::{
    hint::black_box,
    net::{IpAddr, Ipv4Addr},
    time::{Duration, Instant},
};

use census_operator::{
    allocator::{Allocator, Config, ConnId, Effect, Timestamp},
    store::{Loaded, StoreOp},
};
use census_proto::{
    domain::{AllocationId, Endpoint, EndpointKey, IdRange, IdentityId, NodeName, SessionId},
    labels::{LabelLimits, LabelSet},
};
use census_testkit::alloc::{PerThreadCounting, thread_net_bytes};

// The core is synchronous and the bench runs it on the main thread, so the
// per-thread count is the core's memory.
#[global_allocator]
static GLOBAL: PerThreadCounting = PerThreadCounting;

fn heap() -> isize {
    isize::try_from(thread_net_bytes()).unwrap_or(isize::MAX)
}

type BenchResult = Result<(), Box<dyn std::error::Error>>;

fn main() -> BenchResult {
    // `cargo bench` passes `--bench`; a filter argument selects one benchmark.
    let filter: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let run = |name: &str| filter.as_deref().is_none_or(|f| name.contains(f));
    println!("census allocator core benchmarks (release build, one thread)\n");
    if run("allocate") {
        bench_allocate_known()?;
    }
    if run("snapshot") {
        bench_snapshot_unchanged()?;
    }
    if run("memory") {
        bench_memory()?;
    }
    if run("churn") {
        bench_churn()?;
    }
    if run("storm") {
        bench_edit_storm()?;
    }
    Ok(())
}

fn labels(text: &str) -> Result<LabelSet, Box<dyn std::error::Error>> {
    Ok(LabelSet::parse(
        text.split(',').map(|l| format!("k8s:{l}")),
        &LabelLimits::default(),
    )?)
}

fn pod_labels(i: usize) -> Result<LabelSet, Box<dyn std::error::Error>> {
    labels(&format!(
        "app=service-{},app.kubernetes.io/part-of=shop,tier=backend,io.kubernetes.pod.namespace=team-{},io.kubernetes.pod.serviceaccount=default",
        i,
        i % 40
    ))
}

fn node(i: usize) -> Result<NodeName, Box<dyn std::error::Error>> {
    Ok(NodeName::new(&format!("node-{i:05}"))?)
}

fn endpoint(
    node: usize,
    pod: usize,
    id: IdentityId,
    labels: LabelSet,
) -> Result<Endpoint, Box<dyn std::error::Error>> {
    let n = (node * 110 + pod) as u32;
    Ok(Endpoint {
        key: EndpointKey::new(
            &format!("team-{}", pod % 40),
            &format!("service-{pod}-7d9f8b6c4-{node:05}x"),
        )?,
        ips: vec![IpAddr::V4(Ipv4Addr::from(0xC612_0000 + n))].into_boxed_slice(),
        identity: id,
        labels,
    })
}

fn config() -> Config {
    Config {
        range: IdRange::new(256, 1 << 24).unwrap_or_default(),
        max_holds_per_node: 1 << 20,
        gc_rate: 1e9,
        gc_burst: 1e9,
        max_inflight_deletes: 1 << 20,
        ..Config::with_snapshot_interval(Duration::from_secs(30))
    }
}

/// Answers every store op with success (an ideal store), repeatedly.
fn settle(alloc: &mut Allocator, now: Timestamp) {
    loop {
        let ops: Vec<StoreOp> = alloc
            .drain_effects()
            .into_iter()
            .filter_map(|e| match e {
                Effect::Store { op, .. } => Some(op),
                _ => None,
            })
            .collect();
        if ops.is_empty() {
            return;
        }
        for op in ops {
            alloc.store_result(op, Ok(()), now);
        }
    }
}

fn connect(
    alloc: &mut Allocator,
    n: &NodeName,
    now: Timestamp,
) -> Result<(SessionId, ConnId), Box<dyn std::error::Error>> {
    let session = SessionId {
        start_time_ns: 1,
        nonce: 1,
    };
    let conn = alloc.hello(n, session, now)?.conn;
    Ok((session, conn))
}

fn bench_allocate_known() -> BenchResult {
    let mut now = Timestamp::from_millis(1_000_000);
    let mut alloc = Allocator::new(config(), Loaded::default(), now);
    now = now.plus(Duration::from_secs(100));
    alloc.tick(now);
    let n = node(0)?;
    let (session, _) = connect(&mut alloc, &n, now)?;
    let sets: Vec<LabelSet> = (0..1000).map(pod_labels).collect::<Result<_, _>>()?;
    for (i, l) in sets.iter().enumerate() {
        alloc.allocate(i as u64, &n, session, AllocationId::NONE, l.clone(), now)?;
    }
    settle(&mut alloc, now);
    let iterations = 2_000_000;
    let started = Instant::now();
    for i in 0..iterations {
        let l = &sets[i % sets.len()];
        black_box(alloc.allocate(i as u64, &n, session, AllocationId::NONE, l.clone(), now)?);
    }
    let per = started.elapsed() / iterations as u32;
    println!(
        "allocate, known label set (core):             {:>8.0} ns/op   (target < 1000 ns)",
        per.as_nanos() as f64
    );
    Ok(())
}

fn bench_snapshot_unchanged() -> BenchResult {
    let mut now = Timestamp::from_millis(1_000_000);
    let mut alloc = Allocator::new(config(), Loaded::default(), now);
    now = now.plus(Duration::from_secs(100));
    alloc.tick(now);
    let n = node(0)?;
    let (_, conn) = connect(&mut alloc, &n, now)?;
    let eps: Vec<Endpoint> = (0..110)
        .map(|p| {
            endpoint(
                0,
                p,
                IdentityId::new(1000 + p as u32).unwrap_or(IdentityId::WORLD),
                pod_labels(p)?,
            )
        })
        .collect::<Result<_, _>>()?;
    alloc.snapshot(&n, conn, 1, eps.clone(), AllocationId::NONE, now)?;
    settle(&mut alloc, now);
    let iterations = 100_000u64;
    let started = Instant::now();
    for i in 0..iterations {
        black_box(eps.clone());
        black_box(i);
    }
    let clone = started.elapsed() / iterations as u32;
    let started = Instant::now();
    for seq in 2..iterations + 2 {
        let applied = alloc.snapshot(&n, conn, seq, eps.clone(), AllocationId::NONE, now)?;
        debug_assert_eq!(applied.corrections, 0);
        black_box(applied);
    }
    let total = started.elapsed() / iterations as u32;
    let apply = total.saturating_sub(clone);
    println!(
        "snapshot, 110 endpoints, no change (core):     {:>8.2} µs      (target < 20 µs; plus {:.2} µs to build the input)",
        apply.as_nanos() as f64 / 1000.0,
        clone.as_nanos() as f64 / 1000.0
    );
    Ok(())
}

fn bench_memory() -> BenchResult {
    const NODES: usize = 5_000;
    const PODS: usize = 110;
    const IDENTITIES: usize = 50_000;
    let mut now = Timestamp::from_millis(1_000_000);
    let sets: Vec<LabelSet> = (0..IDENTITIES).map(pod_labels).collect::<Result<_, _>>()?;
    let names: Vec<NodeName> = (0..NODES).map(node).collect::<Result<_, _>>()?;
    let base = heap();
    let mut alloc = Allocator::new(config(), Loaded::default(), now);
    now = now.plus(Duration::from_secs(100));
    alloc.tick(now);
    // Identities first: adopted from one node's snapshot, then that view emptied.
    let seed = node(99_999)?;
    let (_, conn) = connect(&mut alloc, &seed, now)?;
    let seed_eps: Vec<Endpoint> = (0..IDENTITIES)
        .map(|i| {
            endpoint(
                99_999,
                i,
                IdentityId::new(256 + i as u32).unwrap_or(IdentityId::WORLD),
                sets[i].clone(),
            )
        })
        .collect::<Result<_, _>>()?;
    alloc.snapshot(&seed, conn, 1, seed_eps, AllocationId::NONE, now)?;
    settle(&mut alloc, now);
    alloc.snapshot(&seed, conn, 2, Vec::new(), AllocationId::NONE, now)?;
    alloc.node_gone(&seed, now);
    settle(&mut alloc, now);
    let with_identities = heap();
    // Then 5,000 nodes x 110 endpoints referencing them.
    let started = Instant::now();
    for (i, name) in names.iter().enumerate() {
        let (_, conn) = connect(&mut alloc, name, now)?;
        let eps: Vec<Endpoint> = (0..PODS)
            .map(|p| {
                let l = (i * PODS + p) % IDENTITIES;
                endpoint(
                    i,
                    p,
                    IdentityId::new(256 + l as u32).unwrap_or(IdentityId::WORLD),
                    sets[l].clone(),
                )
            })
            .collect::<Result<_, _>>()?;
        alloc.snapshot(name, conn, 1, eps, AllocationId::NONE, now)?;
    }
    settle(&mut alloc, now);
    let build = started.elapsed();
    let with_views = heap();
    let stats = alloc.stats();
    drop(sets);
    let per_identity = (with_identities - base) as f64 / IDENTITIES as f64;
    let per_endpoint = (with_views - with_identities) as f64 / (NODES * PODS) as f64;
    println!(
        "memory, {} identities:                     {:>8.0} bytes/identity (labels interned once, ~{} bytes of label text each)",
        IDENTITIES,
        per_identity,
        pod_labels(1)?.as_str().len()
    );
    println!(
        "memory, {} nodes x {} endpoints ({} endpoints): {:>6.0} bytes/endpoint (target < 300); {} live identities; first snapshots applied in {:.2?}",
        NODES, PODS, stats.endpoints, per_endpoint, stats.live, build
    );
    black_box(alloc);
    Ok(())
}

/// One node of the churn benchmark: its name, session, connection, steady
/// endpoints and next sequence number.
struct ChurnNode {
    name: NodeName,
    session: SessionId,
    conn: ConnId,
    steady: Vec<Endpoint>,
    seq: u64,
}

const CHURN_NODES: usize = 3;
const CHURN_STEADY: usize = 57;

/// The churn benchmark's nodes, connected, each with its steady pods snapshotted.
fn churn_nodes(
    alloc: &mut Allocator,
    now: Timestamp,
) -> Result<Vec<ChurnNode>, Box<dyn std::error::Error>> {
    let mut nodes = Vec::new();
    for i in 0..CHURN_NODES {
        let name = node(i)?;
        let (session, conn) = connect(alloc, &name, now)?;
        let steady: Vec<Endpoint> = (0..CHURN_STEADY)
            .map(|p| {
                endpoint(
                    i,
                    p,
                    IdentityId::new(300 + (i * CHURN_STEADY + p) as u32)
                        .unwrap_or(IdentityId::WORLD),
                    pod_labels(i * CHURN_STEADY + p)?,
                )
            })
            .collect::<Result<_, _>>()?;
        alloc.snapshot(&name, conn, 1, steady.clone(), AllocationId::NONE, now)?;
        nodes.push(ChurnNode {
            name,
            session,
            conn,
            steady,
            seq: 2,
        });
    }
    Ok(nodes)
}

/// Every node's true snapshot (its steady pods only), then a tick, settled.
fn true_snapshots(
    alloc: &mut Allocator,
    nodes: &mut [ChurnNode],
    now: Timestamp,
) -> Result<(), Box<dyn std::error::Error>> {
    for n in nodes.iter_mut() {
        alloc.snapshot(
            &n.name,
            n.conn,
            n.seq,
            n.steady.clone(),
            AllocationId::NONE,
            now,
        )?;
        n.seq += 1;
    }
    alloc.tick(now);
    settle(alloc, now);
    Ok(())
}

/// Job pod `j` with labels of its own: allocated and upserted on its node.
fn churn_pod(
    alloc: &mut Allocator,
    nodes: &mut [ChurnNode],
    j: usize,
    now: Timestamp,
) -> Result<(), Box<dyn std::error::Error>> {
    let n = &mut nodes[j % CHURN_NODES];
    let l = labels(&format!(
        "app=backup,job-name=backup-{j},controller-uid=6f1e2c3d-{j:08x}"
    ))?;
    let id = match alloc.allocate(
        j as u64,
        &n.name,
        n.session,
        AllocationId::NONE,
        l.clone(),
        now,
    )? {
        Some(id) => id,
        None => {
            settle(alloc, now);
            alloc
                .lookup(&l)
                .map(|i| i.id)
                .ok_or("no identity after settling")?
        }
    };
    let ep = endpoint(j % CHURN_NODES, 1000 + j, id, l)?;
    alloc.upsert(&n.name, n.conn, n.seq, ep, now)?;
    n.seq += 1;
    Ok(())
}

fn bench_churn() -> BenchResult {
    const CHURN: usize = 100_000;
    let mut cfg = config();
    cfg.quarantine = Duration::from_secs(120);
    let mut now = Timestamp::from_millis(1_000_000);
    let mut alloc = Allocator::new(cfg.clone(), Loaded::default(), now);
    now = now.plus(Duration::from_secs(100));
    alloc.tick(now);
    let mut nodes = churn_nodes(&mut alloc, now)?;
    settle(&mut alloc, now);
    // Let the start-up protection pass, so the baseline is a steady state.
    let until = now.plus(cfg.node_ttl + Duration::from_secs(1));
    while now < until {
        true_snapshots(&mut alloc, &mut nodes, now)?;
        now = now.plus(Duration::from_secs(10));
    }
    let baseline = heap();
    let stats0 = alloc.stats();

    // Job pods with unique labels: allocate, upsert; every delete event is lost.
    // Snapshots every 30 s of simulated time (one job pod started every 3 ms).
    let started = Instant::now();
    let mut peak = baseline;
    for j in 0..CHURN {
        churn_pod(&mut alloc, &mut nodes, j, now)?;
        now = now.plus(Duration::from_millis(3));
        if j % 10_000 == 0 {
            // The true snapshot: the job pod is gone; its delete event never arrived.
            true_snapshots(&mut alloc, &mut nodes, now)?;
            peak = peak.max(heap());
        }
    }
    let churn_time = started.elapsed();
    let at_end = heap();
    let stats_peak = alloc.stats();
    // True snapshots, then the hold timeout, grace period and quarantine pass.
    let until = now.plus(cfg.hold_timeout + cfg.grace + cfg.quarantine + Duration::from_secs(5));
    while now < until {
        true_snapshots(&mut alloc, &mut nodes, now)?;
        now = now.plus(Duration::from_secs(1));
    }
    let after = heap();
    let stats = alloc.stats();
    let retained = (after - baseline) as f64 / CHURN as f64;
    println!(
        "churn, {CHURN} unique label sets, every delete lost ({:.1?} to run):",
        churn_time
    );
    println!(
        "    live heap: baseline {} B, peak {} B, end of churn {} B, after snapshots+grace+quarantine {} B",
        baseline,
        peak.max(at_end),
        at_end,
        after
    );
    println!("    retained: {retained:+.2} bytes per churned label set (target < 64)");
    println!(
        "    identities: baseline live {}, at end of churn live {} released {} quarantined {}, after: live {} released {} deleting {} quarantined {}",
        stats0.live,
        stats_peak.live,
        stats_peak.released,
        stats_peak.quarantined,
        stats.live,
        stats.released,
        stats.deleting,
        stats.quarantined
    );
    let beyond =
        (stats.live + stats.released + stats.deleting + stats.creating) as i64 - stats0.live as i64;
    println!("    identities left beyond the live set: {beyond}");
    if beyond != 0 || retained >= 64.0 {
        return Err(format!("churn gate failed: {beyond} identities beyond the live set, {retained:.2} B retained per label set").into());
    }
    Ok(())
}

fn bench_edit_storm() -> BenchResult {
    const PODS: usize = 110;
    const IDENTITIES: usize = 10_000;
    const EDITED: usize = 200;
    for nodes in [1_000, 5_000] {
        let now = Timestamp::from_millis(1_000_000);
        let sets: Vec<LabelSet> = (0..IDENTITIES).map(pod_labels).collect::<Result<_, _>>()?;
        let mut alloc = Allocator::new(config(), Loaded::default(), now);
        let now = now.plus(Duration::from_secs(100));
        alloc.tick(now);
        for i in 0..nodes {
            let name = node(i)?;
            let (_, conn) = connect(&mut alloc, &name, now)?;
            let eps: Vec<Endpoint> = (0..PODS)
                .map(|p| {
                    let l = (i * PODS + p) % IDENTITIES;
                    endpoint(
                        i,
                        p,
                        IdentityId::new(256 + l as u32).unwrap_or(IdentityId::WORLD),
                        sets[l].clone(),
                    )
                })
                .collect::<Result<_, _>>()?;
            alloc.snapshot(&name, conn, 1, eps, AllocationId::NONE, now)?;
            settle(&mut alloc, now);
        }
        let started = Instant::now();
        for l in 0..EDITED {
            let id = IdentityId::new(256 + l as u32).unwrap_or(IdentityId::WORLD);
            alloc.binding_invalid(id, "labels edited".to_owned(), now);
        }
        let moves = started.elapsed();
        settle(&mut alloc, now);
        println!(
            "edit storm, {} nodes x {} endpoints: {} identities moved in {:.2?} ({:.0} µs per move, under the core's lock)",
            nodes,
            PODS,
            EDITED,
            moves,
            moves.as_secs_f64() * 1e6 / EDITED as f64
        );
        black_box(alloc);
    }
    Ok(())
}
