//! Layout 4 against the real kernel: remote endpoints (REMOTE, with their node) in
//! ENDPOINTS and counted once, NODES, ENDPOINTS sized for the cluster and not
//! preallocated, a full ENDPOINTS refusing new entries without harm, and the
//! migration of layout 3's pins with their entries and counters.

use std::{collections::BTreeMap, net::IpAddr, num::NonZeroU16, path::Path, process::Command};

use aya::maps::{Array, HashMap, Map, MapData};
use census_agent::bpf::{
    DatapathOptions, Direction, Endpoint, EndpointKey, Error, Inspector, LAYOUT_VERSION,
    NodeRecord, TestContext, identity,
};
use census_netlab::{Lab, packet};
use serde_json::Value;

use super::support::*;

const POD_A: u32 = 1000;
const POD_B: u32 = 1001;
const NODE_A: NonZeroU16 = NonZeroU16::new(1).unwrap();
const NODE_B: NonZeroU16 = NonZeroU16::new(2).unwrap();
const COUNT: usize = 30;
const PAYLOAD: usize = 64;

fn census_json(args: &[&str]) -> Fallible<Value> {
    let mut command = Command::new(env!("CARGO_BIN_EXE_census"));
    for (name, _) in std::env::vars() {
        if name.starts_with("CENSUS_") {
            command.env_remove(name);
        }
    }
    let output = command.args(args).output()?;
    if !output.status.success() {
        return Err(format!(
            "census {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        )
        .into());
    }
    Ok(serde_json::from_slice(&output.stdout)?)
}

/// Two nodes' datapaths on one kernel, each with its own pins and attached to its
/// own pod only: A's pod sends to B's pod. A counts the packets as they leave its
/// pod (B's pod is a remote endpoint there); B's egress hook sees them arrive from
/// a pod that is REMOTE on B and skips them. The sum is exactly the packets sent,
/// with both identities. A source flagged REMOTE as a node address (`remote-node`)
/// is still counted on delivery: no hook counts it where it was sent yet.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_remote_pod_is_counted_where_it_sent_not_where_it_arrives() -> TestResult {
    let (pins_a, pins_b) = (PinDir::new(), PinDir::new());
    let mut lab = Lab::new()?;
    let a = lab.add_pod()?;
    let b = lab.add_pod()?;
    let mut node_a = open_attached(&pins_a, &lab, &[&a])?;
    let mut node_b = open_attached(&pins_b, &lab, &[&b])?;
    register(&mut node_a, &a, POD_A)?;
    node_a.upsert_endpoint(b.ipv4.into(), Endpoint::remote(POD_B, NODE_B))?;
    node_a.write_node(NODE_B, "node-b", &[b.gateway_v4.into()])?;
    register(&mut node_b, &b, POD_B)?;
    node_b.upsert_endpoint(a.ipv4.into(), Endpoint::remote(POD_A, NODE_A))?;
    node_b.write_node(NODE_A, "node-a", &[a.gateway_v4.into()])?;

    assert_eq!(
        send(&a.ns, a.ipv4.into(), &b, false, COUNT, PAYLOAD)?,
        COUNT
    );
    let bytes = COUNT as u64 * frame_len(PAYLOAD, false);
    assert_eq!(
        flow(&node_a, POD_A, POD_B)?,
        (COUNT as u64, bytes),
        "counted on the sender's ingress"
    );
    assert_eq!(
        endpoint_flows(&node_b)?,
        [],
        "not counted again where it arrives (nor as world)"
    );

    // The same source as another node's address: not counted on delivery
    // either (the node that sent it counts it, at its own sockets).
    node_b.upsert_endpoint(
        a.ipv4.into(),
        Endpoint::remote(identity::REMOTE_NODE, NODE_A),
    )?;
    assert_eq!(
        send(&a.ns, a.ipv4.into(), &b, false, COUNT, PAYLOAD)?,
        COUNT
    );
    assert_eq!(flow(&node_b, identity::REMOTE_NODE, POD_B)?, (0, 0));

    // And with the program alone: from a remote pod, through no interface census
    // counts on, into B's pod; then as an unattached local endpoint, counted.
    const ELSEWHERE: u32 = 4242;
    let src: IpAddr = "198.18.9.9".parse()?;
    let frame = packet::udp_frame(src, b.ipv4.into(), 10).ok_or("frame")?;
    node_b.upsert_endpoint(src, Endpoint::remote(POD_A, NODE_A))?;
    let from = TestContext {
        ingress_ifindex: ELSEWHERE,
        ..TestContext::default()
    };
    node_b.test_run(Direction::Egress, &frame, from, 5)?;
    assert_eq!(
        flow(&node_b, POD_A, POD_B)?,
        (0, 0),
        "{:?}",
        node_b.flows()?
    );
    node_b.upsert_endpoint(src, Endpoint::unattached(POD_A))?;
    node_b.test_run(Direction::Egress, &frame, from, 5)?;
    assert_eq!(flow(&node_b, POD_A, POD_B)?.0, 5);
    Ok(())
}

/// ENDPOINTS is sized for the cluster and allocated as it fills, NODES too; the
/// sizes are the agent's to choose.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn endpoints_and_nodes_are_not_preallocated() -> TestResult {
    let pins = PinDir::new();
    let mut datapath = open_datapath(pins.path())?;
    let show = |name: &str| -> Fallible<Value> {
        bpftool(
            None,
            &["map", "show", "pinned", path_str(&pins.join(name))?],
        )
    };
    for (name, key, value, entries) in [("ENDPOINTS", 20, 8, 524_288), ("NODES", 4, 580, 65_535)] {
        let map = show(name)?;
        assert_eq!(map["type"], "hash", "{map}");
        assert_eq!(map["name"], name, "{map}");
        assert_eq!(map["flags"], 1, "BPF_F_NO_PREALLOC: {map}");
        assert_eq!(
            (&map["bytes_key"], &map["bytes_value"], &map["max_entries"]),
            (
                &Value::from(key),
                &Value::from(value),
                &Value::from(entries)
            ),
            "{map}"
        );
    }
    // The kernel accounts an entry when it is written: memory grows with the
    // entries, from (nearly) nothing. Before 6.4 the kernel reports a map's
    // memory as its size times its entry size, whatever it holds: there only the
    // flag above says the map is not preallocated.
    let memlock = |name: &str| -> Fallible<u64> {
        show(name)?["bytes_memlock"]
            .as_u64()
            .ok_or_else(|| "no bytes_memlock".into())
    };
    let empty = memlock("ENDPOINTS")?;
    for i in 0..4096u32 {
        let ip: IpAddr = [10, 1, (i >> 8) as u8, i as u8].into();
        datapath.upsert_endpoint(ip, Endpoint::local(POD_A))?;
    }
    let filled = memlock("ENDPOINTS")?;
    if kernel_at_least(6, 4)? {
        assert!(
            filled >= empty + 4096 * (20 + 8),
            "{empty} B empty, {filled} B with 4096 entries"
        );
        // Preallocated, 524,288 entries of at least 28 bytes would be 14 MiB, empty.
        assert!(empty < 524_288 * 28, "{empty} B empty");
    }
    drop(datapath);

    let other = PinDir::new();
    let datapath = open_with(
        other.path(),
        DatapathOptions {
            endpoints_max_entries: Some(600_000),
            nodes_max_entries: Some(5000),
            ..DatapathOptions::default()
        },
    )?;
    assert_eq!(datapath.endpoints_max_entries(), 600_000);
    let nodes = bpftool(
        None,
        &["map", "show", "pinned", path_str(&other.join("NODES"))?],
    )?;
    assert_eq!(nodes["max_entries"], 5000, "{nodes}");
    Ok(())
}

/// A full ENDPOINTS refuses a new address with an error naming the map and the
/// flag to raise; entries already there can still be replaced and removed, and
/// after a removal the new address fits.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_full_endpoints_refuses_new_addresses_and_nothing_else() -> TestResult {
    let pins = PinDir::new();
    let mut datapath = open_with(
        pins.path(),
        DatapathOptions {
            endpoints_max_entries: Some(4),
            ..DatapathOptions::default()
        },
    )?;
    let ip = |i: u8| -> IpAddr { [198, 18, 5, i].into() };
    for i in 0..4 {
        datapath.upsert_endpoint(ip(i), Endpoint::local(POD_A))?;
    }
    let refused = datapath.upsert_endpoint(ip(4), Endpoint::remote(POD_B, NODE_B));
    match &refused {
        Err(error @ Error::MapFull { max_entries: 4, .. }) => {
            let message = error.to_string();
            for needle in ["ENDPOINTS is full", "198.18.5.4", "--endpoints-max-entries"] {
                assert!(message.contains(needle), "{needle:?} in {message}");
            }
        }
        other => return Err(format!("expected a full map, got {other:?}").into()),
    }
    assert_eq!(datapath.endpoint(ip(4))?, None, "nothing written");
    assert_eq!(datapath.endpoints()?.len(), 4);
    datapath.upsert_endpoint(ip(0), Endpoint::local(POD_B))?;
    assert_eq!(datapath.endpoint(ip(0))?, Some(Endpoint::local(POD_B)));
    assert!(datapath.delete_endpoint(ip(1))?);
    datapath.upsert_endpoint(ip(4), Endpoint::remote(POD_B, NODE_B))?;
    assert_eq!(
        datapath.endpoint(ip(4))?,
        Some(Endpoint::remote(POD_B, NODE_B))
    );
    Ok(())
}

/// NODES holds names and addresses by index; what does not fit is refused.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn nodes_are_written_read_and_deleted() -> TestResult {
    let pins = PinDir::new();
    let mut datapath = open_datapath(pins.path())?;
    let addresses: Vec<IpAddr> = vec!["198.19.0.1".parse()?, "2001:db8::1".parse()?];
    datapath.write_node(NODE_A, "node-a", &addresses)?;
    datapath.write_node(NODE_B, "node-b", &[])?;
    datapath.write_node(NODE_B, "node-b2", &addresses[..1])?; // replaces
    let record = |name: &str, addresses: &[IpAddr]| NodeRecord {
        name: name.to_owned(),
        addresses: addresses.to_vec(),
    };
    assert_eq!(
        datapath.nodes()?,
        BTreeMap::from([
            (1, record("node-a", &addresses)),
            (2, record("node-b2", &addresses[..1])),
        ])
    );
    // bpftool reads the name where the layout says: after the two u16 lengths.
    let dump = bpftool(
        None,
        &["map", "dump", "pinned", path_str(&pins.join("NODES"))?],
    )?;
    let entry = dump
        .as_array()
        .and_then(|entries| {
            entries
                .iter()
                .find(|e| u32_at(&e["key"], 0).ok() == Some(1))
        })
        .ok_or_else(|| format!("no node 1 in {dump}"))?;
    let value = bytes(&entry["value"])?;
    assert_eq!(value.len(), 580);
    assert_eq!(&value[..4], &[6, 0, 2, 0], "name length 6, 2 addresses");
    assert_eq!(&value[4..10], b"node-a");
    assert_eq!(&value[260..264], &4u32.to_le_bytes(), "an IPv4 key first");
    assert_eq!(&value[264..268], &[198, 19, 0, 1]);

    let long = "n".repeat(254);
    assert!(matches!(
        datapath.write_node(NODE_A, &long, &[]),
        Err(Error::InvalidNode { index: 1, .. })
    ));
    assert_eq!(datapath.node(NODE_A)?, Some(record("node-a", &addresses)));
    assert!(datapath.delete_node(NODE_A)?);
    assert!(!datapath.delete_node(NODE_A)?);
    assert_eq!(datapath.nodes()?.len(), 1);
    Ok(())
}

/// `census bpf endpoints` shows remote entries with their node's name from NODES,
/// filters local and remote, and `census bpf nodes` lists NODES, agent down.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn the_cli_names_the_node_of_remote_entries() -> TestResult {
    let pins = PinDir::new();
    let bpffs = path_str(pins.path())?.to_owned();
    let mut datapath = open_datapath(pins.path())?;
    let local: IpAddr = "198.18.6.2".parse()?;
    let remote: IpAddr = "2001:db8:6::3".parse()?;
    let unnamed: IpAddr = "198.19.6.4".parse()?;
    datapath.upsert_endpoint(local, Endpoint::local(POD_A))?;
    datapath.upsert_endpoint(remote, Endpoint::remote(POD_B, NODE_B))?;
    datapath.upsert_endpoint(
        unnamed,
        Endpoint::remote(identity::REMOTE_NODE, NonZeroU16::new(77).ok_or("0")?),
    )?;
    datapath.write_node(NODE_B, "node-b", &["198.19.0.2".parse()?])?;
    drop(datapath);

    let list = |filter: &[&str]| -> Fallible<Vec<(String, Value, Value, Value)>> {
        let mut args = vec!["bpf", "endpoints", "list", "-o", "json", "--bpffs", &bpffs];
        args.extend_from_slice(filter);
        let listed = census_json(&args)?;
        Ok(listed
            .as_array()
            .ok_or("not an array")?
            .iter()
            .map(|e| {
                (
                    e["address"].as_str().unwrap_or_default().to_owned(),
                    e["flags"].clone(),
                    e["node"].clone(),
                    e["node_name"].clone(),
                )
            })
            .collect())
    };
    let local_row = (
        local.to_string(),
        Value::from(vec!["local"]),
        Value::Null,
        Value::Null,
    );
    let unnamed_row = (
        unnamed.to_string(),
        Value::from(vec!["remote"]),
        Value::from(77),
        Value::Null,
    );
    let remote_row = (
        remote.to_string(),
        Value::from(vec!["remote"]),
        Value::from(2),
        Value::from("node-b"),
    );
    assert_eq!(
        list(&[])?,
        [local_row.clone(), unnamed_row.clone(), remote_row.clone()]
    );
    assert_eq!(list(&["--local"])?, [local_row]);
    assert_eq!(list(&["--remote"])?, [unnamed_row, remote_row]);

    let nodes = census_json(&["bpf", "nodes", "list", "-o", "json", "--bpffs", &bpffs])?;
    assert_eq!(
        nodes,
        serde_json::json!([{ "index": 2, "name": "node-b", "addresses": ["198.19.0.2"] }])
    );
    Ok(())
}

/// ENDPOINTS of layouts 2 and 3: `identity: u32, flags: u32`.
type OldEndpoints = HashMap<MapData, EndpointKey, [u32; 2]>;

/// What an agent of layout 3 left in `pins`: this layout's maps with the shapes
/// layout 3 gave them (FLOWS, INTERFACES and STATS are unchanged), ENDPOINTS made
/// with layout 3's definition (a preallocated hash of 65,536 entries, `u32` flags)
/// holding `entries`, no NODES, the layout map saying 3. FLOWS holds counters.
fn layout_3_pins(pins: &PinDir, entries: &[(IpAddr, u32, u32)]) -> Fallible<Vec<(u32, u32, u64)>> {
    let mut datapath = open_datapath(pins.path())?;
    let a: IpAddr = "198.18.1.2".parse()?;
    datapath.upsert_endpoint(a, Endpoint::local(POD_A))?;
    for d in 0..3u8 {
        let dst: IpAddr = [198, 18, 2, d].into();
        datapath.upsert_endpoint(dst, Endpoint::unattached(5000 + u32::from(d)))?;
        let frame = packet::udp_frame(a, dst, 10).ok_or("frame")?;
        datapath.test_run(
            Direction::Ingress,
            &frame,
            TestContext::default(),
            u32::from(d) + 1,
        )?;
    }
    let flows = datapath
        .flows()?
        .into_iter()
        .map(|f| (f.src_identity, f.dst_identity, f.packets))
        .collect();
    drop(datapath);

    std::fs::remove_file(pins.join("ENDPOINTS"))?;
    std::fs::remove_file(pins.join("NODES"))?;
    create_old_endpoints(&pins.join("ENDPOINTS"), entries)?;
    set_layout(pins, 3)?;
    Ok(flows)
}

/// Pins layout 3's ENDPOINTS at `path`, made by bpftool, holding `entries`.
fn create_old_endpoints(path: &Path, entries: &[(IpAddr, u32, u32)]) -> TestResult {
    let status = Command::new("bpftool")
        .args(["map", "create", path_str(path)?, "type", "hash"])
        .args([
            "key",
            "20",
            "value",
            "8",
            "entries",
            "65536",
            "name",
            "ENDPOINTS",
        ])
        .status()?;
    if !status.success() {
        return Err(format!("bpftool map create {}: {status}", path.display()).into());
    }
    let mut map = OldEndpoints::try_from(Map::HashMap(MapData::from_pin(path)?))?;
    for &(ip, identity, flags) in entries {
        map.insert(EndpointKey::from(ip), [identity, flags], 0)?;
    }
    Ok(())
}

/// Pins layout 4's ENDPOINTS at `path`, made by bpftool (not by census), holding
/// `entries` (identity, flags; no node).
fn create_new_endpoints(path: &Path, entries: &[(IpAddr, u32, u32)]) -> TestResult {
    let status = Command::new("bpftool")
        .args(["map", "create", path_str(path)?, "type", "hash"])
        .args([
            "key",
            "20",
            "value",
            "8",
            "entries",
            "524288",
            "name",
            "ENDPOINTS",
        ])
        .args(["flags", "1"])
        .status()?;
    if !status.success() {
        return Err(format!("bpftool map create {}: {status}", path.display()).into());
    }
    let mut map = OldEndpoints::try_from(Map::HashMap(MapData::from_pin(path)?))?;
    for &(ip, identity, flags) in entries {
        // identity: u32, flags: u16, node: u16 (0), as the bytes of two words.
        map.insert(EndpointKey::from(ip), [identity, flags], 0)?;
    }
    Ok(())
}

fn set_layout(pins: &PinDir, version: u32) -> TestResult {
    let mut meta: Array<MapData, u32> =
        Array::try_from(Map::Array(MapData::from_pin(pins.join("CENSUS_META"))?))?;
    meta.set(0, version, 0)?;
    Ok(())
}

fn layout_of(pins: &PinDir) -> Fallible<u32> {
    let meta: Array<MapData, u32> =
        Array::try_from(Map::Array(MapData::from_pin(pins.join("CENSUS_META"))?))?;
    Ok(meta.get(&0, 0)?)
}

fn old_entries() -> Fallible<Vec<(IpAddr, u32, u32)>> {
    Ok(vec![
        ("198.18.1.2".parse()?, POD_A, 1),          // LOCAL
        ("198.18.1.1".parse()?, identity::HOST, 4), // HOST
        ("2001:db8:1::7".parse()?, POD_B, 0),       // unattached
        ("198.18.2.0".parse()?, 5000, 0),
    ])
}

fn expected_entries() -> Fallible<BTreeMap<Option<IpAddr>, Endpoint>> {
    Ok(BTreeMap::from([
        (Some("198.18.1.2".parse()?), Endpoint::local(POD_A)),
        (Some("198.18.1.1".parse()?), Endpoint::host()),
        (Some("2001:db8:1::7".parse()?), Endpoint::unattached(POD_B)),
        (Some("198.18.2.0".parse()?), Endpoint::unattached(5000)),
    ]))
}

fn entries_of(
    datapath: &census_agent::bpf::Datapath,
) -> Fallible<BTreeMap<Option<IpAddr>, Endpoint>> {
    Ok(datapath
        .endpoints()?
        .into_iter()
        .map(|(key, endpoint)| (key.ip(), endpoint))
        .collect())
}

fn flows_of(datapath: &census_agent::bpf::Datapath) -> Fallible<Vec<(u32, u32, u64)>> {
    Ok(datapath
        .flows()?
        .into_iter()
        .map(|f| (f.src_identity, f.dst_identity, f.packets))
        .collect())
}

/// An agent of layout 4 takes layout 3's pins over: ENDPOINTS copied into a map of
/// this layout (every entry, its identity and flags, no node), FLOWS and STATS kept
/// with their counters, NODES created, the layout stamped 4, nothing left aside.
/// The CLI reads layout 3's pins before, and layout 4's after.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn layout_3_pins_are_migrated_with_entries_and_counters() -> TestResult {
    let pins = PinDir::new();
    let flows = layout_3_pins(&pins, &old_entries()?)?;
    assert_eq!(flows.len(), 3, "{flows:?}");
    let stats_before = Inspector::open(pins.path())?.stats()?;

    let old = Inspector::open(pins.path())?;
    assert_eq!(old.layout_version(), 3);
    assert_eq!(old.endpoints()?.len(), 4);
    assert_eq!(old.nodes()?.len(), 0, "layout 3 has no NODES");
    let converted = old
        .endpoint("198.18.1.1".parse()?)?
        .ok_or("no host entry")?;
    assert_eq!(
        (converted.identity, converted.flags, converted.node),
        (1, 4, 0)
    );
    drop(old);

    let mut datapath = open_datapath(pins.path())?;
    assert_eq!(entries_of(&datapath)?, expected_entries()?);
    assert_eq!(flows_of(&datapath)?, flows, "counters kept");
    assert_eq!(Some(datapath.stats()?), stats_before, "STATS kept");
    assert_eq!(layout_of(&pins)?, LAYOUT_VERSION);
    let endpoints = bpftool(
        None,
        &["map", "show", "pinned", path_str(&pins.join("ENDPOINTS"))?],
    )?;
    assert_eq!(endpoints["flags"], 1, "{endpoints}");
    assert_eq!(endpoints["max_entries"], 524_288, "{endpoints}");
    assert!(pins.join("NODES").exists());
    assert!(
        !pins.join("ENDPOINTS-layout3").exists(),
        "nothing left aside"
    );
    // Remote entries and nodes can be written now.
    datapath.write_node(NODE_B, "node-b", &[])?;
    datapath.upsert_endpoint("198.19.0.5".parse()?, Endpoint::remote(POD_B, NODE_B))?;
    drop(datapath);

    // Opened again: layout 4's maps, nothing copied again.
    let datapath = open_datapath(pins.path())?;
    assert_eq!(datapath.endpoints()?.len(), 5);
    assert_eq!(flows_of(&datapath)?, flows);
    Ok(())
}

/// An agent killed during the migration: the next one finishes or redoes it.
/// Killed after the copy began (the old ENDPOINTS set aside, a partial new one
/// pinned, the layout still 3): the partial copy is dropped and the copy redone.
/// Killed after the layout was stamped (the copy complete, the old map still
/// aside): the old map is removed and the new one kept as it is.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_migration_killed_midway_is_finished_at_the_next_start() -> TestResult {
    // Killed during the copy.
    let pins = PinDir::new();
    let flows = layout_3_pins(&pins, &old_entries()?)?;
    std::fs::rename(pins.join("ENDPOINTS"), pins.join("ENDPOINTS-layout3"))?;
    // What the killed agent had created and started to fill: one entry copied,
    // and one the old map does not have (it must not survive).
    create_new_endpoints(
        &pins.join("ENDPOINTS"),
        &[
            ("198.18.1.2".parse()?, POD_A, 1),
            ("198.18.3.3".parse()?, 4242, 1),
        ],
    )?;
    assert_eq!(layout_of(&pins)?, 3);
    // The CLI reads the complete old map meanwhile.
    let during = Inspector::open(pins.path())?;
    assert_eq!(during.endpoints()?.len(), 4);
    drop(during);
    let datapath = open_datapath(pins.path())?;
    assert_eq!(
        entries_of(&datapath)?,
        expected_entries()?,
        "copied again, whole"
    );
    assert_eq!(flows_of(&datapath)?, flows);
    assert_eq!(layout_of(&pins)?, LAYOUT_VERSION);
    assert!(!pins.join("ENDPOINTS-layout3").exists());
    drop(datapath);

    // Killed after stamping: the old map, with an entry the new one no longer
    // has (deleted since), must not come back.
    let stamped = PinDir::new();
    let mut datapath = open_datapath(stamped.path())?;
    datapath.upsert_endpoint("198.18.1.2".parse()?, Endpoint::local(POD_A))?;
    drop(datapath);
    assert_eq!(layout_of(&stamped)?, LAYOUT_VERSION);
    create_old_endpoints(
        &stamped.join("ENDPOINTS-layout3"),
        &[
            ("198.18.1.2".parse()?, POD_A, 1),
            ("198.18.3.3".parse()?, 4242, 1),
        ],
    )?;
    let datapath = open_datapath(stamped.path())?;
    assert_eq!(
        entries_of(&datapath)?,
        BTreeMap::from([(Some("198.18.1.2".parse()?), Endpoint::local(POD_A))])
    );
    assert!(!stamped.join("ENDPOINTS-layout3").exists(), "removed");
    Ok(())
}
