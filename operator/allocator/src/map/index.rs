//! The index itself: address -> claims, the node table, and what changed since the
//! last take.
//!
//! A claim is one claimant's say on one address: an endpoint of a node's view
//! (named by the node's index and a hash of the endpoint key, resolved through the
//! view when shown) or one of the node's own addresses. An address with one claim
//! (the common case) holds it inline; only a contested address allocates.

use std::{
    collections::{BTreeSet, HashMap, VecDeque},
    hash::{Hash, Hasher},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    num::NonZeroU32,
};

use census_proto::domain::{EndpointKey, IdentityId, NodeName};

use super::{
    super::{Timestamp, capacity::shrink_map},
    MapNodeIndex,
};

/// Bytes of one address's entry in the index's tables (IPv4 key and slot).
#[cfg(test)]
pub(crate) const SLOT_BYTES: usize = size_of::<(Ipv4Addr, Slot)>();

/// Conflicts kept per address for Lookup.
pub(crate) const HISTORY: usize = 8;

/// The claimant key of a node's own address (endpoint key hashes are never 0).
const ADDRESS: u64 = 0;

/// The claimant key of an endpoint: a fixed hash of its key (the same in every
/// process, so figures and tests are reproducible). Two endpoints of one node that
/// hash alike and claim one address would be taken for one claimant: at 64 bits,
/// about one chance in 10^15 for a node of 100 endpoints.
pub(crate) fn key_hash(key: &EndpointKey) -> u64 {
    #[allow(deprecated)]
    let mut h = std::hash::SipHasher::new();
    key.hash(&mut h);
    h.finish().max(1)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Claim {
    /// [`key_hash`] of the endpoint, or [`ADDRESS`].
    pub(crate) key: u64,
    pub(crate) at: Timestamp,
    pub(crate) node: MapNodeIndex,
    pub(crate) identity: IdentityId,
}

impl Claim {
    pub(crate) fn is_address(&self) -> bool {
        self.key == ADDRESS
    }

    fn same_claimant(&self, node: MapNodeIndex, key: u64) -> bool {
        self.node == node && self.key == key
    }

    fn winner(&self) -> Winner {
        Winner {
            identity: self.identity,
            node: self.node,
            address: self.is_address(),
        }
    }
}

/// Where a new claim stands among an address's claims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Standing {
    /// The most recent: it takes the address (unless a node's own address holds it).
    Newest,
    /// Older than every claim there: it takes the address only if nobody claims it.
    /// A session's first snapshot claims so: what an agent reports after its view
    /// was dropped (silence, a restart of either side) may be stale, and must not
    /// take an address from a claim made meanwhile.
    Oldest,
}

/// What watchers see of an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Winner {
    pub(crate) identity: IdentityId,
    pub(crate) node: MapNodeIndex,
    pub(crate) address: bool,
}

impl Winner {
    /// Equal for watchers (the kind is the index's, not on the wire).
    fn shown_as(&self, other: &Self) -> bool {
        self.identity == other.identity && self.node == other.node
    }
}

#[derive(Debug)]
pub(crate) enum Slot {
    One(Claim),
    /// Claimed by more than one claimant at some point since the address was last
    /// unclaimed: its claims, its conflicts and their history stay together.
    Many(Box<Contested>),
}

#[derive(Debug)]
pub(crate) struct Contested {
    /// Oldest claim first.
    pub(crate) claims: Vec<Claim>,
    pub(crate) conflicts: u64,
    /// Most recent first, at most [`HISTORY`].
    pub(crate) history: VecDeque<Conflict>,
}

/// The claimant of a conflict, as recorded then.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Claimant {
    /// The claim that arrived: its key is known.
    Endpoint(EndpointKey),
    /// A claim already there: named by its hash, resolved through the view.
    Hashed(u64),
    Address,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Conflict {
    pub(crate) at: Timestamp,
    pub(crate) claim: (NodeName, Claimant, IdentityId),
    pub(crate) over: (NodeName, Claimant, IdentityId),
    /// The arriving claim took the address (it does unless the address is a node's).
    pub(crate) won: bool,
}

impl Slot {
    pub(crate) fn claims(&self) -> &[Claim] {
        match self {
            Self::One(c) => std::slice::from_ref(c),
            Self::Many(m) => &m.claims,
        }
    }

    /// The claim watchers see: the most recent node address if any, else the most
    /// recent claim.
    pub(crate) fn winner(&self) -> &Claim {
        match self {
            Self::One(c) => c,
            Self::Many(m) => winner_of(&m.claims),
        }
    }
}

fn winner_of(claims: &[Claim]) -> &Claim {
    claims
        .iter()
        .rev()
        .find(|c| c.is_address())
        .or(claims.last())
        .unwrap_or_else(|| unreachable!("a slot keeps at least one claim"))
}

#[derive(Debug)]
pub(crate) struct NodeSlot {
    pub(crate) name: NodeName,
    /// Claims of the node over all addresses (its endpoints' and its own).
    pub(crate) claims: u64,
    /// The node's own addresses, as last set.
    pub(crate) addresses: Box<[IpAddr]>,
    /// Named in a delta already (so its end is news too).
    announced: bool,
}

/// Node name <-> index. An index is given while the node has claims and freed at
/// the first take that finds it without (reported then if it was ever named), so a
/// watcher never sees an index change hands within one delta.
#[derive(Debug, Default)]
pub(crate) struct NodeTable {
    by_name: HashMap<NodeName, MapNodeIndex>,
    /// Index `i` at `slots[i - 1]`.
    slots: Vec<Option<NodeSlot>>,
    /// Freed indexes, the lowest reused first (indexes stay dense: agents keep them
    /// in a small array).
    free: BTreeSet<u32>,
    /// Indexes given since the last take.
    fresh: Vec<MapNodeIndex>,
    /// Indexes whose claims dropped to zero since the last take.
    unused: Vec<MapNodeIndex>,
}

impl NodeTable {
    pub(crate) fn get(&self, name: &NodeName) -> Option<MapNodeIndex> {
        self.by_name.get(name).copied()
    }

    pub(crate) fn slot(&self, ix: MapNodeIndex) -> Option<&NodeSlot> {
        self.slots.get(ix.0.get() as usize - 1)?.as_ref()
    }

    fn slot_mut(&mut self, ix: MapNodeIndex) -> Option<&mut NodeSlot> {
        self.slots.get_mut(ix.0.get() as usize - 1)?.as_mut()
    }

    pub(crate) fn name(&self, ix: MapNodeIndex) -> Option<&NodeName> {
        self.slot(ix).map(|s| &s.name)
    }

    /// The index of `name`, given now if it has none.
    pub(crate) fn index_for(&mut self, name: &NodeName) -> MapNodeIndex {
        if let Some(ix) = self.by_name.get(name) {
            return *ix;
        }
        let n = match self.free.pop_first() {
            Some(n) => n,
            None => {
                self.slots.push(None);
                self.slots.len() as u32
            }
        };
        let ix = MapNodeIndex(NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN));
        self.slots[n as usize - 1] = Some(NodeSlot {
            name: name.clone(),
            claims: 0,
            addresses: Box::default(),
            announced: false,
        });
        self.by_name.insert(name.clone(), ix);
        self.fresh.push(ix);
        ix
    }

    fn claimed(&mut self, ix: MapNodeIndex) {
        if let Some(s) = self.slot_mut(ix) {
            s.claims += 1;
        }
    }

    fn unclaimed(&mut self, ix: MapNodeIndex) {
        if let Some(s) = self.slot_mut(ix) {
            s.claims = s.claims.saturating_sub(1);
            if s.claims == 0 {
                self.unused.push(ix);
            }
        }
    }

    pub(crate) fn in_use(&self) -> impl Iterator<Item = (MapNodeIndex, &NodeSlot)> {
        self.slots.iter().enumerate().filter_map(|(i, s)| {
            let s = s.as_ref().filter(|s| s.claims > 0)?;
            let ix = MapNodeIndex(NonZeroU32::new(i as u32 + 1)?);
            Some((ix, s))
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.by_name.len()
    }

    /// Names the nodes given an index since the last take, and frees (and reports
    /// if they were named) those left without claims.
    fn take(&mut self, named: &mut Vec<(MapNodeIndex, NodeName)>, removed: &mut Vec<MapNodeIndex>) {
        for ix in std::mem::take(&mut self.unused) {
            let Some(s) = self.slot(ix) else { continue };
            if s.claims > 0 {
                continue;
            }
            if let Some(s) = self.slots[ix.0.get() as usize - 1].take() {
                self.by_name.remove(&s.name);
                if s.announced {
                    removed.push(ix);
                }
                self.free.insert(ix.0.get());
            }
        }
        for ix in std::mem::take(&mut self.fresh) {
            if let Some(s) = self.slot_mut(ix)
                && !s.announced
                && s.claims > 0
            {
                s.announced = true;
                named.push((ix, s.name.clone()));
            }
        }
        // Indexes at the end that are free are given back, so the table shrinks.
        while let Some(None) = self.slots.last() {
            self.slots.pop();
            let n = self.slots.len() as u32 + 1;
            self.free.remove(&n);
        }
        if self.by_name.is_empty() {
            self.by_name.shrink_to_fit();
        }
    }
}

/// The whole index.
#[derive(Debug, Default)]
pub(crate) struct EndpointIndex {
    v4: HashMap<Ipv4Addr, Slot>,
    v6: HashMap<Ipv6Addr, Slot>,
    pub(crate) nodes: NodeTable,
    /// Addresses whose winner changed since the last take, with the winner watchers
    /// were told last (`None`: absent).
    pending: HashMap<IpAddr, Option<Winner>>,
    pub(crate) conflicts_total: u64,
    pub(crate) endpoint_entries: u64,
    pub(crate) address_entries: u64,
    pub(crate) claims: u64,
    /// Addresses with more than one claim.
    pub(crate) contested: u64,
    /// Addresses whose history names a claim by its hash only.
    unnamed: Vec<IpAddr>,
}

/// What one edit of an address did; the default, that it changed nothing (no
/// winner before or after to book).
#[derive(Debug, Default)]
struct Edit {
    before: Option<Winner>,
    after: Option<Winner>,
    /// Claims added (1) or ended (-1).
    claims: i8,
    /// The address became contested (1) or stopped being (-1).
    contested: i8,
    /// A new claim met another claimant's.
    conflict: bool,
    /// The claimant key of the winner before, when a conflict is recorded.
    over: Option<u64>,
    /// The arriving claim took the address.
    won: bool,
}

impl EndpointIndex {
    pub(crate) fn slot(&self, ip: IpAddr) -> Option<&Slot> {
        match ip {
            IpAddr::V4(a) => self.v4.get(&a),
            IpAddr::V6(a) => self.v6.get(&a),
        }
    }

    pub(crate) fn slots(&self) -> impl Iterator<Item = (IpAddr, &Slot)> {
        let v4 = self.v4.iter().map(|(a, s)| (IpAddr::V4(*a), s));
        let v6 = self.v6.iter().map(|(a, s)| (IpAddr::V6(*a), s));
        v4.chain(v6)
    }

    pub(crate) fn len(&self) -> usize {
        self.v4.len() + self.v6.len()
    }

    /// Bytes the address maps hold (their tables and contested addresses' claims).
    #[cfg(test)]
    pub(crate) fn approx_bytes(&self) -> usize {
        fn table<K>(m: &HashMap<K, Slot>) -> usize {
            // hashbrown: a power of two of buckets, 7/8 of them usable from 8 on; one
            // control byte per bucket plus a group's worth.
            let buckets = match m.capacity() {
                0 => return 0,
                c if c < 8 => c + 1,
                c => c / 7 * 8,
            };
            buckets * (size_of::<(K, Slot)>() + 1) + 16
        }
        let many: usize = self
            .slots()
            .map(|(_, s)| match s {
                Slot::One(_) => 0,
                Slot::Many(m) => {
                    size_of::<Contested>()
                        + m.claims.capacity() * size_of::<Claim>()
                        + m.history.capacity() * size_of::<Conflict>()
                }
            })
            .sum();
        table(&self.v4) + table(&self.v6) + many
    }

    /// `node`'s claimant `key` claims `ip` for `identity`, standing as `standing`
    /// says among the claims there. A claim already there with the same identity is
    /// no news; with another identity it is a new claim.
    #[expect(
        clippy::too_many_arguments,
        reason = "one claim's parts, named at the call"
    )]
    pub(crate) fn claim(
        &mut self,
        ip: IpAddr,
        node: MapNodeIndex,
        key: u64,
        endpoint: Option<&EndpointKey>,
        identity: IdentityId,
        standing: Standing,
        now: Timestamp,
    ) {
        let claim = Claim {
            key,
            at: now,
            node,
            identity,
        };
        let edit = match ip {
            IpAddr::V4(a) => claim_in(&mut self.v4, a, claim, standing),
            IpAddr::V6(a) => claim_in(&mut self.v6, a, claim, standing),
        };
        if edit.conflict {
            let record = self.conflict_record(&claim, endpoint, &edit, now);
            if let Some(Slot::Many(m)) = self.slot_mut(ip) {
                m.conflicts += 1;
                if let Some(record) = record {
                    if m.history.len() == HISTORY {
                        m.history.pop_back();
                    }
                    let hashed = matches!(record.over.1, Claimant::Hashed(_));
                    m.history.push_front(record);
                    if hashed {
                        self.unnamed.push(ip);
                    }
                }
            }
        }
        self.account(ip, node, edit);
    }

    /// Ends the claim of `node`'s claimant `key` on `ip`.
    pub(crate) fn unclaim(&mut self, ip: IpAddr, node: MapNodeIndex, key: u64) {
        // A burst's table gives its memory back once it empties out.
        let edit = match ip {
            IpAddr::V4(a) => {
                let edit = unclaim_in(&mut self.v4, a, node, key);
                shrink_map(&mut self.v4);
                edit
            }
            IpAddr::V6(a) => {
                let edit = unclaim_in(&mut self.v6, a, node, key);
                shrink_map(&mut self.v6);
                edit
            }
        };
        debug_assert!(edit.claims != 0, "no claim of {ip} by {node:?}/{key:x}");
        self.account(ip, node, edit);
    }

    /// The identity of a claim changes where it stands (the operator moved the
    /// endpoint to another id): not a new claim.
    pub(crate) fn reidentify(&mut self, ip: IpAddr, node: MapNodeIndex, key: u64, to: IdentityId) {
        let edit = match ip {
            IpAddr::V4(a) => reidentify_in(&mut self.v4, a, node, key, to),
            IpAddr::V6(a) => reidentify_in(&mut self.v6, a, node, key, to),
        };
        self.account(ip, node, edit);
    }

    /// Replaces `name`'s own addresses.
    pub(crate) fn set_addresses(
        &mut self,
        name: &NodeName,
        mut addresses: Vec<IpAddr>,
        now: Timestamp,
    ) {
        addresses.sort_unstable();
        addresses.dedup();
        let old = match self.nodes.get(name) {
            Some(ix) => self
                .nodes
                .slot(ix)
                .map(|s| s.addresses.clone())
                .unwrap_or_default(),
            None => Box::default(),
        };
        // Nothing to change (a node without a slot given no addresses takes none).
        if *old == *addresses {
            return;
        }
        let ix = self.nodes.index_for(name);
        for ip in old.iter().filter(|ip| addresses.binary_search(ip).is_err()) {
            self.unclaim(*ip, ix, ADDRESS);
        }
        for ip in addresses.iter().filter(|ip| old.binary_search(ip).is_err()) {
            let id = IdentityId::REMOTE_NODE;
            self.claim(*ip, ix, ADDRESS, None, id, Standing::Newest, now);
        }
        // Set to nothing by a node without endpoints, the slot was left without
        // claims by the last unclaim, which queued it to be freed at the next take.
        if let Some(s) = self.nodes.slot_mut(ix) {
            s.addresses = addresses.into_boxed_slice();
        }
    }

    pub(crate) fn has_unnamed(&self) -> bool {
        !self.unnamed.is_empty()
    }

    /// Replaces the hashes in conflict histories with the keys `resolve` finds for
    /// (node, key hash, address).
    pub(crate) fn name_conflicts(
        &mut self,
        mut resolve: impl FnMut(&NodeName, u64, IpAddr) -> Option<EndpointKey>,
    ) {
        for ip in std::mem::take(&mut self.unnamed) {
            let Some(Slot::Many(m)) = self.slot_mut(ip) else {
                continue;
            };
            m.history.retain_mut(|c| {
                let Claimant::Hashed(h) = c.over.1 else {
                    return true;
                };
                match resolve(&c.over.0, h, ip) {
                    Some(key) => {
                        c.over.1 = Claimant::Endpoint(key);
                        true
                    }
                    // Cannot happen (the claim met is in its view until the event
                    // ends): shown as gone.
                    None => true,
                }
            });
        }
    }

    /// Ends `name`'s own addresses.
    pub(crate) fn clear_addresses(&mut self, name: &NodeName) {
        self.set_addresses(name, Vec::new(), Timestamp::default());
    }

    fn slot_mut(&mut self, ip: IpAddr) -> Option<&mut Slot> {
        match ip {
            IpAddr::V4(a) => self.v4.get_mut(&a),
            IpAddr::V6(a) => self.v6.get_mut(&a),
        }
    }

    fn conflict_record(
        &self,
        claim: &Claim,
        endpoint: Option<&EndpointKey>,
        edit: &Edit,
        now: Timestamp,
    ) -> Option<Conflict> {
        let (before, over) = (edit.before?, edit.over?);
        let name = |ix| self.nodes.name(ix).cloned();
        let claimant = match endpoint {
            Some(k) => Claimant::Endpoint(k.clone()),
            None => Claimant::Address,
        };
        let over_claimant = if over == ADDRESS {
            Claimant::Address
        } else {
            Claimant::Hashed(over)
        };
        Some(Conflict {
            at: now,
            claim: (name(claim.node)?, claimant, claim.identity),
            over: (name(before.node)?, over_claimant, before.identity),
            won: edit.won,
        })
    }

    /// Books an edit: counters, and the address's winner as watchers last saw it.
    fn account(&mut self, ip: IpAddr, node: MapNodeIndex, edit: Edit) {
        self.claims = self.claims.wrapping_add_signed(edit.claims.into());
        match edit.claims {
            1 => self.nodes.claimed(node),
            -1 => self.nodes.unclaimed(node),
            _ => {}
        }
        self.contested = self.contested.wrapping_add_signed(edit.contested.into());
        if edit.conflict {
            self.conflicts_total += 1;
        }
        if let Some(w) = edit.before {
            *self.kind_count(w.address) -= 1;
        }
        if let Some(w) = edit.after {
            *self.kind_count(w.address) += 1;
        }
        let shown = match (edit.before, edit.after) {
            (Some(b), Some(a)) => b.shown_as(&a),
            (None, None) => true,
            _ => false,
        };
        if !shown {
            self.pending.entry(ip).or_insert(edit.before);
        }
    }

    fn kind_count(&mut self, address: bool) -> &mut u64 {
        if address {
            &mut self.address_entries
        } else {
            &mut self.endpoint_entries
        }
    }
}

fn claim_in<K: Hash + Eq>(
    map: &mut HashMap<K, Slot>,
    k: K,
    claim: Claim,
    standing: Standing,
) -> Edit {
    use std::collections::hash_map::Entry;
    let slot = match map.entry(k) {
        Entry::Vacant(v) => {
            v.insert(Slot::One(claim));
            return Edit {
                after: Some(claim.winner()),
                claims: 1,
                won: true,
                ..Edit::default()
            };
        }
        Entry::Occupied(o) => o.into_mut(),
    };
    let before = *slot.winner();
    let mut edit = Edit {
        before: Some(before.winner()),
        over: Some(before.key),
        ..Edit::default()
    };
    match slot {
        Slot::One(c) if c.same_claimant(claim.node, claim.key) => {
            if c.identity == claim.identity {
                return Edit::default();
            }
            *c = claim;
        }
        Slot::One(c) => {
            let old = *c;
            let claims = match standing {
                Standing::Newest => vec![old, claim],
                Standing::Oldest => vec![claim, old],
            };
            *slot = Slot::Many(Box::new(Contested {
                claims,
                conflicts: 0,
                history: VecDeque::new(),
            }));
            edit.claims = 1;
            edit.contested = 1;
            edit.conflict = true;
        }
        Slot::Many(m) => {
            let len = m.claims.len();
            match m
                .claims
                .iter()
                .position(|c| c.same_claimant(claim.node, claim.key))
            {
                Some(i) if m.claims[i].identity == claim.identity => {
                    return Edit::default();
                }
                Some(i) => {
                    m.claims.remove(i);
                    stand(&mut m.claims, claim, standing);
                    edit.conflict = len > 1;
                }
                None => {
                    stand(&mut m.claims, claim, standing);
                    edit.claims = 1;
                    edit.contested = i8::from(len == 1);
                    edit.conflict = true;
                }
            }
        }
    }
    let after = *slot.winner();
    edit.won = after.same_claimant(claim.node, claim.key);
    edit.after = Some(after.winner());
    edit
}

/// Puts `claim` among `claims` (oldest first) where `standing` says.
fn stand(claims: &mut Vec<Claim>, claim: Claim, standing: Standing) {
    match standing {
        Standing::Newest => claims.push(claim),
        Standing::Oldest => claims.insert(0, claim),
    }
}

fn unclaim_in<K: Hash + Eq>(
    map: &mut HashMap<K, Slot>,
    k: K,
    node: MapNodeIndex,
    key: u64,
) -> Edit {
    use std::collections::hash_map::Entry;
    let Entry::Occupied(mut o) = map.entry(k) else {
        return Edit::default();
    };
    let before = o.get().winner().winner();
    match o.get_mut() {
        Slot::One(c) if c.same_claimant(node, key) => {
            o.remove();
            Edit {
                before: Some(before),
                claims: -1,
                ..Edit::default()
            }
        }
        Slot::One(_) => Edit::default(),
        Slot::Many(m) => {
            let Some(i) = m.claims.iter().position(|c| c.same_claimant(node, key)) else {
                return Edit::default();
            };
            m.claims.remove(i);
            let contested = if m.claims.len() == 1 { -1 } else { 0 };
            if m.claims.is_empty() {
                o.remove();
                return Edit {
                    before: Some(before),
                    claims: -1,
                    ..Edit::default()
                };
            }
            let after = winner_of(&m.claims).winner();
            Edit {
                before: Some(before),
                after: Some(after),
                claims: -1,
                contested,
                ..Edit::default()
            }
        }
    }
}

fn reidentify_in<K: Hash + Eq>(
    map: &mut HashMap<K, Slot>,
    k: K,
    node: MapNodeIndex,
    key: u64,
    to: IdentityId,
) -> Edit {
    let Some(slot) = map.get_mut(&k) else {
        return Edit::default();
    };
    let before = slot.winner().winner();
    let claims: &mut [Claim] = match slot {
        Slot::One(c) => std::slice::from_mut(c),
        Slot::Many(m) => &mut m.claims,
    };
    if let Some(c) = claims.iter_mut().find(|c| c.same_claimant(node, key)) {
        c.identity = to;
    }
    Edit {
        before: Some(before),
        after: Some(slot.winner().winner()),
        ..Edit::default()
    }
}

impl EndpointIndex {
    /// What changed since the last take, coalesced per address.
    pub(crate) fn take(&mut self) -> super::MapDelta {
        let nodes = &self.nodes;
        if self.pending.is_empty() && nodes.fresh.is_empty() && nodes.unused.is_empty() {
            return super::MapDelta::default();
        }
        let mut changes = Vec::with_capacity(self.pending.len());
        for (ip, before) in std::mem::take(&mut self.pending) {
            let now = self.slot(ip).map(|s| s.winner().winner());
            match (before, now) {
                (Some(b), Some(n)) if b.shown_as(&n) => {}
                (None, None) => {}
                (_, Some(n)) => changes.push(super::MapChange::Upsert(super::MapEntry {
                    ip,
                    identity: n.identity,
                    node: n.node,
                })),
                (Some(_), None) => changes.push(super::MapChange::Remove(ip)),
            }
        }
        let mut named = Vec::new();
        let mut removed_nodes = Vec::new();
        self.nodes.take(&mut named, &mut removed_nodes);
        super::MapDelta {
            nodes: named
                .into_iter()
                .map(|(index, name)| super::MapNode { index, name })
                .collect(),
            changes,
            removed_nodes,
        }
    }
}
