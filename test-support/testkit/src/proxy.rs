//! A TCP proxy on loopback that can go silent: it keeps every connection open and
//! stops forwarding bytes either way, as a crashed host's half-open connection or a
//! partition looks to the peer.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use tokio::{
    io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
    task::JoinHandle,
};

use crate::TestResult;

/// Forwards connections to `upstream` until [`SilentProxy::go_silent`]. Stops when
/// dropped.
#[derive(Debug)]
pub struct SilentProxy {
    pub addr: SocketAddr,
    silent: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

impl SilentProxy {
    pub async fn start(upstream: SocketAddr) -> TestResult<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let silent = Arc::new(AtomicBool::new(false));
        let flag = silent.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                let (client_rx, client_tx) = client.into_split();
                let (server_rx, server_tx) = server.into_split();
                tokio::spawn(pump(client_rx, server_tx, flag.clone()));
                tokio::spawn(pump(server_rx, client_tx, flag.clone()));
            }
        });
        Ok(Self { addr, silent, task })
    }

    /// From now on nothing is forwarded; the connections stay open.
    pub fn go_silent(&self) {
        self.silent.store(true, Ordering::SeqCst);
    }
}

impl Drop for SilentProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies `from` to `to` until either ends; once `silent`, holds both open and
/// forwards nothing.
async fn pump(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    silent: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let Ok(n) = from.read(&mut buf).await else {
            return;
        };
        if n == 0 {
            return;
        }
        if silent.load(Ordering::SeqCst) {
            // Keep the sockets (and so the connection) alive, forever silent.
            std::future::pending::<()>().await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
