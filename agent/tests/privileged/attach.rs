//! Attach modes against the kernel: TC filters ordered before the filters already
//! there and adopted across restarts (also without their record), a switch
//! between modes leaving one program per hook, and only a pod's own device
//! accepted (macvlan, a NIC, the node's uplink and a device holding a node
//! address refused; a pod gateway's address accepted).

use census_agent::{
    bpf::{
        AttachMode, AttachModeChoice, AttachOutcome, Datapath, DatapathOptions, Error, NodeRole,
    },
    source::kubernetes::{InterfaceLookup, RouteError, RouteLookup},
};
use census_netlab::Lab;

use super::support::{
    Fallible, PinDir, TestResult, frame_len, hook_programs, register, send, tc_filters,
    tcx_hook_programs,
};

const POD_A: u32 = 2000;
const POD_B: u32 = 2001;
const COUNT: usize = 20;
const PAYLOAD: usize = 64;

fn open(pins: &PinDir, mode: AttachModeChoice) -> Fallible<Datapath> {
    let options = DatapathOptions {
        attach_mode: mode,
        ..DatapathOptions::default()
    };
    Ok(Datapath::open_with_options(pins.path(), &options)?)
}

fn tc(lab: &Lab, args: &[&str]) -> TestResult {
    let output = lab.node().output("tc", args)?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "tc {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr)
        )
        .into())
    }
}

/// The names of the TC filters on `hook` of `interface`, in order.
fn filter_names(lab: &Lab, interface: &str, hook: &str) -> Fallible<Vec<(u64, String)>> {
    Ok(tc_filters(lab, interface, hook)?
        .into_iter()
        .map(|f| (f.priority, f.name))
        .collect())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn tc_filters_go_before_a_cni_verdict_and_pass_packets_on() -> TestResult {
    let pins = PinDir::new();
    let mut lab = Lab::new()?;
    let a = lab.add_pod()?;
    let b = lab.add_pod()?;
    // A CNI's filters, there first: each matches every packet and ends the hook
    // with its verdict (a classification: TC_ACT_OK, the packet passes and
    // nothing after it runs).
    for pod in [&a, &b] {
        tc(
            &lab,
            &["qdisc", "add", "dev", &pod.host_interface, "clsact"],
        )?;
        for hook in ["ingress", "egress"] {
            tc(
                &lab,
                &[
                    "filter",
                    "add",
                    "dev",
                    &pod.host_interface,
                    hook,
                    "prio",
                    "10",
                    "u32",
                    "match",
                    "u32",
                    "0",
                    "0",
                    "classid",
                    "1:1",
                ],
            )?;
        }
    }
    let mut datapath = open(&pins, AttachModeChoice::Tc)?;
    assert_eq!(datapath.attach_mode(), AttachMode::Tc);
    for pod in [&a, &b] {
        let attached = lab.node().run(|| datapath.attach(&pod.host_interface))??;
        assert_eq!(
            (attached.ingress, attached.egress),
            (AttachOutcome::Attached, AttachOutcome::Attached)
        );
    }
    register(&mut datapath, &a, POD_A)?;
    register(&mut datapath, &b, POD_B)?;
    for pod in [&a, &b] {
        assert_eq!(
            filter_names(&lab, &pod.host_interface, "ingress")?,
            vec![(9, "census_ingress".to_owned()), (10, "u32".to_owned())],
            "census first, the CNI's filter kept"
        );
        assert_eq!(
            filter_names(&lab, &pod.host_interface, "egress")?,
            vec![(9, "census_egress".to_owned()), (10, "u32".to_owned())]
        );
        for (hook, programs) in tcx_hook_programs(&lab, &pod.host_interface)? {
            assert!(programs.is_empty(), "no TCX program on {hook}");
        }
    }
    for v6 in [false, true] {
        let before = super::support::flow(&datapath, POD_A, POD_B)?;
        assert_eq!(
            send(&a.ns, a.ip(v6), &b, v6, COUNT, PAYLOAD)?,
            COUNT,
            "delivered"
        );
        let after = super::support::flow(&datapath, POD_A, POD_B)?;
        assert_eq!(
            (after.0 - before.0, after.1 - before.1),
            (COUNT as u64, COUNT as u64 * frame_len(PAYLOAD, v6)),
            "counted once (v6: {v6})"
        );
    }
    Ok(())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn tc_filters_are_adopted_across_restarts_even_without_their_record() -> TestResult {
    let pins = PinDir::new();
    let mut lab = Lab::new()?;
    let a = lab.add_pod()?;
    let b = lab.add_pod()?;
    let mut first = open(&pins, AttachModeChoice::Tc)?;
    for pod in [&a, &b] {
        lab.node().run(|| first.attach(&pod.host_interface))??;
    }
    register(&mut first, &a, POD_A)?;
    let before = filter_names(&lab, &a.host_interface, "ingress")?;
    let programs = lab.node().run(|| first.attachments())??;
    drop(first); // the agent exits (or is killed: nothing runs on drop)

    // The record of A's ingress filter lost (killed between attaching and recording).
    let links = pins.join("links");
    for entry in std::fs::read_dir(&links)? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if name.starts_with(&format!("{}-ingress:tc:", a.host_interface)) {
            std::fs::remove_dir(links.join(name))?;
        }
    }
    let mut second = open(&pins, AttachModeChoice::Tc)?;
    for pod in [&a, &b] {
        let attached = lab.node().run(|| second.attach(&pod.host_interface))??;
        assert_eq!(
            (attached.ingress, attached.egress),
            (AttachOutcome::Adopted, AttachOutcome::Adopted),
            "{}",
            pod.host_interface
        );
    }
    assert_eq!(
        filter_names(&lab, &a.host_interface, "ingress")?,
        before,
        "the same one filter: no second one"
    );
    let adopted = lab.node().run(|| second.attachments())??;
    assert_eq!(adopted.len(), 4, "{adopted:?}");
    for (old, new) in programs.iter().zip(&adopted) {
        assert_eq!(
            (&old.interface, old.direction),
            (&new.interface, new.direction)
        );
        assert_ne!(
            old.program_id, new.program_id,
            "the filter runs the new program"
        );
    }
    register(&mut second, &b, POD_B)?;
    assert_eq!(send(&a.ns, a.ip(false), &b, false, COUNT, PAYLOAD)?, COUNT);
    assert_eq!(
        super::support::flow(&second, POD_A, POD_B)?.0,
        COUNT as u64,
        "counted once"
    );
    Ok(())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn switching_attach_modes_leaves_one_program_per_hook() -> TestResult {
    let pins = PinDir::new();
    let mut lab = Lab::new()?;
    let a = lab.add_pod()?;
    let mut tcx = open(&pins, AttachModeChoice::Tcx)?;
    lab.node().run(|| tcx.attach(&a.host_interface))??;
    drop(tcx);

    let mut tc_mode = open(&pins, AttachModeChoice::Tc)?;
    let attached = lab.node().run(|| tc_mode.attach(&a.host_interface))??;
    assert_eq!(attached.ingress, AttachOutcome::ReplacedStale);
    for (hook, programs) in tcx_hook_programs(&lab, &a.host_interface)? {
        assert!(programs.is_empty(), "the TCX link is gone from {hook}");
        assert_eq!(filter_names(&lab, &a.host_interface, &hook)?.len(), 1);
    }
    drop(tc_mode);

    let mut back = open(&pins, AttachModeChoice::Tcx)?;
    let attached = lab.node().run(|| back.attach(&a.host_interface))??;
    assert_eq!(attached.ingress, AttachOutcome::ReplacedStale);
    for (hook, programs) in tcx_hook_programs(&lab, &a.host_interface)? {
        assert_eq!(programs, vec![format!("census_{hook}")]);
        assert!(
            filter_names(&lab, &a.host_interface, &hook)?.is_empty(),
            "no TC filter on {hook}"
        );
    }
    Ok(())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_macvlan_pod_address_and_the_nodes_uplink_are_refused() -> TestResult {
    let pins = PinDir::new();
    let lab = Lab::new()?;
    let node = lab.node();
    // The node's NIC (one end of a veth here: this kernel has no dummy) and a
    // macvlan on it, as a macvlan CNI makes for a pod.
    node.ip(&[
        "link", "add", "nic0", "type", "veth", "peer", "name", "nic0p",
    ])?;
    node.ip(&["link", "set", "nic0", "up"])?;
    node.ip(&[
        "link", "add", "mv0", "link", "nic0", "type", "macvlan", "mode", "bridge",
    ])?;
    node.ip(&["addr", "add", "198.19.60.1/24", "dev", "mv0"])?;
    node.ip(&["link", "set", "mv0", "up"])?;
    let ip = "198.19.60.7".parse()?;
    match node.run(|| RouteLookup.host_interface(ip))? {
        Err(error @ RouteError::NotPodDevice { .. }) => {
            let text = error.to_string();
            assert!(text.contains("mv0") && text.contains("macvlan"), "{text}");
        }
        other => return Err(format!("{ip}: expected NotPodDevice, got {other:?}").into()),
    }
    // Named directly (the endpoints file): refused by the datapath as well.
    let mut datapath = open(&pins, crate::support::attach_mode())?;
    match node.run(|| datapath.attach("mv0"))? {
        Err(Error::UnsupportedInterface { kind, .. }) => {
            assert_eq!(kind.as_deref(), Some("macvlan"));
        }
        other => return Err(format!("expected UnsupportedInterface, got {other:?}").into()),
    }

    // A node in a container: its uplink is a veth, holding the node's address
    // and its default route. A pod address on its subnet routes there, and the
    // datapath refuses it, named by the route or directly.
    node.ip(&[
        "link", "add", "uplink0", "type", "veth", "peer", "name", "uplink0p",
    ])?;
    node.ip(&["addr", "add", "198.19.70.1/24", "dev", "uplink0"])?;
    node.ip(&["link", "set", "uplink0", "up"])?;
    node.ip(&["link", "set", "uplink0p", "up"])?;
    node.ip(&[
        "route",
        "add",
        "default",
        "via",
        "198.19.70.254",
        "dev",
        "uplink0",
    ])?;
    let ip = "198.19.70.9".parse()?;
    let routed = node.run(|| RouteLookup.host_interface(ip))??;
    assert_eq!(routed, "uplink0");
    match node.run(|| datapath.attach(&routed))? {
        Err(
            error @ Error::NodeInterface {
                role: NodeRole::DefaultRoute,
                ..
            },
        ) => {
            assert!(error.to_string().contains("uplink0"), "{error}");
        }
        other => return Err(format!("expected NodeInterface, got {other:?}").into()),
    }
    assert_no_census_hooks(&lab, "uplink0")?;
    Ok(())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_device_holding_a_node_address_is_refused_and_a_pod_gateway_accepted() -> TestResult {
    let pins = PinDir::new();
    let lab = Lab::new()?;
    let node = lab.node();
    // A second network of the node's (storage, say) on a veth, without a default
    // route: the node's address 198.19.80.1 is on it (`--node-ip`).
    node.ip(&[
        "link",
        "add",
        "storage0",
        "type",
        "veth",
        "peer",
        "name",
        "storage0p",
    ])?;
    node.ip(&["addr", "add", "198.19.80.1/24", "dev", "storage0"])?;
    node.ip(&["link", "set", "storage0", "up"])?;
    // A pod's device as `ptp` makes it: the pod's gateway on the host side.
    node.ip(&[
        "link", "add", "ptp0", "type", "veth", "peer", "name", "ptp0p",
    ])?;
    node.ip(&["addr", "add", "198.19.81.1/32", "dev", "ptp0"])?;
    node.ip(&["link", "set", "ptp0", "up"])?;
    let options = DatapathOptions {
        attach_mode: crate::support::attach_mode(),
        node_addresses: ["198.19.80.1".parse()?, "2001:db8:80::1".parse()?].into(),
        ..DatapathOptions::default()
    };
    let mut datapath = Datapath::open_with_options(pins.path(), &options)?;
    match node.run(|| datapath.attach("storage0"))? {
        Err(
            error @ Error::NodeInterface {
                role: NodeRole::Address(address),
                ..
            },
        ) => {
            assert_eq!(address, "198.19.80.1".parse::<std::net::IpAddr>()?);
            let text = error.to_string();
            assert!(
                text.contains("storage0") && text.contains("198.19.80.1"),
                "{text}"
            );
        }
        other => return Err(format!("expected NodeInterface, got {other:?}").into()),
    }
    assert_no_census_hooks(&lab, "storage0")?;
    node.run(|| datapath.attach("ptp0"))??;
    // Without the node's addresses, the storage network's device is taken for a pod's.
    drop(datapath);
    let mut unaware = open(&pins, crate::support::attach_mode())?;
    node.run(|| unaware.attach("storage0"))??;
    Ok(())
}

/// Nothing on either hook of `interface`: no TCX program, no TC filter.
fn assert_no_census_hooks(lab: &Lab, interface: &str) -> TestResult {
    for (hook, programs) in hook_programs(lab, interface)? {
        assert!(programs.is_empty(), "{interface} {hook}: {programs:?}");
    }
    Ok(())
}

/// What this kernel cannot show: `cargo xtask test-privileged` skips them
/// (`--skip needs_other_kernel::`); run them by name on a kernel that has the device.
mod needs_other_kernel {
    use super::*;

    #[test]
    #[ignore = "this kernel (6.18, as built for this VM) has no ipvlan: `ip link add type ipvlan` says \
                `Unknown device type`; run on a kernel with CONFIG_IPVLAN"]
    fn an_ipvlan_pod_address_is_refused() -> TestResult {
        let lab = Lab::new()?;
        let node = lab.node();
        node.ip(&[
            "link", "add", "nic0", "type", "veth", "peer", "name", "nic0p",
        ])?;
        node.ip(&["link", "set", "nic0", "up"])?;
        node.ip(&[
            "link", "add", "ipv0", "link", "nic0", "type", "ipvlan", "mode", "l3",
        ])?;
        node.ip(&["addr", "add", "198.19.61.1/24", "dev", "ipv0"])?;
        node.ip(&["link", "set", "ipv0", "up"])?;
        let ip = "198.19.61.7".parse()?;
        match node.run(|| RouteLookup.host_interface(ip))? {
            Err(RouteError::NotPodDevice { kind, .. }) => {
                assert_eq!(kind.as_deref(), Some("ipvlan"));
                Ok(())
            }
            other => Err(format!("expected NotPodDevice, got {other:?}").into()),
        }
    }

    #[test]
    #[ignore = "this kernel (6.18, as built for this VM) has no netkit: `ip link add type netkit` says \
                `Unknown device type`; run on a kernel with CONFIG_NETKIT"]
    fn a_netkit_pod_device_in_l2_mode_is_accepted_and_in_l3_mode_refused() -> TestResult {
        let pins = PinDir::new();
        let lab = Lab::new()?;
        let node = lab.node();
        node.ip(&[
            "link", "add", "nk2", "type", "netkit", "mode", "l2", "peer", "name", "nk2p",
        ])?;
        node.ip(&[
            "link", "add", "nk3", "type", "netkit", "mode", "l3", "peer", "name", "nk3p",
        ])?;
        let mut datapath = open(&pins, crate::support::attach_mode())?;
        node.run(|| datapath.attach("nk2"))??;
        match node.run(|| datapath.attach("nk3"))? {
            Err(Error::UnsupportedInterface { ethernet, .. }) => assert!(!ethernet),
            other => return Err(format!("expected UnsupportedInterface, got {other:?}").into()),
        }
        Ok(())
    }

    #[test]
    #[ignore = "this kernel (6.18, as built for this VM) has no wireguard: `ip link add type wireguard` \
                says `Unknown device type`; run on a kernel with CONFIG_WIREGUARD"]
    fn a_wireguard_device_is_refused() -> TestResult {
        let pins = PinDir::new();
        let lab = Lab::new()?;
        lab.node()
            .ip(&["link", "add", "wg0", "type", "wireguard"])?;
        let mut datapath = open(&pins, crate::support::attach_mode())?;
        match lab.node().run(|| datapath.attach("wg0"))? {
            Err(Error::UnsupportedInterface { ethernet, .. }) => assert!(!ethernet),
            other => return Err(format!("expected UnsupportedInterface, got {other:?}").into()),
        }
        Ok(())
    }
}
