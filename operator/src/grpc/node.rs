//! NodeService: what the operator knows of each node, for the CLI and for people.

use std::sync::Arc;

use census_proto::{
    convert::{check_version, node_from_wire},
    pb::{self, node_service_server::NodeService},
};
use tonic::{Request, Response, Status};

use super::convert::{field, node_to_wire, version};
use crate::runtime::Runtime;

#[derive(Debug, Clone)]
pub struct Nodes {
    runtime: Arc<Runtime>,
}

impl Nodes {
    pub fn new(runtime: Arc<Runtime>) -> Self {
        Self { runtime }
    }
}

#[tonic::async_trait]
impl NodeService for Nodes {
    async fn list_nodes(
        &self,
        request: Request<pb::ListNodesRequest>,
    ) -> Result<Response<pb::ListNodesResponse>, Status> {
        check_version(request.into_inner().protocol_version).map_err(version)?;
        let nodes = self.runtime.read(|a| a.nodes());
        Ok(Response::new(pb::ListNodesResponse {
            nodes: nodes.iter().map(node_to_wire).collect(),
        }))
    }

    async fn get_version(
        &self,
        request: Request<pb::GetVersionRequest>,
    ) -> Result<Response<pb::VersionInfo>, Status> {
        check_version(request.into_inner().protocol_version).map_err(version)?;
        Ok(Response::new(pb::VersionInfo {
            operator_version: env!("CARGO_PKG_VERSION").to_owned(),
            protocol_version: census_proto::PROTOCOL_VERSION,
            store: self.runtime.settings.store_kind.to_owned(),
            id_range: self.runtime.read(|a| a.range()).to_string(),
        }))
    }

    async fn get_node(
        &self,
        request: Request<pb::GetNodeRequest>,
    ) -> Result<Response<pb::Node>, Status> {
        let req = request.into_inner();
        check_version(req.protocol_version).map_err(version)?;
        let name = node_from_wire(&req.name, "name").map_err(field)?;
        match self.runtime.read(|a| a.node(&name)) {
            Some(info) => Ok(Response::new(node_to_wire(&info))),
            None => Err(Status::not_found(format!("node {name} is not known"))),
        }
    }
}
