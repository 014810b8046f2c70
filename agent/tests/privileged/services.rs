//! Layout 5 against the real kernel: SERVICES (the cluster's Service addresses)
//! written, read back and seen by bpftool as an LPM trie; layout 4's pins taken
//! over in place; the uplink program attached, adopted and refused where it does
//! not belong; a packet to a Service address not counted where it leaves its
//! endpoint.

use std::collections::BTreeMap;

use aya::maps::{Array, Map, MapData};
use census_agent::bpf::{
    AttachOutcome, DatapathOptions, Direction, Endpoint, EndpointKey, Error, Inspector, Interface,
    LAYOUT_VERSION, ServiceKind, TestContext,
};
use census_netlab::{Lab, packet};
use ipnet::IpNet;

use super::support::{
    Fallible, PinDir, TestResult, bpftool, capture, hex, open_attached, open_datapath, open_with,
    path_str, register,
};

const POD: u32 = 1000;

fn net(text: &str) -> Fallible<IpNet> {
    Ok(text.parse()?)
}

fn layout_of(pins: &PinDir) -> Fallible<u32> {
    let meta: Array<MapData, u32> =
        Array::try_from(Map::Array(MapData::from_pin(pins.join("CENSUS_META"))?))?;
    Ok(meta.get(&0, 0)?)
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn service_ranges_are_written_read_back_and_replaced() -> TestResult {
    let pins = PinDir::new();
    let mut datapath = open_datapath(pins.path())?;
    assert_eq!(datapath.services()?, BTreeMap::new());
    datapath.upsert_service(net("10.96.0.0/12")?, ServiceKind::ClusterIpRange)?;
    datapath.upsert_service(net("fd00:10:96::/108")?, ServiceKind::ClusterIpRange)?;
    datapath.upsert_service(net("203.0.113.7/32")?, ServiceKind::LoadBalancerIp)?;
    // Host bits are not part of a range: this replaces the first entry's kind.
    datapath.upsert_service(net("10.96.3.4/12")?, ServiceKind::ExternalIp)?;
    let expected = BTreeMap::from([
        (net("10.96.0.0/12")?, ServiceKind::ExternalIp),
        (net("fd00:10:96::/108")?, ServiceKind::ClusterIpRange),
        (net("203.0.113.7/32")?, ServiceKind::LoadBalancerIp),
    ]);
    assert_eq!(datapath.services()?, expected);

    // bpftool sees an LPM trie of three entries; the CLI's reader the same ranges.
    let shown = bpftool(
        None,
        &["map", "show", "pinned", path_str(&pins.join("SERVICES"))?],
    )?;
    assert_eq!(shown["type"], "lpm_trie", "{shown}");
    assert_eq!(shown["flags"], 1, "BPF_F_NO_PREALLOC: {shown}");
    let dumped = bpftool(
        None,
        &["map", "dump", "pinned", path_str(&pins.join("SERVICES"))?],
    )?;
    assert_eq!(dumped.as_array().map(Vec::len), Some(3), "{dumped}");

    assert!(datapath.delete_service(net("203.0.113.7/32")?)?);
    assert!(!datapath.delete_service(net("203.0.113.7/32")?)?);
    assert_eq!(datapath.services()?.len(), 2);
    drop(datapath);
    // The entries live in the pinned map, across agents.
    let datapath = open_datapath(pins.path())?;
    assert_eq!(datapath.services()?.len(), 2);
    Ok(())
}

/// The maps of this layout that layouts 6 and 7 did not have.
const SINCE_LAYOUT_8: [&str; 3] = ["SERVICE_FLOWS4", "SERVICE_FLOWS6", "CLIENTS_EPOCH"];

/// An agent of this layout takes layout 4's to 7's pins over in place: the same
/// ENDPOINTS map (not copied), its entries, FLOWS' counters, the maps the older
/// layout lacked (SERVICES, the Service counters, ...) created, layouts 6 and 7's
/// one SERVICE_FLOWS copied into the two of this layout, the layout stamped.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn layout_4_pins_are_taken_over_in_place() -> TestResult {
    older_pins_are_taken_over_in_place(
        4,
        &[&["SERVICES", "ADDRESS_FILTER"][..], &SINCE_LAYOUT_8].concat(),
    )
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn layout_5_pins_are_taken_over_in_place() -> TestResult {
    older_pins_are_taken_over_in_place(5, &[&["ADDRESS_FILTER"][..], &SINCE_LAYOUT_8].concat())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn layout_6_pins_are_taken_over_in_place() -> TestResult {
    older_pins_are_taken_over_in_place(6, &[&["ADDRESS_FILTER"][..], &SINCE_LAYOUT_8].concat())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn layout_7_pins_are_taken_over_in_place() -> TestResult {
    older_pins_are_taken_over_in_place(7, &SINCE_LAYOUT_8)
}

/// Each family's Service counters take their own size when created (an
/// IPv4-only cluster's IPv6 map can be one entry); the IPv6 one takes the IPv4
/// one's size unless given its own, and a pinned one keeps its size.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn each_family_s_service_counters_take_their_own_size() -> TestResult {
    let open = |pins: &PinDir, v4: Option<u32>, v6: Option<u32>| {
        open_with(
            pins.path(),
            DatapathOptions {
                service_flows_max_entries: v4,
                service_flows6_max_entries: v6,
                ..DatapathOptions::default()
            },
        )
    };
    let pins = PinDir::new();
    let datapath = open(&pins, Some(2048), Some(1))?;
    assert_eq!(datapath.service_flows_max_entries()?, (2048, 1));
    let shown = bpftool(
        None,
        &[
            "map",
            "show",
            "pinned",
            path_str(&pins.join("SERVICE_FLOWS6"))?,
        ],
    )?;
    assert_eq!(shown["max_entries"], 1, "{shown}");
    drop(datapath);
    // Pinned: kept, whatever is asked.
    let datapath = open(&pins, Some(4096), None)?;
    assert_eq!(datapath.service_flows_max_entries()?, (2048, 1));
    drop(datapath);
    let both = PinDir::new();
    let datapath = open(&both, Some(4096), None)?;
    assert_eq!(datapath.service_flows_max_entries()?, (4096, 4096));
    Ok(())
}

/// A map of another shape pinned under layouts 6 and 7's SERVICE_FLOWS name is
/// not census's: neither copied nor removed, and a warning says so at every start.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_foreign_map_under_the_old_service_flows_name_is_left_with_a_warning() -> TestResult {
    let pins = PinDir::new();
    drop(open_datapath(pins.path())?);
    let path = pins.join("SERVICE_FLOWS");
    bpftool(
        None,
        &[
            "map",
            "create",
            path_str(&path)?,
            "type",
            "hash",
            "key",
            "8",
            "value",
            "8",
            "entries",
            "16",
            "name",
            "SERVICE_FLOWS",
        ],
    )?;
    let (dispatch, captured) = capture();
    let datapath = tracing::dispatcher::with_default(&dispatch, || open_datapath(pins.path()))?;
    let text = captured
        .lock()
        .map(|lines| String::from_utf8_lossy(&lines).into_owned())
        .unwrap_or_default();
    let removed = !path.exists();
    // The pin directory's uninstall removes census's pins only.
    std::fs::remove_file(&path)?;
    assert!(!removed, "the foreign map's pin was removed");
    assert!(
        text.contains("is not layouts 6 and 7's Service counters")
            && text.contains("Hash map, key 8 B, value 8 B, 16 entries"),
        "no warning naming the map and its shape: {text}"
    );
    assert!(datapath.service_flows()?.is_empty(), "nothing was copied");
    Ok(())
}

/// Layouts 6 and 7's SERVICE_FLOWS, pinned in `pins` with bpftool: a
/// least-recently-used per-CPU hash of 28-byte keys holding an IPv4 and an IPv6
/// Service counter (3 packets and 300 bytes on every CPU).
fn pin_layout7_service_flows(pins: &PinDir) -> TestResult {
    let path = pins.join("SERVICE_FLOWS");
    let path = path_str(&path)?;
    bpftool(
        None,
        &[
            "map",
            "create",
            path,
            "type",
            "lru_percpu_hash",
            "key",
            "28",
            "value",
            "16",
            "entries",
            "16384",
            "name",
            "SERVICE_FLOWS",
        ],
    )?;
    let value = [&3u64.to_ne_bytes()[..], &300u64.to_ne_bytes()].concat();
    let v4 = std::net::Ipv4Addr::new(10, 96, 0, 10).octets();
    let v6 = "fd00:10:96::a".parse::<std::net::Ipv6Addr>()?.octets();
    let mut v4_key = [&POD.to_ne_bytes()[..], &80u16.to_ne_bytes(), &[6, 1]].concat();
    v4_key.extend(4u32.to_ne_bytes());
    v4_key.extend(v4);
    v4_key.extend([0; 12]);
    let mut v6_key = [&POD.to_ne_bytes()[..], &53u16.to_ne_bytes(), &[17, 2]].concat();
    v6_key.extend(6u32.to_ne_bytes());
    v6_key.extend(v6);
    for key in [v4_key, v6_key] {
        let mut args = vec!["map", "update", "pinned", path, "key", "hex"];
        let (key, value) = (hex(&key), hex(&value));
        args.extend(key.iter().map(String::as_str));
        args.extend(["value", "hex"]);
        args.extend(value.iter().map(String::as_str));
        let status = std::process::Command::new("bpftool").args(&args).status()?;
        assert!(status.success(), "bpftool map update");
    }
    Ok(())
}

/// What an agent of `layout` left, without the maps `missing` it lacked (and,
/// for layouts 6 and 7, with their SERVICE_FLOWS), is taken over in place.
fn older_pins_are_taken_over_in_place(layout: u32, missing: &[&str]) -> TestResult {
    let pins = PinDir::new();
    let mut datapath = open_datapath(pins.path())?;
    datapath.upsert_endpoint("198.18.1.2".parse()?, Endpoint::local(POD))?;
    let frame =
        packet::udp_frame("198.18.1.2".parse()?, "198.18.9.9".parse()?, 10).ok_or("frame")?;
    datapath.test_run(Direction::Ingress, &frame, TestContext::default(), 3)?;
    let flows = datapath.flows()?;
    assert_eq!(flows.len(), 1, "{flows:?}");
    drop(datapath);
    let endpoints_id = |pins: &PinDir| -> Fallible<serde_json::Value> {
        let shown = bpftool(
            None,
            &["map", "show", "pinned", path_str(&pins.join("ENDPOINTS"))?],
        )?;
        Ok(shown["id"].clone())
    };
    let id_before = endpoints_id(&pins)?;

    // What the older layout left: not the maps it lacked, meta saying it.
    for map in missing {
        std::fs::remove_file(pins.join(map))?;
    }
    let had_service_flows = layout >= 6;
    if had_service_flows {
        pin_layout7_service_flows(&pins)?;
    }
    let mut meta: Array<MapData, u32> =
        Array::try_from(Map::Array(MapData::from_pin(pins.join("CENSUS_META"))?))?;
    meta.set(0, layout, 0)?;
    drop(meta);
    let old = Inspector::open(pins.path())?;
    assert_eq!(old.layout_version(), layout);
    let old_service_flows = old.service_flows()?;
    if had_service_flows {
        assert_eq!(old_service_flows.len(), 2, "{old_service_flows:?}");
        for flow in &old_service_flows {
            assert!(flow.packets >= 3 && flow.packets % 3 == 0, "{flow:?}");
            assert_eq!(flow.bytes, flow.packets * 100, "{flow:?}");
        }
    } else {
        assert_eq!(
            old_service_flows,
            [],
            "no Service counters in layout {layout}"
        );
    }
    assert_eq!(old.endpoints()?.len(), 1);
    drop(old);

    let mut datapath = open_datapath(pins.path())?;
    assert_eq!(layout_of(&pins)?, LAYOUT_VERSION);
    assert_eq!(LAYOUT_VERSION, 8);
    assert!(
        !pins.join("SERVICE_FLOWS").exists(),
        "the old map's pin removed"
    );
    assert_eq!(
        datapath.service_flows()?,
        old_service_flows,
        "every Service counter copied"
    );
    assert_eq!(
        endpoints_id(&pins)?,
        id_before,
        "ENDPOINTS taken over, not copied"
    );
    assert_eq!(datapath.endpoints()?.len(), 1);
    assert_eq!(datapath.flows()?, flows, "counters kept");
    for map in missing {
        assert!(pins.join(map).exists(), "{map} created");
    }
    datapath.upsert_service(net("10.96.0.0/12")?, ServiceKind::ClusterIpRange)?;
    assert_eq!(datapath.services()?.len(), 1);
    let filter = datapath.address_filter()?;
    assert!(filter.is_on(), "on from the start, ENDPOINTS read once");
    assert!(filter.may_be_service(&key("10.100.0.1")?));
    Ok(())
}

fn key(text: &str) -> Fallible<EndpointKey> {
    Ok(EndpointKey::from(text.parse::<std::net::IpAddr>()?))
}

/// A copy of layout 7's SERVICE_FLOWS killed midway is redone whole at the next
/// start (the counters written as the old map holds them, not added twice); and
/// once this layout is stamped, an old map left beside it is only removed, never
/// copied over counters that went on since.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_service_flows_copy_killed_midway_is_redone_and_a_leftover_only_removed() -> TestResult {
    let pins = PinDir::new();
    drop(open_datapath(pins.path())?);
    pin_layout7_service_flows(&pins)?;
    let stamp = |layout: u32| -> TestResult {
        let mut meta: Array<MapData, u32> =
            Array::try_from(Map::Array(MapData::from_pin(pins.join("CENSUS_META"))?))?;
        meta.set(0, layout, 0)?;
        Ok(())
    };
    // Killed after copying, before stamping: the new maps hold the copy, the
    // layout still says 7, the old map is still pinned.
    stamp(7)?;
    let old = Inspector::open(pins.path())?.service_flows()?;
    let datapath = open_datapath(pins.path())?;
    assert_eq!(datapath.service_flows()?, old);
    drop(datapath);
    pin_layout7_service_flows(&pins)?;
    stamp(7)?;
    let datapath = open_datapath(pins.path())?;
    assert_eq!(
        datapath.service_flows()?,
        old,
        "copied again, not added twice"
    );
    assert!(!pins.join("SERVICE_FLOWS").exists());
    drop(datapath);

    // Stamped, the old pin left (killed before removing it), and the counters
    // moved on since: the leftover is removed, the counters stay.
    let fresh = PinDir::new();
    drop(open_datapath(fresh.path())?);
    pin_layout7_service_flows(&fresh)?;
    let datapath = open_datapath(fresh.path())?;
    assert_eq!(
        datapath.service_flows()?,
        [],
        "nothing copied into this layout's maps"
    );
    assert!(
        !fresh.join("SERVICE_FLOWS").exists(),
        "the leftover removed"
    );
    Ok(())
}

/// ADDRESS_FILTER holds every Service range and address SERVICES holds and
/// every HOST address ENDPOINTS holds, as the datapath writes, removes and
/// reads them, and over a restart; and says "surely not" of other addresses.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn the_address_filter_follows_services_and_the_node_addresses() -> TestResult {
    let pins = PinDir::new();
    let mut datapath = open_datapath(pins.path())?;
    assert!(datapath.address_filter()?.is_on(), "on from the start");

    datapath.upsert_service(net("10.96.0.0/12")?, ServiceKind::ClusterIpRange)?;
    datapath.upsert_service(net("fd00:10:96::/108")?, ServiceKind::ClusterIpRange)?;
    datapath.upsert_service(net("203.0.113.7/32")?, ServiceKind::LoadBalancerIp)?;
    datapath.upsert_endpoint("198.18.0.1".parse()?, Endpoint::host())?;
    datapath.upsert_endpoint("198.18.1.2".parse()?, Endpoint::local(POD))?;
    let filter = datapath.address_filter()?;
    for service in [
        "10.96.0.1",
        "10.111.255.254",
        "fd00:10:96::a",
        "203.0.113.7",
    ] {
        assert!(filter.may_be_service(&key(service)?), "{service}");
    }
    for other in ["10.95.255.255", "10.112.0.0", "fd00:10:97::a", "198.18.1.2"] {
        assert!(!filter.may_be_service(&key(other)?), "{other}");
    }
    assert!(filter.may_be_source(&key("198.18.0.1")?));
    assert!(!filter.may_be_source(&key("198.18.1.2")?));

    // Removed: gone from the filter too.
    datapath.delete_service(net("10.96.0.0/12")?)?;
    datapath.delete_endpoint("198.18.0.1".parse()?)?;
    let filter = datapath.address_filter()?;
    assert!(!filter.may_be_service(&key("10.96.0.1")?));
    assert!(filter.may_be_service(&key("fd00:10:96::a")?));
    assert!(!filter.may_be_source(&key("198.18.0.1")?));

    // A HOST entry rewritten as another kind leaves the node's addresses.
    datapath.upsert_endpoint("198.18.0.2".parse()?, Endpoint::host())?;
    assert!(
        datapath
            .address_filter()?
            .may_be_source(&key("198.18.0.2")?)
    );
    datapath.upsert_endpoint("198.18.0.2".parse()?, Endpoint::local(POD))?;
    assert!(
        !datapath
            .address_filter()?
            .may_be_source(&key("198.18.0.2")?)
    );

    // A restart keeps what the maps hold, before and after reading ENDPOINTS.
    datapath.upsert_endpoint("198.18.0.3".parse()?, Endpoint::host())?;
    drop(datapath);
    let datapath = open_datapath(pins.path())?;
    let filter = datapath.address_filter()?;
    assert!(filter.is_on());
    assert!(filter.may_be_source(&key("198.18.0.3")?));
    assert!(filter.may_be_service(&key("203.0.113.7")?));
    datapath.endpoints()?;
    let filter = datapath.address_filter()?;
    assert!(filter.may_be_source(&key("198.18.0.3")?));
    assert!(filter.may_be_service(&key("fd00:10:96::a")?));
    assert!(!filter.may_be_service(&key("10.96.0.1")?));
    Ok(())
}

/// A packet an endpoint sends to a Service address is not counted where it
/// leaves the endpoint (it is marked, and counted once translated); one to any
/// other address outside the cluster is, as `world`.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_packet_to_a_service_address_is_not_counted_where_it_leaves() -> TestResult {
    let pins = PinDir::new();
    let mut datapath = open_datapath(pins.path())?;
    datapath.upsert_endpoint("198.18.1.2".parse()?, Endpoint::local(POD))?;
    datapath.upsert_service(net("198.19.96.0/24")?, ServiceKind::ClusterIpRange)?;
    // The endpoint's interface, as the agent writes it once attached (loopback
    // stands for it: the program runs on an interface of this namespace).
    datapath.set_interface(Interface {
        ifindex: 1,
        identity: Some(POD),
    })?;
    let on_its_interface = TestContext {
        ifindex: 1,
        ingress_ifindex: 0,
    };
    let to_service =
        packet::udp_frame("198.18.1.2".parse()?, "198.19.96.1".parse()?, 10).ok_or("frame")?;
    let to_world =
        packet::udp_frame("198.18.1.2".parse()?, "198.19.97.1".parse()?, 10).ok_or("frame")?;
    datapath.test_run(Direction::Ingress, &to_service, on_its_interface, 5)?;
    assert_eq!(
        datapath.flows()?,
        Vec::new(),
        "a Service request is counted later"
    );
    assert_eq!(datapath.stats()?.service_marked, 5);
    datapath.test_run(Direction::Ingress, &to_world, on_its_interface, 2)?;
    let flows = datapath.flows()?;
    assert_eq!(flows.len(), 1, "{flows:?}");
    assert_eq!(
        (
            flows[0].src_identity,
            flows[0].dst_identity,
            flows[0].packets
        ),
        (POD, census_agent::bpf::identity::WORLD, 2)
    );
    Ok(())
}

/// The uplink program attaches to an Ethernet device that is no endpoint's,
/// is adopted when attached again, and is listed apart from the endpoints'
/// hooks; an endpoint's interface and a device without Ethernet are refused.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn the_uplink_program_goes_only_where_packets_leave_the_node() -> TestResult {
    let mut lab = Lab::new()?;
    let pod = lab.add_pod()?;
    let pins = PinDir::new();
    let mut datapath = open_attached(&pins, &lab, &[&pod])?;
    register(&mut datapath, &pod, POD)?;
    let ns = lab.node();
    // A veth stands for the node's NIC (this kernel may have no dummy device).
    ns.ip(&[
        "link", "add", "uplink0", "type", "veth", "peer", "name", "uplink0p",
    ])?;
    ns.ip(&["link", "set", "uplink0", "up"])?;

    let first = ns.run(|| datapath.attach_uplink("uplink0"))??;
    let again = ns.run(|| datapath.attach_uplink("uplink0"))??;
    assert_eq!(
        (first, again),
        (AttachOutcome::Attached, AttachOutcome::Adopted)
    );
    let uplinks = ns.run(|| datapath.uplinks())??;
    assert_eq!(uplinks.len(), 1, "{uplinks:?}");
    assert_eq!(uplinks[0].interface, "uplink0");
    assert_eq!(uplinks[0].direction, Direction::Uplink);

    let endpoint = ns.run(|| datapath.attach_uplink(&pod.host_interface))?;
    assert!(
        matches!(endpoint, Err(Error::EndpointInterfaceAsUplink { .. })),
        "{endpoint:?}"
    );
    // Loopback has no Ethernet header either, as a tun or WireGuard device has
    // none (and needs no module a test kernel may lack).
    let l3 = ns.run(|| datapath.attach_uplink("lo"))?;
    assert!(matches!(l3, Err(Error::UnsupportedUplink { .. })), "{l3:?}");
    // The endpoint's own hooks are untouched by all of this, and detaching the
    // endpoint leaves the uplink attached.
    assert!(ns.run(|| datapath.detach(&pod.host_interface))??);
    assert_eq!(ns.run(|| datapath.uplinks())??.len(), 1);
    assert!(ns.run(|| datapath.detach_uplink("uplink0"))??);
    assert_eq!(ns.run(|| datapath.uplinks())??.len(), 0);
    Ok(())
}

/// SERVICES holds `SERVICES_MAX_ENTRIES` ranges: one more is refused as
/// [`Error::ServicesFull`], naming the range and the capacity, and what the map
/// holds is left as it was.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_full_services_map_refuses_the_next_range_and_keeps_what_it_holds() -> TestResult {
    let pins = PinDir::new();
    let mut datapath = open_datapath(pins.path())?;
    let capacity = census_common::SERVICES_MAX_ENTRIES;
    // /32s from 198.18.0.0/15, which has room for twice the capacity.
    let base = u32::from(std::net::Ipv4Addr::new(198, 18, 0, 0));
    let range = |n: u32| IpNet::from(ipnet::Ipv4Net::from(std::net::Ipv4Addr::from(base + n)));
    let started = std::time::Instant::now();
    for n in 0..capacity {
        datapath.upsert_service(range(n), ServiceKind::ExternalIp)?;
    }
    let filled = started.elapsed();
    report(&format!(
        "{capacity} SERVICES entries written one syscall each in {filled:?}"
    ));
    let before = datapath.services()?;
    assert_eq!(before.len(), capacity as usize);

    let one_more = range(capacity);
    match datapath.upsert_service(one_more, ServiceKind::ClusterIpRange) {
        Err(error @ Error::ServicesFull { max_entries, .. }) => {
            assert_eq!(max_entries, capacity);
            let message = error.to_string();
            for needle in [
                "SERVICES is full",
                &format!("{capacity} entries"),
                &format!("Service range {one_more} was not written"),
            ] {
                assert!(message.contains(needle), "{needle:?} in {message}");
            }
        }
        other => return Err(format!("expected ServicesFull, got {other:?}").into()),
    }
    assert_eq!(datapath.services()?, before, "nothing stored changed");
    let dumped = bpftool(
        None,
        &["map", "dump", "pinned", path_str(&pins.join("SERVICES"))?],
    )?;
    assert_eq!(
        dumped.as_array().map(Vec::len),
        Some(capacity as usize),
        "bpftool sees the same count"
    );
    Ok(())
}

#[expect(clippy::print_stdout, reason = "the figure, for --nocapture")]
fn report(line: &str) {
    println!("services: {line}");
}
