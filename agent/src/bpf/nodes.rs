//! NODES: the nodes of the cluster that remote ENDPOINTS entries name, by index.

use std::{collections::BTreeMap, net::IpAddr, num::NonZeroU16};

use aya::maps::{HashMap, MapData, MapError};
use census_common::{NODE_ADDRESSES_MAX, NODE_NAME_MAX, NODES_MAP, NodeValue};

use super::{Datapath, Error, maps::is_not_found};

pub(super) type NodesMap = HashMap<MapData, u32, NodeValue>;

/// What NODES says about one node.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NodeRecord {
    pub name: String,
    pub addresses: Vec<IpAddr>,
}

impl NodeRecord {
    /// The record NODES would hold for node `index`, or why it cannot
    /// ([`Error::InvalidNode`]): a name of 1 to 253 bytes, at most 16 addresses.
    pub fn checked(index: NonZeroU16, name: &str, addresses: &[IpAddr]) -> Result<Self, Error> {
        node_value(index, name, addresses).map(|value| Self::from_value(&value))
    }

    /// The record of a NODES value: a name that is not UTF-8 is read lossily,
    /// addresses that are not well formed are left out (census writes neither).
    pub fn from_value(value: &NodeValue) -> Self {
        Self {
            name: String::from_utf8_lossy(value.name_bytes()).into_owned(),
            addresses: value.address_keys().iter().filter_map(|k| k.ip()).collect(),
        }
    }
}

/// The NODES value of node `index`, or why it cannot be one.
pub(super) fn node_value(
    index: NonZeroU16,
    name: &str,
    addresses: &[IpAddr],
) -> Result<NodeValue, Error> {
    let invalid = |reason| Error::InvalidNode {
        index: index.get(),
        reason,
    };
    if name.is_empty() {
        return Err(invalid("a node has a name"));
    }
    if name.len() > NODE_NAME_MAX {
        return Err(invalid("a node name is at most 253 bytes"));
    }
    if addresses.len() > NODE_ADDRESSES_MAX {
        return Err(invalid("a node has at most 16 addresses"));
    }
    let mut value = NodeValue::EMPTY;
    value.name[..name.len()].copy_from_slice(name.as_bytes());
    value.name_len = name.len() as u16;
    for (slot, ip) in value.addresses.iter_mut().zip(addresses) {
        *slot = (*ip).into();
    }
    value.address_count = addresses.len() as u16;
    Ok(value)
}

pub(super) fn nodes_error(source: MapError) -> Error {
    Error::Map {
        map: NODES_MAP,
        source,
    }
}

/// Every entry of a NODES map, by index; keys outside `1..=65535` are left out (not
/// census's), as are entries deleted while the map is walked.
pub(super) fn read_all(map: &NodesMap) -> Result<BTreeMap<u16, NodeRecord>, Error> {
    let mut nodes = BTreeMap::new();
    for entry in map.iter() {
        match entry {
            Ok((key, value)) => {
                if let Ok(index) = u16::try_from(key)
                    && index != 0
                {
                    nodes.insert(index, NodeRecord::from_value(&value));
                }
            }
            Err(error) if is_not_found(&error) => {}
            Err(error) => return Err(nodes_error(error)),
        }
    }
    Ok(nodes)
}

impl Datapath {
    /// Writes (creates or replaces) the entry of node `index`: its name (at most
    /// 253 bytes) and addresses (at most 16).
    pub fn write_node(
        &mut self,
        index: NonZeroU16,
        name: &str,
        addresses: &[IpAddr],
    ) -> Result<(), Error> {
        let value = node_value(index, name, addresses)?;
        let max_entries = self.nodes_max_entries;
        self.nodes
            .insert(u32::from(index.get()), value, 0)
            .map_err(|source| {
                super::maps::full_or(source, NODES_MAP, max_entries, "nodes-max-entries", || {
                    format!("node {index}")
                })
            })
    }

    /// Removes the entry of node `index`; `false` if there was none.
    pub fn delete_node(&mut self, index: NonZeroU16) -> Result<bool, Error> {
        match self.nodes.remove(&u32::from(index.get())) {
            Ok(()) => Ok(true),
            Err(error) if is_not_found(&error) => Ok(false),
            Err(error) => Err(nodes_error(error)),
        }
    }

    /// The entry of node `index`, if any.
    pub fn node(&self, index: NonZeroU16) -> Result<Option<NodeRecord>, Error> {
        match self.nodes.get(&u32::from(index.get()), 0) {
            Ok(value) => Ok(Some(NodeRecord::from_value(&value))),
            Err(error) if is_not_found(&error) => Ok(None),
            Err(error) => Err(nodes_error(error)),
        }
    }

    /// Every node, by index.
    pub fn nodes(&self) -> Result<BTreeMap<u16, NodeRecord>, Error> {
        read_all(&self.nodes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const N1: NonZeroU16 = NonZeroU16::new(1).unwrap();

    #[test]
    fn node_values_round_trip() -> Result<(), Box<dyn std::error::Error>> {
        let addresses: Vec<IpAddr> = vec!["198.18.0.1".parse()?, "2001:db8::1".parse()?];
        let value = node_value(N1, "node-a", &addresses)?;
        assert_eq!(
            NodeRecord::from_value(&value),
            NodeRecord {
                name: "node-a".to_owned(),
                addresses
            }
        );
        let longest = "n".repeat(NODE_NAME_MAX);
        let many: Vec<IpAddr> = (0..16u8).map(|i| IpAddr::from([198, 18, 1, i])).collect();
        let value = node_value(N1, &longest, &many)?;
        assert_eq!(NodeRecord::from_value(&value).name, longest);
        assert_eq!(NodeRecord::from_value(&value).addresses, many);
        Ok(())
    }

    #[test]
    fn rejects_nodes_that_do_not_fit() {
        let many: Vec<IpAddr> = (0..17u8).map(|i| IpAddr::from([198, 18, 1, i])).collect();
        for (name, addresses) in [
            (String::new(), &[][..]),
            ("n".repeat(NODE_NAME_MAX + 1), &[][..]),
            ("node-a".to_owned(), &many[..]),
        ] {
            assert!(
                matches!(
                    node_value(N1, &name, addresses),
                    Err(Error::InvalidNode { index: 1, .. })
                ),
                "{name:?} {}",
                addresses.len()
            );
        }
    }
}
