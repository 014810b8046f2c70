//! End-to-end figures over real gRPC on loopback (run with
//! `cargo bench -p census-operator --bench grpc`): Allocate of a known label set,
//! and a 110-endpoint snapshot from send to Ack (encode, transport, decode,
//! validation, label filter and the core), as p50/p99.

#![allow(clippy::print_stdout)]

use std::time::{Duration, Instant};

use census_proto::{
    PROTOCOL_VERSION,
    pb::{
        self, agent_message::Body, endpoint_sync_client::EndpointSyncClient,
        identity_service_client::IdentityServiceClient,
    },
};
use census_testkit::Operator;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

type BenchResult = Result<(), Error>;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn labels(i: usize) -> Vec<String> {
    vec![
        format!("k8s:app=service-{i}"),
        "k8s:app.kubernetes.io/part-of=shop".into(),
        "k8s:tier=backend".into(),
        format!("k8s:io.kubernetes.pod.namespace=team-{}", i % 40),
        "k8s:io.kubernetes.pod.serviceaccount=default".into(),
        // Dropped by the default filter, as from a real pod.
        "k8s:pod-template-hash=7d9f8b6c4".into(),
    ]
}

type Error = Box<dyn std::error::Error + Send + Sync>;
const NODE: &str = "bench-node";
/// Label sets (and endpoints) of the node.
const SETS: usize = 110;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> BenchResult {
    // Ticks at the daemon's default pace, as in production.
    let operator = Operator::start_without(&["--tick-interval"], &[]).await?;
    let channel = operator.channel().await?;
    let session = pb::Session {
        start_time_ns: 1,
        nonce: 1,
    };
    let (tx, mut inbound) = open_stream(channel.clone(), session).await?;

    println!("census-operator over gRPC on loopback (release build, 2 worker threads)\n");
    let mut client = IdentityServiceClient::new(channel);
    let mut ids = Vec::with_capacity(SETS);
    for i in 0..SETS {
        ids.push(allocate(&mut client, allocate_request(session, i)).await?);
    }
    let lat = allocate_latency(&mut client, session).await?;
    println!(
        "allocate, known label set, 1 client:     p50 {:>7.1} µs   p99 {:>7.1} µs   ({} calls)",
        percentile(&lat, 0.5).as_secs_f64() * 1e6,
        percentile(&lat, 0.99).as_secs_f64() * 1e6,
        lat.len()
    );
    let lat = snapshot_latency(&tx, &mut inbound, &ids).await?;
    println!(
        "snapshot, 110 endpoints, no change, send to Ack: p50 {:>7.1} µs   p99 {:>7.1} µs   ({} snapshots)",
        percentile(&lat, 0.5).as_secs_f64() * 1e6,
        percentile(&lat, 0.99).as_secs_f64() * 1e6,
        lat.len()
    );
    drop(tx);
    operator.shut_down().await?;
    Ok(())
}

/// An EndpointSync stream of the node, its Hello answered.
async fn open_stream(
    channel: tonic::transport::Channel,
    session: pb::Session,
) -> Result<
    (
        mpsc::Sender<pb::AgentMessage>,
        tonic::Streaming<pb::OperatorMessage>,
    ),
    Error,
> {
    let (tx, rx) = mpsc::channel(16);
    tx.send(pb::AgentMessage {
        seq: 0,
        body: Some(Body::Hello(pb::Hello {
            protocol_version: PROTOCOL_VERSION,
            node: NODE.into(),
            session: Some(session),
            agent_version: "bench".into(),
            addresses: Vec::new(),
        })),
    })
    .await?;
    let mut inbound = EndpointSyncClient::new(channel)
        .sync(ReceiverStream::new(rx))
        .await?
        .into_inner();
    inbound.message().await?.ok_or("no HelloReply")?;
    Ok((tx, inbound))
}

/// The node's Allocate of label set `i`.
fn allocate_request(session: pb::Session, i: usize) -> pb::AllocateRequest {
    pb::AllocateRequest {
        protocol_version: PROTOCOL_VERSION,
        node: NODE.into(),
        session: Some(session),
        labels: labels(i),
        allocation: 0,
    }
}

/// Sends `req`; the id allocated.
async fn allocate(
    client: &mut IdentityServiceClient<tonic::transport::Channel>,
    req: pb::AllocateRequest,
) -> Result<u32, Error> {
    Ok(client
        .allocate(req)
        .await?
        .into_inner()
        .identity
        .ok_or("no identity")?
        .id)
}

/// 20,000 Allocates of known label sets, one at a time; their latencies, sorted.
async fn allocate_latency(
    client: &mut IdentityServiceClient<tonic::transport::Channel>,
    session: pb::Session,
) -> Result<Vec<Duration>, Error> {
    let mut lat = Vec::with_capacity(20_000);
    for i in 0..20_000 {
        let req = allocate_request(session, i % SETS);
        let started = Instant::now();
        allocate(client, req).await?;
        lat.push(started.elapsed());
    }
    lat.sort_unstable();
    Ok(lat)
}

/// 5,000 unchanged snapshots of the node's endpoints, each from send to its Ack;
/// their latencies, sorted.
async fn snapshot_latency(
    tx: &mpsc::Sender<pb::AgentMessage>,
    inbound: &mut tonic::Streaming<pb::OperatorMessage>,
    ids: &[u32],
) -> Result<Vec<Duration>, Error> {
    let endpoints: Vec<pb::Endpoint> = (0..SETS)
        .map(|i| pb::Endpoint {
            namespace: format!("team-{}", i % 40),
            name: format!("service-{i}-7d9f8b6c4-x2b9q"),
            ips: vec![format!("198.18.{}.{}", i / 250, i % 250 + 1)],
            identity: ids[i],
            labels: labels(i),
        })
        .collect();
    let mut lat = Vec::with_capacity(5_000);
    for seq in 1..=5_000u64 {
        let msg = pb::AgentMessage {
            seq,
            body: Some(Body::Snapshot(pb::Snapshot {
                endpoints: endpoints.clone(),
                allocations_settled: 0,
            })),
        };
        let started = Instant::now();
        tx.send(msg).await?;
        loop {
            let reply = inbound.message().await?.ok_or("stream ended")?;
            if let Some(pb::operator_message::Body::Ack(ack)) = reply.body
                && ack.seq == seq
            {
                break;
            }
        }
        lat.push(started.elapsed());
    }
    lat.sort_unstable();
    Ok(lat)
}
