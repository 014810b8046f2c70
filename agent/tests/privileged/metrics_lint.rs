//! A real `census-agent` process's `/metrics`, on its admin listener and on its
//! health listener, passes `promtool check metrics` (text format) and a strict
//! OpenMetrics parser (`census_testkit::promlint`); the health listener serves
//! nothing of the `/v1` API.

use std::{
    fs,
    net::SocketAddr,
    process::{Command, Stdio},
    time::Duration,
};

use crate::support::{PinDir, TestResult};

/// Kills the agent when the test ends, passed or not.
struct Kill(std::process::Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The address logged after `what` (`... what listening addr=...`), once it is.
fn logged_addr(log: &str, message: &str, field: &str) -> Option<SocketAddr> {
    let line = log.lines().find(|l| l.contains(message))?;
    let at = line.find(&format!("{field}="))? + field.len() + 1;
    line[at..].split_whitespace().next()?.parse().ok()
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn the_agents_metrics_pass_promtool_and_the_openmetrics_parser() -> TestResult {
    let pins = PinDir::new();
    let dir = tempfile::tempdir()?;
    let endpoints = dir.path().join("endpoints.yaml");
    fs::write(&endpoints, "[]\n")?;
    let log = dir.path().join("agent.log");
    let child = Command::new(env!("CARGO_BIN_EXE_census-agent"))
        .args(["--node-name", "lint-node"])
        // Nobody listens there: the agent runs fail-static, which is all this needs.
        .args(["--operator", "http://127.0.0.1:9"])
        .arg("--pin-dir")
        .arg(pins.path())
        .args([
            "--admin-listen",
            "127.0.0.1:0",
            "--health-listen",
            "127.0.0.1:0",
        ])
        .arg("--endpoints-file")
        .arg(&endpoints)
        .args(["--attach-mode", crate::support::attach_mode_arg()])
        .args(["--log", "info", "--log-format", "text"])
        .stdout(Stdio::null())
        .stderr(fs::File::create(&log)?)
        .spawn()?;
    let _agent = Kill(child);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let (admin, health) = loop {
        let plain = String::from_utf8(strip_ansi(&fs::read(&log)?))?;
        let admin = logged_addr(&plain, "admin server listening", "admin_addr");
        let health = logged_addr(&plain, "health and metrics server listening", "addr");
        if let (Some(admin), Some(health)) = (admin, health) {
            break (admin, health);
        }
        if std::time::Instant::now() > deadline {
            return Err(format!("the agent did not report its listeners:\n{plain}").into());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        for addr in [admin, health] {
            census_testkit::promlint::check_both_formats(addr)
                .await
                .map_err(|e| e.to_string())?;
        }
        let (status, _, _) = census_testkit::promlint::scrape(health, "/v1/endpoints", "*/*")
            .await
            .map_err(|e| e.to_string())?;
        if status != 404 {
            return Err(format!("/v1/endpoints on the health listener: {status}"));
        }
        Ok::<_, String>(())
    })?;
    Ok(())
}

fn strip_ansi(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == 0x1b {
            while i < bytes.len() && !bytes[i].is_ascii_alphabetic() {
                i += 1;
            }
        } else {
            out.push(bytes[i]);
        }
        i += 1;
    }
    out
}
