//! What an outsider can do to the operator's gRPC port before it authenticates, tried
//! against a real `census-operator` process over loopback with raw HTTP/2 (the `h2`
//! crate: a client that sends exactly what an attacker would, stalls where it likes,
//! and respects flow control so that the test itself holds no large buffers).
//!
//! Each attack asserts that the refusal carries the right status, that every stalled
//! connection is closed within its timeout, that a concurrent Get from a new client
//! still answers, that the operator's resident memory stays under [`RSS_BOUND_KIB`],
//! and that its descriptors come back. The timeouts are the operator's flags, small
//! here. Load figures (RSS, descriptors, Get latency) are the benchmark's
//! (`cargo xtask bench abuse`), not asserted here.

use std::{
    net::SocketAddr,
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use census_proto::{
    PROTOCOL_VERSION,
    pb::{
        self, identity_service_client::IdentityServiceClient,
        node_service_client::NodeServiceClient,
    },
};
use census_testkit::{
    h2attack::{EMPTY_SETTINGS, PREFACE, call, framed, hello, prefix, push},
    process::{self, Spawned},
};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpStream,
};
use tonic::{Code, Status};

type Fallible<T = ()> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The operator's resident memory stays under this during every attack (the deploy
/// limit is 512 MiB; the attacks below would take it past that without the limits).
const RSS_BOUND_KIB: u64 = 64 * 1024;

/// The operator's transport timeouts in these tests: long enough that every
/// connection a test opens is still open when the last one is (opening 400 takes
/// over a second on a loaded machine), short enough to keep the tests quick.
const HANDSHAKE: Duration = Duration::from_secs(3);
const IDLE: Duration = Duration::from_secs(4);
const MESSAGE: Duration = Duration::from_secs(2);

/// Added to a timeout before a connection still open counts as not closed: the
/// operator's timers, scheduling on a loaded machine, and the test's own polling.
const SLACK: Duration = Duration::from_secs(5);

/// A `census-operator` process, its stderr counted and drained.
struct Operator {
    _process: Spawned,
    addr: SocketAddr,
    admin_addr: SocketAddr,
    pid: u32,
    log_bytes: Arc<AtomicU64>,
    _dir: tempfile::TempDir,
}

impl Operator {
    fn start(args: &[&str]) -> Fallible<Self> {
        Self::launch(None, args)
    }

    /// Like [`Operator::start`], the process limited to `nofile` open descriptors
    /// (`ulimit -n`), as a container's runtime may limit it.
    fn start_with_nofile(nofile: u32, args: &[&str]) -> Fallible<Self> {
        Self::launch(Some(nofile), args)
    }

    fn launch(nofile: Option<u32>, args: &[&str]) -> Fallible<Self> {
        let dir = tempfile::tempdir()?;
        let timeouts = [
            ("--handshake-timeout", HANDSHAKE),
            ("--idle-timeout", IDLE),
            ("--message-timeout", MESSAGE),
        ];
        let binary = env!("CARGO_BIN_EXE_census-operator");
        let mut command = match nofile {
            // The shell execs the operator: the child's pid is the operator's.
            Some(nofile) => {
                let mut sh = Command::new("sh");
                sh.arg("-c")
                    .arg(format!("ulimit -n {nofile} && exec \"$0\" \"$@\""))
                    .arg(binary);
                sh
            }
            None => Command::new(binary),
        };
        command
            .args([
                "--grpc-listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
            ])
            .arg("--store-path")
            .arg(dir.path().join("census.redb"))
            .args(["--adoption-window", "0s"]);
        for (flag, value) in timeouts {
            command.arg(flag).arg(format!("{}ms", value.as_millis()));
        }
        let process = Spawned::start(command.args(args), Duration::from_secs(30))?;
        Ok(Self {
            addr: process.grpc,
            admin_addr: process.admin,
            pid: process.pid(),
            log_bytes: Arc::clone(&process.log_bytes),
            _process: process,
            _dir: dir,
        })
    }

    fn rss_kib(&self) -> Fallible<u64> {
        process::rss_kib(self.pid)
    }

    fn fds(&self) -> Fallible<usize> {
        process::fds(self.pid)
    }

    /// A Get from a new client: the reserved identity 1, which needs no state.
    async fn get(&self) -> Fallible<Duration> {
        let started = Instant::now();
        let answer = tokio::time::timeout(Duration::from_secs(10), async {
            let mut client =
                IdentityServiceClient::connect(format!("http://{}", self.addr)).await?;
            let identity = client
                .get(pb::GetRequest {
                    protocol_version: PROTOCOL_VERSION,
                    id: 1,
                })
                .await?
                .into_inner();
            Fallible::Ok(identity)
        })
        .await
        .map_err(|_| "a Get got no answer within 10s during the attack")??;
        assert_eq!(answer.id, 1);
        Ok(started.elapsed())
    }

    /// The nodes the operator knows: an attack before Hello adds none.
    async fn nodes(&self) -> Fallible<Vec<String>> {
        let mut client = NodeServiceClient::connect(format!("http://{}", self.addr)).await?;
        let nodes = client
            .list_nodes(pb::ListNodesRequest {
                protocol_version: PROTOCOL_VERSION,
            })
            .await?
            .into_inner()
            .nodes;
        Ok(nodes.into_iter().map(|n| n.name).collect())
    }

    /// Samples the operator's RSS (and descriptors) until the returned guard is
    /// stopped: the peaks.
    fn watch_rss(&self) -> process::Watch {
        process::Watch::start(self.pid)
    }
}

/// How long a refused or timed-out call may take to be answered before the test fails.
const ANSWER: Duration = Duration::from_secs(20);

/// The call's status: from trailers-only headers, or from the trailers after its messages.
async fn status_of(answer: h2::client::ResponseFuture) -> Fallible<Status> {
    tokio::time::timeout(ANSWER, census_testkit::h2attack::status_of(answer))
        .await
        .map_err(|_| format!("the call was not answered within {ANSWER:?}"))?
}

fn expect(status: &Status, code: Code, needle: &str) {
    assert_eq!(status.code(), code, "{status:?}");
    assert!(
        status.message().contains(needle),
        "{needle:?} not in {status:?}"
    );
}

/// Waits until a raw connection is closed by the operator (EOF or reset): how long
/// after `since` it was, or None if it was still open at `limit`.
async fn closed_within(mut tcp: TcpStream, since: Instant, limit: Duration) -> Option<Duration> {
    let mut buf = [0u8; 1024];
    let read_all = async {
        loop {
            match tcp.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    let deadline = since + limit;
    tokio::time::timeout_at(deadline.into(), read_all)
        .await
        .ok()
        .map(|()| since.elapsed())
}

// ---------------------------------------------------------------------------
// Oversize messages
// ---------------------------------------------------------------------------

/// 15 connections, each declaring a 39 MB message and sending 38 MB of it, on a
/// unary call and on an EndpointSync stream before its Hello: each is refused at the
/// prefix, RESOURCE_EXHAUSTED naming the limit, and the operator buffers none of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversize_messages_are_refused_at_their_prefix_before_they_are_buffered() -> Fallible {
    let op = Operator::start(&[])?;
    op.get().await?;
    let rss = op.watch_rss();
    let body = Bytes::from(vec![0u8; 38_000_000]);
    let mut attacks = Vec::new();
    for i in 0..15 {
        let path = if i % 2 == 0 {
            "/census.v1.IdentityService/Allocate"
        } else {
            "/census.v1.EndpointSync/Sync"
        };
        let (addr, body) = (op.addr, body.clone());
        attacks.push(tokio::spawn(async move {
            let mut call = call(addr, path).await?;
            call.send.send_data(prefix(39_000_000), false)?;
            let sent = push(&mut call.send, &body).await;
            let status = status_of(call.answer).await?;
            call.connection.abort();
            Fallible::Ok((path, sent, status))
        }));
    }
    let during = op.get().await;
    for attack in attacks {
        let (path, sent, status) = attack.await??;
        expect(
            &status,
            Code::ResourceExhausted,
            "a message of 39000000 bytes is over",
        );
        let limit = if path.ends_with("Sync") {
            "the limit before an accepted Hello"
        } else {
            "the request limit (--max-labels x 512 bytes + 4096 bytes): 36864 bytes"
        };
        expect(&status, Code::ResourceExhausted, limit);
        assert!(
            sent < 38_000_000,
            "{path}: all of the message was taken ({sent} bytes)"
        );
    }
    let peak = rss.stop().rss_kib;
    during?;
    assert!(
        peak < RSS_BOUND_KIB,
        "the operator's RSS peaked at {peak} KiB"
    );
    assert_eq!(op.nodes().await?, Vec::<String>::new(), "no state changed");
    Ok(())
}

/// Oversize on a unary call, on a stream before Hello and after it (past the
/// snapshot limit): RESOURCE_EXHAUSTED every time, never a stream that ends OK.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversize_after_hello_ends_the_stream_with_resource_exhausted() -> Fallible {
    let op = Operator::start(&["--max-snapshot-endpoints", "100"])?;
    // 100 endpoints x 4096 bytes is under the 4 MiB floor: the limit is 4 MiB.
    let mut call = call(op.addr, "/census.v1.EndpointSync/Sync").await?;
    call.send.send_data(framed(&hello("node-a", "v1")), false)?;
    call.send.send_data(prefix(5 * 1024 * 1024), false)?;
    let status = status_of(call.answer).await?;
    expect(
        &status,
        Code::ResourceExhausted,
        "a message of 5242880 bytes is over the message limit (--max-snapshot-endpoints x 4096 bytes): 4194304 bytes",
    );
    Ok(())
}

// ---------------------------------------------------------------------------
// Malformed protobuf
// ---------------------------------------------------------------------------

/// Bytes that are not the protobuf they claim to be: INVALID_ARGUMENT, on a unary
/// call and on the stream, before and after Hello.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_protobuf_is_invalid_argument() -> Fallible {
    let op = Operator::start(&[])?;
    // Field 1 with wire type 7, which does not exist.
    let garbage = Bytes::from_static(&[0, 0, 0, 0, 3, 0x0f, 0xff, 0xff]);

    let mut unary = call(op.addr, "/census.v1.IdentityService/Get").await?;
    unary.send.send_data(garbage.clone(), true)?;
    expect(
        &status_of(unary.answer).await?,
        Code::InvalidArgument,
        "failed to decode Protobuf message",
    );

    let mut first = call(op.addr, "/census.v1.EndpointSync/Sync").await?;
    first.send.send_data(garbage.clone(), false)?;
    expect(
        &status_of(first.answer).await?,
        Code::InvalidArgument,
        "failed to decode Protobuf message",
    );

    let mut later = call(op.addr, "/census.v1.EndpointSync/Sync").await?;
    later
        .send
        .send_data(framed(&hello("node-b", "v1")), false)?;
    later.send.send_data(garbage, false)?;
    expect(
        &status_of(later.answer).await?,
        Code::InvalidArgument,
        "failed to decode Protobuf message",
    );
    op.get().await?;
    Ok(())
}

// ---------------------------------------------------------------------------
// Stalled messages and connections
// ---------------------------------------------------------------------------

/// A message that stops halfway: on a Hello'd stream (where a snapshot-sized message
/// is allowed), 3 MB of a declared 4 MB, then nothing. The stream ends with
/// DEADLINE_EXCEEDED within the message timeout, and the memory comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_partial_message_times_out_and_its_memory_comes_back() -> Fallible {
    let op = Operator::start(&["--max-snapshot-endpoints", "100"])?;
    op.get().await?;
    let before = op.rss_kib()?;
    let mut call = call(op.addr, "/census.v1.EndpointSync/Sync").await?;
    call.send.send_data(framed(&hello("node-c", "v1")), false)?;
    call.send.send_data(prefix(4_000_000), false)?;
    let sent = push(&mut call.send, &Bytes::from(vec![0u8; 3_000_000])).await;
    assert_eq!(sent, 3_000_000, "the operator took the message in");
    let stalled = Instant::now();
    let status = tokio::time::timeout(MESSAGE + SLACK, status_of(call.answer))
        .await
        .map_err(|_| "the stalled message did not time out")??;
    expect(
        &status,
        Code::DeadlineExceeded,
        "a message of 4000000 bytes did not arrive in full within 2s",
    );
    assert!(
        stalled.elapsed() < MESSAGE + SLACK,
        "{:?}",
        stalled.elapsed()
    );
    op.get().await?;
    // The message's buffer is freed; jemalloc hands the pages back after its decay
    // time (10 s).
    let back = testkit_eventually(Duration::from_secs(20), || {
        let now = op.rss_kib().ok()?;
        (now < before + 2 * 1024).then_some(now)
    })
    .await;
    assert!(
        back.is_some(),
        "RSS {before} KiB before, {} KiB after",
        op.rss_kib()?
    );
    Ok(())
}

/// 150 half-sent HTTP/2 prefaces and 250 stalled connections of five kinds: every
/// one is closed within its timeout, a new client's Get answers meanwhile, and the
/// operator's descriptors come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_open_and_stalled_connections_are_closed_within_their_timeouts() -> Fallible {
    let op = Operator::start(&[])?;
    op.get().await?;
    let fds_before = op.fds()?;
    let watch = op.watch_rss();
    let started = Instant::now();
    let mut raw = Vec::new();
    // A HEADERS frame announcing 100 bytes, of which 3 come.
    let partial_headers: &[u8] = &[0, 0, 100, 1, 4, 0, 0, 0, 1, 0x82, 0x86, 0x84];
    for i in 0..300 {
        let mut tcp = TcpStream::connect(op.addr).await?;
        let (kind, timeout) = match i {
            0..150 => {
                tcp.write_all(&PREFACE[..12]).await?;
                ("half preface", HANDSHAKE)
            }
            150..200 => ("nothing sent", HANDSHAKE),
            200..250 => {
                tcp.write_all(PREFACE).await?;
                ("preface only", IDLE)
            }
            _ => {
                tcp.write_all(PREFACE).await?;
                tcp.write_all(EMPTY_SETTINGS).await?;
                tcp.write_all(partial_headers).await?;
                ("partial headers", IDLE)
            }
        };
        raw.push((kind, timeout, tcp));
    }
    // Calls whose request is open and stalls: headers and no message, and part of
    // a message. They end after the message timeout; the connection, idle then,
    // after the idle timeout.
    let mut calls = Vec::new();
    for i in 0..100 {
        let mut call = call(op.addr, "/census.v1.IdentityService/Get").await?;
        if i % 2 == 1 {
            call.send.send_data(prefix(1000), false)?;
            call.send.send_data(Bytes::from_static(&[0; 10]), false)?;
        }
        calls.push(call);
    }
    let opened = Instant::now();
    let mut gets = Vec::new();
    for _ in 0..5 {
        gets.push(op.get().await?);
    }
    let mut waits = Vec::new();
    for (kind, timeout, tcp) in raw {
        waits.push(tokio::spawn(async move {
            (
                kind,
                timeout,
                closed_within(
                    tcp,
                    started,
                    timeout + SLACK + opened.duration_since(started),
                )
                .await,
            )
        }));
    }
    for (kind, timeout, closed) in futures::future::join_all(waits).await.into_iter().flatten() {
        assert!(
            closed.is_some(),
            "a connection ({kind}) was still open {timeout:?} + {SLACK:?} after it stalled"
        );
    }
    for call in calls {
        let status = tokio::time::timeout(MESSAGE + SLACK, status_of(call.answer))
            .await
            .map_err(|_| "a stalled call did not end within the message timeout")??;
        assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
        tokio::time::timeout(IDLE + SLACK, call.connection)
            .await
            .map_err(
                |_| "a connection whose call ended was not closed within the idle timeout",
            )??;
    }
    let peaks = watch.stop();
    assert!(
        peaks.rss_kib < RSS_BOUND_KIB,
        "the operator's RSS peaked at {} KiB",
        peaks.rss_kib
    );
    // The connections really were held: the operator had them all open at once.
    assert!(
        peaks.fds >= fds_before + 300,
        "at most {} descriptors (from {fds_before}) with 400 connections open",
        peaks.fds
    );
    testkit_eventually(Duration::from_secs(10), || {
        let now = op.fds().unwrap_or(usize::MAX);
        (now <= fds_before + 2).then_some(())
    })
    .await
    .ok_or_else(|| {
        format!(
            "descriptors did not come back: {fds_before} before, {} after",
            op.fds().unwrap_or(0)
        )
    })?;
    op.get().await?;
    Ok(())
}

/// Past --max-connections, a new connection is closed at once; one comes in again
/// when others close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_cap_are_closed_at_once() -> Fallible {
    let op = Operator::start(&["--max-connections", "20"])?;
    let mut held = Vec::new();
    for _ in 0..20 {
        let mut tcp = TcpStream::connect(op.addr).await?;
        tcp.write_all(PREFACE).await?;
        held.push(tcp);
    }
    // The listener's backlog completes the handshake; the operator closes it.
    let over = TcpStream::connect(op.addr).await?;
    let closed = closed_within(over, Instant::now(), HANDSHAKE / 2).await;
    assert!(
        closed.is_some(),
        "a connection over the cap was not closed at once"
    );
    assert!(op.get().await.is_err(), "a Get over the cap got in");
    // The operator counts a connection closed once its task sees the close: a new
    // one gets in soon after, not necessarily at once.
    drop(held);
    let deadline = Instant::now() + HANDSHAKE;
    loop {
        match op.get().await {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() >= deadline => {
                return Err(format!(
                    "no Get within {HANDSHAKE:?} of the held connections closing: {e}"
                )
                .into());
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

async fn testkit_eventually<T>(
    within: Duration,
    mut check: impl FnMut() -> Option<T>,
) -> Option<T> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(value) = check() {
            return Some(value);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ---------------------------------------------------------------------------
// Strings from clients
// ---------------------------------------------------------------------------

/// A 30 MiB agent_version is refused at the prefix (RESOURCE_EXHAUSTED); one that
/// fits the Hello limit is logged bounded: five Hellos grow the log by lines, not
/// by what they carried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_agent_version_is_refused_and_a_long_one_is_logged_bounded() -> Fallible {
    let op = Operator::start(&[])?;
    let rss = op.watch_rss();
    for _ in 0..5 {
        let huge = framed(&hello("node-d", "v".repeat(30 * 1024 * 1024)));
        let mut call = call(op.addr, "/census.v1.EndpointSync/Sync").await?;
        let sent = push(&mut call.send, &huge).await;
        assert!(sent < huge.len(), "all of a 30 MiB Hello was taken");
        let status = status_of(call.answer).await?;
        expect(
            &status,
            Code::ResourceExhausted,
            "the limit before an accepted Hello",
        );
    }
    assert_eq!(op.nodes().await?, Vec::<String>::new(), "no state changed");
    let log_before = op.log_bytes.load(Ordering::Relaxed);
    let mut open = Vec::new();
    for i in 0..5 {
        let mut call = call(op.addr, "/census.v1.EndpointSync/Sync").await?;
        call.send.send_data(
            framed(&hello(
                &format!("node-{i}"),
                "\n1.0 forged line ".repeat(1500),
            )),
            false,
        )?;
        let answer = call.answer.await?;
        assert_eq!(answer.status(), 200);
        open.push((call.send, answer, call.connection));
    }
    op.get().await?;
    let grown = op.log_bytes.load(Ordering::Relaxed) - log_before;
    let peak = rss.stop().rss_kib;
    assert!(
        grown < 5 * 4096,
        "five Hellos with 25 KB versions grew the log by {grown} bytes"
    );
    assert!(
        peak < RSS_BOUND_KIB,
        "the operator's RSS peaked at {peak} KiB"
    );
    Ok(())
}

/// A client whose connection was closed for idleness gets a new one on its next call:
/// the idle timeout costs a real client (the CLI, a tool holding a channel) nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_channel_idle_past_the_idle_timeout_calls_again() -> Fallible {
    let op = Operator::start(&[])?;
    let mut client = IdentityServiceClient::connect(format!("http://{}", op.addr)).await?;
    let get = pb::GetRequest {
        protocol_version: PROTOCOL_VERSION,
        id: 1,
    };
    client.get(get).await?;
    let fds = op.fds()?;
    testkit_eventually(IDLE + SLACK, || (op.fds().ok()? < fds).then_some(()))
        .await
        .ok_or("the idle connection was not closed")?;
    // The operator's side is closed; the client learns it from the close (and the
    // GOAWAY before it) on its connection's task. A call sent before that task has
    // run would go out on the closing connection: give it the moment a real client's
    // next call, seconds later, always has (CI saw it Cancelled on a loaded machine).
    tokio::time::sleep(Duration::from_millis(500)).await;
    client.get(get).await?;
    Ok(())
}

// ---------------------------------------------------------------------------
// The admin port
// ---------------------------------------------------------------------------

/// The admin server's limits in these tests.
const ADMIN_MAX_CONNECTIONS: usize = 64;
const ADMIN_HEADER: Duration = Duration::from_secs(3);
const ADMIN_IDLE: Duration = Duration::from_secs(4);

/// Descriptors the operator may hold besides its admin connections while they are
/// held: the agent's and the test's gRPC connections, and what comes and goes.
const FDS_BESIDES_ADMIN: usize = 16;

/// An answer read from a raw HTTP/1.1 connection, until the server closes it.
async fn read_to_close(tcp: &mut TcpStream) -> Vec<u8> {
    let mut all = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tcp.read(&mut buf).await {
            Ok(0) | Err(_) => return all,
            Ok(n) => all.extend_from_slice(&buf[..n]),
        }
    }
}

/// GET `path` on the admin port: the answer's text, status line first.
async fn admin_get(addr: SocketAddr, path: &str) -> Fallible<String> {
    let answer = tokio::time::timeout(Duration::from_secs(10), async {
        let mut tcp = TcpStream::connect(addr).await?;
        tcp.write_all(
            format!("GET {path} HTTP/1.1\r\nhost: census\r\nconnection: close\r\n\r\n").as_bytes(),
        )
        .await?;
        Fallible::Ok(read_to_close(&mut tcp).await)
    })
    .await
    .map_err(|_| format!("GET {path} on the admin port got no answer within 10s"))??;
    Ok(String::from_utf8_lossy(&answer).into_owned())
}

/// The admin port is unauthenticated and listens on every address by default (it
/// serves /metrics and the probes). 400 connections held on it, under a descriptor
/// limit of 256: sending nothing, trickling a request's headers, stopping in the
/// middle of the request line, and stopping in the middle of a request's body. The
/// operator holds at most --admin-max-connections of them (the rest are closed as
/// they are accepted), closes every one within the header timeout, and meanwhile an
/// agent says Hello and its snapshot is applied, and a new client's Get answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_admin_connections_are_capped_and_closed_while_an_agent_syncs() -> Fallible {
    use census_testkit::agent::{Agent, endpoint, session};

    let cap = ADMIN_MAX_CONNECTIONS.to_string();
    let header = format!("{}ms", ADMIN_HEADER.as_millis());
    let idle = format!("{}ms", ADMIN_IDLE.as_millis());
    let op = Operator::start_with_nofile(
        256,
        &[
            "--admin-max-connections",
            &cap,
            "--admin-header-timeout",
            &header,
            "--admin-idle-timeout",
            &idle,
        ],
    )?;
    let healthz = admin_get(op.admin_addr, "/healthz").await?;
    assert!(healthz.starts_with("HTTP/1.1 200"), "{healthz}");
    op.get().await?;
    let fds_before = op.fds()?;
    let watch = op.watch_rss();
    let started = Instant::now();
    let mut held = Vec::new();
    let mut trickled = Vec::new();
    for i in 0..400 {
        let mut tcp = TcpStream::connect(op.admin_addr).await?;
        // A connection over the cap may be closed before these writes: that is the
        // cap working.
        let kind = match i % 4 {
            0 => "nothing sent",
            1 => {
                let _ = tcp
                    .write_all(b"GET /metrics HTTP/1.1\r\nhost: census\r\n")
                    .await;
                "headers trickled"
            }
            2 => {
                let _ = tcp.write_all(b"GET /metr").await;
                "half a request line"
            }
            _ => {
                let _ = tcp
                    .write_all(
                        b"POST /metrics HTTP/1.1\r\nhost: census\r\ncontent-length: 100000\r\n\r\npartial",
                    )
                    .await;
                "half a body"
            }
        };
        if kind == "headers trickled" {
            let (read, write) = tcp.into_split();
            trickled.push(write);
            held.push((kind, Err(read)));
        } else {
            held.push((kind, Ok(tcp)));
        }
    }
    let opened = Instant::now();
    // A header line a second on the trickled connections, past the header timeout.
    let trickle = tokio::spawn(async move {
        let mut interval = tokio::time::interval(Duration::from_secs(1));
        for _ in 0..(ADMIN_HEADER.as_secs() + 3) {
            interval.tick().await;
            for write in &mut trickled {
                let _ = write.write_all(b"x-trickle: 1\r\n").await;
            }
        }
    });

    // An agent syncs meanwhile: its Hello, and a snapshot applied whole.
    let (mut agent, _) = tokio::time::timeout(
        Duration::from_secs(20),
        Agent::connect(&op.addr, "node-a", session(1)),
    )
    .await
    .map_err(|_| "an agent's Hello got no answer while the admin port was held")??;
    let answer = agent
        .snapshot(vec![endpoint(
            "default",
            "web",
            &["10.1.0.5"],
            300,
            &["k8s:app=web"],
        )])
        .await?;
    assert!(answer.ack.rejected.is_empty(), "{:?}", answer.ack);
    op.get().await?;
    let during = op.fds()?;

    let mut waits = Vec::new();
    for (kind, tcp) in held {
        let limit = ADMIN_HEADER + SLACK + opened.duration_since(started);
        waits.push(tokio::spawn(async move {
            let closed = match tcp {
                Ok(tcp) => closed_within(tcp, started, limit).await,
                Err(read) => {
                    let mut read = read;
                    let mut buf = [0u8; 1024];
                    let all = async {
                        loop {
                            match read.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(_) => {}
                            }
                        }
                    };
                    tokio::time::timeout_at((started + limit).into(), all)
                        .await
                        .ok()
                        .map(|()| started.elapsed())
                }
            };
            (kind, closed)
        }));
    }
    for (kind, closed) in futures::future::join_all(waits).await.into_iter().flatten() {
        assert!(
            closed.is_some(),
            "an admin connection ({kind}) was still open {ADMIN_HEADER:?} + {SLACK:?} after it was opened"
        );
    }
    trickle.abort();
    let peaks = watch.stop();
    assert!(
        peaks.fds <= fds_before + ADMIN_MAX_CONNECTIONS + FDS_BESIDES_ADMIN,
        "the operator held {} descriptors (from {fds_before}; {during} while the agent synced) with 400 admin connections open and --admin-max-connections {ADMIN_MAX_CONNECTIONS}",
        peaks.fds
    );
    // The cap was reached: the operator did hold connections.
    assert!(
        peaks.fds >= fds_before + ADMIN_MAX_CONNECTIONS / 2,
        "at most {} descriptors (from {fds_before}): the connections were not held",
        peaks.fds
    );
    testkit_eventually(Duration::from_secs(10), || {
        let now = op.fds().unwrap_or(usize::MAX);
        (now <= fds_before + 4).then_some(())
    })
    .await
    .ok_or_else(|| {
        format!(
            "descriptors did not come back: {fds_before} before, {} after",
            op.fds().unwrap_or(0)
        )
    })?;
    let metrics = admin_get(op.admin_addr, "/metrics").await?;
    assert!(metrics.starts_with("HTTP/1.1 200"), "{metrics}");
    let refused = metrics
        .lines()
        .find_map(|l| l.strip_prefix("census_admin_connections_refused_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .ok_or("no census_admin_connections_refused_total in /metrics")?;
    assert!(
        refused > 0.0,
        "no admin connection was refused over the cap"
    );
    Ok(())
}

/// A client that sends a request and then does not read its answer holds the
/// connection only until the idle timeout; one that answers promptly keeps working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_client_that_stops_reading_is_closed_after_the_idle_timeout() -> Fallible {
    let header = format!("{}ms", ADMIN_HEADER.as_millis());
    let idle = format!("{}ms", ADMIN_IDLE.as_millis());
    let op = Operator::start(&[
        "--admin-header-timeout",
        &header,
        "--admin-idle-timeout",
        &idle,
    ])?;
    let fds_before = op.fds()?;
    // Many requests pipelined, none of the answers read: the operator's writes
    // stall once the socket buffers are full.
    let mut tcp = TcpStream::connect(op.admin_addr).await?;
    let started = Instant::now();
    let request = b"GET /metrics HTTP/1.1\r\nhost: census\r\n\r\n";
    let mut pipelined = Vec::new();
    for _ in 0..20_000 {
        pipelined.extend_from_slice(request);
    }
    let writer = tokio::spawn(async move {
        let _ = tcp.write_all(&pipelined).await;
        tcp
    });
    testkit_eventually(SLACK, || (op.fds().ok()? > fds_before).then_some(()))
        .await
        .ok_or("the operator did not accept the connection")?;
    testkit_eventually(ADMIN_IDLE + ADMIN_HEADER + SLACK, || {
        (op.fds().ok()? <= fds_before).then_some(())
    })
    .await
    .ok_or_else(|| {
        format!(
            "a connection whose answers were not read was still open {:?} after it was opened",
            started.elapsed()
        )
    })?;
    writer.abort();
    let healthz = admin_get(op.admin_addr, "/healthz").await?;
    assert!(healthz.starts_with("HTTP/1.1 200"), "{healthz}");
    Ok(())
}
