//! Writer tasks: they apply the core's store ops in batches, off the core's lock,
//! with a timeout, and report every outcome back. Allocation writes and GC writes
//! have a queue and a task each, so an allocation never waits behind deletes.

use std::{sync::Arc, time::Duration};

use tokio::{sync::mpsc, task::JoinHandle, time::Instant};
use tracing::{Instrument, debug, info_span, warn};

use crate::{
    metrics::QueueLabels,
    runtime::{Runtime, WriterQueues},
    store::{Store, StoreError, StoreOp},
};

/// Ops committed together at most.
const MAX_BATCH: usize = 512;

/// Starts the two writers. They stop when their queue is closed and drained.
pub fn spawn(
    queues: WriterQueues,
    store: Arc<dyn Store>,
    runtime: Arc<Runtime>,
    timeout: Duration,
) -> Vec<JoinHandle<()>> {
    vec![
        spawn_one(
            "allocation",
            queues.allocation,
            store.clone(),
            runtime.clone(),
            timeout,
        ),
        spawn_one("gc", queues.gc, store, runtime, timeout),
    ]
}

fn spawn_one(
    queue: &'static str,
    mut rx: mpsc::Receiver<StoreOp>,
    store: Arc<dyn Store>,
    runtime: Arc<Runtime>,
    timeout: Duration,
) -> JoinHandle<()> {
    let span = info_span!("writer", queue, store = store.kind());
    tokio::spawn(
        async move {
            let labels = QueueLabels { queue };
            let mut batch = Vec::with_capacity(MAX_BATCH);
            while rx.recv_many(&mut batch, MAX_BATCH).await > 0 {
                let ops = std::mem::replace(&mut batch, Vec::with_capacity(MAX_BATCH));
                let started = Instant::now();
                let count = ops.len();
                let results = match tokio::time::timeout(timeout, store.apply(ops.clone())).await {
                    Ok(results) if results.len() == count => results,
                    Ok(results) => {
                        warn!(
                            expected = count,
                            got = results.len(),
                            "store answered a batch with the wrong number of results"
                        );
                        unavailable(count, "bad_answer")
                    }
                    Err(_) => {
                        warn!(ops = count, ?timeout, "store batch timed out");
                        unavailable(count, "timeout")
                    }
                };
                runtime
                    .metrics
                    .store_batch_duration
                    .get_or_create(&labels)
                    .observe(started.elapsed().as_secs_f64());
                runtime
                    .metrics
                    .store_batch_ops
                    .get_or_create(&labels)
                    .inc_by(count as u64);
                for (op, result) in ops.iter().zip(&results) {
                    if let Err(e) = result {
                        debug!(op = op.kind(), cause = e.cause(), error = %e, "store op failed");
                    }
                }
                runtime.store_results(ops.into_iter().zip(results));
                // Shrink after a burst.
                if batch.capacity() > MAX_BATCH {
                    batch.shrink_to(MAX_BATCH);
                }
            }
        }
        .instrument(span),
    )
}

fn unavailable(n: usize, cause: &'static str) -> Vec<Result<(), StoreError>> {
    (0..n)
        .map(|_| {
            Err(StoreError::Unavailable {
                cause,
                detail: "the batch did not complete".into(),
            })
        })
        .collect()
}
