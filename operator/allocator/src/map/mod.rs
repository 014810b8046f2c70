//! The cluster-wide endpoint map: `IP -> (identity, node)`, built from every node's
//! view and the nodes' own addresses.

use std::{net::IpAddr, num::NonZeroU32};

use census_proto::domain::{EndpointKey, IdentityId, NodeName};

use self::index::{Claimant, Conflict, Slot};
use super::{Allocator, ConnId, Liveness, Timestamp};

mod index;
pub(crate) mod view;

pub(crate) use self::index::{EndpointIndex, Standing};
#[cfg(test)]
pub(crate) use self::index::{HISTORY, SLOT_BYTES};

/// Index of a node in the map (stable while any entry names it; never 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MapNodeIndex(pub NonZeroU32);

/// A node named by the map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapNode {
    pub index: MapNodeIndex,
    pub name: NodeName,
}

/// The winning claim of one address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapEntry {
    pub ip: IpAddr,
    pub identity: IdentityId,
    pub node: MapNodeIndex,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MapChange {
    Upsert(MapEntry),
    Remove(IpAddr),
}

/// What changed since the last take, coalesced per address (the last state of each
/// IP wins; an IP set then removed within one take is one Remove, or nothing if it
/// was absent before).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MapDelta {
    /// Nodes new to the map since the last take (named before any entry uses them).
    pub nodes: Vec<MapNode>,
    pub changes: Vec<MapChange>,
    /// Nodes no entry names any more; their index may be reused after this take.
    pub removed_nodes: Vec<MapNodeIndex>,
}

impl MapDelta {
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty() && self.changes.is_empty() && self.removed_nodes.is_empty()
    }
}

/// What claims an address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimSource {
    /// An endpoint of the node's view.
    Endpoint(EndpointKey),
    /// One of the node's own addresses.
    NodeAddress,
    /// An endpoint no longer in its node's view, whose key the index cannot name
    /// (it keeps a hash of each key, not the key).
    Gone,
}

/// One claim of an address, as [`Allocator::map_lookup`] shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapClaim {
    pub node: NodeName,
    pub source: ClaimSource,
    pub identity: IdentityId,
    pub claimed_at: Timestamp,
    pub winner: bool,
}

/// A claim that lost an address to a newer one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapConflict {
    pub at: Timestamp,
    /// The claim that held the address after the conflict (the arriving one, unless
    /// the address is a node's own).
    pub winner: NodeName,
    pub winner_source: ClaimSource,
    pub winner_identity: IdentityId,
    /// The other claim.
    pub loser: NodeName,
    pub loser_source: ClaimSource,
    pub loser_identity: IdentityId,
}

/// One address of the map: its claims (winner first), conflicts and their history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapLookup {
    pub ip: IpAddr,
    pub claims: Vec<MapClaim>,
    /// Conflicts of this address since it was last unclaimed.
    pub conflicts: u64,
    /// The most recent conflicts, most recent first (bounded).
    pub history: Vec<MapConflict>,
}

/// Figures of the map, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MapStats {
    /// Addresses whose winner is an endpoint.
    pub endpoint_entries: u64,
    /// Addresses whose winner is a node address.
    pub node_address_entries: u64,
    /// Claims in all (winners and losers).
    pub claims: u64,
    /// Addresses with more than one claim now.
    pub contested: u64,
    /// Nodes with an index.
    pub nodes: u64,
    /// Conflicts counted since start (monotonic).
    pub conflicts_total: u64,
}

impl Allocator {
    /// What changed since the last take; cheap when nothing changed. Apply `nodes`,
    /// then `changes`, then `removed_nodes`.
    pub fn take_map_delta(&mut self) -> MapDelta {
        self.name_conflicts();
        self.core.map.take()
    }

    /// The whole map: every node in use and every address's winner.
    pub fn map_full(&self) -> (Vec<MapNode>, Vec<MapEntry>) {
        let ix = &self.core.map;
        let nodes = ix
            .nodes
            .in_use()
            .map(|(index, s)| MapNode {
                index,
                name: s.name.clone(),
            })
            .collect();
        let mut entries = Vec::with_capacity(ix.len());
        entries.extend(ix.slots().map(|(ip, slot)| {
            let w = slot.winner();
            MapEntry {
                ip,
                identity: w.identity,
                node: w.node,
            }
        }));
        (nodes, entries)
    }

    /// The claims of `ip` (the winner first, then the most recent first), its
    /// conflicts and their recent history.
    pub fn map_lookup(&self, ip: IpAddr) -> Option<MapLookup> {
        let ix = &self.core.map;
        let slot = ix.slot(ip)?;
        let winner = *slot.winner();
        let mut claims: Vec<MapClaim> = slot
            .claims()
            .iter()
            .rev()
            .filter_map(|c| {
                let node = ix.nodes.name(c.node)?.clone();
                let source = if c.is_address() {
                    ClaimSource::NodeAddress
                } else {
                    // Every endpoint claim is its view's (the view keeps the index).
                    self.endpoint_of(&node, c.key, ip)
                        .map_or(ClaimSource::Gone, ClaimSource::Endpoint)
                };
                Some(MapClaim {
                    node,
                    source,
                    identity: c.identity,
                    claimed_at: c.at,
                    winner: *c == winner,
                })
            })
            .collect();
        claims.sort_by_key(|c| !c.winner);
        let (conflicts, history) = match slot {
            Slot::One(_) => (0, Vec::new()),
            Slot::Many(m) => (
                m.conflicts,
                m.history
                    .iter()
                    .filter_map(|c| self.shown_conflict(c))
                    .collect(),
            ),
        };
        Some(MapLookup {
            ip,
            claims,
            conflicts,
            history,
        })
    }

    pub fn map_stats(&self) -> MapStats {
        let ix = &self.core.map;
        MapStats {
            endpoint_entries: ix.endpoint_entries,
            node_address_entries: ix.address_entries,
            claims: ix.claims,
            contested: ix.contested,
            nodes: ix.nodes.len() as u64,
            conflicts_total: ix.conflicts_total,
        }
    }

    /// Replaces `node`'s own addresses: each is an entry of identity `remote-node`
    /// and the node's index, and wins over endpoints claiming it (see
    /// docs/design.md, "The endpoint map"). In a cluster they come from the Node
    /// object and stay while it exists; in embedded mode from the agent's Hello, and
    /// they go with the node's view.
    pub fn set_node_addresses(&mut self, node: &NodeName, addresses: Vec<IpAddr>, now: Timestamp) {
        // The Node exists (again): its agent is welcome.
        self.core.gone.remove(node);
        self.core.map.set_addresses(node, addresses, now);
        self.name_conflicts();
    }

    /// The endpoint of `node` whose key hashes to `hash` and that claims `ip`.
    /// The addresses `name`'s agent reported in the Hello that opened stream `conn`
    /// (at most 16, checked at the wire). They are the node's own addresses in
    /// embedded mode only: in a cluster the Node object is the source, and an agent
    /// cannot make other addresses `remote-node`. Returns whether they were taken.
    pub fn hello_addresses(
        &mut self,
        name: &NodeName,
        conn: ConnId,
        addresses: Vec<IpAddr>,
        now: Timestamp,
    ) -> bool {
        let current = self.nodes.get(name).is_some_and(|n| n.conn == Some(conn));
        if !current || self.core.cfg.liveness != Liveness::Embedded {
            return false;
        }
        self.set_node_addresses(name, addresses, now);
        true
    }

    fn endpoint_of(&self, node: &NodeName, hash: u64, ip: IpAddr) -> Option<EndpointKey> {
        let view = &self.nodes.get(node)?.view;
        view.find_claimant(hash, ip).cloned()
    }

    /// Names the claims that conflicts met (the index knows them by a hash of their
    /// key): right after the event that made the conflicts, while those claims are
    /// still in their views.
    pub(super) fn name_conflicts(&mut self) {
        if !self.core.map.has_unnamed() {
            return;
        }
        let nodes = &self.nodes;
        self.core.map.name_conflicts(|node, hash, ip| {
            let view = &nodes.get(node)?.view;
            view.find_claimant(hash, ip).cloned()
        });
    }

    fn shown_conflict(&self, c: &Conflict) -> Option<MapConflict> {
        let source = |(_, claimant, _): &(NodeName, Claimant, IdentityId)| match claimant {
            Claimant::Endpoint(k) => Some(ClaimSource::Endpoint(k.clone())),
            Claimant::Hashed(_) => Some(ClaimSource::Gone),
            Claimant::Address => Some(ClaimSource::NodeAddress),
        };
        let (winner, loser) = if c.won {
            (&c.claim, &c.over)
        } else {
            (&c.over, &c.claim)
        };
        Some(MapConflict {
            at: c.at,
            winner: winner.0.clone(),
            winner_source: source(winner)?,
            winner_identity: winner.2,
            loser: loser.0.clone(),
            loser_source: source(loser)?,
            loser_identity: loser.2,
        })
    }
}
