//! Services made the way kube-proxy's iptables mode makes them, in a node
//! namespace: the `nat` table's `KUBE-SERVICES` chain (from PREROUTING for what
//! pods send, from OUTPUT for the node's own sockets), a `KUBE-SVC-*` chain per
//! Service picking an endpoint, a `KUBE-SEP-*` chain per endpoint that DNATs to it
//! (and marks a pod reaching itself, the hairpin, for masquerade), and
//! `KUBE-POSTROUTING` masquerading what carries kube-proxy's 0x4000 bit, clearing
//! the bit first. Conntrack does the rest: a reply is translated back on the node
//! that translated its request.
//!
//! A Service with a [`NodePort`] is also reached at that port of every address of
//! the node's own: the last rule of `KUBE-SERVICES` sends what is for a local
//! address (`-m addrtype --dst-type LOCAL`) to `KUBE-NODEPORTS`, which leads the
//! port to the Service's `KUBE-EXT-*` chain. With the `Cluster` policy that marks
//! the request for masquerade (it may be sent to another node, and the reply
//! must come back through this one) and picks any endpoint; with `Local` it
//! leaves the source as it is and picks among the node's own endpoints
//! (`KUBE-SVL-*`), except for the node's own sockets and pods, which are treated
//! as with `Cluster`.
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
/// The pods' addresses (kube-proxy's `--cluster-cidr`): every pod block of a
/// [`Cluster`](crate::Cluster).
const CLUSTER_CIDR: &str = "198.18.0.0/16";

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
    /// Also reached at this port of the node's own addresses (`type: NodePort`).
    pub node_port: Option<NodePort>,
}

/// A Service's port on every node's own addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodePort {
    pub port: u16,
    pub policy: ExternalTrafficPolicy,
}

/// A Service's `externalTrafficPolicy`: what a request from outside the cluster
/// to a node port is led to, and whether it keeps its source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExternalTrafficPolicy {
    /// Any endpoint, the request masqueraded to the node's address.
    Cluster,
    /// Only the node's own endpoints, the request's source kept. (kube-proxy
    /// drops the request where the node has none; here it goes on untranslated,
    /// to the node's own port.)
    Local,
}

/// Creates kube-proxy's fixed chains in `node` (which must have none yet).
pub fn install(node: &Netns) -> Result<(), Error> {
    let mark = format!("{MASQUERADE_MARK:#x}");
    let masked = format!("{MASQUERADE_MARK:#x}/{MASQUERADE_MARK:#x}");
    for chain in [
        "KUBE-SERVICES",
        "KUBE-NODEPORTS",
        "KUBE-MARK-MASQ",
        "KUBE-POSTROUTING",
    ] {
        nat(node, &["-N", chain])?;
    }
    nat(node, &["-A", "PREROUTING", "-j", "KUBE-SERVICES"])?;
    nat(node, &["-A", "OUTPUT", "-j", "KUBE-SERVICES"])?;
    // Stays the last rule of KUBE-SERVICES: `add` inserts each Service's before it.
    nat(
        node,
        &[
            "-A",
            "KUBE-SERVICES",
            "-m",
            "addrtype",
            "--dst-type",
            "LOCAL",
            "-j",
            "KUBE-NODEPORTS",
        ],
    )?;
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
/// as kube-proxy does; so does its node port, if it has one.
///
/// kube-proxy knows which endpoints are on its node from their EndpointSlice;
/// here an endpoint is the node's own when the node routes it without a gateway
/// (one of its pods, or one of its own addresses).
pub fn add(node: &Netns, service: &Service) -> Result<(), Error> {
    let svc = format!("KUBE-SVC-{}", service.name);
    let protocol = service.protocol.name();
    let address = format!("{}/32", service.address.ip());
    let port = service.address.port().to_string();
    nat(node, &["-N", &svc])?;
    nat(
        node,
        &[
            "-I",
            "KUBE-SERVICES",
            "1",
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
    let mut every = Vec::new();
    let mut local = Vec::new();
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
        if service.node_port.is_some() && is_local(node, *endpoint.ip())? {
            local.push(sep.clone());
        }
        every.push(sep);
    }
    pick(node, &svc, &every)?;
    if let Some(node_port) = service.node_port {
        add_node_port(node, service, node_port, &local)?;
    }
    Ok(())
}

/// `service`'s `KUBE-EXT-*` chain, and the rule of `KUBE-NODEPORTS` that leads
/// its node port there; `local` names the `KUBE-SEP-*` chains of the node's own
/// endpoints.
fn add_node_port(
    node: &Netns,
    service: &Service,
    node_port: NodePort,
    local: &[String],
) -> Result<(), Error> {
    let svc = format!("KUBE-SVC-{}", service.name);
    let ext = format!("KUBE-EXT-{}", service.name);
    let port = node_port.port.to_string();
    nat(node, &["-N", &ext])?;
    nat(
        node,
        &[
            "-A",
            "KUBE-NODEPORTS",
            "-p",
            service.protocol.name(),
            "--dport",
            &port,
            "-j",
            &ext,
        ],
    )?;
    match node_port.policy {
        ExternalTrafficPolicy::Cluster => {
            nat(node, &["-A", &ext, "-j", "KUBE-MARK-MASQ"])?;
            nat(node, &["-A", &ext, "-j", &svc])
        }
        ExternalTrafficPolicy::Local => {
            let svl = format!("KUBE-SVL-{}", service.name);
            nat(node, &["-N", &svl])?;
            // Pods, and the node's own sockets (masqueraded), may reach any
            // endpoint; only requests from outside keep to this node's.
            nat(node, &["-A", &ext, "-s", CLUSTER_CIDR, "-j", &svc])?;
            let from_node = ["-m", "addrtype", "--src-type", "LOCAL"];
            let mut rule = vec!["-A", ext.as_str()];
            rule.extend_from_slice(&from_node);
            nat(node, &[rule.as_slice(), &["-j", "KUBE-MARK-MASQ"]].concat())?;
            nat(node, &[rule.as_slice(), &["-j", svc.as_str()]].concat())?;
            nat(node, &["-A", &ext, "-j", &svl])?;
            pick(node, &svl, local)
        }
    }
}

/// Rules of `chain` leading to one of `seps`, picked at random per connection
/// with equal chances (each rule takes its share of what the ones before left).
fn pick(node: &Netns, chain: &str, seps: &[String]) -> Result<(), Error> {
    let count = seps.len();
    for (i, sep) in seps.iter().enumerate() {
        let left = count - i;
        if left == 1 {
            nat(node, &["-A", chain, "-j", sep])?;
        } else {
            let probability = format!("{:.11}", 1.0 / left as f64);
            nat(
                node,
                &[
                    "-A",
                    chain,
                    "-m",
                    "statistic",
                    "--mode",
                    "random",
                    "--probability",
                    &probability,
                    "-j",
                    sep,
                ],
            )?;
        }
    }
    Ok(())
}

/// Whether `node` routes `address` without a gateway: to one of its pods' links,
/// or to itself.
fn is_local(node: &Netns, address: Ipv4Addr) -> Result<bool, Error> {
    let output = node.output("ip", &["-4", "route", "get", &address.to_string()])?;
    let route = String::from_utf8_lossy(&output.stdout);
    Ok(!route.split_whitespace().any(|word| word == "via"))
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
