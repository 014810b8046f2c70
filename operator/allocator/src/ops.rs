//! What the core asks of the store and how the store answers: the bindings, known
//! nodes and tombstones it holds ([`Loaded`]), one write ([`StoreOp`]) and why one
//! failed ([`StoreError`]), and what a store reports that census did not write
//! ([`StoreEvent`]). The operator's stores implement them; the core never touches a
//! store itself.

use census_proto::{
    domain::{IdentityId, NodeName},
    labels::LabelSet,
};

/// An identity as stored: the binding of an id to its canonical label set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredIdentity {
    pub id: IdentityId,
    pub labels: LabelSet,
}

/// A deleted id's quarantine record: the id may be bound again only to the label set
/// with this hash until `until_ms` (wall-clock ms since the Unix epoch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tombstone {
    pub id: IdentityId,
    pub labels_hash: u64,
    pub until_ms: u64,
}

/// Everything a store holds, read once when the operator starts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Loaded {
    pub identities: Vec<StoredIdentity>,
    pub nodes: Vec<NodeName>,
    pub tombstones: Vec<Tombstone>,
}

/// One write. Ops are idempotent, so a retry after an unknown outcome is safe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreOp {
    /// Bind `id` to `labels` and drop any tombstone of `id`. Succeeds if exactly this
    /// binding exists already; fails with [`StoreError::Conflict`] if the id or the
    /// labels are bound otherwise.
    CreateIdentity { id: IdentityId, labels: LabelSet },
    /// Delete `id` if it is bound to `labels` (success if it is gone already) and
    /// record `tombstone`. Fails with [`StoreError::Conflict`] if the id is bound to
    /// other labels.
    DeleteIdentity {
        id: IdentityId,
        labels: LabelSet,
        tombstone: Tombstone,
    },
    /// Forget an expired tombstone (success if it is gone already).
    DeleteTombstone { id: IdentityId },
    /// Record a node as known (success if it is known already).
    PutNode { node: NodeName },
    /// Forget a node (success if it is unknown already).
    DeleteNode { node: NodeName },
}

impl StoreOp {
    /// For logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::CreateIdentity { .. } => "create_identity",
            Self::DeleteIdentity { .. } => "delete_identity",
            Self::DeleteTombstone { .. } => "delete_tombstone",
            Self::PutNode { .. } => "put_node",
            Self::DeleteNode { .. } => "delete_node",
        }
    }
}

/// Why a store refused or failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The store holds, for the op's id, something else than the op expects that is
    /// not a valid binding (an invalid or edited object, a tombstone of other labels).
    /// Not retried as is: the core blocks the id.
    #[error("identity {id}: the store binds {found}, expected {expected}")]
    Conflict {
        id: IdentityId,
        expected: String,
        found: String,
    },
    /// The store binds `id` to another valid label set, `bound`: a binding census
    /// did not write (a deposed leader's late create, a restored backup) where the
    /// core was creating or deleting its own. Nothing was written; the core takes
    /// the store's binding (never fights it, never blocks the id for it) and moves
    /// whatever used `id` to another id.
    #[error("identity {id}: the store binds it to {bound} already, not to {labels}")]
    IdBound {
        id: IdentityId,
        labels: String,
        bound: LabelSet,
    },
    /// A create of `id` found its labels bound to another identity, `bound`: the
    /// store already has an identity for them (restored from a backup, applied by
    /// hand, or written by a deposed leader). Nothing was written; the core takes
    /// `bound` for the labels instead of blocking `id`.
    #[error("identity {id}: the store binds its labels {labels} to identity {bound} already")]
    LabelsBound {
        id: IdentityId,
        labels: String,
        bound: IdentityId,
    },
    /// The write may succeed later (I/O error, timeout, API server unavailable).
    #[error("store unavailable ({cause}): {detail}")]
    Unavailable { cause: &'static str, detail: String },
    /// The file or its contents cannot be read as census state: empty, truncated,
    /// damaged, or not a census store. Fatal at open.
    #[error(
        "store {path} is corrupt: {detail}; \
         it is never rewritten silently: restore it from a backup, or move the file away to start empty"
    )]
    Corrupt { path: String, detail: String },
    /// The file was written by another schema version. Fatal at open.
    #[error(
        "store {path} has schema version {found}, this operator reads version {supported}; \
         it is never rewritten silently: use an operator that reads version {found}, or move the file away to start empty"
    )]
    Schema {
        path: String,
        found: u32,
        supported: u32,
    },
    /// The store cannot be opened (permissions, locked by another process, ...). Fatal at open.
    #[error("cannot open store {path}: {detail}")]
    Open { path: String, detail: String },
}

impl StoreError {
    /// A bounded label for metrics.
    pub fn cause(&self) -> &'static str {
        match self {
            Self::Conflict { .. } => "conflict",
            Self::LabelsBound { .. } => "labels_bound",
            Self::IdBound { .. } => "id_bound",
            Self::Unavailable { cause, .. } => cause,
            Self::Corrupt { .. } => "corrupt",
            Self::Schema { .. } => "schema",
            Self::Open { .. } => "open",
        }
    }

    /// True if the same op may succeed when retried later.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Unavailable { .. })
    }
}

/// A change to the store that census did not make.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreEvent {
    /// The binding of `id` to `labels` is gone from the store (deleted, or made a
    /// tombstone, by someone else). The core writes it again if it still holds it.
    BindingLost { id: IdentityId, labels: LabelSet },
    /// The store holds for `id` an object census did not write, or one that was
    /// edited (`found` says what): the core blocks the id for good.
    BindingInvalid { id: IdentityId, found: String },
    /// The store holds a valid binding of `id` to `labels` that census did not write
    /// (a backup restored, `kubectl apply`, a deposed leader's late write). The core
    /// takes it in if it knows neither the id nor the labels; unused, it is collected
    /// like any other identity.
    BindingFound { id: IdentityId, labels: LabelSet },
    /// The quarantine record `tombstone` is gone from the store (deleted by someone
    /// else); `labels` are the labels it kept, if valid. The core writes it again while
    /// the id is still in quarantine, so the quarantine survives a failover.
    TombstoneLost {
        tombstone: Tombstone,
        labels: Option<LabelSet>,
    },
}
