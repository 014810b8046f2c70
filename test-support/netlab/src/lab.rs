//! A node namespace and pods attached to it by veth pairs.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::{Error, Netns};

/// Pods per lab: pod `i` gets 198.18.<i+1>.0/24 and 2001:2:0:<i+1>::/64.
const MAX_PODS: usize = 250;

/// A "node" namespace with IP forwarding on (inside it only) and the pods
/// attached to it. Dropping the lab deletes the node namespace; each [`Pod`]
/// deletes its own.
#[derive(Debug)]
pub struct Lab {
    node: Netns,
    pods: usize,
}

impl Lab {
    pub fn new() -> Result<Self, Error> {
        let node = Netns::create("node")?;
        node.sysctl("net.ipv4.ip_forward", "1")?;
        node.sysctl("net.ipv6.conf.all.forwarding", "1")?;
        Ok(Self { node, pods: 0 })
    }

    /// The node namespace, where the host side of every pod's veth lives.
    pub fn node(&self) -> &Netns {
        &self.node
    }

    /// Creates a pod: a namespace whose `eth0` is a veth peered with `pod<i>` in
    /// the node namespace, with routes to the other pods (and nothing else)
    /// through the node.
    pub fn add_pod(&mut self) -> Result<Pod, Error> {
        if self.pods >= MAX_PODS {
            return Err(Error::LabFull(MAX_PODS));
        }
        let index = self.pods;
        self.pods += 1;
        let subnet = u8::try_from(index + 1).map_err(|_| Error::LabFull(MAX_PODS))?;
        let ns = Netns::create(&format!("pod{index}"))?;
        let pod = Pod {
            host_interface: format!("pod{index}"),
            ipv4: Ipv4Addr::new(198, 18, subnet, 2),
            ipv6: Ipv6Addr::new(0x2001, 2, 0, u16::from(subnet), 0, 0, 0, 2),
            gateway_v4: Ipv4Addr::new(198, 18, subnet, 1),
            gateway_v6: Ipv6Addr::new(0x2001, 2, 0, u16::from(subnet), 0, 0, 0, 1),
            ns,
        };
        self.wire(&pod)?;
        Ok(pod)
    }

    /// Deletes `pod`'s veth and creates it again under the same names and
    /// addresses, as a restarted pod sandbox does: a new device (a new ifindex)
    /// whose old links, census's included, died with the old one.
    pub fn recreate_link(&self, pod: &Pod) -> Result<(), Error> {
        self.node.ip(&["link", "del", &pod.host_interface])?;
        self.wire(pod)
    }

    /// `pod`'s veth, its addresses on both sides and the pod's routes.
    fn wire(&self, pod: &Pod) -> Result<(), Error> {
        let node = &self.node;
        let host = pod.host_interface.as_str();
        node.add_veth(host, &pod.ns)?;
        node.ip(&[
            "addr",
            "add",
            &format!("{}/24", pod.gateway_v4),
            "dev",
            host,
        ])?;
        node.ip(&[
            "addr",
            "add",
            &format!("{}/64", pod.gateway_v6),
            "dev",
            host,
            "nodad",
        ])?;
        node.ip(&["link", "set", host, "up"])?;

        let ns = &pod.ns;
        ns.ip(&["addr", "add", &format!("{}/24", pod.ipv4), "dev", "eth0"])?;
        ns.ip(&[
            "addr",
            "add",
            &format!("{}/64", pod.ipv6),
            "dev",
            "eth0",
            "nodad",
        ])?;
        ns.ip(&["link", "set", "eth0", "up"])?;
        ns.ip(&[
            "route",
            "add",
            "198.18.0.0/15",
            "via",
            &pod.gateway_v4.to_string(),
        ])?;
        ns.ip(&[
            "-6",
            "route",
            "add",
            "2001:2::/48",
            "via",
            &pod.gateway_v6.to_string(),
        ])?;
        Ok(())
    }
}

/// One pod: its namespace, addresses and the name of its veth's host side (in
/// the node namespace).
#[derive(Debug)]
pub struct Pod {
    pub ns: Netns,
    pub host_interface: String,
    pub ipv4: Ipv4Addr,
    pub ipv6: Ipv6Addr,
    /// The node's address on this pod's link.
    pub gateway_v4: Ipv4Addr,
    pub gateway_v6: Ipv6Addr,
}

impl Pod {
    pub fn ip(&self, v6: bool) -> IpAddr {
        if v6 {
            self.ipv6.into()
        } else {
            self.ipv4.into()
        }
    }

    pub fn gateway(&self, v6: bool) -> IpAddr {
        if v6 {
            self.gateway_v6.into()
        } else {
            self.gateway_v4.into()
        }
    }
}
