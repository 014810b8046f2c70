//! Hook S: census's programs on the root cgroup (cgroup v2), where every socket
//! of the node sends and receives.
//!
//! - `census_sockets`, on its egress, counts what only the node's own sockets
//!   send: packets from one of the node's addresses to a pod, here or on
//!   another node, as (host, pod), after netfilter (a node's request through a
//!   Service is seen translated), and a host-network backend's replies to this
//!   node's pods. Every socket's packets pass it, a pod's too (its cgroup is a
//!   descendant of the root): those are skipped, counted where they leave
//!   their pod.
//! - `census_sockets_ingress`, on its ingress, counts the Service requests a
//!   pod sent that are delivered to one of the node's own sockets (a
//!   host-network backend on this node), which no TC hook sees.
//!
//! Each link is pinned under `links/` as `sockets` and `sockets:ingress`
//! (bpffs refuses a `.` in a name): an interface's link is named
//! `<interface>-<direction>`, which neither parses as. Each is adopted across
//! restarts: its program is replaced in place (`BPF_LINK_UPDATE`), so the hook
//! is never without census's program and never runs two. A cgroup link runs
//! beside whatever else is attached to the root cgroup (systemd's programs, as
//! with `BPF_F_ALLOW_MULTI`), and the programs always let the packet go.

use std::{
    fs::File,
    os::{fd::AsFd as _, unix::fs::MetadataExt as _},
    path::{Path, PathBuf},
};

use aya::programs::{CgroupAttachMode, CgroupSkb, CgroupSkbAttachType, links::FdLink};
use census_common::{PROGRAM_SOCKETS, PROGRAM_SOCKETS_INGRESS};

use super::{AttachOutcome, Datapath, Error, pins, privileges, sys};

/// The two hooks of the root cgroup census counts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SocketHook {
    /// What the node's sockets send.
    Egress,
    /// What the node's sockets receive.
    Ingress,
}

impl SocketHook {
    pub(super) const BOTH: [Self; 2] = [Self::Egress, Self::Ingress];

    pub(super) const fn program(self) -> &'static str {
        match self {
            Self::Egress => PROGRAM_SOCKETS,
            Self::Ingress => PROGRAM_SOCKETS_INGRESS,
        }
    }

    /// The pin of the hook's link, under `links/`.
    const fn link(self) -> &'static str {
        match self {
            Self::Egress => "sockets",
            Self::Ingress => "sockets:ingress",
        }
    }

    const fn attach_type(self) -> CgroupSkbAttachType {
        match self {
            Self::Egress => CgroupSkbAttachType::Egress,
            Self::Ingress => CgroupSkbAttachType::Ingress,
        }
    }
}

/// Where a node mounts its cgroup v2 hierarchy: alone (the unified layout of
/// every current distribution), or beside the v1 controllers (the hybrid layout
/// of older systemd).
const CGROUP2_MOUNTS: [&str; 2] = ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"];

/// The root of this node's cgroup v2 hierarchy, where it is usually mounted
/// (`/sys/fs/cgroup`, or `/sys/fs/cgroup/unified` in the hybrid layout);
/// [`Error::NoCgroup2`] if neither is one.
pub fn find_cgroup2_root() -> Result<PathBuf, Error> {
    for mount in CGROUP2_MOUNTS {
        let path = Path::new(mount);
        if path.exists() && privileges::is_cgroup2(path)? {
            return Ok(path.to_owned());
        }
    }
    Err(Error::NoCgroup2 {
        looked_in: CGROUP2_MOUNTS.join(", "),
    })
}

impl Datapath {
    /// Attaches census's socket programs to the egress and the ingress of cgroup
    /// `cgroup` (the root of the node's cgroup v2 hierarchy), adopting census's
    /// pinned links there. A pinned link on another cgroup is replaced.
    /// [`AttachOutcome::Adopted`] only if both links were.
    pub fn attach_sockets(&mut self, cgroup: &Path) -> Result<AttachOutcome, Error> {
        if !privileges::is_cgroup2(cgroup)? {
            return Err(Error::NotCgroup2 {
                path: cgroup.to_owned(),
            });
        }
        let io_error = |operation, source| Error::Io {
            operation,
            path: cgroup.to_owned(),
            source,
        };
        let directory = File::open(cgroup).map_err(|e| io_error("opening the cgroup", e))?;
        // On cgroup v2, a cgroup's id is its directory's inode number.
        let cgroup_id = directory
            .metadata()
            .map_err(|e| io_error("reading the cgroup", e))?
            .ino();
        let mut outcomes = [AttachOutcome::Adopted; 2];
        for (hook, outcome) in SocketHook::BOTH.into_iter().zip(&mut outcomes) {
            *outcome = self.attach_socket_hook(hook, cgroup, &directory, cgroup_id)?;
        }
        Ok(match outcomes {
            [AttachOutcome::Adopted, AttachOutcome::Adopted] => AttachOutcome::Adopted,
            [AttachOutcome::ReplacedStale, _] | [_, AttachOutcome::ReplacedStale] => {
                AttachOutcome::ReplacedStale
            }
            _ => AttachOutcome::Attached,
        })
    }

    fn attach_socket_hook(
        &mut self,
        hook: SocketHook,
        cgroup: &Path,
        directory: &File,
        cgroup_id: u64,
    ) -> Result<AttachOutcome, Error> {
        let path = self.socket_link(hook);
        let mut outcome = AttachOutcome::Attached;
        if path.exists() {
            let (link, info) = pins::open_link(&path, &[sys::BPF_LINK_TYPE_CGROUP])?;
            if info.cgroup_id() == cgroup_id {
                let program = socket_program(&mut self.ebpf, hook)?;
                let program_fd = program.fd().map_err(|e| program_error(hook, e))?;
                sys::link_update(link.as_fd(), program_fd.as_fd()).map_err(|source| {
                    Error::Link {
                        operation: "replacing the program of",
                        path: path.clone(),
                        source,
                    }
                })?;
                return Ok(AttachOutcome::Adopted);
            }
            tracing::info!(
                cgroup = %cgroup.display(),
                program = hook.program(),
                "census's socket program is pinned on another cgroup: attaching it here"
            );
            pins::detach_and_unpin(&path)?;
            outcome = AttachOutcome::ReplacedStale;
        }
        let program = socket_program(&mut self.ebpf, hook)?;
        let link_id = program
            .attach(
                directory,
                hook.attach_type(),
                // A link takes no flags: it is always one of many on its cgroup.
                CgroupAttachMode::Single,
            )
            .map_err(|source| Error::AttachCgroup {
                cgroup: cgroup.to_owned(),
                source,
            })?;
        let link = program
            .take_link(link_id)
            .map_err(|e| program_error(hook, e))?;
        // Linux 5.7+ (census needs 5.15) makes cgroup attachments bpf links.
        let link = FdLink::try_from(link).map_err(|source| Error::CgroupLinkHandle {
            path: path.clone(),
            source,
        })?;
        link.pin(&path).map_err(|source| Error::PinCgroupLink {
            path: path.clone(),
            source,
        })?;
        Ok(outcome)
    }

    /// Detaches census's socket programs and removes their pins; `false` if
    /// neither was attached.
    pub fn detach_sockets(&mut self) -> Result<bool, Error> {
        let mut detached = false;
        for hook in SocketHook::BOTH {
            let path = self.socket_link(hook);
            if path.exists() {
                pins::detach_and_unpin(&path)?;
                detached = true;
            }
        }
        Ok(detached)
    }

    /// Whether both socket programs are attached (their links pinned and live).
    pub fn sockets_attached(&self) -> Result<bool, Error> {
        for hook in SocketHook::BOTH {
            let path = self.socket_link(hook);
            if !path.exists() {
                return Ok(false);
            }
            let (_, info) = pins::open_link(&path, &[sys::BPF_LINK_TYPE_CGROUP])?;
            // A detached cgroup link reads cgroup id 0.
            if info.cgroup_id() == 0 {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn socket_link(&self, hook: SocketHook) -> PathBuf {
        self.pins.links_dir().join(hook.link())
    }
}

/// The program of `hook` in the loaded object (the loader loads it through
/// this too).
pub(super) fn socket_program(
    ebpf: &mut aya::Ebpf,
    hook: SocketHook,
) -> Result<&mut CgroupSkb, Error> {
    let name = hook.program();
    ebpf.program_mut(name)
        .ok_or(Error::MissingFromObject {
            kind: "program",
            name,
        })?
        .try_into()
        .map_err(|e| program_error(hook, e))
}

fn program_error(hook: SocketHook, source: aya::programs::ProgramError) -> Error {
    Error::Program {
        program: hook.program(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_interface_link_has_a_socket_link_name() {
        for hook in SocketHook::BOTH {
            assert_eq!(pins::parse_link_name(hook.link()), None, "{hook:?}");
        }
        // An interface named `sockets` has links of its own, distinct.
        assert_ne!(
            pins::Pins::new(Path::new("/census"))
                .link("sockets", super::super::Direction::Ingress)
                .file_name()
                .and_then(|name| name.to_str()),
            Some(SocketHook::Ingress.link())
        );
    }
}
