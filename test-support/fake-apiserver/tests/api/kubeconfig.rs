//! Another process reaches the server through the kubeconfig it writes.

use k8s_openapi::api::core::v1::Namespace;
use kube::{
    Api, ResourceExt,
    config::{KubeConfigOptions, Kubeconfig},
};

use crate::common::{TestResult, start};

#[tokio::test]
async fn written_kubeconfig_loads_and_works() -> TestResult {
    let (server, _client) = start().await?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("kubeconfig");
    server.write_kubeconfig(&path)?;

    // What a separate process does: read the file, build a client.
    let kubeconfig = Kubeconfig::read_from(&path)?;
    let config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    assert_eq!(
        config.cluster_url.to_string().trim_end_matches('/'),
        server.url()
    );
    assert_eq!(config.default_namespace, "default");
    let client = kube::Client::try_from(config)?;

    let namespaces: Api<Namespace> = Api::all(client.clone());
    let mut names: Vec<String> = namespaces
        .list(&Default::default())
        .await?
        .items
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["default", "kube-node-lease", "kube-public", "kube-system"]
    );
    let version = client.apiserver_version().await?;
    assert_eq!(version.major, "1");
    Ok(())
}
