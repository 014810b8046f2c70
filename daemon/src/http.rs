//! The admin HTTP server both daemons run (`/metrics`, `/healthz`, `/readyz`, heap
//! profiles, the agent's `/v1` API): its own accept loop and HTTP/1 connections, so
//! that what an unauthenticated caller holds open is bounded.
//!
//! - At most `--admin-max-connections` connections are open per listener; one more
//!   is closed as it is accepted, before hyper sees it, counted
//!   (`admin_connections_refused`) and logged at most once per
//!   [`census_transport::accept::REFUSAL_LOG_EVERY`] (the accept loop is the gRPC
//!   server's, `census_transport::accept`).
//! - A request's head (request line and headers) must arrive within
//!   `--admin-header-timeout` of the connection's start or of the previous answer
//!   (hyper's header read timeout): a connection that sends nothing, trickles its
//!   headers or stops half-way through them is closed, and so is a keep-alive
//!   connection with no next request.
//! - A connection on which no byte moves for `--admin-idle-timeout` while none of
//!   its requests is being handled (a client that stops reading its answer) is
//!   closed. A handler that takes long (a heap profile) is not cut.
//!
//! A request's body is never read by the admin routes: hyper answers and then closes
//! a connection whose request body is still coming, so a half-sent body holds
//! nothing past its answer.

use std::{
    future::Future,
    io,
    net::SocketAddr,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use axum::Router;
use census_transport::{
    ReasonLabels,
    accept::{Acceptor, ConnectionMetrics, Named, Open},
};
use clap::Args;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::{
    metrics::{counter::Counter, family::Family},
    registry::Registry,
};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::watch,
    task::JoinSet,
    time::{Instant, Sleep},
};
use tower::ServiceExt as _;
use tracing::debug;

/// How long a stopping server waits for its connections' answers in flight.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// The admin server's limits, flattened into each daemon's command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Args)]
pub struct AdminLimits {
    /// Connections an admin HTTP listener holds open at once (Prometheus, the
    /// kubelet's probes, the `census` CLI); one more is closed as it is accepted,
    /// counted and logged.
    #[arg(long, env = "CENSUS_ADMIN_MAX_CONNECTIONS", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub admin_max_connections: u32,
    /// How long a request's head (request line and headers) may take to arrive, from
    /// the connection's start or the previous answer, before the connection is
    /// closed.
    #[arg(long, env = "CENSUS_ADMIN_HEADER_TIMEOUT", default_value = "10s", value_parser = timeout)]
    pub admin_header_timeout: Duration,
    /// How long an admin connection may go without a byte read or written while no
    /// request of it is being handled (a client that stops reading its answer)
    /// before it is closed.
    #[arg(long, env = "CENSUS_ADMIN_IDLE_TIMEOUT", default_value = "60s", value_parser = timeout)]
    pub admin_idle_timeout: Duration,
}

impl Default for AdminLimits {
    fn default() -> Self {
        Self {
            admin_max_connections: 64,
            admin_header_timeout: Duration::from_secs(10),
            admin_idle_timeout: Duration::from_secs(60),
        }
    }
}

/// A timeout of the admin server: above zero (a zero timeout would close every
/// connection at once).
fn timeout(text: &str) -> Result<Duration, String> {
    let timeout = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if timeout.is_zero() {
        return Err("must be above zero".to_owned());
    }
    Ok(timeout)
}

/// The admin servers' connections, for `/metrics`.
#[derive(Debug, Clone, Default)]
pub struct AdminMetrics(ConnectionMetrics);

impl AdminMetrics {
    /// Registers the metrics in `registry` (under the daemon's prefix).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "admin_connections",
            "Open admin HTTP connections",
            self.0.open.clone(),
        );
        registry.register(
            "admin_connections_refused",
            "Admin HTTP connections closed on accept because --admin-max-connections were open",
            self.0.refused.clone(),
        );
        registry.register(
            "admin_connections_closed",
            "Admin HTTP connections closed by the daemon, by reason (header_timeout, idle_timeout)",
            self.0.closed.clone(),
        );
    }
}

/// Serves `router` on `listener` within `limits` until `shutdown` turns true, then
/// stops accepting, lets answers in flight finish (for up to [`DRAIN_TIMEOUT`]) and
/// returns.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: AdminLimits,
    metrics: AdminMetrics,
    mut shutdown: watch::Receiver<bool>,
) -> io::Result<()> {
    let max_connections = usize::try_from(limits.admin_max_connections).unwrap_or(usize::MAX);
    let named = Named {
        server: "admin",
        cap_flag: "--admin-max-connections",
    };
    let mut acceptor = Acceptor::new(listener, max_connections, named, metrics.0.clone());
    let mut connections = JoinSet::new();
    loop {
        let (accepted, open) = tokio::select! {
            accepted = acceptor.accept() => accepted,
            _ = shutdown.wait_for(|stop| *stop) => break,
            // Reaps finished connections' tasks as they end.
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let (tcp, peer, permit) = (accepted.tcp, accepted.peer, accepted.permit);
        let conn = Conn::new(tcp, peer, limits.admin_idle_timeout, open, &metrics.0);
        let state = Arc::clone(&conn.state);
        let router = router.clone();
        let service = hyper::service::service_fn(move |request| {
            let handling = state.handling();
            let answer = router.clone().oneshot(request);
            async move {
                let answer = answer.await;
                drop(handling);
                answer
            }
        });
        let header_timeout = limits.admin_header_timeout;
        let mut stop = shutdown.clone();
        let closed = metrics.0.closed.clone();
        let ended = move |result: Result<(), hyper::Error>| {
            if let Err(error) = result {
                if error.is_timeout() {
                    closed
                        .get_or_create(&ReasonLabels {
                            reason: "header_timeout",
                        })
                        .inc();
                }
                debug!(%peer, %error, "an admin connection ended");
            }
        };
        connections.spawn(async move {
            let _permit = permit;
            let mut builder = http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout);
            let mut served = std::pin::pin!(builder.serve_connection(TokioIo::new(conn), service));
            tokio::select! {
                result = served.as_mut() => return ended(result),
                _ = stop.wait_for(|stop| *stop) => served.as_mut().graceful_shutdown(),
            }
            ended(served.await);
        });
    }
    drop(acceptor);
    let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        debug!(
            left = connections.len(),
            "admin connections still open at shutdown are closed"
        );
    }
    Ok(())
}

/// What a connection's requests tell its IO. Both live on the connection's task
/// (hyper polls the handler's future there), so a change is seen at the next poll.
#[derive(Debug)]
struct ConnState {
    /// When the connection was accepted: the origin of `last_progress_ns`.
    accepted: Instant,
    /// Requests whose handler is running.
    handlers: AtomicUsize,
    /// When a byte last moved or a handler last finished, in ns since `accepted`.
    last_progress_ns: AtomicU64,
}

impl ConnState {
    fn handling(self: &Arc<Self>) -> Handling {
        self.handlers.fetch_add(1, Ordering::AcqRel);
        Handling(Arc::clone(self))
    }

    fn progressed(&self) {
        let ns = u64::try_from(self.accepted.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.last_progress_ns.store(ns, Ordering::Release);
    }

    /// When the connection is to be closed for idleness, as things stand.
    fn idle_deadline(&self, idle_timeout: Duration) -> Option<Instant> {
        (self.handlers.load(Ordering::Acquire) == 0).then(|| {
            self.accepted
                + Duration::from_nanos(self.last_progress_ns.load(Ordering::Acquire))
                + idle_timeout
        })
    }
}

/// A request being handled: its connection is not idle meanwhile.
#[derive(Debug)]
struct Handling(Arc<ConnState>);

impl Drop for Handling {
    fn drop(&mut self) {
        self.0.progressed();
        self.0.handlers.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One accepted connection, as hyper reads and writes it: closed with an error once
/// it has been idle for its timeout.
struct Conn {
    tcp: TcpStream,
    peer: SocketAddr,
    state: Arc<ConnState>,
    idle_timeout: Duration,
    timer: Pin<Box<Sleep>>,
    closed: Family<ReasonLabels, Counter>,
    _open: Open,
}

impl Conn {
    fn new(
        tcp: TcpStream,
        peer: SocketAddr,
        idle_timeout: Duration,
        open: Open,
        metrics: &ConnectionMetrics,
    ) -> Self {
        let now = Instant::now();
        Self {
            tcp,
            peer,
            state: Arc::new(ConnState {
                accepted: now,
                handlers: AtomicUsize::new(0),
                last_progress_ns: AtomicU64::new(0),
            }),
            idle_timeout,
            timer: Box::pin(tokio::time::sleep_until(now + idle_timeout)),
            closed: metrics.closed.clone(),
            _open: open,
        }
    }

    /// An error once the connection has been idle for its timeout; else arms the
    /// timer that wakes the connection's task when it will have been.
    fn check(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        loop {
            let Some(deadline) = self.state.idle_deadline(self.idle_timeout) else {
                return Ok(());
            };
            if Instant::now() >= deadline {
                self.closed
                    .get_or_create(&ReasonLabels {
                        reason: "idle_timeout",
                    })
                    .inc();
                debug!(peer = %self.peer, "closing an idle admin connection");
                return Err(io::Error::new(io::ErrorKind::TimedOut, "idle_timeout"));
            }
            if self.timer.deadline() != deadline {
                self.timer.as_mut().reset(deadline);
            }
            if self.timer.as_mut().poll(cx).is_pending() {
                return Ok(());
            }
        }
    }

    fn note<T>(&self, result: &Poll<io::Result<T>>, moved: impl FnOnce(&T) -> bool) {
        if let Poll::Ready(Ok(value)) = result
            && moved(value)
        {
            self.state.progressed();
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        this.check(cx)?;
        let before = buf.filled().len();
        let read = Pin::new(&mut this.tcp).poll_read(cx, buf);
        let after = buf.filled().len();
        this.note(&read, |()| after > before);
        read
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        this.check(cx)?;
        let written = Pin::new(&mut this.tcp).poll_write(cx, buf);
        this.note(&written, |n| *n > 0);
        written
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        this.check(cx)?;
        Pin::new(&mut this.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        this.check(cx)?;
        let written = Pin::new(&mut this.tcp).poll_write_vectored(cx, bufs);
        this.note(&written, |n| *n > 0);
        written
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use axum::routing::get;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;

    #[test]
    fn zero_timeouts_are_refused() {
        assert!(timeout("0s").is_err());
        assert_eq!(timeout("2s"), Ok(Duration::from_secs(2)));
    }

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    async fn server(
        limits: AdminLimits,
        router: Router,
    ) -> Result<
        (
            SocketAddr,
            watch::Sender<bool>,
            tokio::task::JoinHandle<io::Result<()>>,
        ),
        io::Error,
    > {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(serve(
            listener,
            router,
            limits,
            AdminMetrics::default(),
            stopped,
        ));
        Ok((addr, stop, task))
    }

    /// Reads until EOF or an error: the server closed the connection.
    async fn closed(tcp: &mut TcpStream) -> Vec<u8> {
        let mut all = Vec::new();
        let mut buf = [0u8; 1024];
        loop {
            match tcp.read(&mut buf).await {
                Ok(0) | Err(_) => return all,
                Ok(n) => all.extend_from_slice(&buf[..n]),
            }
        }
    }

    /// A handler slower than the idle timeout is answered, not cut; the connection
    /// is closed once no next request comes, and one that sends nothing is closed
    /// by the header timeout.
    #[tokio::test]
    async fn a_slow_handler_is_answered_and_an_idle_connection_closed() -> TestResult {
        let limits = AdminLimits {
            admin_max_connections: 4,
            admin_header_timeout: Duration::from_millis(300),
            admin_idle_timeout: Duration::from_millis(200),
        };
        let router = Router::new()
            .route(
                "/slow",
                get(|| async {
                    tokio::time::sleep(Duration::from_millis(600)).await;
                    "slow\n"
                }),
            )
            .route("/fast", get(|| async { "fast\n" }));
        let (addr, stop, task) = server(limits, router).await?;
        let mut tcp = TcpStream::connect(addr).await?;
        tcp.write_all(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
            .await?;
        let started = Instant::now();
        let answer = tokio::time::timeout(Duration::from_secs(5), closed(&mut tcp)).await?;
        let text = String::from_utf8_lossy(&answer);
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        assert!(text.ends_with("slow\n"), "{text}");
        // Kept alive after the answer, then closed: no next request's head came.
        assert!(started.elapsed() >= Duration::from_millis(600));

        // Nothing sent at all: closed by the header timeout.
        let mut silent = TcpStream::connect(addr).await?;
        let started = Instant::now();
        tokio::time::timeout(Duration::from_secs(5), closed(&mut silent)).await?;
        assert!(started.elapsed() >= Duration::from_millis(150));
        let _ = stop.send(true);
        tokio::time::timeout(Duration::from_secs(5), task).await???;
        Ok(())
    }

    /// Past the cap, a new connection is closed at once; one gets in again when
    /// another closes.
    #[tokio::test]
    async fn connections_over_the_cap_are_closed_at_once() -> TestResult {
        let limits = AdminLimits {
            admin_max_connections: 2,
            admin_header_timeout: Duration::from_secs(30),
            admin_idle_timeout: Duration::from_secs(30),
        };
        let router = Router::new().route("/fast", get(|| async { "fast\n" }));
        let (addr, stop, task) = server(limits, router).await?;
        let mut held = Vec::new();
        for _ in 0..2 {
            let mut tcp = TcpStream::connect(addr).await?;
            tcp.write_all(b"GET /fast HTTP/1.1\r\n").await?;
            held.push(tcp);
        }
        let mut over = TcpStream::connect(addr).await?;
        let _ = over
            .write_all(b"GET /fast HTTP/1.1\r\nhost: x\r\n\r\n")
            .await;
        let answer = tokio::time::timeout(Duration::from_secs(5), closed(&mut over)).await?;
        assert!(answer.is_empty(), "{}", String::from_utf8_lossy(&answer));
        drop(held);
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let mut tcp = TcpStream::connect(addr).await?;
            let _ = tcp
                .write_all(b"GET /fast HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                .await;
            let answer = tokio::time::timeout(Duration::from_secs(5), closed(&mut tcp)).await?;
            if answer.starts_with(b"HTTP/1.1 200") {
                break;
            }
            assert!(Instant::now() < deadline, "no connection got in again");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = stop.send(true);
        tokio::time::timeout(Duration::from_secs(5), task).await???;
        Ok(())
    }
}
