//! The transport attacks of `operator/tests/abuse.rs` at full size, with figures: for
//! each, the operator's RSS before / peak / after, its open descriptors before / peak
//! / after, a concurrent Get's p50 and max (a new client every 50 ms), what the
//! attacker was answered, and how long the operator took to close what stalled.
//! The gate: an RSS peak under 64 MiB for every attack an unauthenticated caller can
//! make (all but the last, which needs an accepted Hello).

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use anyhow::Context as _;
use bytes::Bytes;
use census_proto::{
    PROTOCOL_VERSION,
    pb::{self, identity_service_client::IdentityServiceClient},
};
use serde::Serialize;
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpStream,
    time::Instant,
};

use super::{
    operator::{Binary, Launch, Operator},
    report::{Machine, Results, say},
    sample::{Latency, Proc},
};

/// The RSS peak the gate allows under an unauthenticated attack.
const RSS_GATE: u64 = 64 * 1024 * 1024;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The operator's transport flags in this bench: short, so a run takes a minute.
const FLAGS: &[&str] = &[
    "--handshake-timeout",
    "2s",
    "--idle-timeout",
    "4s",
    "--message-timeout",
    "4s",
    "--adoption-window",
    "0s",
];

#[derive(Debug, Serialize)]
struct Figures {
    attack: &'static str,
    unauthenticated: bool,
    rss_before: u64,
    rss_peak: u64,
    rss_after: u64,
    fds_before: usize,
    fds_peak: usize,
    fds_after: usize,
    get: Latency,
    gets_failed: usize,
    answers: BTreeMap<String, usize>,
    /// From the attack's start until the operator had closed or answered everything.
    done_seconds: f64,
}

#[derive(Debug, Serialize)]
struct Output {
    machine: Machine,
    operator_args: Vec<String>,
    attacks: Vec<Figures>,
    passed: bool,
}

#[derive(Debug, Clone, Copy)]
enum Attack {
    /// 15 connections, each declaring a 39 MB message and sending 38 MB of it
    /// (Allocate and an EndpointSync stream before Hello, in turn).
    Oversize,
    /// 150 connections sending half the HTTP/2 preface.
    HalfPrefaces,
    /// 250 connections of five kinds stalling: nothing sent, half a preface, the
    /// preface only, a partial HEADERS frame, a call without its message.
    Stalled,
    /// 5 Hellos with a 30 MiB agent_version.
    AgentVersion,
    /// 15 Hello'd streams, each sending 38 MB of a declared 39 MB snapshot.
    StalledSnapshot,
}

impl Attack {
    fn name(self) -> &'static str {
        match self {
            Self::Oversize => "15 x 38 MB of a declared 39 MB",
            Self::HalfPrefaces => "150 half-open prefaces",
            Self::Stalled => "250 stalled connections",
            Self::AgentVersion => "5 x 30 MiB agent_version",
            Self::StalledSnapshot => "15 Hello'd x 38 MB of 39 MB",
        }
    }
}

pub(crate) async fn run(binary: &Binary, results: &Results) -> anyhow::Result<bool> {
    let mut machine = Machine::now();
    say(machine.line());
    let args: Vec<String> = FLAGS.iter().map(|f| (*f).to_owned()).collect();
    let mut attacks = Vec::new();
    for attack in [
        Attack::Oversize,
        Attack::HalfPrefaces,
        Attack::Stalled,
        Attack::AgentVersion,
        Attack::StalledSnapshot,
    ] {
        let dir = tempfile::tempdir()?;
        let launch = Launch::new(dir.path(), results.path("operator.log"), args.clone())?;
        let op = Operator::start(binary, launch).await?;
        let figures = measure(&op, attack).await.with_context(|| attack.name())?;
        say(format!(
            "{:<32} RSS {:>4} / {:>4} / {:>4} MiB  fds {:>4} / {:>4} / {:>4}  Get p50 {:>7.1} ms max {:>7.1} ms ({} failed)  done in {:.1} s  answered {:?}",
            figures.attack,
            figures.rss_before >> 20,
            figures.rss_peak >> 20,
            figures.rss_after >> 20,
            figures.fds_before,
            figures.fds_peak,
            figures.fds_after,
            figures.get.p50_us / 1000.0,
            figures.get.max_us / 1000.0,
            figures.gets_failed,
            figures.done_seconds,
            figures.answers,
        ));
        attacks.push(figures);
        op.stop().await?;
    }
    machine.finish();
    let passed = attacks
        .iter()
        .filter(|f| f.unauthenticated)
        .all(|f| f.rss_peak < RSS_GATE);
    say(format!(
        "gate: RSS peak under {} MiB for every unauthenticated attack: {}",
        RSS_GATE >> 20,
        if passed { "passed" } else { "FAILED" }
    ));
    results.write_json(
        "abuse.json",
        &Output {
            machine,
            operator_args: args,
            attacks,
            passed,
        },
    )?;
    Ok(passed)
}

fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count)
}

fn rss(pid: u32) -> u64 {
    Proc::read(pid).map_or(0, |p| p.rss)
}

async fn measure(op: &Operator, attack: Attack) -> anyhow::Result<Figures> {
    let pid = op.pid;
    let addr = op.launch.grpc;
    get(addr).await?;
    let (rss_before, fds_before) = (rss(pid), fds(pid));
    let stop = Arc::new(AtomicBool::new(false));
    let rss_peak = Arc::new(AtomicU64::new(rss_before));
    let fds_peak = Arc::new(AtomicU64::new(fds_before as u64));
    let sampler = {
        let (stop, rss_peak, fds_peak) = (stop.clone(), rss_peak.clone(), fds_peak.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                rss_peak.fetch_max(rss(pid), Ordering::Relaxed);
                fds_peak.fetch_max(fds(pid) as u64, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };
    let getter = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let (mut ok, mut failed) = (Vec::new(), 0);
            while !stop.load(Ordering::Relaxed) {
                match get(addr).await {
                    Ok(took) => ok.push(took),
                    Err(_) => failed += 1,
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            (ok, failed)
        })
    };
    let started = Instant::now();
    let answers = attack_with(addr, attack).await?;
    let done_seconds = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let (gets, gets_failed) = getter.await?;
    let _ = sampler.join();
    // Closed connections and freed buffers: what is left a second later.
    tokio::time::sleep(Duration::from_secs(1)).await;
    Ok(Figures {
        attack: attack.name(),
        unauthenticated: !matches!(attack, Attack::StalledSnapshot),
        rss_before,
        rss_peak: rss_peak.load(Ordering::Relaxed),
        rss_after: rss(pid),
        fds_before,
        fds_peak: fds_peak.load(Ordering::Relaxed) as usize,
        fds_after: fds(pid),
        get: Latency::of(gets),
        gets_failed,
        answers,
        done_seconds,
    })
}

/// A Get of the reserved identity 1 from a new client: how long it took.
async fn get(addr: SocketAddr) -> anyhow::Result<Duration> {
    let started = Instant::now();
    tokio::time::timeout(Duration::from_secs(10), async {
        let mut client = IdentityServiceClient::connect(format!("http://{addr}")).await?;
        client
            .get(pb::GetRequest {
                protocol_version: PROTOCOL_VERSION,
                id: 1,
            })
            .await?;
        anyhow::Ok(())
    })
    .await
    .context("no answer within 10 s")??;
    Ok(started.elapsed())
}

/// Runs `attack` until the operator has answered or closed all of it: what the
/// attacker was answered, by status code (or how the connection ended).
async fn attack_with(addr: SocketAddr, attack: Attack) -> anyhow::Result<BTreeMap<String, usize>> {
    let mut tasks = tokio::task::JoinSet::new();
    match attack {
        Attack::Oversize | Attack::StalledSnapshot => {
            let body = Bytes::from(vec![0u8; 38_000_000]);
            for i in 0..15 {
                let body = body.clone();
                let hello = matches!(attack, Attack::StalledSnapshot);
                let path = if i % 2 == 0 && !hello {
                    "/census.v1.IdentityService/Allocate"
                } else {
                    "/census.v1.EndpointSync/Sync"
                };
                tasks.spawn(async move {
                    let (answer, mut send, _conn) = call(addr, path).await?;
                    if hello {
                        send.send_data(framed(&hello_of(&format!("node-{i}"), "v1")), false)?;
                    }
                    send.send_data(prefix(39_000_000), false)?;
                    push(&mut send, &body).await;
                    status_of(answer).await
                });
            }
        }
        Attack::AgentVersion => {
            for i in 0..5 {
                tasks.spawn(async move {
                    let huge = framed(&hello_of(&format!("node-{i}"), &"v".repeat(30 << 20)));
                    let (answer, mut send, _conn) =
                        call(addr, "/census.v1.EndpointSync/Sync").await?;
                    push(&mut send, &huge).await;
                    status_of(answer).await
                });
            }
        }
        Attack::HalfPrefaces | Attack::Stalled => {
            let count = if matches!(attack, Attack::HalfPrefaces) {
                150
            } else {
                250
            };
            for i in 0..count {
                let kind = if matches!(attack, Attack::HalfPrefaces) {
                    1
                } else {
                    i % 5
                };
                tasks.spawn(async move {
                    if kind == 4 {
                        let (answer, _send, _conn) =
                            call(addr, "/census.v1.IdentityService/Get").await?;
                        return status_of(answer).await;
                    }
                    let mut tcp = TcpStream::connect(addr).await?;
                    match kind {
                        1 => tcp.write_all(&PREFACE[..12]).await?,
                        2 => tcp.write_all(PREFACE).await?,
                        3 => {
                            tcp.write_all(PREFACE).await?;
                            tcp.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await?;
                            tcp.write_all(&[0, 0, 100, 1, 4, 0, 0, 0, 1, 0x82]).await?;
                        }
                        _ => {}
                    }
                    let mut buf = [0u8; 1024];
                    loop {
                        match tcp.read(&mut buf).await {
                            Ok(0) => return Ok("closed".to_owned()),
                            Err(_) => return Ok("reset".to_owned()),
                            Ok(_) => {}
                        }
                    }
                });
            }
        }
    }
    let mut answers = BTreeMap::new();
    let deadline = Duration::from_secs(60);
    while let Some(done) = tokio::time::timeout(deadline, tasks.join_next())
        .await
        .context("the operator left part of the attack open for a minute")?
    {
        let answer = done?.unwrap_or_else(|e| format!("error: {e}"));
        *answers.entry(answer).or_default() += 1;
    }
    Ok(answers)
}

fn prefix(len: u32) -> Bytes {
    let mut out = vec![0];
    out.extend_from_slice(&len.to_be_bytes());
    Bytes::from(out)
}

fn framed(message: &impl prost::Message) -> Bytes {
    let body = message.encode_to_vec();
    let mut out = prefix(body.len() as u32).to_vec();
    out.extend_from_slice(&body);
    Bytes::from(out)
}

fn hello_of(node: &str, agent_version: &str) -> pb::AgentMessage {
    pb::AgentMessage {
        seq: 0,
        body: Some(pb::agent_message::Body::Hello(pb::Hello {
            protocol_version: PROTOCOL_VERSION,
            node: node.into(),
            session: Some(pb::Session {
                start_time_ns: 100,
                nonce: 1,
            }),
            agent_version: agent_version.into(),
            addresses: Vec::new(),
        })),
    }
}

type Call = (
    h2::client::ResponseFuture,
    h2::SendStream<Bytes>,
    tokio::task::JoinHandle<()>,
);

async fn call(addr: SocketAddr, path: &str) -> anyhow::Result<Call> {
    let tcp = TcpStream::connect(addr).await?;
    let (client, connection) = h2::client::handshake(tcp).await?;
    let connection = tokio::spawn(async move {
        let _ = connection.await;
    });
    let mut client = client.ready().await?;
    let request = http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())?;
    let (answer, send) = client.send_request(request, false)?;
    Ok((answer, send, connection))
}

/// Sends `data` as flow control allows, until refused or given no room for a second.
async fn push(send: &mut h2::SendStream<Bytes>, data: &Bytes) {
    const CHUNK: usize = 64 * 1024;
    let mut sent = 0;
    while sent < data.len() {
        send.reserve_capacity(CHUNK.min(data.len() - sent));
        let room = tokio::time::timeout(
            Duration::from_secs(1),
            futures::future::poll_fn(|cx| send.poll_capacity(cx)),
        )
        .await;
        let n = match room {
            Ok(Some(Ok(n))) if n > 0 => n.min(data.len() - sent),
            _ => return,
        };
        if send.send_data(data.slice(sent..sent + n), false).is_err() {
            return;
        }
        sent += n;
    }
}

/// The call's gRPC status code, as `tonic::Code` names it.
async fn status_of(answer: h2::client::ResponseFuture) -> anyhow::Result<String> {
    let answer = answer.await?;
    let code = |headers: &http::HeaderMap| {
        tonic::Status::from_header_map(headers).map(|s| format!("{:?}", s.code()))
    };
    if let Some(code) = code(answer.headers()) {
        return Ok(code);
    }
    let mut body = answer.into_body();
    while let Some(data) = body.data().await {
        let data = data?;
        let _ = body.flow_control().release_capacity(data.len());
    }
    let trailers = body.trailers().await?.context("no trailers")?;
    code(&trailers).context("no grpc-status")
}
