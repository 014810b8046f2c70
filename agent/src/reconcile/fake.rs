//! An in-memory datapath, for tests: every map, the pinned links and the node's
//! hooks, with interfaces that exist or not; it implements each map's port.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    num::NonZeroU16,
    path::{Path, PathBuf},
    sync::Arc,
};

use census_proto::domain::ServiceKind;
use ipnet::IpNet;
use parking_lot::Mutex;

use super::{
    ClassifierPort, EndpointsPort, InterfacesPort, Link, MapKey, NodeHooksPort, NodesPort,
    PinsPort, ServicesPort, endpoints::ENDPOINTS,
};
use crate::bpf::{self, AttachmentState, interface_slot};

#[derive(Debug, Default)]
pub(crate) struct FakeMaps {
    pub(crate) entries: BTreeMap<MapKey, bpf::Endpoint>,
    /// INTERFACES, by slot.
    pub(crate) slots: BTreeMap<u32, bpf::Interface>,
    /// Interface -> attached (two hooks each).
    pub(crate) links: BTreeMap<String, AttachmentState>,
    /// Interfaces that exist.
    pub(crate) interfaces: BTreeSet<String>,
    /// Their ifindexes: given by a test, else 100, 101, ... in order of first use.
    pub(crate) ifindexes: BTreeMap<String, u32>,
    /// ENDPOINTS writes and deletes.
    pub(crate) writes: usize,
    /// INTERFACES writes and deletes.
    pub(crate) interface_writes: usize,
    pub(crate) attaches: usize,
    /// INTERFACES entries written for an interface the classifier is not
    /// attached to: must stay 0.
    pub(crate) unattached_entries: usize,
    /// Why the pins cannot be put back, while they cannot.
    pub(crate) unpinnable: Option<&'static str>,
    /// Times the pins were put back.
    pub(crate) repins: usize,
    /// Whether the pins are there (`census-agent uninstall` clears it).
    pub(crate) unpinned: bool,
    /// Programs in front of census's, by interface.
    pub(crate) in_front: BTreeMap<String, Vec<bpf::InFront>>,
    /// NODES, by index.
    pub(crate) nodes: BTreeMap<u16, bpf::NodeRecord>,
    /// NODES writes and deletes.
    pub(crate) node_writes: usize,
    /// ENDPOINTS' size: a write of a new address into a map holding this many
    /// entries fails with [`bpf::Error::MapFull`], as the kernel's does (`None`:
    /// no limit).
    pub(crate) endpoints_max_entries: Option<usize>,
    /// SERVICES, by range.
    pub(crate) services: BTreeMap<IpNet, ServiceKind>,
    /// SERVICES writes and deletes.
    pub(crate) service_writes: usize,
    /// Why SERVICES refuses writes, while it does.
    pub(crate) services_refuse: Option<&'static str>,
    /// The devices a default route leaves by, and the tunnel devices.
    pub(crate) default_uplinks: BTreeSet<String>,
    /// Uplink program links, by device. Attaching needs the device in
    /// `interfaces`.
    pub(crate) uplink_links: BTreeMap<String, AttachmentState>,
    pub(crate) uplink_attaches: usize,
    /// Where the node's cgroup v2 hierarchy is (`None`: not found).
    pub(crate) cgroup2_root: Option<PathBuf>,
    /// The cgroup the socket program's link is attached at.
    pub(crate) sockets: Option<PathBuf>,
    pub(crate) sockets_attaches: usize,
}

impl FakeMaps {
    pub(crate) fn ifindex(&mut self, interface: &str) -> u32 {
        let next = 100 + u32::try_from(self.ifindexes.len()).unwrap_or(0);
        *self.ifindexes.entry(interface.to_owned()).or_insert(next)
    }

    fn attached(&self, ifindex: u32) -> bool {
        self.links
            .values()
            .any(|state| *state == AttachmentState::Attached { ifindex })
    }

    /// The INTERFACES entries, by interface name.
    pub(crate) fn interface_entries(&self) -> BTreeMap<String, Option<u32>> {
        self.ifindexes
            .iter()
            .filter_map(|(name, ifindex)| {
                let held = self.slots.get(&interface_slot(*ifindex))?;
                (held.ifindex == *ifindex).then(|| (name.clone(), held.identity))
            })
            .collect()
    }

    /// What `census-agent uninstall` does under a running agent: every link
    /// detached, every pin removed (the maps live on in the agent).
    pub(crate) fn uninstall(&mut self) {
        self.links.clear();
        self.slots.clear();
        self.unpinned = true;
    }
}

impl EndpointsPort for FakeMaps {
    fn read_endpoints(&self) -> Result<BTreeMap<MapKey, bpf::Endpoint>, bpf::Error> {
        Ok(self.entries.clone())
    }

    fn read_endpoint(&self, ip: IpAddr) -> Result<Option<bpf::Endpoint>, bpf::Error> {
        Ok(self.entries.get(&MapKey::from(ip)).copied())
    }

    fn write_endpoint(&mut self, ip: IpAddr, endpoint: bpf::Endpoint) -> Result<(), bpf::Error> {
        // As the datapath does: an inconsistent entry is refused, not written.
        endpoint.check(ip)?;
        let key = MapKey::from(ip);
        if let Some(max) = self.endpoints_max_entries
            && self.entries.len() >= max
            && !self.entries.contains_key(&key)
        {
            return Err(bpf::Error::MapFull {
                map: ENDPOINTS,
                max_entries: u32::try_from(max).unwrap_or(u32::MAX),
                key: ip.to_string(),
                flag: "endpoints-max-entries",
            });
        }
        self.writes += 1;
        self.entries.insert(key, endpoint);
        Ok(())
    }

    fn delete_endpoint(&mut self, key: &MapKey) -> Result<bool, bpf::Error> {
        self.writes += 1;
        Ok(self.entries.remove(key).is_some())
    }
}

impl NodesPort for FakeMaps {
    fn read_nodes(&self) -> Result<BTreeMap<u16, bpf::NodeRecord>, bpf::Error> {
        Ok(self.nodes.clone())
    }

    fn write_node(
        &mut self,
        index: NonZeroU16,
        name: &str,
        addresses: &[IpAddr],
    ) -> Result<(), bpf::Error> {
        // As the datapath does: a node that does not fit is refused.
        let record = bpf::NodeRecord::checked(index, name, addresses)?;
        self.node_writes += 1;
        self.nodes.insert(index.get(), record);
        Ok(())
    }

    fn delete_node(&mut self, index: NonZeroU16) -> Result<bool, bpf::Error> {
        self.node_writes += 1;
        Ok(self.nodes.remove(&index.get()).is_some())
    }
}

impl ServicesPort for FakeMaps {
    fn read_services(&self) -> Result<BTreeMap<IpNet, ServiceKind>, bpf::Error> {
        Ok(self.services.clone())
    }

    fn write_service(&mut self, range: IpNet, kind: ServiceKind) -> Result<(), bpf::Error> {
        if let Some(reason) = self.services_refuse {
            return Err(bpf::Error::InvalidInterfaceName {
                name: "SERVICES".to_owned(),
                reason,
            });
        }
        self.service_writes += 1;
        // As the trie does: one entry per range, host bits ignored.
        self.services.insert(range.trunc(), kind);
        Ok(())
    }

    fn delete_service(&mut self, range: IpNet) -> Result<bool, bpf::Error> {
        if let Some(reason) = self.services_refuse {
            return Err(bpf::Error::InvalidInterfaceName {
                name: "SERVICES".to_owned(),
                reason,
            });
        }
        self.service_writes += 1;
        Ok(self.services.remove(&range.trunc()).is_some())
    }
}

impl InterfacesPort for FakeMaps {
    fn read_interfaces(&self) -> BTreeMap<u32, bpf::Interface> {
        self.slots.clone()
    }

    fn write_interface(&mut self, interface: bpf::Interface) -> Result<(), bpf::Error> {
        let slot = interface_slot(interface.ifindex);
        if let Some(holder) = self.slots.get(&slot)
            && holder.ifindex != interface.ifindex
        {
            return Err(bpf::Error::InterfaceSlotTaken {
                ifindex: interface.ifindex,
                slot,
                holder: holder.ifindex,
            });
        }
        if !self.attached(interface.ifindex) {
            self.unattached_entries += 1;
        }
        self.interface_writes += 1;
        self.slots.insert(slot, interface);
        Ok(())
    }

    fn delete_interface(&mut self, ifindex: u32) -> Result<bool, bpf::Error> {
        let slot = interface_slot(ifindex);
        if self
            .slots
            .get(&slot)
            .is_some_and(|held| held.ifindex == ifindex)
        {
            self.interface_writes += 1;
            self.slots.remove(&slot);
            return Ok(true);
        }
        Ok(false)
    }

    fn clear_interface_slot(&mut self, slot: u32) -> Result<(), bpf::Error> {
        self.interface_writes += 1;
        self.slots.remove(&slot);
        Ok(())
    }
}

impl ClassifierPort for FakeMaps {
    fn attach(&mut self, interface: &str) -> Result<u32, bpf::Error> {
        if !self.interfaces.contains(interface) {
            return Err(bpf::Error::InterfaceNotFound {
                name: interface.to_owned(),
                source: nix::Error::ENODEV,
            });
        }
        self.attaches += 1;
        let ifindex = self.ifindex(interface);
        self.links
            .insert(interface.to_owned(), AttachmentState::Attached { ifindex });
        Ok(ifindex)
    }

    fn detach(&mut self, interface: &str) -> Result<bool, bpf::Error> {
        // As the datapath does: the entry of the interface it is on goes first.
        if let Some(AttachmentState::Attached { ifindex }) = self.links.get(interface).copied() {
            self.delete_interface(ifindex)?;
        }
        Ok(self.links.remove(interface).is_some())
    }

    fn attachments(&self) -> Result<Vec<Link>, bpf::Error> {
        Ok(self
            .links
            .iter()
            .flat_map(|(interface, state)| {
                let link = Link {
                    interface: interface.clone(),
                    state: *state,
                };
                [link.clone(), link]
            })
            .collect())
    }

    fn prune_defunct(&mut self) -> Result<usize, bpf::Error> {
        let before = self.links.len();
        self.links.retain(|_, s| *s != AttachmentState::Defunct);
        Ok((before - self.links.len()) * 2)
    }

    fn in_front(&self, interface: &str) -> Result<Vec<bpf::InFront>, bpf::Error> {
        Ok(self.in_front.get(interface).cloned().unwrap_or_default())
    }
}

impl NodeHooksPort for FakeMaps {
    fn default_uplinks(&self) -> Result<BTreeSet<String>, bpf::Error> {
        Ok(self.default_uplinks.clone())
    }

    fn attach_uplink(&mut self, interface: &str) -> Result<bpf::AttachOutcome, bpf::Error> {
        if !self.interfaces.contains(interface) {
            return Err(bpf::Error::InterfaceNotFound {
                name: interface.to_owned(),
                source: nix::Error::ENODEV,
            });
        }
        self.uplink_attaches += 1;
        let ifindex = self.ifindex(interface);
        let before = self
            .uplink_links
            .insert(interface.to_owned(), AttachmentState::Attached { ifindex });
        Ok(match before {
            Some(AttachmentState::Attached { .. }) => bpf::AttachOutcome::Adopted,
            Some(_) => bpf::AttachOutcome::ReplacedStale,
            None => bpf::AttachOutcome::Attached,
        })
    }

    fn detach_uplink(&mut self, interface: &str) -> Result<bool, bpf::Error> {
        Ok(self.uplink_links.remove(interface).is_some())
    }

    fn uplinks(&self) -> Result<Vec<Link>, bpf::Error> {
        Ok(self
            .uplink_links
            .iter()
            .map(|(interface, state)| Link {
                interface: interface.clone(),
                state: *state,
            })
            .collect())
    }

    fn find_cgroup2_root(&self) -> Result<PathBuf, bpf::Error> {
        self.cgroup2_root
            .clone()
            .ok_or_else(|| bpf::Error::NoCgroup2 {
                looked_in: "/sys/fs/cgroup".to_owned(),
            })
    }

    fn attach_sockets(&mut self, cgroup: &Path) -> Result<bpf::AttachOutcome, bpf::Error> {
        if self.cgroup2_root.as_deref() != Some(cgroup) {
            return Err(bpf::Error::NotCgroup2 {
                path: cgroup.to_owned(),
            });
        }
        self.sockets_attaches += 1;
        self.sockets = Some(cgroup.to_owned());
        Ok(bpf::AttachOutcome::Attached)
    }

    fn sockets_attached(&self) -> Result<bool, bpf::Error> {
        Ok(self.sockets.is_some())
    }
}

impl PinsPort for FakeMaps {
    fn ensure_pinned(&mut self) -> Result<bool, bpf::Error> {
        if !self.unpinned {
            return Ok(false);
        }
        if let Some(reason) = self.unpinnable {
            return Err(bpf::Error::InvalidInterfaceName {
                name: "pins".to_owned(),
                reason,
            });
        }
        self.unpinned = false;
        self.repins += 1;
        Ok(true)
    }
}

// The same ports on a fake shared with a test, which looks at it while the daemon
// owns it.

impl EndpointsPort for Arc<Mutex<FakeMaps>> {
    fn read_endpoints(&self) -> Result<BTreeMap<MapKey, bpf::Endpoint>, bpf::Error> {
        self.lock().read_endpoints()
    }

    fn read_endpoint(&self, ip: IpAddr) -> Result<Option<bpf::Endpoint>, bpf::Error> {
        self.lock().read_endpoint(ip)
    }

    fn write_endpoint(&mut self, ip: IpAddr, endpoint: bpf::Endpoint) -> Result<(), bpf::Error> {
        self.lock().write_endpoint(ip, endpoint)
    }

    fn delete_endpoint(&mut self, key: &MapKey) -> Result<bool, bpf::Error> {
        self.lock().delete_endpoint(key)
    }
}

impl NodesPort for Arc<Mutex<FakeMaps>> {
    fn read_nodes(&self) -> Result<BTreeMap<u16, bpf::NodeRecord>, bpf::Error> {
        self.lock().read_nodes()
    }

    fn write_node(
        &mut self,
        index: NonZeroU16,
        name: &str,
        addresses: &[IpAddr],
    ) -> Result<(), bpf::Error> {
        self.lock().write_node(index, name, addresses)
    }

    fn delete_node(&mut self, index: NonZeroU16) -> Result<bool, bpf::Error> {
        self.lock().delete_node(index)
    }
}

impl ServicesPort for Arc<Mutex<FakeMaps>> {
    fn read_services(&self) -> Result<BTreeMap<IpNet, ServiceKind>, bpf::Error> {
        self.lock().read_services()
    }

    fn write_service(&mut self, range: IpNet, kind: ServiceKind) -> Result<(), bpf::Error> {
        self.lock().write_service(range, kind)
    }

    fn delete_service(&mut self, range: IpNet) -> Result<bool, bpf::Error> {
        self.lock().delete_service(range)
    }
}

impl InterfacesPort for Arc<Mutex<FakeMaps>> {
    fn read_interfaces(&self) -> BTreeMap<u32, bpf::Interface> {
        self.lock().read_interfaces()
    }

    fn write_interface(&mut self, interface: bpf::Interface) -> Result<(), bpf::Error> {
        self.lock().write_interface(interface)
    }

    fn delete_interface(&mut self, ifindex: u32) -> Result<bool, bpf::Error> {
        self.lock().delete_interface(ifindex)
    }

    fn clear_interface_slot(&mut self, slot: u32) -> Result<(), bpf::Error> {
        self.lock().clear_interface_slot(slot)
    }
}

impl ClassifierPort for Arc<Mutex<FakeMaps>> {
    fn attach(&mut self, interface: &str) -> Result<u32, bpf::Error> {
        self.lock().attach(interface)
    }

    fn detach(&mut self, interface: &str) -> Result<bool, bpf::Error> {
        self.lock().detach(interface)
    }

    fn attachments(&self) -> Result<Vec<Link>, bpf::Error> {
        self.lock().attachments()
    }

    fn prune_defunct(&mut self) -> Result<usize, bpf::Error> {
        self.lock().prune_defunct()
    }

    fn in_front(&self, interface: &str) -> Result<Vec<bpf::InFront>, bpf::Error> {
        self.lock().in_front(interface)
    }
}

impl NodeHooksPort for Arc<Mutex<FakeMaps>> {
    fn default_uplinks(&self) -> Result<BTreeSet<String>, bpf::Error> {
        self.lock().default_uplinks()
    }

    fn attach_uplink(&mut self, interface: &str) -> Result<bpf::AttachOutcome, bpf::Error> {
        self.lock().attach_uplink(interface)
    }

    fn detach_uplink(&mut self, interface: &str) -> Result<bool, bpf::Error> {
        self.lock().detach_uplink(interface)
    }

    fn uplinks(&self) -> Result<Vec<Link>, bpf::Error> {
        self.lock().uplinks()
    }

    fn find_cgroup2_root(&self) -> Result<PathBuf, bpf::Error> {
        self.lock().find_cgroup2_root()
    }

    fn attach_sockets(&mut self, cgroup: &Path) -> Result<bpf::AttachOutcome, bpf::Error> {
        self.lock().attach_sockets(cgroup)
    }

    fn sockets_attached(&self) -> Result<bool, bpf::Error> {
        self.lock().sockets_attached()
    }
}

impl PinsPort for Arc<Mutex<FakeMaps>> {
    fn ensure_pinned(&mut self) -> Result<bool, bpf::Error> {
        self.lock().ensure_pinned()
    }
}
