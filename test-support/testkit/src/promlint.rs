//! `/metrics` checked in both formats by the Prometheus project's own tools.
//!
//! - The Prometheus text format 0.0.4 (asked with `Accept: text/plain;
//!   version=0.0.4`): `promtool check metrics` (Debian's `prometheus` package)
//!   must pass with nothing to say.
//! - OpenMetrics (asked with `Accept: application/openmetrics-text`): the
//!   OpenMetrics parser of the Prometheus Python client (Debian's
//!   `python3-prometheus-client`, run by Debian's `/usr/bin/python3`), which
//!   refuses what the specification does (no `# EOF`, a counter sample without
//!   `_total`, a family declared twice, ...), and every family needs a HELP text.
//!   `promtool check metrics` reads the text format only, so it is not run on
//!   OpenMetrics: it would take each counter's `x_total` samples for a family
//!   without help.
//!
//! `cargo xtask setup` installs both. Outside CI (`CI` unset) a missing tool
//! skips the check, saying so on stderr; in CI it fails the test.

use std::{
    io::Write as _,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use crate::{TestResult, http_get_with};

/// The `Accept` Prometheus sends for the text format only.
pub const ACCEPT_TEXT: &str = "text/plain;version=0.0.4;q=0.3,*/*;q=0.2";
/// The `Accept` Prometheus 2 sends by default (OpenMetrics preferred).
pub const ACCEPT_OPENMETRICS: &str = "application/openmetrics-text;version=1.0.0;q=0.5,\
     application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.1";

const PYTHON: &str = "/usr/bin/python3";

/// `GET path` with an `Accept` header: status, `Content-Type`, body.
pub async fn scrape(
    addr: SocketAddr,
    path: &str,
    accept: &str,
) -> TestResult<(u16, String, String)> {
    let (status, head, body) = http_get_with(addr, path, &[("Accept", accept)]).await?;
    let content_type = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-type")
                .then(|| v.trim().to_owned())
        })
        .unwrap_or_default();
    Ok((status, content_type, body))
}

fn on_path(tool: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|dir| Path::new(dir).join(tool))
        .find(|p| p.is_file())
}

/// A tool that is missing: an error in CI, else `None` after saying so.
fn missing(what: &str) -> TestResult<Option<()>> {
    if std::env::var_os("CI").is_some() {
        return Err(format!("{what} is missing; `cargo xtask setup` installs it").into());
    }
    #[expect(clippy::print_stderr, reason = "a skipped check says so")]
    {
        eprintln!("SKIPPED: {what} is missing; `cargo xtask setup` installs it");
    }
    Ok(None)
}

fn run_with_input(command: &mut Command, input: &str) -> TestResult<(bool, String)> {
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    child
        .stdin
        .take()
        .ok_or("no stdin")?
        .write_all(input.as_bytes())?;
    let out = child.wait_with_output()?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok((out.status.success(), said))
}

/// `promtool check metrics` on a text-format body: `Some(problems)` (empty when
/// it passes), `None` when promtool is missing outside CI.
pub fn promtool_problems(body: &str) -> TestResult<Option<String>> {
    let Some(promtool) = on_path("promtool") else {
        return missing("promtool (Debian package prometheus)").map(|_| None);
    };
    let (ok, said) = run_with_input(Command::new(promtool).args(["check", "metrics"]), body)?;
    Ok(Some(if ok && said.trim().is_empty() {
        String::new()
    } else {
        format!("promtool check metrics failed:\n{said}")
    }))
}

const OPENMETRICS_CHECK: &str = r#"
import sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families
problems = []
for family in text_string_to_metric_families(sys.stdin.read()):
    if not family.documentation:
        problems.append(f"{family.name} has no HELP text")
    if family.type == "unknown":
        problems.append(f"{family.name} has no TYPE")
print("\n".join(problems))
sys.exit(1 if problems else 0)
"#;

/// The strict OpenMetrics parser on a body: `Some(problems)`, `None` when the
/// parser is missing outside CI.
pub fn openmetrics_problems(body: &str) -> TestResult<Option<String>> {
    let present = Path::new(PYTHON).is_file()
        && Command::new(PYTHON)
            .args(["-c", "import prometheus_client.openmetrics.parser"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
    if !present {
        return missing("the OpenMetrics parser (Debian package python3-prometheus-client)")
            .map(|_| None);
    }
    let (ok, said) = run_with_input(Command::new(PYTHON).args(["-c", OPENMETRICS_CHECK]), body)?;
    Ok(Some(if ok {
        String::new()
    } else {
        format!("the OpenMetrics parser refused the body:\n{said}")
    }))
}

/// Scrape `addr`'s `/metrics` in both formats and lint each; fails naming every
/// problem. Returns the two bodies (text, OpenMetrics) for further checks.
pub async fn check_both_formats(addr: SocketAddr) -> TestResult<(String, String)> {
    let (status, content_type, text) = scrape(addr, "/metrics", ACCEPT_TEXT).await?;
    if status != 200 || !content_type.starts_with("text/plain; version=0.0.4") {
        return Err(format!("text format: {status} {content_type:?}").into());
    }
    let (status, content_type, open) = scrape(addr, "/metrics", ACCEPT_OPENMETRICS).await?;
    if status != 200 || !content_type.starts_with("application/openmetrics-text; version=1.0.0") {
        return Err(format!("OpenMetrics: {status} {content_type:?}").into());
    }
    let mut problems = Vec::new();
    if let Some(p) = promtool_problems(&text)? {
        problems.push(p);
    }
    if let Some(p) = openmetrics_problems(&open)? {
        problems.push(p);
    }
    problems.retain(|p| !p.is_empty());
    if !problems.is_empty() {
        return Err(format!("{addr}/metrics: {}", problems.join("\n")).into());
    }
    Ok((text, open))
}
