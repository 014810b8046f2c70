//! INTERFACES: for each endpoint interface the classifier is attached to, the
//! identity of the endpoint behind it, in the slot of its ifindex.
//!
//! An entry exists only while the classifier is attached to both hooks of its
//! interface: it is written after attaching and removed before detaching
//! ([`classifier`](super::classifier)), because the egress program takes packets
//! that arrived through an interface with an entry as counted when they left it.
//! Two interfaces whose ifindexes share a slot: the first to get it keeps it, the
//! other is counted by address (as if it had no entry) until the slot is free.

use std::collections::BTreeMap;

use tracing::{debug, info, warn};

use super::{PassReport, Reconciler};
use crate::{
    agent_core::Desired,
    bpf::{self, Datapath, interface_slot},
};

const INTERFACES: &str = "INTERFACES";

/// INTERFACES as reconcile drives it.
pub(crate) trait InterfacesPort {
    /// The used slots, by slot.
    fn read_interfaces(&self) -> BTreeMap<u32, bpf::Interface>;
    /// Writes the entry of an interface; [`bpf::Error::InterfaceSlotTaken`] if
    /// another interface holds its slot.
    fn write_interface(&mut self, interface: bpf::Interface) -> Result<(), bpf::Error>;
    /// Removes interface `ifindex`'s entry, if its slot holds it.
    fn delete_interface(&mut self, ifindex: u32) -> Result<bool, bpf::Error>;
    /// Empties a slot, whatever it holds.
    fn clear_interface_slot(&mut self, slot: u32) -> Result<(), bpf::Error>;
}

impl InterfacesPort for Datapath {
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
}

impl Reconciler {
    /// Interfaces the classifier is attached to without an INTERFACES entry
    /// because another interface holds their slot: their packets are counted by
    /// address.
    #[cfg(test)]
    pub(super) fn crowded_interfaces(&self) -> usize {
        self.crowded.len()
    }

    /// Brings interface `ifindex`'s INTERFACES entry to `identity`. A slot held by
    /// another interface is not a failure: this one is counted by address.
    pub(super) fn write_interface<M: InterfacesPort + ?Sized>(
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
    pub(super) fn delete_interface<M: InterfacesPort + ?Sized>(
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

    /// Compares INTERFACES with the entries of the interfaces this agent attached
    /// and repairs every difference; removes the entries nothing wants (only if
    /// `prune`).
    pub(super) fn repair_interfaces<M: InterfacesPort + ?Sized>(
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
            self.prune_interfaces(maps, &want, &mut actual, report);
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

    /// Empties the slots of `actual` that hold no entry of `want` (or an entry
    /// out of its ifindex's slot), and forgets them in `actual`.
    fn prune_interfaces<M: InterfacesPort + ?Sized>(
        &mut self,
        maps: &mut M,
        want: &BTreeMap<u32, (String, Option<u32>)>,
        actual: &mut BTreeMap<u32, bpf::Interface>,
        report: &mut PassReport,
    ) {
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
}
