//! Agents' bearer tokens checked by a TokenReview (`k8s::tokenreview`) against the
//! fake's bound ServiceAccount tokens: the node from the token's node claim or, for a
//! v1.29-style token, from the bound pod; the audience, the ServiceAccount, expiry,
//! deleted and replaced pods; the cache (counted in the request log), coalesced
//! reviews, and an API server that fails. The reviewer authenticates to the fake as
//! the operator's ServiceAccount, authorized by deploy/'s ClusterRole.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, SystemTime},
};

use census_fake_apiserver::{
    Failure, FakeApiServer, Gvr, RequestFilter, RequestRecord, TokenRequest, Verb,
};
use census_operator::{
    config::ServiceAccountRef,
    k8s::tokenreview::{
        NodeToken, Refusal, TokenError, TokenReviewConfig, TokenReviewer, WallClock,
    },
};
use census_proto::{
    PROTOCOL_VERSION,
    pb::{self, identity_service_client::IdentityServiceClient},
};
use serde_json::json;
use tonic::Code;

use crate::common::{TestResult, WAIT, fake, node, yaml_docs};

const NS: &str = "census-agent";
pub(crate) const SA: &str = "census-agent";
pub(crate) const OPERATOR_TOKEN: &str = "census-operator-token";
const OPERATOR: &str = "system:serviceaccount:census-system:census-operator";

/// The agents' namespace and ServiceAccount, Nodes, an agent pod on node-a, and the
/// operator's identity.
fn seed(server: &FakeApiServer) -> TestResult {
    seed_agents(server)?;
    server.insert(node("node-a", "10.0.0.1"))?;
    server.insert(node("node-b", "10.0.0.2"))?;
    agent_pod(server, "agent-a", SA, "node-a")?;
    seed_operator_identity(server)
}

/// The agents' namespace and their ServiceAccount.
pub(crate) fn seed_agents(server: &FakeApiServer) -> TestResult {
    server.insert(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}))?;
    server.insert(json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"namespace": NS, "name": SA}}))?;
    Ok(())
}

/// The operator's ServiceAccount token ([`OPERATOR_TOKEN`]) and its ClusterRole and
/// ClusterRoleBinding from deploy/, which the fake evaluates for TokenReviews.
pub(crate) fn seed_operator_identity(server: &FakeApiServer) -> TestResult {
    server.insert(
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "census-system"}}),
    )?;
    for doc in yaml_docs("deploy/operator/rbac.yaml")? {
        if matches!(
            doc["kind"].as_str(),
            Some("ClusterRole" | "ClusterRoleBinding")
        ) {
            server.insert(doc)?;
        }
    }
    server.add_token(
        OPERATOR_TOKEN,
        OPERATOR,
        &[
            "system:serviceaccounts",
            "system:serviceaccounts:census-system",
        ],
    );
    Ok(())
}

pub(crate) fn agent_pod(
    server: &FakeApiServer,
    name: &str,
    account: &str,
    node: &str,
) -> TestResult {
    server.insert(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"namespace": NS, "name": name, "labels": {"app.kubernetes.io/name": "census-agent"}},
        "spec": {
            "serviceAccountName": account,
            "nodeName": node,
            "containers": [{"name": "census-agent", "image": "census-agent"}],
        },
    }))?;
    Ok(())
}

fn agents() -> ServiceAccountRef {
    ServiceAccountRef {
        namespace: NS.to_owned(),
        name: SA.to_owned(),
    }
}

/// A clock that tests move forward, from the real time.
#[derive(Clone, Default)]
struct Clock {
    ahead_ms: Arc<AtomicU64>,
}

impl Clock {
    fn wall(&self) -> WallClock {
        let ahead = self.ahead_ms.clone();
        Arc::new(move || SystemTime::now() + Duration::from_millis(ahead.load(Ordering::SeqCst)))
    }

    fn advance(&self, by: Duration) {
        self.ahead_ms
            .fetch_add(by.as_millis() as u64, Ordering::SeqCst);
    }
}

/// A reviewer authenticated to the fake as the operator (no kube retries, as the
/// daemon builds it).
fn reviewer(server: &FakeApiServer, clock: &Clock) -> TestResult<TokenReviewer> {
    let mut config = server.kube_config()?;
    config.auth_info.token = Some(OPERATOR_TOKEN.to_owned().into());
    config.default_retry = false;
    Ok(TokenReviewer::with_clock(
        kube::Client::try_from(config)?,
        TokenReviewConfig::new("census", agents()),
        clock.wall(),
    ))
}

pub(crate) fn census_token(pod: &str) -> TokenRequest {
    TokenRequest::for_pod(NS, SA, pod).audiences(&["census"])
}

fn is_review(r: &RequestRecord) -> bool {
    r.resource == "tokenreviews" && r.verb == Verb::Create
}

fn reviews(server: &FakeApiServer) -> usize {
    server.requests().filter(is_review).len()
}

fn pod_gets(server: &FakeApiServer) -> Vec<RequestRecord> {
    server
        .requests()
        .filter(|r| r.resource == "pods" && r.group.is_empty())
}

fn refused(result: Result<NodeToken, TokenError>) -> TestResult<TokenError> {
    match result {
        Ok(token) => Err(format!("accepted: {token:?}").into()),
        Err(e) => Ok(e),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bound_token_names_its_node_until_its_expiry() -> TestResult {
    let server = fake().await?;
    seed(&server)?;
    let clock = Clock::default();
    let tokens = reviewer(&server, &clock)?;
    let before = SystemTime::now();
    let token =
        server.issue_token(&census_token("agent-a").expires_in(Duration::from_secs(1800)))?;
    let bound = tokens.review(&token).await?;
    assert_eq!(bound.node.to_string(), "node-a");
    // `exp` is whole seconds.
    let life = bound.expires.duration_since(before)?;
    assert!(
        life > Duration::from_secs(1798) && life <= Duration::from_secs(1801),
        "{life:?}"
    );
    let log = server.requests();
    let review = log.filter(is_review);
    assert_eq!(review.len(), 1);
    assert_eq!(review[0].code, 201);
    // The node claim (v1.30+) needs no read of the pod.
    assert!(pod_gets(&server).is_empty(), "{:?}", pod_gets(&server));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v1_29_token_is_bound_through_its_pods_node_name() -> TestResult {
    let server = fake().await?;
    seed(&server)?;
    agent_pod(&server, "agent-b", SA, "node-b")?;
    let tokens = reviewer(&server, &Clock::default())?;
    let token = server.issue_token(&census_token("agent-b").as_v1_29())?;
    let bound = tokens.review(&token).await?;
    assert_eq!(bound.node.to_string(), "node-b");
    let gets = pod_gets(&server);
    assert_eq!(gets.len(), 1, "{gets:?}");
    assert_eq!(gets[0].verb, Verb::Get);
    assert_eq!(gets[0].namespace.as_deref(), Some(NS));
    assert_eq!(gets[0].name.as_deref(), Some("agent-b"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_for_another_audience_is_unauthenticated() -> TestResult {
    let server = fake().await?;
    seed(&server)?;
    let tokens = reviewer(&server, &Clock::default())?;
    // The API server's own audience (a pod's default token) and another service's.
    for audiences in [&[census_fake_apiserver::API_AUDIENCE][..], &["vault"]] {
        let token = server.issue_token(&census_token("agent-a").audiences(audiences))?;
        let error = refused(tokens.review(&token).await)?;
        assert!(
            matches!(&error, TokenError::Refused { reason } if reason.contains("audiences")),
            "{audiences:?}: {error}"
        );
        assert_eq!(error.refusal(), Refusal::Unauthenticated);
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_service_account_may_not_speak_for_a_node() -> TestResult {
    let server = fake().await?;
    seed(&server)?;
    // Another account of the agents' namespace, and one of the same name elsewhere.
    server.insert(json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"namespace": NS, "name": "intruder"}}))?;
    agent_pod(&server, "intruder", "intruder", "node-a")?;
    server.insert(json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"namespace": "default", "name": SA}}))?;
    server.insert(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"namespace": "default", "name": "lookalike"},
        "spec": {"serviceAccountName": SA, "nodeName": "node-a", "containers": [{"name": "c", "image": "c"}]},
    }))?;
    let tokens = reviewer(&server, &Clock::default())?;
    for (ns, account, pod, user) in [
        (
            NS,
            "intruder",
            "intruder",
            "system:serviceaccount:census-agent:intruder",
        ),
        (
            "default",
            SA,
            "lookalike",
            "system:serviceaccount:default:census-agent",
        ),
    ] {
        let token =
            server.issue_token(&TokenRequest::for_pod(ns, account, pod).audiences(&["census"]))?;
        let error = refused(tokens.review(&token).await)?;
        assert_eq!(error.refusal(), Refusal::PermissionDenied, "{error}");
        let text = error.to_string();
        assert!(
            text.contains(user) && text.contains("system:serviceaccount:census-agent:census-agent"),
            "{text}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_token_is_refused_without_a_review() -> TestResult {
    let server = fake().await?;
    seed(&server)?;
    let tokens = reviewer(&server, &Clock::default())?;
    let now = SystemTime::now();
    // Past the API server's minute of leeway, and within it (the API server would
    // still authenticate that one).
    for ago in [120, 10] {
        let token = server
            .issue_token(&census_token("agent-a").expires_at(now - Duration::from_secs(ago)))?;
        let error = refused(tokens.review(&token).await)?;
        assert!(
            matches!(error, TokenError::Expired { .. }),
            "{ago}: {error}"
        );
        assert_eq!(error.refusal(), Refusal::Unauthenticated);
    }
    // Not JWTs at all.
    for garbage in ["secret", "a.b.c", ""] {
        let error = refused(tokens.review(garbage).await)?;
        assert!(
            matches!(error, TokenError::Malformed(_)),
            "{garbage:?}: {error}"
        );
    }
    assert_eq!(reviews(&server), 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_of_a_deleted_or_replaced_pod_is_refused() -> TestResult {
    let server = fake().await?;
    seed(&server)?;
    let clock = Clock::default();
    let tokens = reviewer(&server, &clock)?;
    let pods = Gvr::new("", "v1", "pods");
    for v1_29 in [false, true] {
        let request = if v1_29 {
            census_token("agent-a").as_v1_29()
        } else {
            census_token("agent-a")
        };
        let token = server.issue_token(&request)?;
        let cached = server.issue_token(&request)?;
        assert_eq!(tokens.review(&cached).await?.node.to_string(), "node-a");
        server.delete(&pods, Some(NS), "agent-a");
        let error = refused(tokens.review(&token).await)?;
        assert!(
            matches!(&error, TokenError::Refused { reason } if reason.contains("invalidated")),
            "v1.29 {v1_29}: {error}"
        );
        // A new pod of the same name on another node is not the token's pod.
        agent_pod(&server, "agent-a", SA, "node-b")?;
        let error = refused(tokens.review(&token).await)?;
        assert!(
            matches!(&error, TokenError::Refused { reason } if reason.contains("pod UID")),
            "v1.29 {v1_29}: {error}"
        );
        assert_eq!(error.refusal(), Refusal::Unauthenticated);
        // A token reviewed before the pod went is trusted for the cache's life at most.
        assert_eq!(tokens.review(&cached).await?.node.to_string(), "node-a");
        clock.advance(Duration::from_secs(61));
        let error = refused(tokens.review(&cached).await)?;
        assert!(matches!(error, TokenError::Refused { .. }), "{error}");
        // The new pod's own token names its node.
        let fresh = server.issue_token(&request)?;
        assert_eq!(tokens.review(&fresh).await?.node.to_string(), "node-b");
        server.delete(&pods, Some(NS), "agent-a");
        agent_pod(&server, "agent-a", SA, "node-a")?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_are_cached_for_the_ttl_and_never_past_the_tokens_expiry() -> TestResult {
    let server = fake().await?;
    seed(&server)?;
    let clock = Clock::default();
    let tokens = reviewer(&server, &clock)?;
    let long = server.issue_token(&census_token("agent-a"))?;
    let short = server.issue_token(&census_token("agent-a").expires_in(Duration::from_secs(30)))?;
    for token in [&long, &short] {
        tokens.review(token).await?;
    }
    assert_eq!(reviews(&server), 2);
    clock.advance(Duration::from_secs(25));
    for token in [&long, &short] {
        tokens.review(token).await?;
    }
    assert_eq!(reviews(&server), 2, "both answers were cached");
    assert_eq!(tokens.cached(), 2);

    // Past the short token's expiry its answer is gone (the API server, with its
    // leeway, would still authenticate it); the long one's is still cached.
    clock.advance(Duration::from_secs(6));
    let error = refused(tokens.review(&short).await)?;
    assert!(matches!(error, TokenError::Expired { .. }), "{error}");
    tokens.review(&long).await?;
    assert_eq!(reviews(&server), 2);

    // Past the cache's TTL (60 s) the long token is reviewed again.
    clock.advance(Duration::from_secs(30));
    tokens.review(&long).await?;
    assert_eq!(reviews(&server), 3);

    // Every check is counted by its result; the gauge follows the cache.
    let counts = tokens.counts();
    let result = |result: &'static str| {
        counts
            .reviews
            .get_or_create(&census_operator::metrics::ResultLabels { result })
            .get()
    };
    assert_eq!(
        (result("authenticated"), result("cached"), result("expired")),
        (3, 3, 1)
    );
    assert_eq!(counts.cached.get(), tokens.cached() as i64);
    Ok(())
}

/// On one thread the spawned review cannot start before every caller has asked.
#[tokio::test]
async fn concurrent_reviews_of_one_token_share_one_request() -> TestResult {
    let server = fake().await?;
    seed(&server)?;
    let tokens = reviewer(&server, &Clock::default())?;
    let token = server.issue_token(&census_token("agent-a"))?;
    let answers = futures::future::join_all((0..16).map(|_| tokens.review(&token))).await;
    for answer in answers {
        assert_eq!(answer?.node.to_string(), "node-a");
    }
    assert_eq!(reviews(&server), 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_server_that_fails_is_unavailable_and_nothing_is_cached() -> TestResult {
    let server = fake().await?;
    seed(&server)?;
    agent_pod(&server, "agent-b", SA, "node-b")?;
    let tokens = reviewer(&server, &Clock::default())?;
    let token = server.issue_token(&census_token("agent-a"))?;
    server.faults().fail_next(
        RequestFilter::resource("tokenreviews"),
        1,
        Failure::InternalError,
    );
    let error = refused(tokens.review(&token).await)?;
    assert_eq!(error.refusal(), Refusal::Unavailable, "{error}");
    assert_eq!(error.cause(), "server_error");
    assert_eq!(tokens.review(&token).await?.node.to_string(), "node-a");

    // The fallback's read of the pod failing.
    let v1_29 = server.issue_token(&census_token("agent-b").as_v1_29())?;
    server.faults().fail_next(
        RequestFilter::resource("pods"),
        1,
        Failure::ServiceUnavailable,
    );
    let error = refused(tokens.review(&v1_29).await)?;
    assert_eq!(error.refusal(), Refusal::Unavailable, "{error}");
    assert_eq!(tokens.review(&v1_29).await?.node.to_string(), "node-b");

    // An operator without the RBAC to review (403).
    let mut config = server.kube_config()?;
    config.default_retry = false;
    let anonymous = TokenReviewer::new(
        kube::Client::try_from(config)?,
        TokenReviewConfig::new("census", agents()),
    );
    let error = refused(anonymous.review(&token).await)?;
    assert_eq!(error.refusal(), Refusal::Unavailable, "{error}");
    assert_eq!(error.cause(), "forbidden");
    Ok(())
}

/// `request` with the agent's token in its metadata, as the agent sends it.
fn bearer<T>(message: T, token: &str) -> TestResult<tonic::Request<T>> {
    let mut request = tonic::Request::new(message);
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse()?);
    Ok(request)
}

async fn allocate_as(
    channel: &tonic::transport::Channel,
    node: &str,
    token: Option<&str>,
) -> TestResult<Result<(), tonic::Status>> {
    let message = pb::AllocateRequest {
        protocol_version: PROTOCOL_VERSION,
        node: node.into(),
        session: Some(crate::operator::session(1)),
        labels: crate::operator::wire_labels("web"),
        allocation: 0,
    };
    let request = match token {
        Some(token) => bearer(message, token)?,
        None => tonic::Request::new(message),
    };
    let mut client = IdentityServiceClient::new(channel.clone());
    Ok(tokio::time::timeout(WAIT, client.allocate(request))
        .await?
        .map(|_| ()))
}

/// The operator with TLS and no client CA (`--store kubernetes`): callers are
/// authenticated by their bearer tokens, through the daemon's TokenReviewer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_grpc_a_token_speaks_for_its_node_only() -> TestResult {
    let server = fake().await?;
    crate::operator::seed_cluster(&server, &["op-a"])?;
    seed(&server)?;
    agent_pod(&server, "agent-1", SA, "node-1")?;
    server.insert(json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"namespace": NS, "name": "intruder"}}))?;
    agent_pod(&server, "intruder", "intruder", "node-1")?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    server.write_kubeconfig_with_token(&kubeconfig, OPERATOR_TOKEN)?;
    let certs = census_testkit::tls::Certs::generate(&[], &[])?;
    let mut args = crate::operator::replica_args(&kubeconfig, "op-a", &[]);
    args.extend(certs.operator_flags()?.into_iter().take(4));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let op = census_testkit::Operator::start(&args).await?;
    crate::operator::until_leader(&op).await?;
    let channel = certs.target(op.grpc_addr, None)?.channel().await?;

    let token = server.issue_token(&census_token("agent-1"))?;
    let own = allocate_as(&channel, "node-1", Some(&token)).await?;
    assert!(
        !matches!(
            own.as_ref().map_err(tonic::Status::code),
            Err(Code::Unauthenticated | Code::PermissionDenied)
        ),
        "{own:?}"
    );
    let other = allocate_as(&channel, "node-2", Some(&token)).await?;
    let other = other.err().ok_or("node-1's token spoke for node-2")?;
    assert_eq!(other.code(), Code::PermissionDenied, "{other:?}");
    assert!(other.message().contains("node-1"), "{other:?}");
    let none = allocate_as(&channel, "node-1", None).await?;
    let none = none.err().ok_or("no token was accepted")?;
    assert_eq!(none.code(), Code::Unauthenticated, "{none:?}");
    let intruder = server
        .issue_token(&TokenRequest::for_pod(NS, "intruder", "intruder").audiences(&["census"]))?;
    let refused = allocate_as(&channel, "node-1", Some(&intruder)).await?;
    let refused = refused.err().ok_or("another ServiceAccount was accepted")?;
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    let wrong_audience = server.issue_token(&TokenRequest::for_pod(NS, SA, "agent-1"))?;
    let refused = allocate_as(&channel, "node-1", Some(&wrong_audience)).await?;
    let refused = refused
        .err()
        .ok_or("a token of another audience was accepted")?;
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
    assert_eq!(reviews(&server), 3, "one review per token, then cached");
    op.shut_down().await?;
    Ok(())
}
