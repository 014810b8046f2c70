//! Domain types shared by agent and operator: identities, id ranges, node names,
//! endpoint keys, sessions, endpoints and the cluster's Service addresses. Values of these types are valid by
//! construction; the wire edge ([`crate::convert`]) builds them or says precisely why not.

use std::{collections::BTreeMap, fmt, net::IpAddr, ops::RangeInclusive, str::FromStr};

use ipnet::IpNet;

use serde::{Deserialize, Serialize};

use crate::labels::{LabelSet, syntax as syntax_helpers};

/// A numeric security identity. 0 is invalid; 1..=255 are reserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct IdentityId(u32);

impl IdentityId {
    /// Traffic from or to this node's own addresses.
    pub const HOST: Self = Self(1);
    /// Any address census does not know.
    pub const WORLD: Self = Self(2);
    /// An endpoint census does not manage.
    pub const UNMANAGED: Self = Self(3);
    /// Health-check endpoints.
    pub const HEALTH: Self = Self(4);
    /// The addresses of other nodes of the cluster.
    pub const REMOTE_NODE: Self = Self(6);
    /// The highest reserved id.
    pub const RESERVED_MAX: u32 = 255;

    /// `None` for 0.
    pub const fn new(id: u32) -> Option<Self> {
        if id == 0 { None } else { Some(Self(id)) }
    }

    pub const fn get(self) -> u32 {
        self.0
    }

    pub const fn is_reserved(self) -> bool {
        self.0 <= Self::RESERVED_MAX
    }

    /// The name of a reserved identity that has one.
    pub const fn reserved_name(self) -> Option<&'static str> {
        match self.0 {
            1 => Some("host"),
            2 => Some("world"),
            3 => Some("unmanaged"),
            4 => Some("health"),
            6 => Some("remote-node"),
            _ => None,
        }
    }
}

impl fmt::Display for IdentityId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The range cluster-local identities are allocated from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdRange {
    first: u32,
    last: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdRangeError {
    #[error("id range {0:?}: expected FIRST-LAST, e.g. 256-65535")]
    Syntax(String),
    #[error("id range {first}-{last}: the first id must be above the reserved ids (1-255)")]
    OverlapsReserved { first: u32, last: u32 },
    #[error("id range {first}-{last} is empty")]
    Empty { first: u32, last: u32 },
}

impl IdRange {
    pub fn new(first: u32, last: u32) -> Result<Self, IdRangeError> {
        if first <= IdentityId::RESERVED_MAX {
            return Err(IdRangeError::OverlapsReserved { first, last });
        }
        if first > last {
            return Err(IdRangeError::Empty { first, last });
        }
        Ok(Self { first, last })
    }

    pub fn first(&self) -> IdentityId {
        IdentityId(self.first)
    }

    pub fn last(&self) -> IdentityId {
        IdentityId(self.last)
    }

    pub fn contains(&self, id: IdentityId) -> bool {
        (self.first..=self.last).contains(&id.0)
    }

    /// Number of ids in the range.
    pub fn size(&self) -> u64 {
        u64::from(self.last - self.first) + 1
    }

    pub fn ids(&self) -> RangeInclusive<u32> {
        self.first..=self.last
    }

    /// The id after `id`, wrapping to the start of the range.
    pub fn next_after(&self, id: u32) -> IdentityId {
        if id >= self.last || id < self.first {
            IdentityId(self.first)
        } else {
            IdentityId(id + 1)
        }
    }
}

impl Default for IdRange {
    fn default() -> Self {
        Self {
            first: 256,
            last: 65535,
        }
    }
}

impl FromStr for IdRange {
    type Err = IdRangeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (a, b) = s
            .split_once("..=")
            .or_else(|| s.split_once('-'))
            .ok_or_else(|| IdRangeError::Syntax(s.to_owned()))?;
        let first = a
            .trim()
            .parse()
            .map_err(|_| IdRangeError::Syntax(s.to_owned()))?;
        let last = b
            .trim()
            .parse()
            .map_err(|_| IdRangeError::Syntax(s.to_owned()))?;
        Self::new(first, last)
    }
}

impl fmt::Display for IdRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.first, self.last)
    }
}

/// Why a node name or endpoint key was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error(
        "node name {0:?} is not a DNS subdomain (lowercase `a-z0-9-.`, at most 253 characters)"
    )]
    Node(String),
    #[error("namespace {0:?} is not a DNS label (lowercase `a-z0-9-`, at most 63 characters)")]
    Namespace(String),
    #[error(
        "endpoint name {0:?} is not a DNS subdomain (lowercase `a-z0-9-.`, at most 253 characters)"
    )]
    Endpoint(String),
    #[error("endpoint key {0:?}: expected NAMESPACE/NAME")]
    Key(String),
}

/// A rejected name, bounded for its error.
fn clip(s: &str) -> String {
    crate::text::cut(s, 300).into_owned()
}

/// A Kubernetes node name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct NodeName(Box<str>);

impl NodeName {
    pub fn new(name: &str) -> Result<Self, NameError> {
        if syntax_helpers::is_dns_subdomain(name) {
            Ok(Self(name.into()))
        } else {
            Err(NameError::Node(clip(name)))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for NodeName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for NodeName {
    type Err = NameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl TryFrom<String> for NodeName {
    type Error = NameError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        Self::new(&s)
    }
}

impl From<NodeName> for String {
    fn from(n: NodeName) -> Self {
        n.0.into()
    }
}

/// An endpoint's key, `namespace/name`: stable across the pod's restarts and never a UID,
/// so state keyed by it is bounded by the endpoints that exist.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct EndpointKey(Box<str>);

impl EndpointKey {
    pub fn new(namespace: &str, name: &str) -> Result<Self, NameError> {
        if !syntax_helpers::is_dns_label(namespace) {
            return Err(NameError::Namespace(clip(namespace)));
        }
        if !syntax_helpers::is_dns_subdomain(name) {
            return Err(NameError::Endpoint(clip(name)));
        }
        let mut key = String::with_capacity(namespace.len() + 1 + name.len());
        key.push_str(namespace);
        key.push('/');
        key.push_str(name);
        Ok(Self(key.into_boxed_str()))
    }

    pub fn namespace(&self) -> &str {
        self.0.split_once('/').map_or("", |(ns, _)| ns)
    }

    pub fn name(&self) -> &str {
        self.0.split_once('/').map_or(&*self.0, |(_, name)| name)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for EndpointKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for EndpointKey {
    type Err = NameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (ns, name) = s.split_once('/').ok_or_else(|| NameError::Key(clip(s)))?;
        Self::new(ns, name)
    }
}

impl TryFrom<String> for EndpointKey {
    type Error = NameError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<EndpointKey> for String {
    fn from(k: EndpointKey) -> Self {
        k.0.into()
    }
}

/// An agent's session, one per agent process: (start time in ns, random). Ordered by
/// start time, so a newer agent's Hello replaces an older one's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct SessionId {
    pub start_time_ns: u64,
    pub nonce: u64,
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{:016x}", self.start_time_ns, self.nonce)
    }
}

/// An agent's number for one of its allocations, counted from 1 in each session;
/// every retry of one allocation carries the same number. The hold an answer adds
/// records it, and a snapshot that says every allocation up to some number has
/// settled ends the holds of those ([`AllocationId::NONE`]: not numbered, or none
/// settled).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct AllocationId(u64);

impl AllocationId {
    /// Not numbered (an agent that numbers no allocation), or none settled.
    pub const NONE: Self = Self(0);

    pub const fn new(n: u64) -> Self {
        Self(n)
    }

    pub const fn get(self) -> u64 {
        self.0
    }

    /// The number after this one.
    pub const fn next(self) -> Self {
        Self(self.0 + 1)
    }

    /// Whether this is a number at all.
    pub const fn is_some(self) -> bool {
        self.0 != 0
    }
}

/// One endpoint as an agent holds it: its key, addresses, the identity it has written
/// and its canonical identity labels.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    pub key: EndpointKey,
    /// IPv4-mapped IPv6 addresses as IPv4, sorted, without duplicates
    /// ([`canonical_ips`]).
    pub ips: Box<[IpAddr]>,
    pub identity: IdentityId,
    pub labels: LabelSet,
}

/// An endpoint's addresses as census keys them: an IPv4-mapped IPv6 address
/// (`::ffff:a.b.c.d`) is the IPv4 address it maps (one address, one key, in the
/// operator's map as in ENDPOINTS), sorted and deduplicated. Every endpoint source
/// (the wire, the agent's file and pods) goes through here.
pub fn canonical_ips(mut ips: Vec<IpAddr>) -> Box<[IpAddr]> {
    for ip in &mut ips {
        *ip = ip.to_canonical();
    }
    ips.sort_unstable();
    ips.dedup();
    ips.into_boxed_slice()
}

/// What an address is that no endpoint, and no node, can have as its own: traffic
/// between pods and nodes is never from or to one of these, and an ENDPOINTS entry
/// for one would be wrong for every node. Pod and node addresses are unicast,
/// routable and specific: a private range, the benchmarking range 198.18.0.0/15,
/// a documentation range and unique local IPv6 addresses all are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum UnusableIp {
    #[error("the unspecified address")]
    Unspecified,
    #[error("an address of \"this network\" (0.0.0.0/8)")]
    ThisNetwork,
    #[error("the broadcast address")]
    Broadcast,
    #[error("a loopback address")]
    Loopback,
    #[error("a multicast address")]
    Multicast,
    #[error("a link-local address")]
    LinkLocal,
}

impl UnusableIp {
    /// A bounded label for metrics.
    pub const fn kind(self) -> &'static str {
        match self {
            Self::Unspecified => "unspecified",
            Self::ThisNetwork => "this_network",
            Self::Broadcast => "broadcast",
            Self::Loopback => "loopback",
            Self::Multicast => "multicast",
            Self::LinkLocal => "link_local",
        }
    }
}

/// `Err` naming what `ip` is when no endpoint or node can have it (IPv4-mapped IPv6
/// judged as its IPv4 address).
pub fn check_usable_ip(ip: IpAddr) -> Result<(), UnusableIp> {
    let unusable = match ip.to_canonical() {
        IpAddr::V4(v4) if v4.is_unspecified() => Some(UnusableIp::Unspecified),
        IpAddr::V4(v4) if v4.octets()[0] == 0 => Some(UnusableIp::ThisNetwork),
        IpAddr::V4(v4) if v4.is_broadcast() => Some(UnusableIp::Broadcast),
        IpAddr::V4(v4) if v4.is_loopback() => Some(UnusableIp::Loopback),
        IpAddr::V4(v4) if v4.is_multicast() => Some(UnusableIp::Multicast),
        IpAddr::V4(v4) if v4.is_link_local() => Some(UnusableIp::LinkLocal),
        IpAddr::V4(_) => None,
        IpAddr::V6(v6) if v6.is_unspecified() => Some(UnusableIp::Unspecified),
        IpAddr::V6(v6) if v6.is_loopback() => Some(UnusableIp::Loopback),
        IpAddr::V6(v6) if v6.is_multicast() => Some(UnusableIp::Multicast),
        IpAddr::V6(v6) if v6.is_unicast_link_local() => Some(UnusableIp::LinkLocal),
        IpAddr::V6(_) => None,
    };
    unusable.map_or(Ok(()), Err)
}

/// What a Service address range is (census-common's, shared with the kernel side).
pub use census_common::ServiceKind;

/// One port of a Service: its number and IP protocol (6 TCP, 17 UDP, 132 SCTP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServicePort {
    pub port: u16,
    pub protocol: u8,
}

impl ServicePort {
    /// The IP protocols a Service port can have (`TCP`, `UDP`, `SCTP`).
    pub const PROTOCOLS: [u8; 3] = [6, 17, 132];
}

/// The Service a ClusterIP belongs to: its `namespace/name` and its ports, for
/// naming what SERVICE_FLOWS4/6 counts (the kernel needs the addresses only).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClusterIpService {
    /// `namespace/name`, checked as an endpoint key is.
    pub key: EndpointKey,
    /// Sorted, each once.
    pub ports: Box<[ServicePort]>,
}

impl ClusterIpService {
    /// Ports a Service may list here at most.
    pub const MAX_PORTS: usize = 256;

    /// Whether the Service has `port` with `protocol`.
    pub fn has_port(&self, port: u16, protocol: u8) -> bool {
        self.ports
            .binary_search(&ServicePort { port, protocol })
            .is_ok()
    }
}

/// The cluster's Service addresses: each range once (its host bits clear), with
/// its kind. What the operator sends and what SERVICES holds on every node. It
/// also names the Services by their ClusterIPs (every family), for the agent's
/// userspace only.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct ServiceSet(
    BTreeMap<IpNet, ServiceKind>,
    BTreeMap<IpAddr, ClusterIpService>,
);

impl ServiceSet {
    /// Ranges a set holds at most: what SERVICES holds.
    pub const MAX_RANGES: usize = 65_536;
    /// Named ClusterIPs a set holds at most.
    pub const MAX_CLUSTER_IPS: usize = 65_536;

    /// Names `address` (a ClusterIP, IPv4-mapped read as IPv4) as `service`'s; a
    /// later name for one address replaces the earlier.
    pub fn insert_cluster_ip(&mut self, address: IpAddr, service: ClusterIpService) {
        self.1.insert(address.to_canonical(), service);
    }

    /// The Service whose ClusterIP `address` is, if known.
    pub fn cluster_ip(&self, address: &IpAddr) -> Option<&ClusterIpService> {
        self.1.get(&address.to_canonical())
    }

    /// Keeps the first `ranges` ranges and the first `cluster_ips` named
    /// ClusterIPs, in the set's order.
    pub fn truncate(&mut self, ranges: usize, cluster_ips: usize) {
        if self.0.len() > ranges {
            self.0 = std::mem::take(&mut self.0)
                .into_iter()
                .take(ranges)
                .collect();
        }
        if self.1.len() > cluster_ips {
            self.1 = std::mem::take(&mut self.1)
                .into_iter()
                .take(cluster_ips)
                .collect();
        }
    }

    /// Every named ClusterIP, by address.
    pub fn cluster_ips(&self) -> impl ExactSizeIterator<Item = (&IpAddr, &ClusterIpService)> + '_ {
        self.1.iter()
    }

    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `range` (its host bits cleared) as `kind`. A range already there keeps
    /// the kind that comes first in [`ServiceKind`]'s order, whatever the order of
    /// insertion.
    pub fn insert(&mut self, range: IpNet, kind: ServiceKind) {
        self.0
            .entry(range.trunc())
            .and_modify(|have| *have = (*have).min(kind))
            .or_insert(kind);
    }

    /// The kind of exactly `range`, if the set holds it.
    pub fn get(&self, range: &IpNet) -> Option<ServiceKind> {
        self.0.get(range).copied()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Every range with its kind, IPv4 first, by address then prefix length.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (IpNet, ServiceKind)> + '_ {
        self.0.iter().map(|(range, kind)| (*range, *kind))
    }

    /// What changes from `self` to `newer`: each range added or whose kind
    /// changed with its new kind, each range gone with `None`.
    pub fn changes_to(&self, newer: &ServiceSet) -> BTreeMap<IpNet, Option<ServiceKind>> {
        let gone = self
            .0
            .keys()
            .filter(|range| !newer.0.contains_key(range))
            .map(|range| (*range, None));
        let set = newer
            .iter()
            .filter(|(range, kind)| self.get(range) != Some(*kind))
            .map(|(range, kind)| (range, Some(kind)));
        gone.chain(set).collect()
    }
}

impl FromIterator<(IpNet, ServiceKind)> for ServiceSet {
    fn from_iter<I: IntoIterator<Item = (IpNet, ServiceKind)>>(iter: I) -> Self {
        let mut set = Self::new();
        set.extend(iter);
        set
    }
}

impl Extend<(IpNet, ServiceKind)> for ServiceSet {
    fn extend<I: IntoIterator<Item = (IpNet, ServiceKind)>>(&mut self, iter: I) {
        for (range, kind) in iter {
            self.insert(range, kind);
        }
    }
}

/// Why a text is not a Service range (`--service-cidr`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CidrError {
    #[error("{0:?} is not an IPv4 or IPv6 range in CIDR form (e.g. 10.96.0.0/12)")]
    Syntax(String),
    #[error("{text:?} has bits set past its prefix length (the range is {range})")]
    HostBits { text: String, range: IpNet },
}

/// A range in CIDR form with its host bits clear: `10.96.0.0/12`, `fd00:10:96::/108`.
pub fn parse_cidr(text: &str) -> Result<IpNet, CidrError> {
    let trimmed = text.trim();
    let range: IpNet = trimmed
        .parse()
        .map_err(|_| CidrError::Syntax(clip(trimmed)))?;
    if range.trunc() != range {
        return Err(CidrError::HostBits {
            text: clip(trimmed),
            range: range.trunc(),
        });
    }
    Ok(range)
}

#[cfg(test)]
mod address_tests {
    use super::*;

    #[test]
    fn addresses_no_endpoint_can_have_are_named() {
        for (text, want) in [
            ("0.0.0.0", Err(UnusableIp::Unspecified)),
            ("0.9.9.9", Err(UnusableIp::ThisNetwork)),
            ("::", Err(UnusableIp::Unspecified)),
            ("255.255.255.255", Err(UnusableIp::Broadcast)),
            ("127.0.0.1", Err(UnusableIp::Loopback)),
            ("::1", Err(UnusableIp::Loopback)),
            ("::ffff:127.0.0.1", Err(UnusableIp::Loopback)),
            ("224.0.0.251", Err(UnusableIp::Multicast)),
            ("ff02::1", Err(UnusableIp::Multicast)),
            ("169.254.169.254", Err(UnusableIp::LinkLocal)),
            ("fe80::1", Err(UnusableIp::LinkLocal)),
            ("10.0.0.1", Ok(())),
            ("172.16.0.1", Ok(())),
            ("192.168.1.1", Ok(())),
            ("198.18.0.1", Ok(())),
            ("198.19.255.254", Ok(())),
            ("203.0.113.7", Ok(())),
            ("100.64.0.1", Ok(())),
            ("2001:db8::1", Ok(())),
            ("fd00::1", Ok(())),
            ("::ffff:10.0.0.1", Ok(())),
        ] {
            let ip: IpAddr = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(check_usable_ip(ip), want, "{text}");
        }
    }
}

#[cfg(test)]
mod service_tests {
    use super::*;

    fn net(text: &str) -> IpNet {
        text.parse().unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    #[test]
    fn a_range_is_held_once_with_the_kind_that_comes_first() {
        let mut set = ServiceSet::new();
        set.insert(net("203.0.113.7/32"), ServiceKind::ExternalIp);
        set.insert(net("203.0.113.7/32"), ServiceKind::LoadBalancerIp);
        set.insert(net("203.0.113.7/32"), ServiceKind::ExternalIp);
        // Host bits are cleared: one range, one entry.
        set.insert(net("10.96.3.4/12"), ServiceKind::ClusterIpRange);
        set.insert(net("10.96.0.0/12"), ServiceKind::ClusterIpRange);
        assert_eq!(set.len(), 2);
        assert_eq!(
            set.get(&net("203.0.113.7/32")),
            Some(ServiceKind::LoadBalancerIp)
        );
        assert_eq!(
            set.get(&net("10.96.0.0/12")),
            Some(ServiceKind::ClusterIpRange)
        );
    }

    #[test]
    fn changes_name_every_range_added_changed_or_gone() {
        let old: ServiceSet = [
            (net("10.96.0.0/12"), ServiceKind::ClusterIpRange),
            (net("203.0.113.7/32"), ServiceKind::ExternalIp),
            (net("fd00:10:96::/108"), ServiceKind::ClusterIpRange),
        ]
        .into_iter()
        .collect();
        let new: ServiceSet = [
            (net("10.96.0.0/12"), ServiceKind::ClusterIpRange),
            (net("203.0.113.7/32"), ServiceKind::LoadBalancerIp),
            (net("198.51.100.1/32"), ServiceKind::ExternalIp),
        ]
        .into_iter()
        .collect();
        let changes: Vec<_> = old.changes_to(&new).into_iter().collect();
        assert_eq!(
            changes,
            [
                (net("198.51.100.1/32"), Some(ServiceKind::ExternalIp)),
                (net("203.0.113.7/32"), Some(ServiceKind::LoadBalancerIp)),
                (net("fd00:10:96::/108"), None),
            ]
        );
        assert!(new.changes_to(&new).is_empty());
    }

    #[test]
    fn a_cidr_is_a_range_with_its_host_bits_clear() {
        assert_eq!(parse_cidr(" 10.96.0.0/12"), Ok(net("10.96.0.0/12")));
        assert_eq!(parse_cidr("fd00:10:96::/108"), Ok(net("fd00:10:96::/108")));
        assert_eq!(
            parse_cidr("10.96.3.0/12"),
            Err(CidrError::HostBits {
                text: "10.96.3.0/12".to_owned(),
                range: net("10.96.0.0/12"),
            })
        );
        assert_eq!(
            parse_cidr("10.96.0.0"),
            Err(CidrError::Syntax("10.96.0.0".to_owned()))
        );
        assert_eq!(
            parse_cidr("10.96.0.0/33"),
            Err(CidrError::Syntax("10.96.0.0/33".to_owned()))
        );
        let message = parse_cidr("10.96.3.0/12").map_err(|e| e.to_string());
        assert_eq!(
            message,
            Err(
                "\"10.96.3.0/12\" has bits set past its prefix length (the range is 10.96.0.0/12)"
                    .to_owned()
            )
        );
    }
}
