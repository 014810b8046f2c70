//! The operator's periodic one-line summary at INFO: what the core did since the
//! last line (corrections by node, releases, deletes, failures by cause), so someone
//! tailing the log during an incident sees the system work. Nothing is logged for a
//! quiet interval.

use std::{collections::HashMap, fmt::Write as _};

use census_proto::domain::NodeName;

use crate::allocator::{Counters, NodeInfo};

/// Nodes named in a line, by corrections (the rest are summed).
const TOP_NODES: usize = 5;

/// The previous line's counters, to tell what changed. Bounded by the nodes.
#[derive(Debug)]
pub(crate) struct Summary {
    last: Counters,
    corrections: HashMap<NodeName, u64>,
}

impl Summary {
    pub(crate) fn new(counters: &Counters, nodes: &[NodeInfo]) -> Self {
        Self {
            last: counters.clone(),
            corrections: per_node(nodes),
        }
    }

    /// The line for what happened since the last call, `None` if nothing did.
    pub(crate) fn line(&mut self, counters: &Counters, nodes: &[NodeInfo]) -> Option<String> {
        let now = per_node(nodes);
        let mut by_node: Vec<(&NodeName, u64)> = now
            .iter()
            .map(|(name, &n)| {
                (
                    name,
                    n - self.corrections.get(name).copied().unwrap_or(0).min(n),
                )
            })
            .filter(|&(_, d)| d > 0)
            .collect();
        by_node.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        let last = &self.last;
        let d = |now: u64, then: u64| now.saturating_sub(then);
        let mut parts: Vec<String> = Vec::new();
        let corrections = d(counters.corrections, last.corrections);
        if corrections > 0 {
            let mut part = format!("corrections {corrections}");
            if !by_node.is_empty() {
                let named: Vec<String> = by_node
                    .iter()
                    .take(TOP_NODES)
                    .map(|(name, n)| format!("{name} {n}"))
                    .collect();
                let _ = write!(part, " ({}", named.join(", "));
                if by_node.len() > TOP_NODES {
                    let _ = write!(part, ", {} more nodes", by_node.len() - TOP_NODES);
                }
                part.push(')');
            }
            parts.push(part);
        }
        for (what, now, then) in [
            ("adoptions", counters.adoptions, last.adoptions),
            ("new", counters.allocations_new, last.allocations_new),
            (
                "adopted",
                counters.identities_adopted,
                last.identities_adopted,
            ),
            ("released", counters.released, last.released),
            ("holds expired", counters.holds_expired, last.holds_expired),
            ("holds settled", counters.holds_settled, last.holds_settled),
            ("nodes dropped", counters.nodes_dropped, last.nodes_dropped),
            ("unresolved", counters.unresolved, last.unresolved),
            ("rebinds", counters.rebinds, last.rebinds),
            (
                "recreated",
                counters.bindings_recreated,
                last.bindings_recreated,
            ),
            (
                "taken from the store",
                counters.bindings_taken,
                last.bindings_taken,
            ),
            ("blocked", counters.blocked, last.blocked),
        ] {
            let n = d(now, then);
            if n > 0 {
                parts.push(format!("{what} {n}"));
            }
        }
        let deleted = d(
            counters.gc_outcomes.get("deleted").copied().unwrap_or(0),
            last.gc_outcomes.get("deleted").copied().unwrap_or(0),
        );
        if deleted > 0 {
            parts.push(format!("deleted {deleted}"));
        }
        for (what, now, then) in [
            ("GC", &counters.gc_outcomes, &last.gc_outcomes),
            ("create", &counters.create_failures, &last.create_failures),
        ] {
            let failures: Vec<String> = now
                .iter()
                .filter(|(cause, _)| what != "GC" || !matches!(**cause, "deleted" | "recreated"))
                .filter_map(|(cause, &n)| {
                    let n = d(n, then.get(cause).copied().unwrap_or(0));
                    (n > 0).then(|| format!("{cause}={n}"))
                })
                .collect();
            if !failures.is_empty() {
                parts.push(format!("{what} failures {}", failures.join(" ")));
            }
        }
        self.last = counters.clone();
        self.corrections = now;
        (!parts.is_empty()).then(|| parts.join(", "))
    }
}

fn per_node(nodes: &[NodeInfo]) -> HashMap<NodeName, u64> {
    nodes
        .iter()
        .map(|n| (n.name.clone(), n.corrections))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, corrections: u64) -> NodeInfo {
        NodeInfo {
            name: NodeName::new(name).unwrap_or_else(|e| panic!("{e}")),
            session: None,
            connected: true,
            last_seq: 0,
            last_heard: None,
            last_snapshot: None,
            stale: false,
            endpoints: 0,
            holds: 0,
            corrections,
            adoptions: 0,
            old_seq_ignored: 0,
            rebinds: 0,
        }
    }

    #[test]
    fn a_quiet_interval_logs_nothing_and_a_busy_one_says_what_happened() {
        let mut counters = Counters::default();
        let nodes = [node("node-a", 0), node("node-b", 0)];
        let mut summary = Summary::new(&counters, &nodes);
        assert_eq!(summary.line(&counters, &nodes), None);
        counters.corrections = 12;
        counters.released = 5;
        *counters.gc_outcomes.entry("deleted").or_default() += 4;
        *counters.gc_outcomes.entry("conflict").or_default() += 1;
        *counters.gc_outcomes.entry("io").or_default() += 2;
        let nodes = [node("node-a", 10), node("node-b", 2)];
        assert_eq!(
            summary.line(&counters, &nodes).as_deref(),
            Some(
                "corrections 12 (node-a 10, node-b 2), released 5, deleted 4, \
                 GC failures conflict=1 io=2"
            )
        );
        // Only what changed since the last line.
        counters.released = 6;
        assert_eq!(
            summary.line(&counters, &nodes).as_deref(),
            Some("released 1")
        );
        assert_eq!(summary.line(&counters, &nodes), None);
    }

    #[test]
    fn many_correcting_nodes_are_summed_beyond_the_top_five() {
        let counters = Counters::default();
        let quiet: Vec<NodeInfo> = (0..8).map(|i| node(&format!("n{i}"), 0)).collect();
        let mut summary = Summary::new(&counters, &quiet);
        let busy: Vec<NodeInfo> = (0..8).map(|i| node(&format!("n{i}"), 10 + i)).collect();
        let counters = Counters {
            corrections: busy.iter().map(|n| n.corrections).sum(),
            ..Counters::default()
        };
        let line = summary.line(&counters, &busy).unwrap_or_default();
        assert!(
            line.starts_with("corrections 108 (n7 17, n6 16, n5 15, n4 14, n3 13, 3 more nodes)"),
            "{line}"
        );
    }
}
