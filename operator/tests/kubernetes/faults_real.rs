//! Faults of the real control plane, each on a control plane of the test's own
//! (`census_testkit::cluster::Private`) so that stopping its API server disturbs no
//! other test: the Identity CRD missing, the API server not there at start, the API
//! server restarted under the operator's watches, and etcd compacted under them. The
//! API server's audit log says which requests the operator made.

use std::{
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use census_proto::{
    PROTOCOL_VERSION,
    pb::{self, identity_service_client::IdentityServiceClient},
};
use census_testkit::cluster::{ControlPlane, Private};
use serde_json::Value;

use crate::common::{TestResult, WAIT, eventually, fail};

/// A `census-operator` process on `plane` as its administrator, killed on drop.
struct Operator {
    child: Child,
    log: std::path::PathBuf,
}

impl Operator {
    fn start(plane: &ControlPlane, name: &str) -> TestResult<Self> {
        let args = crate::operator::replica_args(
            &plane.kubeconfig(),
            name,
            &[
                ("--namespace", "default"),
                ("--pod-ip", "198.18.255.1"),
                ("--grace-period", "60s"),
            ],
        );
        let log = plane
            .dir()
            .join("logs")
            .join(format!("census-operator-{name}.log"));
        let child = Command::new(env!("CARGO_BIN_EXE_census-operator"))
            .args(&args)
            .args(["--log-format", "json", "--log", "info"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()?;
        Ok(Self { child, log })
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A field of the first log line that has it.
    fn field(&self, name: &str) -> Option<String> {
        self.log()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find_map(|j| j["fields"][name].as_str().map(str::to_owned))
    }

    fn exited(&mut self) -> TestResult<Option<std::process::ExitStatus>> {
        Ok(self.child.try_wait()?)
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn create_identity(plane: &ControlPlane, id: u32, app: &str) -> TestResult {
    plane.apply(&serde_json::json!({
        "apiVersion": "census.dev/v1", "kind": "Identity",
        "metadata": {"name": id.to_string()},
        "spec": {"labels": crate::operator::wire_labels(app)},
    }))?;
    Ok(())
}

/// Whether the operator's read model has `id` (IdentityService.Get).
async fn knows(grpc: &str, id: u32) -> TestResult<bool> {
    let channel = crate::operator::channel(grpc.parse()?).await?;
    let answer = IdentityServiceClient::new(channel)
        .get(pb::GetRequest {
            protocol_version: PROTOCOL_VERSION,
            id,
        })
        .await;
    Ok(answer.is_ok())
}

/// The operator's (the administrator's, here) LIST requests of Identity objects
/// in the audit log.
fn identity_lists(plane: &ControlPlane) -> TestResult<usize> {
    Ok(plane
        .audit()?
        .iter()
        .filter(|e| {
            e["verb"] == "list"
                && e["objectRef"]["resource"] == "identities"
                && e["responseStatus"]["code"] == 200
                && !e["userAgent"]
                    .as_str()
                    .is_some_and(|a| a.starts_with("kubectl"))
        })
        .count())
}

/// The Identity CRD missing, the API server missing at start, restarted, and etcd
/// compacted under the watches, in turn on one private control plane.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_rides_out_the_control_planes_faults() -> TestResult {
    census_testkit::init_tracing();
    let mut private = Private::start("faults")?;

    // 1. The CRD is not installed: the operator says which CRD is missing.
    {
        let mut op = Operator::start(&private.0, "no-crd")?;
        let named = eventually("the operator names the missing CRD", WAIT, || async {
            Ok(op.log().contains("identities.census.dev").then_some(()))
        })
        .await;
        if named.is_err() {
            let status = op.exited()?;
            return fail(format!(
                "without the CRD (exited: {status:?}) the log does not name identities.census.dev:\n{}",
                op.log()
            ));
        }
    }
    census_testkit::cluster::apply_crd(&private.0)?;

    // 2. The API server is not there when the operator starts: it stays up, not
    // ready, saying why, and leads once the API server is back.
    private.0.stop_component("kube-apiserver")?;
    let mut op = Operator::start(&private.0, "replica")?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    if let Some(status) = op.exited()? {
        return fail(format!(
            "the operator exited ({status}) while the API server was away:\n{}",
            op.log()
        ));
    }
    let admin = eventually("the operator serves its admin port", WAIT, || async {
        Ok(op.field("admin_addr"))
    })
    .await?;
    let readyz = http_get(&admin, "/readyz").await?;
    assert!(readyz.starts_with("503"), "{readyz}");
    assert!(
        readyz.contains("not ready: ") && readyz.contains("Identity objects"),
        "/readyz does not say why: {readyz}"
    );
    private.0.start_component("kube-apiserver")?;
    let grpc = eventually("the operator serves", Duration::from_secs(60), || async {
        Ok(op.field("grpc_addr"))
    })
    .await?;
    create_identity(&private.0, 40_000, "faults-before")?;
    eventually(
        "the operator reads what the API server holds",
        WAIT,
        || async { Ok(knows(&grpc, 40_000).await?.then_some(())) },
    )
    .await?;

    // 3. The API server restarted under the watches: a restarted API server's watch
    // cache starts at etcd's current revision, past the one the watch resumes from
    // (the API server writes at start), so it answers 410 Expired and the watch lists
    // once; nothing is lost.
    let lists_before = identity_lists(&private.0)?;
    private.0.stop_component("kube-apiserver")?;
    private.0.start_component("kube-apiserver")?;
    create_identity(&private.0, 40_001, "faults-after-restart")?;
    eventually("the watch resumed after the restart", WAIT, || async {
        Ok(knows(&grpc, 40_001).await?.then_some(()))
    })
    .await?;
    // Whatever else the restart makes it do, it has done by now.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let relists_after_restart = identity_lists(&private.0)? - lists_before;

    // 4. etcd compacted, then the API server restarted: the watch's resume point is
    // gone (410), so it lists once more, and again nothing is lost.
    create_identity(&private.0, 40_002, "faults-before-compaction")?;
    eventually("the watch saw the last object", WAIT, || async {
        Ok(knows(&grpc, 40_002).await?.then_some(()))
    })
    .await?;
    let lists_before = identity_lists(&private.0)?;
    private.0.compact_etcd()?;
    private.0.stop_component("kube-apiserver")?;
    private.0.start_component("kube-apiserver")?;
    create_identity(&private.0, 40_003, "faults-after-compaction")?;
    eventually("the watch resumed after the compaction", WAIT, || async {
        Ok(knows(&grpc, 40_003).await?.then_some(()))
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let relists_after_compaction = identity_lists(&private.0)? - lists_before;
    assert!(op.exited()?.is_none(), "{}", op.log());
    assert_eq!(
        (relists_after_restart, relists_after_compaction),
        (1, 1),
        "one re-list of the Identity objects after each 410, no more"
    );
    let expired = op
        .log()
        .lines()
        .filter(|l| l.contains("the watch of Identity objects failed") && l.contains("Expired"))
        .count();
    assert_eq!(
        expired,
        2,
        "each re-list follows a 410 Expired:\n{}",
        op.log()
    );
    Ok(())
}

/// A request the shipped RBAC does not allow is answered 403 by the real
/// authorizer, and the operator says which verb on which resource it was refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_request_names_the_verb_and_the_resource() -> TestResult {
    let plane = census_testkit::cluster::plane()?;
    let namespace = census_testkit::cluster::Namespace::create("census-denied")?;
    eventually("the namespace's default ServiceAccount", WAIT, || async {
        Ok(plane
            .kubectl_ok(&["-n", &namespace.name, "get", "serviceaccount", "default"])
            .ok())
    })
    .await?;
    let token = plane.token(&namespace.name, "default", None, None, 600)?;
    let kubeconfig = plane.write_token_kubeconfig(&format!("denied-{}", namespace.name), &token)?;
    let args = crate::operator::replica_args(
        &kubeconfig,
        "denied",
        &[
            ("--namespace", namespace.name.as_str()),
            ("--pod-ip", "198.18.255.2"),
        ],
    );
    let log = plane
        .dir()
        .join("logs")
        .join(format!("census-operator-{}.log", namespace.name));
    let mut child = Command::new(env!("CARGO_BIN_EXE_census-operator"))
        .args(&args)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .spawn()?;
    let started = Instant::now();
    let text = loop {
        let text = std::fs::read_to_string(&log)?;
        if text.contains("forbidden") || text.contains("403") || child.try_wait()?.is_some() {
            break text;
        }
        if started.elapsed() > WAIT {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let _ = child.kill();
    let _ = child.wait();
    let user = format!("system:serviceaccount:{}:default", namespace.name);
    assert!(
        text.contains(&user) && text.contains("identities"),
        "the refusal names neither the account nor the resource:\n{text}"
    );
    assert!(
        text.contains("list") || text.contains("watch") || text.contains("get"),
        "the refusal does not name the verb:\n{text}"
    );
    Ok(())
}

async fn http_get(addr: &str, path: &str) -> TestResult<String> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
        .await?;
    let mut response = String::new();
    tokio::time::timeout(WAIT, stream.read_to_string(&mut response)).await??;
    Ok(response
        .split_once(' ')
        .map(|(_, rest)| rest.to_owned())
        .unwrap_or(response))
}
