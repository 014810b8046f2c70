//! census's datapath against the real kernel: programs, pinned maps, TCX links
//! and traffic between network namespaces.
//!
//! These tests need root; they run through `cargo xtask test-privileged`, one at
//! a time. Each uses its own pin directory (`/sys/fs/bpf/census-test-<pid>-<n>`)
//! and its own namespaces, all removed by guards even when the test fails.

mod attach;
mod cli;
mod count_once;
mod datapath_stats;
mod e2e;
mod endpoint_map;
mod kwok;
mod metrics_lint;
mod pin_lock;
mod pod_route;
mod services;
mod snat;
mod sockets;
mod support;
mod two_node;

use std::{
    io::Read as _,
    net::IpAddr,
    num::NonZeroU16,
    os::unix::fs::MetadataExt as _,
    process::{Command, Stdio},
    time::Duration,
};

use census_agent::bpf::{
    AttachOutcome, AttachmentState, Datapath, Direction, Endpoint, EndpointFlags, Error, Interface,
    LAYOUT_VERSION, TestContext, enable_run_time_stats, identity, interface_slot, uninstall,
};
use census_netlab::{Lab, packet};
use support::*;

const POD_A: u32 = 1000;
const NODE_3: NonZeroU16 = NonZeroU16::new(3).unwrap();
const POD_B: u32 = 1001;
const PAYLOAD: usize = 100;
const COUNT: usize = 50;

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn programs_load_and_maps_are_pinned() -> TestResult {
    let pins = PinDir::new();
    let datapath = Datapath::open(pins.path())?;
    assert_eq!(datapath.pin_dir(), pins.path());

    for (name, map_type, flags) in [
        ("CENSUS_META", "array", 0),
        ("ENDPOINTS", "hash", 1), // BPF_F_NO_PREALLOC
        ("FLOWS", "lru_percpu_hash", 0),
        ("INTERFACES", "array", 0x400), // BPF_F_MMAPABLE
        ("NODES", "hash", 1),
    ] {
        let path = pins.join(name);
        let map = bpftool(None, &["map", "show", "pinned", path_str(&path)?])?;
        assert_eq!(map["type"], map_type, "{name}: {map}");
        assert_eq!(map["name"], name, "{name}: {map}");
        assert_eq!(map["flags"], flags, "{name}: {map}");
    }
    let meta = bpftool(
        None,
        &[
            "map",
            "dump",
            "pinned",
            path_str(&pins.join("CENSUS_META"))?,
        ],
    )?;
    assert_eq!(
        u32_at(&meta[0]["value"], 0)?,
        LAYOUT_VERSION,
        "layout version: {meta}"
    );
    for program in [Direction::Ingress.program(), Direction::Egress.program()] {
        let loaded = program_ids_using(program, &pins.join("ENDPOINTS"))?;
        assert_eq!(loaded.len(), 1, "{program} is loaded once: {loaded:?}");
    }
    assert!(pins.join("links").is_dir());
    Ok(())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn endpoints_are_readable_by_bpftool() -> TestResult {
    let pins = PinDir::new();
    let mut datapath = Datapath::open(pins.path())?;
    let v4: IpAddr = "198.18.7.9".parse()?;
    let v6: IpAddr = "2001:2:0:7::9".parse()?;
    let node: IpAddr = "198.18.7.1".parse()?;
    datapath.upsert_endpoint(v4, Endpoint::local(4711))?;
    datapath.upsert_endpoint(v6, Endpoint::remote(4712, NODE_3))?;
    datapath.upsert_endpoint(node, Endpoint::host())?;
    datapath.upsert_endpoint(v4, Endpoint::local(4713))?; // replaces

    // Parsed from bpftool's bytes, independently of census_common's types.
    let dump = bpftool(
        None,
        &["map", "dump", "pinned", path_str(&pins.join("ENDPOINTS"))?],
    )?;
    let mut seen = Vec::new();
    for entry in dump.as_array().into_iter().flatten() {
        let key = bytes(&entry["key"])?;
        let value = bytes(&entry["value"])?;
        assert_eq!((key.len(), value.len()), (20, 8), "{entry}");
        let ip: IpAddr = match u32_at(&entry["key"], 0)? {
            4 => {
                assert_eq!(&key[8..], &[0; 12], "IPv4 keys are zero-padded: {entry}");
                <[u8; 4]>::try_from(&key[4..8])?.into()
            }
            6 => <[u8; 16]>::try_from(&key[4..20])?.into(),
            family => return Err(format!("family {family} in {entry}").into()),
        };
        // identity: u32, flags: u16, node: u16.
        let half = |at: usize| u16::from_le_bytes([value[at], value[at + 1]]);
        seen.push((ip, u32_at(&entry["value"], 0)?, half(4), half(6)));
    }
    seen.sort();
    let mut expected = vec![
        (v4, 4713, 1, 0),
        (v6, 4712, 2, 3),
        (node, identity::HOST, 4, 0),
    ];
    expected.sort();
    assert_eq!(seen, expected);

    assert_eq!(datapath.endpoint(v6)?, Some(Endpoint::remote(4712, NODE_3)));
    let listed: Vec<_> = datapath
        .endpoints()?
        .into_iter()
        .map(|(key, endpoint)| (key.ip(), endpoint))
        .collect();
    assert_eq!(listed.len(), 3);
    assert!(listed.contains(&(Some(node), Endpoint::host())));

    assert!(datapath.delete_endpoint(v4)?);
    assert!(
        !datapath.delete_endpoint(v4)?,
        "deleting twice finds nothing"
    );
    assert_eq!(datapath.endpoint(v4)?, None);
    let dump = bpftool(
        None,
        &["map", "dump", "pinned", path_str(&pins.join("ENDPOINTS"))?],
    )?;
    assert_eq!(dump.as_array().map(Vec::len), Some(2), "{dump}");

    let invalid = datapath.upsert_endpoint(
        v4,
        Endpoint {
            identity: 5,
            flags: EndpointFlags::HOST,
            node: 0,
        },
    );
    assert!(
        matches!(invalid, Err(Error::InvalidEndpoint { .. })),
        "{invalid:?}"
    );
    Ok(())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn same_node_traffic_is_counted_once() -> TestResult {
    let pins = PinDir::new();
    let mut lab = Lab::new()?;
    let a = lab.add_pod()?;
    let b = lab.add_pod()?;
    let mut datapath = open_attached(&pins, &lab, &[&a, &b])?;
    register(&mut datapath, &a, POD_A)?;
    register(&mut datapath, &b, POD_B)?;
    assert_one_census_program_per_hook(&pins, &lab, &[&a, &b])?;

    for v6 in [false, true] {
        let before = flow(&datapath, POD_A, POD_B)?;
        let received = send(&a.ns, a.ip(v6), &b, v6, COUNT, PAYLOAD)?;
        assert_eq!(received, COUNT, "every datagram arrived (v6: {v6})");
        let after = flow(&datapath, POD_A, POD_B)?;
        // Seen leaving A (counted) and entering B (skipped: A is local).
        assert_eq!(after.0 - before.0, COUNT as u64, "packets (v6: {v6})");
        assert_eq!(
            after.1 - before.1,
            COUNT as u64 * frame_len(PAYLOAD, v6),
            "bytes (v6: {v6})"
        );
    }
    assert_eq!(
        flow(&datapath, POD_B, POD_A)?,
        (0, 0),
        "B sent nothing to A"
    );
    Ok(())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn unknown_sources_count_as_world_and_node_addresses_as_host() -> TestResult {
    let pins = PinDir::new();
    let mut lab = Lab::new()?;
    let outside = lab.add_pod()?; // census is not attached here: "the world"
    let b = lab.add_pod()?;
    let mut datapath = open_attached(&pins, &lab, &[&b])?;
    register(&mut datapath, &b, POD_B)?;
    datapath.upsert_endpoint(b.gateway_v4.into(), Endpoint::host())?;

    let received = send(&outside.ns, outside.ipv4.into(), &b, false, COUNT, PAYLOAD)?;
    assert_eq!(received, COUNT);
    assert_eq!(
        flow(&datapath, identity::WORLD, POD_B)?,
        (COUNT as u64, COUNT as u64 * frame_len(PAYLOAD, false)),
        "counted once, entering B, as world"
    );

    // The node's own sockets are counted where they send (the root cgroup's
    // egress), not on delivery: without that hook, nothing counts them.
    let received = send(lab.node(), b.gateway_v4.into(), &b, false, COUNT, PAYLOAD)?;
    assert_eq!(received, COUNT);
    assert_eq!(flow(&datapath, identity::HOST, POD_B)?, (0, 0));
    datapath.attach_sockets(&census_agent::bpf::find_cgroup2_root()?)?;
    let received = send(lab.node(), b.gateway_v4.into(), &b, false, COUNT, PAYLOAD)?;
    assert_eq!(received, COUNT);
    assert_eq!(
        flow(&datapath, identity::HOST, POD_B)?,
        (COUNT as u64, COUNT as u64 * frame_len(PAYLOAD, false)),
        "the node's own address is the host identity, counted once"
    );
    Ok(())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn restart_reuses_maps_and_links_and_still_counts_once() -> TestResult {
    let pins = PinDir::new();
    let mut lab = Lab::new()?;
    let a = lab.add_pod()?;
    let b = lab.add_pod()?;
    let mut first = open_attached(&pins, &lab, &[&a, &b])?;
    register(&mut first, &a, POD_A)?;
    register(&mut first, &b, POD_B)?;
    assert_eq!(
        send(&a.ns, a.ipv4.into(), &b, false, COUNT, PAYLOAD)?,
        COUNT
    );
    let links_before = census_tcx_links()?;
    let old_programs = lab.node().run(|| first.attachments())??;
    drop(first); // the agent exits

    let mut second = open_datapath(pins.path())?;
    for pod in [&a, &b] {
        let attached = lab.node().run(|| second.attach(&pod.host_interface))??;
        assert_eq!(
            (attached.ingress, attached.egress),
            (AttachOutcome::Adopted, AttachOutcome::Adopted)
        );
    }
    assert_eq!(
        second.endpoint(a.ipv4.into())?,
        Some(Endpoint::local(POD_A)),
        "ENDPOINTS survived"
    );
    assert_eq!(
        flow(&second, POD_A, POD_B)?,
        (COUNT as u64, COUNT as u64 * frame_len(PAYLOAD, false)),
        "FLOWS survived"
    );

    // The same links, now running the new agent's programs; no second program.
    let links_after = census_tcx_links()?;
    let ids = |links: &[CensusLink]| links.iter().map(|l| l.link_id).collect::<Vec<_>>();
    assert_eq!(ids(&links_after), ids(&links_before));
    let new_programs = lab.node().run(|| second.attachments())??;
    for (old, new) in old_programs.iter().zip(&new_programs) {
        assert_eq!(old.link_id, new.link_id);
        assert_ne!(
            old.program_id, new.program_id,
            "the link runs the new program"
        );
    }
    assert_one_census_program_per_hook(&pins, &lab, &[&a, &b])?;

    assert_eq!(
        send(&a.ns, a.ipv4.into(), &b, false, COUNT, PAYLOAD)?,
        COUNT
    );
    assert_eq!(
        flow(&second, POD_A, POD_B)?,
        (
            2 * COUNT as u64,
            2 * COUNT as u64 * frame_len(PAYLOAD, false)
        ),
        "still counted exactly once"
    );
    Ok(())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn maps_of_another_layout_are_refused() -> TestResult {
    // A layout version census does not know.
    let pins = PinDir::new();
    drop(Datapath::open(pins.path())?);
    set_layout(&pins, 99)?;
    match Datapath::open(pins.path()) {
        Err(error @ Error::LayoutMismatch { found: 99, .. }) => {
            let message = error.to_string();
            assert!(message.contains("layout version 99"), "{message}");
        }
        other => return Err(format!("expected a layout mismatch, got {other:?}").into()),
    }

    // The previous layout (1: no INTERFACES), as an older agent left it.
    let old = PinDir::new();
    drop(Datapath::open(old.path())?);
    std::fs::remove_file(old.join("INTERFACES"))?;
    set_layout(&old, 1)?;
    match Datapath::open(old.path()) {
        Err(error @ Error::LayoutMismatch { found: 1, .. }) => {
            let message = error.to_string();
            for needle in [
                "have layout version 1",
                &format!("this agent reads layout {LAYOUT_VERSION}"),
                "census-agent uninstall",
            ] {
                assert!(message.contains(needle), "{needle:?} in {message}");
            }
        }
        other => return Err(format!("expected a layout mismatch, got {other:?}").into()),
    }
    assert!(
        !old.join("INTERFACES").exists(),
        "nothing was created beside the old maps"
    );

    // Maps pinned without a layout version.
    let bare = PinDir::new();
    std::fs::create_dir(bare.path())?;
    create_map(&bare.join("ENDPOINTS"), "hash", 8, 8)?;
    let result = Datapath::open(bare.path());
    assert!(
        matches!(result, Err(Error::UnversionedPins { .. })),
        "{result:?}"
    );

    // The right version, but a map of another shape.
    let odd = PinDir::new();
    drop(Datapath::open(odd.path())?);
    std::fs::remove_file(odd.join("ENDPOINTS"))?;
    create_map(&odd.join("ENDPOINTS"), "hash", 16, 8)?;
    let result = Datapath::open(odd.path());
    assert!(
        matches!(result, Err(Error::PinnedMapMismatch { .. })),
        "{result:?}"
    );
    Ok(())
}

/// Writes `version` into the layout version map pinned in `pins`, with bpftool.
fn set_layout(pins: &PinDir, version: u8) -> TestResult {
    let meta = pins.join("CENSUS_META");
    let version = version.to_string();
    bpftool(
        None,
        &[
            "map",
            "update",
            "pinned",
            path_str(&meta)?,
            "key",
            "0",
            "0",
            "0",
            "0",
            "value",
            &version,
            "0",
            "0",
            "0",
        ],
    )?;
    Ok(())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn interfaces_are_written_read_and_cleared_before_detaching() -> TestResult {
    let pins = PinDir::new();
    let mut lab = Lab::new()?;
    let a = lab.add_pod()?;
    let b = lab.add_pod()?;
    let mut datapath = open_datapath(pins.path())?;
    let mut ifindexes = Vec::new();
    for pod in [&a, &b] {
        let attached = lab.node().run(|| datapath.attach(&pod.host_interface))??;
        assert_eq!(attached.ifindex, host_ifindex(&lab, pod)?);
        ifindexes.push(attached.ifindex);
    }
    let [ia, ib] = [ifindexes[0], ifindexes[1]];
    let with = |ifindex, identity| Interface { ifindex, identity };
    datapath.set_interface(with(ia, Some(POD_A)))?;
    datapath.set_interface(with(ib, None))?;
    datapath.set_interface(with(ia, Some(POD_B)))?; // replaces

    // As bpftool reads the slots.
    assert_eq!(interface_entry_by_bpftool(pins.path(), ia)?, Some(POD_B));
    assert_eq!(
        interface_entry_by_bpftool(pins.path(), ib)?,
        Some(0),
        "no identity"
    );
    assert_eq!(datapath.interface(ia), Some(with(ia, Some(POD_B))));
    let listed: Vec<_> = datapath.interfaces().into_iter().collect();
    let mut expected = vec![
        (interface_slot(ia), with(ia, Some(POD_B))),
        (interface_slot(ib), with(ib, None)),
    ];
    expected.sort_by_key(|(slot, _)| *slot);
    assert_eq!(listed, expected);

    // Another interface whose index shares a slot gets no entry; nonsense neither.
    let twin = ia + census_common::INTERFACES_MAX_ENTRIES;
    assert_eq!(interface_slot(twin), interface_slot(ia));
    let taken = datapath.set_interface(with(twin, Some(POD_A)));
    assert!(
        matches!(taken, Err(Error::InterfaceSlotTaken { holder, .. }) if holder == ia),
        "{taken:?}"
    );
    assert!(!datapath.delete_interface(twin)?, "not its entry to delete");
    assert_eq!(datapath.interface(ia), Some(with(ia, Some(POD_B))));
    for bad in [with(0, Some(POD_A)), with(ia, Some(identity::INVALID))] {
        let result = datapath.set_interface(bad);
        assert!(
            matches!(result, Err(Error::InvalidInterface { .. })),
            "{result:?}"
        );
    }

    // Detaching takes the entry with it.
    assert!(lab.node().run(|| datapath.detach(&a.host_interface))??);
    assert_eq!(interface_entry_by_bpftool(pins.path(), ia)?, None);
    assert_eq!(datapath.interface(ib), Some(with(ib, None)));
    assert!(datapath.delete_interface(ib)?);
    assert!(
        !datapath.delete_interface(ib)?,
        "deleting twice finds nothing"
    );
    assert!(datapath.interfaces().is_empty());
    Ok(())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_spoofed_source_is_counted_as_the_interface_it_left() -> TestResult {
    const POD_C: u32 = 1002;
    let pins = PinDir::new();
    let mut lab = Lab::new()?;
    let a = lab.add_pod()?;
    let b = lab.add_pod()?;
    let c = lab.add_pod()?;
    let mut datapath = open_attached(&pins, &lab, &[&a, &b, &c])?;
    for (pod, id) in [(&a, POD_A), (&b, POD_B), (&c, POD_C)] {
        register(&mut datapath, pod, id)?;
        datapath.set_interface(Interface {
            ifindex: host_ifindex(&lab, pod)?,
            identity: Some(id),
        })?;
    }
    // A sends with B's addresses.
    spoof_addresses_of(&lab, &a, &b)?;
    let counters = |datapath: &Datapath| -> Fallible<Vec<(u64, u64)>> {
        [POD_A, POD_B, identity::WORLD]
            .into_iter()
            .map(|src| flow(datapath, src, POD_C))
            .collect()
    };

    for v6 in [false, true] {
        // Neighbour discovery first: the node's solicitations entering C count
        // as C's too (they are for C), and must not land among the datagrams.
        assert_eq!(send(&a.ns, b.ip(v6), &c, v6, 1, PAYLOAD)?, 1);
        let before = counters(&datapath)?;
        assert_eq!(send(&a.ns, b.ip(v6), &c, v6, COUNT, PAYLOAD)?, COUNT);
        let after = counters(&datapath)?;
        let bytes = COUNT as u64 * frame_len(PAYLOAD, v6);
        assert_eq!(
            after[0],
            (before[0].0 + COUNT as u64, before[0].1 + bytes),
            "counted once, as A, the interface it left (v6: {v6})"
        );
        assert_eq!(after[1..], before[1..], "not as B, nor as world (v6: {v6})");
    }

    // Without A's entry: by address (as B, the address claims), still once.
    datapath.delete_interface(host_ifindex(&lab, &a)?)?;
    let before = counters(&datapath)?;
    assert_eq!(
        send(&a.ns, b.ipv4.into(), &c, false, COUNT, PAYLOAD)?,
        COUNT
    );
    let after = counters(&datapath)?;
    assert_eq!(after[0], before[0]);
    assert_eq!(after[1].0 - before[1].0, COUNT as u64, "by address, once");
    assert_eq!(after[2], before[2]);
    Ok(())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn an_endpoint_without_an_identity_is_counted_once_as_world() -> TestResult {
    let pins = PinDir::new();
    let mut lab = Lab::new()?;
    let waiting = lab.add_pod()?;
    let b = lab.add_pod()?;
    let mut datapath = open_attached(&pins, &lab, &[&waiting, &b])?;
    register(&mut datapath, &b, POD_B)?;
    // The classifier is on its interface, but it has no identity (no ENDPOINTS
    // entry): its entry says so.
    datapath.set_interface(Interface {
        ifindex: host_ifindex(&lab, &waiting)?,
        identity: None,
    })?;
    datapath.set_interface(Interface {
        ifindex: host_ifindex(&lab, &b)?,
        identity: Some(POD_B),
    })?;
    for v6 in [false, true] {
        // Neighbour discovery first (see the spoofing test).
        assert_eq!(send(&waiting.ns, waiting.ip(v6), &b, v6, 1, PAYLOAD)?, 1);
        let before = flow(&datapath, identity::WORLD, POD_B)?;
        assert_eq!(
            send(&waiting.ns, waiting.ip(v6), &b, v6, COUNT, PAYLOAD)?,
            COUNT
        );
        let after = flow(&datapath, identity::WORLD, POD_B)?;
        assert_eq!(
            after.0 - before.0,
            COUNT as u64,
            "counted leaving it, not again entering B (v6: {v6})"
        );
    }
    Ok(())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn uninstall_leaves_no_pin_and_no_program() -> TestResult {
    let pins = PinDir::new();
    let mut lab = Lab::new()?;
    let a = lab.add_pod()?;
    let datapath = open_attached(&pins, &lab, &[&a])?;
    let attached = lab.node().run(|| datapath.attachments())??;
    assert_eq!(attached.len(), 2);
    drop(datapath);

    // In the agent's network namespace: TC filters are found there by ifindex.
    let removed = lab.node().run(|| uninstall(pins.path()))??;
    assert_eq!(removed.links.len(), 2);
    assert_eq!(removed.pins.len(), 11, "the eleven maps: {removed:?}");
    assert!(!pins.path().exists());
    assert_eq!(uninstall(pins.path())?, Default::default(), "idempotent");

    for hook in hook_programs(&lab, &a.host_interface)? {
        assert!(hook.1.is_empty(), "nothing attached on {hook:?}");
    }
    let our_links: Vec<u32> = attached.iter().map(|a| a.link_id).collect();
    let our_programs: Vec<u32> = attached.iter().map(|a| a.program_id).collect();
    let gone = eventually(Duration::from_secs(5), || {
        let links = census_tcx_links()?;
        let loaded = [Direction::Ingress.program(), Direction::Egress.program()]
            .into_iter()
            .map(program_ids)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(!links.iter().any(|l| our_links.contains(&l.link_id))
            && !loaded.iter().flatten().any(|id| our_programs.contains(id)))
    })?;
    assert!(gone, "the links and programs were freed");
    Ok(())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn detach_and_prune_defunct_links() -> TestResult {
    let pins = PinDir::new();
    let mut lab = Lab::new()?;
    let a = lab.add_pod()?;
    let b = lab.add_pod()?;
    let c = lab.add_pod()?;
    let mut datapath = open_attached(&pins, &lab, &[&a, &b, &c])?;

    // In the interface's namespace, as the agent runs: TC filters are found there.
    assert!(lab.node().run(|| datapath.detach(&a.host_interface))??);
    assert!(
        !lab.node().run(|| datapath.detach(&a.host_interface))??,
        "detaching twice finds nothing"
    );
    for (hook, programs) in hook_programs(&lab, &a.host_interface)? {
        assert!(programs.is_empty(), "{hook}: {programs:?}");
    }

    // The pod goes away: its veth, and the host side with it.
    let gone = c.host_interface.clone();
    drop(c);
    let defunct = eventually(Duration::from_secs(5), || {
        let attachments = lab.node().run(|| datapath.attachments())??;
        Ok(attachments
            .iter()
            .filter(|at| at.interface == gone)
            .all(|at| at.state == AttachmentState::Defunct))
    })?;
    assert!(defunct, "the links of a deleted interface are defunct");
    let pruned = lab.node().run(|| datapath.prune_defunct())??;
    assert_eq!(pruned.len(), 2);
    assert!(pruned.iter().all(|at| at.interface == gone));

    let left = lab.node().run(|| datapath.attachments())??;
    assert_eq!(left.len(), 2);
    assert!(left.iter().all(|at| at.interface == b.host_interface
        && matches!(at.state, AttachmentState::Attached { .. })));
    assert_one_census_program_per_hook(&pins, &lab, &[&b])?;
    Ok(())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn programs_always_pass_packets_on() -> TestResult {
    const TC_ACT_UNSPEC: i32 = -1;
    let pins = PinDir::new();
    let mut datapath = Datapath::open(pins.path())?;
    let src: IpAddr = "198.18.1.2".parse()?;
    let dst: IpAddr = "198.18.2.2".parse()?;
    datapath.upsert_endpoint(src, Endpoint::local(POD_A))?;
    datapath.upsert_endpoint(dst, Endpoint::local(POD_B))?;
    let udp = packet::udp_frame(src, dst, PAYLOAD).ok_or("no frame")?;
    let arp = packet::arp_frame();

    for direction in Direction::BOTH {
        for frame in [&udp, &arp] {
            let run = datapath.test_run(direction, frame, TestContext::default(), 10)?;
            assert_eq!(run.return_value, TC_ACT_UNSPEC, "{direction}");
        }
    }
    // Ingress counted the 10 UDP runs; egress skipped them (local source); ARP
    // is not IP.
    assert_eq!(
        flow(&datapath, POD_A, POD_B)?,
        (10, 10 * frame_len(PAYLOAD, false))
    );
    assert_eq!(datapath.flows()?.len(), 1);

    // On an interface with an entry (the loopback, where test runs are), the
    // entry's identity is the local side whatever the address says; egress skips
    // packets that arrived through an interface with an entry.
    const LOOPBACK: u32 = 1;
    const ELSEWHERE: u32 = 4242;
    datapath.set_interface(Interface {
        ifindex: LOOPBACK,
        identity: Some(POD_B),
    })?;
    let from = |ingress_ifindex| TestContext {
        ingress_ifindex,
        ..TestContext::default()
    };
    datapath.test_run(Direction::Ingress, &udp, from(0), 10)?;
    assert_eq!(
        flow(&datapath, POD_B, POD_B)?.0,
        10,
        "leaving B's interface: B"
    );
    datapath.test_run(Direction::Egress, &udp, from(LOOPBACK), 10)?;
    assert_eq!(
        datapath.flows()?.len(),
        2,
        "arrived through B's interface: skipped"
    );
    datapath.upsert_endpoint(src, Endpoint::unattached(POD_A))?;
    datapath.test_run(Direction::Egress, &udp, from(ELSEWHERE), 10)?;
    assert_eq!(
        flow(&datapath, POD_A, POD_B)?.0,
        20,
        "from elsewhere, entering B's interface: B"
    );
    Ok(())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn run_time_statistics_count_runs() -> TestResult {
    let pins = PinDir::new();
    let mut datapath = Datapath::open(pins.path())?;
    let frame = packet::arp_frame();
    let stats_enabled = enable_run_time_stats()?;
    let before = datapath.program_stats(Direction::Egress)?;
    datapath.test_run(Direction::Egress, &frame, TestContext::default(), 25)?;
    let after = datapath.program_stats(Direction::Egress)?;
    drop(stats_enabled);
    assert_eq!(after.run_count - before.run_count, 25);
    assert!(
        after
            .mean_since(&before)
            .is_some_and(|mean| !mean.is_zero())
    );
    assert_eq!(after.mean_since(&after), None, "no runs, no mean");
    Ok(())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn processes_spawned_in_a_namespace_see_the_pins() -> TestResult {
    let pins = PinDir::new();
    let _datapath = Datapath::open(pins.path())?;
    let mut lab = Lab::new()?;
    let pod = lab.add_pod()?;

    let mut child = pod.ns.spawn(
        Command::new("readlink")
            .arg("/proc/self/ns/net")
            .stdout(Stdio::piped()),
    )?;
    let mut namespace = String::new();
    child
        .child()
        .stdout
        .take()
        .ok_or("no stdout")?
        .read_to_string(&mut namespace)?;
    assert!(child.child().wait()?.success());
    let inode = std::fs::metadata(pod.ns.path())?.ino();
    assert_eq!(namespace.trim(), format!("net:[{inode}]"));

    // Unlike `ip netns exec`, /sys (and the BPF file system) stays as it is.
    let endpoints = pins.join("ENDPOINTS");
    let map = bpftool(
        Some(&pod.ns),
        &["map", "show", "pinned", path_str(&endpoints)?],
    )?;
    assert_eq!(map["name"], "ENDPOINTS");
    Ok(())
}
