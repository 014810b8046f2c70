//! SERVICE_FLOWS: packets and bytes per (client identity, Service address, port,
//! protocol, direction), counted by the root cgroup's programs where a socket's
//! request still carries the Service address it dialled and its reply carries
//! it back (docs/design.md, "Which Service"). FLOWS' units: segments, and the
//! link-layer bytes of every segment.

use std::{collections::BTreeMap, fmt, net::IpAddr};

use aya::maps::{IterableMap as _, MapData, MapError, PerCpuHashMap};
use census_common::{FlowValue, SERVICE_FLOWS_MAP, ServiceFlowKey, service_direction};
use serde::{Deserialize, Serialize};

use super::{Datapath, Error, maps::is_not_found};

pub(super) type ServiceFlowsMap = PerCpuHashMap<MapData, ServiceFlowKey, FlowValue>;

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

fn service_flows_error(source: MapError) -> Error {
    Error::Map {
        map: SERVICE_FLOWS_MAP,
        source,
    }
}

/// Every entry of a SERVICE_FLOWS map, summed over CPUs, ordered by client,
/// Service address, port, protocol and direction. The map evicts least recently
/// used entries when full, and the walk is not atomic: an entry evicted meanwhile
/// is missing, never counted twice. Entries census does not write (a key whose
/// address or direction is not well formed) are left out.
pub(super) fn read_all(map: &ServiceFlowsMap) -> Result<Vec<ServiceFlow>, MapError> {
    let mut flows = BTreeMap::new();
    for entry in map.iter() {
        match entry {
            Ok((key, per_cpu)) => {
                let (Some(service), Some(direction)) =
                    (key.service.ip(), ServiceDirection::from_raw(key.direction))
                else {
                    continue;
                };
                let (packets, bytes) = per_cpu.iter().fold((0u64, 0u64), |(p, b), v| {
                    (p.wrapping_add(v.packets), b.wrapping_add(v.bytes))
                });
                let flow = ServiceFlow {
                    client_identity: key.client_identity,
                    service,
                    port: key.port,
                    protocol: key.protocol,
                    direction,
                    packets,
                    bytes,
                };
                let order = (
                    key.client_identity,
                    service,
                    key.port,
                    key.protocol,
                    direction,
                );
                flows.insert(order, flow);
            }
            Err(error) if is_not_found(&error) => {}
            Err(error) => return Err(error),
        }
    }
    Ok(flows.into_values().collect())
}

impl Datapath {
    /// Every SERVICE_FLOWS entry (see [`read_all`]).
    pub fn service_flows(&self) -> Result<Vec<ServiceFlow>, Error> {
        read_all(&self.service_flows).map_err(service_flows_error)
    }

    /// SERVICE_FLOWS' size, as created.
    pub fn service_flows_max_entries(&self) -> Result<u32, Error> {
        self.service_flows
            .map()
            .info()
            .map(|info| info.max_entries())
            .map_err(service_flows_error)
    }
}
