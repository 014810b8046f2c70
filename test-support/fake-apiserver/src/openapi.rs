//! `/openapi/v3`: just enough of the OpenAPI v3 discovery for `kubectl`.
//!
//! kubectl (k8s.io/cli-runtime `resource/query_param_verifier_v3.go`) reads the
//! root (`{"paths": {"apis/g/v": {"serverRelativeURL": ...}}}`) and a group
//! version's document to decide whether the server validates fields itself: it
//! does when the PATCH operation tagged with the kind's
//! `x-kubernetes-group-version-kind` takes the `fieldValidation` query parameter.
//! Then kubectl sends `fieldValidation=Strict` and validates nothing client-side
//! (without the documents it wants `/openapi/v2` for client-side validation).
//! The documents here hold only those PATCH operations, no schemas: kubectl's
//! `apply` then computes strategic merge patches from its compiled-in types
//! (built-in kinds) and merge patches for custom resources, as it does against
//! a server whose schemas it cannot use. `fieldValidation` itself is accepted
//! and not enforced (unknown fields are kept, not refused).

use serde_json::{Map, Value, json};

use crate::resource::ResourceSpec;

fn gv_path(spec: &ResourceSpec) -> String {
    if spec.group.is_empty() {
        format!("api/{}", spec.version)
    } else {
        format!("apis/{}/{}", spec.group, spec.version)
    }
}

/// `/openapi/v3`.
pub(crate) fn root(specs: &[&ResourceSpec]) -> Value {
    let mut paths = Map::new();
    for spec in specs {
        let path = gv_path(spec);
        paths.insert(
            path.clone(),
            json!({"serverRelativeURL": format!("/openapi/v3/{path}?hash=census-fake")}),
        );
    }
    json!({"paths": paths})
}

/// `/openapi/v3/api/v1` or `/openapi/v3/apis/{group}/{version}`.
pub(crate) fn group_version(specs: &[&ResourceSpec], path: &str) -> Option<Value> {
    let mut paths = Map::new();
    for spec in specs.iter().filter(|s| gv_path(s) == path) {
        let scope = if spec.namespaced {
            "namespaces/{namespace}/"
        } else {
            ""
        };
        let url = format!("/{}/{scope}{}/{{name}}", gv_path(spec), spec.plural);
        paths.insert(
            url,
            json!({"patch": {
                "operationId": format!("patch{}", spec.kind),
                "parameters": [
                    {"name": "fieldValidation", "in": "query", "schema": {"type": "string", "uniqueItems": true}},
                    {"name": "fieldManager", "in": "query", "schema": {"type": "string", "uniqueItems": true}},
                    {"name": "dryRun", "in": "query", "schema": {"type": "string", "uniqueItems": true}},
                ],
                "x-kubernetes-action": "patch",
                "x-kubernetes-group-version-kind": {"group": spec.group, "version": spec.version, "kind": spec.kind},
                "responses": {"200": {"description": "OK"}},
            }}),
        );
    }
    if paths.is_empty() {
        return None;
    }
    Some(json!({
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": "v1.33.0-census-fake"},
        "paths": paths,
        "components": {},
    }))
}
