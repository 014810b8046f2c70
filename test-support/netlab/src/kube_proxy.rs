//! Services made the way kube-proxy's iptables mode makes them, in a node
//! namespace: the `nat` table's `KUBE-SERVICES` chain (from PREROUTING for what
//! pods send, from OUTPUT for the node's own sockets), a `KUBE-SVC-*` chain per
//! Service picking an endpoint, a `KUBE-SEP-*` chain per endpoint that DNATs to it
//! (and marks a pod reaching itself, the hairpin, for masquerade), and
//! `KUBE-POSTROUTING` masquerading what carries kube-proxy's 0x4000 bit, clearing
//! the bit first. Conntrack does the rest: a reply is translated back on the node
//! that translated its request.
//!
//! IPv4, UDP and TCP: kube-proxy's rules are per family and protocol, and the lab's
//! Services need no more. Nothing leaves the lab: Service addresses
//! ([`service_ip`]) are in 198.18.0.0/15, which pods route to their node, and no
//! node routes them anywhere; only the rules lead somewhere.
//!
//! The rules are the lab node's for its life: dropping the node's namespace drops
//! them.

use std::net::{Ipv4Addr, SocketAddrV4};

use crate::{Error, Netns};

const IPTABLES: &str = "/usr/sbin/iptables";
/// kube-proxy's masquerade bit (`--iptables-masquerade-bit`, default 14).
pub const MASQUERADE_MARK: u32 = 0x4000;

/// The transport protocol of a Service port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Udp,
    Tcp,
}

impl Protocol {
    fn name(self) -> &'static str {
        match self {
            Self::Udp => "udp",
            Self::Tcp => "tcp",
        }
    }
}

/// One Service port and the endpoints behind it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Service {
    /// A short name, unique in the node (it names the chains).
    pub name: String,
    /// The Service address and port clients send to.
    pub address: SocketAddrV4,
    pub protocol: Protocol,
    /// Where it leads: pods, or a node's own address for a host-network backend.
    pub endpoints: Vec<SocketAddrV4>,
    /// kube-proxy's `--masquerade-all`: every request through the Service leaves
    /// with the node's address as its source.
    pub masquerade_all: bool,
}

/// Creates kube-proxy's fixed chains in `node` (which must have none yet).
pub fn install(node: &Netns) -> Result<(), Error> {
    let mark = format!("{MASQUERADE_MARK:#x}");
    let masked = format!("{MASQUERADE_MARK:#x}/{MASQUERADE_MARK:#x}");
    for chain in ["KUBE-SERVICES", "KUBE-MARK-MASQ", "KUBE-POSTROUTING"] {
        nat(node, &["-N", chain])?;
    }
    nat(node, &["-A", "PREROUTING", "-j", "KUBE-SERVICES"])?;
    nat(node, &["-A", "OUTPUT", "-j", "KUBE-SERVICES"])?;
    nat(node, &["-A", "POSTROUTING", "-j", "KUBE-POSTROUTING"])?;
    nat(
        node,
        &["-A", "KUBE-MARK-MASQ", "-j", "MARK", "--or-mark", &mark],
    )?;
    nat(
        node,
        &[
            "-A",
            "KUBE-POSTROUTING",
            "-m",
            "mark",
            "!",
            "--mark",
            &masked,
            "-j",
            "RETURN",
        ],
    )?;
    nat(
        node,
        &["-A", "KUBE-POSTROUTING", "-j", "MARK", "--xor-mark", &mark],
    )?;
    nat(node, &["-A", "KUBE-POSTROUTING", "-j", "MASQUERADE"])
}

/// Adds `service`'s chains in `node` (after [`install`]): its address and port
/// lead to one of its endpoints, picked at random per connection (`statistic`),
/// as kube-proxy does.
pub fn add(node: &Netns, service: &Service) -> Result<(), Error> {
    let svc = format!("KUBE-SVC-{}", service.name);
    let protocol = service.protocol.name();
    let address = format!("{}/32", service.address.ip());
    let port = service.address.port().to_string();
    nat(node, &["-N", &svc])?;
    nat(
        node,
        &[
            "-A",
            "KUBE-SERVICES",
            "-d",
            &address,
            "-p",
            protocol,
            "--dport",
            &port,
            "-j",
            &svc,
        ],
    )?;
    if service.masquerade_all {
        nat(node, &["-A", &svc, "-j", "KUBE-MARK-MASQ"])?;
    }
    let count = service.endpoints.len();
    for (i, endpoint) in service.endpoints.iter().enumerate() {
        let sep = format!("KUBE-SEP-{}-{i}", service.name);
        nat(node, &["-N", &sep])?;
        let source = format!("{}/32", endpoint.ip());
        // The hairpin: an endpoint reaching itself through its Service.
        nat(node, &["-A", &sep, "-s", &source, "-j", "KUBE-MARK-MASQ"])?;
        let to = endpoint.to_string();
        nat(
            node,
            &[
                "-A",
                &sep,
                "-p",
                protocol,
                "-j",
                "DNAT",
                "--to-destination",
                &to,
            ],
        )?;
        let left = count - i;
        if left == 1 {
            nat(node, &["-A", &svc, "-j", &sep])?;
        } else {
            let probability = format!("{:.11}", 1.0 / left as f64);
            nat(
                node,
                &[
                    "-A",
                    &svc,
                    "-m",
                    "statistic",
                    "--mode",
                    "random",
                    "--probability",
                    &probability,
                    "-j",
                    &sep,
                ],
            )?;
        }
    }
    Ok(())
}

/// Runs `iptables -t nat args…` in `node`; fails with its message.
fn nat(node: &Netns, args: &[&str]) -> Result<(), Error> {
    let mut all = vec!["-w", "-t", "nat"];
    all.extend_from_slice(args);
    node.output(IPTABLES, &all).map(drop)
}

/// A Service address of the lab (no route leads there: only the rules do).
pub const fn service_ip(n: u8) -> Ipv4Addr {
    Ipv4Addr::new(198, 19, 96, n)
}
