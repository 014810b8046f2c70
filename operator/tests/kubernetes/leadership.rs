//! Terms of one replica against the fake: a 409 on the Lease is re-read and retried
//! within the renew deadline (only another holder ends the term), and a new leader
//! builds its core from the index its watch synced, not from a second list.

use std::path::Path;

use census_fake_apiserver::{FakeApiServer, Gvr, RequestFilter, Verb};
use census_operator::replica::Role;
use census_proto::{PROTOCOL_VERSION, pb};
use census_testkit::Operator;
use serde_json::json;

use crate::{
    common::{TestResult, WAIT, binding, eventually, fake, labels},
    operator::{Agent, NAMESPACE, allocate, channel, replica_args, seed_cluster, session},
};

async fn start_leader(server: &FakeApiServer, dir: &Path) -> TestResult<Operator> {
    let kubeconfig = dir.join("kubeconfig");
    server.write_kubeconfig(&kubeconfig)?;
    let args = replica_args(&kubeconfig, "op-a", &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let op = Operator::start(&args).await?;
    eventually("the replica leads", WAIT, || async {
        Ok(op.running().runtime.role().is_leader().then_some(()))
    })
    .await?;
    Ok(op)
}

fn lease_updates() -> RequestFilter {
    RequestFilter::object(
        &Gvr::new("coordination.k8s.io", "v1", "leases"),
        Some(NAMESPACE),
        "census-operator",
    )
    .verb(Verb::Update)
}

/// Waits until a renewal answered 409 (injected or not, as `injected` says) was
/// followed by one answered 200.
async fn renewed_after_a_conflict(server: &FakeApiServer, injected: bool) -> TestResult {
    eventually("a renewal succeeds after the 409", WAIT, || async {
        let log = server.requests().matching(&lease_updates());
        let conflict = log
            .iter()
            .position(|r| r.code == 409 && r.injected == injected);
        Ok(conflict.and_then(|i| log[i + 1..].iter().any(|r| r.code == 200).then_some(())))
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conflict_on_the_lease_is_read_again_and_the_term_goes_on() -> TestResult {
    let server = fake().await?;
    seed_cluster(&server, &["op-a"])?;
    let dir = tempfile::tempdir()?;
    let op = start_leader(&server, dir.path()).await?;
    let runtime = op.running().runtime.clone();
    let term = *runtime.terms().borrow();
    let mut agent = Agent::connect(op.grpc_addr, "node-1", session(1)).await??;
    allocate(op.grpc_addr, "node-1", session(1), "web").await??;

    // A 409 with nothing changed, then an edit between the leader's GET and its PUT
    // (an annotation really added: the PUT's resourceVersion is stale).
    server.clear_requests();
    server.faults().conflict_next(lease_updates(), 1);
    renewed_after_a_conflict(&server, true).await?;
    server.faults().touch_before_write(lease_updates(), 1);
    renewed_after_a_conflict(&server, false).await?;

    assert!(runtime.role().is_leader(), "still the leader");
    assert_eq!(*runtime.terms().borrow(), term, "the same term");
    // The term's writers and streams go on: the agent's stream is open, and an
    // allocation is written.
    assert!(
        agent.snapshot(&[]).await?.is_ok(),
        "the agent's stream is open"
    );
    let db = allocate(op.grpc_addr, "node-1", session(1), "db").await??;
    eventually("the new identity is written", WAIT, || async {
        Ok(crate::common::object(&server, db).map(|_| ()))
    })
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lease_taken_by_another_holder_ends_the_term() -> TestResult {
    let server = fake().await?;
    seed_cluster(&server, &["op-a"])?;
    let dir = tempfile::tempdir()?;
    let op = start_leader(&server, dir.path()).await?;
    let runtime = op.running().runtime.clone();
    let term = *runtime.terms().borrow();
    let mut terms = runtime.terms();
    // Another replica holds it now (its renewal just happened).
    let now = serde_json::to_value(k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
        k8s_openapi::jiff::Timestamp::now(),
    ))?;
    server.modify(
        &Gvr::new("coordination.k8s.io", "v1", "leases"),
        Some(NAMESPACE),
        "census-operator",
        |lease| {
            lease["spec"]["holderIdentity"] = json!("op-z");
            lease["spec"]["renewTime"] = now.clone();
        },
    )?;
    tokio::time::timeout(WAIT, terms.wait_for(|t| *t != term))
        .await
        .map_err(|_| "the term did not end")??;
    // The next term is a follower's, pointing at the new holder (unless op-z's Lease
    // has expired already and op-a took it back, in a term after that).
    let role = runtime.role();
    assert!(
        match &role {
            Role::Follower { leader } => leader.as_ref().is_some_and(|l| l.name == "op-z"),
            Role::Leader => *runtime.terms().borrow() > term + 1,
        },
        "{role:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_builds_its_core_from_the_index_without_a_second_list() -> TestResult {
    let server = fake().await?;
    seed_cluster(&server, &["op-a"])?;
    for (n, app) in [(300, "web"), (301, "db"), (302, "cache")] {
        server.insert(binding(n, &labels(app)))?;
    }
    let dir = tempfile::tempdir()?;
    let op = start_leader(&server, dir.path()).await?;

    // The core has what the watch listed, as loaded: kept by the restart protection
    // (a follower's read model would say LIVE).
    let mut ids =
        pb::identity_service_client::IdentityServiceClient::new(channel(op.grpc_addr).await?);
    for id in [300, 301, 302] {
        let got = ids
            .get(pb::GetRequest {
                protocol_version: PROTOCOL_VERSION,
                id,
            })
            .await?
            .into_inner();
        assert_eq!(got.state, i32::from(pb::IdentityState::Protected), "{id}");
    }
    // One list of the identities: the watch's own (then it watches from there). The
    // start-up check that the CRD is installed reads one object's metadata (limit=1).
    let lists: Vec<_> = server
        .requests()
        .lists_of("identities")
        .into_iter()
        .filter(|r| r.param("limit") != Some("1"))
        .collect();
    assert_eq!(
        lists.len(),
        1,
        "the watch's list only; a promotion lists nothing: {:?}",
        lists.iter().map(|r| &r.query).collect::<Vec<_>>()
    );
    assert!(!server.requests().watches_of("identities").is_empty());
    Ok(())
}
