mod error;
mod framed_read;
mod framed_write;

pub use self::error::{SendError, UserError};

use self::framed_read::FramedRead;
use self::framed_write::FramedWrite;

use crate::frame::{self, Data, Frame};
use crate::proto::Error;

use bytes::Buf;
use futures_core::Stream;
use futures_sink::Sink;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::codec::length_delimited;

use std::io;

#[derive(Debug)]
pub struct Codec<T, B> {
    inner: FramedRead<FramedWrite<T, B>>,
}

impl<T, B> Codec<T, B>
where
    T: AsyncRead + AsyncWrite + Unpin,
    B: Buf,
{
    /// Returns a new `Codec` with the default max frame size
    #[inline]
    pub fn new(io: T) -> Self {
        Self::with_max_recv_frame_size(io, frame::DEFAULT_MAX_FRAME_SIZE as usize)
    }

    /// Returns a new `Codec` with the given maximum frame size
    pub fn with_max_recv_frame_size(io: T, max_frame_size: usize) -> Self {
        // Wrap with writer
        let framed_write = FramedWrite::new(io);

        // Delimit the frames
        let delimited = length_delimited::Builder::new()
            .big_endian()
            .length_field_length(3)
            .length_adjustment(9)
            .num_skip(0) // Don't skip the header
            .new_read(framed_write);

        let mut inner = FramedRead::new(delimited);

        // Use FramedRead's method since it checks the value is within range.
        inner.set_max_frame_size(max_frame_size);

        Codec { inner }
    }
}

impl<T, B> Codec<T, B> {
    /// Updates the max received frame size.
    ///
    /// The change takes effect the next time a frame is decoded. In other
    /// words, if a frame is currently in process of being decoded with a frame
    /// size greater than `val` but less than the max frame size in effect
    /// before calling this function, then the frame will be allowed.
    #[inline]
    pub fn set_max_recv_frame_size(&mut self, val: usize) {
        self.inner.set_max_frame_size(val)
    }

    /// Returns the current max received frame size setting.
    ///
    /// This is the largest size this codec will accept from the wire. Larger
    /// frames will be rejected.
    #[cfg(feature = "unstable")]
    #[inline]
    pub fn max_recv_frame_size(&self) -> usize {
        self.inner.max_frame_size()
    }

    /// Returns the max frame size that can be sent to the peer.
    pub fn max_send_frame_size(&self) -> usize {
        self.inner.get_ref().max_frame_size()
    }

    /// Set the peer's max frame size.
    pub fn set_max_send_frame_size(&mut self, val: usize) {
        self.framed_write().set_max_frame_size(val)
    }

    /// Set the peer's header table size size.
    pub fn set_send_header_table_size(&mut self, val: usize) {
        self.framed_write().set_header_table_size(val)
    }

    /// Set the decoder header table size size.
    pub fn set_recv_header_table_size(&mut self, val: usize) {
        self.inner.set_header_table_size(val)
    }

    /// Set the max header list size that can be received.
    pub fn set_max_recv_header_list_size(&mut self, val: usize) {
        self.inner.set_max_header_list_size(val);
    }

    /// Get a reference to the inner stream.
    #[cfg(feature = "unstable")]
    pub fn get_ref(&self) -> &T {
        self.inner.get_ref().get_ref()
    }

    /// Get a mutable reference to the inner stream.
    pub fn get_mut(&mut self) -> &mut T {
        self.inner.get_mut().get_mut()
    }

    /// Takes the data payload value that was fully written to the socket
    pub(crate) fn take_last_data_frame(&mut self) -> Option<Data<B>> {
        self.framed_write().take_last_data_frame()
    }

    fn framed_write(&mut self) -> &mut FramedWrite<T, B> {
        self.inner.get_mut()
    }
}

impl<T, B> Codec<T, B>
where
    T: AsyncWrite + Unpin,
    B: Buf,
{
    /// Returns `Ready` when the codec can buffer a frame
    pub fn poll_ready(&mut self, cx: &mut Context) -> Poll<io::Result<()>> {
        self.framed_write().poll_ready(cx)
    }

    /// Returns whether the codec can buffer a frame without flushing the
    /// underlying I/O object.
    pub(crate) fn has_send_capacity(&mut self) -> bool {
        self.framed_write().has_capacity()
    }

    /// Buffer a frame.
    ///
    /// `poll_ready` must be called first to ensure that a frame may be
    /// accepted.
    ///
    /// TODO: Rename this to avoid conflicts with Sink::buffer
    pub fn buffer(&mut self, item: Frame<B>) -> Result<(), UserError> {
        self.framed_write().buffer(item)
    }

    /// Flush buffered data to the wire
    pub fn flush(&mut self, cx: &mut Context) -> Poll<io::Result<()>> {
        self.framed_write().flush(cx)
    }

    /// Shutdown the send half
    pub fn shutdown(&mut self, cx: &mut Context) -> Poll<io::Result<()>> {
        self.framed_write().shutdown(cx)
    }
}

impl<T, B> Stream for Codec<T, B>
where
    T: AsyncRead + Unpin,
{
    type Item = Result<Frame, Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Pin::new(&mut self.inner).poll_next(cx)
    }
}

impl<T, B> Sink<Frame<B>> for Codec<T, B>
where
    T: AsyncWrite + Unpin,
    B: Buf,
{
    type Error = SendError;

    fn start_send(mut self: Pin<&mut Self>, item: Frame<B>) -> Result<(), Self::Error> {
        Codec::buffer(&mut self, item)?;
        Ok(())
    }
    /// Returns `Ready` when the codec can buffer a frame
    fn poll_ready(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.framed_write().poll_ready(cx).map_err(Into::into)
    }

    /// Flush buffered data to the wire
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.framed_write().flush(cx).map_err(Into::into)
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        ready!(self.shutdown(cx))?;
        Poll::Ready(Ok(()))
    }
}

// TODO: remove (or improve) this
impl<T> From<T> for Codec<T, bytes::Bytes>
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    fn from(src: T) -> Self {
        Self::new(src)
    }
}

// census: what an idle connection holds, and that a frame arriving in pieces is
// kept until it is whole (the buffers are released while idle, never mid-frame).
#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{Headers, Ping, Pseudo, StreamId};

    use bytes::Bytes;
    use http::{HeaderMap, Method, Uri};
    use std::future::poll_fn;
    use tokio::io::{duplex, AsyncWriteExt, DuplexStream};

    type TestCodec = Codec<DuplexStream, Bytes>;

    /// (write buffer capacity, read buffer length, read buffer capacity, HPACK
    /// decoder scratch capacity)
    fn held(codec: &TestCodec) -> (usize, usize, usize, usize) {
        let (read_len, read_cap) = codec.inner.read_buffer();
        (
            codec.inner.get_ref().write_buffer_capacity(),
            read_len,
            read_cap,
            codec.inner.hpack_buffer_capacity(),
        )
    }

    async fn send(codec: &mut TestCodec, frame: Frame<Bytes>) {
        poll_fn(|cx| codec.poll_ready(cx)).await.unwrap();
        codec.buffer(frame).unwrap();
        assert!(
            codec.inner.get_ref().write_buffer_capacity() >= 16 * 1024,
            "a buffered frame has a write buffer"
        );
        poll_fn(|cx| codec.flush(cx)).await.unwrap();
    }

    async fn next(codec: &mut TestCodec) -> Frame {
        poll_fn(|cx| Pin::new(&mut *codec).poll_next(cx))
            .await
            .expect("a frame, not the end")
            .expect("a frame, not an error")
    }

    /// Polls for a frame once: whether the read would block.
    async fn would_block(codec: &mut TestCodec) -> bool {
        poll_fn(|cx| Poll::Ready(Pin::new(&mut *codec).poll_next(cx).is_pending())).await
    }

    #[tokio::test]
    async fn an_idle_connection_holds_no_buffer() {
        let (a, b) = duplex(64 * 1024);
        let mut server: TestCodec = Codec::new(a);
        let mut client: TestCodec = Codec::new(b);
        assert_eq!(held(&client).0, 0, "no write buffer before a frame is sent");

        // A request's headers (Huffman-coded literals, so the HPACK decoder needs
        // its scratch buffer) and a PING, each flushed at once.
        let uri = Uri::from_static("http://census.example:8443/census.v1.EndpointSync/Sync");
        let mut fields = HeaderMap::new();
        fields.insert("content-type", "application/grpc".parse().unwrap());
        fields.insert(
            "user-agent",
            "census-agent/0.1.0 tonic/0.14".parse().unwrap(),
        );
        let pseudo = Pseudo::request(Method::POST, uri, None);
        send(
            &mut client,
            Headers::new(StreamId::from(1), pseudo, fields).into(),
        )
        .await;
        assert_eq!(
            held(&client).0,
            0,
            "the write buffer is released once flushed"
        );
        send(&mut client, Ping::new(*b"census!!").into()).await;
        assert_eq!(
            held(&client).0,
            0,
            "the write buffer is released once flushed"
        );

        match next(&mut server).await {
            Frame::Headers(headers) => {
                assert_eq!(
                    headers.fields()["user-agent"],
                    "census-agent/0.1.0 tonic/0.14"
                );
            }
            other => panic!("expected HEADERS, got {other:?}"),
        }
        match next(&mut server).await {
            Frame::Ping(ping) => assert_eq!(ping.payload(), b"census!!"),
            other => panic!("expected PING, got {other:?}"),
        }
        assert!(would_block(&mut server).await);
        assert_eq!(
            held(&server),
            (0, 0, 0, 0),
            "idle: no write, read or HPACK buffer"
        );
    }

    #[tokio::test]
    async fn a_frame_arriving_in_pieces_is_kept_until_whole() {
        let (a, mut peer) = duplex(64 * 1024);
        let mut server: TestCodec = Codec::new(a);

        // A DATA frame of 1,000 bytes on stream 1, written in three pieces: part
        // of its head, the rest of the head and part of its payload, the rest.
        let payload: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
        let mut wire = vec![0x00, 0x03, 0xe8, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01];
        wire.extend_from_slice(&payload);
        for piece in [0..4, 4..600] {
            let end = piece.end;
            peer.write_all(&wire[piece]).await.unwrap();
            assert!(would_block(&mut server).await, "the frame is not whole yet");
            assert_eq!(
                held(&server).1,
                end,
                "every byte of the frame so far is kept"
            );
        }
        peer.write_all(&wire[600..]).await.unwrap();
        match next(&mut server).await {
            Frame::Data(data) => {
                assert_eq!(data.stream_id(), StreamId::from(1));
                assert_eq!(data.payload(), &payload[..]);
            }
            other => panic!("expected DATA, got {other:?}"),
        }
        assert!(would_block(&mut server).await);
        assert_eq!(held(&server).2, 0, "the read buffer is released once idle");
    }
}
