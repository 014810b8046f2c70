//! Graceful deletion of pods, the end of a pod's run, and the request-rate limit.

use census_fake_apiserver::{PodEnd, RateLimit, RequestFilter, Verb};
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::{
    Api, ResourceExt,
    api::{DeleteParams, Preconditions, WatchEvent, WatchParams},
};
use serde_json::json;

use crate::common::{TestResult, api_code, next, start};

fn running(name: &str, node: Option<&str>, grace: Option<i64>) -> serde_json::Value {
    let mut pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"namespace": "default", "name": name},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
        "status": {"phase": "Running", "podIP": "10.1.0.5", "podIPs": [{"ip": "10.1.0.5"}]},
    });
    if let Some(node) = node {
        pod["spec"]["nodeName"] = json!(node);
    }
    if let Some(grace) = grace {
        pod["spec"]["terminationGracePeriodSeconds"] = json!(grace);
    }
    pod
}

fn grace(pod: &Pod) -> Option<i64> {
    pod.metadata.deletion_grace_period_seconds
}

#[tokio::test]
async fn deleting_a_running_pod_is_graceful_until_its_kubelet_confirms() -> TestResult {
    let (server, client) = start().await?;
    server.insert_many([
        running("web-0", Some("n1"), None),
        running("web-1", Some("n1"), Some(120)),
        running("web-2", Some("n1"), None),
    ])?;
    let pods: Api<Pod> = Api::namespaced(client, "default");
    let mut watch = pods.watch(&WatchParams::default(), "0").await?.boxed();
    for _ in 0..3 {
        next(&mut watch).await??;
    }

    // The default: the pod's own period, else 30 s. The pod stays, with its IP.
    let generation = pods.get("web-0").await?.metadata.generation;
    let answer = pods.delete("web-0", &DeleteParams::default()).await?;
    let terminating = answer.left().ok_or("a pod delete answers with the pod")?;
    assert_eq!(grace(&terminating), Some(30));
    assert!(terminating.metadata.deletion_timestamp.is_some());
    assert_eq!(
        terminating.metadata.generation,
        generation.map(|g| g + 1),
        "BeforeDelete bumps the generation"
    );
    let WatchEvent::Modified(seen) = next(&mut watch).await?? else {
        return Err("a graceful delete is a MODIFIED event".into());
    };
    assert_eq!(seen.name_any(), "web-0");
    let kept = pods.get("web-0").await?;
    assert_eq!(
        kept.status.as_ref().and_then(|s| s.pod_ip.as_deref()),
        Some("10.1.0.5")
    );
    let own = pods.delete("web-1", &DeleteParams::default()).await?;
    assert_eq!(own.left().as_ref().and_then(grace), Some(120));
    next(&mut watch).await??;

    // A second delete may only shorten the period; a longer one changes nothing.
    let longer = pods
        .delete("web-1", &DeleteParams::default().grace_period(600))
        .await?;
    assert_eq!(longer.left().as_ref().and_then(grace), Some(120));
    let shorter = pods
        .delete("web-1", &DeleteParams::default().grace_period(45))
        .await?;
    assert_eq!(shorter.left().as_ref().and_then(grace), Some(45));
    next(&mut watch).await??;

    // A status update while terminating keeps the pod (it has no finalizers, but
    // waits for its grace period).
    server.end_pod("default", "web-1", PodEnd::Succeeded)?;
    next(&mut watch).await??;
    assert!(pods.get_opt("web-1").await?.is_some());

    // The kubelet confirms: the pod is gone, with a DELETED event.
    let last = server
        .confirm_pod_deletion("default", "web-0")
        .ok_or("web-0 is terminating")?;
    assert_eq!(last["metadata"]["name"], "web-0");
    let WatchEvent::Deleted(gone) = next(&mut watch).await?? else {
        return Err("the confirmation deletes the pod".into());
    };
    assert_eq!(gone.name_any(), "web-0");
    assert!(pods.get_opt("web-0").await?.is_none());
    assert!(
        server.confirm_pod_deletion("default", "web-2").is_none(),
        "web-2 is not terminating"
    );

    // A grace period of 0 (what `kubectl delete --grace-period=0 --force` and the
    // kubelet send) deletes at once, as does deleting a terminating pod with 0.
    pods.delete("web-2", &DeleteParams::default().grace_period(0))
        .await?;
    assert!(pods.get_opt("web-2").await?.is_none());
    pods.delete("web-1", &DeleteParams::default().grace_period(0))
        .await?;
    assert!(pods.get_opt("web-1").await?.is_none());
    Ok(())
}

#[tokio::test]
async fn unscheduled_and_finished_pods_are_deleted_at_once() -> TestResult {
    let (server, client) = start().await?;
    server.insert_many([
        running("pending", None, None),
        running("done", Some("n1"), None),
        running("failed", Some("n1"), None),
    ])?;
    let ended = server.end_pod("default", "done", PodEnd::Succeeded)?;
    assert_eq!(ended["status"]["phase"], "Succeeded");
    assert_eq!(ended["status"]["podIP"], "10.1.0.5", "the IP stays");
    server.end_pod("default", "failed", PodEnd::Failed)?;
    let pods: Api<Pod> = Api::namespaced(client, "default");
    for name in ["pending", "done", "failed"] {
        pods.delete(name, &DeleteParams::default()).await?;
        assert!(pods.get_opt(name).await?.is_none(), "{name}");
    }
    assert!(
        server.end_pod("default", "nope", PodEnd::Failed).is_err(),
        "a missing pod is an error"
    );
    Ok(())
}

#[tokio::test]
async fn a_terminating_pod_with_finalizers_waits_for_them_after_its_kubelet() -> TestResult {
    let (server, client) = start().await?;
    let mut pod = running("web-0", Some("n1"), None);
    pod["metadata"]["finalizers"] = json!(["example.com/hold"]);
    server.insert(pod)?;
    let pods: Api<Pod> = Api::namespaced(client, "default");
    let uid = pods.get("web-0").await?.metadata.uid;
    let wrong = DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some("not-its-uid".into()),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    assert_eq!(
        api_code(&pods.delete("web-0", &wrong).await).map(|c| c.0),
        Some(409),
        "preconditions come first"
    );
    let right = DeleteParams {
        preconditions: Some(Preconditions {
            uid,
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    pods.delete("web-0", &right).await?;
    server
        .confirm_pod_deletion("default", "web-0")
        .ok_or("terminating")?;
    let waiting = pods.get("web-0").await?;
    assert_eq!(grace(&waiting), Some(0));
    // Removing the last finalizer through the API now deletes it.
    let mut edited = pods.get("web-0").await?;
    edited.metadata.finalizers = None;
    edited
        .metadata
        .labels
        .get_or_insert_default()
        .insert("x".into(), "y".into());
    pods.replace("web-0", &Default::default(), &edited).await?;
    assert!(pods.get_opt("web-0").await?.is_none());
    Ok(())
}

#[tokio::test]
async fn a_rate_limit_answers_429_as_priority_and_fairness_does() -> TestResult {
    let (server, _client) = start().await?;
    server.insert(running("web-0", Some("n1"), None))?;
    let limit = server.faults().limit_rate(
        RequestFilter::resource("pods").verb(Verb::Get),
        RateLimit::after(2, 7),
    );
    // Without kube's retries, to see the answer itself.
    let mut config = server.kube_config()?;
    config.default_retry = false;
    let once: Api<Pod> = Api::namespaced(kube::Client::try_from(config)?, "default");
    once.get("web-0").await?;
    once.get("web-0").await?;
    let throttled = once.get("web-0").await;
    let Err(kube::Error::Api(status)) = &throttled else {
        return Err(format!("a third get is throttled: {throttled:?}").into());
    };
    assert_eq!(status.code, 429);
    assert_eq!(status.message, "Too many requests, please try again later.");
    // Lists are not in the filter.
    once.list(&Default::default()).await?;

    // The raw answer: Retry-After and a plain-text body, not a Status.
    let response = raw_get(&server.url(), "/api/v1/namespaces/default/pods/web-0").await?;
    assert!(response.starts_with("HTTP/1.1 429"), "{response}");
    let head = response.to_ascii_lowercase();
    assert!(head.contains("retry-after: 7"), "{response}");
    assert!(
        head.contains("content-type: text/plain; charset=utf-8"),
        "{response}"
    );
    assert!(
        response.ends_with("\r\n\r\nToo many requests, please try again later.\n"),
        "{response}"
    );
    let logged = server.requests().of(Verb::Get, "pods");
    assert_eq!(
        logged
            .iter()
            .map(|r| (r.code, r.injected))
            .collect::<Vec<_>>(),
        [(200, false), (200, false), (429, true), (429, true)]
    );
    server.faults().remove(limit);
    once.get("web-0").await?;
    Ok(())
}

/// One HTTP/1.1 GET over a plain socket, answered in full.
async fn raw_get(
    url: &str,
    path: &str,
) -> Result<String, Box<dyn std::error::Error + Send + Sync>> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let addr = url.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    Ok(response)
}
