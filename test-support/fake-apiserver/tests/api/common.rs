use std::{collections::BTreeMap, time::Duration};

use census_fake_apiserver::{FakeApiServer, ServerConfig};
use futures::{Stream, StreamExt};
use k8s_openapi::{
    api::core::v1::{ConfigMap, Container, Pod, PodSpec},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};

pub(crate) type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

pub(crate) const WAIT: Duration = Duration::from_secs(10);

pub(crate) fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

pub(crate) async fn start()
-> Result<(FakeApiServer, kube::Client), Box<dyn std::error::Error + Send + Sync>> {
    start_with(ServerConfig::default()).await
}

pub(crate) async fn start_with(
    config: ServerConfig,
) -> Result<(FakeApiServer, kube::Client), Box<dyn std::error::Error + Send + Sync>> {
    init_tracing();
    let server = FakeApiServer::start_with(config).await?;
    let client = server.client()?;
    Ok((server, client))
}

pub(crate) fn labels(pairs: &[(&str, &str)]) -> Option<BTreeMap<String, String>> {
    Some(
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
    )
}

pub(crate) fn pod(ns: &str, name: &str, node: Option<&str>, label_pairs: &[(&str, &str)]) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(ns.to_owned()),
            labels: labels(label_pairs),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            node_name: node.map(str::to_owned),
            containers: vec![Container {
                name: "c".into(),
                image: Some("busybox".into()),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        status: None,
    }
}

pub(crate) fn config_map(ns: &str, name: &str, label_pairs: &[(&str, &str)]) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(ns.to_owned()),
            labels: labels(label_pairs),
            ..ObjectMeta::default()
        },
        data: Some([("k".to_owned(), "v".to_owned())].into()),
        ..ConfigMap::default()
    }
}

/// The next item of a stream, failing the test after [`WAIT`].
pub(crate) async fn next<S: Stream + Unpin>(
    stream: &mut S,
) -> Result<S::Item, Box<dyn std::error::Error + Send + Sync>> {
    tokio::time::timeout(WAIT, stream.next())
        .await
        .map_err(|_| "timed out waiting for the next stream item")?
        .ok_or_else(|| "stream ended".into())
}

/// The status code of a kube API error, or none.
pub(crate) fn api_code<T>(result: &Result<T, kube::Error>) -> Option<(u16, String)> {
    match result {
        Err(kube::Error::Api(status)) => Some((status.code, status.reason.clone())),
        _ => None,
    }
}
