//! Pods as the source reads them.
//!
//! [`PodObject`] is the type the watcher deserializes pods into. Its
//! deserialization never fails: a pod whose fields census reads are not what the
//! API says (a broken object, a version skew) becomes a `PodObject` that knows
//! its name, if it has a readable one, and what is wrong. With `k8s_openapi`'s
//! `Pod`, one such object would fail the whole list it is in (and with it every
//! re-list), or, on a watch, be lost as an anonymous stream error. It also keeps
//! only what the source reads: the rest of the pod (its spec's containers, its
//! status' conditions, `managedFields`) is dropped as each object is read.

use std::{borrow::Cow, collections::BTreeMap, net::IpAddr};

use census_proto::domain::{EndpointKey, NameError, UnusableIp, canonical_ips, check_usable_ip};
use k8s_openapi::{NamespaceResourceScope, apimachinery::pkg::apis::meta::v1::ObjectMeta};
use serde::{Deserialize, Deserializer};
use serde_json::Value;

/// The service account of a pod that names none (the API server's default).
const DEFAULT_SERVICE_ACCOUNT: &str = "default";

/// A pod, as far as the source reads it. See the module documentation.
#[derive(Debug, Clone)]
pub struct PodObject {
    /// Name, namespace, resourceVersion and labels; nothing else.
    metadata: ObjectMeta,
    /// The fields the source reads, or what is wrong with them.
    fields: Result<Fields, PodProblem>,
}

/// Why a pod cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum PodProblem {
    /// A part of the object is not what the API says (in the decoder's words).
    #[error("{part}: {reason}")]
    Undecodable { part: &'static str, reason: String },
    #[error("status.podIPs: {0:?} is not an IP address")]
    PodIp(String),
    #[error("status.podIPs: {ip} is {what}: no endpoint has it")]
    UnusableIp { ip: IpAddr, what: UnusableIp },
    #[error("its namespace/name: {0}")]
    Name(#[from] NameError),
}

impl PodProblem {
    fn undecodable(part: &'static str, error: &serde_json::Error) -> Self {
        Self::Undecodable {
            part,
            reason: error.to_string(),
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Meta {
    name: Option<String>,
    namespace: Option<String>,
    resource_version: Option<String>,
    labels: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Clone, Default)]
struct Fields {
    spec: Option<Spec>,
    status: Option<Status>,
}

impl Fields {
    /// Each part on its own, so that the problem says which one is wrong.
    fn read(value: &Value) -> Result<Self, PodProblem> {
        let spec = Option::<Spec>::deserialize(&value["spec"])
            .map_err(|e| PodProblem::undecodable("spec", &e))?;
        let status = Option::<Status>::deserialize(&value["status"])
            .map_err(|e| PodProblem::undecodable("status", &e))?;
        Ok(Self { spec, status })
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Spec {
    node_name: Option<String>,
    host_network: Option<bool>,
    service_account_name: Option<String>,
    /// Deprecated alias of `serviceAccountName`.
    service_account: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Status {
    phase: Option<String>,
    #[serde(rename = "podIP")]
    pod_ip: Option<String>,
    #[serde(rename = "podIPs")]
    pod_ips: Option<Vec<PodIp>>,
}

#[derive(Debug, Clone, Default, Deserialize)]
struct PodIp {
    ip: Option<String>,
}

impl<'de> Deserialize<'de> for PodObject {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        // Only bytes that are not JSON at all fail here, and they fail the whole
        // answer whatever the type.
        let value = Value::deserialize(deserializer)?;
        Ok(Self::from_value(&value))
    }
}

impl PodObject {
    fn from_value(value: &Value) -> Self {
        let (meta, meta_problem) = match Meta::deserialize(&value["metadata"]) {
            Ok(meta) => (meta, None),
            Err(error) => (
                lenient_meta(value),
                Some(PodProblem::undecodable("metadata", &error)),
            ),
        };
        let fields = match meta_problem {
            Some(problem) => Err(problem),
            None => Fields::read(value),
        };
        Self {
            metadata: ObjectMeta {
                name: meta.name,
                namespace: meta.namespace,
                resource_version: meta.resource_version,
                labels: meta.labels,
                ..ObjectMeta::default()
            },
            fields,
        }
    }

    /// `namespace/name` as written, for messages.
    pub(crate) fn display_name(&self) -> String {
        let meta = &self.metadata;
        format!(
            "{}/{}",
            meta.namespace.as_deref().unwrap_or("?"),
            meta.name.as_deref().unwrap_or("?")
        )
    }

    /// Its endpoint key, or why it has none.
    pub(crate) fn key(&self) -> Result<EndpointKey, PodProblem> {
        let meta = &self.metadata;
        Ok(EndpointKey::new(
            meta.namespace.as_deref().unwrap_or_default(),
            meta.name.as_deref().unwrap_or_default(),
        )?)
    }

    /// What the source makes of this pod on `node`, with all its labels (the
    /// index applies the operator's filter).
    ///
    /// A pod being deleted (`deletionTimestamp` set, Terminating) is still an
    /// endpoint: during its grace period its containers run, it keeps its IP and
    /// may send and receive traffic, so it keeps its identity and counters until
    /// the pod is gone or has Succeeded or Failed. Cilium does the same (its
    /// endpoint lives until the CNI DEL, and an EndpointSlice lists a terminating
    /// pod with `terminating: true` until it is gone).
    pub(crate) fn read(&self, node: &str) -> Read {
        let key = match self.key() {
            Ok(key) => key,
            Err(problem) => {
                return Read::Unreadable { key: None, problem };
            }
        };
        let fields = match &self.fields {
            Ok(fields) => fields,
            Err(problem) => {
                return Read::Unreadable {
                    key: Some(key),
                    problem: problem.clone(),
                };
            }
        };
        let spec = fields.spec.as_ref();
        let status = fields.status.as_ref();
        if spec.and_then(|s| s.node_name.as_deref()) != Some(node) {
            // The field selector already says so; this is a second lock.
            return Read::Skipped(key, Skip::OtherNode);
        }
        if spec.and_then(|s| s.host_network) == Some(true) {
            return Read::Skipped(key, Skip::HostNetwork);
        }
        if let Some(phase @ ("Succeeded" | "Failed")) = status.and_then(|s| s.phase.as_deref()) {
            return Read::Skipped(
                key,
                if phase == "Failed" {
                    Skip::Failed
                } else {
                    Skip::Succeeded
                },
            );
        }
        let texts = status
            .into_iter()
            .flat_map(|s| {
                s.pod_ip
                    .iter()
                    .chain(s.pod_ips.iter().flatten().filter_map(|p| p.ip.as_ref()))
            })
            .filter(|text| !text.is_empty());
        let mut ips = Vec::new();
        for text in texts {
            match text.parse::<IpAddr>() {
                Ok(ip) => match check_usable_ip(ip) {
                    Ok(()) => ips.push(ip),
                    Err(what) => {
                        return Read::Unreadable {
                            key: Some(key),
                            problem: PodProblem::UnusableIp { ip, what },
                        };
                    }
                },
                Err(_) => {
                    return Read::Unreadable {
                        key: Some(key),
                        problem: PodProblem::PodIp(text.clone()),
                    };
                }
            }
        }
        if ips.is_empty() {
            return Read::Skipped(key, Skip::NoIp);
        }
        let labels = self.metadata.labels.clone().unwrap_or_default();
        let service_account = spec
            .and_then(|s| {
                s.service_account_name
                    .as_ref()
                    .or(s.service_account.as_ref())
            })
            .filter(|sa| !sa.is_empty())
            .map_or_else(|| DEFAULT_SERVICE_ACCOUNT.to_owned(), Clone::clone);
        Read::Endpoint(PodEndpoint {
            key,
            ips: canonical_ips(ips),
            labels,
            service_account,
        })
    }
}

/// The name, namespace and resourceVersion of an object whose metadata does not
/// read as such, where they are strings.
fn lenient_meta(value: &Value) -> Meta {
    let text = |field: &str| value["metadata"][field].as_str().map(str::to_owned);
    Meta {
        name: text("name"),
        namespace: text("namespace"),
        resource_version: text("resourceVersion"),
        labels: None,
    }
}

/// A pod that is an endpoint of this node, before its interface is looked up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PodEndpoint {
    pub key: EndpointKey,
    pub ips: Box<[IpAddr]>,
    /// All the pod's labels.
    pub labels: BTreeMap<String, String>,
    pub service_account: String,
}

/// Why a pod is not an endpoint census manages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Skip {
    OtherNode,
    HostNetwork,
    NoIp,
    Succeeded,
    Failed,
}

impl Skip {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::OtherNode => "on another node",
            Self::HostNetwork => "host network",
            Self::NoIp => "no IP yet",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
        }
    }
}

/// What a pod is to the source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Read {
    Endpoint(PodEndpoint),
    Skipped(EndpointKey, Skip),
    /// Its fields are not what the API says: skipped with a warning.
    Unreadable {
        key: Option<EndpointKey>,
        problem: PodProblem,
    },
}

impl kube::Resource for PodObject {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        "Pod".into()
    }

    fn group(_: &()) -> Cow<'_, str> {
        "".into()
    }

    fn version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }

    fn plural(_: &()) -> Cow<'_, str> {
        "pods".into()
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn pod(value: Value) -> PodObject {
        match serde_json::from_value(value) {
            Ok(pod) => pod,
            Err(e) => panic!("a PodObject always deserializes: {e}"),
        }
    }

    fn web(node: &str, phase: &str) -> Value {
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"namespace": "shop", "name": "web-0", "resourceVersion": "7",
                         "labels": {"app": "web", "pod-template-hash": "abc"},
                         "managedFields": [{"manager": "kubelet"}]},
            "spec": {"nodeName": node, "serviceAccountName": "web",
                     "containers": [{"name": "c", "image": "x"}]},
            "status": {"phase": phase, "podIP": "10.1.0.5",
                       "podIPs": [{"ip": "10.1.0.5"}, {"ip": "fd00::5"}]},
        })
    }

    fn key(ns: &str, name: &str) -> EndpointKey {
        EndpointKey::new(ns, name).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn reads_an_endpoint_with_all_its_labels() {
        let read = pod(web("n1", "Running")).read("n1");
        let Read::Endpoint(endpoint) = read else {
            panic!("{read:?}");
        };
        assert_eq!(endpoint.key, key("shop", "web-0"));
        assert_eq!(
            endpoint
                .ips
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>(),
            ["10.1.0.5", "fd00::5"]
        );
        assert_eq!(
            endpoint.labels,
            BTreeMap::from([
                ("app".to_owned(), "web".to_owned()),
                ("pod-template-hash".to_owned(), "abc".to_owned())
            ])
        );
        assert_eq!(endpoint.service_account, "web");
    }

    #[test]
    fn keeps_only_what_it_reads() {
        let object = pod(web("n1", "Running"));
        let meta = &object.metadata;
        assert!(meta.managed_fields.is_none() && meta.uid.is_none());
        assert_eq!(meta.resource_version.as_deref(), Some("7"));
    }

    #[test]
    fn skips_what_is_not_an_endpoint() {
        let skipped = |value: Value| match pod(value).read("n1") {
            Read::Skipped(_, why) => Some(why),
            _ => None,
        };
        assert_eq!(skipped(web("n2", "Running")), Some(Skip::OtherNode));
        assert_eq!(skipped(web("n1", "Succeeded")), Some(Skip::Succeeded));
        assert_eq!(skipped(web("n1", "Failed")), Some(Skip::Failed));
        let mut host = web("n1", "Running");
        host["spec"]["hostNetwork"] = json!(true);
        assert_eq!(skipped(host), Some(Skip::HostNetwork));
        let mut pending = web("n1", "Pending");
        pending["status"] = json!({"phase": "Pending"});
        assert_eq!(skipped(pending), Some(Skip::NoIp));
        let mut defaulted = web("n1", "Running");
        defaulted["spec"]["serviceAccountName"] = json!(null);
        assert!(matches!(
            pod(defaulted).read("n1"),
            Read::Endpoint(e) if e.service_account == "default"
        ));
        // Terminating: still an endpoint, until it is gone or finished.
        let mut terminating = web("n1", "Running");
        terminating["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:30Z");
        terminating["metadata"]["deletionGracePeriodSeconds"] = json!(30);
        assert!(matches!(pod(terminating).read("n1"), Read::Endpoint(_)));
    }

    #[test]
    fn a_broken_object_still_deserializes_and_names_itself() {
        let mut broken = web("n1", "Running");
        broken["status"]["podIPs"] = json!("10.1.0.5");
        let object = pod(broken);
        assert_eq!(object.display_name(), "shop/web-0");
        assert!(matches!(
            object.read("n1"),
            Read::Unreadable { key: Some(k), problem } if k == key("shop", "web-0") && problem.to_string().starts_with("status: invalid type")
        ));

        let mut bad_ip = web("n1", "Running");
        bad_ip["status"]["podIP"] = json!("10.1.0.500");
        assert!(matches!(
            pod(bad_ip).read("n1"),
            Read::Unreadable { problem, .. } if problem.to_string().contains("\"10.1.0.500\" is not an IP address")
        ));
        // An address no endpoint can have: the pod is unreadable, named.
        let mut link_local = web("n1", "Running");
        link_local["status"]["podIP"] = json!("169.254.1.5");
        link_local["status"]["podIPs"] = json!([{"ip": "169.254.1.5"}]);
        assert!(matches!(
            pod(link_local).read("n1"),
            Read::Unreadable { problem, .. } if problem.to_string() == "status.podIPs: 169.254.1.5 is a link-local address: no endpoint has it"
        ));

        let mut bad_labels = web("n1", "Running");
        bad_labels["metadata"]["labels"] = json!(["app=web"]);
        let object = pod(bad_labels);
        assert_eq!(object.metadata.resource_version.as_deref(), Some("7"));
        assert!(matches!(
            object.read("n1"),
            Read::Unreadable { key: Some(_), problem } if problem.to_string().starts_with("metadata: ")
        ));

        let nameless = pod(json!({"metadata": 5}));
        assert!(matches!(
            nameless.read("n1"),
            Read::Unreadable { key: None, .. }
        ));
        assert_eq!(nameless.display_name(), "?/?");
    }

    #[test]
    fn a_list_with_a_broken_item_still_reads() {
        let list = json!({
            "apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "9"},
            "items": [web("n1", "Running"), {"metadata": {"name": "x", "namespace": "y"}, "spec": 3}],
        });
        let list: kube::core::ObjectList<PodObject> = match serde_json::from_value(list) {
            Ok(list) => list,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(list.items.len(), 2);
    }
}
