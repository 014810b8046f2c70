//! What the shells tell the core: allocation answers, the operator's word, and what
//! reconcile did.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use census_proto::{
    domain::{EndpointKey, IdentityId},
    labels::{LabelFilter, LabelLimits, LabelSet},
};

use super::{AllocateFailure, AllocationId, DatapathError};

/// The operator's settings that shape identity labels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LabelSettings {
    pub(crate) filter: LabelFilter,
    pub(crate) limits: LabelLimits,
    pub(crate) max_ips: usize,
}

impl Default for LabelSettings {
    /// The operator's defaults, in force until its HelloReply says otherwise.
    fn default() -> Self {
        Self {
            filter: LabelFilter::default(),
            limits: LabelLimits::default(),
            max_ips: 16,
        }
    }
}

/// Progress of an allocation, from the allocate client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AllocationEvent {
    Allocated {
        request: AllocationId,
        labels: LabelSet,
        id: IdentityId,
    },
    /// An attempt failed; the client retries after a backoff.
    Failed {
        request: AllocationId,
        labels: LabelSet,
        failure: AllocateFailure,
    },
}

/// What the operator tells the core, from the EndpointSync client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum OperatorEvent {
    Settings(LabelSettings),
    Rebind {
        key: EndpointKey,
        id: IdentityId,
    },
    /// What an Ack said of the entries of its message.
    Verdict(Verdict),
}

/// What the operator's Acks say about the endpoints it was sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Verdict {
    pub(crate) scope: VerdictScope,
    /// Entries the operator rejected, with its reason.
    pub(crate) rejected: BTreeMap<EndpointKey, String>,
    /// Entries whose identity the operator decides after its adoption window.
    pub(crate) pending: BTreeSet<EndpointKey>,
}

/// Whom a [`Verdict`] speaks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum VerdictScope {
    /// Every endpoint: a snapshot's Ack. An endpoint it does not name is accepted.
    All,
    /// One endpoint: a delta's Ack.
    One(EndpointKey),
}

/// What reconcile did, with a batch of effects or in a full pass: the entries and
/// interfaces it brought up to date, the failures among them, and what the
/// datapath holds since.
#[derive(Debug, Default)]
pub(crate) struct Reconciled {
    pub(crate) entries: BTreeSet<IpAddr>,
    pub(crate) entry_failures: Vec<(IpAddr, DatapathError)>,
    pub(crate) interfaces: BTreeSet<String>,
    pub(crate) interface_failures: Vec<(String, DatapathError)>,
    /// ENDPOINTS entries this agent has written.
    pub(crate) map_entries: usize,
    /// Attached interfaces whose INTERFACES slot another interface holds.
    pub(crate) interfaces_by_address: usize,
}
