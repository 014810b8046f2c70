//! The cluster's Nodes, as census needs them: name -> addresses, nothing else.
//!
//! The watch decodes each Node into [`NodeAddresses`], which reads `metadata` and the
//! addresses in `status` and skips everything else while parsing (images, conditions,
//! capacity...), so neither a list page nor the index holds whole Node objects; a
//! Node whose status is malformed is kept with no addresses rather than failing the
//! list. A restart of the watch becomes one reset: Nodes gone during the gap are gone.
//!
//! The index answers [`Admission`] (a Hello only for an existing Node, from one of its
//! addresses) and tells the core when a Node is deleted (`node_gone`).

use std::{borrow::Cow, collections::HashMap, fmt, net::IpAddr, sync::Arc};

use census_proto::domain::NodeName;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::{Api, Client};
use parking_lot::RwLock;
use serde::{
    Deserialize, Deserializer,
    de::{IgnoredAny, MapAccess, SeqAccess, Visitor},
};
use tracing::{debug, info, warn};

use census_daemon::watch::{self, Watched};

use crate::{
    replica::{Admission, AdmissionError},
    runtime::Runtime,
};

/// A Node reduced to what census reads while decoding.
#[derive(Debug, Clone, Deserialize)]
pub struct NodeAddresses {
    pub metadata: ObjectMeta,
    #[serde(default, rename = "status", deserialize_with = "status_addresses")]
    pub addresses: Vec<IpAddr>,
}

impl kube::Resource for NodeAddresses {
    type DynamicType = ();
    type Scope = k8s_openapi::ClusterResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        "Node".into()
    }

    fn group(_: &()) -> Cow<'_, str> {
        "".into()
    }

    fn version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }

    fn plural(_: &()) -> Cow<'_, str> {
        "nodes".into()
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// `status.addresses[*].address` that parse as IPs; anything malformed reads as none.
fn status_addresses<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<IpAddr>, D::Error> {
    struct Status;
    impl<'de> Visitor<'de> for Status {
        type Value = Vec<IpAddr>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a Node status")
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut ips = Vec::new();
            while let Some(key) = map.next_key::<Cow<'de, str>>()? {
                if key == "addresses" {
                    let list: serde_json::Value = map.next_value()?;
                    ips = list
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter(|a| {
                            matches!(
                                a.get("type").and_then(|t| t.as_str()),
                                Some("InternalIP" | "ExternalIP")
                            )
                        })
                        // One form per address: IPv4-mapped IPv6 as IPv4.
                        .filter_map(|a| {
                            a.get("address")?
                                .as_str()?
                                .parse::<IpAddr>()
                                .ok()
                                .map(|ip| ip.to_canonical())
                        })
                        .collect();
                } else {
                    map.next_value::<IgnoredAny>()?;
                }
            }
            Ok(ips)
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok(Vec::new())
        }

        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(Vec::new())
        }

        fn visit_none<E>(self) -> Result<Self::Value, E> {
            Ok(Vec::new())
        }

        fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
            Ok(Vec::new())
        }

        fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
            Ok(Vec::new())
        }

        fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
            Ok(Vec::new())
        }

        fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
            Ok(Vec::new())
        }

        fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
            Ok(Vec::new())
        }
    }
    d.deserialize_any(Status)
}

/// Node name -> addresses.
#[derive(Debug, Default)]
pub struct NodeIndex {
    inner: RwLock<Nodes>,
    /// Admit a Hello only from one of its Node's addresses (`--require-node-address`).
    bind_peer: bool,
}

#[derive(Debug, Default)]
struct Nodes {
    addresses: HashMap<NodeName, Box<[IpAddr]>>,
    /// The watch has listed the Nodes at least once.
    synced: bool,
}

impl NodeIndex {
    /// An index whose admission also requires a Hello to come from one of its Node's
    /// addresses, on top of the caller's credentials. Off by default: kube-proxy
    /// masquerading, IPVS and overlay CNIs source agents' traffic from other addresses.
    pub fn binding_peers(bind_peer: bool) -> Self {
        Self {
            bind_peer,
            ..Self::default()
        }
    }

    /// Nodes known.
    pub fn len(&self) -> usize {
        self.inner.read().addresses.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn is_synced(&self) -> bool {
        self.inner.read().synced
    }

    /// Every Node's name.
    pub fn names(&self) -> Vec<NodeName> {
        self.inner.read().addresses.keys().cloned().collect()
    }

    /// A Node's addresses, if it exists.
    pub fn addresses(&self, node: &NodeName) -> Option<Vec<IpAddr>> {
        self.inner.read().addresses.get(node).map(|a| a.to_vec())
    }

    /// Every Node's addresses.
    pub fn all_addresses(&self) -> Vec<(NodeName, Vec<IpAddr>)> {
        let inner = self.inner.read();
        inner
            .addresses
            .iter()
            .map(|(name, ips)| (name.clone(), ips.to_vec()))
            .collect()
    }

    /// Bytes the index holds for its entries (names and addresses, not the map's
    /// overhead): it grows with the Nodes, never with other objects.
    pub fn approx_bytes(&self) -> usize {
        self.inner
            .read()
            .addresses
            .iter()
            .map(|(name, ips)| name.as_str().len() + size_of_val(&**ips))
            .sum()
    }

    fn upsert(&self, node: &NodeAddresses) -> Option<NodeName> {
        let name = node_name(node)?;
        self.inner
            .write()
            .addresses
            .insert(name.clone(), node.addresses.clone().into_boxed_slice());
        Some(name)
    }

    fn remove(&self, node: &NodeAddresses) -> Option<NodeName> {
        let name = node_name(node)?;
        self.inner.write().addresses.remove(&name).map(|_| name)
    }

    /// Replaces everything with a fresh list; returns the Nodes that are gone.
    fn reset(&self, listed: Vec<(NodeName, Box<[IpAddr]>)>) -> Vec<NodeName> {
        let fresh: HashMap<NodeName, Box<[IpAddr]>> = listed.into_iter().collect();
        let mut inner = self.inner.write();
        let gone = inner
            .addresses
            .keys()
            .filter(|n| !fresh.contains_key(*n))
            .cloned()
            .collect();
        inner.addresses = fresh;
        inner.synced = true;
        gone
    }
}

fn node_name(node: &NodeAddresses) -> Option<NodeName> {
    let name = node.metadata.name.as_deref()?;
    match NodeName::new(name) {
        Ok(n) => Some(n),
        Err(e) => {
            warn!(node = name, error = %e, "skipping a Node whose name census cannot use");
            None
        }
    }
}

impl Admission for NodeIndex {
    fn admit(&self, node: &NodeName, peer: Option<IpAddr>) -> Result<(), AdmissionError> {
        let inner = self.inner.read();
        if !inner.synced {
            return Err(AdmissionError::NotSynced);
        }
        let Some(addresses) = inner.addresses.get(node) else {
            return Err(AdmissionError::UnknownNode { node: node.clone() });
        };
        if !self.bind_peer {
            return Ok(());
        }
        let Some(peer) = peer else {
            return Err(AdmissionError::NoPeer { node: node.clone() });
        };
        if addresses.contains(&peer) {
            return Ok(());
        }
        let listed: Vec<String> = addresses.iter().map(ToString::to_string).collect();
        Err(AdmissionError::WrongAddress {
            node: node.clone(),
            peer,
            addresses: if listed.is_empty() {
                "none".to_owned()
            } else {
                listed.join(", ")
            },
        })
    }
}

/// Watches the Nodes into `index` until the task is dropped; a deleted Node's view is
/// dropped by the core (on a follower, whose core is empty, this does nothing).
pub async fn run(index: Arc<NodeIndex>, client: Client, runtime: Arc<Runtime>) {
    let nodes = NodeWatch {
        index,
        runtime,
        listing: Vec::new(),
    };
    watch::drive(
        Api::<NodeAddresses>::all(client),
        &watch::Config::default(),
        nodes,
    )
    .await;
}

/// The Nodes' watch, into the index and the core.
struct NodeWatch {
    index: Arc<NodeIndex>,
    runtime: Arc<Runtime>,
    listing: Vec<(NodeName, Box<[IpAddr]>)>,
}

impl Watched<NodeAddresses> for NodeWatch {
    const WHAT: &'static str = "Nodes";

    fn relist(&mut self) {
        self.listing.clear();
    }

    fn list(&mut self, node: NodeAddresses) {
        if let Some(name) = node_name(&node) {
            self.listing.push((name, node.addresses.into_boxed_slice()));
        }
    }

    async fn listed(&mut self) {
        let listed = std::mem::take(&mut self.listing);
        debug!(nodes = listed.len(), "listed the Nodes");
        for name in self.index.reset(listed) {
            gone(&self.runtime, &name);
        }
        feed_addresses(&self.index, &self.runtime);
    }

    async fn apply(&mut self, node: NodeAddresses) {
        if let Some(name) = self.index.upsert(&node) {
            self.runtime
                .with(|alloc, now| alloc.set_node_addresses(&name, node.addresses, now));
        }
    }

    async fn delete(&mut self, node: NodeAddresses) {
        if let Some(name) = self.index.remove(&node) {
            gone(&self.runtime, &name);
        }
    }
}

/// Gives the core every Node's addresses (the endpoint map's `remote-node`
/// entries): after a list, and when a core is built (a new leader's starts empty).
/// The core takes a list equal to what it holds as no change.
fn feed_addresses(index: &NodeIndex, runtime: &Runtime) {
    runtime.with(|alloc, now| {
        for (name, ips) in index.all_addresses() {
            alloc.set_node_addresses(&name, ips, now);
        }
    });
}

fn gone(runtime: &Runtime, name: &NodeName) {
    info!(node = %name, "the Node is gone: its view is dropped");
    runtime.with(|alloc, now| alloc.node_gone(name, now));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(json: serde_json::Value) -> Result<NodeAddresses, serde_json::Error> {
        serde_json::from_value(json)
    }

    #[test]
    fn decodes_addresses_and_tolerates_malformed_status() -> Result<(), Box<dyn std::error::Error>>
    {
        let node = decode(serde_json::json!({
            "metadata": {"name": "n1"},
            "status": {
                "images": [{"names": ["a"], "sizeBytes": 5}],
                "addresses": [
                    {"type": "InternalIP", "address": "10.0.0.1"},
                    {"type": "Hostname", "address": "n1"},
                    {"type": "ExternalIP", "address": "fd00::1"},
                    {"type": "InternalIP", "address": "not an ip"},
                    "garbage",
                ],
            },
        }))?;
        let want: Vec<IpAddr> = vec!["10.0.0.1".parse()?, "fd00::1".parse()?];
        assert_eq!(node.addresses, want);
        for status in [
            serde_json::json!("broken"),
            serde_json::json!(5),
            serde_json::json!(null),
            serde_json::json!([1]),
        ] {
            let node = decode(serde_json::json!({"metadata": {"name": "n2"}, "status": status}))?;
            assert!(node.addresses.is_empty());
        }
        assert!(
            decode(serde_json::json!({"metadata": {"name": "n3"}}))?
                .addresses
                .is_empty()
        );
        Ok(())
    }

    #[test]
    fn admission_binds_a_hello_to_its_node_and_by_choice_its_address()
    -> Result<(), Box<dyn std::error::Error>> {
        let any = NodeIndex::default();
        let n1 = NodeName::new("n1")?;
        let ip: IpAddr = "10.0.0.1".parse()?;
        any.reset(vec![(n1.clone(), vec![ip].into_boxed_slice())]);
        assert_eq!(any.admit(&n1, Some("10.0.0.2".parse()?)), Ok(()));
        assert_eq!(any.admit(&n1, None), Ok(()));
        assert!(matches!(
            any.admit(&NodeName::new("n2")?, Some(ip)),
            Err(AdmissionError::UnknownNode { .. })
        ));

        let index = NodeIndex::binding_peers(true);
        assert_eq!(index.admit(&n1, Some(ip)), Err(AdmissionError::NotSynced));
        let gone = index.reset(vec![(n1.clone(), vec![ip].into_boxed_slice())]);
        assert!(gone.is_empty());
        assert_eq!(index.admit(&n1, Some(ip)), Ok(()));
        assert!(matches!(
            index.admit(&n1, Some("10.0.0.2".parse()?)),
            Err(AdmissionError::WrongAddress { .. })
        ));
        assert!(matches!(
            index.admit(&n1, None),
            Err(AdmissionError::NoPeer { .. })
        ));
        let n2 = NodeName::new("n2")?;
        assert!(matches!(
            index.admit(&n2, Some(ip)),
            Err(AdmissionError::UnknownNode { .. })
        ));
        assert_eq!(index.reset(Vec::new()), vec![n1]);
        Ok(())
    }
}
