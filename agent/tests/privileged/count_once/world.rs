//! The world outside the cluster, behind node A (which masquerades what it sends
//! there, and whose link to it is one of its uplinks): a pod reaching it, and
//! the world reaching pods through a NodePort, with and without the node's SNAT.

use std::net::{IpAddr, SocketAddr, SocketAddrV4};

use census_agent::bpf::identity;
use census_netlab::{
    Side, World,
    kube_proxy::{ExternalTrafficPolicy, NodePort, Service},
    udp_echo_through,
};

use super::{
    BACKEND, CLIENT, COUNT, Lab, PAYLOAD, Shape, TARGET_PORT, TestResult, WAIT, cluster_ip,
    counted_as, each_way, echo,
};
use crate::support::Fallible;

/// The node port of the lab's NodePort Services.
const NODE_PORT: u16 = 30053;

/// The world answers a pod only because node A masqueraded the pod's request
/// (the world has no route to any pod): the request is counted where it left
/// the pod, as (pod, world), the reply where it enters it, as (world, pod).
/// Node A's link to the world is an uplink: it counts neither (unmarked).
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_pod_and_the_world_are_counted_once_each_way() -> TestResult {
    let lab = Lab::with(Shape::WITH_WORLD, &[(Side::A, CLIENT)])?;
    let client = lab.pod(CLIENT)?;
    assert_eq!(
        echo(
            (&client.ns, client.ipv4.into()),
            (lab.world()?.ns(), World::IP.into())
        )?,
        COUNT
    );
    assert_eq!(
        lab.counts()?,
        each_way(&[(CLIENT, identity::WORLD), (identity::WORLD, CLIENT)])
    );
    Ok(())
}

/// `COUNT` exchanges from the world to node A's address on its link, at the
/// node port of a Service whose one endpoint is a pod on `backend_side`, with
/// `policy`.
fn from_the_world_through_a_node_port(
    backend_side: Side,
    policy: ExternalTrafficPolicy,
    n: u8,
) -> Fallible<Lab> {
    let lab = Lab::with(Shape::WITH_WORLD, &[(backend_side, BACKEND)])?;
    let backend = lab.pod(BACKEND)?;
    let service = Service {
        node_port: Some(NodePort {
            port: NODE_PORT,
            policy,
        }),
        ..cluster_ip(&format!("np{n}"), n, backend)
    };
    lab.add_service(&service)?;
    let replies = udp_echo_through(
        lab.world()?.ns(),
        World::IP.into(),
        SocketAddr::V4(SocketAddrV4::new(World::NODE_IP, NODE_PORT)),
        &backend.ns,
        SocketAddr::new(IpAddr::V4(backend.ipv4), TARGET_PORT),
        COUNT,
        PAYLOAD,
        WAIT,
    )?;
    assert_eq!(replies, COUNT);
    Ok(lab)
}

/// `externalTrafficPolicy: Local`: the request keeps the world's address as its
/// source, so it is counted from outside where it enters the backend, and the
/// reply where it leaves it, to the world (unmarked: node A's uplink to the
/// world skips it).
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_node_port_without_snat_is_counted_once_each_way_with_the_world() -> TestResult {
    let lab = from_the_world_through_a_node_port(Side::A, ExternalTrafficPolicy::Local, 12)?;
    counted_as(&lab, (identity::WORLD, BACKEND), (BACKEND, identity::WORLD))
}

/// `externalTrafficPolicy: Cluster`, the backend on the other node: the request
/// enters node A by an unhooked link and reaches the backend from node A's
/// address (masqueraded), which is skipped on delivery: counted nowhere. The
/// reply is counted where it leaves the backend, to node A's address.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_node_port_with_snat_to_another_node_counts_only_the_reply_to_the_node() -> TestResult {
    let lab = from_the_world_through_a_node_port(Side::B, ExternalTrafficPolicy::Cluster, 13)?;
    assert_eq!(lab.counts()?, each_way(&[(BACKEND, identity::REMOTE_NODE)]));
    Ok(())
}

/// As above, the backend on node A itself: the request reaches it from the
/// node's address on its link, skipped; the reply is counted to the node's
/// address, as (backend, host).
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_node_port_with_snat_to_its_own_node_counts_only_the_reply_to_the_node() -> TestResult {
    let lab = from_the_world_through_a_node_port(Side::A, ExternalTrafficPolicy::Cluster, 14)?;
    assert_eq!(lab.counts()?, each_way(&[(BACKEND, identity::HOST)]));
    Ok(())
}
