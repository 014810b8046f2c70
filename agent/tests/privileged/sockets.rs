//! Hook S against the real kernel: the socket programs on the egress and the
//! ingress of the root of the cgroup v2 hierarchy, pinned, adopted in place
//! across agents, refused on what is not a cgroup v2 directory, and removed by
//! `census-agent uninstall`.

use census_agent::bpf::{AttachOutcome, Error, find_cgroup2_root, uninstall};

use super::support::{PinDir, TestResult, bpftool, open_datapath, path_str};

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn the_socket_programs_are_pinned_adopted_and_uninstalled() -> TestResult {
    let root = find_cgroup2_root()?;
    let pins = PinDir::new();
    let mut datapath = open_datapath(pins.path())?;
    assert!(!datapath.sockets_attached()?);
    assert_eq!(datapath.attach_sockets(&root)?, AttachOutcome::Attached);
    assert!(datapath.sockets_attached()?);
    let link =
        |pins: &PinDir, name: &str| -> Result<serde_json::Value, Box<dyn std::error::Error>> {
            let pin = pins.join("links").join(name);
            bpftool(None, &["link", "show", "pinned", path_str(&pin)?])
        };
    let hooks = [
        ("sockets", "cgroup_inet_egress"),
        ("sockets:ingress", "cgroup_inet_ingress"),
    ];
    let mut first = Vec::new();
    for (name, attach_type) in hooks {
        let shown = link(&pins, name)?;
        assert_eq!(shown["type"], "cgroup", "{shown}");
        assert_eq!(shown["attach_type"], attach_type, "{shown}");
        first.push(shown);
    }
    drop(datapath);

    // Another agent: the same links, their programs replaced in place.
    let mut datapath = open_datapath(pins.path())?;
    assert_eq!(datapath.attach_sockets(&root)?, AttachOutcome::Adopted);
    for ((name, _), first) in hooks.iter().zip(&first) {
        let again = link(&pins, name)?;
        assert_eq!(again["id"], first["id"], "the same link: {again}");
        assert_ne!(again["prog_id"], first["prog_id"], "this agent's program");
    }

    // Not a cgroup v2 directory: refused, nothing changes.
    let refused = datapath.attach_sockets(pins.path());
    assert!(
        matches!(refused, Err(Error::NotCgroup2 { .. })),
        "{refused:?}"
    );
    assert!(datapath.sockets_attached()?);
    // Neither link is taken for an interface's.
    let attachments = datapath.attachments()?;
    assert!(attachments.is_empty(), "{attachments:?}");

    // One link gone (a pin removed by hand): not attached, and attaching again
    // puts it back beside the one that stayed.
    std::fs::remove_file(pins.join("links/sockets:ingress"))?;
    assert!(!datapath.sockets_attached()?);
    assert_eq!(datapath.attach_sockets(&root)?, AttachOutcome::Attached);
    assert!(datapath.sockets_attached()?);
    assert_eq!(link(&pins, "sockets")?["id"], first[0]["id"]);
    let ingress = link(&pins, "sockets:ingress")?;
    drop(datapath);

    let removed = uninstall(pins.path())?;
    for (name, _) in hooks {
        assert!(
            removed
                .links
                .iter()
                .any(|l| l.ends_with(format!("links/{name}"))),
            "{name}: {removed:?}"
        );
    }
    for id in [&first[0]["id"], &ingress["id"]] {
        let still = bpftool(None, &["link", "show", "id", &id.to_string()]);
        assert!(still.is_err(), "the link is gone: {still:?}");
    }
    Ok(())
}
