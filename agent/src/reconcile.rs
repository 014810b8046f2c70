//! Bringing the datapath to the desired state: ENDPOINTS entries (endpoints with
//! their identities, the node's own addresses flagged HOST) and the classifier's
//! attachments (one per endpoint interface).
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
    bpf::{self, AttachmentState, Datapath},
    metrics::{MapLabels, Metrics},
};

/// A raw ENDPOINTS key, as the map holds it.
pub type MapKey = bpf::EndpointKey;

/// One pinned link, as [`Maps::attachments`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub interface: String,
    pub state: AttachmentState,
}

/// What reconcile needs from the datapath; [`Datapath`] in production, a fake in tests.
pub trait Maps {
    fn read_endpoints(&self) -> Result<BTreeMap<MapKey, bpf::Endpoint>, bpf::Error>;
    fn write_endpoint(&mut self, ip: IpAddr, endpoint: bpf::Endpoint) -> Result<(), bpf::Error>;
    fn delete_endpoint(&mut self, key: &MapKey) -> Result<bool, bpf::Error>;
    /// Attaches (or adopts the pinned link on) both hooks of `interface`.
    fn attach(&mut self, interface: &str) -> Result<(), bpf::Error>;
    fn detach(&mut self, interface: &str) -> Result<bool, bpf::Error>;
    /// The pinned links, one per hook.
    fn attachments(&self) -> Result<Vec<Link>, bpf::Error>;
    /// Removes the pins of links whose interface is gone; how many.
    fn prune_defunct(&mut self) -> Result<usize, bpf::Error>;
}

impl Maps for Datapath {
    fn read_endpoints(&self) -> Result<BTreeMap<MapKey, bpf::Endpoint>, bpf::Error> {
        self.endpoints()
    }

    fn write_endpoint(&mut self, ip: IpAddr, endpoint: bpf::Endpoint) -> Result<(), bpf::Error> {
        self.upsert_endpoint(ip, endpoint)
    }

    fn delete_endpoint(&mut self, key: &MapKey) -> Result<bool, bpf::Error> {
        self.delete_endpoint_key(key)
    }

    fn attach(&mut self, interface: &str) -> Result<(), bpf::Error> {
        let outcomes = Datapath::attach(self, interface)?;
        for (direction, outcome) in outcomes {
            debug!(interface, %direction, ?outcome, "classifier attached");
        }
        Ok(())
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
}

/// What one full pass did.
#[derive(Debug, Default)]
pub struct PassReport {
    /// Entries that differed from what this agent had written (changed or deleted
    /// behind its back) and were rewritten.
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
    /// Interfaces attached (or adopted) by this process.
    attached: BTreeSet<String>,
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

    /// Brings the entries of `ips` to what `desired` says (`None`: no entry); the
    /// failures. Entries are removed only if `prune`.
    pub fn apply_ips<M: Maps + ?Sized>(
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
                    Err(error) => failures.push((ip, self.write_failed(error))),
                },
                None if prune => match maps.delete_endpoint(&MapKey::from(ip)) {
                    Ok(_) => {
                        self.written.remove(&ip);
                    }
                    Err(error) => failures.push((ip, self.write_failed(error))),
                },
                None => {}
            }
        }
        failures
    }

    /// Attaches the classifier to each of `interfaces` that `wanted` says, detaches it
    /// from the others (only if `prune`); the failures.
    pub fn apply_interfaces<M: Maps + ?Sized>(
        &mut self,
        maps: &mut M,
        interfaces: impl IntoIterator<Item = String>,
        wanted: impl Fn(&str) -> bool,
        prune: bool,
    ) -> Vec<(String, bpf::Error)> {
        let mut failures = Vec::new();
        for interface in interfaces {
            if wanted(&interface) {
                if self.attached.contains(&interface) {
                    continue;
                }
                match maps.attach(&interface) {
                    Ok(()) => {
                        info!(interface, "classifier attached");
                        self.attached.insert(interface);
                    }
                    Err(error) => {
                        self.metrics.attach_errors.inc();
                        failures.push((interface, error));
                    }
                }
            } else if prune {
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

    /// Compares the maps' actual content and the pinned links with `desired`, and
    /// repairs every difference.
    pub fn full_pass<M: Maps + ?Sized>(
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
                    .get_or_create(&MapLabels { map: "ENDPOINTS" })
                    .inc();
            }
        }
        self.repair_links(maps, desired, prune, &mut report);
        report
    }

    fn repair_entries<M: Maps + ?Sized>(
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
                    let error = self.write_failed(error);
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
                    let error = self.write_failed(error);
                    if let Some(ip) = key.ip() {
                        report.entry_errors.push((ip, error));
                    }
                }
            }
        }
        self.written
            .retain(|ip, _| desired.entries.contains_key(ip));
    }

    fn repair_links<M: Maps + ?Sized>(
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
        let mut in_place: BTreeMap<&str, usize> = BTreeMap::new();
        for link in &links {
            if matches!(link.state, AttachmentState::Attached { .. }) {
                *in_place.entry(link.interface.as_str()).or_default() += 1;
            }
        }
        for interface in &desired.interfaces {
            let complete = in_place.get(interface.as_str()).is_some_and(|&n| n >= 2);
            if complete && self.attached.contains(interface) {
                continue;
            }
            if !complete && self.attached.remove(interface) {
                warn!(
                    interface,
                    "the classifier's link is gone; attaching it again"
                );
            }
            let failures = self.apply_interfaces(maps, [interface.clone()], |_| true, false);
            report.interface_errors.extend(failures);
        }
        if prune {
            let unwanted: BTreeSet<String> = links
                .iter()
                .filter(|l| !desired.interfaces.contains(&l.interface))
                .map(|l| l.interface.clone())
                .collect();
            let failures = self.apply_interfaces(maps, unwanted, |_| false, true);
            report.interface_errors.extend(failures);
            self.attached.retain(|i| desired.interfaces.contains(i));
        }
    }

    fn write_failed(&self, error: bpf::Error) -> bpf::Error {
        self.metrics
            .map_write_errors
            .get_or_create(&MapLabels { map: "ENDPOINTS" })
            .inc();
        error
    }
}

/// An in-memory datapath, for tests: ENDPOINTS and pinned links, with interfaces
/// that exist or not.
#[cfg(test)]
pub(crate) mod fake {
    use super::*;

    #[derive(Debug, Default)]
    pub(crate) struct FakeMaps {
        pub(crate) entries: BTreeMap<MapKey, bpf::Endpoint>,
        /// Interface -> attached (two hooks each).
        pub(crate) links: BTreeMap<String, AttachmentState>,
        /// Interfaces that exist.
        pub(crate) interfaces: BTreeSet<String>,
        pub(crate) writes: usize,
        pub(crate) attaches: usize,
    }

    impl Maps for FakeMaps {
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

        fn attach(&mut self, interface: &str) -> Result<(), bpf::Error> {
            if !self.interfaces.contains(interface) {
                return Err(bpf::Error::InterfaceNotFound {
                    name: interface.to_owned(),
                    source: nix::Error::ENODEV,
                });
            }
            self.attaches += 1;
            self.links.insert(
                interface.to_owned(),
                AttachmentState::Attached { ifindex: 7 },
            );
            Ok(())
        }

        fn detach(&mut self, interface: &str) -> Result<bool, bpf::Error> {
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
    impl Maps for std::sync::Arc<parking_lot::Mutex<FakeMaps>> {
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

        fn attach(&mut self, interface: &str) -> Result<(), bpf::Error> {
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
        }
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
}
