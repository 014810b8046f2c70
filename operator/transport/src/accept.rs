//! An accept loop with a connection cap, shared by census's servers (the gRPC
//! server, the admin HTTP servers): a connection over the cap is closed as it is
//! accepted, before anything reads it or gives it a buffer or a task, counted and
//! logged at most once per [`REFUSAL_LOG_EVERY`] with the count since the last
//! line. An accept error (out of descriptors) pauses accepting briefly, since it
//! would come again at once, and is logged the same way.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use prometheus_client::metrics::{counter::Counter, family::Family, gauge::Gauge};
use tokio::{
    net::{TcpListener, TcpStream},
    sync::{OwnedSemaphorePermit, Semaphore},
    time::Instant,
};
use tracing::warn;

use crate::ReasonLabels;

/// Refused connections (and accept errors) are logged at most this often, with
/// their count.
pub const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(10);

/// How long accepting pauses after an error: the error would come again at once.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// A server's connections, for `/metrics`: open now, refused at the cap, closed by
/// the server by reason (timeouts).
#[derive(Debug, Clone, Default)]
pub struct ConnectionMetrics {
    pub open: Gauge,
    pub refused: Counter,
    pub closed: Family<ReasonLabels, Counter>,
}

/// What the accept loop says in its log lines: the server (`gRPC`, `admin`) and the
/// flag that sets its cap.
#[derive(Debug, Clone, Copy)]
pub struct Named {
    pub server: &'static str,
    pub cap_flag: &'static str,
}

/// Accepts connections up to a cap.
#[derive(Debug)]
pub struct Acceptor {
    listener: TcpListener,
    permits: Arc<Semaphore>,
    max_connections: usize,
    named: Named,
    metrics: ConnectionMetrics,
    refusals: RateLimited,
    accept_errors: RateLimited,
}

/// An accepted connection, counted open until `permit` and the connection are
/// dropped (see [`Accepted::opened`]).
#[derive(Debug)]
pub struct Accepted {
    pub tcp: TcpStream,
    pub peer: SocketAddr,
    /// Holds the connection's place under the cap.
    pub permit: OwnedSemaphorePermit,
}

/// A connection's place in [`ConnectionMetrics::open`]: counted while it lives.
#[derive(Debug)]
pub struct Open(Gauge);

impl Open {
    fn new(gauge: &Gauge) -> Self {
        gauge.inc();
        Self(gauge.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Acceptor {
    pub fn new(
        listener: TcpListener,
        max_connections: usize,
        named: Named,
        metrics: ConnectionMetrics,
    ) -> Self {
        Self {
            listener,
            permits: Arc::new(Semaphore::new(max_connections.min(Semaphore::MAX_PERMITS))),
            max_connections,
            named,
            metrics,
            refusals: RateLimited::default(),
            accept_errors: RateLimited::default(),
        }
    }

    /// The next connection within the cap, with Nagle's algorithm off (small
    /// request/answer exchanges must not wait for it), and its place in the open
    /// gauge.
    pub async fn accept(&mut self) -> (Accepted, Open) {
        let Named { server, cap_flag } = self.named;
        loop {
            let (tcp, peer) = match self.listener.accept().await {
                Ok(accepted) => accepted,
                Err(error) => {
                    if let Some(errors) = self.accept_errors.note(Instant::now()) {
                        warn!(%error, errors, "cannot accept {server} connections; retrying");
                    }
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            };
            let Ok(permit) = Arc::clone(&self.permits).try_acquire_owned() else {
                drop(tcp);
                self.metrics.refused.inc();
                if let Some(refused) = self.refusals.note(Instant::now()) {
                    warn!(
                        %peer,
                        refused,
                        max_connections = self.max_connections,
                        "refused {server} connections: {cap_flag} are open"
                    );
                }
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let open = Open::new(&self.metrics.open);
            return (Accepted { tcp, peer, permit }, open);
        }
    }
}

/// Counts events and says when one should be logged: the first, then at most one
/// per [`REFUSAL_LOG_EVERY`], with the count since the last line.
#[derive(Debug, Default)]
struct RateLimited {
    last: Option<Instant>,
    unlogged: u64,
}

impl RateLimited {
    /// `Some(events since the last line)` when this one is to be logged.
    fn note(&mut self, now: Instant) -> Option<u64> {
        self.unlogged += 1;
        match self.last {
            Some(last) if now.duration_since(last) < REFUSAL_LOG_EVERY => None,
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.unlogged))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_logged_once_per_period_with_their_count() {
        let mut log = RateLimited::default();
        let start = Instant::now();
        assert_eq!(log.note(start), Some(1));
        assert_eq!(log.note(start + Duration::from_secs(1)), None);
        assert_eq!(log.note(start + Duration::from_secs(2)), None);
        assert_eq!(log.note(start + REFUSAL_LOG_EVERY), Some(3));
    }

    #[tokio::test]
    async fn a_connection_over_the_cap_is_closed_and_counted() -> std::io::Result<()> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let metrics = ConnectionMetrics::default();
        let named = Named {
            server: "test",
            cap_flag: "--cap",
        };
        let mut acceptor = Acceptor::new(listener, 1, named, metrics.clone());
        let _first = TcpStream::connect(addr).await?;
        let (held, open) = acceptor.accept().await;
        assert_eq!(metrics.open.get(), 1);
        // The second is refused while the first holds the only place; a third gets
        // in once the first is gone.
        let mut second = TcpStream::connect(addr).await?;
        let accepting = tokio::spawn(async move { acceptor.accept().await });
        let mut byte = [0u8; 1];
        let read = tokio::io::AsyncReadExt::read(&mut second, &mut byte).await;
        assert!(
            matches!(read, Ok(0) | Err(_)),
            "the refused connection is closed"
        );
        assert_eq!(metrics.refused.get(), 1);
        drop((held, open));
        assert_eq!(metrics.open.get(), 0);
        let _third = TcpStream::connect(addr).await?;
        let (_, _open) = accepting.await.map_err(std::io::Error::other)?;
        assert_eq!(metrics.open.get(), 1);
        Ok(())
    }
}
