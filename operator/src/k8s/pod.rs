//! The leader's label on its own pod, so a Service can select the leader:
//! [`LEADER_LABEL`]`=true` while leading, removed when stepping down (and at start,
//! after a crash). A task keeps the pod as desired, retrying with backoff.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::{
    Api, Client,
    api::{Patch, PatchParams},
};
use serde_json::json;
use tokio::{sync::watch, task::JoinHandle};
use tracing::{Instrument, debug, info, info_span, warn};

/// The label the leader puts on its pod.
pub const LEADER_LABEL: &str = "census.dev/leader";

const RETRY_MIN: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(10);

#[derive(Clone)]
pub struct Pods {
    api: Api<Pod>,
}

impl std::fmt::Debug for Pods {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pods").finish_non_exhaustive()
    }
}

impl Pods {
    pub fn new(client: Client, namespace: &str) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
        }
    }

    /// Sets (`true`) or removes the leader label of pod `name`.
    pub async fn set_leader_label(&self, name: &str, leader: bool) -> Result<(), kube::Error> {
        let value = if leader { json!("true") } else { json!(null) };
        let patch = json!({"metadata": {"labels": {LEADER_LABEL: value}}});
        match self
            .api
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => Ok(()),
            // A pod that is gone carries no label.
            Err(kube::Error::Api(s)) if s.code == 404 && !leader => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// Keeps this replica's pod labelled as desired.
#[derive(Debug)]
pub struct OwnLabel {
    desired: watch::Sender<bool>,
    task: JoinHandle<()>,
    pods: Pods,
    name: String,
}

impl Drop for OwnLabel {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl OwnLabel {
    /// Starts with the label removed (a replica starts as a follower).
    pub fn start(pods: Pods, name: String) -> Self {
        let (desired, rx) = watch::channel(false);
        let task = tokio::spawn(
            keep(pods.clone(), name.clone(), rx)
                .instrument(info_span!("leader_label", pod = %name)),
        );
        Self {
            desired,
            task,
            pods,
            name,
        }
    }

    pub fn set(&self, leader: bool) {
        self.desired.send_replace(leader);
    }

    /// Removes the label now (at shutdown), within `timeout`.
    pub async fn clear(self, timeout: Duration) {
        self.task.abort();
        match tokio::time::timeout(timeout, self.pods.set_leader_label(&self.name, false)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => warn!(pod = %self.name, error = %e, "could not remove the leader label"),
            Err(_) => warn!(pod = %self.name, "removing the leader label timed out"),
        }
    }
}

async fn keep(pods: Pods, name: String, mut desired: watch::Receiver<bool>) {
    'wanted: loop {
        let want = *desired.borrow_and_update();
        let mut wait = RETRY_MIN;
        loop {
            match pods.set_leader_label(&name, want).await {
                Ok(()) => {
                    if want {
                        info!("labelled this pod as the leader");
                    } else {
                        debug!("this pod carries no leader label");
                    }
                    break;
                }
                Err(e) => {
                    warn!(error = %e, leader = want, "could not update the leader label; retrying");
                    tokio::select! {
                        () = tokio::time::sleep(wait) => {}
                        changed = desired.changed() => {
                            if changed.is_err() {
                                return;
                            }
                            continue 'wanted;
                        }
                    }
                    wait = (wait * 2).min(RETRY_MAX);
                }
            }
        }
        if desired.changed().await.is_err() {
            return;
        }
    }
}
