//! SERVICE_FLOWS4 and SERVICE_FLOWS6: packets and bytes per (client identity,
//! Service address, port, protocol, direction), one map per family, counted by
//! the root cgroup's programs where a socket's request still carries the Service
//! address it dialled and its reply carries it back (docs/design.md, "Which
//! Service"). FLOWS' units: segments, and the link-layer bytes of every segment.
//! Layouts 6 and 7 kept both families in one map, SERVICE_FLOWS, which an agent of
//! this layout copies into the two ([`copy_layout7`]).

use std::{collections::BTreeMap, fmt, net::IpAddr};

use aya::maps::{IterableMap as _, MapData, MapError, MapInfo, PerCpuHashMap};
use census_common::{
    EndpointKey, FlowValue, SERVICE_FLOWS_LAYOUT7_MAP, SERVICE_FLOWS4_MAP, SERVICE_FLOWS6_MAP,
    ServiceFlowKey4, ServiceFlowKey6, ServiceFlowKeyLayout7, service_direction,
};
use serde::{Deserialize, Serialize};

use super::{
    Datapath, Error,
    maps::{MapShape, is_not_found},
    migrate,
    pins::{self, Pins},
};

pub(super) type ServiceFlowsMap4 = PerCpuHashMap<MapData, ServiceFlowKey4, FlowValue>;
pub(super) type ServiceFlowsMap6 = PerCpuHashMap<MapData, ServiceFlowKey6, FlowValue>;
pub(super) type ServiceFlowsMapLayout7 = PerCpuHashMap<MapData, ServiceFlowKeyLayout7, FlowValue>;

/// Which way a Service's packets went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ServiceDirection {
    /// From the client to the Service.
    Request,
    /// From the Service back to its client.
    Reply,
}

impl ServiceDirection {
    const fn from_raw(raw: u8) -> Option<Self> {
        match raw {
            service_direction::REQUEST => Some(Self::Request),
            service_direction::REPLY => Some(Self::Reply),
            _ => None,
        }
    }

    /// How the CLI, the admin API and the metrics name it.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Request => "request",
            Self::Reply => "reply",
        }
    }
}

impl fmt::Display for ServiceDirection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An IP protocol's name as Kubernetes spells a Service port's (`TCP`, `UDP`,
/// `SCTP`), or its number.
pub fn protocol_name(protocol: u8) -> std::borrow::Cow<'static, str> {
    match protocol {
        6 => "TCP".into(),
        17 => "UDP".into(),
        132 => "SCTP".into(),
        other => other.to_string().into(),
    }
}

/// One SERVICE_FLOWS entry, summed over CPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceFlow {
    /// The client's identity (`host`, 1, for the node's own sockets).
    pub client_identity: u32,
    /// The Service address the client dialled.
    pub service: IpAddr,
    /// Its port (0 when the packets carry none).
    pub port: u16,
    /// The IP protocol (6 TCP, 17 UDP, 132 SCTP).
    pub protocol: u8,
    pub direction: ServiceDirection,
    pub packets: u64,
    pub bytes: u64,
}

/// A Service counter's key, either family's, as the readers take it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Key {
    client_identity: u32,
    service: IpAddr,
    port: u16,
    protocol: u8,
    direction: ServiceDirection,
}

/// The key of a map of Service counters: what it says, if census wrote it.
trait CounterKey: aya::Pod {
    fn read(&self) -> Option<Key>;
}

impl Key {
    /// The key of these fields, if census wrote them (a well-formed address and
    /// direction).
    fn new(
        client_identity: u32,
        service: EndpointKey,
        (port, protocol, direction): (u16, u8, u8),
    ) -> Option<Self> {
        Some(Self {
            client_identity,
            service: service.ip()?,
            port,
            protocol,
            direction: ServiceDirection::from_raw(direction)?,
        })
    }
}

impl CounterKey for ServiceFlowKey4 {
    fn read(&self) -> Option<Key> {
        let service = EndpointKey::v4_word(self.service);
        let rest = (self.port, self.protocol, self.direction);
        Key::new(self.client_identity, service, rest)
    }
}

impl CounterKey for ServiceFlowKey6 {
    fn read(&self) -> Option<Key> {
        let service = EndpointKey::v6_words(self.service);
        let rest = (self.port, self.protocol, self.direction);
        Key::new(self.client_identity, service, rest)
    }
}

impl CounterKey for ServiceFlowKeyLayout7 {
    fn read(&self) -> Option<Key> {
        let rest = (self.port, self.protocol, self.direction);
        Key::new(self.client_identity, self.service, rest)
    }
}

/// This layout's Service counters: one map per family.
pub(super) struct SplitMaps {
    pub(super) v4: ServiceFlowsMap4,
    pub(super) v6: ServiceFlowsMap6,
}

/// Where a node's Service counters are: this layout's two maps, or an older
/// layout's one (read by the CLI beside an agent not upgraded yet).
pub(super) enum ServiceFlowMaps {
    Split(SplitMaps),
    Layout7(ServiceFlowsMapLayout7),
}

impl SplitMaps {
    /// See [`ServiceFlowMaps::read_all`].
    pub(super) fn read_all(&self) -> Result<Vec<ServiceFlow>, (&'static str, MapError)> {
        let mut flows = BTreeMap::new();
        collect(&self.v4, &mut flows).map_err(|e| (SERVICE_FLOWS4_MAP, e))?;
        collect(&self.v6, &mut flows).map_err(|e| (SERVICE_FLOWS6_MAP, e))?;
        Ok(flows.into_values().collect())
    }
}

impl ServiceFlowMaps {
    /// Every entry, summed over CPUs, ordered by client, Service address, port,
    /// protocol and direction. The maps evict least recently used entries when
    /// full, and a walk is not atomic: an entry evicted meanwhile is missing, never
    /// counted twice. Entries census does not write (a key whose address or
    /// direction is not well formed) are left out. A failure names its map.
    pub(super) fn read_all(&self) -> Result<Vec<ServiceFlow>, (&'static str, MapError)> {
        match self {
            Self::Split(maps) => maps.read_all(),
            Self::Layout7(map) => {
                let mut flows = BTreeMap::new();
                collect(map, &mut flows).map_err(|e| (SERVICE_FLOWS_LAYOUT7_MAP, e))?;
                Ok(flows.into_values().collect())
            }
        }
    }
}

fn collect<K: CounterKey>(
    map: &PerCpuHashMap<MapData, K, FlowValue>,
    flows: &mut BTreeMap<Key, ServiceFlow>,
) -> Result<(), MapError> {
    for entry in map.iter() {
        match entry {
            Ok((key, per_cpu)) => {
                let Some(key) = key.read() else {
                    continue;
                };
                let (packets, bytes) = per_cpu.iter().fold((0u64, 0u64), |(p, b), v| {
                    (p.wrapping_add(v.packets), b.wrapping_add(v.bytes))
                });
                let flow = ServiceFlow {
                    client_identity: key.client_identity,
                    service: key.service,
                    port: key.port,
                    protocol: key.protocol,
                    direction: key.direction,
                    packets,
                    bytes,
                };
                flows.insert(key, flow);
            }
            Err(error) if is_not_found(&error) => {}
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

/// Takes over layouts 6 and 7's SERVICE_FLOWS, before this layout is stamped:
/// every entry copied, with its per-CPU counters, into `v4` or `v6` by its
/// family; how many. A copy killed midway is redone whole at the next start
/// (each entry is written, not added to), and the old pin is removed once this
/// layout is stamped ([`remove_layout7`]). Nothing if there is no old map.
pub(super) fn copy_layout7(pins: &Pins, maps: &mut SplitMaps) -> Result<u64, Error> {
    let Layout7Pin::Found(old) = open_layout7(pins)? else {
        return Ok(0);
    };
    let failed = |map, source| Error::Map { map, source };
    let mut copied = 0;
    for entry in old.iter() {
        let (key, per_cpu) = match entry {
            Ok(entry) => entry,
            Err(error) if is_not_found(&error) => continue,
            Err(error) => return Err(failed(SERVICE_FLOWS_LAYOUT7_MAP, error)),
        };
        let (port, protocol, direction) = (key.port, key.protocol, key.direction);
        let client_identity = key.client_identity;
        match key.service.ip() {
            Some(IpAddr::V4(_)) => {
                let key = ServiceFlowKey4 {
                    client_identity,
                    port,
                    protocol,
                    direction,
                    service: key.service.addr[0],
                };
                maps.v4
                    .insert(key, per_cpu, 0)
                    .map_err(|e| failed(SERVICE_FLOWS4_MAP, e))?;
            }
            Some(IpAddr::V6(_)) => {
                let key = ServiceFlowKey6 {
                    client_identity,
                    port,
                    protocol,
                    direction,
                    service: key.service.addr,
                };
                maps.v6
                    .insert(key, per_cpu, 0)
                    .map_err(|e| failed(SERVICE_FLOWS6_MAP, e))?;
            }
            // Not census's: nothing to count it as.
            None => continue,
        }
        copied += 1;
    }
    Ok(copied)
}

/// What is pinned under layouts 6 and 7's SERVICE_FLOWS name.
enum Layout7Pin {
    Absent,
    /// A map of another shape: not census's Service counters, so neither copied
    /// nor removed.
    Foreign(MapShape),
    Found(ServiceFlowsMapLayout7),
}

/// The old SERVICE_FLOWS pinned in `pins`.
fn open_layout7(pins: &Pins) -> Result<Layout7Pin, Error> {
    let path = pins.map(SERVICE_FLOWS_LAYOUT7_MAP);
    if !path.exists() {
        return Ok(Layout7Pin::Absent);
    }
    let failed = |source| Error::Map {
        map: SERVICE_FLOWS_LAYOUT7_MAP,
        source,
    };
    let info = MapInfo::from_pin(&path).map_err(failed)?;
    let shape = pins::shape_of(&info);
    if !pins::is_layout7_service_flows(&shape) {
        return Ok(Layout7Pin::Foreign(shape));
    }
    let data = MapData::from_pin(&path).map_err(failed)?;
    aya::maps::Map::from_map_data(data)
        .and_then(ServiceFlowsMapLayout7::try_from)
        .map(Layout7Pin::Found)
        .map_err(failed)
}

/// Removes the old SERVICE_FLOWS' pin, once this layout is stamped: its entries
/// were copied. A pin of another shape under its name is left, with a warning
/// at every start while it is there: census did not make it.
pub(super) fn remove_layout7(pins: &Pins) -> Result<(), Error> {
    match open_layout7(pins)? {
        Layout7Pin::Absent => Ok(()),
        Layout7Pin::Foreign(shape) => {
            tracing::warn!(
                pin = %pins.map(SERVICE_FLOWS_LAYOUT7_MAP).display(),
                %shape,
                "a pinned map named SERVICE_FLOWS is not layouts 6 and 7's Service counters \
                 (those are a least-recently-used per-CPU hash of 28-byte keys and 16-byte \
                 values): not copied, left in place; remove it if nothing else uses it"
            );
            Ok(())
        }
        Layout7Pin::Found(_) => migrate::remove_pin(&pins.map(SERVICE_FLOWS_LAYOUT7_MAP)),
    }
}

impl Datapath {
    /// Every Service counter of both families (see [`ServiceFlowMaps::read_all`]).
    pub fn service_flows(&self) -> Result<Vec<ServiceFlow>, Error> {
        self.service_flows
            .read_all()
            .map_err(|(map, source)| Error::Map { map, source })
    }

    /// The sizes SERVICE_FLOWS4 and SERVICE_FLOWS6 were created with.
    pub fn service_flows_max_entries(&self) -> Result<(u32, u32), Error> {
        let size = |map: &MapData, name| {
            map.info()
                .map(|info| info.max_entries())
                .map_err(|source| Error::Map { map: name, source })
        };
        Ok((
            size(self.service_flows.v4.map(), SERVICE_FLOWS4_MAP)?,
            size(self.service_flows.v6.map(), SERVICE_FLOWS6_MAP)?,
        ))
    }
}
