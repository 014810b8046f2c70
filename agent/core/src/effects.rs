//! What the core asks of the shells: the datapath changes themselves, allocations
//! to start or cancel, reports for the operator; and the whole desired state, for a
//! full pass.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
    num::NonZeroU16,
};

use census_proto::domain::{Endpoint, EndpointKey, IdentityId, ServiceKind, ServiceSet};
use ipnet::IpNet;

use super::{AllocationId, AllocationRequest, NodeEntry};

/// The ENDPOINTS entry an address should have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Entry {
    /// An endpoint of this node behind an interface census is attached to.
    Local(IdentityId),
    /// An endpoint of this node whose host-side interface is unknown: no census
    /// program sees its packets leave it, so they must not be skipped where they
    /// enter another local endpoint.
    Unattached(IdentityId),
    /// One of the node's own addresses.
    Host,
    /// An endpoint of another node (or its address, identity `remote-node`), from
    /// the cluster-wide map; `node` is its NODES index.
    Remote { id: IdentityId, node: NonZeroU16 },
}

/// What an interface needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InterfaceChange {
    /// The classifier on both hooks, and an INTERFACES entry carrying `identity`:
    /// the one identity every endpoint behind it holds, `None` when there is no such
    /// single identity (its packets are looked up by address).
    Attach { identity: Option<IdentityId> },
    /// No classifier, no entry.
    Detach,
}

/// An allocation to start or to give up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Allocation {
    Start(AllocationRequest),
    /// No endpoint needs the label set any more.
    Cancel(AllocationId),
}

/// A change of what the agent holds, for the operator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Report {
    Upsert(Endpoint),
    Delete(EndpointKey),
    /// Every allocation numbered up to this one has been answered or given up,
    /// and the reports before this one carry each endpoint that took up its
    /// identity: what a Snapshot's `allocations_settled` says. The last report
    /// of its batch, and only when the number has grown.
    Settled(AllocationId),
}

/// What the shells must do after the events since the last [`super::Core::take_effects`].
#[derive(Debug, Default)]
pub struct Effects {
    pub allocations: Vec<Allocation>,
    pub reports: Vec<Report>,
    /// The ENDPOINTS entries that may have changed, as they should be now (`None`: no
    /// entry).
    pub entries: BTreeMap<IpAddr, Option<Entry>>,
    /// The interfaces that may have changed, as they should be now.
    pub interfaces: BTreeMap<String, InterfaceChange>,
    /// Whether a `None` entry and a `Detach` remove what the datapath holds: not
    /// before the source's first full set, when the agent does not know yet what is
    /// unwanted (a previous run's entries stay in force).
    pub prune: bool,
    /// The NODES entries that may have changed, as they should be now (`None`: no
    /// entry). Written before the entries, removed after them.
    pub nodes: BTreeMap<NonZeroU16, Option<NodeEntry>>,
    /// Whether a `None` entry removes a REMOTE entry: once the cluster-wide map
    /// has completed a resync since start (or the agent is local-only). Until then
    /// the remote entries and nodes pinned by a previous run stay in force.
    pub prune_remote: bool,
    /// The SERVICES entries that changed, as they should be now (`None`: no entry).
    pub services: BTreeMap<IpNet, Option<ServiceKind>>,
}

impl Effects {
    pub fn is_empty(&self) -> bool {
        self.allocations.is_empty()
            && self.reports.is_empty()
            && self.entries.is_empty()
            && self.interfaces.is_empty()
            && self.nodes.is_empty()
            && self.services.is_empty()
    }

    /// `later`'s effects after these: a change of the same address or interface is
    /// the later one.
    pub fn merge(&mut self, later: Effects) {
        let Effects {
            allocations,
            reports,
            entries,
            interfaces,
            prune,
            nodes,
            prune_remote,
            services,
        } = later;
        self.services.extend(services);
        self.allocations.extend(allocations);
        self.reports.extend(reports);
        self.entries.extend(entries);
        self.interfaces.extend(interfaces);
        self.nodes.extend(nodes);
        self.prune = prune;
        self.prune_remote = prune_remote;
    }

    /// The label sets whose allocation starts.
    pub fn started(&self) -> impl Iterator<Item = &AllocationRequest> {
        self.allocations.iter().filter_map(|a| match a {
            Allocation::Start(request) => Some(request),
            Allocation::Cancel(_) => None,
        })
    }
}

/// The state the datapath should be in, for a full pass.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Desired {
    pub entries: HashMap<IpAddr, Entry>,
    pub interfaces: BTreeSet<String>,
    /// The interfaces of `interfaces` behind which every endpoint holds one same
    /// identity, and that identity: their INTERFACES entries carry it. The others'
    /// entries carry none (the program looks addresses up).
    pub interface_identities: HashMap<String, IdentityId>,
    /// The NODES entries the REMOTE entries name.
    pub nodes: BTreeMap<NonZeroU16, NodeEntry>,
    /// Whether the remote part is the whole truth (see [`Effects::prune_remote`]):
    /// only then are REMOTE entries and nodes it lacks removed.
    pub remote_complete: bool,
    /// What SERVICES should hold; `None` until the operator has said (then
    /// SERVICES is left as it is).
    pub services: Option<ServiceSet>,
}
