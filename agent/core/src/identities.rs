//! The identities of the label sets in use on this node: a cache that holds only
//! the label sets endpoints use.
//!
//! - one Allocate in flight per label set: the first endpoint that needs an unknown
//!   set gets an [`AllocationRequest`] to start, the others wait on the same entry
//!   and are all resolved by its answer;
//! - an entry lives exactly as long as some endpoint uses its label set: releasing
//!   the last user drops it, and with it the request in flight (the release says
//!   which request to cancel);
//! - a `Rebind` from the operator rewrites the entry, so every endpoint of the set
//!   follows;
//! - requests are numbered 1, 2, 3, ... and the cache knows which are still in
//!   flight, so it can say up to which number all are settled ([`IdentityCache::settled`]).

use std::collections::{BTreeSet, HashMap, hash_map::Entry};

use census_proto::{
    domain::{AllocationId, EndpointKey, IdentityId},
    labels::LabelSet,
};

/// What the cache knows of one label set.
#[derive(Debug, Default)]
struct CacheEntry {
    id: Option<IdentityId>,
    /// The endpoints whose identity labels are this set.
    users: BTreeSet<EndpointKey>,
    /// The request in flight.
    inflight: Option<AllocationId>,
}

/// The answer of [`IdentityCache::acquire`].
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Lookup {
    Known(IdentityId),
    /// Not known yet. `Some` for the first user: the request to start.
    Pending(Option<AllocationRequest>),
}

/// A label set to allocate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocationRequest {
    pub id: AllocationId,
    pub labels: LabelSet,
}

/// The answer of [`IdentityCache::release`].
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Release {
    /// Other endpoints still use the label set (or it was not in the cache).
    Kept,
    /// The last user went, and the entry with it; its request in flight, to cancel.
    Dropped(Option<AllocationId>),
}

/// The identities of the label sets in use on this node.
#[derive(Debug, Default)]
pub(crate) struct IdentityCache {
    entries: HashMap<LabelSet, CacheEntry>,
    last_request: AllocationId,
    /// Every entry's `inflight`, lowest first for [`Self::settled`]; a B-tree gives
    /// its nodes back as it empties, so it needs no [`Self::shrink`].
    inflight: BTreeSet<AllocationId>,
}

impl IdentityCache {
    /// Records that `user` needs `labels`' identity.
    pub(crate) fn acquire(&mut self, labels: &LabelSet, user: &EndpointKey) -> Lookup {
        let entry = self.entries.entry(labels.clone()).or_default();
        entry.users.insert(user.clone());
        if let Some(id) = entry.id {
            return Lookup::Known(id);
        }
        if entry.inflight.is_some() {
            return Lookup::Pending(None);
        }
        self.last_request = self.last_request.next();
        let id = self.last_request;
        entry.inflight = Some(id);
        self.inflight.insert(id);
        Lookup::Pending(Some(AllocationRequest {
            id,
            labels: labels.clone(),
        }))
    }

    /// `user` no longer needs `labels`; the entry goes with its last user.
    pub(crate) fn release(&mut self, labels: &LabelSet, user: &EndpointKey) -> Release {
        let Entry::Occupied(mut entry) = self.entries.entry(labels.clone()) else {
            return Release::Kept;
        };
        entry.get_mut().users.remove(user);
        if entry.get().users.is_empty() {
            let gone = entry.remove();
            if let Some(request) = gone.inflight {
                self.inflight.remove(&request);
            }
            self.shrink();
            return Release::Dropped(gone.inflight);
        }
        Release::Kept
    }

    /// The operator answered `id` for `labels`: the users to update (none if nobody
    /// needs the set any more). The set's request in flight, whichever answered,
    /// is settled.
    pub(crate) fn resolved(&mut self, labels: &LabelSet, id: IdentityId) -> Vec<EndpointKey> {
        match self.entries.get_mut(labels) {
            Some(entry) => {
                entry.id = Some(id);
                if let Some(request) = entry.inflight.take() {
                    self.inflight.remove(&request);
                }
                entry.users.iter().cloned().collect()
            }
            None => Vec::new(),
        }
    }

    /// The highest number up to which every request has been answered or given
    /// up: the one before the lowest in flight, or the last when none is.
    pub(crate) fn settled(&self) -> AllocationId {
        match self.inflight.first() {
            Some(lowest) => AllocationId::new(lowest.get().saturating_sub(1)),
            None => self.last_request,
        }
    }

    /// The operator said `labels` is `id` (a Rebind): like [`Self::resolved`].
    pub(crate) fn rebind(&mut self, labels: &LabelSet, id: IdentityId) -> Vec<EndpointKey> {
        self.resolved(labels, id)
    }

    /// The users of `labels`, for reporting a failed attempt.
    pub(crate) fn users(&self, labels: &LabelSet) -> Vec<EndpointKey> {
        self.entries
            .get(labels)
            .map(|e| e.users.iter().cloned().collect())
            .unwrap_or_default()
    }

    #[cfg(test)]
    pub(crate) fn id(&self, labels: &LabelSet) -> Option<IdentityId> {
        self.entries.get(labels).and_then(|e| e.id)
    }

    /// Label sets in the cache.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Label sets waiting for the operator.
    pub(crate) fn pending(&self) -> usize {
        self.entries.values().filter(|e| e.id.is_none()).count()
    }

    /// The distinct identities in use.
    #[cfg(test)]
    pub(crate) fn ids(&self) -> BTreeSet<IdentityId> {
        self.entries.values().filter_map(|e| e.id).collect()
    }

    fn shrink(&mut self) {
        if self.entries.capacity() > 64 && self.entries.len() < self.entries.capacity() / 4 {
            self.entries.shrink_to(self.entries.len() * 2);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> EndpointKey {
        EndpointKey::new("default", name).unwrap_or_else(|e| panic!("{e}"))
    }

    fn labels(text: &str) -> LabelSet {
        text.parse().unwrap_or_else(|e| panic!("{e}"))
    }

    fn id(n: u32) -> IdentityId {
        IdentityId::new(n).unwrap_or(IdentityId::WORLD)
    }

    #[test]
    fn one_request_per_label_set() {
        let mut cache = IdentityCache::default();
        let web = labels("k8s:app=web");
        let Lookup::Pending(Some(request)) = cache.acquire(&web, &key("web-0")) else {
            panic!("the first user starts the request");
        };
        assert_eq!(request.labels, web);
        for name in ["web-1", "web-2"] {
            assert!(
                matches!(cache.acquire(&web, &key(name)), Lookup::Pending(None)),
                "later users wait on the same request"
            );
        }
        let users = cache.resolved(&web, id(300));
        assert_eq!(users, vec![key("web-0"), key("web-1"), key("web-2")]);
        assert!(matches!(cache.acquire(&web, &key("web-3")), Lookup::Known(i) if i == id(300)));
        assert_eq!(cache.pending(), 0);
    }

    #[test]
    fn holds_only_label_sets_in_use() {
        let mut cache = IdentityCache::default();
        let web = labels("k8s:app=web");
        let db = labels("k8s:app=db");
        let _ = cache.acquire(&web, &key("web-0"));
        let _ = cache.acquire(&web, &key("web-1"));
        let _ = cache.acquire(&db, &key("db-0"));
        cache.resolved(&web, id(300));
        cache.resolved(&db, id(301));
        assert_eq!(cache.ids(), [id(300), id(301)].into());

        assert_eq!(
            cache.release(&web, &key("web-0")),
            Release::Kept,
            "web-1 still uses it"
        );
        assert_eq!(
            cache.release(&web, &key("web-1")),
            Release::Dropped(None),
            "answered: nothing to cancel"
        );
        assert_eq!(cache.ids(), [id(301)].into());
        assert_eq!(cache.id(&web), None);
        assert_eq!(
            cache.release(&web, &key("web-1")),
            Release::Kept,
            "releasing twice is harmless"
        );
        assert_eq!(cache.release(&db, &key("db-0")), Release::Dropped(None));
        assert!(cache.is_empty());
    }

    #[test]
    fn dropping_the_last_user_cancels_the_request() {
        let mut cache = IdentityCache::default();
        let web = labels("k8s:app=web");
        let Lookup::Pending(Some(request)) = cache.acquire(&web, &key("web-0")) else {
            panic!("a request");
        };
        assert_eq!(
            cache.release(&web, &key("web-0")),
            Release::Dropped(Some(request.id)),
            "the request in flight is cancelled"
        );
        assert!(
            cache.resolved(&web, id(300)).is_empty(),
            "a late answer changes nothing"
        );
        assert!(cache.is_empty());
        let Lookup::Pending(Some(again)) = cache.acquire(&web, &key("web-0")) else {
            panic!("a new request");
        };
        assert_ne!(again.id, request.id, "every request has its own id");
    }

    #[test]
    fn settled_is_the_number_before_the_lowest_request_in_flight() {
        let mut cache = IdentityCache::default();
        assert_eq!(cache.settled(), AllocationId::NONE, "none asked yet");
        let (web, db, api) = (
            labels("k8s:app=web"),
            labels("k8s:app=db"),
            labels("k8s:app=api"),
        );
        for set in [&web, &db, &api] {
            let _ = cache.acquire(set, &key("pod-0"));
        }
        let _ = cache.acquire(&db, &key("pod-1"));
        assert_eq!(cache.settled(), AllocationId::NONE);
        cache.resolved(&db, id(301));
        assert_eq!(cache.settled(), AllocationId::NONE, "1 is still in flight");
        assert_eq!(
            cache.release(&web, &key("pod-0")),
            Release::Dropped(Some(AllocationId::new(1)))
        );
        assert_eq!(cache.settled(), AllocationId::new(2), "3 is in flight");
        assert_eq!(cache.release(&db, &key("pod-0")), Release::Kept);
        cache.resolved(&api, id(302));
        assert_eq!(
            cache.settled(),
            AllocationId::new(3),
            "none in flight: the last"
        );

        let Lookup::Pending(Some(request)) = cache.acquire(&web, &key("pod-0")) else {
            panic!("a request");
        };
        assert_eq!(request.id, AllocationId::new(4));
        assert_eq!(cache.settled(), AllocationId::new(3));
        cache.rebind(&web, id(303));
        assert_eq!(
            cache.settled(),
            AllocationId::new(4),
            "a Rebind answers it too"
        );
        for (set, user) in [(&web, "pod-0"), (&db, "pod-1"), (&api, "pod-0")] {
            cache.release(set, &key(user));
        }
        assert!(cache.is_empty() && cache.inflight.is_empty());
        assert_eq!(
            cache.settled(),
            AllocationId::new(4),
            "the number never goes back"
        );
    }

    #[test]
    fn rebind_moves_every_user() {
        let mut cache = IdentityCache::default();
        let web = labels("k8s:app=web");
        let _ = cache.acquire(&web, &key("web-0"));
        let _ = cache.acquire(&web, &key("web-1"));
        cache.resolved(&web, id(300));
        assert_eq!(
            cache.rebind(&web, id(400)),
            vec![key("web-0"), key("web-1")]
        );
        assert_eq!(cache.id(&web), Some(id(400)));
        assert!(cache.rebind(&labels("k8s:app=other"), id(5)).is_empty());
        assert_eq!(cache.len(), 1, "a rebind of an unused set adds nothing");
    }
}
