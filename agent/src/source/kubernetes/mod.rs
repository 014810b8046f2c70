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
//! **Lists come from the API server's watch cache.** Every list asks for
//! `resourceVersion=0` without a `limit`, which the API server answers from its
//! watch cache, in memory (k8s.io/apiserver `storage/cacher`
//! `shouldDelegateList`); a list without a resourceVersion, or with a `limit`
//! and any other version, is a read from etcd. This is the operator's list policy
//! too (`census_operator::watch`); kube's watcher lists so only with its page size
//! unset and `any_semantic()`, since kube's `ListParams` leaves `resourceVersion=0`
//! out of a list that has a limit. The list at "0" may be a little behind etcd;
//! the watch that follows from its resourceVersion catches up. The source keeps a
//! loop of its own rather than kube's watcher for what follows: resuming without
//! a list but on 410, a `Retry-After` honoured, and each distinct failure reported.
//!
//! **Watches resume; only 410 lists again.** The watch (bookmarks on, so its
//! resourceVersion keeps up on a quiet node) is resumed from the last
//! resourceVersion seen after it ends (the API server's timeout), after a cut
//! connection, after a failed resume (the API server down, 5xx, 429) and after
//! an error in the stream: the history in between is replayed, and nothing is
//! listed. Only a 410 Gone (the resourceVersion was compacted away) starts over
//! with a list, whose set replaces the projection as one `Reset`, forgetting
//! what was deleted meanwhile. Failed requests wait a jittered backoff; 429 and
//! 503 are first retried by kube's client, which honours `Retry-After`, and a
//! 429 whose Status names `retryAfterSeconds` waits at least that long here too.
//! While failing, the source reports [`SourceEvent::Failed`] once per distinct
//! problem, the agent keeps its last set and datapath (fail-static) and
//! `/readyz` says the source is not synced; the first event or bookmark of a
//! resumed watch proves it whole again, and the source sends the set it holds
//! as a `Reset` (no list), which turns `/readyz` back to synced.
//!
//! **Labels.** The agent hands the source the operator's label filter from every
//! HelloReply ([`EndpointSource::label_filter`]). The projection keeps every
//! label of this node's pods, so a new filter is applied to it at once (one
//! `Reset` if any endpoint changed) and asks the API server for nothing.

mod index;
pub mod pod;
pub mod route;

use std::{fmt, sync::Arc, time::Duration};

use census_proto::{domain::NodeName, labels::LabelFilter};
use futures::{StreamExt as _, stream::BoxStream};
use kube::{
    Api, Client,
    api::{ListParams, WatchEvent, WatchParams},
};
use tokio::sync::{mpsc, watch};
use tracing::{Instrument as _, debug, info, info_span, warn};

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

    async fn watch(self, events: mpsc::Sender<SourceEvent>, shutdown: watch::Receiver<bool>) {
        let Self {
            client,
            node,
            lookup,
            timing,
            filter,
            cached,
        } = self;
        let mut filter_changes = filter.subscribe();
        let index = PodIndex::new(
            node.to_string(),
            filter_changes.borrow_and_update().clone(),
            lookup,
            cached,
        );
        let selector = format!("spec.nodeName={node}");
        let mut resync = tokio::time::interval(timing.resync);
        resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut run = Run {
            api: Api::all(client),
            // resourceVersion=0 (NotOlderThan) and no limit: the watch cache.
            list: ListParams::default().fields(&selector).match_any(),
            watch: WatchParams::default().fields(&selector),
            index,
            events,
            shutdown,
            filter_changes,
            resync,
            backoff: Backoff::new(timing.initial_backoff, timing.max_backoff),
            failing: None,
        };
        let mut step = Step::List;
        loop {
            step = match step {
                Step::List => run.list().await,
                Step::Watch(version) => run.watch(version).await,
                Step::Stop => return,
            };
        }
    }
}

/// What the source does next.
enum Step {
    List,
    /// Watch from this resourceVersion.
    Watch(String),
    Stop,
}

/// The running source's state.
struct Run {
    api: Api<PodObject>,
    list: ListParams,
    watch: WatchParams,
    index: PodIndex,
    events: mpsc::Sender<SourceEvent>,
    shutdown: watch::Receiver<bool>,
    filter_changes: watch::Receiver<LabelFilter>,
    resync: tokio::time::Interval,
    backoff: Backoff,
    /// The failure last reported, until the source is whole again.
    failing: Option<String>,
}

impl Run {
    /// Lists the pods (from the watch cache); the set replaces the projection.
    async fn list(&mut self) -> Step {
        let listed = tokio::select! {
            listed = self.api.list(&self.list) => listed,
            () = stopped(&mut self.shutdown) => return Step::Stop,
        };
        let error = match listed {
            Ok(list) => match list.metadata.resource_version.filter(|v| !v.is_empty()) {
                Some(version) => {
                    let set = self.index.relisted(&list.items);
                    if !self.send(set).await {
                        return Step::Stop;
                    }
                    self.backoff.reset();
                    if self.failing.take().is_some() {
                        info!(pods = self.index.len(), "listed again; synced");
                    } else {
                        info!(pods = self.index.len(), "listed the pods of this node");
                    }
                    return Step::Watch(version);
                }
                None => Failure::new("protocol", "the pod list has no resourceVersion".into()),
            },
            Err(error) => Failure::from_error("list", &error),
        };
        let delay = self.delay(&error);
        if !self.fail(error, delay).await || !self.wait(delay).await {
            return Step::Stop;
        }
        Step::List
    }

    /// Watches from `version` until the watch ends; resumes, or lists on 410.
    async fn watch(&mut self, mut version: String) -> Step {
        let opened = tokio::select! {
            opened = self.api.watch(&self.watch, &version) => opened,
            () = stopped(&mut self.shutdown) => return Step::Stop,
        };
        let mut stream: BoxStream<'static, kube::Result<WatchEvent<PodObject>>> = match opened {
            Ok(stream) => stream.boxed(),
            Err(kube::Error::Api(status)) if status.code == 410 => {
                return self.expired(&status.message).await;
            }
            Err(error) => {
                let failure = Failure::from_error("watch", &error);
                let delay = self.delay(&failure);
                if !self.fail(failure, delay).await || !self.wait(delay).await {
                    return Step::Stop;
                }
                return Step::Watch(version);
            }
        };
        let mut delivered = false;
        loop {
            tokio::select! {
                item = stream.next() => {
                    let event = match item {
                        Some(Ok(WatchEvent::Added(pod) | WatchEvent::Modified(pod))) => {
                            version_of(&pod, &mut version);
                            self.index.apply(&pod)
                        }
                        Some(Ok(WatchEvent::Deleted(pod))) => {
                            version_of(&pod, &mut version);
                            self.index.delete(&pod)
                        }
                        Some(Ok(WatchEvent::Bookmark(bookmark))) => {
                            if !bookmark.metadata.resource_version.is_empty() {
                                version = bookmark.metadata.resource_version;
                            }
                            None
                        }
                        Some(Ok(WatchEvent::Error(status))) if status.code == 410 => {
                            return self.expired(&status.message).await;
                        }
                        Some(Ok(WatchEvent::Error(status))) => {
                            let failure = Failure::new(
                                "watch",
                                format!("the watch failed: {} ({})", status.message, status.code),
                            );
                            let delay = self.backoff.next_delay();
                            if !self.fail(failure, delay).await || !self.wait(delay).await {
                                return Step::Stop;
                            }
                            return Step::Watch(version);
                        }
                        Some(Err(error)) => {
                            // A cut connection or a chunk that is not JSON: resume.
                            debug!(%error, "the pod watch broke off; resuming");
                            let delay = self.backoff.next_delay();
                            if !self.wait(delay).await {
                                return Step::Stop;
                            }
                            return Step::Watch(version);
                        }
                        None => {
                            // The API server's timeout, or a closed connection.
                            // One that ends before saying anything waits first.
                            if !delivered {
                                let delay = self.backoff.next_delay();
                                if !self.wait(delay).await {
                                    return Step::Stop;
                                }
                            }
                            return Step::Watch(version);
                        }
                    };
                    if !delivered {
                        delivered = true;
                        if !self.whole_again().await {
                            return Step::Stop;
                        }
                    }
                    if let Some(event) = event && !self.send(event).await {
                        return Step::Stop;
                    }
                }
                work = self.other_work() => if !self.finish(work).await {
                    return Step::Stop;
                },
            }
        }
    }

    /// 410 Gone: the resourceVersion is compacted; only a list can say what is
    /// gone since.
    async fn expired(&mut self, message: &str) -> Step {
        let failure = Failure::new(
            "expired",
            format!("the watch's resourceVersion expired (410: {message}); listing again"),
        );
        if !self.fail(failure, Duration::ZERO).await {
            return Step::Stop;
        }
        Step::List
    }

    /// A resumed watch delivered: the set is whole again.
    async fn whole_again(&mut self) -> bool {
        self.backoff.reset();
        if self.failing.take().is_none() {
            return true;
        }
        info!(
            pods = self.index.len(),
            "watching again from the last resourceVersion; synced"
        );
        let set = self.index.set();
        self.send(set).await
    }

    /// Reports a failure once per distinct problem.
    async fn fail(&mut self, failure: Failure, retry_in: Duration) -> bool {
        if self.failing.as_deref() == Some(failure.detail.as_str()) {
            return true;
        }
        warn!(error = %failure.detail, ?retry_in, "watching pods failed; the last set stays in force");
        self.failing = Some(failure.detail.clone());
        self.send(SourceEvent::Failed(SourceFailure {
            kind: failure.kind,
            detail: format!("not synced: {}", failure.detail),
        }))
        .await
    }

    /// The backoff's next delay, or the server's `retryAfterSeconds` if longer.
    fn delay(&mut self, failure: &Failure) -> Duration {
        self.backoff.next_delay().max(failure.retry_after)
    }

    /// Waits `delay`, doing the other work meanwhile; false on shutdown.
    async fn wait(&mut self, delay: Duration) -> bool {
        let sleep = tokio::time::sleep(delay);
        tokio::pin!(sleep);
        loop {
            tokio::select! {
                () = &mut sleep => return true,
                work = self.other_work() => if !self.finish(work).await {
                    return false;
                },
            }
        }
    }

    /// Waits for one of: the periodic interface lookup, a new label filter,
    /// shutdown. Cancel-safe (nothing is sent here: [`Run::finish`] sends).
    async fn other_work(&mut self) -> Work {
        tokio::select! {
            _ = self.resync.tick() => Work::Send(self.index.refresh_interfaces()),
            Ok(()) = self.filter_changes.changed() => {
                let filter = self.filter_changes.borrow_and_update().clone();
                info!("the operator's label filter changed; applying it to the pods held");
                Work::Send(self.index.set_filter(filter).into_iter().collect())
            }
            () = stopped(&mut self.shutdown) => Work::Stop,
        }
    }

    /// Sends what the other work produced; false when the source must stop.
    async fn finish(&mut self, work: Work) -> bool {
        let Work::Send(events) = work else {
            return false;
        };
        for event in events {
            if !self.send(event).await {
                return false;
            }
        }
        true
    }

    async fn send(&self, event: SourceEvent) -> bool {
        self.events.send(event).await.is_ok()
    }
}

/// What [`Run::other_work`] found to do.
enum Work {
    Send(Vec<SourceEvent>),
    Stop,
}

/// Moves `version` on to a pod's resourceVersion from the watch.
fn version_of(pod: &PodObject, version: &mut String) {
    use kube::Resource as _;
    if let Some(v) = pod
        .meta()
        .resource_version
        .as_deref()
        .filter(|v| !v.is_empty())
    {
        v.clone_into(version);
    }
}

/// A failure of the list or the watch, for the agent and the logs.
struct Failure {
    kind: &'static str,
    detail: String,
    /// At least this long before the next try (a 429's `retryAfterSeconds`).
    retry_after: Duration,
}

impl Failure {
    fn new(kind: &'static str, detail: String) -> Self {
        Self {
            kind,
            detail,
            retry_after: Duration::ZERO,
        }
    }

    fn from_error(what: &'static str, error: &kube::Error) -> Self {
        let (kind, retry_after) = match error {
            kube::Error::Api(status) if status.code == 429 => (
                "throttled",
                status.details.as_ref().map_or(0, |d| d.retry_after_seconds),
            ),
            _ => (what, 0),
        };
        Self {
            kind,
            detail: format!("the {what} failed: {error}"),
            retry_after: Duration::from_secs(retry_after.into()),
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
}

#[cfg(test)]
mod tests;
