//! The `census` CLI against real pinned maps: what `census bpf ...` prints agrees entry
//! by entry with `bpftool map dump`, after real traffic and with the agent gone; maps
//! it must not read (another layout, another shape, no permission) get their own exit
//! codes and are left as they were.

use std::{
    collections::BTreeMap,
    net::IpAddr,
    os::unix::{fs::PermissionsExt as _, process::CommandExt as _},
    path::Path,
    process::Command,
};

use census_agent::bpf::{Datapath, Endpoint, Interface, LAYOUT_VERSION, ServiceKind};
use census_netlab::Lab;
use census_testkit::{Operator, session};
use serde_json::Value;

use crate::support::{
    Fallible, PinDir, TestResult, bpftool, bytes, create_map, host_ifindex,
    interface_entry_by_bpftool, open_attached, path_str, register, send, u32_at,
};

const WEB: u32 = 3000;
const DB: u32 = 3001;
const COUNT: usize = 20;
const PAYLOAD: usize = 64;

/// `census` as root: exit code, stdout, stderr.
fn census(args: &[&str]) -> Fallible<(Option<i32>, String, String)> {
    run(Command::new(env!("CARGO_BIN_EXE_census")).args(args))
}

fn run(command: &mut Command) -> Fallible<(Option<i32>, String, String)> {
    for (name, _) in std::env::vars() {
        if name.starts_with("CENSUS_") {
            command.env_remove(name);
        }
    }
    let output = command.output()?;
    Ok((
        output.status.code(),
        String::from_utf8(output.stdout)?,
        String::from_utf8(output.stderr)?,
    ))
}

fn census_json(args: &[&str]) -> Fallible<Value> {
    let (code, stdout, stderr) = census(args)?;
    if code != Some(0) {
        return Err(format!("census {args:?} exited {code:?}: {stderr}").into());
    }
    Ok(serde_json::from_str(&stdout)?)
}

/// Checks a refusal: exit code, nothing on stdout, one line naming every needle.
fn expect_failure(
    answer: (Option<i32>, String, String),
    code: i32,
    needles: &[&str],
) -> TestResult {
    let (got, stdout, stderr) = &answer;
    assert_eq!(*got, Some(code), "{answer:?}");
    assert!(stdout.is_empty(), "{answer:?}");
    assert_eq!(stderr.lines().count(), 1, "{answer:?}");
    for needle in needles {
        assert!(stderr.contains(needle), "{needle:?} in {answer:?}");
    }
    Ok(())
}

/// ENDPOINTS per bpftool: address -> (identity, flags).
fn bpftool_endpoints(pins: &PinDir) -> Fallible<BTreeMap<IpAddr, (u32, u32)>> {
    let dump = bpftool(
        None,
        &["map", "dump", "pinned", path_str(&pins.join("ENDPOINTS"))?],
    )?;
    let mut entries = BTreeMap::new();
    for entry in dump.as_array().into_iter().flatten() {
        let key = bytes(&entry["key"])?;
        let ip: IpAddr = match u32_at(&entry["key"], 0)? {
            4 => <[u8; 4]>::try_from(&key[4..8])?.into(),
            6 => <[u8; 16]>::try_from(&key[4..20])?.into(),
            family => return Err(format!("family {family} in {entry}").into()),
        };
        let value = (u32_at(&entry["value"], 0)?, u32_at(&entry["value"], 4)?);
        entries.insert(ip, value);
    }
    Ok(entries)
}

fn u64_at(bytes: &[u8], offset: usize) -> Fallible<u64> {
    let word = bytes.get(offset..offset + 8).ok_or("short value")?;
    Ok(u64::from_le_bytes(word.try_into()?))
}

/// FLOWS per bpftool, summed over CPUs: (src, dst) -> (packets, bytes).
fn bpftool_flows(pins: &PinDir) -> Fallible<BTreeMap<(u32, u32), (u64, u64)>> {
    let dump = bpftool(
        None,
        &["map", "dump", "pinned", path_str(&pins.join("FLOWS"))?],
    )?;
    let mut flows = BTreeMap::new();
    for entry in dump.as_array().into_iter().flatten() {
        let pair = (u32_at(&entry["key"], 0)?, u32_at(&entry["key"], 4)?);
        let mut sum = (0, 0);
        for cpu in entry["values"].as_array().into_iter().flatten() {
            let value = bytes(&cpu["value"])?;
            sum.0 += u64_at(&value, 0)?;
            sum.1 += u64_at(&value, 8)?;
        }
        flows.insert(pair, sum);
    }
    Ok(flows)
}

fn u32_of(value: &Value) -> Fallible<u32> {
    Ok(u32::try_from(
        value
            .as_u64()
            .ok_or_else(|| format!("not a number: {value}"))?,
    )?)
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn census_bpf_agrees_with_bpftool_after_traffic() -> TestResult {
    let pins = PinDir::new();
    let bpffs = path_str(pins.path())?.to_owned();
    let mut lab = Lab::new()?;
    let a = lab.add_pod()?;
    let b = lab.add_pod()?;
    let mut datapath = open_attached(&pins, &lab, &[&a, &b])?;
    register(&mut datapath, &a, WEB)?;
    register(&mut datapath, &b, DB)?;
    datapath.upsert_endpoint(a.gateway_v4.into(), Endpoint::host())?;
    let (ia, ib) = (host_ifindex(&lab, &a)?, host_ifindex(&lab, &b)?);
    datapath.set_interface(Interface {
        ifindex: ia,
        identity: Some(WEB),
    })?;
    datapath.set_interface(Interface {
        ifindex: ib,
        identity: None,
    })?;
    for v6 in [false, true] {
        assert_eq!(send(&a.ns, a.ip(v6), &b, v6, COUNT, PAYLOAD)?, COUNT);
    }
    assert_eq!(send(&b.ns, b.ipv4.into(), &a, false, 3, PAYLOAD)?, 3);

    // INTERFACES, as census and bpftool read it (interface names are those of
    // census's network namespace: the pods' host sides are in the node's).
    let interfaces = census_json(&["bpf", "interfaces", "list", "-o", "json", "--bpffs", &bpffs])?;
    let listed: Vec<(u32, Option<u32>)> = interfaces
        .as_array()
        .ok_or("not an array")?
        .iter()
        .map(|entry| {
            Ok((
                u32_of(&entry["ifindex"])?,
                entry["identity"].as_u64().map(u32::try_from).transpose()?,
            ))
        })
        .collect::<Fallible<_>>()?;
    let mut expected = vec![(ia, Some(WEB)), (ib, None)];
    expected.sort_unstable();
    assert_eq!(listed, expected);
    // Names come from census's link pins, as the agent named the interfaces in its
    // network namespace (the node's, not this command's); an entry no link names
    // has none.
    datapath.set_interface(Interface {
        ifindex: 4242,
        identity: Some(DB),
    })?;
    let named = census_json(&["bpf", "interfaces", "-o", "json", "--bpffs", &bpffs])?;
    let name_of = |ifindex: u32| -> Fallible<Value> {
        named
            .as_array()
            .and_then(|entries| entries.iter().find(|e| e["ifindex"] == ifindex))
            .map(|entry| entry["interface"].clone())
            .ok_or_else(|| format!("no entry for {ifindex}: {named}").into())
    };
    assert_eq!(name_of(ia)?, Value::from(a.host_interface.as_str()));
    assert_eq!(name_of(ib)?, Value::from(b.host_interface.as_str()));
    assert_eq!(name_of(4242)?, Value::Null);
    datapath.delete_interface(4242)?;
    for (ifindex, identity) in expected {
        assert_eq!(
            interface_entry_by_bpftool(pins.path(), ifindex)?,
            Some(identity.unwrap_or(0))
        );
    }
    // Counting stops (so census and bpftool see the same counters), then the agent
    // exits: the maps stay pinned, and census reads them without it.
    for pod in [&a, &b] {
        lab.node().run(|| datapath.detach(&pod.host_interface))??;
    }
    drop(datapath);

    let endpoints = census_json(&["bpf", "endpoints", "list", "-o", "json", "--bpffs", &bpffs])?;
    let mut listed = BTreeMap::new();
    for entry in endpoints.as_array().ok_or("not an array")? {
        let ip: IpAddr = entry["address"]
            .as_str()
            .ok_or_else(|| format!("no address: {entry}"))?
            .parse()?;
        listed.insert(
            ip,
            (u32_of(&entry["identity"])?, u32_of(&entry["flag_bits"])?),
        );
    }
    let dumped = bpftool_endpoints(&pins)?;
    assert_eq!(listed, dumped);
    assert_eq!(listed.len(), 5, "{listed:?}");
    assert_eq!(listed.get(&a.ipv4.into()), Some(&(WEB, 1)));

    let flows = census_json(&["bpf", "flows", "list", "-o", "json", "--bpffs", &bpffs])?;
    let mut listed = BTreeMap::new();
    for flow in flows.as_array().ok_or("not an array")? {
        let pair = (
            u32_of(&flow["src_identity"])?,
            u32_of(&flow["dst_identity"])?,
        );
        let counters = (
            flow["packets"].as_u64().ok_or("no packets")?,
            flow["bytes"].as_u64().ok_or("no bytes")?,
        );
        listed.insert(pair, counters);
    }
    assert_eq!(listed, bpftool_flows(&pins)?);
    assert_eq!(
        listed.get(&(WEB, DB)).map(|c| c.0),
        Some(2 * COUNT as u64),
        "{listed:?}"
    );
    assert_eq!(listed.get(&(DB, WEB)).map(|c| c.0), Some(3), "{listed:?}");

    // Filtered and sorted: the busiest pair first.
    let only_db = census_json(&[
        "bpf",
        "flows",
        "list",
        "-o",
        "json",
        "--bpffs",
        &bpffs,
        "--identity",
        "3001",
        "--sort",
        "packets",
    ])?;
    let only_db = only_db.as_array().ok_or("not an array")?;
    let pairs: Vec<(u32, u32)> = only_db
        .iter()
        .map(|f| Ok((u32_of(&f["src_identity"])?, u32_of(&f["dst_identity"])?)))
        .collect::<Fallible<_>>()?;
    assert_eq!(pairs.first(), Some(&(WEB, DB)), "{pairs:?}");
    assert!(pairs.contains(&(DB, WEB)), "{pairs:?}");
    assert!(
        pairs.iter().all(|&(src, dst)| src == DB || dst == DB),
        "{pairs:?}"
    );
    let packets: Vec<u64> = only_db
        .iter()
        .filter_map(|f| f["packets"].as_u64())
        .collect();
    assert!(packets.windows(2).all(|w| w[0] >= w[1]), "{packets:?}");

    let maps = census_json(&["bpf", "maps", "-o", "json", "--bpffs", &bpffs])?;
    let maps = maps.as_array().ok_or("not an array")?;
    let shapes: Vec<(&str, &str, u64, u64)> = maps
        .iter()
        .map(|m| {
            (
                m["name"].as_str().unwrap_or_default(),
                m["type"].as_str().unwrap_or_default(),
                m["key_size"].as_u64().unwrap_or_default(),
                m["value_size"].as_u64().unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        shapes,
        [
            ("CENSUS_META", "array", 4, 4),
            ("ENDPOINTS", "hash", 20, 8),
            ("FLOWS", "lru_percpu_hash", 8, 16),
            ("INTERFACES", "array", 4, 8),
            ("STATS", "percpu_array", 4, 8),
            ("NODES", "hash", 4, 580),
            ("SERVICES", "lpm_trie", 24, 4),
            ("SERVICE_FLOWS4", "lru_percpu_hash", 12, 16),
            ("SERVICE_FLOWS6", "lru_percpu_hash", 24, 16),
            ("ADDRESS_FILTER", "array", 4, 1712),
            ("CLIENTS_EPOCH", "array", 4, 8),
        ]
    );
    for map in maps {
        assert_eq!(map["layout_version"], LAYOUT_VERSION, "{map}");
        let name = map["name"].as_str().unwrap_or_default();
        assert_eq!(map["pin"], path_str(&pins.join(name))?, "{map}");
        let shown = bpftool(
            None,
            &["map", "show", "pinned", path_str(&pins.join(name))?],
        )?;
        assert_eq!(map["id"], shown["id"], "{map}");
        assert_eq!(map["max_entries"], shown["max_entries"], "{map}");
        assert_eq!(map["flags"], shown["flags"], "{map}");
    }
    assert_eq!(maps[1]["entries"], 5);
    assert_eq!(maps[2]["entries"], u64::try_from(listed.len())?);
    assert_eq!(
        maps[3]["entries"], 0,
        "detaching took the INTERFACES entries"
    );

    // The table, for people, and one address.
    let (code, table, _) = census(&["bpf", "maps", "--bpffs", &bpffs])?;
    assert_eq!(code, Some(0));
    assert!(table.starts_with("NAME "), "{table}");
    assert_eq!(
        table.lines().count(),
        12,
        "a header and the eleven maps: {table}"
    );
    let one = census_json(&[
        "bpf",
        "endpoints",
        "get",
        &b.ipv6.to_string(),
        "-o",
        "json",
        "--bpffs",
        &bpffs,
    ])?;
    assert_eq!(one["identity"], DB);
    assert_eq!(one["flags"], serde_json::json!(["local"]));
    expect_failure(
        census(&[
            "bpf",
            "endpoints",
            "get",
            "198.18.255.254",
            "--bpffs",
            &bpffs,
        ])?,
        4,
        &[
            "198.18.255.254 is not in the ENDPOINTS map pinned in",
            &bpffs,
        ],
    )?;
    Ok(())
}

/// SERVICES per bpftool, from its bytes: range -> kind (key: prefix length u32
/// counting the family's 32 bits, family u32, 16 bytes of address; value u32).
fn bpftool_services(pins: &PinDir) -> Fallible<BTreeMap<String, u32>> {
    let dump = bpftool(
        None,
        &["map", "dump", "pinned", path_str(&pins.join("SERVICES"))?],
    )?;
    let mut services = BTreeMap::new();
    for entry in dump.as_array().into_iter().flatten() {
        let key = bytes(&entry["key"])?;
        if key.len() != 24 {
            return Err(format!("a SERVICES key of another shape: {entry}").into());
        }
        let bits = u32_at(&entry["key"], 0)?
            .checked_sub(32)
            .ok_or_else(|| format!("a prefix shorter than the family: {entry}"))?;
        let ip: IpAddr = match u32_at(&entry["key"], 4)? {
            4 => <[u8; 4]>::try_from(&key[8..12])?.into(),
            6 => <[u8; 16]>::try_from(&key[8..24])?.into(),
            family => return Err(format!("family {family} in {entry}").into()),
        };
        services.insert(format!("{ip}/{bits}"), u32_at(&entry["value"], 0)?);
    }
    Ok(services)
}

/// `census bpf services` reads what the datapath wrote into SERVICES, table and
/// JSON, and agrees range by range with bpftool's dump, with the agent gone.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn census_bpf_services_agrees_with_bpftool() -> TestResult {
    let pins = PinDir::new();
    let bpffs = path_str(pins.path())?.to_owned();
    let mut datapath = Datapath::open(pins.path())?;
    let written = [
        ("198.19.96.0/20", ServiceKind::ClusterIpRange),
        ("fd00:10:96::/108", ServiceKind::ClusterIpRange),
        ("198.18.200.7/32", ServiceKind::LoadBalancerIp),
        ("2001:2:0:9::7/128", ServiceKind::ExternalIp),
    ];
    for (range, kind) in written {
        datapath.upsert_service(range.parse()?, kind)?;
    }
    drop(datapath);

    let listed = census_json(&["bpf", "services", "-o", "json", "--bpffs", &bpffs])?;
    let listed: Vec<(String, String)> = listed
        .as_array()
        .ok_or("not an array")?
        .iter()
        .map(|entry| {
            let field = |name: &str| {
                entry[name]
                    .as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| format!("no {name}: {entry}"))
            };
            Ok((field("range")?, field("kind")?))
        })
        .collect::<Fallible<_>>()?;
    // IPv4 first, by address then prefix length.
    let expected: Vec<(String, String)> = [
        ("198.18.200.7/32", "load-balancer-ip"),
        ("198.19.96.0/20", "cluster-ip-range"),
        ("2001:2:0:9::7/128", "external-ip"),
        ("fd00:10:96::/108", "cluster-ip-range"),
    ]
    .map(|(range, kind)| (range.to_owned(), kind.to_owned()))
    .into();
    assert_eq!(listed, expected);
    let by_kind_value = |name: &str| match name {
        "cluster-ip-range" => Ok(ServiceKind::ClusterIpRange.raw()),
        "load-balancer-ip" => Ok(ServiceKind::LoadBalancerIp.raw()),
        "external-ip" => Ok(ServiceKind::ExternalIp.raw()),
        other => Err(format!("kind {other}")),
    };
    let as_raw: BTreeMap<String, u32> = listed
        .iter()
        .map(|(range, kind)| Ok((range.clone(), by_kind_value(kind)?)))
        .collect::<Fallible<_>>()?;
    assert_eq!(as_raw, bpftool_services(&pins)?, "census and bpftool agree");

    let (code, table, stderr) = census(&["bpf", "services", "list", "--bpffs", &bpffs])?;
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(
        table,
        "\
RANGE              KIND
198.18.200.7/32    load-balancer-ip
198.19.96.0/20     cluster-ip-range
2001:2:0:9::7/128  external-ip
fd00:10:96::/108   cluster-ip-range
"
    );
    Ok(())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn bpf_tables_name_identities_when_the_operator_answers() -> TestResult {
    let runtime = tokio::runtime::Runtime::new()?;
    let pins = PinDir::new();
    let bpffs = path_str(pins.path())?.to_owned();
    let mut datapath = Datapath::open(pins.path())?;
    let (operator, agent, web) = runtime
        .block_on(async {
            let operator = Operator::start(&[]).await?;
            let agent = census_testkit::Agent::connect(&operator, "node-a", session(1))
                .await?
                .0;
            let web = operator
                .allocate_ok("node-a", session(1), &["k8s:app=web"])
                .await?;
            census_testkit::TestResult::Ok((operator, agent, web))
        })
        .map_err(|e| e.to_string())?;
    datapath.upsert_endpoint("198.18.9.2".parse()?, Endpoint::local(web.id))?;

    let (code, table, stderr) = census(&[
        "bpf",
        "endpoints",
        "list",
        "--bpffs",
        &bpffs,
        "--operator",
        &operator.url(),
    ])?;
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(
        table,
        format!(
            "ADDRESS     IDENTITY  FLAGS  LABELS\n198.18.9.2  {:<8}  local  k8s:app=web\n",
            web.id
        )
    );
    let (code, numeric, _) = census(&[
        "bpf",
        "endpoints",
        "list",
        "-n",
        "--bpffs",
        &bpffs,
        "--operator",
        &operator.url(),
    ])?;
    assert_eq!(code, Some(0));
    assert_eq!(
        numeric,
        format!(
            "ADDRESS     IDENTITY  FLAGS\n198.18.9.2  {:<8}  local\n",
            web.id
        )
    );
    drop(agent);
    runtime
        .block_on(operator.shut_down())
        .map_err(|e| e.to_string())?;

    // Operator gone: numbers only, a note on stderr, still a success.
    let (code, table, stderr) = census(&[
        "bpf",
        "endpoints",
        "list",
        "--bpffs",
        &bpffs,
        "--operator",
        "127.0.0.1:1",
    ])?;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        table.starts_with("ADDRESS     IDENTITY  FLAGS\n"),
        "{table}"
    );
    assert!(
        stderr.starts_with("note: labels not shown: cannot reach the operator"),
        "{stderr}"
    );
    Ok(())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn maps_census_cannot_read_get_their_own_exit_codes_and_are_left_alone() -> TestResult {
    // Another layout version.
    let pins = PinDir::new();
    drop(Datapath::open(pins.path())?);
    let meta = pins.join("CENSUS_META");
    let set_layout = |value: &str| {
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
                value,
                "0",
                "0",
                "0",
            ],
        )
    };
    set_layout("99")?;
    let bpffs = path_str(pins.path())?.to_owned();
    for verb in [
        &["bpf", "maps"][..],
        &["bpf", "endpoints", "list"],
        &["bpf", "flows", "list"],
    ] {
        let mut args = verb.to_vec();
        args.extend(["--bpffs", &bpffs]);
        expect_failure(
            census(&args)?,
            9,
            &[
                "have layout version 99",
                &format!("this census reads layout {LAYOUT_VERSION}"),
                &bpffs,
            ],
        )?;
    }
    let dump = bpftool(None, &["map", "dump", "pinned", path_str(&meta)?])?;
    assert_eq!(u32_at(&dump[0]["value"], 0)?, 99, "census wrote nothing");
    // The previous layout, as an older agent left it (no INTERFACES).
    set_layout("1")?;
    std::fs::remove_file(pins.join("INTERFACES"))?;
    expect_failure(
        census(&["bpf", "interfaces", "list", "--bpffs", &bpffs])?,
        9,
        &[
            "have layout version 1",
            "use the census CLI of the agent's release",
        ],
    )?;
    // Created, not stamped yet (an agent is loading).
    set_layout("0")?;
    expect_failure(
        census(&["bpf", "maps", "--bpffs", &bpffs])?,
        9,
        &["no layout version yet", "try again"],
    )?;

    // Maps without a layout version.
    let bare = PinDir::new();
    std::fs::create_dir(bare.path())?;
    create_map(&bare.join("ENDPOINTS"), "hash", 20, 8)?;
    expect_failure(
        census(&[
            "bpf",
            "endpoints",
            "list",
            "--bpffs",
            path_str(bare.path())?,
        ])?,
        9,
        &["carry no layout version (CENSUS_META is missing)"],
    )?;

    // The right version, a map of another key size.
    let odd = PinDir::new();
    drop(Datapath::open(odd.path())?);
    std::fs::remove_file(odd.join("ENDPOINTS"))?;
    create_map(&odd.join("ENDPOINTS"), "hash", 16, 8)?;
    expect_failure(
        census(&["bpf", "endpoints", "list", "--bpffs", path_str(odd.path())?])?,
        10,
        &[
            path_str(&odd.join("ENDPOINTS"))?,
            "expected Hash map, key 20 B, value 8 B, 524288 entries, flags 0x1",
            "found Hash map, key 16 B, value 8 B, 16 entries",
        ],
    )?;

    // A map missing beside the others.
    let partial = PinDir::new();
    drop(Datapath::open(partial.path())?);
    std::fs::remove_file(partial.join("FLOWS"))?;
    expect_failure(
        census(&["bpf", "maps", "--bpffs", path_str(partial.path())?])?,
        7,
        &["map FLOWS is not pinned there"],
    )?;

    // No permission: census run as nobody.
    let good = PinDir::new();
    drop(Datapath::open(good.path())?);
    let copy = tempfile::tempdir()?;
    std::fs::set_permissions(copy.path(), std::fs::Permissions::from_mode(0o755))?;
    let binary = copy.path().join("census");
    std::fs::copy(env!("CARGO_BIN_EXE_census"), &binary)?;
    std::fs::set_permissions(&binary, std::fs::Permissions::from_mode(0o755))?;
    let answer = run(Command::new(&binary)
        .args(["bpf", "maps", "--bpffs", path_str(good.path())?])
        .uid(65534)
        .gid(65534)
        .current_dir(Path::new("/")))?;
    expect_failure(
        answer,
        8,
        &["no permission to read", "run census with sudo"],
    )?;
    Ok(())
}
