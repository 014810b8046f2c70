//! "The world": a namespace behind one node, outside every pod block and Service
//! range, that the node masquerades what it sends to (as a node source-NATs
//! its pods' egress), for traffic between pods and outside the cluster.
//!
//! Addresses (IPv4 only: the node's masquerade is iptables' `nat` table):
//!
//! | link | world end | node end |
//! |---|---|---|
//! | [`WORLD_LINK`] (node) <-> `eth0` (world) | 198.19.128.2/24 | 198.19.128.1/24 |
//!
//! The world namespace has its link's /24 and nothing else: it has no route to
//! any pod, so a pod's packet reaches it and is answered only because the node
//! rewrote its source to the node's address on the link
//! (`iptables -t nat -A POSTROUTING -o world -j MASQUERADE`) and translates the
//! replies back. From the world, the node's address on the link is the node's
//! (where a NodePort is reached). Only the node routes to it; nothing routes
//! outside the lab.
//!
//! Dropping the [`World`] deletes its namespace, and with it the link; the
//! node's masquerade rule stays until the node's namespace goes (it matches
//! nothing once the link is gone).

use std::net::Ipv4Addr;

use crate::{Error, Netns};

/// The node's link to the world.
pub const WORLD_LINK: &str = "world";
const IPTABLES: &str = "/usr/sbin/iptables";

/// A namespace outside the cluster, behind one node; see the module
/// documentation.
#[derive(Debug)]
pub struct World {
    ns: Netns,
}

impl World {
    /// The world's address: a source no ENDPOINTS entry has.
    pub const IP: Ipv4Addr = Ipv4Addr::new(198, 19, 128, 2);
    /// The node's address on the link (the world's gateway, and every
    /// masqueraded packet's source).
    pub const NODE_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 128, 1);

    /// Creates the world namespace, links it to `node` (a link named
    /// [`WORLD_LINK`] there, which must not have one yet), and masquerades what
    /// `node` sends over it.
    pub fn behind(node: &Netns) -> Result<Self, Error> {
        let world = Self {
            ns: Netns::create("world")?,
        };
        node.add_veth(WORLD_LINK, &world.ns)?;
        node.ip(&[
            "addr",
            "add",
            &format!("{}/24", Self::NODE_IP),
            "dev",
            WORLD_LINK,
        ])?;
        node.ip(&["link", "set", WORLD_LINK, "up"])?;
        world
            .ns
            .ip(&["addr", "add", &format!("{}/24", Self::IP), "dev", "eth0"])?;
        world.ns.ip(&["link", "set", "eth0", "up"])?;
        node.output(
            IPTABLES,
            &[
                "-w",
                "-t",
                "nat",
                "-A",
                "POSTROUTING",
                "-o",
                WORLD_LINK,
                "-j",
                "MASQUERADE",
            ],
        )?;
        Ok(world)
    }

    /// The world's namespace.
    pub fn ns(&self) -> &Netns {
        &self.ns
    }
}
