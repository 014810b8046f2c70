//! The cluster-wide endpoint map as this agent holds it: every other node's
//! endpoints and addresses (`IP -> identity, node`), and the nodes they name.
//!
//! - Entries of this node are dropped (its own sources are the truth here); an
//!   entry that moves to this node drops the claim held for its address.
//! - A resync (`resync_start` .. `resync_end`) replaces everything: entries it does
//!   not list are swept at its end, not before, so a stream that breaks in the
//!   middle leaves the last complete map in force (fail-static).
//! - Nodes get a local index (the NODES key written with each REMOTE entry), kept
//!   per node **name**: the operator's index is taken as it is when it fits and is
//!   free, but an operator that renumbers its nodes (after a restart) never makes
//!   a pinned entry name the wrong node. Nodes pinned by a previous run keep their
//!   index, and stay until the first completed resync says they are unused.
//! - Storage is compact: one table per address family of 8-byte claims, no
//!   string per entry.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    num::{NonZeroU16, NonZeroU32},
};

use census_proto::domain::{IdentityId, NodeName};
use tracing::{debug, warn};

use super::{MapBatch, MapEntry, MapNode};

/// What NODES holds for one node at most: its first addresses, in order.
pub(crate) const NODE_ADDRESSES_MAX: usize = 16;

/// One remote claim as the agent keeps it (8 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    id: IdentityId,
    node: NonZeroU16,
    /// Listed by the resync in progress (or since the last one).
    seen: bool,
}

/// Address -> claim, one table per family: an IPv4 entry costs 12 bytes of table
/// (plus the table's control byte and slack), not the 28 of an `IpAddr` key.
#[derive(Debug, Default)]
struct Claims {
    v4: HashMap<Ipv4Addr, Slot>,
    v6: HashMap<Ipv6Addr, Slot>,
}

impl Claims {
    fn get(&self, ip: IpAddr) -> Option<&Slot> {
        match ip {
            IpAddr::V4(v4) => self.v4.get(&v4),
            IpAddr::V6(v6) => self.v6.get(&v6),
        }
    }

    fn insert(&mut self, ip: IpAddr, slot: Slot) -> Option<Slot> {
        match ip {
            IpAddr::V4(v4) => self.v4.insert(v4, slot),
            IpAddr::V6(v6) => self.v6.insert(v6, slot),
        }
    }

    fn remove(&mut self, ip: IpAddr) -> Option<Slot> {
        match ip {
            IpAddr::V4(v4) => self.v4.remove(&v4),
            IpAddr::V6(v6) => self.v6.remove(&v6),
        }
    }

    fn len(&self) -> usize {
        self.v4.len() + self.v6.len()
    }

    fn iter(&self) -> impl Iterator<Item = (IpAddr, Slot)> + '_ {
        let v4 = self.v4.iter().map(|(ip, s)| (IpAddr::V4(*ip), *s));
        let v6 = self.v6.iter().map(|(ip, s)| (IpAddr::V6(*ip), *s));
        v4.chain(v6)
    }

    fn slots_mut(&mut self) -> impl Iterator<Item = &mut Slot> {
        self.v4.values_mut().chain(self.v6.values_mut())
    }
}

/// A node of the map, as this agent indexes it.
#[derive(Debug)]
struct Node {
    name: NodeName,
    /// Its addresses (its `remote-node` entries).
    addresses: BTreeSet<IpAddr>,
    /// Claims naming it.
    refs: u32,
    /// Its index in the current stream, if the stream named it.
    operator: Option<NonZeroU32>,
}

/// One NODES entry as it should be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeEntry {
    pub name: NodeName,
    /// At most [`NODE_ADDRESSES_MAX`], sorted.
    pub addresses: Vec<IpAddr>,
}

/// What a batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MapApplied {
    /// Addresses whose claim changed (written, replaced or removed).
    pub changed: usize,
    /// Entries skipped: they name a node the stream never announced, or one no
    /// local index is left for.
    pub skipped: usize,
}

/// See the module documentation.
#[derive(Debug, Default)]
pub(crate) struct RemoteMap {
    /// This node's name: the entries of the node of that name are not kept.
    own: Option<NodeName>,
    /// The current stream's index of this node.
    own_index: Option<NonZeroU32>,
    claims: Claims,
    /// Claims of identity `remote-node` (node addresses).
    node_addresses: usize,
    nodes: BTreeMap<NonZeroU16, Node>,
    by_name: HashMap<NodeName, NonZeroU16>,
    by_operator: HashMap<NonZeroU32, NonZeroU16>,
    /// A resync began and has not ended.
    resyncing: bool,
    /// A resync has completed since start (or the agent is local-only): what the
    /// map lacks may be removed from the datapath.
    complete: bool,
    resyncs: u64,
    /// The last batch's version.
    version: u64,
}

impl RemoteMap {
    pub(crate) fn new(own: Option<NodeName>) -> Self {
        Self {
            own,
            ..Self::default()
        }
    }

    /// The nodes NODES held at start (a previous run's): they keep their index, so
    /// the entries pinned with it keep naming them.
    pub(crate) fn seed_nodes(&mut self, pinned: impl IntoIterator<Item = (NonZeroU16, NodeName)>) {
        for (index, name) in pinned {
            if self.own.as_ref() == Some(&name) || self.by_name.contains_key(&name) {
                continue;
            }
            self.by_name.insert(name.clone(), index);
            self.nodes.insert(
                index,
                Node {
                    name,
                    addresses: BTreeSet::new(),
                    refs: 0,
                    operator: None,
                },
            );
        }
    }

    pub(crate) fn complete(&self) -> bool {
        self.complete
    }

    pub(crate) fn resyncs(&self) -> u64 {
        self.resyncs
    }

    pub(crate) fn version(&self) -> u64 {
        self.version
    }

    pub(crate) fn len(&self) -> usize {
        self.claims.len()
    }

    pub(crate) fn node_addresses(&self) -> usize {
        self.node_addresses
    }

    pub(crate) fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// The claim held for `ip`.
    pub(crate) fn get(&self, ip: IpAddr) -> Option<(IdentityId, NonZeroU16)> {
        self.claims.get(ip).map(|s| (s.id, s.node))
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (IpAddr, IdentityId, NonZeroU16)> + '_ {
        self.claims.iter().map(|(ip, s)| (ip, s.id, s.node))
    }

    /// The NODES entry node `index` should have.
    pub(crate) fn node(&self, index: NonZeroU16) -> Option<NodeEntry> {
        let node = self.nodes.get(&index)?;
        Some(NodeEntry {
            name: node.name.clone(),
            addresses: node
                .addresses
                .iter()
                .take(NODE_ADDRESSES_MAX)
                .copied()
                .collect(),
        })
    }

    pub(crate) fn nodes(&self) -> impl Iterator<Item = (NonZeroU16, NodeEntry)> + '_ {
        self.nodes
            .keys()
            .filter_map(|index| Some((*index, self.node(*index)?)))
    }

    /// Applies one batch; the addresses and nodes that may have changed go to
    /// `ips` and `nodes`.
    pub(crate) fn apply(
        &mut self,
        batch: MapBatch,
        ips: &mut BTreeSet<IpAddr>,
        nodes: &mut BTreeSet<NonZeroU16>,
    ) -> MapApplied {
        let MapBatch {
            resync_start,
            resync_end,
            nodes: announced,
            upserts,
            removes,
            removed_nodes,
            built_at_ms: _,
            version,
            // The core's, not the map's.
            services: _,
        } = batch;
        self.version = version;
        let mut applied = MapApplied::default();
        if resync_start {
            self.start_resync();
        }
        for node in announced {
            self.announce(node, nodes);
        }
        for entry in upserts {
            self.upsert(entry, ips, nodes, &mut applied);
        }
        for ip in removes {
            if self.remove(ip, nodes) {
                ips.insert(ip);
                applied.changed += 1;
            }
        }
        for index in removed_nodes {
            if let Some(local) = self.by_operator.remove(&index)
                && let Some(node) = self.nodes.get_mut(&local)
            {
                node.operator = None;
            }
            if self.own_index == Some(index) {
                self.own_index = None;
            }
        }
        if resync_end && self.resyncing {
            applied.changed += self.end_resync(ips, nodes);
        } else if resync_end {
            debug!("a resync end without its start; ignored");
        }
        if self.complete {
            self.collect_nodes(nodes);
        }
        applied
    }

    /// The agent is local-only (no map, or an operator without one): every claim
    /// goes, and the (empty) map is complete.
    pub(crate) fn local_only(
        &mut self,
        ips: &mut BTreeSet<IpAddr>,
        nodes: &mut BTreeSet<NonZeroU16>,
    ) -> usize {
        self.start_resync();
        let changed = self.end_resync(ips, nodes);
        self.collect_nodes(nodes);
        changed
    }

    fn start_resync(&mut self) {
        self.resyncing = true;
        for slot in self.claims.slots_mut() {
            slot.seen = false;
        }
        // The operator's indexes are those of the new stream from here on.
        self.by_operator.clear();
        self.own_index = None;
        for node in self.nodes.values_mut() {
            node.operator = None;
        }
    }

    /// Sweeps what the resync did not list; how many claims went.
    fn end_resync(
        &mut self,
        ips: &mut BTreeSet<IpAddr>,
        nodes: &mut BTreeSet<NonZeroU16>,
    ) -> usize {
        let stale: Vec<IpAddr> = self
            .claims
            .iter()
            .filter(|(_, s)| !s.seen)
            .map(|(ip, _)| ip)
            .collect();
        for ip in &stale {
            self.remove(*ip, nodes);
            ips.insert(*ip);
        }
        // The addresses of every node, from the claims (nodes pinned by a previous
        // run start without theirs).
        let mut addresses: BTreeMap<NonZeroU16, BTreeSet<IpAddr>> = BTreeMap::new();
        for (ip, slot) in self.claims.iter() {
            if slot.id == IdentityId::REMOTE_NODE {
                addresses.entry(slot.node).or_default().insert(ip);
            }
        }
        for (index, node) in &mut self.nodes {
            let now = addresses.remove(index).unwrap_or_default();
            if node.addresses != now {
                node.addresses = now;
                nodes.insert(*index);
            }
        }
        self.resyncing = false;
        self.complete = true;
        self.resyncs += 1;
        if !stale.is_empty() {
            debug!(
                swept = stale.len(),
                "the resync swept remote entries it did not list"
            );
        }
        stale.len()
    }

    /// Removes the nodes no claim and no stream names.
    fn collect_nodes(&mut self, nodes: &mut BTreeSet<NonZeroU16>) {
        let unused: Vec<NonZeroU16> = self
            .nodes
            .iter()
            .filter(|(_, n)| n.refs == 0 && n.operator.is_none())
            .map(|(index, _)| *index)
            .collect();
        for index in unused {
            if let Some(node) = self.nodes.remove(&index) {
                self.by_name.remove(&node.name);
                nodes.insert(index);
            }
        }
    }

    fn announce(&mut self, announced: MapNode, nodes: &mut BTreeSet<NonZeroU16>) {
        let MapNode { index, name } = announced;
        if self.own.as_ref() == Some(&name) {
            self.own_index = Some(index);
            self.by_operator.remove(&index);
            return;
        }
        if self.own_index == Some(index) {
            self.own_index = None;
        }
        let local = match self.by_name.get(&name) {
            Some(local) => *local,
            None => {
                let Some(local) = self.free_index(index) else {
                    warn!(node = %name, "no NODES index is left for another node; its entries are skipped");
                    self.by_operator.remove(&index);
                    return;
                };
                self.by_name.insert(name.clone(), local);
                self.nodes.insert(
                    local,
                    Node {
                        name,
                        addresses: BTreeSet::new(),
                        refs: 0,
                        operator: None,
                    },
                );
                nodes.insert(local);
                local
            }
        };
        if let Some(previous) = self.by_operator.insert(index, local)
            && previous != local
            && let Some(node) = self.nodes.get_mut(&previous)
        {
            node.operator = None;
        }
        // The index the stream gave this node before, if it gave another.
        if let Some(node) = self.nodes.get_mut(&local)
            && let Some(old) = node.operator.replace(index)
            && old != index
            && self.by_operator.get(&old) == Some(&local)
        {
            self.by_operator.remove(&old);
        }
    }

    /// The operator's `index` if it fits and is free, else the lowest free one.
    fn free_index(&self, index: NonZeroU32) -> Option<NonZeroU16> {
        let direct = u16::try_from(index.get())
            .ok()
            .and_then(NonZeroU16::new)
            .filter(|i| !self.nodes.contains_key(i));
        direct.or_else(|| {
            (1..=u16::MAX)
                .filter_map(NonZeroU16::new)
                .find(|i| !self.nodes.contains_key(i))
        })
    }

    fn upsert(
        &mut self,
        entry: MapEntry,
        ips: &mut BTreeSet<IpAddr>,
        nodes: &mut BTreeSet<NonZeroU16>,
        applied: &mut MapApplied,
    ) {
        let MapEntry { ip, identity, node } = entry;
        if self.own_index == Some(node) {
            // This node's: its sources say; a claim another node held goes.
            if self.remove(ip, nodes) {
                ips.insert(ip);
                applied.changed += 1;
            }
            return;
        }
        let Some(local) = self.by_operator.get(&node).copied() else {
            applied.skipped += 1;
            return;
        };
        let slot = Slot {
            id: identity,
            node: local,
            seen: true,
        };
        let previous = self.claims.insert(ip, slot);
        if previous.is_some_and(|p| p.id == slot.id && p.node == slot.node) {
            return;
        }
        if let Some(previous) = previous {
            self.release(ip, previous, nodes);
        }
        if let Some(n) = self.nodes.get_mut(&local) {
            n.refs += 1;
            if identity == IdentityId::REMOTE_NODE && n.addresses.insert(ip) {
                nodes.insert(local);
            }
        }
        if identity == IdentityId::REMOTE_NODE {
            self.node_addresses += 1;
        }
        ips.insert(ip);
        applied.changed += 1;
    }

    /// Drops the claim of `ip`; whether there was one.
    fn remove(&mut self, ip: IpAddr, nodes: &mut BTreeSet<NonZeroU16>) -> bool {
        match self.claims.remove(ip) {
            Some(slot) => {
                self.release(ip, slot, nodes);
                true
            }
            None => false,
        }
    }

    /// What a claim held, given back.
    fn release(&mut self, ip: IpAddr, slot: Slot, nodes: &mut BTreeSet<NonZeroU16>) {
        if slot.id == IdentityId::REMOTE_NODE {
            self.node_addresses = self.node_addresses.saturating_sub(1);
        }
        if let Some(n) = self.nodes.get_mut(&slot.node) {
            n.refs = n.refs.saturating_sub(1);
            if slot.id == IdentityId::REMOTE_NODE && n.addresses.remove(&ip) {
                nodes.insert(slot.node);
            }
        }
    }
}
