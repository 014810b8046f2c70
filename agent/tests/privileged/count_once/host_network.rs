//! A Service whose backend is a host-network pod: a socket in a node's own
//! namespace, on the node's address (kube-proxy's endpoint is the node's
//! address). Both rows are exact with the backend named by its node: the host
//! on its own node, remote-node from another.

use std::net::{IpAddr, SocketAddr, SocketAddrV4};

use census_agent::bpf::identity;
use census_netlab::{ClusterNode, Side, udp_echo_through};

use super::{
    CLIENT, COUNT, Lab, PAYLOAD, TARGET_PORT, TestResult, WAIT, cluster_ip, counted_as, marks,
};
use crate::support::Fallible;

/// `COUNT` exchanges from the client pod on node A through a ClusterIP whose one
/// endpoint is a socket of node `backend_side` on its uplink address.
fn through_to_host_network(lab: &Lab, backend_side: Side, n: u8) -> Fallible<usize> {
    let client = lab.pod(CLIENT)?;
    let node: &ClusterNode = lab.cluster.node(backend_side);
    let IpAddr::V4(address) = node.uplink_ip(false) else {
        return Err("an IPv4 uplink address".into());
    };
    let backend = SocketAddrV4::new(address, TARGET_PORT);
    let service = census_netlab::kube_proxy::Service {
        endpoints: vec![backend],
        ..cluster_ip(&format!("host{n}"), n, client)
    };
    lab.add_service(&service)?;
    Ok(udp_echo_through(
        &client.ns,
        IpAddr::V4(client.ipv4),
        SocketAddr::V4(service.address),
        node.ns(),
        SocketAddr::V4(backend),
        COUNT,
        PAYLOAD,
        WAIT,
    )?)
}

/// The request, marked where it left the client, is delivered to the node's own
/// socket: counted there (the root cgroup's ingress) as (client, host), its mark
/// cleared. The reply leaves that socket from the node's address and is
/// reverse-translated before the root cgroup's egress, where it comes from the
/// Service address to a pod of this node by that pod's interface: counted as
/// (host, client). Every mark is counted, none lost.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_service_request_to_a_host_network_backend_of_the_same_node_is_counted_once_each_way()
-> TestResult {
    let lab = Lab::new(&[(Side::A, CLIENT)])?;
    assert_eq!(through_to_host_network(&lab, Side::A, 9)?, COUNT);
    counted_as(&lab, (CLIENT, identity::HOST), (identity::HOST, CLIENT))?;
    assert_eq!(marks(&lab)?, (COUNT as u64, COUNT as u64), "none lost");
    Ok(())
}

/// The request is counted translated where it leaves node A, to node B's address
/// (remote-node); the reply where node B's socket sends it, from node B's address
/// (reverse-translated only on node A) to the client, as (host, client) on node B.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_service_request_to_a_host_network_backend_of_another_node_is_counted_once_each_way()
-> TestResult {
    let lab = Lab::new(&[(Side::A, CLIENT)])?;
    assert_eq!(through_to_host_network(&lab, Side::B, 10)?, COUNT);
    counted_as(
        &lab,
        (CLIENT, identity::REMOTE_NODE),
        (identity::HOST, CLIENT),
    )
}
