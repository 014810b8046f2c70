//! Domain -> wire for what the services answer, and errors -> precise gRPC statuses.

use census_proto::{
    convert::{FieldError, VersionMismatch, session_to_wire},
    pb,
};
use tonic::Status;

use crate::{
    allocator::{AllocError, IdentityInfo, IdentityState, NodeInfo, SyncError},
    replica::AdmissionError,
    runtime::{Refused, not_leader_status},
};

pub(super) fn identity_to_wire(info: &IdentityInfo) -> pb::Identity {
    let (state, released_at_ms, quarantined_until_ms, protected_until_ms) = match info.state {
        IdentityState::Creating => (pb::IdentityState::Creating, 0, 0, 0),
        IdentityState::Live => (pb::IdentityState::Live, 0, 0, 0),
        IdentityState::Protected { until } => {
            (pb::IdentityState::Protected, 0, 0, until.as_millis())
        }
        IdentityState::Released { since } => (pb::IdentityState::Released, since.as_millis(), 0, 0),
        IdentityState::Deleting => (pb::IdentityState::Deleting, 0, 0, 0),
        IdentityState::Quarantined { until } => {
            (pb::IdentityState::Quarantined, 0, until.as_millis(), 0)
        }
        IdentityState::Blocked => (pb::IdentityState::Blocked, 0, 0, 0),
    };
    pb::Identity {
        id: info.id.get(),
        labels: info
            .labels
            .as_ref()
            .map(|l| l.to_strings())
            .unwrap_or_default(),
        state: state.into(),
        references: u64::from(info.refs),
        holds: info.holds,
        released_at_ms,
        quarantined_until_ms,
        protected_until_ms,
    }
}

pub(super) fn node_to_wire(n: &NodeInfo) -> pb::Node {
    pb::Node {
        name: n.name.to_string(),
        session: n.session.map(session_to_wire),
        connected: n.connected,
        last_seq: n.last_seq,
        last_heard_ms: n.last_heard.map_or(0, |t| t.as_millis()),
        last_snapshot_ms: n.last_snapshot.map_or(0, |t| t.as_millis()),
        stale: n.stale,
        endpoints: n.endpoints,
        holds: n.holds,
        corrections: n.corrections,
        adoptions: n.adoptions,
        old_seq_ignored: n.old_seq_ignored,
        rebinds: n.rebinds,
    }
}

pub(super) fn field(e: FieldError) -> Status {
    Status::invalid_argument(e.to_string())
}

pub(super) fn version(e: VersionMismatch) -> Status {
    Status::failed_precondition(e.to_string())
}

pub(super) fn sync(e: SyncError) -> Status {
    Status::failed_precondition(e.to_string())
}

pub(super) fn alloc(e: AllocError) -> Status {
    match e {
        AllocError::Sync(e) => sync(e),
        e @ (AllocError::RangeExhausted { .. } | AllocError::HoldQuota { .. }) => {
            Status::resource_exhausted(e.to_string())
        }
        e @ (AllocError::AdoptionWindow { .. } | AllocError::StoreUnavailable { .. }) => {
            Status::unavailable(e.to_string())
        }
    }
}

pub(super) fn refused(e: Refused) -> Status {
    match e {
        Refused::NotLeader(e) => not_leader_status(&e),
        Refused::Admission(e) => admission(e),
        Refused::Sync(e) => sync(e),
        Refused::Alloc(e) => alloc(e),
    }
}

fn admission(e: AdmissionError) -> Status {
    match e {
        AdmissionError::NotSynced => Status::unavailable(e.to_string()),
        AdmissionError::UnknownNode { .. } => Status::failed_precondition(e.to_string()),
        AdmissionError::WrongAddress { .. } | AdmissionError::NoPeer { .. } => {
            Status::permission_denied(e.to_string())
        }
    }
}
