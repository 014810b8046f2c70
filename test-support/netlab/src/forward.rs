//! Loopback forwarders into a network namespace: a namespace standing for a node
//! has no route to this machine's loopback, where the API server and the operator
//! listen; a [`Forward`] accepts on a port of the namespace's loopback and carries
//! each connection to an address of this machine's (what a Service and kube-proxy
//! do for a pod). It counts the bytes it carries back to the clients: what the
//! processes behind it received from the target (a benchmark's "bytes received from
//! the API server").

use std::{
    io::{self, Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use crate::{Error, Netns};

/// Where a forwarded connection goes, asked once per connection (`None`: refused).
pub type Target = Arc<dyn Fn() -> Option<SocketAddr> + Send + Sync>;

/// Accepts on a port of a namespace's loopback and connects each connection to
/// where its target says, from the caller's namespace; stops when dropped.
pub struct Forward {
    stop: Arc<AtomicBool>,
    received: Arc<AtomicU64>,
    addr: SocketAddr,
}

impl std::fmt::Debug for Forward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forward").finish_non_exhaustive()
    }
}

impl Forward {
    pub fn start(ns: &Netns, port: u16, to: Target) -> Result<Self, Error> {
        let what = format!("listening on 127.0.0.1:{port} in {}", ns.name());
        let listener = ns
            .run(|| TcpListener::bind((Ipv4Addr::LOCALHOST, port)))?
            .map_err(Error::io(what.clone()))?;
        Self::serve(listener, to, what)
    }

    /// The same on a free port of this namespace's loopback ([`Forward::addr`]).
    pub fn start_here(to: Target) -> Result<Self, Error> {
        let what = "listening on 127.0.0.1:0".to_owned();
        let listener =
            TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(Error::io(what.clone()))?;
        Self::serve(listener, to, what)
    }

    fn serve(listener: TcpListener, to: Target, what: String) -> Result<Self, Error> {
        let addr = listener.local_addr().map_err(Error::io(what.clone()))?;
        listener.set_nonblocking(true).map_err(Error::io(what))?;
        let stop = Arc::new(AtomicBool::new(false));
        let received = Arc::new(AtomicU64::new(0));
        let (stopped, counter) = (stop.clone(), received.clone());
        std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((inbound, _)) => {
                        let _ = inbound.set_nonblocking(false);
                        let (to, counter) = (to.clone(), counter.clone());
                        std::thread::spawn(move || {
                            if let Some(to) = to() {
                                pipe(inbound, to, &counter);
                            }
                        });
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    Err(_) => break,
                }
            }
        });
        Ok(Self {
            stop,
            received,
            addr,
        })
    }

    /// Where it listens (in its namespace).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Bytes carried from the targets back to the clients so far.
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// A target that is always `addr`.
    pub fn to(addr: SocketAddr) -> Target {
        Arc::new(move || Some(addr))
    }
}

impl Drop for Forward {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn pipe(inbound: TcpStream, to: SocketAddr, received: &AtomicU64) {
    let Ok(outbound) = TcpStream::connect(to) else {
        return;
    };
    let (Ok(mut in_read), Ok(mut out_write)) = (inbound.try_clone(), outbound.try_clone()) else {
        return;
    };
    let up = std::thread::spawn(move || {
        let _ = io::copy(&mut in_read, &mut out_write);
        let _ = out_write.shutdown(std::net::Shutdown::Write);
    });
    let (mut out_read, mut in_write) = (outbound, inbound);
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match out_read.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                received.fetch_add(n as u64, Ordering::Relaxed);
                if in_write.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = in_write.shutdown(std::net::Shutdown::Write);
    let _ = up.join();
}
