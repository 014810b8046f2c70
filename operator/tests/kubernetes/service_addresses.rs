//! The cluster's Service addresses reach agents: `--service-cidr`, the ServiceCIDR
//! objects' ranges and the Services' LoadBalancer and external IPs, as one set, in
//! HelloReply and on the endpoint map stream (in its first batch, and again in
//! whole after every change).

use census_fake_apiserver::Gvr;
use census_proto::{
    PROTOCOL_VERSION,
    convert::services_from_wire,
    domain::{ServiceKind, ServiceSet},
    pb::{
        self, agent_message::Body, endpoint_map_client::EndpointMapClient,
        endpoint_sync_client::EndpointSyncClient, operator_message,
    },
};
use census_testkit::Operator;
use serde_json::json;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

use crate::{
    common::{TestResult, WAIT, eventually, fail, fake},
    operator::{channel, replica_args, seed_cluster, session, until_leader},
};

fn set(ranges: &[(&str, ServiceKind)]) -> TestResult<ServiceSet> {
    let mut set = ServiceSet::new();
    for (text, kind) in ranges {
        set.insert(text.parse()?, *kind);
    }
    Ok(set)
}

/// The ranges of a set the operator sent (`names`: its named ClusterIPs, as
/// `address namespace/name port/protocol,...`); malformed entries fail the test.
fn decoded(wire: Option<&pb::ServiceSet>) -> TestResult<ServiceSet> {
    Ok(decoded_named(wire)?.0)
}

fn decoded_named(wire: Option<&pb::ServiceSet>) -> TestResult<(ServiceSet, Vec<String>)> {
    let wire = wire.ok_or("no services in the message")?;
    let (set, refused) = services_from_wire(wire, "services")?;
    if !refused.is_empty() {
        return fail(format!("the operator sent malformed entries: {refused:?}"));
    }
    Ok((ranges(&set), names(&set)))
}

/// The set's ranges alone.
fn ranges(set: &ServiceSet) -> ServiceSet {
    set.iter().collect()
}

/// The set's named ClusterIPs, `address namespace/name port/protocol,...`.
fn names(set: &ServiceSet) -> Vec<String> {
    set.cluster_ips()
        .map(|(address, service)| {
            let ports: Vec<String> = service
                .ports
                .iter()
                .map(|p| format!("{}/{}", p.port, p.protocol))
                .collect();
            format!("{address} {} {}", service.key, ports.join(","))
        })
        .collect()
}

/// Hello as `node`; the HelloReply, and the stream (kept open: the session stays
/// current while it is).
async fn hello(
    op: &Operator,
    node: &str,
) -> TestResult<(
    pb::HelloReply,
    mpsc::Sender<pb::AgentMessage>,
    Streaming<pb::OperatorMessage>,
)> {
    let (tx, rx) = mpsc::channel(8);
    tx.send(pb::AgentMessage {
        seq: 0,
        body: Some(Body::Hello(pb::Hello {
            protocol_version: PROTOCOL_VERSION,
            node: node.into(),
            session: Some(session(1)),
            agent_version: "test".into(),
            addresses: Vec::new(),
        })),
    })
    .await?;
    let mut client = EndpointSyncClient::new(channel(op.grpc_addr).await?);
    let mut inbound = tokio::time::timeout(WAIT, client.sync(ReceiverStream::new(rx)))
        .await??
        .into_inner();
    match tokio::time::timeout(WAIT, inbound.message()).await?? {
        Some(pb::OperatorMessage {
            body: Some(operator_message::Body::HelloReply(reply)),
        }) => Ok((reply, tx, inbound)),
        other => fail(format!("expected HelloReply, got {other:?}")),
    }
}

/// The next batch of the map stream that carries Service addresses.
/// `node`'s EndpointMap watch and its first batch.
async fn watch_map(
    op: &Operator,
    node: &str,
) -> TestResult<(Streaming<pb::EndpointMapBatch>, pb::EndpointMapBatch)> {
    let mut client = EndpointMapClient::new(channel(op.grpc_addr).await?);
    let mut map = client
        .watch(pb::EndpointMapWatchRequest {
            protocol_version: PROTOCOL_VERSION,
            node: node.into(),
            session: Some(session(1)),
        })
        .await?
        .into_inner();
    let first = tokio::time::timeout(WAIT, map.message())
        .await??
        .ok_or("the map stream ended")?;
    Ok((map, first))
}

async fn next_named_services(
    map: &mut Streaming<pb::EndpointMapBatch>,
) -> TestResult<(ServiceSet, Vec<String>)> {
    loop {
        let batch = tokio::time::timeout(WAIT, map.message())
            .await??
            .ok_or("the map stream ended")?;
        if batch.services.is_some() {
            return decoded_named(batch.services.as_ref());
        }
    }
}

async fn next_services(map: &mut Streaming<pb::EndpointMapBatch>) -> TestResult<ServiceSet> {
    loop {
        let batch = tokio::time::timeout(WAIT, map.message())
            .await??
            .ok_or("the map stream ended")?;
        if batch.services.is_some() {
            return decoded(batch.services.as_ref());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_addresses_reach_agents_and_follow_the_objects() -> TestResult {
    let server = fake().await?;
    seed_cluster(&server, &["op-a"])?;
    server.insert(json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
        "metadata": {"name": "kubernetes"},
        "spec": {"cidrs": ["10.96.0.0/12", "fd00:10:96::/112"]},
    }))?;
    server.insert(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {"ports": [{"port": 80}], "externalIPs": ["198.51.100.7"]},
        "status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.1"}]}},
    }))?;
    server.insert(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "db", "namespace": "default"},
        "spec": {"ports": [{"port": 5432}], "clusterIP": "10.96.0.20"},
    }))?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    server.write_kubeconfig(&kubeconfig)?;
    let mut args = replica_args(&kubeconfig, "op-a", &[]);
    // Also a range the API server does not have, and one the ServiceCIDR has too.
    args.extend([
        "--service-cidr".to_owned(),
        "10.0.0.0/16,10.96.0.0/12".to_owned(),
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let op = Operator::start(&args).await?;
    until_leader(&op).await?;

    let want = set(&[
        ("10.0.0.0/16", ServiceKind::ClusterIpRange),
        ("10.96.0.0/12", ServiceKind::ClusterIpRange),
        ("fd00:10:96::/112", ServiceKind::ClusterIpRange),
        ("198.51.100.7/32", ServiceKind::ExternalIp),
        ("203.0.113.1/32", ServiceKind::LoadBalancerIp),
    ])?;
    eventually(
        "the operator has listed the Service addresses",
        WAIT,
        || async {
            let have = op.running().runtime.services().map(|set| ranges(&set));
            Ok((have.as_ref() == Some(&want)).then_some(()))
        },
    )
    .await?;
    // A Service without an address is not kept.
    let cluster = op.running().cluster.as_ref().ok_or("no cluster side")?;
    assert_eq!(cluster.services.services_with_addresses(), 1);

    let (reply, _tx, _inbound) = hello(&op, "node-1").await?;
    // db's ClusterIP is named with its port (TCP when none is said); web has
    // none (the fake API server allocates no ClusterIP).
    assert_eq!(
        decoded_named(reply.services.as_ref())?,
        (
            want.clone(),
            vec!["10.96.0.20 default/db 5432/6".to_owned()]
        ),
        "HelloReply"
    );

    let (mut map, first) = watch_map(&op, "node-1").await?;
    assert!(first.resync_start);
    assert_eq!(
        decoded(first.services.as_ref())?,
        want,
        "the full map's first batch"
    );

    // A LoadBalancer IP changes (on /status, as a cloud controller writes it).
    let services = Gvr::new("", "v1", "services");
    server.modify(&services, Some("default"), "web", |o| {
        o["status"]["loadBalancer"]["ingress"] = json!([{"ip": "203.0.113.9"}]);
    })?;
    let want = set(&[
        ("10.0.0.0/16", ServiceKind::ClusterIpRange),
        ("10.96.0.0/12", ServiceKind::ClusterIpRange),
        ("fd00:10:96::/112", ServiceKind::ClusterIpRange),
        ("198.51.100.7/32", ServiceKind::ExternalIp),
        ("203.0.113.9/32", ServiceKind::LoadBalancerIp),
    ])?;
    assert_eq!(
        next_services(&mut map).await?,
        want,
        "after the LoadBalancer IP changed"
    );

    // The ServiceCIDR goes: its ranges go, but not the one --service-cidr names too.
    server.delete(
        &Gvr::new("networking.k8s.io", "v1", "servicecidrs"),
        None,
        "kubernetes",
    );
    let want = set(&[
        ("10.0.0.0/16", ServiceKind::ClusterIpRange),
        ("10.96.0.0/12", ServiceKind::ClusterIpRange),
        ("198.51.100.7/32", ServiceKind::ExternalIp),
        ("203.0.113.9/32", ServiceKind::LoadBalancerIp),
    ])?;
    assert_eq!(
        next_services(&mut map).await?,
        want,
        "after the ServiceCIDR went"
    );

    // The Service goes: its addresses go.
    server.delete(&services, Some("default"), "web");
    let want = set(&[
        ("10.0.0.0/16", ServiceKind::ClusterIpRange),
        ("10.96.0.0/12", ServiceKind::ClusterIpRange),
    ])?;
    assert_eq!(
        next_services(&mut map).await?,
        want,
        "after the Service went"
    );
    assert_eq!(cluster.services.services_with_addresses(), 0);

    // The watches asked for exactly these resources, cluster-wide.
    let log = server.requests();
    let watched: Vec<String> = log
        .iter()
        .filter(|r| r.resource == "servicecidrs" || r.resource == "services")
        .filter(|r| r.namespace.is_none())
        .map(|r| format!("{} {}", r.verb.as_str(), r.resource))
        .collect();
    for needed in [
        "list services",
        "watch services",
        "list servicecidrs",
        "watch servicecidrs",
    ] {
        assert!(watched.iter().any(|w| w == needed), "{needed}: {watched:?}");
    }
    op.shut_down().await
}

/// The same on a real control plane (a private one: its operator leads): the
/// cluster's own ServiceCIDR (`kubernetes`, from `--service-cluster-ip-range`), a
/// Service with an external IP whose LoadBalancer IP is written on `/status`, then
/// changed, then the Service deleted; each change a batch of the whole set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_addresses_follow_the_objects_on_the_real_control_plane() -> TestResult {
    let private = census_testkit::cluster::Private::start("service-addresses")?;
    let plane = &private.0;
    census_testkit::cluster::apply_crd(plane)?;
    plane.apply(&json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {"type": "LoadBalancer", "ports": [{"port": 80}], "externalIPs": ["198.51.100.7"]},
    }))?;
    let lb = |ip: &str| -> TestResult {
        let patch = json!({"status": {"loadBalancer": {"ingress": [{"ip": ip}]}}}).to_string();
        plane.kubectl_ok(&[
            "-n",
            "default",
            "patch",
            "service",
            "web",
            "--subresource=status",
            "--type=merge",
            "-p",
            &patch,
        ])?;
        Ok(())
    };
    lb("203.0.113.1")?;
    let mut args = replica_args(
        &plane.kubeconfig(),
        "op-a",
        &[("--namespace", "default"), ("--pod-ip", "198.18.255.4")],
    );
    args.extend(["--service-cidr".to_owned(), "10.0.0.0/16".to_owned()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let op = Operator::start(&args).await?;
    until_leader(&op).await?;
    let range = census_cluster_service_range();
    let want = set(&[
        ("10.0.0.0/16", ServiceKind::ClusterIpRange),
        (range, ServiceKind::ClusterIpRange),
        ("198.51.100.7/32", ServiceKind::ExternalIp),
        ("203.0.113.1/32", ServiceKind::LoadBalancerIp),
    ])?;
    eventually(
        "the operator has listed the Service addresses",
        WAIT,
        || async {
            let have = op.running().runtime.services().map(|set| ranges(&set));
            Ok((have.as_ref() == Some(&want)).then_some(()))
        },
    )
    .await?;
    let (reply, _tx, _inbound) = hello(&op, "kwok-0").await?;
    let web_ip =
        plane.kubectl_json(&["-n", "default", "get", "service", "web"])?["spec"]["clusterIP"]
            .as_str()
            .ok_or("web has no ClusterIP")?
            .to_owned();
    let (have, named) = decoded_named(reply.services.as_ref())?;
    assert_eq!(have, want, "HelloReply");
    // The API server's own Service and web, each at its ClusterIP with its port.
    let web = format!("{web_ip} default/web 80/6");
    assert!(named.contains(&web), "{web} in {named:?}");
    assert!(
        named
            .iter()
            .any(|n| n.ends_with(" default/kubernetes 443/6")),
        "default/kubernetes in {named:?}"
    );
    let (mut map, first) = watch_map(&op, "kwok-0").await?;
    assert_eq!(
        decoded(first.services.as_ref())?,
        want,
        "the full map's first batch"
    );

    lb("203.0.113.9")?;
    let want = set(&[
        ("10.0.0.0/16", ServiceKind::ClusterIpRange),
        (range, ServiceKind::ClusterIpRange),
        ("198.51.100.7/32", ServiceKind::ExternalIp),
        ("203.0.113.9/32", ServiceKind::LoadBalancerIp),
    ])?;
    assert_eq!(
        next_services(&mut map).await?,
        want,
        "after the LoadBalancer IP changed"
    );

    plane.kubectl_ok(&["-n", "default", "delete", "service", "web"])?;
    let want = set(&[
        ("10.0.0.0/16", ServiceKind::ClusterIpRange),
        (range, ServiceKind::ClusterIpRange),
    ])?;
    let gone = next_named_services(&mut map).await?;
    assert_eq!(gone.0, want, "after the Service went");
    assert!(
        !gone.1.iter().any(|n| n.contains("default/web")),
        "web no longer named: {:?}",
        gone.1
    );
    op.shut_down().await
}

/// The Service range census-cluster gives the API server.
fn census_cluster_service_range() -> &'static str {
    census_testkit::cluster::SERVICE_CIDR
}
