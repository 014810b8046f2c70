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

type BenchResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

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

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> BenchResult {
    // Ticks at the daemon's default pace, as in production.
    let operator = Operator::start_without(&["--tick-interval"], &[]).await?;
    let channel = operator.channel().await?;
    let session = pb::Session {
        start_time_ns: 1,
        nonce: 1,
    };

    let (tx, rx) = mpsc::channel(16);
    tx.send(pb::AgentMessage {
        seq: 0,
        body: Some(Body::Hello(pb::Hello {
            protocol_version: PROTOCOL_VERSION,
            node: "bench-node".into(),
            session: Some(session),
            agent_version: "bench".into(),
            addresses: Vec::new(),
        })),
    })
    .await?;
    let mut inbound = EndpointSyncClient::new(channel.clone())
        .sync(ReceiverStream::new(rx))
        .await?
        .into_inner();
    inbound.message().await?.ok_or("no HelloReply")?;

    println!("census-operator over gRPC on loopback (release build, 2 worker threads)\n");
    let mut client = IdentityServiceClient::new(channel);
    let mut ids = Vec::new();
    for i in 0..110 {
        let req = pb::AllocateRequest {
            protocol_version: PROTOCOL_VERSION,
            node: "bench-node".into(),
            session: Some(session),
            labels: labels(i),
        };
        ids.push(
            client
                .allocate(req)
                .await?
                .into_inner()
                .identity
                .ok_or("no identity")?
                .id,
        );
    }
    let mut lat = Vec::with_capacity(20_000);
    for i in 0..20_000 {
        let req = pb::AllocateRequest {
            protocol_version: PROTOCOL_VERSION,
            node: "bench-node".into(),
            session: Some(session),
            labels: labels(i % 110),
        };
        let started = Instant::now();
        client.allocate(req).await?;
        lat.push(started.elapsed());
    }
    lat.sort_unstable();
    println!(
        "allocate, known label set, 1 client:     p50 {:>7.1} µs   p99 {:>7.1} µs   ({} calls)",
        percentile(&lat, 0.5).as_secs_f64() * 1e6,
        percentile(&lat, 0.99).as_secs_f64() * 1e6,
        lat.len()
    );

    let endpoints: Vec<pb::Endpoint> = (0..110)
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
