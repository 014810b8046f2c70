//! The cluster-wide map in the core: remote claims against local endpoints and
//! host addresses, resyncs, fail-static, and the node table.

use std::collections::{BTreeMap, HashMap};

use super::*;

const OWN: &str = "n1";

use crate::testing::{B, id, ip, local, name};

/// ENDPOINTS and NODES as the effects leave them, applied as reconcile applies
/// them (REMOTE entries and nodes removed only with `prune_remote`).
#[derive(Debug, Default)]
struct Maps {
    entries: BTreeMap<IpAddr, Entry>,
    nodes: BTreeMap<NonZeroU16, NodeEntry>,
}

impl Maps {
    fn apply(&mut self, fx: &Effects) {
        for (index, node) in &fx.nodes {
            if let Some(node) = node {
                self.nodes.insert(*index, node.clone());
            }
        }
        for (ip, entry) in &fx.entries {
            match entry {
                Some(entry) => {
                    self.entries.insert(*ip, *entry);
                }
                None => {
                    let remote = matches!(self.entries.get(ip), Some(Entry::Remote { .. }));
                    if (remote && fx.prune_remote) || (!remote && fx.prune) {
                        self.entries.remove(ip);
                    }
                }
            }
        }
        for (index, node) in &fx.nodes {
            if node.is_none() && fx.prune_remote {
                self.nodes.remove(index);
            }
        }
    }

    /// Address -> (identity, node name) of the REMOTE entries, checking that
    /// NODES names every node they refer to.
    fn remote(&self) -> Vec<(String, u32, String)> {
        self.entries
            .iter()
            .filter_map(|(ip, e)| match e {
                Entry::Remote { id, node } => {
                    let node = self.nodes.get(node).map_or_else(
                        || format!("missing NODES entry {node}"),
                        |n| n.name.to_string(),
                    );
                    Some((ip.to_string(), id.get(), node))
                }
                _ => None,
            })
            .collect()
    }
}

fn core() -> Core {
    Core::new(HashMap::new()).with_node(name(OWN), [])
}

fn ep(key_name: &str, address: &str) -> SourceEndpoint {
    SourceEndpoint {
        key: EndpointKey::new("default", key_name).unwrap_or_else(|e| panic!("{e}")),
        ips: vec![ip(address)].into_boxed_slice(),
        labels: BTreeMap::from([("app".to_owned(), "web".to_owned())]),
        service_account: "default".to_owned(),
        interface: HostInterface::Named(format!("veth{key_name}")),
    }
}

fn allocate_all(e: &mut Core, n: u32) {
    let started: Vec<AllocationRequest> = e.take_effects().started().cloned().collect();
    for request in started {
        e.on_allocation(AllocationEvent::Allocated {
            request: request.id,
            labels: request.labels,
            id: id(n),
        });
    }
}

fn row(address: &str, identity: u32, node: &str) -> (String, u32, String) {
    (address.to_owned(), identity, node.to_owned())
}

#[test]
fn remote_entries_are_written_with_their_node() {
    let mut e = core();
    let mut maps = Maps::default();
    e.on_map(
        B::resync()
            .node(2, "n2")
            .upsert("198.18.2.2", 300, 2)
            .upsert("198.18.2.1", 6, 2)
            .event(),
    );
    let fx = e.take_effects();
    assert!(fx.prune_remote, "a completed resync makes the map whole");
    maps.apply(&fx);
    assert_eq!(
        maps.remote(),
        vec![row("198.18.2.1", 6, "n2"), row("198.18.2.2", 300, "n2")]
    );
    assert_eq!(
        maps.nodes.get(&local(2)).map(|n| n.addresses.clone()),
        Some(vec![ip("198.18.2.1")]),
        "a node's remote-node entries are its NODES addresses"
    );
    let status = e.status().map;
    assert_eq!((status.remote, status.remote_node, status.nodes), (1, 1, 1));
}

/// Checked: failing without the `held_locally` and host checks in `Core::entry`.
#[test]
fn a_local_endpoint_or_host_address_wins_over_a_remote_claim() {
    let mut e = core();
    let mut maps = Maps::default();
    e.set_host_ips([ip("198.18.1.1")].into());
    e.on_source(SourceEvent::Reset(vec![ep("web-0", "198.18.1.2")]));
    allocate_all(&mut e, 300);
    maps.apply(&e.take_effects());
    // An IP reused after a lost delete: the other node still claims it.
    e.on_map(
        B::resync()
            .node(2, "n2")
            .upsert("198.18.1.2", 400, 2)
            .upsert("198.18.1.1", 6, 2)
            .upsert("198.18.2.2", 401, 2)
            .event(),
    );
    maps.apply(&e.take_effects());
    assert!(matches!(
        maps.entries.get(&ip("198.18.1.2")),
        Some(Entry::Local(i) | Entry::Unattached(i)) if *i == id(300)
    ));
    assert_eq!(maps.entries.get(&ip("198.18.1.1")), Some(&Entry::Host));
    assert_eq!(maps.remote(), vec![row("198.18.2.2", 401, "n2")]);
    assert_eq!(e.status().map.shadowed, 2);
    assert!(
        !e.desired()
            .entries
            .values()
            .any(|entry| matches!(entry, Entry::Remote { id: claim, .. } if *claim == id(400))),
        "the full pass wants the local entry too"
    );

    // The local endpoint goes: the remote claim is written.
    e.on_source(SourceEvent::Reset(vec![]));
    maps.apply(&e.take_effects());
    assert_eq!(
        maps.remote(),
        vec![row("198.18.1.2", 400, "n2"), row("198.18.2.2", 401, "n2")]
    );
    // So does the node's own address when the node no longer has it.
    e.set_host_ips([].into());
    maps.apply(&e.take_effects());
    assert_eq!(maps.remote().len(), 3);
}

#[test]
fn a_local_endpoint_waiting_for_its_identity_keeps_a_remote_claim_out() {
    let mut e = core();
    e.on_source(SourceEvent::Reset(vec![ep("web-0", "198.18.1.2")]));
    e.on_map(
        B::resync()
            .node(2, "n2")
            .upsert("198.18.1.2", 400, 2)
            .event(),
    );
    assert_eq!(e.entry(ip("198.18.1.2")), None);
}

/// Checked: failing when `end_resync` sweeps nothing, and when `start_resync`
/// sweeps at once.
#[test]
fn a_resync_sweeps_what_it_does_not_list_at_its_end() {
    let mut e = core();
    let mut maps = Maps::default();
    e.on_map(
        B::resync()
            .node(2, "n2")
            .node(3, "n3")
            .upsert("198.18.2.2", 300, 2)
            .upsert("198.18.3.2", 301, 3)
            .event(),
    );
    maps.apply(&e.take_effects());
    assert_eq!(maps.remote().len(), 2);

    // A new full map in two batches: nothing goes before its end.
    e.on_map(
        B::start()
            .node(2, "n2")
            .upsert("198.18.2.2", 300, 2)
            .event(),
    );
    let fx = e.take_effects();
    assert!(fx.entries.is_empty(), "an unchanged entry costs nothing");
    maps.apply(&fx);
    assert_eq!(maps.remote().len(), 2, "still the last whole map");
    e.on_map(B::default().upsert("198.18.2.3", 302, 2).end().event());
    maps.apply(&e.take_effects());
    assert_eq!(
        maps.remote(),
        vec![row("198.18.2.2", 300, "n2"), row("198.18.2.3", 302, "n2")]
    );
    assert!(
        !maps.nodes.contains_key(&local(3)),
        "a node no entry names goes"
    );
    assert_eq!(e.status().map.resyncs, 2);
}

#[test]
fn changes_between_resyncs_apply_in_order() {
    let mut e = core();
    let mut maps = Maps::default();
    e.on_map(
        B::resync()
            .node(2, "n2")
            .upsert("198.18.2.2", 300, 2)
            .event(),
    );
    e.on_map(
        B::default()
            .node(3, "n3")
            .upsert("198.18.3.2", 301, 3)
            .upsert("198.18.2.2", 310, 2)
            .event(),
    );
    e.on_map(B::default().remove("198.18.3.2").removed_node(3).event());
    maps.apply(&e.take_effects());
    assert_eq!(maps.remote(), vec![row("198.18.2.2", 310, "n2")]);
    assert_eq!(maps.nodes.len(), 1, "n3 is gone with its last entry");
}

/// Checked: failing without the `own_index` check in `RemoteMap::upsert`.
#[test]
fn entries_of_this_node_are_ignored() {
    let mut e = core();
    let mut maps = Maps::default();
    e.on_map(
        B::resync()
            .node(1, OWN)
            .node(2, "n2")
            .upsert("198.18.1.2", 300, 1)
            .upsert("198.18.1.1", 6, 1)
            .upsert("198.18.2.2", 301, 2)
            .event(),
    );
    maps.apply(&e.take_effects());
    assert_eq!(maps.remote(), vec![row("198.18.2.2", 301, "n2")]);
    assert!(
        maps.nodes.values().all(|n| n.name.as_str() != OWN),
        "this node is not in NODES"
    );
    // An address that moves to this node: the other node's claim goes.
    e.on_map(B::default().upsert("198.18.2.2", 302, 1).event());
    maps.apply(&e.take_effects());
    assert!(maps.remote().is_empty());
}

/// Checked: failing when a resync start sweeps at once.
#[test]
fn while_disconnected_the_remote_entries_stay() {
    let mut e = core();
    let mut maps = Maps::default();
    e.on_map(
        B::resync()
            .node(2, "n2")
            .upsert("198.18.2.2", 300, 2)
            .event(),
    );
    maps.apply(&e.take_effects());
    // The stream fails; a new one starts its full map and fails again.
    e.set_map_link(MapLink {
        state: MapState::Disconnected,
        last_error: Some(StreamError::Closed),
    });
    e.on_map(
        B::start()
            .node(7, "n9")
            .upsert("198.18.9.2", 309, 7)
            .event(),
    );
    maps.apply(&e.take_effects());
    assert_eq!(
        maps.remote(),
        vec![row("198.18.2.2", 300, "n2"), row("198.18.9.2", 309, "n9")],
        "nothing goes before a full map has ended"
    );
    assert!(e.desired().entries.contains_key(&ip("198.18.2.2")));
    // A later stream completes one: then the rest is swept.
    e.on_map(
        B::resync()
            .node(7, "n9")
            .upsert("198.18.9.2", 309, 7)
            .event(),
    );
    maps.apply(&e.take_effects());
    assert_eq!(maps.remote(), vec![row("198.18.9.2", 309, "n9")]);
}

#[test]
fn local_only_sweeps_every_remote_entry() {
    let mut e = core();
    let mut maps = Maps::default();
    e.on_map(
        B::resync()
            .node(2, "n2")
            .upsert("198.18.2.2", 300, 2)
            .event(),
    );
    maps.apply(&e.take_effects());
    e.on_map(MapEvent::LocalOnly);
    maps.apply(&e.take_effects());
    assert!(maps.entries.is_empty() && maps.nodes.is_empty(), "{maps:?}");
    assert!(e.desired().remote_complete);
}

/// Checked: failing when `prune_remote` is `true` from the start.
#[test]
fn nothing_remote_is_removed_before_the_first_completed_resync() {
    let mut e = core();
    assert!(!e.take_effects().prune_remote);
    assert!(!e.desired().remote_complete);
    e.on_map(
        B::start()
            .node(2, "n2")
            .upsert("198.18.2.2", 300, 2)
            .event(),
    );
    e.on_map(B::default().remove("198.18.2.2").event());
    let fx = e.take_effects();
    assert_eq!(fx.entries.get(&ip("198.18.2.2")), Some(&None));
    assert!(!fx.prune_remote, "the map is not whole yet");
    e.on_map(B::default().end().event());
    assert!(e.take_effects().prune_remote);
    assert!(e.desired().remote_complete);
}

#[test]
fn a_previous_runs_local_entry_keeps_a_remote_claim_out_until_the_source_has_spoken() {
    let found = HashMap::from([(ip("198.18.1.2"), 300)]);
    let mut e = Core::new(found).with_node(name(OWN), []);
    e.on_map(
        B::resync()
            .node(2, "n2")
            .upsert("198.18.1.2", 400, 2)
            .event(),
    );
    assert_eq!(e.take_effects().entries.get(&ip("198.18.1.2")), Some(&None));
    assert!(!e.desired().entries.contains_key(&ip("198.18.1.2")));
    // The source does not list it: the remote claim is written now.
    e.on_source(SourceEvent::Reset(vec![]));
    assert_eq!(
        e.take_effects().entries.get(&ip("198.18.1.2")),
        Some(&Some(Entry::Remote {
            id: id(400),
            node: local(2)
        }))
    );
}

/// Checked: failing when nodes are indexed by the operator's index alone.
#[test]
fn node_indexes_follow_names_so_pinned_entries_keep_naming_the_right_node() {
    let pinned = [(local(5), name("n5")), (local(9), name("gone"))];
    let mut e = Core::new(HashMap::new()).with_node(name(OWN), pinned);
    let mut maps = Maps::default();
    for (index, node) in e.remote.nodes() {
        maps.nodes.insert(index, node);
    }
    // The operator (restarted) numbers n5 as 2 and gives 5 to another node.
    e.on_map(
        B::resync()
            .node(2, "n5")
            .node(5, "n7")
            .upsert("198.18.5.2", 300, 2)
            .upsert("198.18.7.2", 301, 5)
            .event(),
    );
    maps.apply(&e.take_effects());
    assert_eq!(
        maps.remote(),
        vec![row("198.18.5.2", 300, "n5"), row("198.18.7.2", 301, "n7")]
    );
    assert_eq!(e.remote.get(ip("198.18.5.2")), Some((id(300), local(5))));
    assert!(
        !maps.nodes.contains_key(&local(9)),
        "a pinned node nothing names goes once the map is whole"
    );
    // An operator index that does not fit in NODES gets a free one.
    e.on_map(
        B::default()
            .node(70_000, "n8")
            .upsert("198.18.8.2", 302, 70_000)
            .event(),
    );
    maps.apply(&e.take_effects());
    assert!(maps.remote().contains(&row("198.18.8.2", 302, "n8")));
    // The indexes change again: every entry still names its node.
    e.on_map(
        B::resync()
            .node(1, "n7")
            .node(2, "n8")
            .node(3, "n5")
            .upsert("198.18.5.2", 300, 3)
            .upsert("198.18.7.2", 301, 1)
            .upsert("198.18.8.2", 302, 2)
            .event(),
    );
    let fx = e.take_effects();
    assert!(fx.entries.is_empty(), "no entry is rewritten: {fx:?}");
    maps.apply(&fx);
    assert_eq!(maps.remote().len(), 3);
    assert!(
        maps.remote()
            .iter()
            .all(|(_, _, n)| !n.starts_with("missing"))
    );
}

#[test]
fn an_entry_naming_an_unknown_node_is_skipped_and_counted() {
    let mut e = core();
    let applied = e.on_map(
        B::resync()
            .node(2, "n2")
            .upsert("198.18.2.2", 300, 2)
            .upsert("198.18.4.2", 300, 4)
            .event(),
    );
    assert_eq!(applied.skipped, 1);
    assert_eq!(e.remote.len(), 1);
}
