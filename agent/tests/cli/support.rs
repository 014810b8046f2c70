//! Fixtures for the `census` CLI's tests: the real binary run as a user would, a real
//! operator in process (its own tempdir redb store), an agent's EndpointSync stream
//! driven by the test, a fake agent admin port, and a fake operator that answers every
//! call with one status.

use std::{process::Output, time::Duration};

use census_proto::pb::{self, node_service_server};
pub(crate) use census_testkit::{Agent, Operator, TestResult, session};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpListener,
    task::JoinHandle,
};
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Request, Response, Status};

/// How long anything the tests wait for may take.
pub(crate) const TIMEOUT: Duration = Duration::from_secs(20);

/// The `census` binary's answer.
#[derive(Debug)]
pub(crate) struct Run {
    pub(crate) code: Option<i32>,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
}

impl Run {
    /// Checks a failure: its exit code, no output, and one line on stderr that names
    /// every one of `needles`.
    pub(crate) fn expect_failure(&self, code: i32, needles: &[&str]) -> TestResult {
        let context = format!("{self:#?}");
        if self.code != Some(code) {
            return Err(format!("expected exit code {code}: {context}").into());
        }
        if !self.stdout.is_empty() {
            return Err(format!("a failure prints nothing on stdout: {context}").into());
        }
        let lines: Vec<&str> = self.stderr.lines().collect();
        if lines.len() != 1 || !lines[0].starts_with("error: ") {
            return Err(format!("expected one `error: ` line on stderr: {context}").into());
        }
        for needle in needles {
            if !lines[0].contains(needle) {
                return Err(format!("the error should name {needle:?}: {context}").into());
            }
        }
        Ok(())
    }

    /// Checks a success and returns stdout.
    pub(crate) fn expect_success(&self) -> TestResult<&str> {
        if self.code == Some(0) {
            Ok(&self.stdout)
        } else {
            Err(format!("expected success: {self:#?}").into())
        }
    }

    /// Stdout parsed as JSON, after checking success.
    pub(crate) fn json(&self) -> TestResult<serde_json::Value> {
        Ok(serde_json::from_str(self.expect_success()?)?)
    }
}

/// Runs `census` with `args`, its configuration only from `args` and `env`.
pub(crate) async fn census(args: &[&str], env: &[(&str, &str)]) -> TestResult<Run> {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_census"));
    command.args(args).kill_on_drop(true);
    for (name, _) in std::env::vars() {
        if name.starts_with("CENSUS_") {
            command.env_remove(name);
        }
    }
    command.envs(env.iter().copied());
    let Output {
        status,
        stdout,
        stderr,
    } = tokio::time::timeout(TIMEOUT, command.output())
        .await
        .map_err(|_| format!("census {args:?} did not finish within {TIMEOUT:?}"))??;
    Ok(Run {
        code: status.code(),
        stdout: String::from_utf8(stdout)?,
        stderr: String::from_utf8(stderr)?,
    })
}

/// A local address nothing listens on (bound, then closed).
pub(crate) async fn closed_port() -> TestResult<String> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    drop(listener);
    Ok(format!("http://{addr}"))
}

/// The session of every CLI test's agent.
pub(crate) fn cli_session() -> pb::Session {
    session(1_700_000_000_000_000_000)
}

/// An agent of `node` whose Hello `operator` answered.
pub(crate) async fn hello(operator: &Operator, node: &str) -> TestResult<Agent> {
    Ok(Agent::connect(operator, node, cli_session()).await?.0)
}

/// An endpoint of namespace `shop` with one address and `identity`'s labels.
pub(crate) fn endpoint(name: &str, ip: &str, identity: &pb::Identity) -> pb::Endpoint {
    pb::Endpoint {
        namespace: "shop".into(),
        name: name.into(),
        ips: vec![ip.into()],
        identity: identity.id,
        labels: identity.labels.clone(),
    }
}

/// A fake agent admin port: answers each path with a status and a body, and 404
/// otherwise. Stops when dropped.
#[derive(Debug)]
pub(crate) struct FakeAgent {
    pub(crate) addr: String,
    task: JoinHandle<()>,
}

impl FakeAgent {
    pub(crate) async fn start(routes: Vec<(&'static str, u16, String)>) -> TestResult<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = format!("http://{}", listener.local_addr()?);
        let task = tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let routes = routes.clone();
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let head = String::from_utf8_lossy(&head);
                    let path = head.split_whitespace().nth(1).unwrap_or_default();
                    let (status, body) = routes
                        .iter()
                        .find(|(p, _, _)| *p == path)
                        .map_or((404, "not found".to_owned()), |(_, s, b)| (*s, b.clone()));
                    let answer = format!(
                        "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = stream.write_all(answer.as_bytes()).await;
                    let _ = stream.shutdown().await;
                });
            }
        });
        Ok(Self { addr, task })
    }
}

impl Drop for FakeAgent {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A fake operator whose NodeService answers every call with `status`.
#[derive(Debug)]
pub(crate) struct FakeOperator {
    pub(crate) addr: String,
    task: JoinHandle<()>,
}

#[derive(Debug, Clone)]
struct Refuse(Status);

#[tonic::async_trait]
impl node_service_server::NodeService for Refuse {
    async fn list_nodes(
        &self,
        _: Request<pb::ListNodesRequest>,
    ) -> Result<Response<pb::ListNodesResponse>, Status> {
        Err(self.0.clone())
    }

    async fn get_node(&self, _: Request<pb::GetNodeRequest>) -> Result<Response<pb::Node>, Status> {
        Err(self.0.clone())
    }

    async fn get_version(
        &self,
        _: Request<pb::GetVersionRequest>,
    ) -> Result<Response<pb::VersionInfo>, Status> {
        Err(self.0.clone())
    }
}

impl FakeOperator {
    pub(crate) async fn start(status: Status) -> TestResult<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = format!("http://{}", listener.local_addr()?);
        let service = node_service_server::NodeServiceServer::new(Refuse(status));
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(TcpListenerStream::new(listener))
                .await;
        });
        Ok(Self { addr, task })
    }
}

impl Drop for FakeOperator {
    fn drop(&mut self) {
        self.task.abort();
    }
}
