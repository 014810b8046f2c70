//! Two "node" namespaces routed to each other, each with pods behind it, as the
//! nodes of a cluster whose pods reach one another without a tunnel.
//!
//! Addresses (all from 198.18.0.0/15 and 2001:2::/48):
//!
//! | what | node `k` (1 or 2) |
//! |---|---|
//! | pods | 198.18.k.2, .3, … /32 and 2001:2:0:k::2, ::3, … /128 |
//! | the node's side of every pod link | 198.18.k.1/32, 2001:2:0:k::1/128 |
//! | the link between the nodes (`uplink`) | 198.19.0.k/24, 2001:2:0:ff::k/64 |
//! | the VXLAN device of an overlay ([`VXLAN`], [`Routing::Vxlan`]) | 198.19.1.k/24, 2001:2:0:fe::k/64 |
//!
//! Pods are routed one by one (a /32 and a /128 to the host side of their veth,
//! as Calico does), and each node routes the other's block (198.18.k.0/24,
//! 2001:2:0:k::/64) over the uplink, or in an overlay over a VXLAN device whose
//! underlay is the uplink (as flannel's `vxlan` backend does: the pods' packets
//! cross the uplink encapsulated, between the nodes' uplink addresses). So an address can move from a pod on one node
//! to a pod on the other ([`Cluster::add_pod_at`]): the more specific route wins on
//! the new pod's node, and the other node is given one towards it.
//!
//! Nothing routes outside the lab: the namespaces have no other interface.
//! Dropping the cluster deletes both node namespaces, and with them the uplink and
//! the host side of every pod's veth; each [`Pod`] deletes its own namespace.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::{Error, Netns, Pod};

/// Pods per node with an address of the node's own block.
const MAX_PODS: usize = 250;
/// The uplink's name in both node namespaces.
pub const UPLINK: &str = "uplink";
/// The VXLAN device's name in both node namespaces of an overlay.
pub const VXLAN: &str = "vxlan0";
/// The overlay's VXLAN network identifier (flannel's default).
const VXLAN_ID: &str = "1";
/// VXLAN's IANA port.
const VXLAN_PORT: &str = "4789";

/// How a [`Cluster`]'s nodes route each other's pod blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Routing {
    /// Over the uplink, unencapsulated.
    #[default]
    Direct,
    /// Over a VXLAN device ([`VXLAN`]) on each node, its underlay the uplink.
    Vxlan,
}

/// One node of a [`Cluster`]: its namespace (forwarding on inside it only) and
/// its addresses.
#[derive(Debug)]
pub struct ClusterNode {
    ns: Netns,
    name: String,
    /// 1 or 2: the third octet of its block.
    number: u8,
    pods: usize,
}

impl ClusterNode {
    fn new(name: &str, number: u8) -> Result<Self, Error> {
        let ns = Netns::create(name)?;
        ns.sysctl("net.ipv4.ip_forward", "1")?;
        ns.sysctl("net.ipv6.conf.all.forwarding", "1")?;
        Ok(Self {
            ns,
            name: name.to_owned(),
            number,
            pods: 0,
        })
    }

    /// The node namespace, where the host side of each of its pods' veths lives.
    pub fn ns(&self) -> &Netns {
        &self.ns
    }

    /// The node's name (as its agent calls it).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The node's address on the uplink: how the other node reaches it.
    pub fn uplink_ip(&self, v6: bool) -> IpAddr {
        if v6 {
            Ipv6Addr::new(0x2001, 2, 0, 0xff, 0, 0, 0, self.number.into()).into()
        } else {
            Ipv4Addr::new(198, 19, 0, self.number).into()
        }
    }

    /// The node's address on its VXLAN device, in an overlay: where the other
    /// node routes this node's pod block.
    pub fn vxlan_ip(&self, v6: bool) -> IpAddr {
        if v6 {
            Ipv6Addr::new(0x2001, 2, 0, 0xfe, 0, 0, 0, self.number.into()).into()
        } else {
            Ipv4Addr::new(198, 19, 1, self.number).into()
        }
    }

    /// The node's address on every pod link (each pod's gateway).
    pub fn pod_gateway(&self, v6: bool) -> IpAddr {
        if v6 {
            self.gateway_v6().into()
        } else {
            self.gateway_v4().into()
        }
    }

    fn gateway_v4(&self) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, self.number, 1)
    }

    fn gateway_v6(&self) -> Ipv6Addr {
        Ipv6Addr::new(0x2001, 2, 0, self.number.into(), 0, 0, 0, 1)
    }

    /// The block of pod addresses routed to this node: (IPv4 /24, IPv6 /64).
    fn block(&self) -> (String, String) {
        (
            format!("198.18.{}.0/24", self.number),
            format!("2001:2:0:{}::/64", self.number),
        )
    }
}

/// One of the two nodes of a [`Cluster`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    A,
    B,
}

impl Side {
    pub fn other(self) -> Self {
        match self {
            Self::A => Self::B,
            Self::B => Self::A,
        }
    }

    fn index(self) -> usize {
        match self {
            Self::A => 0,
            Self::B => 1,
        }
    }
}

/// Two nodes joined by a veth pair (`uplink` in each), routing each other's pod
/// block; see the module documentation.
#[derive(Debug)]
pub struct Cluster {
    nodes: [ClusterNode; 2],
    routing: Routing,
    /// Pods created so far, on both nodes: names their host interfaces.
    created: usize,
}

impl Cluster {
    /// Creates the two nodes, named `a` and `b` (namespaces
    /// `census-<pid>-<n>-<name>`), the uplink between them and the routes of both
    /// pod blocks over it.
    pub fn new(a: &str, b: &str) -> Result<Self, Error> {
        Self::with_routing(a, b, Routing::Direct)
    }

    /// [`Cluster::new`], the pod blocks routed as `routing` says.
    pub fn with_routing(a: &str, b: &str, routing: Routing) -> Result<Self, Error> {
        let cluster = Self {
            nodes: [ClusterNode::new(a, 1)?, ClusterNode::new(b, 2)?],
            routing,
            created: 0,
        };
        let [first, second] = &cluster.nodes;
        first.ns.ip(&[
            "link",
            "add",
            UPLINK,
            "type",
            "veth",
            "peer",
            "name",
            UPLINK,
            "netns",
            second.ns.name(),
        ])?;
        for (node, peer) in [(first, second), (second, first)] {
            let ns = &node.ns;
            ns.ip(&[
                "addr",
                "add",
                &format!("{}/24", node.uplink_ip(false)),
                "dev",
                UPLINK,
            ])?;
            ns.ip(&[
                "addr",
                "add",
                &format!("{}/64", node.uplink_ip(true)),
                "dev",
                UPLINK,
                "nodad",
            ])?;
            ns.ip(&["link", "set", UPLINK, "up"])?;
            if routing == Routing::Vxlan {
                add_vxlan(node, peer)?;
            }
            let (v4, v6) = peer.block();
            ns.ip(&[
                "route",
                "add",
                &v4,
                "via",
                &cluster.gateway_to(peer, false).to_string(),
            ])?;
            ns.ip(&[
                "-6",
                "route",
                "add",
                &v6,
                "via",
                &cluster.gateway_to(peer, true).to_string(),
            ])?;
        }
        Ok(cluster)
    }

    /// The device each node routes the other's pods over: [`UPLINK`], or
    /// [`VXLAN`] in an overlay.
    pub fn pod_route_device(&self) -> &'static str {
        match self.routing {
            Routing::Direct => UPLINK,
            Routing::Vxlan => VXLAN,
        }
    }

    /// The next hop towards `peer`'s pods.
    fn gateway_to(&self, peer: &ClusterNode, v6: bool) -> IpAddr {
        match self.routing {
            Routing::Direct => peer.uplink_ip(v6),
            Routing::Vxlan => peer.vxlan_ip(v6),
        }
    }

    pub fn node(&self, side: Side) -> &ClusterNode {
        &self.nodes[side.index()]
    }

    /// Creates a pod on `side` with the next addresses of its block.
    pub fn add_pod(&mut self, side: Side) -> Result<Pod, Error> {
        let at = &self.nodes[side.index()];
        let host = u8::try_from(at.pods + 2)
            .ok()
            .filter(|_| at.pods < MAX_PODS)
            .ok_or(Error::LabFull(MAX_PODS))?;
        let ipv4 = Ipv4Addr::new(198, 18, at.number, host);
        let ipv6 = Ipv6Addr::new(0x2001, 2, 0, at.number.into(), 0, 0, 0, host.into());
        self.nodes[side.index()].pods += 1;
        self.add_pod_at(side, ipv4, ipv6)
    }

    /// Creates a pod on `side` with these addresses, wherever they were before: a
    /// pod that had them must be gone (its namespace dropped). The other node routes
    /// them over the uplink.
    pub fn add_pod_at(&mut self, side: Side, ipv4: Ipv4Addr, ipv6: Ipv6Addr) -> Result<Pod, Error> {
        let index = self.created;
        self.created += 1;
        let at = &self.nodes[side.index()];
        let other = &self.nodes[side.other().index()];
        let (gateway_v4, gateway_v6) = (at.gateway_v4(), at.gateway_v6());
        let host = format!("pod{index}");
        let ns = Netns::create(&format!("{}-pod{index}", at.name))?;
        let pod = Pod {
            host_interface: host,
            ipv4,
            ipv6,
            gateway_v4,
            gateway_v6,
            ns,
        };
        let host = pod.host_interface.as_str();
        let node_ns = &at.ns;
        node_ns.add_veth(host, &pod.ns)?;
        node_ns.ip(&["addr", "add", &format!("{gateway_v4}/32"), "dev", host])?;
        node_ns.ip(&[
            "addr",
            "add",
            &format!("{gateway_v6}/128"),
            "dev",
            host,
            "nodad",
        ])?;
        node_ns.ip(&["link", "set", host, "up"])?;
        node_ns.ip(&["route", "replace", &format!("{ipv4}/32"), "dev", host])?;
        node_ns.ip(&[
            "-6",
            "route",
            "replace",
            &format!("{ipv6}/128"),
            "dev",
            host,
        ])?;

        let ns = &pod.ns;
        ns.ip(&["addr", "add", &format!("{ipv4}/32"), "dev", "eth0"])?;
        ns.ip(&[
            "addr",
            "add",
            &format!("{ipv6}/128"),
            "dev",
            "eth0",
            "nodad",
        ])?;
        ns.ip(&["link", "set", "eth0", "up"])?;
        ns.ip(&["route", "add", &gateway_v4.to_string(), "dev", "eth0"])?;
        ns.ip(&[
            "route",
            "add",
            "198.18.0.0/15",
            "via",
            &gateway_v4.to_string(),
        ])?;
        ns.ip(&["-6", "route", "add", &gateway_v6.to_string(), "dev", "eth0"])?;
        ns.ip(&[
            "-6",
            "route",
            "add",
            "2001:2::/48",
            "via",
            &gateway_v6.to_string(),
        ])?;

        // Outside this node's block (an address that moved here): the other node
        // needs a route of its own, more specific than the block it sends here.
        if ipv4.octets()[..3] != [198, 18, at.number] {
            other.ns.ip(&[
                "route",
                "replace",
                &format!("{ipv4}/32"),
                "via",
                &self.gateway_to(at, false).to_string(),
            ])?;
            other.ns.ip(&[
                "-6",
                "route",
                "replace",
                &format!("{ipv6}/128"),
                "via",
                &self.gateway_to(at, true).to_string(),
            ])?;
        }
        Ok(pod)
    }
}

/// `node`'s VXLAN device towards `peer`: its underlay the uplink, from `node`'s
/// uplink address to `peer`'s (a unicast remote: every frame goes there), and
/// `node`'s overlay addresses on it.
fn add_vxlan(node: &ClusterNode, peer: &ClusterNode) -> Result<(), Error> {
    let ns = &node.ns;
    ns.ip(&[
        "link",
        "add",
        VXLAN,
        "type",
        "vxlan",
        "id",
        VXLAN_ID,
        "local",
        &node.uplink_ip(false).to_string(),
        "remote",
        &peer.uplink_ip(false).to_string(),
        "dstport",
        VXLAN_PORT,
        "dev",
        UPLINK,
    ])?;
    ns.ip(&[
        "addr",
        "add",
        &format!("{}/24", node.vxlan_ip(false)),
        "dev",
        VXLAN,
    ])?;
    ns.ip(&[
        "addr",
        "add",
        &format!("{}/64", node.vxlan_ip(true)),
        "dev",
        VXLAN,
        "nodad",
    ])?;
    ns.ip(&["link", "set", VXLAN, "up"])
}
