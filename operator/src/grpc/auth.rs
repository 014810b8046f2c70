//! Who is calling, and whether they may: the [`Authenticate`] trait (mutual TLS in
//! embedded mode, bearer tokens checked by a TokenReview in a cluster, nothing on
//! loopback) and the node binding every handler applies (DESIGN.md,
//! "Authentication and node binding").
//!
//! A node-bound call (EndpointSync's Hello, Allocate, EndpointMap.Watch) proceeds
//! only for [`Principal::Node`] naming the request's node, or [`Principal::Loopback`];
//! a read needs any principal. Health and reflection stay open (they never reach
//! these services). The check runs before a handler touches the operator, so a
//! refused call changes no state.

use std::{
    future::Future,
    net::{IpAddr, SocketAddr},
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::{Duration, SystemTime},
};

use census_proto::domain::NodeName;
use futures::{Stream, StreamExt as _};
use tonic::transport::{
    CertificateDer,
    server::{TcpConnectInfo, TlsConnectInfo},
};
use tower::{Layer, Service};
use tracing::debug;

use crate::certs::{CertSubject, NodeCa, Verified};

/// What a connection and a request prove about the caller.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Credentials<'a> {
    /// The verified client certificate chain (mTLS), leaf first, if any.
    pub(crate) certs: Option<&'a [CertificateDer<'static>]>,
    /// The `authorization: Bearer` token, if any (already stripped of "Bearer ").
    pub(crate) bearer: Option<&'a str>,
    pub(crate) peer: Option<SocketAddr>,
}

/// Who the caller is, once authenticated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Principal {
    /// An agent, speaking for exactly this node, until `expires` (a token's expiry,
    /// or the end of its certificate chain's validity), and for the node addresses
    /// its credentials vouch for.
    Node {
        node: NodeName,
        expires: Option<SystemTime>,
        addresses: Vouched,
    },
    /// A reader (the CLI, a tool): may read, never speak for a node.
    Reader {
        name: String,
        expires: Option<SystemTime>,
    },
    /// No authentication configured: only possible when the operator listens on
    /// loopback without TLS (development, the embedded default); trusted as any node.
    Loopback,
}

/// The node addresses a principal's credentials vouch for: what its Hello may claim
/// as the node's own (`remote-node` in the endpoint map, embedded mode).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Vouched {
    /// Whatever the Hello names: a loopback caller (trusted as any node), or a
    /// token (in a cluster, where the Node object is the authority and Hello
    /// addresses are not taken).
    Any,
    /// These only: a client certificate's IP SANs (`census-operator certs --node
    /// NAME --node-ip ADDRESS`), none for a certificate without them.
    Only(Arc<[IpAddr]>),
}

impl Vouched {
    /// `addresses` split into those vouched for and those not.
    pub(crate) fn split(&self, addresses: Vec<IpAddr>) -> (Vec<IpAddr>, Vec<IpAddr>) {
        match self {
            Self::Any => (addresses, Vec::new()),
            Self::Only(own) => addresses
                .into_iter()
                .partition(|ip| own.contains(&ip.to_canonical())),
        }
    }
}

impl Principal {
    /// The node addresses this principal's Hello may claim.
    pub(crate) fn vouched(&self) -> Vouched {
        match self {
            Self::Node { addresses, .. } => addresses.clone(),
            Self::Loopback => Vouched::Any,
            Self::Reader { .. } => Vouched::Only(Arc::from([])),
        }
    }

    /// When this principal's credentials stop being valid, if they do.
    pub(crate) fn expires(&self) -> Option<SystemTime> {
        match self {
            Self::Node { expires, .. } | Self::Reader { expires, .. } => *expires,
            Self::Loopback => None,
        }
    }
}

impl std::fmt::Display for Principal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Node { node, .. } => write!(f, "node {node}"),
            Self::Reader { name, .. } => write!(f, "reader {}", bounded(name)),
            Self::Loopback => f.write_str("a loopback caller"),
        }
    }
}

/// An authentication answer, computed off the handler.
pub(crate) type AuthFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Principal, AuthError>> + Send + 'a>>;

/// Turns a request's [`Credentials`] into a [`Principal`], or refuses.
pub(crate) trait Authenticate: Send + Sync + 'static {
    fn authenticate<'a>(&'a self, credentials: Credentials<'a>) -> AuthFuture<'a>;
}

/// The longest caller-supplied text an error message repeats.
const MAX_QUOTED: usize = 128;

/// `text`, cut to [`MAX_QUOTED`] bytes and escaped, for a log line or a status
/// message.
pub(crate) fn bounded(text: &str) -> String {
    let head = census_proto::text::cut(text, MAX_QUOTED);
    head.chars().flat_map(char::escape_debug).collect()
}

/// Refusals: UNAUTHENTICATED (no or bad credentials), PERMISSION_DENIED
/// (authenticated, but not as the node the request names / a reader on a node-bound
/// call), UNAVAILABLE (the check itself could not be made, e.g. a TokenReview).
/// Messages are bounded (see [`bounded`]) and name the problem.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum AuthError {
    /// No credentials, or credentials that prove nothing. Becomes UNAUTHENTICATED.
    #[error("{0}")]
    Unauthenticated(String),
    /// A principal that may not make this call. Becomes PERMISSION_DENIED.
    #[error("{0}")]
    PermissionDenied(String),
    /// The credentials could not be checked now. Becomes UNAVAILABLE.
    #[error("{0}")]
    Unavailable(String),
}

impl AuthError {
    /// UNAUTHENTICATED with `message`.
    pub(crate) fn unauthenticated(message: impl std::fmt::Display) -> Self {
        Self::Unauthenticated(bounded_message(message))
    }

    /// PERMISSION_DENIED with `message`.
    pub(crate) fn permission_denied(message: impl std::fmt::Display) -> Self {
        Self::PermissionDenied(bounded_message(message))
    }

    /// UNAVAILABLE with `message`.
    pub(crate) fn unavailable(message: impl std::fmt::Display) -> Self {
        Self::Unavailable(bounded_message(message))
    }
}

/// The longest status message an [`AuthError`] carries.
const MAX_MESSAGE: usize = 512;

fn bounded_message(message: impl std::fmt::Display) -> String {
    census_proto::text::cut(&message.to_string(), MAX_MESSAGE).into_owned()
}

impl From<AuthError> for tonic::Status {
    fn from(error: AuthError) -> Self {
        match error {
            AuthError::Unauthenticated(m) => Self::unauthenticated(m),
            AuthError::PermissionDenied(m) => Self::permission_denied(m),
            AuthError::Unavailable(m) => Self::unavailable(m),
        }
    }
}

/// The gRPC paths anyone may call: health checks (the kubelet's probes, load
/// balancers) and reflection (service descriptions, no data).
fn is_open(path: &str) -> bool {
    path.starts_with("/grpc.health.v1.Health/") || path.starts_with("/grpc.reflection.")
}

/// The bearer token of an `authorization` header: `Bearer TOKEN` (the scheme is
/// case-insensitive, RFC 9110 section 11.1). No header is no token; any other
/// value is refused rather than ignored.
fn bearer(headers: &http::HeaderMap) -> Result<Option<String>, AuthError> {
    let Some(value) = headers.get(http::header::AUTHORIZATION) else {
        return Ok(None);
    };
    let refused = || AuthError::unauthenticated("the authorization metadata is not `Bearer TOKEN`");
    let value = value.to_str().map_err(|_| refused())?;
    let (scheme, token) = value.split_once(' ').ok_or_else(refused)?;
    let token = token.trim();
    if !scheme.eq_ignore_ascii_case("bearer") || token.is_empty() {
        return Err(refused());
    }
    Ok(Some(token.to_owned()))
}

/// The verified client certificate chain and the peer's address of the connection a
/// request came on, as tonic's transport records them.
fn connection(
    extensions: &http::Extensions,
) -> (
    Option<Arc<Vec<CertificateDer<'static>>>>,
    Option<SocketAddr>,
) {
    if let Some(tls) = extensions.get::<TlsConnectInfo<TcpConnectInfo>>() {
        return (tls.peer_certs(), tls.get_ref().remote_addr());
    }
    let peer = extensions
        .get::<TcpConnectInfo>()
        .and_then(TcpConnectInfo::remote_addr);
    (None, peer)
}

/// Authenticates every call but health and reflection before its service sees it
/// (before its message is decoded), and hands the [`Principal`] to the handler in the
/// request's extensions. A refusal is answered here, with the status of its
/// [`AuthError`].
#[derive(Clone)]
pub(crate) struct AuthLayer {
    auth: Arc<dyn Authenticate>,
}

impl AuthLayer {
    pub(crate) fn new(auth: Arc<dyn Authenticate>) -> Self {
        Self { auth }
    }
}

impl<S> Layer<S> for AuthLayer {
    type Service = Authenticated<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Authenticated {
            inner,
            auth: Arc::clone(&self.auth),
        }
    }
}

/// The service of [`AuthLayer`].
#[derive(Clone)]
pub(crate) struct Authenticated<S> {
    inner: S,
    auth: Arc<dyn Authenticate>,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B, RB> Service<http::Request<B>> for Authenticated<S>
where
    S: Service<http::Request<B>, Response = http::Response<RB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Send + 'static,
    RB: Default + Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        if is_open(request.uri().path()) {
            return Box::pin(self.inner.call(request));
        }
        // The clone may not be ready: call the one that is, keep the clone.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let auth = Arc::clone(&self.auth);
        Box::pin(async move {
            let (certs, peer) = connection(request.extensions());
            let answer = match bearer(request.headers()) {
                Ok(token) => {
                    auth.authenticate(Credentials {
                        certs: certs.as_deref().map(Vec::as_slice),
                        bearer: token.as_deref(),
                        peer,
                    })
                    .await
                }
                Err(refusal) => Err(refusal),
            };
            match answer {
                Ok(principal) => {
                    request.extensions_mut().insert(principal);
                    inner.call(request).await
                }
                Err(refusal) => {
                    debug!(?peer, "refused a call: {refusal}");
                    Ok(tonic::Status::from(refusal).into_http())
                }
            }
        })
    }
}

/// The authenticated caller of a request. Every handler but health's and
/// reflection's starts here; a request that did not pass [`AuthLayer`] has none and is
/// refused.
pub(crate) fn caller<T>(request: &tonic::Request<T>) -> Result<Principal, tonic::Status> {
    request
        .extensions()
        .get::<Principal>()
        .cloned()
        .ok_or_else(|| tonic::Status::unauthenticated("the call was not authenticated"))
}

/// The binding rule of a node-bound call (EndpointSync's Hello, Allocate,
/// EndpointMap.Watch): only `node` itself, or a loopback caller when nothing is
/// configured, may speak for `node`.
pub(crate) fn speaks_for(principal: &Principal, node: &NodeName) -> Result<(), tonic::Status> {
    match principal {
        Principal::Node { node: own, .. } if own == node => Ok(()),
        Principal::Loopback => Ok(()),
        Principal::Node { node: own, .. } => Err(AuthError::permission_denied(format!(
            "the caller is authenticated as node {own} and may not speak for node {node}"
        ))
        .into()),
        Principal::Reader { name, .. } => Err(AuthError::permission_denied(format!(
            "reader {} may read, not speak for node {node}",
            bounded(name)
        ))
        .into()),
    }
}

/// The status that ends a stream whose credentials expired.
fn expired_status() -> tonic::Status {
    tonic::Status::unauthenticated("credentials expired: open a new stream with fresh credentials")
}

/// A response stream that [`until_expired`] ends when its caller's credentials expire.
pub(crate) type Expiring<T> = Pin<Box<dyn Stream<Item = Result<T, tonic::Status>> + Send>>;

/// A response stream of a caller whose credentials expire at `expires`: ends with
/// UNAUTHENTICATED then. Dropping the inner stream is what tells its producer (an
/// EndpointSync stream's task, a watch) that the caller went away.
pub(crate) fn until_expired<S, T>(stream: S, expires: Option<SystemTime>) -> Expiring<T>
where
    S: Stream<Item = Result<T, tonic::Status>> + Send + 'static,
    T: Send + 'static,
{
    let Some(at) = expires else {
        return Box::pin(stream);
    };
    let left = at
        .duration_since(SystemTime::now())
        .unwrap_or(Duration::ZERO);
    let deadline = Box::pin(tokio::time::sleep(left));
    let state = Some((Box::pin(stream), deadline));
    Box::pin(futures::stream::unfold(state, |state| async move {
        let (mut stream, mut deadline) = state?;
        tokio::select! {
            biased;
            () = &mut deadline => Some((Err(expired_status()), None)),
            item = stream.next() => item.map(|item| (item, Some((stream, deadline)))),
        }
    }))
}

/// No authentication: for an operator listening on loopback without TLS. A caller
/// from anywhere else (which the listener should make impossible) is refused.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct LoopbackOnly;

impl Authenticate for LoopbackOnly {
    fn authenticate<'a>(&'a self, credentials: Credentials<'a>) -> AuthFuture<'a> {
        let answer = match credentials.peer {
            Some(peer) if peer.ip().to_canonical().is_loopback() => Ok(Principal::Loopback),
            _ => Err(AuthError::unauthenticated(
                "this operator runs without TLS and accepts loopback callers only",
            )),
        };
        Box::pin(std::future::ready(answer))
    }
}

/// Mutual TLS (embedded mode): the client certificate, verified at the handshake
/// against `--client-ca`, names the caller: `census://node/NAME` an agent,
/// `census://reader/NAME` a reader; a node's IP SANs are the addresses it may claim
/// as its own. The chain is checked again here with
/// [`NodeCa`], so what binds a node never rests on the TLS configuration alone.
#[derive(Debug)]
pub(crate) struct MutualTls {
    ca: NodeCa,
}

impl MutualTls {
    pub(crate) fn new(ca: NodeCa) -> Self {
        Self { ca }
    }

    fn principal(&self, credentials: Credentials<'_>) -> Result<Principal, AuthError> {
        let chain = credentials.certs.ok_or_else(|| {
            AuthError::unauthenticated("no client certificate: this operator requires mutual TLS")
        })?;
        // A stream this certificate authenticated ends when the certificate does:
        // an agent reconnects with the renewed one.
        match self.ca.verify(chain) {
            Ok(Verified {
                subject: CertSubject::Node(node),
                not_after,
                addresses,
            }) => Ok(Principal::Node {
                node,
                expires: Some(not_after),
                addresses: Vouched::Only(addresses.into()),
            }),
            Ok(Verified {
                subject: CertSubject::Reader(name),
                not_after,
                ..
            }) => Ok(Principal::Reader {
                name,
                expires: Some(not_after),
            }),
            Err(e) => Err(AuthError::unauthenticated(e)),
        }
    }
}

impl Authenticate for MutualTls {
    fn authenticate<'a>(&'a self, credentials: Credentials<'a>) -> AuthFuture<'a> {
        Box::pin(std::future::ready(self.principal(credentials)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str) -> NodeName {
        NodeName::new(name).unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    #[test]
    fn only_the_node_itself_or_loopback_speaks_for_a_node() {
        let a = Principal::Node {
            node: node("node-a"),
            expires: None,
            addresses: Vouched::Any,
        };
        assert!(speaks_for(&a, &node("node-a")).is_ok());
        assert!(speaks_for(&Principal::Loopback, &node("node-b")).is_ok());
        let refused = speaks_for(&a, &node("node-b")).err();
        assert_eq!(
            refused.map(|s| s.code()),
            Some(tonic::Code::PermissionDenied)
        );
        let reader = Principal::Reader {
            name: "cli".into(),
            expires: None,
        };
        let refused = speaks_for(&reader, &node("node-a")).err();
        assert_eq!(
            refused.map(|s| s.code()),
            Some(tonic::Code::PermissionDenied)
        );
    }

    #[test]
    fn a_request_that_was_not_authenticated_is_refused() {
        let refused = caller(&tonic::Request::new(())).err();
        assert_eq!(
            refused.map(|s| s.code()),
            Some(tonic::Code::Unauthenticated)
        );
    }

    #[test]
    fn the_authorization_metadata_is_a_bearer_token_or_refused() {
        let with = |value: &str| {
            let mut headers = http::HeaderMap::new();
            headers.insert(
                http::header::AUTHORIZATION,
                http::HeaderValue::from_str(value).unwrap_or_else(|e| panic!("{value}: {e}")),
            );
            bearer(&headers)
        };
        assert_eq!(bearer(&http::HeaderMap::new()), Ok(None));
        assert_eq!(with("Bearer abc.def"), Ok(Some("abc.def".to_owned())));
        assert_eq!(with("bearer abc"), Ok(Some("abc".to_owned())));
        for bad in ["Basic dXNlcg==", "Bearer", "Bearer  ", "abc"] {
            assert!(
                matches!(with(bad), Err(AuthError::Unauthenticated(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn messages_and_quoted_text_are_bounded() {
        let long = "x".repeat(10_000);
        assert!(bounded(&long).len() <= MAX_QUOTED + 3);
        assert_eq!(bounded("a\nb"), "a\\nb");
        let AuthError::Unauthenticated(m) = AuthError::unauthenticated(&long) else {
            panic!("not UNAUTHENTICATED");
        };
        assert!(m.len() <= MAX_MESSAGE + 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_ends_unauthenticated_when_its_credentials_expire() {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<u32, tonic::Status>>(4);
        let expires = SystemTime::now() + Duration::from_secs(60);
        let mut stream = until_expired(
            tokio_stream::wrappers::ReceiverStream::new(rx),
            Some(expires),
        );
        let _ = tx.send(Ok(1)).await;
        assert_eq!(stream.next().await.map(|r| r.ok()), Some(Some(1)));
        // Nothing more is sent: the stream ends at the expiry, with UNAUTHENTICATED.
        let end = tokio::time::timeout(Duration::from_secs(120), stream.next())
            .await
            .ok()
            .flatten();
        assert_eq!(
            end.and_then(|r| r.err()).map(|s| s.code()),
            Some(tonic::Code::Unauthenticated)
        );
        assert!(stream.next().await.is_none());
        assert!(tx.is_closed(), "the producer was not told");
        // Without an expiry, the stream is the producer's.
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<u32, tonic::Status>>(4);
        let mut stream = until_expired(tokio_stream::wrappers::ReceiverStream::new(rx), None);
        drop(tx);
        assert!(stream.next().await.is_none());
    }
}
