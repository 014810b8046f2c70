//! The agent's core: the endpoints it manages, their identity labels and the
//! identities they hold, as plain synchronous state. Events come in (the source's
//! sets and changes, allocation answers, Rebinds, the operator's settings, the
//! node's addresses) and effects go out as [`Effects`]: allocations to start,
//! reports for the operator, and the addresses and interfaces whose datapath state
//! must be brought up to date. Reading the desired datapath state
//! ([`Endpoints::desired`]) closes the loop with [`crate::reconcile`].
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

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
};

use census_proto::{
    domain::{Endpoint, EndpointKey, IdentityId},
    labels::{LabelFilter, LabelLimits, LabelSet},
};
use tracing::{debug, info, warn};

use crate::{
    admin::api,
    bpf,
    identities::{AllocationRequest, IdentityCache, Lookup},
    reconcile::Desired,
    source::{HostInterface, SourceEndpoint, SourceEvent, SourceFailure},
    sync::Report,
};

/// The operator's settings that shape identity labels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabelSettings {
    pub filter: LabelFilter,
    pub limits: LabelLimits,
    pub max_ips: usize,
}

impl Default for LabelSettings {
    /// The operator's defaults, in force until its HelloReply says otherwise.
    fn default() -> Self {
        Self {
            filter: LabelFilter::default(),
            limits: LabelLimits::default(),
            max_ips: 16,
        }
    }
}

/// What the rest of the agent must do after an event.
#[derive(Debug, Default)]
pub struct Effects {
    pub allocations: Vec<AllocationRequest>,
    pub reports: Vec<Report>,
    /// Addresses whose ENDPOINTS entry may have to change.
    pub ips: BTreeSet<IpAddr>,
    /// Interfaces that may have to be attached or detached.
    pub interfaces: BTreeSet<String>,
}

impl Effects {
    pub fn is_empty(&self) -> bool {
        self.allocations.is_empty()
            && self.reports.is_empty()
            && self.ips.is_empty()
            && self.interfaces.is_empty()
    }
}

/// What the operator's Acks say about the endpoints it was sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub scope: VerdictScope,
    /// Entries the operator rejected, with its reason.
    pub rejected: BTreeMap<EndpointKey, String>,
    /// Entries whose identity the operator decides after its adoption window.
    pub pending: BTreeSet<EndpointKey>,
}

/// Whom a [`Verdict`] speaks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VerdictScope {
    /// Every endpoint: a snapshot's Ack. An endpoint it does not name is accepted.
    All,
    /// One endpoint: a delta's Ack.
    One(EndpointKey),
}

/// The operator's last word on an endpoint, when it is not "accepted".
#[derive(Debug, Clone, PartialEq, Eq)]
enum Mark {
    Rejected(String),
    Pending,
}

/// What an endpoint the operator has not decided yet shows.
const PENDING: &str = "the operator decides its identity after its adoption window";

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
    wanted: Result<LabelSet, String>,
    held: Option<Held>,
    /// The last failed allocation attempt, and whether the operator refused the labels.
    allocation_error: Option<(String, bool)>,
    map_error: Option<String>,
    interface_error: Option<String>,
    operator: Option<Mark>,
}

/// See the module documentation.
#[derive(Debug, Default)]
pub struct Endpoints {
    settings: LabelSettings,
    table: BTreeMap<EndpointKey, Managed>,
    /// Address -> the endpoints that claim it; the first one gets it.
    owners: HashMap<IpAddr, BTreeSet<EndpointKey>>,
    /// Interface -> endpoints behind it.
    interfaces: HashMap<String, usize>,
    host_ips: BTreeSet<IpAddr>,
    cache: IdentityCache,
    /// Whether the source has given its first full set.
    synced: bool,
    /// LOCAL entries found in ENDPOINTS at start, until the first full set.
    adoptable: Option<HashMap<IpAddr, u32>>,
    source_error: Option<SourceFailure>,
}

impl Endpoints {
    /// `found`: the ENDPOINTS content at start, whose identities endpoints of the
    /// first full set keep until the operator says otherwise.
    pub fn new(found: &BTreeMap<bpf::EndpointKey, bpf::Endpoint>) -> Self {
        let adoptable = found
            .iter()
            .filter(|(_, e)| e.flags.contains(bpf::EndpointFlags::LOCAL))
            .filter_map(|(key, e)| Some((key.ip()?, e.identity)))
            .collect();
        Self {
            adoptable: Some(adoptable),
            ..Self::default()
        }
    }

    /// Whether the source has given its first full set (and removing what it does
    /// not list is allowed).
    pub fn synced(&self) -> bool {
        self.synced
    }

    pub fn source_error(&self) -> Option<&SourceFailure> {
        self.source_error.as_ref()
    }

    pub fn len(&self) -> usize {
        self.table.len()
    }

    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    pub fn cache(&self) -> &IdentityCache {
        &self.cache
    }

    pub fn on_source(&mut self, event: SourceEvent, fx: &mut Effects) {
        match event {
            SourceEvent::Reset(set) => {
                self.source_error = None;
                self.reset(set, fx);
            }
            SourceEvent::Upsert(endpoint) => {
                self.source_error = None;
                self.upsert(endpoint, fx);
            }
            SourceEvent::Delete(key) => {
                self.source_error = None;
                self.remove(&key, fx);
            }
            SourceEvent::Failed(failure) => self.source_error = Some(failure),
        }
    }

    fn reset(&mut self, set: Vec<SourceEndpoint>, fx: &mut Effects) {
        let listed: BTreeSet<&EndpointKey> = set.iter().map(|e| &e.key).collect();
        let gone: Vec<EndpointKey> = self
            .table
            .keys()
            .filter(|k| !listed.contains(k))
            .cloned()
            .collect();
        for key in gone {
            self.remove(&key, fx);
        }
        for endpoint in set {
            self.upsert(endpoint, fx);
        }
        if !self.synced {
            self.synced = true;
            let adopted = self.table.values().filter(|m| m.held.is_some()).count();
            if adopted > 0 {
                info!(adopted, "endpoints keep the identities the maps held");
            }
        }
        self.adoptable = None;
    }

    fn upsert(&mut self, source: SourceEndpoint, fx: &mut Effects) {
        let key = source.key.clone();
        if self.table.get(&key).is_some_and(|m| m.source == source) {
            return;
        }
        let wanted = self.identity_labels(&source);
        let previous = self.table.remove(&key);
        // What the operator was told about this endpoint (nothing unless it held an identity).
        let before = previous.as_ref().and_then(|m| to_report(&key, m));
        let mut managed = match previous {
            Some(mut old) => {
                for ip in &old.source.ips {
                    self.disown(*ip, &key);
                    fx.ips.insert(*ip);
                }
                if old.source.interface != source.interface {
                    self.interface_users(old.source.interface.name(), -1);
                    self.interface_users(source.interface.name(), 1);
                    fx.interfaces
                        .extend(old.source.interface.name().map(str::to_owned));
                    old.interface_error = None;
                }
                old
            }
            None => {
                self.interface_users(source.interface.name(), 1);
                Managed {
                    held: self.adopt(&source, &wanted),
                    source: source.clone(),
                    wanted: Err(String::new()),
                    allocation_error: None,
                    map_error: None,
                    interface_error: None,
                    operator: None,
                }
            }
        };
        for ip in &source.ips {
            self.owners.entry(*ip).or_default().insert(key.clone());
            fx.ips.insert(*ip);
        }
        fx.interfaces
            .extend(source.interface.name().map(str::to_owned));
        managed.source = source;
        if managed.wanted != wanted {
            self.relabel(&key, &mut managed, wanted, fx);
        }
        if to_report(&key, &managed) != before {
            report(&key, &managed, fx);
        }
        self.table.insert(key, managed);
    }

    /// The identity of `source`'s addresses in the maps at start, if they all had
    /// the same one.
    fn adopt(&self, source: &SourceEndpoint, wanted: &Result<LabelSet, String>) -> Option<Held> {
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
        wanted: Result<LabelSet, String>,
        fx: &mut Effects,
    ) {
        if let Ok(old) = &managed.wanted {
            self.cache.release(old, key);
        }
        managed.allocation_error = None;
        managed.wanted = wanted;
        match &managed.wanted {
            Ok(labels) => match self.cache.acquire(labels, key) {
                Lookup::Known(id) => {
                    managed.held = Some(Held {
                        id,
                        labels: labels.clone(),
                    });
                }
                Lookup::Pending(request) => fx.allocations.extend(request),
            },
            Err(reason) => {
                warn!(endpoint = %key, reason, "the endpoint cannot have an identity");
                managed.held = None;
            }
        }
        fx.ips.extend(managed.source.ips.iter().copied());
        fx.interfaces
            .extend(managed.source.interface.name().map(str::to_owned));
    }

    fn remove(&mut self, key: &EndpointKey, fx: &mut Effects) {
        let Some(managed) = self.table.remove(key) else {
            return;
        };
        for ip in &managed.source.ips {
            self.disown(*ip, key);
            fx.ips.insert(*ip);
        }
        self.interface_users(managed.source.interface.name(), -1);
        fx.interfaces
            .extend(managed.source.interface.name().map(str::to_owned));
        if let Ok(labels) = &managed.wanted {
            self.cache.release(labels, key);
        }
        if managed.held.is_some() {
            fx.reports.push(Report::Delete(key.clone()));
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

    fn identity_labels(&self, source: &SourceEndpoint) -> Result<LabelSet, String> {
        let settings = &self.settings;
        if source.ips.len() > settings.max_ips {
            return Err(format!(
                "{} addresses, over the operator's limit of {}",
                source.ips.len(),
                settings.max_ips
            ));
        }
        LabelSet::for_pod(
            &source.labels,
            source.key.namespace(),
            &source.service_account,
            &settings.filter,
            &settings.limits,
        )
        .map_err(|e| e.to_string())
    }

    /// The operator answered `id` for `labels`.
    pub fn allocated(&mut self, labels: &LabelSet, id: IdentityId, fx: &mut Effects) {
        for key in self.cache.resolved(labels, id) {
            self.hold(&key, id, labels, fx);
        }
    }

    /// An allocation attempt for `labels` failed; it is retried.
    pub fn allocation_failed(&mut self, labels: &LabelSet, error: &str, refused: bool) {
        for key in self.cache.users(labels) {
            if let Some(managed) = self.table.get_mut(&key) {
                managed.allocation_error = Some((error.to_owned(), refused));
            }
        }
    }

    /// The operator says `key` must use `id`: every endpoint of the same label set
    /// follows. `false` if the endpoint is unknown or holds no identity.
    pub fn rebind(&mut self, key: &EndpointKey, id: IdentityId, fx: &mut Effects) -> bool {
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
                self.hold(&user, id, &held.labels, fx);
            }
        } else {
            self.hold(key, id, &held.labels, fx);
        }
        true
    }

    fn hold(&mut self, key: &EndpointKey, id: IdentityId, labels: &LabelSet, fx: &mut Effects) {
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
        fx.ips.extend(managed.source.ips.iter().copied());
        fx.interfaces
            .extend(managed.source.interface.name().map(str::to_owned));
        report(key, managed, fx);
    }

    /// The operator's word on what it was sent (from an Ack).
    pub fn on_verdict(&mut self, verdict: Verdict) {
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
    pub fn set_settings(&mut self, settings: LabelSettings, fx: &mut Effects) {
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
                self.relabel(&key, &mut managed, wanted, fx);
                if managed.held != before {
                    report(&key, &managed, fx);
                }
            }
            self.table.insert(key, managed);
        }
    }

    /// The node's own addresses, flagged HOST in ENDPOINTS.
    pub fn set_host_ips(&mut self, ips: BTreeSet<IpAddr>, fx: &mut Effects) {
        if ips == self.host_ips {
            return;
        }
        fx.ips
            .extend(ips.symmetric_difference(&self.host_ips).copied());
        self.host_ips = ips;
    }

    /// The ENDPOINTS entry `ip` should have.
    pub fn desired(&self, ip: IpAddr) -> Option<bpf::Endpoint> {
        let owner = self
            .owners
            .get(&ip)
            .and_then(|owners| owners.first())
            .and_then(|key| self.table.get(key));
        match owner.and_then(|m| m.held.as_ref().map(|held| (m, held))) {
            Some((m, held)) => Some(match m.source.interface {
                HostInterface::Named(_) => bpf::Endpoint::local(held.id.get()),
                // No census program sees its packets leave: it must not be skipped
                // where they enter another local endpoint.
                HostInterface::Unknown(_) => bpf::Endpoint::unattached(held.id.get()),
            }),
            None if self.host_ips.contains(&ip) => Some(bpf::Endpoint::host()),
            None => None,
        }
    }

    /// Interfaces the classifier should be attached to.
    pub fn desired_interfaces(&self) -> usize {
        self.interfaces.len()
    }

    pub fn interface_wanted(&self, interface: &str) -> bool {
        self.interfaces.contains_key(interface)
    }

    /// The whole desired datapath state.
    pub fn desired_all(&self) -> Desired {
        let mut entries: HashMap<IpAddr, bpf::Endpoint> = self
            .host_ips
            .iter()
            .map(|ip| (*ip, bpf::Endpoint::host()))
            .collect();
        for ip in self.owners.keys() {
            if let Some(endpoint) = self.desired(*ip) {
                entries.insert(*ip, endpoint);
            }
        }
        Desired {
            entries,
            interfaces: self.interfaces.keys().cloned().collect(),
            interface_identities: self
                .interface_identities()
                .into_iter()
                .map(|(interface, id)| (interface.to_owned(), id))
                .collect(),
        }
    }

    /// The interfaces behind which every endpoint holds one same identity, and
    /// that identity: the classifier takes it as the local side of every packet
    /// there (INTERFACES), whatever address the packet carries. An interface with
    /// an endpoint still waiting for its identity, or endpoints of different
    /// identities, is not listed: its packets are counted by address.
    pub fn interface_identities(&self) -> HashMap<&str, u32> {
        let mut identities: HashMap<&str, Option<u32>> = HashMap::new();
        for managed in self.table.values() {
            let Some(interface) = managed.source.interface.name() else {
                continue;
            };
            let id = managed.held.as_ref().map(|held| held.id.get());
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

    /// Records the outcome of writing the entries of `touched` (the failures among them).
    pub fn record_entry_results(
        &mut self,
        touched: &BTreeSet<IpAddr>,
        failures: &[(IpAddr, bpf::Error)],
    ) {
        let failed: HashMap<IpAddr, String> = failures
            .iter()
            .map(|(ip, e)| (*ip, format!("writing ENDPOINTS[{ip}]: {e}")))
            .collect();
        let keys: BTreeSet<EndpointKey> = touched
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
                    .find_map(|ip| failed.get(ip).cloned());
            }
        }
    }

    /// Records the outcome of attaching to `touched` (the failures among them).
    pub fn record_interface_results(
        &mut self,
        touched: &BTreeSet<String>,
        failures: &[(String, bpf::Error)],
    ) {
        let failed: HashMap<&str, String> = failures
            .iter()
            .map(|(i, e)| (i.as_str(), e.to_string()))
            .collect();
        for managed in self.table.values_mut() {
            if let Some(name) = managed.source.interface.name()
                && touched.contains(name)
            {
                managed.interface_error = failed.get(name).cloned();
            }
        }
    }

    /// Every managed endpoint, for the endpoints API, sorted by namespace/name.
    pub fn view(&self) -> Vec<api::EndpointStatus> {
        self.table
            .iter()
            .map(|(key, m)| {
                let (state, error) = self.state_of(key, m);
                api::EndpointStatus {
                    namespace: key.namespace().to_owned(),
                    name: key.name().to_owned(),
                    ips: m.source.ips.iter().map(ToString::to_string).collect(),
                    interface: m.source.interface.name().unwrap_or_default().to_owned(),
                    identity: m.held.as_ref().map(|h| h.id.get()),
                    labels: m
                        .wanted
                        .as_ref()
                        .map(LabelSet::to_strings)
                        .unwrap_or_default(),
                    state,
                    error,
                    extra: api::Extra::new(),
                }
            })
            .collect()
    }

    /// Endpoints by state: (programmed, waiting, error).
    pub fn counts(&self) -> (u64, u64, u64) {
        let mut counts = (0, 0, 0);
        for (key, m) in &self.table {
            match self.state_of(key, m).0 {
                api::EndpointState::Programmed => counts.0 += 1,
                api::EndpointState::WaitingForIdentity => counts.1 += 1,
                api::EndpointState::Error => counts.2 += 1,
                // What a reader makes of a newer agent's state; this core has none.
                api::EndpointState::Unknown => {}
            }
        }
        counts
    }

    fn state_of(&self, key: &EndpointKey, m: &Managed) -> (api::EndpointState, Option<String>) {
        let conflict = m.source.ips.iter().find_map(|ip| {
            let owner = self.owners.get(ip)?.first()?;
            (owner != key).then(|| format!("address {ip} is also endpoint {owner}'s"))
        });
        let error = match (&m.wanted, &m.allocation_error, &m.operator) {
            (Err(reason), _, _) => Some(format!("no identity labels: {reason}")),
            (Ok(_), Some((error, true)), _) => {
                Some(format!("the operator refused the labels: {error}"))
            }
            (Ok(_), _, Some(Mark::Rejected(reason))) => {
                Some(format!("the operator rejected it: {reason}"))
            }
            _ => conflict
                .or_else(|| m.map_error.clone())
                .or_else(|| m.interface_error.clone())
                .or_else(|| match &m.source.interface {
                    HostInterface::Unknown(why) => Some(format!("no host-side interface: {why}")),
                    HostInterface::Named(_) => None,
                }),
        };
        if let Some(error) = error {
            return (api::EndpointState::Error, Some(error));
        }
        let current = matches!((&m.wanted, &m.held), (Ok(w), Some(h)) if *w == h.labels);
        let pending = m.operator == Some(Mark::Pending);
        if current && !pending {
            (api::EndpointState::Programmed, None)
        } else {
            let waiting = m.allocation_error.as_ref().map(|(e, _)| e.clone());
            let waiting = waiting.or_else(|| pending.then(|| PENDING.to_owned()));
            (api::EndpointState::WaitingForIdentity, waiting)
        }
    }

    /// The endpoints that hold an identity, as reported to the operator.
    pub fn reported(&self) -> Vec<Endpoint> {
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

fn report(key: &EndpointKey, managed: &Managed, fx: &mut Effects) {
    fx.reports.push(match to_report(key, managed) {
        Some(endpoint) => Report::Upsert(endpoint),
        None => Report::Delete(key.clone()),
    });
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::reconcile::{MapKey, Reconciler, fake::FakeMaps};

    fn ep(name: &str, ip: &str, app: &str) -> SourceEndpoint {
        let ip: IpAddr = ip.parse().unwrap_or(IpAddr::from([0, 0, 0, 0]));
        SourceEndpoint {
            key: EndpointKey::new("default", name).unwrap_or_else(|e| panic!("{e}")),
            ips: vec![ip].into_boxed_slice(),
            labels: BTreeMap::from([("app".to_owned(), app.to_owned())]),
            service_account: "default".to_owned(),
            interface: HostInterface::Named(format!("veth{name}")),
        }
    }

    fn id(n: u32) -> IdentityId {
        IdentityId::new(n).unwrap_or(IdentityId::WORLD)
    }

    fn labels_of(e: &Endpoints, name: &str) -> LabelSet {
        let key = EndpointKey::new("default", name).unwrap_or_else(|e| panic!("{e}"));
        match &e.table[&key].wanted {
            Ok(l) => l.clone(),
            Err(reason) => panic!("{reason}"),
        }
    }

    /// Applies effects to a fake datapath, as the daemon does.
    fn apply(e: &mut Endpoints, r: &mut Reconciler, maps: &mut FakeMaps, fx: &Effects) {
        let failures = r.apply_ips(maps, fx.ips.iter().copied(), |ip| e.desired(ip), e.synced());
        e.record_entry_results(&fx.ips, &failures);
    }

    fn entries(maps: &FakeMaps) -> Vec<(String, u32)> {
        maps.entries
            .iter()
            .map(|(k, v)| {
                (
                    k.ip().map(|i| i.to_string()).unwrap_or_default(),
                    v.identity,
                )
            })
            .collect()
    }

    #[test]
    fn endpoints_are_written_once_their_identity_is_known() {
        let mut e = Endpoints::new(&BTreeMap::new());
        let (mut r, mut maps) = (Reconciler::default(), FakeMaps::default());
        let mut fx = Effects::default();
        e.on_source(
            SourceEvent::Reset(vec![
                ep("web-0", "198.18.1.2", "web"),
                ep("web-1", "198.18.2.2", "web"),
                ep("db-0", "198.18.3.2", "db"),
            ]),
            &mut fx,
        );
        assert_eq!(fx.allocations.len(), 2, "one request per label set");
        assert!(fx.reports.is_empty(), "nothing held yet, nothing reported");
        apply(&mut e, &mut r, &mut maps, &fx);
        assert!(maps.entries.is_empty(), "waiting endpoints are not written");
        assert_eq!(e.counts(), (0, 3, 0));

        let mut fx = Effects::default();
        e.allocated(&labels_of(&e, "web-0"), id(300), &mut fx);
        apply(&mut e, &mut r, &mut maps, &fx);
        assert_eq!(
            entries(&maps),
            vec![("198.18.1.2".into(), 300), ("198.18.2.2".into(), 300)]
        );
        assert_eq!(fx.reports.len(), 2);
        assert_eq!(e.counts(), (2, 1, 0));
        let view = e.view();
        assert_eq!(view[0].name, "db-0", "sorted by namespace/name");
        assert_eq!(view[0].identity, None);
        assert_eq!(view[1].identity, Some(300));
        assert!(view[1].labels.contains(&"k8s:app=web".to_owned()));
    }

    #[test]
    fn deleting_an_endpoint_removes_its_entry_and_reports_it() {
        let mut e = Endpoints::new(&BTreeMap::new());
        let (mut r, mut maps) = (Reconciler::default(), FakeMaps::default());
        let mut fx = Effects::default();
        e.on_source(
            SourceEvent::Reset(vec![ep("web-0", "198.18.1.2", "web")]),
            &mut fx,
        );
        e.allocated(&labels_of(&e, "web-0"), id(300), &mut fx);
        apply(&mut e, &mut r, &mut maps, &fx);

        let mut fx = Effects::default();
        e.on_source(SourceEvent::Reset(vec![]), &mut fx);
        apply(&mut e, &mut r, &mut maps, &fx);
        assert!(maps.entries.is_empty());
        assert!(matches!(fx.reports.as_slice(), [Report::Delete(k)] if k.name() == "web-0"));
        assert!(e.cache().is_empty(), "the identity is no longer in use");
        assert!(!e.interface_wanted("vethweb-0"));
    }

    #[test]
    fn a_label_change_keeps_the_old_identity_until_the_new_one_is_known() {
        let mut e = Endpoints::new(&BTreeMap::new());
        let (mut r, mut maps) = (Reconciler::default(), FakeMaps::default());
        let mut fx = Effects::default();
        e.on_source(
            SourceEvent::Reset(vec![ep("web-0", "198.18.1.2", "web")]),
            &mut fx,
        );
        e.allocated(&labels_of(&e, "web-0"), id(300), &mut fx);
        apply(&mut e, &mut r, &mut maps, &fx);

        let mut fx = Effects::default();
        e.on_source(
            SourceEvent::Upsert(ep("web-0", "198.18.1.2", "api")),
            &mut fx,
        );
        assert_eq!(fx.allocations.len(), 1);
        apply(&mut e, &mut r, &mut maps, &fx);
        assert_eq!(
            entries(&maps),
            vec![("198.18.1.2".into(), 300)],
            "fail-static"
        );
        assert_eq!(e.counts(), (0, 1, 0));

        let mut fx = Effects::default();
        e.allocated(&labels_of(&e, "web-0"), id(301), &mut fx);
        apply(&mut e, &mut r, &mut maps, &fx);
        assert_eq!(entries(&maps), vec![("198.18.1.2".into(), 301)]);
        assert_eq!(e.cache().ids(), [id(301)].into(), "the old set is dropped");
    }

    #[test]
    fn rebind_moves_every_endpoint_of_the_label_set() {
        let mut e = Endpoints::new(&BTreeMap::new());
        let (mut r, mut maps) = (Reconciler::default(), FakeMaps::default());
        let mut fx = Effects::default();
        e.on_source(
            SourceEvent::Reset(vec![
                ep("web-0", "198.18.1.2", "web"),
                ep("web-1", "198.18.2.2", "web"),
            ]),
            &mut fx,
        );
        e.allocated(&labels_of(&e, "web-0"), id(300), &mut fx);
        apply(&mut e, &mut r, &mut maps, &fx);

        let mut fx = Effects::default();
        let key = EndpointKey::new("default", "web-0").unwrap_or_else(|e| panic!("{e}"));
        assert!(e.rebind(&key, id(400), &mut fx));
        apply(&mut e, &mut r, &mut maps, &fx);
        assert_eq!(
            entries(&maps),
            vec![("198.18.1.2".into(), 400), ("198.18.2.2".into(), 400)]
        );
        assert_eq!(
            fx.reports.len(),
            2,
            "both are reported with the new identity"
        );
        let unknown = EndpointKey::new("default", "nope").unwrap_or_else(|e| panic!("{e}"));
        assert!(!e.rebind(&unknown, id(5), &mut Effects::default()));
    }

    #[test]
    fn a_restarted_agent_keeps_the_identities_the_maps_held() {
        let found = BTreeMap::from([
            (
                MapKey::from(
                    "198.18.1.2"
                        .parse::<IpAddr>()
                        .unwrap_or(IpAddr::from([0; 4])),
                ),
                bpf::Endpoint::local(300),
            ),
            (
                MapKey::from(
                    "198.18.9.9"
                        .parse::<IpAddr>()
                        .unwrap_or(IpAddr::from([0; 4])),
                ),
                bpf::Endpoint::local(301),
            ),
        ]);
        let mut e = Endpoints::new(&found);
        let mut fx = Effects::default();
        e.on_source(
            SourceEvent::Reset(vec![
                ep("web-0", "198.18.1.2", "web"),
                ep("db-0", "198.18.3.2", "db"),
            ]),
            &mut fx,
        );
        let reported: Vec<(String, u32)> = e
            .reported()
            .iter()
            .map(|r| (r.key.to_string(), r.identity.get()))
            .collect();
        assert_eq!(reported, vec![("default/web-0".to_owned(), 300)]);
        assert_eq!(fx.allocations.len(), 2, "the operator is still asked");
        assert_eq!(
            e.desired("198.18.1.2".parse().unwrap_or(IpAddr::from([0; 4]))),
            Some(bpf::Endpoint::local(300))
        );
        assert_eq!(
            e.desired("198.18.9.9".parse().unwrap_or(IpAddr::from([0; 4]))),
            None,
            "an address no endpoint claims is removed"
        );
    }

    #[test]
    fn invalid_labels_are_an_error_not_an_identity() {
        let mut e = Endpoints::new(&BTreeMap::new());
        let mut fx = Effects::default();
        e.set_settings(
            LabelSettings {
                limits: LabelLimits { max_labels: 2 },
                ..LabelSettings::default()
            },
            &mut fx,
        );
        e.on_source(
            SourceEvent::Reset(vec![ep("web-0", "198.18.1.2", "web")]),
            &mut fx,
        );
        assert!(fx.allocations.is_empty());
        let view = e.view();
        assert_eq!(view[0].state, api::EndpointState::Error);
        assert!(
            view[0]
                .error
                .as_deref()
                .is_some_and(|e| e.contains("exceed the limit of 2"))
        );
    }

    fn key(name: &str) -> EndpointKey {
        EndpointKey::new("default", name).unwrap_or_else(|e| panic!("{e}"))
    }

    fn verdict(scope: VerdictScope, rejected: &[(&str, &str)], pending: &[&str]) -> Verdict {
        Verdict {
            scope,
            rejected: rejected
                .iter()
                .map(|(name, reason)| (key(name), (*reason).to_owned()))
                .collect(),
            pending: pending.iter().map(|name| key(name)).collect(),
        }
    }

    fn state(e: &Endpoints, name: &str) -> (api::EndpointState, Option<String>) {
        let view = e.view();
        let status = view.iter().find(|s| s.name == name);
        status.map_or((api::EndpointState::Unknown, None), |s| {
            (s.state, s.error.clone())
        })
    }

    #[test]
    fn the_operators_verdicts_mark_endpoints_until_an_ack_says_otherwise() {
        let mut e = Endpoints::new(&BTreeMap::new());
        let mut fx = Effects::default();
        e.on_source(
            SourceEvent::Reset(vec![
                ep("web-0", "198.18.1.2", "web"),
                ep("db-0", "198.18.2.2", "db"),
                ep("api-0", "198.18.3.2", "api"),
            ]),
            &mut fx,
        );
        for name in ["web-0", "db-0", "api-0"] {
            e.allocated(&labels_of(&e, name), id(300), &mut fx);
        }
        assert_eq!(e.counts(), (3, 0, 0));

        // A snapshot's Ack speaks for every endpoint.
        e.on_verdict(verdict(
            VerdictScope::All,
            &[("web-0", "labels[0]: bad"), ("gone-0", "labels[0]: bad")],
            &["db-0"],
        ));
        assert_eq!(
            state(&e, "web-0"),
            (
                api::EndpointState::Error,
                Some("the operator rejected it: labels[0]: bad".to_owned())
            )
        );
        assert_eq!(
            state(&e, "db-0"),
            (
                api::EndpointState::WaitingForIdentity,
                Some(PENDING.to_owned())
            )
        );
        assert_eq!(e.counts(), (1, 1, 1));

        // A delta's Ack speaks for its own endpoint only.
        e.on_verdict(verdict(VerdictScope::One(key("api-0")), &[], &[]));
        assert_eq!(e.counts(), (1, 1, 1));
        e.on_verdict(verdict(
            VerdictScope::One(key("api-0")),
            &[("api-0", "ips[0]: bad")],
            &[],
        ));
        assert_eq!(e.counts(), (0, 1, 2));
        e.on_verdict(verdict(VerdictScope::One(key("api-0")), &[], &[]));
        assert_eq!(e.counts(), (1, 1, 1));

        // A Rebind decides a pending endpoint; a snapshot that names nobody clears all.
        assert!(e.rebind(&key("db-0"), id(301), &mut Effects::default()));
        assert_eq!(state(&e, "db-0"), (api::EndpointState::Programmed, None));
        e.on_verdict(verdict(VerdictScope::All, &[], &[]));
        assert_eq!(e.counts(), (3, 0, 0));
    }

    #[test]
    fn host_addresses_are_flagged_host_unless_an_endpoint_holds_them() {
        let mut e = Endpoints::new(&BTreeMap::new());
        let mut fx = Effects::default();
        let node: IpAddr = "198.18.1.1".parse().unwrap_or(IpAddr::from([0; 4]));
        e.set_host_ips([node].into(), &mut fx);
        assert!(fx.ips.contains(&node));
        assert_eq!(e.desired(node), Some(bpf::Endpoint::host()));
        assert_eq!(e.desired_all().entries.len(), 1);
    }

    #[test]
    fn an_endpoint_without_an_interface_is_written_and_shows_why() {
        let mut e = Endpoints::new(&BTreeMap::new());
        let (mut r, mut maps) = (Reconciler::default(), FakeMaps::default());
        let mut fx = Effects::default();
        let mut lost = ep("web-0", "198.18.1.2", "web");
        lost.interface = HostInterface::Unknown("no route to 198.18.1.2 (unreachable)".into());
        e.on_source(SourceEvent::Reset(vec![lost]), &mut fx);
        assert!(fx.interfaces.is_empty(), "nothing to attach");
        e.allocated(&labels_of(&e, "web-0"), id(300), &mut fx);
        apply(&mut e, &mut r, &mut maps, &fx);
        assert_eq!(entries(&maps), vec![("198.18.1.2".into(), 300)]);
        assert_eq!(
            e.desired(
                "198.18.1.2"
                    .parse()
                    .unwrap_or(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED))
            ),
            Some(bpf::Endpoint::unattached(300)),
            "not LOCAL: no census hook counts its packets as they leave it"
        );
        assert_eq!(fx.reports.len(), 1, "the operator counts it");
        let view = e.view();
        assert_eq!(view[0].state, api::EndpointState::Error);
        assert_eq!(
            view[0].error.as_deref(),
            Some("no host-side interface: no route to 198.18.1.2 (unreachable)")
        );
        assert_eq!(view[0].interface, "");
        assert_eq!(e.desired_interfaces(), 0);

        let mut fx = Effects::default();
        e.on_source(
            SourceEvent::Upsert(ep("web-0", "198.18.1.2", "web")),
            &mut fx,
        );
        assert!(fx.interfaces.contains("vethweb-0"), "found later: attached");
        assert_eq!(e.counts(), (1, 0, 0));
    }

    #[test]
    fn an_interface_carries_the_identity_every_endpoint_behind_it_holds() {
        let mut e = Endpoints::new(&BTreeMap::new());
        let mut fx = Effects::default();
        let mut web1 = ep("web-1", "198.18.2.2", "web");
        web1.interface = HostInterface::Named("vethweb-0".into());
        let mut db1 = ep("db-1", "198.18.4.2", "db");
        db1.interface = HostInterface::Named("vethdb-0".into());
        e.on_source(
            SourceEvent::Reset(vec![
                ep("web-0", "198.18.1.2", "web"),
                web1,
                ep("db-0", "198.18.3.2", "db"),
                db1,
                ep("api-0", "198.18.5.2", "api"),
            ]),
            &mut fx,
        );
        assert!(e.interface_identities().is_empty(), "nobody holds one yet");

        let mut fx = Effects::default();
        e.allocated(&labels_of(&e, "web-0"), id(300), &mut fx);
        e.allocated(&labels_of(&e, "db-0"), id(301), &mut fx);
        assert!(
            fx.interfaces.contains("vethweb-0") && fx.interfaces.contains("vethdb-0"),
            "an identity known is an INTERFACES entry to write: {:?}",
            fx.interfaces
        );
        assert_eq!(
            e.interface_identities(),
            HashMap::from([("vethweb-0", 300), ("vethdb-0", 301)]),
            "api-0 still waits: its interface has no identity"
        );

        // db-1 moves to another label set: two identities behind one interface.
        let mut fx = Effects::default();
        let mut db1 = ep("db-1", "198.18.4.2", "cache");
        db1.interface = HostInterface::Named("vethdb-0".into());
        e.on_source(SourceEvent::Upsert(db1), &mut fx);
        e.allocated(&labels_of(&e, "db-1"), id(302), &mut fx);
        assert!(fx.interfaces.contains("vethdb-0"));
        assert_eq!(
            e.interface_identities(),
            HashMap::from([("vethweb-0", 300)])
        );
        assert_eq!(
            e.desired_all().interface_identities,
            HashMap::from([("vethweb-0".to_owned(), 300)])
        );
    }

    #[test]
    fn a_source_failure_keeps_everything() {
        let mut e = Endpoints::new(&BTreeMap::new());
        let mut fx = Effects::default();
        e.on_source(
            SourceEvent::Reset(vec![ep("web-0", "198.18.1.2", "web")]),
            &mut fx,
        );
        let mut fx = Effects::default();
        e.on_source(
            SourceEvent::Failed(SourceFailure {
                kind: "parse",
                detail: "x.yaml: bad".into(),
            }),
            &mut fx,
        );
        assert!(fx.is_empty());
        assert_eq!(e.len(), 1);
        assert_eq!(e.source_error().map(|f| f.kind), Some("parse"));
    }
}
