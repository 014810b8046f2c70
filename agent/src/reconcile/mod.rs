//! Bringing the datapath to the desired state: ENDPOINTS entries (endpoints with
//! their identities, the node's own addresses flagged HOST), the classifier's
//! attachments (one per endpoint interface) and their INTERFACES entries (the
//! identity of the endpoint behind each).
//!
//! An INTERFACES entry exists only while the classifier is attached to both hooks
//! of its interface: it is written after attaching and removed before detaching,
//! because the egress program takes packets that arrived through an interface with
//! an entry as counted when they left it. Two interfaces whose ifindexes share a
//! slot: the first to get it keeps it, the other is counted by address (as if it
//! had no entry) until the slot is free.
//!
//! Changes are applied as they happen: the core's [`Effects`] say, for the addresses
//! and interfaces they touch, what each should be now ([`Reconciler::apply`]), and
//! what was done goes back to the core as one [`Reconciled`]. A periodic
//! [`Reconciler::full_pass`] reads the maps' actual content and the pinned links and
//! repairs whatever differs: entries changed or deleted behind the agent's back,
//! entries nobody wants, links of deleted interfaces, interfaces that lost their
//! program.
//!
//! An address is LOCAL in ENDPOINTS only once the classifier is attached to its
//! interface: until then (or when attaching fails) the core writes it without,
//! as it is seen from outside, so the hook of whatever it talks to counts its
//! packets. Each [`Reconciled`] says which of the interfaces it touched are
//! attached.
//!
//! The full pass first puts back the pins if they were removed under the agent
//! (`census-agent uninstall`), and reports the datapath broken while it cannot;
//! it also looks for programs attached in front of census's and reports them
//! (and, if asked, attaches census first again), and puts the node's own hooks
//! (uplinks, sockets) back where they are missing ([`node_hooks`]).
//!
//! SERVICES (the cluster's Service addresses) is written range by range as the
//! operator's set changes, only where it differs from what this agent wrote; the
//! full pass compares it with the set and repairs every difference, once the
//! operator has given a set (until then a previous run's entries stay).
//!
//! Nothing is removed while `prune` is false: until the endpoint source has given
//! its first full set the agent does not know what is unwanted, and what the maps
//! hold (from a previous run of the agent) stays in force.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
    num::NonZeroU16,
    path::{Path, PathBuf},
};

use census_proto::domain::{IdentityId, ServiceKind, ServiceSet};
use ipnet::IpNet;
use tracing::{debug, info, warn};

pub use node_hooks::NodeHooks;
use written::Written;

use crate::{
    agent_core::{
        DatapathError, DatapathHealth, Desired, Effects, Entry, HookDirection, InterfaceChange,
        MissingHook, NodeEntry, ProgramInFront, Reconciled,
    },
    bpf::{self, AttachmentState, Datapath, interface_slot},
    metrics::{MapLabels, Metrics},
};

const ENDPOINTS: &str = "ENDPOINTS";
const INTERFACES: &str = "INTERFACES";
const NODES: &str = "NODES";
const SERVICES: &str = "SERVICES";

/// What SERVICES holds (a previous run's, at start), for the core: in force until
/// the operator's first set. Empty if it cannot be read.
pub(crate) fn pinned_services<M: DatapathPort + ?Sized>(maps: &M) -> ServiceSet {
    match maps.read_services() {
        Ok(found) => found.into_iter().collect(),
        Err(error) => {
            warn!(%error, "cannot read SERVICES at start");
            ServiceSet::new()
        }
    }
}

/// A raw ENDPOINTS key, as the map holds it.
pub(crate) type MapKey = bpf::EndpointKey;

/// The ENDPOINTS entry of `entry`.
fn to_map(entry: Entry) -> bpf::Endpoint {
    match entry {
        Entry::Local(id) => bpf::Endpoint::local(id.get()),
        Entry::Unattached(id) => bpf::Endpoint::unattached(id.get()),
        Entry::Host => bpf::Endpoint::host(),
        Entry::Remote { id, node } => bpf::Endpoint::remote(id.get(), node),
    }
}

/// The nodes NODES holds (a previous run's, at start), for the core to keep
/// their indexes; entries whose name is not a node name are left out.
pub(crate) fn pinned_nodes<M: DatapathPort + ?Sized>(
    maps: &M,
) -> Vec<(NonZeroU16, census_proto::domain::NodeName)> {
    let Ok(nodes) = maps.read_nodes() else {
        return Vec::new();
    };
    nodes
        .into_iter()
        .filter_map(|(index, record)| {
            let name = census_proto::domain::NodeName::new(&record.name).ok()?;
            Some((NonZeroU16::new(index)?, name))
        })
        .collect()
}

/// Whether NODES' `record` is `want`.
fn same_node(record: &bpf::NodeRecord, want: &NodeEntry) -> bool {
    record.name == want.name.as_str() && record.addresses == want.addresses
}

/// The identities of the LOCAL entries of `found` (ENDPOINTS at start), which the
/// core lets endpoints keep until the operator says otherwise.
pub(crate) fn adoptable(found: &BTreeMap<MapKey, bpf::Endpoint>) -> HashMap<IpAddr, u32> {
    found
        .iter()
        .filter(|(_, e)| e.flags.contains(bpf::EndpointFlags::LOCAL))
        .filter_map(|(key, e)| Some((key.ip()?, e.identity)))
        .collect()
}

/// The interfaces with both hooks attached at start (a previous run's links): the
/// core keeps their addresses LOCAL while reconcile adopts them.
pub(crate) fn attached_at_start<M: DatapathPort + ?Sized>(maps: &M) -> BTreeSet<String> {
    let Ok(links) = maps.attachments() else {
        return BTreeSet::new();
    };
    let mut hooks: BTreeMap<&str, usize> = BTreeMap::new();
    for link in &links {
        if matches!(link.state, AttachmentState::Attached { .. }) {
            *hooks.entry(link.interface.as_str()).or_default() += 1;
        }
    }
    hooks
        .into_iter()
        .filter(|(_, n)| *n >= 2)
        .map(|(i, _)| i.to_owned())
        .collect()
}

/// One pinned link, as [`DatapathPort::attachments`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Link {
    pub(crate) interface: String,
    pub(crate) state: AttachmentState,
}

/// The datapath as reconcile drives it: its maps and its programs' attachments;
/// [`Datapath`] in production, a fake in tests.
pub(crate) trait DatapathPort {
    fn read_endpoints(&self) -> Result<BTreeMap<MapKey, bpf::Endpoint>, bpf::Error>;
    fn write_endpoint(&mut self, ip: IpAddr, endpoint: bpf::Endpoint) -> Result<(), bpf::Error>;
    fn delete_endpoint(&mut self, key: &MapKey) -> Result<bool, bpf::Error>;
    /// The ENDPOINTS entry of `ip`, if any.
    fn read_endpoint(&self, ip: IpAddr) -> Result<Option<bpf::Endpoint>, bpf::Error>;
    /// INTERFACES' used slots, by slot.
    fn read_interfaces(&self) -> BTreeMap<u32, bpf::Interface>;
    /// Writes an INTERFACES entry; [`bpf::Error::InterfaceSlotTaken`] if another
    /// interface holds its slot.
    fn write_interface(&mut self, interface: bpf::Interface) -> Result<(), bpf::Error>;
    /// Removes interface `ifindex`'s entry, if its slot holds it.
    fn delete_interface(&mut self, ifindex: u32) -> Result<bool, bpf::Error>;
    /// Empties an INTERFACES slot, whatever it holds.
    fn clear_interface_slot(&mut self, slot: u32) -> Result<(), bpf::Error>;
    /// Attaches (or adopts the pinned link on) both hooks of `interface`; its ifindex.
    fn attach(&mut self, interface: &str) -> Result<u32, bpf::Error>;
    fn detach(&mut self, interface: &str) -> Result<bool, bpf::Error>;
    /// The pinned links of endpoints' interfaces, one per hook.
    fn attachments(&self) -> Result<Vec<Link>, bpf::Error>;
    /// Removes the pins of links whose interface is gone; how many.
    fn prune_defunct(&mut self) -> Result<usize, bpf::Error>;
    /// Pins again what was removed under the agent; whether anything was.
    fn ensure_pinned(&mut self) -> Result<bool, bpf::Error>;
    /// The programs that run before census's on `interface`.
    fn in_front(&self, interface: &str) -> Result<Vec<bpf::InFront>, bpf::Error>;
    /// Writes (creates or replaces) NODES' entry of node `index`: its name (at
    /// most 253 bytes) and addresses (at most 16).
    fn write_node(
        &mut self,
        index: NonZeroU16,
        name: &str,
        addresses: &[IpAddr],
    ) -> Result<(), bpf::Error>;
    /// Removes NODES' entry of node `index`; `false` if there was none.
    fn delete_node(&mut self, index: NonZeroU16) -> Result<bool, bpf::Error>;
    /// Every NODES entry, by index.
    fn read_nodes(&self) -> Result<BTreeMap<u16, bpf::NodeRecord>, bpf::Error>;
    /// Writes (creates or replaces) SERVICES' entry of `range`.
    fn write_service(&mut self, range: IpNet, kind: ServiceKind) -> Result<(), bpf::Error>;
    /// Removes SERVICES' entry of `range`; `false` if there was none.
    fn delete_service(&mut self, range: IpNet) -> Result<bool, bpf::Error>;
    /// Every SERVICES entry census writes, by range.
    fn read_services(&self) -> Result<BTreeMap<IpNet, ServiceKind>, bpf::Error>;
    /// The devices packets leave the node by, as [`bpf::default_uplinks`] finds them.
    fn default_uplinks(&self) -> Result<BTreeSet<String>, bpf::Error>;
    /// Attaches (or adopts the pinned link of) the uplink program on `interface`.
    fn attach_uplink(&mut self, interface: &str) -> Result<bpf::AttachOutcome, bpf::Error>;
    /// Detaches the uplink program from `interface`; `false` if it was not there.
    fn detach_uplink(&mut self, interface: &str) -> Result<bool, bpf::Error>;
    /// The pinned links of the uplink program, one per device.
    fn uplinks(&self) -> Result<Vec<Link>, bpf::Error>;
    /// The root of the node's cgroup v2 hierarchy, as [`bpf::find_cgroup2_root`]
    /// finds it.
    fn find_cgroup2_root(&self) -> Result<PathBuf, bpf::Error>;
    /// Attaches (or adopts the pinned link of) the socket program at `cgroup`.
    fn attach_sockets(&mut self, cgroup: &Path) -> Result<bpf::AttachOutcome, bpf::Error>;
    /// Whether the socket program's link is pinned and attached.
    fn sockets_attached(&self) -> Result<bool, bpf::Error>;
}

impl DatapathPort for Datapath {
    fn read_endpoints(&self) -> Result<BTreeMap<MapKey, bpf::Endpoint>, bpf::Error> {
        self.endpoints()
    }

    fn write_endpoint(&mut self, ip: IpAddr, endpoint: bpf::Endpoint) -> Result<(), bpf::Error> {
        self.upsert_endpoint(ip, endpoint)
    }

    fn delete_endpoint(&mut self, key: &MapKey) -> Result<bool, bpf::Error> {
        self.delete_endpoint_key(key)
    }

    fn read_endpoint(&self, ip: IpAddr) -> Result<Option<bpf::Endpoint>, bpf::Error> {
        self.endpoint(ip)
    }

    fn read_interfaces(&self) -> BTreeMap<u32, bpf::Interface> {
        self.interfaces()
    }

    fn write_interface(&mut self, interface: bpf::Interface) -> Result<(), bpf::Error> {
        self.set_interface(interface)
    }

    fn delete_interface(&mut self, ifindex: u32) -> Result<bool, bpf::Error> {
        Datapath::delete_interface(self, ifindex)
    }

    fn clear_interface_slot(&mut self, slot: u32) -> Result<(), bpf::Error> {
        Datapath::clear_interface_slot(self, slot)
    }

    fn attach(&mut self, interface: &str) -> Result<u32, bpf::Error> {
        let bpf::Attached {
            ifindex,
            ingress,
            egress,
        } = Datapath::attach(self, interface)?;
        debug!(interface, ifindex, ?ingress, ?egress, "classifier attached");
        Ok(ifindex)
    }

    fn detach(&mut self, interface: &str) -> Result<bool, bpf::Error> {
        Datapath::detach(self, interface)
    }

    fn attachments(&self) -> Result<Vec<Link>, bpf::Error> {
        // Endpoints' interfaces only: the uplinks' hooks are not reconcile's.
        Ok(Datapath::attachments(self)?
            .into_iter()
            .filter(|a| a.direction.is_endpoint_hook())
            .map(|a| Link {
                interface: a.interface,
                state: a.state,
            })
            .collect())
    }

    fn prune_defunct(&mut self) -> Result<usize, bpf::Error> {
        Ok(Datapath::prune_defunct(self)?.len())
    }

    fn ensure_pinned(&mut self) -> Result<bool, bpf::Error> {
        Ok(!Datapath::ensure_pinned(self)?.is_empty())
    }

    fn in_front(&self, interface: &str) -> Result<Vec<bpf::InFront>, bpf::Error> {
        Datapath::in_front(self, interface)
    }

    fn write_node(
        &mut self,
        index: NonZeroU16,
        name: &str,
        addresses: &[IpAddr],
    ) -> Result<(), bpf::Error> {
        Datapath::write_node(self, index, name, addresses)
    }

    fn delete_node(&mut self, index: NonZeroU16) -> Result<bool, bpf::Error> {
        Datapath::delete_node(self, index)
    }

    fn read_nodes(&self) -> Result<BTreeMap<u16, bpf::NodeRecord>, bpf::Error> {
        self.nodes()
    }

    fn write_service(&mut self, range: IpNet, kind: ServiceKind) -> Result<(), bpf::Error> {
        self.upsert_service(range, kind)
    }

    fn delete_service(&mut self, range: IpNet) -> Result<bool, bpf::Error> {
        Datapath::delete_service(self, range)
    }

    fn read_services(&self) -> Result<BTreeMap<IpNet, ServiceKind>, bpf::Error> {
        self.services()
    }

    fn default_uplinks(&self) -> Result<BTreeSet<String>, bpf::Error> {
        bpf::default_uplinks()
    }

    fn attach_uplink(&mut self, interface: &str) -> Result<bpf::AttachOutcome, bpf::Error> {
        Datapath::attach_uplink(self, interface)
    }

    fn detach_uplink(&mut self, interface: &str) -> Result<bool, bpf::Error> {
        Datapath::detach_uplink(self, interface)
    }

    fn uplinks(&self) -> Result<Vec<Link>, bpf::Error> {
        Ok(Datapath::uplinks(self)?
            .into_iter()
            .map(|a| Link {
                interface: a.interface,
                state: a.state,
            })
            .collect())
    }

    fn find_cgroup2_root(&self) -> Result<PathBuf, bpf::Error> {
        bpf::find_cgroup2_root()
    }

    fn attach_sockets(&mut self, cgroup: &Path) -> Result<bpf::AttachOutcome, bpf::Error> {
        Datapath::attach_sockets(self, cgroup)
    }

    fn sockets_attached(&self) -> Result<bool, bpf::Error> {
        Datapath::sockets_attached(self)
    }
}

/// What one full pass did.
#[derive(Debug, Default)]
pub(crate) struct PassReport {
    /// ENDPOINTS and INTERFACES entries that differed from what this agent had
    /// written (changed or deleted behind its back) and were rewritten.
    pub(crate) repaired: usize,
    /// Entries written for the first time.
    pub(crate) written: usize,
    /// Entries removed because nothing wants them.
    pub(crate) removed: usize,
    /// Links whose interface was gone.
    pub(crate) pruned: usize,
    /// SERVICES entries that could not be written or removed.
    pub(crate) service_errors: Vec<(IpNet, bpf::Error)>,
    pub(crate) entry_errors: Vec<(IpAddr, bpf::Error)>,
    pub(crate) interface_errors: Vec<(String, bpf::Error)>,
    /// Why the pins could not be put back (the pass did nothing else).
    pub(crate) datapath_error: Option<bpf::Error>,
    /// Whether the pins were put back.
    pub(crate) repinned: bool,
    /// Programs found in front of census's.
    pub(crate) in_front: Vec<ProgramInFront>,
    /// The node's own hooks still not attached after the pass.
    pub(crate) missing_hooks: Vec<MissingHook>,
}

/// What this agent believes the datapath holds, and applies changes to it.
#[derive(Debug, Default)]
pub(crate) struct Reconciler {
    written: Written,
    /// NODES entries written by this agent.
    nodes: BTreeMap<NonZeroU16, NodeEntry>,
    /// SERVICES entries written by this agent.
    services: BTreeMap<IpNet, ServiceKind>,
    /// Interfaces attached (or adopted) by this process, and their ifindex.
    attached: BTreeMap<String, u32>,
    /// INTERFACES entries written by this agent: ifindex -> identity.
    interface_entries: HashMap<u32, Option<u32>>,
    /// Attached interfaces whose slot another one holds: counted by address.
    crowded: BTreeSet<u32>,
    /// Programs in front of census's already warned about.
    warned_in_front: BTreeSet<ProgramInFront>,
    /// Attach census first again when another program is found in front of it.
    reassert_order: bool,
    /// Where the node's own hooks go; `None`: this agent attaches none.
    node_hooks: Option<NodeHooks>,
    /// Missing node hooks already warned about.
    warned_missing: BTreeSet<MissingHook>,
    metrics: Metrics,
}

impl Reconciler {
    pub(crate) fn new(metrics: Metrics) -> Self {
        Self {
            metrics,
            ..Self::default()
        }
    }

    /// Whether a program found in front of census's makes it attach first again.
    pub(crate) fn reassert_order(mut self, reassert: bool) -> Self {
        self.reassert_order = reassert;
        self
    }

    /// ENDPOINTS entries of this node written by this agent.
    #[cfg(test)]
    fn entries(&self) -> usize {
        self.written.local_len()
    }

    /// Interfaces the classifier is attached to without an INTERFACES entry
    /// because another interface holds their slot: their packets are counted by
    /// address.
    #[cfg(test)]
    fn crowded_interfaces(&self) -> usize {
        self.crowded.len()
    }

    /// Carries out the datapath changes of `fx`; what was done, for the core.
    pub(crate) fn apply<M: DatapathPort + ?Sized>(
        &mut self,
        maps: &mut M,
        fx: &Effects,
    ) -> Reconciled {
        let entry_failures = self.apply_entries(maps, fx);
        for (ip, error) in &entry_failures {
            warn!(%ip, %error, "writing ENDPOINTS failed; the full pass retries");
        }
        let interface_failures = self.apply_interfaces_of(maps, fx);
        for (interface, error) in &interface_failures {
            warn!(interface, %error, "attaching the classifier or writing its INTERFACES entry failed; the full pass retries");
        }
        for (range, error) in self.apply_services(maps, &fx.services) {
            warn!(%range, %error, "writing SERVICES failed; the full pass retries");
        }
        self.reconciled(
            fx.entries.keys().copied().collect(),
            entry_failures,
            fx.interfaces.keys().cloned().collect(),
            interface_failures,
            None,
        )
    }

    /// The ENDPOINTS changes of `fx`; the failures.
    pub(crate) fn apply_entries<M: DatapathPort + ?Sized>(
        &mut self,
        maps: &mut M,
        fx: &Effects,
    ) -> Vec<(IpAddr, bpf::Error)> {
        // A node is written before the entries naming it, removed after them.
        let upserts = fx.nodes.iter().filter_map(|(i, n)| Some((*i, n.as_ref()?)));
        self.write_nodes(maps, upserts);
        let entries = fx.entries.iter().map(|(ip, e)| (*ip, e.map(to_map)));
        let failures = self.write_entries(maps, entries, fx.prune, fx.prune_remote);
        if fx.prune_remote {
            let gone = fx
                .nodes
                .iter()
                .filter(|(_, n)| n.is_none())
                .map(|(i, _)| *i);
            self.delete_nodes(maps, gone);
        }
        failures
    }

    /// Writes the NODES entries that differ from what this agent wrote.
    fn write_nodes<'a, M: DatapathPort + ?Sized>(
        &mut self,
        maps: &mut M,
        nodes: impl IntoIterator<Item = (NonZeroU16, &'a NodeEntry)>,
    ) {
        for (index, want) in nodes {
            if self.nodes.get(&index) == Some(want) {
                continue;
            }
            match maps.write_node(index, want.name.as_str(), &want.addresses) {
                Ok(()) => {
                    self.nodes.insert(index, want.clone());
                }
                Err(error) => {
                    let error = self.write_failed(NODES, error);
                    warn!(index, node = %want.name, %error, "writing NODES failed; the full pass retries");
                }
            }
        }
    }

    fn delete_nodes<M: DatapathPort + ?Sized>(
        &mut self,
        maps: &mut M,
        nodes: impl IntoIterator<Item = NonZeroU16>,
    ) {
        for index in nodes {
            match maps.delete_node(index) {
                Ok(_) => {
                    self.nodes.remove(&index);
                }
                Err(error) => {
                    let error = self.write_failed(NODES, error);
                    warn!(index, %error, "removing a NODES entry failed; the full pass retries");
                }
            }
        }
    }

    /// Brings each SERVICES entry of `changes` to what it should be (`None`: no
    /// entry), writing only what differs from what this agent wrote; the failures.
    pub(crate) fn apply_services<M: DatapathPort + ?Sized>(
        &mut self,
        maps: &mut M,
        changes: &BTreeMap<IpNet, Option<ServiceKind>>,
    ) -> Vec<(IpNet, bpf::Error)> {
        let mut failures = Vec::new();
        for (range, want) in changes {
            match want {
                Some(kind) if self.services.get(range) == Some(kind) => {}
                Some(kind) => match maps.write_service(*range, *kind) {
                    Ok(()) => {
                        self.services.insert(*range, *kind);
                    }
                    Err(error) => {
                        self.services.remove(range);
                        failures.push((*range, self.write_failed(SERVICES, error)));
                    }
                },
                // An entry this agent did not write may be a previous run's.
                None => match maps.delete_service(*range) {
                    Ok(_) => {
                        self.services.remove(range);
                    }
                    Err(error) => failures.push((*range, self.write_failed(SERVICES, error))),
                },
            }
        }
        failures
    }

    /// SERVICES entries written by this agent.
    #[cfg(test)]
    fn written_services(&self) -> &BTreeMap<IpNet, ServiceKind> {
        &self.services
    }

    /// The attachments and INTERFACES changes of `fx`; the failures.
    pub(crate) fn apply_interfaces_of<M: DatapathPort + ?Sized>(
        &mut self,
        maps: &mut M,
        fx: &Effects,
    ) -> Vec<(String, bpf::Error)> {
        let changes = fx.interfaces.iter().map(|(i, c)| (i.clone(), *c));
        self.apply_interfaces(maps, changes, fx.prune)
    }

    /// What was done to `entries` and `interfaces`, with the failures among them.
    fn reconciled(
        &self,
        entries: BTreeSet<IpAddr>,
        entry_failures: Vec<(IpAddr, bpf::Error)>,
        interfaces: BTreeSet<String>,
        interface_failures: Vec<(String, bpf::Error)>,
        datapath: Option<DatapathHealth>,
    ) -> Reconciled {
        let attached = interfaces
            .iter()
            .filter(|i| self.attached.contains_key(*i))
            .cloned()
            .collect();
        Reconciled {
            attached,
            datapath,
            entries,
            entry_failures: entry_failures
                .into_iter()
                .map(|(ip, e)| (ip, DatapathError::new(e)))
                .collect(),
            interfaces,
            interface_failures: interface_failures
                .into_iter()
                .map(|(i, e)| (i, DatapathError::new(e)))
                .collect(),
            local_entries: self.written.local_len(),
            remote_unwritten: self.written.unwritten_len(),
            interfaces_by_address: self.crowded.len(),
        }
    }

    /// What the full pass that gave `report` did to `desired`, for the core.
    pub(crate) fn pass_outcome(&self, desired: &Desired, report: PassReport) -> Reconciled {
        let health = DatapathHealth {
            error: report.datapath_error.map(DatapathError::new),
            in_front: report.in_front,
            missing: report.missing_hooks,
        };
        self.reconciled(
            desired.entries.keys().copied().collect(),
            report.entry_errors,
            desired.interfaces.clone(),
            report.interface_errors,
            Some(health),
        )
    }

    /// Brings each entry to what it should be (`None`: no entry); the failures.
    /// Entries are removed only if `prune` (REMOTE ones: if `prune_remote`).
    fn write_entries<M: DatapathPort + ?Sized>(
        &mut self,
        maps: &mut M,
        entries: impl IntoIterator<Item = (IpAddr, Option<bpf::Endpoint>)>,
        prune: bool,
        prune_remote: bool,
    ) -> Vec<(IpAddr, bpf::Error)> {
        let mut failures = Vec::new();
        for (ip, want) in entries {
            if self.written.holds(ip, want) {
                continue;
            }
            let Some(endpoint) = want else {
                match self.removal(maps, ip, prune, prune_remote) {
                    Ok(false) => {}
                    Ok(true) => match maps.delete_endpoint(&MapKey::from(ip)) {
                        Ok(_) => self.written.remove(ip),
                        Err(error) => failures.push((ip, self.write_failed(ENDPOINTS, error))),
                    },
                    Err(error) => failures.push((ip, self.write_failed(ENDPOINTS, error))),
                }
                continue;
            };
            match maps.write_endpoint(ip, endpoint) {
                Ok(()) => self.written.insert(ip, endpoint),
                Err(error) => {
                    self.written.failed(ip, endpoint);
                    failures.push((ip, self.write_failed(ENDPOINTS, error)));
                }
            }
        }
        failures
    }

    /// Whether `ip`'s entry is to be deleted now: an entry this agent wrote for a
    /// local endpoint if `prune`; otherwise what ENDPOINTS holds says (REMOTE
    /// entries are not remembered one by one): a REMOTE one if `prune_remote`,
    /// another (a previous run's) if `prune`, none: nothing to do.
    fn removal<M: DatapathPort + ?Sized>(
        &mut self,
        maps: &M,
        ip: IpAddr,
        prune: bool,
        prune_remote: bool,
    ) -> Result<bool, bpf::Error> {
        if self.written.local(ip).is_some() {
            return Ok(prune);
        }
        Ok(match maps.read_endpoint(ip)? {
            None => {
                self.written.remove(ip);
                false
            }
            Some(have) if have.remote_node().is_some() => prune_remote,
            Some(_) => prune,
        })
    }

    /// Attaches the classifier to each interface to attach and brings its
    /// INTERFACES entry to its identity, detaches it from the others (only if
    /// `prune`); the failures.
    fn apply_interfaces<M: DatapathPort + ?Sized>(
        &mut self,
        maps: &mut M,
        changes: impl IntoIterator<Item = (String, InterfaceChange)>,
        prune: bool,
    ) -> Vec<(String, bpf::Error)> {
        let mut failures = Vec::new();
        for (interface, change) in changes {
            if let InterfaceChange::Attach { identity } = change {
                let ifindex = match self.attached.get(&interface) {
                    Some(&ifindex) => ifindex,
                    None => match maps.attach(&interface) {
                        Ok(ifindex) => {
                            info!(interface, ifindex, "classifier attached");
                            self.attached.insert(interface.clone(), ifindex);
                            ifindex
                        }
                        Err(error) => {
                            self.metrics.attach_errors.inc();
                            failures.push((interface, error));
                            continue;
                        }
                    },
                };
                let identity = identity.map(IdentityId::get);
                if let Err(error) = self.write_interface(maps, &interface, ifindex, identity) {
                    failures.push((interface, error));
                }
            } else if prune {
                if let Some(&ifindex) = self.attached.get(&interface)
                    && let Err(error) = self.delete_interface(maps, ifindex)
                {
                    // Detaching now would leave an entry without a classifier.
                    failures.push((interface, error));
                    continue;
                }
                match maps.detach(&interface) {
                    Ok(detached) => {
                        if detached {
                            info!(interface, "classifier detached");
                        }
                        self.attached.remove(&interface);
                    }
                    Err(error) => failures.push((interface, error)),
                }
            }
        }
        failures
    }

    /// Brings interface `ifindex`'s INTERFACES entry to `identity`. A slot held by
    /// another interface is not a failure: this one is counted by address.
    fn write_interface<M: DatapathPort + ?Sized>(
        &mut self,
        maps: &mut M,
        interface: &str,
        ifindex: u32,
        identity: Option<u32>,
    ) -> Result<(), bpf::Error> {
        if self.interface_entries.get(&ifindex) == Some(&identity) {
            return Ok(());
        }
        match maps.write_interface(bpf::Interface { ifindex, identity }) {
            Ok(()) => {
                self.interface_entries.insert(ifindex, identity);
                if self.crowded.remove(&ifindex) {
                    info!(
                        interface,
                        ifindex, "the interface has its INTERFACES slot now"
                    );
                }
                Ok(())
            }
            Err(bpf::Error::InterfaceSlotTaken { slot, holder, .. }) => {
                self.interface_entries.remove(&ifindex);
                if self.crowded.insert(ifindex) {
                    warn!(
                        interface,
                        ifindex,
                        slot,
                        holder,
                        "another interface holds this interface's INTERFACES slot; its packets are counted by address until it is free"
                    );
                }
                Ok(())
            }
            Err(error) => Err(self.write_failed(INTERFACES, error)),
        }
    }

    /// Removes interface `ifindex`'s INTERFACES entry (if this agent could have
    /// written it).
    fn delete_interface<M: DatapathPort + ?Sized>(
        &mut self,
        maps: &mut M,
        ifindex: u32,
    ) -> Result<(), bpf::Error> {
        self.crowded.remove(&ifindex);
        match maps.delete_interface(ifindex) {
            Ok(_) => {
                self.interface_entries.remove(&ifindex);
                Ok(())
            }
            Err(error) => Err(self.write_failed(INTERFACES, error)),
        }
    }

    /// Compares the maps' actual content and the pinned links with `desired`, and
    /// repairs every difference.
    pub(crate) fn full_pass<M: DatapathPort + ?Sized>(
        &mut self,
        maps: &mut M,
        desired: &Desired,
        prune: bool,
    ) -> PassReport {
        let mut report = PassReport::default();
        match maps.ensure_pinned() {
            Ok(repinned) => report.repinned = repinned,
            Err(error) => {
                warn!(%error, "census's pins are gone and cannot be put back; the datapath is not whole");
                report.datapath_error = Some(error);
                return report;
            }
        }
        // Nodes first: an entry never names a node NODES lacks.
        let nodes = self.repair_nodes(maps, desired, &mut report);
        match maps.read_endpoints() {
            Ok(actual) => self.repair_entries(maps, desired, prune, &actual, &mut report),
            Err(error) => {
                warn!(%error, "cannot read ENDPOINTS; the full pass skips the entries");
                self.metrics
                    .map_write_errors
                    .get_or_create(&MapLabels { map: ENDPOINTS })
                    .inc();
            }
        }
        if let Some(actual) = nodes {
            self.prune_nodes(maps, desired, &actual, &mut report);
        }
        self.repair_services(maps, desired, &mut report);
        self.repair_links(maps, desired, prune, &mut report);
        report.missing_hooks = self.repair_node_hooks(maps);
        self.check_order(maps, desired, &mut report);
        self.repair_interfaces(maps, desired, prune, &mut report);
        report
    }

    /// The links part of a full pass alone, after a link change: re-attaches the
    /// classifier where an interface was re-created (its links died with the old
    /// device), drops the links of deleted interfaces, and says which interfaces
    /// are attached now. Costs the interfaces of this node, not the entries.
    /// `desired` needs only its interfaces (see `Core::desired_interfaces`).
    pub(crate) fn link_pass<M: DatapathPort + ?Sized>(
        &mut self,
        maps: &mut M,
        desired: &Desired,
        prune: bool,
    ) -> Reconciled {
        let mut report = PassReport::default();
        self.repair_links(maps, desired, prune, &mut report);
        self.reconciled(
            BTreeSet::new(),
            Vec::new(),
            desired.interfaces.clone(),
            report.interface_errors,
            None,
        )
    }

    /// Finds programs attached in front of census's on the interfaces it is
    /// attached to; warns once about each; attaches census first again if asked.
    fn check_order<M: DatapathPort + ?Sized>(
        &mut self,
        maps: &mut M,
        desired: &Desired,
        report: &mut PassReport,
    ) {
        let mut found = Vec::new();
        for interface in self.attached.keys() {
            match maps.in_front(interface) {
                Ok(programs) => found.extend(programs.into_iter().map(|p| ProgramInFront {
                    interface: interface.clone(),
                    direction: match p.direction {
                        bpf::Direction::Ingress => HookDirection::Ingress,
                        bpf::Direction::Egress => HookDirection::Egress,
                        bpf::Direction::Uplink => HookDirection::Uplink,
                    },
                    program: p.program,
                    program_id: p.program_id,
                })),
                Err(error) => {
                    debug!(interface, %error, "cannot list the programs on the interface");
                }
            }
        }
        for seen in &found {
            if !self.warned_in_front.contains(seen) {
                warn!(
                    interface = seen.interface,
                    direction = seen.direction.name(),
                    program = seen.program,
                    program_id = seen.program_id,
                    reassert = self.reassert_order,
                    "another program runs in front of census's classifier: a verdict it returns bypasses census"
                );
            }
        }
        self.warned_in_front = found.iter().cloned().collect();
        if self.reassert_order {
            let interfaces: BTreeSet<String> = found.iter().map(|f| f.interface.clone()).collect();
            for interface in interfaces {
                let Some(ifindex) = self.attached.get(&interface).copied() else {
                    continue;
                };
                // Its entry goes before the classifier is detached and attached first again.
                if let Err(error) = self.delete_interface(maps, ifindex) {
                    report.interface_errors.push((interface, error));
                    continue;
                }
                if let Err(error) = maps.detach(&interface) {
                    report.interface_errors.push((interface, error));
                    continue;
                }
                self.attached.remove(&interface);
                info!(interface, "attaching census's classifier first again");
                let change = InterfaceChange::Attach {
                    identity: desired.interface_identities.get(&interface).copied(),
                };
                let failures = self.apply_interfaces(maps, [(interface, change)], false);
                report.interface_errors.extend(failures);
            }
        }
        report.in_front = found;
    }

    fn repair_entries<M: DatapathPort + ?Sized>(
        &mut self,
        maps: &mut M,
        desired: &Desired,
        prune: bool,
        actual: &BTreeMap<MapKey, bpf::Endpoint>,
        report: &mut PassReport,
    ) {
        for (ip, want) in &desired.entries {
            let want = &to_map(*want);
            let have = actual.get(&MapKey::from(*ip));
            if have == Some(want) {
                self.written.insert(*ip, *want);
                continue;
            }
            let repair = self.written.wrote(*ip, *want);
            match maps.write_endpoint(*ip, *want) {
                Ok(()) => {
                    if repair {
                        warn!(%ip, found = ?have, wanted = ?want, "repaired an ENDPOINTS entry changed behind the agent's back");
                        report.repaired += 1;
                        self.metrics.map_repairs.inc();
                    } else {
                        report.written += 1;
                    }
                    self.written.insert(*ip, *want);
                }
                Err(error) => {
                    self.written.failed(*ip, *want);
                    let error = self.write_failed(ENDPOINTS, error);
                    report.entry_errors.push((*ip, error));
                }
            }
        }
        for (key, have) in actual {
            let wanted = key.ip().is_some_and(|ip| desired.entries.contains_key(&ip));
            // A REMOTE entry goes once the map is whole, the others once the
            // source has given its first full set.
            let may_go = if have.remote_node().is_some() {
                desired.remote_complete
            } else {
                prune
            };
            if wanted || !may_go {
                continue;
            }
            match maps.delete_endpoint(key) {
                Ok(_) => {
                    debug!(ip = ?key.ip(), "removed an ENDPOINTS entry nothing wants");
                    report.removed += 1;
                    self.metrics.map_removals.inc();
                    if let Some(ip) = key.ip() {
                        self.written.remove(ip);
                    }
                }
                Err(error) => {
                    let error = self.write_failed(ENDPOINTS, error);
                    if let Some(ip) = key.ip() {
                        report.entry_errors.push((ip, error));
                    }
                }
            }
        }
        // What was neither wanted nor removed is still there.
        self.written.retain(|ip| {
            desired.entries.contains_key(&ip) || actual.contains_key(&MapKey::from(ip))
        });
    }

    /// Writes the NODES entries `desired` names that NODES lacks or holds
    /// otherwise; what NODES held, if it could be read.
    fn repair_nodes<M: DatapathPort + ?Sized>(
        &mut self,
        maps: &mut M,
        desired: &Desired,
        report: &mut PassReport,
    ) -> Option<BTreeMap<u16, bpf::NodeRecord>> {
        let actual = match maps.read_nodes() {
            Ok(actual) => actual,
            Err(error) => {
                warn!(%error, "cannot read NODES; the full pass skips the nodes");
                self.write_failed(NODES, error);
                return None;
            }
        };
        for (index, want) in &desired.nodes {
            let have = actual.get(&index.get());
            if have.is_some_and(|record| same_node(record, want)) {
                self.nodes.insert(*index, want.clone());
                continue;
            }
            let repair = self.nodes.get(index) == Some(want);
            match maps.write_node(*index, want.name.as_str(), &want.addresses) {
                Ok(()) => {
                    if repair {
                        warn!(index, node = %want.name, found = ?have, "repaired a NODES entry changed behind the agent's back");
                        report.repaired += 1;
                        self.metrics.map_repairs.inc();
                    } else {
                        report.written += 1;
                    }
                    self.nodes.insert(*index, want.clone());
                }
                Err(error) => {
                    let error = self.write_failed(NODES, error);
                    warn!(index, node = %want.name, %error, "writing NODES failed");
                }
            }
        }
        Some(actual)
    }

    /// Removes the NODES entries `desired` does not name, once the map is whole.
    fn prune_nodes<M: DatapathPort + ?Sized>(
        &mut self,
        maps: &mut M,
        desired: &Desired,
        actual: &BTreeMap<u16, bpf::NodeRecord>,
        report: &mut PassReport,
    ) {
        if !desired.remote_complete {
            return;
        }
        let unwanted = actual
            .keys()
            .filter_map(|index| NonZeroU16::new(*index))
            .filter(|index| !desired.nodes.contains_key(index));
        for index in unwanted {
            match maps.delete_node(index) {
                Ok(_) => {
                    debug!(index, "removed a NODES entry nothing wants");
                    report.removed += 1;
                    self.metrics.map_removals.inc();
                    self.nodes.remove(&index);
                }
                Err(error) => {
                    let error = self.write_failed(NODES, error);
                    warn!(index, %error, "cannot remove a NODES entry nothing wants");
                }
            }
        }
        self.nodes
            .retain(|index, _| desired.nodes.contains_key(index));
    }

    /// Brings SERVICES to the operator's set: writes what it lacks or holds
    /// otherwise, removes what the set does not name. Nothing before the operator
    /// has given a set.
    fn repair_services<M: DatapathPort + ?Sized>(
        &mut self,
        maps: &mut M,
        desired: &Desired,
        report: &mut PassReport,
    ) {
        let Some(want) = &desired.services else {
            return;
        };
        let actual = match maps.read_services() {
            Ok(actual) => actual,
            Err(error) => {
                warn!(%error, "cannot read SERVICES; the full pass skips it");
                self.write_failed(SERVICES, error);
                return;
            }
        };
        for (range, kind) in want.iter() {
            let have = actual.get(&range).copied();
            if have == Some(kind) {
                self.services.insert(range, kind);
                continue;
            }
            let repair = self.services.get(&range) == Some(&kind);
            match maps.write_service(range, kind) {
                Ok(()) => {
                    if repair {
                        warn!(%range, found = ?have, wanted = %kind, "repaired a SERVICES entry changed behind the agent's back");
                        report.repaired += 1;
                        self.metrics.map_repairs.inc();
                    } else {
                        report.written += 1;
                    }
                    self.services.insert(range, kind);
                }
                Err(error) => {
                    self.services.remove(&range);
                    let error = self.write_failed(SERVICES, error);
                    warn!(%range, %error, "writing SERVICES failed");
                    report.service_errors.push((range, error));
                }
            }
        }
        for range in actual.keys().filter(|range| want.get(range).is_none()) {
            match maps.delete_service(*range) {
                Ok(_) => {
                    debug!(%range, "removed a SERVICES entry nothing wants");
                    report.removed += 1;
                    self.metrics.map_removals.inc();
                }
                Err(error) => {
                    let error = self.write_failed(SERVICES, error);
                    warn!(%range, %error, "cannot remove a SERVICES entry nothing wants");
                    report.service_errors.push((*range, error));
                }
            }
        }
        self.services.retain(|range, _| want.get(range).is_some());
    }

    fn repair_links<M: DatapathPort + ?Sized>(
        &mut self,
        maps: &mut M,
        desired: &Desired,
        prune: bool,
        report: &mut PassReport,
    ) {
        match maps.prune_defunct() {
            Ok(pruned) => report.pruned = pruned,
            Err(error) => warn!(%error, "cannot prune the links of deleted interfaces"),
        }
        let links = match maps.attachments() {
            Ok(links) => links,
            Err(error) => {
                warn!(%error, "cannot list the pinned links; the full pass skips them");
                return;
            }
        };
        // An interface is in place when both hooks have a pinned link on it.
        let mut in_place: BTreeMap<&str, (usize, u32)> = BTreeMap::new();
        for link in &links {
            if let AttachmentState::Attached { ifindex } = link.state {
                let place = in_place.entry(link.interface.as_str()).or_default();
                *place = (place.0 + 1, ifindex);
            }
        }
        let attach = |i: &str| InterfaceChange::Attach {
            identity: desired.interface_identities.get(i).copied(),
        };
        for interface in &desired.interfaces {
            let place = in_place.get(interface.as_str()).copied();
            let ours = self.attached.get(interface).copied();
            let complete = place.is_some_and(|(hooks, _)| hooks >= 2);
            if complete && place.map(|(_, ifindex)| ifindex) == ours {
                continue;
            }
            if let Some(ifindex) = ours {
                if !complete {
                    warn!(
                        interface,
                        "the classifier's link is gone; attaching it again"
                    );
                }
                // Its entry goes before the classifier is attached (again).
                if let Err(error) = self.delete_interface(maps, ifindex) {
                    report.interface_errors.push((interface.clone(), error));
                    continue;
                }
                self.attached.remove(interface);
            }
            let failures =
                self.apply_interfaces(maps, [(interface.clone(), attach(interface))], false);
            report.interface_errors.extend(failures);
        }
        if prune {
            let unwanted: BTreeSet<String> = links
                .iter()
                .filter(|l| !desired.interfaces.contains(&l.interface))
                .map(|l| l.interface.clone())
                .collect();
            let detach = unwanted.into_iter().map(|i| (i, InterfaceChange::Detach));
            let failures = self.apply_interfaces(maps, detach, true);
            report.interface_errors.extend(failures);
            self.attached.retain(|i, _| desired.interfaces.contains(i));
        }
    }

    /// Compares INTERFACES with the entries of the interfaces this agent attached
    /// and repairs every difference; removes the entries nothing wants (only if
    /// `prune`).
    fn repair_interfaces<M: DatapathPort + ?Sized>(
        &mut self,
        maps: &mut M,
        desired: &Desired,
        prune: bool,
        report: &mut PassReport,
    ) {
        // ifindex -> (interface, identity) of every entry that should be there.
        let want: BTreeMap<u32, (String, Option<u32>)> = self
            .attached
            .iter()
            .filter(|(interface, _)| desired.interfaces.contains(*interface))
            .map(|(interface, &ifindex)| {
                let identity = desired
                    .interface_identities
                    .get(interface)
                    .map(|id| id.get());
                (ifindex, (interface.clone(), identity))
            })
            .collect();
        let mut actual = maps.read_interfaces();
        if prune {
            let unwanted: Vec<(u32, bpf::Interface)> = actual
                .iter()
                .filter(|(slot, held)| {
                    interface_slot(held.ifindex) != **slot || !want.contains_key(&held.ifindex)
                })
                .map(|(slot, held)| (*slot, *held))
                .collect();
            for (slot, held) in unwanted {
                match maps.clear_interface_slot(slot) {
                    Ok(()) => {
                        debug!(slot, ?held, "removed an INTERFACES entry nothing wants");
                        report.removed += 1;
                        self.metrics.map_removals.inc();
                        self.interface_entries.remove(&held.ifindex);
                        actual.remove(&slot);
                    }
                    Err(error) => {
                        let error = self.write_failed(INTERFACES, error);
                        warn!(slot, %error, "cannot remove an INTERFACES entry nothing wants");
                    }
                }
            }
        }
        for (&ifindex, (interface, identity)) in &want {
            let (interface, identity) = (interface.as_str(), *identity);
            let have = actual
                .get(&interface_slot(ifindex))
                .filter(|held| held.ifindex == ifindex);
            if have.map(|held| held.identity) == Some(identity) {
                self.interface_entries.insert(ifindex, identity);
                continue;
            }
            let repair = self.interface_entries.remove(&ifindex) == Some(identity);
            match self.write_interface(maps, interface, ifindex, identity) {
                Ok(()) if self.interface_entries.contains_key(&ifindex) => {
                    if repair {
                        warn!(interface, ifindex, found = ?have, "repaired an INTERFACES entry changed behind the agent's back");
                        report.repaired += 1;
                        self.metrics.map_repairs.inc();
                    } else {
                        report.written += 1;
                    }
                }
                Ok(()) => {}
                Err(error) => report.interface_errors.push((interface.to_owned(), error)),
            }
        }
        self.interface_entries
            .retain(|ifindex, _| want.contains_key(ifindex));
        self.crowded.retain(|ifindex| want.contains_key(ifindex));
    }

    fn write_failed(&self, map: &'static str, error: bpf::Error) -> bpf::Error {
        self.metrics
            .map_write_errors
            .get_or_create(&MapLabels { map })
            .inc();
        if let bpf::Error::MapFull { map, .. } = &error {
            self.metrics
                .map_full
                .get_or_create(&MapLabels { map })
                .inc();
        }
        error
    }
}

mod node_hooks;
mod written;

#[cfg(test)]
pub(crate) mod fake;
#[cfg(test)]
mod map_tests;
#[cfg(test)]
mod service_tests;
#[cfg(test)]
mod tests;
