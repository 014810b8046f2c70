//! The admin HTTP server: `/metrics` (OpenMetrics or the Prometheus text format, as
//! the scraper's `Accept` asks), `/healthz`, `/readyz`, and
//! `/debug/pprof/heap` (a heap profile when started with `--heap-profiling`).
//! Internal only; never the gRPC port. Served by `census_daemon::http::serve`, its
//! connections capped and timed (`--admin-max-connections`, `--admin-header-timeout`,
//! `--admin-idle-timeout`).

use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

use axum::{
    Router,
    extract::State,
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::get,
};
use prometheus_client::registry::Registry;

/// Readiness, set once the store is loaded and the gRPC server is listening.
#[derive(Debug, Clone, Default)]
pub struct Readiness {
    ready: Arc<AtomicBool>,
    detail: Arc<parking_lot::Mutex<String>>,
}

impl Readiness {
    pub fn set_ready(&self, detail: impl Into<String>) {
        *self.detail.lock() = detail.into();
        self.ready.store(true, Ordering::Release);
    }

    pub fn set_not_ready(&self, detail: impl Into<String>) {
        *self.detail.lock() = detail.into();
        self.ready.store(false, Ordering::Release);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }
}

#[derive(Debug, Clone)]
struct AdminState {
    registry: Arc<Registry>,
    readiness: Readiness,
}

pub(crate) fn router(registry: Arc<Registry>, readiness: Readiness) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(AdminState {
            registry,
            readiness,
        })
        .merge(census_daemon::profiling::routes())
}

async fn metrics(State(state): State<AdminState>, headers: HeaderMap) -> Response {
    census_daemon::metrics::response(&state.registry, &headers)
}

async fn readyz(State(state): State<AdminState>) -> impl IntoResponse {
    let detail = state.readiness.detail.lock().clone();
    if state.readiness.is_ready() {
        (StatusCode::OK, format!("ready: {detail}\n"))
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {detail}\n"),
        )
    }
}
