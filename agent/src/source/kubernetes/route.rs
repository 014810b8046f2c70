//! The host side of a pod's interface, found the way the kernel would send a
//! packet to the pod: a route lookup for the pod's address (`RTM_GETROUTE`, what
//! `ip route get <ip>` asks), then the name and kind of the route's output
//! interface (`RTM_GETLINK`).
//!
//! The requests are the agent's one netlink module's (`crate::netlink`), which
//! also decides what a pod's own device is, for this source and the datapath alike.
//!
//! CNIs that route each pod to its own host-side device (Calico's `cali*`,
//! `ptp`, kindnet, AWS VPC CNI's `eni*`, the test lab's `pod<i>`) resolve to that
//! device. A pod behind a bridge (flannel's `cni0`, `bridge`), behind a gateway
//! (Cilium's `cilium_host`), or an address of the node itself does not name its
//! own device: the lookup says so, and the endpoint is shown in error rather
//! than having the classifier attached where it would count the wrong traffic.
//!
//! Only a veth or netkit device with an Ethernet link type is a pod's own
//! (the classifier parses an Ethernet header): a pod address on a connected
//! subnet of the node's NIC (macvlan and ipvlan CNIs) routes to the NIC, which
//! would give the whole node's traffic that pod's identity. Whether a veth is one
//! of the node's own (its uplink, when the node is a container) is the
//! datapath's to refuse when attaching (`Datapath::attach`), for every source.

use std::{io, net::IpAddr};

use netlink_packet_route::route::RouteType;

use crate::netlink::{self, link::Described};

/// Finds the host side of the interface a pod's address is reached through.
pub trait InterfaceLookup: Send + Sync + 'static {
    fn host_interface(&self, ip: IpAddr) -> Result<String, RouteError>;
}

/// Why a pod's address does not lead to an interface of its own.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    #[error(transparent)]
    Netlink(#[from] netlink::Error),
    #[error("route lookup for {ip}: {source}")]
    Kernel {
        ip: IpAddr,
        #[source]
        source: io::Error,
    },
    #[error("no route to {ip} ({kind})")]
    Unroutable { ip: IpAddr, kind: &'static str },
    #[error("{ip} is an address of this node, not a pod's")]
    Local { ip: IpAddr },
    #[error("{ip} is routed through {gateway} on {interface}, not to a device of its own")]
    Gateway {
        ip: IpAddr,
        gateway: String,
        interface: String,
    },
    #[error("the route to {ip} names no output interface")]
    NoInterface { ip: IpAddr },
    #[error(
        "{ip} is routed to {interface}, a {kind} shared by several pods; the pod's own device cannot be told from the route"
    )]
    Shared {
        ip: IpAddr,
        interface: String,
        kind: &'static str,
    },
    #[error("interface {index} (the route to {ip}): {source}")]
    Link {
        ip: IpAddr,
        index: u32,
        #[source]
        source: io::Error,
    },
    #[error("interface {index} (the route to {ip}) has no name")]
    Unnamed { ip: IpAddr, index: u32 },
    #[error(
        "{ip} is routed to {interface}, {}: census counts only on a pod's own veth or netkit device",
        Described { kind: kind.as_deref(), ethernet: *ethernet }
    )]
    NotPodDevice {
        ip: IpAddr,
        interface: String,
        kind: Option<String>,
        ethernet: bool,
    },
}

/// `error`, the kernel's refusal as `refused` makes it, any other as it is.
fn refusal(error: netlink::Error, refused: impl FnOnce(io::Error) -> RouteError) -> RouteError {
    match error {
        netlink::Error::Refused { source, .. } => refused(source),
        other => RouteError::Netlink(other),
    }
}

/// Route lookups in the agent's own network namespace.
#[derive(Debug, Clone, Copy, Default)]
pub struct RouteLookup;

impl InterfaceLookup for RouteLookup {
    fn host_interface(&self, ip: IpAddr) -> Result<String, RouteError> {
        let route = netlink::route::route_to(ip)
            .map_err(|e| refusal(e, |source| RouteError::Kernel { ip, source }))?;
        match route.kind {
            RouteType::Unicast => {}
            RouteType::Local | RouteType::Broadcast | RouteType::Anycast => {
                return Err(RouteError::Local { ip });
            }
            RouteType::BlackHole => return Err(unroutable(ip, "black hole")),
            RouteType::Unreachable => return Err(unroutable(ip, "unreachable")),
            RouteType::Prohibit => return Err(unroutable(ip, "prohibited")),
            _ => return Err(unroutable(ip, "not a unicast route")),
        }
        let index = route.interface.ok_or(RouteError::NoInterface { ip })?;
        let link = netlink::link::link(index)
            .map_err(|e| refusal(e, |source| RouteError::Link { ip, index, source }))?
            .ok_or(RouteError::Unnamed { ip, index })?;
        if let Some(gateway) = route.gateway {
            return Err(RouteError::Gateway {
                ip,
                gateway,
                interface: link.name,
            });
        }
        if let Some(kind) = link.kind.shared() {
            return Err(RouteError::Shared {
                ip,
                interface: link.name,
                kind,
            });
        }
        if !link.kind.is_pod_device() {
            return Err(RouteError::NotPodDevice {
                ip,
                interface: link.name,
                kind: link.kind.kind,
                ethernet: link.kind.ethernet,
            });
        }
        Ok(link.name)
    }
}

fn unroutable(ip: IpAddr, kind: &'static str) -> RouteError {
    RouteError::Unroutable { ip, kind }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Unprivileged: a lookup in the test's own namespace answers (loopback is
    /// this node's), and the error says so. The veth case is in the privileged
    /// suite (`agent/tests/privileged/pod_route.rs`).
    #[test]
    fn the_nodes_own_address_is_not_a_pod() {
        let ip: IpAddr = [127, 0, 0, 1].into();
        match RouteLookup.host_interface(ip) {
            Err(RouteError::Local { ip: found }) => assert_eq!(found, ip),
            other => panic!("expected Local, got {other:?}"),
        }
    }
}
