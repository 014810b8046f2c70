//! The pod source's state: the endpoints of this node, as a minimal projection
//! keyed by namespace/name (never the API's objects, never UIDs), and the
//! events that keep the agent's core in step with it.
//!
//! A (re)list replaces the whole projection and becomes one
//! [`SourceEvent::Reset`] (kubert's `index.rs` does the same), so a pod deleted
//! while the watch was down is forgotten even though no delete event ever said
//! so. Watch events become `Upsert` and `Delete`, or nothing when nothing census
//! reads changed.
//!
//! Each entry keeps all the pod's labels beside the endpoint (which carries only
//! those the operator's filter keeps), so a new filter is applied to what the
//! index holds, without asking the API server again: a handful of short strings
//! per pod of this node.

use std::{
    collections::HashMap,
    net::IpAddr,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use std::collections::BTreeMap;

use census_proto::{domain::EndpointKey, labels::LabelFilter};
use tracing::{debug, warn};

use super::{
    pod::{PodEndpoint, PodObject, Read},
    route::InterfaceLookup,
};
use crate::source::{HostInterface, NoInterface, SourceEndpoint, SourceEvent};

/// How many pods the source holds, readable from outside its task.
#[derive(Debug, Clone, Default)]
pub struct CachedPods(Arc<AtomicUsize>);

impl CachedPods {
    /// Entries in the projection (the set being re-listed is not counted).
    pub fn get(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }

    fn set(&self, n: usize) {
        self.0.store(n, Ordering::Relaxed);
    }
}

/// One pod of the projection.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    /// What the agent was told, with the labels the filter keeps.
    endpoint: SourceEndpoint,
    /// All the pod's labels, for the next filter.
    labels: BTreeMap<String, String>,
}

pub(crate) struct PodIndex {
    node: String,
    filter: LabelFilter,
    lookup: Arc<dyn InterfaceLookup>,
    pods: HashMap<EndpointKey, Entry>,
    cached: CachedPods,
}

impl PodIndex {
    pub(crate) fn new(
        node: String,
        filter: LabelFilter,
        lookup: Arc<dyn InterfaceLookup>,
        cached: CachedPods,
    ) -> Self {
        Self {
            node,
            filter,
            lookup,
            pods: HashMap::new(),
            cached,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.pods.len()
    }

    /// A new filter, applied to every pod held: one `Reset` of the whole set if
    /// any endpoint's labels changed, else nothing.
    pub(crate) fn set_filter(&mut self, filter: LabelFilter) -> Option<SourceEvent> {
        self.filter = filter;
        let mut changed = false;
        for entry in self.pods.values_mut() {
            let labels = filtered(&self.filter, &entry.labels);
            if labels != entry.endpoint.labels {
                entry.endpoint.labels = labels;
                changed = true;
            }
        }
        changed.then(|| self.set())
    }

    /// The whole set, as one `Reset`.
    pub(crate) fn set(&self) -> SourceEvent {
        let mut set: Vec<SourceEndpoint> = self.pods.values().map(|e| e.endpoint.clone()).collect();
        set.sort_by(|a, b| a.key.cmp(&b.key));
        SourceEvent::Reset(set)
    }

    /// A complete list: the projection becomes exactly what it says.
    pub(crate) fn relisted(&mut self, pods: &[PodObject]) -> SourceEvent {
        let mut next = HashMap::with_capacity(pods.len());
        for pod in pods {
            let read = pod.read(&self.node);
            let entry = match read {
                Read::Endpoint(endpoint) => Some(self.resolve(endpoint)),
                Read::Skipped(key, why) => {
                    debug!(pod = %key, why = why.as_str(), "not an endpoint");
                    None
                }
                Read::Unreadable { key, problem } => {
                    // An object census cannot read is no evidence that the pod is
                    // gone: what the projection had for it stays.
                    let kept = key.as_ref().and_then(|k| self.pods.get(k)).cloned();
                    warn!(
                        pod = %pod.display_name(),
                        problem = problem.to_string(),
                        kept = kept.is_some(),
                        "skipping a pod that cannot be read"
                    );
                    kept
                }
            };
            if let Some(entry) = entry {
                next.insert(entry.endpoint.key.clone(), entry);
            }
        }
        self.pods = next;
        self.cached.set(self.pods.len());
        debug!(pods = self.pods.len(), "listed");
        self.set()
    }

    /// A pod added or changed.
    pub(crate) fn apply(&mut self, pod: &PodObject) -> Option<SourceEvent> {
        match pod.read(&self.node) {
            Read::Endpoint(endpoint) => {
                let entry = self.resolve(endpoint);
                let key = entry.endpoint.key.clone();
                let same = self
                    .pods
                    .get(&key)
                    .is_some_and(|old| old.endpoint == entry.endpoint);
                let endpoint = entry.endpoint.clone();
                self.pods.insert(key, entry);
                self.cached.set(self.pods.len());
                // A change to labels the filter drops says nothing to the agent.
                (!same).then_some(SourceEvent::Upsert(endpoint))
            }
            Read::Skipped(key, why) => {
                debug!(pod = %key, why = why.as_str(), "not an endpoint");
                self.remove(&key)
            }
            Read::Unreadable { problem, .. } => {
                warn!(
                    pod = %pod.display_name(),
                    problem = problem.to_string(),
                    "skipping a change to a pod that cannot be read; what the agent had for it stays"
                );
                None
            }
        }
    }

    /// A pod deleted.
    pub(crate) fn delete(&mut self, pod: &PodObject) -> Option<SourceEvent> {
        match pod.key() {
            Ok(key) => self.remove(&key),
            Err(problem) => {
                warn!(pod = %pod.display_name(), problem = problem.to_string(), "a deleted pod without a usable name");
                None
            }
        }
    }

    fn remove(&mut self, key: &EndpointKey) -> Option<SourceEvent> {
        self.pods.remove(key)?;
        self.cached.set(self.pods.len());
        Some(SourceEvent::Delete(key.clone()))
    }

    /// Looks every pod's interface up again (a pod's sandbox can be re-created
    /// with a new device; a lookup that failed may succeed now).
    pub(crate) fn refresh_interfaces(&mut self) -> Vec<SourceEvent> {
        self.look_up_again(|_| true)
    }

    /// Looks up again the interface of each pod that has none (a link or route
    /// appeared: it may be what a pod's lookup did not find). Costs a lookup per pod
    /// still without one, none for the others.
    pub(crate) fn find_missing_interfaces(&mut self) -> Vec<SourceEvent> {
        self.look_up_again(|interface| interface.name().is_none())
    }

    /// Looks up again the interface of each pod whose interface `which` picks; an
    /// Upsert for each that changed.
    fn look_up_again(&mut self, which: impl Fn(&HostInterface) -> bool) -> Vec<SourceEvent> {
        let mut changed = Vec::new();
        for entry in self.pods.values_mut() {
            let endpoint = &mut entry.endpoint;
            if !which(&endpoint.interface) {
                continue;
            }
            let interface = lookup(self.lookup.as_ref(), &endpoint.ips);
            if interface != endpoint.interface {
                debug!(pod = %endpoint.key, ?interface, "the host-side interface changed");
                endpoint.interface = interface;
                changed.push(SourceEvent::Upsert(endpoint.clone()));
            }
        }
        changed
    }

    /// The endpoint with its interface: the one known for the same addresses, or
    /// a lookup.
    fn resolve(&self, endpoint: PodEndpoint) -> Entry {
        let PodEndpoint {
            key,
            ips,
            labels,
            service_account,
        } = endpoint;
        let known = self
            .pods
            .get(&key)
            .map(|known| &known.endpoint)
            .filter(|known| known.ips == ips && known.interface.name().is_some())
            .map(|known| known.interface.clone());
        let interface = known.unwrap_or_else(|| lookup(self.lookup.as_ref(), &ips));
        Entry {
            endpoint: SourceEndpoint {
                key,
                ips,
                labels: filtered(&self.filter, &labels),
                service_account,
                interface,
            },
            labels,
        }
    }
}

/// The labels `filter` keeps.
fn filtered(filter: &LabelFilter, labels: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    labels
        .iter()
        .filter(|(k, _)| filter.keeps(k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// The first of `ips` that leads to an interface, or why the first one does not.
fn lookup(lookup: &dyn InterfaceLookup, ips: &[IpAddr]) -> HostInterface {
    let mut first_error = None;
    for ip in ips {
        match lookup.host_interface(*ip) {
            Ok(name) => return HostInterface::Named(name),
            Err(error) => {
                first_error.get_or_insert(error);
            }
        }
    }
    HostInterface::Unknown(first_error.map_or_else(NoInterface::no_address, NoInterface::new))
}
