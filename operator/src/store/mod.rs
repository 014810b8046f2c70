//! Durable state: identities, known nodes and quarantine tombstones.
//!
//! The allocator core never touches a store. Its effects become [`StoreOp`]s, which
//! writer tasks apply in batches (see `crate::writer`); the outcome of each op goes
//! back to the core as a `store_result` event. Three implementations: [`redb`], an
//! embedded file (the default), [`kubernetes`] (an `Identity` CRD, written only by
//! the leader), and [`memory`], for tests.
//!
//! A store that watches itself (Kubernetes) also reports changes census did not make
//! as [`StoreEvent`]s, which the runtime feeds to the core.

pub mod kubernetes;
pub mod memory;
pub mod redb;

use std::{future::Future, pin::Pin};

use census_proto::{domain::IdentityId, labels::LabelSet};
use tokio::sync::mpsc;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

// The ops and their outcomes are the core's vocabulary (it asks for writes and hears
// how they went); the stores implement them.
pub use crate::allocator::{Loaded, StoreError, StoreOp, StoredIdentity, Tombstone};

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

/// Durable state behind the allocator.
pub trait Store: Send + Sync + 'static {
    /// Reads everything. Called once at start, before the core exists.
    fn load(&self) -> BoxFuture<'_, Result<Loaded, StoreError>>;

    /// Applies `ops` in order and returns one outcome per op, in the same order. An
    /// implementation may commit them together; ops are independent, so one op's
    /// failure does not fail the others.
    fn apply(&self, ops: Vec<StoreOp>) -> BoxFuture<'_, Vec<Result<(), StoreError>>>;

    /// A short name for logs and metrics (`redb`, `memory`, `kubernetes`).
    fn kind(&self) -> &'static str;

    /// Changes to the store that census did not make, for the core (see
    /// [`StoreEvent`]). The first call takes the receiver; a store that cannot see
    /// such changes, and every later call, returns `None`.
    fn events(&self) -> Option<mpsc::Receiver<StoreEvent>> {
        None
    }
}
