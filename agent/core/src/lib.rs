//! The agent's core: the endpoints it manages, their identity labels, the identities
//! they hold (the [`identities`] cache) and the datapath state they want, as plain
//! synchronous state. No task, no I/O, no clock, no BPF, no wire types: the shells
//! around it (the sources, the allocate client, the EndpointSync client, reconcile,
//! the admin API) feed it events and carry out its effects, and the daemon wires
//! them.
//!
//! The cluster's Service addresses come from the operator, as a whole set each
//! time (in HelloReply, and on the endpoint map stream at its start and after every
//! change); the core wants SERVICES to be the latest set and says what changes
//! (`range -> Option<kind>`). The map stream's set is the newer one while its stream
//! lasts: a HelloReply then does not overwrite it. Until the first set comes,
//! SERVICES keeps what a previous run left (fail-static); the first set's changes
//! are against that.
//!
//! Events come in — the source's sets and changes ([`Core::on_source`]), allocation
//! answers ([`Core::on_allocation`]), the operator's settings, Rebinds and verdicts
//! ([`Core::on_operator`]), the stream's state ([`Core::set_operator_link`]), the
//! node's addresses ([`Core::set_host_ips`]) and what reconcile did
//! ([`Core::on_reconciled`]) — and effects queue up until [`Core::take_effects`]:
//! allocations to start or cancel, reports for the operator, and the datapath
//! changes themselves (`address -> Option<Entry>`, `interface -> attach or detach`).
//! Allocations are numbered 1, 2, 3, ... (one agent process, one count); when every
//! one up to a number has been answered or given up, the batch's reports end with
//! that number ([`Report::Settled`]), after the reports of the endpoints that took
//! up the identities, so the operator may end those allocations' holds.
//! [`Core::status`] is the one status the admin API and the metrics read.
//!
//! An endpoint **holds** an identity once one is known for it; only then are its
//! addresses written to ENDPOINTS and is it reported to the operator. An endpoint
//! whose label set's identity is not known yet is not written (a packet from it
//! counts as `world`, which is true: census does not know it yet) — unless it
//! already held one: when its labels change, it keeps the previous identity until
//! the new one is known (fail-static), and after an agent restart, an endpoint
//! whose addresses the maps already held under one identity keeps that identity
//! (it is reported to the operator, who confirms it or sends a Rebind).
//!
//! The operator's Acks judge what it was sent ([`Verdict`]): an endpoint it rejected
//! is marked (state `error`, with the operator's reason) until an Ack no longer
//! rejects it, and one whose identity it decides after its adoption window shows as
//! waiting for it. Each change of mark is logged once, however often the same
//! snapshot is resent.

mod effects;
mod error;
mod events;
mod identities;
#[cfg(test)]
mod map_tests;
mod remote;
#[cfg(test)]
mod service_tests;
pub mod source;
mod status;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
#[cfg(test)]
mod tests;

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    mem,
    net::IpAddr,
    num::NonZeroU16,
    sync::Arc,
};

use census_proto::{
    domain::{
        ClusterIpService, Endpoint, EndpointKey, IdentityId, NodeName, ServiceKind, ServiceSet,
    },
    labels::{LabelFilter, LabelSet},
};
use ipnet::IpNet;
use tracing::{debug, info, warn};

pub use census_proto::domain::AllocationId;
pub use effects::{Allocation, Desired, Effects, Entry, InterfaceChange, Report};
pub use error::{AllocateFailure, DatapathError, LabelsError, Problem, StreamError};
pub use events::{
    AllocationEvent, DatapathHealth, HookDirection, LabelSettings, MapBatch, MapEntry, MapEvent,
    MapNode, MissingHook, NodeHook, OperatorEvent, ProgramInFront, Reconciled, Verdict,
    VerdictScope,
};
pub use identities::AllocationRequest;
use identities::{IdentityCache, Lookup, Release};
use remote::RemoteMap;
pub use remote::{MapApplied, NodeEntry};
pub use status::ServiceCounts;
pub use status::{EndpointState, EndpointView, MapLink, MapState, MapStatus, OperatorLink, Status};

use crate::source::{HostInterface, SourceEndpoint, SourceEvent, SourceFailure};

/// The operator's last word on an endpoint, when it is not "accepted".
#[derive(Debug, Clone, PartialEq, Eq)]
enum Mark {
    Rejected(String),
    Pending,
}

/// An identity in force for an endpoint, and the label set it stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Held {
    id: IdentityId,
    labels: LabelSet,
}

#[derive(Debug)]
struct Managed {
    source: SourceEndpoint,
    /// Its identity labels, or why there are none.
    wanted: Result<LabelSet, LabelsError>,
    held: Option<Held>,
    /// The last failed allocation attempt.
    allocation_error: Option<AllocateFailure>,
    map_error: Option<(IpAddr, DatapathError)>,
    interface_error: Option<DatapathError>,
    operator: Option<Mark>,
}

/// Effects queued since the last [`Core::take_effects`].
#[derive(Debug, Default)]
struct Queue {
    allocations: Vec<Allocation>,
    reports: Vec<Report>,
    ips: BTreeSet<IpAddr>,
    interfaces: BTreeSet<String>,
    nodes: BTreeSet<NonZeroU16>,
    services: BTreeMap<IpNet, Option<ServiceKind>>,
}

/// The cluster's Service addresses as the core wants SERVICES.
#[derive(Debug, Default)]
struct Services {
    /// The operator's latest set; until one comes, what SERVICES held at start.
    set: ServiceSet,
    /// Whether a set came from the operator.
    known: bool,
    /// Whether the current map stream gave one (a HelloReply's is not newer).
    from_map: bool,
    /// `set`'s named ClusterIPs, shared with every status.
    names: Arc<BTreeMap<IpAddr, ClusterIpService>>,
}

/// See the module documentation.
#[derive(Debug, Default)]
pub struct Core {
    settings: LabelSettings,
    table: BTreeMap<EndpointKey, Managed>,
    /// Address -> the endpoints that claim it; the first one gets it.
    owners: HashMap<IpAddr, BTreeSet<EndpointKey>>,
    /// Interface -> endpoints behind it.
    interfaces: HashMap<String, usize>,
    host_ips: BTreeSet<IpAddr>,
    cache: IdentityCache,
    /// The last [`Report::Settled`] given.
    settled: AllocationId,
    /// Whether the source has given its first full set.
    synced: bool,
    /// LOCAL entries found in ENDPOINTS at start, until the first full set.
    adoptable: Option<HashMap<IpAddr, u32>>,
    source_error: Option<SourceFailure>,
    queue: Queue,
    operator_link: OperatorLink,
    /// ENDPOINTS entries of this node written, and REMOTE entries whose write
    /// failed, as reconcile last said.
    local_entries: usize,
    remote_unwritten: usize,
    interfaces_by_address: usize,
    /// Interfaces the classifier is attached to, as reconcile last said: only
    /// the addresses behind them are LOCAL.
    attached: BTreeSet<String>,
    /// The datapath as the last full pass found it.
    health: DatapathHealth,
    /// The cluster-wide map: other nodes' endpoints and addresses.
    remote: RemoteMap,
    map_link: MapLink,
    services: Services,
}

impl Core {
    /// `adoptable`: the identities of the LOCAL entries ENDPOINTS held at start,
    /// which endpoints of the first full set keep until the operator says otherwise.
    pub fn new(adoptable: HashMap<IpAddr, u32>) -> Self {
        Self {
            adoptable: Some(adoptable),
            ..Self::default()
        }
    }

    /// The interfaces the classifier was found attached to at start (a previous
    /// run's links): their addresses stay LOCAL while reconcile adopts them.
    pub fn with_attached(mut self, attached: BTreeSet<String>) -> Self {
        self.attached = attached;
        self
    }

    /// This node's name (the cluster-wide map's entries of this node are not kept),
    /// and the nodes NODES held at start (they keep their index).
    pub fn with_node(
        mut self,
        node: NodeName,
        pinned: impl IntoIterator<Item = (NonZeroU16, NodeName)>,
    ) -> Self {
        self.remote = RemoteMap::new(Some(node));
        self.remote.seed_nodes(pinned);
        self
    }

    /// What SERVICES held at start (a previous run's): in force until the
    /// operator's first set, which changes only what differs from it.
    pub fn with_services(mut self, pinned: ServiceSet) -> Self {
        self.services.set = pinned;
        self
    }

    /// Whether the cluster-wide map has completed a resync since start (or the
    /// agent is local-only): remote entries it lacks may go.
    pub fn map_complete(&self) -> bool {
        self.remote.complete()
    }

    /// Whether the source has given its first full set (and removing what it does
    /// not list is allowed).
    pub fn synced(&self) -> bool {
        self.synced
    }

    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Whether it manages no endpoint.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn on_source(&mut self, event: SourceEvent) {
        match event {
            SourceEvent::Reset(set) => {
                self.source_error = None;
                self.reset(set);
            }
            SourceEvent::Upsert(endpoint) => {
                self.source_error = None;
                self.upsert(endpoint);
            }
            SourceEvent::Delete(key) => {
                self.source_error = None;
                self.remove(&key);
            }
            SourceEvent::Failed(failure) => self.source_error = Some(failure),
        }
    }

    fn reset(&mut self, set: Vec<SourceEndpoint>) {
        let listed: BTreeSet<&EndpointKey> = set.iter().map(|e| &e.key).collect();
        let gone: Vec<EndpointKey> = self
            .table
            .keys()
            .filter(|k| !listed.contains(k))
            .cloned()
            .collect();
        for key in gone {
            self.remove(&key);
        }
        for endpoint in set {
            self.upsert(endpoint);
        }
        if !self.synced {
            self.synced = true;
            let adopted = self.table.values().filter(|m| m.held.is_some()).count();
            if adopted > 0 {
                info!(adopted, "endpoints keep the identities the maps held");
            }
        }
        // The addresses a previous run held locally no longer keep a remote claim out.
        if let Some(adoptable) = self.adoptable.take() {
            let claimed = adoptable
                .into_keys()
                .filter(|ip| self.remote.get(*ip).is_some());
            self.queue.ips.extend(claimed);
        }
    }

    fn upsert(&mut self, source: SourceEndpoint) {
        let key = source.key.clone();
        if self.table.get(&key).is_some_and(|m| m.source == source) {
            return;
        }
        let wanted = self.identity_labels(&source);
        let previous = self.table.remove(&key);
        // What the operator was told about this endpoint (nothing unless it held an identity).
        let before = previous.as_ref().and_then(|m| to_report(&key, m));
        let managed = match previous {
            Some(mut old) => {
                for ip in &old.source.ips {
                    self.disown(*ip, &key);
                    self.queue.ips.insert(*ip);
                }
                if old.source.interface != source.interface {
                    self.interface_users(old.source.interface.name(), -1);
                    self.interface_users(source.interface.name(), 1);
                    self.queue
                        .interfaces
                        .extend(old.source.interface.name().map(str::to_owned));
                    old.interface_error = None;
                }
                old.source = source;
                if old.wanted != wanted {
                    self.relabel(&key, &mut old, wanted);
                }
                old
            }
            None => {
                self.interface_users(source.interface.name(), 1);
                let mut new = Managed {
                    held: self.adopt(&source, &wanted),
                    source,
                    wanted,
                    allocation_error: None,
                    map_error: None,
                    interface_error: None,
                    operator: None,
                };
                self.label(&key, &mut new);
                new
            }
        };
        for ip in &managed.source.ips {
            self.owners.entry(*ip).or_default().insert(key.clone());
            self.queue.ips.insert(*ip);
        }
        self.queue
            .interfaces
            .extend(managed.source.interface.name().map(str::to_owned));
        if to_report(&key, &managed) != before {
            report(&key, &managed, &mut self.queue.reports);
        }
        self.table.insert(key, managed);
    }

    /// The identity of `source`'s addresses in the maps at start, if they all had
    /// the same one.
    fn adopt(
        &self,
        source: &SourceEndpoint,
        wanted: &Result<LabelSet, LabelsError>,
    ) -> Option<Held> {
        let found = self.adoptable.as_ref()?;
        let labels = wanted.as_ref().ok()?;
        let mut ids = source.ips.iter().map(|ip| found.get(ip).copied());
        let first = ids.next()??;
        if !ids.all(|id| id == Some(first)) {
            return None;
        }
        let id = IdentityId::new(first).filter(|id| !id.is_reserved())?;
        debug!(endpoint = %source.key, %id, "keeping the identity found in the maps");
        Some(Held {
            id,
            labels: labels.clone(),
        })
    }

    /// Gives `managed` new identity labels: releases the old set, acquires the new.
    fn relabel(
        &mut self,
        key: &EndpointKey,
        managed: &mut Managed,
        wanted: Result<LabelSet, LabelsError>,
    ) {
        if let Ok(old) = &managed.wanted {
            self.release(old, key);
        }
        managed.wanted = wanted;
        self.label(key, managed);
    }

    /// Acquires the identity of `managed`'s label set, if it has one.
    fn label(&mut self, key: &EndpointKey, managed: &mut Managed) {
        managed.allocation_error = None;
        match &managed.wanted {
            Ok(labels) => match self.cache.acquire(labels, key) {
                Lookup::Known(id) => {
                    managed.held = Some(Held {
                        id,
                        labels: labels.clone(),
                    });
                }
                Lookup::Pending(request) => self
                    .queue
                    .allocations
                    .extend(request.map(Allocation::Start)),
            },
            Err(reason) => {
                warn!(endpoint = %key, %reason, "the endpoint cannot have an identity");
                managed.held = None;
            }
        }
        self.queue.ips.extend(managed.source.ips.iter().copied());
        self.queue
            .interfaces
            .extend(managed.source.interface.name().map(str::to_owned));
    }

    fn release(&mut self, labels: &LabelSet, key: &EndpointKey) {
        if let Release::Dropped(Some(request)) = self.cache.release(labels, key) {
            self.queue.allocations.push(Allocation::Cancel(request));
        }
    }

    fn remove(&mut self, key: &EndpointKey) {
        let Some(managed) = self.table.remove(key) else {
            return;
        };
        for ip in &managed.source.ips {
            self.disown(*ip, key);
            self.queue.ips.insert(*ip);
        }
        self.interface_users(managed.source.interface.name(), -1);
        self.queue
            .interfaces
            .extend(managed.source.interface.name().map(str::to_owned));
        if let Ok(labels) = &managed.wanted {
            self.release(labels, key);
        }
        if managed.held.is_some() {
            self.queue.reports.push(Report::Delete(key.clone()));
        }
    }

    fn disown(&mut self, ip: IpAddr, key: &EndpointKey) {
        if let Some(owners) = self.owners.get_mut(&ip) {
            owners.remove(key);
            if owners.is_empty() {
                self.owners.remove(&ip);
            }
        }
    }

    fn interface_users(&mut self, interface: Option<&str>, delta: isize) {
        let Some(interface) = interface else {
            return;
        };
        let count = self.interfaces.entry(interface.to_owned()).or_default();
        *count = count.saturating_add_signed(delta);
        if *count == 0 {
            self.interfaces.remove(interface);
        }
    }

    fn identity_labels(&self, source: &SourceEndpoint) -> Result<LabelSet, LabelsError> {
        let settings = &self.settings;
        if source.ips.len() > settings.max_ips {
            return Err(LabelsError::TooManyAddresses {
                count: source.ips.len(),
                limit: settings.max_ips,
            });
        }
        Ok(LabelSet::for_pod(
            &source.labels,
            source.key.namespace(),
            &source.service_account,
            &settings.filter,
            &settings.limits,
        )?)
    }

    /// An allocation answered, or an attempt failed (it is retried).
    pub fn on_allocation(&mut self, event: AllocationEvent) {
        match event {
            AllocationEvent::Allocated { labels, id, .. } => {
                debug!(%labels, %id, "identity allocated");
                for key in self.cache.resolved(&labels, id) {
                    self.hold(&key, id, &labels);
                }
            }
            AllocationEvent::Failed {
                labels, failure, ..
            } => {
                for key in self.cache.users(&labels) {
                    if let Some(managed) = self.table.get_mut(&key) {
                        managed.allocation_error = Some(failure.clone());
                    }
                }
            }
        }
    }

    /// The operator's settings, Rebinds and verdicts.
    pub fn on_operator(&mut self, event: OperatorEvent) {
        match event {
            OperatorEvent::Settings(settings) => self.set_settings(settings),
            OperatorEvent::Rebind { key, id } => {
                if !self.rebind(&key, id) {
                    debug!(endpoint = %key, "Rebind for an endpoint this agent does not hold");
                }
            }
            OperatorEvent::Verdict(verdict) => self.on_verdict(verdict),
            OperatorEvent::Services(set) => {
                if self.services.from_map {
                    debug!("HelloReply's Service addresses: the map stream's are newer");
                } else {
                    self.set_services(set, "HelloReply");
                }
            }
        }
    }

    /// SERVICES is to be `set`: queues what differs from the set in force.
    fn set_services(&mut self, set: ServiceSet, from: &'static str) {
        let changes = self.services.set.changes_to(&set);
        if !changes.is_empty() || !self.services.known {
            info!(
                ranges = set.len(),
                changed = changes.len(),
                from,
                "the cluster's Service addresses"
            );
        }
        self.queue.services.extend(changes);
        let names: BTreeMap<IpAddr, ClusterIpService> = set
            .cluster_ips()
            .map(|(ip, service)| (*ip, service.clone()))
            .collect();
        if *self.services.names != names {
            self.services.names = Arc::new(names);
        }
        self.services.set = set;
        self.services.known = true;
    }

    /// The cluster's Service addresses in force, and whether the operator said them
    /// (else they are what SERVICES held at start).
    #[cfg(test)]
    pub fn services(&self) -> (&ServiceSet, bool) {
        (&self.services.set, self.services.known)
    }

    /// The operator says `key` must use `id`: every endpoint of the same label set
    /// follows. `false` if the endpoint is unknown or holds no identity.
    fn rebind(&mut self, key: &EndpointKey, id: IdentityId) -> bool {
        let Some(managed) = self.table.get_mut(key) else {
            return false;
        };
        let Some(held) = managed.held.clone() else {
            return false;
        };
        info!(endpoint = %key, from = %held.id, to = %id, "rebind");
        if managed.operator == Some(Mark::Pending) {
            // Decided: the Rebind is the operator's answer.
            managed.operator = None;
        }
        if managed.wanted.as_ref() == Ok(&held.labels) {
            for user in self.cache.rebind(&held.labels, id) {
                self.hold(&user, id, &held.labels);
            }
        } else {
            self.hold(key, id, &held.labels);
        }
        true
    }

    fn hold(&mut self, key: &EndpointKey, id: IdentityId, labels: &LabelSet) {
        let Some(managed) = self.table.get_mut(key) else {
            return;
        };
        managed.allocation_error = None;
        let held = Held {
            id,
            labels: labels.clone(),
        };
        if managed.held.as_ref() == Some(&held) {
            return;
        }
        managed.held = Some(held);
        self.queue.ips.extend(managed.source.ips.iter().copied());
        self.queue
            .interfaces
            .extend(managed.source.interface.name().map(str::to_owned));
        report(key, managed, &mut self.queue.reports);
    }

    /// The operator's word on what it was sent (from an Ack).
    fn on_verdict(&mut self, verdict: Verdict) {
        let Verdict {
            scope,
            mut rejected,
            pending,
        } = verdict;
        let mut judge = |key: &EndpointKey, managed: &mut Managed| {
            let mark = match rejected.remove(key) {
                Some(reason) => Some(Mark::Rejected(reason)),
                None if pending.contains(key) => Some(Mark::Pending),
                None => None,
            };
            remark(key, managed, mark);
        };
        match scope {
            VerdictScope::All => {
                for (key, managed) in &mut self.table {
                    judge(key, managed);
                }
            }
            VerdictScope::One(key) => {
                if let Some(managed) = self.table.get_mut(&key) {
                    judge(&key, managed);
                }
            }
        }
        for (key, reason) in rejected {
            debug!(endpoint = %key, reason, "the operator rejected an endpoint this agent no longer has");
        }
    }

    /// The operator's settings (from HelloReply): identity labels are recomputed.
    fn set_settings(&mut self, settings: LabelSettings) {
        if self.settings == settings {
            return;
        }
        info!("the operator's label settings changed; recomputing identity labels");
        self.settings = settings;
        let keys: Vec<EndpointKey> = self.table.keys().cloned().collect();
        for key in keys {
            let Some(mut managed) = self.table.remove(&key) else {
                continue;
            };
            let wanted = self.identity_labels(&managed.source);
            if wanted != managed.wanted {
                let before = managed.held.clone();
                self.relabel(&key, &mut managed, wanted);
                if managed.held != before {
                    report(&key, &managed, &mut self.queue.reports);
                }
            }
            self.table.insert(key, managed);
        }
    }

    /// The operator's label filter, for a source that keeps only the labels it keeps.
    pub fn label_filter(&self) -> &LabelFilter {
        &self.settings.filter
    }

    /// The node's own addresses, flagged HOST in ENDPOINTS.
    pub fn set_host_ips(&mut self, ips: BTreeSet<IpAddr>) {
        if ips == self.host_ips {
            return;
        }
        self.queue
            .ips
            .extend(ips.symmetric_difference(&self.host_ips).copied());
        self.host_ips = ips;
    }

    /// The EndpointSync stream's state, for the status.
    pub fn set_operator_link(&mut self, link: OperatorLink) {
        self.operator_link = link;
    }

    /// A batch of the cluster-wide map, or word that there is none.
    pub fn on_map(&mut self, event: MapEvent) -> MapApplied {
        match event {
            MapEvent::Batch(mut batch) => {
                if let Some(set) = batch.services.take() {
                    self.set_services(set, "the endpoint map");
                    self.services.from_map = true;
                }
                let Queue { ips, nodes, .. } = &mut self.queue;
                self.remote.apply(batch, ips, nodes)
            }
            MapEvent::LocalOnly => {
                self.services.from_map = false;
                let Queue { ips, nodes, .. } = &mut self.queue;
                MapApplied {
                    changed: self.remote.local_only(ips, nodes),
                    skipped: 0,
                }
            }
        }
    }

    /// The EndpointMap watch's state, for the status.
    pub fn set_map_link(&mut self, link: MapLink) {
        if link.state != MapState::Connected {
            // The next stream starts with the operator's set again; until then a
            // HelloReply's is the newest.
            self.services.from_map = false;
        }
        self.map_link = link;
    }

    /// What reconcile did with the effects, or in a full pass.
    pub fn on_reconciled(&mut self, reconciled: Reconciled) {
        let Reconciled {
            entries,
            entry_failures,
            interfaces,
            interface_failures,
            attached,
            datapath,
            local_entries,
            remote_unwritten,
            interfaces_by_address,
        } = reconciled;
        self.local_entries = local_entries;
        self.remote_unwritten = remote_unwritten;
        self.interfaces_by_address = interfaces_by_address;
        if let Some(health) = datapath {
            self.health = health;
        }
        for name in &interfaces {
            let now = attached.contains(name);
            let changed = if now {
                self.attached.insert(name.clone())
            } else {
                self.attached.remove(name)
            };
            if changed {
                // The entries behind it gain or lose LOCAL.
                let ips = self
                    .table
                    .values()
                    .filter(|m| m.source.interface.name() == Some(name.as_str()))
                    .flat_map(|m| m.source.ips.iter().copied());
                self.queue.ips.extend(ips);
            }
        }
        let failed: HashMap<IpAddr, DatapathError> = entry_failures.into_iter().collect();
        let keys: BTreeSet<EndpointKey> = entries
            .iter()
            .filter_map(|ip| self.owners.get(ip))
            .flatten()
            .cloned()
            .collect();
        for key in keys {
            if let Some(managed) = self.table.get_mut(&key) {
                managed.map_error = managed
                    .source
                    .ips
                    .iter()
                    .find_map(|ip| Some((*ip, failed.get(ip)?.clone())));
            }
        }
        let failed: HashMap<String, DatapathError> = interface_failures.into_iter().collect();
        for managed in self.table.values_mut() {
            if let Some(name) = managed.source.interface.name()
                && interfaces.contains(name)
            {
                managed.interface_error = failed.get(name).cloned();
            }
        }
    }

    /// The effects of the events since the last call: the datapath changes as the
    /// state is now. The reports end with [`Report::Settled`] when more requests
    /// are settled: every answer is applied (its endpoints reported) in the event
    /// that settles it, so the reports before it carry them.
    pub fn take_effects(&mut self) -> Effects {
        let Queue {
            allocations,
            mut reports,
            ips,
            interfaces,
            nodes,
            services,
        } = mem::take(&mut self.queue);
        let settled = self.cache.settled();
        if settled > self.settled {
            self.settled = settled;
            reports.push(Report::Settled(settled));
        }
        let identities = self.interface_identities();
        Effects {
            allocations,
            reports,
            entries: ips.into_iter().map(|ip| (ip, self.entry(ip))).collect(),
            nodes: nodes
                .into_iter()
                .map(|index| (index, self.remote.node(index)))
                .collect(),
            prune_remote: self.remote.complete(),
            interfaces: interfaces
                .into_iter()
                .map(|name| {
                    let change = if self.interfaces.contains_key(&name) {
                        InterfaceChange::Attach {
                            identity: identities.get(name.as_str()).copied(),
                        }
                    } else {
                        InterfaceChange::Detach
                    };
                    (name, change)
                })
                .collect(),
            prune: self.synced,
            services,
        }
    }

    /// The ENDPOINTS entry `ip` should have. This node's endpoints and addresses
    /// come first: a remote claim is written only for an address neither holds
    /// (nor, until the source's first full set, a LOCAL entry of a previous run).
    fn entry(&self, ip: IpAddr) -> Option<Entry> {
        let owner = self
            .owners
            .get(&ip)
            .and_then(|owners| owners.first())
            .and_then(|key| self.table.get(key));
        match owner.and_then(|m| m.held.as_ref().map(|held| (m, held))) {
            Some((m, held)) => Some(match &m.source.interface {
                HostInterface::Named(name) if self.attached.contains(name) => Entry::Local(held.id),
                HostInterface::Named(_) | HostInterface::Unknown(_) => Entry::Unattached(held.id),
            }),
            None if self.host_ips.contains(&ip) => Some(Entry::Host),
            None if self.held_locally(ip) => None,
            None => self
                .remote
                .get(ip)
                .map(|(id, node)| Entry::Remote { id, node }),
        }
    }

    /// Whether a local endpoint (with an identity or not) claims `ip`, or, until
    /// the source's first full set, a previous run's LOCAL entry held it.
    fn held_locally(&self, ip: IpAddr) -> bool {
        self.owners.contains_key(&ip)
            || self
                .adoptable
                .as_ref()
                .is_some_and(|found| found.contains_key(&ip))
    }

    /// The interfaces the datapath should be attached to, alone (no entries, no
    /// nodes): what a pass over the links needs.
    pub fn desired_interfaces(&self) -> Desired {
        Desired {
            interfaces: self.interfaces.keys().cloned().collect(),
            interface_identities: self
                .interface_identities()
                .into_iter()
                .map(|(interface, id)| (interface.to_owned(), id))
                .collect(),
            ..Desired::default()
        }
    }

    /// The whole desired datapath state.
    pub fn desired(&self) -> Desired {
        let mut entries: HashMap<IpAddr, Entry> =
            self.host_ips.iter().map(|ip| (*ip, Entry::Host)).collect();
        for ip in self.owners.keys() {
            if let Some(entry) = self.entry(*ip) {
                entries.insert(*ip, entry);
            }
        }
        entries.reserve(self.remote.len());
        for (ip, id, node) in self.remote.iter() {
            if !self.host_ips.contains(&ip) && !self.held_locally(ip) {
                entries.insert(ip, Entry::Remote { id, node });
            }
        }
        Desired {
            nodes: self.remote.nodes().collect(),
            remote_complete: self.remote.complete(),
            services: self.services.known.then(|| self.services.set.clone()),
            entries,
            ..self.desired_interfaces()
        }
    }

    /// The interfaces behind which every endpoint holds one same identity, and
    /// that identity: the classifier takes it as the local side of every packet
    /// there (INTERFACES), whatever address the packet carries. An interface with
    /// an endpoint still waiting for its identity, or endpoints of different
    /// identities, is not listed: its packets are counted by address.
    fn interface_identities(&self) -> HashMap<&str, IdentityId> {
        let mut identities: HashMap<&str, Option<IdentityId>> = HashMap::new();
        for managed in self.table.values() {
            let Some(interface) = managed.source.interface.name() else {
                continue;
            };
            let id = managed.held.as_ref().map(|held| held.id);
            identities
                .entry(interface)
                .and_modify(|seen| {
                    if *seen != id {
                        *seen = None;
                    }
                })
                .or_insert(id);
        }
        identities
            .into_iter()
            .filter_map(|(interface, id)| Some((interface, id?)))
            .collect()
    }

    /// Every managed endpoint, sorted by namespace/name.
    pub fn view(&self) -> Vec<EndpointView> {
        self.table
            .iter()
            .map(|(key, m)| {
                let (state, problem) = self.state_of(key, m);
                EndpointView {
                    key: key.clone(),
                    ips: m.source.ips.clone(),
                    interface: m.source.interface.name().map(str::to_owned),
                    identity: m.held.as_ref().map(|h| h.id),
                    labels: m.wanted.as_ref().ok().cloned(),
                    state,
                    problem,
                }
            })
            .collect()
    }

    /// The status: endpoints by state, the source, the identity cache, the
    /// datapath as reconcile last reported it, and the operator's stream.
    pub fn status(&self) -> Status {
        let (mut programmed, mut waiting, mut errors) = (0, 0, 0);
        for (key, m) in &self.table {
            match self.state_of(key, m).0 {
                EndpointState::Programmed => programmed += 1,
                EndpointState::WaitingForIdentity => waiting += 1,
                EndpointState::Error => errors += 1,
            }
        }
        let map = self.map_status();
        // Every REMOTE entry in force is written, but those whose write failed.
        let remote_written =
            (map.remote + map.remote_node).saturating_sub(self.remote_unwritten as u64);
        Status {
            synced: self.synced,
            source_error: self.source_error.clone(),
            programmed,
            waiting,
            errors,
            identities: self.cache.len() as u64,
            pending_allocations: self.cache.pending() as u64,
            interfaces: self.interfaces.len() as u64,
            map_entries: self.local_entries as u64 + remote_written,
            interfaces_by_address: self.interfaces_by_address as u64,
            unattached: self.unattached() as u64,
            datapath_error: self.health.error.as_ref().map(ToString::to_string),
            in_front: self.health.in_front.clone(),
            missing_hooks: self.health.missing.clone(),
            services: self
                .services
                .known
                .then(|| ServiceCounts::of(&self.services.set)),
            service_names: self.services.names.clone(),
            local_identities: Arc::new(
                self.table
                    .values()
                    .filter_map(|m| m.held.as_ref().map(|held| held.id.get()))
                    .chain([census_common::identity::HOST])
                    .collect(),
            ),
            operator: self.operator_link.clone(),
            map,
        }
    }

    /// The map's entries by kind. Costs the local addresses, not the remote ones.
    fn map_status(&self) -> MapStatus {
        let (mut local, mut host, mut shadowed, mut shadowed_nodes) = (0, 0, 0, 0);
        let mut shadow = |ip: IpAddr| {
            if let Some((id, _)) = self.remote.get(ip) {
                shadowed += 1;
                if id == IdentityId::REMOTE_NODE {
                    shadowed_nodes += 1;
                }
            }
        };
        for ip in self.owners.keys() {
            match self.entry(*ip) {
                Some(Entry::Local(_) | Entry::Unattached(_)) => local += 1,
                Some(Entry::Host) => host += 1,
                Some(Entry::Remote { .. }) | None => {}
            }
            shadow(*ip);
        }
        for ip in self
            .host_ips
            .iter()
            .filter(|ip| !self.owners.contains_key(ip))
        {
            host += 1;
            shadow(*ip);
        }
        if let Some(found) = &self.adoptable {
            let pinned = found
                .keys()
                .filter(|ip| !self.owners.contains_key(ip) && !self.host_ips.contains(ip));
            for ip in pinned {
                shadow(*ip);
            }
        }
        let remote_node = self.remote.node_addresses() as u64;
        let all = self.remote.len() as u64;
        MapStatus {
            link: self.map_link.clone(),
            complete: self.remote.complete(),
            resyncs: self.remote.resyncs(),
            version: self.remote.version(),
            local,
            host,
            remote: (all - remote_node).saturating_sub(shadowed - shadowed_nodes),
            remote_node: remote_node.saturating_sub(shadowed_nodes),
            shadowed,
            nodes: self.remote.node_count() as u64,
        }
    }

    /// Endpoints holding an identity whose classifier is not attached.
    fn unattached(&self) -> usize {
        self.table
            .values()
            .filter(|m| m.held.is_some())
            .filter(|m| {
                m.source
                    .interface
                    .name()
                    .is_none_or(|name| !self.attached.contains(name))
            })
            .count()
    }

    fn state_of(&self, key: &EndpointKey, m: &Managed) -> (EndpointState, Option<Problem>) {
        let conflict = m.source.ips.iter().find_map(|ip| {
            let owner = self.owners.get(ip)?.first()?;
            (owner != key).then(|| Problem::AddressTaken {
                ip: *ip,
                owner: owner.clone(),
            })
        });
        let problem = match (&m.wanted, &m.allocation_error, &m.operator) {
            (Err(reason), _, _) => Some(Problem::NoLabels(reason.clone())),
            (Ok(_), Some(failure), _) if failure.is_refusal() => {
                Some(Problem::Refused(failure.clone()))
            }
            (Ok(_), _, Some(Mark::Rejected(reason))) => Some(Problem::Rejected(reason.clone())),
            _ => conflict
                .or_else(|| {
                    m.map_error
                        .clone()
                        .map(|(ip, error)| Problem::MapWrite { ip, error })
                })
                .or_else(|| m.interface_error.clone().map(Problem::Interface))
                .or_else(|| match &m.source.interface {
                    HostInterface::Unknown(why) => Some(Problem::NoInterface(why.clone())),
                    HostInterface::Named(_) => None,
                }),
        };
        if let Some(problem) = problem {
            return (EndpointState::Error, Some(problem));
        }
        let current = matches!((&m.wanted, &m.held), (Ok(w), Some(h)) if *w == h.labels);
        let pending = m.operator == Some(Mark::Pending);
        if current && !pending {
            (EndpointState::Programmed, None)
        } else {
            let waiting = m.allocation_error.clone().map(Problem::Allocating);
            let waiting = waiting.or_else(|| pending.then_some(Problem::Pending));
            (EndpointState::WaitingForIdentity, waiting)
        }
    }

    /// The endpoints that hold an identity, as reported to the operator.
    #[cfg(test)]
    fn reported(&self) -> Vec<Endpoint> {
        self.table
            .iter()
            .filter_map(|(key, m)| to_report(key, m))
            .collect()
    }
}

fn to_report(key: &EndpointKey, managed: &Managed) -> Option<Endpoint> {
    let held = managed.held.as_ref()?;
    Some(Endpoint {
        key: key.clone(),
        ips: managed.source.ips.clone(),
        identity: held.id,
        labels: held.labels.clone(),
    })
}

/// Gives `managed` the operator's new `mark`, saying so once when it changes.
fn remark(key: &EndpointKey, managed: &mut Managed, mark: Option<Mark>) {
    if managed.operator == mark {
        return;
    }
    match (&managed.operator, &mark) {
        (_, Some(Mark::Rejected(reason))) => {
            warn!(endpoint = %key, reason, "the operator rejected the endpoint; it does not count it until this is fixed");
        }
        (_, Some(Mark::Pending)) => {
            info!(endpoint = %key, "the operator decides the endpoint's identity after its adoption window");
        }
        (Some(Mark::Rejected(_)), None) => {
            info!(endpoint = %key, "the operator accepts the endpoint now");
        }
        (_, None) => debug!(endpoint = %key, "the operator has decided the endpoint's identity"),
    }
    managed.operator = mark;
}

fn report(key: &EndpointKey, managed: &Managed, reports: &mut Vec<Report>) {
    reports.push(match to_report(key, managed) {
        Some(endpoint) => Report::Upsert(endpoint),
        None => Report::Delete(key.clone()),
    });
}
