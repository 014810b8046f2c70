//! The cluster's Service addresses as the API server has them: the ranges of the
//! ServiceCIDR objects (networking.k8s.io/v1, Kubernetes 1.33+; before, the
//! operator's `--service-cidr` says them) and each Service's external IPs
//! (`spec.externalIPs`) and LoadBalancer IPs (`status.loadBalancer.ingress[].ip`).
//!
//! and names each ClusterIP (`spec.clusterIPs`, every family) with the Service's
//! `namespace/name` and ports, for what agents count per Service.
//!
//! A Service is decoded into [`ServiceAddressObject`], which keeps its name,
//! namespace and resource version, those two lists, its ClusterIPs and its ports,
//! and skips everything else while parsing (annotations, managed fields,
//! selectors), so neither a list page nor [`ServiceAddresses`] holds whole Service
//! objects. A restart of a watch
//! becomes one reset: objects gone during the gap are gone.

use std::{borrow::Cow, net::IpAddr, sync::Arc, time::Duration};

use census_daemon::watch::{self, Failure, Watched};
use census_proto::domain::{ServiceKind, ServicePort};
use ipnet::IpNet;
use k8s_openapi::{
    api::networking::v1::ServiceCIDR, apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{Api, Client};
use serde::{Deserialize, Deserializer};
use tracing::{debug, info, warn};

use crate::services::{Addresses, ClusterIps, ServiceAddresses};

/// A Service reduced to its addresses while decoding.
#[derive(Debug, Clone, Deserialize)]
pub struct ServiceAddressObject {
    #[serde(deserialize_with = "slim_meta")]
    pub metadata: ObjectMeta,
    #[serde(default)]
    spec: Option<Spec>,
    #[serde(default)]
    status: Option<Status>,
}

#[derive(Debug, Clone, Default, Deserialize)]
struct Spec {
    #[serde(default, rename = "externalIPs")]
    external_ips: Option<Vec<String>>,
    #[serde(default, rename = "clusterIP")]
    cluster_ip: Option<String>,
    #[serde(default, rename = "clusterIPs")]
    cluster_ips: Option<Vec<String>>,
    #[serde(default)]
    ports: Option<Vec<Port>>,
}

#[derive(Debug, Clone, Default, Deserialize)]
struct Port {
    #[serde(default)]
    port: Option<i64>,
    #[serde(default)]
    protocol: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
struct Status {
    #[serde(default, rename = "loadBalancer")]
    load_balancer: Option<LoadBalancer>,
}

#[derive(Debug, Clone, Default, Deserialize)]
struct LoadBalancer {
    #[serde(default)]
    ingress: Option<Vec<Ingress>>,
}

#[derive(Debug, Clone, Default, Deserialize)]
struct Ingress {
    #[serde(default)]
    ip: Option<String>,
}

/// `metadata` with what the watch needs (name, namespace, resource version, uid)
/// and nothing else: annotations and managed fields are skipped unread.
fn slim_meta<'de, D: Deserializer<'de>>(d: D) -> Result<ObjectMeta, D::Error> {
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Slim {
        name: Option<String>,
        namespace: Option<String>,
        resource_version: Option<String>,
        uid: Option<String>,
    }
    let Slim {
        name,
        namespace,
        resource_version,
        uid,
    } = Slim::deserialize(d)?;
    Ok(ObjectMeta {
        name,
        namespace,
        resource_version,
        uid,
        ..ObjectMeta::default()
    })
}

impl ServiceAddressObject {
    /// `namespace/name`, if the object has both.
    pub fn key(&self) -> Option<String> {
        let namespace = self.metadata.namespace.as_deref()?;
        let name = self.metadata.name.as_deref()?;
        Some(format!("{namespace}/{name}"))
    }

    /// Its LoadBalancer and external IPs, each once (an address both is a
    /// LoadBalancer IP); text that is no address is skipped.
    pub fn addresses(&self) -> Addresses {
        let parse = |text: &str| {
            text.trim()
                .parse::<IpAddr>()
                .ok()
                .map(|ip| ip.to_canonical())
        };
        let ingress = self
            .status
            .iter()
            .filter_map(|s| s.load_balancer.as_ref())
            .filter_map(|lb| lb.ingress.as_ref())
            .flatten()
            .filter_map(|i| parse(i.ip.as_deref()?))
            .map(|ip| (ip, ServiceKind::LoadBalancerIp));
        let external = self
            .spec
            .iter()
            .filter_map(|s| s.external_ips.as_ref())
            .flatten()
            .filter_map(|text| parse(text))
            .map(|ip| (ip, ServiceKind::ExternalIp));
        let mut addresses: Vec<(IpAddr, ServiceKind)> = ingress.chain(external).collect();
        addresses.sort_unstable();
        addresses.dedup_by_key(|(ip, _)| *ip);
        addresses.into_boxed_slice()
    }
}

impl ServiceAddressObject {
    /// Its ClusterIPs (`spec.clusterIPs`, else `spec.clusterIP`; none for a
    /// headless Service) with its ports, each once; text that is no address, a
    /// port out of range or a protocol other than TCP, UDP and SCTP is skipped.
    pub fn cluster_ips(&self) -> Option<ClusterIps> {
        let spec = self.spec.as_ref()?;
        let listed = spec.cluster_ips.iter().flatten();
        let single = spec
            .cluster_ip
            .iter()
            .filter(|_| spec.cluster_ips.is_none());
        let mut ips: Vec<IpAddr> = listed
            .chain(single)
            .filter_map(|text| text.trim().parse::<IpAddr>().ok())
            .map(|ip| ip.to_canonical())
            .collect();
        ips.sort_unstable();
        ips.dedup();
        if ips.is_empty() {
            return None;
        }
        let mut ports: Vec<ServicePort> = spec
            .ports
            .iter()
            .flatten()
            .filter_map(|p| {
                let port = u16::try_from(p.port?).ok().filter(|port| *port != 0)?;
                let protocol = match p.protocol.as_deref().unwrap_or("TCP") {
                    "TCP" => 6,
                    "UDP" => 17,
                    "SCTP" => 132,
                    _ => return None,
                };
                Some(ServicePort { port, protocol })
            })
            .collect();
        ports.sort_unstable();
        ports.dedup();
        Some(ClusterIps {
            ips: ips.into_boxed_slice(),
            ports: ports.into_boxed_slice(),
        })
    }
}

impl kube::Resource for ServiceAddressObject {
    type DynamicType = ();
    type Scope = k8s_openapi::NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        "Service".into()
    }

    fn group(_: &()) -> Cow<'_, str> {
        "".into()
    }

    fn version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }

    fn plural(_: &()) -> Cow<'_, str> {
        "services".into()
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// A ServiceCIDR's name and ranges (host bits cleared; text that is no range is
/// skipped with a warning).
fn cidr_ranges(object: &ServiceCIDR) -> Option<(String, Vec<IpNet>)> {
    let name = object.metadata.name.clone()?;
    let cidrs = object.spec.as_ref().and_then(|s| s.cidrs.as_ref());
    let ranges = cidrs
        .into_iter()
        .flatten()
        .filter_map(|text| match text.trim().parse::<IpNet>() {
            Ok(range) => Some(range.trunc()),
            Err(_) => {
                warn!(
                    servicecidr = name,
                    cidr = %census_proto::text::cut(text, 64),
                    "skipping a ServiceCIDR range that is not a CIDR"
                );
                None
            }
        })
        .collect();
    Some((name, ranges))
}

/// Watches the ServiceCIDR objects into `addresses` until the task is dropped. An
/// API server that does not serve them (before 1.33) is asked again with backoff,
/// said once.
pub async fn run_cidrs(addresses: Arc<ServiceAddresses>, client: Client) {
    let cidrs = CidrWatch {
        addresses,
        listing: Vec::new(),
        said_not_served: false,
    };
    watch::drive(
        Api::<ServiceCIDR>::all(client),
        &watch::Config::default(),
        cidrs,
    )
    .await;
}

/// The ServiceCIDRs' watch, into the Service address set.
struct CidrWatch {
    addresses: Arc<ServiceAddresses>,
    listing: Vec<(String, Vec<IpNet>)>,
    said_not_served: bool,
}

impl Watched<ServiceCIDR> for CidrWatch {
    const WHAT: &'static str = "ServiceCIDRs";

    fn relist(&mut self) {
        self.listing.clear();
    }

    fn list(&mut self, object: ServiceCIDR) {
        self.listing.extend(cidr_ranges(&object));
    }

    async fn listed(&mut self) {
        let listed = std::mem::take(&mut self.listing);
        debug!(servicecidrs = listed.len(), "listed the ServiceCIDRs");
        self.addresses.reset_cidrs(listed);
    }

    async fn apply(&mut self, object: ServiceCIDR) {
        if let Some((name, ranges)) = cidr_ranges(&object) {
            self.addresses.set_cidrs(&name, ranges);
        }
    }

    async fn delete(&mut self, object: ServiceCIDR) {
        if let Some(name) = object.metadata.name.as_deref() {
            self.addresses.remove_cidrs(name);
        }
    }

    /// An API server that does not serve ServiceCIDRs answers 404.
    async fn failed(&mut self, failure: &Failure, _retry_in: Duration) -> bool {
        if failure.code != Some(404) {
            return false;
        }
        self.addresses.cidrs_not_served();
        if !self.said_not_served {
            self.said_not_served = true;
            info!(
                "the API server serves no ServiceCIDRs (Kubernetes before 1.33): the Service ranges are --service-cidr's"
            );
        }
        true
    }
}

/// Watches the Services' LoadBalancer and external IPs, and their ClusterIPs with
/// their names, into `addresses` until the task is dropped.
pub async fn run_services(addresses: Arc<ServiceAddresses>, client: Client) {
    let services = ServiceWatch {
        addresses,
        listing: Vec::new(),
    };
    watch::drive(
        Api::<ServiceAddressObject>::all(client),
        &watch::Config::default(),
        services,
    )
    .await;
}

/// The Services' watch, into the Service address set.
struct ServiceWatch {
    addresses: Arc<ServiceAddresses>,
    listing: Vec<(String, Addresses, Option<ClusterIps>)>,
}

impl Watched<ServiceAddressObject> for ServiceWatch {
    const WHAT: &'static str = "Services";

    fn relist(&mut self) {
        self.listing.clear();
    }

    fn list(&mut self, service: ServiceAddressObject) {
        let (found, cluster_ips) = (service.addresses(), service.cluster_ips());
        let holds = !found.is_empty() || cluster_ips.is_some();
        if let Some(key) = service.key().filter(|_| holds) {
            self.listing.push((key, found, cluster_ips));
        }
    }

    async fn listed(&mut self) {
        let listed = std::mem::take(&mut self.listing);
        debug!(
            services = listed.len(),
            "listed the Services with addresses"
        );
        self.addresses.reset_named_services(listed);
    }

    async fn apply(&mut self, service: ServiceAddressObject) {
        if let Some(key) = service.key() {
            self.addresses
                .set_named_service(&key, service.addresses(), service.cluster_ips());
        }
    }

    async fn delete(&mut self, service: ServiceAddressObject) {
        if let Some(key) = service.key() {
            self.addresses.remove_service(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(json: serde_json::Value) -> Result<ServiceAddressObject, serde_json::Error> {
        serde_json::from_value(json)
    }

    #[test]
    fn a_service_is_decoded_to_its_addresses_and_its_key() -> Result<(), Box<dyn std::error::Error>>
    {
        let service = decode(serde_json::json!({
            "metadata": {
                "name": "web", "namespace": "shop", "resourceVersion": "7",
                "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{...}"},
                "managedFields": [{"manager": "kubectl"}],
            },
            "spec": {
                "clusterIP": "10.96.0.10",
                "externalIPs": ["198.51.100.7", "not an ip", "2001:db8::7", "203.0.113.1"],
                "ports": [{"port": 80}],
            },
            "status": {"loadBalancer": {"ingress": [
                {"ip": "203.0.113.1"},
                {"hostname": "lb.example.com"},
                {"ip": "::ffff:203.0.113.2"},
            ]}},
        }))?;
        assert_eq!(service.key().as_deref(), Some("shop/web"));
        assert_eq!(service.metadata.resource_version.as_deref(), Some("7"));
        assert!(service.metadata.annotations.is_none());
        assert!(service.metadata.managed_fields.is_none());
        let want: Vec<(IpAddr, ServiceKind)> = vec![
            ("198.51.100.7".parse()?, ServiceKind::ExternalIp),
            // Both: a LoadBalancer IP.
            ("203.0.113.1".parse()?, ServiceKind::LoadBalancerIp),
            // IPv4-mapped: as IPv4.
            ("203.0.113.2".parse()?, ServiceKind::LoadBalancerIp),
            ("2001:db8::7".parse()?, ServiceKind::ExternalIp),
        ];
        assert_eq!(&*service.addresses(), want.as_slice());
        // `spec.clusterIP` alone (no `clusterIPs`), a port without a protocol is TCP.
        let named = service.cluster_ips().ok_or("no ClusterIP")?;
        assert_eq!(&*named.ips, &["10.96.0.10".parse::<IpAddr>()?]);
        assert_eq!(
            &*named.ports,
            &[ServicePort {
                port: 80,
                protocol: 6
            }]
        );
        let dual = decode(serde_json::json!({
            "metadata": {"name": "dns", "namespace": "kube-system"},
            "spec": {
                "clusterIP": "10.96.0.53",
                "clusterIPs": ["10.96.0.53", "fd00:10:96::35"],
                "ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}],
            },
        }))?;
        let named = dual.cluster_ips().ok_or("no ClusterIP")?;
        assert_eq!(
            &*named.ips,
            &["10.96.0.53".parse::<IpAddr>()?, "fd00:10:96::35".parse()?]
        );
        assert_eq!(named.ports.len(), 2);
        let headless = decode(serde_json::json!({
            "metadata": {"name": "db", "namespace": "shop"},
            "spec": {"clusterIP": "None", "clusterIPs": ["None"]},
        }))?;
        assert!(headless.cluster_ips().is_none());

        let bare = decode(serde_json::json!({"metadata": {"name": "db", "namespace": "shop"}}))?;
        assert!(bare.addresses().is_empty());
        Ok(())
    }

    #[test]
    fn a_servicecidr_is_its_ranges() -> Result<(), Box<dyn std::error::Error>> {
        let object: ServiceCIDR = serde_json::from_value(serde_json::json!({
            "apiVersion": "networking.k8s.io/v1",
            "kind": "ServiceCIDR",
            "metadata": {"name": "kubernetes"},
            "spec": {"cidrs": ["10.96.0.0/12", "fd00:10:96::/112", "bogus", "10.200.3.0/16"]},
        }))?;
        let (name, ranges) = cidr_ranges(&object).ok_or("no name")?;
        assert_eq!(name, "kubernetes");
        let want: Vec<IpNet> = vec![
            "10.96.0.0/12".parse()?,
            "fd00:10:96::/112".parse()?,
            "10.200.0.0/16".parse()?,
        ];
        assert_eq!(ranges, want);
        Ok(())
    }
}
