//! The pod source's state: the endpoints of this node, as a minimal projection
//! keyed by namespace/name (never the watcher's objects, never UIDs), and the
//! events that keep the agent's core in step with it.
//!
//! A (re)list arrives as `Init`, `InitApply`..., `InitDone`; the index builds the
//! new set aside and, at `InitDone`, replaces its whole projection with it and
//! sends one [`SourceEvent::Reset`] (kubert's `index.rs` does the same), so a pod
//! deleted while the watch was down is forgotten even though no delete event
//! ever said so. `Apply` and `Delete` become `Upsert` and `Delete`, or nothing
//! when nothing census reads changed.

use std::{
    collections::HashMap,
    net::IpAddr,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use census_proto::{domain::EndpointKey, labels::LabelFilter};
use kube::runtime::watcher::Event;
use tracing::{debug, warn};

use super::{
    pod::{PodEndpoint, PodObject, Read},
    route::InterfaceLookup,
};
use crate::source::{HostInterface, SourceEndpoint, SourceEvent};

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

pub(crate) struct PodIndex {
    node: String,
    filter: LabelFilter,
    lookup: Arc<dyn InterfaceLookup>,
    pods: HashMap<EndpointKey, SourceEndpoint>,
    /// The set a list in progress is building, from `Init` to `InitDone`.
    relist: Option<HashMap<EndpointKey, SourceEndpoint>>,
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
            relist: None,
            cached,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.pods.len()
    }

    /// A new filter applies from the next list on (the labels it would keep
    /// beyond the old one's are not in the projection).
    pub(crate) fn set_filter(&mut self, filter: LabelFilter) {
        self.filter = filter;
    }

    /// One watcher event; what the agent must hear of it.
    pub(crate) fn on_event(&mut self, event: Event<PodObject>) -> Option<SourceEvent> {
        match event {
            Event::Init => {
                self.relist = Some(HashMap::new());
                None
            }
            Event::InitApply(pod) => {
                self.init_apply(&pod);
                None
            }
            Event::InitDone => Some(self.init_done()),
            Event::Apply(pod) => self.apply(&pod),
            Event::Delete(pod) => self.delete(&pod),
        }
    }

    fn init_apply(&mut self, pod: &PodObject) {
        let read = pod.read(&self.node, &self.filter);
        let entry = match read {
            Read::Endpoint(endpoint) => Some(self.resolve(endpoint)),
            Read::Skipped(key, why) => {
                debug!(pod = %key, why = why.as_str(), "not an endpoint");
                None
            }
            Read::Unreadable { key, problem } => {
                // An object census cannot read is no evidence that the pod is gone:
                // what the projection had for it stays.
                let kept = key.as_ref().and_then(|k| self.pods.get(k)).cloned();
                warn!(
                    pod = %pod.display_name(),
                    problem,
                    kept = kept.is_some(),
                    "skipping a pod that cannot be read"
                );
                kept
            }
        };
        if let (Some(entry), Some(relist)) = (entry, self.relist.as_mut()) {
            relist.insert(entry.key.clone(), entry);
        }
    }

    fn init_done(&mut self) -> SourceEvent {
        self.pods = self.relist.take().unwrap_or_default();
        self.pods.shrink_to_fit();
        self.cached.set(self.pods.len());
        debug!(pods = self.pods.len(), "listed");
        let mut set: Vec<SourceEndpoint> = self.pods.values().cloned().collect();
        set.sort_by(|a, b| a.key.cmp(&b.key));
        SourceEvent::Reset(set)
    }

    fn apply(&mut self, pod: &PodObject) -> Option<SourceEvent> {
        match pod.read(&self.node, &self.filter) {
            Read::Endpoint(endpoint) => {
                let entry = self.resolve(endpoint);
                if self.pods.get(&entry.key) == Some(&entry) {
                    return None;
                }
                self.pods.insert(entry.key.clone(), entry.clone());
                self.cached.set(self.pods.len());
                Some(SourceEvent::Upsert(entry))
            }
            Read::Skipped(key, why) => {
                debug!(pod = %key, why = why.as_str(), "not an endpoint");
                self.remove(&key)
            }
            Read::Unreadable { problem, .. } => {
                warn!(
                    pod = %pod.display_name(),
                    problem,
                    "skipping a change to a pod that cannot be read; what the agent had for it stays"
                );
                None
            }
        }
    }

    fn delete(&mut self, pod: &PodObject) -> Option<SourceEvent> {
        match pod.key() {
            Ok(key) => self.remove(&key),
            Err(problem) => {
                warn!(pod = %pod.display_name(), problem, "a deleted pod without a usable name");
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
        let mut changed = Vec::new();
        for entry in self.pods.values_mut() {
            let interface = lookup(self.lookup.as_ref(), &entry.ips);
            if interface != entry.interface {
                debug!(pod = %entry.key, ?interface, "the host-side interface changed");
                entry.interface = interface;
                changed.push(SourceEvent::Upsert(entry.clone()));
            }
        }
        changed
    }

    /// The endpoint with its interface: the one known for the same addresses, or
    /// a lookup.
    fn resolve(&self, endpoint: PodEndpoint) -> SourceEndpoint {
        let PodEndpoint {
            key,
            ips,
            labels,
            service_account,
        } = endpoint;
        let known = self
            .pods
            .get(&key)
            .filter(|known| known.ips == ips && known.interface.name().is_some())
            .map(|known| known.interface.clone());
        let interface = known.unwrap_or_else(|| lookup(self.lookup.as_ref(), &ips));
        SourceEndpoint {
            key,
            ips,
            labels,
            service_account,
            interface,
        }
    }
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
    HostInterface::Unknown(
        first_error.map_or_else(|| "the pod has no address".to_owned(), |e| e.to_string()),
    )
}
