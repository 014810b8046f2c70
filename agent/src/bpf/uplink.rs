//! The uplink role: `census_uplink` on the egress hook of the devices packets
//! leave the node by (the default route's devices, VXLAN and Geneve tunnel
//! devices, or those `--uplink` names). It counts what no endpoint's hook can:
//! a Service request whose backend is on another node, seen translated (after
//! kube-proxy's DNAT) and still carrying the mark `census_ingress` gave it. It
//! counts nothing else, and never speaks for an endpoint: the node's own traffic
//! and every unmarked packet pass uncounted.
//!
//! Both a tunnel device and its underlay may be hooked: the bit is cleared where
//! the packet is counted, before encapsulation, so the outer packet is not
//! counted again.
//!
//! Links are pinned (TCX) or recorded (TC filters) beside the endpoints' as
//! `<if>-uplink`, so they are adopted across restarts the same way; reconcile,
//! which attaches and detaches endpoints' interfaces, leaves them alone.

use std::collections::BTreeSet;

use super::{
    AttachMode, AttachOutcome, Attachment, AttachmentState, Datapath, Direction, Error,
    attach::{check_interface_name, ifindex},
};
use crate::netlink;

impl Datapath {
    /// Attaches `census_uplink` to the egress hook of `interface`, ahead of any
    /// other program there (adopting census's own link or filter, as
    /// [`Datapath::attach`] does).
    ///
    /// Refuses a device without an Ethernet link type
    /// ([`Error::UnsupportedUplink`]: the program reads an Ethernet header) and
    /// an endpoint's interface ([`Error::EndpointInterfaceAsUplink`]).
    pub fn attach_uplink(&mut self, interface: &str) -> Result<AttachOutcome, Error> {
        check_interface_name(interface)?;
        let ifindex = ifindex(interface)?;
        let link = netlink::link::link_kind(ifindex).map_err(|source| Error::Netlink {
            operation: "reading the link kind",
            interface: interface.to_owned(),
            source,
        })?;
        if !link.ethernet {
            return Err(Error::UnsupportedUplink {
                interface: interface.to_owned(),
                kind: link.kind,
                ethernet: link.ethernet,
            });
        }
        if self.interface(ifindex).is_some() || self.has_endpoint_hooks(interface, ifindex)? {
            return Err(Error::EndpointInterfaceAsUplink {
                interface: interface.to_owned(),
            });
        }
        match self.mode {
            AttachMode::Tcx => self.attach_one(interface, ifindex, Direction::Uplink),
            AttachMode::Tc => self.attach_tc(interface, ifindex, Direction::Uplink),
        }
    }

    /// Whether census's endpoint programs are attached to `interface`.
    fn has_endpoint_hooks(&self, interface: &str, ifindex: u32) -> Result<bool, Error> {
        Ok(self.attachments()?.iter().any(|a| {
            a.direction.is_endpoint_hook()
                && a.interface == interface
                && a.state == AttachmentState::Attached { ifindex }
        }))
    }

    /// Detaches `census_uplink` from `interface` and removes its pin or record;
    /// `false` if it was not attached. Works also when the interface is gone.
    pub fn detach_uplink(&mut self, interface: &str) -> Result<bool, Error> {
        check_interface_name(interface)?;
        let mut detached = false;
        let path = self.pins.link(interface, Direction::Uplink);
        if path.exists() {
            super::pins::detach_and_unpin(&path)?;
            detached = true;
        }
        for record in super::tc::records(&self.pins.links_dir())? {
            if record.interface == interface && record.direction == Direction::Uplink {
                record.remove()?;
                detached = true;
            }
        }
        Ok(detached)
    }

    /// The uplink hooks census is attached to, as [`Datapath::attachments`]
    /// lists them.
    pub fn uplinks(&self) -> Result<Vec<Attachment>, Error> {
        Ok(self
            .attachments()?
            .into_iter()
            .filter(|a| a.direction == Direction::Uplink)
            .collect())
    }
}

/// The devices of this network namespace that packets leave the node by, as
/// census finds them when no `--uplink` is given: every device a default route
/// (IPv4 or IPv6, any table) leaves by, and every VXLAN or Geneve device. Only
/// those with an Ethernet link type (a WireGuard or other L3 device is left out:
/// see [`Error::UnsupportedUplink`]).
pub fn default_uplinks() -> Result<BTreeSet<String>, Error> {
    let netlink_error = |operation| {
        move |source| Error::Netlink {
            operation,
            interface: String::new(),
            source,
        }
    };
    let routed = netlink::route::default_route_interfaces()
        .map_err(netlink_error("listing the default routes"))?;
    let links = netlink::link::links().map_err(netlink_error("listing the interfaces"))?;
    Ok(links
        .into_iter()
        .filter(|entry| {
            entry.kind.ethernet && (entry.kind.is_tunnel() || routed.contains(&entry.ifindex))
        })
        .map(|entry| entry.name)
        .collect())
}
