//! Interfaces: their names, kinds and link types, and the one rule of what a pod's
//! own device is.

use std::fmt;

use netlink_packet_core::NLM_F_DUMP;
use netlink_packet_route::{
    RouteNetlinkMessage,
    link::{InfoKind, LinkAttribute, LinkInfo, LinkLayerType, LinkMessage},
};

use super::{Error, Request, ask, exchange};

/// What an interface is, for deciding whether census may count on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LinkKind {
    /// `veth`, `netkit`, `macvlan`, `bridge`, ...; `None` for a device without a
    /// kind (a physical NIC, loopback).
    pub(crate) kind: Option<String>,
    /// Whether its link type is ARPHRD_ETHER (frames start with an Ethernet header).
    pub(crate) ethernet: bool,
    /// Whether its link type is ARPHRD_LOOPBACK.
    pub(crate) loopback: bool,
}

impl LinkKind {
    /// A pod's own device: the host side of a veth or netkit pair, whose frames
    /// carry an Ethernet header (the classifier parses one). Anything else (a NIC,
    /// a bridge, macvlan, ipvlan, wireguard, tun) would give its whole traffic one
    /// endpoint's identity, or garbage.
    pub(crate) fn is_pod_device(&self) -> bool {
        matches!(self.kind.as_deref(), Some("veth" | "netkit")) && self.ethernet
    }

    /// What shared device it is, if several pods' traffic crosses it: a bridge, or
    /// loopback.
    pub(crate) fn shared(&self) -> Option<&'static str> {
        if self.loopback {
            Some("loopback")
        } else if self.kind.as_deref() == Some("bridge") {
            Some("bridge")
        } else {
            None
        }
    }

    /// A tunnel packets leave the node by (VXLAN, Geneve).
    pub(crate) fn is_tunnel(&self) -> bool {
        matches!(self.kind.as_deref(), Some("vxlan" | "geneve"))
    }

    fn of(link: &LinkMessage) -> Self {
        let kind = link
            .attributes
            .iter()
            .find_map(|attribute| match attribute {
                LinkAttribute::LinkInfo(infos) => infos.iter().find_map(|info| match info {
                    LinkInfo::Kind(found) => Some(match found {
                        InfoKind::Veth => "veth".to_owned(),
                        InfoKind::Netkit => "netkit".to_owned(),
                        InfoKind::Bridge => "bridge".to_owned(),
                        other => other.to_string(),
                    }),
                    _ => None,
                }),
                _ => None,
            });
        Self {
            kind,
            ethernet: link.header.link_layer_type == LinkLayerType::Ether,
            loopback: link.header.link_layer_type == LinkLayerType::Loopback,
        }
    }
}

/// Describes an interface that census does not count on: "a macvlan device", "a
/// device without a kind (a NIC, loopback) without an Ethernet link type".
pub(crate) struct Described<'a> {
    pub(crate) kind: Option<&'a str>,
    pub(crate) ethernet: bool,
}

impl fmt::Display for Described<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            Some(kind) => write!(f, "a {kind} device")?,
            None => f.write_str("a device without a kind (a NIC, loopback)")?,
        }
        if !self.ethernet {
            f.write_str(" without an Ethernet link type")?;
        }
        Ok(())
    }
}

/// One interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Link {
    pub(crate) name: String,
    pub(crate) ifindex: u32,
    pub(crate) kind: LinkKind,
}

impl Link {
    fn of(link: &LinkMessage) -> Option<Self> {
        let name = link
            .attributes
            .iter()
            .find_map(|attribute| match attribute {
                LinkAttribute::IfName(name) => Some(name.clone()),
                _ => None,
            })?;
        Some(Self {
            name,
            ifindex: link.header.index,
            kind: LinkKind::of(link),
        })
    }
}

const GETLINK: &str = "RTM_GETLINK";

/// Interface `ifindex`: `Ok(None)` when the kernel names it not (it has no name).
pub(crate) fn link(ifindex: u32) -> Result<Option<Link>, Error> {
    let mut request = LinkMessage::default();
    request.header.index = ifindex;
    match ask(Request {
        name: GETLINK,
        message: RouteNetlinkMessage::GetLink(request),
        flags: 0,
    })? {
        RouteNetlinkMessage::NewLink(link) => Ok(Link::of(&link)),
        _ => Err(Error::Unexpected { request: GETLINK }),
    }
}

/// The kind and link type of interface `ifindex`.
pub(crate) fn link_kind(ifindex: u32) -> Result<LinkKind, Error> {
    let mut request = LinkMessage::default();
    request.header.index = ifindex;
    match ask(Request {
        name: GETLINK,
        message: RouteNetlinkMessage::GetLink(request),
        flags: 0,
    })? {
        RouteNetlinkMessage::NewLink(link) => Ok(LinkKind::of(&link)),
        _ => Err(Error::Unexpected { request: GETLINK }),
    }
}

/// Every interface of the calling thread's network namespace.
pub(crate) fn links() -> Result<Vec<Link>, Error> {
    let answers = exchange(Request {
        name: GETLINK,
        message: RouteNetlinkMessage::GetLink(LinkMessage::default()),
        flags: NLM_F_DUMP,
    })?;
    Ok(answers
        .iter()
        .filter_map(|answer| match answer {
            RouteNetlinkMessage::NewLink(link) => Link::of(link),
            _ => None,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(kind: Option<&str>, ethernet: bool) -> LinkKind {
        LinkKind {
            kind: kind.map(str::to_owned),
            ethernet,
            loopback: false,
        }
    }

    #[test]
    fn only_an_ethernet_veth_or_netkit_is_a_pods_own_device() {
        assert!(kind(Some("veth"), true).is_pod_device());
        assert!(kind(Some("netkit"), true).is_pod_device());
        // netkit in L3 mode has no Ethernet header.
        assert!(!kind(Some("netkit"), false).is_pod_device());
        for other in [None, Some("macvlan"), Some("ipvlan"), Some("bridge")] {
            assert!(!kind(other, true).is_pod_device(), "{other:?}");
        }
        assert_eq!(kind(Some("bridge"), true).shared(), Some("bridge"));
        let lo = LinkKind {
            kind: None,
            ethernet: false,
            loopback: true,
        };
        assert_eq!(lo.shared(), Some("loopback"));
    }

    #[test]
    fn a_device_is_described_by_its_kind_and_link_type() {
        let text = |kind, ethernet| Described { kind, ethernet }.to_string();
        assert_eq!(text(Some("macvlan"), true), "a macvlan device");
        assert_eq!(
            text(None, false),
            "a device without a kind (a NIC, loopback) without an Ethernet link type"
        );
    }

    #[test]
    fn a_link_message_gives_its_name_index_and_kind() {
        let mut message = LinkMessage::default();
        message.header.index = 4;
        message.header.link_layer_type = LinkLayerType::Ether;
        message
            .attributes
            .push(LinkAttribute::IfName("pod0".to_owned()));
        message
            .attributes
            .push(LinkAttribute::LinkInfo(vec![LinkInfo::Kind(
                InfoKind::Veth,
            )]));
        assert_eq!(
            Link::of(&message),
            Some(Link {
                name: "pod0".to_owned(),
                ifindex: 4,
                kind: kind(Some("veth"), true),
            })
        );
        message.attributes.remove(0);
        assert_eq!(Link::of(&message), None, "an interface without a name");
    }
}
