//! An agent's EndpointSync stream, driven message by message, and the messages it
//! sends.

use std::net::SocketAddr;

use census_proto::{
    PROTOCOL_VERSION,
    pb::{self, agent_message::Body, endpoint_sync_client::EndpointSyncClient, operator_message},
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{
    Code, Status, Streaming,
    transport::{Channel, ClientTlsConfig},
};

use crate::{ANSWER_TIMEOUT, Operator, TestResult, expect_status, fail, strings};

/// Where an agent's stream goes: an operator, or any address (a proxy in front of
/// one); over TLS for a [`crate::tls::Secured`] target.
pub trait Target {
    fn grpc_addr(&self) -> SocketAddr;

    /// The TLS to connect with (the CA to trust, the client certificate); none for
    /// plain HTTP/2.
    fn tls(&self) -> Option<&ClientTlsConfig> {
        None
    }
}

impl Target for Operator {
    fn grpc_addr(&self) -> SocketAddr {
        self.grpc_addr
    }
}

impl Target for SocketAddr {
    fn grpc_addr(&self) -> SocketAddr {
        *self
    }
}

/// A session that starts at `start_time_ns`.
pub fn session(start_time_ns: u64) -> pb::Session {
    pb::Session {
        start_time_ns,
        nonce: 7,
    }
}

/// A wire endpoint, as a snapshot or an upsert carries it.
pub fn endpoint(
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

/// The Hello of `node` in `session`.
pub fn hello(node: &str, session: pb::Session) -> pb::AgentMessage {
    pb::AgentMessage {
        seq: 0,
        body: Some(Body::Hello(pb::Hello {
            protocol_version: PROTOCOL_VERSION,
            node: node.into(),
            session: Some(session),
            agent_version: "test".into(),
            addresses: Vec::new(),
        })),
    }
}

/// An agent's EndpointSync stream, driven message by message.
#[derive(Debug)]
pub struct Agent {
    pub node: String,
    pub session: pb::Session,
    seq: u64,
    tx: mpsc::Sender<pb::AgentMessage>,
    rx: Streaming<pb::OperatorMessage>,
}

/// What the operator answered to one message: its Ack, and the Rebinds before it.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    pub ack: pb::Ack,
    pub rebinds: Vec<pb::Rebind>,
}

/// The agent's half of an EndpointSync stream, and the operator's.
pub type AgentStream = (
    mpsc::Sender<pb::AgentMessage>,
    Streaming<pb::OperatorMessage>,
);

/// Opens an EndpointSync stream whose first messages are `first`. The operator reads
/// the first message before it answers, so a refused first message is the call's error.
pub async fn open_stream(
    op: &impl Target,
    first: Vec<pb::AgentMessage>,
) -> TestResult<Result<AgentStream, Status>> {
    let (tx, rx) = mpsc::channel(16);
    for message in first {
        tx.send(message).await?;
    }
    Ok(call_sync(op, rx).await?.map(|stream| (tx, stream)))
}

/// Like [`open_stream`], but the agent ends its half of the stream after `first`.
pub async fn open_stream_and_close(
    op: &impl Target,
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
    op: &impl Target,
    rx: mpsc::Receiver<pb::AgentMessage>,
) -> TestResult<Result<Streaming<pb::OperatorMessage>, Status>> {
    let endpoint = match op.tls() {
        Some(tls) => {
            Channel::from_shared(format!("https://{}", op.grpc_addr()))?.tls_config(tls.clone())?
        }
        None => Channel::from_shared(format!("http://{}", op.grpc_addr()))?,
    };
    let channel = endpoint.connect_timeout(ANSWER_TIMEOUT).connect().await?;
    let mut client = EndpointSyncClient::new(channel)
        .max_encoding_message_size(usize::MAX)
        .max_decoding_message_size(64 * 1024 * 1024);
    let answer = tokio::time::timeout(ANSWER_TIMEOUT, client.sync(ReceiverStream::new(rx)))
        .await
        .map_err(|_| "EndpointSync.Sync did not answer")?;
    Ok(answer.map(tonic::Response::into_inner))
}

impl Agent {
    /// Says Hello as `node` in `session` and reads the HelloReply.
    pub async fn connect(
        op: &impl Target,
        node: &str,
        session: pb::Session,
    ) -> TestResult<(Self, pb::HelloReply)> {
        Self::connect_at(op, hello(node, session), node, session, 0).await
    }

    /// Like [`Agent::connect`], with the node's own addresses in Hello.
    pub async fn connect_with_addresses(
        op: &impl Target,
        node: &str,
        session: pb::Session,
        addresses: &[&str],
    ) -> TestResult<(Self, pb::HelloReply)> {
        let mut message = hello(node, session);
        if let Some(Body::Hello(hello)) = &mut message.body {
            hello.addresses = strings(addresses);
        }
        Self::connect_at(op, message, node, session, 0).await
    }

    /// Connects again in the same session (a reconnect): `seq` goes on from here.
    pub async fn reconnect(self, op: &impl Target) -> TestResult<(Self, pb::HelloReply)> {
        Self::connect_at(
            op,
            hello(&self.node, self.session),
            &self.node,
            self.session,
            self.seq,
        )
        .await
    }

    async fn connect_at(
        op: &impl Target,
        first: pb::AgentMessage,
        node: &str,
        session: pb::Session,
        seq: u64,
    ) -> TestResult<(Self, pb::HelloReply)> {
        let (tx, rx) = match open_stream(op, vec![first]).await? {
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
    pub async fn recv(&mut self) -> TestResult<Result<Option<pb::OperatorMessage>, Status>> {
        tokio::time::timeout(ANSWER_TIMEOUT, self.rx.message())
            .await
            .map_err(|_| format!("no message from the operator within {ANSWER_TIMEOUT:?}").into())
    }

    /// Takes the next `seq`.
    pub fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// Sends one message as it is, without reading anything.
    pub async fn send(&mut self, seq: u64, body: Body) -> TestResult {
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
    pub async fn exchange(&mut self, seq: u64, body: Body) -> TestResult<Answer> {
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

    /// A snapshot with the next `seq`, settling no allocation.
    pub async fn snapshot(&mut self, endpoints: Vec<pb::Endpoint>) -> TestResult<Answer> {
        self.snapshot_settled(endpoints, 0).await
    }

    /// A snapshot with the next `seq`, saying the session's allocations up to
    /// `settled` have settled.
    pub async fn snapshot_settled(
        &mut self,
        endpoints: Vec<pb::Endpoint>,
        settled: u64,
    ) -> TestResult<Answer> {
        let seq = self.next_seq();
        self.exchange(
            seq,
            Body::Snapshot(pb::Snapshot {
                endpoints,
                allocations_settled: settled,
            }),
        )
        .await
    }

    /// An upsert with the next `seq`.
    pub async fn upsert(&mut self, endpoint: pb::Endpoint) -> TestResult<Answer> {
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
    pub async fn expect_end(&mut self, code: Code, needles: &[&str]) -> TestResult<Status> {
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
