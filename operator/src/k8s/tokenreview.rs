//! Agents' bearer tokens, checked by a `TokenReview` (DESIGN.md, "Authentication and
//! node binding").
//!
//! An agent sends its projected ServiceAccount token (audience `--token-audience`,
//! `census` by default). The operator asks the API server (`POST
//! authentication.k8s.io/v1 tokenreviews`, `spec.audiences: [audience]`) and binds the
//! caller to a node only if:
//!
//! - `status.authenticated` is true and the audience is in `status.audiences` (the
//!   API server answers the intersection of the review's and the token's audiences:
//!   kubernetes `pkg/serviceaccount/jwt.go`; a webhook authenticator may answer
//!   none, which proves nothing about this audience);
//! - `status.user.username` is exactly the agents' ServiceAccount
//!   (`--agent-service-account`, `system:serviceaccount:NAMESPACE:NAME`); any other
//!   account is authenticated but may not speak for a node: PERMISSION_DENIED;
//! - the node is the token's pod binding: the user's `extra`
//!   `authentication.kubernetes.io/node-name` (Kubernetes 1.30+,
//!   `ServiceAccountTokenPodNodeInfo`), else the bound pod (`extra` `pod-name` and
//!   `pod-uid`) read by name in the agents' namespace: its `spec.nodeName`, if its UID
//!   is the token's (a pod replaced under the same name is another pod).
//!
//! A review says nothing about the token's expiry, so the expiry is the JWT's `exp`
//! claim, read without checking the signature: the review has just verified the
//! token, and the claim is only used to bound how long its answer is trusted. A
//! token that is not a JWT with an `exp`, or whose `exp` has passed, is refused
//! without a review.
//!
//! Answers are cached by the SHA-256 of the token (the token itself is kept only
//! while its review runs, and never logged), each for at most `cache_ttl` and never
//! past the token's expiry; the cache holds at most `max_entries`. Concurrent reviews
//! of one token share one request, and at most `max_in_flight` different tokens are
//! reviewed at once (more are UNAVAILABLE, retryable). Refusals are not cached.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use base64::Engine as _;
use census_proto::domain::NodeName;
use futures::{
    FutureExt as _,
    future::{BoxFuture, Shared},
};
use k8s_openapi::api::{
    authentication::v1::{TokenReview, TokenReviewSpec, TokenReviewStatus},
    core::v1::Pod,
};
use kube::{Api, Client, api::PostParams};
use parking_lot::Mutex;
use prometheus_client::metrics::{counter::Counter, family::Family, gauge::Gauge};
use tracing::{debug, warn};

use crate::{
    config::ServiceAccountRef,
    grpc::auth::{AuthError, AuthFuture, Authenticate, Credentials, Principal, Vouched, bounded},
    metrics::ResultLabels,
};

/// The `extra` keys of a bound ServiceAccount token's user (k8s.io/apiserver
/// `pkg/authentication/serviceaccount/util.go`).
const NODE_NAME: &str = "authentication.kubernetes.io/node-name";
const POD_NAME: &str = "authentication.kubernetes.io/pod-name";
const POD_UID: &str = "authentication.kubernetes.io/pod-uid";

/// The longest bearer token looked at. Projected tokens are about 1 KiB; the API
/// server's own limit on a request's headers is far larger, so this is ours.
pub const MAX_TOKEN_BYTES: usize = 16 * 1024;

/// How the authenticator works; the defaults suit a cluster.
#[derive(Debug, Clone)]
pub struct TokenReviewConfig {
    /// The audience agents' tokens are requested for (`--token-audience`).
    pub audience: String,
    /// The only ServiceAccount whose tokens bind a node (`--agent-service-account`).
    pub agents: ServiceAccountRef,
    /// How long a review's answer is trusted at most (never past the token's expiry).
    pub cache_ttl: Duration,
    /// Answers cached at most (one per live agent token).
    pub max_entries: usize,
    /// Different tokens reviewed at once at most.
    pub max_in_flight: usize,
    /// How long one review (the TokenReview and, for the fallback, the pod's GET) may take.
    pub request_timeout: Duration,
}

impl TokenReviewConfig {
    /// The defaults for `audience` and `agents`.
    pub fn new(audience: impl Into<String>, agents: ServiceAccountRef) -> Self {
        Self {
            audience: audience.into(),
            agents,
            cache_ttl: Duration::from_secs(60),
            max_entries: 16_384,
            max_in_flight: 256,
            request_timeout: Duration::from_secs(10),
        }
    }
}

/// A token's proof: the node it speaks for, until when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeToken {
    pub node: NodeName,
    /// The token's `exp`.
    pub expires: SystemTime,
}

/// How a refusal is to be answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No valid credentials (UNAUTHENTICATED).
    Unauthenticated,
    /// Valid credentials that may not bind a node (PERMISSION_DENIED).
    PermissionDenied,
    /// The token could not be checked now; retry (UNAVAILABLE).
    Unavailable,
}

/// Why a token does not bind a node. Every text in it is bounded and escaped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("the bearer token is not a ServiceAccount token: {0}")]
    Malformed(&'static str),
    #[error("the token expired {ago} ago")]
    Expired { ago: String },
    #[error("the API server refused the token: {reason}")]
    Refused { reason: String },
    #[error("the token is not valid for the audience {audience:?}")]
    Audience { audience: String },
    #[error("{username} may not speak for a node: only the agents' ServiceAccount {expected} may")]
    WrongAccount { username: String, expected: String },
    #[error("the token names no node: {0}")]
    NoNode(String),
    #[error("the token's pod {pod} is gone")]
    PodGone { pod: String },
    #[error("the token's pod {pod} was replaced (uid {now}, the token's {token})")]
    PodReplaced {
        pod: String,
        now: String,
        token: String,
    },
    #[error("cannot check the token now ({cause}): {detail}")]
    Unavailable { cause: &'static str, detail: String },
}

impl TokenError {
    /// How the refusal is answered.
    pub fn refusal(&self) -> Refusal {
        match self {
            Self::WrongAccount { .. } => Refusal::PermissionDenied,
            Self::Unavailable { .. } => Refusal::Unavailable,
            Self::Malformed(_)
            | Self::Expired { .. }
            | Self::Refused { .. }
            | Self::Audience { .. }
            | Self::NoNode(_)
            | Self::PodGone { .. }
            | Self::PodReplaced { .. } => Refusal::Unauthenticated,
        }
    }

    /// A bounded label for logs.
    pub fn cause(&self) -> &'static str {
        match self {
            Self::Malformed(_) => "malformed",
            Self::Expired { .. } => "expired",
            Self::Refused { .. } => "refused",
            Self::Audience { .. } => "audience",
            Self::WrongAccount { .. } => "wrong_account",
            Self::NoNode(_) => "no_node",
            Self::PodGone { .. } => "pod_gone",
            Self::PodReplaced { .. } => "pod_replaced",
            Self::Unavailable { cause, .. } => cause,
        }
    }

    fn unavailable(cause: &'static str, detail: impl std::fmt::Display) -> Self {
        Self::Unavailable {
            cause,
            detail: bounded(&detail.to_string()),
        }
    }
}

impl From<TokenError> for AuthError {
    fn from(error: TokenError) -> Self {
        match error.refusal() {
            Refusal::Unauthenticated => Self::unauthenticated(&error),
            Refusal::PermissionDenied => Self::permission_denied(&error),
            Refusal::Unavailable => Self::unavailable(&error),
        }
    }
}

/// The wall clock the authenticator judges expiry by (tests move it).
pub type WallClock = Arc<dyn Fn() -> SystemTime + Send + Sync>;

type Key = [u8; 32];

/// A check's answer: from the cache, or made now.
enum Checked {
    Cached(NodeToken),
    Now(Result<NodeToken, TokenError>),
}
type Review = Result<NodeToken, TokenError>;

#[derive(Debug)]
struct Entry {
    token: NodeToken,
    until: SystemTime,
}

#[derive(Default)]
struct State {
    cache: HashMap<Key, Entry>,
    in_flight: HashMap<Key, Shared<BoxFuture<'static, Review>>>,
}

struct Inner {
    client: Client,
    config: TokenReviewConfig,
    clock: WallClock,
    state: Mutex<State>,
    counted: Counted,
}

/// What the authenticator counts: every check by its result, and the cache's size.
#[derive(Debug, Clone, Default)]
pub struct Counted {
    pub reviews: Family<ResultLabels, Counter>,
    pub cached: Gauge,
}

impl Counted {
    fn result(&self, result: &'static str) {
        self.reviews.get_or_create(&ResultLabels { result }).inc();
    }
}

/// Checks agents' bearer tokens with TokenReviews; see the module documentation.
#[derive(Clone)]
pub struct TokenReviewer {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for TokenReviewer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenReviewer")
            .field("config", &self.inner.config)
            .field("cached", &self.cached())
            .finish_non_exhaustive()
    }
}

impl TokenReviewer {
    /// Reviews with `client` (best without kube's own retries: a caller waits),
    /// judging expiry by the system clock.
    pub fn new(client: Client, config: TokenReviewConfig) -> Self {
        Self::with_clock(client, config, Arc::new(SystemTime::now))
    }

    /// As [`Self::new`], judging expiry and cache lifetimes by `clock`.
    pub fn with_clock(client: Client, config: TokenReviewConfig, clock: WallClock) -> Self {
        Self::build(client, config, clock, Counted::default())
    }

    /// As [`Self::new`], counting into `counted` (the operator's metrics).
    pub fn counted(client: Client, config: TokenReviewConfig, counted: Counted) -> Self {
        Self::build(client, config, Arc::new(SystemTime::now), counted)
    }

    fn build(
        client: Client,
        config: TokenReviewConfig,
        clock: WallClock,
        counted: Counted,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                client,
                config,
                clock,
                state: Mutex::new(State::default()),
                counted,
            }),
        }
    }

    /// What it counted.
    pub fn counts(&self) -> &Counted {
        &self.inner.counted
    }

    /// Answers cached now (expired ones included until they are swept).
    pub fn cached(&self) -> usize {
        self.inner.state.lock().cache.len()
    }

    /// The node `token` speaks for, and until when.
    pub async fn review(&self, token: &str) -> Result<NodeToken, TokenError> {
        let (answer, cached) = self.answer(token).await;
        let counted = &self.inner.counted;
        match &answer {
            Ok(_) if cached => counted.result("cached"),
            Ok(_) => counted.result("authenticated"),
            Err(e) => counted.result(e.cause()),
        }
        answer
    }

    /// [`Self::review`]'s answer, and whether it came from the cache.
    async fn answer(&self, token: &str) -> (Result<NodeToken, TokenError>, bool) {
        match self.check(token).await {
            Checked::Cached(token) => (Ok(token), true),
            Checked::Now(answer) => (answer, false),
        }
    }

    async fn check(&self, token: &str) -> Checked {
        let now = (self.inner.clock)();
        let expires = match expiry(token) {
            Ok(expires) => expires,
            Err(e) => return Checked::Now(Err(e)),
        };
        if expires <= now {
            let ago = now.duration_since(expires).unwrap_or_default();
            return Checked::Now(Err(TokenError::Expired {
                ago: humantime::format_duration(Duration::from_secs(ago.as_secs())).to_string(),
            }));
        }
        let key = key_of(token);
        let pending = {
            let mut state = self.inner.state.lock();
            if let Some(entry) = state.cache.get(&key) {
                if entry.until > now {
                    return Checked::Cached(entry.token.clone());
                }
                state.cache.remove(&key);
                self.inner.counted.cached.set(state.cache.len() as i64);
            }
            match state.in_flight.get(&key) {
                Some(pending) => pending.clone(),
                None => {
                    if state.in_flight.len() >= self.inner.config.max_in_flight {
                        return Checked::Now(Err(TokenError::unavailable(
                            "busy",
                            format!(
                                "{} token reviews in flight already",
                                self.inner.config.max_in_flight
                            ),
                        )));
                    }
                    let pending = self.spawn_review(key, token.to_owned(), expires);
                    state.in_flight.insert(key, pending.clone());
                    pending
                }
            }
        };
        Checked::Now(pending.await)
    }

    /// Runs one review to its end whoever still waits for it (so the in-flight entry,
    /// and the token it holds, always go), and caches a success.
    fn spawn_review(
        &self,
        key: Key,
        token: String,
        expires: SystemTime,
    ) -> Shared<BoxFuture<'static, Review>> {
        let inner = self.inner.clone();
        let task = tokio::spawn(async move {
            let timeout = inner.config.request_timeout;
            let result = match tokio::time::timeout(timeout, inner.review_uncached(&token)).await {
                Ok(result) => result.map(|node| NodeToken { node, expires }),
                Err(_) => Err(TokenError::unavailable(
                    "timeout",
                    format!(
                        "no answer from the API server within {}",
                        humantime::format_duration(timeout)
                    ),
                )),
            };
            drop(token);
            let mut state = inner.state.lock();
            state.in_flight.remove(&key);
            if let Ok(token) = &result {
                inner.remember(&mut state, key, token.clone());
            }
            result
        });
        async move {
            task.await
                .unwrap_or_else(|e| Err(TokenError::unavailable("aborted", e)))
        }
        .boxed()
        .shared()
    }
}

impl Inner {
    fn remember(&self, state: &mut State, key: Key, token: NodeToken) {
        let now = (self.clock)();
        let until = (now + self.config.cache_ttl).min(token.expires);
        if until <= now || self.config.max_entries == 0 {
            return;
        }
        if state.cache.len() >= self.config.max_entries {
            state.cache.retain(|_, e| e.until > now);
        }
        if state.cache.len() >= self.config.max_entries {
            let soonest = state
                .cache
                .iter()
                .min_by_key(|(_, e)| e.until)
                .map(|(k, _)| *k);
            if let Some(soonest) = soonest {
                state.cache.remove(&soonest);
            }
        }
        state.cache.insert(key, Entry { token, until });
        self.counted.cached.set(state.cache.len() as i64);
    }

    async fn review_uncached(&self, token: &str) -> Result<NodeName, TokenError> {
        let config = &self.config;
        let review = TokenReview {
            spec: TokenReviewSpec {
                audiences: Some(vec![config.audience.clone()]),
                token: Some(token.to_owned()),
            },
            ..TokenReview::default()
        };
        let answer = Api::<TokenReview>::all(self.client.clone())
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| api_error("TokenReview", &e))?;
        let status = answer.status.unwrap_or_default();
        let binding = judge(&status, config)?;
        let node = match binding {
            Binding::Node(node) => node,
            Binding::Pod { name, uid } => {
                let pod = Api::<Pod>::namespaced(self.client.clone(), &config.agents.namespace)
                    .get_opt(&name)
                    .await
                    .map_err(|e| api_error("the token's pod", &e))?;
                let Some(pod) = pod else {
                    return Err(TokenError::PodGone {
                        pod: bounded(&name),
                    });
                };
                node_of_pod(&pod, &name, &uid)?
            }
        };
        debug!(%node, "token reviewed");
        Ok(node)
    }
}

impl Authenticate for TokenReviewer {
    fn authenticate<'a>(&'a self, credentials: Credentials<'a>) -> AuthFuture<'a> {
        Box::pin(async move {
            let Some(token) = credentials.bearer else {
                return Err(AuthError::unauthenticated(
                    "no bearer token: an agent sends its ServiceAccount token as \
                     `authorization: Bearer <token>`",
                ));
            };
            match self.review(token).await {
                // In a cluster the Node object gives a node's addresses and the
                // core takes none from a Hello: nothing for a token to limit.
                Ok(NodeToken { node, expires }) => Ok(Principal::Node {
                    node,
                    expires: Some(expires),
                    addresses: Vouched::Any,
                }),
                Err(error) => {
                    if error.refusal() == Refusal::Unavailable {
                        warn!(cause = error.cause(), %error, "cannot review a token");
                    } else {
                        debug!(cause = error.cause(), peer = ?credentials.peer, %error, "token refused");
                    }
                    Err(error.into())
                }
            }
        })
    }
}

/// What a successful review binds the token to.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Binding {
    Node(NodeName),
    /// No node claim (a v1.29 API server): the node is the pod's.
    Pod {
        name: String,
        uid: String,
    },
}

fn one<'a>(
    extra: Option<&'a std::collections::BTreeMap<String, Vec<String>>>,
    key: &str,
) -> Option<&'a str> {
    match extra.and_then(|e| e.get(key)).map(Vec::as_slice) {
        Some([value]) if !value.is_empty() => Some(value),
        _ => None,
    }
}

/// Judges a review's answer (see the module documentation).
fn judge(status: &TokenReviewStatus, config: &TokenReviewConfig) -> Result<Binding, TokenError> {
    if status.authenticated != Some(true) {
        let reason = status
            .error
            .as_deref()
            .filter(|e| !e.is_empty())
            .unwrap_or("not authenticated");
        return Err(TokenError::Refused {
            reason: bounded(reason),
        });
    }
    if !status
        .audiences
        .iter()
        .flatten()
        .any(|a| *a == config.audience)
    {
        return Err(TokenError::Audience {
            audience: bounded(&config.audience),
        });
    }
    let user = status.user.as_ref();
    let username = user.and_then(|u| u.username.as_deref()).unwrap_or("");
    if username != config.agents.username() {
        return Err(TokenError::WrongAccount {
            username: bounded(username),
            expected: config.agents.username(),
        });
    }
    let extra = user.and_then(|u| u.extra.as_ref());
    if let Some(node) = one(extra, NODE_NAME) {
        return NodeName::new(node)
            .map(Binding::Node)
            .map_err(|e| TokenError::NoNode(bounded(&format!("node-name {node:?}: {e}"))));
    }
    match (one(extra, POD_NAME), one(extra, POD_UID)) {
        (Some(name), Some(uid)) => Ok(Binding::Pod {
            name: name.to_owned(),
            uid: uid.to_owned(),
        }),
        _ => Err(TokenError::NoNode(
            "it is bound to no pod (a projected token of the agent's pod is needed)".to_owned(),
        )),
    }
}

/// The node of the token's pod, if it is still the pod the token was issued for.
fn node_of_pod(pod: &Pod, name: &str, uid: &str) -> Result<NodeName, TokenError> {
    let now = pod.metadata.uid.as_deref().unwrap_or("");
    if now != uid {
        return Err(TokenError::PodReplaced {
            pod: bounded(name),
            now: bounded(now),
            token: bounded(uid),
        });
    }
    let node = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .filter(|n| !n.is_empty())
        .ok_or_else(|| TokenError::NoNode(format!("pod {} is on no node", bounded(name))))?;
    NodeName::new(node)
        .map_err(|e| TokenError::NoNode(bounded(&format!("pod's nodeName {node:?}: {e}"))))
}

fn api_error(what: &str, e: &kube::Error) -> TokenError {
    let cause = match e {
        kube::Error::Api(status) => match status.code {
            401 | 403 => "forbidden",
            429 => "throttled",
            500..=599 => "server_error",
            _ => "unexpected_status",
        },
        kube::Error::SerdeError(_) => "bad_response",
        kube::Error::HyperError(_) | kube::Error::Service(_) => "transport",
        _ => "client",
    };
    TokenError::unavailable(cause, format!("{what}: {e}"))
}

/// SHA-256 of the token: the cache's key.
fn key_of(token: &str) -> Key {
    let digest = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
    let mut key = [0; 32];
    key.copy_from_slice(digest.as_ref());
    key
}

/// The token's `exp`, read from its JWT payload without checking the signature.
fn expiry(token: &str) -> Result<SystemTime, TokenError> {
    if token.len() > MAX_TOKEN_BYTES {
        return Err(TokenError::Malformed("longer than 16 KiB"));
    }
    let mut parts = token.split('.');
    let (Some(_header), Some(payload), Some(_signature), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(TokenError::Malformed(
            "not a JWT (three dot-separated parts)",
        ));
    };
    let payload = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .map_err(|_| TokenError::Malformed("the JWT payload is not base64url"))?;
    // A JSON object of claims (RFC 7519 section 7.2); serde would also read an array
    // into a struct.
    let claims: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&payload)
        .map_err(|_| TokenError::Malformed("the JWT payload is not a JSON object of claims"))?;
    let exp = claims
        .get("exp")
        .and_then(serde_json::Value::as_u64)
        .ok_or(TokenError::Malformed(
            "the JWT has no exp claim (seconds since 1970)",
        ))?;
    UNIX_EPOCH
        .checked_add(Duration::from_secs(exp))
        .ok_or(TokenError::Malformed("the JWT's exp is out of range"))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::{
        api::{authentication::v1::UserInfo, core::v1::PodSpec},
        apimachinery::pkg::apis::meta::v1::ObjectMeta,
    };

    use super::*;

    fn config() -> TokenReviewConfig {
        TokenReviewConfig::new(
            "census",
            ServiceAccountRef {
                namespace: "census-agent".to_owned(),
                name: "census-agent".to_owned(),
            },
        )
    }

    fn status(audiences: &[&str], username: &str, extra: &[(&str, &str)]) -> TokenReviewStatus {
        TokenReviewStatus {
            authenticated: Some(true),
            audiences: Some(audiences.iter().map(|a| (*a).to_owned()).collect()),
            error: None,
            user: Some(UserInfo {
                username: Some(username.to_owned()),
                extra: Some(
                    extra
                        .iter()
                        .map(|(k, v)| ((*k).to_owned(), vec![(*v).to_owned()]))
                        .collect::<BTreeMap<_, _>>(),
                ),
                ..UserInfo::default()
            }),
        }
    }

    const AGENT: &str = "system:serviceaccount:census-agent:census-agent";

    #[test]
    fn an_answer_without_the_audience_proves_nothing() {
        // A webhook authenticator may authenticate without naming audiences.
        let answer = status(&[], AGENT, &[(NODE_NAME, "node-a")]);
        assert!(matches!(
            judge(&answer, &config()),
            Err(TokenError::Audience { .. })
        ));
        let answer = status(&["other"], AGENT, &[(NODE_NAME, "node-a")]);
        assert!(matches!(
            judge(&answer, &config()),
            Err(TokenError::Audience { .. })
        ));
        let answer = status(&["census"], AGENT, &[(NODE_NAME, "node-a")]);
        assert!(matches!(
            judge(&answer, &config()),
            Ok(Binding::Node(node)) if node.to_string() == "node-a"
        ));
    }

    #[test]
    fn the_node_claim_must_be_one_valid_name() {
        for extra in [vec![(NODE_NAME, "Node_A")], vec![(NODE_NAME, "")], vec![]] {
            let answer = status(&["census"], AGENT, &extra);
            assert!(
                matches!(judge(&answer, &config()), Err(TokenError::NoNode(_))),
                "{extra:?}"
            );
        }
        let mut answer = status(&["census"], AGENT, &[]);
        if let Some(user) = &mut answer.user {
            user.extra = Some(BTreeMap::from([(
                NODE_NAME.to_owned(),
                vec!["node-a".to_owned(), "node-b".to_owned()],
            )]));
        }
        assert!(matches!(
            judge(&answer, &config()),
            Err(TokenError::NoNode(_))
        ));
    }

    #[test]
    fn a_pod_with_another_uid_is_not_the_tokens() {
        let pod = Pod {
            metadata: ObjectMeta {
                name: Some("agent-x".to_owned()),
                uid: Some("uid-2".to_owned()),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                node_name: Some("node-a".to_owned()),
                ..PodSpec::default()
            }),
            ..Pod::default()
        };
        assert!(matches!(
            node_of_pod(&pod, "agent-x", "uid-1"),
            Err(TokenError::PodReplaced { .. })
        ));
        assert_eq!(
            node_of_pod(&pod, "agent-x", "uid-2").map(|n| n.to_string()),
            Ok("node-a".to_owned())
        );
        let unscheduled = Pod {
            spec: Some(PodSpec::default()),
            ..pod
        };
        assert!(matches!(
            node_of_pod(&unscheduled, "agent-x", "uid-2"),
            Err(TokenError::NoNode(_))
        ));
    }

    #[test]
    fn the_expiry_is_the_jwts_exp() {
        let b64 = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        let token = format!(
            "{}.{}.sig",
            b64("{}"),
            b64(r#"{"exp":1700000000,"sub":"x"}"#)
        );
        assert_eq!(
            expiry(&token),
            Ok(UNIX_EPOCH + Duration::from_secs(1_700_000_000))
        );
        for bad in [
            "not-a-jwt".to_owned(),
            "a.b".to_owned(),
            "a.b.c.d".to_owned(),
            format!("{}.%%%.sig", b64("{}")),
            format!("{}.{}.sig", b64("{}"), b64("[1]")),
            format!("{}.{}.sig", b64("{}"), b64(r#"{"sub":"x"}"#)),
            format!("{}.{}.sig", b64("{}"), "A".repeat(MAX_TOKEN_BYTES)),
        ] {
            assert!(
                matches!(expiry(&bad), Err(TokenError::Malformed(_))),
                "{bad:.40}"
            );
        }
    }

    #[test]
    fn refusals_map_to_their_codes() {
        let wrong = TokenError::WrongAccount {
            username: "system:serviceaccount:default:default".to_owned(),
            expected: AGENT.to_owned(),
        };
        assert!(matches!(
            AuthError::from(wrong),
            AuthError::PermissionDenied(m) if m.contains("only the agents' ServiceAccount")
        ));
        assert!(matches!(
            AuthError::from(TokenError::unavailable("server_error", "500")),
            AuthError::Unavailable(_)
        ));
        assert!(matches!(
            AuthError::from(TokenError::Malformed("x")),
            AuthError::Unauthenticated(_)
        ));
    }
}
