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

use tokio::sync::mpsc;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

// The ops and their outcomes are the core's vocabulary (it asks for writes and hears
// how they went); the stores implement them.
pub use crate::allocator::{Loaded, StoreError, StoreEvent, StoreOp, StoredIdentity, Tombstone};

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
