//! deploy/: every manifest parses into the k8s-openapi type of its kind with no field
//! that type does not know (the PrometheusRule into a typed struct that denies unknown
//! fields), says what DESIGN.md asks of it, and the CRD is what `crdgen` writes.

use std::{collections::BTreeMap, path::Path};

use k8s_openapi::{
    api::{
        apps::v1::{DaemonSet, Deployment},
        core::v1::{Container, Namespace, PodSpec, ResourceQuota, Service, ServiceAccount},
        policy::v1::PodDisruptionBudget,
        rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding},
    },
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
};
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use serde_json::Value;

use census_operator::{
    config::ServiceAccountRef,
    k8s::endpointslice::{LEADER_SERVICE, PORT_NAME},
};

use crate::common::{TestResult, fail, repo_root, yaml_docs};

/// The PrometheusRule CRD's fields census uses.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PrometheusRule {
    api_version: String,
    kind: String,
    metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    spec: RuleSpec,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleSpec {
    groups: Vec<RuleGroup>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleGroup {
    name: String,
    rules: Vec<AlertRule>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct AlertRule {
    alert: String,
    expr: String,
    #[serde(default, rename = "for")]
    for_: Option<String>,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
}

/// Keys of `original` that the typed round trip lost: fields the type does not have.
fn unknown_keys(original: &Value, typed: &Value, path: &str, out: &mut Vec<String>) {
    match (original, typed) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in a {
                match b.get(k) {
                    Some(w) => unknown_keys(v, w, &format!("{path}.{k}"), out),
                    None => out.push(format!("{path}.{k}")),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) => {
            for (i, v) in a.iter().enumerate() {
                match b.get(i) {
                    Some(w) => unknown_keys(v, w, &format!("{path}[{i}]"), out),
                    None => out.push(format!("{path}[{i}]")),
                }
            }
        }
        _ => {}
    }
}

fn strict<T: DeserializeOwned + Serialize>(doc: &Value, file: &str) -> TestResult<T> {
    let typed: T = serde_json::from_value(doc.clone())
        .map_err(|e| format!("{file}: {} {}: {e}", doc["kind"], doc["metadata"]["name"]))?;
    let back = serde_json::to_value(&typed)?;
    let mut unknown = Vec::new();
    unknown_keys(doc, &back, "", &mut unknown);
    if !unknown.is_empty() {
        return fail(format!(
            "{file}: {} {} has fields its type does not know: {unknown:?}",
            doc["kind"], doc["metadata"]["name"]
        ));
    }
    Ok(typed)
}

/// Every manifest under deploy/, parsed strictly.
#[derive(Default)]
struct Manifests {
    deployments: Vec<Deployment>,
    daemonsets: Vec<DaemonSet>,
    services: Vec<Service>,
    pdbs: Vec<PodDisruptionBudget>,
    cluster_roles: Vec<ClusterRole>,
    cluster_role_bindings: Vec<ClusterRoleBinding>,
    roles: Vec<Role>,
    namespaces: Vec<Namespace>,
    quotas: Vec<ResourceQuota>,
    service_accounts: Vec<ServiceAccount>,
    rules: Vec<PrometheusRule>,
    crds: Vec<CustomResourceDefinition>,
    count: usize,
}

fn yaml_files(dir: &Path, out: &mut Vec<String>) -> TestResult {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            yaml_files(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            let relative = path.strip_prefix(repo_root())?.display().to_string();
            out.push(relative);
        }
    }
    Ok(())
}

fn manifests() -> TestResult<Manifests> {
    let mut files = Vec::new();
    yaml_files(&repo_root().join("deploy"), &mut files)?;
    let mut m = Manifests::default();
    for file in &files {
        for doc in yaml_docs(file)? {
            m.count += 1;
            let api_version = doc["apiVersion"].as_str().unwrap_or_default();
            let kind = doc["kind"].as_str().unwrap_or_default();
            match (api_version, kind) {
                ("v1", "Namespace") => m.namespaces.push(strict(&doc, file)?),
                ("v1", "ResourceQuota") => m.quotas.push(strict(&doc, file)?),
                ("v1", "ServiceAccount") => m.service_accounts.push(strict(&doc, file)?),
                ("v1", "Service") => m.services.push(strict(&doc, file)?),
                ("apps/v1", "Deployment") => m.deployments.push(strict(&doc, file)?),
                ("apps/v1", "DaemonSet") => m.daemonsets.push(strict(&doc, file)?),
                ("policy/v1", "PodDisruptionBudget") => m.pdbs.push(strict(&doc, file)?),
                ("rbac.authorization.k8s.io/v1", "ClusterRole") => {
                    m.cluster_roles.push(strict(&doc, file)?);
                }
                ("rbac.authorization.k8s.io/v1", "Role") => m.roles.push(strict(&doc, file)?),
                ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
                    m.cluster_role_bindings.push(strict(&doc, file)?);
                }
                ("rbac.authorization.k8s.io/v1", "RoleBinding") => {
                    drop(strict::<RoleBinding>(&doc, file)?);
                }
                ("apiextensions.k8s.io/v1", "CustomResourceDefinition") => {
                    m.crds.push(strict(&doc, file)?);
                }
                ("monitoring.coreos.com/v1", "PrometheusRule") => m.rules.push(strict(&doc, file)?),
                ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy") => {
                    drop(strict::<
                        k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicy,
                    >(&doc, file)?);
                }
                ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding") => {
                    drop(strict::<
                        k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicyBinding,
                    >(&doc, file)?);
                }
                _ => {
                    return fail(format!(
                        "{file}: a {api_version} {kind} the test does not know"
                    ));
                }
            }
        }
    }
    Ok(m)
}

fn containers(spec: &PodSpec) -> impl Iterator<Item = &Container> {
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
}

fn probe_port(c: &Container) -> Vec<String> {
    [&c.readiness_probe, &c.liveness_probe]
        .into_iter()
        .flatten()
        .filter_map(|p| p.http_get.as_ref())
        .map(|g| match &g.port {
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(n) => n.to_string(),
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(name) => c
                .ports
                .iter()
                .flatten()
                .find(|p| p.name.as_deref() == Some(name))
                .map_or_else(|| name.clone(), |p| p.container_port.to_string()),
        })
        .collect()
}

#[test]
fn every_manifest_parses_strictly_and_says_what_the_design_asks() -> TestResult {
    let m = manifests()?;
    assert!(m.count >= 15, "{} manifests", m.count);

    let pod_specs: Vec<&PodSpec> = m
        .deployments
        .iter()
        .filter_map(|d| d.spec.as_ref()?.template.spec.as_ref())
        .chain(
            m.daemonsets
                .iter()
                .filter_map(|d| d.spec.as_ref()?.template.spec.as_ref()),
        )
        .collect();
    assert_eq!(pod_specs.len(), 2);
    for spec in &pod_specs {
        for c in containers(spec) {
            let resources = c
                .resources
                .as_ref()
                .ok_or(format!("{}: no resources", c.name))?;
            assert!(
                resources
                    .requests
                    .as_ref()
                    .is_some_and(|r| r.contains_key("memory")),
                "{}",
                c.name
            );
            assert!(
                resources
                    .limits
                    .as_ref()
                    .is_some_and(|l| l.contains_key("memory")),
                "{}",
                c.name
            );
        }
    }

    let operator = m.deployments.first().ok_or("no operator Deployment")?;
    let spec = operator.spec.as_ref().ok_or("no spec")?;
    assert_eq!(spec.replicas, Some(2));
    let pod = spec.template.spec.as_ref().ok_or("no pod spec")?;
    let c = &pod.containers[0];
    assert_eq!(probe_port(c), ["9461", "9461"]);
    let env: BTreeMap<&str, &k8s_openapi::api::core::v1::EnvVar> = c
        .env
        .iter()
        .flatten()
        .map(|e| (e.name.as_str(), e))
        .collect();
    assert_eq!(env["CENSUS_STORE"].value.as_deref(), Some("kubernetes"));
    for (var, field) in [
        ("CENSUS_POD_NAME", "metadata.name"),
        ("CENSUS_POD_IP", "status.podIP"),
    ] {
        let from = env[var]
            .value_from
            .as_ref()
            .and_then(|v| v.field_ref.as_ref());
        assert_eq!(from.map(|f| f.field_path.as_str()), Some(field));
    }

    let agent = m.daemonsets.first().ok_or("no agent DaemonSet")?;
    let pod = agent
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .ok_or("no pod spec")?;
    assert_eq!(pod.host_network, Some(true));
    assert!(
        pod.tolerations
            .iter()
            .flatten()
            .any(|t| t.operator.as_deref() == Some("Exists")
                && t.key.is_none()
                && t.effect.is_none()),
        "the agent must tolerate every taint"
    );
    let c = &pod.containers[0];
    // Probes on the health listener; the unauthenticated admin API on loopback.
    assert_eq!(probe_port(c), ["9463", "9463"]);
    let agent_env = |name: &str| {
        c.env
            .iter()
            .flatten()
            .find(|e| e.name == name)
            .and_then(|e| e.value.clone())
    };
    assert_eq!(
        agent_env("CENSUS_ADMIN_LISTEN").as_deref(),
        Some("127.0.0.1:9462")
    );
    assert_eq!(
        agent_env("CENSUS_HEALTH_LISTEN").as_deref(),
        Some("0.0.0.0:9463")
    );
    let security = c.security_context.as_ref().ok_or("no securityContext")?;
    assert_ne!(security.privileged, Some(true));
    let caps = security.capabilities.as_ref().ok_or("no capabilities")?;
    assert_eq!(
        caps.add.as_deref(),
        Some(
            &[
                "BPF".to_owned(),
                "NET_ADMIN".to_owned(),
                "PERFMON".to_owned()
            ][..]
        )
    );
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_owned()][..]));
    let bpffs = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| {
            v.host_path
                .as_ref()
                .is_some_and(|h| h.path == "/sys/fs/bpf")
        })
        .ok_or("no bpffs volume")?;
    assert!(
        c.volume_mounts
            .iter()
            .flatten()
            .any(|v| v.name == bpffs.name && v.mount_path == "/sys/fs/bpf")
    );

    let pdb = m.pdbs.first().ok_or("no PodDisruptionBudget")?;
    assert_eq!(
        pdb.spec.as_ref().and_then(|s| s.max_unavailable.clone()),
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(1))
    );
    // Reads go to any replica; the leader Service has no selector (the leader
    // publishes its EndpointSlice), and its port name is the slice's.
    let service = |name: &str| {
        m.services
            .iter()
            .find(|s| s.metadata.name.as_deref() == Some(name))
            .and_then(|s| s.spec.as_ref())
            .ok_or(format!("no Service {name}"))
    };
    assert!(
        service("census-operator")?
            .selector
            .as_ref()
            .is_some_and(
                |s| s.get("app.kubernetes.io/name").map(String::as_str) == Some("census-operator")
            )
    );
    let leader = service(LEADER_SERVICE)?;
    assert_eq!(
        leader.selector, None,
        "the leader Service must have no selector"
    );
    assert_eq!(
        leader
            .ports
            .iter()
            .flatten()
            .map(|p| (p.name.as_deref(), p.port))
            .collect::<Vec<_>>(),
        [(Some(PORT_NAME), 9460)]
    );

    let agent_role = m
        .cluster_roles
        .iter()
        .find(|r| r.metadata.name.as_deref() == Some("census-agent"))
        .ok_or("no agent ClusterRole")?;
    let rules = agent_role.rules.as_ref().ok_or("no rules")?;
    assert_eq!(rules.len(), 1);
    assert_eq!(
        rules[0].resources.as_deref(),
        Some(&["pods".to_owned()][..])
    );
    assert_eq!(rules[0].verbs, ["get", "list", "watch"]);

    let exprs: Vec<&str> = m
        .rules
        .iter()
        .flat_map(|r| &r.spec.groups)
        .flat_map(|g| &g.rules)
        .map(|r| r.expr.as_str())
        .collect();
    for needle in [
        "census_id_range_usage_ratio",
        "census_stale_nodes",
        "container_memory_working_set_bytes{container=\"census-operator\"}",
        "container_memory_working_set_bytes{container=\"census-agent\"}",
    ] {
        assert!(
            exprs.iter().any(|e| e.contains(needle)),
            "no alert on {needle}"
        );
    }
    assert!(
        exprs
            .iter()
            .filter(|e| e.contains("> 1.10") && e.contains("[7d:1d]"))
            .count()
            == 2
    );
    assert_eq!(m.crds.len(), 1);
    Ok(())
}

/// What the Pod Security Standards' `restricted` level refuses in `spec`
/// (kubernetes.io/docs/concepts/security/pod-security-standards/, "Restricted").
fn restricted_violations(spec: &PodSpec) -> Vec<String> {
    let mut out = Vec::new();
    let pod = spec.security_context.clone().unwrap_or_default();
    for (what, on) in [
        ("hostNetwork", spec.host_network),
        ("hostPID", spec.host_pid),
        ("hostIPC", spec.host_ipc),
    ] {
        if on == Some(true) {
            out.push(what.to_owned());
        }
    }
    for v in spec.volumes.iter().flatten() {
        let allowed = v.config_map.is_some()
            || v.csi.is_some()
            || v.downward_api.is_some()
            || v.empty_dir.is_some()
            || v.ephemeral.is_some()
            || v.persistent_volume_claim.is_some()
            || v.projected.is_some()
            || v.secret.is_some();
        if !allowed {
            out.push(format!("volume {}", v.name));
        }
    }
    for c in containers(spec) {
        let sc = c.security_context.clone().unwrap_or_default();
        if sc.privileged == Some(true) {
            out.push(format!("{}: privileged", c.name));
        }
        if c.ports
            .iter()
            .flatten()
            .any(|p| p.host_port.is_some_and(|h| h != 0))
        {
            out.push(format!("{}: hostPort", c.name));
        }
        let caps = sc.capabilities.clone().unwrap_or_default();
        if !caps.drop.iter().flatten().any(|d| d == "ALL") {
            out.push(format!("{}: capabilities not dropped (ALL)", c.name));
        }
        if caps.add.iter().flatten().any(|a| a != "NET_BIND_SERVICE") {
            out.push(format!("{}: capabilities added", c.name));
        }
        if sc.allow_privilege_escalation != Some(false) {
            out.push(format!("{}: allowPrivilegeEscalation not false", c.name));
        }
        if sc.run_as_non_root.or(pod.run_as_non_root) != Some(true) {
            out.push(format!("{}: runAsNonRoot not true", c.name));
        }
        if sc.run_as_user.or(pod.run_as_user) == Some(0) {
            out.push(format!("{}: runAsUser 0", c.name));
        }
        let seccomp = sc
            .seccomp_profile
            .clone()
            .or(pod.seccomp_profile.clone())
            .map(|p| p.type_);
        if !matches!(seccomp.as_deref(), Some("RuntimeDefault" | "Localhost")) {
            out.push(format!("{}: seccompProfile {seccomp:?}", c.name));
        }
    }
    out
}

#[test]
fn each_namespace_admits_its_pods_and_the_operator_only_reads_agent_pods() -> TestResult {
    let m = manifests()?;
    let operator = m.deployments.first().ok_or("no operator Deployment")?;
    let agent = m.daemonsets.first().ok_or("no agent DaemonSet")?;
    let operator_ns = operator
        .metadata
        .namespace
        .as_deref()
        .ok_or("no namespace")?;
    let agent_ns = agent.metadata.namespace.as_deref().ok_or("no namespace")?;
    assert_ne!(
        operator_ns, agent_ns,
        "the agent has a namespace of its own"
    );
    let operator_pod = operator
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .ok_or("no pod spec")?;
    let agent_pod = agent
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .ok_or("no pod spec")?;

    // Pod Security admission: enforced, audited and warned at one level per namespace.
    for (ns, level) in [(operator_ns, "restricted"), (agent_ns, "privileged")] {
        let labels = m
            .namespaces
            .iter()
            .find(|n| n.metadata.name.as_deref() == Some(ns))
            .and_then(|n| n.metadata.labels.clone())
            .ok_or(format!("no Namespace {ns} with labels"))?;
        for mode in ["enforce", "audit", "warn"] {
            assert_eq!(
                labels
                    .get(&format!("pod-security.kubernetes.io/{mode}"))
                    .map(String::as_str),
                Some(level),
                "{ns}: {mode}"
            );
        }
    }
    let violations = restricted_violations(operator_pod);
    assert!(
        violations.is_empty(),
        "the operator's pod is not restricted: {violations:?}"
    );
    // The agent needs what only `privileged` allows (and `restricted` would refuse).
    assert!(restricted_violations(agent_pod).len() >= 3);

    // A system-* priority class outside kube-system needs a quota scoped to it.
    for (ns, spec, pods) in [(operator_ns, operator_pod, 3), (agent_ns, agent_pod, 5000)] {
        let Some(class) = spec
            .priority_class_name
            .as_deref()
            .filter(|c| c.starts_with("system-"))
        else {
            continue;
        };
        let quota = m
            .quotas
            .iter()
            .filter(|q| q.metadata.namespace.as_deref() == Some(ns))
            .filter_map(|q| q.spec.as_ref())
            .find(|q| {
                q.scope_selector.iter().any(|s| {
                    s.match_expressions.iter().flatten().any(|e| {
                        e.scope_name == "PriorityClass"
                            && e.operator == "In"
                            && e.values.iter().flatten().any(|v| v == class)
                    })
                })
            })
            .ok_or(format!(
                "no ResourceQuota in {ns} scoped to PriorityClass {class}"
            ))?;
        let hard = quota
            .hard
            .as_ref()
            .and_then(|h| h.get("pods"))
            .ok_or(format!("{ns}: the quota sets no pods"))?;
        assert!(hard.0.parse::<u64>()? >= pods, "{ns}: pods {}", hard.0);
    }

    // The agents' ServiceAccount: in their namespace, bound to their ClusterRole, and
    // named by the operator's --agent-service-account.
    let account = agent_pod
        .service_account_name
        .as_deref()
        .ok_or("the DaemonSet names no ServiceAccount")?;
    assert!(m.service_accounts.iter().any(|a| {
        a.metadata.name.as_deref() == Some(account)
            && a.metadata.namespace.as_deref() == Some(agent_ns)
    }));
    assert!(m.cluster_role_bindings.iter().any(|b| {
        b.role_ref.name == "census-agent"
            && b.subjects.iter().flatten().any(|s| {
                s.kind == "ServiceAccount"
                    && s.name == account
                    && s.namespace.as_deref() == Some(agent_ns)
            })
    }));
    let flag = operator_pod.containers[0]
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "CENSUS_AGENT_SERVICE_ACCOUNT")
        .and_then(|e| e.value.as_deref())
        .ok_or("the operator is not told the agents' ServiceAccount")?;
    let parsed: ServiceAccountRef = flag.parse()?;
    assert_eq!(
        (parsed.namespace.as_str(), parsed.name.as_str()),
        (agent_ns, account)
    );

    // The operator's rules: on pods only `get`, in the agents' namespace (the node of a
    // token from a v1.29 API server is its pod's); tokenreviews `create`; the leader
    // EndpointSlice by name, and create (which RBAC cannot limit by name).
    let operator_rules: Vec<_> = m
        .roles
        .iter()
        .filter(|r| {
            r.metadata
                .name
                .as_deref()
                .is_some_and(|n| n.starts_with("census-operator"))
        })
        .flat_map(|r| {
            r.rules
                .iter()
                .flatten()
                .map(|rule| (r.metadata.namespace.as_deref(), rule))
        })
        .chain(
            m.cluster_roles
                .iter()
                .filter(|r| r.metadata.name.as_deref() == Some("census-operator"))
                .flat_map(|r| r.rules.iter().flatten().map(|rule| (None, rule))),
        )
        .collect();
    let mut pod_rules = 0;
    for (namespace, rule) in &operator_rules {
        let resources = rule.resources.iter().flatten();
        assert!(!rule.verbs.iter().any(|v| v == "*"), "{rule:?}");
        assert!(!resources.clone().any(|r| r == "*"), "{rule:?}");
        if resources
            .clone()
            .any(|r| r == "pods" || r.starts_with("pods/"))
        {
            assert_eq!(
                (
                    *namespace,
                    rule.api_groups.as_deref(),
                    rule.resources.as_deref(),
                    rule.verbs.as_slice()
                ),
                (
                    Some(agent_ns),
                    Some(&[String::new()][..]),
                    Some(&["pods".to_owned()][..]),
                    &["get".to_owned()][..]
                ),
                "the operator may only get the agents' pods: {rule:?}"
            );
            pod_rules += 1;
        }
    }
    assert_eq!(pod_rules, 1, "the operator reads the agents' pods by name");
    let reviews: Vec<_> = operator_rules
        .iter()
        .filter(|(_, r)| r.resources.iter().flatten().any(|x| x == "tokenreviews"))
        .map(|(ns, r)| (*ns, r.api_groups.clone(), r.verbs.clone()))
        .collect();
    assert_eq!(
        reviews,
        [(
            None,
            Some(vec!["authentication.k8s.io".to_owned()]),
            vec!["create".to_owned()]
        )]
    );
    let slices: Vec<(Vec<String>, Option<Vec<String>>)> = operator_rules
        .iter()
        .filter(|(_, r)| r.resources.iter().flatten().any(|x| x == "endpointslices"))
        .map(|(_, r)| {
            assert_eq!(
                r.api_groups.as_deref(),
                Some(&["discovery.k8s.io".to_owned()][..])
            );
            (r.verbs.clone(), r.resource_names.clone())
        })
        .collect();
    assert_eq!(
        slices,
        [
            (vec!["create".to_owned()], None),
            (
                vec!["get".to_owned(), "update".to_owned()],
                Some(vec![LEADER_SERVICE.to_owned()])
            ),
        ]
    );
    Ok(())
}

/// The value of `name` in a container's environment.
fn env<'a>(c: &'a Container, name: &str) -> Option<&'a str> {
    c.env
        .iter()
        .flatten()
        .find(|e| e.name == name)
        .and_then(|e| e.value.as_deref())
}

/// The volume a file of a container is on (read-only), and the path inside it.
fn volume_of<'a>(
    spec: &'a PodSpec,
    c: &Container,
    file: &str,
) -> Option<(&'a k8s_openapi::api::core::v1::Volume, String)> {
    let mount = c.volume_mounts.iter().flatten().find(|m| {
        file.strip_prefix(&m.mount_path)
            .is_some_and(|rest| rest.starts_with('/'))
            && m.read_only == Some(true)
    })?;
    let volume = spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)?;
    Some((volume, file[mount.mount_path.len() + 1..].to_owned()))
}

#[test]
fn the_agent_sends_a_census_token_and_the_operator_serves_tls_from_a_secret() -> TestResult {
    let m = manifests()?;
    let operator_pod = m
        .deployments
        .first()
        .and_then(|d| d.spec.as_ref()?.template.spec.as_ref())
        .ok_or("no operator pod spec")?;
    let agent_pod = m
        .daemonsets
        .first()
        .and_then(|d| d.spec.as_ref()?.template.spec.as_ref())
        .ok_or("no agent pod spec")?;
    let operator = &operator_pod.containers[0];
    let agent = &agent_pod.containers[0];

    // The agent's token: a projected ServiceAccount token for the operator's audience,
    // where --token-file reads it.
    let audience = env(operator, "CENSUS_TOKEN_AUDIENCE").unwrap_or("census");
    let token_file = env(agent, "CENSUS_TOKEN_FILE").ok_or("the agent has no --token-file")?;
    let (volume, path) = volume_of(agent_pod, agent, token_file)
        .ok_or("the token file is on no read-only volume")?;
    let token = volume
        .projected
        .as_ref()
        .and_then(|p| {
            p.sources
                .iter()
                .flatten()
                .find_map(|s| s.service_account_token.as_ref())
        })
        .ok_or("the token volume is not a projected serviceAccountToken")?;
    assert_eq!(token.path, path);
    assert_eq!(token.audience.as_deref(), Some(audience));
    // The TokenRequest API's minimum is 10 minutes; the kubelet renews at 80%.
    let life = token.expiration_seconds.ok_or("no expirationSeconds")?;
    assert!((600..=86_400).contains(&life), "expirationSeconds {life}");

    // TLS: the agent checks the operator's certificate with the CA (--tls-ca turns TLS
    // on); the operator's certificate and key come from a Secret.
    let ca = env(agent, "CENSUS_TLS_CA").ok_or("the agent has no --tls-ca")?;
    let (volume, _) = volume_of(agent_pod, agent, ca).ok_or("the CA is on no read-only volume")?;
    assert_eq!(
        volume.config_map.as_ref().map(|c| c.name.as_str()),
        Some("census-operator-ca")
    );
    for flag in ["CENSUS_TLS_CERT", "CENSUS_TLS_KEY"] {
        let file = env(operator, flag).ok_or(format!("the operator has no {flag}"))?;
        let (volume, _) = volume_of(operator_pod, operator, file)
            .ok_or(format!("{flag} is on no read-only volume"))?;
        assert_eq!(
            volume
                .secret
                .as_ref()
                .and_then(|s| s.secret_name.as_deref()),
            Some("census-operator-tls"),
            "{flag}"
        );
    }
    Ok(())
}

#[test]
fn the_crd_manifest_is_what_crdgen_writes() -> TestResult {
    let committed = std::fs::read_to_string(repo_root().join("deploy/crds/identity.yaml"))?;
    let fresh = census_operator::store::kubernetes::crd::crd_yaml()?;
    assert!(
        committed == fresh,
        "deploy/crds/identity.yaml is stale: run `cargo run -p census-operator -- crdgen --out deploy/crds/identity.yaml`"
    );
    Ok(())
}

#[test]
fn a_field_the_type_does_not_know_is_refused() {
    let doc = serde_json::json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "x"},
        "spec": {"selector": {"a": "b"}, "ports": [{"port": 1, "protocl": "TCP"}]},
    });
    let err = strict::<Service>(&doc, "test.yaml")
        .err()
        .map(|e| e.to_string());
    assert!(err.is_some_and(|e| e.contains(".spec.ports[0].protocl")));
}
