//! A VXLAN overlay: the pod blocks routed over a VXLAN device on each node, its
//! underlay the link between the nodes, and the uplink program on the VXLAN
//! device only (as the agent attaches it to tunnel devices, never their
//! underlay). Both rows are exact: the mark is cleared where the inner packet is
//! counted, before encapsulation, so the outer packet is never counted again.

use census_netlab::{Side, VXLAN};

use super::{
    COUNT, Lab, Shape, TestResult, direct_exchange_is_counted_once,
    service_exchange_is_counted_client_to_backend,
};
use crate::support::Fallible;

/// Packets node A's VXLAN device has sent (`ip -s link`): the exchanges crossed
/// the overlay, not the underlay alone.
fn vxlan_sent(lab: &Lab) -> Fallible<u64> {
    let output = lab
        .cluster
        .node(Side::A)
        .ns()
        .output("ip", &["-j", "-s", "link", "show", "dev", VXLAN])?;
    let links: serde_json::Value = serde_json::from_slice(&output.stdout)?;
    links[0]["stats64"]["tx"]["packets"]
        .as_u64()
        .ok_or_else(|| format!("no tx packets in {links}").into())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_request_and_its_reply_across_a_vxlan_overlay_are_counted_once() -> TestResult {
    let lab = direct_exchange_is_counted_once(Shape::OVERLAY, Side::B)?;
    assert!(vxlan_sent(&lab)? >= COUNT as u64, "sent over {VXLAN}");
    Ok(())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_service_request_across_a_vxlan_overlay_is_counted_once_client_to_backend() -> TestResult {
    let lab = service_exchange_is_counted_client_to_backend(Shape::OVERLAY, Side::B, 11)?;
    assert!(vxlan_sent(&lab)? >= COUNT as u64, "sent over {VXLAN}");
    Ok(())
}
