//! SERVICES: the cluster's Service addresses (ClusterIP ranges, LoadBalancer and
//! external IPs), a longest-prefix-match trie. A packet leaving an endpoint for one
//! of them is marked instead of counted, and counted where it is seen translated
//! (docs/design.md, "Counting traffic once").

use std::{collections::BTreeMap, fmt, str::FromStr};

use aya::maps::{
    MapData, MapError,
    lpm_trie::{Key, LpmTrie},
};
use census_common::{
    EndpointKey, MARK_BIT_DEFAULT, SERVICES_MAP, SERVICES_MAX_ENTRIES, ServiceKey,
};
use ipnet::IpNet;

use super::{
    Datapath, Error,
    maps::{is_full, is_not_found},
};

pub(super) type ServicesMap = LpmTrie<MapData, EndpointKey, u32>;

pub use census_common::ServiceKind;

/// census's bit of `skb->mark`: set on a packet that leaves an endpoint for a
/// Service address, cleared where the packet is counted (it never leaves the
/// node). Exactly one bit; by default one that kube-proxy, Cilium, Calico, Istio
/// and the AWS VPC CNI leave alone
/// ([`MARK_BIT_DEFAULT`](census_common::MARK_BIT_DEFAULT)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MarkBit(u32);

impl MarkBit {
    /// The bit `bit`, or why it is not one.
    pub fn new(bit: u32) -> Result<Self, MarkBitError> {
        if bit.is_power_of_two() {
            Ok(Self(bit))
        } else {
            Err(MarkBitError::NotOneBit(bit))
        }
    }

    pub const fn get(self) -> u32 {
        self.0
    }
}

impl Default for MarkBit {
    fn default() -> Self {
        Self(MARK_BIT_DEFAULT)
    }
}

impl fmt::Display for MarkBit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// Why a `--mark-bit` value is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MarkBitError {
    #[error("{0:#x} is not a single bit of skb->mark (exactly one bit set, e.g. 0x40)")]
    NotOneBit(u32),
    #[error("{0:?} is not a number (hexadecimal with 0x, or decimal)")]
    NotANumber(String),
}

impl FromStr for MarkBit {
    type Err = MarkBitError;

    /// Hexadecimal with `0x` (as iptables prints marks), or decimal.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let trimmed = text.trim();
        let parsed = match trimmed
            .strip_prefix("0x")
            .or_else(|| trimmed.strip_prefix("0X"))
        {
            Some(hex) => u32::from_str_radix(hex, 16),
            None => trimmed.parse(),
        };
        Self::new(parsed.map_err(|_| MarkBitError::NotANumber(text.to_owned()))?)
    }
}

/// The SERVICES key of `range` (its host bits cleared: one range, one entry).
pub(super) fn key_of(range: IpNet) -> Key<EndpointKey> {
    let key = service_key(range);
    Key::new(key.prefix_len, key.address)
}

/// [`key_of`] as census's own type.
pub(super) fn service_key(range: IpNet) -> ServiceKey {
    let range = range.trunc();
    ServiceKey::range(range.addr().into(), range.prefix_len())
}

/// The range a SERVICES key stands for; `None` for a key census does not write
/// (an address that is not well formed, a prefix longer than its family's).
pub(super) fn range_of(key: &Key<EndpointKey>) -> Option<IpNet> {
    let key = ServiceKey {
        prefix_len: key.prefix_len(),
        address: key.data(),
    };
    if key.prefix_len < 32 {
        return None;
    }
    let bits = u8::try_from(key.bits()).ok()?;
    IpNet::new(key.address.ip()?, bits).ok()
}

pub(super) fn services_error(source: MapError) -> Error {
    Error::Map {
        map: SERVICES_MAP,
        source,
    }
}

/// Every entry of a SERVICES map, by range; entries census does not write are
/// left out, as are entries deleted while the map is walked.
pub(super) fn read_all(map: &ServicesMap) -> Result<BTreeMap<IpNet, ServiceKind>, Error> {
    let mut services = BTreeMap::new();
    for entry in map.iter() {
        match entry {
            Ok((key, value)) => {
                if let (Some(range), Some(kind)) = (range_of(&key), ServiceKind::from_raw(value)) {
                    services.insert(range, kind);
                }
            }
            Err(error) if is_not_found(&error) => {}
            Err(error) => return Err(services_error(error)),
        }
    }
    Ok(services)
}

impl Datapath {
    /// Writes (creates or replaces) the entry of `range` (host bits ignored).
    /// [`Error::ServicesFull`] when SERVICES holds its maximum and `range` has no entry
    /// yet (nothing changes).
    ///
    /// ADDRESS_FILTER takes the range first (see [`super::filter`]).
    pub fn upsert_service(&mut self, range: IpNet, kind: ServiceKind) -> Result<(), Error> {
        let key = service_key(range);
        self.filter_mut().add_service(key)?;
        let result = self
            .services
            .insert(&key_of(range), kind.raw(), 0)
            .map_err(|source| {
                if is_full(&source) {
                    Error::ServicesFull {
                        max_entries: SERVICES_MAX_ENTRIES,
                        range: range.trunc(),
                    }
                } else {
                    services_error(source)
                }
            });
        // Refused, the range stays in the filter (it may have been in SERVICES
        // already): more "maybe" than needed until the full pass reads SERVICES.
        result
    }

    /// Removes the entry of `range`; `false` if there was none. ADDRESS_FILTER
    /// loses it after.
    pub fn delete_service(&mut self, range: IpNet) -> Result<bool, Error> {
        let removed = match self.services.remove(&key_of(range)) {
            Ok(()) => true,
            Err(error) if is_not_found(&error) => false,
            Err(error) => return Err(services_error(error)),
        };
        self.filter_mut().remove_service(&service_key(range))?;
        Ok(removed)
    }

    /// ADDRESS_FILTER's value, as the programs read it.
    pub fn address_filter(&self) -> Result<census_common::filter::AddressFilter, Error> {
        self.filter_lock().read()
    }

    /// Every SERVICES entry, by range; ADDRESS_FILTER takes them as its ranges
    /// and addresses.
    pub fn services(&self) -> Result<BTreeMap<IpNet, ServiceKind>, Error> {
        let services = read_all(&self.services)?;
        self.filter_lock()
            .learn_services(services.keys().map(|range| service_key(*range)))?;
        Ok(services)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_and_its_key_are_one_another() -> Result<(), ipnet::AddrParseError> {
        for text in ["10.96.0.0/12", "198.19.96.7/32", "fd00:10:96::/108", "::/0"] {
            let range: IpNet = text.parse()?;
            assert_eq!(range_of(&key_of(range)), Some(range), "{text}");
        }
        Ok(())
    }

    #[test]
    fn host_bits_are_cleared() -> Result<(), ipnet::AddrParseError> {
        let range: IpNet = "10.96.3.4/12".parse()?;
        let key = key_of(range);
        assert_eq!(key.prefix_len(), 32 + 12);
        assert_eq!(range_of(&key), Some("10.96.0.0/12".parse()?));
        Ok(())
    }

    #[test]
    fn keys_census_does_not_write_are_not_ranges() {
        let v4 = EndpointKey::v4([10, 0, 0, 1]);
        // Shorter than the family's bits, longer than an IPv4 address.
        assert_eq!(range_of(&Key::new(16, v4)), None);
        assert_eq!(range_of(&Key::new(32 + 33, v4)), None);
        // An unknown family.
        let foreign = EndpointKey {
            family: 9,
            addr: [0; 4],
        };
        assert_eq!(range_of(&Key::new(40, foreign)), None);
    }

    #[test]
    fn a_mark_bit_is_one_bit() {
        assert_eq!("0x40".parse(), Ok(MarkBit(0x40)));
        assert_eq!("0X8000000".parse(), Ok(MarkBit(0x0800_0000)));
        assert_eq!("64".parse(), Ok(MarkBit(64)));
        assert_eq!(MarkBit::default().get(), 0x40);
        assert_eq!(MarkBit(0x40).to_string(), "0x40");
        assert_eq!(
            "0x4040".parse::<MarkBit>(),
            Err(MarkBitError::NotOneBit(0x4040))
        );
        assert_eq!("0".parse::<MarkBit>(), Err(MarkBitError::NotOneBit(0)));
        assert_eq!(
            "0xzz".parse::<MarkBit>(),
            Err(MarkBitError::NotANumber("0xzz".to_owned()))
        );
        assert!("0x100000000".parse::<MarkBit>().is_err());
    }

    #[test]
    fn kinds_round_trip() {
        for kind in [
            ServiceKind::ClusterIpRange,
            ServiceKind::LoadBalancerIp,
            ServiceKind::ExternalIp,
        ] {
            assert_eq!(ServiceKind::from_raw(kind.raw()), Some(kind));
        }
        assert_eq!(ServiceKind::from_raw(0), None);
    }
}
