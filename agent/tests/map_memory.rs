//! What the agent's userspace holds per remote entry of the cluster-wide endpoint
//! map (target: under 64 bytes), measured, not estimated: the core and reconcile
//! take a full map of N entries on this thread (a datapath that keeps nothing
//! stands in for the kernel's maps), and a counting allocator keeps, per thread,
//! the bytes allocated and not freed.
//!
//! `cargo test -p census-agent --test map_memory -- --ignored --nocapture`

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use census_agent::bench::RemoteMap;
use census_testkit::alloc::{PerThreadCounting, thread_net_bytes};

#[global_allocator]
static GLOBAL: PerThreadCounting = PerThreadCounting;

/// 5,000 nodes of 110 pods each, the largest cluster.
const NODES: u32 = 5_000;
const PODS: u32 = 110;

/// Bytes held per remote entry after a full map of `NODES * PODS` entries (and
/// every node's address) of `family`.
fn per_entry(v6: bool) -> (f64, u64) {
    let ip = |node: u32, pod: u32| -> IpAddr {
        if v6 {
            IpAddr::V6(Ipv6Addr::new(
                0x2001,
                0xdb8,
                0,
                (node >> 16) as u16,
                node as u16,
                0,
                0,
                pod as u16,
            ))
        } else {
            let n = (node << 8) | pod;
            IpAddr::V4(Ipv4Addr::from(0x0a00_0000 | n))
        }
    };
    let entries = (1..=NODES).flat_map(|node| {
        (1..=PODS)
            .map(move |pod| (ip(node, pod), 300 + pod, node))
            .chain(std::iter::once((ip(node, 0), 6, node)))
    });
    let before = thread_net_bytes();
    let mut map = RemoteMap::new();
    map.resync(NODES, entries);
    let held = thread_net_bytes() - before;
    let (remote, written) = map.entries();
    assert_eq!(remote, u64::from(NODES * (PODS + 1)));
    assert_eq!(written, remote, "every remote entry is written");
    let per = held as f64 / remote as f64;
    drop(map);
    (per, remote)
}

#[test]
#[ignore = "a measurement (about a million entries): run it with --ignored --nocapture"]
#[expect(
    clippy::print_stdout,
    reason = "the figure is the measurement's output"
)]
fn userspace_memory_per_remote_entry_is_under_64_bytes() {
    let (v4, n) = per_entry(false);
    let (v6, _) = per_entry(true);
    println!("agent userspace per remote entry, {n} entries: IPv4 {v4:.1} B, IPv6 {v6:.1} B");
    assert!(v4 < 64.0, "IPv4: {v4:.1} B per remote entry");
    assert!(v6 < 64.0, "IPv6: {v6:.1} B per remote entry");
}
