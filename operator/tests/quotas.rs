//! Quotas per authenticated caller and caps on the whole server, over real gRPC with
//! mutual TLS: a node's streams and watches are counted against its own
//! credentials, every refusal is RESOURCE_EXHAUSTED naming the quota and its flag,
//! a refusal changes nothing, and what ends gives its room back. And the budget of
//! large messages received at once: a snapshot that finds no room waits for it,
//! without its bytes being buffered, and goes through once room is given back.

use std::time::Duration;

use bytes::Bytes;
use census_proto::{
    PROTOCOL_VERSION,
    pb::{
        self, endpoint_map_client::EndpointMapClient,
        identity_service_client::IdentityServiceClient,
    },
};
use census_testkit::{
    ANSWER_TIMEOUT, Agent, Operator, TestResult, endpoint, eventually, fail, hello, session,
    tls::{Certs, Client, Secured},
};
use prost::Message as _;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Status, transport::Channel};

async fn map_watch(
    target: &Secured,
    node: &str,
    session: pb::Session,
) -> TestResult<Result<tonic::Streaming<pb::EndpointMapBatch>, Status>> {
    let answer = tokio::time::timeout(
        ANSWER_TIMEOUT,
        EndpointMapClient::new(target.channel().await?).watch(pb::EndpointMapWatchRequest {
            protocol_version: PROTOCOL_VERSION,
            node: node.into(),
            session: Some(session),
        }),
    )
    .await
    .map_err(|_| "EndpointMap.Watch did not answer")?;
    Ok(answer.map(tonic::Response::into_inner))
}

async fn identity_watch(
    target: &Secured,
) -> TestResult<Result<tonic::Streaming<pb::WatchEvent>, Status>> {
    let answer = tokio::time::timeout(
        ANSWER_TIMEOUT,
        IdentityServiceClient::new(target.channel().await?).watch(pb::WatchRequest {
            protocol_version: PROTOCOL_VERSION,
        }),
    )
    .await
    .map_err(|_| "IdentityService.Watch did not answer")?;
    Ok(answer.map(tonic::Response::into_inner))
}

/// An EndpointSync stream of `target` that has sent nothing yet: the operator waits
/// for its Hello, so the call answers only when refused. The sender keeps it open.
async fn silent_stream(
    target: &Secured,
) -> TestResult<(
    mpsc::Sender<pb::AgentMessage>,
    tokio::task::JoinHandle<Result<tonic::Response<tonic::Streaming<pb::OperatorMessage>>, Status>>,
)> {
    let channel: Channel = target.channel().await?;
    let (tx, rx) = mpsc::channel(4);
    let call = tokio::spawn(async move {
        pb::endpoint_sync_client::EndpointSyncClient::new(channel)
            .sync(ReceiverStream::new(rx))
            .await
    });
    Ok((tx, call))
}

fn expect_quota(answer: Result<impl std::fmt::Debug, Status>, needles: &[&str]) -> TestResult {
    let status = match answer {
        Ok(answer) => return fail(format!("not refused: {answer:?}")),
        Err(status) => status,
    };
    if status.code() != Code::ResourceExhausted
        || !needles.iter().all(|n| status.message().contains(n))
    {
        return fail(format!(
            "wanted RESOURCE_EXHAUSTED with {needles:?}, got {status:?}"
        ));
    }
    Ok(())
}

async fn refusals(op: &Operator, quota: &str) -> TestResult<f64> {
    let (_, _, body) = op.admin_get("/metrics").await?;
    let needle = format!("census_quota_refusals_total{{reason=\"{quota}\"}} ");
    Ok(body
        .lines()
        .find_map(|line| line.strip_prefix(&needle))
        .map_or(Ok(0.0), str::parse)?)
}

#[tokio::test]
async fn a_nodes_streams_and_watches_are_held_to_its_quotas_and_the_cap() -> TestResult {
    let certs = Certs::generate(&["node-a", "node-b"], &["cli"])?;
    let mut flags = certs.operator_flags()?;
    flags.extend(
        [
            "--max-streams-per-node",
            "2",
            "--max-watches-per-caller",
            "2",
            "--max-watches",
            "3",
        ]
        .map(String::from),
    );
    let args: Vec<&str> = flags.iter().map(String::as_str).collect();
    let op = Operator::start(&args).await?;
    let addr = op.grpc_addr;
    let as_a = certs.target(addr, Some(Client::Node("node-a")))?;
    let as_b = certs.target(addr, Some(Client::Node("node-b")))?;
    let reader = certs.target(addr, Some(Client::Reader("cli")))?;

    // node-a: its agent's stream, and one more still before its Hello.
    let (mut agent, _) = Agent::connect(&as_a, "node-a", session(10)).await?;
    let (_waiting, mut pending) = silent_stream(&as_a).await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !pending.is_finished(),
        "a second stream is within the quota"
    );
    let (_third, third) = silent_stream(&as_a).await?;
    let third = tokio::time::timeout(ANSWER_TIMEOUT, third).await??;
    expect_quota(
        third.map(|_| ()),
        &["node node-a", "--max-streams-per-node"],
    )?;
    // The refused stream changed nothing: node-a's agent still works.
    let answer = agent.snapshot(Vec::new()).await?;
    assert!(!answer.ack.ignored, "{answer:?}");
    // Another node's quota is its own.
    let (_agent_b, _) = Agent::connect(&as_b, "node-b", session(20)).await?;

    // Watches: two for node-a, the third refused by its quota.
    let a1 = map_watch(&as_a, "node-a", session(10)).await??;
    let _a2 = map_watch(&as_a, "node-a", session(10)).await??;
    expect_quota(
        map_watch(&as_a, "node-a", session(10)).await?,
        &["node node-a has 2 watches open", "--max-watches-per-caller"],
    )?;
    // A reader's watch counts against the same cap: 3 open now, the cap.
    let _r = identity_watch(&reader).await??;
    expect_quota(
        map_watch(&as_b, "node-b", session(20)).await?,
        &["3 watches are open", "--max-watches"],
    )?;
    // A watch that ends gives its room back.
    drop(a1);
    let b = eventually(
        "node-b's watch once node-a's ended",
        Duration::from_secs(5),
        || async { Ok(map_watch(&as_b, "node-b", session(20)).await?.ok()) },
    )
    .await?;
    drop(b);

    // The first pending stream ends: node-a may open another.
    drop(_waiting);
    let ended = tokio::time::timeout(ANSWER_TIMEOUT, &mut pending).await??;
    assert!(
        ended.is_err(),
        "a stream without Hello is refused: {ended:?}"
    );
    let (_again, again) = silent_stream(&as_a).await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!again.is_finished(), "room again for node-a");

    assert_eq!(refusals(&op, "streams_per_node").await?, 1.0);
    assert_eq!(refusals(&op, "watches_per_caller").await?, 1.0);
    assert!(refusals(&op, "watches").await? >= 1.0);
    Ok(())
}

/// Two Hello'd streams of a loopback operator whose budget of large messages is the
/// message limit: the first's stalled snapshot holds most of it, the second's whole
/// snapshot waits (none of its bytes buffered) and is applied once the first's
/// stream is gone.
#[tokio::test]
async fn a_large_snapshot_waits_for_the_budget_and_goes_through_when_room_comes_back() -> TestResult
{
    // 1000 endpoints x 4096 bytes is under 4 MiB: the message limit is 4 MiB.
    let limit = 4 * 1024 * 1024;
    let op = Operator::start(&[
        "--max-snapshot-endpoints",
        "1000",
        "--max-inflight-message-bytes",
        &limit.to_string(),
        "--message-timeout",
        "30s",
    ])
    .await?;
    let addr = op.grpc_addr;

    // The first: Hello'd over a raw HTTP/2 call, then 100 KB of a declared 3 MiB.
    let mut first = census_testkit::h2attack::call(addr, "/census.v1.EndpointSync/Sync").await?;
    let hello_a = census_testkit::h2attack::framed(&hello("node-a", session(1)));
    assert_eq!(
        census_testkit::h2attack::push(&mut first.send, &hello_a).await,
        hello_a.len()
    );
    let mut stalled = census_testkit::h2attack::prefix(3 * 1024 * 1024).to_vec();
    stalled.extend(vec![0u8; 100_000]);
    let stalled = Bytes::from(stalled);
    census_testkit::h2attack::push(&mut first.send, &stalled).await;
    eventually(
        "the first snapshot reserves its length",
        ANSWER_TIMEOUT,
        || async { Ok(inflight(&op).await?.filter(|&n| n >= 3.0 * 1024.0 * 1024.0)) },
    )
    .await?;

    // The second: a real agent's snapshot of about 1.5 MiB (over the request limit).
    let (mut agent, _) = Agent::connect(&op, "node-b", session(2)).await?;
    let labels: Vec<String> = (0..60)
        .map(|i| format!("k8s:label-{i}=value-{i}"))
        .collect();
    let labels: Vec<&str> = labels.iter().map(String::as_str).collect();
    let id = op.allocate_ok("node-b", session(2), &labels).await?.id;
    let endpoints: Vec<pb::Endpoint> = (0..1000)
        .map(|i| {
            let ip = format!("10.1.{}.{}", i / 250, i % 250 + 1);
            endpoint("default", &format!("pod-{i}"), &[ip.as_str()], id, &labels)
        })
        .collect();
    let size = pb::Snapshot {
        endpoints: endpoints.clone(),
        allocations_settled: 0,
    }
    .encoded_len();
    assert!(
        size > 1024 * 1024 && size < limit - 3 * 1024 * 1024 + 1024 * 1024,
        "{size}"
    );
    let seq = agent.next_seq();
    agent
        .send(
            seq,
            pb::agent_message::Body::Snapshot(pb::Snapshot {
                endpoints,
                allocations_settled: 0,
            }),
        )
        .await?;
    // It waits: no Ack while the first holds the budget.
    let early = tokio::time::timeout(Duration::from_secs(2), agent.recv()).await;
    assert!(
        early.is_err(),
        "the snapshot was taken with no room: {early:?}"
    );
    assert!(inflight(&op).await?.unwrap_or(0.0) < limit as f64);

    // The first goes away: its reservation comes back, the second is applied.
    drop(first);
    let ack = tokio::time::timeout(ANSWER_TIMEOUT, agent.recv())
        .await
        .map_err(|_| "no Ack once the budget had room")???
        .ok_or("the stream ended")?;
    let Some(pb::operator_message::Body::Ack(ack)) = ack.body else {
        return fail(format!("not an Ack: {ack:?}"));
    };
    assert_eq!((ack.seq, ack.rejected.len()), (seq, 0));
    assert_eq!(op.get_node_ok("node-b").await?.endpoints, 1000);
    eventually(
        "every reservation is given back",
        ANSWER_TIMEOUT,
        || async { Ok(inflight(&op).await?.filter(|&n| n == 0.0)) },
    )
    .await?;
    Ok(())
}

async fn inflight(op: &Operator) -> TestResult<Option<f64>> {
    let (_, _, body) = op.admin_get("/metrics").await?;
    Ok(body
        .lines()
        .find_map(|line| line.strip_prefix("census_inflight_message_bytes "))
        .map(str::parse)
        .transpose()?)
}
