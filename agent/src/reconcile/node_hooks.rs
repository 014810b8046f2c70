//! The node's own hooks, which no endpoint asks for: `census_uplink` on the
//! devices packets leave the node by, and `census_sockets` at the root of the
//! cgroup v2 hierarchy. They are attached at start and put back by every full
//! pass: a tunnel device created after the agent started (a CNI that makes its
//! VXLAN device late) gets the uplink program, and a link removed under the agent
//! is attached again.
//!
//! A hook that cannot be attached costs only what it alone counts (Service
//! requests leaving by that uplink; what the node's own sockets send to pods):
//! the agent stays Ready, and `/readyz` and the admin API say what is missing and
//! why until a pass attaches it.

use std::{collections::BTreeSet, path::PathBuf};

use tracing::{debug, info, warn};

use super::{DatapathPort, Reconciler};
use crate::{bpf, core::MissingHook};

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
/// What is lost while the socket program is not attached.
const SOCKETS_UNCOUNTED: &str = "what the node's own sockets send to pods goes uncounted";

impl Reconciler {
    /// Attaches the node's hooks at start and in every full pass (see
    /// [`NodeHooks`]); none if not given.
    pub(crate) fn node_hooks(mut self, hooks: Option<NodeHooks>) -> Self {
        self.node_hooks = hooks;
        self
    }

    /// Attaches the uplink program where it should be and is not, and the socket
    /// program if its link is gone; what is still missing, and why.
    pub(crate) fn repair_node_hooks<M: DatapathPort + ?Sized>(
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

    fn repair_uplinks<M: DatapathPort + ?Sized>(
        &mut self,
        maps: &mut M,
        hooks: &NodeHooks,
    ) -> Vec<MissingHook> {
        let wanted: BTreeSet<String> = if hooks.uplinks.is_empty() {
            match maps.default_uplinks() {
                Ok(found) => found,
                Err(error) => {
                    return vec![MissingHook::new(
                        "uplinks".to_owned(),
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
                    "uplinks".to_owned(),
                    &error,
                    UPLINKS_UNCOUNTED,
                )];
            }
        };
        let mut missing = Vec::new();
        for uplink in wanted.difference(&in_place) {
            match maps.attach_uplink(uplink) {
                Ok(bpf::AttachOutcome::Adopted) => debug!(uplink, "uplink adopted"),
                Ok(outcome) => info!(uplink, ?outcome, "uplink attached"),
                Err(error) => {
                    self.metrics.attach_errors.inc();
                    missing.push(MissingHook::new(
                        format!("uplink {uplink}"),
                        &error,
                        UPLINK_UNCOUNTED,
                    ));
                }
            }
        }
        missing
    }
}

fn repair_sockets<M: DatapathPort + ?Sized>(
    maps: &mut M,
    hooks: &NodeHooks,
) -> Option<MissingHook> {
    let sockets_missing =
        |what: String, error: &bpf::Error| Some(MissingHook::new(what, error, SOCKETS_UNCOUNTED));
    match maps.sockets_attached() {
        Ok(true) => return None,
        Ok(false) => {}
        Err(error) => return sockets_missing("sockets".to_owned(), &error),
    }
    let root = match hooks.cgroup_root.clone() {
        Some(root) => root,
        None => match maps.find_cgroup2_root() {
            Ok(root) => root,
            Err(error) => return sockets_missing("sockets".to_owned(), &error),
        },
    };
    match maps.attach_sockets(&root) {
        Ok(outcome) => {
            info!(cgroup = %root.display(), ?outcome, "socket program attached");
            None
        }
        Err(error) => sockets_missing(format!("sockets {}", root.display()), &error),
    }
}
