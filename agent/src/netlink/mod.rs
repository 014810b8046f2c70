//! rtnetlink, once for the whole agent: the socket, the framing of a request, the
//! reading of its answers (a truncated datagram is an error, never a short read),
//! and the typed requests the pod source and the datapath make: a route lookup
//! ([`route`]), interfaces and their kinds, which decide what a pod's own device is
//! ([`link`]), an interface's addresses ([`address`]) and the TC filters of a
//! clsact hook ([`tc`]). The link-event subscription (`crate::links`) reads its
//! datagrams with [`messages`].
//!
//! Netlink directly, through the rust-netlink crates (`netlink-sys` for the
//! socket, `netlink-packet-route` for the typed messages), rather than running
//! `ip`: no process per request, no dependence on iproute2 being in the agent's
//! image, typed attributes instead of parsed text. Sockets are synchronous and
//! opened per request in the calling thread's network namespace: the kernel
//! answers at once, a request takes microseconds, and a socket opened at the time
//! of the call is never in a stale namespace.

pub(crate) mod address;
pub(crate) mod link;
pub(crate) mod route;
pub(crate) mod tc;

use std::io;

use netlink_packet_core::{
    DecodeError, NLM_F_DUMP, NLM_F_REQUEST, NetlinkDeserializable, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

/// The receive buffer of a request's answers: a datagram of a dump holds at most
/// what the kernel fits in 32 KiB (`NLMSG_GOODSIZE` and its dump growth stop there),
/// and any one route, link or filter message fits, a link's statistics included.
pub(crate) const RECEIVE_BUFFER: usize = 32 * 1024;

/// Why a netlink request has no answer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("netlink socket: {0}")]
    Socket(#[source] io::Error),
    #[error("netlink: the kernel refused {request}: {source}")]
    Refused {
        request: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("netlink: the kernel's answer to {request} cannot be read: {source}")]
    Decode {
        request: &'static str,
        #[source]
        source: DecodeError,
    },
    #[error(
        "netlink: an answer to {request} of {size} bytes does not fit the {RECEIVE_BUFFER}-byte buffer"
    )]
    Truncated { request: &'static str, size: usize },
    #[error("netlink: unexpected answer to {request}")]
    Unexpected { request: &'static str },
}

impl Error {
    /// The errno of a refused request (or a failed socket call).
    pub fn errno(&self) -> Option<i32> {
        match self {
            Self::Refused { source, .. } | Self::Socket(source) => source.raw_os_error(),
            _ => None,
        }
    }
}

/// One request: its message, its flags beyond `NLM_F_REQUEST` and its name for
/// errors (`RTM_GETROUTE`, ...).
pub(crate) struct Request {
    pub(crate) name: &'static str,
    pub(crate) message: RouteNetlinkMessage,
    pub(crate) flags: u16,
}

/// `message` framed as a request with `flags` (and `NLM_F_REQUEST`), sequence 1.
pub(crate) fn encode(message: RouteNetlinkMessage, flags: u16) -> Vec<u8> {
    let mut packet = NetlinkMessage::from(message);
    packet.header.flags = NLM_F_REQUEST | flags;
    packet.header.sequence_number = 1;
    packet.finalize();
    let mut bytes = vec![0; packet.buffer_len()];
    packet.serialize(&mut bytes);
    bytes
}

/// The netlink messages of one datagram, in order; an unreadable one ends it with
/// its error. Messages are 4-byte aligned (`NLMSG_ALIGN`).
pub(crate) fn messages<T: NetlinkDeserializable>(
    mut bytes: &[u8],
) -> impl Iterator<Item = Result<NetlinkMessage<T>, DecodeError>> + '_ {
    std::iter::from_fn(move || {
        if bytes.is_empty() {
            return None;
        }
        let message = match NetlinkMessage::<T>::deserialize(bytes) {
            Ok(message) => message,
            Err(error) => {
                bytes = &[];
                return Some(Err(error));
            }
        };
        let length = message.header.length as usize;
        if length == 0 || length > bytes.len() {
            bytes = &[];
            return Some(Err(DecodeError::from(format!(
                "a message of {length} bytes in {} left",
                bytes.len()
            ))));
        }
        bytes = bytes.get(length.next_multiple_of(4)..).unwrap_or_default();
        Some(Ok(message))
    })
}

/// What the answers to a request came to so far.
#[derive(Debug)]
enum Read {
    /// More datagrams follow (a dump not yet done).
    More,
    /// The request is answered.
    Done,
}

/// Takes the answers of one datagram into `answers`: a dump's messages until its
/// `NLMSG_DONE`; one message, or the acknowledgement, otherwise.
fn take(
    request: &'static str,
    datagram: &[u8],
    dump: bool,
    answers: &mut Vec<RouteNetlinkMessage>,
) -> Result<Read, Error> {
    for message in messages::<RouteNetlinkMessage>(datagram) {
        let message = message.map_err(|source| Error::Decode { request, source })?;
        match message.payload {
            NetlinkPayload::InnerMessage(inner) => {
                answers.push(inner);
                if !dump {
                    return Ok(Read::Done);
                }
            }
            NetlinkPayload::Error(error) => {
                return match error.code {
                    Some(_) => Err(Error::Refused {
                        request,
                        source: error.to_io(),
                    }),
                    // An acknowledgement.
                    None => Ok(Read::Done),
                };
            }
            NetlinkPayload::Done(_) => return Ok(Read::Done),
            _ => {}
        }
    }
    Ok(Read::More)
}

fn open() -> Result<Socket, Error> {
    let mut socket = Socket::new(NETLINK_ROUTE).map_err(Error::Socket)?;
    socket.bind_auto().map_err(Error::Socket)?;
    socket
        .connect(&SocketAddr::new(0, 0))
        .map_err(Error::Socket)?;
    Ok(socket)
}

/// Sends `request` on a new socket of the calling thread's network namespace and
/// collects its answers: every message of a dump (`NLM_F_DUMP`), else the one
/// answer (none for an acknowledged `NLM_F_ACK`). An error answer is the request's
/// [`Error::Refused`].
pub(crate) fn exchange(request: Request) -> Result<Vec<RouteNetlinkMessage>, Error> {
    let Request {
        name,
        message,
        flags,
    } = request;
    let socket = open()?;
    socket
        .send(&encode(message, flags), 0)
        .map_err(Error::Socket)?;
    let dump = flags & NLM_F_DUMP == NLM_F_DUMP;
    let mut answers = Vec::new();
    let mut buffer = Vec::with_capacity(RECEIVE_BUFFER);
    loop {
        buffer.clear();
        // MSG_TRUNC: the datagram's real size, so a cut one is seen.
        let size = socket
            .recv(&mut buffer, libc::MSG_TRUNC)
            .map_err(Error::Socket)?;
        if size > buffer.len() {
            return Err(Error::Truncated {
                request: name,
                size,
            });
        }
        if let Read::Done = take(name, &buffer, dump, &mut answers)? {
            return Ok(answers);
        }
    }
}

/// The one answer to `request`.
pub(crate) fn ask(request: Request) -> Result<RouteNetlinkMessage, Error> {
    let name = request.name;
    exchange(request)?
        .into_iter()
        .next()
        .ok_or(Error::Unexpected { request: name })
}

/// An interface index as the TC and link headers take it.
fn index(ifindex: u32) -> Result<i32, Error> {
    i32::try_from(ifindex).map_err(|_| {
        Error::Socket(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("interface index {ifindex} is out of range"),
        ))
    })
}

#[cfg(test)]
mod tests {
    use netlink_packet_core::{ErrorMessage, NLM_F_ACK, NLM_F_MULTIPART, NetlinkHeader};
    use netlink_packet_route::link::{LinkAttribute, LinkMessage};

    use super::*;

    fn framed(payload: NetlinkPayload<RouteNetlinkMessage>, flags: u16) -> Vec<u8> {
        let mut packet = NetlinkMessage::new(NetlinkHeader::default(), payload);
        packet.header.flags = flags;
        packet.finalize();
        let mut bytes = vec![0; packet.buffer_len()];
        packet.serialize(&mut bytes);
        bytes
    }

    fn link(index: u32, name: &str) -> RouteNetlinkMessage {
        let mut link = LinkMessage::default();
        link.header.index = index;
        link.attributes.push(LinkAttribute::IfName(name.to_owned()));
        RouteNetlinkMessage::NewLink(link)
    }

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    #[test]
    fn a_request_is_framed_with_its_flags_and_sequence() -> TestResult {
        let mut request = LinkMessage::default();
        request.header.index = 7;
        let bytes = encode(RouteNetlinkMessage::GetLink(request.clone()), NLM_F_DUMP);
        // nlmsghdr: length, type RTM_GETLINK (18), flags, sequence 1, port 0.
        assert_eq!(
            u32::from_ne_bytes(bytes[0..4].try_into()?) as usize,
            bytes.len()
        );
        assert_eq!(u16::from_ne_bytes([bytes[4], bytes[5]]), 18);
        assert_eq!(
            u16::from_ne_bytes([bytes[6], bytes[7]]),
            NLM_F_REQUEST | NLM_F_DUMP
        );
        assert_eq!(u32::from_ne_bytes(bytes[8..12].try_into()?), 1);
        let back = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&bytes)?;
        assert_eq!(
            back.payload,
            NetlinkPayload::InnerMessage(RouteNetlinkMessage::GetLink(request))
        );
        Ok(())
    }

    #[test]
    fn a_dump_is_read_across_datagrams_until_done() {
        let mut datagram = framed(NetlinkPayload::InnerMessage(link(1, "lo")), NLM_F_MULTIPART);
        datagram.extend(framed(
            NetlinkPayload::InnerMessage(link(2, "eth0")),
            NLM_F_MULTIPART,
        ));
        let mut answers = Vec::new();
        assert!(matches!(
            take("RTM_GETLINK", &datagram, true, &mut answers),
            Ok(Read::More)
        ));
        let done = framed(
            NetlinkPayload::Done(netlink_packet_core::DoneMessage::default()),
            NLM_F_MULTIPART,
        );
        assert!(matches!(
            take("RTM_GETLINK", &done, true, &mut answers),
            Ok(Read::Done)
        ));
        assert_eq!(answers, vec![link(1, "lo"), link(2, "eth0")]);
        // Not a dump: the first message answers.
        let mut one = Vec::new();
        assert!(matches!(
            take("RTM_GETLINK", &datagram, false, &mut one),
            Ok(Read::Done)
        ));
        assert_eq!(one, vec![link(1, "lo")]);
    }

    #[test]
    fn an_error_answer_is_the_requests_refusal_and_an_ack_is_done() {
        let mut error = ErrorMessage::default();
        error.code = std::num::NonZeroI32::new(-libc::ENODEV);
        let refused = framed(NetlinkPayload::Error(error), 0);
        let answer = take("RTM_DELTFILTER", &refused, false, &mut Vec::new());
        let Err(error) = answer else {
            panic!("expected a refusal, got {answer:?}");
        };
        assert_eq!(error.errno(), Some(libc::ENODEV));
        assert!(error.to_string().contains("RTM_DELTFILTER"), "{error}");
        let ack = framed(NetlinkPayload::Error(ErrorMessage::default()), NLM_F_ACK);
        assert!(matches!(
            take("RTM_DELTFILTER", &ack, false, &mut Vec::new()),
            Ok(Read::Done)
        ));
    }

    #[test]
    fn a_cut_or_garbled_datagram_is_an_error_naming_the_request() {
        let whole = framed(NetlinkPayload::InnerMessage(link(2, "eth0")), 0);
        for cut in [&whole[..whole.len() - 4], &whole[..10]] {
            let answer = take("RTM_GETLINK", cut, false, &mut Vec::new());
            let Err(error @ Error::Decode { .. }) = answer else {
                panic!("expected a decode error, got {answer:?}");
            };
            assert!(error.to_string().contains("RTM_GETLINK"), "{error}");
        }
        // A header claiming zero bytes cannot advance.
        let mut zero = whole;
        zero[0..4].copy_from_slice(&0u32.to_ne_bytes());
        assert!(messages::<RouteNetlinkMessage>(&zero).all(|m| m.is_err()));
    }

    /// Unprivileged: a real dump of the test's own namespace reads whole (loopback
    /// is always there) through the one receive buffer.
    #[test]
    fn a_real_link_dump_answers() -> Result<(), Error> {
        let links = link::links()?;
        assert!(links.iter().any(|l| l.name == "lo"), "{links:?}");
        Ok(())
    }
}
