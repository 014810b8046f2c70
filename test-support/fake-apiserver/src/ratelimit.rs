//! A request-rate limit, as the API server's priority and fairness filter (or
//! the older max-in-flight filter) applies one: over the limit, a request is
//! answered 429 at once, before anything is read or written, with a
//! `Retry-After` header and a plain-text body — not a `Status`
//! (`k8s.io/apiserver/pkg/server/filters/priority-and-fairness.go` and
//! `maxinflight.go`, `tooManyRequests`: `w.Header().Set("Retry-After",
//! retryAfter)`, `http.Error(w, "Too many requests, please try again later.",
//! http.StatusTooManyRequests)`). Clients read such a body as an unparsed error
//! with code 429.

use std::time::Instant;

use axum::{body::Body, response::Response};
use http::{HeaderValue, StatusCode, header};

/// The body the real filter writes (`http.Error` adds the newline).
pub(crate) const BODY: &str = "Too many requests, please try again later.\n";

/// How many requests a limit lets through.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RateLimit {
    /// Requests let through at once, from a full bucket.
    pub burst: u32,
    /// Requests let through per second after that (0: none until the limit is
    /// removed, which makes a test independent of timing).
    pub per_second: f64,
    /// The `Retry-After` header, in seconds.
    pub retry_after_secs: u32,
}

impl RateLimit {
    /// `burst` requests, then none (every further one is answered 429) until the
    /// limit is removed.
    pub fn after(burst: u32, retry_after_secs: u32) -> Self {
        Self {
            burst,
            per_second: 0.0,
            retry_after_secs,
        }
    }
}

/// A token bucket.
#[derive(Debug)]
pub(crate) struct Bucket {
    limit: RateLimit,
    tokens: f64,
    at: Instant,
}

impl Bucket {
    pub(crate) fn new(limit: RateLimit) -> Self {
        Self {
            limit,
            tokens: f64::from(limit.burst),
            at: Instant::now(),
        }
    }

    /// Takes a token; `Some(retry_after)` if there was none.
    pub(crate) fn take(&mut self) -> Option<u32> {
        let now = Instant::now();
        let refill = now.duration_since(self.at).as_secs_f64() * self.limit.per_second.max(0.0);
        self.tokens = (self.tokens + refill).min(f64::from(self.limit.burst));
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            None
        } else {
            Some(self.limit.retry_after_secs)
        }
    }
}

/// The real filter's answer.
pub(crate) fn response(retry_after_secs: u32) -> Response {
    let mut response = Response::new(Body::from(BODY));
    *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(header::RETRY_AFTER, HeaderValue::from(retry_after_secs));
    response
}
