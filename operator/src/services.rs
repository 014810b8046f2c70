//! The cluster's Service addresses, from every source: the ranges of
//! `--service-cidr`, the ServiceCIDR objects' ranges and the Services' LoadBalancer
//! and external IPs (the last two fed by [`crate::k8s::services`]). Their union,
//! each range once, is what agents are sent ([`Runtime::set_services`]): it is
//! given to the runtime whenever it changes.
//!
//! Memory: per ServiceCIDR its ranges, per Service with an address its key and
//! addresses; a Service without one holds nothing, and no object is kept.

use std::{collections::HashMap, net::IpAddr, sync::Arc};

use census_proto::domain::{ServiceKind, ServiceSet};
use ipnet::IpNet;
use parking_lot::Mutex;
use tracing::{debug, warn};

use crate::runtime::Runtime;

/// A Service's addresses, as [`ServiceAddresses`] keeps them.
pub type Addresses = Box<[(IpAddr, ServiceKind)]>;

/// See the module documentation.
#[derive(Debug)]
pub struct ServiceAddresses {
    /// `--service-cidr`.
    fixed: Box<[IpNet]>,
    sources: Mutex<Sources>,
    runtime: Arc<Runtime>,
}

#[derive(Debug, Default)]
struct Sources {
    /// ServiceCIDR name -> its ranges.
    cidrs: HashMap<Box<str>, Box<[IpNet]>>,
    /// Service `namespace/name` -> its LoadBalancer and external IPs (never empty).
    services: HashMap<Box<str>, Addresses>,
}

impl ServiceAddresses {
    /// The sources with `fixed` alone so far; the runtime has their set at once.
    pub fn new(fixed: Vec<IpNet>, runtime: Arc<Runtime>) -> Arc<Self> {
        let this = Self {
            fixed: fixed.into_boxed_slice(),
            sources: Mutex::default(),
            runtime,
        };
        this.publish(&this.sources.lock());
        Arc::new(this)
    }

    /// The union as it is now.
    pub fn set(&self) -> ServiceSet {
        self.union(&self.sources.lock())
    }

    /// Replaces every ServiceCIDR's ranges with a fresh list (a watch's restart:
    /// objects gone meanwhile are gone).
    pub fn reset_cidrs(&self, listed: impl IntoIterator<Item = (String, Vec<IpNet>)>) {
        let mut sources = self.sources.lock();
        sources.cidrs = listed
            .into_iter()
            .map(|(name, ranges)| (name.into_boxed_str(), ranges.into_boxed_slice()))
            .collect();
        self.publish(&sources);
    }

    pub fn set_cidrs(&self, name: &str, ranges: Vec<IpNet>) {
        let mut sources = self.sources.lock();
        if sources.cidrs.get(name).map(|r| &**r) == Some(ranges.as_slice()) {
            return;
        }
        sources.cidrs.insert(name.into(), ranges.into_boxed_slice());
        self.publish(&sources);
    }

    pub fn remove_cidrs(&self, name: &str) {
        let mut sources = self.sources.lock();
        if sources.cidrs.remove(name).is_some() {
            self.publish(&sources);
        }
    }

    /// Replaces every Service's addresses with a fresh list.
    pub fn reset_services(&self, listed: impl IntoIterator<Item = (String, Addresses)>) {
        let mut sources = self.sources.lock();
        sources.services = listed
            .into_iter()
            .filter(|(_, addresses)| !addresses.is_empty())
            .map(|(key, addresses)| (key.into_boxed_str(), addresses))
            .collect();
        sources.services.shrink_to_fit();
        self.publish(&sources);
    }

    /// Service `key`'s addresses are `addresses` now (none: it holds nothing).
    pub fn set_service(&self, key: &str, addresses: Addresses) {
        let mut sources = self.sources.lock();
        if addresses.is_empty() {
            if sources.services.remove(key).is_some() {
                self.publish(&sources);
            }
            return;
        }
        if sources.services.get(key) == Some(&addresses) {
            return;
        }
        sources.services.insert(key.into(), addresses);
        self.publish(&sources);
    }

    pub fn remove_service(&self, key: &str) {
        self.set_service(key, Box::default());
    }

    /// Services with an address kept.
    pub fn services_with_addresses(&self) -> usize {
        self.sources.lock().services.len()
    }

    fn union(&self, sources: &Sources) -> ServiceSet {
        let fixed = self
            .fixed
            .iter()
            .chain(sources.cidrs.values().flatten())
            .map(|range| (*range, ServiceKind::ClusterIpRange));
        let addresses = sources
            .services
            .values()
            .flatten()
            .map(|(ip, kind)| (IpNet::from(*ip), *kind));
        fixed.chain(addresses).collect()
    }

    /// Gives the runtime the union (it takes an unchanged set as no change).
    fn publish(&self, sources: &Sources) {
        let mut set = self.union(sources);
        if set.len() > ServiceSet::MAX_RANGES {
            warn!(
                ranges = set.len(),
                max = ServiceSet::MAX_RANGES,
                "more Service addresses than agents hold: the rest are left out"
            );
            set = set.iter().take(ServiceSet::MAX_RANGES).collect();
        }
        let ranges = set.len();
        if self.runtime.set_services(set) {
            debug!(ranges, "the cluster's Service addresses changed");
        }
    }
}
