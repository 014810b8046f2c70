//! Hook S: `census_sockets` on the egress of the root cgroup (cgroup v2). It
//! counts what only the node's own sockets send: packets from one of the node's
//! addresses to a pod, here or on another node, as (host, pod), after netfilter
//! (a node's request through a Service is seen translated). Every socket's
//! packets pass it, a pod's too (its cgroup is a descendant of the root): those
//! are skipped, counted where they leave their pod.
//!
//! The link is pinned as `links/sockets` (a name no interface's link has), and
//! adopted across restarts: its program is replaced in place
//! (`BPF_LINK_UPDATE`), so the hook is never without census's program and never
//! runs two. A cgroup link runs beside whatever else is attached to the root
//! cgroup (systemd's programs, as with `BPF_F_ALLOW_MULTI`), and the program
//! always lets the packet go.

use std::{
    fs::File,
    os::{fd::AsFd as _, unix::fs::MetadataExt as _},
    path::{Path, PathBuf},
};

use aya::programs::{CgroupAttachMode, CgroupSkb, CgroupSkbAttachType, links::FdLink};
use census_common::PROGRAM_SOCKETS;

use super::{AttachOutcome, Datapath, Error, pins, privileges, sys};

/// The pin of the link, under `links/`.
const SOCKETS_LINK: &str = "sockets";

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
    /// Attaches `census_sockets` to the egress of cgroup `cgroup` (the root of
    /// the node's cgroup v2 hierarchy), adopting census's pinned link there.
    /// A pinned link on another cgroup is replaced.
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
        let path = self.sockets_link();
        let mut outcome = AttachOutcome::Attached;
        if path.exists() {
            let (link, info) = pins::open_link(&path, &[sys::BPF_LINK_TYPE_CGROUP])?;
            if info.cgroup_id() == cgroup_id {
                let program = self.sockets_program()?;
                let program_fd = program.fd().map_err(program_error)?;
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
                "census's socket program is pinned on another cgroup: attaching it here"
            );
            pins::detach_and_unpin(&path)?;
            outcome = AttachOutcome::ReplacedStale;
        }
        let program = self.sockets_program()?;
        let link_id = program
            .attach(
                &directory,
                CgroupSkbAttachType::Egress,
                // A link takes no flags: it is always one of many on its cgroup.
                CgroupAttachMode::Single,
            )
            .map_err(|source| Error::AttachCgroup {
                cgroup: cgroup.to_owned(),
                source,
            })?;
        let link = program.take_link(link_id).map_err(program_error)?;
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

    /// Detaches `census_sockets` and removes its pin; `false` if it was not
    /// attached.
    pub fn detach_sockets(&mut self) -> Result<bool, Error> {
        let path = self.sockets_link();
        if !path.exists() {
            return Ok(false);
        }
        pins::detach_and_unpin(&path)?;
        Ok(true)
    }

    /// Whether `census_sockets` is attached (its link pinned and live).
    pub fn sockets_attached(&self) -> Result<bool, Error> {
        let path = self.sockets_link();
        if !path.exists() {
            return Ok(false);
        }
        let (_, info) = pins::open_link(&path, &[sys::BPF_LINK_TYPE_CGROUP])?;
        // A detached cgroup link reads cgroup id 0.
        Ok(info.cgroup_id() != 0)
    }

    fn sockets_link(&self) -> PathBuf {
        self.pins.links_dir().join(SOCKETS_LINK)
    }

    fn sockets_program(&mut self) -> Result<&mut CgroupSkb, Error> {
        sockets_program(&mut self.ebpf)
    }
}

/// `census_sockets` in the loaded object (the loader loads it through this too).
pub(super) fn sockets_program(ebpf: &mut aya::Ebpf) -> Result<&mut CgroupSkb, Error> {
    ebpf.program_mut(PROGRAM_SOCKETS)
        .ok_or(Error::MissingFromObject {
            kind: "program",
            name: PROGRAM_SOCKETS,
        })?
        .try_into()
        .map_err(program_error)
}

fn program_error(source: aya::programs::ProgramError) -> Error {
    Error::Program {
        program: PROGRAM_SOCKETS,
        source,
    }
}
