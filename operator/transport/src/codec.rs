//! Per-method message limits, judged on each message's 5-byte gRPC length prefix as
//! the request body streams in: a message over its method's limit is refused before
//! a byte of it is buffered, and a message that does not arrive in full within the
//! message timeout ends its call, so a stalled partial message holds nothing for long.
//!
//! tonic's own limit (`max_decoding_message_size`) is one per service and fixed for a
//! stream's life, reserves the declared length as soon as it reads the prefix, and
//! refuses with OUT_OF_RANGE; the methods here need different limits (a small one for
//! every request, a snapshot-sized one only on an EndpointSync stream whose Hello was
//! accepted), so the limit is applied here, in front of tonic's decoder, on the body
//! it decodes from. tonic's limit stays as the outer bound.
//!
//! The body hands its decoder (tonic's, or [`crate::wire::Messages`] on the agents'
//! two streams) at most one message per frame: the next message's prefix is judged
//! only when the decoder asks for more, that is once the previous message was decoded
//! and taken, so an EndpointSync stream's limit is raised after its Hello and before
//! the first snapshot is judged.

use std::{
    future::Future as _,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use http_body::Frame;
use prometheus_client::metrics::{counter::Counter, family::Family};
use tokio::time::Sleep;
use tonic::{Code, Status};

use crate::{
    ReasonLabels,
    budget::{MessageBudget, Reserved},
    methods::{SYNC_PATH, is_client_stream, method_name},
};

/// Bytes one label takes on the wire at most: `source:prefix/name=value` with
/// Kubernetes' limits (a 253-byte prefix, 63-byte name and value) and its framing.
pub const LABEL_WIRE_BYTES: usize = 512;

/// Room for everything in a request besides its labels (node name, session, ids,
/// page tokens, addresses), and in a Hello.
pub const REQUEST_SLACK_BYTES: usize = 4096;

/// The limit of every message but the ones after an EndpointSync stream's Hello:
/// a full label set of `max_labels` labels, plus [`REQUEST_SLACK_BYTES`].
pub fn request_limit(max_labels: usize) -> usize {
    max_labels
        .saturating_mul(LABEL_WIRE_BYTES)
        .saturating_add(REQUEST_SLACK_BYTES)
}

/// The limits every call's messages are held to.
#[derive(Debug, Clone)]
pub struct MessageLimits {
    /// Every request message, and an EndpointSync stream's until its Hello is accepted.
    pub request_bytes: usize,
    /// An EndpointSync stream's messages after its Hello (a snapshot).
    pub stream_bytes: usize,
    /// How long one message may take to arrive, from its first byte (a unary or
    /// server-streaming call's one message: from the start of the call).
    pub timeout: Duration,
    /// What a message over `request_bytes` reserves before it is buffered.
    pub budget: MessageBudget,
}

/// The limit of one EndpointSync stream: the request limit until [`StreamLimit::raise`].
#[derive(Debug)]
pub struct StreamLimit {
    bytes: AtomicUsize,
    raised: usize,
}

impl StreamLimit {
    /// The Hello was accepted: snapshots up to the stream limit may come.
    pub fn raise(&self) {
        self.bytes.store(self.raised, Ordering::Relaxed);
    }

    fn is_raised(&self) -> bool {
        self.bytes.load(Ordering::Relaxed) == self.raised
    }
}

#[derive(Debug)]
enum Limit {
    Request(usize),
    Stream(Arc<StreamLimit>),
}

impl Limit {
    /// The limit now, and how it is named in a refusal.
    fn current(&self) -> (usize, &'static str) {
        match self {
            Self::Request(bytes) => (
                *bytes,
                "the request limit (--max-labels x 512 bytes + 4096 bytes)",
            ),
            Self::Stream(limit) if limit.is_raised() => (
                limit.raised,
                "the message limit (--max-snapshot-endpoints x 4096 bytes)",
            ),
            Self::Stream(limit) => (
                limit.bytes.load(Ordering::Relaxed),
                "the limit before an accepted Hello (--max-labels x 512 bytes + 4096 bytes)",
            ),
        }
    }
}

/// The request body of one call, held to its method's limits (see the module).
#[derive(Debug)]
pub struct Limited {
    inner: tonic::body::Body,
    method: &'static str,
    limit: Limit,
    timeout: Duration,
    refused: Family<ReasonLabels, Counter>,
    /// The prefix of the next message, as far as it came.
    prefix: [u8; 5],
    prefix_len: usize,
    /// The current message's declared length, and the bytes of it still to come.
    declared: usize,
    remaining: usize,
    /// Runs while a message is under way.
    deadline: Option<Pin<Box<Sleep>>>,
    /// Bytes after the end of the message just handed on.
    pending: Bytes,
    failed: bool,
    /// Messages over this many bytes reserve their length in `budget` first.
    small_bytes: usize,
    budget: MessageBudget,
    /// The current message's reservation, while it arrives.
    reserved: Option<Reserved>,
    /// The last message's, until tonic asks for more (it has decoded that one).
    decoding: Option<Reserved>,
    /// A reservation waited for: the message's prefix is held back until it comes.
    waiting: Option<Waiting>,
}

/// A reservation under way.
struct Waiting(Pin<Box<dyn Future<Output = Option<Reserved>> + Send>>);

impl std::fmt::Debug for Waiting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Waiting")
    }
}

/// `body` held to the limits of the method at `path`; for an EndpointSync stream,
/// also the handle its handler raises the limit with.
pub fn limit(
    path: &str,
    body: tonic::body::Body,
    limits: &MessageLimits,
    refused: Family<ReasonLabels, Counter>,
) -> (Limited, Option<Arc<StreamLimit>>) {
    let (limit, handle) = if path == SYNC_PATH {
        let handle = Arc::new(StreamLimit {
            bytes: AtomicUsize::new(limits.request_bytes),
            raised: limits.stream_bytes,
        });
        (Limit::Stream(Arc::clone(&handle)), Some(handle))
    } else {
        (Limit::Request(limits.request_bytes), None)
    };
    let deadline = (!is_client_stream(path)).then(|| Box::pin(tokio::time::sleep(limits.timeout)));
    let body = Limited {
        inner: body,
        method: method_name(path),
        limit,
        timeout: limits.timeout,
        refused,
        prefix: [0; 5],
        prefix_len: 0,
        declared: 0,
        remaining: 0,
        deadline,
        pending: Bytes::new(),
        failed: false,
        small_bytes: limits.request_bytes,
        budget: limits.budget.clone(),
        reserved: None,
        decoding: None,
        waiting: None,
    };
    (body, handle)
}

impl Limited {
    /// Judges the prefixes in `data` and hands on at most the rest of one message.
    fn admit(&mut self, mut data: Bytes) -> Result<Bytes, Status> {
        let mut at = 0;
        while at < data.len() {
            if self.remaining > 0 {
                let n = self.remaining.min(data.len() - at);
                self.remaining -= n;
                at += n;
                if self.remaining == 0 {
                    self.deadline = None;
                    self.decoding = self.reserved.take();
                    break;
                }
                continue;
            }
            if self.prefix_len == 0 && self.deadline.is_none() {
                self.deadline = Some(Box::pin(tokio::time::sleep(self.timeout)));
            }
            let n = (5 - self.prefix_len).min(data.len() - at);
            self.prefix[self.prefix_len..self.prefix_len + n].copy_from_slice(&data[at..at + n]);
            self.prefix_len += n;
            at += n;
            if self.prefix_len == 5 {
                self.prefix_len = 0;
                let [_, a, b, c, d] = self.prefix;
                let declared = u32::from_be_bytes([a, b, c, d]) as usize;
                let (limit, named) = self.limit.current();
                if declared > limit {
                    return Err(self.fail(
                        "oversize",
                        Status::resource_exhausted(format!(
                            "{}: a message of {declared} bytes is over {named}: {limit} bytes",
                            self.method
                        )),
                    ));
                }
                if declared > self.small_bytes && !self.reserve(declared) {
                    // Held back, prefix and all, until the reservation comes: tonic
                    // reserves a message's length as soon as it reads its prefix.
                    self.prefix_len = 5 - n;
                    self.pending = data.split_off(at - n);
                    return Ok(data);
                }
                self.declared = declared;
                self.remaining = declared;
                if declared == 0 {
                    self.deadline = None;
                    break;
                }
            }
        }
        if at < data.len() {
            self.pending = data.split_off(at);
        }
        Ok(data)
    }

    /// Whether `declared` bytes are reserved for the message whose prefix just came;
    /// if not, the reservation is waited for.
    fn reserve(&mut self, declared: usize) -> bool {
        if self.reserved.is_some() {
            return true;
        }
        match self.budget.try_reserve(declared) {
            Some(reserved) => {
                self.reserved = Some(reserved);
                true
            }
            None => {
                self.declared = declared;
                self.waiting = Some(Waiting(Box::pin(self.budget.reserve(declared))));
                false
            }
        }
    }

    fn fail(&mut self, reason: &'static str, status: Status) -> Status {
        self.failed = true;
        self.pending = Bytes::new();
        self.refused.get_or_create(&ReasonLabels { reason }).inc();
        status
    }

    fn timed_out(&mut self) -> Status {
        if self.waiting.take().is_some() {
            let message = format!(
                "{}: a message of {} bytes waited {:?} for room in the budget of large messages received at once (--max-inflight-message-bytes {}: {} bytes reserved by other streams)",
                self.method,
                self.declared,
                self.timeout,
                self.budget.total(),
                self.budget.in_use(),
            );
            return self.fail("budget", Status::resource_exhausted(message));
        }
        let got = self.declared - self.remaining;
        let message = if self.remaining > 0 {
            format!(
                "{}: a message of {} bytes did not arrive in full within {:?} ({got} bytes came)",
                self.method, self.declared, self.timeout
            )
        } else {
            format!(
                "{}: the request's message did not arrive within {:?}",
                self.method, self.timeout
            )
        };
        self.fail("timeout", Status::deadline_exceeded(message))
    }
}

impl http_body::Body for Limited {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        if this.failed {
            return Poll::Ready(None);
        }
        // Asked for more: the message handed on last was decoded.
        this.decoding = None;
        if let Some(waiting) = this.waiting.as_mut() {
            match waiting.0.as_mut().poll(cx) {
                Poll::Ready(reserved) => {
                    this.waiting = None;
                    this.reserved = reserved;
                    if this.reserved.is_none() {
                        return Poll::Ready(Some(Err(this.fail(
                            "budget",
                            Status::unavailable("the message budget is closed"),
                        ))));
                    }
                }
                Poll::Pending => {
                    if let Some(deadline) = this.deadline.as_mut()
                        && deadline.as_mut().poll(cx).is_ready()
                    {
                        return Poll::Ready(Some(Err(this.timed_out())));
                    }
                    return Poll::Pending;
                }
            }
        }
        if !this.pending.is_empty() {
            let data = std::mem::take(&mut this.pending);
            return Poll::Ready(Some(this.admit(data).map(Frame::data)));
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) => Poll::Ready(Some(this.admit(data).map(Frame::data))),
                Err(trailers) => Poll::Ready(Some(Ok(trailers))),
            },
            Poll::Ready(other) => Poll::Ready(other),
            Poll::Pending => {
                if let Some(deadline) = this.deadline.as_mut()
                    && deadline.as_mut().poll(cx).is_ready()
                {
                    return Poll::Ready(Some(Err(this.timed_out())));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        !self.failed && self.pending.is_empty() && self.inner.is_end_stream()
    }
}

/// How prost's decode errors begin (tonic turns them into INTERNAL).
const DECODE_ERROR: &str = "failed to decode Protobuf message";

/// A request that is not the protobuf it claims to be is the client's fault:
/// INVALID_ARGUMENT, not tonic's INTERNAL. Other statuses are kept.
pub fn client_fault(status: Status) -> Status {
    if status.code() == Code::Internal && status.message().starts_with(DECODE_ERROR) {
        Status::invalid_argument(status.message().to_owned())
    } else {
        status
    }
}

/// [`client_fault`] on a trailers-only answer (a unary call refused before its
/// handler ran).
pub fn client_fault_headers(headers: &mut http::HeaderMap) {
    let Some(status) = Status::from_header_map(headers) else {
        return;
    };
    if status.code() != Code::Internal {
        return;
    }
    let mapped = client_fault(status);
    if mapped.code() != Code::Internal {
        headers.remove(Status::GRPC_STATUS);
        headers.remove(Status::GRPC_MESSAGE);
        headers.remove(Status::GRPC_STATUS_DETAILS);
        // Only a message that cannot be a header fails here, and it came from a
        // header: it can.
        let _ = mapped.add_header(headers);
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt as _;

    use super::*;

    fn frame(len: u32, body: &[u8]) -> Vec<u8> {
        let mut out = vec![0];
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(body);
        out
    }

    fn limits() -> MessageLimits {
        MessageLimits {
            request_bytes: 10,
            stream_bytes: 100,
            timeout: Duration::from_secs(5),
            budget: MessageBudget::new(100, Default::default()),
        }
    }

    fn body_of(chunks: Vec<Vec<u8>>) -> tonic::body::Body {
        let stream = futures::stream::iter(
            chunks
                .into_iter()
                .map(|c| Ok::<_, Status>(Frame::data(Bytes::from(c)))),
        );
        tonic::body::Body::new(http_body_util::StreamBody::new(stream))
    }

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    /// The next frame's data, or the refusal.
    async fn next(body: &mut Limited) -> Result<Result<Bytes, Status>, Box<dyn std::error::Error>> {
        let frame = body.frame().await.ok_or("the body ended")?;
        Ok(match frame {
            Ok(frame) => Ok(frame.into_data().map_err(|_| "not data")?),
            Err(status) => Err(status),
        })
    }

    #[tokio::test]
    async fn messages_are_handed_on_one_at_a_time_and_judged_by_the_limit_then() -> TestResult {
        let mut data = frame(3, b"abc");
        data.extend(frame(50, &[7; 50]));
        let (mut body, handle) =
            limit(SYNC_PATH, body_of(vec![data]), &limits(), Family::default());
        let handle = handle.ok_or("no stream limit")?;
        assert_eq!(next(&mut body).await??.len(), 8);
        handle.raise();
        assert_eq!(next(&mut body).await??.len(), 55);
        Ok(())
    }

    #[tokio::test]
    async fn a_prefix_over_the_limit_is_refused_before_its_body_comes() -> TestResult {
        let (mut body, _) = limit(
            SYNC_PATH,
            body_of(vec![frame(3, b"abc"), frame(50, b"")]),
            &limits(),
            Family::default(),
        );
        assert!(next(&mut body).await?.is_ok());
        let Err(refused) = next(&mut body).await? else {
            return Err("a message over the limit was handed on".into());
        };
        assert_eq!(refused.code(), Code::ResourceExhausted);
        assert!(
            refused
                .message()
                .contains("50 bytes is over the limit before an accepted Hello"),
            "{refused:?}"
        );
        assert!(body.frame().await.is_none(), "nothing after the refusal");
        Ok(())
    }

    #[tokio::test(start_paused = true)]
    async fn a_partial_message_times_out() -> TestResult {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Status>>(1);
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
        let (mut body, _) = limit(
            "/census.v1.IdentityService/Get",
            tonic::body::Body::new(http_body_util::StreamBody::new(stream)),
            &limits(),
            Family::default(),
        );
        tx.send(Ok(Frame::data(Bytes::from(frame(9, b"1234")))))
            .await?;
        assert!(next(&mut body).await?.is_ok());
        let Err(late) = next(&mut body).await? else {
            return Err("more data from nowhere".into());
        };
        assert_eq!(late.code(), Code::DeadlineExceeded);
        assert!(
            late.message()
                .contains("9 bytes did not arrive in full within 5s (4 bytes came)"),
            "{late:?}"
        );
        Ok(())
    }

    /// A Sync stream's body whose Hello (3 bytes) was taken and limit raised, fed
    /// by the returned sender.
    async fn raised(
        limits: &MessageLimits,
    ) -> Result<
        (
            Limited,
            tokio::sync::mpsc::Sender<Result<Frame<Bytes>, Status>>,
        ),
        Box<dyn std::error::Error>,
    > {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Status>>(4);
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
        let (mut body, handle) = limit(
            SYNC_PATH,
            tonic::body::Body::new(http_body_util::StreamBody::new(stream)),
            limits,
            Family::default(),
        );
        tx.send(Ok(Frame::data(Bytes::from(frame(3, b"abc")))))
            .await?;
        assert!(next(&mut body).await?.is_ok());
        handle.ok_or("no stream limit")?.raise();
        Ok((body, tx))
    }

    #[tokio::test(start_paused = true)]
    async fn a_large_message_waits_for_room_in_the_budget_before_its_prefix_is_handed_on()
    -> TestResult {
        let limits = limits();
        let (mut a, a_tx) = raised(&limits).await?;
        let (mut b, b_tx) = raised(&limits).await?;
        // A's 60-byte message reserves 60 of 100 as its prefix comes.
        a_tx.send(Ok(Frame::data(Bytes::from(frame(60, &[1; 20])))))
            .await?;
        assert_eq!(next(&mut a).await??.len(), 25);
        assert_eq!(limits.budget.in_use(), 60);
        // B's 50 bytes do not fit: nothing of its message, prefix included, is handed on.
        let mut whole = frame(50, &[2; 50]);
        whole.extend(frame(2, b"ok"));
        b_tx.send(Ok(Frame::data(Bytes::from(whole)))).await?;
        let early = tokio::time::timeout(Duration::from_secs(1), next(&mut b)).await;
        match early {
            Err(_) => {}
            Ok(Ok(Ok(data))) => assert!(data.is_empty(), "handed on {data:?}"),
            Ok(other) => return Err(format!("{other:?}").into()),
        }
        // A's message ends; its reservation goes once the next frame is asked for.
        a_tx.send(Ok(Frame::data(Bytes::from(vec![1; 40])))).await?;
        assert_eq!(next(&mut a).await??.len(), 40);
        assert_eq!(limits.budget.in_use(), 60, "held while tonic decodes it");
        drop(a_tx);
        assert!(a.frame().await.is_none());
        let mut got = Vec::new();
        while got.len() < 55 {
            got.extend_from_slice(&next(&mut b).await??);
        }
        assert_eq!(got, frame(50, &[2; 50]));
        assert_eq!(limits.budget.in_use(), 50);
        // A small message reserves nothing; B's reservation went when it was asked for.
        assert_eq!(next(&mut b).await??.as_ref(), frame(2, b"ok").as_slice());
        assert_eq!(limits.budget.in_use(), 0);
        Ok(())
    }

    #[tokio::test(start_paused = true)]
    async fn a_message_that_finds_no_room_within_the_timeout_is_resource_exhausted() -> TestResult {
        let limits = limits();
        let held = limits.budget.try_reserve(90).ok_or("no room")?;
        let (mut body, tx) = raised(&limits).await?;
        tx.send(Ok(Frame::data(Bytes::from(frame(50, &[0; 50])))))
            .await?;
        let refused = loop {
            match next(&mut body).await? {
                Ok(data) => assert!(data.is_empty(), "handed on {data:?}"),
                Err(status) => break status,
            }
        };
        assert_eq!(refused.code(), Code::ResourceExhausted);
        assert!(
            refused
                .message()
                .contains("--max-inflight-message-bytes 100: 90 bytes reserved"),
            "{refused:?}"
        );
        drop(held);
        assert_eq!(
            limits.budget.in_use(),
            0,
            "the refused message holds nothing"
        );
        Ok(())
    }

    #[test]
    fn a_decode_error_is_invalid_argument_on_the_wire() -> TestResult {
        let mut headers = http::HeaderMap::new();
        Status::internal("failed to decode Protobuf message: invalid wire type")
            .add_header(&mut headers)?;
        client_fault_headers(&mut headers);
        let status = Status::from_header_map(&headers).ok_or("no status")?;
        assert_eq!(status.code(), Code::InvalidArgument);
        let mut other = http::HeaderMap::new();
        Status::internal("something else").add_header(&mut other)?;
        client_fault_headers(&mut other);
        assert_eq!(
            Status::from_header_map(&other).map(|s| s.code()),
            Some(Code::Internal)
        );
        Ok(())
    }
}
