//! The kubelet's part in a pod's graceful deletion, which no API server does by
//! itself: once the grace period of a terminating pod has passed (its
//! containers were sent SIGTERM, then SIGKILL), the kubelet confirms with a
//! DELETE of grace period 0 and the pod's UID as precondition
//! (`pkg/kubelet/status/status_manager.go`), and only then is the pod gone.
//! Tests that need the pod gone sooner call
//! [`FakeApiServer::confirm_pod_deletion`](crate::FakeApiServer::confirm_pod_deletion),
//! a kubelet whose containers stopped at once.

use std::{sync::Arc, time::Duration};

use crate::{
    object,
    server::Shared,
    store::{Obj, ObjKey},
};

/// If `obj` is a pod waiting for its grace period, confirm its deletion when the
/// period ends (a later, shorter period gets its own timer; a confirmation that
/// finds the pod gone, re-created or no longer terminating does nothing).
pub(crate) fn finish_at_grace_end(shared: &Arc<Shared>, res: usize, key: &ObjKey, obj: &Obj) {
    let grace = object::meta(obj)
        .and_then(|m| m.get("deletionGracePeriodSeconds"))
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(0);
    if grace == 0 || !shared.store.lock().is_pods(res) {
        return;
    }
    let uid = object::meta_str(obj, "uid").map(str::to_owned);
    let shared = Arc::clone(shared);
    let key = key.clone();
    let mut shutdown = shared.shutdown.subscribe();
    tokio::spawn(async move {
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(grace)) => {
                shared.store.lock().confirm_pod_deletion(res, &key, uid.as_deref());
            }
            _ = shutdown.changed() => {}
        }
    });
}
