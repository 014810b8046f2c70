//! The core and reconcile on a real datapath, without the daemon's tasks: what the
//! reconcile-throughput benchmark (`benches/agent.rs`) drives, and all of the core
//! it sees.

use std::collections::HashMap;

use census_proto::{domain::IdentityId, labels::LabelSet};

use crate::{
    bpf::{self, Datapath},
    core::{AllocationEvent, AllocationId, Core, Effects},
    reconcile::Reconciler,
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
