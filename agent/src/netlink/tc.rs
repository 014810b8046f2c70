//! The TC requests attaching with TC filters needs and aya 0.14 does not expose:
//! the filters on a clsact hook (to order census's before them, and to find
//! census's own), and deleting one filter.

use netlink_packet_core::{NLM_F_ACK, NLM_F_DUMP};
use netlink_packet_route::{
    RouteNetlinkMessage,
    tc::{TcAttribute, TcFilterBpfOption, TcHandle, TcMessage, TcOption},
};

use super::{Error, Request, exchange, index};

/// A clsact hook.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hook {
    Ingress,
    Egress,
}

impl Hook {
    /// The clsact parent of the hook (`ffff:fff2` ingress, `ffff:fff3` egress).
    const fn parent(self) -> TcHandle {
        TcHandle {
            major: 0xFFFF,
            minor: match self {
                Self::Ingress => TcHandle::MIN_INGRESS,
                Self::Egress => TcHandle::MIN_EGRESS,
            },
        }
    }
}

/// One TC filter on a clsact hook, as the kernel lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Filter {
    pub(crate) priority: u16,
    pub(crate) handle: u32,
    /// `bpf`, `u32`, `flower`, ...
    pub(crate) kind: String,
    /// A `bpf` filter's program name (the kernel's, at most 15 bytes).
    pub(crate) program: Option<String>,
    pub(crate) program_id: Option<u32>,
}

impl Filter {
    /// The filter a listed message describes; `None` for a priority's classifier
    /// itself (handle 0), which is not a filter.
    fn of(message: TcMessage) -> Option<Self> {
        if u32::from(message.header.handle) == 0 {
            return None;
        }
        let mut filter = Self {
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
        Some(filter)
    }
}

/// The filters on `hook` of interface `ifindex`, by priority and handle; none
/// when the interface has no clsact qdisc.
pub(crate) fn filters(ifindex: u32, hook: Hook) -> Result<Vec<Filter>, Error> {
    let mut request = TcMessage::with_index(index(ifindex)?);
    request.header.parent = hook.parent();
    let answers = match exchange(Request {
        name: "RTM_GETTFILTER",
        message: RouteNetlinkMessage::GetTrafficFilter(request),
        flags: NLM_F_DUMP,
    }) {
        Ok(answers) => answers,
        // No clsact (no hook to dump): no filters.
        Err(error) if error.errno() == Some(libc::EINVAL) => return Ok(Vec::new()),
        Err(error) => return Err(error),
    };
    let mut filters: Vec<Filter> = answers
        .into_iter()
        .filter_map(|answer| match answer {
            RouteNetlinkMessage::NewTrafficFilter(message) => Filter::of(message),
            _ => None,
        })
        .collect();
    filters.sort_by_key(|f| (f.priority, f.handle));
    Ok(filters)
}

/// The request deleting the `bpf` filter at `priority`/`handle` of `hook`.
fn delete_request(ifindex: i32, hook: Hook, priority: u16, handle: u32) -> TcMessage {
    let mut request = TcMessage::with_index(ifindex);
    request.header.parent = hook.parent();
    request.header.handle = handle.into();
    // Protocol 0: any (the kernel matches the priority and handle).
    request.header.info = u32::from(priority) << 16;
    request.attributes.push(TcAttribute::Kind("bpf".to_owned()));
    request
}

/// Deletes the filter at `priority`/`handle` of `hook` of `ifindex`. A filter (or
/// interface) already gone is not an error.
pub(crate) fn delete_filter(
    ifindex: u32,
    hook: Hook,
    priority: u16,
    handle: u32,
) -> Result<(), Error> {
    let request = delete_request(index(ifindex)?, hook, priority, handle);
    match exchange(Request {
        name: "RTM_DELTFILTER",
        message: RouteNetlinkMessage::DelTrafficFilter(request),
        flags: NLM_F_ACK,
    }) {
        Err(error)
            if matches!(
                error.errno(),
                Some(libc::ENOENT | libc::ENODEV | libc::EINVAL)
            ) =>
        {
            Ok(())
        }
        other => other.map(drop),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_delete_names_the_hook_priority_and_handle_of_a_bpf_filter() {
        let request = delete_request(7, Hook::Egress, 3, 0x10);
        assert_eq!(request.header.index, 7);
        assert_eq!(
            request.header.parent,
            TcHandle {
                major: 0xFFFF,
                minor: TcHandle::MIN_EGRESS
            }
        );
        assert_eq!(u32::from(request.header.handle), 0x10);
        assert_eq!(request.header.info, 3 << 16);
        assert_eq!(
            request.attributes,
            vec![TcAttribute::Kind("bpf".to_owned())]
        );
        assert_eq!(
            Hook::Ingress.parent(),
            TcHandle {
                major: 0xFFFF,
                minor: TcHandle::MIN_INGRESS
            }
        );
    }

    #[test]
    fn a_listed_filter_is_read_and_a_classifier_is_not_one() {
        let mut message = TcMessage::with_index(7);
        message.header.handle = 0x10.into();
        message.header.info = (1 << 16) | 0x0300;
        message.attributes.push(TcAttribute::Kind("bpf".to_owned()));
        message.attributes.push(TcAttribute::Options(vec![
            TcOption::Bpf(TcFilterBpfOption::ProgName("census_ingress".to_owned())),
            TcOption::Bpf(TcFilterBpfOption::ProgId(42)),
        ]));
        assert_eq!(
            Filter::of(message.clone()),
            Some(Filter {
                priority: 1,
                handle: 0x10,
                kind: "bpf".to_owned(),
                program: Some("census_ingress".to_owned()),
                program_id: Some(42),
            })
        );
        message.header.handle = 0.into();
        assert_eq!(Filter::of(message), None);
    }
}
