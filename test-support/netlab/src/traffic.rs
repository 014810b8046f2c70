//! UDP traffic between namespaces.

use std::{
    io,
    net::{IpAddr, SocketAddr, UdpSocket},
    time::Duration,
};

use crate::{Error, Netns};

/// A UDP socket bound inside a namespace, to receive.
#[derive(Debug)]
pub struct UdpReceiver {
    socket: UdpSocket,
    addr: SocketAddr,
}

impl UdpReceiver {
    /// Binds `ip`, port chosen by the kernel, inside `ns`.
    pub fn bind(ns: &Netns, ip: IpAddr) -> Result<Self, Error> {
        Self::bind_addr(ns, SocketAddr::new(ip, 0))
    }

    /// Binds `addr` (port 0: chosen by the kernel) inside `ns`.
    pub fn bind_addr(ns: &Netns, addr: SocketAddr) -> Result<Self, Error> {
        let what = format!("binding a UDP socket to {addr} in {}", ns.name());
        let socket = ns
            .run(|| UdpSocket::bind(addr))?
            .map_err(Error::io(what.clone()))?;
        let addr = socket.local_addr().map_err(Error::io(what))?;
        Ok(Self { socket, addr })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Receives one datagram; `None` after `timeout` without one.
    pub fn recv(&self, timeout: Duration) -> Result<Option<usize>, Error> {
        let what = "receiving a UDP datagram";
        self.socket
            .set_read_timeout(Some(timeout))
            .map_err(Error::io(what))?;
        let mut buf = vec![0u8; 65_536];
        match self.socket.recv(&mut buf) {
            Ok(len) => Ok(Some(len)),
            Err(error) if timed_out(&error) => Ok(None),
            Err(error) => Err(Error::io(what)(error)),
        }
    }
}

/// A UDP socket bound inside a namespace, to send.
#[derive(Debug)]
pub struct UdpSender {
    socket: UdpSocket,
}

impl UdpSender {
    /// Binds `ip` (the source of the datagrams; an unspecified address lets the
    /// kernel pick it), port chosen by the kernel, inside `ns`.
    pub fn bind(ns: &Netns, ip: IpAddr) -> Result<Self, Error> {
        let what = format!("binding a UDP socket to {ip} in {}", ns.name());
        let socket = ns
            .run(|| UdpSocket::bind(SocketAddr::new(ip, 0)))?
            .map_err(Error::io(what))?;
        Ok(Self { socket })
    }

    /// Sends one datagram of `payload` bytes (UDP payload, headers excluded).
    pub fn send(&self, to: SocketAddr, payload: usize) -> Result<(), Error> {
        let buf = vec![0xc5u8; payload];
        let sent = self
            .socket
            .send_to(&buf, to)
            .map_err(Error::io(format!("sending a UDP datagram to {to}")))?;
        if sent == payload {
            Ok(())
        } else {
            Err(Error::Io {
                what: format!("sending a UDP datagram to {to}"),
                source: io::Error::new(io::ErrorKind::WriteZero, "short send"),
            })
        }
    }

    /// Sends `count` datagrams, without waiting for anything.
    pub fn send_many(&self, to: SocketAddr, count: usize, payload: usize) -> Result<(), Error> {
        (0..count).try_for_each(|_| self.send(to, payload))
    }
}

/// Sends `count` datagrams of `payload` bytes from `sender` to `receiver` in
/// lock step (each one received, or given up after a second, before the next
/// is sent, so no queue on the way overflows), and returns how many arrived.
pub fn exchange_udp(
    sender: &UdpSender,
    receiver: &UdpReceiver,
    count: usize,
    payload: usize,
) -> Result<usize, Error> {
    let mut received = 0;
    for _ in 0..count {
        sender.send(receiver.addr(), payload)?;
        if receiver.recv(Duration::from_secs(1))?.is_some() {
            received += 1;
        }
    }
    Ok(received)
}

/// `count` request/reply exchanges of `payload` bytes over UDP, in lock step: a
/// datagram from `client` (bound to `client_ip` in `client_ns`) to a server bound
/// to `server_ip` in `server_ns`, which sends it back to its source. Returns how
/// many replies came back; each side waits at most `wait` for each datagram.
/// Every exchange is one packet each way.
pub fn udp_echo(
    client_ns: &Netns,
    client_ip: IpAddr,
    server_ns: &Netns,
    server_ip: IpAddr,
    count: usize,
    payload: usize,
    wait: Duration,
) -> Result<usize, Error> {
    let server = UdpReceiver::bind(server_ns, server_ip)?;
    let client = UdpReceiver::bind(client_ns, client_ip)?;
    let target = server.addr;
    udp_echo_between(&client, target, &server, count, payload, wait)
}

/// [`udp_echo`] through another address: the client sends to `target` (a
/// Service address and port, say), which the network leads to the server bound
/// to `server` in `server_ns` (the Service's endpoint: its port is the one the
/// rules translate to). The client takes replies from whatever source they come.
#[expect(
    clippy::too_many_arguments,
    reason = "both ends and the exchange's shape"
)]
pub fn udp_echo_through(
    client_ns: &Netns,
    client_ip: IpAddr,
    target: SocketAddr,
    server_ns: &Netns,
    server: SocketAddr,
    count: usize,
    payload: usize,
    wait: Duration,
) -> Result<usize, Error> {
    let server = UdpReceiver::bind_addr(server_ns, server)?;
    let client = UdpReceiver::bind(client_ns, client_ip)?;
    udp_echo_between(&client, target, &server, count, payload, wait)
}

/// [`udp_echo_through`] between sockets the caller keeps open: `count` requests
/// from `client` to `target`, each sent back by `server` to its source; how many
/// replies came back.
pub fn udp_echo_between(
    client: &UdpReceiver,
    target: SocketAddr,
    server: &UdpReceiver,
    count: usize,
    payload: usize,
    wait: Duration,
) -> Result<usize, Error> {
    let request = vec![0xc5u8; payload];
    let mut buf = vec![0u8; 65_536];
    for socket in [&server.socket, &client.socket] {
        socket
            .set_read_timeout(Some(wait))
            .map_err(Error::io("setting a UDP socket's timeout"))?;
    }
    let mut replies = 0;
    for _ in 0..count {
        client
            .socket
            .send_to(&request, target)
            .map_err(Error::io(format!("sending a request to {target}")))?;
        let from = match server.socket.recv_from(&mut buf) {
            Ok((len, from)) => {
                server
                    .socket
                    .send_to(&buf[..len], from)
                    .map_err(Error::io(format!("sending a reply to {from}")))?;
                from
            }
            Err(error) if timed_out(&error) => continue,
            Err(error) => return Err(Error::io("receiving a request")(error)),
        };
        match client.socket.recv(&mut buf) {
            Ok(_) => replies += 1,
            Err(error) if timed_out(&error) => {}
            Err(error) => return Err(Error::io(format!("receiving a reply from {from}"))(error)),
        }
    }
    Ok(replies)
}

fn timed_out(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}
