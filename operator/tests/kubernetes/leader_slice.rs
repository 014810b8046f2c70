//! How agents find the leader: the one EndpointSlice of the selector-less
//! `census-operator-leader` Service, which the leader writes (conditionally) with its
//! pod IP and gRPC port, re-asserts over a crashed predecessor's address, and empties
//! when it steps down; no replica ever writes to a pod.

use std::net::SocketAddr;

use census_fake_apiserver::{FakeApiServer, Gvr, RequestFilter, Verb};
use census_operator::replica::Role;
use serde_json::{Value, json};

use crate::{
    common::{TestResult, WAIT, eventually, fail, fake},
    operator::{NAMESPACE, replica_args, seed_cluster, start_replica, until_leader},
};

pub(crate) const LEADER_SLICE: &str = "census-operator-leader";

pub(crate) fn endpointslices() -> Gvr {
    Gvr::new("discovery.k8s.io", "v1", "endpointslices")
}

pub(crate) fn leader_slice(server: &FakeApiServer) -> Option<Value> {
    server.get(&endpointslices(), Some(NAMESPACE), LEADER_SLICE)
}

/// The pod and `ip:port` the leader slice names, `None` if it names nobody; an error
/// if it names more than one endpoint or is malformed.
pub(crate) fn slice_leader(server: &FakeApiServer) -> TestResult<Option<(String, SocketAddr)>> {
    let Some(slice) = leader_slice(server) else {
        return Ok(None);
    };
    let endpoints = slice["endpoints"].as_array().cloned().unwrap_or_default();
    match endpoints.as_slice() {
        [] => Ok(None),
        [one] => {
            let ip: std::net::IpAddr = one["addresses"][0]
                .as_str()
                .ok_or(format!("no address in {slice}"))?
                .parse()?;
            let port = slice["ports"][0]["port"]
                .as_u64()
                .ok_or(format!("no port in {slice}"))?;
            let pod = one["targetRef"]["name"]
                .as_str()
                .ok_or(format!("no targetRef in {slice}"))?;
            Ok(Some((
                pod.to_owned(),
                SocketAddr::new(ip, u16::try_from(port)?),
            )))
        }
        _ => fail(format!("the leader slice names several endpoints: {slice}")),
    }
}

/// Whether the leader slice names `pod` (and only it).
pub(crate) fn slice_names(server: &FakeApiServer, pod: &str) -> bool {
    matches!(slice_leader(server), Ok(Some((p, _))) if p == pod)
}

/// A slice as another replica of census left it.
fn slice_of(pod: &str, ip: &str, port: u16) -> Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": LEADER_SLICE,
            "namespace": NAMESPACE,
            "labels": {
                "kubernetes.io/service-name": LEADER_SLICE,
                "endpointslice.kubernetes.io/managed-by": "census-operator.census.dev",
            },
        },
        "addressType": "IPv4",
        "endpoints": [{
            "addresses": [ip],
            "conditions": {"ready": true, "serving": true, "terminating": false},
            "targetRef": {"kind": "Pod", "namespace": NAMESPACE, "name": pod},
        }],
        "ports": [{"name": "grpc", "port": port, "protocol": "TCP"}],
    })
}

/// No request of the operator reached a pod: it has no access to them.
pub(crate) fn no_pod_requests(server: &FakeApiServer) -> TestResult {
    let log = server.requests();
    let pods: Vec<String> = log
        .all()
        .iter()
        .filter(|r| r.resource == "pods")
        .map(|r| format!("{} {:?}", r.verb.as_str(), r.name))
        .collect();
    assert!(pods.is_empty(), "requests to pods: {pods:?}");
    Ok(())
}

/// The Lease, taken by `holder` for an hour.
fn give_lease_to(server: &FakeApiServer, holder: &str) -> TestResult {
    server.modify(
        &Gvr::new("coordination.k8s.io", "v1", "leases"),
        Some(NAMESPACE),
        "census-operator",
        |l| {
            l["spec"]["holderIdentity"] = json!(holder);
            l["spec"]["leaseDurationSeconds"] = json!(3600);
        },
    )?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_publishes_itself_over_a_crashed_predecessor_and_steps_off() -> TestResult {
    let server = fake().await?;
    seed_cluster(&server, &["op-a"])?;
    // A predecessor that crashed while leading left its address behind.
    server.insert(slice_of("op-old", "10.1.2.3", 9460))?;
    // Someone writes the slice between the new leader's read and its write.
    server.faults().conflict_next(
        RequestFilter::object(&endpointslices(), Some(NAMESPACE), LEADER_SLICE).verb(Verb::Update),
        1,
    );
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    server.write_kubeconfig(&kubeconfig)?;
    let op = start_replica(&kubeconfig, "op-a").await?;
    until_leader(&op).await?;
    eventually("the leader publishes itself", WAIT, || async {
        Ok(slice_names(&server, "op-a").then_some(()))
    })
    .await?;
    let written = leader_slice(&server).ok_or("no slice")?;
    assert_eq!(
        written["metadata"]["labels"],
        json!({
            "kubernetes.io/service-name": LEADER_SLICE,
            "endpointslice.kubernetes.io/managed-by": "census-operator.census.dev",
        })
    );
    assert_eq!(written["addressType"], "IPv4");
    assert_eq!(
        written["endpoints"],
        json!([{
            "addresses": ["127.0.0.1"],
            "conditions": {"ready": true, "serving": true, "terminating": false},
            "targetRef": {"kind": "Pod", "namespace": NAMESPACE, "name": "op-a"},
        }])
    );
    assert_eq!(
        written["ports"],
        json!([{"name": "grpc", "port": op.grpc_addr.port(), "protocol": "TCP"}])
    );
    assert_eq!(
        slice_leader(&server)?.map(|(_, addr)| addr),
        Some(op.grpc_addr)
    );
    // Conditional writes: the 409 was re-read, then written on the new version. (The
    // follower it started as read the slice too, and left op-old's address alone.)
    let log = server.requests();
    let calls: Vec<(Verb, u16)> = log
        .all()
        .iter()
        .filter(|r| r.resource == "endpointslices")
        .map(|r| (r.verb, r.code))
        .collect();
    assert!(
        calls.ends_with(&[
            (Verb::Get, 200),
            (Verb::Update, 409),
            (Verb::Get, 200),
            (Verb::Update, 200)
        ]) && calls.iter().filter(|(v, _)| v.is_write()).count() == 2,
        "{calls:?}"
    );

    // Another replica takes the Lease: this one steps down and empties the slice.
    give_lease_to(&server, "op-z")?;
    eventually("the leader steps down", WAIT, || async {
        Ok((!op.running().runtime.role().is_leader()).then_some(()))
    })
    .await?;
    eventually("the replica takes itself off the slice", WAIT, || async {
        Ok(leader_slice(&server)
            .filter(|s| s["endpoints"].as_array().is_some_and(Vec::is_empty))
            .map(|_| ()))
    })
    .await?;
    let emptied = leader_slice(&server).ok_or("no slice")?;
    assert_eq!(emptied["metadata"]["labels"], written["metadata"]["labels"]);
    op.shut_down().await?;
    no_pod_requests(&server)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_follower_takes_its_stale_address_off_and_leaves_others_alone() -> TestResult {
    let server = fake().await?;
    seed_cluster(&server, &["op-a"])?;
    // op-b crashed while leading; op-z holds the Lease now, for an hour.
    server.insert(slice_of("op-b", "127.0.0.1", 9460))?;
    server.insert(json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "census-operator", "namespace": NAMESPACE},
        "spec": {"holderIdentity": "op-z", "leaseDurationSeconds": 3600},
    }))?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    server.write_kubeconfig(&kubeconfig)?;

    // op-a follows, and leaves another replica's address alone (its shutdown takes
    // only its own address off).
    let a = start_replica(&kubeconfig, "op-a").await?;
    eventually("op-a follows op-z", WAIT, || async {
        Ok(matches!(
            a.running().runtime.role(),
            Role::Follower { leader: Some(l) } if l.name == "op-z"
        )
        .then_some(()))
    })
    .await?;
    a.shut_down().await?;
    assert!(slice_names(&server, "op-b"), "op-a erased op-b's address");
    let log = server.requests();
    assert!(
        !log.all()
            .iter()
            .any(|r| r.resource == "endpointslices" && r.verb.is_write()),
        "a follower wrote the slice"
    );

    // op-a restarts (same pod, same IP) after crashing while it led: it takes its
    // address off at start, as a follower.
    server.modify(&endpointslices(), Some(NAMESPACE), LEADER_SLICE, |s| {
        s["endpoints"] = slice_of("op-a", "127.0.0.1", 9460)["endpoints"].clone();
    })?;
    let a = start_replica(&kubeconfig, "op-a").await?;
    eventually("the stale address is gone", WAIT, || async {
        Ok(slice_leader(&server)?.is_none().then_some(()))
    })
    .await?;
    assert!(!a.running().runtime.role().is_leader());
    a.shut_down().await?;
    no_pod_requests(&server)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_service_account_is_reported() -> TestResult {
    let server = fake().await?;
    seed_cluster(&server, &["op-a"])?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    server.write_kubeconfig(&kubeconfig)?;
    let mut args = replica_args(&kubeconfig, "op-a", &[]);
    args.extend([
        "--agent-service-account".to_owned(),
        "census-agent/census-agent".to_owned(),
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let op = census_testkit::Operator::start(&args).await?;
    let account = op
        .running()
        .cluster
        .as_ref()
        .map(|c| &c.agent_service_account)
        .map(ToString::to_string);
    assert_eq!(account.as_deref(), Some("census-agent/census-agent"));
    let (status, body) = eventually("the replica is ready", WAIT, || async {
        let (status, _, body) = census_testkit::http_get(op.admin_addr, "/readyz").await?;
        Ok((status == 200).then_some((status, body)))
    })
    .await?;
    assert_eq!(status, 200);
    assert!(
        body.contains("agents' ServiceAccount census-agent/census-agent"),
        "{body}"
    );
    op.shut_down().await?;
    Ok(())
}
