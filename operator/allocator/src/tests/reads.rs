//! What the services, the CLI and the metrics read agrees with the core's state,
//! checked after every event of every test: each figure of `stats` counted afresh
//! from the state, the identity list equal to itself paged in small steps and
//! filtered by labels, every node shown as it is. Mutation testing found these reads
//! checked by no test (a stats figure that stays 0, a page that loses its last id).

use std::{
    cell::Cell,
    collections::{BTreeMap, BTreeSet},
};

use census_proto::labels::LabelSet;

use super::super::{
    Allocator, IdentityId, IdentityInfo, IdentityState, Liveness, Stats, identities::Phase,
};

/// The longest list walked page by page.
const WALKED_UP_TO: usize = 64;
/// Lists are paged and filtered after one event in this many.
const LISTED_EVERY: u64 = 8;

pub(crate) fn check(a: &Allocator) {
    let all = identities(a);
    stats(a, &all);
    nodes(a);
    map(a);
    // Lists walked page by page and filtered are many lists: after every few events
    // is enough (a test has thousands), and keeps the tests' time.
    thread_local!(static CHECKS: Cell<u64> = const { Cell::new(0) });
    if CHECKS
        .replace(CHECKS.get() + 1)
        .is_multiple_of(LISTED_EVERY)
    {
        pages(a, &all);
        by_labels(a, &all);
    }
}

/// Every identity as `list` shows it, with quarantined and blocked ids, checked
/// against the state: each bound, quarantined and blocked id once, as `identity`
/// shows it.
fn identities(a: &Allocator) -> Vec<IdentityInfo> {
    let ids = &a.core.ids;
    let (all, more) = a.list(None, usize::MAX, None, true);
    assert!(!more, "the whole list says more follow");
    let mut want: Vec<_> = ids
        .entries()
        .keys()
        .chain(ids.quarantine().keys())
        .chain(ids.blocked().keys())
        .copied()
        .collect();
    want.sort_unstable();
    let got: Vec<_> = all.iter().map(|info| info.id).collect();
    assert_eq!(got, want, "the ids the whole list shows");
    for info in &all {
        match info.state {
            IdentityState::Quarantined { .. } | IdentityState::Blocked => {
                assert_eq!(info.labels, None, "{} shows labels", info.id);
            }
            state => {
                let entry = ids.get(info.id);
                assert_eq!(
                    info.labels.as_ref(),
                    entry.map(|e| &e.labels),
                    "labels of {}",
                    info.id
                );
                if matches!(state, IdentityState::Protected { .. }) {
                    assert!(
                        info.refs == 0 && info.holds == 0,
                        "{} is shown kept by the restart fence, but referenced or held",
                        info.id
                    );
                }
            }
        }
    }
    all
}

fn stats(a: &Allocator, all: &[IdentityInfo]) {
    let ids = &a.core.ids;
    let mut by_state: BTreeMap<&'static str, u64> = BTreeMap::new();
    for info in all {
        *by_state.entry(info.state.name()).or_default() += 1;
    }
    let state = |name: &str| by_state.get(name).copied().unwrap_or(0);
    // Phases counted from the entries themselves: a shown state must follow them.
    let mut phases: BTreeMap<&'static str, u64> = BTreeMap::new();
    for entry in ids.entries().values() {
        let phase = match entry.phase {
            Phase::Creating { .. } => "creating",
            Phase::Live => "live",
            Phase::Released { .. } => "released",
            Phase::Deleting { .. } => "deleting",
        };
        *phases.entry(phase).or_default() += 1;
    }
    let phase = |name: &str| phases.get(name).copied().unwrap_or(0);
    assert_eq!(
        state("live") + state("protected"),
        phase("live"),
        "live phases"
    );
    for name in ["creating", "released", "deleting"] {
        assert_eq!(state(name), phase(name), "{name} phases");
    }

    let shown = a.nodes();
    let hidden_pending: u64 = a
        .nodes
        .values()
        .filter(|n| !n.hidden())
        .map(|n| u64::from(n.pending))
        .sum();
    // Stale: silent past the TTL in a cluster, unless only awaited since a start
    // (known from the store and no Hello since).
    let cluster = matches!(a.core.cfg.liveness, Liveness::Cluster { .. });
    let stale = a
        .nodes
        .values()
        .filter(|n| !n.hidden())
        .filter(|n| n.session.is_some() || !n.awaited)
        .filter(|n| cluster && n.stale_since.is_some())
        .count() as u64;
    // Ids of the range in use: bound, quarantined or blocked, each once.
    let used: BTreeSet<IdentityId> = ids
        .entries()
        .keys()
        .chain(ids.quarantine().keys())
        .chain(ids.blocked().keys())
        .copied()
        .filter(|&id| a.range().contains(id))
        .collect();
    let gc = &a.core.gc;
    let want = Stats {
        creating: state("creating"),
        live: state("live"),
        protected: state("protected"),
        released: state("released"),
        deleting: state("deleting"),
        quarantined: state("quarantined"),
        blocked: state("blocked"),
        range_size: a.range().size(),
        range_used: used.len() as u64,
        nodes: shown.len() as u64,
        stale_nodes: stale,
        connected_nodes: shown.iter().filter(|n| n.connected).count() as u64,
        endpoints: shown.iter().map(|n| n.endpoints).sum(),
        holds: shown.iter().map(|n| u64::from(n.holds)).sum(),
        pending_allocations: hidden_pending,
        gc_inflight: gc.inflight as u64,
        gc_backlog: (gc.released.len() + gc.create_retries.len() + gc.delete_retries.len()) as u64,
    };
    let got = a.stats();
    assert_eq!(got, want, "stats");
    assert_eq!(
        shown.iter().filter(|n| n.stale).count() as u64,
        got.stale_nodes,
        "nodes shown stale against those counted"
    );
}

/// The list paged in steps of a few ids is the whole list, each page full but the
/// last, and says more follow exactly when they do.
/// (Only for lists of a few dozen ids, as the model test's are: paging a churn
/// test's thousands after every event would cost more than the test.)
fn pages(a: &Allocator, all: &[IdentityInfo]) {
    if all.len() > WALKED_UP_TO {
        return;
    }
    let step = (all.len() / 4).max(1);
    for limit in [step, step + 1, step * 3] {
        let mut walked = Vec::new();
        let mut after = None;
        loop {
            let (page, more) = a.list(after, limit, None, true);
            assert!(page.len() <= limit, "a page of {limit} held {}", page.len());
            assert!(
                !more || page.len() == limit,
                "a short page says more follow"
            );
            assert!(
                after.is_none() || !page.is_empty(),
                "a page of {limit} said more follow, and none did"
            );
            after = page.last().map(|info| info.id);
            walked.extend(page);
            if !more {
                break;
            }
        }
        assert_eq!(walked, all, "the list paged by {limit}");
    }
}

/// With labels asked for, the list shows the bound identities carrying them (never
/// a quarantined or blocked id, which shows none); without quarantined ids asked
/// for, only bound ones.
fn by_labels(a: &Allocator, all: &[IdentityInfo]) {
    let bound: Vec<&IdentityInfo> = all.iter().filter(|info| info.labels.is_some()).collect();
    let (listed, more) = a.list(None, usize::MAX, None, false);
    assert!(!more);
    assert_eq!(listed.iter().collect::<Vec<_>>(), bound, "bound identities");
    let Some(selector) = bound.iter().find_map(|info| info.labels.clone()) else {
        return;
    };
    let carrying = |labels: &Option<LabelSet>| {
        labels
            .as_ref()
            .is_some_and(|l: &LabelSet| l.contains_all(&selector))
    };
    let want: Vec<&IdentityInfo> = bound.into_iter().filter(|i| carrying(&i.labels)).collect();
    for include_quarantined in [false, true] {
        let (listed, more) = a.list(None, usize::MAX, Some(&selector), include_quarantined);
        assert!(!more);
        assert_eq!(
            listed.iter().collect::<Vec<_>>(),
            want,
            "identities carrying {selector} (quarantined asked for: {include_quarantined})"
        );
    }
}

/// Each node as NodeService shows it, by name; shadows not heard from are not shown.
fn nodes(a: &Allocator) {
    let mut want: Vec<_> = a.nodes.keys().collect();
    want.sort_unstable();
    let shown = a.nodes();
    let names: Vec<_> = shown.iter().map(|n| &n.name).collect();
    let visible: Vec<_> = want
        .into_iter()
        .filter(|name| a.nodes.get(*name).is_some_and(|n| !n.hidden()))
        .collect();
    assert_eq!(names, visible, "the nodes shown");
    for info in &shown {
        let Some(node) = a.nodes.get(&info.name) else {
            panic!("{} shown but not known", info.name);
        };
        assert_eq!(info.session, node.session, "{}", info.name);
        assert_eq!(info.connected, node.conn.is_some(), "{}", info.name);
        assert_eq!(info.last_seq, node.last_seq, "{}", info.name);
        assert_eq!(info.endpoints, node.view.len() as u64, "{}", info.name);
        assert_eq!(info.holds as usize, node.holds.len(), "{}", info.name);
        assert_eq!(info.rebinds, node.counters.rebinds, "{}", info.name);
        assert_eq!(info.adoptions, node.counters.adoptions, "{}", info.name);
        assert_eq!(info.corrections, node.counters.corrections, "{}", info.name);
        assert_eq!(
            info.old_seq_ignored, node.counters.old_seq_ignored,
            "{}",
            info.name
        );
        assert_eq!(a.node(&info.name).as_ref(), Some(info));
    }
}

/// The endpoint map's figures against the map itself: each address's winner is an
/// endpoint or a node address, each in-use node has an index.
fn map(a: &Allocator) {
    let stats = a.map_stats();
    let (nodes, entries) = a.map_full();
    assert_eq!(
        stats.endpoint_entries + stats.node_address_entries,
        entries.len() as u64,
        "map entries"
    );
    assert!(
        stats.claims >= entries.len() as u64,
        "fewer claims than entries"
    );
    assert!(
        stats.nodes >= nodes.len() as u64,
        "{} nodes have an index, {} are in use",
        stats.nodes,
        nodes.len()
    );
}
