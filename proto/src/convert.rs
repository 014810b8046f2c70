//! Wire <-> domain conversions. Every conversion from the wire validates completely
//! and, when it refuses, names the field (`snapshot.endpoints[3].labels[1]`) and the
//! problem, so the caller can answer INVALID_ARGUMENT without touching state.

use std::{collections::HashSet, fmt, net::IpAddr};

use crate::{
    PROTOCOL_VERSION,
    domain::{Endpoint, EndpointKey, IdentityId, NameError, NodeName, SessionId, canonical_ips},
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
    #[error("must not be 0")]
    Zero,
    #[error("has {count} entries, over the limit of {max}")]
    TooMany { count: usize, max: usize },
    #[error("endpoint {0} appears twice")]
    Duplicate(String),
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

pub fn identity_from_wire(id: u32, field: &str) -> Result<IdentityId, FieldError> {
    IdentityId::new(id).ok_or_else(|| FieldError::new(field, Problem::Zero))
}

pub fn endpoint_key_from_wire(
    namespace: &str,
    name: &str,
    field: &str,
) -> Result<EndpointKey, FieldError> {
    if namespace.is_empty() {
        return Err(FieldError::new(
            format_args!("{field}.namespace"),
            Problem::Missing,
        ));
    }
    if name.is_empty() {
        return Err(FieldError::new(
            format_args!("{field}.name"),
            Problem::Missing,
        ));
    }
    EndpointKey::new(namespace, name).map_err(|e| {
        let which = if matches!(e, NameError::Namespace(_)) {
            "namespace"
        } else {
            "name"
        };
        FieldError::new(format_args!("{field}.{which}"), e)
    })
}

pub fn endpoint_from_wire(
    ep: &pb::Endpoint,
    limits: &WireLimits,
    field: &str,
) -> Result<Endpoint, FieldError> {
    let key = endpoint_key_from_wire(&ep.namespace, &ep.name, field)?;
    if ep.ips.len() > limits.max_ips_per_endpoint {
        return Err(FieldError::new(
            format_args!("{field}.ips"),
            Problem::TooMany {
                count: ep.ips.len(),
                max: limits.max_ips_per_endpoint,
            },
        ));
    }
    let mut ips = Vec::with_capacity(ep.ips.len());
    for (i, text) in ep.ips.iter().enumerate() {
        let ip: IpAddr = text.parse().map_err(|_| {
            FieldError::new(
                format_args!("{field}.ips[{i}]"),
                Problem::Ip(text.chars().take(64).collect()),
            )
        })?;
        ips.push(ip);
    }
    let identity = identity_from_wire(ep.identity, &format!("{field}.identity"))?;
    let labels = labels_from_wire(&ep.labels, &limits.labels, &format!("{field}.labels"))?;
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

/// A snapshot's endpoints, checked against the endpoint limit before anything else
/// and for duplicate keys.
pub fn snapshot_from_wire(
    snapshot: &pb::Snapshot,
    limits: &WireLimits,
) -> Result<Vec<Endpoint>, FieldError> {
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
    let mut seen = HashSet::with_capacity(count);
    let mut endpoints = Vec::with_capacity(count);
    for (i, ep) in snapshot.endpoints.iter().enumerate() {
        let field = format!("snapshot.endpoints[{i}]");
        let ep = endpoint_from_wire(ep, limits, &field)?;
        if !seen.insert(ep.key.clone()) {
            return Err(FieldError::new(
                field,
                Problem::Duplicate(ep.key.to_string()),
            ));
        }
        endpoints.push(ep);
    }
    Ok(endpoints)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(ns: &str, name: &str, ips: &[&str], id: u32, labels: &[&str]) -> pb::Endpoint {
        pb::Endpoint {
            namespace: ns.into(),
            name: name.into(),
            ips: ips.iter().map(|s| s.to_string()).collect(),
            identity: id,
            labels: labels.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn endpoint_round_trips() -> Result<(), FieldError> {
        let wire = ep(
            "default",
            "web-0",
            &["198.18.0.2", "2001:db8::2", "198.18.0.2"],
            300,
            &["k8s:b=2", "k8s:a=1"],
        );
        let domain = endpoint_from_wire(&wire, &WireLimits::default(), "e")?;
        assert_eq!(domain.key.as_str(), "default/web-0");
        assert_eq!(domain.ips.len(), 2, "duplicate addresses are merged");
        assert_eq!(domain.labels.as_str(), "k8s:a=1;k8s:b=2");
        let back = endpoint_to_wire(&domain);
        assert_eq!(back.labels, vec!["k8s:a=1", "k8s:b=2"]);
        assert_eq!(back.ips, vec!["198.18.0.2", "2001:db8::2"]);
        Ok(())
    }

    #[test]
    fn errors_name_the_field() {
        let limits = WireLimits::default();
        let cases = [
            (
                ep("", "a", &[], 300, &["k8s:a=1"]),
                "e.namespace: is required",
            ),
            (
                ep("Default", "a", &[], 300, &["k8s:a=1"]),
                "e.namespace: namespace \"Default\"",
            ),
            (
                ep("d", "a", &["nope"], 300, &["k8s:a=1"]),
                "e.ips[0]: \"nope\"",
            ),
            (
                ep("d", "a", &[], 0, &["k8s:a=1"]),
                "e.identity: must not be 0",
            ),
            (
                ep("d", "a", &[], 300, &["k8s:a=1", "k8s:b"]),
                "e.labels[1]: label \"k8s:b\"",
            ),
            (
                ep("d", "a", &[], 300, &["k8s:a=1", "reserved:host="]),
                "e.labels[1]: label \"reserved:host=\"",
            ),
        ];
        for (wire, want) in cases {
            let err = endpoint_from_wire(&wire, &limits, "e")
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(err.starts_with(want), "{err:?} should start with {want:?}");
        }
    }

    #[test]
    fn snapshot_limit_is_checked_first() {
        let limits = WireLimits {
            max_snapshot_endpoints: 2,
            ..WireLimits::default()
        };
        let snapshot = pb::Snapshot {
            endpoints: vec![ep("", "", &[], 0, &[]); 3],
        };
        let err = snapshot_from_wire(&snapshot, &limits)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert_eq!(
            err,
            "snapshot.endpoints: has 3 entries, over the limit of 2"
        );
    }

    #[test]
    fn snapshot_refuses_duplicate_keys() {
        let one = ep("d", "a", &[], 300, &["k8s:a=1"]);
        let snapshot = pb::Snapshot {
            endpoints: vec![one.clone(), one],
        };
        let err = snapshot_from_wire(&snapshot, &WireLimits::default())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert_eq!(err, "snapshot.endpoints[1]: endpoint d/a appears twice");
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
}
