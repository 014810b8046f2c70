//! Heap profiles in pprof format, for whoever chases a memory problem in production.
//!
//! jemalloc is built with profiling and runs with it inactive (see
//! [`crate::alloc::MALLOC_CONF`]); a daemon started with `--heap-profiling`
//! ([`ProfilingArgs`]) calls [`activate`] once, and from then on jemalloc samples
//! allocations and [`routes`] serves the live heap at `/debug/pprof/heap`, on the
//! admin port only:
//!
//! ```text
//! curl -o heap.pb.gz http://127.0.0.1:9461/debug/pprof/heap
//! go tool pprof -http :8080 /usr/bin/census-operator heap.pb.gz
//! ```

use std::sync::Arc;

use axum::{
    Router,
    http::{StatusCode, header},
    response::{IntoResponse, Response},
    routing::get,
};
use jemalloc_pprof::{JemallocProfCtl, PROF_CTL};
use tokio::sync::Mutex;

/// The heap-profiling flag every daemon flattens into its command line.
#[derive(Debug, Clone, Copy, Default, clap::Args)]
pub struct ProfilingArgs {
    /// Sample heap allocations with jemalloc and serve the live heap in pprof format at
    /// /debug/pprof/heap on the admin port. Off by default: sampling costs some CPU and
    /// memory (one sample per 512 KiB allocated, on average).
    #[arg(long, env = "CENSUS_HEAP_PROFILING")]
    pub heap_profiling: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum ProfilingError {
    #[error(
        "jemalloc heap profiling is not available: the process does not run with jemalloc built with profiling (opt.prof is false)"
    )]
    Unavailable,
    #[error("cannot activate jemalloc heap profiling: {0}")]
    Activate(#[source] tikv_jemalloc_ctl::Error),
    #[error("cannot dump the heap profile: {0}")]
    Dump(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("the heap profile task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
}

fn ctl() -> Result<Arc<Mutex<JemallocProfCtl>>, ProfilingError> {
    PROF_CTL
        .as_ref()
        .cloned()
        .ok_or(ProfilingError::Unavailable)
}

/// Turns sampling on, for the rest of the process's life.
pub async fn activate() -> Result<(), ProfilingError> {
    let ctl = ctl()?;
    let mut ctl = ctl.lock().await;
    if !ctl.activated() {
        ctl.activate().map_err(ProfilingError::Activate)?;
    }
    Ok(())
}

/// Whether sampling is on.
pub async fn is_active() -> bool {
    match PROF_CTL.as_ref() {
        Some(ctl) => ctl.lock().await.activated(),
        None => false,
    }
}

/// The live heap, sampled since activation, as a gzipped pprof protobuf.
pub async fn dump_pprof() -> Result<Vec<u8>, ProfilingError> {
    let guard = ctl()?.lock_owned().await;
    // Dumping writes and parses a file: off the async workers.
    tokio::task::spawn_blocking(move || {
        let mut guard = guard;
        guard
            .dump_pprof()
            .map_err(|e| ProfilingError::Dump(e.into()))
    })
    .await?
}

/// `/debug/pprof/heap`, to merge into a daemon's admin router (never the gRPC port).
pub fn routes() -> Router {
    Router::new().route("/debug/pprof/heap", get(heap))
}

async fn heap() -> Response {
    let text = |code: StatusCode, body: String| {
        (
            code,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            body,
        )
            .into_response()
    };
    if PROF_CTL.is_none() {
        return text(
            StatusCode::CONFLICT,
            format!("{}\n", ProfilingError::Unavailable),
        );
    }
    if !is_active().await {
        return text(
            StatusCode::NOT_FOUND,
            "heap profiling is off: start the daemon with --heap-profiling (CENSUS_HEAP_PROFILING=true)\n"
                .to_owned(),
        );
    }
    match dump_pprof().await {
        Ok(profile) => (
            StatusCode::OK,
            [
                (header::CONTENT_TYPE, "application/octet-stream"),
                (
                    header::CONTENT_DISPOSITION,
                    "attachment; filename=\"heap.pb.gz\"",
                ),
            ],
            profile,
        )
            .into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "heap profile failed");
            text(StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n"))
        }
    }
}

#[cfg(test)]
mod tests {
    use axum::{body::Body, http::Request};
    use tower::ServiceExt as _;

    use super::*;

    async fn get_heap() -> Result<(StatusCode, Vec<u8>), Box<dyn std::error::Error>> {
        let response = routes()
            .oneshot(Request::get("/debug/pprof/heap").body(Body::empty())?)
            .await?;
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), 1 << 26).await?;
        Ok((status, body.to_vec()))
    }

    // One test: activation is for the life of the process.
    #[tokio::test]
    async fn off_until_activated_then_serves_pprof() -> Result<(), Box<dyn std::error::Error>> {
        let (status, body) = get_heap().await?;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert!(String::from_utf8_lossy(&body).contains("--heap-profiling"));

        activate().await?;
        assert!(is_active().await);
        let (status, body) = get_heap().await?;
        assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
        // A gzipped protobuf.
        assert_eq!(body.get(..2), Some(&[0x1f, 0x8b][..]));
        Ok(())
    }
}
