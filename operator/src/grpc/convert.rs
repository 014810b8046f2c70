//! Domain -> wire for what the services answer and what the operator tells agents.

use census_proto::{convert::session_to_wire, domain::NodeName, pb};
use tonic::Status;

use super::status::not_leader_status;
use crate::api::{CloseReason, IdentityInfo, IdentityState, NodeInfo, StreamEnd, ToAgent};

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

/// A message of the operator to the agent on `node`'s stream: a message, or the end
/// of the stream with its status.
pub(super) fn to_agent(node: &NodeName, msg: ToAgent) -> Result<pb::OperatorMessage, Status> {
    use pb::operator_message::Body;
    let body = match msg {
        ToAgent::Rebind { key, identity } => Body::Rebind(pb::Rebind {
            namespace: key.namespace().to_owned(),
            name: key.name().to_owned(),
            identity: identity.get(),
        }),
        ToAgent::SnapshotNow => Body::SnapshotRequest(pb::SnapshotRequest {}),
        ToAgent::End(end) => return Err(ended(node, end)),
    };
    Ok(pb::OperatorMessage { body: Some(body) })
}

fn ended(node: &NodeName, end: StreamEnd) -> Status {
    match end {
        StreamEnd::Closed(CloseReason::Replaced { by }) => Status::failed_precondition(format!(
            "node {node}: this stream was replaced by a newer stream (session {by})"
        )),
        StreamEnd::Closed(CloseReason::Expired) => Status::failed_precondition(format!(
            "node {node}: silent longer than the node TTL; its view was dropped: reconnect and send a snapshot"
        )),
        StreamEnd::Closed(CloseReason::NodeGone) => {
            Status::failed_precondition(format!("node {node} is gone from the cluster"))
        }
        StreamEnd::NotLeader(refusal) => not_leader_status(&refusal),
        StreamEnd::ShuttingDown => Status::unavailable("the operator is shutting down; reconnect"),
    }
}

#[cfg(test)]
mod tests {
    use census_proto::domain::{EndpointKey, IdentityId, SessionId};

    use super::*;
    use crate::api::{Leader, NotLeader};

    #[test]
    fn the_operators_messages_to_an_agent_become_messages_or_the_end_of_the_stream()
    -> Result<(), Box<dyn std::error::Error>> {
        let node = NodeName::new("node-a")?;
        let rebind = ToAgent::Rebind {
            key: EndpointKey::new("default", "web-1")?,
            identity: IdentityId::new(300).ok_or("id")?,
        };
        assert_eq!(
            to_agent(&node, rebind)?.body,
            Some(pb::operator_message::Body::Rebind(pb::Rebind {
                namespace: "default".into(),
                name: "web-1".into(),
                identity: 300,
            }))
        );
        assert!(matches!(
            to_agent(&node, ToAgent::SnapshotNow)?.body,
            Some(pb::operator_message::Body::SnapshotRequest(_))
        ));
        let end = |end| to_agent(&node, ToAgent::End(end)).err().ok_or("not an end");
        let by = SessionId {
            start_time_ns: 2,
            nonce: 7,
        };
        let replaced = end(StreamEnd::Closed(CloseReason::Replaced { by }))?;
        assert_eq!(replaced.code(), tonic::Code::FailedPrecondition);
        assert!(replaced.message().contains("node node-a"), "{replaced:?}");
        let gone = end(StreamEnd::Closed(CloseReason::NodeGone))?;
        assert!(gone.message().contains("gone from the cluster"), "{gone:?}");
        let leader = Leader {
            name: "op-b".into(),
            address: Some("10.0.0.2:9460".into()),
        };
        let moved = end(StreamEnd::NotLeader(Box::new(NotLeader {
            leader: Some(leader),
        })))?;
        assert_eq!(moved.code(), tonic::Code::Unavailable);
        assert!(moved.metadata().get("census-leader").is_some());
        let stopping = end(StreamEnd::ShuttingDown)?;
        assert_eq!(stopping.code(), tonic::Code::Unavailable);
        Ok(())
    }
}
