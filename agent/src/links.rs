//! The node's link and route events, so that an interface re-created under the
//! agent (a pod's sandbox restarted, its veth deleted and added again under the
//! same name) gets census's classifier back at once, not at the next full pass:
//! the classifier's links die with the device, and until they are back the pod's
//! packets leave it uncounted; and so that a pod whose device was not found (a CNI
//! plugin that adds the device, then the route to the pod's address) is looked up
//! again as soon as its route exists.
//!
//! An rtnetlink socket subscribed to `RTMGRP_LINK` and the IPv4 and IPv6 route
//! groups in the agent's network namespace (the host's: the host sides of the
//! pods' interfaces live there). The events are not interpreted beyond "a link
//! (or a route) was added, changed or removed": each one bumps a counter a task
//! watches, so a burst (a pod start sends several) costs one pass: over the
//! endpoint interfaces for a link change, over the pods without an interface yet
//! for either.

use std::io;

use netlink_packet_core::NetlinkPayload;
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::{AsyncSocket, AsyncSocketExt, SocketAddr, TokioSocket, protocols::NETLINK_ROUTE};
use nix::errno::Errno;
use tokio::sync::watch;
use tracing::{debug, warn};

use crate::netlink;

/// `RTMGRP_LINK`, `RTMGRP_IPV4_ROUTE` and `RTMGRP_IPV6_ROUTE` (linux/rtnetlink.h):
/// the multicast groups of link and route changes.
const RTMGRP_LINK: u32 = 0x1;
const RTMGRP_IPV4_ROUTE: u32 = 0x40;
const RTMGRP_IPV6_ROUTE: u32 = 0x400;

/// What one read of the socket found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Found {
    /// Links and routes were added, changed or removed (this many messages of each).
    Changed { links: usize, routes: usize },
    /// Only other messages.
    Nothing,
    /// The kernel dropped messages (the socket's buffer was full): anything may
    /// have changed.
    Overflow,
}

/// The counters [`watch_links`] bumps.
#[derive(Debug)]
pub(crate) struct Changes {
    /// At every link change.
    pub(crate) links: watch::Sender<u64>,
    /// At every link or route change: where a pod's address is routed may differ.
    pub(crate) routes: watch::Sender<u64>,
}

/// A subscription to the link and route changes of the calling thread's network
/// namespace.
pub(crate) struct LinkEvents {
    socket: TokioSocket,
    buffer: Vec<u8>,
}

impl LinkEvents {
    /// Subscribes; the socket belongs to the calling thread's network namespace.
    pub(crate) fn open() -> io::Result<Self> {
        let mut socket = TokioSocket::new(NETLINK_ROUTE)?;
        let groups = RTMGRP_LINK | RTMGRP_IPV4_ROUTE | RTMGRP_IPV6_ROUTE;
        socket.socket_mut().bind(&SocketAddr::new(0, groups))?;
        Ok(Self {
            socket,
            buffer: Vec::with_capacity(netlink::RECEIVE_BUFFER),
        })
    }

    /// Waits for the next datagram of events and says what it held.
    pub(crate) async fn next(&mut self) -> io::Result<Found> {
        self.buffer.clear();
        match self.socket.recv(&mut self.buffer).await {
            Ok(()) => Ok(parse(&self.buffer)),
            // The kernel dropped events for this socket: its buffer was full.
            Err(error) if error.raw_os_error() == Some(Errno::ENOBUFS as i32) => {
                Ok(Found::Overflow)
            }
            Err(error) => Err(error),
        }
    }
}

impl std::fmt::Debug for LinkEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkEvents").finish_non_exhaustive()
    }
}

/// What a datagram of rtnetlink messages holds.
fn parse(bytes: &[u8]) -> Found {
    let (mut links, mut routes) = (0, 0);
    for message in netlink::messages::<RouteNetlinkMessage>(bytes) {
        match message.map(|m| m.payload) {
            Ok(NetlinkPayload::InnerMessage(
                RouteNetlinkMessage::NewLink(_)
                | RouteNetlinkMessage::DelLink(_)
                | RouteNetlinkMessage::SetLink(_),
            )) => links += 1,
            Ok(NetlinkPayload::InnerMessage(
                RouteNetlinkMessage::NewRoute(_) | RouteNetlinkMessage::DelRoute(_),
            )) => routes += 1,
            Ok(_) => {}
            // Unreadable: assume the worst, a change of either.
            Err(_) => {
                return Found::Changed {
                    links: links + 1,
                    routes: routes + 1,
                };
            }
        }
    }
    if links == 0 && routes == 0 {
        Found::Nothing
    } else {
        Found::Changed { links, routes }
    }
}

/// Bumps `changes` at every link or route change (or overflow) until the socket
/// fails or nobody watches either counter any more. A failed socket is logged: the
/// full pass and the periodic lookups remain, every reconcile interval.
pub(crate) async fn watch_links(mut events: LinkEvents, changes: Changes) {
    loop {
        let found = tokio::select! {
            found = events.next() => found,
            () = both_closed(&changes) => return,
        };
        let (links, routes) = match found {
            Ok(Found::Nothing) => continue,
            Ok(Found::Overflow) => (true, true),
            Ok(Found::Changed { links, routes }) => (links > 0, links + routes > 0),
            Err(error) => {
                warn!(%error, "the link event socket failed; re-created interfaces wait for the full pass");
                return;
            }
        };
        debug!(?found, "link or route change");
        let bump = |n: &mut u64| *n = n.wrapping_add(1);
        if links {
            changes.links.send_modify(bump);
        }
        if routes {
            changes.routes.send_modify(bump);
        }
    }
}

/// Once nobody watches either counter.
async fn both_closed(changes: &Changes) {
    tokio::join!(changes.links.closed(), changes.routes.closed());
}

#[cfg(test)]
mod tests {
    use netlink_packet_core::{NetlinkHeader, NetlinkMessage};
    use netlink_packet_route::{
        address::AddressMessage,
        link::{LinkAttribute, LinkMessage},
        route::RouteMessage,
    };

    use super::*;

    fn datagram(messages: Vec<RouteNetlinkMessage>) -> Vec<u8> {
        let mut bytes = Vec::new();
        for message in messages {
            let mut packet = NetlinkMessage::new(
                NetlinkHeader::default(),
                NetlinkPayload::InnerMessage(message),
            );
            packet.finalize();
            let mut buffer = vec![0; packet.buffer_len()];
            packet.serialize(&mut buffer);
            buffer.resize(buffer.len().next_multiple_of(4), 0);
            bytes.extend(buffer);
        }
        bytes
    }

    fn link(name: &str) -> LinkMessage {
        let mut message = LinkMessage::default();
        message.header.index = 7;
        message
            .attributes
            .push(LinkAttribute::IfName(name.to_owned()));
        message
    }

    #[test]
    fn link_and_route_messages_are_changes_and_other_messages_are_not() {
        let both = datagram(vec![
            RouteNetlinkMessage::NewLink(link("pod0")),
            RouteNetlinkMessage::NewAddress(AddressMessage::default()),
            RouteNetlinkMessage::DelLink(link("pod1")),
        ]);
        assert_eq!(
            parse(&both),
            Found::Changed {
                links: 2,
                routes: 0
            }
        );
        let routes = datagram(vec![
            RouteNetlinkMessage::NewRoute(RouteMessage::default()),
            RouteNetlinkMessage::DelRoute(RouteMessage::default()),
        ]);
        assert_eq!(
            parse(&routes),
            Found::Changed {
                links: 0,
                routes: 2
            }
        );
        let other = datagram(vec![RouteNetlinkMessage::NewAddress(
            AddressMessage::default(),
        )]);
        assert_eq!(parse(&other), Found::Nothing);
        assert_eq!(parse(&[]), Found::Nothing);
        assert_eq!(
            parse(&[1, 2, 3]),
            Found::Changed {
                links: 1,
                routes: 1
            },
            "unreadable: a change"
        );
    }
}
