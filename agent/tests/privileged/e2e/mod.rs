//! End to end, against the real kernel and real processes: network namespaces and
//! veth pairs as labelled pods, a `census-operator` and a `census-agent` (on an
//! endpoints file) started inside the node namespace, traffic between the pods.
//!
//! These tests need root; they run through `cargo xtask test-privileged`, one at a
//! time. Everything a test creates (namespaces, processes, pins) is removed by
//! guards, also when it fails; the processes' logs are printed when it does.

pub(crate) mod harness;

mod gaps;

use std::{collections::BTreeMap, net::IpAddr, process::Command, time::Duration};

use crate::support::{
    self, CensusLink, Fallible, TestResult, assert_one_census_program_per_hook, bpftool, bytes,
    census_tcx_links, eventually, frame_len, hook_programs, host_ifindex,
    interface_entry_by_bpftool, path_str, send, spoof_addresses_of, u32_at,
};
use census_agent::bpf::{Inspector, identity};
use census_netlab::Pod;
use harness::{World, endpoint_entry, wait_for};

const PAYLOAD: usize = 100;
const COUNT: usize = 20;
const LOCAL: u32 = 1;
const HOST: u32 = 4;

const WEB: &[(&str, &str)] = &[("app", "web")];
const DB: &[(&str, &str)] = &[("app", "db")];
const CACHE: &[(&str, &str)] = &[("app", "cache")];

/// ENDPOINTS as bpftool reads it (parsed from its bytes, independently of
/// census's types): address -> (identity, flags).
fn endpoints_by_bpftool(world: &World) -> Fallible<BTreeMap<IpAddr, (u32, u32)>> {
    let path = world.pins.join("ENDPOINTS");
    let dump = bpftool(None, &["map", "dump", "pinned", path_str(&path)?])?;
    let mut entries = BTreeMap::new();
    for entry in dump.as_array().into_iter().flatten() {
        let key = bytes(&entry["key"])?;
        let ip: IpAddr = match u32_at(&entry["key"], 0)? {
            4 => <[u8; 4]>::try_from(&key[4..8])?.into(),
            6 => <[u8; 16]>::try_from(&key[4..20])?.into(),
            family => return Err(format!("family {family} in {entry}").into()),
        };
        entries.insert(
            ip,
            (u32_at(&entry["value"], 0)?, u32_at(&entry["value"], 4)?),
        );
    }
    Ok(entries)
}

/// The TCX links pinned in this test's pin directory, per bpftool; in TC mode,
/// the TC filters recorded there, per `tc` (a link id made of the filter's
/// priority and handle).
fn our_links(world: &World) -> Fallible<Vec<CensusLink>> {
    if support::tc_mode() {
        return our_tc_filters(world);
    }
    let dir = world.pins.path().to_string_lossy().into_owned();
    Ok(census_tcx_links()?
        .into_iter()
        .filter(|l| l.pinned.iter().any(|p| p.starts_with(&dir)))
        .collect())
}

fn our_tc_filters(world: &World) -> Fallible<Vec<CensusLink>> {
    let mut filters = Vec::new();
    for entry in std::fs::read_dir(world.pins.join("links"))? {
        let path = entry?.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or("a record without a name")?;
        // `links/sockets` is the socket program's cgroup link, no filter.
        let Some((hook, place)) = name.rsplit_once(":tc:") else {
            continue;
        };
        let (interface, direction) = hook.rsplit_once('-').ok_or("no direction")?;
        let place: Vec<u32> = place.split(':').map(str::parse).collect::<Result<_, _>>()?;
        let (priority, handle) = (place[1], place[2]);
        let program = format!("census_{direction}");
        let listed = support::tc_filters(&world.lab, interface, direction)?;
        if listed
            .iter()
            .any(|f| f.priority == u64::from(priority) && f.name == program)
        {
            filters.push(CensusLink {
                link_id: (priority << 16) | (handle & 0xffff),
                program,
                pinned: vec![path.to_string_lossy().into_owned()],
            });
        }
    }
    filters.sort_by_key(|l| l.link_id);
    Ok(filters)
}

/// Packets and bytes of one identity pair in FLOWS.
fn flow(world: &World, src: u32, dst: u32) -> Fallible<(u64, u64)> {
    let maps = Inspector::open(world.pins.path())?;
    Ok(maps
        .flows()?
        .into_iter()
        .find(|f| f.src_identity == src && f.dst_identity == dst)
        .map_or((0, 0), |f| (f.packets, f.bytes)))
}

/// Sends `COUNT` datagrams from `from` to `to` (IPv4 or IPv6); all must arrive.
fn traffic(from: &Pod, to: &Pod, v6: bool) -> TestResult {
    let received = send(&from.ns, from.ip(v6), to, v6, COUNT, PAYLOAD)?;
    if received != COUNT {
        return Err(format!("{received} of {COUNT} datagrams arrived").into());
    }
    Ok(())
}

/// Asserts `traffic` adds exactly `COUNT` packets to the pair, once per v4 and v6.
fn counted_once(world: &World, from: &Pod, to: &Pod, pair: (u32, u32)) -> TestResult {
    for v6 in [false, true] {
        let before = flow(world, pair.0, pair.1)?;
        traffic(from, to, v6)?;
        let after = flow(world, pair.0, pair.1)?;
        assert_eq!(
            (after.0 - before.0, after.1 - before.1),
            (COUNT as u64, COUNT as u64 * frame_len(PAYLOAD, v6)),
            "{pair:?} counted exactly once (v6: {v6})"
        );
    }
    Ok(())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn agent_programs_identities_and_counts_each_packet_once() -> TestResult {
    let mut world = World::new()?;
    let web0 = world.lab.add_pod()?;
    let web1 = world.lab.add_pod()?;
    let db0 = world.lab.add_pod()?;
    let file = endpoint_entry("web-0", &web0, WEB)
        + &endpoint_entry(
            "web-1",
            &web1,
            &[("app", "web"), ("pod-template-hash", "5d8f")],
        )
        + &endpoint_entry("db-0", &db0, DB);
    world.write_endpoints(&file)?;
    world.start_operator()?;
    world.start_agent()?;
    let response = world.wait_programmed(&["db-0", "web-0", "web-1"])?;
    assert!(response.operator.connected);

    let web = world.lookup(WEB)?;
    let db = world.lookup(DB)?;
    assert!(web > 255 && db > 255 && web != db, "{web} {db}");
    for endpoint in &response.endpoints {
        let want = if endpoint.name.starts_with("web") {
            web
        } else {
            db
        };
        assert_eq!(endpoint.identity, Some(want), "{endpoint:?}");
    }

    // ENDPOINTS, as bpftool sees it.
    let entries = endpoints_by_bpftool(&world)?;
    for (pod, id) in [(&web0, web), (&web1, web), (&db0, db)] {
        for v6 in [false, true] {
            assert_eq!(
                entries.get(&pod.ip(v6)),
                Some(&(id, LOCAL)),
                "{}",
                pod.ip(v6)
            );
        }
        assert_eq!(
            entries.get(&pod.gateway(false)),
            Some(&(identity::HOST, HOST)),
            "the node's own address is host"
        );
    }
    assert_one_census_program_per_hook(&world.pins, &world.lab, &[&web0, &web1, &db0])?;
    // INTERFACES, as bpftool sees it: each pod's host side -> its identity.
    for (pod, id) in [(&web0, web), (&web1, web), (&db0, db)] {
        let ifindex = host_ifindex(&world.lab, pod)?;
        assert_eq!(
            interface_entry_by_bpftool(world.pins.path(), ifindex)?,
            Some(id),
            "{}",
            pod.host_interface
        );
    }
    let web1_ifindex = host_ifindex(&world.lab, &web1)?;

    // Each packet once, per identity pair; same-identity and same-node pairs too.
    counted_once(&world, &web0, &db0, (web, db))?;
    counted_once(&world, &db0, &web1, (db, web))?;
    counted_once(&world, &web0, &web1, (web, web))?;
    // The node itself is `host`.
    let before = flow(&world, identity::HOST, db)?;
    let received = send(
        world.lab.node(),
        db0.gateway(false),
        &db0,
        false,
        COUNT,
        PAYLOAD,
    )?;
    assert_eq!(received, COUNT);
    assert_eq!(flow(&world, identity::HOST, db)?.0 - before.0, COUNT as u64);

    // web-1 leaves: its entries and links go, the operator's count drops.
    assert_eq!(world.references(web)?, 2);
    world.write_endpoints(
        &(endpoint_entry("web-0", &web0, WEB) + &endpoint_entry("db-0", &db0, DB)),
    )?;
    world.wait_programmed(&["db-0", "web-0"])?;
    wait_for(Duration::from_secs(10), "web-1's entries to go", || {
        let entries = endpoints_by_bpftool(&world)?;
        Ok(!entries.contains_key(&web1.ip(false))
            && !entries.contains_key(&web1.ip(true))
            && interface_entry_by_bpftool(world.pins.path(), web1_ifindex)?.is_none())
    })?;
    wait_for(
        Duration::from_secs(10),
        "the operator to drop web-1",
        || Ok(world.references(web)? == 1 && world.node()?.endpoints == 2),
    )?;
    for (hook, programs) in hook_programs(&world.lab, &web1.host_interface)? {
        assert!(
            programs.is_empty(),
            "detached from web-1's {hook}: {programs:?}"
        );
    }
    let (status, metrics) = world.http_get(harness::ADMIN_PORT, "/metrics")?;
    assert_eq!(status, 200);
    assert!(
        metrics.contains(&format!(
            "census_agent_flow_packets_total{{src_identity=\"{web}\",dst_identity=\"{db}\"}} {}",
            2 * COUNT
        )),
        "{metrics}"
    );
    world.pass();
    Ok(())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_spoofed_source_is_counted_as_the_interface_it_left() -> TestResult {
    let mut world = World::new()?;
    let a = world.lab.add_pod()?;
    let b = world.lab.add_pod()?;
    let c = world.lab.add_pod()?;
    world.write_endpoints(
        &(endpoint_entry("a", &a, WEB)
            + &endpoint_entry("b", &b, DB)
            + &endpoint_entry("c", &c, CACHE)),
    )?;
    world.start_operator()?;
    world.start_agent()?;
    world.wait_programmed(&["a", "b", "c"])?;
    let (web, db, cache) = (world.lookup(WEB)?, world.lookup(DB)?, world.lookup(CACHE)?);
    // The agent writes the INTERFACES entries as it attaches; wait for a's.
    let ia = host_ifindex(&world.lab, &a)?;
    wait_for(Duration::from_secs(10), "a's INTERFACES entry", || {
        Ok(interface_entry_by_bpftool(world.pins.path(), ia)? == Some(web))
    })?;

    // a sends to c with b's addresses: counted once, as a (web), not as b (db).
    spoof_addresses_of(&world.lab, &a, &b)?;
    for v6 in [false, true] {
        // Neighbours resolved first: a datagram waiting for them can be dropped on a
        // loaded machine, and the exchange below counts every one.
        send(&a.ns, b.ip(v6), &c, v6, 2, PAYLOAD)?;
        let before = (flow(&world, web, cache)?, flow(&world, db, cache)?);
        let received = send(&a.ns, b.ip(v6), &c, v6, COUNT, PAYLOAD)?;
        assert_eq!(received, COUNT);
        let after = (flow(&world, web, cache)?, flow(&world, db, cache)?);
        assert_eq!(
            after.0.0 - before.0.0,
            COUNT as u64,
            "as the interface it left (v6: {v6})"
        );
        assert_eq!(after.1, before.1, "not as the address claims (v6: {v6})");
    }
    // b's own traffic is still b's.
    counted_once(&world, &b, &c, (db, cache))?;
    world.pass();
    Ok(())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn sigkill_and_restart_keep_maps_links_counters_and_identities() -> TestResult {
    let mut world = World::new()?;
    let a = world.lab.add_pod()?;
    let b = world.lab.add_pod()?;
    world.write_endpoints(&(endpoint_entry("a", &a, WEB) + &endpoint_entry("b", &b, DB)))?;
    world.start_operator()?;
    world.start_agent()?;
    world.wait_programmed(&["a", "b"])?;
    let (web, db) = (world.lookup(WEB)?, world.lookup(DB)?);
    counted_once(&world, &a, &b, (web, db))?;
    let entries = endpoints_by_bpftool(&world)?;
    let links = our_links(&world)?;
    assert_eq!(links.len(), 4, "two pods, two hooks each");
    let counters = flow(&world, web, db)?;

    world.kill_agent()?;
    // With no agent running, the datapath goes on.
    assert_eq!(endpoints_by_bpftool(&world)?, entries);
    assert_eq!(our_links(&world)?, links);
    traffic(&a, &b, false)?;
    assert_eq!(flow(&world, web, db)?.0, counters.0 + COUNT as u64);

    world.start_agent()?;
    world.wait_programmed(&["a", "b"])?;
    assert_eq!(
        endpoints_by_bpftool(&world)?,
        entries,
        "no identity changed"
    );
    let after: Vec<u32> = our_links(&world)?.iter().map(|l| l.link_id).collect();
    let before: Vec<u32> = links.iter().map(|l| l.link_id).collect();
    assert_eq!(
        after, before,
        "the pinned links were adopted, not duplicated"
    );
    assert_one_census_program_per_hook(&world.pins, &world.lab, &[&a, &b])?;
    counted_once(&world, &a, &b, (web, db))?;
    assert_eq!(world.references(web)?, 1);
    world.pass();
    Ok(())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn the_operator_recovers_the_truth_from_the_agents_snapshot() -> TestResult {
    let mut world = World::new()?;
    let a = world.lab.add_pod()?;
    let b = world.lab.add_pod()?;
    let c = world.lab.add_pod()?;
    let d = world.lab.add_pod()?;
    world.write_endpoints(
        &(endpoint_entry("a", &a, WEB)
            + &endpoint_entry("b", &b, DB)
            + &endpoint_entry("c", &c, WEB)),
    )?;
    world.start_operator()?;
    world.start_agent()?;
    world.wait_programmed(&["a", "b", "c"])?;
    let (web, db) = (world.lookup(WEB)?, world.lookup(DB)?);
    wait_for(Duration::from_secs(10), "the operator to count", || {
        Ok(world.references(web)? == 2 && world.references(db)? == 1)
    })?;

    world.stop_operator()?;
    // While it is away: c goes, d (a db pod) comes; traffic keeps being counted.
    world.write_endpoints(
        &(endpoint_entry("a", &a, WEB)
            + &endpoint_entry("b", &b, DB)
            + &endpoint_entry("d", &d, DB)),
    )?;
    world.wait_programmed(&["a", "b", "d"])?;
    let response = world.endpoints()?;
    assert!(!response.operator.connected, "{:?}", response.operator);
    let (status, readyz) = world.http_get(harness::ADMIN_PORT, "/readyz")?;
    assert_eq!(status, 200, "Ready while the operator is away: {readyz}");
    assert!(readyz.contains("disconnected"), "{readyz}");
    counted_once(&world, &a, &d, (web, db))?;

    world.start_operator()?;
    wait_for(
        Duration::from_secs(20),
        "the operator to learn the truth",
        || {
            let node = world.node()?;
            Ok(node.connected
                && node.endpoints == 3
                && world.references(web)? == 1
                && world.references(db)? == 2)
        },
    )?;
    assert_eq!(world.lookup(WEB)?, web, "the store kept the identities");
    counted_once(&world, &d, &a, (db, web))?;
    world.pass();
    Ok(())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_malformed_file_changes_nothing_and_uninstall_removes_everything() -> TestResult {
    let mut world = World::new()?;
    let a = world.lab.add_pod()?;
    let b = world.lab.add_pod()?;
    world.write_endpoints(&(endpoint_entry("a", &a, WEB) + &endpoint_entry("b", &b, DB)))?;
    world.start_operator()?;
    world.start_agent()?;
    world.wait_programmed(&["a", "b"])?;
    let entries = endpoints_by_bpftool(&world)?;
    let links = our_links(&world)?;

    world.write_endpoints(
        "- {namespace: default, name: a, ips: [198.18.1.2, oops], interface: pod0}\n",
    )?;
    wait_for(
        Duration::from_secs(10),
        "the failure to be reported",
        || {
            let source = world.endpoints()?.source;
            Ok(source
                .and_then(|s| s.error)
                .is_some_and(|e| e.contains("\"oops\" is not an IPv4 or IPv6 address")))
        },
    )?;
    // Several full passes later, nothing changed.
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(endpoints_by_bpftool(&world)?, entries);
    assert_eq!(our_links(&world)?, links);
    world.wait_programmed(&["a", "b"])?;
    traffic(&a, &b, false)?;

    world.stop_agent()?;
    assert!(
        world.pins.path().exists(),
        "SIGTERM leaves the datapath in place"
    );
    let (agent_bin, _) = harness::binaries()?;
    // In the node's network namespace, as on a node: TC filters are found there.
    let uninstall_args: [&std::ffi::OsStr; 3] = [
        "uninstall".as_ref(),
        "--pin-dir".as_ref(),
        world.pins.path().as_os_str(),
    ];
    let agent_path = path_str(&agent_bin)?;
    let output = world.lab.node().output(agent_path, &uninstall_args)?;
    assert!(output.status.success(), "{output:?}");
    let said = String::from_utf8_lossy(&output.stdout);
    assert!(said.contains("detached and unpinned"), "{said}");
    assert!(said.contains("ENDPOINTS"), "{said}");
    assert!(!world.pins.path().exists());
    for pod in [&a, &b] {
        for (hook, programs) in hook_programs(&world.lab, &pod.host_interface)? {
            assert!(programs.is_empty(), "{hook}: {programs:?}");
        }
    }
    let ours: Vec<u32> = links.iter().map(|l| l.link_id).collect();
    let gone = eventually(Duration::from_secs(5), || {
        Ok(!census_tcx_links()?
            .iter()
            .any(|l| ours.contains(&l.link_id)))
    })?;
    assert!(gone, "no link of this agent is left");
    let again = Command::new(&agent_bin)
        .arg("uninstall")
        .arg("--pin-dir")
        .arg(world.pins.path())
        .output()?;
    assert!(again.status.success());
    assert!(String::from_utf8_lossy(&again.stdout).contains("nothing to remove"));
    world.pass();
    Ok(())
}
