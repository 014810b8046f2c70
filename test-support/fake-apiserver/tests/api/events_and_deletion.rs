//! Event validation (namespaces for Events about cluster-scoped objects) and the
//! deletion of a custom resource held by a finalizer, as the real API server does.

use census_fake_apiserver::{Gvr, ResourceSpec};
use k8s_openapi::{
    api::{core::v1::ObjectReference, events::v1::Event},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
};
use kube::{
    Api,
    api::{ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, PostParams},
};
use serde_json::json;

use crate::common::{TestResult, api_code, start};

fn event_about(namespace: &str, regarding: ObjectReference) -> Event {
    Event {
        metadata: ObjectMeta {
            generate_name: Some("identity-300-".into()),
            namespace: Some(namespace.into()),
            ..ObjectMeta::default()
        },
        event_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::now())),
        action: Some("Validate".into()),
        reason: Some("InvalidIdentityObject".into()),
        type_: Some("Warning".into()),
        reporting_controller: Some("census.dev/operator".into()),
        reporting_instance: Some("op-a".into()),
        regarding: Some(regarding),
        ..Event::default()
    }
}

#[tokio::test]
async fn events_about_cluster_scoped_objects_are_accepted_only_in_default_or_kube_system()
-> TestResult {
    let (server, client) = start().await?;
    server.insert(
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "census-system"}}),
    )?;
    let identity = ObjectReference {
        api_version: Some("census.dev/v1".into()),
        kind: Some("Identity".into()),
        name: Some("300".into()),
        ..ObjectReference::default()
    };
    let refused = Api::<Event>::namespaced(client.clone(), "census-system")
        .create(
            &PostParams::default(),
            &event_about("census-system", identity.clone()),
        )
        .await;
    assert_eq!(api_code(&refused), Some((422, "Invalid".into())));
    let Err(kube::Error::Api(status)) = refused else {
        return Err("expected a Status".into());
    };
    assert!(
        status.message.contains(
            "involvedObject.namespace: Invalid value: \"\": does not match event.namespace"
        ),
        "{}",
        status.message
    );
    for ns in ["default", "kube-system"] {
        Api::<Event>::namespaced(client.clone(), ns)
            .create(&PostParams::default(), &event_about(ns, identity.clone()))
            .await?;
    }
    // About a namespaced object, its own namespace is fine.
    let pod = ObjectReference {
        kind: Some("Pod".into()),
        name: Some("p".into()),
        namespace: Some("census-system".into()),
        ..ObjectReference::default()
    };
    Api::<Event>::namespaced(client, "census-system")
        .create(&PostParams::default(), &event_about("census-system", pod))
        .await?;
    assert_eq!(server.count(&Gvr::new("events.k8s.io", "v1", "events")), 3);
    Ok(())
}

#[tokio::test]
async fn a_custom_resource_held_by_a_finalizer_is_being_deleted_until_it_is_removed() -> TestResult
{
    let (server, client) = start().await?;
    server.register_resource(
        ResourceSpec::cluster("census.dev", "v1", "Identity", "identities").with_status(),
    );
    let resource = ApiResource {
        group: "census.dev".into(),
        version: "v1".into(),
        api_version: "census.dev/v1".into(),
        kind: "Identity".into(),
        plural: "identities".into(),
    };
    let api: Api<DynamicObject> = Api::all_with(client, &resource);
    let mut obj =
        DynamicObject::new("300", &resource).data(json!({"spec": {"labels": ["k8s:a=1"]}}));
    obj.metadata.finalizers = Some(vec!["example.com/hold".into()]);
    api.create(&PostParams::default(), &obj).await?;

    // 200 with the object, deletionTimestamp set; it stays.
    let answer = api.delete("300", &DeleteParams::default()).await?;
    let held = answer.left().ok_or("expected the object, not a Status")?;
    assert!(held.metadata.deletion_timestamp.is_some());
    assert!(api.get("300").await?.metadata.deletion_timestamp.is_some());
    // Nothing can be created under its name meanwhile.
    let again = DynamicObject::new("300", &resource).data(json!({"spec": {"labels": ["k8s:b=1"]}}));
    let created = api.create(&PostParams::default(), &again).await;
    assert_eq!(api_code(&created), Some((409, "AlreadyExists".into())));
    // Its status may still change (the subresource ignores metadata).
    api.patch_status(
        "300",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"state": "Quarantined"}})),
    )
    .await?;
    // Removing the finalizer deletes it; then the name is free.
    api.patch(
        "300",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await?;
    assert!(api.get_opt("300").await?.is_none());
    api.create(&PostParams::default(), &again).await?;
    Ok(())
}
