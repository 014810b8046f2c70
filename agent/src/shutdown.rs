//! Waiting for the agent's shutdown signal, a `watch` that turns true.

use tokio::sync::watch;

/// Resolves once `shutdown` is true (or its sender is gone).
pub(crate) async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    // The guard `wait_for` returns is dropped here, so callers' futures stay `Send`.
    let _ = shutdown.wait_for(|stop| *stop).await.map(|_| ());
}
