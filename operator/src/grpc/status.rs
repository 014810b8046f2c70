//! Errors -> precise gRPC statuses, and how a follower says who leads.

use census_proto::convert::{FieldError, VersionMismatch};
use tonic::Status;

use super::untrusted::untrusted;

use crate::api::{AdmissionError, AllocError, NotLeader, Refused, SyncError};

/// The gRPC metadata key with the leader's address, on a follower's UNAVAILABLE.
pub(super) const LEADER_METADATA: &str = "census-leader";

/// How a follower ends an agent stream or refuses a call: UNAVAILABLE naming the
/// leader, with its address also in the `census-leader` metadata for clients.
pub(super) fn not_leader_status(refusal: &NotLeader) -> Status {
    let mut status = Status::unavailable(refusal.to_string());
    if let Some(address) = refusal.leader.as_ref().and_then(|l| l.address.as_deref())
        && let Ok(value) = address.parse()
    {
        status.metadata_mut().insert(LEADER_METADATA, value);
    }
    status
}

/// A refused field: its error may quote what the client sent, so it is shown bounded.
pub(super) fn field(e: FieldError) -> Status {
    Status::invalid_argument(untrusted(&e.to_string()).to_string())
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
        e @ Refused::MapNotServed => Status::unimplemented(e.to_string()),
        e @ Refused::MapBusy => Status::unavailable(e.to_string()),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::Leader;

    #[test]
    fn a_follower_names_the_leader_in_the_message_and_the_metadata() {
        let leader = Leader {
            name: "op-b".into(),
            address: Some("10.0.0.2:9460".into()),
        };
        let status = refused(Refused::NotLeader(NotLeader {
            leader: Some(leader),
        }));
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert!(
            status.message().contains("op-b at 10.0.0.2:9460"),
            "{status:?}"
        );
        assert_eq!(
            status
                .metadata()
                .get(LEADER_METADATA)
                .and_then(|v| v.to_str().ok()),
            Some("10.0.0.2:9460")
        );
        let unknown = not_leader_status(&NotLeader { leader: None });
        assert_eq!(unknown.code(), tonic::Code::Unavailable);
        assert!(unknown.metadata().get(LEADER_METADATA).is_none());
    }
}
