//! kubectl (v1.36.3, as census-cluster builds it) as an independent client of the fake while census runs:
//! `kubectl apply` of everything in deploy/ (recursively), `kubectl get identities`,
//! and `kubectl delete identities --all`. Without the admission policy census writes
//! every quarantine tombstone and every referenced binding again; with the shipped
//! policy kubectl is refused and nothing changes.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
};

use census_fake_apiserver::FakeApiServer;
use serde_json::{Value, json};

use crate::{
    common::{TestResult, WAIT, eventually, fail, fake, identities, labels, now_ms, tombstone},
    operator::{Agent, allocate, replica_args, seed_cluster, session, until_leader},
};

/// The operator's ServiceAccount, as deploy/operator/admission.yaml names it.
const OPERATOR_USER: &str = "system:serviceaccount:census-system:census-operator";

/// The kubectl census-cluster builds from the control plane's pins.
fn kubectl_path() -> TestResult<PathBuf> {
    census_testkit::cluster::kubectl()
}

struct Kubectl {
    bin: PathBuf,
    kubeconfig: PathBuf,
}

impl Kubectl {
    fn run(&self, args: &[&str]) -> TestResult<(bool, String)> {
        let home = self
            .kubeconfig
            .parent()
            .map(Path::to_owned)
            .unwrap_or_default();
        let out = tokio::task::block_in_place(|| {
            Command::new(&self.bin)
                .arg("--kubeconfig")
                .arg(&self.kubeconfig)
                .args(args)
                .env_remove("KUBECONFIG")
                .env("HOME", home)
                .output()
        })?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok((out.status.success(), text))
    }

    fn ok(&self, args: &[&str]) -> TestResult<String> {
        match self.run(args)? {
            (true, text) => Ok(text),
            (false, text) => fail(format!("kubectl {}: {text}", args.join(" "))),
        }
    }
}

/// Every Identity object: name -> (labels, the tombstone's hash and end, if any).
fn objects(server: &FakeApiServer) -> BTreeMap<String, (Value, Value)> {
    server
        .list(&identities())
        .into_iter()
        .filter_map(|o| {
            let name = o["metadata"]["name"].as_str()?.to_owned();
            Some((
                name,
                (
                    o["spec"]["labels"].clone(),
                    o["status"]["tombstone"].clone(),
                ),
            ))
        })
        .collect()
}

/// The PrometheusRule CRD, as a cluster running the Prometheus Operator has it
/// (deploy/monitoring needs it).
fn prometheus_rule_crd() -> Value {
    json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "prometheusrules.monitoring.coreos.com"},
        "spec": {
            "group": "monitoring.coreos.com", "scope": "Namespaced",
            "names": {"kind": "PrometheusRule", "plural": "prometheusrules", "singular": "prometheusrule"},
            "versions": [{"name": "v1", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}],
        },
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_deletes_every_identity_while_census_runs_and_loses_no_quarantine() -> TestResult {
    let bin = kubectl_path()?;
    let server = fake().await?;
    seed_cluster(&server, &["op-a"])?;
    server.insert(prometheus_rule_crd())?;
    // Two quarantines from an earlier term, for a few minutes more.
    let until = now_ms() + 600_000;
    server.insert(tombstone(300, &labels("gone-a"), until))?;
    server.insert(tombstone(301, &labels("gone-b"), until))?;
    let dir = tempfile::tempdir()?;
    let admin = Kubectl {
        bin,
        kubeconfig: dir.path().join("admin.kubeconfig"),
    };
    server.write_kubeconfig_as(&admin.kubeconfig, "kubernetes-admin", &["system:masters"])?;

    // Everything in deploy/, whatever it holds now: the namespaces first, as
    // deploy/README.md says (kubectl applies a directory in file-name order).
    let deploy = crate::common::repo_root()
        .join("deploy")
        .display()
        .to_string();
    admin.ok(&["apply", "-f", &format!("{deploy}/namespace.yaml")])?;
    let out = admin.ok(&["apply", "-R", "-f", &deploy])?;
    assert!(
        out.contains("customresourcedefinition.apiextensions.k8s.io/identities.census.dev"),
        "{out}"
    );
    assert!(
        out.contains(
            "validatingadmissionpolicybinding.admissionregistration.k8s.io/census-identities"
        ),
        "{out}"
    );
    // Applied twice, nothing changes.
    let again = admin.ok(&["apply", "-R", "-f", &deploy])?;
    assert!(!again.contains(" created"), "{again}");
    // The policy is optional in many clusters: first without it.
    admin.ok(&["delete", "-f", &format!("{deploy}/operator/admission.yaml")])?;

    // census runs as its ServiceAccount.
    let op_kubeconfig = dir.path().join("operator.kubeconfig");
    server.write_kubeconfig_as(&op_kubeconfig, OPERATOR_USER, &["system:serviceaccounts"])?;
    // GC would collect the identities nobody references after their holds: keep them.
    let args = replica_args(&op_kubeconfig, "op-a", &[("--grace-period", "600s")]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let op = census_testkit::Operator::start(&args).await?;
    until_leader(&op).await?;
    let addr = op.grpc_addr;
    let _agent = Agent::connect(addr, "node-1", session(1)).await??;
    let web = allocate(addr, "node-1", session(1), "web").await??;
    let db = allocate(addr, "node-1", session(1), "db").await??;
    let before = objects(&server);
    assert_eq!(before.len(), 4, "{before:?}");
    let listed = admin.ok(&["get", "identities", "-o", "name"])?;
    for n in ["300", "301", &web.to_string(), &db.to_string()] {
        assert!(
            listed.contains(&format!("identity.census.dev/{n}")),
            "{listed}"
        );
    }

    let out = admin.ok(&["delete", "identities", "--all"])?;
    assert!(out.contains("identity.census.dev \"300\" deleted"), "{out}");
    // Every tombstone is back as it was (same labels, hash and end), every binding
    // in use is back.
    eventually("census writes every identity again", WAIT, || async {
        Ok((objects(&server) == before).then_some(()))
    })
    .await?;
    let again = allocate(addr, "node-1", session(1), "web").await??;
    assert_eq!(again, web);

    // With the shipped policy, kubectl is refused and nothing changes; census
    // (its ServiceAccount) still writes.
    admin.ok(&["apply", "-f", &format!("{deploy}/operator/admission.yaml")])?;
    let (ok, text) = admin.run(&["delete", "identities", "--all"])?;
    assert!(!ok, "{text}");
    assert!(
        text.contains("ValidatingAdmissionPolicy 'census-identities' with binding 'census-identities' denied request"),
        "{text}"
    );
    let (ok, text) = admin.run(&["label", "identity", "300", "x=y"])?;
    assert!(!ok && text.contains("is forbidden"), "{text}");
    assert_eq!(objects(&server), before);
    let api = allocate(addr, "node-1", session(1), "api").await??;
    assert!(objects(&server).contains_key(&api.to_string()));
    Ok(())
}
