//! A crash at any point between "persisted" and "returned" never yields two ids for
//! one label set: a real operator process is SIGKILLed at a different moment of each
//! burst of allocations, restarted on the same redb file, and checked.

use std::{
    collections::{BTreeMap, HashMap},
    net::SocketAddr,
    path::Path,
    process::Command,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use census_proto::{
    PROTOCOL_VERSION,
    pb::{
        self, agent_message::Body, endpoint_sync_client::EndpointSyncClient,
        identity_service_client::IdentityServiceClient,
    },
};
use census_testkit::process::Spawned;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

const ROUNDS: usize = 8;
const NODE: &str = "crash-node";

/// A `census-operator` process, killed when dropped.
struct Operator {
    process: Spawned,
    addr: SocketAddr,
}

impl Operator {
    fn start(store: &Path) -> Result<Self, Box<dyn std::error::Error + Send + Sync>> {
        let process = Spawned::start(
            Command::new(env!("CARGO_BIN_EXE_census-operator"))
                .args([
                    "--grpc-listen",
                    "127.0.0.1:0",
                    "--admin-listen",
                    "127.0.0.1:0",
                ])
                .arg("--store-path")
                .arg(store)
                .args(["--adoption-window", "0s", "--max-holds-per-node", "100000"]),
            Duration::from_secs(20),
        )?;
        Ok(Self {
            addr: process.grpc,
            process,
        })
    }

    /// SIGKILL: no shutdown path runs.
    fn kill(mut self) -> TestResult {
        self.process.kill();
        Ok(())
    }
}

fn labels(name: &str) -> Vec<String> {
    vec![
        format!("k8s:app={name}"),
        "k8s:io.kubernetes.pod.namespace=crash".to_owned(),
    ]
}

fn session(start: u64) -> pb::Session {
    pb::Session {
        start_time_ns: start,
        nonce: 1,
    }
}

/// Opens an EndpointSync stream and says Hello, so Allocate has a session.
async fn hello(
    channel: Channel,
    start: u64,
) -> Result<mpsc::Sender<pb::AgentMessage>, Box<dyn std::error::Error + Send + Sync>> {
    let (tx, rx) = mpsc::channel(16);
    tx.send(pb::AgentMessage {
        seq: 0,
        body: Some(Body::Hello(pb::Hello {
            protocol_version: PROTOCOL_VERSION,
            node: NODE.into(),
            session: Some(session(start)),
            agent_version: "crash-test".into(),
            addresses: Vec::new(),
        })),
    })
    .await?;
    let mut inbound = EndpointSyncClient::new(channel)
        .sync(ReceiverStream::new(rx))
        .await?
        .into_inner();
    inbound.message().await?.ok_or("no HelloReply")?;
    // Keep reading so acks never back up.
    tokio::spawn(async move { while let Ok(Some(_)) = inbound.message().await {} });
    Ok(tx)
}

async fn allocate(
    client: &mut IdentityServiceClient<Channel>,
    start: u64,
    name: &str,
) -> Result<u32, tonic::Status> {
    let req = pb::AllocateRequest {
        protocol_version: PROTOCOL_VERSION,
        node: NODE.into(),
        session: Some(session(start)),
        labels: labels(name),
        allocation: 0,
    };
    let identity = client.allocate(req).await?.into_inner().identity;
    identity
        .map(|i| i.id)
        .ok_or_else(|| tonic::Status::internal("no identity in the answer"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_operator_during_allocations_never_binds_a_label_set_twice() -> TestResult {
    let dir = tempfile::tempdir()?;
    let store = dir.path().join("census.redb");
    // Every label set whose Allocate was answered, with the id it got.
    let answered: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let mut attempted: Vec<String> = Vec::new();
    let mut kills_mid_burst = 0;
    for round in 0..ROUNDS {
        let op = Operator::start(&store)?;
        let channel = Channel::from_shared(format!("http://{}", op.addr))?
            .connect()
            .await?;
        let start = 1_000 + round as u64;
        let _stream = hello(channel.clone(), start).await?;
        let mut client = IdentityServiceClient::new(channel);

        // What was answered before every earlier crash is still bound the same way.
        let known: Vec<(String, u32)> = answered
            .lock()
            .map_err(|_| "poisoned")?
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        for (name, id) in &known {
            let got = allocate(&mut client, start, name).await?;
            assert_eq!(
                got, *id,
                "round {round}: {name} was {id} before the crash, now {got}"
            );
        }

        // A burst: new label sets from 4 concurrent callers, killed mid-burst.
        let names: Vec<String> = (0..400).map(|i| format!("burst-{round}-{i}")).collect();
        attempted.extend(names.iter().cloned());
        let answered_in_round = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for chunk in names.chunks(100) {
            let mut client = client.clone();
            let chunk = chunk.to_vec();
            let answered = answered.clone();
            let answered_in_round = answered_in_round.clone();
            tasks.push(tokio::spawn(async move {
                for name in chunk {
                    match allocate(&mut client, start, &name).await {
                        Ok(id) => {
                            if let Ok(mut a) = answered.lock() {
                                a.insert(name, id);
                            }
                            answered_in_round.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(_) => return,
                    }
                }
            }));
        }
        // The kill lands after a number of answers that differs per round, not after a
        // time: however loaded the machine, every round answers some and leaves the
        // rest of its burst in flight.
        let kill_after = 15 + (round * 37) % 180;
        while answered_in_round.load(Ordering::Relaxed) < kill_after
            && !tasks.iter().all(|t| t.is_finished())
        {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let done_before_kill = tasks.iter().all(|t| t.is_finished());
        op.kill()?;
        for t in tasks {
            let _ = t.await;
        }
        if !done_before_kill {
            kills_mid_burst += 1;
        }
    }
    assert!(
        kills_mid_burst >= ROUNDS / 2,
        "only {kills_mid_burst} kills landed mid-burst: the test must kill during allocations"
    );

    // Final check on a clean start: every label set has exactly one id, no id has two
    // label sets, and every answer given before a crash still holds.
    let op = Operator::start(&store)?;
    let channel = Channel::from_shared(format!("http://{}", op.addr))?
        .connect()
        .await?;
    let start = 99_999;
    let _stream = hello(channel.clone(), start).await?;
    let mut client = IdentityServiceClient::new(channel);
    let answered = answered.lock().map_err(|_| "poisoned")?.clone();
    let mut by_id: BTreeMap<u32, String> = BTreeMap::new();
    for name in &attempted {
        let id = allocate(&mut client, start, name).await?;
        if let Some(before) = answered.get(name) {
            assert_eq!(id, *before, "{name} changed id across crashes");
        }
        if let Some(other) = by_id.insert(id, name.clone()) {
            panic!("id {id} is bound to both {other} and {name}");
        }
    }
    assert!(
        answered.len() > 100,
        "too few allocations were answered ({}) to mean anything",
        answered.len()
    );
    op.kill()?;
    Ok(())
}
