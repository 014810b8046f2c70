//! A real `census-operator` process's `/metrics`, scraped as Prometheus does in
//! both formats, passes `promtool check metrics` (text format) and a strict
//! OpenMetrics parser (`census_testkit::promlint`).

use std::{net::SocketAddr, process::Command, time::Duration};

use census_proto::{PROTOCOL_VERSION, pb};
use census_testkit::{TestResult, process::Spawned, promlint};

/// The operator on a redb store in `dir`: the process, its gRPC and admin addresses.
fn start(dir: &std::path::Path) -> TestResult<(Spawned, SocketAddr, SocketAddr)> {
    let process = Spawned::start(
        Command::new(env!("CARGO_BIN_EXE_census-operator"))
            .args([
                "--grpc-listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
            ])
            .arg("--store-path")
            .arg(dir.join("census.redb")),
        Duration::from_secs(20),
    )?;
    let (grpc, admin) = (process.grpc, process.admin);
    Ok((process, grpc, admin))
}

#[tokio::test]
async fn the_operators_metrics_pass_promtool_and_the_openmetrics_parser() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (_process, grpc, admin) = start(dir.path())?;
    // A call, so that labelled families (calls by method and code, latencies)
    // have samples too.
    let mut client =
        pb::identity_service_client::IdentityServiceClient::connect(format!("http://{grpc}"))
            .await?;
    let missing = client
        .get(pb::GetRequest {
            protocol_version: PROTOCOL_VERSION,
            id: 4711,
        })
        .await;
    assert_eq!(
        missing.map(|_| ()).map_err(|s| s.code()),
        Err(tonic::Code::NotFound)
    );

    let (text, open) = promlint::check_both_formats(admin).await?;
    let line = "census_grpc_requests_total{method=\"IdentityService/Get\",code=\"NotFound\"} 1";
    for body in [&text, &open] {
        assert!(body.lines().any(|l| l == line), "no {line:?} in\n{body}");
    }
    // The same counter, named as each format wants.
    assert!(
        text.contains("# TYPE census_grpc_requests_total counter\n"),
        "{text}"
    );
    assert!(
        open.contains("# TYPE census_grpc_requests counter\n"),
        "{open}"
    );
    Ok(())
}
