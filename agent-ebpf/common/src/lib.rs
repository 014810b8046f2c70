//! The types census's eBPF program and its agent share through BPF maps.
//!
//! Every type is `#[repr(C)]` with explicit padding, so that the kernel side, the
//! agent and tools such as `bpftool map dump` agree on every byte, and every size
//! is asserted at compile time. Changing any of them, or the kind or size of a
//! map, is a new [`LAYOUT_VERSION`].
//!
//! With the `user` feature the types implement `aya::Pod`, for the agent.
#![no_std]

use core::net::{IpAddr, Ipv4Addr, Ipv6Addr};

pub mod filter;

/// Version of the layout of every pinned map (types, map kinds, sizes).
///
/// The agent records it in [`META_MAP`] when it creates the maps and refuses to
/// use pinned maps that carry another one. 0 is never a layout: it marks a meta
/// map that was created but not yet stamped.
///
/// 2: [`INTERFACES_MAP`] (the endpoint behind each interface census counts on).
/// 3: [`STATS_MAP`] (the program's own counters); FLOWS bytes under GSO are
/// per-segment (see [`FlowValue`]). Layout 2's maps are taken over as they are
/// (their shapes did not change; [`STATS_MAP`] is added beside them): see
/// [`MIGRATES_FROM`].
/// 4: [`EndpointValue`] carries the node of a remote endpoint (`flags` is a
/// `u16`, `node` the other half of the old `u32` flags); ENDPOINTS is sized for
/// the cluster and not preallocated ([`ENDPOINTS_MAP_FLAGS`]); [`NODES_MAP`]
/// names the nodes. Layouts 2 and 3 are migrated: ENDPOINTS is created anew and
/// every entry copied into it (see [`EndpointValue::from_layout3`]), the other
/// maps are taken over as they are.
/// 5: [`SERVICES_MAP`] (the cluster's Service addresses: a packet leaving an
/// endpoint for one is marked, and counted once translated). Layout 4's maps are
/// taken over as they are, SERVICES created beside them.
/// 6: [`SERVICE_FLOWS_LAYOUT7_MAP`] (per client identity, Service address, port,
/// protocol and direction, counted at the root cgroup's hooks). Layout 5's maps
/// are taken over as they are, SERVICE_FLOWS created beside them.
/// 7: [`filter::ADDRESS_FILTER_MAP`] (what SERVICES and the HOST entries surely
/// do not hold, for the root cgroup's programs). Layout 6's maps are taken over
/// as they are, ADDRESS_FILTER created beside them.
/// 8: one Service counter map per family, [`SERVICE_FLOWS4_MAP`] (a 12-byte key)
/// and [`SERVICE_FLOWS6_MAP`] (24 bytes), in place of layouts 6 and 7's one
/// SERVICE_FLOWS ([`ServiceFlowKeyLayout7`], 28 bytes), whose every entry is
/// copied into them; [`CLIENTS_EPOCH_MAP`]. Layout 7's other maps are taken over
/// as they are.
pub const LAYOUT_VERSION: u32 = 8;

/// Older layouts whose pinned maps an agent of [`LAYOUT_VERSION`] takes over,
/// keeping every entry and counter: the maps whose shape did not change are
/// reused in place, ENDPOINTS is copied into a map of this layout, and the maps
/// they lack are created beside them.
pub const MIGRATES_FROM: [u32; 6] = [2, 3, 4, 5, 6, 7];

/// The layouts of [`MIGRATES_FROM`] whose ENDPOINTS has another shape (before 4):
/// taking them over copies ENDPOINTS into a new map.
pub const ENDPOINTS_COPIED_FROM: [u32; 2] = [2, 3];

/// `endpoint address -> identity + flags + node`: [`EndpointKey`] -> [`EndpointValue`].
pub const ENDPOINTS_MAP: &str = "ENDPOINTS";
/// `node index -> name + addresses`: `u32` (a node index, never 0) ->
/// [`NodeValue`]. The node of a remote [`EndpointValue`] is a key of this map.
pub const NODES_MAP: &str = "NODES";
/// `(source identity, destination identity) -> packets, bytes`, per CPU, least
/// recently used pairs evicted first: [`FlowKey`] -> [`FlowValue`].
pub const FLOWS_MAP: &str = "FLOWS";
/// `interface -> the endpoint behind it`: an array of [`InterfaceValue`] slots, the
/// slot of an interface being [`interface_slot`] of its ifindex. It makes the local
/// side of every packet a fact of where the packet is (the interface), not a claim
/// of its headers (the address), and saves the program one hash lookup per packet.
/// Mmapable, so the agent and the CLI read every slot without a syscall each.
pub const INTERFACES_MAP: &str = "INTERFACES";
/// The program's own counters, per CPU: an array of `u64` indexed by the
/// constants of [`stats`]. Slots past the last one a layout names read 0, so a
/// counter can be added in a free slot without a new layout.
pub const STATS_MAP: &str = "STATS";
/// `Service address range -> kind`: a longest-prefix-match trie keyed by
/// [`ServiceKey`] (`prefix_len` bits of the family and address, an
/// [`EndpointKey`]), valued by one of [`service`]'s kinds (`u32`). Every
/// ClusterIP range, LoadBalancer and external IP of the cluster: a packet leaving
/// an endpoint for one of them is not counted there but marked
/// ([`MARK_BIT_GLOBAL`]), and counted where it is seen translated.
pub const SERVICES_MAP: &str = "SERVICES";
/// `(client identity, IPv4 Service address, port, protocol, direction) ->
/// packets, bytes`, per CPU, least recently used entries evicted first:
/// [`ServiceFlowKey4`] -> [`FlowValue`]. Written by the root cgroup's programs,
/// where a pod's request still carries the Service address it dialled and its
/// reply carries it back; FLOWS is counted as it would be without it. One map
/// per family: a 12-byte key costs a counter update a third less than the
/// 28 bytes one key of both families takes.
pub const SERVICE_FLOWS4_MAP: &str = "SERVICE_FLOWS4";
/// [`SERVICE_FLOWS4_MAP`] of IPv6 Service addresses: [`ServiceFlowKey6`] ->
/// [`FlowValue`].
pub const SERVICE_FLOWS6_MAP: &str = "SERVICE_FLOWS6";
/// Layouts 6 and 7's Service counters, both families in one map:
/// [`ServiceFlowKeyLayout7`] -> [`FlowValue`]. Taken over by copying every entry
/// into [`SERVICE_FLOWS4_MAP`] and [`SERVICE_FLOWS6_MAP`].
pub const SERVICE_FLOWS_LAYOUT7_MAP: &str = "SERVICE_FLOWS";
/// The clients Service packets were last counted for, by address (an array of
/// [`CLIENTS_MAX_ENTRIES`] [`ClientCache`] entries, not pinned): the root
/// cgroup's programs look a Service packet's client up in ENDPOINTS once per
/// address and epoch, not once per packet. Made with the programs, so it never
/// outlives what wrote it.
pub const CLIENTS_MAP: &str = "CLIENTS";
/// Entries of [`CLIENTS_MAP`]: 2^[`CLIENTS_LG`], 128 KiB. An address takes the
/// entry its hash's top bits name; two clients of one node whose addresses share
/// an entry take it from each other. The hash spreads consecutive addresses: 110
/// pods of one IPv4 /24 take 110 entries (among random addresses, about 1.5 pairs
/// of 110 would share one).
pub const CLIENTS_MAX_ENTRIES: u32 = 1 << CLIENTS_LG;
/// The bits of an address's hash that name its [`CLIENTS_MAP`] entry.
pub const CLIENTS_LG: u32 = 12;
/// A one-entry array of `u64`, mmapable: the epoch of [`CLIENTS_MAP`]'s
/// entries. The agent adds one after each write to ENDPOINTS, and a kept client
/// is used only while its epoch is the current one. Pinned, so an agent's writes
/// also reach the programs an older agent left attached until it replaces them.
pub const CLIENTS_EPOCH_MAP: &str = "CLIENTS_EPOCH";
/// A one-entry array holding the [`LAYOUT_VERSION`] the pinned maps were made
/// with. Its own shape (array, `u32` key, `u32` value, one entry) never changes,
/// so any agent, older or newer, can read it before touching the other maps.
pub const META_MAP: &str = "CENSUS_META";

/// Entries of ENDPOINTS when it is created, unless the agent is told otherwise
/// (`census-agent --endpoints-max-entries`): every endpoint of the cluster, local
/// and remote, and every node address.
pub const ENDPOINTS_MAX_ENTRIES: u32 = 524_288;
/// ENDPOINTS' map flags: `BPF_F_NO_PREALLOC`, so the kernel allocates an entry
/// when it is written, not every entry when the map is created.
pub const ENDPOINTS_MAP_FLAGS: u32 = BPF_F_NO_PREALLOC;
/// Entries of NODES when it is created, unless the agent is told otherwise
/// (`census-agent --nodes-max-entries`): node indexes are `u16`.
pub const NODES_MAX_ENTRIES: u32 = 65_535;
/// NODES' map flags: `BPF_F_NO_PREALLOC`.
pub const NODES_MAP_FLAGS: u32 = BPF_F_NO_PREALLOC;
/// Entries of SERVICES: ranges and single addresses (a LoadBalancer or external
/// IP is one entry each).
pub const SERVICES_MAX_ENTRIES: u32 = 65_536;
/// SERVICES' map flags: `BPF_F_NO_PREALLOC`, which the kernel requires of a
/// longest-prefix-match trie.
pub const SERVICES_MAP_FLAGS: u32 = BPF_F_NO_PREALLOC;
/// The `prefix_len` of a SERVICES lookup: every bit of an [`EndpointKey`] (the
/// family's 32 and the address's 128; an IPv4 key's trailing bytes are zero, so
/// IPv4 prefixes, at most 32 + 32 bits, match it).
pub const SERVICE_LOOKUP_PREFIX_LEN: u32 = 32 + 128;
/// The program's global holding census's bit of `skb->mark` (set at load, read
/// only: the verifier sees a constant).
pub const MARK_BIT_GLOBAL: &str = "CENSUS_MARK_BIT";
/// census's mark bit unless the agent is told otherwise (`--mark-bit`): a bit that
/// kube-proxy (0x4000, 0x8000), Cilium (0x0F00, 0xFFFF0000), Calico (its mask,
/// 0xFFFF0000), Istio (0x200, 0x539) and the AWS VPC CNI (0x80) leave alone.
pub const MARK_BIT_DEFAULT: u32 = 0x40;
/// `BPF_F_NO_PREALLOC` (uapi `linux/bpf.h`).
pub const BPF_F_NO_PREALLOC: u32 = 1 << 0;
/// Bytes of a node name a [`NodeValue`] holds: a Kubernetes node name is a DNS
/// subdomain, at most 253 bytes.
pub const NODE_NAME_MAX: usize = 253;
/// Addresses a [`NodeValue`] holds (Hello carries at most 16).
pub const NODE_ADDRESSES_MAX: usize = 16;
/// Maximum number of identity pairs counted at once; the least recently used
/// pair is evicted when the map is full.
pub const FLOWS_MAX_ENTRIES: u32 = 65_536;
/// Entries of [`SERVICE_FLOWS4_MAP`], and of [`SERVICE_FLOWS6_MAP`], unless the
/// agent is told otherwise (`census-agent --service-flows-max-entries`).
pub const SERVICE_FLOWS_MAX_ENTRIES: u32 = 16_384;
/// Slots of [`INTERFACES_MAP`] (a power of two). Two interfaces census counts on
/// share a slot only when their ifindexes differ by a multiple of this; the one
/// that does not get it is counted by address, as if it had no entry.
pub const INTERFACES_MAX_ENTRIES: u32 = 65_536;
/// [`INTERFACES_MAP`]'s map flags: `BPF_F_MMAPABLE`.
pub const INTERFACES_MAP_FLAGS: u32 = 1 << 10;
/// [`CLIENTS_EPOCH_MAP`]'s map flags: `BPF_F_MMAPABLE`, so the agent bumps it with
/// a store, not a syscall, after each write to ENDPOINTS.
pub const CLIENTS_EPOCH_MAP_FLAGS: u32 = 1 << 10;
/// Slots of [`STATS_MAP`].
pub const STATS_MAX_ENTRIES: u32 = 16;
/// The meta map holds one entry, at index [`META_LAYOUT_INDEX`].
pub const META_MAX_ENTRIES: u32 = 1;
/// Index of the layout version in [`META_MAP`].
pub const META_LAYOUT_INDEX: u32 = 0;

/// Name of the program attached to the host side's ingress hook (packets
/// leaving the endpoint).
pub const PROGRAM_INGRESS: &str = "census_ingress";
/// Name of the program attached to the host side's egress hook (packets
/// entering the endpoint).
pub const PROGRAM_EGRESS: &str = "census_egress";

/// Name of the program attached to the egress hook of uplink and tunnel devices
/// (packets leaving the node, translated): it counts the packets an endpoint
/// sent to a Service whose backend is on another node.
pub const PROGRAM_UPLINK: &str = "census_uplink";

/// Name of the program attached to the egress of the root cgroup: packets the
/// node's own sockets send to pods.
pub const PROGRAM_SOCKETS: &str = "census_sockets";

/// Name of the program attached to the ingress of the root cgroup: Service
/// requests from pods that the node's own sockets receive (host-network
/// backends).
pub const PROGRAM_SOCKETS_INGRESS: &str = "census_sockets_ingress";

/// The key of [`SERVICES_MAP`], laid out as the kernel's `bpf_lpm_trie_key`:
/// `prefix_len` bits of `address` match, the family's 32 first. An IPv4 range
/// `a.b.c.d/n` is `prefix_len` 32 + n.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey {
    pub prefix_len: u32,
    pub address: EndpointKey,
}

impl ServiceKey {
    /// The key of the range of `address`'s first `bits` bits (at most 32 for
    /// IPv4, 128 for IPv6; the caller checks).
    pub const fn range(address: EndpointKey, bits: u8) -> Self {
        Self {
            prefix_len: 32 + bits as u32,
            address,
        }
    }

    /// The bits of the address this range matches (`prefix_len` less the
    /// family's 32).
    pub const fn bits(&self) -> u32 {
        self.prefix_len.saturating_sub(32)
    }
}

/// What a [`SERVICES_MAP`] entry is (its value).
/// What a Service address range is: the value SERVICES holds for it, and the one
/// type the kernel side, the agent and the operator's domain share. The order is
/// the precedence when one range is more than one kind: a ClusterIP range first,
/// then a LoadBalancer IP.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ServiceKind {
    /// A range of ClusterIPs (a `ServiceCIDR`, or the operator's `--service-cidr`).
    ClusterIpRange = 1,
    /// A Service's LoadBalancer ingress IP.
    LoadBalancerIp = 2,
    /// A Service's external IP (`spec.externalIPs`).
    ExternalIp = 3,
}

impl ServiceKind {
    /// The value SERVICES holds for this kind.
    pub const fn raw(self) -> u32 {
        self as u32
    }

    /// The kind of a SERVICES value; `None` for a value census does not write.
    pub const fn from_raw(raw: u32) -> Option<Self> {
        match raw {
            service::CLUSTER_IP_RANGE => Some(Self::ClusterIpRange),
            service::LOAD_BALANCER_IP => Some(Self::LoadBalancerIp),
            service::EXTERNAL_IP => Some(Self::ExternalIp),
            _ => None,
        }
    }

    /// How the CLI and the logs name it.
    pub const fn name(self) -> &'static str {
        match self {
            Self::ClusterIpRange => "cluster-ip-range",
            Self::LoadBalancerIp => "load-balancer-ip",
            Self::ExternalIp => "external-ip",
        }
    }
}

impl core::fmt::Display for ServiceKind {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.name())
    }
}

/// [`ServiceKind`]'s values, as the kernel side compares SERVICES' values with them.
pub mod service {
    use super::ServiceKind;

    pub const CLUSTER_IP_RANGE: u32 = ServiceKind::ClusterIpRange as u32;
    pub const LOAD_BALANCER_IP: u32 = ServiceKind::LoadBalancerIp as u32;
    pub const EXTERNAL_IP: u32 = ServiceKind::ExternalIp as u32;
}

/// Reserved identities (1..=255 are reserved, 0 is invalid).
pub mod identity {
    /// Not an identity.
    pub const INVALID: u32 = 0;
    /// The node itself: its addresses are in ENDPOINTS with the `HOST` flag.
    pub const HOST: u32 = 1;
    /// Any address that is not in ENDPOINTS.
    pub const WORLD: u32 = 2;
    /// The addresses of the other nodes of the cluster (REMOTE entries).
    pub const REMOTE_NODE: u32 = 6;
}

/// The slots of [`STATS_MAP`]: events the program counts, summed over CPUs by
/// the agent. FLOWS is an LRU map, which evicts without telling the program:
/// the pairs evicted are the pairs inserted less the pairs present (the agent
/// never deletes a pair).
pub mod stats {
    /// New identity pairs inserted into FLOWS.
    pub const FLOW_INSERTS: u32 = 0;
    /// Inserts into FLOWS the kernel refused (not counting the race in which
    /// another CPU inserted the same pair first): that packet went uncounted.
    pub const FLOW_INSERT_FAILURES: u32 = 1;
    /// IPv4 or IPv6 frames whose addresses could not be read (truncated): not
    /// counted.
    pub const UNPARSABLE: u32 = 2;
    /// Packets on an interface without an INTERFACES entry whose local side is
    /// an address flagged LOCAL (its interface's entry is missing or not written
    /// yet): counted by address.
    pub const INTERFACE_MISSES: u32 = 3;
    /// Datapath log events not sent because of the rate limit.
    pub const LOG_SUPPRESSED: u32 = 4;
    /// Packets an endpoint sent to a Service address, marked where they left it;
    /// packets as FLOWS counts them (`max(1, gso_segs)` per skb).
    pub const SERVICE_MARKED: u32 = 5;
    /// Marked packets counted once translated (where they entered a pod, left
    /// the node or reached one of its sockets), in the same units. Fewer than
    /// [`SERVICE_MARKED`] over time: the others were dropped, or lost the mark to
    /// a rule that rewrites the whole of `skb->mark`.
    pub const MARKED_COUNTED: u32 = 6;
    /// New entries inserted into SERVICE_FLOWS.
    pub const SERVICE_FLOW_INSERTS: u32 = 7;
    /// Inserts into SERVICE_FLOWS the kernel refused (the race with another
    /// CPU aside): that packet went uncounted there (FLOWS is not affected).
    pub const SERVICE_FLOW_INSERT_FAILURES: u32 = 8;
    /// Every slot this layout uses.
    pub const ALL: [u32; 9] = [
        FLOW_INSERTS,
        FLOW_INSERT_FAILURES,
        UNPARSABLE,
        INTERFACE_MISSES,
        LOG_SUPPRESSED,
        SERVICE_MARKED,
        MARKED_COUNTED,
        SERVICE_FLOW_INSERTS,
        SERVICE_FLOW_INSERT_FAILURES,
    ];
}

/// Address family tag of an [`EndpointKey`].
pub mod family {
    /// IPv4: the address is in `addr[0]`, the other three words are zero.
    pub const IPV4: u32 = 4;
    /// IPv6: all four words.
    pub const IPV6: u32 = 6;
}

/// An endpoint address, the key of [`ENDPOINTS_MAP`].
///
/// `family` is [`family::IPV4`] or [`family::IPV6`]. `addr` holds the address
/// bytes in network order, in memory order: the words are typed `u32` only so the
/// program copies them from the packet with word loads and stores (the BPF
/// backend turns byte arrays into byte-by-byte code). Read as bytes, `addr` is the
/// address; an IPv4 address is the first 4 bytes and the other 12 are zero (not
/// v4-mapped: the program copies the word straight from the header). There is no
/// padding: the kernel hashes every byte of a key.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointKey {
    pub family: u32,
    pub addr: [u32; 4],
}

impl EndpointKey {
    /// The key of an IPv4 address given as it sits in a packet header: its 4
    /// bytes in network order, read as one native word.
    #[inline(always)]
    pub const fn v4_word(word: u32) -> Self {
        Self {
            family: family::IPV4,
            addr: [word, 0, 0, 0],
        }
    }

    /// The key of an IPv6 address given as it sits in a packet header, read as
    /// four native words.
    #[inline(always)]
    pub const fn v6_words(words: [u32; 4]) -> Self {
        Self {
            family: family::IPV6,
            addr: words,
        }
    }

    /// The key of an IPv4 address.
    pub const fn v4(octets: [u8; 4]) -> Self {
        Self::v4_word(u32::from_ne_bytes(octets))
    }

    /// The key of an IPv6 address.
    pub const fn v6(octets: [u8; 16]) -> Self {
        let o = octets;
        Self::v6_words([
            u32::from_ne_bytes([o[0], o[1], o[2], o[3]]),
            u32::from_ne_bytes([o[4], o[5], o[6], o[7]]),
            u32::from_ne_bytes([o[8], o[9], o[10], o[11]]),
            u32::from_ne_bytes([o[12], o[13], o[14], o[15]]),
        ])
    }

    /// The 16 bytes of `addr`, as they are in memory.
    pub const fn octets(&self) -> [u8; 16] {
        let [a, b, c, d] = [
            self.addr[0].to_ne_bytes(),
            self.addr[1].to_ne_bytes(),
            self.addr[2].to_ne_bytes(),
            self.addr[3].to_ne_bytes(),
        ];
        [
            a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3], c[0], c[1], c[2], c[3], d[0], d[1],
            d[2], d[3],
        ]
    }

    /// The address, or `None` if the key is not well formed (unknown family, or
    /// an IPv4 key with non-zero trailing bytes): such a key was not written by
    /// census.
    pub fn ip(&self) -> Option<IpAddr> {
        let o = self.octets();
        match self.family {
            family::IPV4 if self.addr[1..] == [0; 3] => {
                Some(IpAddr::V4(Ipv4Addr::new(o[0], o[1], o[2], o[3])))
            }
            family::IPV6 => Some(IpAddr::V6(Ipv6Addr::from(o))),
            _ => None,
        }
    }
}

impl From<IpAddr> for EndpointKey {
    fn from(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(v4) => Self::v4(v4.octets()),
            IpAddr::V6(v6) => Self::v6(v6.octets()),
        }
    }
}

/// Flags of an [`EndpointValue`].
pub mod flags {
    /// The endpoint runs on this node and census's program is attached to the
    /// host side of its interface: its packets are counted when they leave it.
    pub const LOCAL: u16 = 1 << 0;
    /// The endpoint runs on another node, [`EndpointValue::node`] (a pod, or the
    /// node's own address): its packets were counted when they left it, on that
    /// node.
    pub const REMOTE: u16 = 1 << 1;
    /// The address is one of this node's own; its identity is
    /// [`identity::HOST`](super::identity::HOST).
    pub const HOST: u16 = 1 << 2;
    /// Every flag this layout defines.
    pub const ALL: u16 = LOCAL | REMOTE | HOST;
}

/// What census knows about an address, the value of [`ENDPOINTS_MAP`].
///
/// `node` is the index of the node a [`flags::REMOTE`] endpoint is on (a key of
/// [`NODES_MAP`]), 0 for every other entry.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EndpointValue {
    pub identity: u32,
    pub flags: u16,
    pub node: u16,
}

impl EndpointValue {
    /// Whether the endpoint is on this node behind an interface census counts on.
    #[inline(always)]
    pub const fn is_local(&self) -> bool {
        self.flags & flags::LOCAL != 0
    }

    /// Whether the endpoint is on another node.
    #[inline(always)]
    pub const fn is_remote(&self) -> bool {
        self.flags & flags::REMOTE != 0
    }

    /// The value of layouts 2 and 3 (`identity: u32, flags: u32`) in this
    /// layout: the same identity and flags (layout 3 defined only the low three
    /// bits), no node (those layouts had none).
    pub const fn from_layout3(identity: u32, flags: u32) -> Self {
        Self {
            identity,
            flags: (flags & 0xffff) as u16,
            node: 0,
        }
    }
}

/// One node of the cluster, the value of [`NODES_MAP`]: its name (the first
/// `name_len` bytes of `name`, UTF-8) and its addresses (the first
/// `address_count` of `addresses`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NodeValue {
    pub name_len: u16,
    pub address_count: u16,
    /// [`NODE_NAME_MAX`] bytes and 3 of padding, zeroed.
    pub name: [u8; NODE_NAME_MAX + 3],
    pub addresses: [EndpointKey; NODE_ADDRESSES_MAX],
}

impl NodeValue {
    /// A node without name or address (every byte zero).
    pub const EMPTY: Self = Self {
        name_len: 0,
        address_count: 0,
        name: [0; NODE_NAME_MAX + 3],
        addresses: [EndpointKey {
            family: 0,
            addr: [0; 4],
        }; NODE_ADDRESSES_MAX],
    };

    /// The name's bytes (clamped to the array).
    pub fn name_bytes(&self) -> &[u8] {
        let len = usize::from(self.name_len).min(NODE_NAME_MAX);
        &self.name[..len]
    }

    /// The addresses' keys (clamped to the array).
    pub fn address_keys(&self) -> &[EndpointKey] {
        let count = usize::from(self.address_count).min(NODE_ADDRESSES_MAX);
        &self.addresses[..count]
    }
}

/// The slot of [`INTERFACES_MAP`] that belongs to interface `ifindex`.
#[inline(always)]
pub const fn interface_slot(ifindex: u32) -> u32 {
    ifindex % INTERFACES_MAX_ENTRIES
}

/// One slot of [`INTERFACES_MAP`]: an interface census's programs are attached to
/// (both hooks), and the endpoint behind it.
///
/// `ifindex` 0 is an empty slot (no interface has index 0). A slot answers only for
/// the interface it names, so a slot never speaks for another interface that
/// shares it. `identity` is the identity every endpoint behind the interface holds,
/// or [`identity::INVALID`] when there is no such single identity (an endpoint
/// still waiting for one, or endpoints of different identities behind one
/// interface): the program then looks the packet's address up in ENDPOINTS, but
/// still knows the packet was counted when it left this interface.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct InterfaceValue {
    pub ifindex: u32,
    pub identity: u32,
}

impl InterfaceValue {
    /// An empty slot.
    pub const EMPTY: Self = Self {
        ifindex: 0,
        identity: identity::INVALID,
    };

    /// Whether this slot holds the entry of interface `ifindex`.
    #[inline(always)]
    pub const fn is_for(&self, ifindex: u32) -> bool {
        ifindex != 0 && self.ifindex == ifindex
    }
}

/// A pair of identities, the key of [`FLOWS_MAP`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FlowKey {
    pub src_identity: u32,
    pub dst_identity: u32,
}

/// Which way a Service counter's packets went.
pub mod service_direction {
    /// From the client to the Service address (the root cgroup's egress).
    pub const REQUEST: u8 = 1;
    /// From the Service address back to the client (the root cgroup's ingress).
    pub const REPLY: u8 = 2;
}

/// The key of [`SERVICE_FLOWS4_MAP`]: a client, the Service address and port it
/// dialled (as the socket layer sees them, before DNAT and after its reversal),
/// the IP protocol, and which way ([`service_direction`]).
///
/// `service` is the address as it sits in the packet (network order), read as a
/// native word, as [`EndpointKey::v4_word`] takes it. `port` is in host order; 0
/// when the packet carries none (neither TCP nor UDP, a fragment without its
/// transport header). `client_identity` is [`identity::HOST`] for the node's own
/// (host-network) sockets.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceFlowKey4 {
    pub client_identity: u32,
    pub port: u16,
    pub protocol: u8,
    pub direction: u8,
    pub service: u32,
}

/// The key of [`SERVICE_FLOWS6_MAP`]: [`ServiceFlowKey4`] of an IPv6 Service
/// address (its four words as they sit in the packet, as
/// [`EndpointKey::v6_words`] takes them).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceFlowKey6 {
    pub client_identity: u32,
    pub port: u16,
    pub protocol: u8,
    pub direction: u8,
    pub service: [u32; 4],
}

/// The key of layouts 6 and 7's [`SERVICE_FLOWS_LAYOUT7_MAP`]: as
/// [`ServiceFlowKey4`] and [`ServiceFlowKey6`], the address an [`EndpointKey`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceFlowKeyLayout7 {
    pub client_identity: u32,
    pub port: u16,
    pub protocol: u8,
    pub direction: u8,
    pub service: EndpointKey,
}

/// An entry of [`CLIENTS_MAP`]: the client of `address` (the address of a Service
/// packet's socket: a request's source, a reply's destination), as found in
/// ENDPOINTS while [`CLIENTS_EPOCH_MAP`] read an epoch. `stamp` is one 8-byte word,
/// written and read whole: the client in its low 32 bits, and in its high 32 the
/// epoch's low 32 bits XOR the address's hash (`filter::Probe::hash`)
/// ([`ClientCache::stamp`]). The entry is shared by every CPU and written without a
/// lock, so a reader can meet one writer's stamp beside another's address; the hash
/// in the stamp refuses that pair, since two addresses of one family have one hash
/// only if they fold to one 32-bit word (never two IPv4 addresses). The client is
/// [`identity::INVALID`] for an address whose Service packets this node does not
/// count (another node's pod, an unknown address). A new entry is zeroed: no
/// address has family 0, so it matches nothing.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientCache {
    pub stamp: u64,
    pub address: EndpointKey,
    pub pad: u32,
}

impl ClientCache {
    /// The [`CLIENTS_MAP`] entry of an address of hash `hash`.
    #[inline(always)]
    pub const fn slot(hash: u32) -> u32 {
        hash >> (32 - CLIENTS_LG)
    }

    /// The stamp of `client`, read in `epoch` for an address of hash `hash`.
    #[inline(always)]
    #[expect(
        clippy::cast_possible_truncation,
        reason = "the epoch's low 32 bits are what a stamp keeps"
    )]
    pub const fn stamp(epoch: u64, hash: u32, client: u32) -> u64 {
        (((epoch as u32) ^ hash) as u64) << 32 | client as u64
    }

    /// The client of a stamp.
    #[inline(always)]
    #[expect(
        clippy::cast_possible_truncation,
        reason = "the client is the stamp's low 32 bits"
    )]
    pub const fn client(stamp: u64) -> u32 {
        stamp as u32
    }

    /// Whether `stamp` was made in `epoch` for an address of hash `hash` (a stale
    /// entry is taken for a current one only after exactly 2^32 ENDPOINTS writes).
    #[inline(always)]
    #[expect(
        clippy::cast_possible_truncation,
        reason = "the epoch's low 32 bits are what a stamp keeps"
    )]
    pub const fn is_of(stamp: u64, epoch: u64, hash: u32) -> bool {
        (stamp >> 32) as u32 == (epoch as u32) ^ hash
    }
}

/// Counters of one identity pair on one CPU, the value of [`FLOWS_MAP`] (and of
/// one Service key, in the same units, in [`SERVICE_FLOWS4_MAP`] and
/// [`SERVICE_FLOWS6_MAP`]).
///
/// `packets` counts GSO segments (a GSO packet of 10 segments counts 10).
/// `bytes` counts the link-layer bytes of every segment: `skb->len`, Ethernet
/// header included, plus, for a GSO packet, the headers each further segment
/// repeats, `(gso_segs - 1) * (Ethernet + IP + TCP or UDP header)`, as the
/// kernel's qdiscs and a NIC's counters count them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowValue {
    pub packets: u64,
    pub bytes: u64,
}

const _: () = {
    assert!(size_of::<EndpointKey>() == 20);
    assert!(align_of::<EndpointKey>() == 4);
    assert!(core::mem::offset_of!(EndpointKey, addr) == 4);
    assert!(size_of::<[u32; 4]>() == 16);
    assert!(size_of::<EndpointValue>() == 8);
    assert!(core::mem::offset_of!(EndpointValue, flags) == 4);
    assert!(core::mem::offset_of!(EndpointValue, node) == 6);
    assert!(size_of::<NodeValue>() == 4 + 256 + 16 * 20);
    assert!(align_of::<NodeValue>() == 4);
    assert!(core::mem::offset_of!(NodeValue, name) == 4);
    assert!(core::mem::offset_of!(NodeValue, addresses) == 260);
    assert!(NODES_MAX_ENTRIES <= u16::MAX as u32);
    assert!(size_of::<InterfaceValue>() == 8);
    assert!(INTERFACES_MAX_ENTRIES.is_power_of_two());
    assert!(stats::ALL.len() <= STATS_MAX_ENTRIES as usize);
    assert!(size_of::<FlowKey>() == 8);
    assert!(size_of::<ServiceKey>() == 24);
    assert!(core::mem::offset_of!(ServiceKey, address) == 4);
    assert!(size_of::<FlowValue>() == 16);
    assert!(size_of::<ServiceFlowKey4>() == 12);
    assert!(size_of::<ServiceFlowKey6>() == 24);
    assert!(align_of::<ServiceFlowKey6>() == 4);
    assert!(core::mem::offset_of!(ServiceFlowKey6, service) == 8);
    assert!(size_of::<ServiceFlowKeyLayout7>() == 28);
    assert!(align_of::<ServiceFlowKeyLayout7>() == 4);
    assert!(core::mem::offset_of!(ServiceFlowKeyLayout7, service) == 8);
    assert!(size_of::<ClientCache>() == 32);
    assert!(core::mem::offset_of!(ClientCache, address) == 8);
    assert!(align_of::<FlowValue>() == 8);
    assert!(size_of::<filter::AddressFilter>() == 16 + 4 * 8 + 4 * 32 + 1024 + 512);
};

#[cfg(feature = "user")]
mod user {
    use super::{
        EndpointKey, EndpointValue, FlowKey, FlowValue, InterfaceValue, NodeValue, ServiceFlowKey4,
        ServiceFlowKey6, ServiceFlowKeyLayout7, ServiceKey,
    };

    // SAFETY: `#[repr(C)]`, only integer fields, no implicit padding (the sizes are
    // asserted above), so every bit pattern is a valid value and every byte is
    // initialized.
    unsafe impl aya::Pod for EndpointKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for EndpointValue {}
    // SAFETY: as above.
    unsafe impl aya::Pod for FlowKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for FlowValue {}
    // SAFETY: as above.
    unsafe impl aya::Pod for InterfaceValue {}
    // SAFETY: as above (the name's padding is part of the array).
    unsafe impl aya::Pod for NodeValue {}
    // SAFETY: as above.
    unsafe impl aya::Pod for ServiceKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for ServiceFlowKey4 {}
    // SAFETY: as above.
    unsafe impl aya::Pod for ServiceFlowKey6 {}
    // SAFETY: as above.
    unsafe impl aya::Pod for ServiceFlowKeyLayout7 {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::filter::AddressFilter {}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stamp gives back its client, and is of its epoch and its address's hash
    /// only (by the epoch's low 32 bits), the highest client and a wrapped epoch
    /// included.
    #[test]
    fn a_client_stamp_holds_its_client_its_epoch_and_its_address() {
        for (epoch, hash, client) in [
            (0, 0, 0),
            (1, 0x9e37_79b1, 1000),
            (u64::from(u32::MAX), u32::MAX, u32::MAX),
            (7 << 32 | 5, 12345, 42),
        ] {
            let stamp = ClientCache::stamp(epoch, hash, client);
            assert_eq!(ClientCache::client(stamp), client);
            assert!(ClientCache::is_of(stamp, epoch, hash));
            assert!(!ClientCache::is_of(stamp, epoch + 1, hash));
            assert!(!ClientCache::is_of(stamp, epoch, hash ^ 1));
            assert!(
                ClientCache::is_of(stamp, epoch + (1 << 32), hash),
                "only the low 32 bits"
            );
        }
        let fresh = 0;
        assert!(ClientCache::is_of(fresh, 0, 0), "a new entry's stamp");
        assert_ne!(
            EndpointKey::v4([0; 4]).family,
            0,
            "but no address matches a new entry's zeroed address"
        );
    }

    /// Two IPv4 addresses never have one hash, so a stamp written for one is
    /// refused beside the other, whichever entry they share: every address of a
    /// /16, and addresses far apart.
    #[test]
    fn a_stamp_for_one_ipv4_address_is_refused_beside_another() {
        extern crate std;
        use crate::filter::Probe;
        use std::collections::{HashMap, HashSet};
        let hash = |octets: [u8; 4]| EndpointKey::v4(octets).hash();
        let mut seen = HashMap::new();
        for i in 0..=u16::MAX {
            let [a, b] = i.to_be_bytes();
            let octets = [10, 244, a, b];
            if let Some(other) = seen.insert(hash(octets), octets) {
                panic!("{other:?} and {octets:?} have one hash");
            }
        }
        for (x, y) in [
            ([10, 0, 0, 1], [10, 0, 0, 2]),
            ([198, 18, 0, 1], [203, 0, 113, 9]),
            ([0, 0, 0, 0], [255, 255, 255, 255]),
        ] {
            let stamp = ClientCache::stamp(3, hash(x), 1000);
            assert!(ClientCache::is_of(stamp, 3, hash(x)));
            assert!(!ClientCache::is_of(stamp, 3, hash(y)), "{x:?} beside {y:?}");
        }
        // The entries of a node's pods spread: 110 of one /24 take 110 entries.
        for prefix in [[10, 244, 7], [10, 0, 3], [192, 168, 1]] {
            let slots: HashSet<u32> = (1..=110)
                .map(|i| ClientCache::slot(hash([prefix[0], prefix[1], prefix[2], i])))
                .collect();
            assert_eq!(slots.len(), 110, "entries for 110 pods of {prefix:?}.0/24");
            assert!(slots.iter().all(|slot| *slot < CLIENTS_MAX_ENTRIES));
        }
    }

    #[test]
    fn v4_keys_round_trip_and_zero_the_tail() {
        let ip: IpAddr = Ipv4Addr::new(198, 18, 0, 7).into();
        let key = EndpointKey::from(ip);
        assert_eq!(key.family, family::IPV4);
        assert_eq!(&key.octets()[..4], &[198, 18, 0, 7]);
        assert_eq!(&key.octets()[4..], &[0; 12]);
        assert_eq!(key.ip(), Some(ip));
    }

    #[test]
    fn v6_keys_round_trip() {
        let ip: IpAddr = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 7).into();
        assert_eq!(EndpointKey::from(ip).ip(), Some(ip));
    }

    #[test]
    fn a_slot_answers_only_for_its_interface() {
        let slot = InterfaceValue {
            ifindex: 7,
            identity: 4711,
        };
        assert!(slot.is_for(7));
        assert!(
            !slot.is_for(7 + INTERFACES_MAX_ENTRIES),
            "shares the slot, not the entry"
        );
        assert_eq!(
            interface_slot(7),
            interface_slot(7 + INTERFACES_MAX_ENTRIES)
        );
        assert!(
            !InterfaceValue::EMPTY.is_for(0),
            "no packet matches an empty slot"
        );
    }

    #[test]
    fn stats_slots_are_distinct_and_in_the_map() {
        for (i, slot) in stats::ALL.iter().enumerate() {
            assert!(*slot < STATS_MAX_ENTRIES, "{slot}");
            assert!(!stats::ALL[..i].contains(slot), "{slot} twice");
        }
    }

    #[test]
    fn layout3_values_keep_identity_and_flags_without_a_node() {
        let value = EndpointValue::from_layout3(4711, u32::from(flags::LOCAL));
        assert_eq!(
            value,
            EndpointValue {
                identity: 4711,
                flags: flags::LOCAL,
                node: 0
            }
        );
        // On a little-endian machine the old bytes read as the new value.
        let old = [4711u32.to_le_bytes(), u32::from(flags::HOST).to_le_bytes()].concat();
        let new = EndpointValue::from_layout3(4711, u32::from(flags::HOST));
        assert_eq!(&old[4..6], &new.flags.to_le_bytes());
        assert_eq!(&old[6..8], &new.node.to_le_bytes());
    }

    #[test]
    fn node_values_clamp_their_lengths() {
        let mut node = NodeValue::EMPTY;
        node.name[..2].copy_from_slice(b"n1");
        node.name_len = 2;
        assert_eq!(node.name_bytes(), b"n1");
        node.name_len = u16::MAX;
        assert_eq!(node.name_bytes().len(), NODE_NAME_MAX);
        node.address_count = u16::MAX;
        assert_eq!(node.address_keys().len(), NODE_ADDRESSES_MAX);
    }

    #[test]
    fn malformed_keys_have_no_address() {
        let mut key = EndpointKey::v4([1, 2, 3, 4]);
        key.addr[3] = 1;
        assert_eq!(key.ip(), None);
        let mut key = EndpointKey::v4([1, 2, 3, 4]);
        key.family = 5;
        assert_eq!(key.ip(), None);
    }
}
