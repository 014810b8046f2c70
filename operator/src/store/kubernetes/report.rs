//! Kubernetes Events about invalid Identity objects, so `kubectl describe identity`
//! and `kubectl get events` show why census blocked an id. Only the leader reports
//! (the Events API is written through the fence like every write).

use census_proto::domain::IdentityId;
use k8s_openapi::{
    api::{core::v1::ObjectReference, events::v1::Event},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
};
use kube::{Api, Client, api::PostParams};
use tracing::debug;

use super::{Shared, crd::GROUP};

/// `reportingController` of census's Events.
const CONTROLLER: &str = "census.dev/operator";
/// Events API limit on `note`.
const NOTE_MAX: usize = 1024;

#[derive(Clone)]
pub(super) struct Reporter {
    api: Api<Event>,
    namespace: String,
    instance: String,
}

impl Reporter {
    pub(super) fn new(client: Client, namespace: &str, instance: &str) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            namespace: namespace.to_owned(),
            instance: instance.to_owned(),
        }
    }

    /// Publishes one Warning about the object of `id`. Failures are logged at debug
    /// level: the log line and the metric already report the object.
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
                generate_name: Some(format!("identity-{id}.")),
                namespace: Some(self.namespace.clone()),
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
            .request(self.api.create(&PostParams::default(), &event))
            .await;
        if let Err(e) = published {
            debug!(object = %id, error = %e, "could not publish the Event about an invalid Identity object");
        }
    }
}

impl std::fmt::Debug for Reporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reporter")
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}
