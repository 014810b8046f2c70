//! The pod source's route lookup against the kernel: a pod's address leads to
//! the host side of its veth, and what is not a pod's own device says why.

use census_agent::source::kubernetes::{InterfaceLookup, RouteError, RouteLookup};
use census_netlab::Lab;

use super::support::TestResult;

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_pod_address_leads_to_its_host_side_veth() -> TestResult {
    let mut lab = Lab::new()?;
    let a = lab.add_pod()?;
    let b = lab.add_pod()?;
    for pod in [&a, &b] {
        for v6 in [false, true] {
            let found = lab
                .node()
                .run(|| RouteLookup.host_interface(pod.ip(v6)))??;
            assert_eq!(found, pod.host_interface, "{} (v6: {v6})", pod.ip(v6));
        }
    }

    // The node's own address on a pod's link is not a pod.
    let gateway = a.gateway(false);
    match lab.node().run(|| RouteLookup.host_interface(gateway))? {
        Err(RouteError::Local { ip }) => assert_eq!(ip, gateway),
        other => return Err(format!("expected Local, got {other:?}").into()),
    }

    // Nothing routes outside the lab.
    let nowhere = "203.0.113.9".parse()?;
    let error = lab
        .node()
        .run(|| RouteLookup.host_interface(nowhere))?
        .err()
        .ok_or("no route, no interface")?;
    assert!(
        matches!(
            error,
            RouteError::Kernel { .. } | RouteError::Unroutable { .. }
        ),
        "{error}"
    );
    assert!(error.to_string().contains("203.0.113.9"), "{error}");

    // A pod behind a bridge shares the bridge's route: the lookup says so
    // instead of naming the bridge.
    lab.node().ip(&["link", "add", "cbr0", "type", "bridge"])?;
    lab.node()
        .ip(&["addr", "add", "198.19.200.1/24", "dev", "cbr0"])?;
    lab.node().ip(&["link", "set", "cbr0", "up"])?;
    let bridged = "198.19.200.7".parse()?;
    match lab.node().run(|| RouteLookup.host_interface(bridged))? {
        Err(RouteError::Shared {
            interface, kind, ..
        }) => assert_eq!((interface.as_str(), kind), ("cbr0", "bridge")),
        other => return Err(format!("expected a shared bridge, got {other:?}").into()),
    }
    Ok(())
}
