//! Per-node state: the current session and stream, ordering, liveness, holds, and
//! the view (endpoint -> identity) that reference counts are derived from.

use std::{
    collections::HashMap,
    net::{IpAddr, Ipv4Addr},
};

use census_proto::domain::{AllocationId, IdentityId, SessionId};

use super::{ConnId, Timestamp, map::view::View};

/// A node's hold on an identity an Allocate handed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hold {
    pub(crate) expires: Timestamp,
    /// The agent's number of the allocation the hold protects: a snapshot of the
    /// same session that says it has settled ends the hold. `NONE` for an agent
    /// that numbers none, and for every hold of an earlier session (a new session
    /// counts from 1 again): such a hold only expires.
    pub(crate) allocation: AllocationId,
}

impl Hold {
    /// The hold after another Allocate of the same identity: it expires later and
    /// protects the later allocation; a hold that only expires stays so.
    pub(crate) fn renewed(self, expires: Timestamp, allocation: AllocationId) -> Self {
        let allocation = if self.allocation.is_some() && allocation.is_some() {
            self.allocation.max(allocation)
        } else {
            AllocationId::NONE
        };
        Self {
            expires,
            allocation,
        }
    }

    /// Whether a snapshot whose allocations up to `settled` have settled ends it.
    pub(crate) fn settled_by(&self, settled: AllocationId) -> bool {
        self.allocation.is_some() && self.allocation <= settled
    }
}

/// One endpoint in a node's view: the identity the agent holds (corrected by
/// Rebind) and its addresses. Labels are not kept: the identity has them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ViewEntry {
    pub(crate) id: IdentityId,
    /// The last snapshot (by [`Node::snapshots`]) that found this entry unchanged: a
    /// second entry of the same key in one snapshot finds it marked already. In the
    /// padding after `id`, so it costs no memory.
    pub(crate) seen: u32,
    pub(crate) ips: Addrs,
}

/// An endpoint's addresses, sorted and distinct. Nearly every pod has one IPv4
/// address, so that one is kept in the entry, which stays 24 bytes; anything else
/// (IPv6, dual stack, none) is one thin pointer to a boxed slice. A boxed slice of
/// one `IpAddr` asks for 17 bytes, and jemalloc hands out 32, per endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Addrs {
    V4(Ipv4Addr),
    Other(Box<Box<[IpAddr]>>),
}

impl From<Box<[IpAddr]>> for Addrs {
    fn from(ips: Box<[IpAddr]>) -> Self {
        match *ips {
            [IpAddr::V4(ip)] => Self::V4(ip),
            _ => Self::Other(Box::new(ips)),
        }
    }
}

impl Addrs {
    pub(crate) fn iter(&self) -> impl Iterator<Item = IpAddr> + '_ {
        let (one, rest): (Option<IpAddr>, &[IpAddr]) = match self {
            Self::V4(ip) => (Some(IpAddr::V4(*ip)), &[]),
            Self::Other(ips) => (None, ips),
        };
        one.into_iter().chain(rest.iter().copied())
    }

    pub(crate) fn contains(&self, ip: &IpAddr) -> bool {
        self.iter().any(|a| a == *ip)
    }

    pub(crate) fn is_empty(&self) -> bool {
        matches!(self, Self::Other(ips) if ips.is_empty())
    }

    /// Whether these are exactly `ips`, in order.
    pub(crate) fn is(&self, ips: &[IpAddr]) -> bool {
        self.iter().eq(ips.iter().copied())
    }
}

/// Cumulative per-node counters, shown by NodeService.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct NodeCounters {
    pub(crate) corrections: u64,
    pub(crate) adoptions: u64,
    pub(crate) old_seq_ignored: u64,
    pub(crate) rebinds: u64,
}

/// Whether the store knows this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Persisted {
    No,
    InFlight,
    Yes,
}

#[derive(Debug)]
pub(crate) struct Node {
    pub(crate) session: Option<SessionId>,
    /// The current stream, while one is open.
    pub(crate) conn: Option<ConnId>,
    /// The last seq applied in the current session.
    pub(crate) last_seq: u64,
    /// The next snapshot is the session's first: its differences are adoptions.
    pub(crate) first_snapshot_pending: bool,
    pub(crate) last_heard: Timestamp,
    /// Wall-clock time a message was last received; `None` if never since start.
    pub(crate) last_message: Option<Timestamp>,
    pub(crate) last_snapshot: Option<Timestamp>,
    /// Since when the node has been silent longer than the node TTL.
    pub(crate) stale_since: Option<Timestamp>,
    pub(crate) persisted: Persisted,
    /// Changed only through [`View`]'s methods, which keep the endpoint map in step.
    pub(crate) view: View,
    /// Identities handed out by Allocate and not yet taken up by the view.
    pub(crate) holds: HashMap<IdentityId, Hold>,
    /// Allocations of this node waiting for the store.
    pub(crate) pending: u32,
    /// Snapshots checked against the view, never 0 (see [`ViewEntry::seen`]).
    pub(crate) snapshots: u32,
    /// Known from the store at start and no snapshot since: the restart protection
    /// waits for it (its agent may be partitioned away, still using its identities).
    pub(crate) awaited: bool,
    /// Made only for the restart protection, from the cluster's Node objects (see
    /// [`super::Allocator::await_nodes`]): not shown until its agent says Hello.
    pub(crate) shadow: bool,
    pub(crate) counters: NodeCounters,
}

impl Node {
    pub(crate) fn new(now: Timestamp, persisted: Persisted) -> Self {
        Self {
            session: None,
            conn: None,
            last_seq: 0,
            first_snapshot_pending: true,
            last_heard: now,
            last_message: None,
            last_snapshot: None,
            stale_since: None,
            persisted,
            view: View::default(),
            holds: HashMap::new(),
            pending: 0,
            snapshots: 0,
            awaited: false,
            shadow: false,
            counters: NodeCounters::default(),
        }
    }

    /// Known from the store (or, in a cluster, from its Node object) at start and not
    /// heard since: waited for by the restart protection, but not reported stale, as
    /// a node without an agent would be for the whole stale-view limit.
    pub(crate) fn unheard_since_start(&self) -> bool {
        self.awaited && self.session.is_none()
    }

    /// Shown and counted stale: silent past the node TTL in a cluster (its view kept
    /// until the stale-view limit), and not a node that is only awaited since a start.
    pub(crate) fn stale(&self) -> bool {
        self.stale_since.is_some() && !self.unheard_since_start()
    }

    /// Not shown by NodeService: a shadow whose agent has not said Hello.
    pub(crate) fn hidden(&self) -> bool {
        self.shadow && self.session.is_none()
    }

    pub(crate) fn heard(&mut self, now: Timestamp) {
        self.last_heard = now;
        self.last_message = Some(now);
        self.stale_since = None;
    }

    /// Holds plus pending allocations, against the per-node quota.
    pub(crate) fn hold_load(&self) -> usize {
        self.holds.len() + self.pending as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A view's slot is its key (16 bytes) and this, for every endpoint.
    #[test]
    fn a_view_entry_is_24_bytes_and_keeps_its_addresses() {
        assert_eq!(size_of::<ViewEntry>(), 24);
        let v4: IpAddr = "10.0.0.1"
            .parse()
            .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
        let v6: IpAddr = "fd00::1".parse().unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
        for ips in [vec![], vec![v4], vec![v6], vec![v4, v6]] {
            let addrs = Addrs::from(ips.clone().into_boxed_slice());
            assert!(addrs.is(&ips), "{ips:?}");
            assert_eq!(addrs.is_empty(), ips.is_empty());
            assert_eq!(addrs.contains(&v4), ips.contains(&v4));
            assert_eq!(addrs.contains(&v6), ips.contains(&v6));
        }
        assert!(matches!(Addrs::from(Box::from([v4])), Addrs::V4(_)));
    }
}
