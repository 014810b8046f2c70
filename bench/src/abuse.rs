//! The transport attacks of `operator/tests/abuse.rs` at full size, with figures: for
//! each, the operator's RSS before / peak / after, its open descriptors before / peak
//! / after, a concurrent Get's p50 and max (a new client every 50 ms), what the
//! attacker was answered, and how long the operator took to close what stalled.
//! The gate: an RSS peak under 64 MiB for every attack an unauthenticated caller can
//! make (all but the last, which needs an accepted Hello), and under 64 MiB plus the
//! budget of large messages received at once (`--max-inflight-message-bytes`) for the
//! last: Hello'd streams together hold no more than that budget.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use anyhow::Context as _;
use bytes::Bytes;
use census_proto::{
    PROTOCOL_VERSION,
    pb::{self, identity_service_client::IdentityServiceClient},
};
use census_testkit::{
    TestResult,
    h2attack::{self, Call, EMPTY_SETTINGS, PREFACE, call, framed, hello, prefix, push},
    process,
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
    sample::Latency,
};

/// The RSS peak the gate allows under an unauthenticated attack.
const RSS_GATE: u64 = 64 * 1024 * 1024;

/// `--max-inflight-message-bytes` in this bench: what authenticated streams may hold
/// in partial large messages together, on top of [`RSS_GATE`].
const INFLIGHT_BUDGET: u64 = 64 * 1024 * 1024;

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
    "--max-inflight-message-bytes",
    "67108864",
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
    let passed = attacks.iter().all(|f| {
        let gate = if f.unauthenticated {
            RSS_GATE
        } else {
            RSS_GATE + INFLIGHT_BUDGET
        };
        f.rss_peak < gate
    });
    say(format!(
        "gate: RSS peak under {} MiB for every unauthenticated attack, under {} MiB (+ --max-inflight-message-bytes) for Hello'd streams: {}",
        RSS_GATE >> 20,
        (RSS_GATE + INFLIGHT_BUDGET) >> 20,
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

/// Its open descriptors, 0 once it is gone.
fn fds(pid: u32) -> usize {
    process::fds(pid).unwrap_or(0)
}

/// Its RSS in bytes, 0 once it is gone.
fn rss(pid: u32) -> u64 {
    process::rss_kib(pid).map_or(0, |kib| kib * 1024)
}

async fn measure(op: &Operator, attack: Attack) -> anyhow::Result<Figures> {
    let pid = op.pid;
    let addr = op.launch.grpc;
    get(addr).await?;
    let (rss_before, fds_before) = (rss(pid), fds(pid));
    let sampler = process::Watch::start(pid);
    let stop = Arc::new(AtomicBool::new(false));
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
    let peaks = sampler.stop();
    // Closed connections and freed buffers: what is left a second later.
    tokio::time::sleep(Duration::from_secs(1)).await;
    Ok(Figures {
        attack: attack.name(),
        unauthenticated: !matches!(attack, Attack::StalledSnapshot),
        rss_before,
        rss_peak: rss_before.max(peaks.rss_kib * 1024),
        rss_after: rss(pid),
        fds_before,
        fds_peak: fds_before.max(peaks.fds),
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
                let with_hello = matches!(attack, Attack::StalledSnapshot);
                let path = if i % 2 == 0 && !with_hello {
                    "/census.v1.IdentityService/Allocate"
                } else {
                    "/census.v1.EndpointSync/Sync"
                };
                tasks.spawn(async move {
                    let Call {
                        answer, mut send, ..
                    } = call(addr, path).await?;
                    if with_hello {
                        send.send_data(framed(&hello(&format!("node-{i}"), "v1")), false)?;
                    }
                    send.send_data(prefix(39_000_000), false)?;
                    push(&mut send, &body).await;
                    code_of(answer).await
                });
            }
        }
        Attack::AgentVersion => {
            for i in 0..5 {
                tasks.spawn(async move {
                    let huge = framed(&hello(&format!("node-{i}"), "v".repeat(30 << 20)));
                    let Call {
                        answer, mut send, ..
                    } = call(addr, "/census.v1.EndpointSync/Sync").await?;
                    push(&mut send, &huge).await;
                    code_of(answer).await
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
                        // The request stays open (and stalls) while the answer is awaited.
                        let Call {
                            answer,
                            send: _send,
                            ..
                        } = call(addr, "/census.v1.IdentityService/Get").await?;
                        return code_of(answer).await;
                    }
                    let mut tcp = TcpStream::connect(addr).await?;
                    match kind {
                        1 => tcp.write_all(&PREFACE[..12]).await?,
                        2 => tcp.write_all(PREFACE).await?,
                        3 => {
                            tcp.write_all(PREFACE).await?;
                            tcp.write_all(EMPTY_SETTINGS).await?;
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

/// The call's gRPC status code, as `tonic::Code` names it.
async fn code_of(answer: h2::client::ResponseFuture) -> TestResult<String> {
    Ok(format!("{:?}", h2attack::status_of(answer).await?.code()))
}
