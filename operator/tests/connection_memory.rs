//! What an idle agent connection costs the operator. An agent holds one HTTP/2
//! connection with both its streams (EndpointSync and the endpoint map's watch) and
//! is idle between its snapshots; at 5,000 agents every KiB a connection keeps is
//! 5 MiB of the operator's memory (docs/benchmarks.md, scale-5k).
//!
//! The operator runs on a current-thread runtime on a thread of its own, with a
//! counting allocator keeping the bytes each thread allocated and has not freed; the
//! agents run on other threads. Each agent does what a real one does on its
//! connection: Hello, Allocate, a snapshot of 110 endpoints (over 16 KiB, so it
//! arrives in DATA frames of the largest size), the map's watch, then an empty
//! snapshot, so what stays is the connection and the node, not its endpoints.

use std::{thread, time::Duration};

use census_proto::{
    PROTOCOL_VERSION,
    pb::{
        self, agent_message::Body, endpoint_map_client::EndpointMapClient,
        endpoint_sync_client::EndpointSyncClient, identity_service_client::IdentityServiceClient,
        operator_message,
    },
};
use census_testkit::{
    ANSWER_TIMEOUT, Operator, TestResult,
    alloc::{PerThreadCounting, thread_net_bytes},
    endpoint, fail, hello, session, strings,
};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Streaming, transport::Channel};

#[global_allocator]
static GLOBAL: PerThreadCounting = PerThreadCounting;

const AGENTS: usize = 64;
const ENDPOINTS: usize = 110;
const LABELS: &[&str] = &["k8s:app=shop", "k8s:io.kubernetes.pod.namespace=shop"];

/// The most an idle agent connection may cost the operator, its node's state
/// included. Measured in a debug build: 19.9 KB (HTTP/2 stream and HPACK state,
/// tonic's and census's per-stream tasks); 56.8 KB with crates.io's h2, whose frame
/// buffers stay allocated while the connection is idle (operator/transport/vendor/h2).
const LIMIT: i64 = 28 * 1024;

/// The operator on a thread of its own, answering with the bytes its thread holds.
struct OperatorThread {
    measure: mpsc::UnboundedSender<oneshot::Sender<i64>>,
    thread: thread::JoinHandle<TestResult<()>>,
}

impl OperatorThread {
    fn start() -> TestResult<(Self, String)> {
        let (url_tx, url_rx) = std::sync::mpsc::channel();
        let (measure, mut asks) = mpsc::unbounded_channel::<oneshot::Sender<i64>>();
        let thread = thread::spawn(move || -> TestResult<()> {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(async move {
                let base = thread_net_bytes();
                // Long timers: nothing is released, collected or asked for while the
                // test measures.
                let op =
                    Operator::start(&["--snapshot-interval", "1h", "--grace-period", "1h"]).await?;
                let _ = url_tx.send(op.url());
                while let Some(reply) = asks.recv().await {
                    let _ = reply.send(thread_net_bytes() - base);
                }
                op.shut_down().await
            })
        });
        let url = url_rx.recv_timeout(ANSWER_TIMEOUT)?;
        Ok((Self { measure, thread }, url))
    }

    /// The smallest of a few measurements after a pause, so a buffer in use for a
    /// moment (a keepalive, a timer) is not counted.
    async fn settled(&self) -> TestResult<i64> {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let mut best = i64::MAX;
        for _ in 0..10 {
            let (tx, rx) = oneshot::channel();
            self.measure.send(tx)?;
            best = best.min(rx.await?);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(best)
    }

    fn stop(self) -> TestResult<()> {
        drop(self.measure);
        self.thread
            .join()
            .map_err(|_| "the operator's thread panicked")?
    }
}

/// One agent's connection and both its streams, left open.
struct IdleAgent {
    _sync: mpsc::Sender<pb::AgentMessage>,
    _answers: Streaming<pb::OperatorMessage>,
    _channel: Channel,
}

async fn next_answer(
    answers: &mut Streaming<pb::OperatorMessage>,
) -> TestResult<operator_message::Body> {
    match tokio::time::timeout(ANSWER_TIMEOUT, answers.message()).await {
        Ok(Ok(Some(pb::OperatorMessage { body: Some(body) }))) => Ok(body),
        other => fail(format!("expected an answer, got {other:?}")),
    }
}

async fn ack(answers: &mut Streaming<pb::OperatorMessage>, seq: u64) -> TestResult {
    loop {
        match next_answer(answers).await? {
            operator_message::Body::Ack(ack) if ack.seq == seq && ack.rejected.is_empty() => {
                return Ok(());
            }
            operator_message::Body::Rebind(_) | operator_message::Body::SnapshotRequest(_) => {}
            other => return fail(format!("expected the Ack of seq {seq}, got {other:?}")),
        }
    }
}

async fn connect(url: &str, n: usize) -> TestResult<IdleAgent> {
    let channel = Channel::from_shared(url.to_owned())?
        .connect_timeout(ANSWER_TIMEOUT)
        .connect()
        .await?;
    let node = format!("node-{n:03}");
    let session = session(1_000 + n as u64);

    let (sync, rx) = mpsc::channel(4);
    sync.send(hello(&node, session)).await?;
    let mut answers = EndpointSyncClient::new(channel.clone())
        .sync(ReceiverStream::new(rx))
        .await?
        .into_inner();
    match next_answer(&mut answers).await? {
        operator_message::Body::HelloReply(_) => {}
        other => return fail(format!("expected HelloReply, got {other:?}")),
    }

    let identity = IdentityServiceClient::new(channel.clone())
        .allocate(pb::AllocateRequest {
            protocol_version: PROTOCOL_VERSION,
            node: node.clone(),
            session: Some(session),
            labels: strings(LABELS),
            allocation: 0,
        })
        .await?
        .into_inner()
        .identity
        .ok_or("AllocateResponse without an identity")?
        .id;

    // The map's watch on the same connection, read as an agent reads it.
    let mut watch = EndpointMapClient::new(channel.clone())
        .watch(pb::EndpointMapWatchRequest {
            protocol_version: PROTOCOL_VERSION,
            node: node.clone(),
            session: Some(session),
        })
        .await?
        .into_inner();
    tokio::spawn(async move { while let Ok(Some(_)) = watch.message().await {} });

    let endpoints = (0..ENDPOINTS)
        .map(|e| {
            let name = format!("shop-7d9f8b6c4-n{n:03}e{e:03}");
            let ip = format!("10.{}.{}.{}", n / 250, n % 250, e + 1);
            endpoint("shop", &name, &[&ip], identity, LABELS)
        })
        .collect();
    for (seq, endpoints) in [(1, endpoints), (2, Vec::new())] {
        sync.send(pb::AgentMessage {
            seq,
            body: Some(Body::Snapshot(pb::Snapshot {
                endpoints,
                allocations_settled: 0,
            })),
        })
        .await?;
        ack(&mut answers, seq).await?;
    }
    Ok(IdleAgent {
        _sync: sync,
        _answers: answers,
        _channel: channel,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn an_idle_agent_connection_costs_the_operator_little() -> TestResult<()> {
    let (operator, url) = OperatorThread::start()?;
    let before = operator.settled().await?;

    let mut agents = Vec::with_capacity(AGENTS);
    for n in 0..AGENTS {
        agents.push(connect(&url, n).await?);
    }
    let after = operator.settled().await?;
    let per_agent = (after - before) / AGENTS as i64;
    #[expect(clippy::print_stderr, reason = "the figure for the record")]
    {
        eprintln!(
            "operator: {before} bytes held before {AGENTS} agents, {after} with them idle: \
             {per_agent} bytes per agent connection (limit {LIMIT})"
        );
    }
    assert!(
        per_agent <= LIMIT,
        "an idle agent connection costs the operator {per_agent} bytes (limit {LIMIT})"
    );

    drop(agents);
    operator.stop()
}
