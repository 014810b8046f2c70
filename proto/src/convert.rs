//! Wire <-> domain conversions. Every conversion from the wire validates completely
//! and, when it refuses, names the field and the problem, so the caller can answer
//! without touching state.
//!
//! A message malformed as a whole is refused with a [`FieldError`] naming the field
//! (`snapshot.endpoints`, `upsert.endpoint`): the caller answers INVALID_ARGUMENT. An
//! entry of a snapshot or delta that fails validation is [`Rejected`] alone, named by
//! its key as sent and the field within it (`labels[1]`), and the rest of the
//! message stands. No entry is ever too broken to be named: a proto3 string is
//! UTF-8 (a message that is not fails to decode and ends the stream before it gets
//! here), and an invalid key is echoed as sent, cut to a bounded length.

use std::{collections::HashSet, fmt, net::IpAddr};

use ipnet::IpNet;

use crate::{
    PROTOCOL_VERSION,
    domain::{
        ClusterIpService, Endpoint, EndpointKey, IdentityId, NameError, NodeName, ServiceKind,
        ServicePort, ServiceSet, SessionId, UnusableIp, canonical_ips, check_usable_ip,
    },
    labels::{LabelError, LabelFilter, LabelLimits, LabelSet, PatternError},
    pb,
};

/// Limits applied while converting from the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireLimits {
    pub labels: LabelLimits,
    pub max_ips_per_endpoint: usize,
    pub max_snapshot_endpoints: usize,
}

impl Default for WireLimits {
    fn default() -> Self {
        Self {
            labels: LabelLimits::default(),
            max_ips_per_endpoint: 16,
            max_snapshot_endpoints: 10_000,
        }
    }
}

/// A protocol version other than ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "protocol version mismatch: the peer speaks version {theirs}, this side speaks version {ours}{hint}",
    hint = if *theirs == 0 { " (protocol_version is unset)" } else { "" }
)]
pub struct VersionMismatch {
    pub theirs: u32,
    pub ours: u32,
}

pub fn check_version(theirs: u32) -> Result<(), VersionMismatch> {
    if theirs == PROTOCOL_VERSION {
        Ok(())
    } else {
        Err(VersionMismatch {
            theirs,
            ours: PROTOCOL_VERSION,
        })
    }
}

/// What is wrong with a field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Problem {
    #[error("is required")]
    Missing,
    #[error(transparent)]
    Label(#[from] LabelError),
    #[error(transparent)]
    Name(#[from] NameError),
    #[error(transparent)]
    Pattern(#[from] PatternError),
    #[error("{0:?} is not an IPv4 or IPv6 address")]
    Ip(String),
    /// An address no endpoint or node can have (loopback, multicast, ...).
    #[error("{ip} is {what}: no endpoint has it")]
    UnusableIp { ip: IpAddr, what: UnusableIp },
    #[error("must not be 0")]
    Zero,
    #[error("has {count} entries, over the limit of {max}")]
    TooMany { count: usize, max: usize },
    /// The label set is valid but the operator's label filter leaves it invalid.
    #[error("after the label filter: {0}")]
    Filtered(LabelError),
    #[error(transparent)]
    ServiceRange(#[from] ServiceRangeError),
    #[error(transparent)]
    ClusterIp(#[from] ClusterIpError),
}

/// Why a `ClusterIp` of the wire is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClusterIpError {
    #[error("address of {0} bytes (neither 4 nor 16)")]
    AddressLength(usize),
    #[error("{address}: {source}")]
    Name { address: IpAddr, source: NameError },
    #[error("{address}: port {port} is not 1 to 65,535")]
    Port { address: IpAddr, port: u32 },
    #[error("{address}: protocol {protocol} is none of TCP (6), UDP (17), SCTP (132)")]
    Protocol { address: IpAddr, protocol: u32 },
    #[error("{address}: {count} ports, over the limit of {max}")]
    TooManyPorts {
        address: IpAddr,
        count: usize,
        max: usize,
    },
}

/// Why a `ServiceRange` of the wire is refused; each names the range as far as it
/// can be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ServiceRangeError {
    #[error("address of {len} bytes (neither 4 nor 16), prefix length {prefix_len}")]
    AddressLength { len: usize, prefix_len: u32 },
    #[error("{address}/{prefix_len}: prefix length over {max}")]
    PrefixTooLong {
        address: IpAddr,
        prefix_len: u32,
        max: u8,
    },
    #[error("{address}/{prefix_len} has bits set past its prefix length (the range is {range})")]
    HostBits {
        address: IpAddr,
        prefix_len: u32,
        range: IpNet,
    },
    #[error("{range}: kind {kind} is not a ServiceKind census knows")]
    Kind { range: IpNet, kind: i32 },
}

/// A refused field: where, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct FieldError {
    pub field: String,
    pub problem: Problem,
}

impl FieldError {
    pub fn new(field: impl fmt::Display, problem: impl Into<Problem>) -> Self {
        Self {
            field: field.to_string(),
            problem: problem.into(),
        }
    }
}

pub fn node_from_wire(node: &str, field: &str) -> Result<NodeName, FieldError> {
    if node.is_empty() {
        return Err(FieldError::new(field, Problem::Missing));
    }
    NodeName::new(node).map_err(|e| FieldError::new(field, e))
}

pub fn session_from_wire(
    session: Option<&pb::Session>,
    field: &str,
) -> Result<SessionId, FieldError> {
    let session = session.ok_or_else(|| FieldError::new(field, Problem::Missing))?;
    if session.start_time_ns == 0 {
        return Err(FieldError::new(
            format_args!("{field}.start_time_ns"),
            Problem::Zero,
        ));
    }
    Ok(SessionId {
        start_time_ns: session.start_time_ns,
        nonce: session.nonce,
    })
}

/// Addresses a Hello may report (`Hello.addresses`).
pub const MAX_HELLO_ADDRESSES: usize = 16;

/// A node's own addresses as its Hello reports them: at most
/// [`MAX_HELLO_ADDRESSES`], each an IPv4 or IPv6 address (IPv4-mapped IPv6 read as
/// IPv4) that a node can have ([`check_usable_ip`]: not loopback, link-local,
/// multicast, broadcast or unspecified), each once, sorted.
pub fn addresses_from_wire(addresses: &[String], field: &str) -> Result<Vec<IpAddr>, FieldError> {
    if addresses.len() > MAX_HELLO_ADDRESSES {
        return Err(FieldError::new(
            field,
            Problem::TooMany {
                count: addresses.len(),
                max: MAX_HELLO_ADDRESSES,
            },
        ));
    }
    let mut ips = Vec::with_capacity(addresses.len());
    for (i, text) in addresses.iter().enumerate() {
        ips.push(ip_from_wire(text, format_args!("{field}[{i}]"))?);
    }
    Ok(canonical_ips(ips).into_vec())
}

/// One address of an endpoint or a node, as text on the wire: it parses, and an
/// endpoint or a node can have it.
fn ip_from_wire(text: &str, field: impl fmt::Display) -> Result<IpAddr, FieldError> {
    let ip: IpAddr = text.parse().map_err(|_| {
        FieldError::new(&field, Problem::Ip(crate::text::cut(text, 64).into_owned()))
    })?;
    let ip = ip.to_canonical();
    check_usable_ip(ip)
        .map_err(|what| FieldError::new(&field, Problem::UnusableIp { ip, what }))?;
    Ok(ip)
}

pub fn session_to_wire(session: SessionId) -> pb::Session {
    pb::Session {
        start_time_ns: session.start_time_ns,
        nonce: session.nonce,
    }
}

pub fn labels_from_wire(
    labels: &[String],
    limits: &LabelLimits,
    field: &str,
) -> Result<LabelSet, FieldError> {
    LabelSet::parse_indexed(labels, limits).map_err(|(index, e)| match index {
        Some(i) => FieldError::new(format_args!("{field}[{i}]"), e),
        None => FieldError::new(field, e),
    })
}

/// Labels from the wire passed through `filter`, the limit counting the labels it
/// keeps: a label set over `--max-labels` only because of labels the filter drops
/// is allowed. A set the filter leaves empty is [`Problem::Filtered`].
pub fn filtered_labels_from_wire(
    labels: &[String],
    filter: &LabelFilter,
    limits: &LabelLimits,
    field: &str,
) -> Result<LabelSet, FieldError> {
    LabelSet::parse_filtered_indexed(labels, filter, limits).map_err(|(index, e)| match index {
        Some(i) => FieldError::new(format_args!("{field}[{i}]"), e),
        None if matches!(e, LabelError::Empty) && !labels.is_empty() => {
            FieldError::new(field, Problem::Filtered(e))
        }
        None => FieldError::new(field, e),
    })
}

pub fn identity_from_wire(id: u32, field: &str) -> Result<IdentityId, FieldError> {
    IdentityId::new(id).ok_or_else(|| FieldError::new(field, Problem::Zero))
}

/// An endpoint key; `field` names the message part holding it (`delete`), or is
/// empty when the caller names it.
pub fn endpoint_key_from_wire(
    namespace: &str,
    name: &str,
    field: &str,
) -> Result<EndpointKey, FieldError> {
    let sub = |which: &str| {
        if field.is_empty() {
            which.to_owned()
        } else {
            format!("{field}.{which}")
        }
    };
    if namespace.is_empty() {
        return Err(FieldError::new(sub("namespace"), Problem::Missing));
    }
    if name.is_empty() {
        return Err(FieldError::new(sub("name"), Problem::Missing));
    }
    EndpointKey::new(namespace, name).map_err(|e| {
        let which = if matches!(e, NameError::Namespace(_)) {
            "namespace"
        } else {
            "name"
        };
        FieldError::new(sub(which), e)
    })
}

/// The key of an entry as the agent sent it, cut to a bounded length: it names a
/// rejected entry even when it is not a valid [`EndpointKey`].
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SentKey {
    pub namespace: String,
    pub name: String,
}

impl SentKey {
    /// The longest namespace or name echoed back: a valid name's limit.
    const MAX: usize = 253;

    pub fn new(namespace: &str, name: &str) -> Self {
        Self {
            namespace: namespace.chars().take(Self::MAX).collect(),
            name: name.chars().take(Self::MAX).collect(),
        }
    }
}

impl From<&EndpointKey> for SentKey {
    fn from(key: &EndpointKey) -> Self {
        Self::new(key.namespace(), key.name())
    }
}

impl fmt::Display for SentKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Why an entry of a snapshot or delta was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EntryError {
    /// A field of the entry, named relative to it (`labels[0]`, `ips[1]`): the same
    /// text for the same entry whether it came in a snapshot or an upsert, and
    /// wherever it sits in the snapshot.
    #[error(transparent)]
    Field(Box<FieldError>),
    #[error("duplicate endpoint key, first entry kept")]
    Duplicate,
}

/// An entry of a snapshot or delta refused alone; the rest of its message stands.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("endpoint {key}: {error}")]
pub struct Rejected {
    pub key: SentKey,
    pub error: EntryError,
}

impl Rejected {
    /// A bounded label for metrics: what kind of problem, never the text.
    pub fn kind(&self) -> &'static str {
        let problem = match &self.error {
            EntryError::Duplicate => return "duplicate",
            EntryError::Field(e) => &e.problem,
        };
        match problem {
            Problem::Missing | Problem::Name(_) => "key",
            Problem::Ip(_) => "ip",
            Problem::UnusableIp { .. } => "unusable_ip",
            Problem::TooMany { .. } => "too_many_ips",
            Problem::Zero => "identity",
            Problem::Label(LabelError::TooMany { .. }) => "too_many_labels",
            Problem::Label(_) => "labels",
            Problem::Filtered(_) => "labels_after_filter",
            Problem::Pattern(_) | Problem::ServiceRange(_) | Problem::ClusterIp(_) => "other",
        }
    }

    /// The entry as the Ack names it.
    pub fn to_wire(&self) -> pb::RejectedEntry {
        pb::RejectedEntry {
            namespace: self.key.namespace.clone(),
            name: self.key.name.clone(),
            reason: self.error.to_string(),
        }
    }
}

/// One endpoint of a snapshot or upsert: validated completely against `limits`, its
/// labels passed through `filter`. An error names the field relative to the entry.
pub fn endpoint_from_wire(
    ep: &pb::Endpoint,
    limits: &WireLimits,
    filter: &LabelFilter,
) -> Result<Endpoint, Rejected> {
    entry_from_wire(ep, limits, filter).map_err(|e| Rejected {
        key: SentKey::new(&ep.namespace, &ep.name),
        error: EntryError::Field(Box::new(e)),
    })
}

fn entry_from_wire(
    ep: &pb::Endpoint,
    limits: &WireLimits,
    filter: &LabelFilter,
) -> Result<Endpoint, FieldError> {
    let key = endpoint_key_from_wire(&ep.namespace, &ep.name, "")?;
    if ep.ips.len() > limits.max_ips_per_endpoint {
        return Err(FieldError::new(
            "ips",
            Problem::TooMany {
                count: ep.ips.len(),
                max: limits.max_ips_per_endpoint,
            },
        ));
    }
    let mut ips = Vec::with_capacity(ep.ips.len());
    for (i, text) in ep.ips.iter().enumerate() {
        ips.push(ip_from_wire(text, format_args!("ips[{i}]"))?);
    }
    let identity = identity_from_wire(ep.identity, "identity")?;
    let labels = filtered_labels_from_wire(&ep.labels, filter, &limits.labels, "labels")?;
    Ok(Endpoint {
        key,
        ips: canonical_ips(ips),
        identity,
        labels,
    })
}

pub fn endpoint_to_wire(ep: &Endpoint) -> pb::Endpoint {
    pb::Endpoint {
        namespace: ep.key.namespace().to_owned(),
        name: ep.key.name().to_owned(),
        ips: ep.ips.iter().map(ToString::to_string).collect(),
        identity: ep.identity.get(),
        labels: ep.labels.to_strings(),
    }
}

/// The entries of a snapshot or delta: those that passed, and those rejected alone.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Entries {
    pub endpoints: Vec<Endpoint>,
    pub rejected: Vec<Rejected>,
}

/// A snapshot's endpoints. Only the endpoint limit refuses the snapshot as a whole
/// (checked before anything else: nothing of an oversized message is read). Every
/// entry that fails validation is rejected alone; of entries with the same key the
/// first is taken (valid or rejected) and every later one is rejected, so the valid
/// endpoints never repeat a key.
pub fn snapshot_from_wire(
    snapshot: &pb::Snapshot,
    limits: &WireLimits,
    filter: &LabelFilter,
) -> Result<Entries, FieldError> {
    let count = snapshot.endpoints.len();
    if count > limits.max_snapshot_endpoints {
        return Err(FieldError::new(
            "snapshot.endpoints",
            Problem::TooMany {
                count,
                max: limits.max_snapshot_endpoints,
            },
        ));
    }
    let mut seen: HashSet<(&str, &str)> = HashSet::with_capacity(count);
    let mut entries = Entries {
        endpoints: Vec::with_capacity(count),
        rejected: Vec::new(),
    };
    for ep in &snapshot.endpoints {
        if !seen.insert((&ep.namespace, &ep.name)) {
            entries.rejected.push(Rejected {
                key: SentKey::new(&ep.namespace, &ep.name),
                error: EntryError::Duplicate,
            });
            continue;
        }
        match endpoint_from_wire(ep, limits, filter) {
            Ok(ep) => entries.endpoints.push(ep),
            Err(rejected) => entries.rejected.push(rejected),
        }
    }
    Ok(entries)
}

/// An upsert's endpoint, or its rejection. An upsert without its endpoint is
/// malformed as a whole.
pub fn upsert_from_wire(
    upsert: &pb::EndpointUpsert,
    limits: &WireLimits,
    filter: &LabelFilter,
) -> Result<Result<Endpoint, Rejected>, FieldError> {
    let ep = upsert
        .endpoint
        .as_ref()
        .ok_or_else(|| FieldError::new("upsert.endpoint", Problem::Missing))?;
    Ok(endpoint_from_wire(ep, limits, filter))
}

/// A delete's key, or its rejection: a delete is one entry, its key.
pub fn delete_from_wire(delete: &pb::EndpointDelete) -> Result<EndpointKey, Rejected> {
    endpoint_key_from_wire(&delete.namespace, &delete.name, "").map_err(|e| Rejected {
        key: SentKey::new(&delete.namespace, &delete.name),
        error: EntryError::Field(Box::new(e)),
    })
}

/// The keys of endpoints whose identity the operator decides later, as the Ack names them.
pub fn pending_to_wire(keys: &[EndpointKey]) -> Vec<pb::EndpointKey> {
    keys.iter()
        .map(|key| pb::EndpointKey {
            namespace: key.namespace().to_owned(),
            name: key.name().to_owned(),
        })
        .collect()
}

pub fn filter_to_wire(filter: &LabelFilter) -> pb::LabelFilter {
    pb::LabelFilter {
        include: filter.include().iter().map(ToString::to_string).collect(),
        exclude: filter.exclude().iter().map(ToString::to_string).collect(),
    }
}

pub fn filter_from_wire(filter: Option<&pb::LabelFilter>) -> Result<LabelFilter, FieldError> {
    let filter = filter.ok_or_else(|| FieldError::new("hello_reply.filter", Problem::Missing))?;
    LabelFilter::from_parts(&filter.include, &filter.exclude)
        .map_err(|e| FieldError::new("hello_reply.filter", e))
}

/// `set` for the wire: every range with its kind, in the set's order, and every
/// named ClusterIP.
pub fn services_to_wire(set: &ServiceSet) -> pb::ServiceSet {
    pb::ServiceSet {
        cluster_ips: set
            .cluster_ips()
            .map(|(address, service)| pb::ClusterIp {
                address: ip_octets(*address),
                namespace: service.key.namespace().to_owned(),
                name: service.key.name().to_owned(),
                ports: service
                    .ports
                    .iter()
                    .map(|p| pb::ServicePort {
                        port: u32::from(p.port),
                        protocol: u32::from(p.protocol),
                    })
                    .collect(),
            })
            .collect(),
        ranges: set
            .iter()
            .map(|(range, kind)| pb::ServiceRange {
                address: match range.addr() {
                    IpAddr::V4(v4) => v4.octets().to_vec(),
                    IpAddr::V6(v6) => v6.octets().to_vec(),
                },
                prefix_len: u32::from(range.prefix_len()),
                kind: match kind {
                    ServiceKind::ClusterIpRange => pb::ServiceKind::ClusterIpRange,
                    ServiceKind::LoadBalancerIp => pb::ServiceKind::LoadBalancerIp,
                    ServiceKind::ExternalIp => pb::ServiceKind::ExternalIp,
                } as i32,
            })
            .collect(),
    }
}

fn ip_octets(address: IpAddr) -> Vec<u8> {
    match address {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    }
}

/// One named ClusterIP of the wire, or why not.
fn cluster_ip_from_wire(
    entry: &pb::ClusterIp,
) -> Result<(IpAddr, ClusterIpService), ClusterIpError> {
    let address = if let Ok(v4) = <[u8; 4]>::try_from(entry.address.as_slice()) {
        IpAddr::from(v4)
    } else if let Ok(v6) = <[u8; 16]>::try_from(entry.address.as_slice()) {
        IpAddr::from(v6).to_canonical()
    } else {
        return Err(ClusterIpError::AddressLength(entry.address.len()));
    };
    let key = EndpointKey::new(&entry.namespace, &entry.name)
        .map_err(|source| ClusterIpError::Name { address, source })?;
    if entry.ports.len() > ClusterIpService::MAX_PORTS {
        return Err(ClusterIpError::TooManyPorts {
            address,
            count: entry.ports.len(),
            max: ClusterIpService::MAX_PORTS,
        });
    }
    let mut ports = Vec::with_capacity(entry.ports.len());
    for p in &entry.ports {
        let port =
            u16::try_from(p.port)
                .ok()
                .filter(|port| *port != 0)
                .ok_or(ClusterIpError::Port {
                    address,
                    port: p.port,
                })?;
        let protocol = u8::try_from(p.protocol)
            .ok()
            .filter(|protocol| ServicePort::PROTOCOLS.contains(protocol))
            .ok_or(ClusterIpError::Protocol {
                address,
                protocol: p.protocol,
            })?;
        ports.push(ServicePort { port, protocol });
    }
    ports.sort_unstable();
    ports.dedup();
    Ok((
        address,
        ClusterIpService {
            key,
            ports: ports.into_boxed_slice(),
        },
    ))
}

/// One range of the wire, or why not.
fn service_range_from_wire(
    range: &pb::ServiceRange,
) -> Result<(IpNet, ServiceKind), ServiceRangeError> {
    let prefix_len = range.prefix_len;
    let address = if let Ok(v4) = <[u8; 4]>::try_from(range.address.as_slice()) {
        IpAddr::from(v4)
    } else if let Ok(v6) = <[u8; 16]>::try_from(range.address.as_slice()) {
        IpAddr::from(v6)
    } else {
        return Err(ServiceRangeError::AddressLength {
            len: range.address.len(),
            prefix_len,
        });
    };
    let max = if address.is_ipv4() { 32 } else { 128 };
    let net = u8::try_from(prefix_len)
        .ok()
        .and_then(|bits| IpNet::new(address, bits).ok())
        .ok_or(ServiceRangeError::PrefixTooLong {
            address,
            prefix_len,
            max,
        })?;
    if net.trunc() != net {
        return Err(ServiceRangeError::HostBits {
            address,
            prefix_len,
            range: net.trunc(),
        });
    }
    let kind = match pb::ServiceKind::try_from(range.kind) {
        Ok(pb::ServiceKind::ClusterIpRange) => ServiceKind::ClusterIpRange,
        Ok(pb::ServiceKind::LoadBalancerIp) => ServiceKind::LoadBalancerIp,
        Ok(pb::ServiceKind::ExternalIp) => ServiceKind::ExternalIp,
        Ok(pb::ServiceKind::Unspecified) | Err(_) => {
            return Err(ServiceRangeError::Kind {
                range: net,
                kind: range.kind,
            });
        }
    };
    Ok((net, kind))
}

/// A set of Service ranges from the wire (`field` names it: `hello_reply.services`).
/// A set over [`ServiceSet::MAX_RANGES`] is refused as a whole; otherwise each
/// range that cannot be read is refused alone, named (`field.ranges[3]`) among the
/// errors returned, and left out of the set; the others are the set.
pub fn services_from_wire(
    set: &pb::ServiceSet,
    field: &str,
) -> Result<(ServiceSet, Vec<FieldError>), FieldError> {
    if set.ranges.len() > ServiceSet::MAX_RANGES {
        return Err(FieldError::new(
            format_args!("{field}.ranges"),
            Problem::TooMany {
                count: set.ranges.len(),
                max: ServiceSet::MAX_RANGES,
            },
        ));
    }
    if set.cluster_ips.len() > ServiceSet::MAX_CLUSTER_IPS {
        return Err(FieldError::new(
            format_args!("{field}.cluster_ips"),
            Problem::TooMany {
                count: set.cluster_ips.len(),
                max: ServiceSet::MAX_CLUSTER_IPS,
            },
        ));
    }
    let mut services = ServiceSet::new();
    let mut refused = Vec::new();
    for (i, range) in set.ranges.iter().enumerate() {
        match service_range_from_wire(range) {
            Ok((net, kind)) => services.insert(net, kind),
            Err(problem) => refused.push(FieldError::new(
                format_args!("{field}.ranges[{i}]"),
                problem,
            )),
        }
    }
    for (i, entry) in set.cluster_ips.iter().enumerate() {
        match cluster_ip_from_wire(entry) {
            Ok((address, service)) => services.insert_cluster_ip(address, service),
            Err(problem) => refused.push(FieldError::new(
                format_args!("{field}.cluster_ips[{i}]"),
                problem,
            )),
        }
    }
    Ok((services, refused))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_addresses_are_checked_and_named() {
        let text = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let ok = addresses_from_wire(
            &text(&["10.0.0.2", "fd00::1", "10.0.0.2", "::ffff:10.0.0.3"]),
            "hello.addresses",
        );
        let want: Vec<IpAddr> = ["10.0.0.2", "10.0.0.3", "fd00::1"]
            .iter()
            .filter_map(|s| s.parse().ok())
            .collect();
        assert_eq!(ok, Ok(want));
        assert_eq!(addresses_from_wire(&[], "hello.addresses"), Ok(Vec::new()));
        let bad = addresses_from_wire(&text(&["10.0.0.1", "node-a"]), "hello.addresses");
        assert_eq!(
            bad.map_err(|e| e.to_string()),
            Err("hello.addresses[1]: \"node-a\" is not an IPv4 or IPv6 address".to_owned())
        );
        let many: Vec<String> = (0..17).map(|i| format!("10.0.0.{i}")).collect();
        assert_eq!(
            addresses_from_wire(&many, "hello.addresses").map_err(|e| e.to_string()),
            Err("hello.addresses: has 17 entries, over the limit of 16".to_owned())
        );
    }

    fn ep(ns: &str, name: &str, ips: &[&str], id: u32, labels: &[&str]) -> pb::Endpoint {
        pb::Endpoint {
            namespace: ns.into(),
            name: name.into(),
            ips: ips.iter().map(|s| s.to_string()).collect(),
            identity: id,
            labels: labels.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn snapshot(endpoints: Vec<pb::Endpoint>) -> pb::Snapshot {
        pb::Snapshot {
            endpoints,
            allocations_settled: 0,
        }
    }

    /// (key, reason) of each rejection, in order.
    fn rejections(entries: &Entries) -> Vec<(String, String)> {
        entries
            .rejected
            .iter()
            .map(|r| (r.key.to_string(), r.error.to_string()))
            .collect()
    }

    #[test]
    fn endpoint_round_trips() -> Result<(), Rejected> {
        let wire = ep(
            "default",
            "web-0",
            &["198.18.0.2", "2001:db8::2", "198.18.0.2"],
            300,
            &["k8s:b=2", "k8s:a=1"],
        );
        let domain = endpoint_from_wire(&wire, &WireLimits::default(), &LabelFilter::default())?;
        assert_eq!(domain.key.as_str(), "default/web-0");
        assert_eq!(domain.ips.len(), 2, "duplicate addresses are merged");
        assert_eq!(domain.labels.as_str(), "k8s:a=1;k8s:b=2");
        let back = endpoint_to_wire(&domain);
        assert_eq!(back.labels, vec!["k8s:a=1", "k8s:b=2"]);
        assert_eq!(back.ips, vec!["198.18.0.2", "2001:db8::2"]);
        Ok(())
    }

    /// `::ffff:a.b.c.d` is the IPv4 address a.b.c.d: one address, one key, in an
    /// entry's addresses as in a Hello's.
    #[test]
    fn an_ipv4_mapped_address_is_its_ipv4_address() -> Result<(), Rejected> {
        let wire = ep(
            "default",
            "web-0",
            &["::ffff:198.18.9.9", "198.18.9.9", "::FFFF:c612:909"],
            300,
            &["k8s:a=1"],
        );
        let domain = endpoint_from_wire(&wire, &WireLimits::default(), &LabelFilter::default())?;
        let want: IpAddr = [198, 18, 9, 9].into();
        assert_eq!(&*domain.ips, &[want]);
        assert_eq!(endpoint_to_wire(&domain).ips, vec!["198.18.9.9"]);
        // A real IPv6 address that merely ends in an IPv4 one stays IPv6.
        let compat = ep(
            "default",
            "web-1",
            &["64:ff9b::c612:909"],
            300,
            &["k8s:a=1"],
        );
        let domain = endpoint_from_wire(&compat, &WireLimits::default(), &LabelFilter::default())?;
        assert!(domain.ips.iter().all(IpAddr::is_ipv6), "{:?}", domain.ips);
        Ok(())
    }

    #[test]
    fn errors_name_the_field_within_the_entry_and_a_bounded_kind() {
        let limits = WireLimits {
            max_ips_per_endpoint: 2,
            labels: LabelLimits { max_labels: 2 },
            ..WireLimits::default()
        };
        let cases = [
            (
                ep("", "a", &[], 300, &["k8s:a=1"]),
                "namespace: is required",
                "key",
            ),
            (
                ep("Default", "a", &[], 300, &["k8s:a=1"]),
                "namespace: namespace \"Default\"",
                "key",
            ),
            (
                ep("d", "", &[], 300, &["k8s:a=1"]),
                "name: is required",
                "key",
            ),
            (
                ep("d", "Web_0", &[], 300, &["k8s:a=1"]),
                "name: endpoint name \"Web_0\"",
                "key",
            ),
            (
                ep("d", "a", &["nope"], 300, &["k8s:a=1"]),
                "ips[0]: \"nope\"",
                "ip",
            ),
            (
                ep(
                    "d",
                    "a",
                    &["198.18.0.1", "198.18.0.2", "198.18.0.3"],
                    300,
                    &["k8s:a=1"],
                ),
                "ips: has 3 entries, over the limit of 2",
                "too_many_ips",
            ),
            (
                ep("d", "a", &[], 0, &["k8s:a=1"]),
                "identity: must not be 0",
                "identity",
            ),
            (
                ep("d", "a", &[], 300, &["k8s:a=1", "k8s:b"]),
                "labels[1]: label \"k8s:b\"",
                "labels",
            ),
            (
                ep("d", "a", &[], 300, &["k8s:-x=y"]),
                "labels[0]: label \"k8s:-x=y\"",
                "labels",
            ),
            (
                ep("d", "a", &[], 300, &["k8s:a=1", "reserved:host="]),
                "labels[1]: label \"reserved:host=\"",
                "labels",
            ),
            (
                ep("d", "a", &[], 300, &["k8s:a=1", "k8s:b=2", "k8s:c=3"]),
                "labels: 3 labels exceed the limit of 2",
                "too_many_labels",
            ),
            (
                ep("d", "a", &[], 300, &["k8s:controller-revision-hash=7"]),
                "labels: after the label filter: a label set must have at least one label",
                "labels_after_filter",
            ),
        ];
        for (wire, want, kind) in cases {
            let Err(rejected) = endpoint_from_wire(&wire, &limits, &LabelFilter::default()) else {
                panic!("{wire:?} should be rejected with {want:?}");
            };
            let reason = rejected.error.to_string();
            assert!(
                reason.starts_with(want),
                "{reason:?} should start with {want:?}"
            );
            assert_eq!(rejected.kind(), kind, "{reason}");
            assert_eq!(
                rejected.key,
                SentKey::new(&wire.namespace, &wire.name),
                "named by its key as sent"
            );
            assert_eq!(rejected.to_wire().reason, reason);
        }
    }

    #[test]
    fn a_snapshot_keeps_its_good_entries_and_rejects_each_bad_one() -> Result<(), FieldError> {
        let good = |name: &str| ep("d", name, &["198.18.0.2"], 300, &["k8s:app=web"]);
        let entries = snapshot_from_wire(
            &snapshot(vec![
                good("web-0"),
                ep("d", "bad-0", &[], 300, &["k8s:-x=y"]),
                good("web-1"),
                ep("d", "bad-1", &["198.18.0.300"], 300, &["k8s:app=web"]),
                ep("Nope", "x", &[], 300, &["k8s:app=web"]),
                good("web-2"),
            ]),
            &WireLimits::default(),
            &LabelFilter::default(),
        )?;
        let kept: Vec<&str> = entries.endpoints.iter().map(|e| e.key.as_str()).collect();
        assert_eq!(kept, ["d/web-0", "d/web-1", "d/web-2"]);
        let rejected = rejections(&entries);
        assert_eq!(rejected.len(), 3, "{rejected:?}");
        assert_eq!(rejected[0].0, "d/bad-0");
        assert!(
            rejected[0].1.starts_with("labels[0]: label \"k8s:-x=y\""),
            "{rejected:?}"
        );
        assert_eq!(rejected[1].0, "d/bad-1");
        assert!(
            rejected[1].1.starts_with("ips[0]: \"198.18.0.300\""),
            "{rejected:?}"
        );
        assert_eq!(rejected[2].0, "Nope/x", "an invalid key is named as sent");
        assert!(
            rejected[2].1.starts_with("namespace: namespace \"Nope\""),
            "{rejected:?}"
        );
        Ok(())
    }

    #[test]
    fn a_rejection_reads_the_same_wherever_the_entry_sits() -> Result<(), FieldError> {
        let bad = ep("d", "bad-0", &[], 300, &["k8s:a=1", "k8s:-x=y"]);
        let alone = snapshot_from_wire(
            &snapshot(vec![bad.clone()]),
            &WireLimits::default(),
            &LabelFilter::default(),
        )?;
        let behind = snapshot_from_wire(
            &snapshot(vec![ep("d", "web-0", &[], 300, &["k8s:a=1"]), bad.clone()]),
            &WireLimits::default(),
            &LabelFilter::default(),
        )?;
        let upsert = pb::EndpointUpsert {
            endpoint: Some(bad),
        };
        let Ok(Err(delta)) =
            upsert_from_wire(&upsert, &WireLimits::default(), &LabelFilter::default())
        else {
            panic!("the upsert's entry is rejected alone");
        };
        assert_eq!(alone.rejected, behind.rejected);
        assert_eq!(alone.rejected, [delta]);
        Ok(())
    }

    #[test]
    fn of_duplicate_keys_the_first_entry_is_kept() -> Result<(), FieldError> {
        let first = ep("d", "a", &["198.18.0.2"], 300, &["k8s:a=1"]);
        let second = ep("d", "a", &["198.18.0.3"], 301, &["k8s:a=2"]);
        let entries = snapshot_from_wire(
            &snapshot(vec![
                first,
                ep("d", "b", &[], 300, &["k8s:a=1"]),
                second.clone(),
                second,
            ]),
            &WireLimits::default(),
            &LabelFilter::default(),
        )?;
        let kept: Vec<(&str, u32)> = entries
            .endpoints
            .iter()
            .map(|e| (e.key.as_str(), e.identity.get()))
            .collect();
        assert_eq!(kept, [("d/a", 300), ("d/b", 300)]);
        let dup = (
            "d/a".to_owned(),
            "duplicate endpoint key, first entry kept".to_owned(),
        );
        assert_eq!(rejections(&entries), [dup.clone(), dup]);
        assert!(entries.rejected.iter().all(|r| r.kind() == "duplicate"));

        // The first decides even when it is the bad one.
        let entries = snapshot_from_wire(
            &snapshot(vec![
                ep("d", "a", &[], 300, &["k8s:-x=y"]),
                ep("d", "a", &[], 300, &["k8s:a=1"]),
            ]),
            &WireLimits::default(),
            &LabelFilter::default(),
        )?;
        assert!(entries.endpoints.is_empty());
        let kinds: Vec<&str> = entries.rejected.iter().map(Rejected::kind).collect();
        assert_eq!(kinds, ["labels", "duplicate"]);
        Ok(())
    }

    #[test]
    fn only_the_endpoint_limit_refuses_a_snapshot_as_a_whole() {
        let limits = WireLimits {
            max_snapshot_endpoints: 2,
            ..WireLimits::default()
        };
        let at_limit = snapshot(vec![ep("", "", &[], 0, &[]); 2]);
        let entries = snapshot_from_wire(&at_limit, &limits, &LabelFilter::default());
        assert!(
            entries.is_ok_and(|e| e.endpoints.is_empty() && e.rejected.len() == 2),
            "entries that are all bad are rejected, not the snapshot"
        );
        let over = snapshot(vec![ep("", "", &[], 0, &[]); 3]);
        let err = snapshot_from_wire(&over, &limits, &LabelFilter::default())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert_eq!(
            err,
            "snapshot.endpoints: has 3 entries, over the limit of 2"
        );
    }

    #[test]
    fn an_upsert_without_its_endpoint_is_malformed_a_bad_delete_is_rejected() {
        let err = upsert_from_wire(
            &pb::EndpointUpsert { endpoint: None },
            &WireLimits::default(),
            &LabelFilter::default(),
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
        assert_eq!(err, "upsert.endpoint: is required");

        let delete = |ns: &str, name: &str| pb::EndpointDelete {
            namespace: ns.into(),
            name: name.into(),
        };
        assert_eq!(
            delete_from_wire(&delete("d", "a")).map(|k| k.to_string()),
            Ok("d/a".to_owned())
        );
        let rejected = delete_from_wire(&delete("d", "")).map_err(|r| (r.to_string(), r.kind()));
        assert_eq!(
            rejected,
            Err(("endpoint d/: name: is required".to_owned(), "key"))
        );
    }

    #[test]
    fn a_sent_key_is_cut_to_a_bounded_length() {
        let long = "a".repeat(10_000);
        let key = SentKey::new(&long, &long);
        assert_eq!((key.namespace.len(), key.name.len()), (253, 253));
    }

    #[test]
    fn the_field_of_a_key_is_named_within_its_message() {
        let err = endpoint_key_from_wire("d", "", "delete")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert_eq!(err, "delete.name: is required");
    }

    #[test]
    fn version_mismatch_names_both() {
        assert!(check_version(PROTOCOL_VERSION).is_ok());
        let err = check_version(7)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert_eq!(
            err,
            format!(
                "protocol version mismatch: the peer speaks version 7, this side speaks version {PROTOCOL_VERSION}"
            )
        );
        let err = check_version(0)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.ends_with("(protocol_version is unset)"));
    }

    #[test]
    fn filter_round_trips() -> Result<(), FieldError> {
        let filter = LabelFilter::default();
        let back = filter_from_wire(Some(&filter_to_wire(&filter)))?;
        assert_eq!(back, filter);
        Ok(())
    }

    fn wire_range(address: &[u8], prefix_len: u32, kind: pb::ServiceKind) -> pb::ServiceRange {
        pb::ServiceRange {
            address: address.to_vec(),
            prefix_len,
            kind: kind as i32,
        }
    }

    #[test]
    fn cluster_ips_round_trip_and_bad_entries_are_named() -> Result<(), Box<dyn std::error::Error>>
    {
        let mut set = ServiceSet::new();
        set.insert("10.96.0.0/12".parse()?, ServiceKind::ClusterIpRange);
        let web = ClusterIpService {
            key: EndpointKey::new("shop", "web")?,
            ports: vec![
                ServicePort {
                    port: 80,
                    protocol: 6,
                },
                ServicePort {
                    port: 53,
                    protocol: 17,
                },
            ]
            .into(),
        };
        set.insert_cluster_ip("10.96.0.10".parse()?, web.clone());
        set.insert_cluster_ip("fd00:10:96::a".parse()?, web);
        let mut wire = services_to_wire(&set);
        let (back, refused) = services_from_wire(&wire, "services")?;
        assert!(refused.is_empty(), "{refused:?}");
        // Ports come back sorted.
        let named = back
            .cluster_ip(&"10.96.0.10".parse()?)
            .ok_or("10.96.0.10 unnamed")?;
        assert_eq!(named.key.as_str(), "shop/web");
        assert!(named.has_port(53, 17) && named.has_port(80, 6) && !named.has_port(80, 17));
        assert_eq!(back.cluster_ips().len(), 2);

        wire.cluster_ips[0].name = "Web".to_owned();
        wire.cluster_ips[1].ports[0].protocol = 1;
        let (back, refused) = services_from_wire(&wire, "services")?;
        assert_eq!(back.cluster_ips().len(), 0);
        let text: Vec<String> = refused.iter().map(ToString::to_string).collect();
        assert_eq!(
            text,
            [
                "services.cluster_ips[0]: 10.96.0.10: endpoint name \"Web\" is not a DNS subdomain \
                 (lowercase `a-z0-9-.`, at most 253 characters)",
                "services.cluster_ips[1]: fd00:10:96::a: protocol 1 is none of TCP (6), UDP (17), \
                 SCTP (132)",
            ]
        );
        Ok(())
    }

    #[test]
    fn services_round_trip() -> Result<(), Box<dyn std::error::Error>> {
        let set: ServiceSet = [
            ("10.96.0.0/12".parse()?, ServiceKind::ClusterIpRange),
            ("fd00:10:96::/108".parse()?, ServiceKind::ClusterIpRange),
            ("203.0.113.7/32".parse()?, ServiceKind::LoadBalancerIp),
            ("2001:db8::7/128".parse()?, ServiceKind::ExternalIp),
        ]
        .into_iter()
        .collect();
        let wire = services_to_wire(&set);
        assert_eq!(wire.ranges.len(), 4);
        assert_eq!(
            wire.ranges[0],
            wire_range(&[10, 96, 0, 0], 12, pb::ServiceKind::ClusterIpRange)
        );
        let (back, refused) = services_from_wire(&wire, "services")?;
        assert!(refused.is_empty(), "{refused:?}");
        assert_eq!(back, set);
        Ok(())
    }

    #[test]
    fn a_malformed_service_range_is_refused_named_and_left_out() -> Result<(), FieldError> {
        let wire = pb::ServiceSet {
            cluster_ips: Vec::new(),
            ranges: vec![
                wire_range(&[10, 96, 0, 0], 12, pb::ServiceKind::ClusterIpRange),
                wire_range(&[10, 96, 0], 12, pb::ServiceKind::ClusterIpRange),
                wire_range(&[10, 96, 0, 0], 33, pb::ServiceKind::ClusterIpRange),
                wire_range(&[10, 96, 3, 0], 12, pb::ServiceKind::ClusterIpRange),
                wire_range(&[203, 0, 113, 7], 32, pb::ServiceKind::Unspecified),
                pb::ServiceRange {
                    address: vec![203, 0, 113, 8],
                    prefix_len: 32,
                    kind: 42,
                },
                wire_range(&[0; 16], 129, pb::ServiceKind::ExternalIp),
                wire_range(&[198, 51, 100, 1], 32, pb::ServiceKind::ExternalIp),
            ],
        };
        let (set, refused) = services_from_wire(&wire, "hello_reply.services")?;
        let ranges: Vec<String> = set.iter().map(|(r, _)| r.to_string()).collect();
        assert_eq!(ranges, ["10.96.0.0/12", "198.51.100.1/32"]);
        let messages: Vec<String> = refused.iter().map(ToString::to_string).collect();
        assert_eq!(
            messages,
            [
                "hello_reply.services.ranges[1]: address of 3 bytes (neither 4 nor 16), prefix length 12",
                "hello_reply.services.ranges[2]: 10.96.0.0/33: prefix length over 32",
                "hello_reply.services.ranges[3]: 10.96.3.0/12 has bits set past its prefix length (the range is 10.96.0.0/12)",
                "hello_reply.services.ranges[4]: 203.0.113.7/32: kind 0 is not a ServiceKind census knows",
                "hello_reply.services.ranges[5]: 203.0.113.8/32: kind 42 is not a ServiceKind census knows",
                "hello_reply.services.ranges[6]: ::/129: prefix length over 128",
            ]
        );
        Ok(())
    }

    #[test]
    fn a_service_set_over_the_limit_is_refused_as_a_whole() {
        let range = wire_range(&[10, 0, 0, 1], 32, pb::ServiceKind::ExternalIp);
        let wire = pb::ServiceSet {
            cluster_ips: Vec::new(),
            ranges: vec![range; ServiceSet::MAX_RANGES + 1],
        };
        assert_eq!(
            services_from_wire(&wire, "batch.services").map(|_| ()),
            Err(FieldError::new(
                "batch.services.ranges",
                Problem::TooMany {
                    count: ServiceSet::MAX_RANGES + 1,
                    max: ServiceSet::MAX_RANGES
                }
            ))
        );
    }
}
