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
//! Changes are applied as they happen, for the addresses and interfaces they touch
//! ([`Reconciler::apply_ips`], [`Reconciler::apply_interfaces`]). A periodic
//! [`Reconciler::full_pass`] reads the maps' actual content and the pinned links and
//! repairs whatever differs: entries changed or deleted behind the agent's back,
//! entries nobody wants, links of deleted interfaces, interfaces that lost their
//! program.
//!
//! Nothing is removed while `prune` is false: until the endpoint source has given
//! its first full set the agent does not know what is unwanted, and what the maps
//! hold (from a previous run of the agent) stays in force.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
};

use tracing::{debug, info, warn};

use crate::{
    bpf::{self, AttachmentState, Datapath, interface_slot},
    metrics::{MapLabels, Metrics},
};

const ENDPOINTS: &str = "ENDPOINTS";
const INTERFACES: &str = "INTERFACES";

/// A raw ENDPOINTS key, as the map holds it.
pub type MapKey = bpf::EndpointKey;

/// One pinned link, as [`DatapathPort::attachments`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub interface: String,
    pub state: AttachmentState,
}

/// The datapath as reconcile drives it: its maps and its programs' attachments;
/// [`Datapath`] in production, a fake in tests.
pub trait DatapathPort {
    fn read_endpoints(&self) -> Result<BTreeMap<MapKey, bpf::Endpoint>, bpf::Error>;
    fn write_endpoint(&mut self, ip: IpAddr, endpoint: bpf::Endpoint) -> Result<(), bpf::Error>;
    fn delete_endpoint(&mut self, key: &MapKey) -> Result<bool, bpf::Error>;
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
    /// The pinned links, one per hook.
    fn attachments(&self) -> Result<Vec<Link>, bpf::Error>;
    /// Removes the pins of links whose interface is gone; how many.
    fn prune_defunct(&mut self) -> Result<usize, bpf::Error>;
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
        Ok(Datapath::attachments(self)?
            .into_iter()
            .map(|a| Link {
                interface: a.interface,
                state: a.state,
            })
            .collect())
    }

    fn prune_defunct(&mut self) -> Result<usize, bpf::Error> {
        Ok(Datapath::prune_defunct(self)?.len())
    }
}

/// The state the datapath should be in.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Desired {
    pub entries: HashMap<IpAddr, bpf::Endpoint>,
    pub interfaces: BTreeSet<String>,
    /// The interfaces of `interfaces` behind which every endpoint holds one same
    /// identity, and that identity: their INTERFACES entries carry it. The others'
    /// entries carry none (the program looks addresses up).
    pub interface_identities: HashMap<String, u32>,
}

/// What one full pass did.
#[derive(Debug, Default)]
pub struct PassReport {
    /// ENDPOINTS and INTERFACES entries that differed from what this agent had
    /// written (changed or deleted behind its back) and were rewritten.
    pub repaired: usize,
    /// Entries written for the first time.
    pub written: usize,
    /// Entries removed because nothing wants them.
    pub removed: usize,
    /// Links whose interface was gone.
    pub pruned: usize,
    pub entry_errors: Vec<(IpAddr, bpf::Error)>,
    pub interface_errors: Vec<(String, bpf::Error)>,
}

/// What this agent believes the datapath holds, and applies changes to it.
#[derive(Debug, Default)]
pub struct Reconciler {
    written: HashMap<IpAddr, bpf::Endpoint>,
    /// Interfaces attached (or adopted) by this process, and their ifindex.
    attached: BTreeMap<String, u32>,
    /// INTERFACES entries written by this agent: ifindex -> identity.
    interface_entries: HashMap<u32, Option<u32>>,
    /// Attached interfaces whose slot another one holds: counted by address.
    crowded: BTreeSet<u32>,
    metrics: Metrics,
}

impl Reconciler {
    pub fn new(metrics: Metrics) -> Self {
        Self {
            metrics,
            ..Self::default()
        }
    }

    /// ENDPOINTS entries written by this agent.
    pub fn entries(&self) -> usize {
        self.written.len()
    }

    /// Interfaces the classifier is attached to without an INTERFACES entry
    /// because another interface holds their slot: their packets are counted by
    /// address.
    pub fn crowded_interfaces(&self) -> usize {
        self.crowded.len()
    }

    /// Brings the entries of `ips` to what `desired` says (`None`: no entry); the
    /// failures. Entries are removed only if `prune`.
    pub fn apply_ips<M: DatapathPort + ?Sized>(
        &mut self,
        maps: &mut M,
        ips: impl IntoIterator<Item = IpAddr>,
        desired: impl Fn(IpAddr) -> Option<bpf::Endpoint>,
        prune: bool,
    ) -> Vec<(IpAddr, bpf::Error)> {
        let mut failures = Vec::new();
        for ip in ips {
            let want = desired(ip);
            if self.written.get(&ip) == want.as_ref() {
                continue;
            }
            match want {
                Some(endpoint) => match maps.write_endpoint(ip, endpoint) {
                    Ok(()) => {
                        self.written.insert(ip, endpoint);
                    }
                    Err(error) => failures.push((ip, self.write_failed(ENDPOINTS, error))),
                },
                None if prune => match maps.delete_endpoint(&MapKey::from(ip)) {
                    Ok(_) => {
                        self.written.remove(&ip);
                    }
                    Err(error) => failures.push((ip, self.write_failed(ENDPOINTS, error))),
                },
                None => {}
            }
        }
        failures
    }

    /// Attaches the classifier to each of `interfaces` that `wanted` says and
    /// brings its INTERFACES entry to `identity` (see [`Desired::interface_identities`]),
    /// detaches it from the others (only if `prune`); the failures.
    pub fn apply_interfaces<M: DatapathPort + ?Sized>(
        &mut self,
        maps: &mut M,
        interfaces: impl IntoIterator<Item = String>,
        wanted: impl Fn(&str) -> bool,
        identity: impl Fn(&str) -> Option<u32>,
        prune: bool,
    ) -> Vec<(String, bpf::Error)> {
        let mut failures = Vec::new();
        for interface in interfaces {
            if wanted(&interface) {
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
                if let Err(error) =
                    self.write_interface(maps, &interface, ifindex, identity(&interface))
                {
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
    pub fn full_pass<M: DatapathPort + ?Sized>(
        &mut self,
        maps: &mut M,
        desired: &Desired,
        prune: bool,
    ) -> PassReport {
        let mut report = PassReport::default();
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
        self.repair_links(maps, desired, prune, &mut report);
        self.repair_interfaces(maps, desired, prune, &mut report);
        report
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
            let have = actual.get(&MapKey::from(*ip));
            if have == Some(want) {
                self.written.insert(*ip, *want);
                continue;
            }
            let repair = self.written.get(ip) == Some(want);
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
                    let error = self.write_failed(ENDPOINTS, error);
                    report.entry_errors.push((*ip, error));
                }
            }
        }
        if !prune {
            return;
        }
        for key in actual.keys() {
            let wanted = key.ip().is_some_and(|ip| desired.entries.contains_key(&ip));
            if wanted {
                continue;
            }
            match maps.delete_endpoint(key) {
                Ok(_) => {
                    debug!(ip = ?key.ip(), "removed an ENDPOINTS entry nothing wants");
                    report.removed += 1;
                    self.metrics.map_removals.inc();
                    if let Some(ip) = key.ip() {
                        self.written.remove(&ip);
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
        self.written
            .retain(|ip, _| desired.entries.contains_key(ip));
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
        let identity = |i: &str| desired.interface_identities.get(i).copied();
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
                self.apply_interfaces(maps, [interface.clone()], |_| true, identity, false);
            report.interface_errors.extend(failures);
        }
        if prune {
            let unwanted: BTreeSet<String> = links
                .iter()
                .filter(|l| !desired.interfaces.contains(&l.interface))
                .map(|l| l.interface.clone())
                .collect();
            let failures = self.apply_interfaces(maps, unwanted, |_| false, identity, true);
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
                let identity = desired.interface_identities.get(interface).copied();
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
        error
    }
}

/// An in-memory datapath, for tests: ENDPOINTS, INTERFACES and pinned links, with
/// interfaces that exist or not.
#[cfg(test)]
pub(crate) mod fake {
    use super::*;

    #[derive(Debug, Default)]
    pub(crate) struct FakeMaps {
        pub(crate) entries: BTreeMap<MapKey, bpf::Endpoint>,
        /// INTERFACES, by slot.
        pub(crate) slots: BTreeMap<u32, bpf::Interface>,
        /// Interface -> attached (two hooks each).
        pub(crate) links: BTreeMap<String, AttachmentState>,
        /// Interfaces that exist.
        pub(crate) interfaces: BTreeSet<String>,
        /// Their ifindexes: given by a test, else 100, 101, ... in order of first use.
        pub(crate) ifindexes: BTreeMap<String, u32>,
        /// ENDPOINTS writes and deletes.
        pub(crate) writes: usize,
        /// INTERFACES writes and deletes.
        pub(crate) interface_writes: usize,
        pub(crate) attaches: usize,
        /// INTERFACES entries written for an interface the classifier is not
        /// attached to: must stay 0.
        pub(crate) unattached_entries: usize,
    }

    impl FakeMaps {
        pub(crate) fn ifindex(&mut self, interface: &str) -> u32 {
            let next = 100 + u32::try_from(self.ifindexes.len()).unwrap_or(0);
            *self.ifindexes.entry(interface.to_owned()).or_insert(next)
        }

        fn attached(&self, ifindex: u32) -> bool {
            self.links
                .values()
                .any(|state| *state == AttachmentState::Attached { ifindex })
        }

        /// The INTERFACES entries, by interface name.
        pub(crate) fn interface_entries(&self) -> BTreeMap<String, Option<u32>> {
            self.ifindexes
                .iter()
                .filter_map(|(name, ifindex)| {
                    let held = self.slots.get(&interface_slot(*ifindex))?;
                    (held.ifindex == *ifindex).then(|| (name.clone(), held.identity))
                })
                .collect()
        }
    }

    impl DatapathPort for FakeMaps {
        fn read_endpoints(&self) -> Result<BTreeMap<MapKey, bpf::Endpoint>, bpf::Error> {
            Ok(self.entries.clone())
        }

        fn write_endpoint(
            &mut self,
            ip: IpAddr,
            endpoint: bpf::Endpoint,
        ) -> Result<(), bpf::Error> {
            self.writes += 1;
            self.entries.insert(MapKey::from(ip), endpoint);
            Ok(())
        }

        fn delete_endpoint(&mut self, key: &MapKey) -> Result<bool, bpf::Error> {
            self.writes += 1;
            Ok(self.entries.remove(key).is_some())
        }

        fn read_interfaces(&self) -> BTreeMap<u32, bpf::Interface> {
            self.slots.clone()
        }

        fn write_interface(&mut self, interface: bpf::Interface) -> Result<(), bpf::Error> {
            let slot = interface_slot(interface.ifindex);
            if let Some(holder) = self.slots.get(&slot)
                && holder.ifindex != interface.ifindex
            {
                return Err(bpf::Error::InterfaceSlotTaken {
                    ifindex: interface.ifindex,
                    slot,
                    holder: holder.ifindex,
                });
            }
            if !self.attached(interface.ifindex) {
                self.unattached_entries += 1;
            }
            self.interface_writes += 1;
            self.slots.insert(slot, interface);
            Ok(())
        }

        fn delete_interface(&mut self, ifindex: u32) -> Result<bool, bpf::Error> {
            let slot = interface_slot(ifindex);
            if self
                .slots
                .get(&slot)
                .is_some_and(|held| held.ifindex == ifindex)
            {
                self.interface_writes += 1;
                self.slots.remove(&slot);
                return Ok(true);
            }
            Ok(false)
        }

        fn clear_interface_slot(&mut self, slot: u32) -> Result<(), bpf::Error> {
            self.interface_writes += 1;
            self.slots.remove(&slot);
            Ok(())
        }

        fn attach(&mut self, interface: &str) -> Result<u32, bpf::Error> {
            if !self.interfaces.contains(interface) {
                return Err(bpf::Error::InterfaceNotFound {
                    name: interface.to_owned(),
                    source: nix::Error::ENODEV,
                });
            }
            self.attaches += 1;
            let ifindex = self.ifindex(interface);
            self.links
                .insert(interface.to_owned(), AttachmentState::Attached { ifindex });
            Ok(ifindex)
        }

        fn detach(&mut self, interface: &str) -> Result<bool, bpf::Error> {
            // As the datapath does: the entry of the interface it is on goes first.
            if let Some(AttachmentState::Attached { ifindex }) = self.links.get(interface).copied()
            {
                self.delete_interface(ifindex)?;
            }
            Ok(self.links.remove(interface).is_some())
        }

        fn attachments(&self) -> Result<Vec<Link>, bpf::Error> {
            Ok(self
                .links
                .iter()
                .flat_map(|(interface, state)| {
                    let link = Link {
                        interface: interface.clone(),
                        state: *state,
                    };
                    [link.clone(), link]
                })
                .collect())
        }

        fn prune_defunct(&mut self) -> Result<usize, bpf::Error> {
            let before = self.links.len();
            self.links.retain(|_, s| *s != AttachmentState::Defunct);
            Ok((before - self.links.len()) * 2)
        }
    }

    /// A fake a test can look at while the daemon owns it.
    impl DatapathPort for std::sync::Arc<parking_lot::Mutex<FakeMaps>> {
        fn read_endpoints(&self) -> Result<BTreeMap<MapKey, bpf::Endpoint>, bpf::Error> {
            self.lock().read_endpoints()
        }

        fn write_endpoint(
            &mut self,
            ip: IpAddr,
            endpoint: bpf::Endpoint,
        ) -> Result<(), bpf::Error> {
            self.lock().write_endpoint(ip, endpoint)
        }

        fn delete_endpoint(&mut self, key: &MapKey) -> Result<bool, bpf::Error> {
            self.lock().delete_endpoint(key)
        }

        fn read_interfaces(&self) -> BTreeMap<u32, bpf::Interface> {
            self.lock().read_interfaces()
        }

        fn write_interface(&mut self, interface: bpf::Interface) -> Result<(), bpf::Error> {
            self.lock().write_interface(interface)
        }

        fn delete_interface(&mut self, ifindex: u32) -> Result<bool, bpf::Error> {
            self.lock().delete_interface(ifindex)
        }

        fn clear_interface_slot(&mut self, slot: u32) -> Result<(), bpf::Error> {
            self.lock().clear_interface_slot(slot)
        }

        fn attach(&mut self, interface: &str) -> Result<u32, bpf::Error> {
            self.lock().attach(interface)
        }

        fn detach(&mut self, interface: &str) -> Result<bool, bpf::Error> {
            self.lock().detach(interface)
        }

        fn attachments(&self) -> Result<Vec<Link>, bpf::Error> {
            self.lock().attachments()
        }

        fn prune_defunct(&mut self) -> Result<usize, bpf::Error> {
            self.lock().prune_defunct()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{fake::FakeMaps, *};

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap_or(IpAddr::from([0, 0, 0, 0]))
    }

    fn desired(entries: &[(&str, bpf::Endpoint)], interfaces: &[&str]) -> Desired {
        Desired {
            entries: entries.iter().map(|(i, e)| (ip(i), *e)).collect(),
            interfaces: interfaces.iter().map(|s| (*s).to_owned()).collect(),
            interface_identities: HashMap::new(),
        }
    }

    /// Interfaces with their INTERFACES identities (`None`: no single identity).
    fn with_identities(interfaces: &[(&str, Option<u32>)]) -> Desired {
        Desired {
            interfaces: interfaces.iter().map(|(i, _)| (*i).to_owned()).collect(),
            interface_identities: interfaces
                .iter()
                .filter_map(|(i, id)| Some(((*i).to_owned(), (*id)?)))
                .collect(),
            ..Desired::default()
        }
    }

    fn entries_of(maps: &FakeMaps) -> Vec<(String, Option<u32>)> {
        maps.interface_entries().into_iter().collect()
    }

    fn maps_with(interfaces: &[&str]) -> FakeMaps {
        FakeMaps {
            interfaces: interfaces.iter().map(|s| (*s).to_owned()).collect(),
            ..FakeMaps::default()
        }
    }

    #[test]
    fn full_pass_writes_what_is_missing_and_nothing_more() {
        let mut maps = maps_with(&["veth0"]);
        let mut r = Reconciler::default();
        let want = desired(
            &[
                ("198.18.1.2", bpf::Endpoint::local(300)),
                ("198.18.1.1", bpf::Endpoint::host()),
            ],
            &["veth0"],
        );
        let report = r.full_pass(&mut maps, &want, true);
        assert_eq!((report.written, report.repaired, report.removed), (2, 0, 0));
        assert_eq!(maps.entries.len(), 2);
        assert_eq!(maps.attaches, 1);

        let writes = maps.writes;
        let report = r.full_pass(&mut maps, &want, true);
        assert_eq!((report.written, report.repaired, report.removed), (0, 0, 0));
        assert_eq!(maps.writes, writes, "an unchanged datapath costs no write");
        assert_eq!(maps.attaches, 1, "nor an attach");
    }

    #[test]
    fn full_pass_repairs_changes_made_behind_its_back() {
        let mut maps = maps_with(&["veth0"]);
        let mut r = Reconciler::default();
        let want = desired(
            &[
                ("198.18.1.2", bpf::Endpoint::local(300)),
                ("198.18.2.2", bpf::Endpoint::local(301)),
            ],
            &["veth0"],
        );
        r.full_pass(&mut maps, &want, true);
        // Someone changes one entry, deletes another, adds a third, detaches a link.
        maps.entries
            .insert(MapKey::from(ip("198.18.1.2")), bpf::Endpoint::local(999));
        maps.entries.remove(&MapKey::from(ip("198.18.2.2")));
        maps.entries
            .insert(MapKey::from(ip("198.18.9.9")), bpf::Endpoint::local(5));
        maps.links.clear();

        let report = r.full_pass(&mut maps, &want, true);
        assert_eq!((report.repaired, report.removed), (2, 1));
        let entries: Vec<_> = maps
            .entries
            .iter()
            .map(|(k, e)| (k.ip(), e.identity))
            .collect();
        assert_eq!(
            entries,
            vec![(Some(ip("198.18.1.2")), 300), (Some(ip("198.18.2.2")), 301)]
        );
        assert_eq!(maps.attaches, 2, "the lost link is attached again");
    }

    #[test]
    fn nothing_is_removed_without_prune() {
        let mut maps = maps_with(&["veth0"]);
        maps.entries
            .insert(MapKey::from(ip("198.18.9.9")), bpf::Endpoint::local(5));
        maps.links
            .insert("old0".to_owned(), AttachmentState::Attached { ifindex: 3 });
        let mut r = Reconciler::default();
        let report = r.full_pass(&mut maps, &Desired::default(), false);
        assert_eq!(report.removed, 0);
        assert_eq!(maps.entries.len(), 1, "a previous run's entries stay");
        assert!(maps.links.contains_key("old0"), "and its links");

        let report = r.full_pass(&mut maps, &Desired::default(), true);
        assert_eq!(report.removed, 1);
        assert!(maps.entries.is_empty());
        assert!(maps.links.is_empty());
    }

    #[test]
    fn incremental_changes_touch_only_their_addresses() {
        let mut maps = maps_with(&[]);
        let mut r = Reconciler::default();
        let a = ip("198.18.1.2");
        let failures = r.apply_ips(&mut maps, [a], |_| Some(bpf::Endpoint::local(300)), true);
        assert!(failures.is_empty());
        assert_eq!(maps.writes, 1);
        r.apply_ips(&mut maps, [a], |_| Some(bpf::Endpoint::local(300)), true);
        assert_eq!(maps.writes, 1, "already written");
        r.apply_ips(&mut maps, [a], |_| None, true);
        assert!(maps.entries.is_empty());
        assert_eq!(r.entries(), 0);
    }

    #[test]
    fn missing_interfaces_are_reported_and_retried() {
        let mut maps = maps_with(&[]);
        let mut r = Reconciler::default();
        let want = desired(&[], &["veth0"]);
        let report = r.full_pass(&mut maps, &want, true);
        assert_eq!(report.interface_errors.len(), 1);
        assert!(
            report.interface_errors[0]
                .1
                .to_string()
                .contains("veth0 does not exist")
        );
        maps.interfaces.insert("veth0".to_owned());
        let report = r.full_pass(&mut maps, &want, true);
        assert!(report.interface_errors.is_empty());
        assert_eq!(maps.attaches, 1);
    }

    #[test]
    fn defunct_links_are_pruned() {
        let mut maps = maps_with(&["veth0"]);
        maps.links
            .insert("gone0".to_owned(), AttachmentState::Defunct);
        let mut r = Reconciler::default();
        let report = r.full_pass(&mut maps, &desired(&[], &["veth0"]), false);
        assert_eq!(report.pruned, 2);
        assert_eq!(maps.links.len(), 1);
    }

    #[test]
    fn interface_entries_follow_attachments_and_identities() {
        let mut maps = maps_with(&["veth0", "veth1"]);
        let mut r = Reconciler::default();
        let want = with_identities(&[("veth0", Some(300)), ("veth1", None)]);
        let report = r.full_pass(&mut maps, &want, true);
        assert!(report.interface_errors.is_empty(), "{report:?}");
        assert_eq!(
            entries_of(&maps),
            vec![("veth0".into(), Some(300)), ("veth1".into(), None)],
            "an interface without a single identity still has an entry"
        );
        let writes = maps.interface_writes;
        r.full_pass(&mut maps, &want, true);
        assert_eq!(
            maps.interface_writes, writes,
            "nothing changed, nothing written"
        );

        // veth0's endpoint gets a new identity, veth1's gets its first.
        let failures = r.apply_interfaces(
            &mut maps,
            ["veth0".to_owned(), "veth1".to_owned()],
            |_| true,
            |i| Some(if i == "veth0" { 301 } else { 400 }),
            true,
        );
        assert!(failures.is_empty(), "{failures:?}");
        assert_eq!(
            entries_of(&maps),
            vec![("veth0".into(), Some(301)), ("veth1".into(), Some(400))]
        );
        assert_eq!(
            maps.attaches, 2,
            "already attached: only the entries change"
        );

        // veth1's endpoint goes: its entry before its classifier.
        let failures =
            r.apply_interfaces(&mut maps, ["veth1".to_owned()], |_| false, |_| None, true);
        assert!(failures.is_empty(), "{failures:?}");
        assert_eq!(entries_of(&maps), vec![("veth0".into(), Some(301))]);
        assert!(!maps.links.contains_key("veth1"));
        assert_eq!(
            maps.unattached_entries, 0,
            "no entry without its classifier"
        );
    }

    #[test]
    fn interface_entries_changed_behind_its_back_are_repaired() {
        let mut maps = maps_with(&["veth0"]);
        let mut r = Reconciler::default();
        let want = with_identities(&[("veth0", Some(300))]);
        r.full_pass(&mut maps, &want, true);
        let ifindex = maps.ifindex("veth0");
        let slot = interface_slot(ifindex);
        // Someone rewrites veth0's entry, adds one for an interface census is not
        // on, and one in a slot that is not its interface's.
        maps.slots.insert(
            slot,
            bpf::Interface {
                ifindex,
                identity: Some(999),
            },
        );
        let stray = bpf::Interface {
            ifindex: 7,
            identity: Some(5),
        };
        maps.slots.insert(interface_slot(7), stray);
        maps.slots.insert(3, stray);

        let report = r.full_pass(&mut maps, &want, false);
        assert_eq!(
            (report.repaired, report.removed),
            (1, 0),
            "nothing removed before the first full set"
        );
        assert_eq!(maps.slots.len(), 3);

        let report = r.full_pass(&mut maps, &want, true);
        assert_eq!((report.repaired, report.removed), (0, 2));
        assert_eq!(entries_of(&maps), vec![("veth0".into(), Some(300))]);
        assert_eq!(maps.slots.len(), 1);
    }

    #[test]
    fn a_shared_slot_goes_to_the_first_interface_then_to_the_other() {
        let mut maps = maps_with(&["veth0", "veth1"]);
        maps.ifindexes.insert("veth0".into(), 5);
        maps.ifindexes
            .insert("veth1".into(), 5 + census_common::INTERFACES_MAX_ENTRIES);
        let mut r = Reconciler::default();
        let want = with_identities(&[("veth0", Some(300)), ("veth1", Some(301))]);
        let report = r.full_pass(&mut maps, &want, true);
        assert!(
            report.interface_errors.is_empty(),
            "not an error: {report:?}"
        );
        assert_eq!(entries_of(&maps), vec![("veth0".into(), Some(300))]);
        assert_eq!(r.crowded_interfaces(), 1, "veth1 is counted by address");
        assert!(maps.links.contains_key("veth1"), "and still attached");

        // veth0 goes; at the next pass veth1 has the slot.
        let want = with_identities(&[("veth1", Some(301))]);
        r.full_pass(&mut maps, &want, true);
        assert_eq!(entries_of(&maps), vec![("veth1".into(), Some(301))]);
        assert_eq!(r.crowded_interfaces(), 0);
        assert_eq!(maps.unattached_entries, 0);
    }

    #[test]
    fn a_lost_or_replaced_link_loses_its_entry_until_attached_again() {
        let mut maps = maps_with(&["veth0"]);
        let mut r = Reconciler::default();
        let want = with_identities(&[("veth0", Some(300))]);
        r.full_pass(&mut maps, &want, true);
        let old = maps.ifindex("veth0");

        // The interface is deleted and created again under the same name.
        maps.links.insert("veth0".into(), AttachmentState::Defunct);
        maps.ifindexes.insert("veth0".into(), 200);
        let report = r.full_pass(&mut maps, &want, false);
        assert!(report.interface_errors.is_empty(), "{report:?}");
        assert_eq!(
            maps.links.get("veth0"),
            Some(&AttachmentState::Attached { ifindex: 200 })
        );
        assert_eq!(entries_of(&maps), vec![("veth0".into(), Some(300))]);
        assert!(
            !maps.slots.values().any(|held| held.ifindex == old),
            "the old interface's entry is gone, also before the first full set"
        );
        assert_eq!(maps.unattached_entries, 0);
    }
}
