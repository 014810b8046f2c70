//! What comes back from the store: the writers' outcomes (over a channel per term)
//! and changes the store saw that census did not make.

use std::sync::{Arc, Weak};

use tokio::sync::mpsc;

use super::{Inner, Runtime, Writers, term};
use crate::{
    api::Term,
    store::{StoreError, StoreEvent, StoreOp},
    writer::{WriterQueues, Written},
};

/// Capacity of each writer queue. The core bounds what is in flight (one op per
/// identity, a capped number of deletes), so a full queue means a stuck store.
const WRITER_QUEUE: usize = 65_536;
/// Batches of outcomes on their way back to the core; a writer waits when it is full.
const WRITTEN_QUEUE: usize = 64;

impl Runtime {
    /// New writer queues for the current term, and a task that takes their outcomes
    /// to the core while the term lasts.
    pub(super) fn writer_queues(self: &Arc<Self>, inner: &mut Inner) -> WriterQueues {
        let (alloc_tx, alloc_rx) = mpsc::channel(WRITER_QUEUE);
        let (gc_tx, gc_rx) = mpsc::channel(WRITER_QUEUE);
        let (written_tx, written_rx) = mpsc::channel(WRITTEN_QUEUE);
        inner.writers = Some(Writers {
            allocation: alloc_tx,
            gc: gc_tx,
        });
        tokio::spawn(take_written(Arc::downgrade(self), inner.term, written_rx));
        WriterQueues {
            allocation: alloc_rx,
            gc: gc_rx,
            written: written_tx,
        }
    }

    /// The writers' outcomes of `term`. Those of a term that is over (the replica
    /// stepped down, or stepped down and up again) are dropped: a follower has no
    /// writes in flight, and a new core never hears of an old core's writes.
    pub(super) fn store_results(
        &self,
        term: Term,
        results: impl IntoIterator<Item = (StoreOp, Result<(), StoreError>)>,
    ) {
        let mut inner = self.inner.lock();
        if term::current(&inner, term).is_err() {
            return;
        }
        let now = self.clock.now();
        for (op, result) in results {
            inner.alloc.store_result(op, result, now);
        }
        self.dispatch(&mut inner, now);
    }

    /// A change the store reported; it reaches the core only while this replica leads.
    /// Returns whether it was applied.
    pub fn store_event(&self, event: StoreEvent) -> bool {
        let mut inner = self.inner.lock();
        if !inner.role.is_leader() {
            return false;
        }
        let now = self.clock.now();
        match event {
            StoreEvent::BindingLost { id, labels } => inner.alloc.binding_lost(id, &labels, now),
            StoreEvent::BindingInvalid { id, found } => {
                inner.alloc.binding_invalid(id, found, now);
            }
            StoreEvent::BindingFound { id, labels } => inner.alloc.binding_found(id, &labels),
            StoreEvent::TombstoneLost { tombstone, labels } => {
                inner.alloc.tombstone_lost(tombstone, labels.as_ref(), now);
            }
        }
        self.dispatch(&mut inner, now);
        true
    }
}

/// Takes a term's outcomes to the core until its writers stop (or the runtime is gone).
async fn take_written(runtime: Weak<Runtime>, term: Term, mut rx: mpsc::Receiver<Written>) {
    while let Some(written) = rx.recv().await {
        let Some(runtime) = runtime.upgrade() else {
            return;
        };
        runtime.store_results(term, written);
    }
}

/// Feeds a store's [`StoreEvent`]s to the core (while this replica leads) until the
/// store stops sending.
pub async fn feed_store_events(runtime: Arc<Runtime>, mut events: mpsc::Receiver<StoreEvent>) {
    while let Some(event) = events.recv().await {
        runtime.store_event(event);
    }
}
