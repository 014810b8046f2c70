//! An in-memory [`Store`] for tests, with fault injection.
//!
//! It applies ops with the same code as the redb store ([`plan`] decides what an op
//! writes, or why it fails, from the current state), so the two cannot drift. Faults
//! let the allocator's and the operator's tests see a store that fails, loses replies,
//! refuses particular ops or is slow.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    fmt,
    sync::{
        Arc, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use census_proto::{
    domain::{IdentityId, NodeName},
    labels::{LabelLimits, LabelSet},
};

use super::{BoxFuture, Loaded, Store, StoreError, StoreOp, StoredIdentity, Tombstone};

// ---------------------------------------------------------------------------------------
// Op semantics, shared by every store that can read its state before writing.
// ---------------------------------------------------------------------------------------

/// What [`plan`] needs to know about a store's current state.
pub(super) trait View {
    /// The canonical label string `id` is bound to, if any.
    fn labels_of(&self, id: IdentityId) -> Result<Option<String>, StoreError>;
    /// The id `labels` are bound to, if any.
    fn id_of(&self, labels: &LabelSet) -> Result<Option<IdentityId>, StoreError>;
}

/// One primitive write. An op's writes keep identities, the label index and tombstones
/// consistent with each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Write<'a> {
    /// Bind `id` to `labels` (identities and the label index).
    PutIdentity {
        id: IdentityId,
        labels: &'a LabelSet,
    },
    /// Unbind `id` from `labels` (identities and the label index).
    RemoveIdentity {
        id: IdentityId,
        labels: &'a LabelSet,
    },
    /// Record a tombstone for `id` (the key; the tombstone's own `id` is not used).
    PutTombstone {
        id: IdentityId,
        tombstone: &'a Tombstone,
    },
    RemoveTombstone {
        id: IdentityId,
    },
    PutNode {
        node: &'a NodeName,
    },
    RemoveNode {
        node: &'a NodeName,
    },
}

/// Decides what `op` writes given the current state, or why it fails. Nothing is
/// written for a failed op, so a failure never leaves part of an op behind.
pub(super) fn plan<'a>(op: &'a StoreOp, view: &impl View) -> Result<Vec<Write<'a>>, StoreError> {
    match op {
        StoreOp::CreateIdentity { id, labels } => {
            let id = *id;
            match view.labels_of(id)? {
                Some(found) if found == labels.as_str() => {}
                Some(found) => return Err(conflict(id, labels, found)),
                None => {}
            }
            let bound = view.id_of(labels)?;
            let mut writes = Vec::with_capacity(2);
            match bound {
                Some(other) if other != id => {
                    return Err(StoreError::LabelsBound {
                        id,
                        labels: labels.to_string(),
                        bound: other,
                    });
                }
                // Exactly this binding exists already: only a stray tombstone to drop.
                Some(_) => {}
                None => writes.push(Write::PutIdentity { id, labels }),
            }
            writes.push(Write::RemoveTombstone { id });
            Ok(writes)
        }
        StoreOp::DeleteIdentity {
            id,
            labels,
            tombstone,
        } => {
            let id = *id;
            let mut writes = Vec::with_capacity(2);
            match view.labels_of(id)? {
                Some(found) if found == labels.as_str() => {
                    writes.push(Write::RemoveIdentity { id, labels });
                }
                Some(found) => return Err(conflict(id, labels, found)),
                // Gone already (a retry, or deleted by someone else): still quarantine it.
                None => {}
            }
            writes.push(Write::PutTombstone { id, tombstone });
            Ok(writes)
        }
        StoreOp::DeleteTombstone { id } => Ok(vec![Write::RemoveTombstone { id: *id }]),
        StoreOp::PutNode { node } => Ok(vec![Write::PutNode { node }]),
        StoreOp::DeleteNode { node } => Ok(vec![Write::RemoveNode { node }]),
    }
}

/// `id` holds `found` where the op expects `labels`: a valid binding is one census
/// takes ([`StoreError::IdBound`]), anything else a conflict.
fn conflict(id: IdentityId, labels: &LabelSet, found: String) -> StoreError {
    match LabelSet::from_canonical(&found, &LabelLimits::default()) {
        Ok(bound) => StoreError::IdBound {
            id,
            labels: labels.to_string(),
            bound,
        },
        Err(_) => StoreError::Conflict {
            id,
            expected: labels.to_string(),
            found,
        },
    }
}

// ---------------------------------------------------------------------------------------
// State
// ---------------------------------------------------------------------------------------

#[derive(Debug, Default)]
struct State {
    identities: BTreeMap<IdentityId, LabelSet>,
    by_labels: HashMap<LabelSet, IdentityId>,
    tombstones: BTreeMap<IdentityId, Tombstone>,
    nodes: BTreeSet<NodeName>,
}

impl View for State {
    fn labels_of(&self, id: IdentityId) -> Result<Option<String>, StoreError> {
        Ok(self
            .identities
            .get(&id)
            .map(|labels| labels.as_str().to_owned()))
    }

    fn id_of(&self, labels: &LabelSet) -> Result<Option<IdentityId>, StoreError> {
        Ok(self.by_labels.get(labels).copied())
    }
}

impl State {
    fn from_loaded(loaded: Loaded) -> Result<Self, StoreError> {
        let mut state = Self::default();
        for StoredIdentity { id, labels } in loaded.identities {
            let op = StoreOp::CreateIdentity { id, labels };
            let writes = plan(&op, &state)?;
            state.write_all(&writes);
        }
        for tombstone in loaded.tombstones {
            state.tombstones.insert(tombstone.id, tombstone);
        }
        state.nodes.extend(loaded.nodes);
        Ok(state)
    }

    fn write_all(&mut self, writes: &[Write<'_>]) {
        for write in writes {
            match *write {
                Write::PutIdentity { id, labels } => {
                    self.identities.insert(id, labels.clone());
                    self.by_labels.insert(labels.clone(), id);
                }
                Write::RemoveIdentity { id, labels } => {
                    self.identities.remove(&id);
                    self.by_labels.remove(labels);
                }
                Write::PutTombstone { id, tombstone } => {
                    self.tombstones.insert(id, Tombstone { id, ..*tombstone });
                }
                Write::RemoveTombstone { id } => {
                    self.tombstones.remove(&id);
                }
                Write::PutNode { node } => {
                    self.nodes.insert(node.clone());
                }
                Write::RemoveNode { node } => {
                    self.nodes.remove(node);
                }
            }
        }
    }

    fn contents(&self) -> Loaded {
        Loaded {
            identities: self
                .identities
                .iter()
                .map(|(id, labels)| StoredIdentity {
                    id: *id,
                    labels: labels.clone(),
                })
                .collect(),
            nodes: self.nodes.iter().cloned().collect(),
            tombstones: self.tombstones.values().copied().collect(),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Faults
// ---------------------------------------------------------------------------------------

/// Decides, per op, whether an injected fault refuses it (and with which error).
type OpFault = Arc<dyn Fn(&StoreOp) -> Option<StoreError> + Send + Sync>;

#[derive(Default)]
struct Faults {
    /// Applies that fail whole, writing nothing.
    fail_applies: u64,
    /// Applies whose writes land but whose caller is told they failed (an unknown outcome).
    lose_replies: u64,
    /// Loads that fail.
    fail_loads: u64,
    /// Refuses matching ops; the others of the batch go on.
    op_fault: Option<OpFault>,
    /// Every apply waits this long (on the tokio clock) before it is applied.
    delay: Option<Duration>,
}

impl fmt::Debug for Faults {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Faults")
            .field("fail_applies", &self.fail_applies)
            .field("lose_replies", &self.lose_replies)
            .field("fail_loads", &self.fail_loads)
            .field("op_fault", &self.op_fault.as_ref().map(|_| "<fn>"))
            .field("delay", &self.delay)
            .finish()
    }
}

/// The error every injected failure returns unless the caller chose another.
pub fn injected_error() -> StoreError {
    StoreError::Unavailable {
        cause: "injected",
        detail: "fault injected by the memory store".to_owned(),
    }
}

// ---------------------------------------------------------------------------------------
// The store
// ---------------------------------------------------------------------------------------

/// An in-memory store with the redb store's semantics, and fault injection for tests.
///
/// Cloning gives another handle to the same contents and faults, so a test can keep one
/// handle while the code under test owns another.
#[derive(Debug, Clone, Default)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    state: Mutex<State>,
    faults: Mutex<Faults>,
    /// Held (shared) by every apply; [`MemoryStore::pause_applies`] takes it exclusively.
    gate: Arc<tokio::sync::RwLock<()>>,
    applies: AtomicU64,
}

/// Applies wait while this guard lives. Returned by [`MemoryStore::pause_applies`].
#[derive(Debug)]
pub struct PausedApplies {
    _guard: tokio::sync::OwnedRwLockWriteGuard<()>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while the lock was held cannot leave `State` half-written (every op's
    // writes are planned first and are plain map updates), so the contents stay usable.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// A store holding `loaded`, as if an operator had written it before. Fails with
    /// [`StoreError::Conflict`] if two identities share an id,
    /// [`StoreError::LabelsBound`] if they share a label set.
    pub fn with_contents(loaded: Loaded) -> Result<Self, StoreError> {
        let store = Self::new();
        *lock(&store.inner.state) = State::from_loaded(loaded)?;
        Ok(store)
    }

    /// Everything the store holds now, sorted as [`Store::load`] returns it.
    pub fn contents(&self) -> Loaded {
        lock(&self.inner.state).contents()
    }

    /// How many times `apply` has been called (with or without faults).
    pub fn apply_count(&self) -> u64 {
        self.inner.applies.load(Ordering::Relaxed)
    }

    /// The next `n` applies fail whole with a transient error and write nothing.
    pub fn fail_next_applies(&self, n: u64) {
        lock(&self.inner.faults).fail_applies = n;
    }

    /// The next `n` applies write as usual, but every op is reported as failed with a
    /// transient error: the caller cannot know the outcome, as after a timeout.
    pub fn lose_next_replies(&self, n: u64) {
        lock(&self.inner.faults).lose_replies = n;
    }

    /// The next `n` loads fail with a transient error.
    pub fn fail_next_loads(&self, n: u64) {
        lock(&self.inner.faults).fail_loads = n;
    }

    /// Until [`Self::clear_faults`], ops matching `matches` fail with [`injected_error`]
    /// and write nothing; the other ops of their batch are applied.
    pub fn fail_ops_matching(&self, matches: impl Fn(&StoreOp) -> bool + Send + Sync + 'static) {
        self.fail_ops_with(move |op| matches(op).then(injected_error));
    }

    /// Until [`Self::clear_faults`], an op for which `fault` returns an error fails with
    /// it and writes nothing; the other ops of their batch are applied.
    pub fn fail_ops_with(
        &self,
        fault: impl Fn(&StoreOp) -> Option<StoreError> + Send + Sync + 'static,
    ) {
        lock(&self.inner.faults).op_fault = Some(Arc::new(fault));
    }

    /// Every apply first waits `delay` on the tokio clock (so tests with a paused clock
    /// stay deterministic); `None` removes the delay.
    pub fn set_apply_delay(&self, delay: Option<Duration>) {
        lock(&self.inner.faults).delay = delay;
    }

    /// Applies wait until the returned guard is dropped (after those in progress finish).
    pub async fn pause_applies(&self) -> PausedApplies {
        PausedApplies {
            _guard: Arc::clone(&self.inner.gate).write_owned().await,
        }
    }

    /// Removes every injected fault and delay.
    pub fn clear_faults(&self) {
        *lock(&self.inner.faults) = Faults::default();
    }

    fn apply_now(&self, ops: &[StoreOp]) -> Vec<Result<(), StoreError>> {
        let (fail_whole, lose_reply, op_fault) = {
            let mut faults = lock(&self.inner.faults);
            let fail_whole = take_one(&mut faults.fail_applies);
            let lose_reply = !fail_whole && take_one(&mut faults.lose_replies);
            (fail_whole, lose_reply, faults.op_fault.clone())
        };
        if fail_whole {
            return ops.iter().map(|_| Err(injected_error())).collect();
        }
        let mut state = lock(&self.inner.state);
        let results: Vec<Result<(), StoreError>> = ops
            .iter()
            .map(|op| {
                if let Some(err) = op_fault.as_ref().and_then(|fault| fault(op)) {
                    return Err(err);
                }
                let writes = plan(op, &*state)?;
                state.write_all(&writes);
                Ok(())
            })
            .collect();
        if lose_reply {
            return ops.iter().map(|_| Err(injected_error())).collect();
        }
        results
    }
}

fn take_one(counter: &mut u64) -> bool {
    if *counter == 0 {
        return false;
    }
    *counter -= 1;
    true
}

impl Store for MemoryStore {
    fn load(&self) -> BoxFuture<'_, Result<Loaded, StoreError>> {
        Box::pin(async move {
            if take_one(&mut lock(&self.inner.faults).fail_loads) {
                return Err(injected_error());
            }
            Ok(self.contents())
        })
    }

    fn apply(&self, ops: Vec<StoreOp>) -> BoxFuture<'_, Vec<Result<(), StoreError>>> {
        Box::pin(async move {
            self.inner.applies.fetch_add(1, Ordering::Relaxed);
            let delay = lock(&self.inner.faults).delay;
            if let Some(delay) = delay {
                tokio::time::sleep(delay).await;
            }
            let _open = self.inner.gate.read().await;
            self.apply_now(&ops)
        })
    }

    fn kind(&self) -> &'static str {
        "memory"
    }
}

#[cfg(test)]
mod tests {
    use census_proto::labels::LabelLimits;

    use super::*;

    fn labels(s: &str) -> Result<LabelSet, Box<dyn std::error::Error>> {
        Ok(LabelSet::parse(s.split(';'), &LabelLimits::default())?)
    }

    fn id(n: u32) -> Result<IdentityId, Box<dyn std::error::Error>> {
        IdentityId::new(n).ok_or_else(|| "id 0".into())
    }

    #[tokio::test]
    async fn lost_reply_still_writes() -> Result<(), Box<dyn std::error::Error>> {
        let store = MemoryStore::new();
        store.lose_next_replies(1);
        let op = StoreOp::CreateIdentity {
            id: id(300)?,
            labels: labels("k8s:app=web")?,
        };
        let results = store.apply(vec![op.clone()]).await;
        assert_eq!(results, vec![Err(injected_error())]);
        assert_eq!(store.contents().identities.len(), 1);
        // The retry of an op whose outcome was lost succeeds: ops are idempotent.
        assert_eq!(store.apply(vec![op]).await, vec![Ok(())]);
        Ok(())
    }

    #[tokio::test]
    async fn failed_apply_writes_nothing_and_counts_down() -> Result<(), Box<dyn std::error::Error>>
    {
        let store = MemoryStore::new();
        store.fail_next_applies(2);
        let op = StoreOp::PutNode {
            node: NodeName::new("node-a")?,
        };
        for _ in 0..2 {
            assert_eq!(
                store.apply(vec![op.clone()]).await,
                vec![Err(injected_error())]
            );
            assert!(store.contents().nodes.is_empty());
        }
        assert_eq!(store.apply(vec![op]).await, vec![Ok(())]);
        assert_eq!(store.contents().nodes.len(), 1);
        assert_eq!(store.apply_count(), 3);
        Ok(())
    }

    #[tokio::test]
    async fn op_fault_refuses_only_matching_ops() -> Result<(), Box<dyn std::error::Error>> {
        let store = MemoryStore::new();
        store.fail_ops_matching(
            |op| matches!(op, StoreOp::PutNode { node } if node.as_str() == "bad"),
        );
        let results = store
            .apply(vec![
                StoreOp::PutNode {
                    node: NodeName::new("bad")?,
                },
                StoreOp::PutNode {
                    node: NodeName::new("good")?,
                },
            ])
            .await;
        assert_eq!(results, vec![Err(injected_error()), Ok(())]);
        assert_eq!(store.contents().nodes, vec![NodeName::new("good")?]);
        store.clear_faults();
        let results = store
            .apply(vec![StoreOp::PutNode {
                node: NodeName::new("bad")?,
            }])
            .await;
        assert_eq!(results, vec![Ok(())]);
        Ok(())
    }

    #[tokio::test(start_paused = true)]
    async fn delay_and_pause_hold_applies_back() -> Result<(), Box<dyn std::error::Error>> {
        let store = MemoryStore::new();
        store.set_apply_delay(Some(Duration::from_secs(5)));
        let start = tokio::time::Instant::now();
        store
            .apply(vec![StoreOp::PutNode {
                node: NodeName::new("a")?,
            }])
            .await;
        assert!(start.elapsed() >= Duration::from_secs(5));
        store.set_apply_delay(None);

        let paused = store.pause_applies().await;
        let handle = store.clone();
        let node = NodeName::new("b")?;
        let task = tokio::spawn(async move { handle.apply(vec![StoreOp::PutNode { node }]).await });
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(
            store.contents().nodes.len(),
            1,
            "a paused apply must not write"
        );
        drop(paused);
        assert_eq!(task.await?, vec![Ok(())]);
        assert_eq!(store.contents().nodes.len(), 2);
        Ok(())
    }

    #[tokio::test]
    async fn failed_load() {
        let store = MemoryStore::new();
        store.fail_next_loads(1);
        assert_eq!(store.load().await, Err(injected_error()));
        assert_eq!(store.load().await, Ok(Loaded::default()));
    }

    #[test]
    fn with_contents_refuses_duplicate_labels() -> Result<(), Box<dyn std::error::Error>> {
        let web = labels("k8s:app=web")?;
        let loaded = Loaded {
            identities: vec![
                StoredIdentity {
                    id: id(300)?,
                    labels: web.clone(),
                },
                StoredIdentity {
                    id: id(301)?,
                    labels: web,
                },
            ],
            ..Loaded::default()
        };
        assert!(matches!(
            MemoryStore::with_contents(loaded),
            Err(StoreError::LabelsBound { .. })
        ));
        Ok(())
    }
}
