//! Remote entries and NODES through the core and reconcile on the fake datapath:
//! effects, and the full pass's repairs and prunes.

use census_proto::domain::NodeName;

use super::{fake::FakeMaps, *};
use census_agent_core::{Core, testing::B};

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap_or(IpAddr::from([0, 0, 0, 0]))
}

fn node(n: u16) -> NonZeroU16 {
    NonZeroU16::new(n).unwrap_or(NonZeroU16::MIN)
}

fn name(n: &str) -> NodeName {
    NodeName::new(n).unwrap_or_else(|e| panic!("{e}"))
}

/// The core and reconcile on a fake datapath, wired as the daemon wires them.
struct Agent {
    core: Core,
    reconciler: Reconciler,
    maps: FakeMaps,
}

impl Agent {
    fn new(maps: FakeMaps) -> Self {
        let pinned = pinned_nodes(&maps);
        let found = maps.read_endpoints().unwrap_or_default();
        Self {
            core: Core::new(adoptable(&found)).with_node(name("n1"), pinned),
            reconciler: Reconciler::default(),
            maps,
        }
    }

    fn apply(&mut self) {
        let fx = self.core.take_effects();
        let done = self.reconciler.apply(&mut self.maps, &fx);
        self.core.on_reconciled(done);
    }

    fn full_pass(&mut self) -> PassReport {
        let desired = self.core.desired();
        let prune = self.core.synced();
        self.reconciler.full_pass(&mut self.maps, &desired, prune)
    }

    fn entry(&self, address: &str) -> Option<bpf::Endpoint> {
        self.maps.entries.get(&MapKey::from(ip(address))).copied()
    }
}

fn remote(identity: u32, n: u16) -> bpf::Endpoint {
    bpf::Endpoint::remote(identity, node(n))
}

fn record(n: &str, addresses: &[&str]) -> bpf::NodeRecord {
    bpf::NodeRecord {
        name: n.to_owned(),
        addresses: addresses.iter().map(|a| ip(a)).collect(),
    }
}

#[test]
fn remote_entries_and_their_nodes_are_written() {
    let mut agent = Agent::new(FakeMaps::default());
    agent.core.on_map(
        B::resync()
            .node(2, "n2")
            .upsert("198.18.2.2", 300, 2)
            .upsert("198.18.2.1", 6, 2)
            .event(),
    );
    agent.apply();
    assert_eq!(agent.entry("198.18.2.2"), Some(remote(300, 2)));
    assert_eq!(agent.entry("198.18.2.1"), Some(remote(6, 2)));
    assert_eq!(
        agent.maps.nodes.get(&2),
        Some(&record("n2", &["198.18.2.1"]))
    );
    let writes = (agent.maps.writes, agent.maps.node_writes);
    let report = agent.full_pass();
    assert_eq!((report.written, report.repaired, report.removed), (0, 0, 0));
    assert_eq!(
        (agent.maps.writes, agent.maps.node_writes),
        writes,
        "a full pass over an unchanged map writes nothing"
    );
    // A new identity for an address: its entry is rewritten.
    agent
        .core
        .on_map(B::default().upsert("198.18.2.2", 310, 2).event());
    agent.apply();
    assert_eq!(agent.entry("198.18.2.2"), Some(remote(310, 2)));
}

/// Checked: failing when `repair_entries` skips REMOTE entries, and when
/// `repair_nodes` is not called.
#[test]
fn the_full_pass_puts_back_remote_entries_and_nodes_deleted_behind_its_back() {
    let mut agent = Agent::new(FakeMaps::default());
    agent.core.on_map(
        B::resync()
            .node(2, "n2")
            .upsert("198.18.2.2", 300, 2)
            .event(),
    );
    agent.apply();
    agent.maps.entries.remove(&MapKey::from(ip("198.18.2.2")));
    agent.maps.nodes.clear();
    let report = agent.full_pass();
    assert_eq!(report.repaired, 2, "{report:?}");
    assert_eq!(agent.entry("198.18.2.2"), Some(remote(300, 2)));
    assert_eq!(agent.maps.nodes.get(&2), Some(&record("n2", &[])));
}

/// Checked: failing when the full pass removes REMOTE entries with `prune` alone.
#[test]
fn pinned_remote_entries_stay_until_the_first_completed_resync() {
    let mut maps = FakeMaps::default();
    // A previous run's map.
    maps.entries
        .insert(MapKey::from(ip("198.18.2.2")), remote(300, 2));
    maps.entries
        .insert(MapKey::from(ip("198.18.3.2")), remote(301, 3));
    maps.nodes.insert(2, record("n2", &[]));
    maps.nodes.insert(3, record("n3", &[]));
    let mut agent = Agent::new(maps);
    agent
        .core
        .on_source(crate::source::SourceEvent::Reset(vec![]));
    agent.apply();
    assert!(agent.core.synced());
    let report = agent.full_pass();
    assert_eq!(report.removed, 0, "the map has not spoken yet");
    assert_eq!(agent.maps.entries.len(), 2);

    // The full map starts: still nothing goes.
    agent.core.on_map(
        B::start()
            .node(7, "n2")
            .upsert("198.18.2.2", 300, 7)
            .event(),
    );
    agent.apply();
    agent.full_pass();
    assert_eq!(agent.maps.entries.len(), 2);
    assert_eq!(
        agent.entry("198.18.2.2"),
        Some(remote(300, 2)),
        "n2 keeps its pinned index"
    );
    // It ends: what it lacks goes, the node at once, the entry (which the core
    // never held) in the full pass.
    agent.core.on_map(B::default().end().event());
    agent.apply();
    assert!(!agent.maps.nodes.contains_key(&3));
    let report = agent.full_pass();
    assert_eq!(report.removed, 1, "{report:?}");
    assert_eq!(agent.entry("198.18.3.2"), None);
    assert_eq!(agent.maps.nodes.keys().copied().collect::<Vec<_>>(), [2]);
}

/// Checked: failing when `write_entries` deletes REMOTE entries with `prune` only.
#[test]
fn a_remote_entry_removed_by_the_operator_goes_even_before_the_source_has_spoken() {
    let mut agent = Agent::new(FakeMaps::default());
    agent.core.on_map(
        B::resync()
            .node(2, "n2")
            .upsert("198.18.2.2", 300, 2)
            .event(),
    );
    agent.apply();
    agent
        .core
        .on_map(B::default().remove("198.18.2.2").removed_node(2).event());
    agent.apply();
    assert!(!agent.core.synced());
    assert_eq!(agent.entry("198.18.2.2"), None);
    assert!(agent.maps.nodes.is_empty());
}

#[test]
fn a_local_endpoint_taking_a_remote_address_overwrites_its_entry() {
    let mut agent = Agent::new(FakeMaps {
        interfaces: ["vethweb-0".to_owned()].into(),
        ..FakeMaps::default()
    });
    agent.core.on_map(
        B::resync()
            .node(2, "n2")
            .upsert("198.18.1.2", 300, 2)
            .event(),
    );
    agent.apply();
    agent
        .core
        .set_host_ips(["198.18.1.2".parse().unwrap_or(ip("0.0.0.0"))].into());
    agent.apply();
    assert_eq!(agent.entry("198.18.1.2"), Some(bpf::Endpoint::host()));
    agent.core.set_host_ips(BTreeSet::new());
    agent.apply();
    assert_eq!(agent.entry("198.18.1.2"), Some(remote(300, 2)));
}

/// Reconcile keeps nothing per REMOTE entry but the failed writes: the status
/// counts every REMOTE entry in force as written except those, and the full pass
/// that finally writes one says "written", not "repaired".
/// Checked: failing when a failed REMOTE write is not remembered (`failed`), and
/// when the status counts the claims without subtracting the failures.
#[test]
fn a_remote_entry_whose_write_failed_is_not_counted_written_until_it_is() {
    let mut agent = Agent::new(FakeMaps {
        endpoints_max_entries: Some(2),
        ..FakeMaps::default()
    });
    agent.core.on_map(
        B::resync()
            .node(2, "n2")
            .upsert("198.18.2.2", 300, 2)
            .upsert("198.18.2.3", 301, 2)
            .upsert("198.18.2.4", 302, 2)
            .event(),
    );
    agent.apply();
    assert_eq!(agent.maps.entries.len(), 2, "ENDPOINTS is full");
    assert_eq!(agent.core.status().map_entries, 2);

    agent.maps.endpoints_max_entries = None;
    let report = agent.full_pass();
    assert_eq!((report.written, report.repaired), (1, 0), "{report:?}");
    let desired = agent.core.desired();
    let outcome = agent.reconciler.pass_outcome(&desired, report);
    agent.core.on_reconciled(outcome);
    assert_eq!(agent.core.status().map_entries, 3);

    // A REMOTE entry deleted behind the agent's back is a repair.
    agent.maps.entries.remove(&MapKey::from(ip("198.18.2.3")));
    let report = agent.full_pass();
    assert_eq!((report.written, report.repaired), (0, 1), "{report:?}");
}

/// A removal reads what ENDPOINTS holds for an address this agent wrote no local
/// entry for: the REMOTE entry it finds goes (with `prune_remote`), whatever value
/// it holds.
/// Checked: failing when `removal` skips an address it has no local entry for.
#[test]
fn a_removed_claim_deletes_the_remote_entry_it_finds() {
    let mut agent = Agent::new(FakeMaps::default());
    agent.core.on_map(
        B::resync()
            .node(2, "n2")
            .upsert("198.18.2.2", 300, 2)
            .event(),
    );
    agent.apply();
    // Written again by someone else, with another identity: still REMOTE.
    agent
        .maps
        .entries
        .insert(MapKey::from(ip("198.18.2.2")), remote(999, 2));
    agent.core.on_map(B::default().remove("198.18.2.2").event());
    agent.apply();
    assert_eq!(agent.entry("198.18.2.2"), None);
    assert_eq!(agent.core.status().map_entries, 0);
}
