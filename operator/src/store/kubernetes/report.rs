//! Kubernetes Events about invalid Identity objects, so `kubectl describe identity`
//! and `kubectl get events` show why census blocked an id. Only the leader reports
//! (the Events API is written through the fence like every write).
//!
//! The Identity objects are cluster-scoped, and the API server accepts an Event whose
//! `regarding` has no namespace only in `default` or `kube-system` (k8s.io/kubernetes
//! `pkg/apis/core/validation/events.go`, `legacyValidateEvent`: "does not match
//! event.namespace", 422 anywhere else). So census's Events go to [`NAMESPACE`],
//! whatever namespace the operator runs in (the RBAC Role for them lives there).

use std::collections::HashSet;

use census_proto::domain::IdentityId;
use k8s_openapi::{
    api::{core::v1::ObjectReference, events::v1::Event},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
};
use kube::{Api, Client, api::PostParams};
use parking_lot::Mutex;
use tracing::{debug, warn};

use super::{Shared, crd::GROUP};

/// `reportingController` of census's Events.
const CONTROLLER: &str = "census.dev/operator";
/// Events API limit on `note`.
const NOTE_MAX: usize = 1024;
/// Where Events about the cluster-scoped Identity objects may be created (`default`;
/// `kube-system` is the only other namespace the API server accepts for them).
const NAMESPACE: &str = "default";

pub(super) struct Reporter {
    api: Api<Event>,
    instance: String,
    /// Causes of failed publications already logged at WARN: each is logged there
    /// once, later ones at debug (one refused Event per invalid object would flood).
    warned: Mutex<HashSet<&'static str>>,
}

impl Reporter {
    pub(super) fn new(client: Client, instance: &str) -> Self {
        Self {
            api: Api::namespaced(client, NAMESPACE),
            instance: instance.to_owned(),
            warned: Mutex::new(HashSet::new()),
        }
    }

    /// Publishes one Warning about the object of `id`. A failure is logged at WARN the
    /// first time its cause is seen (a refused Event means a cluster census does not
    /// fit, e.g. RBAC), then at debug: the log line and the metric already report the
    /// object.
    pub(super) async fn invalid(&self, shared: &Shared, id: IdentityId, found: &str) {
        let uid = shared.index.read().get(id).map(|e| e.meta.uid.to_string());
        let mut note = format!("census blocks id {id} and never binds it: {found}");
        if note.len() > NOTE_MAX {
            let mut end = NOTE_MAX - 3;
            while !note.is_char_boundary(end) {
                end -= 1;
            }
            note.truncate(end);
            note.push_str("...");
        }
        let event = Event {
            metadata: ObjectMeta {
                // A name prefix: it may end in `-`, not `.` (the API server refuses it).
                generate_name: Some(format!("identity-{id}-")),
                namespace: Some(NAMESPACE.to_owned()),
                ..ObjectMeta::default()
            },
            event_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::now())),
            action: Some("Validate".into()),
            reason: Some("InvalidIdentityObject".into()),
            type_: Some("Warning".into()),
            note: Some(note),
            reporting_controller: Some(CONTROLLER.into()),
            reporting_instance: Some(self.instance.clone()),
            regarding: Some(ObjectReference {
                api_version: Some(format!("{GROUP}/v1")),
                kind: Some("Identity".into()),
                name: Some(id.to_string()),
                uid,
                ..ObjectReference::default()
            }),
            ..Event::default()
        };
        let published = shared
            .request(
                self.api.create(&PostParams::default(), &event),
                tokio::time::Instant::now() + shared.cfg.request_timeout,
            )
            .await;
        if let Err(e) = published {
            let cause = e.cause();
            if self.warned.lock().insert(cause) {
                warn!(
                    object = %id,
                    namespace = NAMESPACE,
                    cause,
                    error = %e,
                    "could not publish the Event about an invalid Identity object \
                     (further failures with this cause are logged at debug level)"
                );
            } else {
                debug!(object = %id, cause, error = %e, "could not publish the Event about an invalid Identity object");
            }
        }
    }
}

impl std::fmt::Debug for Reporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reporter")
            .field("namespace", &NAMESPACE)
            .finish_non_exhaustive()
    }
}
