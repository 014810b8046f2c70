//! What differs between the replicas of an operator in a cluster: which one leads,
//! what a follower answers reads from, and who may open an EndpointSync stream.
//!
//! The runtime and the gRPC layer depend on these types and traits, never on
//! Kubernetes code: the Kubernetes store implements [`ReadModel`], the Node watch
//! implements [`Admission`], and leader election drives the [`Role`].

use std::{fmt, net::IpAddr, time::Duration};

use census_proto::{
    domain::{IdentityId, NodeName},
    labels::LabelSet,
};
use parking_lot::Mutex;
use tokio::{sync::broadcast, time::Instant};

use crate::allocator::{IdentityInfo, WatchChange};

/// The replica that leads, as followers know it from the Lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leader {
    /// The leader's name (its pod's name).
    pub name: String,
    /// Where it serves gRPC (`ip:port`), if it published that.
    pub address: Option<String>,
}

impl fmt::Display for Leader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.address {
            Some(address) => write!(f, "{} at {address}", self.name),
            None => write!(f, "{} (address not published)", self.name),
        }
    }
}

/// Whether this replica runs the allocator core.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// It owns the core: it writes, and it accepts Allocate and EndpointSync.
    Leader,
    /// It serves reads from its [`ReadModel`] and refuses writes.
    Follower { leader: Option<Leader> },
}

impl Role {
    pub fn is_leader(&self) -> bool {
        matches!(self, Self::Leader)
    }
}

/// A write or a stream refused by a follower. The message names the leader, so a
/// client (or a person) knows where to go.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct NotLeader {
    pub leader: Option<Leader>,
}

impl fmt::Display for NotLeader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("this operator replica is a follower and does not allocate")?;
        match &self.leader {
            Some(leader) => write!(f, "; the leader is {leader}"),
            None => f.write_str("; no leader is known yet, retry shortly"),
        }
    }
}

/// What a follower answers IdentityService reads from (the Kubernetes store's view of
/// its own objects, fed by its watch). Answers have no references or holds: only the
/// leader knows those.
pub trait ReadModel: Send + Sync + fmt::Debug + 'static {
    fn identity(&self, id: IdentityId) -> Option<IdentityInfo>;
    fn lookup(&self, labels: &LabelSet) -> Option<IdentityInfo>;
    /// As [`crate::allocator::Allocator::list`].
    fn list(
        &self,
        after: Option<IdentityId>,
        limit: usize,
        selector: Option<&LabelSet>,
        include_quarantined: bool,
    ) -> (Vec<IdentityInfo>, bool);
    /// Every binding, by id.
    fn bindings(&self) -> Vec<IdentityInfo>;
    /// Changes to the bindings from now on.
    fn subscribe(&self) -> broadcast::Receiver<WatchChange>;
}

/// Who may say Hello: in a cluster, only an agent on an existing Node, connecting from
/// one of that Node's addresses.
pub trait Admission: Send + Sync + fmt::Debug + 'static {
    fn admit(&self, node: &NodeName, peer: Option<IpAddr>) -> Result<(), AdmissionError>;
}

/// Why a Hello was refused before it reached the core.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionError {
    #[error("the operator has not listed the cluster's Nodes yet; retry shortly")]
    NotSynced,
    #[error(
        "node {node} is not a Node of this cluster: a Hello is accepted only for an existing Node object"
    )]
    UnknownNode { node: NodeName },
    #[error(
        "node {node}: this stream comes from {peer}, which is not one of the Node's addresses ({addresses}); agents run with host networking and connect from their Node's address"
    )]
    WrongAddress {
        node: NodeName,
        peer: IpAddr,
        addresses: String,
    },
    #[error("node {node}: the stream's peer address is unknown, so it cannot be bound to the Node")]
    NoPeer { node: NodeName },
}

/// A replica's cluster-side collaborators.
#[derive(Debug, Clone)]
pub struct Replica {
    pub reads: std::sync::Arc<dyn ReadModel>,
    pub admission: std::sync::Arc<dyn Admission>,
}

/// The leader's permission to write, which expires: leader election opens it until
/// the renew deadline after each successful renewal, so a leader that cannot renew
/// stops writing before its lease can pass to another replica. The Kubernetes store
/// checks it before every request and gives each request only the time left.
#[derive(Debug)]
pub struct Fence {
    state: Mutex<FenceState>,
}

#[derive(Debug, Clone, Copy)]
enum FenceState {
    Closed,
    Until(Instant),
    /// No leader election (tests that drive a store directly).
    Always,
}

impl Fence {
    /// Closed until leadership opens it.
    pub fn closed() -> Self {
        Self {
            state: Mutex::new(FenceState::Closed),
        }
    }

    /// Always open: for a single writer without leader election.
    pub fn always_open() -> Self {
        Self {
            state: Mutex::new(FenceState::Always),
        }
    }

    pub fn open_until(&self, deadline: Instant) {
        *self.state.lock() = FenceState::Until(deadline);
    }

    pub fn close(&self) {
        *self.state.lock() = FenceState::Closed;
    }

    /// How long a write may take so that it ends before the fence closes; `None` if it
    /// is closed.
    pub fn remaining(&self) -> Option<Duration> {
        match *self.state.lock() {
            FenceState::Closed => None,
            FenceState::Always => Some(Duration::MAX),
            FenceState::Until(deadline) => {
                let left = deadline.saturating_duration_since(Instant::now());
                (!left.is_zero()).then_some(left)
            }
        }
    }

    pub fn is_open(&self) -> bool {
        self.remaining().is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fence_closes_at_its_deadline() {
        let fence = Fence::closed();
        assert!(!fence.is_open());
        fence.open_until(Instant::now() + Duration::from_secs(60));
        assert!(
            fence
                .remaining()
                .is_some_and(|d| d <= Duration::from_secs(60))
        );
        fence.open_until(Instant::now());
        assert!(!fence.is_open());
        assert!(Fence::always_open().is_open());
    }

    #[test]
    fn refusals_name_the_leader() {
        let leader = Leader {
            name: "census-operator-b".into(),
            address: Some("10.0.0.7:9460".into()),
        };
        let text = NotLeader {
            leader: Some(leader),
        }
        .to_string();
        assert!(
            text.contains("census-operator-b at 10.0.0.7:9460"),
            "{text}"
        );
        assert!(
            NotLeader { leader: None }
                .to_string()
                .contains("no leader is known")
        );
    }
}
