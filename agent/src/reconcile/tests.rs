use census_proto::domain::IdentityId;

use super::{fake::FakeMaps, *};
use crate::{
    agent_core::{Entry, InterfaceChange},
    bpf::interface_slot,
    reconcile::endpoints::ENDPOINTS,
};

#[test]
fn only_local_entries_are_adoptable() {
    let found = BTreeMap::from([
        (MapKey::from(ip("198.18.1.2")), bpf::Endpoint::local(300)),
        (
            MapKey::from(ip("198.18.1.3")),
            bpf::Endpoint::unattached(301),
        ),
        (MapKey::from(ip("198.18.1.1")), bpf::Endpoint::host()),
    ]);
    assert_eq!(adoptable(&found), HashMap::from([(ip("198.18.1.2"), 300)]));
}

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap_or(IpAddr::from([0, 0, 0, 0]))
}

fn id(n: u32) -> IdentityId {
    IdentityId::new(n).unwrap_or(IdentityId::WORLD)
}

fn desired(entries: &[(&str, Entry)], interfaces: &[&str]) -> Desired {
    Desired {
        entries: entries.iter().map(|(i, e)| (ip(i), *e)).collect(),
        interfaces: interfaces.iter().map(|s| (*s).to_owned()).collect(),
        ..Desired::default()
    }
}

/// Interfaces with their INTERFACES identities (`None`: no single identity).
fn with_identities(interfaces: &[(&str, Option<u32>)]) -> Desired {
    Desired {
        interfaces: interfaces.iter().map(|(i, _)| (*i).to_owned()).collect(),
        interface_identities: interfaces
            .iter()
            .filter_map(|(i, n)| Some(((*i).to_owned(), id((*n)?))))
            .collect(),
        ..Desired::default()
    }
}

fn entries_of(maps: &FakeMaps) -> Vec<(String, Option<u32>)> {
    maps.interface_entries().into_iter().collect()
}

fn maps_with(interfaces: &[&str]) -> FakeMaps {
    FakeMaps {
        interfaces: interfaces.iter().map(|s| (*s).to_owned()).collect(),
        ..FakeMaps::default()
    }
}

#[test]
fn full_pass_writes_what_is_missing_and_nothing_more() {
    let mut maps = maps_with(&["veth0"]);
    let mut r = Reconciler::default();
    let want = desired(
        &[
            ("198.18.1.2", Entry::Local(id(300))),
            ("198.18.1.1", Entry::Host),
        ],
        &["veth0"],
    );
    let report = r.full_pass(&mut maps, &want, true);
    assert_eq!((report.written, report.repaired, report.removed), (2, 0, 0));
    assert_eq!(maps.entries.len(), 2);
    assert_eq!(maps.attaches, 1);

    let writes = maps.writes;
    let report = r.full_pass(&mut maps, &want, true);
    assert_eq!((report.written, report.repaired, report.removed), (0, 0, 0));
    assert_eq!(maps.writes, writes, "an unchanged datapath costs no write");
    assert_eq!(maps.attaches, 1, "nor an attach");
}

#[test]
fn full_pass_repairs_changes_made_behind_its_back() {
    let mut maps = maps_with(&["veth0"]);
    let mut r = Reconciler::default();
    let want = desired(
        &[
            ("198.18.1.2", Entry::Local(id(300))),
            ("198.18.2.2", Entry::Local(id(301))),
        ],
        &["veth0"],
    );
    r.full_pass(&mut maps, &want, true);
    // Someone changes one entry, deletes another, adds a third, detaches a link.
    maps.entries
        .insert(MapKey::from(ip("198.18.1.2")), bpf::Endpoint::local(999));
    maps.entries.remove(&MapKey::from(ip("198.18.2.2")));
    maps.entries
        .insert(MapKey::from(ip("198.18.9.9")), bpf::Endpoint::local(5));
    maps.links.clear();

    let report = r.full_pass(&mut maps, &want, true);
    assert_eq!((report.repaired, report.removed), (2, 1));
    let entries: Vec<_> = maps
        .entries
        .iter()
        .map(|(k, e)| (k.ip(), e.identity))
        .collect();
    assert_eq!(
        entries,
        vec![(Some(ip("198.18.1.2")), 300), (Some(ip("198.18.2.2")), 301)]
    );
    assert_eq!(maps.attaches, 2, "the lost link is attached again");
}

#[test]
fn nothing_is_removed_without_prune() {
    let mut maps = maps_with(&["veth0"]);
    maps.entries
        .insert(MapKey::from(ip("198.18.9.9")), bpf::Endpoint::local(5));
    maps.links
        .insert("old0".to_owned(), AttachmentState::Attached { ifindex: 3 });
    let mut r = Reconciler::default();
    let report = r.full_pass(&mut maps, &Desired::default(), false);
    assert_eq!(report.removed, 0);
    assert_eq!(maps.entries.len(), 1, "a previous run's entries stay");
    assert!(maps.links.contains_key("old0"), "and its links");

    let report = r.full_pass(&mut maps, &Desired::default(), true);
    assert_eq!(report.removed, 1);
    assert!(maps.entries.is_empty());
    assert!(maps.links.is_empty());
}

#[test]
fn incremental_changes_touch_only_their_addresses() {
    let mut maps = maps_with(&[]);
    let mut r = Reconciler::default();
    let a = ip("198.18.1.2");
    let fx = |entry: Option<Entry>| Effects {
        entries: [(a, entry)].into(),
        prune: true,
        ..Effects::default()
    };
    let reconciled = r.apply(&mut maps, &fx(Some(Entry::Local(id(300)))));
    assert!(reconciled.entry_failures.is_empty());
    assert_eq!(reconciled.entries, [a].into());
    assert_eq!(reconciled.local_entries, 1);
    assert_eq!(maps.writes, 1);
    r.apply(&mut maps, &fx(Some(Entry::Local(id(300)))));
    assert_eq!(maps.writes, 1, "already written");
    let kept = Effects {
        prune: false,
        ..fx(None)
    };
    r.apply(&mut maps, &kept);
    assert_eq!(maps.entries.len(), 1, "nothing is removed without prune");
    let reconciled = r.apply(&mut maps, &fx(None));
    assert!(maps.entries.is_empty());
    assert_eq!(r.entries(), 0);
    assert_eq!(reconciled.local_entries, 0);
}

#[test]
fn missing_interfaces_are_reported_and_retried() {
    let mut maps = maps_with(&[]);
    let mut r = Reconciler::default();
    let want = desired(&[], &["veth0"]);
    let report = r.full_pass(&mut maps, &want, true);
    assert_eq!(report.interface_errors.len(), 1);
    assert!(
        report.interface_errors[0]
            .1
            .to_string()
            .contains("veth0 does not exist")
    );
    maps.interfaces.insert("veth0".to_owned());
    let report = r.full_pass(&mut maps, &want, true);
    assert!(report.interface_errors.is_empty());
    assert_eq!(maps.attaches, 1);
}

#[test]
fn defunct_links_are_pruned() {
    let mut maps = maps_with(&["veth0"]);
    maps.links
        .insert("gone0".to_owned(), AttachmentState::Defunct);
    let mut r = Reconciler::default();
    let report = r.full_pass(&mut maps, &desired(&[], &["veth0"]), false);
    assert_eq!(report.pruned, 2);
    assert_eq!(maps.links.len(), 1);
}

#[test]
fn interface_entries_follow_attachments_and_identities() {
    let mut maps = maps_with(&["veth0", "veth1"]);
    let mut r = Reconciler::default();
    let want = with_identities(&[("veth0", Some(300)), ("veth1", None)]);
    let report = r.full_pass(&mut maps, &want, true);
    assert!(report.interface_errors.is_empty(), "{report:?}");
    assert_eq!(
        entries_of(&maps),
        vec![("veth0".into(), Some(300)), ("veth1".into(), None)],
        "an interface without a single identity still has an entry"
    );
    let writes = maps.interface_writes;
    r.full_pass(&mut maps, &want, true);
    assert_eq!(
        maps.interface_writes, writes,
        "nothing changed, nothing written"
    );

    // veth0's endpoint gets a new identity, veth1's gets its first.
    let attach = |n| InterfaceChange::Attach {
        identity: Some(id(n)),
    };
    let failures = r.apply_interfaces(
        &mut maps,
        [
            ("veth0".to_owned(), attach(301)),
            ("veth1".to_owned(), attach(400)),
        ],
        true,
    );
    assert!(failures.is_empty(), "{failures:?}");
    assert_eq!(
        entries_of(&maps),
        vec![("veth0".into(), Some(301)), ("veth1".into(), Some(400))]
    );
    assert_eq!(
        maps.attaches, 2,
        "already attached: only the entries change"
    );

    // veth1's endpoint goes: its entry before its classifier.
    let failures = r.apply_interfaces(
        &mut maps,
        [("veth1".to_owned(), InterfaceChange::Detach)],
        true,
    );
    assert!(failures.is_empty(), "{failures:?}");
    assert_eq!(entries_of(&maps), vec![("veth0".into(), Some(301))]);
    assert!(!maps.links.contains_key("veth1"));
    assert_eq!(
        maps.unattached_entries, 0,
        "no entry without its classifier"
    );
}

#[test]
fn interface_entries_changed_behind_its_back_are_repaired() {
    let mut maps = maps_with(&["veth0"]);
    let mut r = Reconciler::default();
    let want = with_identities(&[("veth0", Some(300))]);
    r.full_pass(&mut maps, &want, true);
    let ifindex = maps.ifindex("veth0");
    let slot = interface_slot(ifindex);
    // Someone rewrites veth0's entry, adds one for an interface census is not
    // on, and one in a slot that is not its interface's.
    maps.slots.insert(
        slot,
        bpf::Interface {
            ifindex,
            identity: Some(999),
        },
    );
    let stray = bpf::Interface {
        ifindex: 7,
        identity: Some(5),
    };
    maps.slots.insert(interface_slot(7), stray);
    maps.slots.insert(3, stray);

    let report = r.full_pass(&mut maps, &want, false);
    assert_eq!(
        (report.repaired, report.removed),
        (1, 0),
        "nothing removed before the first full set"
    );
    assert_eq!(maps.slots.len(), 3);

    let report = r.full_pass(&mut maps, &want, true);
    assert_eq!((report.repaired, report.removed), (0, 2));
    assert_eq!(entries_of(&maps), vec![("veth0".into(), Some(300))]);
    assert_eq!(maps.slots.len(), 1);
}

#[test]
fn a_shared_slot_goes_to_the_first_interface_then_to_the_other() {
    let mut maps = maps_with(&["veth0", "veth1"]);
    maps.ifindexes.insert("veth0".into(), 5);
    maps.ifindexes
        .insert("veth1".into(), 5 + census_common::INTERFACES_MAX_ENTRIES);
    let mut r = Reconciler::default();
    let want = with_identities(&[("veth0", Some(300)), ("veth1", Some(301))]);
    let report = r.full_pass(&mut maps, &want, true);
    assert!(
        report.interface_errors.is_empty(),
        "not an error: {report:?}"
    );
    assert_eq!(entries_of(&maps), vec![("veth0".into(), Some(300))]);
    assert_eq!(r.crowded_interfaces(), 1, "veth1 is counted by address");
    assert!(maps.links.contains_key("veth1"), "and still attached");

    // veth0 goes; at the next pass veth1 has the slot.
    let want = with_identities(&[("veth1", Some(301))]);
    r.full_pass(&mut maps, &want, true);
    assert_eq!(entries_of(&maps), vec![("veth1".into(), Some(301))]);
    assert_eq!(r.crowded_interfaces(), 0);
    assert_eq!(maps.unattached_entries, 0);
}

#[test]
fn a_lost_or_replaced_link_loses_its_entry_until_attached_again() {
    let mut maps = maps_with(&["veth0"]);
    let mut r = Reconciler::default();
    let want = with_identities(&[("veth0", Some(300))]);
    r.full_pass(&mut maps, &want, true);
    let old = maps.ifindex("veth0");

    // The interface is deleted and created again under the same name.
    maps.links.insert("veth0".into(), AttachmentState::Defunct);
    maps.ifindexes.insert("veth0".into(), 200);
    let report = r.full_pass(&mut maps, &want, false);
    assert!(report.interface_errors.is_empty(), "{report:?}");
    assert_eq!(
        maps.links.get("veth0"),
        Some(&AttachmentState::Attached { ifindex: 200 })
    );
    assert_eq!(entries_of(&maps), vec![("veth0".into(), Some(300))]);
    assert!(
        !maps.slots.values().any(|held| held.ifindex == old),
        "the old interface's entry is gone, also before the first full set"
    );
    assert_eq!(maps.unattached_entries, 0);
}

/// The link pass alone (after a link change) re-attaches a re-created interface
/// and says it is attached, and touches no ENDPOINTS entry.
/// Checked: failing when `link_pass` does not repair the links.
#[test]
fn a_link_pass_reattaches_a_recreated_interface_without_touching_entries() {
    let mut maps = maps_with(&["veth0"]);
    let mut r = Reconciler::default();
    let want = desired(&[("198.18.1.2", Entry::Local(id(300)))], &["veth0"]);
    r.full_pass(&mut maps, &want, true);
    let (writes, attaches) = (maps.writes, maps.attaches);

    maps.links.insert("veth0".into(), AttachmentState::Defunct);
    maps.ifindexes.insert("veth0".into(), 200);
    let interfaces = Desired {
        interfaces: want.interfaces.clone(),
        interface_identities: want.interface_identities.clone(),
        ..Desired::default()
    };
    let outcome = r.link_pass(&mut maps, &interfaces, true);
    assert_eq!(
        maps.links.get("veth0"),
        Some(&AttachmentState::Attached { ifindex: 200 })
    );
    assert_eq!(maps.attaches, attaches + 1);
    assert!(outcome.attached.contains("veth0"), "{outcome:?}");
    assert!(outcome.interface_failures.is_empty());
    assert_eq!(maps.writes, writes, "no ENDPOINTS entry written");
    assert_eq!(maps.entries.len(), 1, "none removed");

    // Gone for good: the link pass says it is not attached.
    maps.interfaces.remove("veth0");
    maps.links.insert("veth0".into(), AttachmentState::Defunct);
    let outcome = r.link_pass(&mut maps, &interfaces, true);
    assert!(!outcome.attached.contains("veth0"), "{outcome:?}");
    assert_eq!(outcome.interface_failures.len(), 1);
}

#[test]
fn a_datapath_removed_under_the_agent_is_put_back_by_the_full_pass() {
    let mut maps = maps_with(&["veth0"]);
    let mut r = Reconciler::default();
    let want = desired(&[("198.18.1.2", Entry::Local(id(300)))], &["veth0"]);
    let _ = r.full_pass(&mut maps, &want, true);
    assert_eq!(maps.attaches, 1);

    // `census-agent uninstall` while the agent runs, and the pins cannot come back yet.
    maps.uninstall();
    maps.unpinnable = Some("not on a bpffs");
    let report = r.full_pass(&mut maps, &want, true);
    assert!(report.datapath_error.is_some());
    let outcome = r.pass_outcome(&want, report);
    let health = outcome.datapath.as_ref().map(|h| h.error.is_some());
    assert_eq!(
        health,
        Some(true),
        "the pass says the datapath is not whole"
    );
    assert_eq!(maps.attaches, 1, "nothing is attached without pins");

    maps.unpinnable = None;
    let report = r.full_pass(&mut maps, &want, true);
    assert!(report.repinned && report.datapath_error.is_none());
    assert_eq!(maps.repins, 1);
    assert_eq!(maps.attaches, 2, "the classifier is attached again");
    assert_eq!(
        maps.links.get("veth0"),
        Some(&AttachmentState::Attached { ifindex: 100 })
    );
    let outcome = r.pass_outcome(&want, report);
    assert!(outcome.attached.contains("veth0"));
    assert!(outcome.datapath.is_some_and(|h| h.error.is_none()));
}

#[test]
fn a_program_in_front_is_reported_and_moved_behind_only_if_asked() {
    let in_front = bpf::InFront {
        direction: bpf::Direction::Ingress,
        program: "cni_policy".to_owned(),
        program_id: 42,
    };
    for reassert in [false, true] {
        let mut maps = maps_with(&["veth0"]);
        let mut r = Reconciler::default().reassert_order(reassert);
        let want = with_identities(&[("veth0", Some(300))]);
        let _ = r.full_pass(&mut maps, &want, true);
        maps.in_front
            .insert("veth0".to_owned(), vec![in_front.clone()]);
        let report = r.full_pass(&mut maps, &want, true);
        assert_eq!(report.in_front.len(), 1, "reassert: {reassert}");
        assert_eq!(report.in_front[0].program, "cni_policy");
        assert_eq!(report.in_front[0].direction.name(), "ingress");
        assert_eq!(
            maps.attaches,
            if reassert { 2 } else { 1 },
            "attached first again only when asked (reassert: {reassert})"
        );
        assert_eq!(
            entries_of(&maps),
            vec![("veth0".to_owned(), Some(300))],
            "its INTERFACES entry is back (reassert: {reassert})"
        );
    }
}

#[test]
fn interfaces_attached_at_start_are_those_with_both_hooks() {
    let mut maps = maps_with(&["veth0", "veth1"]);
    maps.links.insert(
        "veth0".to_owned(),
        AttachmentState::Attached { ifindex: 100 },
    );
    maps.links
        .insert("veth1".to_owned(), AttachmentState::Defunct);
    assert_eq!(
        attached_at_start(&maps),
        BTreeSet::from(["veth0".to_owned()])
    );
}

#[test]
fn a_write_into_a_full_endpoints_is_counted_and_the_others_still_written() {
    let mut maps = FakeMaps {
        endpoints_max_entries: Some(2),
        ..maps_with(&[])
    };
    let mut r = Reconciler::default();
    let want = desired(
        &[
            ("198.18.1.1", Entry::Host),
            ("198.18.1.2", Entry::Unattached(id(300))),
            ("198.18.1.3", Entry::Unattached(id(301))),
        ],
        &[],
    );
    let report = r.full_pass(&mut maps, &want, true);
    assert_eq!(maps.entries.len(), 2, "the map holds what fits");
    assert_eq!(report.entry_errors.len(), 1, "{:?}", report.entry_errors);
    assert!(
        matches!(
            report.entry_errors[0].1,
            bpf::Error::MapFull {
                map: ENDPOINTS,
                max_entries: 2,
                ..
            }
        ),
        "{:?}",
        report.entry_errors
    );
    let full = |r: &Reconciler| {
        r.metrics
            .map_full
            .get_or_create(&MapLabels { map: ENDPOINTS })
            .get()
    };
    assert_eq!(full(&r), 1);
    // Room made: the next pass writes it.
    maps.endpoints_max_entries = Some(3);
    let report = r.full_pass(&mut maps, &want, true);
    assert!(report.entry_errors.is_empty(), "{:?}", report.entry_errors);
    assert_eq!(maps.entries.len(), 3);
    assert_eq!(full(&r), 1);
}
