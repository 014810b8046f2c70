//! Read routing: the leader (and a lone operator) answers reads from its core, a
//! follower from its replica's read model. One lock decides and, on the leader, reads.

use census_proto::{domain::IdentityId, labels::LabelSet};
use parking_lot::MutexGuard;

use super::{Inner, Runtime};
use crate::{
    allocator::{IdentityInfo, WatchChange},
    api::Feed,
    replica::ReadModel,
};

/// Where this replica's reads come from, for the time of one read.
pub(super) enum Reads<'a> {
    Core(MutexGuard<'a, Inner>),
    Follower(&'a dyn ReadModel),
}

impl Runtime {
    pub(super) fn reads(&self) -> Reads<'_> {
        let inner = self.inner.lock();
        match &self.replica {
            Some(replica) if !inner.role.is_leader() => Reads::Follower(replica.reads.as_ref()),
            _ => Reads::Core(inner),
        }
    }

    /// Subscribes to the term and the identity changes, then reads every binding, so
    /// no change falls between the list and the changes. A follower's changes come
    /// from its read model, a leader's from its core: a change of term starts over.
    pub(super) fn identity_feed(&self) -> Feed<WatchChange, IdentityInfo> {
        let terms = self.terms.subscribe();
        match self.reads() {
            Reads::Core(inner) => Feed {
                terms,
                changes: self.watch.subscribe(),
                full: inner.alloc.bindings(),
            },
            Reads::Follower(reads) => Feed {
                terms,
                changes: reads.subscribe(),
                full: reads.bindings(),
            },
        }
    }
}

impl Reads<'_> {
    pub(super) fn identity(&self, id: IdentityId) -> Option<IdentityInfo> {
        match self {
            Self::Core(inner) => inner.alloc.identity(id),
            Self::Follower(reads) => reads.identity(id),
        }
    }

    pub(super) fn lookup(&self, labels: &LabelSet) -> Option<IdentityInfo> {
        match self {
            Self::Core(inner) => inner.alloc.lookup(labels),
            Self::Follower(reads) => reads.lookup(labels),
        }
    }

    /// As [`crate::allocator::Allocator::list`].
    pub(super) fn list(
        &self,
        after: Option<IdentityId>,
        limit: usize,
        selector: Option<&LabelSet>,
        include_quarantined: bool,
    ) -> (Vec<IdentityInfo>, bool) {
        match self {
            Self::Core(inner) => inner
                .alloc
                .list(after, limit, selector, include_quarantined),
            Self::Follower(reads) => reads.list(after, limit, selector, include_quarantined),
        }
    }
}
