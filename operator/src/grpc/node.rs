//! NodeService: what the operator knows of each node, for the CLI and for people.
//!
//! Only the leader knows nodes (sessions and views live in its core), so a follower
//! forwards ListNodes and GetNode to the leader whose address the Lease publishes, and
//! answers UNAVAILABLE naming it if that fails. A forwarded call is never forwarded
//! again. GetVersion is answered by every replica.
//!
//! A call is forwarded only once this replica authenticated it, with the caller's own
//! `authorization` metadata (its bearer token) and nothing of this replica's, so the
//! leader authenticates the original caller itself. When this replica serves TLS the
//! leader is reached over TLS too, verified with `--tls-ca` by the serving
//! certificate's first DNS name (every replica serves the one certificate; the
//! leader is reached by its pod IP); without `--tls-ca`, or when callers prove
//! themselves with client certificates (which cannot be forwarded), the follower
//! answers UNAVAILABLE naming the leader and why, and never falls back to plain
//! HTTP/2.

use std::{sync::Arc, time::Duration};

use census_proto::{
    convert::{check_version, node_from_wire},
    pb::{self, node_service_client::NodeServiceClient, node_service_server::NodeService},
};
use parking_lot::Mutex;
use tonic::{
    Request, Response, Status,
    metadata::{AsciiMetadataValue, MetadataValue},
    transport::{Certificate, Channel, ClientTlsConfig},
};
use tracing::warn;

use super::{
    Operator, ServerTls, auth,
    convert::node_to_wire,
    status::{field, not_leader_status, version},
};
use crate::api::{Leader, NotLeader, Role};

/// Marks a call one replica forwarded to another.
const FORWARDED: &str = "census-forwarded";
/// The caller's credentials, forwarded as they came.
const AUTHORIZATION: &str = "authorization";
/// How long a forwarded call may take.
const FORWARD_TIMEOUT: Duration = Duration::from_secs(5);

/// How this replica reaches the leader, from its own TLS.
#[derive(Debug, Clone)]
enum Upstream {
    /// No TLS here (loopback only): plain HTTP/2.
    Plain,
    /// TLS verified with `--tls-ca`, for the serving certificate's first DNS name.
    Tls(ClientTlsConfig),
    /// TLS here and no `--tls-ca`: nothing to verify the leader with.
    NoCa,
    /// Callers prove themselves with client certificates, which cannot be forwarded.
    ClientCertificates,
}

impl Upstream {
    fn new(tls: Option<&ServerTls>) -> Self {
        match tls {
            None => Self::Plain,
            Some(ServerTls {
                client_ca_pem: Some(_),
                ..
            }) => Self::ClientCertificates,
            Some(ServerTls {
                leader: Some(leader),
                ..
            }) => Self::Tls(
                ClientTlsConfig::new()
                    .ca_certificate(Certificate::from_pem(&leader.ca_pem))
                    .domain_name(leader.server_name.clone()),
            ),
            Some(ServerTls { leader: None, .. }) => {
                warn!(
                    "no --tls-ca: as a follower this replica answers NodeService calls UNAVAILABLE instead of forwarding them to the leader over TLS"
                );
                Self::NoCa
            }
        }
    }

    fn scheme(&self) -> &'static str {
        match self {
            Self::Plain => "http",
            _ => "https",
        }
    }
}

/// A call on its way to the leader: the client, and the caller's credentials.
struct Forward {
    client: NodeServiceClient<Channel>,
    authorization: Option<AsciiMetadataValue>,
}

#[derive(Debug, Clone)]
pub(crate) struct Nodes {
    operator: Operator,
    upstream: Upstream,
    /// A channel to the leader, by its address, reused while the leader stays.
    leader: Arc<Mutex<Option<(String, Channel)>>>,
}

impl Nodes {
    /// `tls` is this replica's own: a follower reaches the leader over TLS when it
    /// serves TLS.
    pub(crate) fn new(operator: Operator, tls: Option<&ServerTls>) -> Self {
        Self {
            operator,
            upstream: Upstream::new(tls),
            leader: Arc::new(Mutex::new(None)),
        }
    }

    /// `None` to answer here; the call to forward; or why neither is possible.
    fn route<T>(&self, request: &Request<T>) -> Result<Option<Forward>, Status> {
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
        let why_not = |why: &str| {
            let status = refusal();
            Status::with_metadata(
                status.code(),
                format!("{}; {why}", status.message()),
                status.metadata().clone(),
            )
        };
        let tls = match &self.upstream {
            Upstream::Plain => None,
            Upstream::Tls(tls) => Some(tls.clone()),
            Upstream::NoCa => {
                return Err(why_not(
                    "this replica serves TLS and was started without --tls-ca (the CA that signed the serving certificate), so it cannot verify the leader to forward the call: call the leader, or give the replicas --tls-ca",
                ));
            }
            Upstream::ClientCertificates => {
                return Err(why_not(
                    "callers' client certificates cannot be forwarded: call the leader",
                ));
            }
        };
        let mut cached = self.leader.lock();
        let channel = match cached.as_ref() {
            Some((addr, channel)) if addr == address => channel.clone(),
            _ => {
                let mut endpoint =
                    Channel::from_shared(format!("{}://{address}", self.upstream.scheme()))
                        .map_err(|_| refusal())?
                        .connect_timeout(FORWARD_TIMEOUT)
                        .timeout(FORWARD_TIMEOUT);
                if let Some(tls) = tls {
                    endpoint = endpoint.tls_config(tls).map_err(|e| {
                        why_not(&format!("TLS to the leader cannot be set up: {e}"))
                    })?;
                }
                let channel = endpoint.connect_lazy();
                *cached = Some((address.clone(), channel.clone()));
                channel
            }
        };
        Ok(Some(Forward {
            client: NodeServiceClient::new(channel),
            authorization: request.metadata().get(AUTHORIZATION).cloned(),
        }))
    }

    /// `message` as the leader gets it: marked forwarded, with the caller's own
    /// credentials and nothing else of its metadata.
    fn forwarded<T>(&self, authorization: Option<AsciiMetadataValue>, message: T) -> Request<T> {
        let mut request = Request::new(message);
        let metadata = request.metadata_mut();
        metadata.insert(FORWARDED, MetadataValue::from_static("1"));
        if let Some(authorization) = authorization {
            metadata.insert(AUTHORIZATION, authorization);
        }
        request
    }

    fn forward_failed(&self, status: Status) -> Status {
        let leader = match self.operator.role() {
            Role::Follower { leader: Some(l) } => l.to_string(),
            _ => "the leader".to_owned(),
        };
        if matches!(
            status.code(),
            tonic::Code::NotFound
                | tonic::Code::InvalidArgument
                | tonic::Code::FailedPrecondition
                // The leader refused the caller's own credentials.
                | tonic::Code::Unauthenticated
                | tonic::Code::PermissionDenied
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
        if let Some(Forward {
            mut client,
            authorization,
        }) = route?
        {
            return client
                .list_nodes(self.forwarded(authorization, req))
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
        if let Some(Forward {
            mut client,
            authorization,
        }) = route?
        {
            return client
                .get_node(self.forwarded(authorization, req))
                .await
                .map_err(|s| self.forward_failed(s));
        }
        match self.operator.node(&name) {
            Some(info) => Ok(Response::new(node_to_wire(&info))),
            None => Err(Status::not_found(format!("node {name} is not known"))),
        }
    }
}
