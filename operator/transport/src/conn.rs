//! The gRPC server's connections: its own accept loop, so that what tonic lacks is
//! enforced before a connection costs more than a descriptor.
//!
//! - At most `max_connections` are open; one over the cap is closed at once, counted
//!   (`census_grpc_connections_refused`) and logged at most once per
//!   [`crate::accept::REFUSAL_LOG_EVERY`] ([`crate::accept`]).
//! - A connection that has not sent the 24 bytes of the HTTP/2 preface within
//!   `handshake_timeout` is closed. Under TLS the first 24 bytes are the TLS
//!   handshake's, which tonic's own timeout (the same flag) bounds; the preface after
//!   it falls under the idle timeout.
//! - A connection with no open request for `idle_timeout` is closed: one that never
//!   sends a request, one whose last call ended (an agent always holds its stream).
//!
//! The IO handed to tonic keeps `TcpConnectInfo` as its connect info, so
//! `Request::remote_addr` and tonic's TLS (which wraps it) work as with tonic's own
//! listener. Requests find their connection by that address ([`Connections`]) to
//! mark it busy while they are open ([`RequestLayer`], which also holds every
//! request body to its method's message limits: `codec`).

use std::{
    collections::HashMap,
    future::Future,
    io,
    net::SocketAddr,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use futures::{Stream, task::AtomicWaker};
use http_body::Frame;
use parking_lot::Mutex;
use prometheus_client::metrics::{counter::Counter, family::Family};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::OwnedSemaphorePermit,
    time::{Instant, Sleep},
};
use tonic::{
    Status,
    transport::server::{Connected, TcpConnectInfo, TlsConnectInfo},
};
use tower::{Layer, Service};
use tracing::debug;

use crate::{
    ReasonLabels,
    accept::{Acceptor, ConnectionMetrics, Named, Open},
    codec::{self, MessageLimits},
};

/// The HTTP/2 client connection preface (RFC 9113, section 3.4).
const PREFACE_BYTES: usize = 24;

/// What the gRPC server's connections are held to.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// Connections open at once (`--max-connections`).
    pub max_connections: usize,
    /// How long a connection may take to send the HTTP/2 preface.
    pub handshake_timeout: Duration,
    /// How long a connection may go with no open request.
    pub idle_timeout: Duration,
}

/// HTTP/2 flow-control windows, sized for this traffic: an agent's messages are a
/// snapshot every interval (~44 KB at 110 endpoints) and small deltas, so one window
/// holds a usual snapshot whole and a large one (up to the message limit) streams in
/// at a window per round trip; what a peer can make the operator buffer before its
/// handler reads is the connection window, not hyper's 1 MiB per stream. Answers are
/// paced by the agents' windows, and the operator only takes the next one from a
/// stream when the transport has room for it.
pub const STREAM_WINDOW_BYTES: u32 = 256 * 1024;
pub const CONNECTION_WINDOW_BYTES: u32 = 512 * 1024;

/// The open connections, by peer address (unique among one listener's connections).
#[derive(Debug, Default)]
pub struct Connections(Mutex<HashMap<SocketAddr, Arc<ConnState>>>);

impl Connections {
    fn of(&self, peer: SocketAddr) -> Option<Arc<ConnState>> {
        self.0.lock().get(&peer).cloned()
    }
}

/// What requests tell their connection.
#[derive(Debug)]
struct ConnState {
    open_requests: AtomicUsize,
    /// When the last request ended (or the connection was accepted).
    idle_since: Mutex<Instant>,
    /// The connection's reader, woken when it turns idle.
    waker: AtomicWaker,
}

impl ConnState {
    fn request_started(self: &Arc<Self>) -> OpenRequest {
        self.open_requests.fetch_add(1, Ordering::AcqRel);
        OpenRequest(Arc::clone(self))
    }
}

/// An open request on a connection: the connection is not idle while it lives.
#[derive(Debug)]
struct OpenRequest(Arc<ConnState>);

impl Drop for OpenRequest {
    fn drop(&mut self) {
        if self.0.open_requests.fetch_sub(1, Ordering::AcqRel) == 1 {
            *self.0.idle_since.lock() = Instant::now();
            self.0.waker.wake();
        }
    }
}

/// The connections the gRPC server serves: accepted, capped and timed (see the module).
pub fn incoming(
    listener: TcpListener,
    limits: ConnLimits,
    metrics: ConnectionMetrics,
    connections: Arc<Connections>,
) -> impl Stream<Item = Result<Conn, io::Error>> + Send + 'static {
    let named = Named {
        server: "gRPC",
        cap_flag: "--max-connections",
    };
    let closed = metrics.closed.clone();
    let acceptor = Acceptor::new(listener, limits.max_connections, named, metrics);
    futures::stream::unfold(acceptor, move |mut acceptor| {
        let connections = Arc::clone(&connections);
        let closed = closed.clone();
        async move {
            let (accepted, open) = acceptor.accept().await;
            let now = Instant::now();
            let state = Arc::new(ConnState {
                open_requests: AtomicUsize::new(0),
                idle_since: Mutex::new(now),
                waker: AtomicWaker::new(),
            });
            connections
                .0
                .lock()
                .insert(accepted.peer, Arc::clone(&state));
            let conn = Conn {
                tcp: accepted.tcp,
                peer: accepted.peer,
                state,
                connections,
                handshake_deadline: now + limits.handshake_timeout,
                idle_timeout: limits.idle_timeout,
                preface_read: 0,
                timer: Box::pin(tokio::time::sleep_until(now + limits.handshake_timeout)),
                closed,
                _open: open,
                _permit: accepted.permit,
            };
            Some((Ok(conn), acceptor))
        }
    })
}

/// One accepted connection, as tonic reads and writes it.
#[derive(Debug)]
pub struct Conn {
    tcp: TcpStream,
    peer: SocketAddr,
    state: Arc<ConnState>,
    connections: Arc<Connections>,
    handshake_deadline: Instant,
    idle_timeout: Duration,
    /// Bytes read, up to the preface's length.
    preface_read: usize,
    timer: Pin<Box<Sleep>>,
    closed: Family<ReasonLabels, Counter>,
    _open: Open,
    _permit: OwnedSemaphorePermit,
}

impl Conn {
    /// When the connection is to be closed as things stand, and why.
    fn deadline(&self) -> Option<(Instant, &'static str)> {
        let idle = (self.state.open_requests.load(Ordering::Acquire) == 0).then(|| {
            (
                *self.state.idle_since.lock() + self.idle_timeout,
                "idle_timeout",
            )
        });
        let handshake = (self.preface_read < PREFACE_BYTES)
            .then_some((self.handshake_deadline, "handshake_timeout"));
        match (handshake, idle) {
            (Some(h), Some(i)) => Some(if h.0 <= i.0 { h } else { i }),
            (h, i) => h.or(i),
        }
    }

    /// An error once the connection's time is up; else arms the timer that wakes
    /// the reader when it is.
    fn check(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        self.state.waker.register(cx.waker());
        loop {
            let Some((deadline, reason)) = self.deadline() else {
                return Ok(());
            };
            if Instant::now() >= deadline {
                self.closed.get_or_create(&ReasonLabels { reason }).inc();
                debug!(peer = %self.peer, reason, "closing a gRPC connection");
                return Err(io::Error::new(io::ErrorKind::TimedOut, reason));
            }
            if self.timer.deadline() != deadline {
                self.timer.as_mut().reset(deadline);
            }
            if self.timer.as_mut().poll(cx).is_pending() {
                return Ok(());
            }
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.connections.0.lock().remove(&self.peer);
    }
}

impl Connected for Conn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.tcp.connect_info()
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
        if let Poll::Ready(Ok(())) = read {
            this.preface_read = this
                .preface_read
                .saturating_add(buf.filled().len() - before)
                .min(PREFACE_BYTES);
        }
        read
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }
}

/// Per request: marks its connection busy until the answer ends, holds the request
/// body to its method's message limits, and answers a request that is not protobuf
/// with INVALID_ARGUMENT.
#[derive(Debug, Clone)]
pub struct RequestLayer {
    pub connections: Arc<Connections>,
    pub limits: MessageLimits,
    pub refused: Family<ReasonLabels, Counter>,
}

impl<S> Layer<S> for RequestLayer {
    type Service = Requests<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Requests {
            inner,
            layer: self.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Requests<S> {
    inner: S,
    layer: RequestLayer,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

fn peer_of<B>(request: &http::Request<B>) -> Option<SocketAddr> {
    let extensions = request.extensions();
    extensions
        .get::<TcpConnectInfo>()
        .and_then(TcpConnectInfo::remote_addr)
        .or_else(|| {
            extensions
                .get::<TlsConnectInfo<TcpConnectInfo>>()
                .and_then(|tls| tls.get_ref().remote_addr())
        })
}

impl<S, RB> Service<http::Request<tonic::body::Body>> for Requests<S>
where
    S: Service<http::Request<tonic::body::Body>, Response = http::Response<RB>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<tonic::codegen::StdError>,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let open = peer_of(&request)
            .and_then(|peer| self.layer.connections.of(peer))
            .map(|state| state.request_started());
        let (parts, body) = request.into_parts();
        let (body, stream_limit) = codec::limit(
            parts.uri.path(),
            body,
            &self.layer.limits,
            self.layer.refused.clone(),
        );
        let mut request = http::Request::from_parts(parts, tonic::body::Body::new(body));
        if let Some(limit) = stream_limit {
            request.extensions_mut().insert(limit);
        }
        let answer = self.inner.call(request);
        Box::pin(async move {
            let (mut parts, body) = answer.await?.into_parts();
            codec::client_fault_headers(&mut parts.headers);
            let body = Busy {
                body: tonic::body::Body::new(body),
                _open: open,
            };
            Ok(http::Response::from_parts(
                parts,
                tonic::body::Body::new(body),
            ))
        })
    }
}

/// An answer's body, holding its connection busy until it ends.
struct Busy {
    body: tonic::body::Body,
    _open: Option<OpenRequest>,
}

impl http_body::Body for Busy {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}
