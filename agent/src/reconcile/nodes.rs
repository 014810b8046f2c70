//! NODES: node index -> the node's name and addresses, for the REMOTE entries of
//! ENDPOINTS that name it. A node is written before the entries naming it and
//! removed after them; the full pass repairs the nodes before the entries and
//! removes the unwanted ones after them, once the endpoint map is whole.

use std::{collections::BTreeMap, net::IpAddr, num::NonZeroU16};

use census_proto::domain::NodeName;
use tracing::{debug, warn};

use super::{PassReport, Reconciler};
use crate::{
    agent_core::{Desired, NodeEntry},
    bpf::{self, Datapath},
};

const NODES: &str = "NODES";

/// NODES as reconcile drives it.
pub(crate) trait NodesPort {
    /// Every entry, by index.
    fn read_nodes(&self) -> Result<BTreeMap<u16, bpf::NodeRecord>, bpf::Error>;
    /// Writes (creates or replaces) the entry of node `index`: its name (at most
    /// 253 bytes) and addresses (at most 16).
    fn write_node(
        &mut self,
        index: NonZeroU16,
        name: &str,
        addresses: &[IpAddr],
    ) -> Result<(), bpf::Error>;
    /// Removes the entry of node `index`; `false` if there was none.
    fn delete_node(&mut self, index: NonZeroU16) -> Result<bool, bpf::Error>;
}

impl NodesPort for Datapath {
    fn read_nodes(&self) -> Result<BTreeMap<u16, bpf::NodeRecord>, bpf::Error> {
        self.nodes()
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
}

/// The nodes NODES holds (a previous run's, at start), for the core to keep
/// their indexes; entries whose name is not a node name are left out.
pub(crate) fn pinned_nodes<M: NodesPort + ?Sized>(maps: &M) -> Vec<(NonZeroU16, NodeName)> {
    let Ok(nodes) = maps.read_nodes() else {
        return Vec::new();
    };
    nodes
        .into_iter()
        .filter_map(|(index, record)| {
            let name = NodeName::new(&record.name).ok()?;
            Some((NonZeroU16::new(index)?, name))
        })
        .collect()
}

/// Whether NODES' `record` is `want`.
fn same_node(record: &bpf::NodeRecord, want: &NodeEntry) -> bool {
    record.name == want.name.as_str() && record.addresses == want.addresses
}

impl Reconciler {
    /// Writes the NODES entries that differ from what this agent wrote.
    pub(super) fn write_nodes<'a, M: NodesPort + ?Sized>(
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

    pub(super) fn delete_nodes<M: NodesPort + ?Sized>(
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

    /// Writes the NODES entries `desired` names that NODES lacks or holds
    /// otherwise; what NODES held, if it could be read.
    pub(super) fn repair_nodes<M: NodesPort + ?Sized>(
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
    pub(super) fn prune_nodes<M: NodesPort + ?Sized>(
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
}
