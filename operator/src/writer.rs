//! Writer tasks: they apply the core's store ops in batches, off the core's lock,
//! with a timeout, and send every outcome back on a channel (the runtime feeds them
//! to the core). Allocation writes and GC writes have a queue and a task each, so an
//! allocation never waits behind deletes.

use std::{sync::Arc, time::Duration};

use tokio::{sync::mpsc, task::JoinHandle, time::Instant};
use tracing::{Instrument, debug, info_span, warn};

use crate::{
    metrics::{Metrics, QueueLabels},
    store::{Store, StoreError, StoreOp},
};

/// Ops committed together at most.
const MAX_BATCH: usize = 512;

/// One batch's outcomes, one per op, in the order of the ops.
pub type Written = Vec<(StoreOp, Result<(), StoreError>)>;

/// What the two writers read, and where they send what they wrote.
#[derive(Debug)]
pub struct WriterQueues {
    pub allocation: mpsc::Receiver<StoreOp>,
    pub gc: mpsc::Receiver<StoreOp>,
    pub written: mpsc::Sender<Written>,
}

/// Starts the two writers. Each stops when its queue is closed and drained, or when
/// nobody takes its outcomes any more.
pub fn spawn(
    queues: WriterQueues,
    store: Arc<dyn Store>,
    metrics: Metrics,
    timeout: Duration,
) -> Vec<JoinHandle<()>> {
    let WriterQueues {
        allocation,
        gc,
        written,
    } = queues;
    let writer = |queue| Writer {
        queue,
        store: store.clone(),
        written: written.clone(),
        metrics: metrics.clone(),
        timeout,
    };
    vec![
        writer("allocation").spawn(allocation),
        writer("gc").spawn(gc),
    ]
}

struct Writer {
    queue: &'static str,
    store: Arc<dyn Store>,
    written: mpsc::Sender<Written>,
    metrics: Metrics,
    timeout: Duration,
}

impl Writer {
    fn spawn(self, rx: mpsc::Receiver<StoreOp>) -> JoinHandle<()> {
        let span = info_span!("writer", queue = self.queue, store = self.store.kind());
        tokio::spawn(self.run(rx).instrument(span))
    }

    async fn run(self, mut rx: mpsc::Receiver<StoreOp>) {
        let labels = QueueLabels { queue: self.queue };
        let mut batch = Vec::with_capacity(MAX_BATCH);
        while rx.recv_many(&mut batch, MAX_BATCH).await > 0 {
            let ops = std::mem::replace(&mut batch, Vec::with_capacity(MAX_BATCH));
            let started = Instant::now();
            let count = ops.len();
            let timeout = self.timeout;
            let results = match tokio::time::timeout(timeout, self.store.apply(ops.clone())).await {
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
            self.metrics
                .store_batch_duration
                .get_or_create(&labels)
                .observe(started.elapsed().as_secs_f64());
            self.metrics
                .store_batch_ops
                .get_or_create(&labels)
                .inc_by(count as u64);
            for (op, result) in ops.iter().zip(&results) {
                if let Err(e) = result {
                    debug!(op = op.kind(), cause = e.cause(), error = %e, "store op failed");
                }
            }
            if self
                .written
                .send(ops.into_iter().zip(results).collect())
                .await
                .is_err()
            {
                debug!("nobody takes the outcomes any more: stopping");
                return;
            }
            // Shrink after a burst.
            if batch.capacity() > MAX_BATCH {
                batch.shrink_to(MAX_BATCH);
            }
        }
    }
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
