//! How both daemons watch a kind of Kubernetes object: one list policy, and one
//! driver that lists, watches and hands what it learns to a [`Watched`].
//!
//! A list becomes one reset of what the watched keeps ([`Watched::relist`], each
//! object to [`Watched::list`], then [`Watched::listed`]), which forgets what
//! disappeared while the watch was down; then each change ([`Watched::apply`],
//! [`Watched::delete`]).
//!
//! **The list policy.** Every list asks for `resourceVersion=0`
//! (`resourceVersionMatch=NotOlderThan`) without a `limit`, which the API server
//! answers from its watch cache, in memory (k8s.io/apiserver `storage/cacher`
//! `shouldDelegateList`); a list without a resourceVersion, or with a `limit` and
//! any other version, is a read from etcd (kube's `ListParams` leaves
//! `resourceVersion=0` out of a list that has a limit). The list at "0" may be a
//! little behind etcd; the watch from its resourceVersion catches up. The operator's
//! Identity store's full load at a leader's start is the one read from etcd, in
//! pages of [`PAGE`].
//!
//! **Watches resume; only 410 lists again.** The watch (bookmarks on, so its
//! resourceVersion keeps up when nothing changes) is resumed from the last
//! resourceVersion seen after it ends (the API server's timeout), after a cut
//! connection, after a failed resume (the API server down, 5xx, 429) and after an
//! error in the stream: the history in between is replayed, and nothing is listed.
//! Only a 410 Gone (the resourceVersion was compacted away) lists again. Failed
//! requests wait a jittered backoff; a 429 whose Status names `retryAfterSeconds`
//! waits at least that long (a client with kube's retries on has already retried a
//! 429 or 503 after its `Retry-After`). Each distinct failure goes to
//! [`Watched::failed`] once; after one, the first event or bookmark of a resumed
//! watch proves that nothing was missed ([`Watched::resumed`]).
//!
//! **Why not kube-runtime's watcher.** kube-runtime 5's `watcher` resumes in the
//! same cases, but says nothing of a resumed watch until an object changes: a
//! bookmark and a watch that opened again only move its private state on
//! (`watcher.rs`, `step_trampolined`: `WatchEvent::Bookmark` and
//! `State::InitListed`'s `Ok(stream)` yield no event), and its `InitDone` carries no
//! resourceVersion to resume from. The agent on a quiet node could then not say
//! it is synced again after an outage.

use std::{fmt::Debug, future::Future, time::Duration};

use futures::{StreamExt as _, stream::BoxStream};
use kube::{
    Api, Resource,
    api::{ListParams, WatchEvent, WatchParams},
    core::Status,
};
use serde::de::DeserializeOwned;
use tracing::{debug, warn};

use crate::backoff::Backoff;

/// Objects per page of a list read from etcd.
pub const PAGE: u32 = 500;

/// What to watch, and how long to wait after failures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// A field selector (`spec.nodeName=n1`), or every object.
    pub fields: Option<String>,
    /// First and longest wait before a failed list or watch is tried again.
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            fields: None,
            initial_backoff: Duration::from_millis(800),
            max_backoff: Duration::from_secs(30),
        }
    }
}

impl Config {
    /// The list policy: see the module.
    pub fn list_params(&self) -> ListParams {
        let params = ListParams::default().match_any();
        match &self.fields {
            Some(fields) => params.fields(fields),
            None => params,
        }
    }

    fn watch_params(&self) -> WatchParams {
        let params = WatchParams::default();
        match &self.fields {
            Some(fields) => params.fields(fields),
            None => params,
        }
    }
}

/// What a watch feeds.
pub trait Watched<K>: Send {
    /// The resource, for logs: `Nodes`, `Services`.
    const WHAT: &'static str;

    /// A list begins: its objects come to [`Self::list`], then [`Self::listed`].
    fn relist(&mut self);

    /// One object of a list, kept until it ends.
    fn list(&mut self, object: K);

    /// The list ended: what it held replaces what was known.
    fn listed(&mut self) -> impl Future<Output = ()> + Send;

    /// An object added or changed.
    fn apply(&mut self, object: K) -> impl Future<Output = ()> + Send;

    /// An object deleted.
    fn delete(&mut self, object: K) -> impl Future<Output = ()> + Send;

    /// The list or watch failed, and is tried again in `retry_in`; said once per
    /// distinct failure until a list or a resumed watch works. `true` when this
    /// said so itself; otherwise the driver logs a warning.
    fn failed(
        &mut self,
        failure: &Failure,
        retry_in: Duration,
    ) -> impl Future<Output = bool> + Send {
        let _ = (failure, retry_in);
        async { false }
    }

    /// After a failure, a resumed watch gave its first event or bookmark: what
    /// the watched holds is whole again (that event comes next).
    fn resumed(&mut self) -> impl Future<Output = ()> + Send {
        async {}
    }

    /// Waits until the watched has work of its own, besides the watch (the
    /// agent's interface lookups). Cancel-safe: the driver drops it whenever the
    /// watch has something first.
    fn work_due(&mut self) -> impl Future<Output = ()> + Send {
        std::future::pending()
    }

    /// Does the work [`Self::work_due`] found.
    fn work(&mut self) -> impl Future<Output = ()> + Send {
        async {}
    }
}

/// A failed list or watch, for the watched and the logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// What failed: `list`, `watch`, `throttled` (429), `expired` (410),
    /// `protocol`.
    pub kind: &'static str,
    /// What happened, for people.
    pub detail: String,
    /// The API server's status code and reason (`Expired`, `TooManyRequests`), if
    /// it answered with a Status.
    pub code: Option<u16>,
    pub reason: Option<String>,
    /// At least this long before the next try (a 429's `retryAfterSeconds`).
    retry_after: Duration,
}

impl Failure {
    fn new(kind: &'static str, detail: String, status: Option<&Status>) -> Self {
        Self {
            kind,
            detail,
            code: status.map(|s| s.code),
            reason: status.map(|s| s.reason.clone()),
            retry_after: Duration::ZERO,
        }
    }

    fn from_error(what: &'static str, error: &kube::Error) -> Self {
        let status = match error {
            kube::Error::Api(status) => Some(&**status),
            _ => None,
        };
        let (kind, retry_after) = match status {
            Some(status) if status.code == 429 => (
                "throttled",
                status.details.as_ref().map_or(0, |d| d.retry_after_seconds),
            ),
            _ => (what, 0),
        };
        Self {
            retry_after: Duration::from_secs(retry_after.into()),
            ..Self::new(kind, format!("the {what} failed: {error}"), status)
        }
    }
}

/// Lists and watches `api`, with the selector of `config`, into `watched` until
/// the task is dropped.
pub async fn drive<K, W>(api: Api<K>, config: &Config, watched: W)
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    W: Watched<K>,
{
    let mut run = Run {
        api,
        list: config.list_params(),
        watch: config.watch_params(),
        backoff: Backoff::new(config.initial_backoff, config.max_backoff),
        failing: None,
        watched,
    };
    let mut step = Step::List;
    loop {
        step = match step {
            Step::List => run.list().await,
            Step::Watch(version) => run.watch(version).await,
        };
    }
}

/// What the driver does next.
enum Step {
    List,
    /// Watch from this resourceVersion.
    Watch(String),
}

/// A running watch's state.
struct Run<K, W> {
    api: Api<K>,
    list: ListParams,
    watch: WatchParams,
    backoff: Backoff,
    /// The failure last reported, until a list or a resumed watch works.
    failing: Option<String>,
    watched: W,
}

impl<K, W> Run<K, W>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    W: Watched<K>,
{
    /// Lists the objects (from the watch cache); they replace what was known.
    async fn list(&mut self) -> Step {
        let failure = match self.api.list(&self.list).await {
            Ok(list) => match list.metadata.resource_version.filter(|v| !v.is_empty()) {
                Some(version) => {
                    self.watched.relist();
                    for object in list.items {
                        self.watched.list(object);
                    }
                    self.watched.listed().await;
                    self.backoff.reset();
                    self.failing = None;
                    return Step::Watch(version);
                }
                None => Failure::new(
                    "protocol",
                    format!("the list of {} has no resourceVersion", W::WHAT),
                    None,
                ),
            },
            Err(error) => Failure::from_error("list", &error),
        };
        let delay = self.delay(&failure);
        self.fail(failure, delay).await;
        self.wait(delay).await;
        Step::List
    }

    /// Watches from `version` until the watch ends; resumes, or lists on 410.
    async fn watch(&mut self, mut version: String) -> Step {
        let mut stream: BoxStream<'static, kube::Result<WatchEvent<K>>> =
            match self.api.watch(&self.watch, &version).await {
                Ok(stream) => stream.boxed(),
                Err(kube::Error::Api(status)) if status.code == 410 => {
                    return self.expired(&status).await;
                }
                Err(error) => {
                    let failure = Failure::from_error("watch", &error);
                    let delay = self.delay(&failure);
                    self.fail(failure, delay).await;
                    self.wait(delay).await;
                    return Step::Watch(version);
                }
            };
        let mut delivered = false;
        loop {
            tokio::select! {
                item = stream.next() => {
                    let change = match item {
                        Some(Ok(WatchEvent::Added(object) | WatchEvent::Modified(object))) => {
                            version_of(&object, &mut version);
                            Some(Change::Apply(object))
                        }
                        Some(Ok(WatchEvent::Deleted(object))) => {
                            version_of(&object, &mut version);
                            Some(Change::Delete(object))
                        }
                        Some(Ok(WatchEvent::Bookmark(bookmark))) => {
                            if !bookmark.metadata.resource_version.is_empty() {
                                version = bookmark.metadata.resource_version;
                            }
                            None
                        }
                        Some(Ok(WatchEvent::Error(status))) if status.code == 410 => {
                            return self.expired(&status).await;
                        }
                        Some(Ok(WatchEvent::Error(status))) => {
                            let failure = Failure::new(
                                "watch",
                                format!("the watch failed: {} ({})", status.message, status.code),
                                Some(&status),
                            );
                            let delay = self.backoff.next_delay();
                            self.fail(failure, delay).await;
                            self.wait(delay).await;
                            return Step::Watch(version);
                        }
                        Some(Err(error)) => {
                            // A cut connection or a chunk that is not JSON: resume.
                            debug!(%error, "the watch of {} broke off; resuming", W::WHAT);
                            let delay = self.backoff.next_delay();
                            self.wait(delay).await;
                            return Step::Watch(version);
                        }
                        None => {
                            // The API server's timeout, or a closed connection.
                            // One that ends before saying anything waits first.
                            if !delivered {
                                let delay = self.backoff.next_delay();
                                self.wait(delay).await;
                            }
                            return Step::Watch(version);
                        }
                    };
                    if !delivered {
                        delivered = true;
                        self.backoff.reset();
                        if self.failing.take().is_some() {
                            self.watched.resumed().await;
                        }
                    }
                    match change {
                        Some(Change::Apply(object)) => self.watched.apply(object).await,
                        Some(Change::Delete(object)) => self.watched.delete(object).await,
                        None => {}
                    }
                }
                () = self.watched.work_due() => self.watched.work().await,
            }
        }
    }

    /// 410 Gone: the resourceVersion is compacted; only a list can say what is
    /// gone since.
    async fn expired(&mut self, status: &Status) -> Step {
        let failure = Failure::new(
            "expired",
            format!(
                "the watch's resourceVersion expired (410: {}); listing again",
                status.message
            ),
            Some(status),
        );
        self.fail(failure, Duration::ZERO).await;
        Step::List
    }

    /// Reports a failure once per distinct problem.
    async fn fail(&mut self, failure: Failure, retry_in: Duration) {
        if self.failing.as_deref() == Some(failure.detail.as_str()) {
            return;
        }
        if !self.watched.failed(&failure, retry_in).await {
            let reason = failure.reason.as_deref().unwrap_or_default();
            warn!(error = %failure.detail, reason, ?retry_in, "the watch of {} failed; it resumes with backoff", W::WHAT);
        }
        self.failing = Some(failure.detail);
    }

    /// The backoff's next delay, or the server's `retryAfterSeconds` if longer.
    fn delay(&mut self, failure: &Failure) -> Duration {
        self.backoff.next_delay().max(failure.retry_after)
    }

    /// Waits `delay`, doing the watched's other work meanwhile.
    async fn wait(&mut self, delay: Duration) {
        let sleep = tokio::time::sleep(delay);
        tokio::pin!(sleep);
        loop {
            tokio::select! {
                () = &mut sleep => return,
                () = self.watched.work_due() => self.watched.work().await,
            }
        }
    }
}

/// A change the watch reported.
enum Change<K> {
    Apply(K),
    Delete(K),
}

/// Moves `version` on to an object's resourceVersion from the watch.
fn version_of<K: Resource>(object: &K, version: &mut String) {
    if let Some(v) = object
        .meta()
        .resource_version
        .as_deref()
        .filter(|v| !v.is_empty())
    {
        v.clone_into(version);
    }
}
