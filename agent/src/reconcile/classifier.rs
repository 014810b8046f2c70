//! The classifier's links: one per hook (ingress and egress) on each endpoint's
//! interface, pinned so that they survive the agent, with the interface's
//! INTERFACES entry ([`interfaces`](super::interfaces)) written after attaching
//! and removed before detaching.
//!
//! An address is LOCAL in ENDPOINTS only once the classifier is attached to its
//! interface: until then (or when attaching fails) the core writes it without, as
//! it is seen from outside, so the hook of whatever it talks to counts its
//! packets. Each [`Reconciled`](crate::agent_core::Reconciled) says which of the
//! interfaces it touched are attached.
//!
//! The full pass drops the links of deleted interfaces, attaches the classifier
//! again where a link is gone, detaches it from interfaces nothing wants (only
//! once the endpoint source has given its first full set), and looks for programs
//! attached in front of census's and reports them (and, if asked, attaches census
//! first again).

use std::collections::{BTreeMap, BTreeSet};

use census_proto::domain::IdentityId;
use tracing::{debug, info, warn};

use super::{Link, PassReport, Reconciler, interfaces::InterfacesPort};
use crate::{
    agent_core::{Desired, Effects, HookDirection, InterfaceChange, ProgramInFront},
    bpf::{self, AttachmentState, Datapath},
};

/// The classifier's links as reconcile drives them.
pub(crate) trait ClassifierPort {
    /// Attaches (or adopts the pinned link on) both hooks of `interface`; its
    /// ifindex.
    fn attach(&mut self, interface: &str) -> Result<u32, bpf::Error>;
    /// Detaches both hooks of `interface`, its INTERFACES entry first; `false` if
    /// they were not there.
    fn detach(&mut self, interface: &str) -> Result<bool, bpf::Error>;
    /// The pinned links of endpoints' interfaces, one per hook.
    fn attachments(&self) -> Result<Vec<Link>, bpf::Error>;
    /// Removes the pins of links whose interface is gone; how many.
    fn prune_defunct(&mut self) -> Result<usize, bpf::Error>;
    /// The programs that run before census's on `interface`.
    fn in_front(&self, interface: &str) -> Result<Vec<bpf::InFront>, bpf::Error>;
}

impl ClassifierPort for Datapath {
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
        // Endpoints' interfaces only: the uplinks' hooks are not the classifier's.
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

    fn in_front(&self, interface: &str) -> Result<Vec<bpf::InFront>, bpf::Error> {
        Datapath::in_front(self, interface)
    }
}

/// The interfaces with both hooks attached at start (a previous run's links): the
/// core keeps their addresses LOCAL while reconcile adopts them.
pub(crate) fn attached_at_start<M: ClassifierPort + ?Sized>(maps: &M) -> BTreeSet<String> {
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

impl Reconciler {
    /// The attachments and INTERFACES changes of `fx`; the failures.
    pub(crate) fn apply_interfaces_of<M: ClassifierPort + InterfacesPort + ?Sized>(
        &mut self,
        maps: &mut M,
        fx: &Effects,
    ) -> Vec<(String, bpf::Error)> {
        let changes = fx.interfaces.iter().map(|(i, c)| (i.clone(), *c));
        self.apply_interfaces(maps, changes, fx.prune)
    }

    /// Attaches the classifier to each interface to attach and brings its
    /// INTERFACES entry to its identity, detaches it from the others (only if
    /// `prune`); the failures.
    pub(super) fn apply_interfaces<M: ClassifierPort + InterfacesPort + ?Sized>(
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

    /// Drops the links of deleted interfaces, attaches the classifier where
    /// `desired` wants it and it is not (or not where this agent attached it),
    /// and detaches it from the interfaces nothing wants (only if `prune`).
    pub(super) fn repair_links<M: ClassifierPort + InterfacesPort + ?Sized>(
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

    /// Finds programs attached in front of census's on the interfaces it is
    /// attached to; warns once about each; attaches census first again if asked.
    pub(super) fn check_order<M: ClassifierPort + InterfacesPort + ?Sized>(
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
                self.attach_first(maps, desired, interface, report);
            }
        }
        report.in_front = found;
    }

    /// Detaches the classifier from `interface` and attaches it again, in front
    /// of the programs attached since.
    fn attach_first<M: ClassifierPort + InterfacesPort + ?Sized>(
        &mut self,
        maps: &mut M,
        desired: &Desired,
        interface: String,
        report: &mut PassReport,
    ) {
        let Some(ifindex) = self.attached.get(&interface).copied() else {
            return;
        };
        // Its entry goes before the classifier is detached and attached first again.
        if let Err(error) = self.delete_interface(maps, ifindex) {
            report.interface_errors.push((interface, error));
            return;
        }
        if let Err(error) = maps.detach(&interface) {
            report.interface_errors.push((interface, error));
            return;
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
