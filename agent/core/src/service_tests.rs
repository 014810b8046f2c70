//! The cluster's Service addresses in the core: what SERVICES should hold, from
//! HelloReply and the endpoint map stream, as changes against what is in force.

use super::*;

fn net(text: &str) -> IpNet {
    text.parse().unwrap_or_else(|e| panic!("{text}: {e}"))
}

fn set(ranges: &[(&str, ServiceKind)]) -> ServiceSet {
    ranges.iter().map(|(r, k)| (net(r), *k)).collect()
}

fn changed(core: &mut Core) -> Vec<(String, Option<ServiceKind>)> {
    core.take_effects()
        .services
        .into_iter()
        .map(|(r, k)| (r.to_string(), k))
        .collect()
}

fn batch(services: Option<ServiceSet>) -> MapEvent {
    MapEvent::Batch(MapBatch {
        services,
        ..MapBatch::default()
    })
}

const CLUSTER: ServiceKind = ServiceKind::ClusterIpRange;
const LB: ServiceKind = ServiceKind::LoadBalancerIp;
const EXTERNAL: ServiceKind = ServiceKind::ExternalIp;

#[test]
fn until_the_operator_says_services_stay_as_a_previous_run_left_them() {
    let pinned = set(&[("10.96.0.0/12", CLUSTER)]);
    let mut core = Core::new(HashMap::new()).with_services(pinned.clone());
    assert!(changed(&mut core).is_empty());
    assert_eq!(
        core.desired().services,
        None,
        "the full pass leaves SERVICES alone"
    );
    assert_eq!(core.services(), (&pinned, false));
    // A batch without a set says nothing of them.
    core.on_map(batch(None));
    assert!(changed(&mut core).is_empty());
    assert_eq!(core.desired().services, None);
}

#[test]
fn the_first_set_changes_only_what_differs_from_what_services_held() {
    let pinned = set(&[("10.96.0.0/12", CLUSTER), ("203.0.113.7/32", EXTERNAL)]);
    let mut core = Core::new(HashMap::new()).with_services(pinned);
    let first = set(&[
        ("10.96.0.0/12", CLUSTER),
        ("203.0.113.7/32", LB),
        ("198.51.100.1/32", EXTERNAL),
    ]);
    core.on_operator(OperatorEvent::Services(first.clone()));
    assert_eq!(
        changed(&mut core),
        [
            ("198.51.100.1/32".to_owned(), Some(EXTERNAL)),
            ("203.0.113.7/32".to_owned(), Some(LB)),
        ]
    );
    assert_eq!(core.desired().services, Some(first.clone()));
    // The same set again changes nothing; a smaller one removes what it lacks.
    core.on_operator(OperatorEvent::Services(first));
    assert!(changed(&mut core).is_empty());
    core.on_operator(OperatorEvent::Services(set(&[("10.96.0.0/12", CLUSTER)])));
    assert_eq!(
        changed(&mut core),
        [
            ("198.51.100.1/32".to_owned(), None),
            ("203.0.113.7/32".to_owned(), None),
        ]
    );
}

#[test]
fn the_map_streams_set_is_newer_than_a_hello_replys_while_the_stream_lasts() {
    let mut core = Core::new(HashMap::new());
    let from_map = set(&[("10.96.0.0/12", CLUSTER), ("203.0.113.9/32", LB)]);
    core.set_map_link(MapLink {
        state: MapState::Connected,
        last_error: None,
    });
    core.on_map(batch(Some(from_map.clone())));
    assert_eq!(changed(&mut core).len(), 2);
    // A HelloReply read late (its set built before the batch's) changes nothing.
    core.on_operator(OperatorEvent::Services(set(&[("10.96.0.0/12", CLUSTER)])));
    assert!(changed(&mut core).is_empty());
    assert_eq!(core.services(), (&from_map, true));
    // The stream is lost: the next HelloReply's set is the newest.
    core.set_map_link(MapLink {
        state: MapState::Disconnected,
        last_error: None,
    });
    core.on_operator(OperatorEvent::Services(set(&[("10.96.0.0/12", CLUSTER)])));
    assert_eq!(changed(&mut core), [("203.0.113.9/32".to_owned(), None)]);
    // A later batch's set is in force again.
    core.on_map(batch(Some(from_map)));
    assert_eq!(
        changed(&mut core),
        [("203.0.113.9/32".to_owned(), Some(LB))]
    );
}

#[test]
fn changes_merge_as_the_later_one() {
    let mut core = Core::new(HashMap::new());
    core.on_operator(OperatorEvent::Services(set(&[("10.96.0.0/12", CLUSTER)])));
    let mut fx = core.take_effects();
    core.on_operator(OperatorEvent::Services(ServiceSet::new()));
    fx.merge(core.take_effects());
    assert_eq!(
        fx.services.into_iter().collect::<Vec<_>>(),
        [(net("10.96.0.0/12"), None)]
    );
}

#[test]
fn the_status_counts_the_operators_last_set_per_kind_and_none_before_it() {
    let pinned = set(&[("10.96.0.0/12", CLUSTER)]);
    let mut core = Core::new(HashMap::new()).with_services(pinned);
    assert_eq!(
        core.status().services,
        None,
        "a previous run's are not the operator's"
    );
    core.on_operator(OperatorEvent::Services(set(&[
        ("10.96.0.0/12", CLUSTER),
        ("fd00:10:96::/108", CLUSTER),
        ("203.0.113.7/32", LB),
    ])));
    assert_eq!(
        core.status().services,
        Some(ServiceCounts {
            cluster_ip_range: 2,
            load_balancer_ip: 1,
            external_ip: 0,
        })
    );
    core.on_map(batch(Some(set(&[("198.51.100.9/32", EXTERNAL)]))));
    assert_eq!(
        core.status().services,
        Some(ServiceCounts {
            cluster_ip_range: 0,
            load_balancer_ip: 0,
            external_ip: 1,
        }),
        "the latest set, not a sum"
    );
}
