//! gRPC framing by hand for the two streams every agent holds for its life
//! (EndpointSync.Sync and EndpointMap.Watch), so that what a stream costs follows
//! what is in flight on it, not the largest message it ever carried.
//!
//! tonic's `Streaming` keeps one decode buffer per stream and its encoder one encode
//! buffer per stream; each keeps the capacity of the largest message through it for as
//! long as the stream lives (a 110-endpoint snapshot: ~44 KB; a full-map chunk: ~64 KB),
//! which at 5,000 agents is most of the operator's memory. Here:
//!
//! - [`Messages`] decodes requests from the body as it comes: a message within one
//!   body chunk (the usual case) is decoded from that chunk, one split across chunks
//!   is gathered into a buffer of exactly its length, and nothing is kept between
//!   messages. It polls the body only when asked for a message, as tonic's decoder
//!   does, so the request body's limits ([`crate::codec`]) judge the next message's
//!   prefix only after the previous one was taken.
//! - [`Answers`] is a response body of messages already framed, one HTTP/2 DATA frame
//!   each: the map's batches and chunks are framed once and shared by every watcher
//!   (h2 sends a `Bytes` without copying it), and the Sync stream's small answers are
//!   framed into their own allocation, freed once sent. The end of the stream, or the
//!   first error, becomes its trailers.

use std::{
    collections::VecDeque,
    marker::PhantomData,
    pin::Pin,
    task::{Context, Poll, ready},
};

use bytes::{Buf as _, BufMut as _, Bytes, BytesMut};
use futures::Stream;
use http_body::{Body as _, Frame};
use prost::Message;
use tonic::{Request, Status, body::Body, metadata::MetadataMap};

/// The length prefix of a gRPC message: a compression flag and a big-endian length.
pub const PREFIX_BYTES: usize = 5;

/// `message` framed for the wire, in an allocation of its exact size.
pub fn frame(message: &impl Message) -> Bytes {
    let len = message.encoded_len();
    let mut buf = BytesMut::with_capacity(PREFIX_BYTES + len);
    put_prefix(&mut buf, len);
    // Cannot fail: the buffer has room for the encoded length.
    let _ = message.encode(&mut buf);
    buf.freeze()
}

/// A [`frame`]d message, refused when over `max_bytes` (the peer would refuse it).
pub fn within(framed: Bytes, max_bytes: usize) -> Result<Bytes, Status> {
    let len = framed.len().saturating_sub(PREFIX_BYTES);
    if len > max_bytes {
        return Err(Status::internal(format!(
            "an answer of {len} bytes is over the message limit of {max_bytes} bytes"
        )));
    }
    Ok(framed)
}

/// Writes the uncompressed prefix of a message of `len` bytes.
pub fn put_prefix(buf: &mut impl bytes::BufMut, len: usize) {
    buf.put_u8(0);
    buf.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
}

/// The request messages of one call, decoded from its body as they come.
pub struct Messages<M> {
    body: Body,
    /// Received and not yet part of a decoded message.
    chunks: VecDeque<Bytes>,
    buffered: usize,
    /// The current message's length, once its prefix came.
    declared: Option<usize>,
    /// Longer messages are refused (the request body's own limits are tighter: this is
    /// the outer bound).
    max_bytes: usize,
    ended: bool,
    _message: PhantomData<fn() -> M>,
}

impl<M> std::fmt::Debug for Messages<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Messages")
            .field("buffered", &self.buffered)
            .field("declared", &self.declared)
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}

impl<M: Message + Default> Messages<M> {
    pub fn new(body: Body, max_bytes: usize) -> Self {
        Self {
            body,
            chunks: VecDeque::new(),
            buffered: 0,
            declared: None,
            max_bytes,
            ended: false,
            _message: PhantomData,
        }
    }

    /// The next message; `None` when the client ended its side of the stream between
    /// messages. Cancel-safe: what came so far stays for the next call.
    pub async fn message(&mut self) -> Result<Option<M>, Status> {
        std::future::poll_fn(|cx| self.poll_message(cx)).await
    }

    fn poll_message(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<M>, Status>> {
        loop {
            if let Some(message) = self.take()? {
                return Poll::Ready(Ok(Some(message)));
            }
            if self.ended {
                return Poll::Ready(if self.buffered == 0 && self.declared.is_none() {
                    Ok(None)
                } else {
                    Err(Status::invalid_argument(format!(
                        "{}: the stream ended inside a message ({} bytes of it came)",
                        type_name::<M>(),
                        self.buffered
                    )))
                });
            }
            match ready!(Pin::new(&mut self.body).poll_frame(cx)) {
                Some(Ok(frame)) => {
                    // Trailers from a client carry nothing a server reads.
                    if let Ok(data) = frame.into_data()
                        && !data.is_empty()
                    {
                        self.buffered += data.len();
                        self.chunks.push_back(data);
                    }
                }
                Some(Err(status)) => return Poll::Ready(Err(status)),
                None => self.ended = true,
            }
        }
    }

    /// The next message if all of it came.
    fn take(&mut self) -> Result<Option<M>, Status> {
        let len = match self.declared {
            Some(len) => len,
            None if self.buffered >= PREFIX_BYTES => {
                let mut prefix = [0; PREFIX_BYTES];
                self.copy_out(&mut prefix);
                let [flag, a, b, c, d] = prefix;
                if flag != 0 {
                    return Err(Status::unimplemented(format!(
                        "{}: compressed messages are not accepted (send them uncompressed)",
                        type_name::<M>()
                    )));
                }
                let len = u32::from_be_bytes([a, b, c, d]) as usize;
                if len > self.max_bytes {
                    return Err(Status::resource_exhausted(format!(
                        "{}: a message of {len} bytes is over the limit of {} bytes",
                        type_name::<M>(),
                        self.max_bytes
                    )));
                }
                self.declared = Some(len);
                len
            }
            None => return Ok(None),
        };
        if self.buffered < len {
            return Ok(None);
        }
        self.declared = None;
        let bytes = self.split(len);
        M::decode(bytes)
            .map(Some)
            .map_err(|e| Status::invalid_argument(format!("{}: {e}", type_name::<M>())))
    }

    /// Moves the first `out.len()` buffered bytes into `out`.
    fn copy_out(&mut self, out: &mut [u8]) {
        let mut at = 0;
        while at < out.len() {
            let Some(front) = self.chunks.front_mut() else {
                return;
            };
            let n = front.len().min(out.len() - at);
            out[at..at + n].copy_from_slice(&front[..n]);
            front.advance(n);
            at += n;
            if front.is_empty() {
                self.chunks.pop_front();
            }
        }
        self.buffered -= out.len();
    }

    /// The first `len` buffered bytes: a slice of the first chunk when it holds them
    /// all, else a copy of exactly `len` bytes.
    fn split(&mut self, len: usize) -> Bytes {
        self.buffered -= len;
        if let Some(front) = self.chunks.front_mut()
            && front.len() >= len
        {
            let bytes = front.split_to(len);
            if front.is_empty() {
                self.chunks.pop_front();
            }
            return bytes;
        }
        let mut out = BytesMut::with_capacity(len);
        while out.len() < len {
            let Some(front) = self.chunks.front_mut() else {
                break;
            };
            let n = front.len().min(len - out.len());
            out.put_slice(&front[..n]);
            front.advance(n);
            if front.is_empty() {
                self.chunks.pop_front();
            }
        }
        out.freeze()
    }
}

/// The message type's short name, for errors.
fn type_name<M>() -> &'static str {
    let full = std::any::type_name::<M>();
    full.rsplit("::").next().unwrap_or(full)
}

/// `req` as a tonic request of its messages: the metadata and the extensions (the
/// caller, the peer address, the stream's limit) as tonic's server would give them.
pub fn request<M: Message + Default>(
    req: http::Request<Body>,
    max_bytes: usize,
) -> Request<Messages<M>> {
    let (parts, body) = req.into_parts();
    Request::from_parts(
        MetadataMap::from_headers(parts.headers),
        parts.extensions,
        Messages::new(body, max_bytes),
    )
}

/// The one message of a unary or server-streaming request.
pub async fn single<M: Message + Default>(
    req: http::Request<Body>,
    max_bytes: usize,
) -> Result<Request<M>, Status> {
    let (metadata, extensions, mut messages) = request::<M>(req, max_bytes).into_parts();
    let message = messages.message().await?.ok_or_else(|| {
        Status::invalid_argument(format!(
            "{}: the request ended before its message",
            type_name::<M>()
        ))
    })?;
    Ok(Request::from_parts(metadata, extensions, message))
}

/// Messages already framed ([`frame`]), sent as they come; the stream's end or first
/// error becomes the trailers.
pub type Framed = Pin<Box<dyn Stream<Item = Result<Bytes, Status>> + Send>>;

/// A response body of [`Framed`] messages.
pub struct Answers {
    messages: Option<Framed>,
}

impl std::fmt::Debug for Answers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Answers")
            .field("ended", &self.messages.is_none())
            .finish()
    }
}

impl Answers {
    /// The response that streams `messages`.
    pub fn response(messages: Framed) -> http::Response<Body> {
        let mut response = http::Response::new(Body::new(Self {
            messages: Some(messages),
        }));
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/grpc"),
        );
        response
    }

    /// The response of a call refused before its stream began: trailers only.
    pub fn refused(status: Status) -> http::Response<Body> {
        status.into_http()
    }
}

impl http_body::Body for Answers {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let Some(messages) = self.messages.as_mut() else {
            return Poll::Ready(None);
        };
        let status = match ready!(messages.as_mut().poll_next(cx)) {
            Some(Ok(bytes)) => return Poll::Ready(Some(Ok(Frame::data(bytes)))),
            Some(Err(status)) => status,
            None => Status::ok(""),
        };
        // Dropped at once: whatever the stream held goes with it.
        self.messages = None;
        let mut trailers = http::HeaderMap::new();
        if status.add_header(&mut trailers).is_err() {
            // A message that cannot be a header: the code alone.
            let _ = Status::new(status.code(), "").add_header(&mut trailers);
        }
        Poll::Ready(Some(Ok(Frame::trailers(trailers))))
    }

    fn is_end_stream(&self) -> bool {
        self.messages.is_none()
    }
}

#[cfg(test)]
mod tests {
    use census_proto::pb;
    use futures::StreamExt as _;
    use http_body_util::BodyExt as _;

    use super::*;

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    fn hello(node: &str) -> pb::AgentMessage {
        pb::AgentMessage {
            body: Some(pb::agent_message::Body::Hello(pb::Hello {
                node: node.to_owned(),
                ..pb::Hello::default()
            })),
            ..pb::AgentMessage::default()
        }
    }

    /// A body that hands on `chunks` one frame each, then ends.
    fn body(chunks: Vec<Bytes>) -> Body {
        let frames =
            futures::stream::iter(chunks.into_iter().map(|c| Ok::<_, Status>(Frame::data(c))));
        Body::new(http_body_util::StreamBody::new(frames))
    }

    /// `bytes` cut into pieces of `at` bytes.
    fn cut(bytes: &[u8], at: usize) -> Vec<Bytes> {
        bytes.chunks(at).map(Bytes::copy_from_slice).collect()
    }

    #[tokio::test]
    async fn messages_come_whole_however_the_body_cuts_them() -> TestResult {
        let sent: Vec<_> = (0..5).map(|i| hello(&format!("node-{i}"))).collect();
        let mut wire = Vec::new();
        for m in &sent {
            wire.extend_from_slice(&frame(m));
        }
        for at in [1, 2, 5, 7, 16, wire.len()] {
            let mut messages = Messages::<pb::AgentMessage>::new(body(cut(&wire, at)), 1024);
            let mut got = Vec::new();
            while let Some(m) = messages.message().await? {
                got.push(m);
            }
            assert_eq!(got, sent, "cut every {at} bytes");
            assert_eq!((messages.buffered, messages.chunks.len()), (0, 0));
        }
        Ok(())
    }

    #[tokio::test]
    async fn an_end_inside_a_message_is_an_error_naming_it() -> TestResult {
        let wire = frame(&hello("node-a"));
        for keep in [3, wire.len() - 1] {
            let mut messages =
                Messages::<pb::AgentMessage>::new(body(vec![wire.slice(..keep)]), 1024);
            let err = messages.message().await.err().ok_or("no error")?;
            assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
            assert!(
                err.message()
                    .contains("AgentMessage: the stream ended inside a message"),
                "{err:?}"
            );
        }
        Ok(())
    }

    #[tokio::test]
    async fn oversize_compressed_and_malformed_messages_are_refused_by_name() -> TestResult {
        let wire = frame(&hello("node-a"));
        let cases: [(Vec<u8>, tonic::Code, &str); 3] = [
            (
                wire.to_vec(),
                tonic::Code::ResourceExhausted,
                "over the limit of 4 bytes",
            ),
            (
                [&[1u8][..], &wire[1..]].concat(),
                tonic::Code::Unimplemented,
                "compressed",
            ),
            (
                vec![0, 0, 0, 0, 2, 0xff, 0xff],
                tonic::Code::InvalidArgument,
                "AgentMessage",
            ),
        ];
        for (bytes, code, says) in cases {
            let max = if code == tonic::Code::ResourceExhausted {
                4
            } else {
                1024
            };
            let mut messages =
                Messages::<pb::AgentMessage>::new(body(vec![Bytes::from(bytes)]), max);
            let err = messages.message().await.err().ok_or("no error")?;
            assert_eq!(err.code(), code, "{err:?}");
            assert!(err.message().contains(says), "{err:?}");
        }
        Ok(())
    }

    #[test]
    fn a_message_in_one_chunk_is_not_copied() -> TestResult {
        let mut wire = BytesMut::new();
        let message = pb::EndpointMapWatchRequest {
            node: "node-a".into(),
            ..pb::EndpointMapWatchRequest::default()
        };
        wire.extend_from_slice(&frame(&message));
        let wire = wire.freeze();
        let mut messages = Messages::<pb::EndpointMapWatchRequest>::new(body(vec![]), 1024);
        messages.buffered = wire.len();
        messages.chunks.push_back(wire.clone());
        messages.copy_out(&mut [0; PREFIX_BYTES]);
        let split = messages.split(wire.len() - PREFIX_BYTES);
        assert_eq!(split.as_ptr(), wire[PREFIX_BYTES..].as_ptr());
        Ok(())
    }

    #[tokio::test]
    async fn answers_are_the_frames_then_trailers_with_the_status() -> TestResult {
        let first = frame(&hello("node-a"));
        for (end, code) in [
            (None, "0"),
            (Some(Status::resource_exhausted("too many")), "8"),
        ] {
            let items: Vec<Result<Bytes, Status>> = std::iter::once(Ok(first.clone()))
                .chain(end.into_iter().map(Err))
                .collect();
            let response = Answers::response(futures::stream::iter(items).boxed());
            assert_eq!(response.headers()["content-type"], "application/grpc");
            let mut body = response.into_body();
            let data = body.frame().await.ok_or("no frame")??;
            let data = data.into_data().map_err(|_| "not data")?;
            // The very bytes given: not copied.
            assert_eq!(data.as_ptr(), first.as_ptr());
            let trailers = body.frame().await.ok_or("no trailers")??;
            let trailers = trailers.into_trailers().map_err(|_| "not trailers")?;
            assert_eq!(trailers["grpc-status"], code);
            assert!(body.frame().await.is_none());
            assert!(body.is_end_stream());
        }
        Ok(())
    }
}
