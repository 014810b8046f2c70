//! Fixtures for the operator's component tests: a real operator on loopback (its own
//! tempdir redb store, short timers), real tonic clients, and an [`Agent`] that speaks
//! EndpointSync message by message.

use std::{
    error::Error,
    fmt::Debug,
    future::Future,
    net::SocketAddr,
    time::{Duration, Instant},
};

use census_operator::{
    config::Cli,
    daemon::{self, Running},
};
use census_proto::{
    PROTOCOL_VERSION,
    pb::{
        self, agent_message::Body, endpoint_sync_client::EndpointSyncClient,
        identity_service_client::IdentityServiceClient, node_service_client::NodeServiceClient,
        operator_message,
    },
};
use clap::Parser;
use tempfile::TempDir;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
    sync::mpsc,
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Status, Streaming, transport::Channel};

pub(crate) type TestResult<T = ()> = Result<T, Box<dyn Error + Send + Sync>>;

/// How long any single answer may take before the test fails.
pub(crate) const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// Test logs go to the test's captured output; `RUST_LOG` raises them.
pub(crate) fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

/// Builds a failure with a message, for `?`.
pub(crate) fn fail<T>(msg: impl Into<String>) -> TestResult<T> {
    Err(msg.into().into())
}

/// A real operator on 127.0.0.1 with a store in its own tempdir.
#[derive(Debug)]
pub(crate) struct Operator {
    running: Running,
    pub(crate) grpc_addr: SocketAddr,
    pub(crate) admin_addr: SocketAddr,
    // Dropped after the operator: the store file lives here.
    _dir: TempDir,
}

/// Flags every test operator gets unless the test passes them itself.
const DEFAULTS: &[(&str, &str)] = &[
    ("--grpc-listen", "127.0.0.1:0"),
    ("--admin-listen", "127.0.0.1:0"),
    // A fresh store would refuse new ids for a node TTL; tests opt in to that.
    ("--adoption-window", "0s"),
    ("--tick-interval", "50ms"),
];

/// Starts an operator with `args` (flags as on the command line) on top of [`DEFAULTS`].
pub(crate) async fn start_operator(args: &[&str]) -> TestResult<Operator> {
    start_in(tempfile::tempdir()?, args, &[]).await
}

/// Like [`start_operator`], leaving out the defaults of the flags in `omit`.
pub(crate) async fn start_operator_without(omit: &[&str], args: &[&str]) -> TestResult<Operator> {
    start_in(tempfile::tempdir()?, args, omit).await
}

async fn start_in(dir: TempDir, args: &[&str], omit: &[&str]) -> TestResult<Operator> {
    init_tracing();
    let store = dir.path().join("census.redb");
    let store = store
        .to_str()
        .ok_or("the tempdir path is not UTF-8")?
        .to_owned();
    let mut argv: Vec<String> = vec!["census-operator".into(), "--store-path".into(), store];
    for (flag, value) in DEFAULTS {
        if !args.contains(flag) && !omit.contains(flag) {
            argv.push((*flag).into());
            argv.push((*value).into());
        }
    }
    argv.extend(args.iter().map(|a| (*a).to_owned()));
    let cli = Cli::try_parse_from(&argv)?;
    let running = daemon::start(cli).await?;
    Ok(Operator {
        grpc_addr: running.grpc_addr,
        admin_addr: running.admin_addr,
        running,
        _dir: dir,
    })
}

impl Operator {
    pub(crate) async fn channel(&self) -> TestResult<Channel> {
        let endpoint = Channel::from_shared(format!("http://{}", self.grpc_addr))?
            .connect_timeout(ANSWER_TIMEOUT);
        Ok(endpoint.connect().await?)
    }

    pub(crate) async fn identities(&self) -> TestResult<IdentityServiceClient<Channel>> {
        Ok(IdentityServiceClient::new(self.channel().await?))
    }

    pub(crate) async fn nodes(&self) -> TestResult<NodeServiceClient<Channel>> {
        Ok(NodeServiceClient::new(self.channel().await?))
    }

    /// Stops the operator the way the daemon does on SIGTERM; fails if that hangs.
    pub(crate) async fn shut_down(self) -> TestResult {
        let Self { running, _dir, .. } = self;
        tokio::time::timeout(Duration::from_secs(20), running.shut_down())
            .await
            .map_err(|_| "the operator did not shut down within 20 s")?;
        Ok(())
    }

    /// Shuts down and starts again on the same store with `args`.
    pub(crate) async fn restart(self, args: &[&str]) -> TestResult<Self> {
        let Self {
            running, _dir: dir, ..
        } = self;
        tokio::time::timeout(Duration::from_secs(20), running.shut_down())
            .await
            .map_err(|_| "the operator did not shut down within 20 s")?;
        start_in(dir, args, &[]).await
    }

    /// Allocates `labels` for `node` in `session`; the gRPC answer as it is.
    pub(crate) async fn allocate(
        &self,
        node: &str,
        session: pb::Session,
        labels: &[&str],
    ) -> TestResult<Result<pb::Identity, Status>> {
        let mut client = self.identities().await?;
        let answer = client
            .allocate(pb::AllocateRequest {
                protocol_version: PROTOCOL_VERSION,
                node: node.into(),
                session: Some(session),
                labels: strings(labels),
            })
            .await;
        Ok(match answer {
            Ok(resp) => Ok(resp
                .into_inner()
                .identity
                .ok_or("AllocateResponse without an identity")?),
            Err(status) => Err(status),
        })
    }

    /// Allocates and insists on success.
    pub(crate) async fn allocate_ok(
        &self,
        node: &str,
        session: pb::Session,
        labels: &[&str],
    ) -> TestResult<pb::Identity> {
        match self.allocate(node, session, labels).await? {
            Ok(identity) => Ok(identity),
            Err(status) => fail(format!("Allocate {labels:?} failed: {status:?}")),
        }
    }

    pub(crate) async fn get(&self, id: u32) -> TestResult<Result<pb::Identity, Status>> {
        let mut client = self.identities().await?;
        Ok(client
            .get(pb::GetRequest {
                protocol_version: PROTOCOL_VERSION,
                id,
            })
            .await
            .map(tonic::Response::into_inner))
    }

    pub(crate) async fn get_node(&self, name: &str) -> TestResult<Result<pb::Node, Status>> {
        let mut client = self.nodes().await?;
        Ok(client
            .get_node(pb::GetNodeRequest {
                protocol_version: PROTOCOL_VERSION,
                name: name.into(),
            })
            .await
            .map(tonic::Response::into_inner))
    }

    pub(crate) async fn get_node_ok(&self, name: &str) -> TestResult<pb::Node> {
        match self.get_node(name).await? {
            Ok(node) => Ok(node),
            Err(status) => fail(format!("GetNode {name} failed: {status:?}")),
        }
    }

    /// Every identity, quarantined ones too, in id order (all pages).
    pub(crate) async fn list_all(&self) -> TestResult<Vec<pb::Identity>> {
        let mut client = self.identities().await?;
        let mut all = Vec::new();
        let mut page_token = String::new();
        loop {
            let page = client
                .list(pb::ListRequest {
                    protocol_version: PROTOCOL_VERSION,
                    page_size: 1000,
                    page_token,
                    selector: Vec::new(),
                    include_quarantined: true,
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

    /// What the operator shows of its state, without what moves by itself (when a
    /// node was last heard, whether its stream is open): equal before and after a
    /// refused request.
    pub(crate) async fn observe(&self) -> TestResult<Observed> {
        let identities = self.list_all().await?;
        let mut client = self.nodes().await?;
        let mut nodes = client
            .list_nodes(pb::ListNodesRequest {
                protocol_version: PROTOCOL_VERSION,
            })
            .await?
            .into_inner()
            .nodes;
        for node in &mut nodes {
            node.last_heard_ms = 0;
            node.connected = false;
        }
        Ok(Observed { identities, nodes })
    }

    /// GET on the admin port: status code and body.
    pub(crate) async fn admin_get(&self, path: &str) -> TestResult<(u16, String, String)> {
        http_get(self.admin_addr, path).await
    }
}

/// The operator's state as the services show it; see [`Operator::observe`].
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Observed {
    pub(crate) identities: Vec<pb::Identity>,
    pub(crate) nodes: Vec<pb::Node>,
}

impl Observed {
    pub(crate) fn node(&self, name: &str) -> Option<&pb::Node> {
        self.nodes.iter().find(|n| n.name == name)
    }

    pub(crate) fn identity(&self, id: u32) -> Option<&pb::Identity> {
        self.identities.iter().find(|i| i.id == id)
    }
}

pub(crate) fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

pub(crate) fn session(start_time_ns: u64) -> pb::Session {
    pb::Session {
        start_time_ns,
        nonce: 7,
    }
}

pub(crate) fn endpoint(
    namespace: &str,
    name: &str,
    ips: &[&str],
    identity: u32,
    labels: &[&str],
) -> pb::Endpoint {
    pb::Endpoint {
        namespace: namespace.into(),
        name: name.into(),
        ips: strings(ips),
        identity,
        labels: strings(labels),
    }
}

pub(crate) fn hello(node: &str, session: pb::Session) -> pb::AgentMessage {
    pb::AgentMessage {
        seq: 0,
        body: Some(Body::Hello(pb::Hello {
            protocol_version: PROTOCOL_VERSION,
            node: node.into(),
            session: Some(session),
            agent_version: "test".into(),
        })),
    }
}

/// Checks a refusal: its code, and that its message names every one of `needles`.
pub(crate) fn expect_status<T: Debug>(
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

/// Polls `check` every 50 ms until it returns `Some`, or fails after `timeout`.
pub(crate) async fn eventually<T, F, Fut>(
    what: &str,
    timeout: Duration,
    mut check: F,
) -> TestResult<T>
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
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An agent's EndpointSync stream, driven message by message.
#[derive(Debug)]
pub(crate) struct Agent {
    pub(crate) node: String,
    pub(crate) session: pb::Session,
    seq: u64,
    tx: mpsc::Sender<pb::AgentMessage>,
    rx: Streaming<pb::OperatorMessage>,
}

/// What the operator answered to one message: its Ack, and the Rebinds before it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Answer {
    pub(crate) ack: pb::Ack,
    pub(crate) rebinds: Vec<pb::Rebind>,
}

/// The agent's half of an EndpointSync stream, and the operator's.
pub(crate) type AgentStream = (
    mpsc::Sender<pb::AgentMessage>,
    Streaming<pb::OperatorMessage>,
);

/// Opens an EndpointSync stream whose first messages are `first`. The operator reads
/// the first message before it answers, so a refused first message is the call's error.
pub(crate) async fn open_stream(
    op: &Operator,
    first: Vec<pb::AgentMessage>,
) -> TestResult<Result<AgentStream, Status>> {
    let (tx, rx) = mpsc::channel(16);
    for message in first {
        tx.send(message).await?;
    }
    Ok(call_sync(op, rx).await?.map(|stream| (tx, stream)))
}

/// Like [`open_stream`], but the agent ends its half of the stream after `first`.
pub(crate) async fn open_stream_and_close(
    op: &Operator,
    first: Vec<pb::AgentMessage>,
) -> TestResult<Result<Streaming<pb::OperatorMessage>, Status>> {
    let (tx, rx) = mpsc::channel(16);
    for message in first {
        tx.send(message).await?;
    }
    drop(tx);
    call_sync(op, rx).await
}

async fn call_sync(
    op: &Operator,
    rx: mpsc::Receiver<pb::AgentMessage>,
) -> TestResult<Result<Streaming<pb::OperatorMessage>, Status>> {
    let mut client = EndpointSyncClient::new(op.channel().await?)
        .max_encoding_message_size(usize::MAX)
        .max_decoding_message_size(64 * 1024 * 1024);
    let answer = tokio::time::timeout(ANSWER_TIMEOUT, client.sync(ReceiverStream::new(rx)))
        .await
        .map_err(|_| "EndpointSync.Sync did not answer")?;
    Ok(answer.map(tonic::Response::into_inner))
}

impl Agent {
    /// Says Hello as `node` in `session` and reads the HelloReply.
    pub(crate) async fn connect(
        op: &Operator,
        node: &str,
        session: pb::Session,
    ) -> TestResult<(Self, pb::HelloReply)> {
        Self::connect_at(op, node, session, 0).await
    }

    /// Connects again in the same session (a reconnect): `seq` goes on from here.
    pub(crate) async fn reconnect(self, op: &Operator) -> TestResult<(Self, pb::HelloReply)> {
        Self::connect_at(op, &self.node, self.session, self.seq).await
    }

    async fn connect_at(
        op: &Operator,
        node: &str,
        session: pb::Session,
        seq: u64,
    ) -> TestResult<(Self, pb::HelloReply)> {
        let (tx, rx) = match open_stream(op, vec![hello(node, session)]).await? {
            Ok(stream) => stream,
            Err(status) => return fail(format!("Hello of {node} refused: {status:?}")),
        };
        let mut agent = Self {
            node: node.into(),
            session,
            seq,
            tx,
            rx,
        };
        match agent.recv().await? {
            Ok(Some(pb::OperatorMessage {
                body: Some(operator_message::Body::HelloReply(reply)),
            })) => Ok((agent, reply)),
            other => fail(format!("expected HelloReply, got {other:?}")),
        }
    }

    /// The next message from the operator: `Ok(None)` when the stream ended cleanly.
    pub(crate) async fn recv(&mut self) -> TestResult<Result<Option<pb::OperatorMessage>, Status>> {
        tokio::time::timeout(ANSWER_TIMEOUT, self.rx.message())
            .await
            .map_err(|_| format!("no message from the operator within {ANSWER_TIMEOUT:?}").into())
    }

    /// Takes the next `seq`.
    pub(crate) fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// Sends one message as it is, without reading anything.
    pub(crate) async fn send(&mut self, seq: u64, body: Body) -> TestResult {
        self.tx
            .send(pb::AgentMessage {
                seq,
                body: Some(body),
            })
            .await
            .map_err(|_| "the agent's stream is closed")?;
        Ok(())
    }

    /// Sends one message and reads up to its Ack.
    pub(crate) async fn exchange(&mut self, seq: u64, body: Body) -> TestResult<Answer> {
        self.send(seq, body).await?;
        let mut rebinds = Vec::new();
        loop {
            match self.recv().await? {
                Ok(Some(pb::OperatorMessage { body: Some(body) })) => match body {
                    operator_message::Body::Ack(ack) if ack.seq == seq => {
                        return Ok(Answer { ack, rebinds });
                    }
                    operator_message::Body::Rebind(rebind) => rebinds.push(rebind),
                    operator_message::Body::SnapshotRequest(_) => {}
                    other => return fail(format!("expected the Ack of seq {seq}, got {other:?}")),
                },
                other => return fail(format!("expected the Ack of seq {seq}, got {other:?}")),
            }
        }
    }

    /// A snapshot with the next `seq`.
    pub(crate) async fn snapshot(&mut self, endpoints: Vec<pb::Endpoint>) -> TestResult<Answer> {
        let seq = self.next_seq();
        self.exchange(seq, Body::Snapshot(pb::Snapshot { endpoints }))
            .await
    }

    /// An upsert with the next `seq`.
    pub(crate) async fn upsert(&mut self, endpoint: pb::Endpoint) -> TestResult<Answer> {
        let seq = self.next_seq();
        self.exchange(
            seq,
            Body::Upsert(pb::EndpointUpsert {
                endpoint: Some(endpoint),
            }),
        )
        .await
    }

    /// Reads until the stream ends, which must be with `code` and a message naming
    /// every one of `needles`. An Ack on the way fails: the refused message got one.
    pub(crate) async fn expect_end(&mut self, code: Code, needles: &[&str]) -> TestResult<Status> {
        loop {
            match self.recv().await? {
                Ok(Some(pb::OperatorMessage {
                    body: Some(operator_message::Body::Ack(ack)),
                })) => {
                    return fail(format!(
                        "expected the stream to end with {code:?}, got {ack:?}"
                    ));
                }
                Ok(Some(_)) => {}
                Ok(None) => {
                    return fail(format!(
                        "expected the stream to end with {code:?}, it ended cleanly"
                    ));
                }
                Err(status) => return expect_status::<()>(Err(status), code, needles),
            }
        }
    }
}

/// A minimal HTTP/1.0 GET (the connection closes after the answer, so the body is
/// everything after the headers): status code, headers, body.
pub(crate) async fn http_get(addr: SocketAddr, path: &str) -> TestResult<(u16, String, String)> {
    let exchange = async {
        let mut stream = TcpStream::connect(addr).await?;
        stream
            .write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
            .await?;
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
