//! Fixtures: a fake API server with the Identity CRD installed from deploy/, stores
//! and label builders.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use census_fake_apiserver::{FakeApiServer, Gvr, ServerConfig};
use census_operator::{
    replica::Fence,
    store::kubernetes::{KubeStore, KubeStoreConfig},
};
use census_proto::{domain::IdentityId, labels::LabelSet};
use serde_json::{Value, json};

pub(crate) use census_testkit::{TestResult, eventually, fail, init_tracing};

/// How long any single expectation may take.
pub(crate) const WAIT: Duration = Duration::from_secs(15);

pub(crate) fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Every YAML document of a file under the repository root, as JSON.
pub(crate) fn yaml_docs(relative: &str) -> TestResult<Vec<Value>> {
    let text = std::fs::read_to_string(repo_root().join(relative))?;
    let mut docs = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(&text) {
        let value: Value = serde::Deserialize::deserialize(doc)?;
        if !value.is_null() {
            docs.push(value);
        }
    }
    Ok(docs)
}

/// A fake API server with the CRD from deploy/crds/identity.yaml installed.
pub(crate) async fn fake() -> TestResult<FakeApiServer> {
    fake_with(ServerConfig::default()).await
}

pub(crate) async fn fake_with(config: ServerConfig) -> TestResult<FakeApiServer> {
    init_tracing();
    let server = FakeApiServer::start_with(config).await?;
    for crd in yaml_docs("deploy/crds/identity.yaml")? {
        server.insert(crd)?;
    }
    Ok(server)
}

pub(crate) fn identities() -> Gvr {
    Gvr::new("census.dev", "v1", "identities")
}

pub(crate) fn id(n: u32) -> IdentityId {
    match IdentityId::new(n) {
        Some(id) => id,
        None => panic!("id 0"),
    }
}

/// `k8s:app=<app>` plus the namespace label, canonical.
pub(crate) fn labels(app: &str) -> LabelSet {
    let text = format!("k8s:app={app},k8s:io.kubernetes.pod.namespace=default");
    match text.parse() {
        Ok(set) => set,
        Err(e) => panic!("test labels {text:?}: {e}"),
    }
}

/// An Identity binding object, as census writes it.
pub(crate) fn binding(n: u32, labels: &LabelSet) -> Value {
    json!({
        "apiVersion": "census.dev/v1",
        "kind": "Identity",
        "metadata": {"name": n.to_string()},
        "spec": {"labels": labels.to_strings()},
    })
}

/// An Identity tombstone object, quarantined until `until_ms`.
pub(crate) fn tombstone(n: u32, labels: &LabelSet, until_ms: u64) -> Value {
    let mut obj = binding(n, labels);
    obj["status"] = json!({
        "state": "Quarantined",
        "tombstone": {
            "labelsHash": format!("{:016x}", labels.stable_hash()),
            "until": census_operator::store::kubernetes::crd::time_to_text(until_ms),
        },
    });
    obj
}

pub(crate) fn node(name: &str, ip: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name},
        "status": {"addresses": [
            {"type": "InternalIP", "address": ip},
            {"type": "Hostname", "address": name},
        ]},
    })
}

pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A kube client for the fake, with or without kube's own retries.
pub(crate) fn client(server: &FakeApiServer, retry: bool) -> TestResult<kube::Client> {
    let mut config = server.kube_config()?;
    config.default_retry = retry;
    Ok(kube::Client::try_from(config)?)
}

/// A Kubernetes store on the fake, writing while `fence` is open.
pub(crate) fn store(
    server: &FakeApiServer,
    fence: Arc<Fence>,
    cfg: KubeStoreConfig,
) -> TestResult<KubeStore> {
    Ok(KubeStore::new(
        client(server, false)?,
        client(server, true)?,
        fence,
        cfg,
    ))
}

/// Waits for the store's watch to list everything once.
pub(crate) async fn synced(store: &KubeStore) -> TestResult {
    tokio::time::timeout(WAIT, store.wait_synced())
        .await
        .map_err(|_| "the store's watch did not list the objects")?;
    Ok(())
}

/// The object `n` in the fake, if any.
pub(crate) fn object(server: &FakeApiServer, n: u32) -> Option<Value> {
    server.get(&identities(), None, &n.to_string())
}
