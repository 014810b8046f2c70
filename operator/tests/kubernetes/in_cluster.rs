//! census deployed on the real control plane as in a cluster: `deploy/` applied with
//! server-side apply (namespaces with their Pod Security labels, the CRD with its CEL
//! rules, RBAC, the ValidatingAdmissionPolicy, Services, the PDB, the Deployment and
//! the DaemonSet), kwok running the Deployment's and the DaemonSet's pods on its
//! nodes, and census's real processes on this machine with those pods' identities:
//! each operator replica with a token of the operator's ServiceAccount bound to its
//! Deployment pod, each agent with a token of the agents' ServiceAccount bound to its
//! node's DaemonSet pod (TokenRequest). The real RBAC authorizer and the real
//! TokenReview judge them as a cluster would.
//!
//! The PrometheusRule (deploy/monitoring/) is not applied: its CRD comes with the
//! Prometheus operator, which this control plane does not run; `deploy::*` checks it.

use std::{
    collections::BTreeSet,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use census_proto::{
    PROTOCOL_VERSION,
    pb::{self, identity_service_client::IdentityServiceClient},
};
use census_testkit::cluster::ControlPlane;
use serde_json::Value;
use tonic::Code;

use crate::common::{TestResult, WAIT, eventually, fail};

const OPERATOR_NS: &str = "census-system";
const AGENT_NS: &str = "census-agent";

/// deploy/ applied (what it holds is cluster-wide, the ValidatingAdmissionPolicy
/// included, so every test of the real control plane in this binary runs with it).
pub(crate) async fn applied() -> TestResult<&'static ControlPlane> {
    let plane = census_testkit::cluster::plane()?;
    census_testkit::cluster::apply_deploy(plane)?;
    Ok(plane)
}

/// [`applied`], and kwok runs census's pods: two operator pods and one agent pod
/// per node.
async fn deployed() -> TestResult<&'static ControlPlane> {
    let plane = applied().await?;
    let nodes = plane.nodes().len();
    eventually(
        "kwok runs census's pods",
        Duration::from_secs(90),
        || async {
            let operators = running_pods(plane, OPERATOR_NS)?;
            let agents = running_pods(plane, AGENT_NS)?;
            Ok((operators.len() == 2 && agents.len() == nodes).then_some(()))
        },
    )
    .await?;
    Ok(plane)
}

/// Running pods of a namespace: (name, node, pod IP).
fn running_pods(
    plane: &ControlPlane,
    namespace: &str,
) -> TestResult<Vec<(String, String, String)>> {
    Ok(plane
        .running_pods(namespace)?
        .into_iter()
        .map(|p| (p.name, p.node, p.ip.to_string()))
        .collect())
}

/// A `census-operator` replica as the Deployment's pod `pod`: a token of the
/// operator's ServiceAccount bound to that pod, TLS for its agents; killed on drop.
struct Replica {
    child: Child,
    pod: String,
    grpc: std::net::SocketAddr,
}

impl Replica {
    fn start(
        plane: &ControlPlane,
        pod: &str,
        pod_ip: &str,
        certs: &census_testkit::tls::Certs,
    ) -> TestResult<Self> {
        let token = plane.token(OPERATOR_NS, "census-operator", None, Some(pod), 3600)?;
        let kubeconfig = plane.write_token_kubeconfig(&format!("operator-{pod}"), &token)?;
        let mut args = crate::operator::replica_args(
            &kubeconfig,
            pod,
            &[
                ("--namespace", OPERATOR_NS),
                // The address kwok gave its pod, as the downward API would: the
                // leader publishes it in its EndpointSlice (a real API server
                // refuses a loopback address there).
                ("--pod-ip", pod_ip),
                ("--grace-period", "60s"),
                ("--quarantine", "60s"),
                // The API server is shared with the other tests, and slow while they
                // start private control planes: a create may take seconds.
                ("--store-timeout", "20s"),
            ],
        );
        // Serving TLS with no client CA: agents authenticate with their tokens.
        args.extend(certs.operator_flags()?.into_iter().take(4));
        args.extend([
            "--log-format".into(),
            "json".into(),
            "--log".into(),
            "info".into(),
        ]);
        let log = plane
            .dir()
            .join("logs")
            .join(format!("census-operator-{pod}.log"));
        let mut child = Command::new(env!("CARGO_BIN_EXE_census-operator"))
            .args(&args)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()?;
        let deadline = Instant::now() + WAIT;
        while Instant::now() < deadline {
            let text = std::fs::read_to_string(&log)?;
            if let Some(addr) = text
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .find_map(|j| {
                    j.pointer("/fields/grpc_addr")
                        .and_then(|v| v.as_str())
                        .map(str::to_owned)
                })
            {
                return Ok(Self {
                    child,
                    pod: pod.to_owned(),
                    grpc: addr.parse()?,
                });
            }
            if let Some(status) = child.try_wait()? {
                return fail(format!("operator {pod} exited ({status}):\n{text}"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        fail(format!(
            "operator {pod} did not report its address; see {}",
            log.display()
        ))
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn lease_holder(plane: &ControlPlane) -> Option<String> {
    plane
        .kubectl_json(&["-n", OPERATOR_NS, "get", "lease", "census-operator"])
        .ok()
        .and_then(|l| l["spec"]["holderIdentity"].as_str().map(str::to_owned))
}

/// An agent's EndpointSync stream opened with `token`, after its HelloReply: the
/// session Allocate needs. Kept open while the returned sender lives.
async fn hello_as(
    channel: &tonic::transport::Channel,
    node: &str,
    token: &str,
) -> TestResult<(
    tokio::sync::mpsc::Sender<pb::AgentMessage>,
    tonic::Streaming<pb::OperatorMessage>,
)> {
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    tx.send(pb::AgentMessage {
        seq: 0,
        body: Some(pb::agent_message::Body::Hello(pb::Hello {
            protocol_version: PROTOCOL_VERSION,
            node: node.into(),
            session: Some(crate::operator::session(1)),
            agent_version: "test".into(),
            addresses: Vec::new(),
        })),
    })
    .await?;
    let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse()?);
    let mut client = pb::endpoint_sync_client::EndpointSyncClient::new(channel.clone());
    let mut stream = tokio::time::timeout(WAIT, client.sync(request))
        .await??
        .into_inner();
    match tokio::time::timeout(WAIT, stream.message()).await?? {
        Some(pb::OperatorMessage {
            body: Some(pb::operator_message::Body::HelloReply(_)),
        }) => Ok((tx, stream)),
        other => fail(format!("expected HelloReply, got {other:?}")),
    }
}

/// [`allocate_as`] until it is not UNAVAILABLE (what an agent does: the answer says
/// retry), for at most twice [`WAIT`].
async fn allocate_retrying(
    channel: &tonic::transport::Channel,
    node: &str,
    token: &str,
    app: &str,
) -> TestResult<Result<u32, tonic::Status>> {
    let deadline = Instant::now() + 2 * WAIT;
    loop {
        let answer = allocate_as(channel, node, token, app).await?;
        match answer {
            Err(status) if status.code() == Code::Unavailable && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            answer => return Ok(answer),
        }
    }
}

async fn allocate_as(
    channel: &tonic::transport::Channel,
    node: &str,
    token: &str,
    app: &str,
) -> TestResult<Result<u32, tonic::Status>> {
    let mut request = tonic::Request::new(pb::AllocateRequest {
        protocol_version: PROTOCOL_VERSION,
        node: node.into(),
        session: Some(crate::operator::session(1)),
        labels: crate::operator::wire_labels(app),
        allocation: 0,
    });
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse()?);
    let mut client = IdentityServiceClient::new(channel.clone());
    Ok(tokio::time::timeout(WAIT, client.allocate(request))
        .await?
        .map(|r| r.into_inner().identity.map_or(0, |i| i.id)))
}

/// Two replicas as the Deployment's pods: one leads (the Lease, the leader
/// EndpointSlice), a node's agent token Allocates for its node only and the Identity
/// object appears in etcd; the leader killed, the other takes over within the
/// Lease's duration and answers the same labels with the same id. No request of
/// either replica was refused by RBAC.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn census_runs_on_the_real_control_plane_with_its_shipped_rbac() -> TestResult {
    census_testkit::init_tracing();
    // The audit log is the control plane's, shared by earlier runs: this run's
    // requests are those from this second on.
    let since: String = k8s_openapi::jiff::Timestamp::now()
        .to_string()
        .chars()
        .take(19)
        .collect();
    let plane = deployed().await?;
    let operators = running_pods(plane, OPERATOR_NS)?;
    let agents = running_pods(plane, AGENT_NS)?;
    let certs = census_testkit::tls::Certs::generate(&[], &[])?;
    let mut replicas = Vec::new();
    for (pod, _, ip) in &operators {
        replicas.push(Replica::start(plane, pod, ip, &certs)?);
    }
    let leader = eventually("a replica holds the Lease", WAIT, || async {
        Ok(lease_holder(plane))
    })
    .await?;
    let slice = eventually("the leader publishes itself", WAIT, || async {
        let slice = plane
            .kubectl_json(&[
                "-n",
                OPERATOR_NS,
                "get",
                "endpointslice",
                "census-operator-leader",
            ])
            .ok();
        Ok(slice.filter(|s| s["endpoints"].as_array().is_some_and(|e| !e.is_empty())))
    })
    .await?;
    assert_eq!(
        slice["metadata"]["labels"]["kubernetes.io/service-name"], "census-operator-leader",
        "{slice}"
    );

    // Each agent pod's token speaks for its own node, and for no other.
    let (agent_pod, node, _) = agents.first().ok_or("no agent pod")?;
    let other_node = plane
        .nodes()
        .iter()
        .map(|n| n.name.clone())
        .find(|n| n != node)
        .ok_or("one node only")?;
    let token = plane.token(
        AGENT_NS,
        "census-agent",
        Some("census"),
        Some(agent_pod),
        600,
    )?;
    let lead = replicas
        .iter()
        .position(|r| r.pod == leader)
        .ok_or("the holder is not a replica")?;
    let channel = certs.target(replicas[lead].grpc, None)?.channel().await?;
    let _stream = hello_as(&channel, node, &token).await?;
    let id = allocate_retrying(&channel, node, &token, "in-cluster-web").await??;
    let refused = allocate_as(&channel, &other_node, &token, "in-cluster-web")
        .await?
        .err()
        .ok_or("one node's token spoke for another")?;
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    assert!(refused.message().contains(node.as_str()), "{refused:?}");
    let api_token = plane.token(AGENT_NS, "census-agent", None, Some(agent_pod), 600)?;
    let refused = allocate_as(&channel, node, &api_token, "in-cluster-web")
        .await?
        .err()
        .ok_or("a token for the API server's audience was accepted")?;
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
    let object = plane.kubectl_json(&["get", "identity", &id.to_string()])?;
    assert!(
        object["spec"]["labels"]
            .as_array()
            .is_some_and(|l| l.iter().any(|v| v == "k8s:app=in-cluster-web")),
        "{object}"
    );

    // The leader killed: the other replica takes over within the Lease's duration
    // (2 s in these replicas' flags) plus its retry period, and answers the same.
    let killed_at = Instant::now();
    let mut dead = replicas.remove(lead);
    dead.child.kill()?;
    dead.child.wait()?;
    let survivor = replicas.first().ok_or("no second replica")?;
    let next = eventually("the other replica takes over", WAIT, || async {
        Ok(lease_holder(plane).filter(|h| *h == survivor.pod))
    })
    .await?;
    let took = killed_at.elapsed();
    assert_eq!(next, survivor.pod);
    assert!(took < Duration::from_secs(10), "took over after {took:?}");
    let channel = certs.target(survivor.grpc, None)?.channel().await?;
    // The agent reconnects to the new leader: Hello, then the same labels.
    let _stream = hello_as(&channel, node, &token).await?;
    let again = allocate_retrying(&channel, node, &token, "in-cluster-web").await??;
    assert_eq!(again, id, "the same labels, the same id after the failover");

    // Everything either replica asked of the API server was allowed by deploy/'s RBAC:
    // the API server's audit log has no 403 for census's ServiceAccounts.
    let operator = "system:serviceaccount:census-system:census-operator";
    let audit = plane.audit()?;
    let refused: Vec<String> = audit
        .iter()
        .filter(|e| e["user"]["username"] == operator && e["responseStatus"]["code"] == 403)
        .map(|e| format!("{} {}", e["verb"], e["requestURI"]))
        .collect();
    assert!(refused.is_empty(), "refused by RBAC: {refused:#?}");
    let used: BTreeSet<String> = audit
        .iter()
        .filter(|e| e["user"]["username"] == operator)
        .map(|e| {
            format!(
                "{} {}",
                e["verb"].as_str().unwrap_or("?"),
                e["objectRef"]["resource"].as_str().unwrap_or("?")
            )
        })
        .collect();
    for needed in [
        "list identities",
        "watch identities",
        "create identities",
        "create tokenreviews",
        "update leases",
        "update endpointslices",
        "list nodes",
        "list services",
        "list servicecidrs",
    ] {
        assert!(
            used.contains(needed),
            "the replicas never did {needed}: {used:?}"
        );
    }
    // The watches list from the API server's watch cache: resourceVersion 0 and no
    // limit (kube leaves the version out of a list with a limit: etcd). Only the
    // Identity store's load at a leader's start reads etcd, in pages.
    let lists = |resource: &str| -> Vec<String> {
        audit
            .iter()
            .filter(|e| {
                e["user"]["username"] == operator
                    && e["verb"] == "list"
                    && e["objectRef"]["resource"] == resource
                    && e["requestReceivedTimestamp"]
                        .as_str()
                        .is_some_and(|t| t.get(..19).is_some_and(|t| t >= since.as_str()))
            })
            .filter_map(|e| e["requestURI"].as_str().map(str::to_owned))
            .collect()
    };
    let from_cache = |uri: &String| uri.contains("resourceVersion=0") && !uri.contains("limit=");
    for resource in ["nodes", "services", "servicecidrs"] {
        let uris = lists(resource);
        assert!(
            !uris.is_empty() && uris.iter().all(from_cache),
            "lists of {resource} not from the watch cache: {uris:#?}"
        );
    }
    let identities = lists("identities");
    assert!(
        identities.iter().any(from_cache),
        "no list of identities from the watch cache: {identities:#?}"
    );
    drop(dead);
    Ok(())
}

/// What each ServiceAccount may do, as the real authorizer lists it
/// (`kubectl auth can-i --list`), equals what docs/kubernetes.md documents, beyond
/// what every authenticated user gets (`system:basic-user`, `system:discovery`,
/// `system:public-info-viewer`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_service_account_may_do_exactly_what_the_docs_say() -> TestResult {
    let plane = deployed().await?;
    let baseline = can_i(plane, "system:serviceaccount:default:default", "default")?;
    let operator = "system:serviceaccount:census-system:census-operator";
    let agent = "system:serviceaccount:census-agent:census-agent";
    for (account, namespace, documented) in [
        (
            operator,
            "census-system",
            [OPERATOR_CLUSTER_WIDE, OPERATOR_IN_OWN_NS].concat(),
        ),
        (
            operator,
            "default",
            [OPERATOR_CLUSTER_WIDE, OPERATOR_IN_DEFAULT].concat(),
        ),
        (
            operator,
            "census-agent",
            [OPERATOR_CLUSTER_WIDE, OPERATOR_IN_AGENT_NS].concat(),
        ),
        (operator, "kube-system", OPERATOR_CLUSTER_WIDE.to_vec()),
        (agent, "census-agent", AGENT_EVERYWHERE.to_vec()),
        (agent, "default", AGENT_EVERYWHERE.to_vec()),
    ] {
        let granted: BTreeSet<String> = can_i(plane, account, namespace)?
            .difference(&baseline)
            .cloned()
            .collect();
        let documented: BTreeSet<String> = documented.iter().map(|s| (*s).to_owned()).collect();
        assert_eq!(
            granted, documented,
            "{account} in {namespace}: granted (left) vs documented (right)"
        );
    }
    Ok(())
}

/// `kubectl auth can-i --list` as `user`, one `resource [names] verbs` line per rule.
fn can_i(plane: &ControlPlane, user: &str, namespace: &str) -> TestResult<BTreeSet<String>> {
    let text = plane.kubectl_ok(&["auth", "can-i", "--list", "--as", user, "-n", namespace])?;
    Ok(text
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|l| !l.is_empty())
        .collect())
}

// What docs/kubernetes.md ("What each ServiceAccount may do") lists, as
// `kubectl auth can-i --list` prints it: RESOURCE NON-RESOURCE-URLS NAMES VERBS.
const OPERATOR_CLUSTER_WIDE: &[&str] = &[
    "identities.census.dev [] [] [get list watch create delete]",
    "identities.census.dev/status [] [] [patch]",
    "nodes [] [] [list watch]",
    "services [] [] [list watch]",
    "servicecidrs.networking.k8s.io [] [] [list watch]",
    "tokenreviews.authentication.k8s.io [] [] [create]",
];
const OPERATOR_IN_OWN_NS: &[&str] = &[
    "leases.coordination.k8s.io [] [] [create]",
    "leases.coordination.k8s.io [] [census-operator] [get update]",
    "endpointslices.discovery.k8s.io [] [] [create]",
    "endpointslices.discovery.k8s.io [] [census-operator-leader] [get update]",
];
const OPERATOR_IN_DEFAULT: &[&str] = &["events.events.k8s.io [] [] [create]"];
const OPERATOR_IN_AGENT_NS: &[&str] = &["pods [] [] [get]"];
const AGENT_EVERYWHERE: &[&str] = &["pods [] [] [get list watch]"];
