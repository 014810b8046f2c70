//! A router namespace that joins two namespaces and masquerades (source NAT) what
//! leaves one towards the other, as kube-proxy's masquerading, IPVS and overlay
//! networks rewrite an agent's source address on its way to the operator.
//!
//! Addresses (IPv4 only: iptables' `nat` table, from 198.19.0.0/16):
//!
//! | link | inside end | router end |
//! |---|---|---|
//! | `inside` (router) <-> `to-router` (the inside namespace) | 198.19.1.2/24 | 198.19.1.1/24 |
//! | `outside` (router) <-> `to-router` (the outside namespace) | 198.19.2.2/24 | 198.19.2.1/24 |
//!
//! The inside namespace routes 198.19.2.0/24 through the router; the outside
//! namespace has no route back to the inside at all, so a connection from inside
//! can only work because the router rewrote its source to 198.19.2.1
//! (`iptables -t nat -A POSTROUTING -o outside -j MASQUERADE`) and translates the
//! replies back. Nothing routes outside the lab.
//!
//! Dropping the [`Masquerade`] deletes the router namespace, its rule, both veth
//! pairs and the routes through them; the two namespaces it joined stay theirs.

use std::{io, net::Ipv4Addr};

use crate::{Error, Netns};

/// The name of the link towards the router, in both joined namespaces.
pub const TO_ROUTER: &str = "to-router";
/// The router's links.
const INSIDE: &str = "inside";
const OUTSIDE: &str = "outside";
const IPTABLES: &str = "/usr/sbin/iptables";

/// A router namespace masquerading the traffic from one namespace to another; see
/// the module documentation.
#[derive(Debug)]
pub struct Masquerade {
    router: Netns,
}

impl Masquerade {
    /// The inside namespace's address, which the outside never sees.
    pub const INSIDE_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 1, 2);
    /// The router's address on the inside link (the inside's gateway).
    pub const ROUTER_INSIDE_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 1, 1);
    /// The router's address on the outside link: every masqueraded packet's source.
    pub const MASQUERADE_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 2, 1);
    /// The outside namespace's address (where a server there listens).
    pub const OUTSIDE_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 2, 2);

    /// Creates the router namespace, links it to `inside` and `outside` (a link
    /// named [`TO_ROUTER`] in each, which must not have one yet), routes `inside`
    /// to the outside link through it, and masquerades what it forwards there.
    pub fn new(inside: &Netns, outside: &Netns) -> Result<Self, Error> {
        let router = Netns::create("router")?;
        router.sysctl("net.ipv4.ip_forward", "1")?;
        let nat = Self { router };
        let router = &nat.router;
        for (link, peer, router_ip, peer_ip) in [
            (INSIDE, inside, Self::ROUTER_INSIDE_IP, Self::INSIDE_IP),
            (OUTSIDE, outside, Self::MASQUERADE_IP, Self::OUTSIDE_IP),
        ] {
            router.ip(&[
                "link",
                "add",
                link,
                "type",
                "veth",
                "peer",
                "name",
                TO_ROUTER,
                "netns",
                peer.name(),
            ])?;
            router.ip(&["addr", "add", &format!("{router_ip}/24"), "dev", link])?;
            router.ip(&["link", "set", link, "up"])?;
            peer.ip(&["addr", "add", &format!("{peer_ip}/24"), "dev", TO_ROUTER])?;
            peer.ip(&["link", "set", TO_ROUTER, "up"])?;
        }
        inside.ip(&[
            "route",
            "add",
            "198.19.2.0/24",
            "via",
            &Self::ROUTER_INSIDE_IP.to_string(),
        ])?;
        router.output(
            IPTABLES,
            &[
                "-t",
                "nat",
                "-A",
                "POSTROUTING",
                "-o",
                OUTSIDE,
                "-j",
                "MASQUERADE",
            ],
        )?;
        Ok(nat)
    }

    /// The router namespace.
    pub fn router(&self) -> &Netns {
        &self.router
    }

    /// Connections (and other flows) the masquerade rule has translated so far: the
    /// rule's packet counter, which only the first packet of each flow reaches (the
    /// `nat` table sees new flows only).
    pub fn masqueraded(&self) -> Result<u64, Error> {
        let output = self.router.output(
            IPTABLES,
            &["-t", "nat", "-L", "POSTROUTING", "-v", "-x", "-n"],
        )?;
        let text = String::from_utf8_lossy(&output.stdout);
        // "pkts bytes target prot opt in out source destination"
        text.lines()
            .map(|line| line.split_whitespace().collect::<Vec<_>>())
            .find(|columns| {
                columns.get(2) == Some(&"MASQUERADE") && columns.get(6) == Some(&OUTSIDE)
            })
            .and_then(|columns| columns.first()?.parse().ok())
            .ok_or_else(|| Error::Io {
                what: format!(
                    "reading the masquerade rule's counter in {}",
                    self.router.name()
                ),
                source: io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("no MASQUERADE rule out of {OUTSIDE} in:\n{text}"),
                ),
            })
    }
}
