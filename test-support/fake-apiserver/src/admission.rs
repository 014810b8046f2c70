//! Who is asking, and ValidatingAdmissionPolicies.
//!
//! **Users.** Requests are authenticated by bearer token as with the real
//! server's static token file (`--token-auth-file`): a token registered with
//! [`crate::FakeApiServer::add_token`] names a user and groups; a request
//! without a token is `system:anonymous` (group `system:unauthenticated`), as
//! with anonymous authentication enabled; an unknown token is 401. Only
//! TokenReviews are authorized (by RBAC, `tokenreview`); elsewhere the user
//! matters to admission only.
//!
//! **ValidatingAdmissionPolicy** (`admissionregistration.k8s.io/v1`): every
//! create, update (also of a subresource) and delete is checked against the
//! policies that a binding names, as the real admission plugin does
//! (k8s.io/apiserver `pkg/admission/plugin/policy/validating`): the policy's
//! `matchConstraints.resourceRules` (groups, versions, resources with
//! `res/sub`, `*` and `res/*`, operations, `resourceNames`, scope) and
//! `excludeResourceRules`, the binding's `matchResources` the same way, then
//! the `matchConditions` and the `validations` as CEL with `object`,
//! `oldObject`, `request` (`userInfo`, `operation`, `name`, `namespace`,
//! `kind`, `resource`) bound, evaluated by `kube-cel`. A false validation in a
//! binding with `validationActions: [Deny]` refuses the request with the
//! real 403 message; an expression that fails to evaluate refuses it when the
//! policy's `failurePolicy` is `Fail` (the default). `Warn`/`Audit` actions
//! refuse nothing. Not modelled: `paramKind`/params, `variables`,
//! `auditAnnotations`, `namespaceSelector`/`objectSelector` (a binding or
//! policy that sets one never matches, so a test cannot silently rely on it),
//! and the delay before a new policy takes effect.

use std::collections::HashMap;

use serde_json::Value;

use crate::{error::ApiError, resource::ResourceSpec};

/// An authenticated user, as `request.userInfo` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct UserInfo {
    pub(crate) username: String,
    pub(crate) groups: Vec<String>,
}

impl UserInfo {
    pub(crate) fn anonymous() -> Self {
        Self {
            username: "system:anonymous".to_owned(),
            groups: vec!["system:unauthenticated".to_owned()],
        }
    }
}

/// Tokens the server accepts, like a static token file.
#[derive(Debug, Default)]
pub(crate) struct Tokens {
    users: HashMap<String, UserInfo>,
}

impl Tokens {
    pub(crate) fn add(&mut self, token: &str, username: &str, groups: &[&str]) {
        let mut groups: Vec<String> = groups.iter().map(|g| (*g).to_owned()).collect();
        // Every authenticated user is in system:authenticated.
        groups.push("system:authenticated".to_owned());
        self.users.insert(
            token.to_owned(),
            UserInfo {
                username: username.to_owned(),
                groups,
            },
        );
    }

    /// The user of an `Authorization` header; `None` for a token nobody issued.
    pub(crate) fn authenticate(&self, authorization: Option<&str>) -> Option<UserInfo> {
        match authorization.and_then(|a| a.strip_prefix("Bearer ")) {
            None => Some(UserInfo::anonymous()),
            Some(token) => self.users.get(token.trim()).cloned(),
        }
    }
}

/// The user a request acts as: the impersonated one when it sends
/// `Impersonate-User` (and `Impersonate-Group`s), as k8s.io/apiserver's
/// `filters/impersonation.go` makes it (plus `system:authenticated`; who may
/// impersonate is not checked, as nothing is authorized here).
pub(crate) fn impersonate(user: UserInfo, headers: &http::HeaderMap) -> UserInfo {
    let Some(name) = headers
        .get("impersonate-user")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty())
    else {
        return user;
    };
    let mut groups: Vec<String> = headers
        .get_all("impersonate-group")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .map(str::to_owned)
        .collect();
    if name.starts_with("system:serviceaccount:") {
        groups.push("system:serviceaccounts".to_owned());
        if let Some(ns) = name
            .trim_start_matches("system:serviceaccount:")
            .split(':')
            .next()
        {
            groups.push(format!("system:serviceaccounts:{ns}"));
        }
    }
    groups.push("system:authenticated".to_owned());
    groups.dedup();
    UserInfo {
        username: name.to_owned(),
        groups,
    }
}

/// An admission operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Operation {
    Create,
    Update,
    Delete,
}

impl Operation {
    fn as_str(self) -> &'static str {
        match self {
            Self::Create => "CREATE",
            Self::Update => "UPDATE",
            Self::Delete => "DELETE",
        }
    }
}

/// The request being admitted.
pub(crate) struct Attributes<'a> {
    pub(crate) operation: Operation,
    pub(crate) spec: &'a ResourceSpec,
    pub(crate) subresource: Option<&'a str>,
    pub(crate) namespace: &'a str,
    pub(crate) name: &'a str,
    pub(crate) object: Option<&'a Value>,
    pub(crate) old_object: Option<&'a Value>,
    pub(crate) user: &'a UserInfo,
}

fn strs(v: &Value) -> Vec<&str> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

fn any_or(list: &[&str], value: &str) -> bool {
    list.iter().any(|x| *x == "*" || *x == value)
}

/// One `NamedRuleWithOperations` (admissionregistration/v1).
fn rule_matches(rule: &Value, a: &Attributes<'_>) -> bool {
    let resource = match a.subresource {
        Some(sub) => format!("{}/{sub}", a.spec.plural),
        None => a.spec.plural.clone(),
    };
    let resources = strs(&rule["resources"]);
    let resource_ok = resources.iter().any(|r| {
        *r == resource
            || (*r == "*" && a.subresource.is_none())
            || *r == "*/*"
            || (a.subresource.is_some() && *r == format!("{}/*", a.spec.plural))
            || a.subresource.is_some_and(|sub| *r == format!("*/{sub}"))
    });
    let names = strs(&rule["resourceNames"]);
    let scope = rule["scope"].as_str().unwrap_or("*");
    let scope_ok = match scope {
        "Cluster" => !a.spec.namespaced,
        "Namespaced" => a.spec.namespaced,
        _ => true,
    };
    any_or(&strs(&rule["apiGroups"]), &a.spec.group)
        && any_or(&strs(&rule["apiVersions"]), &a.spec.version)
        && any_or(&strs(&rule["operations"]), a.operation.as_str())
        && resource_ok
        && (names.is_empty() || names.contains(&a.name))
        && scope_ok
}

/// `MatchResources`: some rule matches and no exclusion does. Selectors are
/// not modelled: a non-empty one never matches.
fn resources_match(m: &Value, a: &Attributes<'_>) -> bool {
    let selector_set = |s: &Value| {
        s.as_object().is_some_and(|o| {
            o.get("matchLabels")
                .and_then(Value::as_object)
                .is_some_and(|l| !l.is_empty())
                || o.get("matchExpressions")
                    .and_then(Value::as_array)
                    .is_some_and(|e| !e.is_empty())
        })
    };
    if selector_set(&m["namespaceSelector"]) || selector_set(&m["objectSelector"]) {
        return false;
    }
    let included = m["resourceRules"]
        .as_array()
        .is_some_and(|rules| rules.iter().any(|r| rule_matches(r, a)));
    let excluded = m["excludeResourceRules"]
        .as_array()
        .is_some_and(|rules| rules.iter().any(|r| rule_matches(r, a)));
    included && !excluded
}

fn evaluator(a: &Attributes<'_>) -> kube_cel::VapEvaluator {
    let request = kube_cel::AdmissionRequest {
        operation: a.operation.as_str().to_owned(),
        username: a.user.username.clone(),
        uid: String::new(),
        groups: a.user.groups.clone(),
        name: a.name.to_owned(),
        namespace: a.namespace.to_owned(),
        dry_run: false,
        kind: kube_cel::GroupVersionKind {
            group: a.spec.group.clone(),
            version: a.spec.version.clone(),
            kind: a.spec.kind.clone(),
        },
        resource: kube_cel::GroupVersionResource {
            group: a.spec.group.clone(),
            version: a.spec.version.clone(),
            resource: a.spec.plural.clone(),
        },
    };
    // `object` is null on DELETE and `oldObject` null on CREATE.
    let mut builder = kube_cel::VapEvaluator::builder()
        .request(request)
        .object(a.object.cloned().unwrap_or(Value::Null));
    if let Some(old) = a.old_object {
        builder = builder.old_object(old.clone());
    }
    builder.build()
}

fn expressions(list: &Value, message_key: bool) -> Vec<kube_cel::VapExpression> {
    list.as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| {
            Some(kube_cel::VapExpression {
                expression: v["expression"].as_str()?.to_owned(),
                message: if message_key {
                    v["message"].as_str().map(str::to_owned)
                } else {
                    None
                },
                message_expression: v["messageExpression"].as_str().map(str::to_owned),
            })
        })
        .collect()
}

/// Check a request against the policies and their bindings; a refusal is
/// the real 403 (`... is forbidden: ValidatingAdmissionPolicy 'p' with
/// binding 'b' denied request: message`).
pub(crate) fn check(
    policies: &[&Value],
    bindings: &[&Value],
    a: &Attributes<'_>,
) -> Result<(), ApiError> {
    for binding in bindings {
        let Some(policy_name) = binding["spec"]["policyName"].as_str() else {
            continue;
        };
        let Some(policy) = policies
            .iter()
            .find(|p| p["metadata"]["name"].as_str() == Some(policy_name))
        else {
            continue;
        };
        let actions = strs(&binding["spec"]["validationActions"]);
        if !actions.contains(&"Deny") {
            continue;
        }
        let spec = &policy["spec"];
        if spec["paramKind"].is_object() || !resources_match(&spec["matchConstraints"], a) {
            continue;
        }
        if binding["spec"]["matchResources"].is_object()
            && !resources_match(&binding["spec"]["matchResources"], a)
        {
            continue;
        }
        let fail_open = spec["failurePolicy"].as_str() == Some("Ignore");
        let eval = evaluator(a);
        let conditions = expressions(&spec["matchConditions"], false);
        let results = eval.evaluate(&conditions);
        if results.iter().any(|r| !r.passed) {
            // A condition that is false skips the policy; one that errs is a
            // failure (refused unless failurePolicy is Ignore). kube-cel does
            // not tell the two apart in its results, so a non-boolean or an
            // error message marks the error.
            let errored = results.iter().any(|r| {
                !r.passed
                    && r.message.as_deref().is_some_and(|m| {
                        m.starts_with("evaluation error") || m.starts_with("expression returned")
                    })
            });
            if errored && !fail_open {
                return Err(denied(
                    a,
                    policy_name,
                    binding,
                    "a match condition failed to evaluate",
                ));
            }
            continue;
        }
        for result in eval.evaluate(&expressions(&spec["validations"], true)) {
            if result.passed {
                continue;
            }
            let message = result.message.unwrap_or_default();
            let errored = message.starts_with("evaluation error")
                || message.starts_with("expression returned");
            if errored && fail_open {
                continue;
            }
            let message = if errored {
                format!(
                    "expression '{}' resulted in error: {message}",
                    result.expression
                )
            } else {
                message
            };
            return Err(denied(a, policy_name, binding, &message));
        }
    }
    Ok(())
}

fn denied(a: &Attributes<'_>, policy: &str, binding: &Value, message: &str) -> ApiError {
    ApiError::Forbidden {
        resource: a.spec.group_resource(),
        name: a.name.to_owned(),
        message: format!(
            "ValidatingAdmissionPolicy '{policy}' with binding '{}' denied request: {message}",
            binding["metadata"]["name"].as_str().unwrap_or_default()
        ),
    }
}
