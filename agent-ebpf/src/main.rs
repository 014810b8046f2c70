//! census's programs: count packets and bytes per (source identity, destination
//! identity) on the host side of each endpoint's interface, on the node's uplinks
//! and at its own sockets.
//!
//! The same code runs on both hooks of the host-side veth. One side of every
//! packet is the endpoint behind that interface, and INTERFACES says who it is
//! (looked up by ifindex: an array slot, nearly free), so only the other side is
//! looked up by address in ENDPOINTS (a hash lookup). The local side is where the
//! packet is, not what its header claims: an endpoint cannot be counted as another
//! by sending with that one's address.
//!
//! Each packet is counted exactly once in the cluster, with both identities after
//! address translation (docs/design.md, "Counting traffic once"):
//!
//! - `census_ingress` (host-side ingress: the packet leaves the endpoint) counts
//!   every packet, the source being the interface's endpoint, except one for a
//!   Service address (SERVICES, matched on the address alone: a non-first fragment
//!   carries no ports). Such a packet is not translated yet (kube-proxy's DNAT runs
//!   after this hook): it gets census's mark bit instead, and is counted where it
//!   is seen translated;
//! - `census_egress` (host-side egress: the packet enters the endpoint) counts a
//!   marked packet, as (its sender, the endpoint), clearing the bit. Of the
//!   others it counts only packets that did not arrive through an interface
//!   census counts on (`skb->ingress_ifindex` has no INTERFACES entry): the others
//!   were counted when they left it. Nor does it count packets from a pod on
//!   another node (an ENDPOINTS entry flagged REMOTE): census on that node counted
//!   them when they left the pod; nor packets from a node's address (this node's,
//!   HOST, or another's, `remote-node`): `census_sockets` counted them on the node
//!   that sent them; nor packets from a Service address (a reply,
//!   reverse-translated on this node: its sender counted it when it left). The
//!   destination is the interface's endpoint;
//! - `census_uplink` (egress of an uplink or tunnel device) counts marked packets
//!   only, as (sender, destination), clearing the bit: a Service request whose
//!   backend is on another node, translated. Everything else leaving the node was
//!   counted when it left its endpoint. Cleared here, the bit never leaves the
//!   node, and a tunnel's outer packet is not counted again;
//! - `census_sockets` (egress of the root cgroup: the node's own sockets) counts
//!   packets from one of this node's addresses to a pod, as (host, pod), and a
//!   socket's reply to a Service request from a pod of this node (its source the
//!   Service address, translated back before this hook), as (host, pod);
//! - `census_sockets_ingress` (ingress of the root cgroup: delivered to one of
//!   the node's own sockets) counts a marked packet, as (sender, host): a
//!   Service request whose backend is host-network on this node, or a Service
//!   address the node serves itself (a node-local DNS cache). No TC hook sees a
//!   packet delivered locally.
//!
//! The root cgroup's two programs also count SERVICE_FLOWS4 and SERVICE_FLOWS6
//! (one map per family), beside FLOWS and changing nothing of it (docs/design.md,
//! "Which Service"): every socket of the node, a pod's included, passes them, where a request still carries the
//! Service address its client dialled (a pod's packet is translated later, in
//! the node's namespace; a host-network socket's is translated before the hook,
//! but its socket still holds the address it connected to) and a reply carries
//! it back (translated back before delivery). Egress counts a request from a
//! pod of this node or from the node itself to a Service address, ingress a
//! reply from a Service address to one of them. The client of a Service
//! packet is looked up in ENDPOINTS once per address (CLIENTS, valid while the
//! agent has not written ENDPOINTS since).
//!
//! The sender of a marked packet is the endpoint behind the interface it came in
//! by (`skb->ingress_ifindex`'s INTERFACES entry): so a request that kube-proxy
//! masqueraded to the node's address is still its sender's. The mark is taken
//! as census's only on a packet that came in by such an interface, and
//! `census_ingress` marks only there: a packet carrying the bit otherwise (a
//! socket's `SO_MARK`, another program's rule) is neither counted nor cleared as
//! census's.
//!
//! INTERFACES only ever speeds counting up and pins the local side: without an
//! entry for an interface (not written yet, or its slot taken by another), both
//! sides are looked up by address, and egress skips packets whose source address
//! is a LOCAL endpoint (the ingress program of that endpoint counts them).
//!
//! The TC programs always return `TC_ACT_UNSPEC` (TCX "next"): the packet goes on to whatever
//! runs after census (a CNI's policy), never dropped, never redirected.
//!
//! The maps are declared unpinned here: the agent decides where they are pinned
//! (`EbpfLoader::map_pin_path`), so that a benchmark or a test can load the object
//! without touching `/sys/fs/bpf`.
//!
//! Bytes are the link-layer bytes of every segment: a GSO packet counts its
//! `skb->len` plus the headers its further segments repeat (see
//! `census_common::FlowValue`).
//!
//! Rare events (a FLOWS insert the kernel refuses, an IP frame too short to read,
//! a LOCAL endpoint whose interface has no INTERFACES entry) are counted in STATS
//! and reported through aya-log. Logging is off unless the agent sets
//! `AYA_LOG_LEVEL` at load (`--datapath-log`); the global is read-only data, so
//! the verifier removes the disabled calls and they cost nothing. When on, each
//! CPU sends at most one event per [`LOG_INTERVAL_NS`]; the others are counted
//! as suppressed.
#![no_std]
#![no_main]
// One word load per address word (`load_word`): the BPF backend splits a load it
// cannot prove aligned into byte loads.
#![feature(asm_experimental_arch)]

mod load;

use load::{load_dword, load_word};

use aya_ebpf::{
    EbpfContext,
    bindings::{__sk_buff, BPF_NOEXIST, TC_ACT_UNSPEC},
    helpers::bpf_ktime_get_ns,
    macros::{cgroup_skb, classifier, map},
    maps::{Array, HashMap, LpmTrie, LruPerCpuHashMap, PerCpuArray, lpm_trie::Key},
    programs::{SkBuffContext, TcContext},
};
use aya_log_ebpf::{
    debug, info,
    macro_support::{Level, level_enabled},
    warn,
};
use census_common::{
    CLIENTS_EPOCH_MAP_FLAGS, CLIENTS_MAX_ENTRIES, ClientCache, ENDPOINTS_MAP_FLAGS,
    ENDPOINTS_MAX_ENTRIES, EndpointKey, EndpointValue, FLOWS_MAX_ENTRIES, FlowKey, FlowValue,
    INTERFACES_MAP_FLAGS, INTERFACES_MAX_ENTRIES, InterfaceValue, MARK_BIT_DEFAULT,
    META_MAX_ENTRIES, NODES_MAP_FLAGS, NODES_MAX_ENTRIES, NodeValue, SERVICE_FLOWS_MAX_ENTRIES,
    SERVICE_LOOKUP_PREFIX_LEN, SERVICES_MAP_FLAGS, SERVICES_MAX_ENTRIES, STATS_MAX_ENTRIES,
    ServiceFlowKey4, ServiceFlowKey6,
    filter::{AddressFilter, FILTER_MAP_MAX_ENTRIES, Probe, V4, V6, Verdict},
    flags, identity, interface_slot, service_direction, stats,
};

/// Not preallocated: sized for the cluster, it costs memory only for the entries
/// written.
#[map(name = "ENDPOINTS")]
static ENDPOINTS: HashMap<EndpointKey, EndpointValue> =
    HashMap::with_max_entries(ENDPOINTS_MAX_ENTRIES, ENDPOINTS_MAP_FLAGS);

/// The nodes remote ENDPOINTS entries name; written and read by the agent and
/// the CLI only. It lives in the object so that every map census pins comes from
/// one declaration site.
#[map(name = "NODES")]
static NODES: HashMap<u32, NodeValue> =
    HashMap::with_max_entries(NODES_MAX_ENTRIES, NODES_MAP_FLAGS);

#[map(name = "FLOWS")]
static FLOWS: LruPerCpuHashMap<FlowKey, FlowValue> =
    LruPerCpuHashMap::with_max_entries(FLOWS_MAX_ENTRIES, 0);

#[map(name = "INTERFACES")]
static INTERFACES: Array<InterfaceValue> =
    Array::with_max_entries(INTERFACES_MAX_ENTRIES, INTERFACES_MAP_FLAGS);

/// The cluster's Service addresses, by longest prefix; written by the agent.
#[map(name = "SERVICES")]
static SERVICES: LpmTrie<EndpointKey, u32> =
    LpmTrie::with_max_entries(SERVICES_MAX_ENTRIES, SERVICES_MAP_FLAGS);

/// What SERVICES and ENDPOINTS' HOST entries surely do not hold, without a
/// lookup in either (`census_common::filter`); written by the agent.
#[map(name = "ADDRESS_FILTER")]
static ADDRESS_FILTER: Array<AddressFilter> = Array::with_max_entries(FILTER_MAP_MAX_ENTRIES, 0);

/// Per client, IPv4 Service address, port, protocol and direction, in FLOWS'
/// units.
#[map(name = "SERVICE_FLOWS4")]
static SERVICE_FLOWS4: LruPerCpuHashMap<ServiceFlowKey4, FlowValue> =
    LruPerCpuHashMap::with_max_entries(SERVICE_FLOWS_MAX_ENTRIES, 0);

/// SERVICE_FLOWS4 of IPv6 Service addresses.
#[map(name = "SERVICE_FLOWS6")]
static SERVICE_FLOWS6: LruPerCpuHashMap<ServiceFlowKey6, FlowValue> =
    LruPerCpuHashMap::with_max_entries(SERVICE_FLOWS_MAX_ENTRIES, 0);

/// By address, the client Service packets were last counted for (`client_of`).
/// Not pinned: made with the programs.
#[map(name = "CLIENTS")]
static CLIENTS: Array<ClientCache> = Array::with_max_entries(CLIENTS_MAX_ENTRIES, 0);

/// The epoch of CLIENTS' entries, bumped by the agent after each write to
/// ENDPOINTS.
#[map(name = "CLIENTS_EPOCH")]
static CLIENTS_EPOCH: Array<u64> = Array::with_max_entries(1, CLIENTS_EPOCH_MAP_FLAGS);

/// census's bit of `skb->mark` (`census_common::MARK_BIT_GLOBAL`): the agent sets
/// it at load, as read-only data, so the verifier sees a constant.
#[unsafe(no_mangle)]
static CENSUS_MARK_BIT: u32 = MARK_BIT_DEFAULT;

#[map(name = "STATS")]
static STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(STATS_MAX_ENTRIES, 0);

/// Per CPU, when it last sent a log event (`bpf_ktime_get_ns`). Not pinned: the
/// rate limit is this program's, not the node's.
#[map(name = "LOG_BUDGET")]
static LOG_BUDGET: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// Each CPU sends at most one log event per this many nanoseconds (10 a second).
const LOG_INTERVAL_NS: u64 = 100_000_000;

/// Holds the layout version; written and read by the agent only. It lives in the
/// object so that every map census pins comes from one declaration site.
#[map(name = "CENSUS_META")]
static CENSUS_META: Array<u32> = Array::with_max_entries(META_MAX_ENTRIES, 0);

/// No GPL-only helper is used (map and ring buffer helpers, `bpf_skb_load_bytes`,
/// `bpf_ktime_get_ns`).
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
const IPV4_PROTOCOL: usize = 9;
const IPV6_NEXT_HEADER: usize = 6;
const IPV6_HLEN: usize = 40;
/// Offset of the data offset (high nibble, in words) in a TCP header.
const TCP_DATA_OFFSET: usize = 12;
const UDP_HLEN: u32 = 8;
const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;
/// Offset of the flags and fragment offset in an IPv4 header.
const IPV4_FRAGMENT: usize = 6;
/// The fragment offset's bits of those two bytes (big-endian).
const IPV4_FRAGMENT_OFFSET: u16 = 0x1fff;
const AF_INET: u32 = 2;
const AF_INET6: u32 = 10;
/// `-EEXIST`: the pair was inserted meanwhile (by another CPU).
const EEXIST: i32 = -17;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Family {
    V4,
    V6,
}

/// What the program makes of a frame.
enum Frame {
    /// Neither IPv4 nor IPv6 (ARP, say): not census's business.
    NotIp,
    /// IPv4 or IPv6, but too short to hold both addresses.
    Truncated(Family),
    Ip(Family, EndpointKey, EndpointKey),
}

/// Which hook of the host-side interface a program runs on.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Hook {
    /// Packets leaving the endpoint.
    Ingress,
    /// Packets entering the endpoint.
    Egress,
}

/// The node's own sockets' packets (egress of the root cgroup, after
/// netfilter's OUTPUT and POSTROUTING: translated). Always lets the packet go.
#[cgroup_skb(egress)]
fn census_sockets(ctx: SkBuffContext) -> i32 {
    count_from_node(&ctx);
    1
}

/// Packets delivered to the node's own sockets (ingress of the root cgroup,
/// after netfilter's PREROUTING and INPUT: translated). Always lets the packet
/// go.
#[cgroup_skb(ingress)]
fn census_sockets_ingress(ctx: SkBuffContext) -> i32 {
    count_delivered(&ctx);
    1
}

#[classifier]
fn census_uplink(ctx: TcContext) -> i32 {
    count_marked(&ctx);
    TC_ACT_UNSPEC
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
    let Some((family, src, dst)) = addresses(ctx) else {
        return;
    };
    // SAFETY: the kernel passes a valid `__sk_buff` for the program's whole run;
    // these are readable context fields of a TC program.
    let (ifindex, ingress_ifindex) = unsafe {
        let skb = ctx.skb.skb;
        ((*skb).ifindex, (*skb).ingress_ifindex)
    };
    let key = match hook {
        Hook::Ingress => {
            let to = endpoint(&dst);
            // Marked only where the interface is known: the hooks that count a
            // marked packet take the mark as census's only on a packet that came
            // in by such an interface, and name the sender by it.
            if to.is_none() && interface(ifindex).is_some() && is_service(&dst) {
                // Counted once translated, where the mark is seen.
                set_mark(ctx, mark(ctx) | mark_bit());
                count_events(stats::SERVICE_MARKED, segments(ctx));
                return;
            }
            FlowKey {
                src_identity: local_identity(ctx, ifindex, &src),
                dst_identity: identity_of(to),
            }
        }
        Hook::Egress if let Some(sender) = marked_by(ctx, ingress_ifindex) => {
            clear_mark_bit(ctx);
            FlowKey {
                src_identity: sender_identity(&sender, &src),
                dst_identity: local_identity(ctx, ifindex, &dst),
            }
        }
        Hook::Egress => {
            if interface(ingress_ifindex).is_some() {
                // Counted when it left that interface.
                return;
            }
            let src_key = src;
            let src = endpoint(&src_key);
            if src.is_some_and(|ep| ep.is_local()) {
                // From an endpoint whose interface has no entry (yet): it was
                // counted when it left, by address.
                return;
            }
            if src.is_some_and(|ep| ep.is_remote() || ep.flags & flags::HOST != 0) {
                // From a pod on another node (counted when it left the pod, there)
                // or from a node's address (counted by `census_sockets` on the
                // node that sent it).
                return;
            }
            if src.is_none() && is_service(&src_key) {
                // A reply reverse-translated on this node: counted when it left
                // its sender.
                return;
            }
            FlowKey {
                src_identity: identity_of(src),
                dst_identity: local_identity(ctx, ifindex, &dst),
            }
        }
    };
    add_packet(ctx, family, &key);
}

/// `census_uplink`: counts a marked packet, as (sender, destination), clearing
/// the bit; nothing else (counted when it left its endpoint).
#[inline(always)]
fn count_marked(ctx: &TcContext) {
    // Before the headers: most packets leaving the node are not marked.
    if !is_marked(ctx) {
        return;
    }
    // SAFETY: as in `count`.
    let ingress_ifindex = unsafe { (*ctx.skb.skb).ingress_ifindex };
    let Some(sender) = marked_by(ctx, ingress_ifindex) else {
        return;
    };
    clear_mark_bit(ctx);
    let Some((family, src, dst)) = addresses(ctx) else {
        return;
    };
    let key = FlowKey {
        src_identity: sender_identity(&sender, &src),
        dst_identity: identity_of(endpoint(&dst)),
    };
    add_packet(ctx, family, &key);
}

/// `census_sockets`: counts a packet from one of this node's addresses (HOST)
/// to a pod, on this node or another, as (host, pod). A pod's own sockets pass
/// this hook too (their cgroups are the root's descendants): their packets were
/// counted where they left the pod, and are skipped, as are packets to anything
/// but a pod (the node's own, other nodes, outside).
///
/// A packet from a Service address is a node's socket replying to a Service
/// request it took as a host-network backend (netfilter translated its source
/// back before this hook), or a socket bound to the Service address (a
/// node-local DNS cache): counted as (host, pod) too, when it goes to a pod of
/// this node by that pod's own interface. Only a request from this node's pod
/// is translated on this node; and a pod's socket replying from a Service
/// address (direct server return) leaves by its own interface, not the
/// destination's, and was counted where it left its pod.
#[inline(always)]
fn count_from_node(ctx: &SkBuffContext) {
    // Each family's path on its own, its addresses as the filter reads them.
    match socket_sides(ctx) {
        Some(Sides::V4(src, dst)) => count_from_node_in(ctx, Family::V4, src, dst),
        Some(Sides::V6(src, dst)) => count_from_node_in(ctx, Family::V6, src, dst),
        None => {}
    }
}

/// [`count_from_node`] of a packet of `family`.
#[inline(always)]
fn count_from_node_in<A: Probe>(ctx: &SkBuffContext, family: Family, src: A, dst: A) {
    // Nearly no packet a socket sends is a Service request or from an address
    // FLOWS counts here (the node's own, or a Service's): the filter says so
    // without a lookup of its source, and without making its keys.
    let filter = address_filter();
    let pair = filter.is_none_or(|filter| filter.may_be_source(&src));
    let service = service_requested(ctx, family, filter, (pair, &dst));
    if pair {
        let src = src.key();
        let from = endpoint(&src);
        if let Some(service) = service {
            count_service_request(ctx, family, service_client(from), service);
        }
        count_pair_from_node(ctx, family, (&src, from), &dst.key());
    } else if let Some(service) = service {
        count_service_request(ctx, family, client_of(&src.key()), service);
    }
}

/// [`count_from_node`]'s FLOWS part, `from` the source's ENDPOINTS entry.
#[inline(always)]
fn count_pair_from_node(
    ctx: &SkBuffContext,
    family: Family,
    (src, from): (&EndpointKey, Option<EndpointValue>),
    dst: &EndpointKey,
) {
    if from.is_some_and(|ep| ep.flags & flags::HOST == 0) {
        return;
    }
    let Some(pod) = endpoint(dst).filter(is_pod) else {
        return;
    };
    if from.is_none() {
        // SAFETY: the kernel passes a valid `__sk_buff` for the program's whole
        // run; `ifindex` (the device the packet leaves by) is readable here.
        let ifindex = unsafe { (*ctx.skb.skb).ifindex };
        let by_its_interface = pod.is_local()
            && interface(ifindex)
                .is_some_and(|i| i.identity == pod.identity || i.identity == identity::INVALID);
        if !by_its_interface || !is_service(src) {
            return;
        }
    }
    let key = FlowKey {
        src_identity: identity::HOST,
        dst_identity: pod.identity,
    };
    add_packet(ctx, family, &key);
}

/// `census_sockets_ingress`: counts a packet carrying census's mark that is
/// delivered to one of this node's sockets, as (sender, host), clearing the
/// bit. It left a pod for a Service address (marked there), and netfilter gave
/// it to a local socket: a host-network backend on this node (the destination
/// now this node's address), or a socket on the Service address itself (a
/// node-local DNS cache). Nothing else: what a pod's sockets receive entered
/// the pod by its interface and was counted there (crossing into the pod's
/// namespace clears every mark), and what arrives from elsewhere for the node
/// was counted by the node or pod that sent it.
#[inline(always)]
fn count_delivered(ctx: &SkBuffContext) {
    // SAFETY: the kernel passes a valid `__sk_buff` for the program's whole
    // run; `ingress_ifindex` is a readable field of a cgroup_skb program's
    // context.
    let ingress_ifindex = unsafe { (*ctx.skb.skb).ingress_ifindex };
    // Before the headers (`marked_by` checks the mark first): most packets a
    // node receives are not marked.
    let Some(sender) = marked_by(ctx, ingress_ifindex) else {
        count_service_reply(ctx);
        return;
    };
    let Some((family, src, dst)) = addresses(ctx) else {
        return;
    };
    let to_node = match endpoint(&dst) {
        Some(ep) => ep.flags & flags::HOST != 0,
        None => is_service(&dst),
    };
    if !to_node {
        return;
    }
    clear_mark_bit(ctx);
    let key = FlowKey {
        src_identity: sender_identity(&sender, &src),
        dst_identity: identity::HOST,
    };
    add_packet(ctx, family, &key);
}

/// The client a socket's packet is counted for in SERVICE_FLOWS4/6, from its
/// address's ENDPOINTS entry: a pod of this node, or the node itself (`host`).
/// Anything else (another node's pod or address, an unknown address) is not
/// this node's to count: a lab of several nodes on one kernel shares the root
/// cgroup, and a pod's address is only LOCAL on its own node.
#[inline(always)]
fn service_client(ep: Option<EndpointValue>) -> Option<u32> {
    let ep = ep?;
    if ep.flags & flags::HOST != 0 {
        Some(identity::HOST)
    } else if ep.is_local() {
        Some(ep.identity)
    } else {
        None
    }
}

/// [`service_client`] of `address`, the address of the packet's socket (a
/// request's source, a reply's destination), from its CLIENTS entry while the
/// entry's epoch is CLIENTS_EPOCH's: one ENDPOINTS lookup per address and epoch,
/// not one per packet, and no kernel function called when the entry holds it. The
/// entry is the address's by its hash's top bits; an address that finds another
/// there looks its client up and takes the entry. Each CPU writes it without a
/// lock: the hash in the stamp keeps a reader from taking one writer's client for
/// another's address (see [`ClientCache`]).
#[inline(always)]
fn client_of(address: &EndpointKey) -> Option<u32> {
    // The epoch before ENDPOINTS: the agent bumps it after each write, so an
    // entry stamped with it holds what ENDPOINTS held then, or newer.
    // SAFETY: index 0 of a one-entry array; a volatile read keeps it before the
    // lookup.
    let epoch = CLIENTS_EPOCH
        .get_ptr(0)
        .map_or(0, |epoch| unsafe { core::ptr::read_volatile(epoch) });
    let hash = address.hash();
    let Some(entry) = CLIENTS.get_ptr_mut(ClientCache::slot(hash)) else {
        return service_client(endpoint(address));
    };
    // SAFETY: an element of a live array, for the run; see above for CPUs
    // writing it at once.
    unsafe {
        let stamp = core::ptr::read_volatile(&raw const (*entry).stamp);
        if ClientCache::is_of(stamp, epoch, hash) && (*entry).address == *address {
            let client = ClientCache::client(stamp);
            return (client != identity::INVALID).then_some(client);
        }
        let client = service_client(endpoint(address));
        (*entry).address = *address;
        core::ptr::write_volatile(
            &raw mut (*entry).stamp,
            ClientCache::stamp(epoch, hash, client.unwrap_or(identity::INVALID)),
        );
        client
    }
}

/// The Service address, port and protocol a socket's packet is a request to:
/// its destination, if a Service address, else its socket's (see
/// [`count_service_request`]) when its source may be one of the node's own
/// addresses (`host_source`, from the filter): only a host-network socket's packet
/// is translated before this hook, and a pod's carries the pod's address.
#[inline(always)]
fn service_requested<A: Probe>(
    ctx: &SkBuffContext,
    family: Family,
    filter: Option<&AddressFilter>,
    (host_source, dst): (bool, &A),
) -> Option<(EndpointKey, u16, u8)> {
    // The headers' ports only once the packet is a Service's: nearly no packet a
    // socket sends is.
    if is_service_counted(filter, dst) {
        let (protocol, _, dst_port) = transport(ctx, family);
        return Some((dst.key(), dst_port, protocol));
    }
    if !host_source {
        return None;
    }
    match socket_destination(ctx, family) {
        Some((address, port)) if address != dst.key() && is_service_counted(filter, &address) => {
            Some((address, port, transport(ctx, family).0))
        }
        _ => None,
    }
}

/// SERVICE_FLOWS4/6, egress of the root cgroup: a request of a pod of this
/// node or of the node itself (`client`, from [`service_client`]) to a Service
/// address (`service`, from [`service_requested`]). A pod's packet is not
/// translated yet here (its DNAT happens in the node's namespace, after it
/// leaves the pod): its destination is the Service address and port. A
/// host-network socket's packet was translated in OUTPUT, before this hook: its
/// socket still holds the address and port it connected to. An unconnected
/// host-network socket's datagram (`sendto`) is seen translated, and not
/// counted.
#[inline(always)]
fn count_service_request(
    ctx: &SkBuffContext,
    family: Family,
    client: Option<u32>,
    (service, port, protocol): (EndpointKey, u16, u8),
) {
    let Some(client) = client else {
        return;
    };
    let service = ServiceCounter {
        client,
        service: &service,
        port,
        protocol,
        direction: service_direction::REQUEST,
    };
    add_service(ctx, family, &service);
}

/// SERVICE_FLOWS4/6, ingress of the root cgroup: a reply from a Service address
/// (translated back before delivery) to a pod of this node or to the node
/// itself.
#[inline(always)]
fn count_service_reply(ctx: &SkBuffContext) {
    match socket_sides(ctx) {
        Some(Sides::V4(src, dst)) => count_service_reply_in(ctx, Family::V4, src, dst),
        Some(Sides::V6(src, dst)) => count_service_reply_in(ctx, Family::V6, src, dst),
        None => {}
    }
}

/// [`count_service_reply`] of a packet of `family`.
#[inline(always)]
fn count_service_reply_in<A: Probe>(ctx: &SkBuffContext, family: Family, src: A, dst: A) {
    // The Service address first: nearly no packet a socket receives is from one.
    if !is_service_counted(address_filter(), &src) {
        return;
    }
    let Some(client) = client_of(&dst.key()) else {
        return;
    };
    let (protocol, src_port, _) = transport(ctx, family);
    let src = src.key();
    let service = ServiceCounter {
        client,
        service: &src,
        port: src_port,
        protocol,
        direction: service_direction::REPLY,
    };
    add_service(ctx, family, &service);
}

/// The address and port the packet's socket is connected to, in the packet's
/// family (an IPv6 socket connected to an IPv4-mapped address gives the IPv4
/// address); `None` without a socket, or for one not connected.
#[inline(always)]
fn socket_destination(ctx: &SkBuffContext, family: Family) -> Option<(EndpointKey, u16)> {
    // SAFETY: `sk` is a readable field of a cgroup_skb program's context (a
    // socket or null); a non-null one is the packet's socket for the program's
    // whole run, and `family`, `dst_port`, `dst_ip4` and `dst_ip6` are readable
    // fields of any socket (its common part). Each read is of one field, the
    // width the verifier allows.
    unsafe {
        let sk = core::ptr::read_volatile(&raw const (*ctx.skb.skb).__bindgen_anon_2.sk);
        if sk.is_null() {
            return None;
        }
        let sk_family = core::ptr::read_volatile(&raw const (*sk).family);
        let port = u16::from_be(core::ptr::read_volatile(&raw const (*sk).dst_port));
        // Every address field, each at its own fixed offset, before looking at
        // the families: the verifier refuses a load whose offset into the socket
        // is computed, which is what the compiler makes of field loads chosen
        // by a branch.
        let ip4 = core::ptr::read_volatile(&raw const (*sk).dst_ip4);
        let ip6 = [
            core::ptr::read_volatile(&raw const (*sk).dst_ip6[0]),
            core::ptr::read_volatile(&raw const (*sk).dst_ip6[1]),
            core::ptr::read_volatile(&raw const (*sk).dst_ip6[2]),
            core::ptr::read_volatile(&raw const (*sk).dst_ip6[3]),
        ];
        let address = match (family, sk_family) {
            (Family::V4, AF_INET) => EndpointKey::v4_word(ip4),
            (Family::V4, AF_INET6) => {
                if ip6[..3] != [0, 0, u32::from_ne_bytes([0, 0, 0xff, 0xff])] {
                    return None;
                }
                EndpointKey::v4_word(ip6[3])
            }
            (Family::V6, AF_INET6) => EndpointKey::v6_words(ip6),
            _ => return None,
        };
        (port != 0).then_some((address, port))
    }
}

/// The packet's IP protocol and, for TCP and UDP, its source and destination
/// ports (host order; 0 where it carries none: another protocol, an IPv4
/// fragment after the first, an IPv6 transport header after extension
/// headers, which counts as the extension header's protocol).
#[inline(always)]
fn transport<P: Packet>(packet: &P, family: Family) -> (u8, u16, u16) {
    let l3 = P::L2_LEN;
    let (ip_len, protocol, first) = match family {
        Family::V4 => {
            // One read from the version to the protocol: the header's first 10
            // bytes (the addresses were read after them).
            let Some(header) = packet.read::<[u8; IPV4_PROTOCOL + 1]>(l3) else {
                return (0, 0, 0);
            };
            let fragment = u16::from_be_bytes([header[IPV4_FRAGMENT], header[IPV4_FRAGMENT + 1]]);
            (
                usize::from(header[0] & 0x0f) * 4,
                header[IPV4_PROTOCOL],
                fragment & IPV4_FRAGMENT_OFFSET == 0,
            )
        }
        Family::V6 => (
            IPV6_HLEN,
            packet
                .read::<[u8; 2]>(l3 + IPV6_NEXT_HEADER)
                .map_or(0, |[next, _]| next),
            true,
        ),
    };
    if !first || (protocol != IPPROTO_TCP && protocol != IPPROTO_UDP) {
        return (protocol, 0, 0);
    }
    match packet.read::<[u8; 4]>(l3 + ip_len) {
        Some([s0, s1, d0, d1]) => (
            protocol,
            u16::from_be_bytes([s0, s1]),
            u16::from_be_bytes([d0, d1]),
        ),
        None => (protocol, 0, 0),
    }
}

/// Whether an ENDPOINTS entry is a pod (here or on another node): not one of
/// this node's addresses, nor another node's.
#[inline(always)]
fn is_pod(ep: &EndpointValue) -> bool {
    ep.flags & flags::HOST == 0 && ep.identity != identity::REMOTE_NODE
}

/// Counts the packet under `key`: `max(1, gso_segs)` packets, and the
/// link-layer bytes of every segment, each with its Ethernet, IP and transport
/// headers (a cgroup hook's `skb->len` starts at the IP header: each segment's
/// Ethernet header is added).
#[inline(always)]
fn add_packet<P: Packet>(packet: &P, family: Family, key: &FlowKey) {
    let (packets, bytes) = packets_and_bytes(packet, family);
    add(packet, key, packets, bytes);
}

/// The packets and bytes FLOWS counts for this packet (see [`add_packet`]).
#[inline(always)]
fn packets_and_bytes<P: Packet>(packet: &P, family: Family) -> (u64, u64) {
    let (len, _) = packet.len_and_segments();
    let segments = segments(packet);
    // A cgroup hook's packet lacks the first segment's Ethernet header; every
    // further segment's is in the headers it repeats, below.
    let link = (ETH_HLEN - P::L2_LEN) as u64;
    let mut bytes = u64::from(len) + link;
    if segments > 1 {
        bytes += (segments - 1) * (ETH_HLEN as u64 + u64::from(header_len(packet, family)));
    }
    (segments, bytes)
}

/// census's mark bit, as the agent set it at load.
#[inline(always)]
fn mark_bit() -> u32 {
    // SAFETY: a plain read of a static; volatile so that the compiler keeps the
    // load the loader's value replaces (read-only data, folded by the verifier).
    unsafe { core::ptr::read_volatile(&raw const CENSUS_MARK_BIT) }
}

#[inline(always)]
fn mark<P: Packet>(ctx: &P) -> u32 {
    // SAFETY: the kernel passes a valid `__sk_buff` for the program's whole run;
    // `mark` is a readable field of a TC and of a cgroup_skb program's context.
    unsafe { (*ctx.sk_buff()).mark }
}

#[inline(always)]
fn set_mark<P: Packet>(ctx: &P, mark: u32) {
    // SAFETY: as in `mark`; `mark` is also a writable field of both contexts.
    unsafe { (*ctx.sk_buff()).mark = mark };
}

/// Whether the packet carries census's mark bit: it left an endpoint for a
/// Service address, and has not been counted yet.
#[inline(always)]
fn is_marked<P: Packet>(ctx: &P) -> bool {
    mark(ctx) & mark_bit() != 0
}

/// Clears census's mark bit, leaving every other bit as it is: the packet is
/// counted here.
#[inline(always)]
fn clear_mark_bit<P: Packet>(ctx: &P) {
    set_mark(ctx, mark(ctx) & !mark_bit());
    count_events(stats::MARKED_COUNTED, segments(ctx));
}

/// Whether `address` is in a Service range or is a Service's address: the
/// filter first, SERVICES only if it says maybe.
#[inline(always)]
fn is_service(address: &EndpointKey) -> bool {
    is_service_by(address_filter(), address)
}

/// [`is_service`] with the filter read once for the packet.
#[inline(always)]
fn is_service_by(filter: Option<&AddressFilter>, address: &EndpointKey) -> bool {
    may_be_service(filter, address) && in_services(address)
}

/// Whether SERVICES holds `address` (one of its ranges, or the address itself).
#[inline(always)]
fn in_services(address: &EndpointKey) -> bool {
    SERVICES
        .get(Key::new(SERVICE_LOOKUP_PREFIX_LEN, *address))
        .is_some()
}

/// [`is_service_by`] for SERVICE_FLOWS4/6: an address in a range the filter holds
/// exactly (a ClusterIP) is a Service's without the SERVICES lookup. Not for
/// FLOWS' choices: what a packet is counted as there never rests on a filter
/// read while it is written, and nothing is counted twice or lost.
#[inline(always)]
fn is_service_counted<A: Probe>(filter: Option<&AddressFilter>, address: &A) -> bool {
    match filter.map_or(Verdict::Maybe, |filter| filter.service_verdict(address)) {
        Verdict::No => false,
        Verdict::Yes => true,
        Verdict::Maybe => in_services(&address.key()),
    }
}

/// ADDRESS_FILTER's entry (`None` only if the map has none: then every address
/// may be anything).
#[inline(always)]
fn address_filter() -> Option<&'static AddressFilter> {
    ADDRESS_FILTER.get(0)
}

/// Whether `address` may be in SERVICES: `false` only if the filter says it
/// surely is not.
#[inline(always)]
fn may_be_service(filter: Option<&AddressFilter>, address: &EndpointKey) -> bool {
    filter.is_none_or(|filter| filter.may_be_service(address))
}

/// The interface a packet carrying census's mark came in by, if census counts
/// on it: only then is the mark census's (`census_ingress` marks nothing else).
/// A packet that carries the bit otherwise (a local socket's `SO_MARK`, another
/// program's rule) is not census's to count or clear.
#[inline(always)]
fn marked_by<P: Packet>(ctx: &P, ingress_ifindex: u32) -> Option<InterfaceValue> {
    if !is_marked(ctx) {
        return None;
    }
    interface(ingress_ifindex)
}

/// The identity of a marked packet's sender: the endpoint behind the interface
/// it came in by, else (endpoints of several identities behind it) its source
/// address's.
#[inline(always)]
fn sender_identity(interface: &InterfaceValue, src: &EndpointKey) -> u32 {
    if interface.identity != identity::INVALID {
        interface.identity
    } else {
        identity_of(endpoint(src))
    }
}

/// The IP and transport headers every segment of a GSO packet carries: IP
/// (IPv4 with its options; IPv6's fixed header) and TCP (with its options) or UDP.
/// An IPv6 packet whose transport header follows extension headers counts IPv6's
/// only (GSO is for TCP and UDP, which rarely follow extension headers).
#[inline(always)]
fn header_len<P: Packet>(packet: &P, family: Family) -> u32 {
    let l3 = P::L2_LEN;
    // Every field is read as the first of two bytes: a one-byte bounds check
    // compiles to a comparison the verifier cannot use for a variable offset.
    let (ip_len, protocol) = match family {
        Family::V4 => {
            let Some([version_ihl, _]) = packet.read::<[u8; 2]>(l3) else {
                return 0;
            };
            let ihl = usize::from(version_ihl & 0x0f) * 4;
            // TTL, then protocol.
            let protocol = packet
                .read::<[u8; 2]>(l3 + IPV4_PROTOCOL - 1)
                .map(|[_, p]| p);
            (ihl, protocol)
        }
        Family::V6 => (
            IPV6_HLEN,
            packet
                .read::<[u8; 2]>(l3 + IPV6_NEXT_HEADER)
                .map(|[next, _]| next),
        ),
    };
    let transport = match protocol {
        Some(IPPROTO_TCP) => packet
            .read::<[u8; 2]>(l3 + ip_len + TCP_DATA_OFFSET)
            .map_or(0, |[offset, _]| u32::from(offset >> 4) * 4),
        Some(IPPROTO_UDP) => UDP_HLEN,
        _ => 0,
    };
    #[expect(clippy::cast_possible_truncation, reason = "at most 60")]
    let ip_len = ip_len as u32;
    ip_len + transport
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
fn local_identity(ctx: &TcContext, ifindex: u32, address: &EndpointKey) -> u32 {
    match interface(ifindex) {
        Some(entry) if entry.identity != identity::INVALID => entry.identity,
        Some(_) => identity_of(endpoint(address)),
        None => {
            let ep = endpoint(address);
            if let Some(ep) = ep
                && ep.is_local()
            {
                interface_miss(ctx, ifindex, ep.identity);
            }
            identity_of(ep)
        }
    }
}

/// The family, source and destination of an IPv4 or IPv6 packet.
#[inline(always)]
fn frame<P: Packet>(packet: &P) -> Frame {
    let l3 = P::L2_LEN;
    match packet.protocol() {
        ETH_P_IP => match packet.read_words::<2>(l3 + IPV4_SADDR) {
            Some([src, dst]) => Frame::Ip(
                Family::V4,
                EndpointKey::v4_word(src),
                EndpointKey::v4_word(dst),
            ),
            None => Frame::Truncated(Family::V4),
        },
        ETH_P_IPV6 => match packet.read_words::<8>(l3 + IPV6_SADDR) {
            Some([s0, s1, s2, s3, d0, d1, d2, d3]) => Frame::Ip(
                Family::V6,
                EndpointKey::v6_words([s0, s1, s2, s3]),
                EndpointKey::v6_words([d0, d1, d2, d3]),
            ),
            None => Frame::Truncated(Family::V6),
        },
        _ => Frame::NotIp,
    }
}

/// A socket's packet's addresses as the filter reads them: the root cgroup's
/// programs make keys of them only for the few packets that need a lookup.
enum Sides {
    V4(V4, V4),
    V6(V6, V6),
}

/// [`Sides`] of an IP packet the root cgroup sees; `None` for anything else, a
/// packet too short to hold them counted as unparsable (as [`addresses`]).
#[inline(always)]
fn socket_sides(ctx: &SkBuffContext) -> Option<Sides> {
    match ctx.protocol() {
        ETH_P_IP => match ctx.read_words::<2>(IPV4_SADDR) {
            Some([src, dst]) => return Some(Sides::V4(V4(src), V4(dst))),
            None => unparsable(ctx, Family::V4),
        },
        ETH_P_IPV6 => match ctx.read_dwords::<4>(IPV6_SADDR) {
            Some([s0, s1, d0, d1]) => return Some(Sides::V6(V6([s0, s1]), V6([d0, d1]))),
            None => unparsable(ctx, Family::V6),
        },
        _ => {}
    }
    None
}

/// [`frame`]'s addresses of an IP packet; `None` for anything else, a packet
/// too short to hold them counted as unparsable.
#[inline(always)]
fn addresses<P: Packet>(packet: &P) -> Option<(Family, EndpointKey, EndpointKey)> {
    match frame(packet) {
        Frame::Ip(family, src, dst) => Some((family, src, dst)),
        Frame::NotIp => None,
        Frame::Truncated(family) => {
            unparsable(packet, family);
            None
        }
    }
}

/// What the programs read of a packet, on a TC hook (from its Ethernet header)
/// or a cgroup hook (from its IP header).
trait Packet: EbpfContext {
    /// Bytes before the IP header.
    const L2_LEN: usize;

    /// A `T` at `offset` of the packet, if it has that many bytes: straight from
    /// the linear data when it is there (the common case, and the cheapest), else
    /// as [`load_bytes`](Self::load_bytes) reads it.
    #[inline(always)]
    fn read<T: Copy>(&self, offset: usize) -> Option<T> {
        let (start, end) = self.linear();
        if start + offset + size_of::<T>() <= end {
            // SAFETY: the bounds check above is the one the verifier requires for
            // direct packet access; the read is unaligned-safe.
            return Some(unsafe { core::ptr::read_unaligned((start + offset) as *const T) });
        }
        self.load_bytes(offset)
    }

    /// A `T` at `offset` of the packet through `bpf_skb_load_bytes`, which also
    /// reads paged data.
    fn load_bytes<T: Copy>(&self, offset: usize) -> Option<T>;

    /// `N` words at `offset` of the packet, as they sit in memory, if it has
    /// that many bytes: one load each from the linear data (see [`load_word`]),
    /// else as [`read`](Self::read) reads them.
    #[inline(always)]
    fn read_words<const N: usize>(&self, offset: usize) -> Option<[u32; N]> {
        let (start, end) = self.linear();
        if start + offset + 4 * N <= end {
            let mut words = [0u32; N];
            for (i, word) in words.iter_mut().enumerate() {
                *word = load_word(start + offset + 4 * i);
            }
            return Some(words);
        }
        self.read(offset)
    }

    /// As [`read_words`](Self::read_words), in 64-bit words (see
    /// [`load_dword`]).
    #[inline(always)]
    fn read_dwords<const N: usize>(&self, offset: usize) -> Option<[u64; N]> {
        let (start, end) = self.linear();
        if start + offset + 8 * N <= end {
            let mut words = [0u64; N];
            for (i, word) in words.iter_mut().enumerate() {
                *word = load_dword(start + offset + 8 * i);
            }
            return Some(words);
        }
        self.read(offset)
    }

    /// The linear data's start and end (`skb->data`, `skb->data_end`).
    fn linear(&self) -> (usize, usize);

    /// `skb->protocol`: the EtherType.
    #[inline(always)]
    fn protocol(&self) -> u16 {
        // SAFETY: the kernel passes a valid `__sk_buff` for the program's whole
        // run; `protocol` is a readable field of a TC and a cgroup_skb program's
        // context. The EtherType is in network order in the low 16 bits.
        #[expect(clippy::cast_possible_truncation, reason = "a be16 held in a u32")]
        u16::from_be(unsafe { (*self.sk_buff()).protocol } as u16)
    }

    /// `skb->len` and `skb->gso_segs`.
    #[inline(always)]
    fn len_and_segments(&self) -> (u32, u32) {
        // SAFETY: as for `protocol`; `len` and `gso_segs` are readable fields of
        // both programs' contexts.
        unsafe {
            let skb = self.sk_buff();
            ((*skb).len, (*skb).gso_segs)
        }
    }

    /// The packet's `__sk_buff`, valid for the program's whole run.
    fn sk_buff(&self) -> *mut __sk_buff;
}

impl Packet for TcContext {
    const L2_LEN: usize = ETH_HLEN;

    #[inline(always)]
    fn linear(&self) -> (usize, usize) {
        (self.data(), self.data_end())
    }

    #[inline(always)]
    fn load_bytes<T: Copy>(&self, offset: usize) -> Option<T> {
        self.load(offset).ok()
    }

    #[inline(always)]
    fn sk_buff(&self) -> *mut __sk_buff {
        self.skb.skb
    }
}

impl Packet for SkBuffContext {
    const L2_LEN: usize = 0;

    #[inline(always)]
    fn linear(&self) -> (usize, usize) {
        // SAFETY: the kernel passes a valid `__sk_buff` for the program's whole
        // run; `data` and `data_end` are readable fields of a cgroup_skb
        // program's context (for a program loaded with CAP_BPF or
        // CAP_SYS_ADMIN, as census's are).
        unsafe {
            let skb = self.skb.skb;
            ((*skb).data as usize, (*skb).data_end as usize)
        }
    }

    #[inline(always)]
    fn load_bytes<T: Copy>(&self, offset: usize) -> Option<T> {
        self.load(offset).ok()
    }

    #[inline(always)]
    fn sk_buff(&self) -> *mut __sk_buff {
        self.skb.skb
    }
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
fn add<C: EbpfContext>(ctx: &C, key: &FlowKey, packets: u64, bytes: u64) {
    match add_to(&FLOWS, key, packets, bytes) {
        Ok(false) => {}
        Ok(true) => count_event(stats::FLOW_INSERTS),
        Err(error) => insert_failed(ctx, key, error),
    }
}

/// A Service packet's counter, of either family: what a key of SERVICE_FLOWS4
/// or SERVICE_FLOWS6 is made of.
struct ServiceCounter<'a> {
    client: u32,
    service: &'a EndpointKey,
    port: u16,
    protocol: u8,
    direction: u8,
}

/// Adds a Service packet to its counters in SERVICE_FLOWS4 or SERVICE_FLOWS6,
/// inserting them if new.
#[inline(always)]
fn add_service(ctx: &SkBuffContext, family: Family, counter: &ServiceCounter<'_>) {
    let (packets, bytes) = packets_and_bytes(ctx, family);
    let added = match family {
        Family::V4 => {
            let key = ServiceFlowKey4 {
                client_identity: counter.client,
                port: counter.port,
                protocol: counter.protocol,
                direction: counter.direction,
                service: counter.service.addr[0],
            };
            add_to(&SERVICE_FLOWS4, &key, packets, bytes)
        }
        Family::V6 => {
            let key = ServiceFlowKey6 {
                client_identity: counter.client,
                port: counter.port,
                protocol: counter.protocol,
                direction: counter.direction,
                service: counter.service.addr,
            };
            add_to(&SERVICE_FLOWS6, &key, packets, bytes)
        }
    };
    match added {
        Ok(false) => {}
        Ok(true) => count_event(stats::SERVICE_FLOW_INSERTS),
        Err(error) => service_insert_failed(ctx, counter.client, error),
    }
}

/// Adds to this CPU's counters of `key` in `map`, inserting them if new:
/// `Ok(true)` if this inserted them, the kernel's error if it refused to.
#[inline(always)]
fn add_to<K>(
    map: &LruPerCpuHashMap<K, FlowValue>,
    key: &K,
    packets: u64,
    bytes: u64,
) -> Result<bool, i32> {
    if bump(map, key, packets, bytes) {
        return Ok(false);
    }
    let value = FlowValue { packets, bytes };
    match map.insert(key, value, u64::from(BPF_NOEXIST)) {
        Ok(()) => Ok(true),
        // Another CPU created the entry since the lookup: add to this CPU's slot.
        Err(EEXIST) => {
            bump(map, key, packets, bytes);
            Ok(false)
        }
        Err(error) => Err(error),
    }
}

#[inline(never)]
fn service_insert_failed<C: EbpfContext>(ctx: &C, client: u32, error: i32) {
    count_event(stats::SERVICE_FLOW_INSERT_FAILURES);
    if may_log(Level::Warn) {
        warn!(
            ctx,
            "SERVICE_FLOWS4/6 refused a new entry for client {} (error {}): the packet is not \
             counted there",
            client,
            error
        );
    }
}

/// Adds one to this CPU's slot `index` of STATS.
#[inline(always)]
fn count_event(index: u32) {
    count_events(index, 1);
}

/// Adds `n` to the STATS slot `index`.
#[inline(always)]
fn count_events(index: u32, n: u64) {
    if let Some(slot) = STATS.get_ptr_mut(index) {
        // SAFETY: this CPU's slot of a live array element; programs on one CPU
        // do not interleave (TC runs with bottom halves disabled).
        unsafe { *slot += n };
    }
}

/// The packets an skb stands for, as FLOWS counts them: `max(1, gso_segs)`.
#[inline(always)]
fn segments<P: Packet>(packet: &P) -> u64 {
    u64::from(packet.len_and_segments().1.max(1))
}

/// Whether an event of `level` is to be logged now: logging is on at that level
/// and this CPU has not logged for [`LOG_INTERVAL_NS`]. An event refused by the
/// rate limit is counted as suppressed.
#[inline(always)]
fn may_log(level: Level) -> bool {
    // Read-only data: with logging off the verifier drops everything below.
    if !level_enabled(level) {
        return false;
    }
    let Some(last) = LOG_BUDGET.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: a helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    // SAFETY: this CPU's slot, as in `count_event`.
    unsafe {
        if *last != 0 && now.wrapping_sub(*last) < LOG_INTERVAL_NS {
            count_event(stats::LOG_SUPPRESSED);
            return false;
        }
        *last = now;
    }
    true
}

#[inline(never)]
fn insert_failed<C: EbpfContext>(ctx: &C, key: &FlowKey, error: i32) {
    count_event(stats::FLOW_INSERT_FAILURES);
    if may_log(Level::Warn) {
        warn!(
            ctx,
            "FLOWS refused a new pair {} -> {} (error {}): the packet is not counted",
            key.src_identity,
            key.dst_identity,
            error
        );
    }
}

#[inline(never)]
fn unparsable<P: Packet>(ctx: &P, family: Family) {
    count_event(stats::UNPARSABLE);
    if may_log(Level::Info) {
        let (version, len) = (
            if family == Family::V4 { 4u8 } else { 6 },
            ctx.len_and_segments().0,
        );
        info!(
            ctx,
            "an IPv{} frame of {} bytes is too short to hold its addresses: not counted",
            version,
            len
        );
    }
}

#[inline(never)]
fn interface_miss(ctx: &TcContext, ifindex: u32, identity: u32) {
    count_event(stats::INTERFACE_MISSES);
    if may_log(Level::Debug) {
        debug!(
            ctx,
            "interface {} has no INTERFACES entry, but its endpoint (identity {}) is flagged \
             LOCAL: counted by address",
            ifindex,
            identity
        );
    }
}

/// Adds to this CPU's counters of `key` in `map`, if the entry exists.
#[inline(always)]
fn bump<K>(map: &LruPerCpuHashMap<K, FlowValue>, key: &K, packets: u64, bytes: u64) -> bool {
    let Some(value) = map.get_ptr_mut(key) else {
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
