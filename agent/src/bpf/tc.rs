//! Attaching with a clsact qdisc and TC filters over netlink, where the kernel has
//! no TCX (before 6.6) or `--attach-mode tc` asks for it.
//!
//! A netlink filter is no BPF object and cannot be pinned, so each one census
//! attaches is recorded by an empty directory in `links/` whose name says where
//! it is: `<if>-<direction>:tc:<ifindex>:<priority>:<handle>` (bpffs takes
//! directories, not regular files, and no `.` in a name; no interface name has a
//! `:`). A restarted agent (also after `kill -9`)
//! finds its filter by that record and replaces the program in it (the same
//! priority and handle), rather than adding a second filter; a census filter
//! without a record (the agent killed between attaching and recording) is found
//! by its program's name and adopted too.
//!
//! Order: a classic TC filter that returns a verdict (`TC_ACT_OK`, `SHOT`, ...)
//! ends the hook, so census's filter goes before every filter already there (a
//! lower priority number than the lowest) and returns `TC_ACT_UNSPEC`, which
//! hands the packet on to the next. Other filters are never replaced or deleted.

use std::{
    fs, io,
    path::{Path, PathBuf},
};

use aya::programs::{
    TcAttachType,
    tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcError, TcHandle},
};

use super::{AttachOutcome, Datapath, Direction, Error, pins::detach_and_unpin};
use crate::netlink::{self, tc::Filter};

/// The priority of census's filter on a hook without filters: the first.
const EMPTY_HOOK_PRIORITY: u16 = 1;
/// census's filter handle: its own, so that a filter replaced by another loader at
/// the same priority with handle 1 (what `tc filter replace ... handle 1` does)
/// is never census's.
const HANDLE: u32 = 0xCE45;

const RECORD_MARK: &str = ":tc:";

/// One recorded filter, as found in `links/`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct TcRecord {
    pub(super) interface: String,
    pub(super) direction: Direction,
    pub(super) ifindex: u32,
    pub(super) priority: u16,
    pub(super) handle: u32,
    pub(super) path: PathBuf,
}

impl TcRecord {
    fn name(
        interface: &str,
        direction: Direction,
        ifindex: u32,
        priority: u16,
        handle: u32,
    ) -> String {
        format!("{interface}-{direction}{RECORD_MARK}{ifindex}:{priority}:{handle}")
    }

    /// Reads a record's directory name; `None` if it is not one.
    pub(super) fn parse(dir: &Path, name: &str) -> Option<Self> {
        let (hook, place) = name.rsplit_once(RECORD_MARK)?;
        let mut place = place.split(':');
        let ifindex = place.next()?.parse().ok()?;
        let priority = place.next()?.parse().ok()?;
        let handle = place.next()?.parse().ok()?;
        if place.next().is_some() {
            return None;
        }
        let (interface, direction) = super::pins::parse_link_name(hook)?;
        Some(Self {
            interface: interface.to_owned(),
            direction,
            ifindex,
            priority,
            handle,
            path: dir.join(name),
        })
    }

    /// The census filter this record names, if it is still there.
    pub(super) fn filter(&self) -> Option<Filter> {
        census_filter_at(self.ifindex, self.direction, self.priority, self.handle)
    }

    /// Deletes the filter (if it is still census's) and the record.
    pub(super) fn remove(&self) -> Result<(), Error> {
        if self.filter().is_some() {
            netlink::tc::delete_filter(
                self.ifindex,
                self.direction.hook(),
                self.priority,
                self.handle,
            )
            .map_err(|source| Error::Netlink {
                operation: "deleting census's TC filter",
                interface: self.interface.clone(),
                source,
            })?;
        }
        remove_record(&self.path)
    }
}

fn census_filter_at(
    ifindex: u32,
    direction: Direction,
    priority: u16,
    handle: u32,
) -> Option<Filter> {
    netlink::tc::filters(ifindex, direction.hook())
        .ok()?
        .into_iter()
        .find(|f| f.priority == priority && f.handle == handle && is_census(f, direction))
}

fn is_census(filter: &Filter, direction: Direction) -> bool {
    filter.kind == "bpf" && filter.program.as_deref() == Some(direction.program())
}

fn remove_record(path: &Path) -> Result<(), Error> {
    match fs::remove_dir(path) {
        Err(error) if error.kind() != io::ErrorKind::NotFound => Err(Error::Io {
            operation: "removing TC filter record",
            path: path.to_owned(),
            source: error,
        }),
        _ => Ok(()),
    }
}

/// The recorded filters in `links`.
pub(super) fn records(links: &Path) -> Result<Vec<TcRecord>, Error> {
    let io_error = |source| Error::Io {
        operation: "reading directory",
        path: links.to_owned(),
        source,
    };
    let mut found = Vec::new();
    for entry in fs::read_dir(links).map_err(io_error)? {
        let entry = entry.map_err(io_error)?;
        if let Some(record) = entry
            .file_name()
            .to_str()
            .and_then(|n| TcRecord::parse(links, n))
        {
            found.push(record);
        }
    }
    found.sort_by(|a, b| (&a.interface, a.direction).cmp(&(&b.interface, b.direction)));
    Ok(found)
}

/// The priority census's filter takes on a hook holding `filters`: before all of them.
fn priority_before(
    interface: &str,
    direction: Direction,
    filters: &[Filter],
) -> Result<u16, Error> {
    match filters.iter().map(|f| f.priority).min() {
        None => Ok(EMPTY_HOOK_PRIORITY),
        Some(1) => Err(Error::NoRoomInFront {
            interface: interface.to_owned(),
            direction,
        }),
        Some(lowest) => Ok(lowest - 1),
    }
}

impl Datapath {
    pub(super) fn attach_tc(
        &mut self,
        interface: &str,
        ifindex: u32,
        direction: Direction,
    ) -> Result<AttachOutcome, Error> {
        let mut outcome = AttachOutcome::Attached;
        // A TCX link of an agent that ran in the other mode: one census program per hook.
        let tcx_pin = self.pins.link(interface, direction);
        if tcx_pin.exists() {
            detach_and_unpin(&tcx_pin)?;
            outcome = AttachOutcome::ReplacedStale;
        }
        let netlink_error = |operation| {
            move |source| Error::Netlink {
                operation,
                interface: interface.to_owned(),
                source,
            }
        };
        let links = self.pins.links_dir();
        for record in records(&links)? {
            if record.interface != interface || record.direction != direction {
                continue;
            }
            if record.ifindex == ifindex && record.filter().is_some() {
                self.replace_tc_program(interface, direction, record.priority, record.handle)?;
                return Ok(AttachOutcome::Adopted);
            }
            tracing::info!(interface, %direction, record = %record.path.display(), "replacing a stale census TC filter record");
            record.remove()?;
            outcome = AttachOutcome::ReplacedStale;
        }

        let filters = netlink::tc::filters(ifindex, direction.hook())
            .map_err(netlink_error("listing the TC filters"))?;
        if let Some(orphan) = filters.iter().find(|f| is_census(f, direction)) {
            // Attached by an agent that died before recording it.
            self.record(
                interface,
                direction,
                ifindex,
                orphan.priority,
                orphan.handle,
            )?;
            self.replace_tc_program(interface, direction, orphan.priority, orphan.handle)?;
            return Ok(AttachOutcome::Adopted);
        }
        let priority = priority_before(interface, direction, &filters)?;
        match tc::qdisc_add_clsact(interface) {
            Ok(()) => {}
            Err(TcError::NetlinkError(error)) if error.raw_os_error() == Some(libc::EEXIST) => {}
            Err(error) => {
                return Err(Error::Attach {
                    interface: interface.to_owned(),
                    direction,
                    source: error.into(),
                });
            }
        }
        // Recorded first: an agent killed right after attaching finds the record.
        self.record(interface, direction, ifindex, priority, HANDLE)?;
        let attach_error = |source| Error::Attach {
            interface: interface.to_owned(),
            direction,
            source,
        };
        let program = self.program_mut(direction)?;
        let attached = program
            .attach_with_options(
                interface,
                tc_attach_type(direction),
                TcAttachOptions::Netlink(NlOptions {
                    priority,
                    handle: TcHandle::from(HANDLE),
                    classid: None,
                }),
            )
            .and_then(|id| program.take_link(id));
        match attached {
            Ok(link) => {
                keep_attached(link);
                Ok(outcome)
            }
            Err(error) => {
                let path = links.join(TcRecord::name(
                    interface, direction, ifindex, priority, HANDLE,
                ));
                remove_record(&path)?;
                Err(attach_error(error))
            }
        }
    }

    fn record(
        &self,
        interface: &str,
        direction: Direction,
        ifindex: u32,
        priority: u16,
        handle: u32,
    ) -> Result<(), Error> {
        let path = self.pins.links_dir().join(TcRecord::name(
            interface, direction, ifindex, priority, handle,
        ));
        match fs::create_dir(&path) {
            Err(error) if error.kind() != io::ErrorKind::AlreadyExists => Err(Error::Io {
                operation: "recording census's TC filter at",
                path,
                source: error,
            }),
            _ => Ok(()),
        }
    }

    /// Makes census's filter at `priority`/`handle` run this agent's program: the
    /// kernel replaces the filter's program in place.
    fn replace_tc_program(
        &mut self,
        interface: &str,
        direction: Direction,
        priority: u16,
        handle: u32,
    ) -> Result<(), Error> {
        let attach_error = |source| Error::Attach {
            interface: interface.to_owned(),
            direction,
            source,
        };
        let link = SchedClassifierLink::attached(
            interface,
            tc_attach_type(direction),
            priority,
            TcHandle::from(handle),
            None,
        )
        .map_err(|source| Error::Netlink {
            operation: "finding census's TC filter",
            interface: interface.to_owned(),
            source: netlink::Error::Refused {
                request: "RTM_GETTFILTER",
                source,
            },
        })?;
        let program = self.program_mut(direction)?;
        let link = program
            .attach_to_link(link)
            .and_then(|id| program.take_link(id))
            .map_err(attach_error)?;
        keep_attached(link);
        Ok(())
    }

    /// Removes census's filters and their records on `interface`; whether there was one.
    pub(super) fn detach_tc(&mut self, interface: &str) -> Result<bool, Error> {
        let mut detached = false;
        for record in records(&self.pins.links_dir())? {
            if record.interface == interface && record.direction.is_endpoint_hook() {
                record.remove()?;
                detached = true;
            }
        }
        Ok(detached)
    }
}

/// A netlink "link" is only the filter's address: dropping aya's handle would
/// delete the filter, and nothing else is held (no descriptor, no memory).
fn keep_attached(link: SchedClassifierLink) {
    std::mem::forget(link);
}

pub(super) const fn tc_attach_type(direction: Direction) -> TcAttachType {
    direction.attach_type()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        let dir = Path::new("/sys/fs/bpf/census/links");
        let name = TcRecord::name("lxc-a.tc-1", Direction::Egress, 42, 7, HANDLE);
        let Some(record) = TcRecord::parse(dir, &name) else {
            panic!("{name} is not read back");
        };
        assert_eq!(record.interface, "lxc-a.tc-1");
        assert_eq!(record.direction, Direction::Egress);
        assert_eq!(
            (record.ifindex, record.priority, record.handle),
            (42, 7, HANDLE)
        );
        for other in [
            "pod0-ingress",
            "pod0-ingress:tc:1:2",
            "pod0-sideways:tc:1:2:3",
            "pod0-ingress:tc:1:2:3:4",
        ] {
            assert_eq!(TcRecord::parse(dir, other), None, "{other}");
        }
    }

    fn filter(priority: u16) -> Filter {
        Filter {
            priority,
            handle: 1,
            kind: "bpf".to_owned(),
            program: Some("cni".to_owned()),
            program_id: Some(9),
        }
    }

    #[test]
    fn census_goes_before_every_filter() {
        let before = |filters: &[Filter]| priority_before("pod0", Direction::Ingress, filters);
        assert_eq!(before(&[]).ok(), Some(EMPTY_HOOK_PRIORITY));
        assert_eq!(before(&[filter(49152), filter(20)]).ok(), Some(19));
        assert!(matches!(
            before(&[filter(1)]),
            Err(Error::NoRoomInFront { .. })
        ));
    }
}
