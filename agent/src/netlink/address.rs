//! An interface's addresses.

use std::net::IpAddr;

use netlink_packet_core::NLM_F_DUMP;
use netlink_packet_route::{
    RouteNetlinkMessage,
    address::{AddressAttribute, AddressMessage},
};

use super::{Error, Request, exchange};

/// The addresses interface `ifindex` holds (each address's own: `IFA_LOCAL`
/// where the kernel gives one, as for a point-to-point peer, else `IFA_ADDRESS`).
pub(crate) fn addresses(ifindex: u32) -> Result<Vec<IpAddr>, Error> {
    let answers = exchange(Request {
        name: "RTM_GETADDR",
        message: RouteNetlinkMessage::GetAddress(AddressMessage::default()),
        flags: NLM_F_DUMP,
    })?;
    Ok(answers
        .into_iter()
        .filter_map(|answer| match answer {
            RouteNetlinkMessage::NewAddress(message) if message.header.index == ifindex => {
                Some(message)
            }
            _ => None,
        })
        .filter_map(|message| {
            let (mut local, mut address) = (None, None);
            for attribute in message.attributes {
                match attribute {
                    AddressAttribute::Local(ip) => local = Some(ip),
                    AddressAttribute::Address(ip) => address = Some(ip),
                    _ => {}
                }
            }
            local.or(address)
        })
        .collect())
}
