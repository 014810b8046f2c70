//! Hook S against the real kernel: the socket program on the root of the
//! cgroup v2 hierarchy, pinned, adopted in place across agents, refused on what
//! is not a cgroup v2 directory, and removed by `census-agent uninstall`.

use census_agent::bpf::{AttachOutcome, Error, find_cgroup2_root, uninstall};

use super::support::{PinDir, TestResult, bpftool, open_datapath, path_str};

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn the_socket_program_is_pinned_adopted_and_uninstalled() -> TestResult {
    let root = find_cgroup2_root()?;
    let pins = PinDir::new();
    let mut datapath = open_datapath(pins.path())?;
    assert!(!datapath.sockets_attached()?);
    assert_eq!(datapath.attach_sockets(&root)?, AttachOutcome::Attached);
    assert!(datapath.sockets_attached()?);
    let link = |pins: &PinDir| -> Result<serde_json::Value, Box<dyn std::error::Error>> {
        bpftool(
            None,
            &[
                "link",
                "show",
                "pinned",
                path_str(&pins.join("links/sockets"))?,
            ],
        )
    };
    let first = link(&pins)?;
    assert_eq!(first["type"], "cgroup", "{first}");
    assert_eq!(first["attach_type"], "cgroup_inet_egress", "{first}");
    drop(datapath);

    // Another agent: the same link, its program replaced in place.
    let mut datapath = open_datapath(pins.path())?;
    assert_eq!(datapath.attach_sockets(&root)?, AttachOutcome::Adopted);
    let again = link(&pins)?;
    assert_eq!(again["id"], first["id"], "the same link: {again}");
    assert_ne!(again["prog_id"], first["prog_id"], "this agent's program");

    // Not a cgroup v2 directory: refused, nothing changes.
    let refused = datapath.attach_sockets(pins.path());
    assert!(
        matches!(refused, Err(Error::NotCgroup2 { .. })),
        "{refused:?}"
    );
    assert!(datapath.sockets_attached()?);
    drop(datapath);

    let removed = uninstall(pins.path())?;
    assert!(
        removed.links.iter().any(|l| l.ends_with("links/sockets")),
        "{removed:?}"
    );
    let still = bpftool(None, &["link", "show", "id", &first["id"].to_string()]);
    assert!(still.is_err(), "the link is gone: {still:?}");
    Ok(())
}
