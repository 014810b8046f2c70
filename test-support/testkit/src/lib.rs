//! Test-only fixtures for census's tests and benchmarks, one copy each:
//!
//! - [`operator`]: a real census-operator in this process, on loopback, with its redb
//!   store in a temporary directory and short timers, and typed calls to its services;
//! - [`agent`]: an agent's EndpointSync stream, driven message by message;
//! - [`eventually`], [`until_some`] and [`wait_for`]: polling with a deadline;
//! - [`alloc`]: a global allocator that counts live bytes per thread;
//! - [`cluster`]: the real Kubernetes control plane (census-cluster), namespaces on it;
//! - [`proxy`]: a TCP proxy that can go silent (a half-open connection);
//! - [`promlint`]: `/metrics` scraped in both formats and linted by promtool and
//!   a strict OpenMetrics parser;
//! - [`layering`]: a crate's module graph read from its source, for layering tests;
//! - [`tls`]: certificates from `census-operator certs` and clients that present them;
//! - [`h2attack`]: a raw HTTP/2 client that sends what an attacker would;
//! - [`process`]: another process's RSS and descriptors, and their peaks.
//!
//! Only ever a dev-dependency, or one of the load generator (census-bench): nothing
//! here belongs in a production binary.

pub mod agent;
pub mod alloc;
pub mod cluster;
pub mod h2attack;
pub mod layering;
pub mod operator;
pub mod process;
pub mod promlint;
pub mod proxy;
pub mod tls;

use std::{
    error::Error,
    fmt::Debug,
    future::Future,
    net::SocketAddr,
    time::{Duration, Instant},
};

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpStream,
};
use tonic::{Code, Status};

pub use self::{
    agent::{
        Agent, AgentStream, Answer, Target, endpoint, hello, open_stream, open_stream_and_close,
        session,
    },
    operator::{Observed, Operator, identity, lazy_channel, node},
};

/// A test's result; its error can cross threads.
pub type TestResult<T = ()> = Result<T, Box<dyn Error + Send + Sync>>;

/// How long any single answer may take before the test fails.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// Test logs go to the test's captured output; `RUST_LOG` raises them.
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

/// Builds a failure with a message, for `?`.
pub fn fail<T>(msg: impl Into<String>) -> TestResult<T> {
    Err(msg.into().into())
}

/// `items` as owned strings (labels, addresses).
pub fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

/// Polls `check` every 20 ms until it returns `Some`, or fails after `timeout`
/// naming `what`. An error from `check` fails at once.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> TestResult<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = TestResult<Option<T>>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(found) = check().await? {
            return Ok(found);
        }
        if Instant::now() >= deadline {
            return fail(format!("{what}: not within {timeout:?}"));
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// [`eventually`] for a check that cannot fail: `None` once `timeout` has passed.
pub async fn until_some<T, F, Fut>(timeout: Duration, mut check: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    eventually("", timeout, || {
        let next = check();
        async move { Ok(next.await) }
    })
    .await
    .ok()
}

/// [`eventually`] for synchronous code (privileged tests, which wait on the kernel):
/// whether `check` held within `timeout`. An error from `check` fails at once.
pub fn wait_for<E>(
    timeout: Duration,
    mut check: impl FnMut() -> Result<bool, E>,
) -> Result<bool, E> {
    let deadline = Instant::now() + timeout;
    loop {
        if check()? {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        std::thread::sleep(POLL_INTERVAL);
    }
}

const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// Checks a refusal: its code, and that its message names every one of `needles`.
pub fn expect_status<T: Debug>(
    answer: Result<T, Status>,
    code: Code,
    needles: &[&str],
) -> TestResult<Status> {
    let status = match answer {
        Ok(ok) => return fail(format!("expected {code:?}, got an answer: {ok:?}")),
        Err(status) => status,
    };
    if status.code() != code {
        return fail(format!("expected {code:?}, got {status:?}"));
    }
    for needle in needles {
        if !status.message().contains(needle) {
            return fail(format!(
                "the message of {code:?} should name {needle:?}: {:?}",
                status.message()
            ));
        }
    }
    Ok(status)
}

/// A minimal HTTP/1.0 GET (the connection closes after the answer, so the body is
/// everything after the headers): status code, headers, body.
pub async fn http_get(addr: SocketAddr, path: &str) -> TestResult<(u16, String, String)> {
    http_get_with(addr, path, &[]).await
}

/// [`http_get`] with extra request headers (`name`, `value`).
pub async fn http_get_with(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
) -> TestResult<(u16, String, String)> {
    let mut request = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n");
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    let exchange = async {
        let mut stream = TcpStream::connect(addr).await?;
        stream.write_all(request.as_bytes()).await?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await?;
        Ok::<_, std::io::Error>(raw)
    };
    let raw = tokio::time::timeout(ANSWER_TIMEOUT, exchange)
        .await
        .map_err(|_| format!("GET {path}: no answer within {ANSWER_TIMEOUT:?}"))??;
    let text = String::from_utf8(raw)?;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("GET {path}: no end of headers in {text:?}"))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| format!("GET {path}: no status line in {head:?}"))?;
    Ok((status, head.to_owned(), body.to_owned()))
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    #[tokio::test]
    async fn eventually_returns_what_the_check_found_and_names_what_it_waited_for() -> TestResult {
        let calls = Cell::new(0);
        let found = eventually("three calls", Duration::from_secs(5), || {
            calls.set(calls.get() + 1);
            let n = calls.get();
            async move { Ok((n >= 3).then_some(n)) }
        })
        .await?;
        assert_eq!(found, 3);
        let timed_out = eventually("never", Duration::from_millis(50), || async {
            Ok(None::<()>)
        })
        .await;
        let error = timed_out.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(error.starts_with("never: not within"), "{error}");
        Ok(())
    }

    #[tokio::test]
    async fn eventually_stops_at_the_first_error() {
        let calls = Cell::new(0);
        let answer: TestResult<()> = eventually("x", Duration::from_secs(5), || {
            calls.set(calls.get() + 1);
            async { fail("broken") }
        })
        .await;
        assert!(answer.is_err());
        assert_eq!(calls.get(), 1);
    }

    #[test]
    fn wait_for_says_whether_the_check_held() {
        let mut n = 0;
        assert_eq!(
            wait_for(Duration::from_secs(5), || {
                n += 1;
                Ok::<_, ()>(n == 2)
            }),
            Ok(true)
        );
        assert_eq!(
            wait_for(Duration::from_millis(30), || Ok::<_, ()>(false)),
            Ok(false)
        );
    }
}
