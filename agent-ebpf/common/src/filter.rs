//! ADDRESS_FILTER: what the root cgroup's programs ask before a map lookup.
//!
//! Nearly every packet a node's sockets send or receive is neither from nor to a
//! Service address, nor from one of the node's own addresses: the programs need
//! to know that much about it, and a longest-prefix-match lookup in SERVICES or
//! a hash lookup in ENDPOINTS costs more than the rest of the program. The
//! filter answers "surely not" from one array entry the verifier inlines: the
//! Service ranges in a few slots per family, and two bitmaps indexed by a hash of
//! the address: the single Service addresses, and the sources (the node's own
//! addresses and the single Service addresses). "Maybe" is answered by the map
//! itself.
//!
//! **What the programs rely on:** every range and address SERVICES holds is
//! "maybe a Service", and every address ENDPOINTS flags HOST is "maybe a
//! source", whenever a program reads the filter. The agent writes the filter
//! before it adds an entry, and after it removes one. A program may read the
//! entry while the agent rewrites it (an array update is a copy, not atomic), and
//! see any mix of the two values' bytes; [`AddressFilter::steps`] makes every
//! write safe for that: it only adds (ranges in free slots, bits) or only takes
//! away (slots and bits of what is gone), the ranges that stay keep their slots,
//! and [`FILTER_ON`] is switched alone, the rest of the value unchanged. A filter
//! that is not on ([`AddressFilter::OFF`], and the zeroed entry the map is
//! created with) answers "maybe" for everything: the programs look every address
//! up, as they did before the filter.
//!
//! **"Yes" without a lookup:** a filter the agent built holds SERVICES' ranges
//! in its slots, and nothing else ([`FILTER_RANGES_EXACT`]): an address in one
//! is a Service address, and the Service counters need no SERVICES lookup for
//! it (a ClusterIP, nearly every Service packet). A write that changes a
//! range slot is never exact, nor the writes on either side of it: exactness is
//! switched off alone before, and on alone after, so a program that reads the
//! filter as exact never reads a slot being rewritten. Between the filter's
//! write and SERVICES', a range is a Service's in one and not yet (or no
//! longer) in the other: the agent has decided, and the packet is judged as if
//! it came a moment later (or earlier).

use crate::{EndpointKey, ServiceKey, family};

/// `0 -> AddressFilter`: a one-entry array (the agent and the programs use key
/// 0).
pub const ADDRESS_FILTER_MAP: &str = "ADDRESS_FILTER";
/// [`ADDRESS_FILTER_MAP`]'s one entry.
pub const FILTER_MAP_MAX_ENTRIES: u32 = 1;
/// [`AddressFilter::state`] of a filter the programs may use: its "surely not"
/// is true.
pub const FILTER_ON: u32 = 1;
/// [`AddressFilter::state`] of a filter that is on and whose range slots hold
/// SERVICES' ranges and nothing else: an address in one is a Service address
/// without a lookup ([`AddressFilter::service_verdict`]).
pub const FILTER_RANGES_EXACT: u32 = 3;
/// Range slots per family. A cluster has a ClusterIP range or two per family;
/// with more ranges than slots the filter is off.
pub const FILTER_RANGES: usize = 4;
/// Bits of the single Service addresses' bitmap (LoadBalancer and external
/// IPs): 2^13.
pub const SERVICE_BITS_LG: u32 = 13;
/// Bits of the sources' bitmap (the node's own addresses and the single Service
/// addresses): 2^12.
pub const SOURCE_BITS_LG: u32 = 12;
const SERVICE_WORDS: usize = 1 << (SERVICE_BITS_LG - 6);
const SOURCE_WORDS: usize = 1 << (SOURCE_BITS_LG - 6);

/// [`AddressFilter::service_verdict`]'s answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    No,
    Yes,
    Maybe,
}

/// An IPv4 range: the address `a` is in it when `a & mask == network` (both in
/// network order, read as one native word, as [`EndpointKey`] holds them). An
/// unused slot has a zero mask and a network of all ones: nothing matches it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct V4Range {
    pub network: u32,
    pub mask: u32,
}

/// An IPv6 range, as [`V4Range`] over the address's two halves (see [`V6`]):
/// two 64-bit tests where four words would be four.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct V6Range {
    pub network: [u64; 2],
    pub mask: [u64; 2],
}

/// An IPv4 address as a header holds it: its 4 bytes in network order, read as
/// one native word (as [`EndpointKey::v4_word`] takes it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct V4(pub u32);

/// An IPv6 address as a header holds it: its 16 bytes read as two native 64-bit
/// words, in memory order. The root cgroup's programs read a packet's addresses
/// so (two loads each, not four) and ask the filter about them before any
/// [`EndpointKey`] is made: nearly no packet needs one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct V6(pub [u64; 2]);

impl V6 {
    /// The address of an [`EndpointKey`]'s four words.
    #[inline(always)]
    pub const fn from_words([a, b, c, d]: [u32; 4]) -> Self {
        Self([join(a, b), join(c, d)])
    }

    /// The address's four words, as an [`EndpointKey`] holds them.
    #[inline(always)]
    pub const fn words(self) -> [u32; 4] {
        let [[a, b], [c, d]] = [split(self.0[0]), split(self.0[1])];
        [a, b, c, d]
    }
}

/// Two words in memory order as one 64-bit word.
#[inline(always)]
const fn join(first: u32, second: u32) -> u64 {
    let (low, high) = if cfg!(target_endian = "little") {
        (first, second)
    } else {
        (second, first)
    };
    (high as u64) << 32 | low as u64
}

/// [`join`] undone.
#[inline(always)]
#[expect(clippy::cast_possible_truncation, reason = "the halves of a u64")]
const fn split(word: u64) -> [u32; 2] {
    let (low, high) = (word as u32, (word >> 32) as u32);
    if cfg!(target_endian = "little") {
        [low, high]
    } else {
        [high, low]
    }
}

/// What the filter is asked about: an address of a family known where it is
/// read ([`V4`], [`V6`]: the programs', no family tests), or an
/// [`EndpointKey`] (the family read from it).
pub trait Probe: Copy {
    /// Whether the address is in one of `filter`'s range slots, or of a family
    /// the filter does not know (which may be anything).
    fn in_ranges(&self, filter: &AddressFilter) -> bool;
    /// The hash whose top bits are its bitmaps' bit; equal for an address and
    /// its [`EndpointKey`].
    fn hash(&self) -> u32;
    /// Whether it is an IPv4 or IPv6 address.
    fn is_ip(&self) -> bool;
    /// Its key in ENDPOINTS and SERVICES.
    fn key(&self) -> EndpointKey;
}

impl Probe for V4 {
    #[inline(always)]
    fn in_ranges(&self, filter: &AddressFilter) -> bool {
        for (i, range) in (0u32..).zip(filter.v4_ranges.iter()) {
            if i >= filter.v4_slots {
                break;
            }
            if self.0 & range.mask == range.network {
                return true;
            }
        }
        false
    }

    #[inline(always)]
    fn hash(&self) -> u32 {
        hash_words([self.0, 0, 0, 0], family::IPV4)
    }

    #[inline(always)]
    fn is_ip(&self) -> bool {
        true
    }

    #[inline(always)]
    fn key(&self) -> EndpointKey {
        EndpointKey::v4_word(self.0)
    }
}

impl Probe for V6 {
    #[inline(always)]
    fn in_ranges(&self, filter: &AddressFilter) -> bool {
        let [high, low] = self.0;
        for (i, range) in (0u32..).zip(filter.v6_ranges.iter()) {
            if i >= filter.v6_slots {
                break;
            }
            if high & range.mask[0] == range.network[0] && low & range.mask[1] == range.network[1] {
                return true;
            }
        }
        false
    }

    #[inline(always)]
    fn hash(&self) -> u32 {
        hash_words(self.words(), family::IPV6)
    }

    #[inline(always)]
    fn is_ip(&self) -> bool {
        true
    }

    #[inline(always)]
    fn key(&self) -> EndpointKey {
        EndpointKey::v6_words(self.words())
    }
}

impl Probe for EndpointKey {
    #[inline(always)]
    fn in_ranges(&self, filter: &AddressFilter) -> bool {
        match self.family {
            family::IPV4 => V4(self.addr[0]).in_ranges(filter),
            family::IPV6 => V6::from_words(self.addr).in_ranges(filter),
            _ => true,
        }
    }

    #[inline(always)]
    fn hash(&self) -> u32 {
        hash_words(self.addr, self.family)
    }

    #[inline(always)]
    fn is_ip(&self) -> bool {
        self.family == family::IPV4 || self.family == family::IPV6
    }

    #[inline(always)]
    fn key(&self) -> EndpointKey {
        *self
    }
}

/// The value of [`ADDRESS_FILTER_MAP`]'s entry.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AddressFilter {
    /// [`FILTER_ON`] or [`FILTER_RANGES_EXACT`], or anything else: every
    /// address may be anything.
    pub state: u32,
    /// The IPv4 range slots to look at: `v4_ranges[..v4_slots]` (unused slots
    /// below it match nothing).
    pub v4_slots: u32,
    /// As `v4_slots`, for `v6_ranges`.
    pub v6_slots: u32,
    pub _pad: u32,
    pub v4_ranges: [V4Range; FILTER_RANGES],
    pub v6_ranges: [V6Range; FILTER_RANGES],
    /// The single Service addresses, bit [`bucket`]`(address, SERVICE_BITS_LG)`.
    pub services: [u64; SERVICE_WORDS],
    /// The addresses a packet the node's sockets send is counted in FLOWS from
    /// (the node's own, flagged HOST in ENDPOINTS) and the single Service
    /// addresses (a host-network backend's reply), bit
    /// [`bucket`]`(address, SOURCE_BITS_LG)`: with the ranges, one hash tells of a
    /// source that it is neither.
    pub sources: [u64; SOURCE_WORDS],
}

const UNUSED_V4: V4Range = V4Range {
    network: u32::MAX,
    mask: 0,
};
const UNUSED_V6: V6Range = V6Range {
    network: [u64::MAX; 2],
    mask: [0; 2],
};

/// The bit of `key` in a bitmap of `2^lg` bits: a multiplicative hash of its
/// words.
#[inline(always)]
pub const fn bucket(key: &EndpointKey, lg: u32) -> u32 {
    bucket_of(hash_words(key.addr, key.family), lg)
}

/// The bit of a hash in a bitmap of `2^lg` bits.
#[inline(always)]
const fn bucket_of(hash: u32, lg: u32) -> u32 {
    hash >> (32 - lg)
}

/// A multiplicative hash of a key's words and family; its top bits are its
/// bucket.
#[inline(always)]
const fn hash_words([a, b, c, d]: [u32; 4], family: u32) -> u32 {
    let folded = a ^ b.rotate_left(8) ^ c.rotate_left(16) ^ d.rotate_left(24) ^ family;
    folded.wrapping_mul(0x9E37_79B1)
}

#[inline(always)]
fn test_bit(words: &[u64], bit: u32) -> bool {
    match words.get((bit >> 6) as usize) {
        Some(word) => word & (1 << (bit & 63)) != 0,
        None => true,
    }
}

fn set_bit(words: &mut [u64], bit: u32) {
    if let Some(word) = words.get_mut((bit >> 6) as usize) {
        *word |= 1 << (bit & 63);
    }
}

/// The mask of the first `bits` bits of 16 address bytes, as four native words.
fn mask_words(bits: u32) -> [u32; 4] {
    let mut words = [0u32; 4];
    for (start, word) in (0u32..).step_by(32).zip(words.iter_mut()) {
        let take = bits.saturating_sub(start).min(32);
        let be = if take == 0 {
            0
        } else {
            u32::MAX << (32 - take)
        };
        *word = u32::from_ne_bytes(be.to_be_bytes());
    }
    words
}

impl AddressFilter {
    /// Off, every slot unused: what the programs see before the agent writes the
    /// filter (the map's zeroed entry is off too).
    pub const OFF: Self = Self {
        state: 0,
        v4_slots: 0,
        v6_slots: 0,
        _pad: 0,
        v4_ranges: [UNUSED_V4; FILTER_RANGES],
        v6_ranges: [UNUSED_V6; FILTER_RANGES],
        services: [0; SERVICE_WORDS],
        sources: [0; SOURCE_WORDS],
    };

    /// Whether the programs may trust the filter's "surely not".
    #[inline(always)]
    pub const fn is_on(&self) -> bool {
        self.state == FILTER_ON || self.state == FILTER_RANGES_EXACT
    }

    /// Whether the range slots hold SERVICES' ranges and nothing else.
    #[inline(always)]
    pub const fn ranges_exact(&self) -> bool {
        self.state == FILTER_RANGES_EXACT
    }

    /// What the filter knows of `key` as a Service address: `No` only if it
    /// surely is not one; `Yes` only if it is in a range the slots hold
    /// exactly (a ClusterIP, the Service packets' common case); else `Maybe`,
    /// for SERVICES to answer.
    #[inline(always)]
    pub fn service_verdict<P: Probe>(&self, key: &P) -> Verdict {
        if !self.is_on() || !key.is_ip() {
            Verdict::Maybe
        } else if key.in_ranges(self) {
            if self.ranges_exact() {
                Verdict::Yes
            } else {
                Verdict::Maybe
            }
        } else if test_bit(&self.services, bucket_of(key.hash(), SERVICE_BITS_LG)) {
            Verdict::Maybe
        } else {
            Verdict::No
        }
    }

    /// Whether `key` may be a Service address (in SERVICES); `false` only if it
    /// surely is not.
    #[inline(always)]
    pub fn may_be_service<P: Probe>(&self, key: &P) -> bool {
        !self.is_on()
            || key.in_ranges(self)
            || test_bit(&self.services, bucket_of(key.hash(), SERVICE_BITS_LG))
    }

    /// Whether `key` may be one of the node's own addresses (flagged HOST in
    /// ENDPOINTS) or a Service address; `false` only if it surely is neither.
    #[inline(always)]
    pub fn may_be_source<P: Probe>(&self, key: &P) -> bool {
        !self.is_on()
            || key.in_ranges(self)
            || test_bit(&self.sources, bucket_of(key.hash(), SOURCE_BITS_LG))
    }

    /// The filter of `services` (SERVICES' keys) and `hosts` (the addresses
    /// ENDPOINTS flags HOST), on. Each range keeps the slot it has in `previous`
    /// (the value the map holds), a new one takes the lowest slot free in both:
    /// so [`steps`](Self::steps) can go from `previous` to it adding first, then
    /// taking away. Off if a family has more ranges than slots, or a range of
    /// length 0.
    pub fn build(
        previous: &Self,
        services: impl IntoIterator<Item = ServiceKey>,
        hosts: impl IntoIterator<Item = EndpointKey>,
    ) -> Self {
        let mut filter = Self {
            state: FILTER_RANGES_EXACT,
            ..Self::OFF
        };
        let mut v4 = Ranges::new(&previous.v4_ranges, previous.v4_slots);
        let mut v6 = Ranges::new(&previous.v6_ranges, previous.v6_slots);
        for key in services {
            let bits = key.bits();
            let address = key.address;
            let full = match address.family {
                family::IPV4 => 32,
                family::IPV6 => 128,
                _ => continue,
            };
            if bits >= full {
                set_bit(&mut filter.services, bucket(&address, SERVICE_BITS_LG));
                set_bit(&mut filter.sources, bucket(&address, SOURCE_BITS_LG));
                continue;
            }
            let mask = mask_words(bits);
            let network = [
                address.addr[0] & mask[0],
                address.addr[1] & mask[1],
                address.addr[2] & mask[2],
                address.addr[3] & mask[3],
            ];
            let added = if bits == 0 {
                false
            } else if address.family == family::IPV4 {
                v4.add(V4Range {
                    network: network[0],
                    mask: mask[0],
                })
            } else {
                v6.add(V6Range {
                    network: V6::from_words(network).0,
                    mask: V6::from_words(mask).0,
                })
            };
            if !added {
                return Self { state: 0, ..filter };
            }
        }
        match (v4.slots(UNUSED_V4), v6.slots(UNUSED_V6)) {
            (Some(v4), Some(v6)) => {
                (filter.v4_ranges, filter.v4_slots) = v4;
                (filter.v6_ranges, filter.v6_slots) = v6;
            }
            _ => return Self { state: 0, ..filter },
        }
        for host in hosts {
            set_bit(&mut filter.sources, bucket(&host, SOURCE_BITS_LG));
        }
        filter
    }

    /// The values to write, in order, to take an entry holding `current` to
    /// `target` (built from `current` by [`build`](Self::build)), each safe
    /// for a program that reads the entry while it is written (see the module's
    /// documentation): at most four, none if `current` is `target`.
    pub fn steps(current: &Self, target: &Self) -> Steps {
        let mut steps = Steps::default();
        if current == target {
            return steps;
        }
        if !target.is_on() {
            // Off, and nothing else changed: the content no longer matters.
            if current.is_on() {
                steps.push(Self {
                    state: target.state,
                    ..*current
                });
            }
            return steps;
        }
        if current.is_on() {
            if let Some(mut union) = current.union(target) {
                // The union holds the ranges of both: no longer exact if they
                // differ. Whether a range slot's words are read torn only
                // matters to a program that reads the filter as exact: a write
                // that changes them never is, and neither is the write before
                // it (exactness switched off alone), nor the one after (on
                // alone).
                let same_ranges = current.same_ranges(target);
                let exact = current.ranges_exact() && target.ranges_exact() && same_ranges;
                if current.ranges_exact() && !exact {
                    steps.push(Self {
                        state: FILTER_ON,
                        ..*current
                    });
                }
                union.state = if exact {
                    FILTER_RANGES_EXACT
                } else {
                    FILTER_ON
                };
                steps.push(union);
                if target.ranges_exact() && !same_ranges {
                    steps.push(Self {
                        state: FILTER_ON,
                        ..*target
                    });
                }
                steps.push(*target);
                return steps;
            }
            steps.push(Self {
                state: 0,
                ..*current
            });
        }
        // Off: the content first (not read), then on alone.
        steps.push(Self {
            state: 0,
            ..*target
        });
        steps.push(*target);
        steps
    }

    /// Whether both hold the same ranges in the same slots.
    fn same_ranges(&self, other: &Self) -> bool {
        self.v4_slots == other.v4_slots
            && self.v6_slots == other.v6_slots
            && self.v4_ranges == other.v4_ranges
            && self.v6_ranges == other.v6_ranges
    }

    /// Every range and bit of both, ranges in the slots both give them; `None`
    /// if a slot holds another range in each.
    fn union(&self, other: &Self) -> Option<Self> {
        let mut union = *self;
        for i in 0..FILTER_RANGES {
            union.v4_ranges[i] = merge(self.v4_ranges[i], other.v4_ranges[i], UNUSED_V4)?;
            union.v6_ranges[i] = merge(self.v6_ranges[i], other.v6_ranges[i], UNUSED_V6)?;
        }
        union.v4_slots = self.v4_slots.max(other.v4_slots);
        union.v6_slots = self.v6_slots.max(other.v6_slots);
        for (word, theirs) in union.services.iter_mut().zip(other.services) {
            *word |= theirs;
        }
        for (word, theirs) in union.sources.iter_mut().zip(other.sources) {
            *word |= theirs;
        }
        Some(union)
    }
}

/// The writes of [`AddressFilter::steps`], in order.
#[derive(Debug, Default)]
pub struct Steps {
    values: [Option<AddressFilter>; 4],
    len: usize,
}

impl Steps {
    fn push(&mut self, value: AddressFilter) {
        let last = self.len.checked_sub(1).and_then(|i| self.values[i]);
        if last == Some(value) {
            return;
        }
        debug_assert!(self.len < self.values.len(), "more steps than Steps holds");
        if let Some(slot) = self.values.get_mut(self.len) {
            *slot = Some(value);
            self.len += 1;
        }
    }

    /// The values, in the order they are to be written.
    pub fn iter(&self) -> impl Iterator<Item = &AddressFilter> {
        self.values[..self.len].iter().flatten()
    }
}

/// A slot's range in a union: the one either holds, or `None` if each holds
/// another.
fn merge<R: Copy + PartialEq>(a: R, b: R, unused: R) -> Option<R> {
    if a == unused || a == b {
        Some(b)
    } else if b == unused {
        Some(a)
    } else {
        None
    }
}

/// One family's ranges for [`AddressFilter::build`], and the slots they had.
struct Ranges<'a, R> {
    previous: &'a [R],
    ranges: [Option<R>; FILTER_RANGES],
    len: usize,
}

impl<'a, R: Copy + PartialEq> Ranges<'a, R> {
    fn new(previous: &'a [R; FILTER_RANGES], used: u32) -> Self {
        Self {
            previous: &previous[..(used as usize).min(FILTER_RANGES)],
            ranges: [None; FILTER_RANGES],
            len: 0,
        }
    }

    /// Adds `range` (once); `false` if there are more ranges than slots.
    fn add(&mut self, range: R) -> bool {
        if self.ranges[..self.len].contains(&Some(range)) {
            return true;
        }
        match self.ranges.get_mut(self.len) {
            Some(slot) => {
                *slot = Some(range);
                self.len += 1;
                true
            }
            None => false,
        }
    }

    /// The slots: each range where `previous` has it, the others in the lowest
    /// slots free in both (else in one `previous` uses for a range that is gone),
    /// `unused` in the rest; and how many to look at. `None` if they do not fit.
    fn slots(&self, unused: R) -> Option<([R; FILTER_RANGES], u32)> {
        let mut slots = [None; FILTER_RANGES];
        let mut new = [None; FILTER_RANGES];
        for (i, range) in self.ranges[..self.len].iter().flatten().enumerate() {
            match self.previous.iter().position(|held| held == range) {
                Some(at) => slots[at] = Some(*range),
                None => new[i] = Some(*range),
            }
        }
        let free_in_previous = |i: usize| self.previous.get(i).is_none_or(|held| *held == unused);
        for range in new.into_iter().flatten() {
            let at = (0..FILTER_RANGES)
                .find(|&i| slots[i].is_none() && free_in_previous(i))
                .or_else(|| (0..FILTER_RANGES).find(|&i| slots[i].is_none()))?;
            slots[at] = Some(range);
        }
        let used = (1u32..)
            .zip(slots.iter())
            .filter(|(_, slot)| slot.is_some())
            .last()
            .map_or(0, |(n, _)| n);
        Some((slots.map(|slot| slot.unwrap_or(unused)), used))
    }
}
