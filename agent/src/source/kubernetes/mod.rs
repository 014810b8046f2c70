//! The Kubernetes endpoint source: the pods of this node, from the API server.
//!
//! One `kube::runtime::watcher` on pods with the field selector
//! `spec.nodeName=<node>` and nothing else: the agent never lists or watches
//! another resource, nor another node's pods, so what it holds grows with its
//! node, not with the cluster. Pods on the host network, without an address yet,
//! or that have Succeeded or Failed are not endpoints. What it keeps of each
//! endpoint is its projection (`index.rs`): addresses, the labels the operator's
//! filter keeps, the service account and the host-side interface
//! ([`route`]), keyed by namespace/name.
//!
//! **Restarts.** A watch that simply ends (the API server's timeout) is resumed by
//! kube's watcher from its last resourceVersion. Every watcher error (the API
//! server down, a connection cut, a resume answered 410 after a compaction) is
//! reported as [`SourceEvent::Failed`] and, after a jittered backoff, the watch
//! starts over with a fresh list, whose `InitDone` becomes one `Reset`. kube's
//! watcher would resume after most errors by itself, but a resumed watch that
//! stays quiet cannot be told from one that is still failing, while a completed
//! list says the set is whole again: it is what turns `/readyz` back to synced. A
//! list of one node's pods is small and served from the API server's watch
//! cache. Until then the agent keeps its last set and its datapath (fail-static),
//! and `/readyz` says the source is not synced and why.
//!
//! **Labels.** The source keeps only the labels the operator's filter keeps (the
//! agent hands it the filter from every HelloReply, [`EndpointSource::label_filter`]).
//! When the filter changes the watch starts over, since labels the old filter
//! dropped are not in the projection.

mod index;
pub mod pod;
pub mod route;

use std::{fmt, pin::pin, sync::Arc, time::Duration};

use census_proto::{domain::NodeName, labels::LabelFilter};
use futures::StreamExt as _;
use kube::{
    Api, Client,
    runtime::watcher::{self, watcher},
};
use tokio::sync::{mpsc, watch};
use tracing::{Instrument as _, info, info_span, warn};

pub use index::CachedPods;
use index::PodIndex;
pub use pod::PodObject;
pub use route::{InterfaceLookup, RouteError, RouteLookup};

use super::{BoxFuture, EndpointSource, SourceEvent, SourceFailure};
use crate::{backoff::Backoff, shutdown::stopped};

/// Timing of the pod source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// How often every pod's host-side interface is looked up again.
    pub resync: Duration,
    /// First and longest wait before the watch starts over after an error.
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            resync: Duration::from_secs(10),
            initial_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(30),
        }
    }
}

/// The pod source; see the module documentation.
pub struct PodSource {
    client: Client,
    node: NodeName,
    lookup: Arc<dyn InterfaceLookup>,
    timing: Timing,
    filter: watch::Sender<LabelFilter>,
    cached: CachedPods,
}

impl fmt::Debug for PodSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PodSource")
            .field("node", &self.node)
            .field("timing", &self.timing)
            .finish_non_exhaustive()
    }
}

impl PodSource {
    /// The pods of `node`, with interfaces found by `lookup` ([`RouteLookup`] in
    /// production).
    pub fn new(
        client: Client,
        node: NodeName,
        lookup: Arc<dyn InterfaceLookup>,
        timing: Timing,
    ) -> Self {
        Self {
            client,
            node,
            lookup,
            timing,
            filter: watch::Sender::new(LabelFilter::default()),
            cached: CachedPods::default(),
        }
    }

    /// How many pods the source holds, for tests and measurements.
    pub fn cached_pods(&self) -> CachedPods {
        self.cached.clone()
    }

    async fn watch(self, events: mpsc::Sender<SourceEvent>, mut shutdown: watch::Receiver<bool>) {
        let Self {
            client,
            node,
            lookup,
            timing,
            filter,
            cached,
        } = self;
        let mut filter_changes = filter.subscribe();
        let mut index = PodIndex::new(
            node.to_string(),
            filter_changes.borrow_and_update().clone(),
            lookup,
            cached,
        );
        let api: Api<PodObject> = Api::all(client);
        let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
        let mut backoff = Backoff::new(timing.initial_backoff, timing.max_backoff);
        let mut resync = tokio::time::interval(timing.resync);
        resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing: Option<String> = None;
        loop {
            // A new watcher: a fresh list, then a watch from it. It is dropped
            // (its connection closed) before the backoff.
            let error = {
                let mut stream = pin!(watcher(api.clone(), config.clone()));
                loop {
                    tokio::select! {
                        item = stream.next() => match item {
                            Some(Ok(event)) => {
                                let listed = matches!(event, watcher::Event::InitDone);
                                if let Some(out) = index.on_event(event)
                                    && events.send(out).await.is_err()
                                {
                                    return;
                                }
                                if listed {
                                    backoff.reset();
                                    if failing.take().is_some() {
                                        info!(pods = index.len(), "synced again");
                                    } else {
                                        info!(pods = index.len(), "listed the pods of this node");
                                    }
                                }
                            }
                            Some(Err(error)) => break Some(error),
                            // The watcher never ends; if it did, start it again.
                            None => break None,
                        },
                        _ = resync.tick() => {
                            for out in index.refresh_interfaces() {
                                if events.send(out).await.is_err() {
                                    return;
                                }
                            }
                        }
                        Ok(()) = filter_changes.changed() => {
                            info!("the operator's label filter changed; listing the pods again");
                            index.set_filter(filter_changes.borrow_and_update().clone());
                            break None;
                        }
                        () = stopped(&mut shutdown) => return,
                    }
                }
            };
            let Some(error) = error else {
                continue;
            };
            let delay = backoff.next_delay();
            let failure = failure(&error);
            if failing.as_ref() != Some(&failure.detail) {
                warn!(error = %error, retry_in = ?delay, "watching pods failed; the last set stays in force");
                failing = Some(failure.detail.clone());
                if events.send(SourceEvent::Failed(failure)).await.is_err() {
                    return;
                }
            }
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = stopped(&mut shutdown) => return,
            }
        }
    }
}

/// What the agent reports while the watch is down.
fn failure(error: &watcher::Error) -> SourceFailure {
    let kind = match error {
        watcher::Error::InitialListFailed(_) => "list",
        watcher::Error::WatchStartFailed(_) | watcher::Error::WatchFailed(_) => "watch",
        watcher::Error::WatchError(status) if status.code == 410 => "expired",
        watcher::Error::WatchError(_) => "watch",
        watcher::Error::NoResourceVersion => "protocol",
    };
    SourceFailure {
        kind,
        detail: format!("not synced, starting over: {error}"),
    }
}

impl EndpointSource for PodSource {
    fn describe(&self) -> String {
        format!("kubernetes pods with spec.nodeName={}", self.node)
    }

    fn run(
        self: Box<Self>,
        events: mpsc::Sender<SourceEvent>,
        shutdown: watch::Receiver<bool>,
    ) -> BoxFuture {
        let span = info_span!("source", node = %self.node);
        Box::pin((*self).watch(events, shutdown).instrument(span))
    }

    fn label_filter(&self) -> Option<watch::Sender<LabelFilter>> {
        Some(self.filter.clone())
    }
}

#[cfg(test)]
mod tests;
