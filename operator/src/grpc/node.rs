//! NodeService: what the operator knows of each node, for the CLI and for people.
//!
//! Only the leader knows nodes (sessions and views live in its core), so a follower
//! forwards ListNodes and GetNode to the leader whose address the Lease publishes, and
//! answers UNAVAILABLE naming it if that fails. A forwarded call is never forwarded
//! again. GetVersion is answered by every replica.

use std::{sync::Arc, time::Duration};

use census_proto::{
    convert::{check_version, node_from_wire},
    pb::{self, node_service_client::NodeServiceClient, node_service_server::NodeService},
};
use parking_lot::Mutex;
use tonic::{Request, Response, Status, transport::Channel};

use super::{
    Operator, auth,
    convert::node_to_wire,
    status::{field, not_leader_status, version},
};
use crate::api::{Leader, NotLeader, Role};

/// Marks a call one replica forwarded to another.
const FORWARDED: &str = "census-forwarded";
/// How long a forwarded call may take.
const FORWARD_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Clone)]
pub(crate) struct Nodes {
    operator: Operator,
    /// A channel to the leader, by its address, reused while the leader stays.
    leader: Arc<Mutex<Option<(String, Channel)>>>,
}

impl Nodes {
    pub(crate) fn new(operator: Operator) -> Self {
        Self {
            operator,
            leader: Arc::new(Mutex::new(None)),
        }
    }

    /// `None` to answer here; a client to forward to; or why neither is possible.
    fn route<T>(&self, request: &Request<T>) -> Result<Option<NodeServiceClient<Channel>>, Status> {
        let leader = match self.operator.role() {
            Role::Leader => return Ok(None),
            Role::Follower { leader } => leader,
        };
        let refusal = || {
            not_leader_status(&NotLeader {
                leader: leader.clone(),
            })
        };
        if request.metadata().contains_key(FORWARDED) {
            return Err(refusal());
        }
        let Some(Leader {
            address: Some(address),
            ..
        }) = &leader
        else {
            return Err(refusal());
        };
        let mut cached = self.leader.lock();
        let channel = match cached.as_ref() {
            Some((addr, channel)) if addr == address => channel.clone(),
            _ => {
                let endpoint = Channel::from_shared(format!("http://{address}"))
                    .map_err(|_| refusal())?
                    .connect_timeout(FORWARD_TIMEOUT)
                    .timeout(FORWARD_TIMEOUT);
                let channel = endpoint.connect_lazy();
                *cached = Some((address.clone(), channel.clone()));
                channel
            }
        };
        Ok(Some(NodeServiceClient::new(channel)))
    }

    fn forwarded<T>(&self, message: T) -> Request<T> {
        let mut request = Request::new(message);
        request
            .metadata_mut()
            .insert(FORWARDED, tonic::metadata::MetadataValue::from_static("1"));
        request
    }

    fn forward_failed(&self, status: Status) -> Status {
        let leader = match self.operator.role() {
            Role::Follower { leader: Some(l) } => l.to_string(),
            _ => "the leader".to_owned(),
        };
        if matches!(
            status.code(),
            tonic::Code::NotFound | tonic::Code::InvalidArgument | tonic::Code::FailedPrecondition
        ) {
            return status;
        }
        Status::unavailable(format!(
            "this operator replica is a follower; forwarding to the leader {leader} failed: {}",
            status.message()
        ))
    }
}

#[tonic::async_trait]
impl NodeService for Nodes {
    async fn list_nodes(
        &self,
        request: Request<pb::ListNodesRequest>,
    ) -> Result<Response<pb::ListNodesResponse>, Status> {
        auth::caller(&request)?;
        let route = self.route(&request);
        let req = request.into_inner();
        check_version(req.protocol_version).map_err(version)?;
        if let Some(mut leader) = route? {
            return leader
                .list_nodes(self.forwarded(req))
                .await
                .map_err(|s| self.forward_failed(s));
        }
        let nodes = self.operator.nodes();
        Ok(Response::new(pb::ListNodesResponse {
            nodes: nodes.iter().map(node_to_wire).collect(),
        }))
    }

    async fn get_version(
        &self,
        request: Request<pb::GetVersionRequest>,
    ) -> Result<Response<pb::VersionInfo>, Status> {
        auth::caller(&request)?;
        check_version(request.into_inner().protocol_version).map_err(version)?;
        Ok(Response::new(pb::VersionInfo {
            operator_version: env!("CARGO_PKG_VERSION").to_owned(),
            protocol_version: census_proto::PROTOCOL_VERSION,
            store: self.operator.settings().store_kind.to_owned(),
            id_range: self.operator.id_range().to_string(),
        }))
    }

    async fn get_node(
        &self,
        request: Request<pb::GetNodeRequest>,
    ) -> Result<Response<pb::Node>, Status> {
        auth::caller(&request)?;
        let route = self.route(&request);
        let req = request.into_inner();
        check_version(req.protocol_version).map_err(version)?;
        let name = node_from_wire(&req.name, "name").map_err(field)?;
        if let Some(mut leader) = route? {
            return leader
                .get_node(self.forwarded(req))
                .await
                .map_err(|s| self.forward_failed(s));
        }
        match self.operator.node(&name) {
            Some(info) => Ok(Response::new(node_to_wire(&info))),
            None => Err(Status::not_found(format!("node {name} is not known"))),
        }
    }
}
