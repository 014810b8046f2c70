//! The programs' own counters (STATS), FLOWS when full, bytes under GSO against the
//! kernel's own per-segment accounting, the datapath log, and taking over layout
//! 2's maps.

use std::{
    io::{Read as _, Write as _},
    net::{IpAddr, SocketAddr, TcpListener, TcpStream},
    path::Path,
    sync::Mutex,
    time::Duration,
};

use aya::maps::{Array, Map, MapData};
use census_agent::bpf::{
    DatapathLog, DatapathOptions, DatapathStats, Direction, Endpoint, Inspector, Interface,
    LAYOUT_VERSION, TestContext,
};
use census_netlab::{Lab, Netns, packet};
use serde_json::Value;

use super::support::*;

const POD_A: u32 = 1000;
const POD_B: u32 = 1001;
const LOOPBACK: u32 = 1;
/// The node the remote destinations are on.
const NODE: std::num::NonZeroU16 = std::num::NonZeroU16::new(2).unwrap();

/// A full FLOWS evicts without telling the program: every new pair is counted as
/// inserted, and the pairs inserted less the pairs present are the evictions the
/// agent reports (`census bpf maps`, the metrics).
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_full_flows_counts_inserts_and_evictions() -> TestResult {
    const CAPACITY: u32 = 1_024;
    const SOURCES: u32 = 40;
    const DESTINATIONS: u32 = 40;
    let pins = PinDir::new();
    let mut datapath = open_with(
        pins.path(),
        DatapathOptions {
            flows_max_entries: Some(CAPACITY),
            ..DatapathOptions::default()
        },
    )?;
    let src: IpAddr = "198.18.1.2".parse()?;
    let mut frames = Vec::new();
    for d in 0..DESTINATIONS {
        let dst: IpAddr = [198, 18, 2, u8::try_from(d)?].into();
        datapath.upsert_endpoint(dst, Endpoint::remote(5000 + d, NODE))?;
        frames.push(packet::udp_frame(src, dst, 10).ok_or("frame")?);
    }
    // Each pair once: 1,600 pairs into a map of 1,024.
    for s in 0..SOURCES {
        datapath.set_interface(Interface {
            ifindex: LOOPBACK,
            identity: Some(3000 + s),
        })?;
        for frame in &frames {
            datapath.test_run(Direction::Ingress, frame, TestContext::default(), 1)?;
        }
    }
    let sent = u64::from(SOURCES * DESTINATIONS);
    let present = datapath.flows()?.len() as u64;
    let stats = datapath.stats()?;
    assert!(
        present <= u64::from(CAPACITY),
        "{present} pairs in {CAPACITY}"
    );
    assert_eq!(stats.flow_inserts, sent, "{stats:?}");
    assert_eq!(stats.flow_insert_failures, 0, "{stats:?}");
    assert_eq!(stats.flow_evictions(present), sent - present);
    assert!(sent - present >= sent - u64::from(CAPACITY), "{stats:?}");

    // The CLI reads the same, read-only.
    let maps = census_json(pins.path(), &["bpf", "maps", "-o", "json"])?;
    let flows = find_map(&maps, "FLOWS")?;
    assert_eq!(flows["max_entries"], CAPACITY, "{flows}");
    assert_eq!(flows["entries"], present, "{flows}");
    assert_eq!(flows["counters"]["inserts"], sent, "{flows}");
    assert_eq!(flows["counters"]["evictions"], sent - present, "{flows}");
    assert_eq!(flows["counters"]["insert_failures"], 0, "{flows}");
    let stats_map = find_map(&maps, "STATS")?;
    assert_eq!(stats_map["type"], "percpu_array", "{stats_map}");
    assert_eq!(stats_map["counters"]["flow_inserts"], sent, "{stats_map}");
    Ok(())
}

/// Packets that reach the program by address although their endpoint is LOCAL
/// (their interface has no INTERFACES entry) are counted in STATS whatever the log
/// level. (Frames too short for their addresses are counted too, but
/// `BPF_PROG_TEST_RUN` refuses IP frames shorter than an IP header, and every
/// address lies within it.)
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn interface_misses_are_counted() -> TestResult {
    let pins = PinDir::new();
    let mut datapath = open_datapath(pins.path())?;
    let a: IpAddr = "198.18.1.2".parse()?;
    let b: IpAddr = "198.18.2.2".parse()?;
    datapath.upsert_endpoint(a, Endpoint::local(POD_A))?;
    datapath.upsert_endpoint(b, Endpoint::local(POD_B))?;
    let udp = packet::udp_frame(a, b, 10).ok_or("frame")?;
    // No INTERFACES entry for the loopback, and the source is LOCAL: by address.
    datapath.test_run(Direction::Ingress, &udp, TestContext::default(), 5)?;
    assert_eq!(
        datapath.stats()?,
        DatapathStats {
            interface_misses: 5,
            flow_inserts: 1,
            ..DatapathStats::default()
        }
    );
    assert_eq!(flow(&datapath, POD_A, POD_B)?.0, 5, "counted by address");
    // With the entry, the local side is the interface's: no miss.
    datapath.set_interface(Interface {
        ifindex: LOOPBACK,
        identity: Some(POD_A),
    })?;
    datapath.test_run(Direction::Ingress, &udp, TestContext::default(), 5)?;
    assert_eq!(datapath.stats()?.interface_misses, 5);
    Ok(())
}

fn datapath_lines(lines: &Mutex<Vec<u8>>) -> Vec<String> {
    let text = lines
        .lock()
        .map(|lines| String::from_utf8_lossy(&lines).into_owned())
        .unwrap_or_default();
    text.lines()
        .filter(|line| line.contains("census_datapath:"))
        .map(str::to_owned)
        .collect()
}

/// With `--datapath-log debug` the programs' events reach `tracing` (target
/// `census_datapath`, their own level), rate-limited in the kernel: every event is
/// either sent or counted as suppressed. With the log off (the default) the
/// programs send nothing at all, though they still count the events.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn the_datapath_log_is_off_by_default_and_forwards_rate_limited_events() -> TestResult {
    let a: IpAddr = "198.18.1.2".parse()?;
    let b: IpAddr = "198.18.2.2".parse()?;
    let udp = packet::udp_frame(a, b, 10).ok_or("frame")?;
    const EVENTS: u32 = 1_000;

    // Off: the events happen, nothing is sent.
    let pins = PinDir::new();
    let mut datapath = open_datapath(pins.path())?;
    datapath.upsert_endpoint(a, Endpoint::local(POD_A))?;
    datapath.test_run(Direction::Ingress, &udp, TestContext::default(), EVENTS)?;
    assert_eq!(datapath.stats()?.interface_misses, u64::from(EVENTS));
    assert_eq!(
        datapath.stats()?.log_suppressed,
        0,
        "nothing to suppress: off"
    );
    drop(datapath);
    drop(pins);

    // Debug: the first event goes out, the others within 100 ms are suppressed.
    let pins = PinDir::new();
    let (dispatch, captured) = capture();
    // The forwarder sends to the subscriber of whoever opened the datapath.
    let mut datapath = tracing::dispatcher::with_default(&dispatch, || {
        open_with(
            pins.path(),
            DatapathOptions {
                datapath_log: DatapathLog::Debug,
                ..DatapathOptions::default()
            },
        )
    })?;
    datapath.upsert_endpoint(a, Endpoint::local(POD_A))?;
    datapath.test_run(Direction::Ingress, &udp, TestContext::default(), EVENTS)?;
    let stats = datapath.stats()?;
    assert_eq!(stats.interface_misses, u64::from(EVENTS));
    let sent = u64::from(EVENTS) - stats.log_suppressed;
    assert!(sent >= 1, "{stats:?}");
    let forwarded = eventually(Duration::from_secs(10), || {
        Ok(datapath_lines(&captured).len() as u64 >= sent)
    })?;
    let lines = datapath_lines(&captured);
    assert!(
        forwarded,
        "{sent} events sent, {} forwarded: {lines:?}",
        lines.len()
    );
    assert_eq!(lines.len() as u64, sent, "{lines:?}");
    assert!(
        lines[0].contains(
            "DEBUG census_datapath: interface 1 has no INTERFACES entry, but its \
             endpoint (identity 1000) is flagged LOCAL: counted by address"
        ),
        "{lines:?}"
    );
    Ok(())
}

/// Bytes under GSO are per-segment link-layer bytes, as the kernel's own qdisc
/// accounting counts them (`qdisc_pkt_len_init`: `skb->len` plus the headers every
/// further segment repeats), and packets are segments: real TCP from pod A to pod
/// B, counted on A's host-side interface, equals what a qdisc on A's own interface
/// counted for B's address.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn tcp_under_gso_counts_per_segment_bytes_like_the_kernel() -> TestResult {
    for v6 in [false, true] {
        let mut lab = Lab::new()?;
        let pod_a = lab.add_pod()?;
        let pod_b = lab.add_pod()?;
        let pins = PinDir::new();
        let mut datapath = open_attached(&pins, &lab, &[&pod_a, &pod_b])?;
        register(&mut datapath, &pod_a, POD_A)?;
        register(&mut datapath, &pod_b, POD_B)?;
        for (pod, identity) in [(&pod_a, POD_A), (&pod_b, POD_B)] {
            datapath.set_interface(Interface {
                ifindex: host_ifindex(&lab, pod)?,
                identity: Some(identity),
            })?;
        }
        // Only what pod A sends to pod B lands in class 1:1 of A's eth0.
        count_to(&pod_a.ns, pod_b.ip(v6), v6)?;
        // Neighbours resolved before counting starts.
        send(&pod_a.ns, pod_a.ip(v6), &pod_b, v6, 2, 10)?;
        let (before_packets, before_bytes) = qdisc_counted(&pod_a.ns)?;
        let before = flow(&datapath, POD_A, POD_B)?;

        let version = if v6 { 6 } else { 4 };
        let segments_seen = transfer(&pod_a.ns, &pod_b.ns, pod_b.ip(v6), 8 << 20)?;
        assert!(
            segments_seen,
            "IPv{version}: the transfer used GSO (more segments than skbs)"
        );

        // The host side counts a moment after the qdisc (the veth hands packets
        // over through a backlog): compare once both have seen the last one.
        let mut last = None;
        let agreed = eventually(Duration::from_secs(10), || {
            let (after_packets, after_bytes) = qdisc_counted(&pod_a.ns)?;
            let after = flow(&datapath, POD_A, POD_B)?;
            let census = (after.0 - before.0, after.1 - before.1);
            let kernel = (after_packets - before_packets, after_bytes - before_bytes);
            last = Some((census, kernel));
            Ok(census == kernel)
        })?;
        assert!(
            agreed,
            "IPv{version}: census vs the qdisc's (packets, bytes): {last:?}"
        );
    }
    Ok(())
}

/// A classful qdisc on pod A's eth0 whose class 1:1 gets what A sends to `to` alone:
/// its counters are the kernel's per-segment accounting (`bstats_update`:
/// `qdisc_pkt_len`, GSO segments).
fn count_to(ns: &Netns, to: IpAddr, v6: bool) -> TestResult {
    let tc = |args: &[&str]| -> TestResult {
        let output = ns.output("tc", args)?;
        if !output.status.success() {
            return Err(format!("tc {args:?}: {}", String::from_utf8_lossy(&output.stderr)).into());
        }
        Ok(())
    };
    // HTB (built into this kernel, unlike prio): class 1:1 for `to`, 1:99 for the
    // rest, both far faster than the veth.
    tc(&[
        "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "99",
    ])?;
    for class in ["1:1", "1:99"] {
        tc(&[
            "class", "add", "dev", "eth0", "parent", "1:", "classid", class, "htb", "rate",
            "10gbit", "burst", "1m", "cburst", "1m",
        ])?;
    }
    let (protocol, matcher, prefix) = if v6 {
        ("ipv6", "ip6", format!("{to}/128"))
    } else {
        ("ip", "ip", format!("{to}/32"))
    };
    tc(&[
        "filter", "add", "dev", "eth0", "parent", "1:", "protocol", protocol, "prio", "1", "u32",
        "match", matcher, "dst", &prefix, "flowid", "1:1",
    ])?;
    Ok(())
}

/// Packets and bytes class 1:1 of pod A's qdisc counted (`tc -s class show`: HTB
/// classes have no JSON form).
fn qdisc_counted(ns: &Netns) -> Fallible<(u64, u64)> {
    let output = ns.output("tc", &["-s", "class", "show", "dev", "eth0"])?;
    let text = String::from_utf8_lossy(&output.stdout);
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        if !line.starts_with("class htb 1:1 ") {
            continue;
        }
        // " Sent 1234 bytes 5 pkt (dropped 0, ...)"
        let sent: Vec<&str> = lines
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .collect();
        if let ["Sent", bytes, "bytes", packets, "pkt", ..] = sent[..] {
            return Ok((packets.parse()?, bytes.parse()?));
        }
        return Err(format!("unexpected class statistics: {text}").into());
    }
    Err(format!("no class 1:1: {text}").into())
}

/// Sends `len` bytes over TCP from `from` to `to` (a listener in `to_ns`); true
/// when the sender's interface emitted fewer skbs than segments (GSO in use), as
/// its counters (skbs) and the qdisc (segments) tell apart.
fn transfer(from: &Netns, to_ns: &Netns, to: IpAddr, len: usize) -> Fallible<bool> {
    let skbs_before = tx_packets(from)?;
    let (segments_before, _) = qdisc_counted(from)?;
    let listener = to_ns.run(|| TcpListener::bind(SocketAddr::new(to, 0)))??;
    let addr = listener.local_addr()?;
    let receiver = std::thread::spawn(move || -> std::io::Result<usize> {
        let (mut stream, _) = listener.accept()?;
        let mut received = Vec::new();
        stream.read_to_end(&mut received)?;
        Ok(received.len())
    });
    let mut stream = from.run(|| TcpStream::connect(addr))??;
    let chunk = vec![7u8; 1 << 16];
    let mut left = len;
    while left > 0 {
        let n = left.min(chunk.len());
        stream.write_all(&chunk[..n])?;
        left -= n;
    }
    stream.shutdown(std::net::Shutdown::Write)?;
    let received = receiver.join().map_err(|_| "receiver panicked")??;
    assert_eq!(received, len);
    // The receiver closed: read its FIN, so the connection is done on both sides.
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest)?;
    drop(stream);
    let skbs = tx_packets(from)? - skbs_before;
    let (segments, _) = qdisc_counted(from)?;
    Ok(segments - segments_before > skbs)
}

/// The skbs pod A's eth0 sent (a veth counts each skb once, GSO or not), as
/// rtnetlink reports them in the pod's namespace (`/sys/class/net` would be the
/// sysfs of the namespace it was mounted in, not the pod's).
fn tx_packets(ns: &Netns) -> Fallible<u64> {
    let output = ns.output("ip", &["-s", "-j", "link", "show", "dev", "eth0"])?;
    let links: Value = serde_json::from_slice(&output.stdout)?;
    links[0]["stats64"]["tx"]["packets"]
        .as_u64()
        .ok_or_else(|| format!("no tx packets in {links}").into())
}

fn census_json(pins: &Path, args: &[&str]) -> Fallible<Value> {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_census"));
    command.args(args).arg("--bpffs").arg(pins);
    let output = command.output()?;
    if !output.status.success() {
        return Err(format!(
            "census {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        )
        .into());
    }
    Ok(serde_json::from_slice(&output.stdout)?)
}

fn find_map<'a>(maps: &'a Value, name: &str) -> Fallible<&'a Value> {
    maps.as_array()
        .and_then(|maps| maps.iter().find(|map| map["name"] == name))
        .ok_or_else(|| format!("no {name} in {maps}").into())
}

/// An agent of layout 3 takes layout 2's maps over in place: entries and counters
/// kept, STATS added beside them (the pairs already in FLOWS counted as
/// inserted, so evictions stay exact), the layout stamped 3. The CLI reads layout
/// 2's maps too, without STATS.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn layout_2_maps_are_taken_over_with_their_counters() -> TestResult {
    let pins = PinDir::new();
    let a: IpAddr = "198.18.1.2".parse()?;
    let mut datapath = open_datapath(pins.path())?;
    datapath.upsert_endpoint(a, Endpoint::local(POD_A))?;
    datapath.set_interface(Interface {
        ifindex: LOOPBACK,
        identity: Some(POD_A),
    })?;
    for d in 0..3u8 {
        let dst: IpAddr = [198, 18, 2, d].into();
        datapath.upsert_endpoint(dst, Endpoint::remote(5000 + u32::from(d), NODE))?;
        let frame = packet::udp_frame(a, dst, 10).ok_or("frame")?;
        datapath.test_run(Direction::Ingress, &frame, TestContext::default(), 4)?;
    }
    let flows = datapath.flows()?;
    drop(datapath);

    // What layout 2 left: no STATS, meta saying 2.
    std::fs::remove_file(pins.join("STATS"))?;
    let mut meta: Array<MapData, u32> =
        Array::try_from(Map::Array(MapData::from_pin(pins.join("CENSUS_META"))?))?;
    meta.set(0, 2, 0)?;
    drop(meta);
    let old = Inspector::open(pins.path())?;
    assert_eq!(old.layout_version(), 2);
    assert_eq!(old.stats()?, None, "layout 2 has no STATS");
    assert_eq!(old.flows()?, flows);
    drop(old);

    let datapath = open_datapath(pins.path())?;
    assert_eq!(datapath.flows()?, flows, "counters kept");
    let stats = datapath.stats()?;
    assert_eq!(stats.flow_inserts, 3, "the pairs present count as inserted");
    assert_eq!(stats.flow_evictions(3), 0);
    let meta = bpftool(
        None,
        &[
            "map",
            "dump",
            "pinned",
            path_str(&pins.join("CENSUS_META"))?,
        ],
    )?;
    assert_eq!(u32_at(&meta[0]["value"], 0)?, LAYOUT_VERSION, "{meta}");
    Ok(())
}
