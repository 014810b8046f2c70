//! How census's servers take connections and bytes, apart from what they serve:
//!
//! - [`accept`]: an accept loop with a connection cap (one over it is closed before
//!   anything reads it, counted and logged at most once per period), shared by the
//!   gRPC server and both daemons' admin HTTP servers;
//! - [`conn`]: the gRPC server's connections (handshake and idle timeouts) and the
//!   request layer that marks a connection busy and holds each request body to its
//!   method's limits;
//! - [`codec`]: per-method message limits judged on each message's length prefix,
//!   and the message timeout;
//! - [`budget`]: the bytes of large messages in flight, shared by every stream;
//! - [`wire`]: gRPC framing by hand for the two streams an agent holds for its life;
//! - [`methods`]: the bounded names of census's gRPC methods, for metrics and
//!   refusals.
//!
//! The operator's `grpc` module keeps the services, their conversions and the
//! per-caller quotas (which need the authenticated principal). h2, patched so that
//! an idle HTTP/2 connection holds no frame buffers, is vendored beside this crate
//! (`vendor/h2`, its `CENSUS.md` says what and why).

pub mod accept;
pub mod budget;
pub mod codec;
pub mod conn;
pub mod methods;
pub mod wire;

use prometheus_client::encoding::EncodeLabelSet;

/// A metric label naming why something happened (a refusal, a close), from a
/// bounded set of values.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}
