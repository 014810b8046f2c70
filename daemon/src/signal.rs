//! Waiting for the signal that stops a daemon.

use tokio::signal::unix::{SignalKind, signal};

/// Returns on SIGTERM (Kubernetes stopping the pod) or SIGINT (Ctrl-C). Without
/// signal handlers (they cannot be installed) it never returns, and says so: the
/// daemon then stops only with SIGKILL.
pub async fn shutdown() {
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::warn!("cannot install signal handlers; stop with SIGKILL");
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => {},
        _ = int.recv() => {},
    }
}
