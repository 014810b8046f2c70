//! get/create/update/patch/delete against the API conventions.

use census_fake_apiserver::{Gvr, ResourceSpec};
use k8s_openapi::{
    api::{
        coordination::v1::{Lease, LeaseSpec},
        core::v1::{ConfigMap, Namespace, Node, Pod},
    },
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{
    Api, ResourceExt,
    api::{
        ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
        Preconditions,
    },
    core::Status,
};
use serde_json::json;

use crate::common::{TestResult, api_code, config_map, pod, start};

fn identity_crd() -> Result<CustomResourceDefinition, serde_json::Error> {
    serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "identities.census.dev"},
        "spec": {
            "group": "census.dev",
            "names": {"kind": "Identity", "plural": "identities", "singular": "identity", "listKind": "IdentityList"},
            "scope": "Cluster",
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}},
                "subresources": {"status": {}},
            }],
        },
    }))
}

fn identity_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("census.dev", "v1", "Identity"),
        "identities",
    )
}

fn identity(name: &str, labels: &serde_json::Value) -> Result<DynamicObject, serde_json::Error> {
    serde_json::from_value(json!({
        "apiVersion": "census.dev/v1",
        "kind": "Identity",
        "metadata": {"name": name},
        "spec": {"labels": labels},
    }))
}

#[tokio::test]
async fn typed_pod_crud_follows_conventions() -> TestResult {
    let (server, client) = start().await?;
    let pods: Api<Pod> = Api::namespaced(client, "default");

    let created = pods
        .create(
            &PostParams::default(),
            &pod("default", "a", Some("n1"), &[]),
        )
        .await?;
    let meta = &created.metadata;
    assert!(meta.uid.is_some(), "uid set");
    assert!(meta.creation_timestamp.is_some(), "creationTimestamp set");
    assert_eq!(meta.generation, Some(1));
    let rv: u64 = created.resource_version().ok_or("no rv")?.parse()?;
    assert_eq!(rv, server.resource_version());
    // The server owns the status of a new pod.
    assert_eq!(
        created.status.and_then(|s| s.phase).as_deref(),
        Some("Pending")
    );

    let again = pods
        .create(&PostParams::default(), &pod("default", "a", None, &[]))
        .await;
    assert_eq!(api_code(&again), Some((409, "AlreadyExists".into())));

    let missing = pods.get("nope").await;
    assert_eq!(api_code(&missing), Some((404, "NotFound".into())));
    assert!(pods.get_opt("nope").await?.is_none());

    // A create that carries a resourceVersion is refused, as by etcd3 storage.
    let mut stale = pods.get("a").await?;
    stale.metadata.name = Some("b".into());
    assert_eq!(
        api_code(&pods.create(&PostParams::default(), &stale).await).map(|c| c.0),
        Some(500)
    );

    // Deleting a pod answers with the pod (ReturnDeletedObject). A scheduled pod
    // is deleted gracefully: it stays until its kubelet confirms (`pods.rs`).
    let deleted = pods.delete("a", &DeleteParams::default()).await?;
    assert!(deleted.left().is_some_and(|p| p.name_any() == "a"));
    assert_eq!(server.count(&Gvr::of::<Pod>()), 1);
    server
        .confirm_pod_deletion("default", "a")
        .ok_or("a is terminating")?;
    assert_eq!(server.count(&Gvr::of::<Pod>()), 0);
    Ok(())
}

#[tokio::test]
async fn create_needs_an_existing_namespace_and_a_valid_name() -> TestResult {
    let (_server, client) = start().await?;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "ghost");
    let res = cms
        .create(&PostParams::default(), &config_map("ghost", "x", &[]))
        .await;
    assert_eq!(api_code(&res), Some((404, "NotFound".into())));

    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns = Namespace {
        metadata: ObjectMeta {
            name: Some("ghost".into()),
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    };
    namespaces.create(&PostParams::default(), &ns).await?;
    cms.create(&PostParams::default(), &config_map("ghost", "x", &[]))
        .await?;

    let bad = cms
        .create(
            &PostParams::default(),
            &config_map("ghost", "Not_Valid", &[]),
        )
        .await;
    assert_eq!(api_code(&bad), Some((422, "Invalid".into())));

    // A label value with a `/` is refused on create and on update, as a real API
    // server refuses it (census's leader EndpointSlice once carried one).
    let mut labelled = config_map("ghost", "labelled", &[]);
    labelled.metadata.labels =
        Some([("managed-by".to_owned(), "census.dev/operator".to_owned())].into());
    let bad = cms.create(&PostParams::default(), &labelled).await;
    assert_eq!(api_code(&bad), Some((422, "Invalid".into())));
    let mut fine = cms.get("x").await?;
    fine.metadata.labels = labelled.metadata.labels.clone();
    let bad = cms.replace("x", &PostParams::default(), &fine).await;
    assert_eq!(api_code(&bad), Some((422, "Invalid".into())));

    let mut generated = config_map("ghost", "", &[]);
    generated.metadata.name = None;
    generated.metadata.generate_name = Some("gen-".into());
    let made = cms.create(&PostParams::default(), &generated).await?;
    // A prefix ending in `.` is refused, as the real API server refuses it (census's
    // Events once had one).
    let mut dotted = generated.clone();
    dotted.metadata.generate_name = Some("gen.".into());
    let bad = cms.create(&PostParams::default(), &dotted).await;
    assert_eq!(api_code(&bad), Some((422, "Invalid".into())));
    assert!(
        made.name_any().starts_with("gen-") && made.name_any().len() == 9,
        "{}",
        made.name_any()
    );

    // Deleting the namespace takes its objects with it.
    namespaces.delete("ghost", &DeleteParams::default()).await?;
    assert!(cms.list(&Default::default()).await?.items.is_empty());
    Ok(())
}

#[tokio::test]
async fn stale_update_conflicts_and_noop_update_keeps_version() -> TestResult {
    let (_server, client) = start().await?;
    let leases: Api<Lease> = Api::namespaced(client, "kube-system");
    let lease = Lease {
        metadata: ObjectMeta {
            name: Some("census".into()),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some("a".into()),
            lease_duration_seconds: Some(15),
            ..LeaseSpec::default()
        }),
    };
    let v1 = leases.create(&PostParams::default(), &lease).await?;

    let mut take = v1.clone();
    take.spec
        .get_or_insert_with(LeaseSpec::default)
        .holder_identity = Some("b".into());
    let v2 = leases
        .replace("census", &PostParams::default(), &take)
        .await?;
    assert_ne!(v2.resource_version(), v1.resource_version());
    assert_eq!(
        v2.metadata.generation,
        Some(2),
        "spec change bumps generation"
    );

    // Another replica still holding v1 loses.
    let mut late = v1.clone();
    late.spec
        .get_or_insert_with(LeaseSpec::default)
        .holder_identity = Some("c".into());
    let res = leases
        .replace("census", &PostParams::default(), &late)
        .await;
    assert_eq!(api_code(&res), Some((409, "Conflict".into())));
    if let Err(kube::Error::Api(status)) = &res {
        assert!(
            status.message.contains("the object has been modified"),
            "{}",
            status.message
        );
        assert_eq!(
            status.details.as_ref().map(|d| d.kind.as_str()),
            Some("leases")
        );
    }

    // Writing what is already there does not make a new version.
    let same = leases
        .replace("census", &PostParams::default(), &v2)
        .await?;
    assert_eq!(same.resource_version(), v2.resource_version());

    // No resourceVersion: an unconditional update.
    let mut blind = v2.clone();
    blind.metadata.resource_version = None;
    blind
        .spec
        .get_or_insert_with(LeaseSpec::default)
        .holder_identity = Some("d".into());
    leases
        .replace("census", &PostParams::default(), &blind)
        .await?;

    let res = leases
        .replace("other", &PostParams::default(), &blind)
        .await;
    assert_eq!(api_code(&res).map(|c| c.0), Some(400), "name mismatch");
    Ok(())
}

#[tokio::test]
async fn delete_preconditions_conflict_when_they_do_not_match() -> TestResult {
    let (_server, client) = start().await?;
    let cms: Api<ConfigMap> = Api::namespaced(client, "default");
    let cm = cms
        .create(&PostParams::default(), &config_map("default", "x", &[]))
        .await?;

    let wrong_uid = DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some("not-the-uid".into()),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    let res = cms.delete("x", &wrong_uid).await;
    assert_eq!(api_code(&res), Some((409, "Conflict".into())));
    if let Err(kube::Error::Api(status)) = &res {
        assert!(
            status
                .message
                .contains("Precondition failed: UID in precondition"),
            "{}",
            status.message
        );
    }

    let stale_rv = DeleteParams {
        preconditions: Some(Preconditions {
            uid: cm.metadata.uid.clone(),
            resource_version: Some("1".into()),
        }),
        ..DeleteParams::default()
    };
    let res = cms.delete("x", &stale_rv).await;
    assert_eq!(api_code(&res), Some((409, "Conflict".into())));

    let exact = DeleteParams {
        preconditions: Some(Preconditions {
            uid: cm.metadata.uid.clone(),
            resource_version: cm.metadata.resource_version.clone(),
        }),
        ..DeleteParams::default()
    };
    // ConfigMaps answer a delete with a Success Status naming the object.
    let status: Status = cms
        .delete("x", &exact)
        .await?
        .right()
        .ok_or("expected a Status")?;
    assert!(status.is_success());
    assert_eq!(status.details.map(|d| d.uid), cm.metadata.uid);

    let res = cms.delete("x", &exact).await;
    assert_eq!(api_code(&res), Some((404, "NotFound".into())));
    Ok(())
}

#[tokio::test]
async fn finalizers_hold_deletion_until_removed() -> TestResult {
    let (server, client) = start().await?;
    let cms: Api<ConfigMap> = Api::namespaced(client, "default");
    let mut cm = config_map("default", "held", &[]);
    cm.metadata.finalizers = Some(vec!["census.dev/cleanup".into()]);
    cms.create(&PostParams::default(), &cm).await?;

    let pending = cms.delete("held", &DeleteParams::default()).await?;
    let pending = pending.left().ok_or("expected the object back")?;
    assert!(pending.metadata.deletion_timestamp.is_some());
    assert!(
        cms.get("held").await?.metadata.deletion_timestamp.is_some(),
        "still there"
    );

    // A second delete changes nothing.
    let again = cms.delete("held", &DeleteParams::default()).await?;
    assert_eq!(
        again.left().and_then(|c| c.metadata.resource_version),
        pending.metadata.resource_version
    );

    // No new finalizers while deleting.
    let add = json!({"metadata": {"finalizers": ["census.dev/cleanup", "other"]}});
    let res = cms
        .patch("held", &PatchParams::default(), &Patch::Merge(&add))
        .await;
    assert_eq!(api_code(&res), Some((422, "Invalid".into())));

    let clear = json!({"metadata": {"finalizers": null}});
    cms.patch("held", &PatchParams::default(), &Patch::Merge(&clear))
        .await?;
    assert!(cms.get_opt("held").await?.is_none());
    assert_eq!(server.count(&Gvr::of::<ConfigMap>()), 0);
    Ok(())
}

#[tokio::test]
async fn crd_objects_register_resources_with_status_subresource() -> TestResult {
    let (server, client) = start().await?;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    crds.create(&PostParams::default(), &identity_crd()?)
        .await?;
    let established = kube::runtime::wait::await_condition(
        crds.clone(),
        "identities.census.dev",
        kube::runtime::wait::conditions::is_crd_established(),
    );
    tokio::time::timeout(crate::common::WAIT, established).await??;

    let discovery = kube::Discovery::new(client.clone()).run().await?;
    let (ar, caps) = discovery
        .resolve_gvk(&GroupVersionKind::gvk("census.dev", "v1", "Identity"))
        .ok_or("identity not discovered")?;
    assert_eq!(ar.plural, "identities");
    assert_eq!(caps.scope, kube::discovery::Scope::Cluster);
    let aggregated = kube::Discovery::new(client.clone())
        .run_aggregated()
        .await?;
    assert!(aggregated.has_group("census.dev") && aggregated.has_group("coordination.k8s.io"));
    let (_, caps) = aggregated
        .resolve_gvk(&GroupVersionKind::gvk("", "v1", "Pod"))
        .ok_or("pods not in aggregated discovery")?;
    assert!(
        caps.subresources
            .iter()
            .any(|(ar, _)| ar.plural == "pods/status" || ar.plural == "status")
    );

    let ids: Api<DynamicObject> = Api::all_with(client.clone(), &identity_resource());
    let created = ids
        .create(
            &PostParams::default(),
            &identity("4711", &json!({"app": "web"}))?,
        )
        .await?;
    assert_eq!(created.metadata.generation, Some(1));

    // Status is ignored on the main resource...
    let mut with_status = created.clone();
    with_status.data["status"] = json!({"state": "bound"});
    let replaced = ids
        .replace("4711", &PostParams::default(), &with_status)
        .await?;
    assert!(replaced.data.get("status").is_none());
    assert_eq!(
        replaced.resource_version(),
        created.resource_version(),
        "nothing changed"
    );

    // ...and only status counts on /status.
    let patch = json!({"spec": {"labels": {"app": "db"}}, "status": {"state": "bound"}});
    let patched = ids
        .patch_status("4711", &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    assert_eq!(patched.data["status"]["state"], "bound");
    assert_eq!(patched.data["spec"]["labels"]["app"], "web");
    assert_eq!(
        patched.metadata.generation,
        Some(1),
        "status does not bump generation"
    );

    let spec_patch = json!({"spec": {"labels": {"app": "db"}}});
    let patched = ids
        .patch("4711", &PatchParams::default(), &Patch::Merge(&spec_patch))
        .await?;
    assert_eq!(patched.metadata.generation, Some(2));

    // Custom resources have no strategic merge patch.
    let res = ids
        .patch(
            "4711",
            &PatchParams::default(),
            &Patch::Strategic(&spec_patch),
        )
        .await;
    assert_eq!(api_code(&res).map(|c| c.0), Some(415));

    // Deleting a custom resource answers with a Success Status.
    assert!(
        ids.delete("4711", &DeleteParams::default())
            .await?
            .is_right()
    );

    // Deleting the CRD removes the resource.
    ids.create(&PostParams::default(), &identity("1", &json!({}))?)
        .await?;
    crds.delete("identities.census.dev", &DeleteParams::default())
        .await?;
    let gone = ids.list(&Default::default()).await;
    assert_eq!(api_code(&gone).map(|c| c.0), Some(404));
    assert_eq!(server.count(&Gvr::new("census.dev", "v1", "identities")), 0);
    Ok(())
}

#[tokio::test]
async fn registered_namespaced_resource_serves_dynamic_objects() -> TestResult {
    let (server, client) = start().await?;
    server.register_resource(ResourceSpec::namespaced(
        "census.dev",
        "v1alpha1",
        "Probe",
        "probes",
    ));
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("census.dev", "v1alpha1", "Probe"),
        "probes",
    );
    let probes: Api<DynamicObject> = Api::namespaced_with(client.clone(), "default", &ar);
    let obj: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "census.dev/v1alpha1", "kind": "Probe",
        "metadata": {"name": "p1", "labels": {"a": "1"}}, "spec": {"x": 1},
    }))?;
    probes.create(&PostParams::default(), &obj).await?;
    let got = probes.get("p1").await?;
    assert_eq!(got.metadata.namespace.as_deref(), Some("default"));
    assert_eq!(got.data["spec"]["x"], 1);
    let all: Api<DynamicObject> = Api::all_with(client, &ar);
    assert_eq!(all.list(&Default::default()).await?.items.len(), 1);
    Ok(())
}

#[tokio::test]
async fn nodes_are_cluster_scoped_and_keep_status() -> TestResult {
    let (server, client) = start().await?;
    let nodes: Api<Node> = Api::all(client);
    let node: Node = serde_json::from_value(json!({
        "metadata": {"name": "n1", "labels": {"kubernetes.io/os": "linux"}},
        "status": {"addresses": [{"type": "InternalIP", "address": "10.0.0.1"}]},
    }))?;
    let created = nodes.create(&PostParams::default(), &node).await?;
    assert!(created.metadata.namespace.is_none());
    assert!(created.status.is_some(), "node status is kept on create");
    let stored: Option<Node> = server.get_as(None, "n1")?;
    assert_eq!(stored.map(|n| n.name_any()).as_deref(), Some("n1"));
    Ok(())
}

#[tokio::test]
async fn merge_json_strategic_and_apply_patches() -> TestResult {
    let (_server, client) = start().await?;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    cms.create(
        &PostParams::default(),
        &config_map("default", "p", &[("a", "1")]),
    )
    .await?;

    let merge = json!({"metadata": {"labels": {"b": "2", "a": null}}, "data": {"k2": "v2"}});
    let merged = cms
        .patch("p", &PatchParams::default(), &Patch::Merge(&merge))
        .await?;
    assert_eq!(merged.labels().get("b").map(String::as_str), Some("2"));
    assert!(!merged.labels().contains_key("a"));
    assert_eq!(merged.data.as_ref().map(|d| d.len()), Some(2));

    // A merge patch carrying a stale resourceVersion is a precondition.
    let stale = json!({"metadata": {"resourceVersion": "1", "labels": {"c": "3"}}});
    let res = cms
        .patch("p", &PatchParams::default(), &Patch::Merge(&stale))
        .await;
    assert_eq!(api_code(&res), Some((409, "Conflict".into())));

    let strategic = json!({"metadata": {"annotations": {"x": "y"}}});
    let patched = cms
        .patch("p", &PatchParams::default(), &Patch::Strategic(&strategic))
        .await?;
    assert_eq!(
        patched.annotations().get("x").map(String::as_str),
        Some("y")
    );

    // JSON patch (kube's Patch::Json needs a feature; send it raw).
    let rv = patched.resource_version().ok_or("no rv")?;
    let ops = json!([
        {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
        {"op": "replace", "path": "/data/k", "value": "changed"},
    ]);
    let request = http::Request::patch("/api/v1/namespaces/default/configmaps/p")
        .header(http::header::CONTENT_TYPE, "application/json-patch+json")
        .body(serde_json::to_vec(&ops)?)?;
    let jp: ConfigMap = client.request(request).await?;
    assert_eq!(
        jp.data
            .as_ref()
            .and_then(|d| d.get("k"))
            .map(String::as_str),
        Some("changed")
    );
    let request = http::Request::patch("/api/v1/namespaces/default/configmaps/p")
        .header(http::header::CONTENT_TYPE, "application/json-patch+json")
        .body(serde_json::to_vec(&ops)?)?;
    let failed = client.request::<ConfigMap>(request).await;
    assert_eq!(
        api_code(&failed).map(|c| c.0),
        Some(422),
        "the test op fails now"
    );

    // Server-side apply creates when missing, then merges.
    let apply = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "applied"}, "data": {"a": "1"}});
    let pp = PatchParams::apply("census-test").force();
    let made = cms.patch("applied", &pp, &Patch::Apply(&apply)).await?;
    assert_eq!(made.metadata.namespace.as_deref(), Some("default"));
    let apply = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "applied"}, "data": {"a": "1", "b": "2"}});
    let merged = cms.patch("applied", &pp, &Patch::Apply(&apply)).await?;
    assert_eq!(merged.data.map(|d| d.len()), Some(2));

    let missing = cms
        .patch("nope", &PatchParams::default(), &Patch::Merge(&merge))
        .await;
    assert_eq!(api_code(&missing), Some((404, "NotFound".into())));
    Ok(())
}

#[tokio::test]
async fn kube_event_recorder_creates_then_patches_series() -> TestResult {
    use k8s_openapi::api::{core::v1::ObjectReference, events::v1::Event};
    use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};

    let (server, client) = start().await?;
    let recorder = Recorder::new(client, Reporter::from("census-operator"));
    let reference = ObjectReference {
        kind: Some("Node".into()),
        name: Some("n1".into()),
        api_version: Some("v1".into()),
        ..ObjectReference::default()
    };
    let event = KubeEvent {
        type_: EventType::Warning,
        reason: "Stale".into(),
        note: Some("node stopped reporting".into()),
        action: "Quarantine".into(),
        secondary: None,
    };
    recorder.publish(&event, &reference).await?;
    recorder.publish(&event, &reference).await?;
    let events = server.list(&Gvr::of::<Event>());
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["series"]["count"], 2);
    assert_eq!(events[0]["metadata"]["namespace"], "default");
    Ok(())
}
