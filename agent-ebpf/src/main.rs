//! census's TC classifier: counts packets and bytes per (source identity,
//! destination identity) on the host side of each endpoint's interface.
//!
//! The same code runs on both hooks of the host-side veth. One side of every
//! packet is the endpoint behind that interface, and INTERFACES says who it is
//! (looked up by ifindex: an array slot, nearly free), so only the other side is
//! looked up by address in ENDPOINTS (a hash lookup). The local side is where the
//! packet is, not what its header claims: an endpoint cannot be counted as another
//! by sending with that one's address.
//!
//! Each packet is counted exactly once, also between two endpoints on the same
//! node:
//!
//! - `census_ingress` (host-side ingress: the packet leaves the endpoint) always
//!   counts; the source is the interface's endpoint;
//! - `census_egress` (host-side egress: the packet enters the endpoint) counts only
//!   packets that did not arrive through an interface census counts on
//!   (`skb->ingress_ifindex` has no INTERFACES entry): the others were counted when
//!   they left it. The destination is the interface's endpoint.
//!
//! INTERFACES only ever speeds counting up and pins the local side: without an
//! entry for an interface (not written yet, or its slot taken by another), both
//! sides are looked up by address, and egress skips packets whose source address
//! is a LOCAL endpoint, as before INTERFACES existed.
//!
//! Both always return `TC_ACT_UNSPEC` (TCX "next"): the packet goes on to whatever
//! runs after census (a CNI's policy), never dropped, never redirected.
//!
//! The maps are declared unpinned here: the agent decides where they are pinned
//! (`EbpfLoader::map_pin_path`), so that a benchmark or a test can load the object
//! without touching `/sys/fs/bpf`.
#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::{BPF_NOEXIST, TC_ACT_UNSPEC},
    macros::{classifier, map},
    maps::{Array, HashMap, LruPerCpuHashMap},
    programs::TcContext,
};
use census_common::{
    ENDPOINTS_MAX_ENTRIES, EndpointKey, EndpointValue, FLOWS_MAX_ENTRIES, FlowKey, FlowValue,
    INTERFACES_MAP_FLAGS, INTERFACES_MAX_ENTRIES, InterfaceValue, META_MAX_ENTRIES, flags,
    identity, interface_slot,
};

#[map(name = "ENDPOINTS")]
static ENDPOINTS: HashMap<EndpointKey, EndpointValue> =
    HashMap::with_max_entries(ENDPOINTS_MAX_ENTRIES, 0);

#[map(name = "FLOWS")]
static FLOWS: LruPerCpuHashMap<FlowKey, FlowValue> =
    LruPerCpuHashMap::with_max_entries(FLOWS_MAX_ENTRIES, 0);

#[map(name = "INTERFACES")]
static INTERFACES: Array<InterfaceValue> =
    Array::with_max_entries(INTERFACES_MAX_ENTRIES, INTERFACES_MAP_FLAGS);

/// Holds the layout version; written and read by the agent only. It lives in the
/// object so that every map census pins comes from one declaration site.
#[map(name = "CENSUS_META")]
static CENSUS_META: Array<u32> = Array::with_max_entries(META_MAX_ENTRIES, 0);

/// No GPL-only helper is used (only map helpers and `bpf_skb_load_bytes`).
#[unsafe(no_mangle)]
#[unsafe(link_section = "license")]
static LICENSE: [u8; 11] = *b"Apache-2.0\0";

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86DD;
/// Offset of the source address in an IPv4 header; the destination follows it.
const IPV4_SADDR: usize = 12;
/// Offset of the source address in an IPv6 header; the destination follows it.
const IPV6_SADDR: usize = 8;

/// Which hook of the host-side interface a program runs on.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Hook {
    /// Packets leaving the endpoint.
    Ingress,
    /// Packets entering the endpoint.
    Egress,
}

#[classifier]
fn census_ingress(ctx: TcContext) -> i32 {
    count(&ctx, Hook::Ingress);
    TC_ACT_UNSPEC
}

#[classifier]
fn census_egress(ctx: TcContext) -> i32 {
    count(&ctx, Hook::Egress);
    TC_ACT_UNSPEC
}

#[inline(always)]
fn count(ctx: &TcContext, hook: Hook) {
    let Some((src, dst)) = addresses(ctx) else {
        return;
    };
    // SAFETY: the kernel passes a valid `__sk_buff` for the program's whole run;
    // these are readable context fields of a TC program.
    let (ifindex, ingress_ifindex, len, gso_segs) = unsafe {
        let skb = ctx.skb.skb;
        (
            (*skb).ifindex,
            (*skb).ingress_ifindex,
            (*skb).len,
            (*skb).gso_segs,
        )
    };
    let key = match hook {
        Hook::Ingress => FlowKey {
            src_identity: local_identity(ifindex, &src),
            dst_identity: identity_of(endpoint(&dst)),
        },
        Hook::Egress => {
            if interface(ingress_ifindex).is_some() {
                // Counted when it left that interface.
                return;
            }
            let src = endpoint(&src);
            if src.is_some_and(|ep| ep.is_local()) {
                // From an endpoint whose interface has no entry (yet): it was
                // counted when it left, by address.
                return;
            }
            FlowKey {
                src_identity: identity_of(src),
                dst_identity: local_identity(ifindex, &dst),
            }
        }
    };
    add(&key, u64::from(gso_segs.max(1)), u64::from(len));
}

/// The entry of interface `ifindex` in INTERFACES, if census counts on it.
#[inline(always)]
fn interface(ifindex: u32) -> Option<InterfaceValue> {
    let slot = INTERFACES.get(interface_slot(ifindex))?;
    slot.is_for(ifindex).then_some(*slot)
}

/// The identity of the endpoint behind interface `ifindex` (the side of the
/// packet that is on this interface, whose address is `address`): from
/// INTERFACES, else by address.
#[inline(always)]
fn local_identity(ifindex: u32, address: &EndpointKey) -> u32 {
    match interface(ifindex) {
        Some(entry) if entry.identity != identity::INVALID => entry.identity,
        _ => identity_of(endpoint(address)),
    }
}

/// The source and destination of an IPv4 or IPv6 packet with an Ethernet header,
/// `None` for anything else (ARP, truncated headers).
#[inline(always)]
fn addresses(ctx: &TcContext) -> Option<(EndpointKey, EndpointKey)> {
    // `skb->protocol` is the EtherType in network order in the low 16 bits.
    #[expect(clippy::cast_possible_truncation, reason = "a be16 held in a u32")]
    let protocol = u16::from_be(ctx.skb.protocol() as u16);
    match protocol {
        ETH_P_IP => {
            let [src, dst]: [u32; 2] = read(ctx, ETH_HLEN + IPV4_SADDR)?;
            Some((EndpointKey::v4_word(src), EndpointKey::v4_word(dst)))
        }
        ETH_P_IPV6 => {
            let [src, dst]: [[u32; 4]; 2] = read(ctx, ETH_HLEN + IPV6_SADDR)?;
            Some((EndpointKey::v6_words(src), EndpointKey::v6_words(dst)))
        }
        _ => None,
    }
}

/// Reads a `T` at `offset` of the packet: straight from the linear data when it
/// is there (the common case, and the cheapest), else through
/// `bpf_skb_load_bytes`, which also reads paged data.
#[inline(always)]
fn read<T: Copy>(ctx: &TcContext, offset: usize) -> Option<T> {
    let start = ctx.data();
    if start + offset + size_of::<T>() <= ctx.data_end() {
        // SAFETY: the bounds check above is the one the verifier requires for
        // direct packet access; the read is unaligned-safe.
        return Some(unsafe { core::ptr::read_unaligned((start + offset) as *const T) });
    }
    ctx.load(offset).ok()
}

#[inline(always)]
fn endpoint(key: &EndpointKey) -> Option<EndpointValue> {
    // SAFETY: the value is copied out at once; an entry the agent rewrites
    // concurrently can at worst yield one stale identity for this packet.
    unsafe { ENDPOINTS.get(key) }.copied()
}

#[inline(always)]
fn identity_of(ep: Option<EndpointValue>) -> u32 {
    match ep {
        Some(ep) if ep.flags & flags::HOST != 0 => identity::HOST,
        Some(ep) => ep.identity,
        None => identity::WORLD,
    }
}

#[inline(always)]
fn add(key: &FlowKey, packets: u64, bytes: u64) {
    if bump(key, packets, bytes) {
        return;
    }
    let value = FlowValue { packets, bytes };
    if FLOWS.insert(key, value, u64::from(BPF_NOEXIST)).is_err() {
        // Another CPU created the pair since the lookup: add to this CPU's slot.
        bump(key, packets, bytes);
    }
}

/// Adds to this CPU's counters of `key`, if the pair exists.
#[inline(always)]
fn bump(key: &FlowKey, packets: u64, bytes: u64) -> bool {
    let Some(value) = FLOWS.get_ptr_mut(key) else {
        return false;
    };
    // SAFETY: the pointer is this CPU's slot of a live element; programs on one
    // CPU do not interleave (TC runs with bottom halves disabled), so plain adds
    // are exclusive. An LRU eviction racing with this write loses only this
    // packet's count for a pair that is being evicted anyway.
    unsafe {
        (*value).packets += packets;
        (*value).bytes += bytes;
    }
    true
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
    loop {}
}
