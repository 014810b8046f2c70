//! Attaching census's programs to interfaces, one per hook, adopted (not
//! duplicated) when the agent restarts: with TCX, one pinned link per hook; with
//! TC filters ([`super::tc`]), one recorded filter per hook.
//!
//! Interface names are resolved in the calling thread's network namespace.

use std::{
    collections::BTreeSet,
    fmt, fs,
    net::IpAddr,
    path::{Path, PathBuf},
};

use aya::programs::{
    LinkOrder, SchedClassifier, TcAttachType,
    links::{FdLink, PinnedLink},
    tc::{SchedClassifierLink, TcAttachOptions},
};
use census_common::{PROGRAM_EGRESS, PROGRAM_INGRESS, PROGRAM_UPLINK};
use nix::net::if_::if_nametoindex;

use super::{
    AttachMode, Datapath, Error, NodeRole,
    pins::{detach_and_unpin, open_tcx_link, parse_link_name},
    sys,
    tc::{self, TcRecord},
};
use crate::netlink;

/// A hook census attaches a program to: the two of an endpoint's host-side
/// interface, and the egress of an uplink or tunnel device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Direction {
    /// Packets the endpoint sends (they arrive on the host side).
    Ingress,
    /// Packets the endpoint receives (they leave through the host side).
    Egress,
    /// Packets leaving the node by an uplink or tunnel device (its egress hook):
    /// marked Service requests, counted once translated.
    Uplink,
}

impl Direction {
    /// The hooks of an endpoint's interface.
    pub const BOTH: [Self; 2] = [Self::Ingress, Self::Egress];

    /// The program that runs on this hook.
    pub const fn program(self) -> &'static str {
        match self {
            Self::Ingress => PROGRAM_INGRESS,
            Self::Egress => PROGRAM_EGRESS,
            Self::Uplink => PROGRAM_UPLINK,
        }
    }

    /// The clsact hook its programs attach to with TC filters.
    pub(super) const fn hook(self) -> netlink::tc::Hook {
        match self {
            Self::Ingress => netlink::tc::Hook::Ingress,
            Self::Egress | Self::Uplink => netlink::tc::Hook::Egress,
        }
    }

    pub(super) const fn attach_type(self) -> TcAttachType {
        match self {
            Self::Ingress => TcAttachType::Ingress,
            Self::Egress | Self::Uplink => TcAttachType::Egress,
        }
    }

    /// `enum bpf_attach_type`'s BPF_TCX_INGRESS / BPF_TCX_EGRESS.
    const fn tcx_attach_type(self) -> u32 {
        match self {
            Self::Ingress => 46,
            Self::Egress | Self::Uplink => 47,
        }
    }

    /// Whether this is a hook of an endpoint's interface.
    pub const fn is_endpoint_hook(self) -> bool {
        matches!(self, Self::Ingress | Self::Egress)
    }
}

impl fmt::Display for Direction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Ingress => "ingress",
            Self::Egress => "egress",
            Self::Uplink => "uplink",
        })
    }
}

/// What [`Datapath::attach`] did on one hook.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachOutcome {
    /// A new link was created and pinned.
    Attached,
    /// The pinned link was already on this interface: it now runs this agent's
    /// program (replaced atomically), and no second program was attached.
    Adopted,
    /// The pinned link belonged to an interface that is gone or was replaced
    /// under the same name: it was removed and a new link attached.
    ReplacedStale,
}

/// What [`Datapath::attach`] did on an interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attached {
    /// The interface's index, which its INTERFACES entry is written under.
    pub ifindex: u32,
    pub ingress: AttachOutcome,
    pub egress: AttachOutcome,
}

/// One pinned link or recorded TC filter, as found in the pin directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attachment {
    pub interface: String,
    pub direction: Direction,
    pub mode: AttachMode,
    /// The link's pin, or the filter's record.
    pub pin: PathBuf,
    /// The TCX link's id; 0 for a TC filter.
    pub link_id: u32,
    /// The program it runs (0: a TC filter that is gone).
    pub program_id: u32,
    pub state: AttachmentState,
}

/// A program that runs before census's on one hook of an interface.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InFront {
    pub direction: Direction,
    /// Its name as the kernel knows it (at most 15 bytes), or the filter's kind.
    pub program: String,
    /// Its program id, 0 for a TC filter of another kind.
    pub program_id: u32,
}

/// Whether a pinned link still runs on the interface its pin is named after.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachmentState {
    /// Attached to the interface of that name, here.
    Attached { ifindex: u32 },
    /// Its interface was deleted: the link is defunct and its pin is stale.
    Defunct,
    /// Attached to an interface that does not have that name in this network
    /// namespace (renamed, or seen from another namespace). Left alone.
    Elsewhere { ifindex: u32 },
}

/// Checks `name` is a valid Linux interface name (as `dev_valid_name` does),
/// which also makes it a safe pin file name.
pub(super) fn check_interface_name(name: &str) -> Result<(), Error> {
    let invalid = |reason| {
        Err(Error::InvalidInterfaceName {
            name: name.to_owned(),
            reason,
        })
    };
    if name.is_empty() {
        return invalid("empty");
    }
    if name.len() > 15 {
        return invalid("longer than 15 bytes");
    }
    if name == "." || name == ".." {
        return invalid("not a name");
    }
    if name
        .chars()
        .any(|c| c == '/' || c == ':' || c == '\0' || c.is_whitespace())
    {
        return invalid("contains '/', ':', NUL or whitespace");
    }
    Ok(())
}

pub(super) fn ifindex(name: &str) -> Result<u32, Error> {
    if_nametoindex(name).map_err(|source| Error::InterfaceNotFound {
        name: name.to_owned(),
        source,
    })
}

impl Datapath {
    /// Attaches census to both hooks of `interface` (the host side of an
    /// endpoint's interface, in this thread's network namespace), ahead of any
    /// other program there: with TCX, each link pinned under `links/`; in TC mode,
    /// a filter before every other, recorded under `links/`.
    ///
    /// Idempotent: a hook whose pinned link (or recorded filter) is already on
    /// this interface is adopted (its program atomically replaced by this
    /// agent's), so exactly one census program runs per hook; one of the other
    /// mode goes.
    ///
    /// Only an endpoint's own device is accepted: a veth or netkit with an
    /// Ethernet link type ([`Error::UnsupportedInterface`] otherwise), and not
    /// one of the node's ([`Error::NodeInterface`]: a device a default route
    /// leaves by, or holding one of the node's addresses).
    ///
    /// The interface's INTERFACES entry ([`Datapath::set_interface`]) is the
    /// caller's to write, once this has returned.
    pub fn attach(&mut self, interface: &str) -> Result<Attached, Error> {
        check_interface_name(interface)?;
        let ifindex = ifindex(interface)?;
        check_endpoint_device(interface, ifindex)?;
        check_not_the_nodes(interface, ifindex, &self.node_addresses)?;
        let (ingress, egress) = match self.mode {
            AttachMode::Tcx => (
                self.attach_one(interface, ifindex, Direction::Ingress)?,
                self.attach_one(interface, ifindex, Direction::Egress)?,
            ),
            AttachMode::Tc => (
                self.attach_tc(interface, ifindex, Direction::Ingress)?,
                self.attach_tc(interface, ifindex, Direction::Egress)?,
            ),
        };
        Ok(Attached {
            ifindex,
            ingress,
            egress,
        })
    }

    pub(super) fn attach_one(
        &mut self,
        interface: &str,
        ifindex: u32,
        direction: Direction,
    ) -> Result<AttachOutcome, Error> {
        let path = self.pins.link(interface, direction);
        let mut outcome = AttachOutcome::Attached;
        // A filter of an agent that ran in TC mode: one census program per hook.
        for record in tc::records(&self.pins.links_dir())? {
            if record.interface == interface && record.direction == direction {
                record.remove()?;
                outcome = AttachOutcome::ReplacedStale;
            }
        }
        if path.exists() {
            let info = pinned_link_info(&path)?;
            if info.tcx_ifindex == ifindex && info.tcx_attach_type == direction.tcx_attach_type() {
                self.adopt(interface, &path, direction)?;
                return Ok(AttachOutcome::Adopted);
            }
            tracing::info!(
                interface,
                %direction,
                pinned_ifindex = info.tcx_ifindex,
                ifindex,
                "replacing a stale census link"
            );
            detach_and_unpin(&path)?;
            outcome = AttachOutcome::ReplacedStale;
        }

        let attach_error = |source| Error::Attach {
            interface: interface.to_owned(),
            direction,
            source,
        };
        let program = self.program_mut(direction)?;
        let link_id = program
            .attach_with_options(
                interface,
                direction.attach_type(),
                TcAttachOptions::TcxOrder(LinkOrder::first()),
            )
            .map_err(attach_error)?;
        let link = program.take_link(link_id).map_err(attach_error)?;
        let link = FdLink::try_from(link).map_err(|source| Error::LinkHandle {
            interface: interface.to_owned(),
            direction,
            path: path.clone(),
            source,
        })?;
        // Dropping the pinned link closes our descriptor; the pin keeps it attached.
        link.pin(&path).map_err(|source| Error::PinLink {
            interface: interface.to_owned(),
            direction,
            path: path.clone(),
            source,
        })?;
        Ok(outcome)
    }

    /// Makes the link pinned at `path` run this agent's program.
    fn adopt(&mut self, interface: &str, path: &Path, direction: Direction) -> Result<(), Error> {
        let link_error = |source| Error::LinkHandle {
            interface: interface.to_owned(),
            direction,
            path: path.to_owned(),
            source,
        };
        let pinned = PinnedLink::from_pin(path).map_err(link_error)?;
        let link = SchedClassifierLink::try_from(FdLink::from(pinned)).map_err(link_error)?;
        let program_error = |source| Error::Program {
            program: direction.program(),
            source,
        };
        let program = self.program_mut(direction)?;
        let link_id = program.attach_to_link(link).map_err(program_error)?;
        // Closing our descriptor keeps the link: it is pinned.
        drop(program.take_link(link_id).map_err(program_error)?);
        Ok(())
    }

    pub(super) fn program_mut(
        &mut self,
        direction: Direction,
    ) -> Result<&mut SchedClassifier, Error> {
        let name = direction.program();
        let program = self
            .ebpf
            .program_mut(name)
            .ok_or(Error::MissingFromObject {
                kind: "program",
                name,
            })?;
        program.try_into().map_err(|source| Error::Program {
            program: name,
            source,
        })
    }

    /// Detaches census from both hooks of `interface` and removes their pins;
    /// `false` if it was not attached. Works also when the interface is gone.
    ///
    /// The interface's INTERFACES entry goes first: while it is there, the egress
    /// program takes packets from this interface as counted when they left it.
    pub fn detach(&mut self, interface: &str) -> Result<bool, Error> {
        check_interface_name(interface)?;
        let mut detached = false;
        for direction in Direction::BOTH {
            let path = self.pins.link(interface, direction);
            if path.exists() {
                let ifindex = pinned_link_info(&path)?.tcx_ifindex;
                if ifindex != 0 {
                    self.delete_interface(ifindex)?;
                }
                detach_and_unpin(&path)?;
                detached = true;
            }
        }
        if tc::records(&self.pins.links_dir())?
            .iter()
            .any(|r| r.interface == interface)
        {
            if let Ok(ifindex) = if_nametoindex(interface) {
                self.delete_interface(ifindex)?;
            }
            detached |= self.detach_tc(interface)?;
        }
        Ok(detached)
    }

    /// Every link pinned in the pin directory, with its state as seen from this
    /// thread's network namespace, ordered by interface and direction.
    pub fn attachments(&self) -> Result<Vec<Attachment>, Error> {
        let dir = self.pins.links_dir();
        let io_error = |source| Error::Io {
            operation: "reading directory",
            path: dir.clone(),
            source,
        };
        let mut attachments = Vec::new();
        for entry in fs::read_dir(&dir).map_err(io_error)? {
            let pin = entry.map_err(io_error)?.path();
            let Some((interface, direction)) = pin
                .file_name()
                .and_then(|name| name.to_str())
                .and_then(parse_link_name)
            else {
                continue;
            };
            let info = pinned_link_info(&pin)?;
            let state = match (info.tcx_ifindex, if_nametoindex(interface)) {
                (0, _) => AttachmentState::Defunct,
                (ifindex, Ok(current)) if current == ifindex => {
                    AttachmentState::Attached { ifindex }
                }
                (ifindex, _) => AttachmentState::Elsewhere { ifindex },
            };
            attachments.push(Attachment {
                interface: interface.to_owned(),
                direction,
                mode: AttachMode::Tcx,
                link_id: info.id,
                program_id: info.prog_id,
                state,
                pin,
            });
        }
        for record in tc::records(&dir)? {
            attachments.push(tc_attachment(record));
        }
        attachments.sort_by(|a, b| (&a.interface, a.direction).cmp(&(&b.interface, b.direction)));
        Ok(attachments)
    }

    /// Removes the pins of links whose interface was deleted, and returns them.
    pub fn prune_defunct(&mut self) -> Result<Vec<Attachment>, Error> {
        let mut pruned = Vec::new();
        for attachment in self.attachments()? {
            if attachment.state == AttachmentState::Defunct {
                match attachment.mode {
                    AttachMode::Tcx => detach_and_unpin(&attachment.pin)?,
                    AttachMode::Tc => {
                        if let Some(record) = attachment
                            .pin
                            .file_name()
                            .and_then(|n| n.to_str())
                            .and_then(|n| TcRecord::parse(&self.pins.links_dir(), n))
                        {
                            record.remove()?;
                        }
                    }
                }
                pruned.push(attachment);
            }
        }
        Ok(pruned)
    }
}

impl Datapath {
    /// The programs that run before census's on the hooks of `interface` (none
    /// where census is first): TCX programs ahead of census's link, or TC filters
    /// of a lower priority (or the same priority, listed first).
    pub fn in_front(&self, interface: &str) -> Result<Vec<InFront>, Error> {
        check_interface_name(interface)?;
        let mut found = Vec::new();
        match self.mode {
            AttachMode::Tcx => {
                for direction in Direction::BOTH {
                    let ours = self.program_id(direction)?;
                    let (_, programs) =
                        SchedClassifier::query_tcx(interface, direction.attach_type()).map_err(
                            |source| Error::Program {
                                program: direction.program(),
                                source,
                            },
                        )?;
                    if !programs.iter().any(|p| p.id() == ours) {
                        continue;
                    }
                    found.extend(
                        programs
                            .iter()
                            .take_while(|p| p.id() != ours)
                            .map(|p| InFront {
                                direction,
                                program: p.name_as_str().unwrap_or("?").to_owned(),
                                program_id: p.id(),
                            }),
                    );
                }
            }
            AttachMode::Tc => {
                let ifindex = ifindex(interface)?;
                for record in tc::records(&self.pins.links_dir())? {
                    if record.interface != interface || record.ifindex != ifindex {
                        continue;
                    }
                    let filters = netlink::tc::filters(ifindex, record.direction.hook()).map_err(
                        |source| Error::Netlink {
                            operation: "listing the TC filters",
                            interface: interface.to_owned(),
                            source,
                        },
                    )?;
                    found.extend(
                        filters
                            .iter()
                            .take_while(|f| {
                                (f.priority, f.handle) != (record.priority, record.handle)
                            })
                            .map(|f| InFront {
                                direction: record.direction,
                                program: f.program.clone().unwrap_or_else(|| f.kind.clone()),
                                program_id: f.program_id.unwrap_or(0),
                            }),
                    );
                }
            }
        }
        found.sort();
        Ok(found)
    }

    fn program_id(&self, direction: Direction) -> Result<u32, Error> {
        let program = direction.program();
        let classifier = self.classifier(direction)?;
        classifier
            .info()
            .map(|info| info.id())
            .map_err(|source| Error::Program { program, source })
    }
}

/// A recorded TC filter as an attachment: attached while its filter is there on
/// the interface of that name, defunct once the filter or its interface is gone.
fn tc_attachment(record: TcRecord) -> Attachment {
    let filter = record.filter();
    let state = match (filter.is_some(), if_nametoindex(record.interface.as_str())) {
        (false, _) => AttachmentState::Defunct,
        (true, Ok(current)) if current == record.ifindex => AttachmentState::Attached {
            ifindex: record.ifindex,
        },
        (true, _) => AttachmentState::Elsewhere {
            ifindex: record.ifindex,
        },
    };
    Attachment {
        interface: record.interface,
        direction: record.direction,
        mode: AttachMode::Tc,
        pin: record.path,
        link_id: 0,
        program_id: filter.and_then(|f| f.program_id).unwrap_or(0),
        state,
    }
}

/// Refuses a device that is not an endpoint's own: census attaches to the host
/// side of a veth or netkit pair, whose frames carry an Ethernet header (the
/// classifier parses one). A NIC, a bridge, macvlan, ipvlan, wireguard or tun
/// would give its whole traffic one endpoint's identity, or garbage.
fn check_endpoint_device(interface: &str, ifindex: u32) -> Result<(), Error> {
    let link = netlink::link::link_kind(ifindex).map_err(|source| Error::Netlink {
        operation: "reading the link kind",
        interface: interface.to_owned(),
        source,
    })?;
    if link.is_pod_device() {
        Ok(())
    } else {
        Err(Error::UnsupportedInterface {
            interface: interface.to_owned(),
            kind: link.kind,
            ethernet: link.ethernet,
        })
    }
}

/// Refuses one of the node's own devices, whatever its kind (a node in a
/// container has veth uplinks): one a default route leaves by, or one holding an
/// address of the node's (`--node-ip`). Counting there would give the node's
/// traffic an endpoint's identity. A pod's device may hold addresses of its own,
/// as a gateway (`ptp` puts the gateway on every pod's host side).
fn check_not_the_nodes(
    interface: &str,
    ifindex: u32,
    node_addresses: &BTreeSet<IpAddr>,
) -> Result<(), Error> {
    let netlink_error = |operation| {
        move |source| Error::Netlink {
            operation,
            interface: interface.to_owned(),
            source,
        }
    };
    let uplinks = netlink::route::default_route_interfaces()
        .map_err(netlink_error("reading the default routes"))?;
    if uplinks.contains(&ifindex) {
        return Err(Error::NodeInterface {
            interface: interface.to_owned(),
            role: NodeRole::DefaultRoute,
        });
    }
    if node_addresses.is_empty() {
        return Ok(());
    }
    let held =
        netlink::address::addresses(ifindex).map_err(netlink_error("reading the addresses"))?;
    match held.into_iter().find(|ip| node_addresses.contains(ip)) {
        Some(address) => Err(Error::NodeInterface {
            interface: interface.to_owned(),
            role: NodeRole::Address(address),
        }),
        None => Ok(()),
    }
}

fn pinned_link_info(path: &Path) -> Result<sys::LinkInfo, Error> {
    open_tcx_link(path).map(|(_, info)| info)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_real_interface_names() {
        for name in ["eth0", "lxc1234abcd5678", "veth-a.b_c"] {
            assert!(check_interface_name(name).is_ok(), "{name}");
        }
    }

    #[test]
    fn rejects_names_the_kernel_rejects() {
        for name in ["", ".", "..", "a/b", "a:b", "a b", "sixteen-bytes-xx"] {
            assert!(
                matches!(
                    check_interface_name(name),
                    Err(Error::InvalidInterfaceName { .. })
                ),
                "{name}"
            );
        }
    }
}
