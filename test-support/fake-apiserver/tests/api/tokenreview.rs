//! TokenReview of bound ServiceAccount tokens, as the real authenticator answers
//! (kubernetes `pkg/serviceaccount/jwt.go`, `claims.go`), and its RBAC.

use std::time::{Duration, SystemTime};

use base64::Engine as _;
use census_fake_apiserver::{API_AUDIENCE, FakeApiServer, Gvr, TokenRequest, Verb};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, TokenReviewStatus};
use kube::{Api, api::PostParams};
use serde_json::{Value, json};

use crate::common::{TestResult, api_code, pod, start};

const NS: &str = "census-agent";
const SA: &str = "census-agent";
const REVIEWER_TOKEN: &str = "operator-token";
const REVIEWER: &str = "system:serviceaccount:census-system:census-operator";

/// The agent's namespace, ServiceAccount, a Node and an agent pod on it, and a
/// reviewer bound to `system:auth-delegator` (as an operator that calls
/// TokenReview is).
fn seed(server: &FakeApiServer) -> TestResult {
    server.insert(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}))?;
    server.insert(
        json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"namespace": NS, "name": SA}}),
    )?;
    server.insert(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}}))?;
    insert_agent_pod(server, "agent-a", "n1")?;
    server.add_token(REVIEWER_TOKEN, REVIEWER, &[]);
    server.insert(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": "census-operator-auth-delegator"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:auth-delegator"},
        "subjects": [{"kind": "ServiceAccount", "namespace": "census-system", "name": "census-operator"}],
    }))?;
    Ok(())
}

fn insert_agent_pod(server: &FakeApiServer, name: &str, node: &str) -> TestResult {
    let mut p = pod(NS, name, Some(node), &[]);
    if let Some(spec) = p.spec.as_mut() {
        spec.service_account_name = Some(SA.to_owned());
    }
    server.insert(p)?;
    Ok(())
}

fn uid(server: &FakeApiServer, resource: &str, namespace: Option<&str>, name: &str) -> String {
    server
        .get(&Gvr::new("", "v1", resource), namespace, name)
        .and_then(|o| o["metadata"]["uid"].as_str().map(str::to_owned))
        .unwrap_or_default()
}

async fn review(
    server: &FakeApiServer,
    token: &str,
    audiences: &[&str],
) -> Result<TokenReviewStatus, Box<dyn std::error::Error + Send + Sync>> {
    let api = Api::<TokenReview>::all(server.client_with_token(REVIEWER_TOKEN)?);
    let answer = api
        .create(
            &PostParams::default(),
            &TokenReview {
                spec: TokenReviewSpec {
                    token: Some(token.to_owned()),
                    audiences: Some(audiences.iter().map(|a| (*a).to_owned()).collect()),
                },
                ..TokenReview::default()
            },
        )
        .await?;
    answer.status.ok_or_else(|| "no status".into())
}

fn extra(status: &TokenReviewStatus, key: &str) -> Option<Vec<String>> {
    status
        .user
        .as_ref()
        .and_then(|u| u.extra.as_ref())
        .and_then(|e| e.get(&format!("authentication.kubernetes.io/{key}")))
        .cloned()
}

fn payload(token: &str) -> Result<Value, Box<dyn std::error::Error + Send + Sync>> {
    let part = token.split('.').nth(1).ok_or("not a JWT")?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(part)?;
    Ok(serde_json::from_slice(&bytes)?)
}

#[tokio::test]
async fn a_bound_token_names_its_service_account_pod_and_node() -> TestResult {
    let (server, _) = start().await?;
    seed(&server)?;
    let token = server.issue_token(
        &TokenRequest::for_pod(NS, SA, "agent-a")
            .audiences(&["census"])
            .expires_in(Duration::from_secs(600)),
    )?;
    let status = review(&server, &token, &["census", "other"]).await?;
    assert_eq!(status.authenticated, Some(true), "{status:?}");
    assert_eq!(status.error, None);
    assert_eq!(
        status.audiences.as_deref(),
        Some(&["census".to_owned()][..])
    );
    let user = status.user.as_ref().ok_or("no user")?;
    assert_eq!(
        user.username.as_deref(),
        Some("system:serviceaccount:census-agent:census-agent")
    );
    assert_eq!(
        user.uid,
        Some(uid(&server, "serviceaccounts", Some(NS), SA))
    );
    assert_eq!(
        user.groups.as_deref(),
        Some(
            &[
                "system:serviceaccounts".to_owned(),
                "system:serviceaccounts:census-agent".to_owned(),
                "system:authenticated".to_owned(),
            ][..]
        )
    );
    assert_eq!(extra(&status, "pod-name"), Some(vec!["agent-a".to_owned()]));
    assert_eq!(
        extra(&status, "pod-uid"),
        Some(vec![uid(&server, "pods", Some(NS), "agent-a")])
    );
    assert_eq!(extra(&status, "node-name"), Some(vec!["n1".to_owned()]));
    assert_eq!(
        extra(&status, "node-uid"),
        Some(vec![uid(&server, "nodes", None, "n1")])
    );
    let credential = extra(&status, "credential-id").ok_or("no credential-id")?;
    assert!(credential[0].starts_with("JTI="), "{credential:?}");

    // The token carries the claims of `claims.go`: a client can read its expiry.
    let claims = payload(&token)?;
    let exp = claims["exp"].as_u64().ok_or("no exp")?;
    let iat = claims["iat"].as_u64().ok_or("no iat")?;
    assert_eq!(exp - iat, 600);
    assert_eq!(claims["aud"], json!(["census"]));
    assert_eq!(claims["iss"], json!(API_AUDIENCE));
    assert_eq!(
        claims["sub"],
        json!("system:serviceaccount:census-agent:census-agent")
    );
    assert_eq!(claims["kubernetes.io"]["node"]["name"], json!("n1"));
    assert_eq!(claims["kubernetes.io"]["pod"]["name"], json!("agent-a"));
    assert_eq!(
        format!("JTI={}", claims["jti"].as_str().unwrap_or_default()),
        credential[0]
    );

    // Every review is a logged create, for RBAC checks against the log.
    let reviews: Vec<_> = server
        .requests()
        .iter()
        .filter(|r| r.resource == "tokenreviews")
        .map(|r| (r.verb, r.group.clone(), r.code))
        .collect();
    assert_eq!(
        reviews,
        vec![(Verb::Create, "authentication.k8s.io".to_owned(), 201)]
    );
    Ok(())
}

#[tokio::test]
async fn a_token_for_another_audience_is_not_authenticated() -> TestResult {
    let (server, _) = start().await?;
    seed(&server)?;
    let token =
        server.issue_token(&TokenRequest::for_pod(NS, SA, "agent-a").audiences(&["vault"]))?;
    let status = review(&server, &token, &["census"]).await?;
    assert_eq!(status.authenticated, None, "{status:?}");
    assert_eq!(status.audiences, None);
    let error = status.error.unwrap_or_default();
    assert!(
        error.contains(
            r#"token audiences ["vault"] is invalid for the target audiences ["census"]"#
        ),
        "{error}"
    );
    // No audiences asked: the API server's own, which a census token is not for.
    let token =
        server.issue_token(&TokenRequest::for_pod(NS, SA, "agent-a").audiences(&["census"]))?;
    let status = review(&server, &token, &[]).await?;
    assert_eq!(status.authenticated, None, "{status:?}");
    // And an API token is good for the API audience.
    let token = server.issue_token(&TokenRequest::for_pod(NS, SA, "agent-a"))?;
    let status = review(&server, &token, &[]).await?;
    assert_eq!(status.authenticated, Some(true), "{status:?}");
    assert_eq!(status.audiences, Some(vec![API_AUDIENCE.to_owned()]));
    Ok(())
}

#[tokio::test]
async fn an_expired_token_is_refused_after_the_leeway() -> TestResult {
    let (server, _) = start().await?;
    seed(&server)?;
    let now = SystemTime::now();
    let request = TokenRequest::for_pod(NS, SA, "agent-a").audiences(&["census"]);
    // go-jose validates `exp` with a one-minute leeway.
    let just_expired =
        server.issue_token(&request.clone().expires_at(now - Duration::from_secs(20)))?;
    let status = review(&server, &just_expired, &["census"]).await?;
    assert_eq!(status.authenticated, Some(true), "{status:?}");
    let expired = server.issue_token(&request.expires_at(now - Duration::from_secs(120)))?;
    let status = review(&server, &expired, &["census"]).await?;
    assert_eq!(status.authenticated, None, "{status:?}");
    assert!(
        status
            .error
            .unwrap_or_default()
            .contains("service account token has expired")
    );
    Ok(())
}

#[tokio::test]
async fn unknown_and_edited_tokens_are_not_authenticated() -> TestResult {
    let (server, _) = start().await?;
    seed(&server)?;
    let status = review(&server, "not-a-token", &["census"]).await?;
    assert_eq!(status.authenticated, None);
    assert_eq!(status.error.as_deref(), Some("invalid bearer token"));
    assert_eq!(status.user.and_then(|u| u.username), None);

    // A client that rewrites the claims (another node) breaks the signature.
    let token =
        server.issue_token(&TokenRequest::for_pod(NS, SA, "agent-a").audiences(&["census"]))?;
    let mut claims = payload(&token)?;
    claims["kubernetes.io"]["node"]["name"] = json!("n2");
    let parts: Vec<&str> = token.split('.').collect();
    let forged = format!(
        "{}.{}.{}",
        parts[0],
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(claims.to_string()),
        parts[2]
    );
    let status = review(&server, &forged, &["census"]).await?;
    assert_eq!(status.authenticated, None);
    Ok(())
}

#[tokio::test]
async fn a_token_of_a_deleted_or_replaced_pod_is_invalidated() -> TestResult {
    let (server, _) = start().await?;
    seed(&server)?;
    let pods = Gvr::new("", "v1", "pods");
    let request = TokenRequest::for_pod(NS, SA, "agent-a").audiences(&["census"]);
    let token = server.issue_token(&request)?;
    assert_eq!(
        review(&server, &token, &["census"]).await?.authenticated,
        Some(true)
    );

    // Being deleted for less than the leeway: still valid.
    server.modify(&pods, Some(NS), "agent-a", |p| {
        p["metadata"]["deletionTimestamp"] = json!(k8s_openapi::jiff::Timestamp::now().to_string());
    })?;
    assert_eq!(
        review(&server, &token, &["census"]).await?.authenticated,
        Some(true)
    );
    // Deleted for longer: invalid.
    server.modify(&pods, Some(NS), "agent-a", |p| {
        p["metadata"]["deletionTimestamp"] = json!("2020-01-01T00:00:00Z");
    })?;
    let status = review(&server, &token, &["census"]).await?;
    assert_eq!(status.authenticated, None, "{status:?}");
    assert!(
        status
            .error
            .unwrap_or_default()
            .contains("has been invalidated")
    );

    // Gone.
    server.delete(&pods, Some(NS), "agent-a");
    let status = review(&server, &token, &["census"]).await?;
    assert_eq!(status.authenticated, None, "{status:?}");
    assert!(
        status
            .error
            .unwrap_or_default()
            .contains("has been invalidated")
    );

    // A new pod of the same name is another object: the old token stays invalid.
    insert_agent_pod(&server, "agent-a", "n1")?;
    let status = review(&server, &token, &["census"]).await?;
    assert_eq!(status.authenticated, None, "{status:?}");
    assert!(
        status
            .error
            .unwrap_or_default()
            .contains("does not match service account pod ref claim")
    );
    let fresh = server.issue_token(&request)?;
    assert_eq!(
        review(&server, &fresh, &["census"]).await?.authenticated,
        Some(true)
    );

    // The ServiceAccount replaced: every token of the old one is invalid.
    let sas = Gvr::new("", "v1", "serviceaccounts");
    server.delete(&sas, Some(NS), SA);
    server.insert(
        json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"namespace": NS, "name": SA}}),
    )?;
    let status = review(&server, &fresh, &["census"]).await?;
    assert_eq!(status.authenticated, None, "{status:?}");
    assert!(
        status
            .error
            .unwrap_or_default()
            .contains("service account UID")
    );
    Ok(())
}

#[tokio::test]
async fn a_v1_29_token_has_no_node_so_the_node_comes_from_the_bound_pod() -> TestResult {
    let (server, client) = start().await?;
    seed(&server)?;
    let token = server.issue_token(
        &TokenRequest::for_pod(NS, SA, "agent-a")
            .audiences(&["census"])
            .as_v1_29(),
    )?;
    let status = review(&server, &token, &["census"]).await?;
    assert_eq!(status.authenticated, Some(true), "{status:?}");
    assert_eq!(extra(&status, "node-name"), None);
    assert_eq!(extra(&status, "node-uid"), None);
    assert_eq!(extra(&status, "credential-id"), None);
    assert_eq!(payload(&token)?["kubernetes.io"].get("node"), None);
    // The fallback: the bound pod, by name and UID, names its node.
    let pod_name = extra(&status, "pod-name").ok_or("no pod-name")?;
    let pod_uid = extra(&status, "pod-uid").ok_or("no pod-uid")?;
    let bound = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client, NS)
        .get(&pod_name[0])
        .await?;
    assert_eq!(bound.metadata.uid, Some(pod_uid[0].clone()));
    assert_eq!(bound.spec.and_then(|s| s.node_name).as_deref(), Some("n1"));

    // A v1.30 token for a pod whose Node is gone has no node either (TokenRequest
    // does not fail for it).
    insert_agent_pod(&server, "agent-b", "n-gone")?;
    let token =
        server.issue_token(&TokenRequest::for_pod(NS, SA, "agent-b").audiences(&["census"]))?;
    let status = review(&server, &token, &["census"]).await?;
    assert_eq!(status.authenticated, Some(true));
    assert_eq!(extra(&status, "node-name"), None);
    Ok(())
}

#[tokio::test]
async fn tokens_are_issued_only_for_a_pod_of_the_service_account() -> TestResult {
    let (server, _) = start().await?;
    seed(&server)?;
    server.insert(pod(NS, "other", Some("n1"), &[]))?;
    let refused = server.issue_token(&TokenRequest::for_pod(NS, SA, "other"));
    let Err(census_fake_apiserver::Error::Api(error)) = refused else {
        return Err(format!("expected a refusal, got {refused:?}").into());
    };
    assert_eq!(error.code(), 400);
    assert!(
        error.to_string().contains("different serviceaccount name"),
        "{error}"
    );
    let missing = server.issue_token(&TokenRequest::for_pod(NS, "nobody", "agent-a"));
    assert!(
        matches!(&missing, Err(census_fake_apiserver::Error::Api(e)) if e.code() == 404),
        "{missing:?}"
    );
    let missing = server.issue_token(&TokenRequest::for_pod(NS, SA, "no-such-pod"));
    assert!(
        matches!(&missing, Err(census_fake_apiserver::Error::Api(e)) if e.code() == 404),
        "{missing:?}"
    );
    Ok(())
}

#[tokio::test]
async fn creating_a_token_review_needs_rbac() -> TestResult {
    let (server, anonymous) = start().await?;
    seed(&server)?;
    let token =
        server.issue_token(&TokenRequest::for_pod(NS, SA, "agent-a").audiences(&["census"]))?;
    let body = TokenReview {
        spec: TokenReviewSpec {
            token: Some(token),
            audiences: Some(vec!["census".to_owned()]),
        },
        ..TokenReview::default()
    };
    let pp = PostParams::default();

    let refused = Api::<TokenReview>::all(anonymous).create(&pp, &body).await;
    assert_eq!(api_code(&refused), Some((403, "Forbidden".into())));
    let Err(kube::Error::Api(status)) = refused else {
        return Err("expected a Status".into());
    };
    assert_eq!(
        status.message,
        "tokenreviews.authentication.k8s.io is forbidden: User \"system:anonymous\" cannot create \
         resource \"tokenreviews\" in API group \"authentication.k8s.io\" at the cluster scope"
    );

    // A user with a binding to a role without the rule, then with it.
    server.add_token("reader", "reader", &["readers"]);
    let reader = Api::<TokenReview>::all(server.client_with_token("reader")?);
    server.insert(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": "reviewer"},
        "rules": [{"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["get"]}],
    }))?;
    server.insert(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": "readers-review"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "reviewer"},
        "subjects": [{"kind": "Group", "name": "readers"}],
    }))?;
    // A RoleBinding grants nothing on a cluster-scoped resource.
    server.insert(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"namespace": "default", "name": "delegator"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:auth-delegator"},
        "subjects": [{"kind": "User", "name": "reader"}],
    }))?;
    assert_eq!(
        api_code(&reader.create(&pp, &body).await),
        Some((403, "Forbidden".into()))
    );
    server.modify(
        &Gvr::new("rbac.authorization.k8s.io", "v1", "clusterroles"),
        None,
        "reviewer",
        |r| r["rules"][0]["verbs"] = json!(["create"]),
    )?;
    let status = reader.create(&pp, &body).await?.status.ok_or("no status")?;
    assert_eq!(status.authenticated, Some(true));

    // system:masters may do anything; an empty token is a bad request.
    server.add_token("admin", "admin", &["system:masters"]);
    let admin = Api::<TokenReview>::all(server.client_with_token("admin")?);
    let empty = TokenReview {
        spec: TokenReviewSpec::default(),
        ..TokenReview::default()
    };
    let refused = admin.create(&pp, &empty).await;
    assert_eq!(api_code(&refused), Some((400, "BadRequest".into())));
    let Err(kube::Error::Api(status)) = refused else {
        return Err("expected a Status".into());
    };
    assert_eq!(
        status.message,
        "token is required for TokenReview in authentication"
    );
    Ok(())
}
