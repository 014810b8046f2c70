//! A real `census-operator` process's `/metrics`, scraped as Prometheus does in
//! both formats, passes `promtool check metrics` (text format) and a strict
//! OpenMetrics parser (`census_testkit::promlint`).

use std::{
    io::{BufRead, BufReader},
    net::SocketAddr,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use census_proto::{PROTOCOL_VERSION, pb};
use census_testkit::{TestResult, promlint};

struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The operator on a redb store in `dir`: the process, its gRPC and admin addresses.
fn start(dir: &std::path::Path) -> TestResult<(Process, SocketAddr, SocketAddr)> {
    let mut child = Process(
        Command::new(env!("CARGO_BIN_EXE_census-operator"))
            .args([
                "--grpc-listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
            ])
            .arg("--store-path")
            .arg(dir.join("census.redb"))
            .args(["--log-format", "json", "--log", "info"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()?,
    );
    let stderr = child.0.stderr.take().ok_or("no stderr")?;
    let mut lines = BufReader::new(stderr).lines();
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        let Some(line) = lines.next() else { break };
        let Ok(json) = serde_json::from_str::<serde_json::Value>(&line?) else {
            continue;
        };
        let field = |name: &str| {
            json.pointer(&format!("/fields/{name}"))
                .and_then(|v| v.as_str())
                .and_then(|a| a.parse::<SocketAddr>().ok())
        };
        if let (Some(grpc), Some(admin)) = (field("grpc_addr"), field("admin_addr")) {
            // Keep draining stderr so the child never blocks on a full pipe.
            std::thread::spawn(move || for _ in lines.by_ref() {});
            return Ok((child, grpc, admin));
        }
    }
    Err("the operator did not report its addresses".into())
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
