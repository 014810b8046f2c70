//! SERVICES: written where it differs from what this agent wrote, repaired by the
//! full pass once the operator has given a set, left alone before.

use census_proto::domain::ServiceSet;

use super::{fake::FakeMaps, *};

fn net(text: &str) -> IpNet {
    text.parse().unwrap_or_else(|e| panic!("{text}: {e}"))
}

fn set(ranges: &[(&str, ServiceKind)]) -> ServiceSet {
    ranges.iter().map(|(r, k)| (net(r), *k)).collect()
}

fn changes(ranges: &[(&str, Option<ServiceKind>)]) -> Effects {
    Effects {
        services: ranges.iter().map(|(r, k)| (net(r), *k)).collect(),
        ..Effects::default()
    }
}

fn held(maps: &FakeMaps) -> Vec<(String, ServiceKind)> {
    maps.services
        .iter()
        .map(|(r, k)| (r.to_string(), *k))
        .collect()
}

#[test]
fn changes_are_written_only_where_they_differ() {
    let mut maps = FakeMaps::default();
    let mut r = Reconciler::default();
    let fx = changes(&[
        ("10.96.0.0/12", Some(ServiceKind::ClusterIpRange)),
        ("203.0.113.7/32", Some(ServiceKind::LoadBalancerIp)),
    ]);
    r.apply(&mut maps, &fx);
    assert_eq!(maps.service_writes, 2);
    // The same again: nothing to write.
    r.apply(&mut maps, &fx);
    assert_eq!(maps.service_writes, 2);
    // A kind changes, a range goes.
    r.apply(
        &mut maps,
        &changes(&[
            ("203.0.113.7/32", Some(ServiceKind::ExternalIp)),
            ("10.96.0.0/12", None),
        ]),
    );
    assert_eq!(maps.service_writes, 4);
    assert_eq!(
        held(&maps),
        [("203.0.113.7/32".to_owned(), ServiceKind::ExternalIp)]
    );
    assert_eq!(
        r.written_services().keys().collect::<Vec<_>>(),
        [&net("203.0.113.7/32")]
    );
}

#[test]
fn the_full_pass_repairs_services_to_the_operators_set() {
    let mut maps = FakeMaps::default();
    let mut r = Reconciler::default();
    r.apply(
        &mut maps,
        &changes(&[
            ("10.96.0.0/12", Some(ServiceKind::ClusterIpRange)),
            ("fd00:10:96::/112", Some(ServiceKind::ClusterIpRange)),
        ]),
    );
    // Behind the agent's back: one entry deleted, one changed, one added.
    maps.services.remove(&net("fd00:10:96::/112"));
    maps.services
        .insert(net("10.96.0.0/12"), ServiceKind::ExternalIp);
    maps.services
        .insert(net("192.0.2.0/24"), ServiceKind::ClusterIpRange);
    let want = set(&[
        ("10.96.0.0/12", ServiceKind::ClusterIpRange),
        ("fd00:10:96::/112", ServiceKind::ClusterIpRange),
        ("198.51.100.1/32", ServiceKind::ExternalIp),
    ]);
    let desired = Desired {
        services: Some(want.clone()),
        ..Desired::default()
    };
    let report = r.full_pass(&mut maps, &desired, true);
    assert_eq!((report.repaired, report.written, report.removed), (2, 1, 1));
    assert!(report.service_errors.is_empty());
    let found: ServiceSet = pinned_services(&maps);
    assert_eq!(found, want);
    // Whole now: a second pass writes nothing.
    let writes = maps.service_writes;
    let report = r.full_pass(&mut maps, &desired, true);
    assert_eq!((report.repaired, report.written, report.removed), (0, 0, 0));
    assert_eq!(maps.service_writes, writes);
}

#[test]
fn before_the_operators_set_the_full_pass_leaves_services_alone() {
    let mut maps = FakeMaps::default();
    maps.services
        .insert(net("10.96.0.0/12"), ServiceKind::ClusterIpRange);
    let mut r = Reconciler::default();
    let report = r.full_pass(&mut maps, &Desired::default(), true);
    assert_eq!(report.removed, 0);
    assert_eq!(maps.service_writes, 0);
    assert_eq!(maps.services.len(), 1);
}

#[test]
fn a_failed_write_is_made_by_the_next_full_pass() {
    let mut maps = FakeMaps {
        services_refuse: Some("test"),
        ..FakeMaps::default()
    };
    let mut r = Reconciler::default();
    r.apply(
        &mut maps,
        &changes(&[("10.96.0.0/12", Some(ServiceKind::ClusterIpRange))]),
    );
    assert!(maps.services.is_empty());
    assert!(r.written_services().is_empty());
    maps.services_refuse = None;
    let desired = Desired {
        services: Some(set(&[("10.96.0.0/12", ServiceKind::ClusterIpRange)])),
        ..Desired::default()
    };
    let report = r.full_pass(&mut maps, &desired, true);
    assert_eq!(report.written, 1);
    assert_eq!(
        held(&maps),
        [("10.96.0.0/12".to_owned(), ServiceKind::ClusterIpRange)]
    );
}
