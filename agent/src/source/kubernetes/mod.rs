//! The Kubernetes endpoint source: the pods of this node, from the API server.
//!
//! One list and watch of pods with the field selector `spec.nodeName=<node>` and
//! nothing else: the agent never lists or watches another resource, nor another
//! node's pods, so what it holds grows with its node, not with the cluster. Pods
//! on the host network, without an address yet, or that have Succeeded or Failed
//! are not endpoints; a Terminating pod (`deletionTimestamp` set) still is, until
//! it is gone (`pod.rs`). What it keeps of each endpoint is its projection
//! (`index.rs`): addresses, labels, the service account and the host-side
//! interface ([`route`]), keyed by namespace/name.
//!
//! **Lists and watches** go through census-daemon's watch driver
//! (`census_daemon::watch`), which the operator's watches use too: every list asks
//! for `resourceVersion=0` without a `limit`, which the API server answers from
//! its watch cache; the watch (bookmarks on) resumes from the last resourceVersion
//! after it ends, a cut connection, a failed resume (the API server down, 5xx,
//! 429) or an error in the stream, and only a 410 Gone lists again, whose set
//! replaces the projection as one `Reset`, forgetting what was deleted meanwhile.
//! Failed requests wait a jittered backoff ([`Timing`]); 429 and 503 are first
//! retried by kube's client, which honours `Retry-After`, and a 429 whose Status
//! names `retryAfterSeconds` waits at least that long in the driver too. While
//! failing, the source reports [`SourceEvent::Failed`] once per distinct problem,
//! the agent keeps its last set and datapath (fail-static) and `/readyz` says the
//! source is not synced; the first event or bookmark of a resumed watch proves it
//! whole again, and the source sends the set it holds as a `Reset` (no list),
//! which turns `/readyz` back to synced. The periodic interface lookup and a new
//! label filter are the source's own work, which the driver does between the
//! watch's events and while it waits.
//!
//! **Labels.** The agent hands the source the operator's label filter from every
//! HelloReply ([`EndpointSource::label_filter`]). The projection keeps every
//! label of this node's pods, so a new filter is applied to it at once (one
//! `Reset` if any endpoint changed) and asks the API server for nothing.

mod index;
pub mod pod;
pub mod route;

use std::{fmt, sync::Arc, time::Duration};

use census_daemon::watch::{self as driver, Failure, Watched};
use census_proto::{domain::NodeName, labels::LabelFilter};
use kube::{Api, Client};
use tokio::sync::{mpsc, watch};
use tracing::{Instrument as _, info, info_span, warn};

pub use index::CachedPods;
use index::PodIndex;
pub use pod::PodObject;
pub use route::{InterfaceLookup, RouteError, RouteLookup};

use super::{BoxFuture, EndpointSource, SourceEvent, SourceFailure};
use crate::shutdown::stopped;

/// Timing of the pod source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// How often every pod's host-side interface is looked up again.
    pub resync: Duration,
    /// First and longest wait before a failed list or watch is tried again.
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
    /// The node's link and route changes, if the agent watches them.
    links: Option<watch::Receiver<u64>>,
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
            links: None,
        }
    }

    /// How many pods the source holds, for tests and measurements.
    pub fn cached_pods(&self) -> CachedPods {
        self.cached.clone()
    }

    /// Watches the pods until shutdown, or until the agent stops listening.
    async fn watch(self, events: mpsc::Sender<SourceEvent>, mut shutdown: watch::Receiver<bool>) {
        let Self {
            client,
            node,
            lookup,
            timing,
            filter,
            cached,
            links,
        } = self;
        let mut filter_changes = filter.subscribe();
        let index = PodIndex::new(
            node.to_string(),
            filter_changes.borrow_and_update().clone(),
            lookup,
            cached,
        );
        // The first lookup again one period after the start: the list looks up all.
        let first = tokio::time::Instant::now() + timing.resync;
        let mut resync = tokio::time::interval_at(first, timing.resync);
        resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let config = driver::Config {
            fields: Some(format!("spec.nodeName={node}")),
            initial_backoff: timing.initial_backoff,
            max_backoff: timing.max_backoff,
        };
        let agent = events.clone();
        let pods = Pods {
            index,
            events,
            filter_changes,
            resync,
            links,
            listing: Vec::new(),
            due: None,
            failing: false,
        };
        tokio::select! {
            () = driver::drive(Api::all(client), &config, pods) => {}
            () = stopped(&mut shutdown) => {}
            () = agent.closed() => {}
        }
    }
}

/// The watched pods: the projection, and what the source tells the agent.
struct Pods {
    index: PodIndex,
    events: mpsc::Sender<SourceEvent>,
    filter_changes: watch::Receiver<LabelFilter>,
    resync: tokio::time::Interval,
    links: Option<watch::Receiver<u64>>,
    /// The pods of a list, until it ends.
    listing: Vec<PodObject>,
    /// The work [`Watched::work_due`] found.
    due: Option<Work>,
    /// A failure was reported and the set is not known to be whole since.
    failing: bool,
}

/// The source's own work, besides the watch.
#[derive(Debug, Clone, Copy)]
enum Work {
    /// Look every pod's host-side interface up again.
    Resync,
    /// A link or route of the node changed: look up the pods still without an
    /// interface.
    Links,
    /// Apply the operator's new label filter.
    Filter,
}

impl Pods {
    /// Tells the agent; a closed channel ends the source (`PodSource::watch`).
    async fn send(&self, event: SourceEvent) {
        let _ = self.events.send(event).await;
    }
}

impl Watched<PodObject> for Pods {
    const WHAT: &'static str = "pods";

    fn relist(&mut self) {
        self.listing.clear();
    }

    fn list(&mut self, pod: PodObject) {
        self.listing.push(pod);
    }

    async fn listed(&mut self) {
        let listed = std::mem::take(&mut self.listing);
        let set = self.index.relisted(&listed);
        drop(listed);
        self.send(set).await;
        if std::mem::take(&mut self.failing) {
            info!(pods = self.index.len(), "listed again; synced");
        } else {
            info!(pods = self.index.len(), "listed the pods of this node");
        }
    }

    async fn apply(&mut self, pod: PodObject) {
        if let Some(event) = self.index.apply(&pod) {
            self.send(event).await;
        }
    }

    async fn delete(&mut self, pod: PodObject) {
        if let Some(event) = self.index.delete(&pod) {
            self.send(event).await;
        }
    }

    async fn failed(&mut self, failure: &Failure, retry_in: Duration) -> bool {
        warn!(error = %failure.detail, ?retry_in, "watching pods failed; the last set stays in force");
        self.failing = true;
        self.send(SourceEvent::Failed(SourceFailure {
            kind: failure.kind,
            detail: format!("not synced: {}", failure.detail),
        }))
        .await;
        true
    }

    async fn resumed(&mut self) {
        self.failing = false;
        info!(
            pods = self.index.len(),
            "watching again from the last resourceVersion; synced"
        );
        let set = self.index.set();
        self.send(set).await;
    }

    async fn work_due(&mut self) {
        tokio::select! {
            _ = self.resync.tick() => self.due = Some(Work::Resync),
            Ok(()) = self.filter_changes.changed() => self.due = Some(Work::Filter),
            Ok(()) = link_changed(self.links.as_mut()) => self.due = Some(Work::Links),
        }
    }

    async fn work(&mut self) {
        let events = match self.due.take() {
            Some(Work::Resync) => self.index.refresh_interfaces(),
            Some(Work::Links) => {
                if let Some(links) = &mut self.links {
                    links.borrow_and_update();
                }
                self.index.find_missing_interfaces()
            }
            Some(Work::Filter) => {
                let filter = self.filter_changes.borrow_and_update().clone();
                info!("the operator's label filter changed; applying it to the pods held");
                self.index.set_filter(filter).into_iter().collect()
            }
            None => Vec::new(),
        };
        for event in events {
            self.send(event).await;
        }
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

    fn watch_routes(&mut self, routes: watch::Receiver<u64>) {
        self.links = Some(routes);
    }
}

/// The next link or route change, if they are watched; never otherwise.
async fn link_changed(
    links: Option<&mut watch::Receiver<u64>>,
) -> Result<(), watch::error::RecvError> {
    match links {
        Some(links) => links.changed().await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests;
