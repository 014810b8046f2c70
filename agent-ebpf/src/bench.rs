//! Programs for `cargo xtask bench-classifier`, never loaded by the agent.
//!
//! `BPF_PROG_TEST_RUN` runs a program many times on one packet, so a packet's
//! addresses, and the map entries they look up, stay in the CPU's caches and hide
//! the cost of a large ENDPOINTS. The cyclers give every run another peer: each
//! rewrites one address word of the packet with the next of `peers` consecutive
//! values (a per-CPU cursor), then tail-calls the program in slot 0 of
//! `BENCH_TARGET` (census's classifier, or `bench_empty` to measure the floor:
//! the cycler and an empty program).
//!
//! `bench_lookup_src`/`bench_lookup_dst` are a second reference: one lookup of
//! the cycled address in `BENCH_ENDPOINTS`, a map made and filled as census's
//! ENDPOINTS is. The memory of one lookup among that many entries is what no
//! classifier that names the peer by its address can avoid.
//!
//! `bench_lpm_src`/`bench_lpm_dst` are the peer reference: the same lookup in
//! `BENCH_IPCACHE`, the same addresses in a longest-prefix-match trie (each a
//! /32 or /128), the structure Cilium's ipcache uses.
//!
//! `bench_cgroup_empty` is the floor of the root cgroup's programs
//! (`census_sockets`, `census_sockets_ingress`): an empty `cgroup_skb` program.
//! `bench_cgroup_counter`, `bench_cgroup_counter6` and
//! `bench_cgroup_service_floor` measure the least a counted Service packet costs:
//! the update of a counter in a map made as SERVICE_FLOWS4 (or SERVICE_FLOWS6)
//! is, alone, and after one ENDPOINTS-like lookup of the client (what census did
//! for every Service packet before it kept each socket's client).
//! `bench_cgroup_call`, `bench_cgroup_client` and `bench_cgroup_slot` take a
//! Service packet's cost apart: one kernel helper call that does nearly nothing
//! (what a call and its return cost on the machine), the read of the client's
//! entry in a map made as CLIENTS, and a counter reached by index in a per-CPU
//! array, which the verifier inlines (what a counter costs without a key hashed
//! and compared).
#![no_std]
#![no_main]
#![feature(asm_experimental_arch)]

#[expect(dead_code, reason = "the bench's programs read no 64-bit words")]
mod load;

use load::load_word;

use aya_ebpf::{
    bindings::TC_ACT_UNSPEC,
    helpers::generated::bpf_get_numa_node_id,
    macros::{cgroup_skb, classifier, map},
    maps::{Array, HashMap, LpmTrie, LruPerCpuHashMap, PerCpuArray, ProgramArray, lpm_trie::Key},
    programs::{SkBuffContext, TcContext},
};
use census_common::{
    BPF_F_NO_PREALLOC, CLIENTS_MAX_ENTRIES, ClientCache, ENDPOINTS_MAP_FLAGS,
    ENDPOINTS_MAX_ENTRIES, EndpointKey, EndpointValue, FlowValue, SERVICE_FLOWS_MAX_ENTRIES,
    SERVICE_LOOKUP_PREFIX_LEN, ServiceFlowKey4, ServiceFlowKey6, filter::Probe,
};

#[map(name = "BENCH_TARGET")]
static TARGET: ProgramArray = ProgramArray::with_max_entries(1, 0);

/// Slot 0: how many peers to cycle through; slot 1: the first peer's address
/// word, in host order (peers are consecutive words); slot 2: the stride of the
/// order they are visited in, prime to their count (1: in address order).
#[map(name = "BENCH_CONFIG")]
static CONFIG: Array<u32> = Array::with_max_entries(3, 0);

#[map(name = "BENCH_CURSOR")]
static CURSOR: PerCpuArray<u32> = PerCpuArray::with_max_entries(1, 0);

/// Shaped and flagged as census's ENDPOINTS; the bench sizes and fills it alike.
#[map(name = "BENCH_ENDPOINTS")]
static ENDPOINTS: HashMap<EndpointKey, EndpointValue> =
    HashMap::with_max_entries(ENDPOINTS_MAX_ENTRIES, ENDPOINTS_MAP_FLAGS);

/// The addresses of BENCH_ENDPOINTS in a longest-prefix-match trie, each a /32
/// or /128 (keyed as SERVICES is: the family's 32 bits, then the address).
#[map(name = "BENCH_IPCACHE")]
static IPCACHE: LpmTrie<EndpointKey, EndpointValue> =
    LpmTrie::with_max_entries(ENDPOINTS_MAX_ENTRIES, BPF_F_NO_PREALLOC);

/// Shaped as census's SERVICE_FLOWS4.
#[map(name = "BENCH_SERVICE_FLOWS4")]
static SERVICE_FLOWS4: LruPerCpuHashMap<ServiceFlowKey4, FlowValue> =
    LruPerCpuHashMap::with_max_entries(SERVICE_FLOWS_MAX_ENTRIES, 0);

/// Shaped as census's SERVICE_FLOWS6.
#[map(name = "BENCH_SERVICE_FLOWS6")]
static SERVICE_FLOWS6: LruPerCpuHashMap<ServiceFlowKey6, FlowValue> =
    LruPerCpuHashMap::with_max_entries(SERVICE_FLOWS_MAX_ENTRIES, 0);

/// Shaped as census's CLIENTS.
#[map(name = "BENCH_CLIENTS")]
static CLIENTS: Array<ClientCache> = Array::with_max_entries(CLIENTS_MAX_ENTRIES, 0);

/// Per-CPU counters in an array, looked up by index: the verifier inlines the
/// lookup, so no kernel function is called.
#[map(name = "BENCH_SLOTS")]
static SLOTS: PerCpuArray<FlowValue> = PerCpuArray::with_max_entries(1024, 0);

/// Where the lookups leave the identity they found, so that they are not
/// optimized away.
#[map(name = "BENCH_SINK")]
static SINK: PerCpuArray<u32> = PerCpuArray::with_max_entries(1, 0);

#[unsafe(no_mangle)]
#[unsafe(link_section = "license")]
static LICENSE: [u8; 11] = *b"Apache-2.0\0";

/// Ethernet (14) + the IPv4 source address's offset (12).
const IPV4_SRC: usize = 26;
const IPV4_DST: usize = IPV4_SRC + 4;
/// Ethernet (14) + the IPv6 source address's offset (8) + its first 12 bytes.
const IPV6_SRC_LAST: usize = 34;
const IPV6_DST_LAST: usize = IPV6_SRC_LAST + 16;

/// Does nothing: the floor every measurement is compared with.
#[classifier]
fn bench_empty(_ctx: TcContext) -> i32 {
    TC_ACT_UNSPEC
}

#[classifier]
fn bench_cycle_v4_src(ctx: TcContext) -> i32 {
    cycle::<IPV4_SRC>(&ctx)
}

#[classifier]
fn bench_cycle_v4_dst(ctx: TcContext) -> i32 {
    cycle::<IPV4_DST>(&ctx)
}

#[classifier]
fn bench_cycle_v6_src(ctx: TcContext) -> i32 {
    cycle::<IPV6_SRC_LAST>(&ctx)
}

#[classifier]
fn bench_cycle_v6_dst(ctx: TcContext) -> i32 {
    cycle::<IPV6_DST_LAST>(&ctx)
}

/// Does nothing: the floor of the root cgroup's programs.
#[cgroup_skb(ingress)]
fn bench_cgroup_empty(_ctx: SkBuffContext) -> i32 {
    1
}

/// The counters of an IPv4 packet's destination in BENCH_SERVICE_FLOWS4 updated
/// (the entry exists after the first run), as census adds a Service packet's;
/// nothing else.
#[cgroup_skb(egress)]
fn bench_cgroup_counter(ctx: SkBuffContext) -> i32 {
    if let Some((_, dst, len)) = ipv4_addresses(&ctx) {
        count_service(0, dst, len);
    }
    1
}

/// One call of a kernel helper that only reads a per-CPU word
/// (`bpf_get_numa_node_id`): what a call and its return cost on this machine.
#[cgroup_skb(egress)]
fn bench_cgroup_call(_ctx: SkBuffContext) -> i32 {
    // SAFETY: a helper of no arguments.
    let node = unsafe { bpf_get_numa_node_id() };
    #[expect(
        clippy::cast_sign_loss,
        clippy::cast_possible_truncation,
        reason = "a NUMA node's number, kept only"
    )]
    let node = node as u32;
    if let Some(sink) = SINK.get_ptr_mut(0) {
        // SAFETY: this CPU's slot.
        unsafe { *sink = node };
    }
    1
}

/// The client of the packet's IPv4 source read from a map made as CLIENTS, as
/// census reads a Service packet's client (written on the first run); nothing
/// else.
#[cgroup_skb(egress)]
fn bench_cgroup_client(ctx: SkBuffContext) -> i32 {
    let Some((src, _, _)) = ipv4_addresses(&ctx) else {
        return 1;
    };
    let address = EndpointKey::v4_word(src);
    let hash = address.hash();
    let Some(entry) = CLIENTS.get_ptr_mut(ClientCache::slot(hash)) else {
        return 1;
    };
    // SAFETY: an element of a live array; runs on one CPU do not interleave.
    let client = unsafe {
        let stamp = core::ptr::read_volatile(&raw const (*entry).stamp);
        if ClientCache::is_of(stamp, 0, hash) && (*entry).address == address {
            ClientCache::client(stamp)
        } else {
            (*entry).address = address;
            core::ptr::write_volatile(&raw mut (*entry).stamp, ClientCache::stamp(0, hash, 7));
            7
        }
    };
    if let Some(sink) = SINK.get_ptr_mut(0) {
        // SAFETY: this CPU's slot.
        unsafe { *sink = client };
    }
    1
}

/// A packet added to this CPU's counters in slot (destination mod 1024) of a
/// per-CPU array: what a counter costs that is reached without hashing a key.
#[cgroup_skb(egress)]
fn bench_cgroup_slot(ctx: SkBuffContext) -> i32 {
    if let Some((_, dst, len)) = ipv4_addresses(&ctx)
        && let Some(value) = SLOTS.get_ptr_mut(dst & 1023)
    {
        // SAFETY: this CPU's slot of an array element.
        unsafe {
            (*value).packets += 1;
            (*value).bytes += u64::from(len);
        }
    }
    1
}

/// [`bench_cgroup_counter`] after one BENCH_ENDPOINTS lookup of the IPv4 source,
/// the client: the least a counted Service request costs as census counts it,
/// the Service address not confirmed, no port read.
#[cgroup_skb(egress)]
fn bench_cgroup_service_floor(ctx: SkBuffContext) -> i32 {
    if let Some((src, dst, len)) = ipv4_addresses(&ctx) {
        // SAFETY: the value is copied out at once.
        let client =
            unsafe { ENDPOINTS.get(EndpointKey::v4_word(src)) }.map_or(0, |ep| ep.identity);
        count_service(client, dst, len);
    }
    1
}

/// [`bench_cgroup_counter`] in a map made as SERVICE_FLOWS6 (the destination's
/// IPv4 word in an IPv6 key): what an IPv6 Service packet's counter costs.
#[cgroup_skb(egress)]
fn bench_cgroup_counter6(ctx: SkBuffContext) -> i32 {
    if let Some((_, dst, len)) = ipv4_addresses(&ctx) {
        let key = ServiceFlowKey6 {
            client_identity: 0,
            port: 0,
            protocol: 17,
            direction: 0,
            service: [0, 0, 0, dst],
        };
        add(&SERVICE_FLOWS6, &key, len);
    }
    1
}

/// A cgroup_skb packet's IPv4 source and destination (one load each, as census's
/// programs load them) and its length.
#[inline(always)]
fn ipv4_addresses(ctx: &SkBuffContext) -> Option<(u32, u32, u32)> {
    // SAFETY: `data`, `data_end` and `len` are readable fields of a cgroup_skb
    // program's context (loaded with CAP_BPF); the loads are bounds-checked.
    unsafe {
        let skb = ctx.skb.skb;
        let (start, end) = ((*skb).data as usize, (*skb).data_end as usize);
        if start + 20 > end {
            return None;
        }
        Some((load_word(start + 12), load_word(start + 16), (*skb).len))
    }
}

#[inline(always)]
fn count_service(client: u32, dst: u32, len: u32) {
    let key = ServiceFlowKey4 {
        client_identity: client,
        port: 0,
        protocol: 17,
        direction: 0,
        service: dst,
    };
    add(&SERVICE_FLOWS4, &key, len);
}

/// Adds a packet of `len` bytes to `key`'s counters in `map`, as census adds a
/// Service packet's (the entry exists after the first run).
#[inline(always)]
fn add<K>(map: &LruPerCpuHashMap<K, FlowValue>, key: &K, len: u32) {
    if let Some(value) = map.get_ptr_mut(key) {
        // SAFETY: this CPU's slot of a live element.
        unsafe {
            (*value).packets += 1;
            (*value).bytes += u64::from(len);
        }
    } else {
        let value = FlowValue {
            packets: 1,
            bytes: u64::from(len),
        };
        let _ = map.insert(key, value, 0);
    }
}

/// One ipcache-like (LPM) lookup of the packet's source address.
#[classifier]
fn bench_lpm_src(ctx: TcContext) -> i32 {
    lpm::<0>(&ctx)
}

/// One ipcache-like (LPM) lookup of the packet's destination address.
#[classifier]
fn bench_lpm_dst(ctx: TcContext) -> i32 {
    lpm::<1>(&ctx)
}

/// One ENDPOINTS-like lookup of the packet's source address.
#[classifier]
fn bench_lookup_src(ctx: TcContext) -> i32 {
    lookup::<0>(&ctx)
}

/// One ENDPOINTS-like lookup of the packet's destination address.
#[classifier]
fn bench_lookup_dst(ctx: TcContext) -> i32 {
    lookup::<1>(&ctx)
}

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;

/// Looks up address `WHICH` (0 the source, 1 the destination) in BENCH_IPCACHE.
#[inline(always)]
fn lpm<const WHICH: usize>(ctx: &TcContext) -> i32 {
    let Some(key) = address::<WHICH>(ctx) else {
        return TC_ACT_UNSPEC;
    };
    let identity = IPCACHE
        .get(Key::new(SERVICE_LOOKUP_PREFIX_LEN, key))
        .map_or(0, |ep| ep.identity);
    if let Some(sink) = SINK.get_ptr_mut(0) {
        // SAFETY: this CPU's slot.
        unsafe { *sink = identity };
    }
    TC_ACT_UNSPEC
}

/// Address `WHICH` (0 the source, 1 the destination) of an IPv4 or IPv6
/// packet, as census's classifier reads it.
#[inline(always)]
fn address<const WHICH: usize>(ctx: &TcContext) -> Option<EndpointKey> {
    #[expect(clippy::cast_possible_truncation, reason = "a be16 held in a u32")]
    let protocol = u16::from_be(ctx.skb.protocol() as u16);
    let (start, end) = (ctx.data(), ctx.data_end());
    if protocol == ETH_P_IP {
        let offset = ETH_HLEN + 12 + WHICH * 4;
        if start + offset + 4 > end {
            return None;
        }
        Some(EndpointKey::v4_word(load_word(start + offset)))
    } else {
        let offset = ETH_HLEN + 8 + WHICH * 16;
        if start + offset + 16 > end {
            return None;
        }
        Some(EndpointKey::v6_words(words(start + offset)))
    }
}

/// Looks up address `WHICH` (0 the source, 1 the destination) of an IPv4 or
/// IPv6 packet, as census's classifier reads it.
#[inline(always)]
fn lookup<const WHICH: usize>(ctx: &TcContext) -> i32 {
    #[expect(clippy::cast_possible_truncation, reason = "a be16 held in a u32")]
    let protocol = u16::from_be(ctx.skb.protocol() as u16);
    let (start, end) = (ctx.data(), ctx.data_end());
    let key = if protocol == ETH_P_IP {
        let offset = ETH_HLEN + 12 + WHICH * 4;
        if start + offset + 4 > end {
            return TC_ACT_UNSPEC;
        }
        EndpointKey::v4_word(load_word(start + offset))
    } else {
        let offset = ETH_HLEN + 8 + WHICH * 16;
        if start + offset + 16 > end {
            return TC_ACT_UNSPEC;
        }
        EndpointKey::v6_words(words(start + offset))
    };
    // SAFETY: the value is copied out at once.
    let identity = unsafe { ENDPOINTS.get(key) }.map_or(0, |ep| ep.identity);
    if let Some(sink) = SINK.get_ptr_mut(0) {
        // SAFETY: this CPU's slot.
        unsafe { *sink = identity };
    }
    TC_ACT_UNSPEC
}

/// The four words of an IPv6 address at `address` of the packet's linear data
/// (bounds checked by the caller), one load each, as census's programs read them.
#[inline(always)]
fn words(address: usize) -> [u32; 4] {
    [
        load_word(address),
        load_word(address + 4),
        load_word(address + 8),
        load_word(address + 12),
    ]
}

#[inline(always)]
fn cycle<const OFFSET: usize>(ctx: &TcContext) -> i32 {
    let (Some(&peers), Some(&base), Some(&stride), Some(cursor)) = (
        CONFIG.get(0),
        CONFIG.get(1),
        CONFIG.get(2),
        CURSOR.get_ptr_mut(0),
    ) else {
        return TC_ACT_UNSPEC;
    };
    // SAFETY: this CPU's slot; runs on one CPU do not interleave.
    let step = unsafe {
        let step = *cursor;
        *cursor = if step + 1 >= peers { 0 } else { step + 1 };
        step
    };
    // The step's peer: a stride prime to `peers` visits each once per cycle.
    #[expect(clippy::cast_possible_truncation, reason = "a remainder below `peers`")]
    let peer = ((u64::from(step) * u64::from(stride)) % u64::from(peers.max(1))) as u32;
    let word = base.wrapping_add(peer).to_be();
    let (start, end) = (ctx.data(), ctx.data_end());
    if start + OFFSET + 4 <= end {
        // SAFETY: bounds checked above, as the verifier requires for direct
        // packet access; a TC program may write its packet.
        unsafe { core::ptr::write_unaligned((start + OFFSET) as *mut u32, word) };
    }
    // SAFETY: the context is the program's own; on success this does not return.
    unsafe { TARGET.tail_call(ctx, 0) };
    TC_ACT_UNSPEC
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
    loop {}
}
