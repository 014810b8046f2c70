//! ENDPOINTS: an entry per address, for the endpoints of this node (LOCAL once the
//! classifier is attached to their interface, without the flag until then), the
//! node's own addresses (HOST) and the endpoints of other nodes (REMOTE, naming
//! their node's NODES entry).
//!
//! A change is written only where it differs from what this agent wrote
//! ([`Written`](super::written::Written)); the full pass reads the whole map and
//! repairs every difference.

use std::{
    collections::{BTreeMap, HashMap},
    net::IpAddr,
};

use tracing::{debug, warn};

use super::{PassReport, Reconciler, nodes::NodesPort};
use crate::{
    agent_core::{Desired, Effects, Entry},
    bpf::{self, Datapath},
    metrics::MapLabels,
};

pub(super) const ENDPOINTS: &str = "ENDPOINTS";

/// A raw ENDPOINTS key, as the map holds it.
pub(crate) type MapKey = bpf::EndpointKey;

/// ENDPOINTS as reconcile drives it.
pub(crate) trait EndpointsPort {
    /// Every entry, by key.
    fn read_endpoints(&self) -> Result<BTreeMap<MapKey, bpf::Endpoint>, bpf::Error>;
    /// The entry of `ip`, if any.
    fn read_endpoint(&self, ip: IpAddr) -> Result<Option<bpf::Endpoint>, bpf::Error>;
    /// Writes (creates or replaces) the entry of `ip`.
    fn write_endpoint(&mut self, ip: IpAddr, endpoint: bpf::Endpoint) -> Result<(), bpf::Error>;
    /// Removes the entry of `key`; `false` if there was none.
    fn delete_endpoint(&mut self, key: &MapKey) -> Result<bool, bpf::Error>;
}

impl EndpointsPort for Datapath {
    fn read_endpoints(&self) -> Result<BTreeMap<MapKey, bpf::Endpoint>, bpf::Error> {
        self.endpoints()
    }

    fn read_endpoint(&self, ip: IpAddr) -> Result<Option<bpf::Endpoint>, bpf::Error> {
        self.endpoint(ip)
    }

    fn write_endpoint(&mut self, ip: IpAddr, endpoint: bpf::Endpoint) -> Result<(), bpf::Error> {
        self.upsert_endpoint(ip, endpoint)
    }

    fn delete_endpoint(&mut self, key: &MapKey) -> Result<bool, bpf::Error> {
        self.delete_endpoint_key(key)
    }
}

/// The ENDPOINTS entry of `entry`.
fn to_map(entry: Entry) -> bpf::Endpoint {
    match entry {
        Entry::Local(id) => bpf::Endpoint::local(id.get()),
        Entry::Unattached(id) => bpf::Endpoint::unattached(id.get()),
        Entry::Host => bpf::Endpoint::host(),
        Entry::Remote { id, node } => bpf::Endpoint::remote(id.get(), node),
    }
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

impl Reconciler {
    /// ENDPOINTS entries of this node written by this agent.
    #[cfg(test)]
    pub(super) fn entries(&self) -> usize {
        self.written.local_len()
    }

    /// The ENDPOINTS changes of `fx`, with the NODES changes they need; the
    /// failures.
    pub(crate) fn apply_entries<M: EndpointsPort + NodesPort + ?Sized>(
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

    /// Brings each entry to what it should be (`None`: no entry); the failures.
    /// Entries are removed only if `prune` (REMOTE ones: if `prune_remote`).
    fn write_entries<M: EndpointsPort + ?Sized>(
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
    fn removal<M: EndpointsPort + ?Sized>(
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

    /// Reads ENDPOINTS and brings it to `desired`: writes what it lacks or holds
    /// otherwise, removes what nothing wants (see [`Self::repair_entries`]).
    pub(super) fn repair_endpoints<M: EndpointsPort + ?Sized>(
        &mut self,
        maps: &mut M,
        desired: &Desired,
        prune: bool,
        report: &mut PassReport,
    ) {
        match maps.read_endpoints() {
            Ok(actual) => self.repair_entries(maps, desired, prune, &actual, report),
            Err(error) => {
                warn!(%error, "cannot read ENDPOINTS; the full pass skips the entries");
                self.metrics
                    .map_write_errors
                    .get_or_create(&MapLabels { map: ENDPOINTS })
                    .inc();
            }
        }
    }

    /// Writes the entries of `desired` that `actual` lacks or holds otherwise;
    /// removes the others: REMOTE ones once the map is whole, the rest if `prune`.
    fn repair_entries<M: EndpointsPort + ?Sized>(
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
}
