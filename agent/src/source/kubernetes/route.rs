//! The host side of a pod's interface, found the way the kernel would send a
//! packet to the pod: a route lookup for the pod's address (`RTM_GETROUTE`, what
//! `ip route get <ip>` asks), then the name and kind of the route's output
//! interface (`RTM_GETLINK`).
//!
//! Netlink directly, through the rust-netlink crates (`netlink-sys` for the
//! socket, `netlink-packet-route` for the typed messages), rather than running
//! `ip -j route get`: no process per lookup, no dependence on iproute2 being in
//! the agent's image, and typed attributes instead of parsed text. The socket is
//! synchronous and opened per lookup: the kernel answers before `send` returns, a
//! lookup takes microseconds, and a socket opened in the agent's network
//! namespace at the time of the call is never stale.
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

use netlink_packet_core::{DecodeError, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload};
use netlink_packet_route::{
    AddressFamily, RouteNetlinkMessage,
    link::{InfoKind, LinkAttribute, LinkInfo, LinkLayerType, LinkMessage},
    route::{RouteAddress, RouteAttribute, RouteMessage, RouteType},
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

/// Finds the host side of the interface a pod's address is reached through.
pub trait InterfaceLookup: Send + Sync + 'static {
    fn host_interface(&self, ip: IpAddr) -> Result<String, RouteError>;
}

/// Why a pod's address does not lead to an interface of its own.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    #[error("netlink: {0}")]
    Socket(#[source] io::Error),
    #[error("netlink: the kernel's answer cannot be read: {0}")]
    Decode(#[source] DecodeError),
    #[error("netlink: an answer of {size} bytes does not fit the buffer")]
    Truncated { size: usize },
    #[error("netlink: unexpected answer to {request}")]
    Unexpected { request: &'static str },
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
        describe(kind.as_deref(), *ethernet)
    )]
    NotPodDevice {
        ip: IpAddr,
        interface: String,
        kind: Option<String>,
        ethernet: bool,
    },
}

fn describe(kind: Option<&str>, ethernet: bool) -> String {
    let kind = kind.map_or_else(
        || "a device without a kind (a NIC)".to_owned(),
        |k| format!("a {k} device"),
    );
    if ethernet {
        kind
    } else {
        format!("{kind} without an Ethernet link type")
    }
}

/// Route lookups in the agent's own network namespace.
#[derive(Debug, Clone, Copy, Default)]
pub struct RouteLookup;

impl InterfaceLookup for RouteLookup {
    fn host_interface(&self, ip: IpAddr) -> Result<String, RouteError> {
        let socket = open()?;
        let route = route_to(&socket, ip)?;
        let mut index = None;
        let mut gateway = None;
        for attribute in &route.attributes {
            match attribute {
                RouteAttribute::Oif(oif) => index = Some(*oif),
                RouteAttribute::Gateway(address) => gateway = Some(address_text(address)),
                _ => {}
            }
        }
        match route.header.kind {
            RouteType::Unicast => {}
            RouteType::Local | RouteType::Broadcast | RouteType::Anycast => {
                return Err(RouteError::Local { ip });
            }
            RouteType::BlackHole => return Err(unroutable(ip, "black hole")),
            RouteType::Unreachable => return Err(unroutable(ip, "unreachable")),
            RouteType::Prohibit => return Err(unroutable(ip, "prohibited")),
            _ => return Err(unroutable(ip, "not a unicast route")),
        }
        let index = index.ok_or(RouteError::NoInterface { ip })?;
        let link = link(&socket, ip, index)?;
        if let Some(gateway) = gateway {
            return Err(RouteError::Gateway {
                ip,
                gateway,
                interface: link.name,
            });
        }
        if let Some(kind) = link.shared {
            return Err(RouteError::Shared {
                ip,
                interface: link.name,
                kind,
            });
        }
        let own = matches!(link.kind.as_deref(), Some("veth" | "netkit"));
        if !own || !link.ethernet {
            return Err(RouteError::NotPodDevice {
                ip,
                interface: link.name,
                kind: link.kind,
                ethernet: link.ethernet,
            });
        }
        Ok(link.name)
    }
}

fn unroutable(ip: IpAddr, kind: &'static str) -> RouteError {
    RouteError::Unroutable { ip, kind }
}

fn address_text(address: &RouteAddress) -> String {
    match address {
        RouteAddress::Inet(v4) => v4.to_string(),
        RouteAddress::Inet6(v6) => v6.to_string(),
        other => format!("{other:?}"),
    }
}

fn open() -> Result<Socket, RouteError> {
    let mut socket = Socket::new(NETLINK_ROUTE).map_err(RouteError::Socket)?;
    socket.bind_auto().map_err(RouteError::Socket)?;
    socket
        .connect(&SocketAddr::new(0, 0))
        .map_err(RouteError::Socket)?;
    Ok(socket)
}

/// The route the kernel would use to reach `ip`.
fn route_to(socket: &Socket, ip: IpAddr) -> Result<RouteMessage, RouteError> {
    let mut request = RouteMessage::default();
    let (family, prefix) = match ip {
        IpAddr::V4(_) => (AddressFamily::Inet, 32),
        IpAddr::V6(_) => (AddressFamily::Inet6, 128),
    };
    request.header.address_family = family;
    request.header.destination_prefix_length = prefix;
    request
        .attributes
        .push(RouteAttribute::Destination(RouteAddress::from(ip)));
    match ask(socket, RouteNetlinkMessage::GetRoute(request)) {
        Ok(RouteNetlinkMessage::NewRoute(route)) => Ok(route),
        Ok(_) => Err(RouteError::Unexpected {
            request: "RTM_GETROUTE",
        }),
        Err(Asked::Kernel(source)) => Err(RouteError::Kernel { ip, source }),
        Err(Asked::Failed(error)) => Err(error),
    }
}

struct Link {
    name: String,
    /// What kind of shared device it is, if it is one.
    shared: Option<&'static str>,
    /// Its link kind (`veth`, `macvlan`, ...); `None` for a NIC.
    kind: Option<String>,
    /// Whether its link type is ARPHRD_ETHER.
    ethernet: bool,
}

fn link(socket: &Socket, ip: IpAddr, index: u32) -> Result<Link, RouteError> {
    let mut request = LinkMessage::default();
    request.header.index = index;
    let message = match ask(socket, RouteNetlinkMessage::GetLink(request)) {
        Ok(RouteNetlinkMessage::NewLink(message)) => message,
        Ok(_) => {
            return Err(RouteError::Unexpected {
                request: "RTM_GETLINK",
            });
        }
        Err(Asked::Kernel(source)) => return Err(RouteError::Link { ip, index, source }),
        Err(Asked::Failed(error)) => return Err(error),
    };
    let mut name = None;
    let mut shared =
        (message.header.link_layer_type == LinkLayerType::Loopback).then_some("loopback");
    let ethernet = message.header.link_layer_type == LinkLayerType::Ether;
    let mut kind = None;
    for attribute in message.attributes {
        match attribute {
            LinkAttribute::IfName(n) => name = Some(n),
            LinkAttribute::LinkInfo(infos) => {
                for info in infos {
                    if let LinkInfo::Kind(found) = info {
                        if found == InfoKind::Bridge {
                            shared = Some("bridge");
                        }
                        kind = Some(match found {
                            InfoKind::Veth => "veth".to_owned(),
                            InfoKind::Netkit => "netkit".to_owned(),
                            other => other.to_string(),
                        });
                    }
                }
            }
            _ => {}
        }
    }
    let name = name.ok_or(RouteError::Unnamed { ip, index })?;
    Ok(Link {
        name,
        shared,
        kind,
        ethernet,
    })
}

enum Asked {
    /// The kernel refused the request.
    Kernel(io::Error),
    Failed(RouteError),
}

/// Big enough for any one route or link message (a link's statistics included).
const RECEIVE_BUFFER: usize = 32 * 1024;

/// Sends one request and reads its one answer.
fn ask(socket: &Socket, message: RouteNetlinkMessage) -> Result<RouteNetlinkMessage, Asked> {
    let mut packet = NetlinkMessage::from(message);
    packet.header.flags = NLM_F_REQUEST;
    packet.header.sequence_number = 1;
    packet.finalize();
    let mut bytes = vec![0; packet.buffer_len()];
    packet.serialize(&mut bytes);
    socket
        .send(&bytes, 0)
        .map_err(|e| Asked::Failed(RouteError::Socket(e)))?;
    let mut answer = Vec::with_capacity(RECEIVE_BUFFER);
    let size = socket
        .recv(&mut answer, libc::MSG_TRUNC)
        .map_err(|e| Asked::Failed(RouteError::Socket(e)))?;
    if size > answer.len() {
        return Err(Asked::Failed(RouteError::Truncated { size }));
    }
    let answer = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&answer)
        .map_err(|e| Asked::Failed(RouteError::Decode(e)))?;
    match answer.payload {
        NetlinkPayload::InnerMessage(message) => Ok(message),
        NetlinkPayload::Error(error) if error.code.is_some() => Err(Asked::Kernel(error.to_io())),
        _ => Err(Asked::Failed(RouteError::Unexpected {
            request: "a route netlink request",
        })),
    }
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
