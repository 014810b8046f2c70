//! Operator replicas in this process (`daemon::start` with `--store kubernetes`)
//! against the fake: leadership, node-bound streams, GC through the CRD, invalid
//! objects, an API server that goes down or slows down, followers, and the RBAC rules
//! of deploy/ checked against every request the operator made.

use std::{
    collections::{BTreeSet, HashMap},
    net::SocketAddr,
    path::Path,
    time::{Duration, Instant},
};

use census_fake_apiserver::{DownMode, FakeApiServer, Gvr, RequestFilter, RequestRecord, Verb};
use census_operator::replica::Role;
use census_proto::{
    PROTOCOL_VERSION,
    pb::{
        self, agent_message::Body, endpoint_sync_client::EndpointSyncClient,
        identity_service_client::IdentityServiceClient, node_service_client::NodeServiceClient,
        operator_message,
    },
};
use census_testkit::Operator;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Status, Streaming, transport::Channel};

use crate::{
    common::{TestResult, WAIT, eventually, fail, fake, identities, node, yaml_docs},
    leader_slice::{slice_leader, slice_names},
};

pub(crate) const NAMESPACE: &str = "census";

/// Namespace, the replicas' pods, and Nodes: node-1 at 127.0.0.1 (where test agents
/// connect from), node-2 elsewhere.
pub(crate) fn seed_cluster(server: &FakeApiServer, pods: &[&str]) -> TestResult {
    server.insert(
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}),
    )?;
    for pod in pods {
        server.insert(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod, "namespace": NAMESPACE, "labels": {"app.kubernetes.io/name": "census-operator"}},
            "spec": {"containers": [{"name": "census-operator", "image": "census-operator"}]},
        }))?;
    }
    server.insert(node("node-1", "127.0.0.1"))?;
    server.insert(node("node-2", "10.9.9.9"))?;
    Ok(())
}

/// Flags of a test replica: short lease timings, short GC timings; `overrides`
/// replace defaults of the same flags.
pub(crate) fn replica_args(
    kubeconfig: &Path,
    pod: &str,
    overrides: &[(&str, &str)],
) -> Vec<String> {
    let defaults = [
        "--store",
        "kubernetes",
        "--namespace",
        NAMESPACE,
        "--lease-duration",
        "2s",
        "--lease-renew-deadline",
        "1500ms",
        "--lease-retry-period",
        "250ms",
        "--pod-ip",
        "127.0.0.1",
        "--grpc-listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--adoption-window",
        "0s",
        "--tick-interval",
        "50ms",
        "--snapshot-interval",
        "1s",
        "--node-ttl",
        "1s",
        "--grace-period",
        "0s",
        "--quarantine",
        "1s",
        "--store-timeout",
        "5s",
    ];
    let mut args = Vec::new();
    for pair in defaults.chunks(2) {
        let (flag, value) = (pair[0], pair.get(1).copied().unwrap_or_default());
        let value = overrides
            .iter()
            .find(|(f, _)| *f == flag)
            .map_or(value, |(_, v)| *v);
        args.extend([flag.to_owned(), value.to_owned()]);
    }
    args.extend([
        "--pod-name".to_owned(),
        pod.to_owned(),
        "--kubeconfig".to_owned(),
        kubeconfig.display().to_string(),
    ]);
    args
}

pub(crate) async fn start_replica(kubeconfig: &Path, pod: &str) -> TestResult<Operator> {
    let args = replica_args(kubeconfig, pod, &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Operator::start(&args).await
}

pub(crate) async fn until_leader(op: &Operator) -> TestResult {
    eventually("the replica leads", WAIT, || async {
        Ok(op.running().runtime.role().is_leader().then_some(()))
    })
    .await
}

pub(crate) async fn channel(addr: SocketAddr) -> TestResult<Channel> {
    Ok(Channel::from_shared(format!("http://{addr}"))?
        .connect_timeout(WAIT)
        .connect()
        .await?)
}

pub(crate) fn session(start: u64) -> pb::Session {
    pb::Session {
        start_time_ns: start,
        nonce: 1,
    }
}

pub(crate) fn wire_labels(app: &str) -> Vec<String> {
    crate::common::labels(app).to_strings()
}

pub(crate) async fn allocate(
    addr: SocketAddr,
    node: &str,
    session: pb::Session,
    app: &str,
) -> TestResult<Result<u32, Status>> {
    let mut client = IdentityServiceClient::new(channel(addr).await?);
    let answer = tokio::time::timeout(
        WAIT,
        client.allocate(pb::AllocateRequest {
            protocol_version: PROTOCOL_VERSION,
            node: node.into(),
            session: Some(session),
            labels: wire_labels(app),
            allocation: 0,
        }),
    )
    .await
    .map_err(|_| "Allocate did not answer")?;
    Ok(answer.map(|r| r.into_inner().identity.map_or(0, |i| i.id)))
}

/// An agent's EndpointSync stream.
pub(crate) struct Agent {
    tx: mpsc::Sender<pb::AgentMessage>,
    rx: Streaming<pb::OperatorMessage>,
    seq: u64,
}

impl Agent {
    pub(crate) async fn connect(
        addr: SocketAddr,
        node: &str,
        session: pb::Session,
    ) -> TestResult<Result<Self, Status>> {
        let (tx, rx) = mpsc::channel(64);
        tx.send(pb::AgentMessage {
            seq: 0,
            body: Some(Body::Hello(pb::Hello {
                protocol_version: PROTOCOL_VERSION,
                node: node.into(),
                session: Some(session),
                agent_version: "test".into(),
                addresses: Vec::new(),
            })),
        })
        .await?;
        let mut client = EndpointSyncClient::new(channel(addr).await?);
        let answer = tokio::time::timeout(WAIT, client.sync(ReceiverStream::new(rx)))
            .await
            .map_err(|_| "Sync did not answer")?;
        let mut rx = match answer {
            Ok(r) => r.into_inner(),
            Err(status) => return Ok(Err(status)),
        };
        match tokio::time::timeout(WAIT, rx.message()).await? {
            Ok(Some(pb::OperatorMessage {
                body: Some(operator_message::Body::HelloReply(_)),
            })) => Ok(Ok(Self { tx, rx, seq: 0 })),
            Ok(other) => fail(format!("expected HelloReply, got {other:?}")),
            Err(status) => Ok(Err(status)),
        }
    }

    /// Sends a snapshot of `(pod, id, app)` endpoints and waits for its Ack; returns the
    /// Rebinds that came before it.
    pub(crate) async fn snapshot(
        &mut self,
        endpoints: &[(&str, u32, &str)],
    ) -> TestResult<Result<Vec<pb::Rebind>, Status>> {
        self.seq += 1;
        let seq = self.seq;
        let endpoints = endpoints
            .iter()
            .enumerate()
            .map(|(k, (pod, id, app))| pb::Endpoint {
                namespace: "default".into(),
                name: (*pod).into(),
                ips: vec![format!("198.18.0.{}", k + 1)],
                identity: *id,
                labels: wire_labels(app),
            })
            .collect();
        self.tx
            .send(pb::AgentMessage {
                seq,
                body: Some(Body::Snapshot(pb::Snapshot {
                    endpoints,
                    allocations_settled: 0,
                })),
            })
            .await
            .map_err(|_| "the stream is closed")?;
        let mut rebinds = Vec::new();
        loop {
            match self.next().await? {
                Ok(operator_message::Body::Ack(ack)) if ack.seq == seq => return Ok(Ok(rebinds)),
                Ok(operator_message::Body::Rebind(r)) => rebinds.push(r),
                Ok(_) => {}
                Err(status) => return Ok(Err(status)),
            }
        }
    }

    /// The next message, or how the stream ended.
    pub(crate) async fn next(&mut self) -> TestResult<Result<operator_message::Body, Status>> {
        match tokio::time::timeout(WAIT, self.rx.message()).await? {
            Ok(Some(pb::OperatorMessage { body: Some(body) })) => Ok(Ok(body)),
            Ok(_) => Ok(Err(Status::cancelled("the stream ended"))),
            Err(status) => Ok(Err(status)),
        }
    }
}

fn expect_code<T: std::fmt::Debug>(
    answer: Result<T, Status>,
    code: Code,
    needle: &str,
) -> TestResult<Status> {
    match answer {
        Err(status) if status.code() == code && status.message().contains(needle) => Ok(status),
        other => fail(format!(
            "expected {code:?} naming {needle:?}, got {other:?}"
        )),
    }
}

fn lease(server: &FakeApiServer) -> Option<Value> {
    server.get(
        &Gvr::new("coordination.k8s.io", "v1", "leases"),
        Some(NAMESPACE),
        "census-operator",
    )
}

/// A fake API server seeded with the cluster and `pod`, and a directory whose
/// `kubeconfig` speaks to it as the operator's ServiceAccount (the fake authorizes
/// its TokenReviews by deploy/'s ClusterRole).
async fn cluster_for(pod: &str) -> TestResult<(FakeApiServer, tempfile::TempDir)> {
    let server = fake().await?;
    seed_cluster(&server, &[pod])?;
    crate::tokenreview::seed_operator_identity(&server)?;
    let dir = tempfile::tempdir()?;
    server.write_kubeconfig_with_token(
        dir.path().join("kubeconfig"),
        crate::tokenreview::OPERATOR_TOKEN,
    )?;
    Ok((server, dir))
}

/// By default the source address binds nothing (credentials do): a Node's agent
/// gets in through a masquerading path, here from 127.0.0.1 for a Node at 10.9.9.9;
/// a Hello for a name that is no Node is still refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nodes_agent_is_admitted_from_any_address_unless_the_check_is_asked_for() -> TestResult {
    let (_server, dir) = cluster_for("op-a").await?;
    let kubeconfig = dir.path().join("kubeconfig");
    let op = start_replica(&kubeconfig, "op-a").await?;
    until_leader(&op).await?;
    let _agent = eventually("node-2's agent gets in", WAIT, || async {
        Ok(Agent::connect(op.grpc_addr, "node-2", session(1))
            .await?
            .ok())
    })
    .await?;
    let refused = Agent::connect(op.grpc_addr, "node-9", session(1)).await?;
    expect_code(
        refused.map(|_| ()),
        Code::FailedPrecondition,
        "not a Node of this cluster",
    )?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_leads_admits_its_nodes_collects_garbage_and_survives_the_api_server()
-> TestResult {
    let (server, dir) = cluster_for("op-a").await?;
    let kubeconfig = dir.path().join("kubeconfig");
    // With the opt-in source-address check: a Hello also comes from its Node's address.
    let mut args = replica_args(&kubeconfig, "op-a", &[]);
    args.push("--require-node-address".to_owned());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let op = Operator::start(&args).await?;
    until_leader(&op).await?;
    let addr = op.grpc_addr;
    let lease_obj = lease(&server).ok_or("no Lease")?;
    assert_eq!(lease_obj["spec"]["holderIdentity"], "op-a");
    assert_eq!(
        lease_obj["metadata"]["annotations"]["census.dev/leader-address"],
        addr.to_string()
    );
    eventually("the leader publishes itself", WAIT, || async {
        Ok(slice_names(&server, "op-a").then_some(()))
    })
    .await?;

    // Node-bound streams.
    let refused = Agent::connect(addr, "node-9", session(1)).await?;
    expect_code(
        refused.map(|_| ()),
        Code::FailedPrecondition,
        "not a Node of this cluster",
    )?;
    let refused = Agent::connect(addr, "node-2", session(1)).await?;
    expect_code(refused.map(|_| ()), Code::PermissionDenied, "10.9.9.9")?;
    let mut agent = Agent::connect(addr, "node-1", session(1)).await??;

    // Allocation writes a binding; an identity nobody uses is garbage collected
    // through a tombstone, across a conflict (an annotation added before the write).
    let web = allocate(addr, "node-1", session(1), "web").await??;
    let gvr = identities();
    let obj = server
        .get(&gvr, None, &web.to_string())
        .ok_or("no object for web")?;
    assert_eq!(obj["spec"]["labels"], json!(wire_labels("web")));
    assert!(agent.snapshot(&[("web-1", web, "web")]).await??.is_empty());
    let temp = allocate(addr, "node-1", session(1), "temp").await??;
    server.faults().touch_before_write(
        RequestFilter::object(&gvr, None, &temp.to_string()).verb(Verb::Patch),
        1,
    );
    eventually("the unused identity is deleted", WAIT, || async {
        Ok(server
            .get(&gvr, None, &temp.to_string())
            .is_none()
            .then_some(()))
    })
    .await?;
    let log = server.requests();
    let temp_name = temp.to_string();
    let writes: Vec<(Verb, u16)> = log
        .iter()
        .filter(|r| {
            r.resource == "identities"
                && r.name.as_deref() == Some(&temp_name)
                && r.verb != Verb::Get
        })
        .map(|r| (r.verb, r.code))
        .collect();
    assert_eq!(
        writes,
        [(Verb::Patch, 409), (Verb::Patch, 200), (Verb::Delete, 200)],
        "tombstone (after a conflict and a re-read), delete after quarantine"
    );

    // An edited object blocks its id: the agent is told to rebind, an Event says why.
    server.modify(&gvr, None, &web.to_string(), |o| {
        o["spec"]["labels"] = json!(wire_labels("edited"));
    })?;
    let rebind = loop {
        match agent.next().await? {
            Ok(operator_message::Body::Rebind(r)) => break r,
            Ok(_) => {}
            Err(status) => return fail(format!("stream ended: {status:?}")),
        }
    };
    assert_eq!(rebind.name, "web-1");
    assert_ne!(rebind.identity, web);
    let web2 = rebind.identity;
    eventually("an Event about the edited object", WAIT, || async {
        Ok(server
            .list(&Gvr::new("events.k8s.io", "v1", "events"))
            .into_iter()
            .find(|e| {
                // Not the operator's namespace: Events about cluster-scoped objects
                // are accepted only in `default` (or `kube-system`).
                e["regarding"]["name"].as_str() == Some(web.to_string().as_str())
                    && e["metadata"]["namespace"] == "default"
            }))
    })
    .await?;
    let mut ids = IdentityServiceClient::new(channel(addr).await?);
    let blocked = ids
        .get(pb::GetRequest {
            protocol_version: PROTOCOL_VERSION,
            id: web,
        })
        .await?
        .into_inner();
    assert_eq!(blocked.state, i32::from(pb::IdentityState::Blocked));

    // A deleted Node ends its agent's stream and drops its view.
    server.delete(&Gvr::new("", "v1", "nodes"), None, "node-1");
    let ended = loop {
        match agent.next().await? {
            Ok(_) => {}
            Err(status) => break status,
        }
    };
    assert_eq!(ended.code(), Code::FailedPrecondition, "{ended:?}");
    assert!(ended.message().contains("gone"), "{ended:?}");
    server.insert(node("node-1", "127.0.0.1"))?;
    let mut agent = eventually("the agent says Hello again", WAIT, || async {
        Ok(Agent::connect(addr, "node-1", session(2)).await?.ok())
    })
    .await?;
    // Its snapshot re-adopts the identity it holds (deleted with the node's view, or
    // about to be).
    assert!(agent.snapshot(&[("web-1", web2, "web")]).await??.is_empty());
    eventually(
        "the re-adopted identity is a binding again",
        WAIT,
        || async {
            Ok(server
                .get(&gvr, None, &web2.to_string())
                .filter(|o| o["status"].is_null())
                .map(|_| ()))
        },
    )
    .await?;

    // A slow API server: Allocate waits for the write, then answers.
    let slow = server.faults().delay(
        RequestFilter::resource("identities").verb(Verb::Create),
        Duration::from_millis(700),
    );
    let started = Instant::now();
    allocate(addr, "node-1", session(2), "slow").await??;
    assert!(started.elapsed() >= Duration::from_millis(700));
    server.faults().remove(slow);

    // The API server goes down: a new identity cannot be persisted (UNAVAILABLE, the
    // core retries), reads are still served, and past the renew deadline the leader
    // steps down. When it comes back, the replica leads again.
    server.faults().go_down(DownMode::Refuse);
    let down = allocate(addr, "node-1", session(2), "while-down").await?;
    expect_code(down, Code::Unavailable, "")?;
    eventually(
        "the leader steps down without its API server",
        WAIT,
        || async { Ok((!op.running().runtime.role().is_leader()).then_some(())) },
    )
    .await?;
    let read = ids
        .get(pb::GetRequest {
            protocol_version: PROTOCOL_VERSION,
            id: web2,
        })
        .await?
        .into_inner();
    assert_eq!(
        read.labels,
        wire_labels("web"),
        "reads are served by a follower: {read:?}"
    );
    let refused = allocate(addr, "node-1", session(2), "while-down").await?;
    expect_code(refused, Code::Unavailable, "follower")?;
    server.faults().come_up();
    until_leader(&op).await?;
    let _agent = eventually("the agent says Hello to the new term", WAIT, || async {
        Ok(Agent::connect(addr, "node-1", session(3)).await?.ok())
    })
    .await?;
    let again = eventually("Allocate works again", WAIT, || async {
        Ok(allocate(addr, "node-1", session(3), "after").await?.ok())
    })
    .await?;
    assert!(server.get(&gvr, None, &again.to_string()).is_some());

    // Agents' tokens, reviewed by the operator's own TokenReviewer (its client, its
    // flags): the node claim of a v1.30 token, the bound pod of a v1.29 one.
    crate::tokenreview::seed_agents(&server)?;
    crate::tokenreview::agent_pod(&server, "agent-1", crate::tokenreview::SA, "node-1")?;
    let tokens = &op.running().cluster.as_ref().ok_or("no cluster")?.tokens;
    for request in [
        crate::tokenreview::census_token("agent-1"),
        crate::tokenreview::census_token("agent-1").as_v1_29(),
    ] {
        let bound = tokens.review(&server.issue_token(&request)?).await?;
        assert_eq!(bound.node.to_string(), "node-1");
    }

    // Shutdown hands the Lease over and empties the leader slice.
    op.shut_down().await?;
    let lease_obj = lease(&server).ok_or("no Lease")?;
    assert!(lease_obj["spec"]["holderIdentity"].is_null(), "{lease_obj}");
    assert_eq!(slice_leader(&server)?, None);

    let log = server.requests();
    check_rbac(log.all())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_serves_reads_and_points_writes_at_the_leader() -> TestResult {
    let server = fake().await?;
    seed_cluster(&server, &["op-a", "op-b"])?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    server.write_kubeconfig(&kubeconfig)?;
    let a = start_replica(&kubeconfig, "op-a").await?;
    let b = start_replica(&kubeconfig, "op-b").await?;
    let a_leads = eventually("one replica leads", WAIT, || async {
        Ok(
            match (a.running().runtime.role(), b.running().runtime.role()) {
                (Role::Leader, Role::Follower { leader: Some(_) }) => Some(true),
                (Role::Follower { leader: Some(_) }, Role::Leader) => Some(false),
                _ => None,
            },
        )
    })
    .await?;
    let (leader, follower, leader_pod, follower_pod) = if a_leads {
        (a, b, "op-a", "op-b")
    } else {
        (b, a, "op-b", "op-a")
    };
    let _agent = Agent::connect(leader.grpc_addr, "node-1", session(1)).await??;
    let web = allocate(leader.grpc_addr, "node-1", session(1), "web").await??;

    // Writes and streams on the follower: UNAVAILABLE naming the leader.
    let refused = allocate(follower.grpc_addr, "node-1", session(1), "db").await?;
    let status = expect_code(refused, Code::Unavailable, &leader.grpc_addr.to_string())?;
    assert_eq!(
        status
            .metadata()
            .get("census-leader")
            .and_then(|v| v.to_str().ok()),
        Some(leader.grpc_addr.to_string().as_str())
    );
    let refused = Agent::connect(follower.grpc_addr, "node-1", session(1)).await?;
    expect_code(refused.map(|_| ()), Code::Unavailable, "follower")?;
    // So is a watch of the endpoint map (the views are the leader's), and a look-up.
    let mut map =
        pb::endpoint_map_client::EndpointMapClient::new(channel(follower.grpc_addr).await?);
    let refused = map
        .watch(pb::EndpointMapWatchRequest {
            protocol_version: PROTOCOL_VERSION,
            node: "node-1".into(),
            session: Some(session(1)),
        })
        .await
        .map(|_| ());
    let status = expect_code(refused, Code::Unavailable, &leader.grpc_addr.to_string())?;
    assert!(
        status.metadata().get("census-leader").is_some(),
        "{status:?}"
    );
    let refused = map
        .lookup(pb::EndpointMapLookupRequest {
            protocol_version: PROTOCOL_VERSION,
            ip: "127.0.0.1".into(),
        })
        .await
        .map(|_| ());
    expect_code(refused, Code::Unavailable, "follower")?;
    let mut map = pb::endpoint_map_client::EndpointMapClient::new(channel(leader.grpc_addr).await?);
    let watching = map
        .watch(pb::EndpointMapWatchRequest {
            protocol_version: PROTOCOL_VERSION,
            node: "node-1".into(),
            session: Some(session(1)),
        })
        .await;
    assert!(watching.is_ok(), "the leader serves the map: {watching:?}");

    // Reads on the follower come from its watch of the Identity objects.
    let mut ids = IdentityServiceClient::new(channel(follower.grpc_addr).await?);
    let found = eventually("the follower sees the new identity", WAIT, || {
        let mut ids = ids.clone();
        async move {
            Ok(ids
                .lookup(pb::LookupRequest {
                    protocol_version: PROTOCOL_VERSION,
                    labels: wire_labels("web"),
                })
                .await
                .ok()
                .map(|r| r.into_inner().id))
        }
    })
    .await?;
    assert_eq!(found, web);
    let mut watch = ids
        .watch(pb::WatchRequest {
            protocol_version: PROTOCOL_VERSION,
        })
        .await?
        .into_inner();
    let mut seen = BTreeSet::new();
    loop {
        let event = tokio::time::timeout(WAIT, watch.message())
            .await??
            .ok_or("watch ended")?;
        if event.kind == i32::from(pb::watch_event::Kind::ResyncEnd) {
            break;
        }
        if let Some(identity) = event.identity {
            seen.insert(identity.id);
        }
    }
    assert!(seen.contains(&web));
    let db = allocate(leader.grpc_addr, "node-1", session(1), "db").await??;
    let event = tokio::time::timeout(WAIT, watch.message())
        .await??
        .ok_or("watch ended")?;
    assert_eq!(event.kind, i32::from(pb::watch_event::Kind::Upsert));
    assert_eq!(event.identity.map(|i| i.id), Some(db));

    // NodeService on the follower is forwarded to the leader.
    let mut nodes = NodeServiceClient::new(channel(follower.grpc_addr).await?);
    let listed = nodes
        .list_nodes(pb::ListNodesRequest {
            protocol_version: PROTOCOL_VERSION,
        })
        .await?
        .into_inner();
    assert_eq!(
        listed
            .nodes
            .iter()
            .map(|n| n.name.as_str())
            .collect::<Vec<_>>(),
        ["node-1"]
    );

    // The leader stops: the follower takes over at its next try, and its Watch
    // subscribers get the full list again from its new core.
    let stopped = Instant::now();
    leader.shut_down().await?;
    let new = follower;
    until_leader(&new).await?;
    assert!(
        stopped.elapsed() < Duration::from_secs(2),
        "a released Lease is taken at once"
    );
    let event = tokio::time::timeout(WAIT, watch.message())
        .await??
        .ok_or("watch ended")?;
    assert_eq!(event.kind, i32::from(pb::watch_event::Kind::ResyncStart));
    eventually("the new leader publishes itself", WAIT, || async {
        Ok((slice_names(&server, follower_pod) && !slice_names(&server, leader_pod)).then_some(()))
    })
    .await?;
    let again = allocate(new.grpc_addr, "node-1", session(1), "web").await?;
    expect_code(again, Code::FailedPrecondition, "Hello")?;
    let _agent = Agent::connect(new.grpc_addr, "node-1", session(1)).await??;
    assert_eq!(
        allocate(new.grpc_addr, "node-1", session(1), "web").await??,
        web
    );
    new.shut_down().await?;
    Ok(())
}

/// One RBAC rule of deploy/operator/rbac.yaml.
#[derive(Debug)]
struct Rule {
    groups: Vec<String>,
    resources: Vec<String>,
    verbs: Vec<String>,
    names: Option<Vec<String>>,
    /// From a Role: only in its namespace (the operator's, `census-system` in deploy/
    /// and [`NAMESPACE`] here, or another one it names, such as `default`).
    namespace: Option<String>,
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str().map(str::to_owned))
        .collect()
}

fn operator_rules() -> TestResult<Vec<Rule>> {
    let mut rules = Vec::new();
    for doc in yaml_docs("deploy/operator/rbac.yaml")? {
        let namespace = match doc["kind"].as_str() {
            Some("ClusterRole") => None,
            Some("Role") => Some(match doc["metadata"]["namespace"].as_str() {
                Some("census-system") | None => NAMESPACE.to_owned(),
                Some(other) => other.to_owned(),
            }),
            _ => continue,
        };
        for rule in doc["rules"].as_array().into_iter().flatten() {
            rules.push(Rule {
                groups: strings(&rule["apiGroups"]),
                resources: strings(&rule["resources"]),
                verbs: strings(&rule["verbs"]),
                names: rule.get("resourceNames").map(strings),
                namespace: namespace.clone(),
            });
        }
    }
    Ok(rules)
}

impl Rule {
    fn allows(&self, r: &RequestRecord, resource: &str) -> bool {
        self.groups.contains(&r.group)
            && self.resources.iter().any(|x| x == resource)
            && self.verbs.iter().any(|v| v == r.verb.as_str())
            && self
                .names
                .as_ref()
                .is_none_or(|names| r.name.as_ref().is_some_and(|n| names.contains(n)))
            && self
                .namespace
                .as_ref()
                .is_none_or(|ns| r.namespace.as_ref() == Some(ns))
    }
}

/// Every request the operator made is allowed by deploy/'s rules, and every verb of
/// every rule was used: the rules are exactly what the code needs.
fn check_rbac(log: &[RequestRecord]) -> TestResult {
    let rules = operator_rules()?;
    let mut used: HashMap<(usize, String), usize> = HashMap::new();
    let mut denied = BTreeSet::new();
    for r in log {
        if matches!(r.verb, Verb::Discovery | Verb::Other) || r.resource.is_empty() {
            continue;
        }
        let resource = match &r.subresource {
            Some(sub) => format!("{}/{sub}", r.resource),
            None => r.resource.clone(),
        };
        let allowing: Vec<usize> = rules
            .iter()
            .enumerate()
            .filter(|(_, rule)| rule.allows(r, &resource))
            .map(|(i, _)| i)
            .collect();
        if allowing.is_empty() {
            denied.insert(format!(
                "{} {}/{resource} {:?}",
                r.verb.as_str(),
                r.group,
                r.namespace
            ));
        }
        for i in allowing {
            *used.entry((i, r.verb.as_str().to_owned())).or_default() += 1;
        }
    }
    assert!(
        denied.is_empty(),
        "requests deploy/operator/rbac.yaml does not allow: {denied:?}"
    );
    let mut unused = Vec::new();
    for (i, rule) in rules.iter().enumerate() {
        for verb in &rule.verbs {
            if !used.contains_key(&(i, verb.clone())) {
                unused.push(format!("{verb} {:?} {:?}", rule.groups, rule.resources));
            }
        }
    }
    assert!(
        unused.is_empty(),
        "RBAC grants verbs the operator never used: {unused:?}"
    );
    Ok(())
}
