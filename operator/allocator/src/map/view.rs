//! A node's view (endpoint key -> identity and addresses), kept in step with the
//! endpoint map: every method that changes what the view claims takes the index and
//! edits it too, and the entries cannot be reached mutably otherwise, so no path
//! that changes a view can leave the index behind.

use std::{collections::HashMap, net::IpAddr};

use census_proto::domain::{EndpointKey, IdentityId, NodeName};

use super::{
    super::{
        Timestamp,
        capacity::{settle_map, shrink_map},
        nodes::{Addrs, ViewEntry},
    },
    MapNodeIndex,
    index::{EndpointIndex, Standing, key_hash},
};

#[derive(Debug, Default)]
pub(crate) struct View {
    entries: HashMap<EndpointKey, ViewEntry>,
}

impl View {
    pub(crate) fn get(&self, key: &EndpointKey) -> Option<&ViewEntry> {
        self.entries.get(key)
    }

    pub(crate) fn contains_key(&self, key: &EndpointKey) -> bool {
        self.entries.contains_key(key)
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.entries.capacity()
    }

    #[cfg(test)]
    pub(crate) fn iter(&self) -> std::collections::hash_map::Iter<'_, EndpointKey, ViewEntry> {
        self.entries.iter()
    }

    /// The endpoint whose key hashes to `hash` and that claims `ip`.
    pub(crate) fn find_claimant(&self, hash: u64, ip: IpAddr) -> Option<&EndpointKey> {
        self.entries
            .iter()
            .find(|(k, v)| v.ips.contains(&ip) && key_hash(k) == hash)
            .map(|(k, _)| k)
    }

    /// Marks `key`'s entry as seen by snapshot `mark`; whether it was not already,
    /// and the entry. Touches nothing the map shows.
    pub(crate) fn mark_seen(&mut self, key: &EndpointKey, mark: u32) -> Option<(bool, &ViewEntry)> {
        let v = self.entries.get_mut(key)?;
        let first = std::mem::replace(&mut v.seen, mark) != mark;
        Some((first, v))
    }

    /// See [`settle_map`].
    pub(crate) fn settle(&mut self) {
        settle_map(&mut self.entries);
    }

    /// See [`shrink_map`].
    pub(crate) fn shrink(&mut self) {
        shrink_map(&mut self.entries);
    }

    /// Sets `key`'s entry; returns the one it replaces.
    pub(crate) fn insert(
        &mut self,
        ix: &mut EndpointIndex,
        node: &NodeName,
        key: EndpointKey,
        entry: ViewEntry,
        now: Timestamp,
    ) -> Option<ViewEntry> {
        let n = claims_index(ix, node, &entry);
        let hash = key_hash(&key);
        let prev = self.entries.get(&key);
        if let Some(prev) = prev {
            unclaim_gone(ix, node, hash, prev, Some(&entry));
        }
        if let Some(n) = n {
            let claimant = (n, hash, &key);
            claim_new(ix, claimant, prev, &entry, Standing::Newest, now);
        }
        self.entries.insert(key, entry)
    }

    pub(crate) fn remove(
        &mut self,
        ix: &mut EndpointIndex,
        node: &NodeName,
        key: &EndpointKey,
    ) -> Option<ViewEntry> {
        let prev = self.entries.remove(key)?;
        unclaim_gone(ix, node, key_hash(key), &prev, None);
        Some(prev)
    }

    /// Replaces the whole view (a snapshot); returns the old entries. Claims that go
    /// end before new ones are made, so an address moving between two endpoints of
    /// this node is no conflict; the new ones stand as `standing` says.
    pub(crate) fn replace(
        &mut self,
        ix: &mut EndpointIndex,
        node: &NodeName,
        entries: HashMap<EndpointKey, ViewEntry>,
        standing: Standing,
        now: Timestamp,
    ) -> HashMap<EndpointKey, ViewEntry> {
        let old = std::mem::replace(&mut self.entries, entries);
        for (key, prev) in &old {
            unclaim_gone(ix, node, key_hash(key), prev, self.entries.get(key));
        }
        let mut n = None;
        for (key, entry) in &self.entries {
            if entry.ips.is_empty() {
                continue;
            }
            let n = *n.get_or_insert_with(|| ix.nodes.index_for(node));
            let claimant = (n, key_hash(key), key);
            claim_new(ix, claimant, old.get(key), entry, standing, now);
        }
        old
    }

    /// Keeps the entries `keep` says to; the others' claims end.
    pub(crate) fn retain(
        &mut self,
        ix: &mut EndpointIndex,
        node: &NodeName,
        mut keep: impl FnMut(&EndpointKey, &ViewEntry) -> bool,
    ) {
        self.entries.retain(|key, v| {
            if keep(key, v) {
                return true;
            }
            unclaim_gone(ix, node, key_hash(key), v, None);
            false
        });
    }

    /// Points every entry of identity `from` at `to` (the operator moved them: no new
    /// claim), calling `each` for each; returns how many moved.
    pub(crate) fn reidentify(
        &mut self,
        ix: &mut EndpointIndex,
        node: &NodeName,
        from: IdentityId,
        to: IdentityId,
        mut each: impl FnMut(&EndpointKey),
    ) -> u32 {
        let n = ix.nodes.get(node);
        let mut moved = 0;
        for (key, v) in self.entries.iter_mut().filter(|(_, v)| v.id == from) {
            v.id = to;
            moved += 1;
            each(key);
            if let Some(n) = n {
                let hash = key_hash(key);
                for ip in distinct(&v.ips) {
                    ix.reidentify(ip, n, hash, to);
                }
            }
        }
        moved
    }

    /// Empties the view (its node is dropped); returns the entries.
    pub(crate) fn drain(
        &mut self,
        ix: &mut EndpointIndex,
        node: &NodeName,
    ) -> HashMap<EndpointKey, ViewEntry> {
        let old = std::mem::take(&mut self.entries);
        for (key, prev) in &old {
            unclaim_gone(ix, node, key_hash(key), prev, None);
        }
        old
    }
}

/// The node's index if `entry` claims anything (given now if it has none).
fn claims_index(
    ix: &mut EndpointIndex,
    node: &NodeName,
    entry: &ViewEntry,
) -> Option<MapNodeIndex> {
    (!entry.ips.is_empty()).then(|| ix.nodes.index_for(node))
}

/// The addresses of `ips`, each once.
fn distinct(ips: &Addrs) -> impl Iterator<Item = IpAddr> + '_ {
    ips.iter()
        .enumerate()
        .filter(|(i, ip)| !ips.iter().take(*i).any(|p| p == *ip))
        .map(|(_, ip)| ip)
}

/// Ends the claims of `prev` that `next` (the entry replacing it, if any) does not
/// make again.
fn unclaim_gone(
    ix: &mut EndpointIndex,
    node: &NodeName,
    hash: u64,
    prev: &ViewEntry,
    next: Option<&ViewEntry>,
) {
    if prev.ips.is_empty() {
        return;
    }
    let Some(n) = ix.nodes.get(node) else {
        debug_assert!(false, "{node} claims addresses without an index");
        return;
    };
    for ip in distinct(&prev.ips) {
        let kept = next.is_some_and(|e| e.ips.contains(&ip));
        if !kept {
            ix.unclaim(ip, n, hash);
        }
    }
}

/// Makes the claims of `entry` that `prev` (the entry it replaces, if any) did not
/// make: its new addresses, or every address if the identity changed. The claimant
/// is the node's index, the key's hash and the key.
fn claim_new(
    ix: &mut EndpointIndex,
    (n, hash, key): (MapNodeIndex, u64, &EndpointKey),
    prev: Option<&ViewEntry>,
    entry: &ViewEntry,
    standing: Standing,
    now: Timestamp,
) {
    for ip in distinct(&entry.ips) {
        let same = prev.is_some_and(|p| p.id == entry.id && p.ips.contains(&ip));
        if !same {
            ix.claim(ip, n, hash, Some(key), entry.id, standing, now);
        }
    }
}
