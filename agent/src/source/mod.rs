//! Where the agent learns which endpoints run on its node.
//!
//! A source is a task that sends [`SourceEvent`]s: either a full desired set
//! ([`SourceEvent::Reset`], which replaces everything said before) or one change
//! ([`SourceEvent::Upsert`], [`SourceEvent::Delete`]). The file source sends a
//! `Reset` on every good read. The Kubernetes source (a pod watcher on this node)
//! turns the watcher's `Init`/`InitApply`/`InitDone` into one `Reset` (so a watch
//! restart forgets what disappeared while it was down) and its `Apply`/`Delete`
//! into `Upsert`/`Delete`.
//!
//! A source that cannot read its input says so with [`SourceEvent::Failed`]; the
//! agent keeps the last good set in force.

pub mod file;
pub mod kubernetes;

use std::{future::Future, pin::Pin};

use census_proto::labels::LabelFilter;
use tokio::sync::{mpsc, watch};

pub use file::FileSource;
pub use kubernetes::PodSource;

pub use census_agent_core::source::{
    HostInterface, NoInterface, SourceEndpoint, SourceEvent, SourceFailure,
};

/// A boxed future, for object-safe sources.
pub type BoxFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A source of endpoints: runs until `shutdown` turns true (or the agent stops
/// listening), sending events on `events`.
pub trait EndpointSource: Send + 'static {
    /// What the source reads, for logs and the endpoints API (`file /etc/census/endpoints.yaml`).
    fn describe(&self) -> String;

    fn run(
        self: Box<Self>,
        events: mpsc::Sender<SourceEvent>,
        shutdown: watch::Receiver<bool>,
    ) -> BoxFuture;

    /// Where the agent sends the operator's label filter whenever it changes, for
    /// a source that keeps only the labels the filter keeps; `None` (the default)
    /// for a source that hands over every label.
    fn label_filter(&self) -> Option<watch::Sender<LabelFilter>> {
        None
    }

    /// Hands over a receiver that changes whenever one of the node's links or
    /// routes is added, changed or removed, for a source that looks pods' devices
    /// up: a device, or the route to a pod's address, can appear after its pod (a
    /// CNI plugin that wires it late), and the lookup that failed is worth making
    /// again at once. Ignored by default.
    fn watch_routes(&mut self, routes: watch::Receiver<u64>) {
        let _ = routes;
    }
}
