//! Event validation on create, as the real API server's `ValidateEventCreate`
//! (k8s.io/kubernetes `pkg/apis/core/validation/events.go`, `legacyValidateEvent`),
//! which both the core `v1` and the `events.k8s.io/v1` Events go through (the latter
//! converted to the internal Event: `regarding` is `involvedObject` there, so the
//! field paths in the errors name `involvedObject`):
//!
//! - an Event with `eventTime` set (every `events.k8s.io/v1` Event) about an object
//!   without a namespace (a cluster-scoped object: a Node, a custom resource of
//!   `scope: Cluster`) must be created in `default` or `kube-system`
//!   (`metav1.NamespaceDefault`, `metav1.NamespaceSystem`);
//! - an Event without `eventTime` (an old-style core Event) about such an object only
//!   in `default` (or no namespace), and about a namespaced object only in that
//!   object's namespace;
//! - `events.k8s.io/v1` requires `eventTime` (the strict validation of the new API).
//!
//! The rule looks at the reference's namespace only, never at whether its resource is
//! really cluster-scoped, and so does this.

use serde_json::Value;

use crate::{error::Invalidity, resource::ResourceSpec};

/// `metav1.NamespaceDefault` and `metav1.NamespaceSystem`.
const ALLOWED_FOR_CLUSTER_SCOPED: [&str; 2] = ["default", "kube-system"];

fn is_event(spec: &ResourceSpec) -> bool {
    spec.plural == "events" && matches!(spec.group.as_str(), "" | "events.k8s.io")
}

fn is_set(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::String(s) => !s.is_empty(),
        _ => true,
    }
}

/// Checks an Event about to be created in `namespace`; other resources pass.
pub(crate) fn validate_create(
    spec: &ResourceSpec,
    namespace: &str,
    obj: &Value,
) -> Result<(), Invalidity> {
    if !is_event(spec) {
        return Ok(());
    }
    let new_api = spec.group == "events.k8s.io";
    let reference = if new_api {
        &obj["regarding"]
    } else {
        &obj["involvedObject"]
    };
    let involved = reference["namespace"].as_str().unwrap_or_default();
    let event_time = is_set(&obj["eventTime"]);
    let mismatch = || Invalidity::EventNamespace {
        involved: involved.to_owned(),
    };
    if event_time {
        if involved.is_empty() && !ALLOWED_FOR_CLUSTER_SCOPED.contains(&namespace) {
            return Err(mismatch());
        }
    } else if involved.is_empty() {
        if !namespace.is_empty() && namespace != "default" {
            return Err(mismatch());
        }
    } else if namespace != involved {
        return Err(mismatch());
    }
    if new_api && !event_time {
        return Err(Invalidity::EventTimeRequired);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn new_api() -> ResourceSpec {
        ResourceSpec::namespaced("events.k8s.io", "v1", "Event", "events")
    }

    fn core() -> ResourceSpec {
        ResourceSpec::namespaced("", "v1", "Event", "events")
    }

    #[test]
    fn events_about_cluster_scoped_objects_go_to_default_or_kube_system() {
        let about_identity = json!({
            "eventTime": "2026-01-01T00:00:00.000000Z",
            "regarding": {"apiVersion": "census.dev/v1", "kind": "Identity", "name": "300"},
        });
        for ns in ["default", "kube-system"] {
            assert_eq!(validate_create(&new_api(), ns, &about_identity), Ok(()));
        }
        assert_eq!(
            validate_create(&new_api(), "census-system", &about_identity),
            Err(Invalidity::EventNamespace {
                involved: String::new()
            })
        );
        let about_pod = json!({
            "eventTime": "2026-01-01T00:00:00.000000Z",
            "regarding": {"kind": "Pod", "name": "p", "namespace": "census-system"},
        });
        assert_eq!(
            validate_create(&new_api(), "census-system", &about_pod),
            Ok(())
        );
        assert_eq!(
            validate_create(&new_api(), "default", &json!({"regarding": {}})),
            Err(Invalidity::EventTimeRequired)
        );

        // Old-style core Events: no kube-system for cluster-scoped objects, and a
        // namespaced object's own namespace.
        let old = json!({"involvedObject": {"kind": "Node", "name": "n"}});
        assert_eq!(validate_create(&core(), "default", &old), Ok(()));
        assert!(validate_create(&core(), "kube-system", &old).is_err());
        let old_pod = json!({"involvedObject": {"kind": "Pod", "name": "p", "namespace": "a"}});
        assert_eq!(validate_create(&core(), "a", &old_pod), Ok(()));
        assert!(validate_create(&core(), "b", &old_pod).is_err());
        let other = ResourceSpec::namespaced("", "v1", "ConfigMap", "configmaps");
        assert_eq!(validate_create(&other, "x", &json!({})), Ok(()));
    }
}
