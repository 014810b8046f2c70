//! ADDRESS_FILTER, kept by the datapath beside what it writes to SERVICES and to
//! ENDPOINTS' HOST entries: the programs trust its "surely not", so every Service
//! range and address, and every address flagged HOST, is in it whenever a
//! program may look (`census_common::filter`).
//!
//! The filter is written before an entry is added and after one is removed, each
//! write one of [`AddressFilter::steps`]'. At start it takes what SERVICES holds,
//! and keeps the node addresses of the pinned filter (a previous run's) until it
//! has read ENDPOINTS whole: the HOST entries found there replace them.

use std::collections::BTreeSet;

use aya::maps::{Array, MapData, MapError};
use census_common::{
    EndpointKey, ServiceKey, family,
    filter::{ADDRESS_FILTER_MAP, AddressFilter, SERVICE_BITS_LG, SOURCE_BITS_LG, bucket},
};

use super::Error;

pub(super) type FilterMap = Array<MapData, AddressFilter>;

/// What the filter is built from, and the value the map holds.
pub(super) struct Filter {
    map: FilterMap,
    /// The value last written (or found pinned).
    written: AddressFilter,
    services: BTreeSet<ServiceKey>,
    /// The ranges of `services` (the others are single addresses).
    ranges: BTreeSet<ServiceKey>,
    hosts: BTreeSet<EndpointKey>,
    /// The single Service addresses' bits, and the sources' (those and `hosts`),
    /// kept as entries come and go: a write costs the same with 10 or 60,000
    /// Service addresses.
    service_bits: CountedBits,
    source_bits: CountedBits,
    /// The pinned filter's node address bits, kept until ENDPOINTS is read whole.
    inherited_hosts: Option<AddressFilter>,
}

impl std::fmt::Debug for Filter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Filter")
            .field("on", &self.written.is_on())
            .field("services", &self.services.len())
            .field("hosts", &self.hosts.len())
            .field("inherited_hosts", &self.inherited_hosts.is_some())
            .finish_non_exhaustive()
    }
}

fn filter_error(source: MapError) -> Error {
    Error::Map {
        map: ADDRESS_FILTER_MAP,
        source,
    }
}

impl Filter {
    /// The filter of `services` (SERVICES' keys, as pinned), keeping the pinned
    /// value's node addresses until [`learn_hosts`](Self::learn_hosts); written
    /// at once.
    ///
    /// A pinned filter that is not on (the map was just created, or taken over
    /// from a layout without it) says nothing of the node's addresses: then
    /// `hosts` reads them from ENDPOINTS at once (empty, or read once after a
    /// migration).
    pub(super) fn open(
        map: FilterMap,
        services: impl IntoIterator<Item = ServiceKey>,
        hosts: impl FnOnce() -> Result<Vec<EndpointKey>, Error>,
    ) -> Result<Self, Error> {
        let written = map.get(&0, 0).map_err(filter_error)?;
        let (hosts, inherited_hosts) = if written.is_on() {
            (Vec::new(), Some(written))
        } else {
            (hosts()?, None)
        };
        let mut filter = Self {
            map,
            written,
            services: BTreeSet::new(),
            ranges: BTreeSet::new(),
            hosts: BTreeSet::new(),
            service_bits: CountedBits::new(SERVICE_BITS_LG),
            source_bits: CountedBits::new(SOURCE_BITS_LG),
            inherited_hosts,
        };
        for key in services {
            filter.take_service(key);
        }
        for key in hosts {
            filter.take_host(key);
        }
        filter.write()?;
        Ok(filter)
    }

    /// Counts `key` in, without writing; whether it is new.
    fn take_service(&mut self, key: ServiceKey) -> bool {
        if !self.services.insert(key) {
            return false;
        }
        if is_single(&key) {
            self.service_bits.add(&key.address);
            self.source_bits.add(&key.address);
        } else {
            self.ranges.insert(key);
        }
        true
    }

    /// Counts `key` out, without writing; whether it was there.
    fn drop_service(&mut self, key: &ServiceKey) -> bool {
        if !self.services.remove(key) {
            return false;
        }
        if is_single(key) {
            self.service_bits.remove(&key.address);
            self.source_bits.remove(&key.address);
        } else {
            self.ranges.remove(key);
        }
        true
    }

    fn take_host(&mut self, key: EndpointKey) -> bool {
        let new = self.hosts.insert(key);
        if new {
            self.source_bits.add(&key);
        }
        new
    }

    fn drop_host(&mut self, key: &EndpointKey) -> bool {
        let gone = self.hosts.remove(key);
        if gone {
            self.source_bits.remove(key);
        }
        gone
    }

    /// The value the map holds.
    pub(super) fn read(&self) -> Result<AddressFilter, Error> {
        self.map.get(&0, 0).map_err(filter_error)
    }

    /// Before SERVICES takes `key`.
    pub(super) fn add_service(&mut self, key: ServiceKey) -> Result<(), Error> {
        if self.take_service(key) {
            return self.write();
        }
        Ok(())
    }

    /// After SERVICES lost `key` (or refused it).
    pub(super) fn remove_service(&mut self, key: &ServiceKey) -> Result<(), Error> {
        if self.drop_service(key) {
            return self.write();
        }
        Ok(())
    }

    /// Before ENDPOINTS takes `key` flagged HOST.
    pub(super) fn add_host(&mut self, key: EndpointKey) -> Result<(), Error> {
        if self.take_host(key) {
            return self.write();
        }
        Ok(())
    }

    /// After ENDPOINTS lost `key`'s HOST entry (or refused it).
    pub(super) fn remove_host(&mut self, key: &EndpointKey) -> Result<(), Error> {
        if self.drop_host(key) {
            return self.write();
        }
        Ok(())
    }

    /// ENDPOINTS read whole: its HOST entries are the node's addresses from now
    /// on, the pinned filter's are forgotten.
    pub(super) fn learn_hosts(
        &mut self,
        hosts: impl IntoIterator<Item = EndpointKey>,
    ) -> Result<(), Error> {
        let hosts: BTreeSet<_> = hosts.into_iter().collect();
        if hosts == self.hosts && self.inherited_hosts.is_none() {
            return Ok(());
        }
        let gone: Vec<_> = self.hosts.difference(&hosts).copied().collect();
        for key in &gone {
            self.drop_host(key);
        }
        for key in hosts {
            self.take_host(key);
        }
        self.inherited_hosts = None;
        self.write()
    }

    /// SERVICES read whole: its ranges are the filter's from now on.
    pub(super) fn learn_services(
        &mut self,
        services: impl IntoIterator<Item = ServiceKey>,
    ) -> Result<(), Error> {
        let services: BTreeSet<_> = services.into_iter().collect();
        if services == self.services {
            return Ok(());
        }
        let gone: Vec<_> = self.services.difference(&services).copied().collect();
        for key in &gone {
            self.drop_service(key);
        }
        for key in services {
            self.take_service(key);
        }
        self.write()
    }

    /// The filter of what is known now.
    fn target(&self) -> AddressFilter {
        let mut target = AddressFilter::build(&self.written, self.ranges.iter().copied(), []);
        target.services.copy_from_slice(&self.service_bits.words);
        target.sources.copy_from_slice(&self.source_bits.words);
        match &self.inherited_hosts {
            None => {}
            Some(inherited) if inherited.is_on() => {
                for (word, kept) in target.sources.iter_mut().zip(inherited.sources) {
                    *word |= kept;
                }
            }
            Some(_) => target.state = 0,
        }
        target
    }

    /// Takes the map to [`target`](Self::target), step by step.
    fn write(&mut self) -> Result<(), Error> {
        let target = self.target();
        for step in AddressFilter::steps(&self.written, &target).iter() {
            self.map.set(0, step, 0).map_err(filter_error)?;
            self.written = *step;
        }
        Ok(())
    }
}

/// Whether `key` is a single address (not a range).
fn is_single(key: &ServiceKey) -> bool {
    match key.address.family {
        family::IPV4 => key.bits() >= 32,
        family::IPV6 => key.bits() >= 128,
        _ => false,
    }
}

/// A bitmap of `2^lg` bits with a count of the addresses on each bit: a bit two
/// addresses share is cleared only when the last of them goes.
#[derive(Debug)]
struct CountedBits {
    lg: u32,
    counts: Vec<u32>,
    words: Vec<u64>,
}

impl CountedBits {
    fn new(lg: u32) -> Self {
        Self {
            lg,
            counts: vec![0; 1 << lg],
            words: vec![0; 1 << (lg - 6)],
        }
    }

    fn add(&mut self, key: &EndpointKey) {
        let bit = bucket(key, self.lg) as usize;
        if let Some(count) = self.counts.get_mut(bit) {
            *count += 1;
            if let Some(word) = self.words.get_mut(bit >> 6) {
                *word |= 1 << (bit & 63);
            }
        }
    }

    fn remove(&mut self, key: &EndpointKey) {
        let bit = bucket(key, self.lg) as usize;
        if let Some(count) = self.counts.get_mut(bit) {
            *count = count.saturating_sub(1);
            if *count == 0
                && let Some(word) = self.words.get_mut(bit >> 6)
            {
                *word &= !(1 << (bit & 63));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use census_common::filter::FILTER_RANGES;
    use ipnet::IpNet;
    use proptest::prelude::*;

    use super::*;

    fn service(text: &str) -> ServiceKey {
        let range = text.parse().unwrap_or_else(|_| IpNet::default());
        super::super::services::service_key(range)
    }

    fn address(text: &str) -> EndpointKey {
        EndpointKey::from(text.parse().unwrap_or(IpAddr::from([0, 0, 0, 0])))
    }

    /// Whether `filter` says "maybe" of every address of `services` (a range's
    /// first and last) and of every one of `hosts`.
    fn holds(filter: &AddressFilter, services: &[ServiceKey], hosts: &[EndpointKey]) -> bool {
        services.iter().all(|key| {
            let Some(range) = key
                .address
                .ip()
                .and_then(|ip| IpNet::new(ip, u8::try_from(key.bits()).unwrap_or(0)).ok())
            else {
                return true;
            };
            [range.network(), range.broadcast()]
                .into_iter()
                .all(|ip| filter.may_be_service(&EndpointKey::from(ip)))
        }) && hosts.iter().all(|key| filter.may_be_source(key))
    }

    #[test]
    fn an_address_in_a_range_is_a_services_without_a_lookup_only_while_the_ranges_are_exact() {
        use census_common::filter::{FILTER_ON, Verdict};
        let filter = AddressFilter::build(
            &AddressFilter::OFF,
            [
                service("10.96.0.0/12"),
                service("fd00:10:96::/108"),
                service("203.0.113.7/32"),
            ],
            [],
        );
        assert!(filter.ranges_exact());
        let verdict = |filter: &AddressFilter, ip: &str| filter.service_verdict(&address(ip));
        assert_eq!(verdict(&filter, "10.96.0.10"), Verdict::Yes);
        assert_eq!(verdict(&filter, "fd00:10:96::a"), Verdict::Yes);
        // A single address is only in a bitmap: SERVICES answers.
        assert_eq!(verdict(&filter, "203.0.113.7"), Verdict::Maybe);
        assert_eq!(verdict(&filter, "10.112.0.1"), Verdict::No);
        let on = AddressFilter {
            state: FILTER_ON,
            ..filter
        };
        assert_eq!(verdict(&on, "10.96.0.10"), Verdict::Maybe);
        assert_eq!(verdict(&on, "10.112.0.1"), Verdict::No);
        assert_eq!(verdict(&AddressFilter::OFF, "10.112.0.1"), Verdict::Maybe);
        // A new range: exactness off alone, the ranges written, on alone.
        let next = AddressFilter::build(
            &filter,
            [service("10.96.0.0/12"), service("10.200.0.0/16")],
            [],
        );
        let steps: Vec<_> = AddressFilter::steps(&filter, &next)
            .iter()
            .copied()
            .collect();
        assert_eq!(
            steps.first(),
            Some(&AddressFilter {
                state: FILTER_ON,
                ..filter
            })
        );
        assert_eq!(steps.last(), Some(&next));
        assert!(steps[..steps.len() - 1].iter().all(|s| !s.ranges_exact()));
        assert!(next.ranges_exact());
    }

    #[test]
    fn a_built_filter_answers_for_what_it_holds_and_surely_not_for_the_rest() {
        let services = [
            service("10.96.0.0/12"),
            service("fd00:10:96::/108"),
            service("203.0.113.7/32"),
            service("2001:db8::7/128"),
        ];
        let hosts = [address("198.18.0.1"), address("2001:db8:1::1")];
        let filter = AddressFilter::build(&AddressFilter::OFF, services, hosts);
        assert!(filter.is_on());
        assert!(holds(&filter, &services, &hosts));
        for other in ["10.95.255.255", "10.112.0.0", "fd00:10:97::1", "198.18.0.2"] {
            assert!(!filter.may_be_service(&address(other)), "{other}");
        }
        assert!(!filter.may_be_source(&address("198.18.0.2")));
        assert!(
            filter.may_be_source(&address("10.96.0.1")),
            "a Service address is a source too (a host-network backend's reply)"
        );
        assert!(AddressFilter::OFF.may_be_service(&address("192.0.2.1")));
        assert!(AddressFilter::OFF.may_be_source(&address("192.0.2.1")));
    }

    #[test]
    fn more_ranges_than_slots_or_a_range_of_everything_turn_the_filter_off() {
        let many = (0..=FILTER_RANGES).map(|i| service(&format!("10.{i}.0.0/16")));
        assert!(!AddressFilter::build(&AddressFilter::OFF, many, []).is_on());
        let everything = [service("0.0.0.0/0")];
        assert!(!AddressFilter::build(&AddressFilter::OFF, everything, []).is_on());
        let few = (0..FILTER_RANGES).map(|i| service(&format!("10.{i}.0.0/16")));
        assert!(AddressFilter::build(&AddressFilter::OFF, few, []).is_on());
    }

    #[test]
    fn a_bit_two_addresses_share_is_cleared_only_when_the_last_goes() {
        let mut bits = CountedBits::new(SOURCE_BITS_LG);
        let first = address("198.18.0.1");
        // Another address on the same bit.
        let second = (2..=u16::MAX)
            .map(|i| EndpointKey::from(IpAddr::from([198, 19, (i >> 8) as u8, i as u8])))
            .find(|other| bucket(other, SOURCE_BITS_LG) == bucket(&first, SOURCE_BITS_LG));
        assert!(second.is_some(), "65,534 addresses on 4,096 bits share one");
        let Some(second) = second else {
            return;
        };
        let set = |bits: &CountedBits| {
            let bit = bucket(&first, SOURCE_BITS_LG) as usize;
            bits.words[bit >> 6] & (1 << (bit & 63)) != 0
        };
        bits.add(&first);
        bits.add(&second);
        bits.remove(&first);
        assert!(set(&bits), "the second address still holds the bit");
        bits.remove(&second);
        assert!(!set(&bits));
        assert!(bits.words.iter().all(|w| *w == 0));
    }

    #[test]
    fn a_kept_range_keeps_its_slot() {
        let first = AddressFilter::build(
            &AddressFilter::OFF,
            [service("10.96.0.0/12"), service("10.200.0.0/16")],
            [],
        );
        let second = AddressFilter::build(&first, [service("10.200.0.0/16")], []);
        assert_eq!(first.v4_ranges[1], second.v4_ranges[1]);
        assert_eq!(second.v4_slots, 2, "slot 0 is free, slot 1 still looked at");
        let third = AddressFilter::build(
            &second,
            [service("10.200.0.0/16"), service("10.1.0.0/16")],
            [],
        );
        assert_eq!(third.v4_ranges[1], first.v4_ranges[1]);
    }

    /// A value a program could read while `after` is written over `before`:
    /// each word from one or the other, as `mix`'s bits say (a copy moves
    /// words; no word is ever half of each).
    fn torn(before: &AddressFilter, after: &AddressFilter, mix: u64) -> AddressFilter {
        let mut bit = 0u32;
        let mut pick = |a: u32, b: u32| {
            bit += 1;
            if mix.rotate_left(bit) & 1 == 1 { b } else { a }
        };
        let mut read = *before;
        read.state = pick(before.state, after.state);
        read.v4_slots = pick(before.v4_slots, after.v4_slots);
        read.v6_slots = pick(before.v6_slots, after.v6_slots);
        for (i, range) in read.v4_ranges.iter_mut().enumerate() {
            range.network = pick(before.v4_ranges[i].network, after.v4_ranges[i].network);
            range.mask = pick(before.v4_ranges[i].mask, after.v4_ranges[i].mask);
        }
        // The IPv6 ranges' 64-bit halves, torn in the middle too.
        let mut pick_halves = |a: u64, b: u64| {
            #[expect(clippy::cast_possible_truncation, reason = "the halves of a u64")]
            let (low, high) = (
                pick(a as u32, b as u32),
                pick((a >> 32) as u32, (b >> 32) as u32),
            );
            u64::from(high) << 32 | u64::from(low)
        };
        for (i, range) in read.v6_ranges.iter_mut().enumerate() {
            for w in 0..2 {
                range.network[w] = pick_halves(
                    before.v6_ranges[i].network[w],
                    after.v6_ranges[i].network[w],
                );
                range.mask[w] =
                    pick_halves(before.v6_ranges[i].mask[w], after.v6_ranges[i].mask[w]);
            }
        }
        let mut pick64 = |a: u64, b: u64| {
            bit += 1;
            if mix.rotate_left(bit) & 1 == 1 { b } else { a }
        };
        for (i, word) in read.services.iter_mut().enumerate() {
            *word = pick64(before.services[i], after.services[i]);
        }
        for (i, word) in read.sources.iter_mut().enumerate() {
            *word = pick64(before.sources[i], after.sources[i]);
        }
        read
    }

    /// Whether every slot `read` looks at is unused or holds a range of one
    /// of `ranges` (each built from one Service key).
    fn only_ranges_of(read: &AddressFilter, ranges: &[AddressFilter]) -> bool {
        let unused = AddressFilter::OFF;
        let v4 = read
            .v4_ranges
            .iter()
            .take(read.v4_slots as usize)
            .all(|slot| {
                *slot == unused.v4_ranges[0] || ranges.iter().any(|r| r.v4_ranges[0] == *slot)
            });
        let v6 = read
            .v6_ranges
            .iter()
            .take(read.v6_slots as usize)
            .all(|slot| {
                *slot == unused.v6_ranges[0] || ranges.iter().any(|r| r.v6_ranges[0] == *slot)
            });
        v4 && v6
    }

    fn range_strategy() -> impl Strategy<Value = ServiceKey> {
        prop_oneof![
            (0u8..4, 8u8..=24).prop_map(|(i, bits)| service(&format!("10.{}.0.0/{bits}", 64 * i))),
            (0u16..4).prop_map(|i| service(&format!("fd00:{i}::/112"))),
            (0u8..8).prop_map(|i| service(&format!("203.0.113.{i}/32"))),
            (0u16..8).prop_map(|i| service(&format!("2001:db8::{i}/128"))),
        ]
    }

    fn host_strategy() -> impl Strategy<Value = EndpointKey> {
        (0u8..8).prop_map(|i| address(&format!("198.18.0.{i}")))
    }

    /// Addresses in, beside and far from what [`range_strategy`] and
    /// [`host_strategy`] make.
    fn probe_strategy() -> impl Strategy<Value = IpAddr> {
        prop_oneof![
            any::<[u8; 4]>().prop_map(IpAddr::from),
            (0u8..=255, any::<u16>()).prop_map(|(i, low)| {
                let [a, b] = low.to_be_bytes();
                IpAddr::from([10, i, a, b])
            }),
            (0u8..16).prop_map(|i| IpAddr::from([198, 18, 0, i])),
            (0u8..16).prop_map(|i| IpAddr::from([203, 0, 113, i])),
            any::<u128>().prop_map(|bits| IpAddr::from(bits.to_be_bytes())),
            (0u16..6, any::<u32>()).prop_map(|(i, low)| {
                IpAddr::from(
                    ((0xfd00_u128 << 112) | (u128::from(i) << 96) | u128::from(low)).to_be_bytes(),
                )
            }),
            (0u16..16).prop_map(|i| {
                IpAddr::from(((0x2001_0db8_u128 << 96) | u128::from(i)).to_be_bytes())
            }),
        ]
    }

    /// An address as the root cgroup's programs read it from a header: IPv4
    /// one word, IPv6 two 64-bit words (each 8 bytes as they sit in memory).
    fn read_as_the_programs_do(
        ip: IpAddr,
    ) -> Result<census_common::filter::V6, census_common::filter::V4> {
        use census_common::filter::{V4, V6};
        match ip {
            IpAddr::V4(ip) => Err(V4(u32::from_ne_bytes(ip.octets()))),
            IpAddr::V6(ip) => {
                let o = ip.octets();
                let half = |i: usize| {
                    u64::from_ne_bytes([
                        o[i],
                        o[i + 1],
                        o[i + 2],
                        o[i + 3],
                        o[i + 4],
                        o[i + 5],
                        o[i + 6],
                        o[i + 7],
                    ])
                };
                Ok(V6([half(0), half(8)]))
            }
        }
    }

    proptest! {
        /// The programs ask the filter about a packet's addresses as they read
        /// them (`V4`, `V6`), the agent about keys: every answer is the same,
        /// and so is the key the programs make of an address when they need one.
        #[test]
        fn an_address_read_as_the_programs_read_it_is_judged_as_its_key_is(
            services in prop::collection::vec(range_strategy(), 0..7),
            hosts in prop::collection::vec(host_strategy(), 0..4),
            exact in any::<bool>(),
            probes in prop::collection::vec(probe_strategy(), 1..32),
        ) {
            use census_common::filter::{FILTER_ON, Probe};
            let built = AddressFilter::build(&AddressFilter::OFF, services, hosts);
            let filter = if exact || !built.is_on() { built } else { AddressFilter { state: FILTER_ON, ..built } };
            for ip in probes {
                let key = EndpointKey::from(ip);
                let (verdict, service, source, read_key) = match read_as_the_programs_do(ip) {
                    Ok(v6) => {
                        prop_assert_eq!(census_common::filter::V6::from_words(key.addr), v6);
                        prop_assert_eq!(v6.words(), key.addr);
                        (filter.service_verdict(&v6), filter.may_be_service(&v6), filter.may_be_source(&v6), v6.key())
                    }
                    Err(v4) => (filter.service_verdict(&v4), filter.may_be_service(&v4), filter.may_be_source(&v4), v4.key()),
                };
                prop_assert_eq!(read_key, key);
                prop_assert_eq!(verdict, filter.service_verdict(&key), "{}", ip);
                prop_assert_eq!(service, filter.may_be_service(&key), "{}", ip);
                prop_assert_eq!(source, filter.may_be_source(&key), "{}", ip);
            }
        }

        /// Over any sequence of sets, every write of the steps from one filter
        /// to the next, read torn with the write before it, still says "maybe"
        /// of what both the filter before and after hold (what SERVICES and
        /// ENDPOINTS may hold while it is written); and the last write is the
        /// filter built (or, if that is off, a filter that is off).
        #[test]
        fn every_torn_read_of_every_step_holds_what_the_maps_may_hold(
            sets in prop::collection::vec(
                (prop::collection::vec(range_strategy(), 0..7), prop::collection::vec(host_strategy(), 0..4)),
                1..8,
            ),
            mixes in prop::collection::vec(any::<u64>(), 4),
        ) {
            let mut current = AddressFilter::OFF;
            let mut before: (Vec<ServiceKey>, Vec<EndpointKey>) = (Vec::new(), Vec::new());
            for (services, hosts) in sets {
                let target = AddressFilter::build(&current, services.iter().copied(), hosts.iter().copied());
                // While the filter is written, the maps hold what is in both.
                let both_services: Vec<_> = services.iter().filter(|s| before.0.contains(s)).copied().collect();
                let both_hosts: Vec<_> = hosts.iter().filter(|h| before.1.contains(h)).copied().collect();
                // A range a read taken as exact may hold: one SERVICES holds
                // before or after.
                let ranges: Vec<AddressFilter> = before.0.iter().chain(&services)
                    .map(|s| AddressFilter::build(&AddressFilter::OFF, [*s], []))
                    .collect();
                let mut previous = current;
                for step in AddressFilter::steps(&current, &target).iter() {
                    for mix in mixes.iter().copied().chain([0, u64::MAX]) {
                        let read = torn(&previous, step, mix);
                        prop_assert!(holds(&read, &both_services, &both_hosts), "torn {mix:#x}");
                        if read.ranges_exact() {
                            prop_assert!(only_ranges_of(&read, &ranges), "torn {mix:#x}: {read:?}");
                        }
                    }
                    previous = *step;
                }
                // An off filter's content says nothing: only that it is off.
                if target.is_on() {
                    prop_assert_eq!(previous, target);
                } else {
                    prop_assert!(!previous.is_on());
                }
                prop_assert!(holds(&target, &services, &hosts));
                current = target;
                before = (services, hosts);
            }
        }
    }
}
