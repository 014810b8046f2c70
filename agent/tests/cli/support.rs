//! Fixtures for the `census` CLI's tests: the real binary run as a user would, a real
//! operator in process (its own tempdir redb store), an agent's EndpointSync stream
//! driven by the test, a fake agent admin port, and a fake operator that answers every
//! call with one status.
#![allow(dead_code, reason = "each test target uses part of the fixtures")]

use std::{error::Error, process::Output, time::Duration};

use census_operator::{
    config::Cli,
    daemon::{self, Running},
};
use census_proto::{
    PROTOCOL_VERSION,
    pb::{
        self, agent_message::Body, endpoint_sync_client::EndpointSyncClient,
        identity_service_client::IdentityServiceClient, node_service_server, operator_message,
    },
};
use clap::Parser as _;
use tempfile::TempDir;
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpListener,
    sync::mpsc,
    task::JoinHandle,
};
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming, transport::Channel};

pub(crate) type TestResult<T = ()> = Result<T, Box<dyn Error + Send + Sync>>;

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

/// A real operator on 127.0.0.1 with a store in its own tempdir, no adoption window.
#[derive(Debug)]
pub(crate) struct Operator {
    running: Option<Running>,
    pub(crate) addr: String,
    _dir: TempDir,
}

impl Operator {
    pub(crate) async fn start() -> TestResult<Self> {
        let dir = tempfile::tempdir()?;
        let store = dir.path().join("census.redb");
        let store = store.to_str().ok_or("the tempdir path is not UTF-8")?;
        let cli = Cli::try_parse_from([
            "census-operator",
            "--store-path",
            store,
            "--grpc-listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--adoption-window",
            "0s",
            "--tick-interval",
            "50ms",
        ])?;
        let running = daemon::start(cli).await?;
        Ok(Self {
            addr: format!("http://{}", running.grpc_addr),
            running: Some(running),
            _dir: dir,
        })
    }

    pub(crate) async fn channel(&self) -> TestResult<Channel> {
        Ok(Channel::from_shared(self.addr.clone())?
            .connect_timeout(TIMEOUT)
            .connect()
            .await?)
    }

    /// Allocates `labels` for `node` (which must have said Hello).
    pub(crate) async fn allocate(&self, node: &str, labels: &[&str]) -> TestResult<pb::Identity> {
        let mut client = IdentityServiceClient::new(self.channel().await?);
        let answer = client
            .allocate(pb::AllocateRequest {
                protocol_version: PROTOCOL_VERSION,
                node: node.into(),
                session: Some(session()),
                labels: strings(labels),
            })
            .await?
            .into_inner();
        Ok(answer
            .identity
            .ok_or("AllocateResponse without an identity")?)
    }

    /// Every identity the operator lists (without quarantined ones), all pages.
    pub(crate) async fn list(&self, selector: &[&str]) -> TestResult<Vec<pb::Identity>> {
        let mut client = IdentityServiceClient::new(self.channel().await?);
        let mut all = Vec::new();
        let mut page_token = String::new();
        loop {
            let page = client
                .list(pb::ListRequest {
                    protocol_version: PROTOCOL_VERSION,
                    page_size: 2,
                    page_token,
                    selector: strings(selector),
                    include_quarantined: false,
                })
                .await?
                .into_inner();
            all.extend(page.identities);
            if page.next_page_token.is_empty() {
                return Ok(all);
            }
            page_token = page.next_page_token;
        }
    }

    pub(crate) async fn shut_down(mut self) {
        if let Some(running) = self.running.take() {
            let _ = tokio::time::timeout(TIMEOUT, running.shut_down()).await;
        }
    }
}

pub(crate) fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

pub(crate) fn session() -> pb::Session {
    pb::Session {
        start_time_ns: 1_700_000_000_000_000_000,
        nonce: 7,
    }
}

pub(crate) fn endpoint(name: &str, ip: &str, identity: &pb::Identity) -> pb::Endpoint {
    pb::Endpoint {
        namespace: "shop".into(),
        name: name.into(),
        ips: vec![ip.into()],
        identity: identity.id,
        labels: identity.labels.clone(),
    }
}

/// An agent's EndpointSync stream: Hello answered, then messages one by one.
#[derive(Debug)]
pub(crate) struct AgentStream {
    tx: mpsc::Sender<pb::AgentMessage>,
    rx: Streaming<pb::OperatorMessage>,
    seq: u64,
}

impl AgentStream {
    pub(crate) async fn hello(operator: &Operator, node: &str) -> TestResult<Self> {
        let (tx, rx) = mpsc::channel(16);
        tx.send(pb::AgentMessage {
            seq: 0,
            body: Some(Body::Hello(pb::Hello {
                protocol_version: PROTOCOL_VERSION,
                node: node.into(),
                session: Some(session()),
                agent_version: "test".into(),
            })),
        })
        .await?;
        let mut client = EndpointSyncClient::new(operator.channel().await?);
        let rx = tokio::time::timeout(TIMEOUT, client.sync(ReceiverStream::new(rx)))
            .await
            .map_err(|_| "EndpointSync.Sync did not answer")??
            .into_inner();
        let mut stream = Self { tx, rx, seq: 0 };
        match stream.recv().await? {
            Some(operator_message::Body::HelloReply(_)) => Ok(stream),
            other => Err(format!("expected a HelloReply, got {other:?}").into()),
        }
    }

    async fn recv(&mut self) -> TestResult<Option<operator_message::Body>> {
        let message = tokio::time::timeout(TIMEOUT, self.rx.message())
            .await
            .map_err(|_| "no message from the operator")??;
        Ok(message.and_then(|m| m.body))
    }

    /// Sends a snapshot and waits for its Ack.
    pub(crate) async fn snapshot(&mut self, endpoints: Vec<pb::Endpoint>) -> TestResult<pb::Ack> {
        self.seq += 1;
        self.tx
            .send(pb::AgentMessage {
                seq: self.seq,
                body: Some(Body::Snapshot(pb::Snapshot { endpoints })),
            })
            .await?;
        loop {
            match self.recv().await? {
                Some(operator_message::Body::Ack(ack)) if ack.seq == self.seq => return Ok(ack),
                Some(
                    operator_message::Body::Ack(_) | operator_message::Body::SnapshotRequest(_),
                ) => {}
                other => return Err(format!("expected an Ack, got {other:?}").into()),
            }
        }
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
