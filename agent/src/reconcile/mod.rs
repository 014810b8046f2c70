//! Bringing the datapath to the desired state, one map per module: ENDPOINTS
//! ([`endpoints`]: endpoints with their identities, the node's own addresses
//! flagged HOST, other nodes' endpoints REMOTE) and the NODES they name
//! ([`nodes`]), the classifier's attachments, one per endpoint interface
//! ([`classifier`]), and their INTERFACES entries, the identity of the endpoint
//! behind each ([`interfaces`]), the cluster's Service ranges in SERVICES
//! ([`services`]), and the node's own hooks ([`node_hooks`]). Each module has the
//! narrow port it drives the datapath through ([`EndpointsPort`],
//! [`NodesPort`], [`ClassifierPort`], [`InterfacesPort`], [`ServicesPort`],
//! [`NodeHooksPort`]); [`DatapathPort`] is all of them with [`PinsPort`].
//!
//! Changes are applied as they happen: the core's [`Effects`] say, for the addresses
//! and interfaces they touch, what each should be now ([`Reconciler::apply`]), and
//! what was done goes back to the core as one [`Reconciled`]. A periodic
//! [`Reconciler::full_pass`] reads the maps' actual content and the pinned links and
//! repairs whatever differs: entries changed or deleted behind the agent's back,
//! entries nobody wants, links of deleted interfaces, interfaces that lost their
//! program.
//!
//! The full pass first puts back the pins if they were removed under the agent
//! (`census-agent uninstall`), and reports the datapath broken while it cannot;
//! it also looks for programs attached in front of census's and reports them
//! (and, if asked, attaches census first again), and puts the node's own hooks
//! (uplinks, sockets) back where they are missing.
//!
//! Nothing is removed while `prune` is false: until the endpoint source has given
//! its first full set the agent does not know what is unwanted, and what the maps
//! hold (from a previous run of the agent) stays in force.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
    num::NonZeroU16,
};

use census_proto::domain::ServiceKind;
use ipnet::IpNet;
use tracing::warn;

pub(crate) use classifier::{ClassifierPort, attached_at_start};
pub(crate) use endpoints::{EndpointsPort, MapKey, adoptable};
pub(crate) use interfaces::InterfacesPort;
pub use node_hooks::NodeHooks;
pub(crate) use node_hooks::NodeHooksPort;
pub(crate) use nodes::{NodesPort, pinned_nodes};
pub(crate) use services::{ServicesPort, pinned_services};
use written::Written;

use crate::{
    agent_core::{
        DatapathError, DatapathHealth, Desired, Effects, MissingHook, NodeEntry, ProgramInFront,
        Reconciled,
    },
    bpf::{self, AttachmentState, Datapath},
    metrics::{MapLabels, Metrics},
};

/// One pinned link, as [`ClassifierPort::attachments`] and
/// [`NodeHooksPort::uplinks`] list them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Link {
    pub(crate) interface: String,
    pub(crate) state: AttachmentState,
}

/// The datapath's pins, which the full pass puts back first.
pub(crate) trait PinsPort {
    /// Pins again what was removed under the agent; whether anything was.
    fn ensure_pinned(&mut self) -> Result<bool, bpf::Error>;
}

impl PinsPort for Datapath {
    fn ensure_pinned(&mut self) -> Result<bool, bpf::Error> {
        Ok(!Datapath::ensure_pinned(self)?.is_empty())
    }
}

/// The whole datapath as reconcile drives it: every map's port and the pins;
/// [`Datapath`] in production, a fake in tests.
pub(crate) trait DatapathPort:
    EndpointsPort
    + NodesPort
    + ClassifierPort
    + InterfacesPort
    + ServicesPort
    + NodeHooksPort
    + PinsPort
{
}

impl<M> DatapathPort for M where
    M: EndpointsPort
        + NodesPort
        + ClassifierPort
        + InterfacesPort
        + ServicesPort
        + NodeHooksPort
        + PinsPort
        + ?Sized
{
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

    /// Carries out the datapath changes of `fx`; what was done, for the core.
    pub(crate) fn apply<M>(&mut self, maps: &mut M, fx: &Effects) -> Reconciled
    where
        M: EndpointsPort + NodesPort + ClassifierPort + InterfacesPort + ServicesPort + ?Sized,
    {
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
        self.repair_endpoints(maps, desired, prune, &mut report);
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
    pub(crate) fn link_pass<M: ClassifierPort + InterfacesPort + ?Sized>(
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

mod classifier;
mod endpoints;
mod interfaces;
mod node_hooks;
mod nodes;
mod services;
mod written;

#[cfg(test)]
pub(crate) mod fake;
#[cfg(test)]
mod map_tests;
#[cfg(test)]
mod service_tests;
#[cfg(test)]
mod tests;
