//! The manifests in deploy/ validate against the Kubernetes 1.30 and 1.33 API schemas
//! (the oldest and newest versions census supports), with `kubernetes-validate` from
//! PyPI (it bundles the schemas of each version) in strict mode, so an unknown field
//! fails too. Kinds no version ships (the Prometheus Operator's PrometheusRule) are
//! reported as such and checked by `deploy::` only.

use std::process::Command;

use crate::common::{TestResult, fail, repo_root};

/// The validator's version; `cargo xtask setup` installs the same.
const VALIDATOR: &str = "kubernetes-validate==1.37.0";
const VERSIONS: [&str; 2] = ["1.30.0", "1.33.0"];

fn python() -> &'static str {
    "python3"
}

/// Installs the validator unless it is there already.
fn ensure_validator() -> TestResult {
    let have = Command::new(python())
        .args(["-c", "import kubernetes_validate"])
        .status()?;
    if have.success() {
        return Ok(());
    }
    let out = Command::new(python())
        .args(["-m", "pip", "install", "--quiet", VALIDATOR])
        .output()?;
    if !out.status.success() {
        return fail(format!(
            "pip install {VALIDATOR} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(())
}

fn validate(version: &str, files: &[String]) -> TestResult<(bool, String)> {
    let out = Command::new(python())
        .args(["-m", "kubernetes_validate", "--strict", "-k", version])
        .args(files)
        .current_dir(repo_root())
        .output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok((out.status.success(), text))
}

fn yaml_files(dir: &std::path::Path, out: &mut Vec<String>) -> TestResult {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            yaml_files(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            out.push(path.strip_prefix(repo_root())?.display().to_string());
        }
    }
    Ok(())
}

#[test]
fn every_manifest_validates_against_kubernetes_1_30_and_1_33() -> TestResult {
    ensure_validator()?;
    let mut files = Vec::new();
    yaml_files(&repo_root().join("deploy"), &mut files)?;
    files.sort();
    assert!(files.len() >= 8, "{files:?}");
    for version in VERSIONS {
        let (ok, text) = validate(version, &files)?;
        if !ok || text.contains("ERROR") {
            return fail(format!("deploy/ against Kubernetes {version}:\n{text}"));
        }
        for line in text.lines().filter(|l| l.starts_with("WARN")) {
            // Only kinds that no Kubernetes version has a schema for.
            assert!(
                line.contains("Couldn't find schema for kind PrometheusRule"),
                "{version}: {line}"
            );
        }
        let short = &version[..4];
        assert!(
            text.contains(&format!("passed for resource customresourcedefinition/identities.census.dev against version {short}")),
            "{text}"
        );
        assert!(
            text.contains(&format!("passed for resource validatingadmissionpolicy/census-identities against version {short}")),
            "{text}"
        );
    }
    Ok(())
}

#[test]
fn the_validator_refuses_a_bad_manifest() -> TestResult {
    ensure_validator()?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("bad.yaml");
    std::fs::write(
        &path,
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\nspec:\n  replicas: two\n  \
         selector: {matchLabels: {a: b}}\n  template: {metadata: {labels: {a: b}}, spec: {containers: [{name: c, image: i}]}}\n",
    )?;
    for version in VERSIONS {
        let (ok, text) = validate(version, &[path.display().to_string()])?;
        assert!(!ok && text.contains("spec.replicas"), "{version}: {text}");
    }
    Ok(())
}
