//! The node's link events, so that an interface re-created under the agent (a
//! pod's sandbox restarted, its veth deleted and added again under the same
//! name) gets census's classifier back at once, not at the next full pass: the
//! classifier's links die with the device, and until they are back the pod's
//! packets leave it uncounted.
//!
//! An rtnetlink socket subscribed to `RTMGRP_LINK` in the agent's network
//! namespace (the host's: the host sides of the pods' interfaces live there). The
//! events are not interpreted beyond "a link was added, changed or removed": each
//! one bumps a counter the core's task watches, so a burst (a pod start sends
//! several) costs one pass over the endpoint interfaces, whose cost is the number
//! of interfaces of this node, not of the cluster.

use std::io;

use netlink_packet_core::NetlinkPayload;
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::{AsyncSocket, AsyncSocketExt, SocketAddr, TokioSocket, protocols::NETLINK_ROUTE};
use nix::errno::Errno;
use tokio::sync::watch;
use tracing::{debug, warn};

use crate::netlink;

/// `RTMGRP_LINK` (linux/rtnetlink.h): the multicast group of link changes.
const RTMGRP_LINK: u32 = 1;

/// What one read of the socket found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Found {
    /// Links were added, changed or removed (this many messages).
    Changed(usize),
    /// Only other messages.
    Nothing,
    /// The kernel dropped messages (the socket's buffer was full): anything may
    /// have changed.
    Overflow,
}

/// A subscription to the link changes of the calling thread's network namespace.
pub(crate) struct LinkEvents {
    socket: TokioSocket,
    buffer: Vec<u8>,
}

impl LinkEvents {
    /// Subscribes; the socket belongs to the calling thread's network namespace.
    pub(crate) fn open() -> io::Result<Self> {
        let mut socket = TokioSocket::new(NETLINK_ROUTE)?;
        socket.socket_mut().bind(&SocketAddr::new(0, RTMGRP_LINK))?;
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
    let mut changed = 0;
    for message in netlink::messages::<RouteNetlinkMessage>(bytes) {
        match message.map(|m| m.payload) {
            Ok(NetlinkPayload::InnerMessage(
                RouteNetlinkMessage::NewLink(_)
                | RouteNetlinkMessage::DelLink(_)
                | RouteNetlinkMessage::SetLink(_),
            )) => changed += 1,
            Ok(_) => {}
            // Unreadable: assume the worst, a change.
            Err(_) => return Found::Changed(changed + 1),
        }
    }
    if changed == 0 {
        Found::Nothing
    } else {
        Found::Changed(changed)
    }
}

/// Bumps `changes` at every link change (or overflow) until the socket fails or
/// nobody watches `changes` any more. A failed socket is logged: the full pass
/// remains, every reconcile interval.
pub(crate) async fn watch_links(mut events: LinkEvents, changes: watch::Sender<u64>) {
    loop {
        let found = tokio::select! {
            found = events.next() => found,
            () = changes.closed() => return,
        };
        match found {
            Ok(Found::Nothing) => {}
            Ok(found) => {
                debug!(?found, "link change");
                changes.send_modify(|n| *n = n.wrapping_add(1));
            }
            Err(error) => {
                warn!(%error, "the link event socket failed; re-created interfaces wait for the full pass");
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use netlink_packet_core::{NetlinkHeader, NetlinkMessage};
    use netlink_packet_route::{
        address::AddressMessage,
        link::{LinkAttribute, LinkMessage},
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
    fn link_messages_are_changes_and_other_messages_are_not() {
        let both = datagram(vec![
            RouteNetlinkMessage::NewLink(link("pod0")),
            RouteNetlinkMessage::NewAddress(AddressMessage::default()),
            RouteNetlinkMessage::DelLink(link("pod1")),
        ]);
        assert_eq!(parse(&both), Found::Changed(2));
        let other = datagram(vec![RouteNetlinkMessage::NewAddress(
            AddressMessage::default(),
        )]);
        assert_eq!(parse(&other), Found::Nothing);
        assert_eq!(parse(&[]), Found::Nothing);
        assert_eq!(parse(&[1, 2, 3]), Found::Changed(1), "unreadable: a change");
    }
}
