//! Loopback forwarders into a network namespace: a namespace standing for a node
//! has no route to this machine's loopback, where the API server and the operator
//! listen; a [`Forward`] accepts on a port of the namespace's loopback and carries
//! each connection to an address of this machine's (what a Service and kube-proxy
//! do for a pod).

use std::{
    io,
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
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
        listener.set_nonblocking(true).map_err(Error::io(what))?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((inbound, _)) => {
                        let _ = inbound.set_nonblocking(false);
                        let to = to.clone();
                        std::thread::spawn(move || {
                            if let Some(to) = to() {
                                pipe(inbound, to);
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
        Ok(Self { stop })
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

fn pipe(inbound: TcpStream, to: SocketAddr) {
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
    let _ = io::copy(&mut out_read, &mut in_write);
    let _ = in_write.shutdown(std::net::Shutdown::Write);
    let _ = up.join();
}
