//! The Kubernetes store: one cluster-scoped `Identity` object per id (see [`crd`]).
//!
//! - **load** is a paginated list of the objects (bindings and tombstones). Known
//!   nodes are not stored: the cluster's Node objects are that record, so `PutNode`
//!   and `DeleteNode` succeed at once and write nothing.
//! - **apply** runs a batch's ops concurrently (bounded), each as DESIGN.md's
//!   "Garbage collection" says: every write carries a resourceVersion (and a delete
//!   also a UID) precondition; on a 409 the object is re-read, and the op is retried
//!   if it still holds what census wrote (an annotation added is no change), or fails
//!   with [`StoreError::IdBound`] if it binds other valid labels (the core takes that
//!   binding) and [`StoreError::Conflict`] if it is no valid binding; 404 on a delete
//!   is success;
//!   429, 5xx and timeouts are [`StoreError::Unavailable`] with a bounded cause, and
//!   the core retries them with backoff. The 409s met are counted by op
//!   (`census_kubernetes_conflicts_total`): a retried one leaves no other trace, as the
//!   op it delayed still succeeds.
//! - it **watches its own objects** ([`watch`]) into a minimal [`index`] (uid,
//!   resourceVersion, labels or tombstone per id; never the objects): a binding deleted
//!   by someone else becomes [`StoreEvent::BindingLost`], an object with invalid or
//!   edited labels [`StoreEvent::BindingInvalid`] (logged, counted, and reported as a
//!   Kubernetes Event by the leader). Followers answer reads from the same index.
//! - it writes only while its [`Fence`] is open (the leader's, see `crate::k8s`).

pub mod crd;
mod error;
mod index;
mod object;
mod report;
mod watch;
mod write;

use std::{
    collections::HashSet,
    fmt,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use census_proto::{
    domain::IdentityId,
    labels::{LabelLimits, LabelSet},
};
use futures::StreamExt;
use kube::{
    Api, Client,
    api::{ApiResource, DynamicObject, ListParams},
};
use parking_lot::{Mutex, RwLock};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{counter::ConstCounter, gauge::ConstGauge},
};
use tokio::{
    sync::{broadcast, mpsc, watch as tokio_watch},
    task::JoinHandle,
};
use tracing::{Instrument, debug, info, info_span, warn};

use self::{
    error::{Failure, classify},
    index::Index,
    object::{Parsed, State},
    report::Reporter,
};
use super::{BoxFuture, Loaded, Store, StoreError, StoreEvent, StoreOp, StoredIdentity, Tombstone};
use crate::{
    allocator::{IdentityInfo, WatchChange},
    replica::{Fence, ReadModel},
};

/// Store events buffered for the core.
const EVENTS: usize = 4096;

/// How the store is set up.
#[derive(Debug, Clone)]
pub struct KubeStoreConfig {
    /// Limits for reading label sets from objects (the operator's `--max-labels`).
    pub limits: LabelLimits,
    /// Ops of one batch in flight at once.
    pub concurrency: usize,
    /// Longest one API request may take (also bounded by the fence).
    pub request_timeout: Duration,
    /// Where Kubernetes Events about invalid objects go, and who reports them; `None`
    /// for no Events.
    pub events: Option<EventsConfig>,
}

/// Kubernetes Events about invalid objects. They go to `default`, whatever the
/// operator's namespace: the only namespace (with `kube-system`) where the API server
/// accepts Events about cluster-scoped objects.
#[derive(Debug, Clone)]
pub struct EventsConfig {
    /// The reporting instance (the operator's pod name).
    pub instance: String,
}

impl Default for KubeStoreConfig {
    fn default() -> Self {
        Self {
            limits: LabelLimits::default(),
            concurrency: 64,
            request_timeout: Duration::from_secs(10),
            events: None,
        }
    }
}

/// State shared by the store handle, its watch task and its read model.
struct Shared {
    /// Writes: a client without kube's own retries, so the core's backoff governs.
    writes: Api<DynamicObject>,
    /// Lists and the watch.
    reads: Api<DynamicObject>,
    resource: ApiResource,
    index: RwLock<Index>,
    fence: Arc<Fence>,
    cfg: KubeStoreConfig,
    events: mpsc::Sender<StoreEvent>,
    /// Whether someone took the receiving end (events are dropped until then).
    events_taken: AtomicBool,
    synced: tokio_watch::Sender<bool>,
    reporter: Option<Reporter>,
    conflicts: Conflicts,
}

/// 409s (a failed resourceVersion or UID precondition) met by census's own writes,
/// by op: each was followed by a re-read and, unless the object then held something
/// census did not write, by the write again.
#[derive(Debug, Default)]
struct Conflicts {
    create: AtomicU64,
    tombstone: AtomicU64,
    delete_tombstone: AtomicU64,
}

/// The op a conflict delayed, as the metric's label says it.
#[derive(Debug, Clone, Copy)]
enum ConflictOp {
    Create,
    Tombstone,
    DeleteTombstone,
}

impl Conflicts {
    fn met(&self, op: ConflictOp) {
        let counter = match op {
            ConflictOp::Create => &self.create,
            ConflictOp::Tombstone => &self.tombstone,
            ConflictOp::DeleteTombstone => &self.delete_tombstone,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn by_op(&self) -> [(&'static str, u64); 3] {
        [
            ("create", self.create.load(Ordering::Relaxed)),
            ("tombstone", self.tombstone.load(Ordering::Relaxed)),
            (
                "delete_tombstone",
                self.delete_tombstone.load(Ordering::Relaxed),
            ),
        ]
    }
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KubeStore")
            .field("objects", &self.index.read().len())
            .finish_non_exhaustive()
    }
}

/// The Kubernetes store. Dropping it stops its watch.
#[derive(Debug)]
pub struct KubeStore {
    shared: Arc<Shared>,
    events: Mutex<Option<mpsc::Receiver<StoreEvent>>>,
    watch: JoinHandle<()>,
}

impl Drop for KubeStore {
    fn drop(&mut self) {
        self.watch.abort();
    }
}

impl KubeStore {
    /// A store over the Identity objects of the cluster `writes` and `reads` talk to,
    /// writing through `writes` (configure it without retries) only while `fence` is
    /// open. Starts watching at once; must run inside a tokio runtime.
    pub fn new(writes: Client, reads: Client, fence: Arc<Fence>, cfg: KubeStoreConfig) -> Self {
        let resource = object::api_resource();
        let (events_tx, events_rx) = mpsc::channel(EVENTS);
        let reporter = cfg
            .events
            .as_ref()
            .map(|e| Reporter::new(writes.clone(), &e.instance));
        let shared = Arc::new(Shared {
            writes: Api::all_with(writes, &resource),
            reads: Api::all_with(reads, &resource),
            resource,
            index: RwLock::new(Index::default()),
            fence,
            cfg,
            events: events_tx,
            events_taken: AtomicBool::new(false),
            synced: tokio_watch::Sender::new(false),
            reporter,
            conflicts: Conflicts::default(),
        });
        let watch = tokio::spawn(
            watch::run(shared.clone()).instrument(info_span!("watch", resource = "identities")),
        );
        Self {
            shared,
            events: Mutex::new(Some(events_rx)),
            watch,
        }
    }

    /// Waits until the watch has listed every object once.
    pub async fn wait_synced(&self) {
        let mut rx = self.shared.synced.subscribe();
        let _ = rx.wait_for(|synced| *synced).await;
    }

    pub fn is_synced(&self) -> bool {
        *self.shared.synced.borrow()
    }

    /// What followers answer reads from.
    pub fn read_model(&self) -> Arc<dyn ReadModel> {
        Arc::new(Reads(self.shared.clone()))
    }

    /// Objects census cannot use, by id, with what is wrong with each.
    pub fn invalid_objects(&self) -> Vec<(IdentityId, String)> {
        self.shared.index.read().invalid()
    }

    /// What a new leader builds its core from: the index the watch keeps synced (a
    /// second full list would only repeat it). Like [`Store::load`]: the bindings (a
    /// label set claimed by two objects stays with the older, as the index decides) and
    /// the tombstones; invalid objects are left out (the caller tells the core of them,
    /// [`Self::invalid_objects`]). An object being deleted is included as what it says,
    /// so its id stays taken in the core: a binding's users keep it, and the binding is
    /// reported lost right after ([`Self::lost_since_load`]), so the core writes it
    /// again once the object is gone; a tombstone keeps its quarantine.
    ///
    /// Call it once [`Self::wait_synced`] has returned.
    pub fn loaded_from_index(&self) -> Loaded {
        let index = self.shared.index.read();
        let mut loaded = Loaded::default();
        for (id, entry) in index.iter() {
            match &entry.state {
                // Its labels are bound to a live object already: that one is theirs.
                State::Binding(labels)
                    if entry.meta.deleting && index.bound_to(labels).is_some_and(|b| b != id) => {}
                State::Binding(labels) => loaded.identities.push(StoredIdentity {
                    id,
                    labels: labels.clone(),
                }),
                State::Tombstone {
                    labels_hash,
                    until_ms,
                    ..
                } => loaded.tombstones.push(Tombstone {
                    id,
                    labels_hash: *labels_hash,
                    until_ms: *until_ms,
                }),
                State::Invalid(_) => {}
            }
        }
        loaded
    }

    /// Of `loaded`, the bindings the watch no longer sees as they were loaded: deleted,
    /// being deleted, or tombstoned by someone else since. A new leader tells its core
    /// right after building it.
    pub fn lost_since_load(&self, loaded: &[StoredIdentity]) -> Vec<(IdentityId, LabelSet)> {
        let index = self.shared.index.read();
        loaded
            .iter()
            .filter(|s| match index.get(s.id) {
                Some(e) if e.meta.deleting => true,
                Some(e) => match &e.state {
                    State::Binding(labels) => *labels != s.labels,
                    State::Invalid(_) => false,
                    State::Tombstone { .. } => true,
                },
                None => true,
            })
            .map(|s| (s.id, s.labels.clone()))
            .collect()
    }

    /// Reports every invalid object as a Kubernetes Event (a new leader does this once).
    pub async fn report_invalid(&self) {
        if let Some(reporter) = &self.shared.reporter {
            for (id, found) in self.invalid_objects() {
                reporter.invalid(&self.shared, id, &found).await;
            }
        }
    }

    /// Objects in the index.
    pub fn cached_objects(&self) -> usize {
        self.shared.index.read().len()
    }

    /// The scrape-time gauges of this store.
    pub fn collector(&self) -> Box<dyn Collector> {
        Box::new(StoreCollector(self.shared.clone()))
    }

    async fn load_once(&self) -> Result<Vec<Parsed>, Failure> {
        let mut all = Vec::new();
        let mut continue_token = None;
        loop {
            let params = ListParams {
                limit: Some(census_daemon::watch::PAGE),
                continue_token: continue_token.take(),
                ..ListParams::default()
            };
            let page = self
                .shared
                .reads
                .list(&params)
                .await
                .map_err(|e| classify(&e))?;
            for obj in &page.items {
                match object::parse(obj, &self.shared.cfg.limits) {
                    Ok(p) => all.push(p),
                    Err(bad) => warn!("{bad}; skipped"),
                }
            }
            match page.metadata.continue_ {
                Some(token) if !token.is_empty() => continue_token = Some(token),
                _ => return Ok(all),
            }
        }
    }
}

impl Store for KubeStore {
    fn load(&self) -> BoxFuture<'_, Result<Loaded, StoreError>> {
        Box::pin(async move {
            let mut attempt = 0;
            let mut all = loop {
                attempt += 1;
                match self.load_once().await {
                    Ok(all) => break all,
                    // The list's snapshot was compacted between pages: start over.
                    Err(Failure::Expired) if attempt < 3 => {
                        info!("the list expired between pages; listing again");
                    }
                    Err(e) => return Err(e.into_store_error("listing Identity objects")),
                }
            };
            // A label set claimed by two objects stays with the older one, as the
            // watch decides; the other is reported as invalid there.
            all.sort_by_key(|p| (p.meta.created_ms, p.id));
            let mut seen = HashSet::new();
            let mut loaded = Loaded::default();
            for p in all {
                match p.state {
                    State::Binding(labels) => {
                        if seen.insert(labels.clone()) {
                            loaded.identities.push(StoredIdentity { id: p.id, labels });
                        }
                    }
                    State::Tombstone {
                        labels_hash,
                        until_ms,
                        ..
                    } => loaded.tombstones.push(Tombstone {
                        id: p.id,
                        labels_hash,
                        until_ms,
                    }),
                    State::Invalid(_) => {}
                }
            }
            loaded.identities.sort_by_key(|s| s.id);
            Ok(loaded)
        })
    }

    fn apply(&self, ops: Vec<StoreOp>) -> BoxFuture<'_, Vec<Result<(), StoreError>>> {
        let shared = self.shared.clone();
        Box::pin(async move {
            let concurrency = shared.cfg.concurrency.max(1);
            futures::stream::iter(ops)
                .map(|op| {
                    let shared = shared.clone();
                    async move { shared.apply_one(op).await }
                })
                .buffered(concurrency)
                .collect()
                .await
        })
    }

    fn kind(&self) -> &'static str {
        "kubernetes"
    }

    fn events(&self) -> Option<mpsc::Receiver<StoreEvent>> {
        let rx = self.events.lock().take();
        if rx.is_some() {
            self.shared.events_taken.store(true, Ordering::Release);
        }
        rx
    }
}

impl Shared {
    /// Hands events to the core; an invalid object is also logged and, by the leader,
    /// reported as a Kubernetes Event.
    async fn emit(&self, events: Vec<StoreEvent>) {
        for event in events {
            match &event {
                StoreEvent::BindingInvalid { id, found } => {
                    warn!(
                        object = %id,
                        "Identity object {id} is invalid: {found}; census blocks id {id} and never binds it"
                    );
                    if let Some(reporter) = &self.reporter
                        && self.fence.is_open()
                    {
                        reporter.invalid(self, *id, found).await;
                    }
                }
                StoreEvent::BindingFound { id, labels } => {
                    // Also census's own create, seen by the watch before its answer
                    // (the core knows that one and ignores it).
                    debug!(object = %id, %labels, "the store holds a binding of identity {id}");
                }
                StoreEvent::BindingLost { id, labels } => {
                    // Also census's own delete, seen by the watch before its answer
                    // (the core ignores that one).
                    debug!(object = %id, %labels, "the store no longer holds the binding of identity {id}");
                }
                StoreEvent::TombstoneLost { tombstone, .. } => {
                    // Also census's own delete at the end of a quarantine (the core
                    // has ended that quarantine and ignores it).
                    debug!(object = %tombstone.id, "the store no longer holds the tombstone of identity {}", tombstone.id);
                }
            }
            if self.events_taken.load(Ordering::Acquire) {
                // A closed receiver means the operator is stopping.
                let _ = self.events.send(event).await;
            }
        }
    }
}

/// The index as a read model.
#[derive(Debug)]
struct Reads(Arc<Shared>);

impl ReadModel for Reads {
    fn identity(&self, id: IdentityId) -> Option<IdentityInfo> {
        self.0.index.read().identity(id)
    }

    fn lookup(&self, labels: &LabelSet) -> Option<IdentityInfo> {
        self.0.index.read().lookup(labels)
    }

    fn list(
        &self,
        after: Option<IdentityId>,
        limit: usize,
        selector: Option<&LabelSet>,
        include_quarantined: bool,
    ) -> (Vec<IdentityInfo>, bool) {
        self.0
            .index
            .read()
            .list(after, limit, selector, include_quarantined)
    }

    fn bindings(&self) -> Vec<IdentityInfo> {
        self.0.index.read().bindings()
    }

    fn subscribe(&self) -> broadcast::Receiver<WatchChange> {
        self.0.index.read().subscribe()
    }
}

#[derive(Debug)]
struct StoreCollector(Arc<Shared>);

impl Collector for StoreCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), fmt::Error> {
        let (objects, invalid) = {
            let index = self.0.index.read();
            (index.len(), index.invalid_count())
        };
        for (name, help, value) in [
            (
                "census_invalid_identity_objects",
                "Identity objects census cannot use (invalid or edited labels, a name that is not an id); their ids are blocked",
                invalid,
            ),
            (
                "census_kubernetes_cached_identity_objects",
                "Identity objects in the store's index (uid, resourceVersion and labels of each)",
                objects,
            ),
        ] {
            let gauge = ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX));
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        let kind = ConstCounter::new(0u64).metric_type();
        let mut family = encoder.encode_descriptor(
            "census_kubernetes_conflicts",
            "409s census's conditional writes to Identity objects met (each re-read, and retried unless the object held something census did not write), by op",
            None,
            kind,
        )?;
        for (op, n) in self.0.conflicts.by_op() {
            ConstCounter::new(n).encode(family.encode_family(&[("op", op)])?)?;
        }
        Ok(())
    }
}
