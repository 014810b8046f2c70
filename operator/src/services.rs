//! The cluster's Service addresses, from every source: the ranges of
//! `--service-cidr`, the ServiceCIDR objects' ranges and the Services' LoadBalancer
//! and external IPs (the last two fed by [`crate::k8s::services`]). Their union,
//! each range once, is what agents are sent ([`Runtime::set_services`]): it is
//! given to the runtime whenever it changes.
//!
//! Each Service's ClusterIPs are named with its `namespace/name` and ports in the
//! set ([`ServiceSet::insert_cluster_ip`]), for what agents count per Service.
//!
//! Memory: per ServiceCIDR its ranges, per Service with an address its key and
//! addresses, per Service with a ClusterIP its key, ClusterIPs and ports; a
//! headless Service without other addresses holds nothing, and no object is
//! kept.

use std::{collections::HashMap, net::IpAddr, sync::Arc};

use census_proto::domain::{ClusterIpService, EndpointKey, ServiceKind, ServicePort, ServiceSet};
use ipnet::IpNet;
use parking_lot::Mutex;
use tracing::{debug, warn};

use crate::runtime::Runtime;

/// The ServiceCIDRs, as a source still to be read.
const CIDRS: u8 = 1;
/// The Services, as a source still to be read.
const SERVICES: u8 = 2;

/// A Service's addresses, as [`ServiceAddresses`] keeps them.
pub type Addresses = Box<[(IpAddr, ServiceKind)]>;

/// A Service's ClusterIPs (each once, every family) and ports, as
/// [`ServiceAddresses`] keeps them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterIps {
    pub ips: Box<[IpAddr]>,
    pub ports: Box<[ServicePort]>,
}

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
    /// Sources not read in full yet ([`CIDRS`], [`SERVICES`]): nothing is given
    /// to the runtime before they are, so agents never take a partial set.
    pending: u8,
    /// ServiceCIDR name -> its ranges.
    cidrs: HashMap<Box<str>, Box<[IpNet]>>,
    /// Service `namespace/name` -> its LoadBalancer and external IPs (never empty).
    services: HashMap<Box<str>, Addresses>,
    /// Service `namespace/name` -> its ClusterIPs and ports.
    cluster_ips: HashMap<Box<str>, ClusterIps>,
}

impl ServiceAddresses {
    /// `fixed` alone (embedded mode): the runtime has the set at once.
    pub fn new(fixed: Vec<IpNet>, runtime: Arc<Runtime>) -> Arc<Self> {
        Self::with_pending(fixed, runtime, 0)
    }

    /// `fixed` and what the ServiceCIDR and Service watches will list: the runtime
    /// has the set once both have listed (or the API server serves no
    /// ServiceCIDRs, [`ServiceAddresses::cidrs_not_served`]).
    pub fn listing(fixed: Vec<IpNet>, runtime: Arc<Runtime>) -> Arc<Self> {
        Self::with_pending(fixed, runtime, CIDRS | SERVICES)
    }

    fn with_pending(fixed: Vec<IpNet>, runtime: Arc<Runtime>, pending: u8) -> Arc<Self> {
        let this = Self {
            fixed: fixed.into_boxed_slice(),
            sources: Mutex::new(Sources {
                pending,
                ..Sources::default()
            }),
            runtime,
        };
        this.publish(&this.sources.lock());
        Arc::new(this)
    }

    /// The API server serves no ServiceCIDRs (before Kubernetes 1.33): there are
    /// none to wait for.
    pub fn cidrs_not_served(&self) {
        let mut sources = self.sources.lock();
        if sources.pending & CIDRS != 0 {
            sources.pending &= !CIDRS;
            self.publish(&sources);
        }
    }

    /// Replaces every ServiceCIDR's ranges with a fresh list (a watch's restart:
    /// objects gone meanwhile are gone).
    pub fn reset_cidrs(&self, listed: impl IntoIterator<Item = (String, Vec<IpNet>)>) {
        let mut sources = self.sources.lock();
        sources.cidrs = listed
            .into_iter()
            .map(|(name, ranges)| (name.into_boxed_str(), ranges.into_boxed_slice()))
            .collect();
        sources.pending &= !CIDRS;
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
        self.reset_named_services(
            listed
                .into_iter()
                .map(|(key, addresses)| (key, addresses, None)),
        );
    }

    /// Replaces every Service's addresses and ClusterIPs with a fresh list.
    pub fn reset_named_services(
        &self,
        listed: impl IntoIterator<Item = (String, Addresses, Option<ClusterIps>)>,
    ) {
        let mut sources = self.sources.lock();
        sources.services.clear();
        sources.cluster_ips.clear();
        for (key, addresses, cluster_ips) in listed {
            let key = key.into_boxed_str();
            if let Some(cluster_ips) = cluster_ips {
                sources.cluster_ips.insert(key.clone(), cluster_ips);
            }
            if !addresses.is_empty() {
                sources.services.insert(key, addresses);
            }
        }
        sources.services.shrink_to_fit();
        sources.cluster_ips.shrink_to_fit();
        sources.pending &= !SERVICES;
        self.publish(&sources);
    }

    /// Service `key`'s addresses and ClusterIPs are these now (a Service
    /// holding neither holds nothing).
    pub fn set_named_service(
        &self,
        key: &str,
        addresses: Addresses,
        cluster_ips: Option<ClusterIps>,
    ) {
        let mut sources = self.sources.lock();
        let renamed = if sources.cluster_ips.get(key) == cluster_ips.as_ref() {
            false
        } else {
            match cluster_ips {
                Some(cluster_ips) => sources.cluster_ips.insert(key.into(), cluster_ips),
                None => sources.cluster_ips.remove(key),
            };
            true
        };
        let moved = Self::set_addresses(&mut sources, key, addresses);
        if renamed || moved {
            self.publish(&sources);
        }
    }

    /// Sets `key`'s addresses in `sources`; whether they changed.
    fn set_addresses(sources: &mut Sources, key: &str, addresses: Addresses) -> bool {
        if addresses.is_empty() {
            return sources.services.remove(key).is_some();
        }
        if sources.services.get(key) == Some(&addresses) {
            return false;
        }
        sources.services.insert(key.into(), addresses);
        true
    }

    /// Service `key`'s addresses are `addresses` now (none: it holds nothing).
    pub fn set_service(&self, key: &str, addresses: Addresses) {
        let mut sources = self.sources.lock();
        if Self::set_addresses(&mut sources, key, addresses) {
            self.publish(&sources);
        }
    }

    pub fn remove_service(&self, key: &str) {
        self.set_named_service(key, Box::default(), None);
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
        let mut set: ServiceSet = fixed.chain(addresses).collect();
        for (key, cluster_ips) in &sources.cluster_ips {
            let Ok(key) = key.parse::<EndpointKey>() else {
                continue;
            };
            let service = ClusterIpService {
                key,
                ports: cluster_ips.ports.clone(),
            };
            for ip in &cluster_ips.ips {
                set.insert_cluster_ip(*ip, service.clone());
            }
        }
        set
    }

    /// Gives the runtime the union (it takes an unchanged set as no change), once
    /// every source has been read in full.
    fn publish(&self, sources: &Sources) {
        if sources.pending != 0 {
            return;
        }
        let mut set = self.union(sources);
        if set.len() > ServiceSet::MAX_RANGES
            || set.cluster_ips().len() > ServiceSet::MAX_CLUSTER_IPS
        {
            warn!(
                ranges = set.len(),
                max = ServiceSet::MAX_RANGES,
                cluster_ips = set.cluster_ips().len(),
                max_cluster_ips = ServiceSet::MAX_CLUSTER_IPS,
                "more Service addresses than agents hold: the rest are left out"
            );
            set.truncate(ServiceSet::MAX_RANGES, ServiceSet::MAX_CLUSTER_IPS);
        }
        let ranges = set.len();
        if self.runtime.set_services(set) {
            debug!(ranges, "the cluster's Service addresses changed");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use census_proto::{convert::WireLimits, labels::LabelFilter};

    use super::*;
    use crate::{
        allocator::{Allocator, Config},
        api::Settings,
        metrics::Metrics,
        runtime::Clock,
        store::Loaded,
    };

    fn runtime() -> Arc<Runtime> {
        let settings = Settings {
            filter: LabelFilter::default(),
            wire: WireLimits::default(),
            snapshot_interval: Duration::from_secs(30),
            max_message_bytes: 4 << 20,
            store_kind: "test",
        };
        let clock = Clock::new();
        let alloc = Allocator::new(Config::default(), Loaded::default(), clock.now());
        Runtime::new(alloc, clock, settings, Metrics::default()).0
    }

    fn net(text: &str) -> IpNet {
        text.parse().unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    fn ranges(runtime: &Runtime) -> Option<Vec<(String, ServiceKind)>> {
        runtime.services().map(|set| {
            set.iter()
                .map(|(range, kind)| (range.to_string(), kind))
                .collect()
        })
    }

    #[tokio::test]
    async fn agents_are_given_a_set_only_once_every_source_is_listed() {
        let runtime = runtime();
        let addresses = ServiceAddresses::listing(vec![net("10.0.0.0/16")], runtime.clone());
        assert_eq!(ranges(&runtime), None, "nothing listed yet");
        addresses.reset_services([(
            "shop/web".to_owned(),
            vec![(IpAddr::from([203, 0, 113, 7]), ServiceKind::LoadBalancerIp)].into(),
        )]);
        assert_eq!(
            ranges(&runtime),
            None,
            "the ServiceCIDRs are not listed yet"
        );
        addresses.reset_cidrs([("kubernetes".to_owned(), vec![net("10.96.0.0/12")])]);
        assert_eq!(
            ranges(&runtime),
            Some(vec![
                ("10.0.0.0/16".to_owned(), ServiceKind::ClusterIpRange),
                ("10.96.0.0/12".to_owned(), ServiceKind::ClusterIpRange),
                ("203.0.113.7/32".to_owned(), ServiceKind::LoadBalancerIp),
            ])
        );
        // A Service with no address holds nothing; one losing its address goes.
        addresses.set_service("shop/db", Box::default());
        addresses.set_service("shop/web", Box::default());
        assert_eq!(addresses.services_with_addresses(), 0);
        addresses.remove_cidrs("kubernetes");
        assert_eq!(
            ranges(&runtime),
            Some(vec![(
                "10.0.0.0/16".to_owned(),
                ServiceKind::ClusterIpRange
            )])
        );
    }

    #[tokio::test]
    async fn cluster_ips_are_named_and_forgotten_with_their_service() {
        let runtime = runtime();
        let addresses = ServiceAddresses::new(vec![net("10.96.0.0/12")], runtime.clone());
        let web = ClusterIps {
            ips: vec![
                IpAddr::from([10, 96, 0, 10]),
                "fd00::a".parse().unwrap_or(IpAddr::from([0; 16])),
            ]
            .into(),
            ports: vec![ServicePort {
                port: 80,
                protocol: 6,
            }]
            .into(),
        };
        addresses.set_named_service("shop/web", Box::default(), Some(web));
        let set = runtime.services().unwrap_or_default();
        let names: Vec<(String, String)> = set
            .cluster_ips()
            .map(|(ip, service)| (ip.to_string(), service.key.to_string()))
            .collect();
        assert_eq!(
            names,
            [
                ("10.96.0.10".to_owned(), "shop/web".to_owned()),
                ("fd00::a".to_owned(), "shop/web".to_owned())
            ]
        );
        assert_eq!(set.len(), 1, "a ClusterIP adds no range");
        addresses.remove_service("shop/web");
        assert_eq!(
            runtime.services().unwrap_or_default().cluster_ips().len(),
            0
        );
    }

    #[tokio::test]
    async fn without_servicecidrs_the_services_alone_are_waited_for() {
        let runtime = runtime();
        let addresses = ServiceAddresses::listing(vec![net("10.96.0.0/12")], runtime.clone());
        addresses.cidrs_not_served();
        assert_eq!(ranges(&runtime), None);
        addresses.reset_services([]);
        assert_eq!(
            ranges(&runtime),
            Some(vec![(
                "10.96.0.0/12".to_owned(),
                ServiceKind::ClusterIpRange
            )])
        );
        // Embedded mode: at once.
        let runtime = self::runtime();
        ServiceAddresses::new(Vec::new(), runtime.clone());
        assert_eq!(ranges(&runtime), Some(Vec::new()));
    }
}
