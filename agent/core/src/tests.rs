//! The core alone: events in, effects out, no datapath and no operator.

use std::collections::{BTreeMap, HashMap};

use census_proto::labels::LabelLimits;

use super::*;

fn ep(name: &str, ip: &str, app: &str) -> SourceEndpoint {
    let ip: IpAddr = ip.parse().unwrap_or(IpAddr::from([0, 0, 0, 0]));
    SourceEndpoint {
        key: EndpointKey::new("default", name).unwrap_or_else(|e| panic!("{e}")),
        ips: vec![ip].into_boxed_slice(),
        labels: BTreeMap::from([("app".to_owned(), app.to_owned())]),
        service_account: "default".to_owned(),
        interface: HostInterface::Named(format!("veth{name}")),
    }
}

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap_or(IpAddr::from([0, 0, 0, 0]))
}

fn id(n: u32) -> IdentityId {
    IdentityId::new(n).unwrap_or(IdentityId::WORLD)
}

fn key(name: &str) -> EndpointKey {
    EndpointKey::new("default", name).unwrap_or_else(|e| panic!("{e}"))
}

fn labels_of(e: &Core, name: &str) -> LabelSet {
    match &e.table[&key(name)].wanted {
        Ok(l) => l.clone(),
        Err(reason) => panic!("{reason}"),
    }
}

/// The operator answers `id` for `name`'s label set.
fn allocated(e: &mut Core, name: &str, n: u32) {
    let labels = labels_of(e, name);
    e.on_allocation(AllocationEvent::Allocated {
        request: AllocationId::new(0),
        labels,
        id: id(n),
    });
}

/// The requests `fx` starts.
fn started(fx: &Effects) -> Vec<AllocationRequest> {
    fx.started().cloned().collect()
}

/// The operator answers `request` with `n`.
fn answer(e: &mut Core, request: &AllocationRequest, n: u32) {
    e.on_allocation(AllocationEvent::Allocated {
        request: request.id,
        labels: request.labels.clone(),
        id: id(n),
    });
}

/// `fx`'s reports, in order: `upsert web-0 300`, `delete web-0`, `settled 2`.
fn reports(fx: &Effects) -> Vec<String> {
    fx.reports
        .iter()
        .map(|report| match report {
            Report::Upsert(endpoint) => {
                format!("upsert {} {}", endpoint.key.name(), endpoint.identity)
            }
            Report::Delete(key) => format!("delete {}", key.name()),
            Report::Settled(upto) => format!("settled {}", upto.get()),
        })
        .collect()
}

/// ENDPOINTS as the effects leave it, applied as reconcile applies them.
#[derive(Debug, Default)]
struct Maps(BTreeMap<IpAddr, Entry>);

impl Maps {
    fn apply(&mut self, fx: &Effects) {
        for (ip, entry) in &fx.entries {
            match entry {
                Some(entry) => {
                    self.0.insert(*ip, *entry);
                }
                None if fx.prune => {
                    self.0.remove(ip);
                }
                None => {}
            }
        }
    }

    fn entries(&self) -> Vec<(String, u32)> {
        self.0
            .iter()
            .map(|(ip, entry)| {
                let identity = match entry {
                    Entry::Local(id) | Entry::Unattached(id) | Entry::Remote { id, .. } => id.get(),
                    Entry::Host => 1,
                };
                (ip.to_string(), identity)
            })
            .collect()
    }
}

fn counts(e: &Core) -> (u64, u64, u64) {
    let status = e.status();
    (status.programmed, status.waiting, status.errors)
}

fn state(e: &Core, name: &str) -> Option<(EndpointState, Option<String>)> {
    let view = e.view();
    let status = view.into_iter().find(|s| s.key.name() == name)?;
    Some((status.state, status.problem.map(|p| p.to_string())))
}

#[test]
fn endpoints_are_written_once_their_identity_is_known() {
    let mut e = Core::new(HashMap::new());
    let mut maps = Maps::default();
    e.on_source(SourceEvent::Reset(vec![
        ep("web-0", "198.18.1.2", "web"),
        ep("web-1", "198.18.2.2", "web"),
        ep("db-0", "198.18.3.2", "db"),
    ]));
    let fx = e.take_effects();
    assert_eq!(fx.started().count(), 2, "one request per label set");
    assert!(fx.reports.is_empty(), "nothing held yet, nothing reported");
    maps.apply(&fx);
    assert!(maps.0.is_empty(), "waiting endpoints are not written");
    assert_eq!(counts(&e), (0, 3, 0));

    allocated(&mut e, "web-0", 300);
    let fx = e.take_effects();
    maps.apply(&fx);
    assert_eq!(
        maps.entries(),
        vec![("198.18.1.2".into(), 300), ("198.18.2.2".into(), 300)]
    );
    assert_eq!(
        reports(&fx),
        ["upsert web-0 300", "upsert web-1 300", "settled 1"]
    );
    assert_eq!(counts(&e), (2, 1, 0));
    let view = e.view();
    assert_eq!(view[0].key.name(), "db-0", "sorted by namespace/name");
    assert_eq!(view[0].identity, None);
    assert_eq!(view[1].identity, Some(id(300)));
    assert!(
        view[1]
            .labels
            .as_ref()
            .is_some_and(|l| l.to_strings().contains(&"k8s:app=web".to_owned()))
    );
}

#[test]
fn deleting_an_endpoint_removes_its_entry_and_reports_it() {
    let mut e = Core::new(HashMap::new());
    let mut maps = Maps::default();
    e.on_source(SourceEvent::Reset(vec![ep("web-0", "198.18.1.2", "web")]));
    allocated(&mut e, "web-0", 300);
    maps.apply(&e.take_effects());

    e.on_source(SourceEvent::Reset(vec![]));
    let fx = e.take_effects();
    maps.apply(&fx);
    assert!(maps.0.is_empty());
    assert!(matches!(fx.reports.as_slice(), [Report::Delete(k)] if k.name() == "web-0"));
    assert_eq!(
        fx.interfaces.get("vethweb-0"),
        Some(&InterfaceChange::Detach)
    );
    assert!(e.cache.is_empty(), "the identity is no longer in use");
    assert!(e.desired().interfaces.is_empty());
}

#[test]
fn a_label_change_keeps_the_old_identity_until_the_new_one_is_known() {
    let mut e = Core::new(HashMap::new());
    let mut maps = Maps::default();
    e.on_source(SourceEvent::Reset(vec![ep("web-0", "198.18.1.2", "web")]));
    allocated(&mut e, "web-0", 300);
    maps.apply(&e.take_effects());

    e.on_source(SourceEvent::Upsert(ep("web-0", "198.18.1.2", "api")));
    let fx = e.take_effects();
    assert_eq!(fx.started().count(), 1);
    maps.apply(&fx);
    assert_eq!(
        maps.entries(),
        vec![("198.18.1.2".into(), 300)],
        "fail-static"
    );
    assert_eq!(counts(&e), (0, 1, 0));

    allocated(&mut e, "web-0", 301);
    maps.apply(&e.take_effects());
    assert_eq!(maps.entries(), vec![("198.18.1.2".into(), 301)]);
    assert_eq!(e.cache.ids(), [id(301)].into(), "the old set is dropped");
}

#[test]
fn rebind_moves_every_endpoint_of_the_label_set() {
    let mut e = Core::new(HashMap::new());
    let mut maps = Maps::default();
    e.on_source(SourceEvent::Reset(vec![
        ep("web-0", "198.18.1.2", "web"),
        ep("web-1", "198.18.2.2", "web"),
    ]));
    allocated(&mut e, "web-0", 300);
    maps.apply(&e.take_effects());

    e.on_operator(OperatorEvent::Rebind {
        key: key("web-0"),
        id: id(400),
    });
    let fx = e.take_effects();
    maps.apply(&fx);
    assert_eq!(
        maps.entries(),
        vec![("198.18.1.2".into(), 400), ("198.18.2.2".into(), 400)]
    );
    assert_eq!(
        fx.reports.len(),
        2,
        "both are reported with the new identity"
    );
    assert!(!e.rebind(&key("nope"), id(5)));
}

#[test]
fn a_restarted_agent_keeps_the_identities_the_maps_held() {
    let found = HashMap::from([(ip("198.18.1.2"), 300), (ip("198.18.9.9"), 301)]);
    // Its interface still has the previous run's links.
    let mut e = Core::new(found).with_attached(["vethweb-0".to_owned()].into());
    e.on_source(SourceEvent::Reset(vec![
        ep("web-0", "198.18.1.2", "web"),
        ep("db-0", "198.18.3.2", "db"),
    ]));
    let reported: Vec<(String, u32)> = e
        .reported()
        .iter()
        .map(|r| (r.key.to_string(), r.identity.get()))
        .collect();
    assert_eq!(reported, vec![("default/web-0".to_owned(), 300)]);
    let fx = e.take_effects();
    assert_eq!(fx.started().count(), 2, "the operator is still asked");
    assert_eq!(
        fx.entries.get(&ip("198.18.1.2")),
        Some(&Some(Entry::Local(id(300))))
    );
    assert_eq!(
        e.entry(ip("198.18.9.9")),
        None,
        "an address no endpoint claims is removed"
    );
}

#[test]
fn invalid_labels_are_an_error_not_an_identity() {
    let mut e = Core::new(HashMap::new());
    e.on_operator(OperatorEvent::Settings(LabelSettings {
        limits: LabelLimits { max_labels: 2 },
        ..LabelSettings::default()
    }));
    e.on_source(SourceEvent::Reset(vec![ep("web-0", "198.18.1.2", "web")]));
    assert_eq!(e.take_effects().started().count(), 0);
    let (state, problem) = state(&e, "web-0").unwrap_or((EndpointState::Programmed, None));
    assert_eq!(state, EndpointState::Error);
    assert_eq!(
        problem.as_deref(),
        Some("no identity labels: 3 labels exceed the limit of 2")
    );
}

fn verdict(scope: VerdictScope, rejected: &[(&str, &str)], pending: &[&str]) -> Verdict {
    Verdict {
        scope,
        rejected: rejected
            .iter()
            .map(|(name, reason)| (key(name), (*reason).to_owned()))
            .collect(),
        pending: pending.iter().map(|name| key(name)).collect(),
    }
}

#[test]
fn the_operators_verdicts_mark_endpoints_until_an_ack_says_otherwise() {
    let mut e = Core::new(HashMap::new());
    e.on_source(SourceEvent::Reset(vec![
        ep("web-0", "198.18.1.2", "web"),
        ep("db-0", "198.18.2.2", "db"),
        ep("api-0", "198.18.3.2", "api"),
    ]));
    for name in ["web-0", "db-0", "api-0"] {
        allocated(&mut e, name, 300);
    }
    assert_eq!(counts(&e), (3, 0, 0));

    // A snapshot's Ack speaks for every endpoint.
    e.on_verdict(verdict(
        VerdictScope::All,
        &[("web-0", "labels[0]: bad"), ("gone-0", "labels[0]: bad")],
        &["db-0"],
    ));
    assert_eq!(
        state(&e, "web-0"),
        Some((
            EndpointState::Error,
            Some("the operator rejected it: labels[0]: bad".to_owned())
        ))
    );
    assert_eq!(
        state(&e, "db-0"),
        Some((
            EndpointState::WaitingForIdentity,
            Some("the operator decides its identity after its adoption window".to_owned())
        ))
    );
    assert_eq!(counts(&e), (1, 1, 1));

    // A delta's Ack speaks for its own endpoint only.
    e.on_verdict(verdict(VerdictScope::One(key("api-0")), &[], &[]));
    assert_eq!(counts(&e), (1, 1, 1));
    e.on_verdict(verdict(
        VerdictScope::One(key("api-0")),
        &[("api-0", "ips[0]: bad")],
        &[],
    ));
    assert_eq!(counts(&e), (0, 1, 2));
    e.on_verdict(verdict(VerdictScope::One(key("api-0")), &[], &[]));
    assert_eq!(counts(&e), (1, 1, 1));

    // A Rebind decides a pending endpoint; a snapshot that names nobody clears all.
    assert!(e.rebind(&key("db-0"), id(301)));
    assert_eq!(state(&e, "db-0"), Some((EndpointState::Programmed, None)));
    e.on_verdict(verdict(VerdictScope::All, &[], &[]));
    assert_eq!(counts(&e), (3, 0, 0));
}

#[test]
fn host_addresses_are_flagged_host_unless_an_endpoint_holds_them() {
    let mut e = Core::new(HashMap::new());
    let node = ip("198.18.1.1");
    e.set_host_ips([node].into());
    let fx = e.take_effects();
    assert_eq!(fx.entries.get(&node), Some(&Some(Entry::Host)));
    assert_eq!(e.desired().entries.len(), 1);
}

#[test]
fn an_endpoint_without_an_interface_is_written_and_shows_why() {
    let mut e = Core::new(HashMap::new());
    let mut maps = Maps::default();
    let mut lost = ep("web-0", "198.18.1.2", "web");
    lost.interface = HostInterface::Unknown("no route to 198.18.1.2 (unreachable)".into());
    e.on_source(SourceEvent::Reset(vec![lost]));
    assert!(e.take_effects().interfaces.is_empty(), "nothing to attach");
    allocated(&mut e, "web-0", 300);
    let fx = e.take_effects();
    maps.apply(&fx);
    assert_eq!(maps.entries(), vec![("198.18.1.2".into(), 300)]);
    assert_eq!(
        e.entry(ip("198.18.1.2")),
        Some(Entry::Unattached(id(300))),
        "not LOCAL: no census hook counts its packets as they leave it"
    );
    assert_eq!(
        reports(&fx),
        ["upsert web-0 300", "settled 1"],
        "the operator counts it"
    );
    let view = e.view();
    assert_eq!(view[0].state, EndpointState::Error);
    assert_eq!(
        view[0].problem.as_ref().map(ToString::to_string).as_deref(),
        Some("no host-side interface: no route to 198.18.1.2 (unreachable)")
    );
    assert_eq!(view[0].interface, None);
    assert_eq!(e.status().interfaces, 0);

    e.on_source(SourceEvent::Upsert(ep("web-0", "198.18.1.2", "web")));
    let fx = e.take_effects();
    assert_eq!(
        fx.interfaces.get("vethweb-0"),
        Some(&InterfaceChange::Attach {
            identity: Some(id(300))
        }),
        "found later: attached"
    );
    assert_eq!(counts(&e), (1, 0, 0));
}

#[test]
fn an_interface_carries_the_identity_every_endpoint_behind_it_holds() {
    let mut e = Core::new(HashMap::new());
    let mut web1 = ep("web-1", "198.18.2.2", "web");
    web1.interface = HostInterface::Named("vethweb-0".into());
    let mut db1 = ep("db-1", "198.18.4.2", "db");
    db1.interface = HostInterface::Named("vethdb-0".into());
    e.on_source(SourceEvent::Reset(vec![
        ep("web-0", "198.18.1.2", "web"),
        web1,
        ep("db-0", "198.18.3.2", "db"),
        db1,
        ep("api-0", "198.18.5.2", "api"),
    ]));
    assert!(e.interface_identities().is_empty(), "nobody holds one yet");
    let _ = e.take_effects();

    allocated(&mut e, "web-0", 300);
    allocated(&mut e, "db-0", 301);
    let fx = e.take_effects();
    assert_eq!(
        fx.interfaces,
        BTreeMap::from([
            (
                "vethdb-0".to_owned(),
                InterfaceChange::Attach {
                    identity: Some(id(301))
                }
            ),
            (
                "vethweb-0".to_owned(),
                InterfaceChange::Attach {
                    identity: Some(id(300))
                }
            ),
        ]),
        "an identity known is an INTERFACES entry to write"
    );
    assert_eq!(
        e.interface_identities(),
        HashMap::from([("vethweb-0", id(300)), ("vethdb-0", id(301))]),
        "api-0 still waits: its interface has no identity"
    );

    // db-1 moves to another label set: two identities behind one interface.
    let mut db1 = ep("db-1", "198.18.4.2", "cache");
    db1.interface = HostInterface::Named("vethdb-0".into());
    e.on_source(SourceEvent::Upsert(db1));
    allocated(&mut e, "db-1", 302);
    let fx = e.take_effects();
    assert_eq!(
        fx.interfaces.get("vethdb-0"),
        Some(&InterfaceChange::Attach { identity: None })
    );
    assert_eq!(
        e.interface_identities(),
        HashMap::from([("vethweb-0", id(300))])
    );
    assert_eq!(
        e.desired().interface_identities,
        HashMap::from([("vethweb-0".to_owned(), id(300))])
    );
}

#[test]
fn a_source_failure_keeps_everything() {
    let mut e = Core::new(HashMap::new());
    e.on_source(SourceEvent::Reset(vec![ep("web-0", "198.18.1.2", "web")]));
    let _ = e.take_effects();
    e.on_source(SourceEvent::Failed(SourceFailure {
        kind: "parse",
        detail: "x.yaml: bad".into(),
    }));
    assert!(e.take_effects().is_empty());
    assert_eq!(e.len(), 1);
    assert_eq!(e.status().source_error.map(|f| f.kind), Some("parse"));
}

#[test]
fn effects_remove_nothing_before_the_first_full_set() {
    let mut e = Core::new(HashMap::new());
    e.on_source(SourceEvent::Upsert(ep("web-0", "198.18.1.2", "web")));
    allocated(&mut e, "web-0", 300);
    let fx = e.take_effects();
    assert_eq!(
        fx.entries,
        BTreeMap::from([(ip("198.18.1.2"), Some(Entry::Unattached(id(300))))])
    );

    e.on_source(SourceEvent::Delete(key("web-0")));
    let fx = e.take_effects();
    assert_eq!(fx.entries, BTreeMap::from([(ip("198.18.1.2"), None)]));
    assert_eq!(
        fx.interfaces,
        BTreeMap::from([("vethweb-0".to_owned(), InterfaceChange::Detach)])
    );
    assert!(!fx.prune, "not yet: the source has not given a full set");

    e.on_source(SourceEvent::Reset(vec![]));
    assert!(e.take_effects().prune);
}

#[test]
fn the_last_user_gone_cancels_its_allocation() {
    let mut e = Core::new(HashMap::new());
    e.on_source(SourceEvent::Reset(vec![
        ep("web-0", "198.18.1.2", "web"),
        ep("web-1", "198.18.2.2", "web"),
    ]));
    let fx = e.take_effects();
    let started: Vec<AllocationId> = fx.started().map(|r| r.id).collect();
    let [request] = started.as_slice() else {
        panic!("one request: {started:?}");
    };
    e.on_source(SourceEvent::Delete(key("web-0")));
    assert!(e.take_effects().allocations.is_empty(), "web-1 still waits");
    e.on_source(SourceEvent::Delete(key("web-1")));
    assert_eq!(
        e.take_effects().allocations,
        vec![Allocation::Cancel(*request)]
    );
}

#[test]
fn failed_allocations_show_why_the_endpoints_wait() {
    let mut e = Core::new(HashMap::new());
    e.on_source(SourceEvent::Reset(vec![ep("web-0", "198.18.1.2", "web")]));
    let labels = labels_of(&e, "web-0");
    let failed = |failure| AllocationEvent::Failed {
        request: AllocationId::new(0),
        labels: labels.clone(),
        failure,
    };
    e.on_allocation(failed(AllocateFailure::Timeout));
    assert_eq!(
        state(&e, "web-0"),
        Some((
            EndpointState::WaitingForIdentity,
            Some("the operator did not answer Allocate in time".to_owned())
        ))
    );
    e.on_allocation(failed(AllocateFailure::Refused {
        message: "labels[0]: bad".to_owned(),
    }));
    assert_eq!(
        state(&e, "web-0"),
        Some((
            EndpointState::Error,
            Some(
                "the operator refused the labels: operator: InvalidArgument: labels[0]: bad"
                    .to_owned()
            )
        ))
    );
}

#[test]
fn reconcile_failures_mark_their_endpoints_until_a_write_succeeds() {
    let mut e = Core::new(HashMap::new());
    e.on_source(SourceEvent::Reset(vec![ep("web-0", "198.18.1.2", "web")]));
    allocated(&mut e, "web-0", 300);
    let fx = e.take_effects();
    let error = DatapathError::new(std::io::Error::other("no space left"));
    e.on_reconciled(Reconciled {
        entries: fx.entries.keys().copied().collect(),
        entry_failures: vec![(ip("198.18.1.2"), error)],
        local_entries: 0,
        ..Reconciled::default()
    });
    assert_eq!(
        state(&e, "web-0"),
        Some((
            EndpointState::Error,
            Some("writing ENDPOINTS[198.18.1.2]: no space left".to_owned())
        ))
    );
    e.on_reconciled(Reconciled {
        entries: [ip("198.18.1.2")].into(),
        local_entries: 1,
        ..Reconciled::default()
    });
    assert_eq!(state(&e, "web-0"), Some((EndpointState::Programmed, None)));
    assert_eq!(e.status().map_entries, 1);
}

/// What reconcile says after attaching (or failing to attach) `interface`.
fn attach_outcome(interface: &str, attached: bool) -> Reconciled {
    let interfaces: BTreeSet<String> = [interface.to_owned()].into();
    Reconciled {
        attached: if attached {
            interfaces.clone()
        } else {
            BTreeSet::new()
        },
        interface_failures: if attached {
            Vec::new()
        } else {
            vec![(
                interface.to_owned(),
                DatapathError::new(std::io::Error::other("attach failed")),
            )]
        },
        interfaces,
        ..Reconciled::default()
    }
}

#[test]
fn an_address_is_local_only_while_its_interface_is_attached() {
    let mut e = Core::new(HashMap::new());
    e.on_source(SourceEvent::Reset(vec![ep("web-0", "198.18.1.2", "web")]));
    allocated(&mut e, "web-0", 300);
    let fx = e.take_effects();
    assert_eq!(
        fx.entries.get(&ip("198.18.1.2")),
        Some(&Some(Entry::Unattached(id(300)))),
        "not LOCAL before its classifier is attached: its packets are counted where they go"
    );
    assert!(matches!(
        fx.interfaces.get("vethweb-0"),
        Some(InterfaceChange::Attach { .. })
    ));
    assert_eq!(e.status().unattached, 1);

    e.on_reconciled(attach_outcome("vethweb-0", true));
    let fx = e.take_effects();
    assert_eq!(
        fx.entries,
        BTreeMap::from([(ip("198.18.1.2"), Some(Entry::Local(id(300))))]),
        "LOCAL once attached"
    );
    assert_eq!(
        e.desired().entries[&ip("198.18.1.2")],
        Entry::Local(id(300))
    );
    assert_eq!(e.status().unattached, 0);

    // The link lost and attaching again failing: LOCAL goes.
    e.on_reconciled(attach_outcome("vethweb-0", false));
    let fx = e.take_effects();
    assert_eq!(
        fx.entries,
        BTreeMap::from([(ip("198.18.1.2"), Some(Entry::Unattached(id(300))))])
    );
    assert_eq!(e.status().unattached, 1);
    let view = e.view();
    assert_eq!(view[0].state, EndpointState::Error);
    assert!(
        view[0]
            .problem
            .as_ref()
            .is_some_and(|p| p.to_string().contains("attach failed"))
    );
    // Nothing changed: nothing to write.
    e.on_reconciled(attach_outcome("vethweb-0", false));
    assert!(e.take_effects().entries.is_empty());
}

#[test]
fn the_datapath_health_of_a_full_pass_is_the_status() {
    let mut e = Core::new(HashMap::new());
    e.on_reconciled(Reconciled {
        datapath: Some(DatapathHealth {
            error: Some(DatapathError::new(std::io::Error::other("no bpffs"))),
            in_front: vec![ProgramInFront {
                interface: "veth0".to_owned(),
                direction: HookDirection::Ingress,
                program: "cni_policy".to_owned(),
                program_id: 7,
            }],
            missing: Vec::new(),
        }),
        ..Reconciled::default()
    });
    let status = e.status();
    assert_eq!(status.datapath_error.as_deref(), Some("no bpffs"));
    assert_eq!(status.in_front.len(), 1);
    // A batch of effects says nothing about the whole: the health stays.
    e.on_reconciled(Reconciled::default());
    assert!(e.status().datapath_error.is_some());
    e.on_reconciled(Reconciled {
        datapath: Some(DatapathHealth::default()),
        ..Reconciled::default()
    });
    assert_eq!(e.status().datapath_error, None);
    assert!(e.status().in_front.is_empty());
}

#[test]
fn an_answer_is_settled_after_the_endpoints_that_took_its_identity_up() {
    let mut e = Core::new(HashMap::new());
    e.on_source(SourceEvent::Reset(vec![
        ep("web-0", "198.18.1.2", "web"),
        ep("web-1", "198.18.2.2", "web"),
    ]));
    let fx = e.take_effects();
    let [web] = started(&fx).try_into().unwrap_or_else(|r| panic!("{r:?}"));
    assert_eq!(web.id, AllocationId::new(1), "numbered from 1");
    assert!(
        reports(&fx).is_empty(),
        "nothing settled while it is in flight"
    );

    answer(&mut e, &web, 300);
    assert_eq!(
        reports(&e.take_effects()),
        ["upsert web-0 300", "upsert web-1 300", "settled 1"]
    );
    assert!(e.take_effects().is_empty(), "said once");
}

#[test]
fn a_request_given_up_is_settled() {
    let mut e = Core::new(HashMap::new());
    e.on_source(SourceEvent::Reset(vec![ep("web-0", "198.18.1.2", "web")]));
    let [web] = started(&e.take_effects())
        .try_into()
        .unwrap_or_else(|r| panic!("{r:?}"));

    e.on_source(SourceEvent::Delete(key("web-0")));
    let fx = e.take_effects();
    assert_eq!(fx.allocations, [Allocation::Cancel(web.id)]);
    assert_eq!(
        reports(&fx),
        ["settled 1"],
        "the pod ended before the answer"
    );

    answer(&mut e, &web, 300);
    assert!(
        e.take_effects().is_empty(),
        "a late answer settles nothing again"
    );
}

#[test]
fn the_settled_number_waits_for_the_lowest_request_in_flight() {
    let mut e = Core::new(HashMap::new());
    e.on_source(SourceEvent::Reset(vec![
        ep("web-0", "198.18.1.2", "web"),
        ep("db-0", "198.18.3.2", "db"),
    ]));
    let [web, db] = started(&e.take_effects())
        .try_into()
        .unwrap_or_else(|r| panic!("{r:?}"));
    assert_eq!((web.id.get(), db.id.get()), (1, 2));

    answer(&mut e, &db, 301);
    assert_eq!(
        reports(&e.take_effects()),
        ["upsert db-0 301"],
        "1 is still in flight"
    );
    answer(&mut e, &web, 300);
    assert_eq!(
        reports(&e.take_effects()),
        ["upsert web-0 300", "settled 2"]
    );
}

#[test]
fn a_failed_attempt_settles_nothing() {
    let mut e = Core::new(HashMap::new());
    e.on_source(SourceEvent::Reset(vec![ep("web-0", "198.18.1.2", "web")]));
    let [web] = started(&e.take_effects())
        .try_into()
        .unwrap_or_else(|r| panic!("{r:?}"));

    e.on_allocation(AllocationEvent::Failed {
        request: web.id,
        labels: web.labels.clone(),
        failure: AllocateFailure::Timeout,
    });
    assert!(reports(&e.take_effects()).is_empty(), "it is retried");
    answer(&mut e, &web, 300);
    assert_eq!(
        reports(&e.take_effects()),
        ["upsert web-0 300", "settled 1"]
    );
}

#[test]
fn a_rebind_that_answers_a_request_in_flight_settles_it() {
    // A restarted agent: web-0 keeps the identity the maps held while it asks.
    let mut e = Core::new(HashMap::from([(ip("198.18.1.2"), 300)]));
    e.on_source(SourceEvent::Reset(vec![ep("web-0", "198.18.1.2", "web")]));
    let fx = e.take_effects();
    assert_eq!(started(&fx).len(), 1);
    assert_eq!(reports(&fx), ["upsert web-0 300"]);

    e.on_operator(OperatorEvent::Rebind {
        key: key("web-0"),
        id: id(400),
    });
    assert_eq!(
        reports(&e.take_effects()),
        ["upsert web-0 400", "settled 1"]
    );
}

#[test]
fn settled_comes_after_every_report_of_its_batch() {
    let mut e = Core::new(HashMap::new());
    e.on_source(SourceEvent::Reset(vec![
        ep("web-0", "198.18.1.2", "web"),
        ep("api-0", "198.18.5.2", "api"),
    ]));
    for request in started(&e.take_effects()) {
        answer(&mut e, &request, 300);
    }
    assert_eq!(
        reports(&e.take_effects()).last().map(String::as_str),
        Some("settled 2")
    );

    e.on_source(SourceEvent::Upsert(ep("db-0", "198.18.3.2", "db")));
    let [db] = started(&e.take_effects())
        .try_into()
        .unwrap_or_else(|r| panic!("{r:?}"));
    e.on_source(SourceEvent::Upsert(ep("web-1", "198.18.2.2", "web")));
    e.on_source(SourceEvent::Delete(key("api-0")));
    assert_eq!(
        reports(&e.take_effects()),
        ["upsert web-1 300", "delete api-0"],
        "nothing settled: 3 is in flight"
    );

    e.on_source(SourceEvent::Upsert(ep("web-2", "198.18.4.2", "web")));
    answer(&mut e, &db, 301);
    e.on_source(SourceEvent::Delete(key("web-0")));
    assert_eq!(
        reports(&e.take_effects()),
        [
            "upsert web-2 300",
            "upsert db-0 301",
            "delete web-0",
            "settled 3"
        ]
    );
}
