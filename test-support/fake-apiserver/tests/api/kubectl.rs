//! The machine's `kubectl`, an independent client (discovery, OpenAPI v3 for field
//! validation, client-side apply with its last-applied annotation, get, delete),
//! against the fake: CRD validation rules and a ValidatingAdmissionPolicy, from
//! census's shipped manifests, refuse what the real server refuses.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use census_fake_apiserver::{FakeApiServer, Gvr};

use crate::common::{TestResult, start};

/// The kubectl census-cluster builds from the control plane's pins (v1.36.3),
/// built now if it is not (Go is required, as for the whole suite).
pub(crate) fn kubectl_path() -> Result<PathBuf, census_cluster::Error> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let root = root.canonicalize().unwrap_or(root);
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
    let say = |_: &str| {};
    census_cluster::kubectl(&root, &target, &say)
}

fn repo_file(relative: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(relative)
        .display()
        .to_string()
}

struct Kubectl {
    bin: PathBuf,
    kubeconfig: PathBuf,
    _dir: tempfile::TempDir,
}

struct Out {
    ok: bool,
    stdout: String,
    stderr: String,
}

impl Kubectl {
    /// kubectl acting as `user` (impersonation: kubectl sends no bearer token over
    /// plain HTTP).
    fn new(
        bin: PathBuf,
        server: &FakeApiServer,
        user: &str,
        groups: &[&str],
    ) -> Result<Self, Box<dyn std::error::Error + Send + Sync>> {
        let dir = tempfile::tempdir()?;
        let kubeconfig = dir.path().join("kubeconfig");
        server.write_kubeconfig_as(&kubeconfig, user, groups)?;
        Ok(Self {
            bin,
            kubeconfig,
            _dir: dir,
        })
    }

    fn run(&self, args: &[&str]) -> Result<Out, std::io::Error> {
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
        Ok(Out {
            ok: out.status.success(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }

    fn ok(&self, args: &[&str]) -> Result<String, Box<dyn std::error::Error + Send + Sync>> {
        let out = self.run(args)?;
        if !out.ok {
            return Err(format!("kubectl {}: {}{}", args.join(" "), out.stdout, out.stderr).into());
        }
        Ok(out.stdout)
    }

    fn refused(&self, args: &[&str]) -> Result<String, Box<dyn std::error::Error + Send + Sync>> {
        let out = self.run(args)?;
        if out.ok {
            return Err(
                format!("kubectl {} was not refused: {}", args.join(" "), out.stdout).into(),
            );
        }
        Ok(out.stderr)
    }

    /// `kubectl apply -f -` of a YAML text.
    fn apply_text(&self, yaml: &str) -> Result<Out, Box<dyn std::error::Error + Send + Sync>> {
        let path = self.kubeconfig.with_file_name("object.yaml");
        std::fs::write(&path, yaml)?;
        Ok(self.run(&["apply", "-f", &path.display().to_string()])?)
    }
}

const OPERATOR: &str = "system:serviceaccount:census-system:census-operator";

fn identity(name: &str, labels: &[&str]) -> String {
    let labels: Vec<String> = labels.iter().map(|l| format!("\"{l}\"")).collect();
    format!(
        "apiVersion: census.dev/v1\nkind: Identity\nmetadata:\n  name: \"{name}\"\nspec:\n  labels: [{}]\n",
        labels.join(", ")
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_applies_census_crd_whose_rules_refuse_bad_identities() -> TestResult {
    let bin = kubectl_path()?;
    let (server, _client) = start().await?;
    let k = Kubectl::new(bin, &server, "kubernetes-admin", &["system:masters"])?;
    let out = k.ok(&["apply", "-f", &repo_file("deploy/crds/identity.yaml")])?;
    assert!(
        out.contains("customresourcedefinition.apiextensions.k8s.io/identities.census.dev created"),
        "{out}"
    );

    let out = k.apply_text(&identity("4711", &["k8s:app=web"]))?;
    assert!(out.ok, "{}", out.stderr);
    let out = k.ok(&["get", "identities", "-o", "name"])?;
    assert_eq!(out.trim(), "identity.census.dev/4711");

    // The name rule (CEL at the root), the bounds (schema) and immutability (a
    // transition rule) refuse with 422 and the real field errors.
    let out = k.apply_text(&identity("web", &["k8s:app=web"]))?;
    assert!(!out.ok);
    assert!(
        out.stderr.contains("The Identity \"web\" is invalid: <nil>: Invalid value: \"object\": metadata.name must be the numeric id"),
        "{}",
        out.stderr
    );
    let out = k.apply_text(&identity("200", &["k8s:app=web"]))?;
    assert!(
        !out.ok && out.stderr.contains("1-255 are reserved"),
        "{}",
        out.stderr
    );
    let out = k.apply_text(&identity("4712", &["k8s:a=1", "k8s:a=1"]))?;
    assert!(
        !out.ok
            && out
                .stderr
                .contains("spec.labels[1]: Duplicate value: \"k8s:a=1\""),
        "{}",
        out.stderr
    );
    let long = format!("k8s:a={}", "x".repeat(500));
    let out = k.apply_text(&identity("4712", &[&long]))?;
    assert!(
        !out.ok
            && out
                .stderr
                .contains("spec.labels[0]: Too long: may not be more than 414 bytes"),
        "{}",
        out.stderr
    );
    let out = k.apply_text(&identity("4711", &["k8s:app=db"]))?;
    assert!(
        !out.ok
            && out
                .stderr
                .contains("spec.labels: Invalid value: \"array\": spec.labels is immutable"),
        "{}",
        out.stderr
    );
    let gvr = Gvr::new("census.dev", "v1", "identities");
    assert_eq!(server.count(&gvr), 1, "a refused write changes nothing");
    let kept = server.get(&gvr, None, "4711").ok_or("4711 is gone")?;
    assert_eq!(kept["spec"]["labels"][0], "k8s:app=web");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_admission_policy_lets_only_the_operator_change_identities() -> TestResult {
    let bin = kubectl_path()?;
    let (server, _client) = start().await?;
    let admin = Kubectl::new(
        bin.clone(),
        &server,
        "kubernetes-admin",
        &["system:masters"],
    )?;
    let operator = Kubectl::new(bin, &server, OPERATOR, &[])?;
    admin.ok(&["apply", "-f", &repo_file("deploy/crds/identity.yaml")])?;
    for n in ["4711", "4712", "4713"] {
        let out = operator.apply_text(&identity(n, &[&format!("k8s:n={n}")]))?;
        assert!(out.ok, "{}", out.stderr);
    }
    let out = admin.ok(&["apply", "-f", &repo_file("deploy/operator/admission.yaml")])?;
    assert!(
        out.contains(
            "validatingadmissionpolicy.admissionregistration.k8s.io/census-identities created"
        ),
        "{out}"
    );

    let err = admin.refused(&["delete", "identities", "--all"])?;
    assert!(
        err.contains("identities.census.dev \"4711\" is forbidden: ValidatingAdmissionPolicy 'census-identities' with binding 'census-identities' denied request: only census-operator (system:serviceaccount:census-system:census-operator) may change or delete Identity objects, not kubernetes-admin"),
        "{err}"
    );
    let err = admin.refused(&["annotate", "identity", "4712", "x=y"])?;
    assert!(err.contains("is forbidden"), "{err}");
    let err = admin.refused(&["patch", "identity", "4712", "--subresource", "status", "--type", "merge", "-p", r#"{"status":{"state":"Quarantined","tombstone":{"labelsHash":"0000000000000000","until":"2030-01-01T00:00:00.000Z"}}}"#])?;
    assert!(err.contains("is forbidden"), "{err}");
    // Creating stays open; the operator may do anything.
    let out = admin.apply_text(&identity("4714", &["k8s:n=4714"]))?;
    assert!(out.ok, "{}", out.stderr);
    operator.ok(&["annotate", "identity", "4712", "x=y"])?;
    operator.ok(&["delete", "identity", "4713"])?;
    let gvr = Gvr::new("census.dev", "v1", "identities");
    let names: Vec<String> = server
        .list(&gvr)
        .iter()
        .filter_map(|o| o["metadata"]["name"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(names, ["4711", "4712", "4714"]);

    // A kube client with a bearer token: the token's user; an unknown token is 401.
    server.add_token("operator-token", OPERATOR, &["system:serviceaccounts"]);
    let api: kube::Api<kube::api::DynamicObject> = kube::Api::all_with(
        server.client_with_token("operator-token")?,
        &kube::api::ApiResource::from_gvk_with_plural(
            &kube::api::GroupVersionKind::gvk("census.dev", "v1", "Identity"),
            "identities",
        ),
    );
    api.delete("4714", &Default::default()).await?;
    let stranger: kube::Api<kube::api::DynamicObject> = kube::Api::all_with(
        server.client_with_token("nobody-issued-this")?,
        &kube::api::ApiResource::from_gvk_with_plural(
            &kube::api::GroupVersionKind::gvk("census.dev", "v1", "Identity"),
            "identities",
        ),
    );
    match stranger.get("4711").await {
        Err(kube::Error::Api(status)) if status.code == 401 => {}
        other => return Err(format!("an unknown token got {other:?}").into()),
    }
    let err = match api_as_admin(&server)?
        .delete("4711", &Default::default())
        .await
    {
        Err(kube::Error::Api(status)) => status,
        other => return Err(format!("an anonymous delete got {other:?}").into()),
    };
    assert_eq!((err.code, err.reason.as_str()), (403, "Forbidden"));
    Ok(())
}

fn api_as_admin(
    server: &FakeApiServer,
) -> Result<kube::Api<kube::api::DynamicObject>, Box<dyn std::error::Error + Send + Sync>> {
    Ok(kube::Api::all_with(
        server.client()?,
        &kube::api::ApiResource::from_gvk_with_plural(
            &kube::api::GroupVersionKind::gvk("census.dev", "v1", "Identity"),
            "identities",
        ),
    ))
}
