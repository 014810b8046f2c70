//! The core's internal invariants, checked after every event of every test.

use std::collections::{HashMap, HashSet};

use census_proto::domain::{IdentityId, NodeName};

use super::super::{
    Allocator,
    identities::{Phase, Waiter},
};

pub(crate) fn check(a: &Allocator) {
    let ids = &a.core.ids;
    let mut refs: HashMap<IdentityId, u32> = HashMap::new();
    let mut holds: HashMap<IdentityId, u32> = HashMap::new();
    for (name, node) in &a.nodes {
        for (key, v) in node.view.iter() {
            assert!(
                ids.get(v.id).is_some(),
                "node {name} endpoint {key} references unknown identity {}",
                v.id
            );
            *refs.entry(v.id).or_default() += 1;
        }
        for id in node.holds.keys() {
            assert!(
                ids.get(*id).is_some(),
                "node {name} holds unknown identity {id}"
            );
            *holds.entry(*id).or_default() += 1;
        }
    }
    let mut pending: HashMap<NodeName, u32> = HashMap::new();
    let mut inflight_deletes = 0;
    for (&id, entry) in ids.entries() {
        let want_refs = refs.get(&id).copied().unwrap_or(0);
        assert_eq!(
            entry.refs, want_refs,
            "identity {id} ({}) refcount",
            entry.labels
        );
        assert_eq!(
            entry.holds,
            holds.get(&id).copied().unwrap_or(0),
            "identity {id} hold count"
        );
        assert_eq!(ids.id_of(&entry.labels), Some(id), "label index of {id}");
        assert!(
            !ids.quarantine().contains_key(&id),
            "{id} is bound and quarantined"
        );
        assert!(
            !ids.blocked().contains_key(&id),
            "{id} is bound and blocked"
        );
        if let Phase::Released { .. } = entry.phase {
            assert!(
                entry.refs == 0 && entry.holds == 0,
                "{id} is released but referenced or held"
            );
        }
        if let Phase::Deleting { inflight: true, .. } = entry.phase {
            inflight_deletes += 1;
        }
        for w in &entry.waiters {
            if let Waiter::Request { node, .. } = w {
                *pending.entry(node.clone()).or_default() += 1;
            }
        }
    }
    // At least these: a delete stays in flight after its identity is rehomed (its
    // object was edited meanwhile) until the store answers it.
    assert!(
        a.core.gc.inflight >= inflight_deletes,
        "deletes in flight: {} counted, {inflight_deletes} identities deleting",
        a.core.gc.inflight
    );
    for id in &a.core.gc.rewriting {
        assert!(
            ids.get(*id).is_none(),
            "the tombstone of {id} is written again, but it is bound"
        );
    }
    for (name, node) in &a.nodes {
        assert_eq!(
            node.pending,
            pending.get(name).copied().unwrap_or(0),
            "pending allocations of {name}"
        );
    }
    let quarantined: HashSet<IdentityId> = ids.quarantine().keys().copied().collect();
    for id in ids.blocked().keys() {
        assert!(!quarantined.contains(id), "{id} is blocked and quarantined");
    }
    let range = ids.range();
    let used = ids
        .entries()
        .keys()
        .chain(ids.quarantine().keys())
        .chain(ids.blocked().keys())
        .filter(|id| range.contains(**id))
        .count() as u64;
    assert_eq!(ids.used_in_range(), used, "ids used in range");
    // Checked after a drain: what Watch owes is emitted, and its memory gone.
    assert_eq!(ids.touched_len(), 0, "identities touched after the drain");
}
