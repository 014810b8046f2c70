//! Helpers for the agent's component tests: a real operator in process, over
//! loopback, and gRPC clients to look at it.

use std::{net::SocketAddr, path::Path, time::Duration};

use census_operator::{config::Cli, daemon};
use census_proto::{
    PROTOCOL_VERSION,
    pb::{
        self, identity_service_client::IdentityServiceClient,
        node_service_client::NodeServiceClient,
    },
};
use clap::Parser as _;
use tonic::transport::Channel;

pub(crate) type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// Starts an operator on `port` (0: any) with its redb file in `dir` and short timers.
pub(crate) async fn operator(
    dir: &Path,
    port: u16,
) -> Result<daemon::Running, Box<dyn std::error::Error + Send + Sync>> {
    let store = dir.join("census.redb");
    let cli = Cli::try_parse_from([
        "census-operator",
        "--grpc-listen",
        &format!("127.0.0.1:{port}"),
        "--admin-listen",
        "127.0.0.1:0",
        "--store-path",
        store.to_str().ok_or("temp dir is not UTF-8")?,
        "--snapshot-interval",
        "1s",
        "--grace-period",
        "1s",
        "--tick-interval",
        "50ms",
        "--adoption-window",
        "0s",
    ])?;
    Ok(daemon::start(cli).await?)
}

pub(crate) fn channel(addr: SocketAddr) -> Result<Channel, tonic::transport::Error> {
    Ok(
        tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
            .connect_timeout(Duration::from_secs(2))
            .connect_lazy(),
    )
}

/// The operator's identity `id`, if it knows it.
pub(crate) async fn identity(channel: &Channel, id: u32) -> Option<pb::Identity> {
    IdentityServiceClient::new(channel.clone())
        .get(pb::GetRequest {
            protocol_version: PROTOCOL_VERSION,
            id,
        })
        .await
        .ok()
        .map(tonic::Response::into_inner)
}

/// The operator's view of `node`, if it knows it.
pub(crate) async fn node(channel: &Channel, name: &str) -> Option<pb::Node> {
    NodeServiceClient::new(channel.clone())
        .get_node(pb::GetNodeRequest {
            protocol_version: PROTOCOL_VERSION,
            name: name.to_owned(),
        })
        .await
        .ok()
        .map(tonic::Response::into_inner)
}

/// Polls `check` every 20 ms until it returns `Some`, for at most `timeout`.
pub(crate) async fn eventually<T, F, Fut>(timeout: Duration, mut check: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return Some(value);
        }
        if tokio::time::Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
