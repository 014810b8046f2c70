//! The ENDPOINTS, INTERFACES and FLOWS maps, in domain terms.

use std::{
    collections::BTreeMap, fmt, io, net::IpAddr, num::NonZeroU16, ops::BitOr, os::fd::AsFd as _,
};

use aya::{
    maps::{
        Array, HashMap, Map, MapData, MapError, MapType, PerCpuArray, PerCpuHashMap, PerCpuValues,
    },
    sys::SyscallError,
    util::nr_cpus,
};
use census_common::{
    ENDPOINTS_MAP, EndpointKey, EndpointValue, FLOWS_MAP, FlowKey, FlowValue, INTERFACES_MAP,
    InterfaceValue, STATS_MAP, flags, identity, interface_slot, stats,
};

use super::{Datapath, Error, sys::MappedArray};

/// What ENDPOINTS says about one address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Endpoint {
    pub identity: u32,
    pub flags: EndpointFlags,
    /// The index of the node a REMOTE endpoint is on (a NODES key); 0 for every
    /// other entry.
    pub node: u16,
}

impl Endpoint {
    /// An endpoint on this node, behind an interface census is attached to.
    pub const fn local(identity: u32) -> Self {
        Self {
            identity,
            flags: EndpointFlags::LOCAL,
            node: 0,
        }
    }

    /// An endpoint on this node whose host-side interface census could not find, so
    /// no census program sees its packets leave: the hook of whatever it talks to
    /// counts them (no LOCAL flag, so an egress hook does not skip them).
    pub const fn unattached(identity: u32) -> Self {
        Self {
            identity,
            flags: EndpointFlags(0),
            node: 0,
        }
    }

    /// An endpoint on another node, `node` (its NODES index): a pod there, or one
    /// of that node's addresses (identity `remote-node`).
    pub const fn remote(identity: u32, node: NonZeroU16) -> Self {
        Self {
            identity,
            flags: EndpointFlags::REMOTE,
            node: node.get(),
        }
    }

    /// One of this node's own addresses.
    pub const fn host() -> Self {
        Self {
            identity: identity::HOST,
            flags: EndpointFlags::HOST,
            node: 0,
        }
    }

    /// The node of a REMOTE endpoint.
    pub const fn remote_node(&self) -> Option<NonZeroU16> {
        if self.flags.contains(EndpointFlags::REMOTE) {
            NonZeroU16::new(self.node)
        } else {
            None
        }
    }

    /// Whether this is an entry ENDPOINTS may hold for `ip`
    /// ([`Error::InvalidEndpoint`] says why not): at most one of LOCAL, REMOTE and
    /// HOST; the host identity with HOST only; a node with REMOTE only.
    pub fn check(self, ip: IpAddr) -> Result<(), Error> {
        let invalid = |reason| Err(Error::InvalidEndpoint { ip, reason });
        let flags = self.flags;
        if self.identity == identity::INVALID {
            return invalid("identity 0 is not an identity");
        }
        if flags.bits() & !flags::ALL != 0 {
            return invalid("unknown flags");
        }
        let places = [
            EndpointFlags::LOCAL,
            EndpointFlags::REMOTE,
            EndpointFlags::HOST,
        ]
        .into_iter()
        .filter(|&flag| flags.contains(flag))
        .count();
        if places > 1 {
            return invalid("at most one of LOCAL, REMOTE and HOST may be set");
        }
        if flags.contains(EndpointFlags::HOST) != (self.identity == identity::HOST) {
            return invalid("the host identity (1) goes with the HOST flag, and only with it");
        }
        if flags.contains(EndpointFlags::REMOTE) != (self.node != 0) {
            return invalid("a REMOTE endpoint names its node (index 1 or more), and only it");
        }
        Ok(())
    }

    pub(super) fn to_value(self) -> EndpointValue {
        EndpointValue {
            identity: self.identity,
            flags: self.flags.bits(),
            node: self.node,
        }
    }

    pub(super) const fn from_value(value: EndpointValue) -> Self {
        Self {
            identity: value.identity,
            flags: EndpointFlags(value.flags),
            node: value.node,
        }
    }
}

/// The flags of an [`Endpoint`]; unknown bits read from a map are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct EndpointFlags(u16);

impl EndpointFlags {
    pub const LOCAL: Self = Self(flags::LOCAL);
    pub const REMOTE: Self = Self(flags::REMOTE);
    pub const HOST: Self = Self(flags::HOST);

    pub const fn bits(self) -> u16 {
        self.0
    }

    pub const fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }
}

impl BitOr for EndpointFlags {
    type Output = Self;

    fn bitor(self, rhs: Self) -> Self {
        Self(self.0 | rhs.0)
    }
}

/// What INTERFACES says about one interface census's programs are attached to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Interface {
    /// Its index, in the network namespace the programs are attached in.
    pub ifindex: u32,
    /// The identity every endpoint behind it holds; `None` when there is no such
    /// single identity (the program then looks the packet's address up, and
    /// still knows the packet was counted when it left this interface).
    pub identity: Option<u32>,
}

impl Interface {
    fn check(self) -> Result<(), Error> {
        let invalid = |reason| {
            Err(Error::InvalidInterface {
                ifindex: self.ifindex,
                reason,
            })
        };
        if self.ifindex == 0 {
            return invalid("no interface has index 0");
        }
        if self.identity == Some(identity::INVALID) {
            return invalid("identity 0 is not an identity (None means no single identity)");
        }
        Ok(())
    }

    fn to_value(self) -> InterfaceValue {
        InterfaceValue {
            ifindex: self.ifindex,
            identity: self.identity.unwrap_or(identity::INVALID),
        }
    }

    /// The interface a slot holds, `None` for an empty slot.
    pub(super) fn from_value(value: InterfaceValue) -> Option<Self> {
        (value.ifindex != 0).then_some(Self {
            ifindex: value.ifindex,
            identity: (value.identity != identity::INVALID).then_some(value.identity),
        })
    }
}

/// Traffic of one (source identity, destination identity) pair, summed over
/// CPUs. `packets` counts GSO segments; `bytes` includes link-layer headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Flow {
    pub src_identity: u32,
    pub dst_identity: u32,
    pub packets: u64,
    pub bytes: u64,
}

/// The kind, sizes and flags of a map, compared with what a layout expects.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MapShape {
    /// `None` for a map type aya does not know.
    pub map_type: Option<MapType>,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
    /// `BPF_F_*` creation flags (INTERFACES is `BPF_F_MMAPABLE`).
    pub map_flags: u32,
}

impl fmt::Display for MapShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Self {
            map_type,
            key_size,
            value_size,
            max_entries,
            map_flags,
        } = self;
        match map_type {
            Some(map_type) => write!(f, "{map_type:?}")?,
            None => f.write_str("unknown type")?,
        }
        write!(
            f,
            " map, key {key_size} B, value {value_size} B, {max_entries} entries"
        )?;
        if *map_flags != 0 {
            write!(f, ", flags {map_flags:#x}")?;
        }
        Ok(())
    }
}

pub(super) type EndpointsMap = HashMap<MapData, EndpointKey, EndpointValue>;
pub(super) type FlowsMap = PerCpuHashMap<MapData, FlowKey, FlowValue>;
pub(super) type StatsMap = PerCpuArray<MapData, u64>;

/// The programs' own counters (STATS), summed over CPUs, since the maps were
/// created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct DatapathStats {
    /// Identity pairs inserted into FLOWS.
    pub flow_inserts: u64,
    /// FLOWS inserts the kernel refused: those packets went uncounted.
    pub flow_insert_failures: u64,
    /// IPv4 or IPv6 frames too short to hold their addresses (not counted).
    pub unparsable: u64,
    /// Packets counted by address because their interface had no INTERFACES
    /// entry although their endpoint is LOCAL.
    pub interface_misses: u64,
    /// Datapath log events the programs' rate limit held back.
    pub log_suppressed: u64,
    /// Packets sent to a Service address, marked where they left their endpoint.
    pub service_marked: u64,
    /// Marked packets counted once translated.
    pub marked_counted: u64,
    /// Entries inserted into SERVICE_FLOWS4/6.
    pub service_flow_inserts: u64,
    /// SERVICE_FLOWS4/6 inserts the kernel refused: those packets went uncounted
    /// there (FLOWS counted them as always).
    pub service_flow_insert_failures: u64,
}

impl DatapathStats {
    /// Pairs FLOWS evicted: an LRU map evicts without telling the program, and
    /// nothing else removes pairs, so every pair inserted and no longer present
    /// was evicted.
    pub fn flow_evictions(&self, pairs_present: u64) -> u64 {
        self.flow_inserts.saturating_sub(pairs_present)
    }

    /// Marked packets not counted: dropped (a Service without endpoints
    /// rejects them, say), or stripped of the mark by a rule that rewrites the
    /// whole of `skb->mark` (a `CONNMARK --restore-mark` without a mask). A count
    /// that grows with Service traffic is such a rule.
    pub fn marks_lost(&self) -> u64 {
        self.service_marked.saturating_sub(self.marked_counted)
    }

    /// Reads STATS.
    pub(super) fn read(map: &StatsMap) -> Result<Self, MapError> {
        let slot = |index| -> Result<u64, MapError> {
            let values = map.get(&index, 0)?;
            Ok(values.iter().fold(0u64, |sum, v| sum.wrapping_add(*v)))
        };
        Ok(Self {
            flow_inserts: slot(stats::FLOW_INSERTS)?,
            flow_insert_failures: slot(stats::FLOW_INSERT_FAILURES)?,
            unparsable: slot(stats::UNPARSABLE)?,
            interface_misses: slot(stats::INTERFACE_MISSES)?,
            log_suppressed: slot(stats::LOG_SUPPRESSED)?,
            service_marked: slot(stats::SERVICE_MARKED)?,
            marked_counted: slot(stats::MARKED_COUNTED)?,
            service_flow_inserts: slot(stats::SERVICE_FLOW_INSERTS)?,
            service_flow_insert_failures: slot(stats::SERVICE_FLOW_INSERT_FAILURES)?,
        })
    }
}

/// The number of pairs in FLOWS.
pub(super) fn count_flows(flows: &FlowsMap) -> Result<u64, Error> {
    let mut pairs = 0;
    for key in flows.keys() {
        match key {
            Ok(_) => pairs += 1,
            Err(error) if is_not_found(&error) => {}
            Err(error) => return Err(flows_error(error)),
        }
    }
    Ok(pairs)
}

/// Counts `pairs` as inserted, on the first CPU, unless STATS already counted
/// inserts: the pairs of maps that predate STATS.
pub(super) fn seed_flow_inserts(map: &mut StatsMap, pairs: u64) -> Result<(), Error> {
    let current = DatapathStats::read(map).map_err(stats_error)?;
    if current.flow_inserts != 0 || pairs == 0 {
        return Ok(());
    }
    let cpus_error = |source| Error::Io {
        operation: "reading the possible CPUs",
        path: "/sys/devices/system/cpu/possible".into(),
        source,
    };
    let cpus = nr_cpus().map_err(|(_, source)| cpus_error(source))?;
    let mut values = vec![0u64; cpus];
    if let Some(first) = values.first_mut() {
        *first = pairs;
    }
    let values = PerCpuValues::try_from(values).map_err(cpus_error)?;
    map.set(stats::FLOW_INSERTS, values, 0).map_err(stats_error)
}

fn stats_error(source: MapError) -> Error {
    Error::Map {
        map: STATS_MAP,
        source,
    }
}

/// INTERFACES: written through `bpf(2)`, read through a mapping of its memory
/// (every slot of a 65,536-slot array in microseconds, not one syscall each).
pub(super) struct InterfacesMap {
    array: Array<MapData, InterfaceValue>,
    slots: MappedArray,
}

impl InterfacesMap {
    pub(super) fn new(map: Map) -> Result<Self, Error> {
        let Map::Array(data) = map else {
            return Err(Error::MissingFromObject {
                kind: "array map",
                name: INTERFACES_MAP,
            });
        };
        let info = data.info().map_err(interfaces_error)?;
        let slots = MappedArray::new(data.fd().as_fd(), info.max_entries(), info.value_size())
            .map_err(|source| Error::MapMemory {
                map: INTERFACES_MAP,
                source,
            })?;
        let array = Array::try_from(Map::Array(data)).map_err(interfaces_error)?;
        Ok(Self { array, slots })
    }
}

/// Every used slot of a mapped INTERFACES, by slot.
pub(super) fn used_slots(slots: &MappedArray) -> BTreeMap<u32, Interface> {
    (0..slots.entries())
        .filter_map(|slot| Some((slot, slot_of(slots, slot)?)))
        .collect()
}

/// The interface slot `slot` of a mapped INTERFACES holds, if any.
pub(super) fn slot_of(slots: &MappedArray, slot: u32) -> Option<Interface> {
    let [ifindex, identity] = slots.read(slot)?;
    Interface::from_value(InterfaceValue { ifindex, identity })
}

pub(super) fn is_not_found(error: &MapError) -> bool {
    match error {
        MapError::KeyNotFound | MapError::ElementNotFound => true,
        MapError::SyscallError(SyscallError { io_error, .. }) => {
            io_error.kind() == io::ErrorKind::NotFound
        }
        _ => false,
    }
}

/// Whether a failed write was refused because the map is full: a hash map holding
/// `max_entries` answers `E2BIG` (and `ENOSPC` is what some map kinds answer).
pub(super) fn is_full(error: &MapError) -> bool {
    match error {
        MapError::SyscallError(SyscallError { io_error, .. }) => matches!(
            io_error.raw_os_error(),
            Some(code) if code == libc::E2BIG || code == libc::ENOSPC
        ),
        _ => false,
    }
}

/// [`Error::MapFull`] if the write failed because the map is full, else the
/// map's error.
pub(super) fn full_or(
    source: MapError,
    map: &'static str,
    max_entries: u32,
    flag: &'static str,
    key: impl FnOnce() -> String,
) -> Error {
    if is_full(&source) {
        Error::MapFull {
            map,
            max_entries,
            key: key(),
            flag,
        }
    } else {
        Error::Map { map, source }
    }
}

fn endpoints_error(source: MapError) -> Error {
    Error::Map {
        map: ENDPOINTS_MAP,
        source,
    }
}

fn interfaces_error(source: MapError) -> Error {
    Error::Map {
        map: INTERFACES_MAP,
        source,
    }
}

fn flows_error(source: MapError) -> Error {
    Error::Map {
        map: FLOWS_MAP,
        source,
    }
}

/// The keys of `entries` flagged HOST.
fn hosts_of(entries: &BTreeMap<EndpointKey, Endpoint>) -> impl Iterator<Item = EndpointKey> {
    entries
        .iter()
        .filter(|(_, entry)| entry.flags.contains(EndpointFlags::HOST))
        .map(|(key, _)| *key)
}

/// The keys of ENDPOINTS' HOST entries, read whole (for ADDRESS_FILTER at
/// start, when the pinned filter is not on).
pub(super) fn host_keys(endpoints: &EndpointsMap) -> Result<Vec<EndpointKey>, Error> {
    let mut hosts = Vec::new();
    for entry in endpoints.iter() {
        match entry {
            Ok((key, value)) => {
                if Endpoint::from_value(value)
                    .flags
                    .contains(EndpointFlags::HOST)
                {
                    hosts.push(key);
                }
            }
            Err(error) if is_not_found(&error) => {}
            Err(error) => return Err(endpoints_error(error)),
        }
    }
    Ok(hosts)
}

impl Datapath {
    /// Writes (creates or replaces) the entry of `ip`.
    /// [`Error::MapFull`] when ENDPOINTS holds its maximum and `ip` has no entry
    /// yet (nothing changes; replacing an entry never fails so).
    ///
    /// ADDRESS_FILTER takes a HOST entry's address first, and loses it after the
    /// address's entry is no longer HOST (see [`super::filter`]).
    pub fn upsert_endpoint(&mut self, ip: IpAddr, endpoint: Endpoint) -> Result<(), Error> {
        endpoint.check(ip)?;
        let key = EndpointKey::from(ip);
        let host = endpoint.flags.contains(EndpointFlags::HOST);
        if host {
            self.filter_mut().add_host(key)?;
        }
        let max_entries = self.endpoints_max_entries;
        let result = self
            .endpoints
            .insert(key, endpoint.to_value(), 0)
            .map_err(|source| {
                full_or(
                    source,
                    ENDPOINTS_MAP,
                    max_entries,
                    "endpoints-max-entries",
                    || ip.to_string(),
                )
            });
        let full = matches!(result, Err(Error::MapFull { .. }));
        if full && !self.endpoints_full {
            tracing::warn!(
                max_entries,
                %ip,
                "ENDPOINTS is full: new addresses are not written (their packets count as \
                 world) until entries are removed or the agent runs with a larger \
                 --endpoints-max-entries"
            );
        } else if !full && self.endpoints_full && result.is_ok() {
            tracing::info!(max_entries, "ENDPOINTS takes new entries again");
        }
        if full || result.is_ok() {
            self.endpoints_full = full;
        }
        if result.is_ok() {
            // The sockets' cached clients were read before this write.
            self.clients_epoch.advance();
        }
        if !host && result.is_ok() {
            self.filter_mut().remove_host(&key)?;
        }
        result
    }

    /// The number of entries ENDPOINTS can hold.
    pub fn endpoints_max_entries(&self) -> u32 {
        self.endpoints_max_entries
    }

    /// Removes the entry of `ip`; `false` if there was none.
    pub fn delete_endpoint(&mut self, ip: IpAddr) -> Result<bool, Error> {
        self.delete_endpoint_key(&EndpointKey::from(ip))
    }

    /// Removes an entry by its raw key, for keys that [`EndpointKey::ip`] cannot
    /// read (not written by census); `false` if there was none.
    pub fn delete_endpoint_key(&mut self, key: &EndpointKey) -> Result<bool, Error> {
        let removed = match self.endpoints.remove(key) {
            Ok(()) => true,
            Err(error) if is_not_found(&error) => false,
            Err(error) => return Err(endpoints_error(error)),
        };
        if removed {
            self.clients_epoch.advance();
        }
        self.filter_mut().remove_host(key)?;
        Ok(removed)
    }

    /// The entry of `ip`, if any.
    pub fn endpoint(&self, ip: IpAddr) -> Result<Option<Endpoint>, Error> {
        match self.endpoints.get(&EndpointKey::from(ip), 0) {
            Ok(value) => Ok(Some(Endpoint::from_value(value))),
            Err(error) if is_not_found(&error) => Ok(None),
            Err(error) => Err(endpoints_error(error)),
        }
    }

    /// Every entry, by raw key (`EndpointKey::ip` gives the address of the keys
    /// census writes). A key deleted while the map is walked may be missing.
    /// ADDRESS_FILTER takes the HOST entries as the node's addresses.
    pub fn endpoints(&self) -> Result<BTreeMap<EndpointKey, Endpoint>, Error> {
        let mut entries = BTreeMap::new();
        for entry in self.endpoints.iter() {
            match entry {
                Ok((key, value)) => {
                    entries.insert(key, Endpoint::from_value(value));
                }
                Err(error) if is_not_found(&error) => {}
                Err(error) => return Err(endpoints_error(error)),
            }
        }
        self.filter_lock().learn_hosts(hosts_of(&entries))?;
        Ok(entries)
    }

    /// Writes the entry of `interface` into its slot of INTERFACES. Fails with
    /// [`Error::InterfaceSlotTaken`] when another interface holds the slot: clear
    /// that one first ([`Datapath::delete_interface`]).
    ///
    /// Write it only while census's programs are attached to both hooks of the
    /// interface: the egress program skips packets that arrived through an
    /// interface with an entry, as counted when they left it.
    ///
    /// Refusing a slot held by another interface also means a slot never passes
    /// from one interface to another in one write: a program that reads it while
    /// it is written (a plain copy, not atomic) sees the old entry, the new one, an
    /// empty slot or the interface without identity, never an interface with
    /// another's identity.
    pub fn set_interface(&mut self, interface: Interface) -> Result<(), Error> {
        interface.check()?;
        let slot = interface_slot(interface.ifindex);
        if let Some(holder) = self.interface_slot(slot)
            && holder.ifindex != interface.ifindex
        {
            return Err(Error::InterfaceSlotTaken {
                ifindex: interface.ifindex,
                slot,
                holder: holder.ifindex,
            });
        }
        self.interfaces
            .array
            .set(slot, interface.to_value(), 0)
            .map_err(interfaces_error)
    }

    /// Removes the entry of interface `ifindex`; `false` if there was none (its
    /// slot is empty or holds another interface, which is left alone).
    pub fn delete_interface(&mut self, ifindex: u32) -> Result<bool, Error> {
        let slot = interface_slot(ifindex);
        match self.interface_slot(slot) {
            Some(holder) if holder.ifindex == ifindex => {
                self.clear_interface_slot(slot)?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Empties slot `slot` of INTERFACES, whatever it holds (also an entry that is
    /// not in its interface's slot, which no packet ever matches).
    pub fn clear_interface_slot(&mut self, slot: u32) -> Result<(), Error> {
        self.interfaces
            .array
            .set(slot, InterfaceValue::EMPTY, 0)
            .map_err(interfaces_error)
    }

    /// The entry of interface `ifindex`, if its slot holds one for it.
    pub fn interface(&self, ifindex: u32) -> Option<Interface> {
        self.interface_slot(interface_slot(ifindex))
            .filter(|held| held.ifindex == ifindex)
    }

    /// Every used slot of INTERFACES, by slot. A slot holds the interface whose
    /// [`census_common::interface_slot`] it is, unless someone else wrote it.
    pub fn interfaces(&self) -> BTreeMap<u32, Interface> {
        used_slots(&self.interfaces.slots)
    }

    fn interface_slot(&self, slot: u32) -> Option<Interface> {
        slot_of(&self.interfaces.slots, slot)
    }

    /// The programs' own counters, summed over CPUs.
    pub fn stats(&self) -> Result<DatapathStats, Error> {
        DatapathStats::read(&self.stats).map_err(stats_error)
    }

    /// The counters of one identity pair, summed over CPUs.
    pub fn flow(&self, src_identity: u32, dst_identity: u32) -> Result<Option<Flow>, Error> {
        let key = FlowKey {
            src_identity,
            dst_identity,
        };
        match self.flows.get(&key, 0) {
            Ok(per_cpu) => Ok(Some(sum(key, per_cpu.iter()))),
            Err(error) if is_not_found(&error) => Ok(None),
            Err(error) => Err(flows_error(error)),
        }
    }

    /// Every identity pair's counters, summed over CPUs, ordered by pair. The map
    /// evicts least recently used pairs when full, and the walk is not atomic: a
    /// pair evicted meanwhile is missing, never counted twice.
    pub fn flows(&self) -> Result<Vec<Flow>, Error> {
        let mut flows = BTreeMap::new();
        for entry in self.flows.iter() {
            match entry {
                Ok((key, per_cpu)) => {
                    flows.insert(key, sum(key, per_cpu.iter()));
                }
                Err(error) if is_not_found(&error) => {}
                Err(error) => return Err(flows_error(error)),
            }
        }
        Ok(flows.into_values().collect())
    }
}

fn sum<'a>(key: FlowKey, per_cpu: impl Iterator<Item = &'a FlowValue>) -> Flow {
    per_cpu.fold(
        Flow {
            src_identity: key.src_identity,
            dst_identity: key.dst_identity,
            packets: 0,
            bytes: 0,
        },
        |flow, value| Flow {
            packets: flow.packets.wrapping_add(value.packets),
            bytes: flow.bytes.wrapping_add(value.bytes),
            ..flow
        },
    )
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    const IP: IpAddr = IpAddr::V4(Ipv4Addr::new(198, 18, 0, 2));
    const NODE: NonZeroU16 = NonZeroU16::new(3).unwrap();

    #[test]
    fn constructors_make_valid_endpoints() {
        for endpoint in [
            Endpoint::local(256),
            Endpoint::remote(300, NODE),
            Endpoint::remote(identity::REMOTE_NODE, NODE),
            Endpoint::host(),
        ] {
            assert!(endpoint.check(IP).is_ok(), "{endpoint:?}");
        }
    }

    #[test]
    fn rejects_inconsistent_endpoints() {
        let bad = [
            Endpoint::local(0),
            Endpoint::local(identity::HOST),
            Endpoint {
                identity: 256,
                flags: EndpointFlags::HOST,
                node: 0,
            },
            Endpoint {
                identity: 256,
                flags: EndpointFlags::LOCAL | EndpointFlags::REMOTE,
                node: 3,
            },
            Endpoint {
                identity: 256,
                flags: EndpointFlags(1 << 7) | EndpointFlags::LOCAL,
                node: 0,
            },
            Endpoint::unattached(identity::HOST),
            // A remote endpoint without its node, and a node without REMOTE.
            Endpoint {
                identity: 256,
                flags: EndpointFlags::REMOTE,
                node: 0,
            },
            Endpoint {
                node: 3,
                ..Endpoint::local(256)
            },
            Endpoint {
                node: 3,
                ..Endpoint::unattached(256)
            },
            Endpoint {
                node: 3,
                ..Endpoint::host()
            },
        ];
        for endpoint in bad {
            assert!(
                matches!(endpoint.check(IP), Err(Error::InvalidEndpoint { .. })),
                "{endpoint:?}"
            );
        }
        // A local endpoint without a hooked interface carries no place flag.
        assert!(Endpoint::unattached(256).check(IP).is_ok());
    }

    #[test]
    fn interface_entries_round_trip_and_reject_nonsense() {
        for interface in [
            Interface {
                ifindex: 7,
                identity: Some(4711),
            },
            Interface {
                ifindex: 70_000,
                identity: None,
            },
        ] {
            assert!(interface.check().is_ok(), "{interface:?}");
            assert_eq!(Interface::from_value(interface.to_value()), Some(interface));
        }
        assert_eq!(Interface::from_value(InterfaceValue::EMPTY), None);
        for bad in [
            Interface {
                ifindex: 0,
                identity: Some(4711),
            },
            Interface {
                ifindex: 7,
                identity: Some(identity::INVALID),
            },
        ] {
            assert!(
                matches!(bad.check(), Err(Error::InvalidInterface { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn sums_over_cpus() {
        let key = FlowKey {
            src_identity: 256,
            dst_identity: 257,
        };
        let values = [
            FlowValue {
                packets: 2,
                bytes: 100,
            },
            FlowValue::default(),
            FlowValue {
                packets: 3,
                bytes: 50,
            },
        ];
        let flow = sum(key, values.iter());
        assert_eq!((flow.packets, flow.bytes), (5, 150));
        assert_eq!((flow.src_identity, flow.dst_identity), (256, 257));
    }
}
