//! What a kubelet does to the pods of its node, for tests: end a pod's run, and
//! confirm a graceful deletion (see `store/graceful.rs`).

use serde_json::{Value, json};

use crate::{error::Error, resource::Gvr, server::FakeApiServer, store::ObjKey};

/// The phase a pod's run ends in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodEnd {
    /// Every container exited 0 and will not restart.
    Succeeded,
    /// A container failed and will not restart.
    Failed,
}

impl PodEnd {
    /// The `status.phase` value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Succeeded => "Succeeded",
            Self::Failed => "Failed",
        }
    }
}

fn pods() -> Gvr {
    Gvr::new("", "v1", "pods")
}

impl FakeApiServer {
    /// End a pod's run as its kubelet reports it: `status.phase` becomes
    /// `Succeeded` or `Failed` (a MODIFIED event); its IP stays in the status, as
    /// the kubelet leaves it. Returns the stored pod.
    pub fn end_pod(&self, namespace: &str, name: &str, end: PodEnd) -> Result<Value, Error> {
        self.modify(&pods(), Some(namespace), name, |pod| {
            pod["status"]["phase"] = json!(end.as_str());
        })
    }

    /// What the kubelet does once a terminating pod's containers have stopped: a
    /// DELETE with grace period 0 and the pod's UID as precondition. The pod goes
    /// (watches see DELETED) or, with finalizers left, waits for them. Returns its
    /// last state; `None` if no such pod is terminating.
    pub fn confirm_pod_deletion(&self, namespace: &str, name: &str) -> Option<Value> {
        let mut store = self.shared.store.lock();
        let res = store.resolve(&pods())?;
        store
            .confirm_pod_deletion(res, &ObjKey::new(namespace, name), None)
            .map(|o| (*o).clone())
    }
}
