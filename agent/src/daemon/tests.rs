//! The whole agent against a real operator in process, over loopback, with an
//! endpoints file and an in-memory datapath.

use std::{collections::BTreeMap, net::IpAddr, path::Path, sync::Arc, time::Duration};

use census_proto::{
    PROTOCOL_VERSION,
    domain::ServiceKind,
    labels::{LabelFilter, LabelLimits, LabelSet},
    pb::{self, identity_service_client::IdentityServiceClient},
};
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tonic::transport::Channel;

use census_testkit::{Operator, TestResult, identity, lazy_channel, node, until_some};

use super::*;
use crate::{
    admin::api::{EndpointState, EndpointsResponse},
    reconcile::{MapKey, fake::FakeMaps},
    source::FileSource,
};

type Fallible<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const WAIT: Duration = Duration::from_secs(15);

const FOUR: &str = "
- {namespace: default, name: web-0, ips: [198.18.1.2], labels: {app: web}, interface: veth1}
- {namespace: default, name: web-1, ips: [198.18.2.2], labels: {app: web, pod-template-hash: x1}, interface: veth2}
- {namespace: default, name: db-0, ips: [198.18.3.2], labels: {app: db}, interface: veth3}
- {namespace: default, name: batch-1, ips: [198.18.4.2], labels: {app: batch, job-name: batch-1}, interface: veth4}
";

struct Agent {
    running: Running,
    maps: Arc<Mutex<FakeMaps>>,
}

async fn agent(dir: &Path, operator: SocketAddr, maps: Arc<Mutex<FakeMaps>>) -> Fallible<Agent> {
    agent_on("n1", "198.18.0.1", dir, operator, maps, true).await
}

/// An agent on node `node` whose own address is `host`, with the endpoints file in
/// `dir`, watching the endpoint map or not.
async fn agent_on(
    node: &str,
    host: &str,
    dir: &Path,
    operator: SocketAddr,
    maps: Arc<Mutex<FakeMaps>>,
    endpoint_map: bool,
) -> Fallible<Agent> {
    agent_with(node, host, dir, operator, maps, endpoint_map, None).await
}

/// [`agent_on`], attaching the node's own hooks as `node_hooks` says.
async fn agent_with(
    node: &str,
    host: &str,
    dir: &Path,
    operator: SocketAddr,
    maps: Arc<Mutex<FakeMaps>>,
    endpoint_map: bool,
    node_hooks: Option<NodeHooks>,
) -> Fallible<Agent> {
    let options = Options {
        node: NodeName::new(node)?,
        operator: format!("http://{operator}"),
        operator_auth: crate::client::OperatorAuth::default(),
        admin_listen: "127.0.0.1:0".parse()?,
        health_listen: None,
        admin_limits: census_daemon::http::AdminLimits::default(),
        reconcile_interval: Duration::from_millis(200),
        initial_backoff: Duration::from_millis(50),
        max_backoff: Duration::from_millis(300),
        session: new_session(),
        host_ips: HostIps::Fixed([host.parse()?].into()),
        reassert_order: false,
        endpoint_map,
        drop_endpoint_deletes: false,
        node_hooks,
    };
    let source = FileSource::new(dir.join("endpoints.yaml"), Duration::from_millis(200))?;
    let running = start(options, maps.clone(), None, Box::new(source)).await?;
    Ok(Agent { running, maps })
}

fn fake_maps() -> Arc<Mutex<FakeMaps>> {
    let mut maps = FakeMaps::default();
    for i in 1..=9 {
        maps.interfaces.insert(format!("veth{i}"));
    }
    Arc::new(Mutex::new(maps))
}

fn write(dir: &Path, text: &str) -> std::io::Result<()> {
    let tmp = dir.join("endpoints.tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(tmp, dir.join("endpoints.yaml"))
}

fn entry(maps: &Arc<Mutex<FakeMaps>>, ip: &str) -> Option<bpf::Endpoint> {
    let ip: IpAddr = ip.parse().ok()?;
    maps.lock().entries.get(&MapKey::from(ip)).copied()
}

async fn lookup(channel: &Channel, labels: &[(&str, &str)]) -> Option<u32> {
    let labels: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    let set = LabelSet::for_pod(
        &labels,
        "default",
        "default",
        &LabelFilter::default(),
        &LabelLimits::default(),
    )
    .ok()?;
    let identity = IdentityServiceClient::new(channel.clone())
        .lookup(pb::LookupRequest {
            protocol_version: PROTOCOL_VERSION,
            labels: set.to_strings(),
        })
        .await
        .ok()?
        .into_inner();
    Some(identity.id)
}

async fn get(addr: SocketAddr, path: &str) -> Fallible<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: agent\r\n\r\n").as_bytes())
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let (head, body) = response.split_once("\r\n\r\n").ok_or("no HTTP header")?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or("no HTTP status")?;
    Ok((status, body.to_owned()))
}

async fn endpoints_api(addr: SocketAddr) -> Fallible<EndpointsResponse> {
    let (status, body) = get(addr, "/v1/endpoints").await?;
    if status != 200 {
        return Err(format!("GET /v1/endpoints: {status} {body}").into());
    }
    Ok(serde_json::from_str(&body)?)
}

async fn all_programmed(addr: SocketAddr, count: usize) -> Option<EndpointsResponse> {
    let response = endpoints_api(addr).await.ok()?;
    (response.endpoints.len() == count
        && response
            .endpoints
            .iter()
            .all(|e| e.state == EndpointState::Programmed))
    .then_some(response)
}

#[tokio::test]
async fn endpoints_get_their_identities_and_the_operator_counts_them() -> TestResult {
    let dir = tempfile::tempdir()?;
    let op = Operator::for_agents(dir.path(), 0).await?;
    let ch = lazy_channel(op.grpc_addr)?;
    write(dir.path(), FOUR)?;
    let agent = agent(dir.path(), op.grpc_addr, fake_maps()).await?;
    let admin = agent.running.admin_addr;

    let response = until_some(WAIT, || all_programmed(admin, 4))
        .await
        .ok_or("every endpoint is programmed")?;
    assert_eq!(response.node, "n1");
    assert!(response.operator.connected);
    let names: Vec<&str> = response.endpoints.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["batch-1", "db-0", "web-0", "web-1"], "sorted");
    let batch = &response.endpoints[0];
    assert!(
        batch.labels.iter().all(|l| !l.contains("job-name")),
        "the operator's filter dropped job-name: {:?}",
        batch.labels
    );

    let web = lookup(&ch, &[("app", "web")])
        .await
        .ok_or("web is allocated")?;
    let db = lookup(&ch, &[("app", "db")])
        .await
        .ok_or("db is allocated")?;
    assert_ne!(web, db);
    assert_eq!(
        entry(&agent.maps, "198.18.1.2"),
        Some(bpf::Endpoint::local(web))
    );
    assert_eq!(
        entry(&agent.maps, "198.18.2.2"),
        Some(bpf::Endpoint::local(web)),
        "pod-template-hash is filtered: same identity"
    );
    assert_eq!(
        entry(&agent.maps, "198.18.3.2"),
        Some(bpf::Endpoint::local(db))
    );
    assert_eq!(
        entry(&agent.maps, "198.18.0.1"),
        Some(bpf::Endpoint::host())
    );
    assert_eq!(
        agent.maps.lock().links.len(),
        4,
        "one attachment per interface"
    );
    let batch_id = response.endpoints[0]
        .identity
        .ok_or("batch-1 holds an identity")?;
    assert_eq!(
        agent.maps.lock().interface_entries(),
        BTreeMap::from([
            ("veth1".to_owned(), Some(web)),
            ("veth2".to_owned(), Some(web)),
            ("veth3".to_owned(), Some(db)),
            ("veth4".to_owned(), Some(batch_id)),
        ]),
        "each interface's INTERFACES entry names the endpoint behind it"
    );

    let counted = until_some(WAIT, || async {
        let refs = identity(&ch, web).await?.references;
        (refs == 2).then_some(())
    })
    .await;
    assert!(counted.is_some(), "the operator counts both web endpoints");

    // An endpoint leaves: its entry goes, and the operator's count drops.
    write(
        dir.path(),
        &FOUR.replace("- {namespace: default, name: web-1", "# "),
    )?;
    let dropped = until_some(WAIT, || async {
        let refs = identity(&ch, web).await?.references;
        (refs == 1 && entry(&agent.maps, "198.18.2.2").is_none()).then_some(())
    })
    .await;
    assert!(
        dropped.is_some(),
        "the delete reached the map and the operator"
    );
    {
        let maps = agent.maps.lock();
        assert!(
            !maps.interface_entries().contains_key("veth2") && !maps.links.contains_key("veth2"),
            "its INTERFACES entry and its links go with it"
        );
        assert_eq!(maps.unattached_entries, 0);
    }
    assert_eq!(node(&ch, "n1").await.map(|n| n.endpoints), Some(3));

    let (status, version) = get(admin, "/v1/version").await?;
    assert_eq!(status, 200);
    let version: serde_json::Value = serde_json::from_str(&version)?;
    assert_eq!(version["protocol_version"], PROTOCOL_VERSION);
    assert_eq!(version["layout_version"], bpf::LAYOUT_VERSION);
    let (status, metrics) = get(admin, "/metrics").await?;
    assert_eq!(status, 200);
    assert!(
        metrics.contains("census_agent_operator_connected 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("census_agent_endpoints{state=\"programmed\"} 3"),
        "{metrics}"
    );

    agent.running.shut_down().await;
    op.shut_down().await?;
    Ok(())
}

#[tokio::test]
async fn a_malformed_file_changes_nothing() -> TestResult {
    let dir = tempfile::tempdir()?;
    let op = Operator::for_agents(dir.path(), 0).await?;
    write(dir.path(), FOUR)?;
    let agent = agent(dir.path(), op.grpc_addr, fake_maps()).await?;
    let admin = agent.running.admin_addr;
    until_some(WAIT, || all_programmed(admin, 4))
        .await
        .ok_or("programmed")?;
    let before = agent.maps.lock().entries.clone();

    write(
        dir.path(),
        "- {namespace: default, name: web-0, ips: [not-an-ip]",
    )?;
    let reported = until_some(WAIT, || async {
        let response = endpoints_api(admin).await.ok()?;
        response.source?.error
    })
    .await
    .ok_or("the failure is reported")?;
    assert!(
        reported.contains("endpoints.yaml: invalid YAML"),
        "{reported}"
    );
    let (status, readyz) = get(admin, "/readyz").await?;
    assert_eq!(status, 200, "still ready: {readyz}");
    assert!(readyz.contains("endpoints.yaml: invalid YAML"), "{readyz}");
    let (_, metrics) = get(admin, "/metrics").await?;
    assert!(
        metrics.contains("census_agent_source_errors_total{kind=\"parse\"} 1"),
        "{metrics}"
    );
    // A few full passes later, the datapath is as it was.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(agent.maps.lock().entries, before);
    assert_eq!(endpoints_api(admin).await?.endpoints.len(), 4);

    agent.running.shut_down().await;
    op.shut_down().await?;
    Ok(())
}

#[tokio::test]
async fn fail_static_while_the_operator_is_away() -> TestResult {
    let dir = tempfile::tempdir()?;
    let op = Operator::for_agents(dir.path(), 0).await?;
    let addr = op.grpc_addr;
    let ch = lazy_channel(addr)?;
    write(dir.path(), FOUR)?;
    let agent = agent(dir.path(), addr, fake_maps()).await?;
    let admin = agent.running.admin_addr;
    until_some(WAIT, || all_programmed(admin, 4))
        .await
        .ok_or("programmed")?;

    op.shut_down().await?;
    let response = until_some(WAIT, || async {
        endpoints_api(admin)
            .await
            .ok()
            .filter(|r| !r.operator.connected)
    })
    .await
    .ok_or("the agent notices")?;
    assert!(response.operator.error.is_some());
    let (status, readyz) = get(admin, "/readyz").await?;
    assert_eq!(status, 200, "still ready: {readyz}");
    assert!(readyz.contains("disconnected"), "{readyz}");

    // While it is away: web-1 goes, a web pod comes (a known identity: programmed at
    // once), and an api pod whose identity is new has to wait.
    let changed = FOUR.replace("- {namespace: default, name: web-1", "# ")
        + "- {namespace: default, name: web-2, ips: [198.18.5.2], labels: {app: web}, interface: veth5}\n"
        + "- {namespace: default, name: api-0, ips: [198.18.6.2], labels: {app: api}, interface: veth6}\n";
    write(dir.path(), &changed)?;
    let web = entry(&agent.maps, "198.18.1.2").ok_or("web-0")?.identity;
    let waiting = until_some(WAIT, || async {
        let response = endpoints_api(admin).await.ok()?;
        let state = |name: &str| {
            response
                .endpoints
                .iter()
                .find(|e| e.name == name)
                .map(|e| e.state)
        };
        (state("web-2") == Some(EndpointState::Programmed)
            && state("api-0") == Some(EndpointState::WaitingForIdentity))
        .then_some(())
    })
    .await;
    assert!(waiting.is_some(), "known identities need no operator");
    assert_eq!(
        entry(&agent.maps, "198.18.5.2"),
        Some(bpf::Endpoint::local(web))
    );
    assert_eq!(
        entry(&agent.maps, "198.18.6.2"),
        None,
        "waiting endpoints are not written"
    );
    assert_eq!(entry(&agent.maps, "198.18.2.2"), None);

    // The operator comes back on its store: the agent's snapshot is the truth.
    let op = Operator::for_agents(dir.path(), addr.port()).await?;
    until_some(WAIT, || all_programmed(admin, 5))
        .await
        .ok_or("api-0 got its identity")?;
    let truth = until_some(WAIT, || async {
        let n = node(&ch, "n1").await?;
        let web_refs = identity(&ch, web).await?.references;
        (n.connected && n.endpoints == 5 && web_refs == 2).then_some(())
    })
    .await;
    assert!(truth.is_some(), "the operator's view is the node's truth");
    let api = lookup(&ch, &[("app", "api")]).await.ok_or("api")?;
    assert_eq!(
        entry(&agent.maps, "198.18.6.2"),
        Some(bpf::Endpoint::local(api))
    );

    agent.running.shut_down().await;
    op.shut_down().await?;
    Ok(())
}

#[tokio::test]
async fn a_restarted_agent_keeps_identities_and_repairs_the_maps() -> TestResult {
    let dir = tempfile::tempdir()?;
    let op = Operator::for_agents(dir.path(), 0).await?;
    write(dir.path(), FOUR)?;
    let maps = fake_maps();
    let first = agent(dir.path(), op.grpc_addr, maps.clone()).await?;
    until_some(WAIT, || all_programmed(first.running.admin_addr, 4))
        .await
        .ok_or("programmed")?;
    first.running.shut_down().await;
    let before = maps.lock().entries.clone();
    let attaches = maps.lock().attaches;

    // Someone meddles with the maps while no agent runs.
    {
        let mut m = maps.lock();
        m.entries.insert(
            MapKey::from("198.18.3.2".parse::<IpAddr>()?),
            bpf::Endpoint::local(999),
        );
        m.entries.insert(
            MapKey::from("198.18.9.9".parse::<IpAddr>()?),
            bpf::Endpoint::local(998),
        );
    }
    let second = agent(dir.path(), op.grpc_addr, maps.clone()).await?;
    let repaired = until_some(WAIT, || async {
        (maps.lock().entries == before).then_some(())
    })
    .await;
    assert!(repaired.is_some(), "the full pass repaired the maps");
    until_some(WAIT, || all_programmed(second.running.admin_addr, 4))
        .await
        .ok_or("programmed")?;
    assert_eq!(maps.lock().entries, before, "no identity changed");
    assert_eq!(
        maps.lock().attaches,
        attaches + 4,
        "links adopted once each"
    );

    second.running.shut_down().await;
    op.shut_down().await?;
    Ok(())
}

#[tokio::test]
async fn the_health_listener_serves_probes_and_metrics_only_and_both_formats_lint() -> TestResult {
    let dir = tempfile::tempdir()?;
    let op = Operator::for_agents(dir.path(), 0).await?;
    write(dir.path(), FOUR)?;
    let options = Options {
        node: NodeName::new("n1")?,
        operator: format!("http://{}", op.grpc_addr),
        operator_auth: crate::client::OperatorAuth::default(),
        admin_listen: "127.0.0.1:0".parse()?,
        health_listen: Some("127.0.0.1:0".parse()?),
        admin_limits: census_daemon::http::AdminLimits::default(),
        reconcile_interval: Duration::from_millis(200),
        initial_backoff: Duration::from_millis(50),
        max_backoff: Duration::from_millis(300),
        session: new_session(),
        host_ips: HostIps::Fixed(["198.18.0.1".parse()?].into()),
        reassert_order: false,
        endpoint_map: true,
        drop_endpoint_deletes: false,
        node_hooks: None,
    };
    let source = FileSource::new(
        dir.path().join("endpoints.yaml"),
        Duration::from_millis(200),
    )?;
    let running = start(options, fake_maps(), None, Box::new(source)).await?;
    let admin = running.admin_addr;
    let health = running.health_addr.ok_or("no health listener")?;
    assert_ne!(health, admin);
    until_some(WAIT, || all_programmed(admin, 4))
        .await
        .ok_or("the endpoints were not programmed")?;

    for path in ["/healthz", "/readyz", "/metrics"] {
        assert_eq!(
            get(health, path).await?.0,
            200,
            "{path} on the health listener"
        );
        assert_eq!(
            get(admin, path).await?.0,
            200,
            "{path} on the admin listener"
        );
    }
    // The API the CLI reads, and the heap profiles, only on the admin listener.
    for path in [
        "/v1/endpoints",
        "/v1/flows",
        "/v1/version",
        "/debug/pprof/heap",
    ] {
        assert_eq!(
            get(health, path).await?.0,
            404,
            "{path} on the health listener"
        );
    }
    assert_eq!(get(admin, "/v1/endpoints").await?.0, 200);

    for addr in [admin, health] {
        let (text, open) = census_testkit::promlint::check_both_formats(addr).await?;
        let line = "census_agent_endpoints{state=\"programmed\"} 4";
        for body in [&text, &open] {
            assert!(body.lines().any(|l| l == line), "no {line:?} in\n{body}");
        }
    }
    running.shut_down().await;
    Ok(())
}

fn remote_entry(maps: &Arc<Mutex<FakeMaps>>, ip: &str) -> Option<bpf::Endpoint> {
    entry(maps, ip).filter(|e| e.remote_node().is_some())
}

/// Two agents on one operator: each writes the other node's endpoints REMOTE,
/// with the identity the other writes LOCAL and a node NODES names, keeps its own
/// LOCAL, and loses a remote endpoint once the other node deletes it.
#[tokio::test]
async fn each_agent_holds_the_other_nodes_endpoints() -> TestResult {
    let dir = tempfile::tempdir()?;
    let op = Operator::for_agents(dir.path(), 0).await?;
    let (d1, d2) = (dir.path().join("n1"), dir.path().join("n2"));
    std::fs::create_dir_all(&d1)?;
    std::fs::create_dir_all(&d2)?;
    write(
        &d1,
        "- {namespace: default, name: web-0, ips: [198.18.1.2], labels: {app: web}, interface: veth1}\n",
    )?;
    write(
        &d2,
        "- {namespace: default, name: db-0, ips: [198.18.2.2], labels: {app: db}, interface: veth2}\n",
    )?;
    let a1 = agent_on("n1", "198.18.0.1", &d1, op.grpc_addr, fake_maps(), true).await?;
    let a2 = agent_on("n2", "198.18.0.2", &d2, op.grpc_addr, fake_maps(), true).await?;

    let db = until_some(WAIT, || async { remote_entry(&a1.maps, "198.18.2.2") })
        .await
        .ok_or("n1 never wrote n2's db-0")?;
    let web = until_some(WAIT, || async { remote_entry(&a2.maps, "198.18.1.2") })
        .await
        .ok_or("n2 never wrote n1's web-0")?;
    let local_db = entry(&a2.maps, "198.18.2.2").ok_or("n2 has no entry for db-0")?;
    let local_web = entry(&a1.maps, "198.18.1.2").ok_or("n1 has no entry for web-0")?;
    assert_eq!(db.identity, local_db.identity);
    assert_eq!(web.identity, local_web.identity);
    assert_eq!(
        local_web.remote_node(),
        None,
        "its own endpoint stays local"
    );
    assert_ne!(db.identity, web.identity);
    let named = |maps: &Arc<Mutex<FakeMaps>>, e: bpf::Endpoint| {
        maps.lock()
            .nodes
            .get(&e.node)
            .map(|n| n.name.clone())
            .unwrap_or_default()
    };
    assert_eq!(named(&a1.maps, db), "n2");
    assert_eq!(named(&a2.maps, web), "n1");
    let (status, body) = get(a1.running.admin_addr, "/readyz").await?;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("endpoint map: connected"), "{body}");

    write(&d2, "[]\n")?;
    until_some(WAIT, || async {
        entry(&a1.maps, "198.18.2.2").is_none().then_some(())
    })
    .await
    .ok_or("n2's deleted endpoint stayed in n1's map")?;
    a1.running.shut_down().await;
    a2.running.shut_down().await;
    Ok(())
}

/// Checked: failing when the daemon does not tell the core it is local-only.
#[tokio::test]
async fn without_the_map_the_agent_is_local_only_and_says_so() -> TestResult {
    let dir = tempfile::tempdir()?;
    let op = Operator::for_agents(dir.path(), 0).await?;
    write(dir.path(), FOUR)?;
    let maps = fake_maps();
    // A previous run's remote entry and its node.
    maps.lock().entries.insert(
        MapKey::from("198.18.9.9".parse::<IpAddr>()?),
        bpf::Endpoint::remote(300, std::num::NonZeroU16::MIN),
    );
    maps.lock().nodes.insert(
        1,
        bpf::NodeRecord {
            name: "n9".to_owned(),
            addresses: Vec::new(),
        },
    );
    let a = agent_on("n1", "198.18.0.1", dir.path(), op.grpc_addr, maps, false).await?;
    until_some(WAIT, || async {
        let maps = a.maps.lock();
        (!maps
            .entries
            .contains_key(&MapKey::from(IpAddr::from([198, 18, 9, 9])))
            && maps.nodes.is_empty())
        .then_some(())
    })
    .await
    .ok_or("the previous run's remote entry stayed")?;
    let (_, body) = get(a.running.admin_addr, "/readyz").await?;
    assert!(body.contains("endpoint map: off"), "{body}");
    a.running.shut_down().await;
    Ok(())
}

fn services_of(maps: &Arc<Mutex<FakeMaps>>) -> Vec<(String, ServiceKind)> {
    maps.lock()
        .services
        .iter()
        .map(|(range, kind)| (range.to_string(), *kind))
        .collect()
}

/// The operator's `--service-cidr` reaches SERVICES (through HelloReply without the
/// endpoint map, and through the map stream with it, which also carries each
/// change); what a previous run left that the set lacks goes.
#[tokio::test]
async fn the_operators_service_addresses_become_services() -> TestResult {
    let dir = tempfile::tempdir()?;
    let op = Operator::start_in(
        dir.path(),
        &[
            "--grpc-listen",
            "127.0.0.1:0",
            "--snapshot-interval",
            "1s",
            "--service-cidr",
            "10.96.0.0/12,fd00:10:96::/108",
        ],
    )
    .await?;
    let want = vec![
        ("10.96.0.0/12".to_owned(), ServiceKind::ClusterIpRange),
        ("fd00:10:96::/108".to_owned(), ServiceKind::ClusterIpRange),
    ];
    let (d1, d2) = (dir.path().join("n1"), dir.path().join("n2"));
    std::fs::create_dir_all(&d1)?;
    std::fs::create_dir_all(&d2)?;
    write(&d1, "[]\n")?;
    write(&d2, "[]\n")?;
    // A previous run's entry, in neither set.
    let stale = fake_maps();
    stale
        .lock()
        .services
        .insert("192.0.2.0/24".parse()?, ServiceKind::ExternalIp);
    let mapped = agent_on("n1", "198.18.0.1", &d1, op.grpc_addr, stale, true).await?;
    let local = agent_on("n2", "198.18.0.2", &d2, op.grpc_addr, fake_maps(), false).await?;
    for (agent, how) in [(&mapped, "with the map"), (&local, "without the map")] {
        until_some(WAIT, || async {
            (services_of(&agent.maps) == want).then_some(())
        })
        .await
        .ok_or_else(|| format!("{how}: SERVICES is {:?}", services_of(&agent.maps)))?;
    }

    // The set changes: the map stream carries it.
    let changed: census_proto::domain::ServiceSet = [
        ("10.96.0.0/12".parse()?, ServiceKind::ClusterIpRange),
        ("203.0.113.7/32".parse()?, ServiceKind::LoadBalancerIp),
    ]
    .into_iter()
    .collect();
    assert!(op.running().runtime.set_services(changed));
    let want = vec![
        ("10.96.0.0/12".to_owned(), ServiceKind::ClusterIpRange),
        ("203.0.113.7/32".to_owned(), ServiceKind::LoadBalancerIp),
    ];
    until_some(WAIT, || async {
        (services_of(&mapped.maps) == want).then_some(())
    })
    .await
    .ok_or_else(|| format!("the change: SERVICES is {:?}", services_of(&mapped.maps)))?;

    // Changed behind the agent's back: the full pass repairs it.
    mapped.maps.lock().services.clear();
    until_some(WAIT, || async {
        (services_of(&mapped.maps) == want).then_some(())
    })
    .await
    .ok_or("the full pass did not repair SERVICES")?;
    mapped.running.shut_down().await;
    local.running.shut_down().await;
    op.shut_down().await
}

/// The node's own hooks are attached at start and put back by the full pass: a
/// tunnel device that appears later gets the uplink program, a socket link
/// removed under the agent comes back. While one is missing the agent stays
/// Ready and `/readyz` and `/v1/endpoints` say which and why.
#[tokio::test]
async fn missing_node_hooks_are_attached_by_the_full_pass_and_reported_meanwhile() -> TestResult {
    let dir = tempfile::tempdir()?;
    let op = Operator::for_agents(dir.path(), 0).await?;
    write(dir.path(), FOUR)?;
    let maps = fake_maps();
    {
        let mut maps = maps.lock();
        maps.cgroup2_root = Some("/sys/fs/cgroup".into());
        // Listed as an uplink, but not there yet.
        maps.default_uplinks.insert("vxlan0".to_owned());
    }
    let hooks = NodeHooks::default();
    let agent = agent_with(
        "n1",
        "198.18.0.1",
        dir.path(),
        op.grpc_addr,
        maps.clone(),
        true,
        Some(hooks),
    )
    .await?;
    let admin = agent.running.admin_addr;
    until_some(WAIT, || all_programmed(admin, 4))
        .await
        .ok_or("programmed")?;
    assert_eq!(
        maps.lock().sockets.as_deref(),
        Some(Path::new("/sys/fs/cgroup")),
        "the socket program attached at start"
    );
    let (status, readyz) = until_some(WAIT, || async {
        get(admin, "/readyz")
            .await
            .ok()
            .filter(|(_, body)| body.contains("uplink vxlan0"))
    })
    .await
    .ok_or(format!(
        "readyz names the missing uplink: {:?}",
        get(admin, "/readyz").await?
    ))?;
    assert_eq!(status, 200, "still ready: {readyz}");
    assert!(
        readyz.contains("datapath: uplink vxlan0 is not attached (interface vxlan0")
            && readyz.contains("Service requests leaving the node by it go uncounted"),
        "{readyz}"
    );
    let listed = endpoints_api(admin).await?;
    let datapath = listed.datapath.ok_or("no datapath status")?;
    assert_eq!(datapath.missing_hooks.len(), 1, "{datapath:?}");
    assert_eq!(datapath.missing_hooks[0].hook, "uplink vxlan0");

    // The device appears: the next full pass attaches it, and the report goes.
    maps.lock().interfaces.insert("vxlan0".to_owned());
    until_some(WAIT, || async {
        get(admin, "/readyz")
            .await
            .ok()
            .filter(|(_, body)| !body.contains("uplink vxlan0"))
    })
    .await
    .ok_or("the uplink attached")?;
    assert!(
        matches!(
            maps.lock().uplink_links.get("vxlan0"),
            Some(bpf::AttachmentState::Attached { .. })
        ),
        "{:?}",
        maps.lock().uplink_links
    );
    assert_eq!(
        maps.lock().uplink_attaches,
        1,
        "attached once, then left alone"
    );

    // The socket program's link removed under the agent: attached again.
    maps.lock().sockets = None;
    until_some(WAIT, || async {
        maps.lock().sockets.is_some().then_some(())
    })
    .await
    .ok_or("the socket program attached again")?;
    assert_eq!(maps.lock().sockets_attaches, 2);

    agent.running.shut_down().await;
    op.shut_down().await?;
    Ok(())
}
