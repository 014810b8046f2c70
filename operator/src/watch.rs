//! One way the operator watches a kind of Kubernetes object: kube-runtime's
//! watcher with one list policy, and a [`Watched`] that takes what it says. A
//! (re-)list (`Init`, `InitApply`..., `InitDone`) becomes one reset of what the
//! watched keeps, which forgets what disappeared while the watch was down; then
//! each change. A failed watch resumes with backoff (kube-runtime's default).
//!
//! **The list policy**, the agent's pod source's too: `resourceVersion=0`
//! (`resourceVersionMatch=NotOlderThan`, kube's `any_semantic`) and no `limit`,
//! which the API server answers from its watch cache, in memory, not from etcd
//! (kube leaves `resourceVersion=0` out of a list that has a limit, so the
//! watcher's default page size is unset here). The watch goes on from the version
//! that list was read at, so nothing is missed. The Identity store's full load at
//! a leader's start (`store::kubernetes`) is the one read from etcd, in pages of
//! [`PAGE`].

use std::{fmt::Debug, future::Future};

use futures::StreamExt as _;
use kube::{
    Api, Resource,
    runtime::{WatchStreamExt as _, watcher},
};
use serde::de::DeserializeOwned;
use tracing::warn;

/// Objects per page of a list read from etcd.
pub const PAGE: u32 = 500;

/// The watcher's configuration: see the module.
pub fn config() -> watcher::Config {
    watcher::Config {
        page_size: None,
        ..watcher::Config::default()
    }
    .any_semantic()
}

/// What a watch feeds.
pub trait Watched<K>: Send {
    /// The resource, for logs: `Nodes`, `Services`.
    const WHAT: &'static str;

    /// A (re-)list begins: its objects come to [`Self::list`], then [`Self::listed`].
    fn relist(&mut self);

    /// One object of a (re-)list, kept until it ends.
    fn list(&mut self, object: K);

    /// The (re-)list ended: what it held replaces what was known.
    fn listed(&mut self) -> impl Future<Output = ()> + Send;

    /// An object added or changed.
    fn apply(&mut self, object: K) -> impl Future<Output = ()> + Send;

    /// An object deleted.
    fn delete(&mut self, object: K) -> impl Future<Output = ()> + Send;

    /// The watch failed (it resumes with backoff); `true` when this said so itself.
    fn failed(&mut self, error: &watcher::Error) -> bool {
        let _ = error;
        false
    }
}

/// Watches `api` into `watched` until the task is dropped.
pub async fn drive<K, W>(api: Api<K>, mut watched: W)
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    W: Watched<K>,
{
    let stream = watcher(api, config()).default_backoff();
    let mut stream = std::pin::pin!(stream);
    while let Some(event) = stream.next().await {
        match event {
            Ok(watcher::Event::Init) => watched.relist(),
            Ok(watcher::Event::InitApply(object)) => watched.list(object),
            Ok(watcher::Event::InitDone) => watched.listed().await,
            Ok(watcher::Event::Apply(object)) => watched.apply(object).await,
            Ok(watcher::Event::Delete(object)) => watched.delete(object).await,
            Err(error) => {
                if !watched.failed(&error) {
                    warn!(%error, "the watch of {} failed; it resumes with backoff", W::WHAT);
                }
            }
        }
    }
}
