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

use std::{collections::BTreeMap, fmt, future::Future, net::IpAddr, pin::Pin};

use census_proto::{domain::EndpointKey, labels::LabelFilter};
use tokio::sync::{mpsc, watch};

pub use file::FileSource;
pub use kubernetes::PodSource;

/// One endpoint as a source describes it: pod labels, before the agent applies the
/// label filter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceEndpoint {
    pub key: EndpointKey,
    /// Sorted, without duplicates.
    pub ips: Box<[IpAddr]>,
    /// The pod's labels (`key -> value`): all of them, or, from a source that takes
    /// the operator's filter ([`EndpointSource::label_filter`]), those it keeps.
    pub labels: BTreeMap<String, String>,
    pub service_account: String,
    pub interface: HostInterface,
}

/// The host side of an endpoint's interface, where the classifier goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostInterface {
    /// Its name, in the agent's network namespace.
    Named(String),
    /// The source could not find it, and says why. The endpoint still gets its
    /// identity and ENDPOINTS entries (its traffic with other endpoints is counted
    /// at theirs), but no classifier of its own, and it is shown in error.
    Unknown(String),
}

impl HostInterface {
    pub fn name(&self) -> Option<&str> {
        match self {
            Self::Named(name) => Some(name),
            Self::Unknown(_) => None,
        }
    }
}

/// What a source tells the agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceEvent {
    /// The full desired set: replaces everything the source said before.
    Reset(Vec<SourceEndpoint>),
    /// One endpoint appeared or changed.
    Upsert(SourceEndpoint),
    /// One endpoint is gone.
    Delete(EndpointKey),
    /// The source could not read its input; what it said before stays in force.
    Failed(SourceFailure),
}

/// Why a source could not deliver, for logs, `/readyz` and the endpoints API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceFailure {
    /// A bounded metric label (`read`, `parse`, `invalid`, ...).
    pub kind: &'static str,
    /// The whole message, naming the input and the problem.
    pub detail: String,
}

impl fmt::Display for SourceFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.detail)
    }
}

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
}
