//! Leadership, term by term. A follower tries the Lease every retry period (once its
//! store has listed its objects). On winning it opens the store's fence until the
//! renew deadline, builds a core from the store's index of the Identity objects (kept
//! synced by its watch; `Allocator::new` with those identities; agents re-snapshot
//! when they reconnect) and starts the term's writers,
//! all while renewing. Each renewal moves the fence's deadline; a leader that cannot
//! renew before the deadline, or finds the Lease taken, stops writing (fence closed,
//! writers aborted) and becomes a follower again.

use std::{sync::Arc, time::Duration};

use tokio::{sync::watch, task::JoinHandle, time::Instant};
use tracing::{info, warn};

use super::{
    endpointslice::Publisher,
    lease::{Elector, Outcome},
    nodes::NodeIndex,
};
use crate::{
    allocator::{Allocator, Config},
    replica::{Fence, Leader},
    runtime::Runtime,
    store::{Loaded, kubernetes::KubeStore},
    writer,
};

/// How long a stepping-down leader lets its writers finish at shutdown.
const DRAIN: Duration = Duration::from_secs(5);
/// How long shutdown waits for the Lease release and the leader slice's update.
const GOODBYE: Duration = Duration::from_secs(3);

pub(super) struct Leadership {
    pub(super) runtime: Arc<Runtime>,
    pub(super) store: Arc<KubeStore>,
    /// The cluster's Nodes: a new core waits for each before it releases anything.
    pub(super) nodes: Arc<NodeIndex>,
    pub(super) fence: Arc<Fence>,
    pub(super) elector: Elector,
    /// This replica's address in the leader Service's EndpointSlice.
    pub(super) slice: Option<Publisher>,
    pub(super) cfg: Config,
    pub(super) store_timeout: Duration,
    pub(super) stop: watch::Receiver<bool>,
}

/// Why a term ended.
enum End {
    /// The renew deadline passed without a renewal.
    Deadline,
    /// Another replica holds the Lease.
    Taken(Option<Leader>),
    /// The operator is stopping.
    Stopping,
}

impl Leadership {
    pub(super) async fn run(mut self) {
        loop {
            let Some((deadline, previous)) = self.follow().await else {
                return;
            };
            if self.lead(deadline, previous).await {
                return;
            }
        }
    }

    fn retry_period(&self) -> Duration {
        self.elector.config().retry_period
    }

    /// Until this replica holds the Lease: `(renew deadline, previous holder)`, or
    /// `None` when stopping.
    async fn follow(&mut self) -> Option<(Instant, Option<String>)> {
        loop {
            if *self.stop.borrow() {
                return None;
            }
            if self.store.is_synced() {
                let started = Instant::now();
                let attempt = tokio::time::timeout(
                    self.elector.config().renew_deadline,
                    self.elector.try_acquire_or_renew(),
                )
                .await;
                match attempt {
                    Ok(Ok(Outcome::Leading { previous })) => {
                        return Some((started + self.elector.config().renew_deadline, previous));
                    }
                    Ok(Ok(Outcome::Following(leader))) => self.runtime.set_leader(leader),
                    // Another replica wrote it first (or someone edited it): read it
                    // again at the next try.
                    Ok(Ok(Outcome::Conflict)) => {}
                    Ok(Err(e)) => warn!(error = %e, "trying the Lease failed"),
                    Err(_) => warn!("trying the Lease timed out"),
                }
            }
            // Followers spread their tries within the retry period, and try again right
            // when the holder's Lease expires: a dead leader is replaced within the
            // lease duration plus one retry period.
            let jitter = rand::random_range(0.8..1.0);
            let mut next = Instant::now() + self.retry_period().mul_f64(jitter);
            if let Some(expiry) = self.elector.expires_at() {
                next = next.min(expiry);
            }
            tokio::select! {
                () = tokio::time::sleep_until(next) => {}
                _ = self.stop.changed() => {}
            }
        }
    }

    /// One term. Returns true when the operator is stopping.
    async fn lead(&mut self, mut deadline: Instant, previous: Option<String>) -> bool {
        self.fence.open_until(deadline);
        info!(lease = %self.elector.config().name, "this replica leads");
        if let Some(slice) = &self.slice {
            // Overwrites whatever a crashed predecessor left there.
            slice.set(true);
        }
        if let Some(previous) = previous {
            info!(%previous, "took the Lease over from another replica");
        }
        let store = self.store.clone();
        let retry = self.retry_period();
        // The core is built from the index the store's watch keeps synced (a replica
        // campaigns only once it is), not from a second full list.
        let load = async move {
            store.wait_synced().await;
            store.loaded_from_index()
        };
        let mut load = std::pin::pin!(load);
        let mut writers: Vec<JoinHandle<()>> = Vec::new();
        let mut loaded = false;
        let mut renew_at = Instant::now() + retry;
        // 409s on the Lease in a row: the first is retried at once, later ones each
        // retry period (client-go retries every retry period until the renew deadline).
        let mut conflicts = 0u32;
        let end = loop {
            tokio::select! {
                l = &mut load, if !loaded => {
                    loaded = true;
                    writers = self.promote(l);
                }
                () = tokio::time::sleep_until(renew_at.min(deadline)) => {
                    let started = Instant::now();
                    let left = deadline.saturating_duration_since(started);
                    match tokio::time::timeout(left, self.elector.try_acquire_or_renew()).await {
                        Ok(Ok(Outcome::Leading { .. })) => {
                            deadline = started + self.elector.config().renew_deadline;
                            self.fence.open_until(deadline);
                            conflicts = 0;
                        }
                        Ok(Ok(Outcome::Following(leader))) => break End::Taken(leader),
                        // The Lease changed between the read and the write (an edit, an
                        // annotation): not a reason to step down. The next round reads
                        // it again; only another holder found there, or the deadline,
                        // ends the term.
                        Ok(Ok(Outcome::Conflict)) => {
                            conflicts = conflicts.saturating_add(1);
                            info!(conflicts, "the Lease changed while renewing it; reading it again");
                        }
                        Ok(Err(e)) => warn!(error = %e, "renewing the Lease failed"),
                        Err(_) => warn!("renewing the Lease timed out"),
                    }
                    if Instant::now() >= deadline {
                        break End::Deadline;
                    }
                    renew_at = if conflicts == 1 {
                        Instant::now()
                    } else {
                        Instant::now() + retry
                    };
                }
                _ = self.stop.changed() => break End::Stopping,
            }
        };
        self.step_down(end, writers).await
    }

    /// Installs a core built from the store and starts the term's writers.
    fn promote(&self, loaded: Loaded) -> Vec<JoinHandle<()>> {
        let identities = loaded.identities.clone();
        info!(
            identities = loaded.identities.len(),
            tombstones = loaded.tombstones.len(),
            "building the core from the index of the Identity objects"
        );
        let mut alloc = Allocator::new(self.cfg.clone(), loaded, self.runtime.now());
        // Every Node is a node whose agent may be partitioned away, still using its
        // identities: the restart protection waits for each.
        if self.nodes.is_synced() {
            alloc.await_nodes(self.nodes.names(), self.runtime.now());
        } else {
            warn!(
                "the Nodes are not listed yet: the restart protection lasts the node TTL, \
                 not the stale-view limit of agents that do not report"
            );
        }
        let queues = self.runtime.lead(alloc);
        let writers = writer::spawn(
            queues,
            self.store.clone(),
            self.runtime.metrics.clone(),
            self.store_timeout,
        );
        // What changed between the list and now reached a follower's core (dropped):
        // tell this core. Duplicates of later events are harmless.
        let lost = self.store.lost_since_load(&identities);
        let invalid = self.store.invalid_objects();
        self.runtime.with(|alloc, now| {
            // Read under the core's lock, so a Node update the watch makes meanwhile
            // is either read here or applied to this core after.
            for (name, ips) in self.nodes.all_addresses() {
                alloc.set_node_addresses(&name, ips, now);
            }
            for (id, labels) in &lost {
                alloc.binding_lost(*id, labels, now);
            }
            for (id, found) in invalid {
                alloc.binding_invalid(id, found, now);
            }
        });
        let store = self.store.clone();
        tokio::spawn(async move { store.report_invalid().await });
        writers
    }

    async fn step_down(&mut self, end: End, writers: Vec<JoinHandle<()>>) -> bool {
        let stopping = matches!(end, End::Stopping);
        match &end {
            End::Deadline => warn!(
                "the Lease was not renewed before the renew deadline: this replica stops writing"
            ),
            End::Taken(leader) => {
                warn!(leader = ?leader, "another replica holds the Lease: this replica stops writing");
            }
            End::Stopping => info!("stopping: handing the Lease over"),
        }
        if stopping {
            // Let writes in flight finish while the fence is still open.
            self.runtime.follow(None);
            let drain = async {
                for w in writers {
                    let _ = w.await;
                }
            };
            if tokio::time::timeout(DRAIN, drain).await.is_err() {
                warn!("store writes still in flight when stepping down");
            }
            self.fence.close();
            match tokio::time::timeout(GOODBYE, self.elector.release()).await {
                Ok(Ok(())) => info!("released the Lease"),
                Ok(Err(e)) => warn!(error = %e, "could not release the Lease"),
                Err(_) => warn!("releasing the Lease timed out"),
            }
            if let Some(slice) = self.slice.take() {
                slice.clear(GOODBYE).await;
            }
            return true;
        }
        // The deadline may already have passed: nothing more may reach the API.
        self.fence.close();
        for w in &writers {
            w.abort();
        }
        for w in writers {
            let _ = w.await;
        }
        let leader = match end {
            End::Taken(leader) => leader,
            End::Deadline | End::Stopping => None,
        };
        self.runtime.follow(leader);
        if let Some(slice) = &self.slice {
            slice.set(false);
        }
        false
    }
}
