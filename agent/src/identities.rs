//! Identities of label sets: a cache that holds only the label sets endpoints use,
//! and the client that asks the operator for the ones it does not know.
//!
//! The cache is plain synchronous state owned by the agent's core:
//!
//! - one Allocate in flight per label set: the first endpoint that needs an unknown
//!   set gets an [`AllocationRequest`] to start, the others wait on the same entry
//!   and are all resolved by its answer;
//! - an entry lives exactly as long as some endpoint uses its label set: releasing
//!   the last user drops it, and with it the request in flight (its task sees the
//!   cancellation and stops retrying);
//! - a `Rebind` from the operator rewrites the entry, so every endpoint of the set
//!   follows.
//!
//! [`IdentityClient`] runs each request as a task that retries with capped, jittered
//! backoff while the operator is away or refuses, reporting progress as
//! [`AllocationEvent`]s.

use std::{
    collections::{BTreeSet, HashMap, hash_map::Entry},
    sync::Arc,
    time::Duration,
};

use census_proto::{
    PROTOCOL_VERSION,
    convert::session_to_wire,
    domain::{EndpointKey, IdentityId, NodeName, SessionId},
    labels::LabelSet,
    pb::{self, identity_service_client::IdentityServiceClient},
    status::code_label,
};
use tokio::sync::{Semaphore, mpsc, oneshot, watch};
use tonic::{Code, transport::Channel};
use tracing::{Instrument as _, debug, info_span, warn};

use crate::{backoff::Backoff, metrics::Metrics};

/// What the cache knows of one label set.
#[derive(Debug, Default)]
struct CacheEntry {
    id: Option<IdentityId>,
    /// The endpoints whose identity labels are this set.
    users: BTreeSet<EndpointKey>,
    /// Dropping it cancels the request in flight.
    inflight: Option<oneshot::Sender<()>>,
}

/// The answer of [`IdentityCache::acquire`].
#[derive(Debug)]
pub enum Lookup {
    Known(IdentityId),
    /// Not known yet. `Some` for the first user: the request to start.
    Pending(Option<AllocationRequest>),
}

/// A label set to allocate; dropping the cache entry cancels it.
#[derive(Debug)]
pub struct AllocationRequest {
    pub labels: LabelSet,
    pub cancelled: oneshot::Receiver<()>,
}

/// The identities of the label sets in use on this node.
#[derive(Debug, Default)]
pub struct IdentityCache {
    entries: HashMap<LabelSet, CacheEntry>,
}

impl IdentityCache {
    /// Records that `user` needs `labels`' identity.
    pub fn acquire(&mut self, labels: &LabelSet, user: &EndpointKey) -> Lookup {
        let entry = self.entries.entry(labels.clone()).or_default();
        entry.users.insert(user.clone());
        if let Some(id) = entry.id {
            return Lookup::Known(id);
        }
        if entry.inflight.is_some() {
            return Lookup::Pending(None);
        }
        let (cancel, cancelled) = oneshot::channel();
        entry.inflight = Some(cancel);
        Lookup::Pending(Some(AllocationRequest {
            labels: labels.clone(),
            cancelled,
        }))
    }

    /// `user` no longer needs `labels`; the entry goes with its last user. Returns
    /// whether it went.
    pub fn release(&mut self, labels: &LabelSet, user: &EndpointKey) -> bool {
        let Entry::Occupied(mut entry) = self.entries.entry(labels.clone()) else {
            return false;
        };
        entry.get_mut().users.remove(user);
        if entry.get().users.is_empty() {
            entry.remove();
            self.shrink();
            return true;
        }
        false
    }

    /// The operator answered `id` for `labels`: the users to update (none if nobody
    /// needs the set any more).
    pub fn resolved(&mut self, labels: &LabelSet, id: IdentityId) -> Vec<EndpointKey> {
        match self.entries.get_mut(labels) {
            Some(entry) => {
                entry.id = Some(id);
                entry.inflight = None;
                entry.users.iter().cloned().collect()
            }
            None => Vec::new(),
        }
    }

    /// The operator said `labels` is `id` (a Rebind): like [`Self::resolved`].
    pub fn rebind(&mut self, labels: &LabelSet, id: IdentityId) -> Vec<EndpointKey> {
        self.resolved(labels, id)
    }

    /// The users of `labels`, for reporting a failed attempt.
    pub fn users(&self, labels: &LabelSet) -> Vec<EndpointKey> {
        self.entries
            .get(labels)
            .map(|e| e.users.iter().cloned().collect())
            .unwrap_or_default()
    }

    pub fn id(&self, labels: &LabelSet) -> Option<IdentityId> {
        self.entries.get(labels).and_then(|e| e.id)
    }

    /// Label sets in the cache.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Label sets waiting for the operator.
    pub fn pending(&self) -> usize {
        self.entries.values().filter(|e| e.id.is_none()).count()
    }

    /// The distinct identities in use.
    pub fn ids(&self) -> BTreeSet<IdentityId> {
        self.entries.values().filter_map(|e| e.id).collect()
    }

    fn shrink(&mut self) {
        if self.entries.capacity() > 64 && self.entries.len() < self.entries.capacity() / 4 {
            self.entries.shrink_to(self.entries.len() * 2);
        }
    }
}

/// Progress of an allocation, for the core.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AllocationEvent {
    Allocated {
        labels: LabelSet,
        id: IdentityId,
    },
    /// An attempt failed; the task retries after a backoff. `refused` when the
    /// operator refused the label set (INVALID_ARGUMENT), not merely unreachable.
    Retrying {
        labels: LabelSet,
        error: String,
        refused: bool,
    },
}

/// Runs allocation requests against the operator.
#[derive(Debug, Clone)]
pub(crate) struct IdentityClient {
    client: IdentityServiceClient<Channel>,
    node: NodeName,
    session: SessionId,
    events: mpsc::Sender<AllocationEvent>,
    limit: Arc<Semaphore>,
    /// Allocate needs the operator to know this session: calls wait for a stream.
    connected: watch::Receiver<bool>,
    initial_backoff: Duration,
    max_backoff: Duration,
    metrics: Metrics,
}

/// At most this many Allocate calls at once.
const CONCURRENCY: usize = 32;
/// One Allocate call may take this long.
const CALL_TIMEOUT: Duration = Duration::from_secs(15);

impl IdentityClient {
    pub(crate) fn new(
        channel: Channel,
        node: NodeName,
        session: SessionId,
        events: mpsc::Sender<AllocationEvent>,
        connected: watch::Receiver<bool>,
        max_backoff: Duration,
        metrics: Metrics,
    ) -> Self {
        Self {
            client: IdentityServiceClient::new(channel),
            node,
            session,
            events,
            limit: Arc::new(Semaphore::new(CONCURRENCY)),
            connected,
            initial_backoff: Duration::from_millis(200),
            max_backoff,
            metrics,
        }
    }

    /// Starts a task for `request`; it ends with an answer or its cancellation.
    pub(crate) fn spawn(&self, request: AllocationRequest) {
        let this = self.clone();
        let span = info_span!("allocate", labels = %request.labels);
        tokio::spawn(this.run(request).instrument(span));
    }

    async fn run(self, request: AllocationRequest) {
        let AllocationRequest {
            labels,
            mut cancelled,
        } = request;
        let mut backoff = Backoff::new(self.initial_backoff, self.max_backoff);
        let mut connected = self.connected.clone();
        loop {
            let attempt = async {
                // Ended (false) only when the agent stops; then the call fails and ends.
                let _ = connected.wait_for(|up| *up).await.map(|_| ());
                let _permit = self.limit.acquire().await;
                self.attempt(&labels).await
            };
            let result = tokio::select! {
                result = attempt => result,
                _ = &mut cancelled => {
                    debug!("no endpoint needs the label set any more");
                    return;
                }
            };
            let event = match result {
                Ok(id) => {
                    self.metrics.allocation("ok");
                    AllocationEvent::Allocated {
                        labels: labels.clone(),
                        id,
                    }
                }
                Err((kind, error, refused)) => {
                    self.metrics.allocation(kind);
                    warn!(%error, "Allocate failed; retrying");
                    AllocationEvent::Retrying {
                        labels: labels.clone(),
                        error,
                        refused,
                    }
                }
            };
            let done = matches!(event, AllocationEvent::Allocated { .. });
            if self.events.send(event).await.is_err() || done {
                return;
            }
            let delay = backoff.next_delay();
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                _ = &mut cancelled => return,
            }
        }
    }

    /// One Allocate call: the id, or (metric label, message, refused).
    async fn attempt(&self, labels: &LabelSet) -> Result<IdentityId, (&'static str, String, bool)> {
        let request = pb::AllocateRequest {
            protocol_version: PROTOCOL_VERSION,
            node: self.node.to_string(),
            session: Some(session_to_wire(self.session)),
            labels: labels.to_strings(),
        };
        let mut client = self.client.clone();
        let call = tokio::time::timeout(CALL_TIMEOUT, client.allocate(request));
        match call.await {
            Err(_) => Err((
                "timeout",
                "the operator did not answer Allocate in time".to_owned(),
                false,
            )),
            Ok(Err(status)) => {
                let refused = status.code() == Code::InvalidArgument;
                Err((
                    code_label(status.code()),
                    format!(
                        "operator: {}: {}",
                        code_label(status.code()),
                        status.message()
                    ),
                    refused,
                ))
            }
            Ok(Ok(response)) => response
                .into_inner()
                .identity
                .and_then(|identity| IdentityId::new(identity.id))
                .ok_or((
                    "invalid",
                    "the operator answered without an identity".to_owned(),
                    false,
                )),
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

        assert!(!cache.release(&web, &key("web-0")), "web-1 still uses it");
        assert!(cache.release(&web, &key("web-1")));
        assert_eq!(cache.ids(), [id(301)].into());
        assert_eq!(cache.id(&web), None);
        assert!(
            !cache.release(&web, &key("web-1")),
            "releasing twice is harmless"
        );
        assert!(cache.release(&db, &key("db-0")));
        assert!(cache.is_empty());
    }

    #[test]
    fn dropping_the_last_user_cancels_the_request() {
        let mut cache = IdentityCache::default();
        let web = labels("k8s:app=web");
        let Lookup::Pending(Some(mut request)) = cache.acquire(&web, &key("web-0")) else {
            panic!("a request");
        };
        assert!(
            request
                .cancelled
                .try_recv()
                .is_err_and(|e| e == oneshot::error::TryRecvError::Empty)
        );
        cache.release(&web, &key("web-0"));
        assert_eq!(
            request.cancelled.try_recv(),
            Err(oneshot::error::TryRecvError::Closed),
            "the task sees its cancellation"
        );
        assert!(
            cache.resolved(&web, id(300)).is_empty(),
            "a late answer changes nothing"
        );
        assert!(cache.is_empty());
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
