//! A raw HTTP/2 client that sends exactly what an attacker would (the `h2` crate):
//! gRPC message prefixes that declare any length, calls that stall where they
//! like, and data pushed only as the server's flow control allows, so that the
//! attacker itself holds no large buffers. For the operator's transport tests and
//! its abuse benchmark.

use std::{net::SocketAddr, time::Duration};

use bytes::Bytes;
use census_proto::pb::{self, agent_message::Body};
use tokio::{net::TcpStream, task::JoinHandle};
use tonic::Status;

use crate::TestResult;

/// The HTTP/2 client connection preface.
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// An empty SETTINGS frame, what a client sends after its preface.
pub const EMPTY_SETTINGS: &[u8] = &[0, 0, 0, 4, 0, 0, 0, 0, 0];

/// A gRPC message's 5-byte prefix declaring `len` bytes.
pub fn prefix(len: u32) -> Bytes {
    let mut out = vec![0];
    out.extend_from_slice(&len.to_be_bytes());
    Bytes::from(out)
}

/// `message` as one gRPC message: its prefix and its bytes.
pub fn framed(message: &impl prost::Message) -> Bytes {
    let body = message.encode_to_vec();
    let mut out = prefix(body.len() as u32).to_vec();
    out.extend_from_slice(&body);
    Bytes::from(out)
}

/// The Hello of `node` carrying `agent_version` (the string a client controls).
pub fn hello(node: &str, agent_version: impl Into<String>) -> pb::AgentMessage {
    let session = pb::Session {
        start_time_ns: 100,
        nonce: 1,
    };
    let mut message = crate::agent::hello(node, session);
    if let Some(Body::Hello(hello)) = &mut message.body {
        hello.agent_version = agent_version.into();
    }
    message
}

/// One HTTP/2 connection and a call on it, as an attacker drives them.
#[derive(Debug)]
pub struct Call {
    /// The answer's headers (and then its body and trailers).
    pub answer: h2::client::ResponseFuture,
    /// The request's body, open.
    pub send: h2::SendStream<Bytes>,
    /// The task driving the connection: it ends when the server closes it.
    pub connection: JoinHandle<()>,
}

/// Opens a connection to `addr` and starts a gRPC call of `path` on it: the
/// request's headers are sent, its body is left open.
pub async fn call(addr: SocketAddr, path: &str) -> TestResult<Call> {
    let tcp = TcpStream::connect(addr).await?;
    let (client, connection) = h2::client::handshake(tcp).await?;
    let connection = tokio::spawn(async move {
        let _ = connection.await;
    });
    let mut client = client.ready().await?;
    let request = http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())?;
    let (answer, send) = client.send_request(request, false)?;
    Ok(Call {
        answer,
        send,
        connection,
    })
}

/// Sends `data` as the flow control allows; stops at the first refusal, or when the
/// server grants no more room for a second. The bytes sent.
pub async fn push(send: &mut h2::SendStream<Bytes>, data: &Bytes) -> usize {
    const CHUNK: usize = 64 * 1024;
    let total = data.len();
    let mut sent = 0;
    while sent < total {
        send.reserve_capacity(CHUNK.min(total - sent));
        let room = tokio::time::timeout(
            Duration::from_secs(1),
            futures::future::poll_fn(|cx| send.poll_capacity(cx)),
        )
        .await;
        let n = match room {
            Ok(Some(Ok(n))) if n > 0 => n.min(total - sent),
            _ => break,
        };
        if send.send_data(data.slice(sent..sent + n), false).is_err() {
            break;
        }
        sent += n;
    }
    sent
}

/// The call's status: from trailers-only headers, or from the trailers after its
/// messages (which are read and dropped). Waits as long as the server takes.
pub async fn status_of(answer: h2::client::ResponseFuture) -> TestResult<Status> {
    let answer = answer.await?;
    if let Some(status) = Status::from_header_map(answer.headers()) {
        return Ok(status);
    }
    let mut body = answer.into_body();
    while let Some(data) = body.data().await {
        let data = data?;
        let _ = body.flow_control().release_capacity(data.len());
    }
    let trailers = body.trailers().await?.ok_or("an answer without trailers")?;
    Ok(Status::from_header_map(&trailers).ok_or("trailers without grpc-status")?)
}

#[cfg(test)]
mod tests {
    use prost::Message as _;

    use super::*;

    #[test]
    fn a_framed_message_is_its_prefix_and_its_bytes() -> TestResult {
        let message = hello("node-a", "v".repeat(300));
        let framed = framed(&message);
        let len = u32::from_be_bytes(framed[1..5].try_into()?);
        assert_eq!(framed[0], 0, "not compressed");
        assert_eq!(len as usize, framed.len() - 5);
        let decoded = pb::AgentMessage::decode(&framed[5..])?;
        let Some(Body::Hello(hello)) = decoded.body else {
            return crate::fail("not a Hello");
        };
        assert_eq!(
            (hello.node.as_str(), hello.agent_version.len()),
            ("node-a", 300)
        );
        assert_eq!(&prefix(39_000_000)[..], &[0, 0x02, 0x53, 0x17, 0xc0]);
        Ok(())
    }
}
