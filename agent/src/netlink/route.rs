//! Routes: the one the kernel would use to reach an address (`ip route get`), and
//! the interfaces default routes leave by.

use std::{collections::BTreeSet, net::IpAddr};

use netlink_packet_core::NLM_F_DUMP;
use netlink_packet_route::{
    AddressFamily, RouteNetlinkMessage,
    route::{RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteType},
};

use super::{Error, Request, ask, exchange};

/// The route to one address, as far as census reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Route {
    pub(crate) kind: RouteType,
    /// The output interface, if the route names one.
    pub(crate) interface: Option<u32>,
    /// The next hop, if the route goes through one.
    pub(crate) gateway: Option<String>,
}

/// The request for the route to `ip` (`RTM_GETROUTE` for the host prefix).
fn route_request(ip: IpAddr) -> RouteMessage {
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
    request
}

/// The route the kernel would use to reach `ip`.
pub(crate) fn route_to(ip: IpAddr) -> Result<Route, Error> {
    const GETROUTE: &str = "RTM_GETROUTE";
    let RouteNetlinkMessage::NewRoute(route) = ask(Request {
        name: GETROUTE,
        message: RouteNetlinkMessage::GetRoute(route_request(ip)),
        flags: 0,
    })?
    else {
        return Err(Error::Unexpected { request: GETROUTE });
    };
    let mut found = Route {
        kind: route.header.kind,
        interface: None,
        gateway: None,
    };
    for attribute in &route.attributes {
        match attribute {
            RouteAttribute::Oif(oif) => found.interface = Some(*oif),
            RouteAttribute::Gateway(address) => found.gateway = Some(address_text(address)),
            _ => {}
        }
    }
    Ok(found)
}

fn address_text(address: &RouteAddress) -> String {
    match address {
        RouteAddress::Inet(v4) => v4.to_string(),
        RouteAddress::Inet6(v6) => v6.to_string(),
        other => format!("{other:?}"),
    }
}

/// The interfaces the node's default routes leave by, IPv4 and IPv6, in every
/// routing table but `local` (policy routing keeps an uplink's default route in
/// a table of its own), every next hop of a multipath route: the node's uplinks.
pub(crate) fn default_route_interfaces() -> Result<BTreeSet<u32>, Error> {
    let mut interfaces = BTreeSet::new();
    for family in [AddressFamily::Inet, AddressFamily::Inet6] {
        let mut request = RouteMessage::default();
        request.header.address_family = family;
        request.header.table = RouteHeader::RT_TABLE_UNSPEC;
        let answers = exchange(Request {
            name: "RTM_GETROUTE",
            message: RouteNetlinkMessage::GetRoute(request),
            flags: NLM_F_DUMP,
        })?;
        for answer in answers {
            let RouteNetlinkMessage::NewRoute(route) = answer else {
                continue;
            };
            if route.header.destination_prefix_length != 0
                || route.header.kind != RouteType::Unicast
            {
                continue;
            }
            for attribute in &route.attributes {
                match attribute {
                    RouteAttribute::Oif(oif) => {
                        interfaces.insert(*oif);
                    }
                    RouteAttribute::MultiPath(hops) => {
                        interfaces.extend(hops.iter().map(|hop| hop.interface_index));
                    }
                    _ => {}
                }
            }
        }
    }
    Ok(interfaces)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_route_lookup_asks_for_the_host_prefix_of_the_address()
    -> Result<(), std::net::AddrParseError> {
        for (ip, family, prefix) in [
            ("198.18.0.5", AddressFamily::Inet, 32),
            ("2001:db8::5", AddressFamily::Inet6, 128),
        ] {
            let ip: IpAddr = ip.parse()?;
            let request = route_request(ip);
            assert_eq!(request.header.address_family, family);
            assert_eq!(request.header.destination_prefix_length, prefix);
            assert_eq!(
                request.attributes,
                vec![RouteAttribute::Destination(RouteAddress::from(ip))]
            );
        }
        Ok(())
    }

    /// Unprivileged: loopback is this node's own (a local route).
    #[test]
    fn the_route_to_loopback_is_local() -> Result<(), Error> {
        let route = route_to([127, 0, 0, 1].into())?;
        assert_eq!(route.kind, RouteType::Local);
        Ok(())
    }
}
