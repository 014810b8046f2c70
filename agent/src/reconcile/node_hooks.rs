//! The node's own hooks, which no endpoint asks for: `census_uplink` on the
//! devices packets leave the node by, and `census_sockets` and
//! `census_sockets_ingress` at the root of the cgroup v2 hierarchy. They are
//! attached at start and put back by every full pass: a tunnel device created
//! after the agent started (a CNI that makes its VXLAN device late) gets the
//! uplink program, and a link removed under the agent is attached again.
//!
//! A device that stops being an uplink has the program detached by the next
//! full pass.
//!
//! A hook that cannot be attached costs only what it alone counts (Service
//! requests leaving by that uplink; what the node's own sockets send to pods and
//! the Service requests they receive): the agent stays Ready, and `/readyz` and
//! the admin API say what is missing and why until a pass attaches it.

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
};

use tracing::{debug, info, warn};

use super::{Link, Reconciler};
use crate::{
    agent_core::{MissingHook, NodeHook},
    bpf::{self, Datapath},
};

/// The node's hooks as reconcile drives them.
pub(crate) trait NodeHooksPort {
    /// The devices packets leave the node by, as [`bpf::default_uplinks`] finds them.
    fn default_uplinks(&self) -> Result<BTreeSet<String>, bpf::Error>;
    /// Attaches (or adopts the pinned link of) the uplink program on `interface`.
    fn attach_uplink(&mut self, interface: &str) -> Result<bpf::AttachOutcome, bpf::Error>;
    /// Detaches the uplink program from `interface`; `false` if it was not there.
    fn detach_uplink(&mut self, interface: &str) -> Result<bool, bpf::Error>;
    /// The pinned links of the uplink program, one per device.
    fn uplinks(&self) -> Result<Vec<Link>, bpf::Error>;
    /// The root of the node's cgroup v2 hierarchy, as [`bpf::find_cgroup2_root`]
    /// finds it.
    fn find_cgroup2_root(&self) -> Result<PathBuf, bpf::Error>;
    /// Attaches (or adopts the pinned link of) the socket program at `cgroup`.
    fn attach_sockets(&mut self, cgroup: &Path) -> Result<bpf::AttachOutcome, bpf::Error>;
    /// Whether the socket program's link is pinned and attached.
    fn sockets_attached(&self) -> Result<bool, bpf::Error>;
}

impl NodeHooksPort for Datapath {
    fn default_uplinks(&self) -> Result<BTreeSet<String>, bpf::Error> {
        bpf::default_uplinks()
    }

    fn attach_uplink(&mut self, interface: &str) -> Result<bpf::AttachOutcome, bpf::Error> {
        Datapath::attach_uplink(self, interface)
    }

    fn detach_uplink(&mut self, interface: &str) -> Result<bool, bpf::Error> {
        Datapath::detach_uplink(self, interface)
    }

    fn uplinks(&self) -> Result<Vec<Link>, bpf::Error> {
        Ok(Datapath::uplinks(self)?
            .into_iter()
            .map(|a| Link {
                interface: a.interface,
                state: a.state,
            })
            .collect())
    }

    fn find_cgroup2_root(&self) -> Result<PathBuf, bpf::Error> {
        bpf::find_cgroup2_root()
    }

    fn attach_sockets(&mut self, cgroup: &Path) -> Result<bpf::AttachOutcome, bpf::Error> {
        Datapath::attach_sockets(self, cgroup)
    }

    fn sockets_attached(&self) -> Result<bool, bpf::Error> {
        Datapath::sockets_attached(self)
    }
}

/// Where the node's hooks go: the command line, resolved.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeHooks {
    /// `--uplink`: these devices. Empty: every device a default route leaves by
    /// and every VXLAN or Geneve device, found again at every full pass.
    pub uplinks: Vec<String>,
    /// `--cgroup-root`; `None`: where the node's cgroup v2 hierarchy is usually
    /// mounted.
    pub cgroup_root: Option<PathBuf>,
}

/// What is lost while the uplink program is missing from a device.
const UPLINK_UNCOUNTED: &str = "Service requests leaving the node by it go uncounted";
/// What is lost while no uplink can be listed.
const UPLINKS_UNCOUNTED: &str = "Service requests to other nodes go uncounted";
/// What is lost while the socket programs are not attached.
const SOCKETS_UNCOUNTED: &str = "what the node's own sockets send to pods, and pods' Service requests they receive, go uncounted";

impl Reconciler {
    /// Attaches the node's hooks at start and in every full pass (see
    /// [`NodeHooks`]); none if not given.
    pub(crate) fn node_hooks(mut self, hooks: Option<NodeHooks>) -> Self {
        self.node_hooks = hooks;
        self
    }

    /// Attaches the uplink program where it should be and is not, and the socket
    /// program if its link is gone; what is still missing, and why.
    pub(crate) fn repair_node_hooks<M: NodeHooksPort + ?Sized>(
        &mut self,
        maps: &mut M,
    ) -> Vec<MissingHook> {
        let Some(hooks) = self.node_hooks.clone() else {
            return Vec::new();
        };
        let mut missing = self.repair_uplinks(maps, &hooks);
        missing.extend(repair_sockets(maps, &hooks));
        for hook in &missing {
            if !self.warned_missing.contains(hook) {
                warn!(hook = %hook.hook, error = %hook.error, "{}", hook.uncounted);
            }
        }
        self.warned_missing = missing.iter().cloned().collect();
        missing
    }

    fn repair_uplinks<M: NodeHooksPort + ?Sized>(
        &mut self,
        maps: &mut M,
        hooks: &NodeHooks,
    ) -> Vec<MissingHook> {
        let wanted: BTreeSet<String> = if hooks.uplinks.is_empty() {
            match maps.default_uplinks() {
                Ok(found) => found,
                Err(error) => {
                    return vec![MissingHook::new(
                        NodeHook::Uplinks,
                        &error,
                        UPLINKS_UNCOUNTED,
                    )];
                }
            }
        } else {
            hooks.uplinks.iter().cloned().collect()
        };
        let in_place: BTreeSet<String> = match maps.uplinks() {
            Ok(links) => links
                .into_iter()
                .filter(|link| matches!(link.state, bpf::AttachmentState::Attached { .. }))
                .map(|link| link.interface)
                .collect(),
            Err(error) => {
                return vec![MissingHook::new(
                    NodeHook::Uplinks,
                    &error,
                    UPLINKS_UNCOUNTED,
                )];
            }
        };
        // A device that is no longer one of the uplinks (a `--uplink` list changed
        // across a restart, a default route moved) loses the program. Finding no
        // uplink at all is taken as routes being replaced, not as a node without
        // any: what is attached stays until a pass finds the new ones.
        if !(hooks.uplinks.is_empty() && wanted.is_empty()) {
            for stale in in_place.difference(&wanted) {
                match maps.detach_uplink(stale) {
                    Ok(_) => info!(uplink = stale, "uplink detached: no longer an uplink"),
                    Err(error) => warn!(uplink = stale, %error, "cannot detach a former uplink"),
                }
            }
        }
        let mut missing = Vec::new();
        for uplink in wanted.difference(&in_place) {
            match maps.attach_uplink(uplink) {
                Ok(bpf::AttachOutcome::Adopted) => debug!(uplink, "uplink adopted"),
                Ok(outcome) => info!(uplink, ?outcome, "uplink attached"),
                Err(error) => {
                    self.metrics.attach_errors.inc();
                    missing.push(MissingHook::new(
                        NodeHook::Uplink(uplink.clone()),
                        &error,
                        UPLINK_UNCOUNTED,
                    ));
                }
            }
        }
        missing
    }
}

fn repair_sockets<M: NodeHooksPort + ?Sized>(
    maps: &mut M,
    hooks: &NodeHooks,
) -> Option<MissingHook> {
    let sockets_missing = |root: Option<PathBuf>, error: &bpf::Error| {
        Some(MissingHook::new(
            NodeHook::Sockets(root),
            error,
            SOCKETS_UNCOUNTED,
        ))
    };
    match maps.sockets_attached() {
        Ok(true) => return None,
        Ok(false) => {}
        Err(error) => return sockets_missing(None, &error),
    }
    let root = match hooks.cgroup_root.clone() {
        Some(root) => root,
        None => match maps.find_cgroup2_root() {
            Ok(root) => root,
            Err(error) => return sockets_missing(None, &error),
        },
    };
    match maps.attach_sockets(&root) {
        Ok(outcome) => {
            info!(cgroup = %root.display(), ?outcome, "socket program attached");
            None
        }
        Err(error) => sockets_missing(Some(root), &error),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcile::fake::FakeMaps;

    fn names(list: &[&str]) -> BTreeSet<String> {
        list.iter().map(|&name| name.to_owned()).collect()
    }

    fn attached(maps: &FakeMaps) -> BTreeSet<String> {
        maps.uplink_links.keys().cloned().collect()
    }

    fn maps_with(interfaces: &[&str], default_uplinks: &[&str]) -> FakeMaps {
        FakeMaps {
            interfaces: names(interfaces),
            default_uplinks: names(default_uplinks),
            cgroup2_root: Some("/sys/fs/cgroup".into()),
            ..FakeMaps::default()
        }
    }

    #[test]
    fn a_device_that_is_no_longer_a_default_uplink_loses_the_program() {
        let mut maps = maps_with(&["eth0", "eth1", "vxlan0"], &["eth0", "vxlan0"]);
        let mut r = Reconciler::default().node_hooks(Some(NodeHooks::default()));
        assert!(r.repair_node_hooks(&mut maps).is_empty());
        assert_eq!(attached(&maps), names(&["eth0", "vxlan0"]));

        // The default route moves to eth1 and the tunnel device is no longer one.
        maps.default_uplinks = names(&["eth1"]);
        assert!(r.repair_node_hooks(&mut maps).is_empty());
        assert_eq!(attached(&maps), names(&["eth1"]));
    }

    #[test]
    fn finding_no_uplink_keeps_the_attached_ones() {
        let mut maps = maps_with(&["eth0"], &["eth0"]);
        let mut r = Reconciler::default().node_hooks(Some(NodeHooks::default()));
        r.repair_node_hooks(&mut maps);
        // Routes being replaced: no default route for a moment.
        maps.default_uplinks.clear();
        r.repair_node_hooks(&mut maps);
        assert_eq!(attached(&maps), names(&["eth0"]));
    }

    #[test]
    fn an_uplink_left_out_of_the_list_is_detached() {
        let mut maps = maps_with(&["eth0", "eth1"], &[]);
        let both = NodeHooks {
            uplinks: vec!["eth0".to_owned(), "eth1".to_owned()],
            cgroup_root: None,
        };
        Reconciler::default()
            .node_hooks(Some(both))
            .repair_node_hooks(&mut maps);
        assert_eq!(attached(&maps), names(&["eth0", "eth1"]));

        // The agent restarts with `--uplink eth1`: it adopts eth1's pinned link
        // and detaches eth0's.
        let one = NodeHooks {
            uplinks: vec!["eth1".to_owned()],
            cgroup_root: None,
        };
        let attaches = maps.uplink_attaches;
        let missing = Reconciler::default()
            .node_hooks(Some(one))
            .repair_node_hooks(&mut maps);
        assert!(missing.is_empty(), "{missing:?}");
        assert_eq!(attached(&maps), names(&["eth1"]));
        assert_eq!(maps.uplink_attaches, attaches, "eth1 left as it was");
    }
}
