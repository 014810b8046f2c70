//! Watch streams: newline-delimited `{"type": ..., "object": ...}` events,
//! with history replay, selector transitions, bookmarks, timeouts, the
//! in-stream 410 and abrupt drops.

use std::{
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use axum::body::Body;
use bytes::Bytes;
use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::{
    error::ApiError,
    object::{self, set_meta},
    resource::ResourceSpec,
    selector::{FieldSelector, LabelSelector},
    server::Shared,
    store::{Change, ChangeKind, WatchOpen},
};

/// What a watch request asked for.
pub(crate) struct WatchRequest {
    pub(crate) spec: ResourceSpec,
    pub(crate) namespace: Option<String>,
    pub(crate) label: LabelSelector,
    pub(crate) field: FieldSelector,
    pub(crate) send_initial: bool,
    pub(crate) bookmarks: bool,
    pub(crate) timeout: Option<Duration>,
    pub(crate) metadata_only: bool,
}

/// Ends a stream abruptly, so hyper drops the connection mid-body.
#[derive(Debug, thiserror::Error)]
#[error("watch dropped by fault injection")]
pub(crate) struct WatchDropped;

#[derive(Serialize)]
struct Event<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    object: &'a Value,
}

fn line(kind: &str, object: &Value) -> Bytes {
    let mut buf = serde_json::to_vec(&Event { kind, object }).unwrap_or_default();
    buf.push(b'\n');
    Bytes::from(buf)
}

impl WatchRequest {
    fn selects(&self, obj: &Value) -> bool {
        self.label.matches(object::labels(obj)) && self.field.matches(&self.spec, obj)
    }

    fn render(&self, kind: &str, obj: &Value) -> Bytes {
        if self.metadata_only {
            line(kind, &object::partial_metadata(obj))
        } else {
            line(kind, obj)
        }
    }

    /// The event this watcher sees for a change, if any: an object that
    /// starts matching the selectors is ADDED, one that stops is DELETED.
    fn translate(&self, change: &Change) -> Option<Bytes> {
        if self
            .namespace
            .as_ref()
            .is_some_and(|ns| *ns != change.key.namespace)
        {
            return None;
        }
        let now = self.selects(&change.object);
        match change.kind {
            ChangeKind::Added => now.then(|| self.render("ADDED", &change.object)),
            ChangeKind::Deleted => now.then(|| self.render("DELETED", &change.object)),
            ChangeKind::Modified => {
                let before = change.prev.as_deref().is_some_and(|p| self.selects(p));
                match (before, now) {
                    (true, true) => Some(self.render("MODIFIED", &change.object)),
                    (false, true) => Some(self.render("ADDED", &change.object)),
                    (true, false) => {
                        // The real watch cache sends the previous state with
                        // the new resourceVersion.
                        let mut gone = change.prev.as_deref().cloned().unwrap_or(Value::Null);
                        set_meta(
                            &mut gone,
                            "resourceVersion",
                            Value::String(change.rv.to_string()),
                        );
                        Some(self.render("DELETED", &gone))
                    }
                    (false, false) => None,
                }
            }
        }
    }

    fn bookmark(&self, rv: u64, initial_end: bool) -> Bytes {
        let (kind, api_version) = if self.metadata_only {
            (
                "PartialObjectMetadata".to_owned(),
                "meta.k8s.io/v1".to_owned(),
            )
        } else {
            (self.spec.kind.clone(), self.spec.api_version())
        };
        let mut obj = json!({
            "kind": kind,
            "apiVersion": api_version,
            "metadata": {"resourceVersion": rv.to_string(), "creationTimestamp": null},
        });
        if initial_end {
            obj["metadata"]["annotations"] = json!({"k8s.io/initial-events-end": "true"});
        }
        line("BOOKMARK", &obj)
    }
}

/// The body of a watch that cannot start because its resourceVersion was
/// compacted: HTTP 200 with one ERROR event carrying a 410 Status.
pub(crate) fn expired_body(err: &ApiError) -> Body {
    Body::from(line("ERROR", &err.to_status()))
}

type Out = mpsc::Sender<Result<Bytes, WatchDropped>>;

struct OpenWatchGuard(Arc<Shared>);

impl Drop for OpenWatchGuard {
    fn drop(&mut self) {
        self.0.open_watches.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Stream a watch that [`crate::store::Store::watch_open`] started.
pub(crate) fn stream(shared: Arc<Shared>, req: WatchRequest, open: WatchOpen) -> Body {
    let (tx, rx) = mpsc::channel::<Result<Bytes, WatchDropped>>(64);
    shared.open_watches.fetch_add(1, Ordering::SeqCst);
    let guard = OpenWatchGuard(Arc::clone(&shared));
    tokio::spawn(async move {
        let _guard = guard;
        run(&shared, &req, open, &tx).await;
    });
    let body = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    Body::from_stream(body)
}

async fn send(out: &Out, bytes: Bytes) -> bool {
    out.send(Ok(bytes)).await.is_ok()
}

async fn send_changes(
    shared: &Shared,
    req: &WatchRequest,
    out: &Out,
    changes: &[Arc<Change>],
    cursor: &mut u64,
) -> bool {
    for change in changes {
        *cursor = (*cursor).max(change.rv);
        if let Some(bytes) = req.translate(change) {
            shared.wait_serving().await;
            if !send(out, bytes).await {
                return false;
            }
        }
    }
    true
}

async fn run(shared: &Shared, req: &WatchRequest, open: WatchOpen, out: &Out) {
    let WatchOpen {
        initial,
        replay,
        mut rx,
        rv,
    } = open;
    let mut kill = shared.watch_epoch.subscribe();
    let mut shutdown = shared.shutdown.subscribe();
    let mut cursor = rv;
    for obj in &initial {
        if !send(out, req.render("ADDED", obj)).await {
            return;
        }
    }
    if req.send_initial && req.bookmarks && !send(out, req.bookmark(rv, true)).await {
        return;
    }
    let replay_rv = replay.last().map_or(0, |c| c.rv);
    if !send_changes(shared, req, out, &replay, &mut cursor).await {
        return;
    }
    cursor = cursor.max(replay_rv);

    let timeout = req.timeout.unwrap_or(Duration::from_secs(1800));
    let deadline = tokio::time::sleep(timeout);
    tokio::pin!(deadline);
    let period = shared
        .config
        .bookmark_interval
        .max(Duration::from_millis(10));
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    loop {
        tokio::select! {
            // A drop wins over pending events, so nothing slips out after it.
            biased;
            _ = kill.changed() => {
                let _ = out.send(Err(WatchDropped)).await;
                return;
            }
            _ = shutdown.changed() => return,
            () = &mut deadline => return,
            () = out.closed() => return,
            change = rx.recv() => {
                let Some(change) = change else {
                    // Closed for falling behind: end; the client resumes.
                    return;
                };
                if !send_changes(shared, req, out, &[change], &mut cursor).await {
                    return;
                }
            }
            _ = ticks.tick(), if req.bookmarks => {
                shared.wait_serving().await;
                // Everything up to `now` is already in `rx`: deliver it, then
                // the bookmark may say `now`.
                let now = shared.store.lock().rv();
                let mut pending = Vec::new();
                while let Ok(change) = rx.try_recv() {
                    pending.push(change);
                }
                if !send_changes(shared, req, out, &pending, &mut cursor).await {
                    return;
                }
                cursor = cursor.max(now);
                if !send(out, req.bookmark(cursor, false)).await {
                    return;
                }
            }
        }
    }
}
