//! The core and reconcile on a real datapath, without the daemon's tasks: what the
//! reconcile-throughput benchmark (`benches/agent.rs`) drives, and all of the core
//! it sees; and the cluster-wide endpoint map in the core and reconcile, for the
//! memory measurement (`tests/map_memory.rs`).

use std::{
    collections::{BTreeMap, HashMap},
    net::IpAddr,
    num::{NonZeroU16, NonZeroU32},
};

use ipnet::IpNet;

use census_proto::{
    domain::{IdentityId, NodeName},
    labels::LabelSet,
};

use crate::{
    agent_core::{
        AllocationEvent, AllocationId, Core, Effects, MapBatch, MapEntry, MapEvent, MapNode,
    },
    bpf::{self, Datapath, ServiceKind},
    reconcile::{
        ClassifierPort, EndpointsPort, InterfacesPort, Link, MapKey, NodesPort, Reconciler,
        ServicesPort,
    },
    source::SourceEvent,
};

/// The agent's core and reconciler on `datapath`, driven by hand.
#[derive(Debug)]
pub struct Reconcile {
    core: Core,
    reconciler: Reconciler,
    datapath: Datapath,
    /// Effects taken from the core and not carried out yet.
    pending: Effects,
    requests: HashMap<LabelSet, AllocationId>,
}

/// What a full pass did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PassCounts {
    pub written: usize,
    pub repaired: usize,
    pub removed: usize,
}

impl Reconcile {
    pub fn new(datapath: Datapath) -> Self {
        Self {
            core: Core::new(HashMap::new()),
            reconciler: Reconciler::default(),
            datapath,
            pending: Effects::default(),
            requests: HashMap::new(),
        }
    }

    /// The core takes `event`; the label sets it asks the operator for.
    pub fn source(&mut self, event: SourceEvent) -> Vec<LabelSet> {
        self.core.on_source(event);
        self.take();
        let started: Vec<_> = self.pending.started().cloned().collect();
        started
            .into_iter()
            .map(|request| {
                self.requests.insert(request.labels.clone(), request.id);
                request.labels
            })
            .collect()
    }

    /// The operator answers `id` for `labels`.
    pub fn allocated(&mut self, labels: &LabelSet, id: IdentityId) {
        let request = self
            .requests
            .get(labels)
            .copied()
            .unwrap_or(AllocationId::NONE);
        self.core.on_allocation(AllocationEvent::Allocated {
            request,
            labels: labels.clone(),
            id,
        });
    }

    /// Writes the ENDPOINTS changes of every event so far; the first failure.
    pub fn write_entries(&mut self) -> Result<(), bpf::Error> {
        self.take();
        let failures = self
            .reconciler
            .apply_entries(&mut self.datapath, &self.pending);
        failures.into_iter().next().map_or(Ok(()), |(_, e)| Err(e))
    }

    /// Attaches the classifier and writes the INTERFACES entries the events so far
    /// ask for; the first failure. The effects are done with.
    pub fn attach_interfaces(&mut self) -> Result<(), bpf::Error> {
        self.take();
        let failures = self
            .reconciler
            .apply_interfaces_of(&mut self.datapath, &self.pending);
        self.pending = Effects::default();
        failures.into_iter().next().map_or(Ok(()), |(_, e)| Err(e))
    }

    /// A full pass over the whole desired state.
    pub fn full_pass(&mut self) -> PassCounts {
        let desired = self.core.desired();
        let report = self
            .reconciler
            .full_pass(&mut self.datapath, &desired, self.core.synced());
        PassCounts {
            written: report.written,
            repaired: report.repaired,
            removed: report.removed,
        }
    }

    fn take(&mut self) {
        let later = self.core.take_effects();
        self.pending.merge(later);
    }
}

/// The cluster-wide endpoint map in the agent's core and reconcile, on a datapath
/// that keeps nothing: what the agent's userspace holds per remote entry
/// (`tests/map_memory.rs` measures it).
#[derive(Debug)]
pub struct RemoteMap {
    core: Core,
    reconciler: Reconciler,
    datapath: Discard,
}

impl Default for RemoteMap {
    fn default() -> Self {
        Self::new()
    }
}

impl RemoteMap {
    /// An agent on node `bench-own`.
    pub fn new() -> Self {
        let own = NodeName::new("bench-own").ok();
        let core = Core::new(HashMap::new());
        Self {
            core: match own {
                Some(own) => core.with_node(own, []),
                None => core,
            },
            reconciler: Reconciler::default(),
            datapath: Discard,
        }
    }

    /// One full map, as one resync batch carried to the datapath: `nodes` nodes
    /// (operator indexes `1..=nodes`, named `node-<index>`) and `entries`
    /// (address, identity, operator node index).
    pub fn resync(&mut self, nodes: u32, entries: impl IntoIterator<Item = (IpAddr, u32, u32)>) {
        let nodes = (1..=nodes)
            .filter_map(|i| {
                Some(MapNode {
                    index: NonZeroU32::new(i)?,
                    name: NodeName::new(&format!("node-{i}")).ok()?,
                })
            })
            .collect();
        let upserts = entries
            .into_iter()
            .filter_map(|(ip, identity, node)| {
                Some(MapEntry {
                    ip,
                    identity: IdentityId::new(identity)?,
                    node: NonZeroU32::new(node)?,
                })
            })
            .collect();
        self.core.on_map(MapEvent::Batch(MapBatch {
            resync_start: true,
            resync_end: true,
            nodes,
            upserts,
            ..MapBatch::default()
        }));
        let fx = self.core.take_effects();
        let done = self.reconciler.apply(&mut self.datapath, &fx);
        self.core.on_reconciled(done);
    }

    /// The remote entries in force, and the ENDPOINTS entries reconcile wrote.
    pub fn entries(&self) -> (u64, u64) {
        let status = self.core.status();
        (
            status.map.remote + status.map.remote_node,
            status.map_entries,
        )
    }
}

/// A datapath of the maps [`Reconciler::apply`] writes, that takes every write and
/// keeps nothing.
#[derive(Debug)]
struct Discard;

impl EndpointsPort for Discard {
    fn read_endpoints(&self) -> Result<BTreeMap<MapKey, bpf::Endpoint>, bpf::Error> {
        Ok(BTreeMap::new())
    }

    fn read_endpoint(&self, _: IpAddr) -> Result<Option<bpf::Endpoint>, bpf::Error> {
        Ok(None)
    }

    fn write_endpoint(&mut self, _: IpAddr, _: bpf::Endpoint) -> Result<(), bpf::Error> {
        Ok(())
    }

    fn delete_endpoint(&mut self, _: &MapKey) -> Result<bool, bpf::Error> {
        Ok(true)
    }
}

impl NodesPort for Discard {
    fn read_nodes(&self) -> Result<BTreeMap<u16, bpf::NodeRecord>, bpf::Error> {
        Ok(BTreeMap::new())
    }

    fn write_node(&mut self, _: NonZeroU16, _: &str, _: &[IpAddr]) -> Result<(), bpf::Error> {
        Ok(())
    }

    fn delete_node(&mut self, _: NonZeroU16) -> Result<bool, bpf::Error> {
        Ok(true)
    }
}

impl ServicesPort for Discard {
    fn read_services(&self) -> Result<BTreeMap<IpNet, ServiceKind>, bpf::Error> {
        Ok(BTreeMap::new())
    }

    fn write_service(&mut self, _: IpNet, _: ServiceKind) -> Result<(), bpf::Error> {
        Ok(())
    }

    fn delete_service(&mut self, _: IpNet) -> Result<bool, bpf::Error> {
        Ok(true)
    }
}

impl InterfacesPort for Discard {
    fn read_interfaces(&self) -> BTreeMap<u32, bpf::Interface> {
        BTreeMap::new()
    }

    fn write_interface(&mut self, _: bpf::Interface) -> Result<(), bpf::Error> {
        Ok(())
    }

    fn delete_interface(&mut self, _: u32) -> Result<bool, bpf::Error> {
        Ok(true)
    }

    fn clear_interface_slot(&mut self, _: u32) -> Result<(), bpf::Error> {
        Ok(())
    }
}

impl ClassifierPort for Discard {
    fn attach(&mut self, _: &str) -> Result<u32, bpf::Error> {
        Ok(1)
    }

    fn detach(&mut self, _: &str) -> Result<bool, bpf::Error> {
        Ok(true)
    }

    fn attachments(&self) -> Result<Vec<Link>, bpf::Error> {
        Ok(Vec::new())
    }

    fn prune_defunct(&mut self) -> Result<usize, bpf::Error> {
        Ok(0)
    }

    fn in_front(&self, _: &str) -> Result<Vec<bpf::InFront>, bpf::Error> {
        Ok(Vec::new())
    }
}
