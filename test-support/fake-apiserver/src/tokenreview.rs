//! Bound ServiceAccount tokens and `TokenReview`, as the real API server issues
//! and checks them.
//!
//! **Issuing** ([`crate::FakeApiServer::issue_token`], what the kubelet gets for a
//! projected `serviceAccountToken` volume through the TokenRequest API): the
//! ServiceAccount and the pod must exist and the pod must run as that
//! ServiceAccount (kubernetes `pkg/registry/core/serviceaccount/storage/token.go`);
//! the node is the pod's `spec.nodeName`, its UID read from the Node (a missing
//! Node leaves the node out, as `token.go` does). The token is a JWT with the
//! claims of kubernetes `pkg/serviceaccount/claims.go` `Claims`: `iss`, `sub`
//! (`system:serviceaccount:NS:NAME`), `aud`, `exp`, `iat`, `nbf`, `jti`, and
//! `kubernetes.io` with `namespace`, `serviceaccount`, `pod` and (from v1.30,
//! `ServiceAccountTokenPodNodeInfo`) `node`, each `{name, uid}`. Its signature
//! is random bytes: the fake checks a token by looking it up, so a token it did
//! not issue, or one edited by a client, is unknown.
//!
//! **Reviewing** (`POST /apis/authentication.k8s.io/v1/tokenreviews`,
//! kubernetes `pkg/registry/authentication/tokenreview/storage.go`): `create`
//! only, cluster-scoped, authorized by RBAC (below); an empty `spec.token` is 400.
//! The token is authenticated in the order of kubernetes
//! `pkg/serviceaccount/jwt.go` `AuthenticateToken` and `claims.go` `Validate`:
//!
//! 1. a token the fake did not issue: `authenticated: false`;
//! 2. audiences: the review's `spec.audiences` (the API server's own,
//!    [`API_AUDIENCE`], when empty) intersected with the token's; an empty
//!    intersection is `authenticated: false`, otherwise `status.audiences` is
//!    the intersection;
//! 3. expiry and not-before, with go-jose's one-minute leeway
//!    (`jwt.DefaultLeeway`): a token is refused only once `exp` is more than 60 s
//!    past;
//! 4. the ServiceAccount still exists with the token's UID, and is not being
//!    deleted for more than the leeway;
//! 5. the bound pod still exists with the token's UID, and is not being deleted
//!    for more than the leeway (`service account token has been invalidated`).
//!    A pod-bound token's node is **not** checked against the Nodes: `Validate`
//!    only copies it out.
//!
//! The user is `ServiceAccountInfo.UserInfo()` (k8s.io/apiserver
//! `pkg/authentication/serviceaccount/util.go`): username
//! `system:serviceaccount:NS:NAME`, uid the ServiceAccount's, groups
//! `system:serviceaccounts`, `system:serviceaccounts:NS` and
//! `system:authenticated` (the authenticator's group adder), and `extra`
//! `authentication.kubernetes.io/pod-name`, `pod-uid`, `credential-id`
//! (`JTI=<jti>`) and `node-name`, `node-uid`. A token issued as a v1.29 server
//! does ([`TokenRequest::as_v1_29`]: `ServiceAccountTokenPodNodeInfo` and
//! `ServiceAccountTokenJTI` were alpha) has no node claim and no `jti`, so its
//! review carries no node and no credential id: the node is then only found
//! through the bound pod's `spec.nodeName`.
//!
//! `status.error` is worded like the real one (the union of the server's
//! authenticators prefixes `invalid bearer token, `); clients must only rely on
//! `authenticated`.
//!
//! **Authorization.** The real server authorizes every request; the fake
//! authorizes only TokenReviews, by RBAC evaluated from the
//! ClusterRoleBindings and ClusterRoles in its store (k8s.io/apiserver RBAC
//! `rule_matches`: verbs, apiGroups, resources, each with `*`), plus the
//! `system:masters` group, which RBAC's bootstrap policy allows everything. The
//! bootstrap ClusterRole `system:auth-delegator` (create on tokenreviews and
//! subjectaccessreviews) is known without being stored, as every real cluster
//! has it. RoleBindings grant nothing here (tokenreviews are cluster-scoped);
//! aggregated ClusterRoles are not modelled. A refusal is the real 403.
//!
//! Not modelled: legacy Secret-based tokens, tokens bound to a Secret or
//! directly to a Node, the TokenRequest minimum of 10 minutes (a test may issue
//! any expiry), the year-long extension of 3607 s tokens, `warnafter`, a
//! TokenReview cache, and bearer authentication of the fake's own requests with
//! these tokens (requests name their user by static token or impersonation).

use std::{
    collections::{BTreeMap, HashMap},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use k8s_openapi::jiff::Timestamp;
use serde_json::{Value, json};

use crate::{
    admission::UserInfo,
    error::ApiError,
    log::Verb,
    object::meta_str,
    resource::{GroupResource, Gvr},
    rng::SplitMix64,
    route::ResourcePath,
    store::{ObjKey, Store},
};

/// The issuer, and the audience of the API server itself (kube-apiserver's
/// `--api-audiences` defaults to `--service-account-issuer`).
pub const API_AUDIENCE: &str = "https://kubernetes.default.svc.cluster.local";

/// go-jose's `jwt.DefaultLeeway`, which `claims.go` validates with.
const LEEWAY: Duration = Duration::from_secs(60);

const GROUP: &str = "authentication.k8s.io";
const RESOURCE: &str = "tokenreviews";

/// What a test asks a token for: the TokenRequest the kubelet makes for a pod's
/// projected `serviceAccountToken` volume.
#[derive(Clone, Debug)]
pub struct TokenRequest {
    namespace: String,
    service_account: String,
    pod: String,
    audiences: Vec<String>,
    expiry: Expiry,
    node_info: bool,
}

#[derive(Clone, Copy, Debug)]
enum Expiry {
    In(Duration),
    At(SystemTime),
}

impl TokenRequest {
    /// A token of `namespace/service_account` bound to the pod `namespace/pod`,
    /// for the API server's audience, valid for an hour (the kubelet's default
    /// `expirationSeconds` for a projected token), issued as a v1.30+ server
    /// does (with the node and a `jti`).
    pub fn for_pod(namespace: &str, service_account: &str, pod: &str) -> Self {
        Self {
            namespace: namespace.to_owned(),
            service_account: service_account.to_owned(),
            pod: pod.to_owned(),
            audiences: vec![API_AUDIENCE.to_owned()],
            expiry: Expiry::In(Duration::from_secs(3600)),
            node_info: true,
        }
    }

    /// The token's audiences (a projected volume's `audience`).
    #[must_use]
    pub fn audiences(mut self, audiences: &[&str]) -> Self {
        self.audiences = audiences.iter().map(|a| (*a).to_owned()).collect();
        self
    }

    /// Valid for this long from now.
    #[must_use]
    pub fn expires_in(mut self, life: Duration) -> Self {
        self.expiry = Expiry::In(life);
        self
    }

    /// Valid until this time, which may be past (an expired token).
    #[must_use]
    pub fn expires_at(mut self, at: SystemTime) -> Self {
        self.expiry = Expiry::At(at);
        self
    }

    /// Issued as a v1.29 server does: no node claim, no `jti`
    /// (`ServiceAccountTokenPodNodeInfo` and `ServiceAccountTokenJTI` became beta,
    /// on by default, in v1.30).
    #[must_use]
    pub fn as_v1_29(mut self) -> Self {
        self.node_info = false;
        self
    }
}

#[derive(Clone, Debug)]
struct Ref {
    name: String,
    uid: String,
}

/// The claims of an issued token that the review reads back.
#[derive(Clone, Debug)]
struct Claims {
    audiences: Vec<String>,
    not_before: u64,
    expiry: u64,
    jti: Option<String>,
    namespace: String,
    service_account: Ref,
    pod: Ref,
    node: Option<Ref>,
}

/// The tokens the fake has issued.
#[derive(Debug)]
pub(crate) struct Issued {
    tokens: HashMap<String, Claims>,
    rng: SplitMix64,
}

impl Issued {
    pub(crate) fn new(seed: u64) -> Self {
        Self {
            tokens: HashMap::new(),
            rng: SplitMix64::new(seed ^ 0x746F_6B65_6E73),
        }
    }
}

fn unix_secs(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn get_object(store: &Store, gvr: &Gvr, namespace: &str, name: &str) -> Result<Value, ApiError> {
    let res = store.resolve(gvr).ok_or(ApiError::NoSuchResource)?;
    store
        .get(res, &ObjKey::new(namespace, name))
        .map(|o| (*o).clone())
}

fn uid_of(obj: &Value) -> String {
    meta_str(obj, "uid").unwrap_or_default().to_owned()
}

/// Issue a token as the TokenRequest API does (see the module documentation).
pub(crate) fn issue(
    store: &Store,
    issued: &mut Issued,
    request: &TokenRequest,
    now: SystemTime,
) -> Result<String, ApiError> {
    let TokenRequest {
        namespace,
        service_account,
        pod,
        audiences,
        expiry,
        node_info,
    } = request;
    let sa = get_object(
        store,
        &Gvr::new("", "v1", "serviceaccounts"),
        namespace,
        service_account,
    )?;
    let pod_obj = get_object(store, &Gvr::new("", "v1", "pods"), namespace, pod)?;
    let runs_as = pod_obj["spec"]["serviceAccountName"]
        .as_str()
        .unwrap_or("default");
    if runs_as != service_account {
        return Err(ApiError::TokenForOtherServiceAccount {
            service_account: service_account.clone(),
        });
    }
    let node = match pod_obj["spec"]["nodeName"].as_str() {
        Some(node) if *node_info && !node.is_empty() => {
            get_object(store, &Gvr::new("", "v1", "nodes"), "", node)
                .ok()
                .map(|n| Ref {
                    name: node.to_owned(),
                    uid: uid_of(&n),
                })
        }
        _ => None,
    };
    let expires = match *expiry {
        Expiry::In(life) => now + life,
        Expiry::At(at) => at,
    };
    // An already expired token was issued before it expired.
    let issued_at = unix_secs(
        now.min(
            expires
                .checked_sub(Duration::from_secs(600))
                .unwrap_or(expires),
        ),
    );
    let jti = node_info.then(|| issued.rng.uuid());
    let claims = Claims {
        audiences: audiences.clone(),
        not_before: issued_at,
        expiry: unix_secs(expires),
        jti,
        namespace: namespace.clone(),
        service_account: Ref {
            name: service_account.clone(),
            uid: uid_of(&sa),
        },
        pod: Ref {
            name: pod.clone(),
            uid: uid_of(&pod_obj),
        },
        node,
    };
    let token = jwt(&claims, issued_at, &mut issued.rng);
    issued.tokens.insert(token.clone(), claims);
    Ok(token)
}

fn ref_json(r: &Ref) -> Value {
    json!({"name": r.name, "uid": r.uid})
}

/// A compact JWS with the claims `claims.go` writes and a random signature.
fn jwt(claims: &Claims, issued_at: u64, rng: &mut SplitMix64) -> String {
    let header = json!({"alg": "RS256", "kid": "census-fake-apiserver"});
    let mut kubernetes = json!({
        "namespace": claims.namespace,
        "serviceaccount": ref_json(&claims.service_account),
        "pod": ref_json(&claims.pod),
    });
    if let Some(node) = &claims.node {
        kubernetes["node"] = ref_json(node);
    }
    let mut payload = json!({
        "aud": claims.audiences,
        "exp": claims.expiry,
        "iat": issued_at,
        "iss": API_AUDIENCE,
        "kubernetes.io": kubernetes,
        "nbf": claims.not_before,
        "sub": format!("system:serviceaccount:{}:{}", claims.namespace, claims.service_account.name),
    });
    if let Some(jti) = &claims.jti {
        payload["jti"] = json!(jti);
    }
    let signature: Vec<u8> = (0..32).flat_map(|_| rng.next_u64().to_le_bytes()).collect();
    format!(
        "{}.{}.{}",
        base64url(header.to_string().as_bytes()),
        base64url(payload.to_string().as_bytes()),
        base64url(&signature)
    )
}

/// Base64url without padding (RFC 7515 `BASE64URL`).
fn base64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for i in 0..=chunk.len() {
            out.push(char::from(ALPHABET[(n >> (18 - 6 * i) & 63) as usize]));
        }
    }
    out
}

/// Whether a resource path is the TokenReview endpoint.
pub(crate) fn addresses(p: &ResourcePath) -> bool {
    p.gvr.group == GROUP && p.gvr.version == "v1" && p.gvr.resource == RESOURCE
}

fn resource() -> GroupResource {
    GroupResource {
        group: GROUP.to_owned(),
        resource: RESOURCE.to_owned(),
    }
}

/// `POST /apis/authentication.k8s.io/v1/tokenreviews`: the status code and
/// the body.
pub(crate) fn review(
    store: &Store,
    issued: &Issued,
    user: &UserInfo,
    p: &ResourcePath,
    verb: Verb,
    body: Result<Value, ApiError>,
    now: SystemTime,
) -> Result<(u16, Value), ApiError> {
    if p.namespace.is_some() || p.subresource.is_some() || p.name.is_some() {
        return Err(ApiError::NoSuchResource);
    }
    let verb_name = match verb {
        Verb::Create => "create",
        Verb::Get => "get",
        Verb::List => "list",
        Verb::Watch => "watch",
        Verb::Update => "update",
        Verb::Patch => "patch",
        Verb::Delete => "delete",
        Verb::DeleteCollection => "deletecollection",
        _ => return Err(ApiError::MethodNotAllowed),
    };
    // The authorization filter runs before the handler reads the body.
    if !rbac_allows(store, user, verb_name, GROUP, RESOURCE) {
        return Err(ApiError::AccessDenied {
            resource: resource(),
            user: user.username.clone(),
            verb: verb_name,
        });
    }
    if verb != Verb::Create {
        return Err(ApiError::MethodNotAllowed);
    }
    let mut review = body?;
    if !review.is_object() {
        return Err(ApiError::NotAnObject);
    }
    let token = review["spec"]["token"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    if token.is_empty() {
        return Err(ApiError::TokenRequired);
    }
    let mut requested: Vec<String> = review["spec"]["audiences"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();
    if requested.is_empty() {
        requested = vec![API_AUDIENCE.to_owned()];
    }
    let status = match authenticate(store, issued, &token, &requested, now) {
        Ok((user, audiences)) => json!({
            "authenticated": true,
            "user": user,
            "audiences": audiences,
        }),
        Err(error) => json!({"user": {}, "error": error}),
    };
    review["status"] = status;
    review["apiVersion"] = json!("authentication.k8s.io/v1");
    review["kind"] = json!("TokenReview");
    review["metadata"] = json!({"creationTimestamp": null});
    Ok((201, review))
}

fn quoted(list: &[String]) -> String {
    let items: Vec<String> = list.iter().map(|a| format!("{a:?}")).collect();
    format!("[{}]", items.join(" "))
}

fn invalid(why: impl std::fmt::Display) -> String {
    format!("[invalid bearer token, {why}]")
}

/// Authenticate a token: the user and the audiences, or why not.
fn authenticate(
    store: &Store,
    issued: &Issued,
    token: &str,
    requested: &[String],
    now: SystemTime,
) -> Result<(Value, Vec<String>), String> {
    let Some(claims) = issued.tokens.get(token) else {
        return Err("invalid bearer token".to_owned());
    };
    let audiences: Vec<String> = claims
        .audiences
        .iter()
        .filter(|a| requested.contains(a))
        .cloned()
        .collect();
    if audiences.is_empty() {
        return Err(invalid(format!(
            "token audiences {} is invalid for the target audiences {}",
            quoted(&claims.audiences),
            quoted(requested)
        )));
    }
    let now_secs = unix_secs(now);
    if now_secs.saturating_sub(LEEWAY.as_secs()) > claims.expiry {
        return Err(invalid("service account token has expired"));
    }
    if now_secs + LEEWAY.as_secs() < claims.not_before {
        return Err(invalid("service account token is not valid yet"));
    }
    check_bound_objects(store, claims, now)?;
    Ok((user_info(claims), audiences))
}

/// The objects the token is bound to, still as it claims: its service account
/// (the same uid, not deleted before the leeway) and its pod.
fn check_bound_objects(store: &Store, claims: &Claims, now: SystemTime) -> Result<(), String> {
    let invalid_if_deleted_before = now.checked_sub(LEEWAY).unwrap_or(UNIX_EPOCH);
    let deleted_long_ago = |obj: &Value| {
        meta_str(obj, "deletionTimestamp")
            .and_then(|t| t.parse::<Timestamp>().ok())
            .is_some_and(|t| SystemTime::from(t) < invalid_if_deleted_before)
    };
    let ns = &claims.namespace;
    let sa_ref = &claims.service_account;
    let sa = get_object(
        store,
        &Gvr::new("", "v1", "serviceaccounts"),
        ns,
        &sa_ref.name,
    )
    .map_err(invalid)?;
    if uid_of(&sa) != sa_ref.uid {
        return Err(invalid(format!(
            "service account UID ({}) does not match claim ({})",
            uid_of(&sa),
            sa_ref.uid
        )));
    }
    if deleted_long_ago(&sa) {
        return Err(invalid(format!(
            "service account {ns}/{} has been deleted",
            sa_ref.name
        )));
    }
    let pod_ref = &claims.pod;
    let Ok(pod) = get_object(store, &Gvr::new("", "v1", "pods"), ns, &pod_ref.name) else {
        return Err(invalid("service account token has been invalidated"));
    };
    if uid_of(&pod) != pod_ref.uid {
        return Err(invalid(format!(
            "pod UID ({}) does not match service account pod ref claim ({})",
            uid_of(&pod),
            pod_ref.uid
        )));
    }
    if deleted_long_ago(&pod) {
        return Err(invalid("service account token has been invalidated"));
    }
    Ok(())
}

/// The user a token's `claims` authenticate as: its service account, with the
/// pod (and node) it is bound to as extra.
fn user_info(claims: &Claims) -> Value {
    let ns = &claims.namespace;
    let sa_ref = &claims.service_account;
    let pod_ref = &claims.pod;
    let mut extra: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    extra.insert(
        "authentication.kubernetes.io/pod-name",
        vec![pod_ref.name.clone()],
    );
    extra.insert(
        "authentication.kubernetes.io/pod-uid",
        vec![pod_ref.uid.clone()],
    );
    if let Some(jti) = &claims.jti {
        extra.insert(
            "authentication.kubernetes.io/credential-id",
            vec![format!("JTI={jti}")],
        );
    }
    if let Some(node) = &claims.node {
        extra.insert(
            "authentication.kubernetes.io/node-name",
            vec![node.name.clone()],
        );
        if !node.uid.is_empty() {
            extra.insert(
                "authentication.kubernetes.io/node-uid",
                vec![node.uid.clone()],
            );
        }
    }
    json!({
        "username": format!("system:serviceaccount:{ns}:{}", sa_ref.name),
        "uid": sa_ref.uid,
        "groups": [
            "system:serviceaccounts",
            format!("system:serviceaccounts:{ns}"),
            "system:authenticated",
        ],
        "extra": extra,
    })
}

fn strs(v: &Value) -> Vec<&str> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

/// The rules of the bootstrap ClusterRole `system:auth-delegator`
/// (kubernetes `plugin/pkg/auth/authorizer/rbac/bootstrappolicy/policy.go`).
fn auth_delegator_rules() -> Value {
    json!([
        {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
        {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"], "verbs": ["create"]},
    ])
}

fn subject_is(subject: &Value, user: &UserInfo) -> bool {
    let name = subject["name"].as_str().unwrap_or_default();
    match subject["kind"].as_str() {
        Some("User") => user.username == name,
        Some("Group") => user.groups.iter().any(|g| g == name),
        Some("ServiceAccount") => {
            let ns = subject["namespace"].as_str().unwrap_or_default();
            user.username == format!("system:serviceaccount:{ns}:{name}")
        }
        _ => false,
    }
}

/// Whether the cluster-wide RBAC rules allow `verb` on a cluster-scoped
/// resource, as the RBAC authorizer's `VisitRulesFor` + `RuleAllows` decide
/// (k8s.io/kubernetes `pkg/registry/rbac/validation/rule.go`).
fn rbac_allows(store: &Store, user: &UserInfo, verb: &str, group: &str, resource: &str) -> bool {
    if user.groups.iter().any(|g| g == "system:masters") {
        return true;
    }
    let rbac = |plural: &str| {
        store
            .resolve(&Gvr::new("rbac.authorization.k8s.io", "v1", plural))
            .map(|res| store.all(res))
            .unwrap_or_default()
    };
    let roles = rbac("clusterroles");
    let has = |list: Vec<&str>, value: &str| list.iter().any(|x| *x == "*" || *x == value);
    rbac("clusterrolebindings").iter().any(|binding| {
        let subjects = binding["subjects"].as_array().cloned().unwrap_or_default();
        if !subjects.iter().any(|s| subject_is(s, user)) {
            return false;
        }
        if binding["roleRef"]["kind"].as_str() != Some("ClusterRole") {
            return false;
        }
        let role_name = binding["roleRef"]["name"].as_str().unwrap_or_default();
        let rules = roles
            .iter()
            .find(|r| meta_str(r, "name") == Some(role_name))
            .map(|r| r["rules"].clone())
            .or_else(|| (role_name == "system:auth-delegator").then(auth_delegator_rules))
            .unwrap_or(Value::Null);
        rules.as_array().into_iter().flatten().any(|rule| {
            has(strs(&rule["verbs"]), verb)
                && has(strs(&rule["apiGroups"]), group)
                && has(strs(&rule["resources"]), resource)
                && strs(&rule["resourceNames"]).is_empty()
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64url_matches_rfc_4648_vectors() {
        // RFC 4648 section 10, without padding.
        for (input, want) in [
            ("", ""),
            ("f", "Zg"),
            ("fo", "Zm8"),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg"),
            ("fooba", "Zm9vYmE"),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64url(input.as_bytes()), want);
        }
        assert_eq!(base64url(&[0xfb, 0xff]), "-_8");
    }
}
