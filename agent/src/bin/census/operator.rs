//! The operator over gRPC: IdentityService and NodeService, every call bounded by
//! `--timeout`, every refusal mapped to a [`CliError`] with its exit code. Also the
//! look-up that gives tables the labels of the identities they show.

use std::{collections::BTreeMap, future::Future, time::Duration};

use census_agent::client::{AccessFiles, OperatorChannel, TlsFiles};
use census_proto::{
    PROTOCOL_VERSION,
    domain::IdentityId,
    pb::{
        self, endpoint_map_client::EndpointMapClient,
        identity_service_client::IdentityServiceClient, node_service_client::NodeServiceClient,
    },
};
use futures::{StreamExt as _, stream};
use tonic::{Code, Status};

use super::{
    args::ServerAddr,
    error::{CliError, Peer, one_line},
    tls_probe,
};

/// Identities per List page.
const IDENTITIES_PER_LIST: u32 = 1000;
/// Get calls in flight at once while looking labels up.
const LOOKUPS_IN_FLIGHT: usize = 16;

/// A connection to the operator.
#[derive(Debug, Clone)]
pub(crate) struct Operator {
    addr: ServerAddr,
    channel: OperatorChannel,
    timeout: Duration,
    /// The TLS files, when the connection is TLS: a refused handshake is diagnosed
    /// with them ([`tls_probe`]).
    tls: Option<TlsFiles>,
}

impl Operator {
    pub(crate) async fn connect(
        addr: &ServerAddr,
        access: &AccessFiles,
        timeout: Duration,
    ) -> Result<Self, CliError> {
        let unreachable = |reason: String| CliError::OperatorUnreachable {
            addr: addr.clone(),
            reason,
        };
        let auth = access.auth().map_err(|e| unreachable(e.to_string()))?;
        let endpoint = census_agent::client::endpoint(&addr.to_string(), auth.tls.as_ref())
            .map_err(|e| unreachable(e.to_string()))?
            .connect_timeout(timeout);
        let tls = access.tls.ca.is_some().then(|| access.tls.clone());
        let channel = match tokio::time::timeout(timeout, endpoint.connect()).await {
            Ok(Ok(channel)) => census_agent::client::with_token(channel, auth.token_file),
            Ok(Err(error)) => {
                if let Some(refused) = handshake_refused(addr, tls.as_ref(), timeout).await {
                    return Err(refused);
                }
                return Err(unreachable(root_cause(&error)));
            }
            Err(_) => return Err(unreachable(no_answer(timeout))),
        };
        Ok(Self {
            addr: addr.clone(),
            channel,
            timeout,
            tls,
        })
    }

    pub(crate) fn addr(&self) -> &ServerAddr {
        &self.addr
    }

    fn identities(&self) -> IdentityServiceClient<OperatorChannel> {
        IdentityServiceClient::new(self.channel.clone())
    }

    fn nodes(&self) -> NodeServiceClient<OperatorChannel> {
        NodeServiceClient::new(self.channel.clone())
    }

    /// Runs one call within the timeout; `Err(Status)` is the operator's answer.
    async fn call<T>(
        &self,
        call: impl Future<Output = Result<tonic::Response<T>, Status>>,
    ) -> Result<Result<T, Status>, CliError> {
        match tokio::time::timeout(self.timeout, call).await {
            // A connection ended under the call: over TLS, the operator may have
            // refused the handshake (TLS 1.3 says so only after it), which the
            // status no longer carries.
            Ok(Err(status))
                if matches!(
                    status.code(),
                    Code::Unavailable | Code::Cancelled | Code::Unknown
                ) =>
            {
                match handshake_refused(&self.addr, self.tls.as_ref(), self.timeout).await {
                    Some(refused) => Err(refused),
                    None => Ok(Err(status)),
                }
            }
            Ok(answer) => Ok(answer.map(tonic::Response::into_inner)),
            Err(_) => Err(CliError::OperatorUnreachable {
                addr: self.addr.clone(),
                reason: no_answer(self.timeout),
            }),
        }
    }

    /// The error for a refusal other than NOT_FOUND (which callers name themselves).
    pub(crate) fn refusal(&self, status: &Status) -> CliError {
        let addr = self.addr.clone();
        let message = one_line(status.message());
        match status.code() {
            Code::InvalidArgument => CliError::Refused { addr, message },
            Code::FailedPrecondition if message.contains("protocol version") => {
                CliError::Incompatible {
                    peer: Peer::Operator,
                    addr,
                    message,
                }
            }
            Code::Unavailable | Code::Cancelled | Code::DeadlineExceeded => {
                CliError::OperatorUnreachable {
                    addr,
                    reason: if message.is_empty() {
                        status.code().to_string()
                    } else {
                        message
                    },
                }
            }
            code => CliError::OperatorFailed {
                addr,
                code,
                message,
            },
        }
    }

    /// Every identity matching `selector` (all pages).
    pub(crate) async fn list_identities(
        &self,
        selector: Vec<String>,
        include_quarantined: bool,
    ) -> Result<Vec<pb::Identity>, CliError> {
        let mut client = self.identities();
        let mut all = Vec::new();
        let mut page_token = String::new();
        loop {
            let request = pb::ListRequest {
                protocol_version: PROTOCOL_VERSION,
                page_size: IDENTITIES_PER_LIST,
                page_token,
                selector: selector.clone(),
                include_quarantined,
            };
            let page = self
                .call(client.list(request))
                .await?
                .map_err(|status| self.refusal(&status))?;
            all.extend(page.identities);
            if page.next_page_token.is_empty() {
                return Ok(all);
            }
            page_token = page.next_page_token;
        }
    }

    /// The identity `id`: `Ok(None)` if the operator does not know it.
    pub(crate) async fn get_identity(&self, id: u32) -> Result<Option<pb::Identity>, CliError> {
        let request = pb::GetRequest {
            protocol_version: PROTOCOL_VERSION,
            id,
        };
        match self.call(self.identities().get(request)).await? {
            Ok(identity) => Ok(Some(identity)),
            Err(status) if status.code() == Code::NotFound => Ok(None),
            Err(status) => Err(self.refusal(&status)),
        }
    }

    /// The identity of exactly these labels: `Ok(None)` if there is none.
    pub(crate) async fn lookup(
        &self,
        labels: Vec<String>,
    ) -> Result<Option<pb::Identity>, CliError> {
        let request = pb::LookupRequest {
            protocol_version: PROTOCOL_VERSION,
            labels,
        };
        match self.call(self.identities().lookup(request)).await? {
            Ok(identity) => Ok(Some(identity)),
            Err(status) if status.code() == Code::NotFound => Ok(None),
            Err(status) => Err(self.refusal(&status)),
        }
    }

    /// The claims of `ip` in the cluster-wide endpoint map: `Ok(None)` if nothing is
    /// known of it.
    pub(crate) async fn map_lookup(
        &self,
        ip: std::net::IpAddr,
    ) -> Result<Option<pb::EndpointMapLookupResponse>, CliError> {
        let request = pb::EndpointMapLookupRequest {
            protocol_version: PROTOCOL_VERSION,
            ip: ip.to_string(),
        };
        let mut client = EndpointMapClient::new(self.channel.clone());
        match self.call(client.lookup(request)).await? {
            Ok(found) => Ok(Some(found)),
            Err(status) if status.code() == Code::NotFound => Ok(None),
            Err(status) => Err(self.refusal(&status)),
        }
    }

    pub(crate) async fn list_nodes(&self) -> Result<Vec<pb::Node>, CliError> {
        let request = pb::ListNodesRequest {
            protocol_version: PROTOCOL_VERSION,
        };
        self.call(self.nodes().list_nodes(request))
            .await?
            .map(|answer| answer.nodes)
            .map_err(|status| self.refusal(&status))
    }

    /// The node `name`: `Ok(None)` if the operator does not know it.
    pub(crate) async fn get_node(&self, name: &str) -> Result<Option<pb::Node>, CliError> {
        let request = pb::GetNodeRequest {
            protocol_version: PROTOCOL_VERSION,
            name: name.to_owned(),
        };
        match self.call(self.nodes().get_node(request)).await? {
            Ok(node) => Ok(Some(node)),
            Err(status) if status.code() == Code::NotFound => Ok(None),
            Err(status) => Err(self.refusal(&status)),
        }
    }

    pub(crate) async fn version(&self) -> Result<pb::VersionInfo, CliError> {
        let request = pb::GetVersionRequest {
            protocol_version: PROTOCOL_VERSION,
        };
        self.call(self.nodes().get_version(request))
            .await?
            .map_err(|status| self.refusal(&status))
    }
}

/// [`CliError::TlsRefused`] when the operator at `addr` refuses a TLS handshake
/// made with `tls` (none: the connection is not TLS).
async fn handshake_refused(
    addr: &ServerAddr,
    tls: Option<&TlsFiles>,
    within: Duration,
) -> Option<CliError> {
    let tls = tls?;
    let alert = tls_probe::refusal(addr.authority(), tls, within).await?;
    Some(CliError::TlsRefused {
        addr: addr.clone(),
        alert,
        presented: tls.cert.is_some(),
    })
}

fn no_answer(timeout: Duration) -> String {
    format!("no answer within {}", humantime::format_duration(timeout))
}

/// The innermost cause of a transport error ("Connection refused (os error 111)"),
/// which says more than its outer layers ("transport error").
pub(crate) fn root_cause(error: &(dyn std::error::Error + 'static)) -> String {
    let mut cause = error;
    while let Some(source) = cause.source() {
        cause = source;
    }
    one_line(&cause.to_string())
}

/// The labels of the identities a table shows, looked up at the operator.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct IdentityLabels {
    /// `None`: not looked up (`-n`, JSON or YAML, or the operator is unreachable);
    /// tables then have no label column.
    labels: Option<BTreeMap<u32, Option<Vec<String>>>>,
}

/// What a label column shows for an identity the operator does not know.
const UNKNOWN: &str = "(unknown)";

impl IdentityLabels {
    /// No look-up: tables show numbers only.
    pub(crate) fn none() -> Self {
        Self::default()
    }

    /// Looks up every identity in `ids` (reserved ones are named locally, as the
    /// operator names them: `reserved:host=`). When the
    /// operator cannot answer, says so in `notes` and looks nothing up.
    pub(crate) async fn look_up(
        addr: &ServerAddr,
        access: &AccessFiles,
        timeout: Duration,
        ids: impl IntoIterator<Item = u32>,
        notes: &mut Vec<String>,
    ) -> Self {
        let mut found = BTreeMap::new();
        let mut remote = Vec::new();
        for id in ids {
            match IdentityId::new(id).and_then(IdentityId::reserved_name) {
                Some(name) => {
                    found.insert(id, Some(vec![format!("reserved:{name}=")]));
                }
                None => remote.push(id),
            }
        }
        remote.sort_unstable();
        remote.dedup();
        if !remote.is_empty() {
            let answers = match Operator::connect(addr, access, timeout).await {
                Ok(operator) => {
                    stream::iter(remote)
                        .map(|id| {
                            let operator = operator.clone();
                            async move { (id, operator.get_identity(id).await) }
                        })
                        .buffer_unordered(LOOKUPS_IN_FLIGHT)
                        .collect::<Vec<_>>()
                        .await
                }
                Err(error) => {
                    notes.push(labels_skipped(&error));
                    return Self::none();
                }
            };
            for (id, answer) in answers {
                match answer {
                    Ok(identity) => {
                        found.insert(id, identity.map(|identity| identity.labels));
                    }
                    Err(error) => {
                        notes.push(labels_skipped(&error));
                        return Self::none();
                    }
                }
            }
        }
        Self {
            labels: Some(found),
        }
    }

    /// Fixed labels, for tests.
    #[cfg(test)]
    pub(crate) fn fixed(labels: &[(u32, &[&str])]) -> Self {
        Self {
            labels: Some(
                labels
                    .iter()
                    .map(|(id, labels)| {
                        (*id, Some(labels.iter().map(|l| (*l).to_owned()).collect()))
                    })
                    .collect(),
            ),
        }
    }

    /// Whether tables get a label column.
    pub(crate) fn shown(&self) -> bool {
        self.labels.is_some()
    }

    /// The label cell of `id`: its labels joined by commas.
    pub(crate) fn cell(&self, id: u32) -> String {
        match self.labels.as_ref().and_then(|labels| labels.get(&id)) {
            Some(Some(labels)) => labels.join(","),
            _ => UNKNOWN.to_owned(),
        }
    }
}

fn labels_skipped(error: &CliError) -> String {
    let why = match error {
        CliError::OperatorUnreachable { addr, reason } => {
            format!("cannot reach the operator at {addr} ({reason})")
        }
        other => other.one_line(),
    };
    format!("labels not shown: {why}; -n skips the look-up")
}
