//! The rtnetlink requests attaching with TC filters needs and aya 0.14 does not
//! expose: the filters on a clsact hook (to order census's before them, and to
//! find census's own), deleting one filter, an interface's kind and link type,
//! its addresses, and the interfaces default routes leave by. Synchronous sockets opened per request in the calling thread's network
//! namespace, as the route lookup of the pod source does.

use std::{collections::BTreeSet, io, net::IpAddr};

use netlink_packet_core::{NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload};
use netlink_packet_route::{
    AddressFamily, RouteNetlinkMessage,
    address::{AddressAttribute, AddressMessage},
    link::{InfoKind, LinkAttribute, LinkInfo, LinkLayerType, LinkMessage},
    route::{RouteAttribute, RouteHeader, RouteMessage, RouteType},
    tc::{TcAttribute, TcFilterBpfOption, TcHandle, TcMessage, TcOption},
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

use super::Direction;

/// One TC filter on a clsact hook, as the kernel lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Filter {
    pub(super) priority: u16,
    pub(super) handle: u32,
    /// `bpf`, `u32`, `flower`, ...
    pub(super) kind: String,
    /// A `bpf` filter's program name (the kernel's, at most 15 bytes).
    pub(super) program: Option<String>,
    pub(super) program_id: Option<u32>,
}

/// The clsact parent of `direction`'s hook (`ffff:fff2` ingress, `ffff:fff3` egress).
const fn parent(direction: Direction) -> TcHandle {
    TcHandle {
        major: 0xFFFF,
        minor: match direction {
            Direction::Ingress => TcHandle::MIN_INGRESS,
            Direction::Egress | Direction::Uplink => TcHandle::MIN_EGRESS,
        },
    }
}

fn open() -> io::Result<Socket> {
    let mut socket = Socket::new(NETLINK_ROUTE)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    Ok(socket)
}

/// Sends `message` with `flags` and collects the answers until the dump ends or
/// the kernel acknowledges (an error answer is the request's error).
fn exchange(message: RouteNetlinkMessage, flags: u16) -> io::Result<Vec<RouteNetlinkMessage>> {
    let socket = open()?;
    let mut packet = NetlinkMessage::from(message);
    packet.header.flags = NLM_F_REQUEST | flags;
    packet.header.sequence_number = 1;
    packet.finalize();
    let mut bytes = vec![0; packet.buffer_len()];
    packet.serialize(&mut bytes);
    socket.send(&bytes, 0)?;
    let dump = flags & NLM_F_DUMP == NLM_F_DUMP;
    let mut answers = Vec::new();
    loop {
        let mut buffer = Vec::with_capacity(64 * 1024);
        let size = socket.recv(&mut buffer, 0)?;
        let mut offset = 0;
        while offset < size {
            let answer = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&buffer[offset..])
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            let length = answer.header.length as usize;
            if length == 0 {
                return Err(io::ErrorKind::InvalidData.into());
            }
            offset += length;
            match answer.payload {
                NetlinkPayload::InnerMessage(message) => {
                    answers.push(message);
                    if !dump {
                        return Ok(answers);
                    }
                }
                NetlinkPayload::Error(error) => {
                    return match error.code {
                        Some(_) => Err(error.to_io()),
                        None => Ok(answers),
                    };
                }
                NetlinkPayload::Done(_) => return Ok(answers),
                _ => {}
            }
        }
    }
}

/// The filters on `direction`'s clsact hook of interface `ifindex`, by priority
/// and handle; none when the interface has no clsact qdisc.
pub(super) fn filters(ifindex: u32, direction: Direction) -> io::Result<Vec<Filter>> {
    let mut request = TcMessage::with_index(index(ifindex)?);
    request.header.parent = parent(direction);
    let answers = match exchange(RouteNetlinkMessage::GetTrafficFilter(request), NLM_F_DUMP) {
        Ok(answers) => answers,
        // No clsact (no hook to dump): no filters.
        Err(error) if error.raw_os_error() == Some(libc::EINVAL) => return Ok(Vec::new()),
        Err(error) => return Err(error),
    };
    let mut filters: Vec<Filter> = answers
        .into_iter()
        .filter_map(|answer| match answer {
            RouteNetlinkMessage::NewTrafficFilter(message) => Some(message),
            _ => None,
        })
        // A handle of 0 is a priority's classifier itself, not a filter.
        .filter(|message| u32::from(message.header.handle) != 0)
        .map(|message| {
            let mut filter = Filter {
                priority: (message.header.info >> 16) as u16,
                handle: message.header.handle.into(),
                kind: String::new(),
                program: None,
                program_id: None,
            };
            for attribute in message.attributes {
                match attribute {
                    TcAttribute::Kind(kind) => filter.kind = kind,
                    TcAttribute::Options(options) => {
                        for option in options {
                            match option {
                                TcOption::Bpf(TcFilterBpfOption::ProgName(name)) => {
                                    filter.program = Some(name);
                                }
                                TcOption::Bpf(TcFilterBpfOption::ProgId(id)) => {
                                    filter.program_id = Some(id);
                                }
                                _ => {}
                            }
                        }
                    }
                    _ => {}
                }
            }
            filter
        })
        .collect();
    filters.sort_by_key(|f| (f.priority, f.handle));
    Ok(filters)
}

/// Deletes the filter at `priority`/`handle` of `direction`'s hook of `ifindex`.
/// A filter (or interface) already gone is not an error.
pub(super) fn delete_filter(
    ifindex: u32,
    direction: Direction,
    priority: u16,
    handle: u32,
) -> io::Result<()> {
    let mut request = TcMessage::with_index(index(ifindex)?);
    request.header.parent = parent(direction);
    request.header.handle = handle.into();
    // Protocol 0: any (the kernel matches the priority and handle).
    request.header.info = u32::from(priority) << 16;
    request.attributes.push(TcAttribute::Kind("bpf".to_owned()));
    match exchange(RouteNetlinkMessage::DelTrafficFilter(request), NLM_F_ACK) {
        Err(error)
            if matches!(
                error.raw_os_error(),
                Some(libc::ENOENT | libc::ENODEV | libc::EINVAL)
            ) =>
        {
            Ok(())
        }
        other => other.map(drop),
    }
}

/// What an interface is, for deciding whether census may attach to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct LinkKind {
    /// `veth`, `netkit`, `macvlan`, ...; `None` for a device without a kind
    /// (a physical NIC, loopback).
    pub(super) kind: Option<String>,
    /// Whether its link type is ARPHRD_ETHER (frames start with an Ethernet header).
    pub(super) ethernet: bool,
}

/// The kind and link type of interface `ifindex`.
pub(super) fn link_kind(ifindex: u32) -> io::Result<LinkKind> {
    let mut request = LinkMessage::default();
    request.header.index = ifindex;
    let answers = exchange(RouteNetlinkMessage::GetLink(request), 0)?;
    let Some(RouteNetlinkMessage::NewLink(link)) = answers.into_iter().next() else {
        return Err(io::ErrorKind::InvalidData.into());
    };
    Ok(kind_of(&link))
}

/// One interface of a link dump.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct LinkEntry {
    pub(super) name: String,
    pub(super) ifindex: u32,
    pub(super) link: LinkKind,
}

/// Every interface of the calling thread's network namespace.
pub(super) fn links() -> io::Result<Vec<LinkEntry>> {
    let answers = exchange(
        RouteNetlinkMessage::GetLink(LinkMessage::default()),
        NLM_F_DUMP,
    )?;
    Ok(answers
        .into_iter()
        .filter_map(|answer| {
            let RouteNetlinkMessage::NewLink(link) = answer else {
                return None;
            };
            let name = link
                .attributes
                .iter()
                .find_map(|attribute| match attribute {
                    LinkAttribute::IfName(name) => Some(name.clone()),
                    _ => None,
                })?;
            Some(LinkEntry {
                name,
                ifindex: link.header.index,
                link: kind_of(&link),
            })
        })
        .collect())
}

fn kind_of(link: &LinkMessage) -> LinkKind {
    let mut kind = None;
    for attribute in &link.attributes {
        if let LinkAttribute::LinkInfo(infos) = attribute {
            for info in infos {
                if let LinkInfo::Kind(found) = info {
                    kind = Some(match found {
                        InfoKind::Veth => "veth".to_owned(),
                        InfoKind::Netkit => "netkit".to_owned(),
                        other => other.to_string(),
                    });
                }
            }
        }
    }
    LinkKind {
        kind,
        ethernet: link.header.link_layer_type == LinkLayerType::Ether,
    }
}

/// The addresses interface `ifindex` holds (each address's own: `IFA_LOCAL`
/// where the kernel gives one, as for a point-to-point peer, else `IFA_ADDRESS`).
pub(super) fn addresses(ifindex: u32) -> io::Result<Vec<IpAddr>> {
    let answers = exchange(
        RouteNetlinkMessage::GetAddress(AddressMessage::default()),
        NLM_F_DUMP,
    )?;
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

/// The interfaces the node's default routes leave by, IPv4 and IPv6, in every
/// routing table but `local` (policy routing keeps an uplink's default route in
/// a table of its own), every next hop of a multipath route: the node's uplinks.
pub(super) fn default_route_interfaces() -> io::Result<BTreeSet<u32>> {
    let mut interfaces = BTreeSet::new();
    for family in [AddressFamily::Inet, AddressFamily::Inet6] {
        let mut request = RouteMessage::default();
        request.header.address_family = family;
        request.header.table = RouteHeader::RT_TABLE_UNSPEC;
        for answer in exchange(RouteNetlinkMessage::GetRoute(request), NLM_F_DUMP)? {
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

fn index(ifindex: u32) -> io::Result<i32> {
    i32::try_from(ifindex).map_err(|_| io::ErrorKind::InvalidInput.into())
}
