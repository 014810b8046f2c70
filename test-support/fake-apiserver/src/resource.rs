//! What the server knows how to serve: resource kinds, their names and scope.

use std::fmt;

use serde_json::{Value, json};

/// A resource type the server serves, like a row of `kubectl api-resources`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ResourceSpec {
    /// API group; empty for the core group.
    pub group: String,
    /// API version within the group, e.g. `v1`.
    pub version: String,
    /// The kind, e.g. `Pod`.
    pub kind: String,
    /// The plural resource name used in URLs, e.g. `pods`.
    pub plural: String,
    /// Whether objects live in namespaces.
    pub namespaced: bool,
    /// Whether the `/status` subresource is enabled: then status changes are
    /// ignored on the main resource and only status changes apply on `/status`.
    pub status_subresource: bool,
}

impl ResourceSpec {
    /// A namespaced resource without the status subresource.
    pub fn namespaced(group: &str, version: &str, kind: &str, plural: &str) -> Self {
        Self {
            group: group.to_owned(),
            version: version.to_owned(),
            kind: kind.to_owned(),
            plural: plural.to_owned(),
            namespaced: true,
            status_subresource: false,
        }
    }

    /// A cluster-scoped resource without the status subresource.
    pub fn cluster(group: &str, version: &str, kind: &str, plural: &str) -> Self {
        Self {
            namespaced: false,
            ..Self::namespaced(group, version, kind, plural)
        }
    }

    /// The same resource with the `/status` subresource enabled.
    #[must_use]
    pub fn with_status(mut self) -> Self {
        self.status_subresource = true;
        self
    }

    /// The spec of a kube-rs typed resource, e.g. `ResourceSpec::of::<Pod>(true)`.
    pub fn of<K: kube::Resource<DynamicType = ()>>(namespaced: bool) -> Self {
        let spec = Self::namespaced(
            &K::group(&()),
            &K::version(&()),
            &K::kind(&()),
            &K::plural(&()),
        );
        Self { namespaced, ..spec }
    }

    /// `group/version`, or `version` for the core group.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// The group/version/resource triple that addresses this resource.
    pub fn gvr(&self) -> Gvr {
        Gvr::new(&self.group, &self.version, &self.plural)
    }

    pub(crate) fn group_resource(&self) -> GroupResource {
        GroupResource {
            group: self.group.clone(),
            resource: self.plural.clone(),
        }
    }

    fn discovery_entries(&self) -> Vec<Value> {
        let mut out = vec![json!({
            "name": self.plural,
            "singularName": self.kind.to_lowercase(),
            "namespaced": self.namespaced,
            "kind": self.kind,
            "verbs": ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"],
        })];
        if self.status_subresource {
            out.push(json!({
                "name": format!("{}/status", self.plural),
                "singularName": "",
                "namespaced": self.namespaced,
                "kind": self.kind,
                "verbs": ["get", "patch", "update"],
            }));
        }
        out
    }

    fn aggregated_entry(&self) -> Value {
        let scope = if self.namespaced {
            "Namespaced"
        } else {
            "Cluster"
        };
        let kind = json!({"group": self.group, "version": self.version, "kind": self.kind});
        let subresources: Vec<Value> = if self.status_subresource {
            vec![
                json!({"subresource": "status", "responseKind": kind, "verbs": ["get", "patch", "update"]}),
            ]
        } else {
            Vec::new()
        };
        json!({
            "resource": self.plural,
            "responseKind": kind,
            "scope": scope,
            "singularResource": self.kind.to_lowercase(),
            "verbs": ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"],
            "subresources": subresources,
        })
    }
}

/// Group, version and (plural) resource: how a URL names a collection.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Gvr {
    /// API group; empty for the core group.
    pub group: String,
    /// API version.
    pub version: String,
    /// Plural resource name.
    pub resource: String,
}

impl Gvr {
    /// `Gvr::new("", "v1", "pods")`.
    pub fn new(group: &str, version: &str, resource: &str) -> Self {
        Self {
            group: group.to_owned(),
            version: version.to_owned(),
            resource: resource.to_owned(),
        }
    }

    /// The GVR of a kube-rs typed resource, e.g. `Gvr::of::<Pod>()`.
    pub fn of<K: kube::Resource<DynamicType = ()>>() -> Self {
        Self::new(&K::group(&()), &K::version(&()), &K::plural(&()))
    }
}

impl fmt::Display for Gvr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.group.is_empty() {
            write!(f, "{}/{}", self.version, self.resource)
        } else {
            write!(f, "{}/{}/{}", self.group, self.version, self.resource)
        }
    }
}

/// `pods` or `leases.coordination.k8s.io`, as the API server names resources in
/// its error messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupResource {
    /// API group; empty for the core group.
    pub group: String,
    /// Plural resource name.
    pub resource: String,
}

impl fmt::Display for GroupResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.group.is_empty() {
            f.write_str(&self.resource)
        } else {
            write!(f, "{}.{}", self.resource, self.group)
        }
    }
}

pub(crate) const CRD_GROUP: &str = "apiextensions.k8s.io";
pub(crate) const CRD_PLURAL: &str = "customresourcedefinitions";

/// The resources a fresh server serves.
pub(crate) fn builtins() -> Vec<ResourceSpec> {
    vec![
        ResourceSpec::namespaced("", "v1", "Pod", "pods").with_status(),
        ResourceSpec::cluster("", "v1", "Node", "nodes").with_status(),
        ResourceSpec::namespaced("", "v1", "ConfigMap", "configmaps"),
        ResourceSpec::namespaced("", "v1", "Secret", "secrets"),
        ResourceSpec::cluster("", "v1", "Namespace", "namespaces").with_status(),
        ResourceSpec::namespaced("", "v1", "Event", "events"),
        ResourceSpec::namespaced("", "v1", "Service", "services").with_status(),
        ResourceSpec::namespaced("", "v1", "ServiceAccount", "serviceaccounts"),
        ResourceSpec::namespaced("events.k8s.io", "v1", "Event", "events"),
        ResourceSpec::namespaced("coordination.k8s.io", "v1", "Lease", "leases"),
        // Kubernetes 1.33+ (GA): the cluster's ClusterIP ranges.
        ResourceSpec::cluster("networking.k8s.io", "v1", "ServiceCIDR", "servicecidrs")
            .with_status(),
        // Served by every cluster since 1.21 (GA); no status subresource.
        ResourceSpec::namespaced("discovery.k8s.io", "v1", "EndpointSlice", "endpointslices"),
        ResourceSpec::cluster(CRD_GROUP, "v1", "CustomResourceDefinition", CRD_PLURAL)
            .with_status(),
        // Stored and served, not acted on (no controllers), so that `kubectl apply`
        // of census's manifests works; ValidatingAdmissionPolicies are enforced
        // (`admission`).
        ResourceSpec::namespaced("", "v1", "ResourceQuota", "resourcequotas").with_status(),
        ResourceSpec::namespaced("apps", "v1", "Deployment", "deployments").with_status(),
        ResourceSpec::namespaced("apps", "v1", "DaemonSet", "daemonsets").with_status(),
        ResourceSpec::namespaced(
            "policy",
            "v1",
            "PodDisruptionBudget",
            "poddisruptionbudgets",
        )
        .with_status(),
        ResourceSpec::cluster(
            "scheduling.k8s.io",
            "v1",
            "PriorityClass",
            "priorityclasses",
        ),
        ResourceSpec::cluster(RBAC_GROUP, "v1", "ClusterRole", "clusterroles"),
        ResourceSpec::cluster(
            RBAC_GROUP,
            "v1",
            "ClusterRoleBinding",
            "clusterrolebindings",
        ),
        ResourceSpec::namespaced(RBAC_GROUP, "v1", "Role", "roles"),
        ResourceSpec::namespaced(RBAC_GROUP, "v1", "RoleBinding", "rolebindings"),
        ResourceSpec::cluster(
            VAP_GROUP,
            "v1",
            "ValidatingAdmissionPolicy",
            "validatingadmissionpolicies",
        )
        .with_status(),
        ResourceSpec::cluster(
            VAP_GROUP,
            "v1",
            "ValidatingAdmissionPolicyBinding",
            "validatingadmissionpolicybindings",
        ),
    ]
}

const RBAC_GROUP: &str = "rbac.authorization.k8s.io";
pub(crate) const VAP_GROUP: &str = "admissionregistration.k8s.io";

/// The namespaces a real cluster starts with.
pub(crate) const INITIAL_NAMESPACES: [&str; 4] =
    ["default", "kube-system", "kube-public", "kube-node-lease"];

/// The resource specs a CustomResourceDefinition object declares (one per
/// served version), or none if the object is not a usable CRD.
pub(crate) fn specs_from_crd(crd: &Value) -> Vec<ResourceSpec> {
    let spec = &crd["spec"];
    let (Some(group), Some(kind), Some(plural)) = (
        spec["group"].as_str(),
        spec["names"]["kind"].as_str(),
        spec["names"]["plural"].as_str(),
    ) else {
        return Vec::new();
    };
    let namespaced = spec["scope"].as_str() != Some("Cluster");
    let Some(versions) = spec["versions"].as_array() else {
        return Vec::new();
    };
    versions
        .iter()
        .filter(|v| v["served"].as_bool().unwrap_or(true))
        .filter_map(|v| {
            let name = v["name"].as_str()?;
            Some(ResourceSpec {
                group: group.to_owned(),
                version: name.to_owned(),
                kind: kind.to_owned(),
                plural: plural.to_owned(),
                namespaced,
                status_subresource: v["subresources"]["status"].is_object(),
            })
        })
        .collect()
}

/// Discovery documents (`/api`, `/apis`, ...) for a set of active resources.
pub(crate) struct Discovery<'a> {
    pub(crate) specs: Vec<&'a ResourceSpec>,
}

impl Discovery<'_> {
    fn groups(&self) -> Vec<(String, Vec<String>)> {
        let mut groups: Vec<(String, Vec<String>)> = Vec::new();
        for spec in &self.specs {
            if spec.group.is_empty() {
                continue;
            }
            match groups.iter_mut().find(|(g, _)| *g == spec.group) {
                Some((_, versions)) => {
                    if !versions.contains(&spec.version) {
                        versions.push(spec.version.clone());
                    }
                }
                None => groups.push((spec.group.clone(), vec![spec.version.clone()])),
            }
        }
        groups
    }

    pub(crate) fn api_versions(&self, server_address: &str) -> Value {
        json!({
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}],
        })
    }

    fn group_doc(group: &str, versions: &[String]) -> Value {
        let versions: Vec<Value> = versions
            .iter()
            .map(|v| json!({"groupVersion": format!("{group}/{v}"), "version": v}))
            .collect();
        json!({
            "kind": "APIGroup",
            "apiVersion": "v1",
            "name": group,
            "versions": versions,
            "preferredVersion": versions.first(),
        })
    }

    pub(crate) fn group_list(&self) -> Value {
        let groups: Vec<Value> = self
            .groups()
            .iter()
            .map(|(g, vs)| {
                let mut doc = Self::group_doc(g, vs);
                if let Some(obj) = doc.as_object_mut() {
                    obj.remove("kind");
                    obj.remove("apiVersion");
                }
                doc
            })
            .collect();
        json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
    }

    pub(crate) fn group(&self, group: &str) -> Option<Value> {
        self.groups()
            .iter()
            .find(|(g, _)| g == group)
            .map(|(g, vs)| Self::group_doc(g, vs))
    }

    pub(crate) fn resource_list(&self, group: &str, version: &str) -> Option<Value> {
        let resources: Vec<Value> = self
            .specs
            .iter()
            .filter(|s| s.group == group && s.version == version)
            .flat_map(|s| s.discovery_entries())
            .collect();
        if resources.is_empty() {
            return None;
        }
        let group_version = if group.is_empty() {
            version.to_owned()
        } else {
            format!("{group}/{version}")
        };
        Some(json!({
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": group_version,
            "resources": resources,
        }))
    }

    /// Aggregated discovery (`apidiscovery.k8s.io/v2`) for the core group
    /// (`core == true`, served at `/api`) or all other groups (`/apis`).
    pub(crate) fn aggregated(&self, core: bool) -> Value {
        let groups = if core {
            vec![(String::new(), vec!["v1".to_owned()])]
        } else {
            self.groups()
        };
        let items: Vec<Value> = groups
            .iter()
            .map(|(group, versions)| {
                let versions: Vec<Value> = versions
                    .iter()
                    .map(|version| {
                        let resources: Vec<Value> = self
                            .specs
                            .iter()
                            .filter(|s| &s.group == group && &s.version == version)
                            .map(|s| s.aggregated_entry())
                            .collect();
                        json!({"version": version, "resources": resources, "freshness": "Current"})
                    })
                    .collect();
                json!({"metadata": {"name": group}, "versions": versions})
            })
            .collect();
        json!({
            "kind": "APIGroupDiscoveryList",
            "apiVersion": "apidiscovery.k8s.io/v2",
            "metadata": {},
            "items": items,
        })
    }
}
