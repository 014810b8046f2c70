//! The real Kubernetes control plane tests run against (census-cluster): the one
//! `CENSUS_TEST_KUBECONFIG` names (`cargo xtask test` starts one for the whole run),
//! or else one named `cargo-test` that the first test to need it starts and later
//! runs reuse (`cargo xtask cluster down --name cargo-test` stops it). Each test
//! works in namespaces of its own, removed when its guard drops.

use std::{
    path::{Path, PathBuf},
    sync::OnceLock,
};

pub use census_cluster::{ControlPlane, SERVICE_CIDR};

use crate::TestResult;

/// The control plane a plain `cargo test` starts when no kubeconfig is given.
const OWN: &str = "cargo-test";

/// The control plane census-cluster started for this run, started now if needed.
pub fn plane() -> TestResult<&'static ControlPlane> {
    static PLANE: OnceLock<Result<ControlPlane, String>> = OnceLock::new();
    PLANE
        .get_or_init(|| find_or_start().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| e.clone().into())
}

fn paths() -> (PathBuf, PathBuf) {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let root = manifest
        .join("../..")
        .canonicalize()
        .unwrap_or_else(|_| manifest.join("../.."));
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
    (root, target)
}

fn find_or_start() -> TestResult<ControlPlane> {
    if let Some(path) = std::env::var_os("CENSUS_TEST_KUBECONFIG") {
        let path = PathBuf::from(path);
        return ControlPlane::of_kubeconfig(&path)?.ok_or_else(|| {
            format!(
                "CENSUS_TEST_KUBECONFIG={}: not a control plane census-cluster started \
                 (`cargo xtask cluster up` starts one)",
                path.display()
            )
            .into()
        });
    }
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let root = manifest
        .join("../..")
        .canonicalize()
        .unwrap_or_else(|_| manifest.join("../.."));
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
    std::fs::create_dir_all(target.join("cluster"))?;
    // One test binary at a time starts it; the others wait and reuse it.
    let lock = std::fs::File::create(target.join("cluster").join(format!("{OWN}.lock")))?;
    let _lock =
        nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive).map_err(|(_, e)| e)?;
    if let Ok(plane) = ControlPlane::running(&target, OWN) {
        return Ok(plane);
    }
    let say = |line: &str| eprintln_line(line);
    Ok(ControlPlane::up(
        &root,
        &target,
        &census_cluster::Options {
            name: OWN.to_owned(),
            nodes: 2,
        },
        &say,
    )?)
}

#[expect(
    clippy::print_stderr,
    reason = "what the control plane's start says, in the test's output"
)]
fn eprintln_line(line: &str) {
    eprintln!("census-cluster: {line}");
}

/// Applies `deploy/` (server-side) once per process: the namespaces, the CRD (and
/// waits until it is established), the operator's and the agent's manifests, RBAC
/// and the admission policy. The PrometheusRule is not applied: its CRD comes with
/// the Prometheus operator, which the control plane does not run.
pub fn apply_deploy(plane: &ControlPlane) -> TestResult {
    static APPLIED: OnceLock<Result<(), String>> = OnceLock::new();
    APPLIED
        .get_or_init(|| {
            let (root, _) = paths();
            let apply = || -> TestResult {
                for part in ["namespace.yaml", "crds", "operator", "agent"] {
                    let path = root.join("deploy").join(part).display().to_string();
                    plane.kubectl_ok(&[
                        "apply",
                        "--server-side",
                        "--force-conflicts",
                        "--field-manager=census-deploy",
                        "-f",
                        &path,
                    ])?;
                    if part == "crds" {
                        plane.kubectl_ok(&[
                            "wait",
                            "--for=condition=Established",
                            "crd/identities.census.dev",
                            "--timeout=60s",
                        ])?;
                    }
                }
                Ok(())
            };
            apply().map_err(|e| e.to_string())
        })
        .clone()
        .map_err(Into::into)
}

/// Applies the Identity CRD alone (from `deploy/crds/`) and waits until it is
/// established: for a private control plane whose operator runs as the administrator.
pub fn apply_crd(plane: &ControlPlane) -> TestResult {
    let (root, _) = paths();
    let crd = root.join("deploy/crds/identity.yaml").display().to_string();
    plane.kubectl_ok(&["apply", "--server-side", "-f", &crd])?;
    plane.kubectl_ok(&[
        "wait",
        "--for=condition=Established",
        "crd/identities.census.dev",
        "--timeout=60s",
    ])?;
    Ok(())
}

/// A control plane of a test's own, for faults that would disturb the others' (the
/// API server stopped or restarted, etcd compacted), stopped when dropped. One at a
/// time in a test binary: each is four more processes on the machine, and several
/// starting at once slowed the shared API server past the tests' timeouts in CI.
#[derive(Debug)]
pub struct Private(
    pub ControlPlane,
    #[allow(
        dead_code,
        reason = "held for its drop: the next private control plane waits"
    )]
    std::sync::MutexGuard<'static, ()>,
);

impl Private {
    /// Starts a fresh control plane named `private-<name>` with one node, once no
    /// other test of this binary holds one.
    pub fn start(name: &str) -> TestResult<Self> {
        static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let turn = ONE_AT_A_TIME
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (root, target) = paths();
        let say = |line: &str| eprintln_line(line);
        let plane = ControlPlane::up(
            &root,
            &target,
            &census_cluster::Options {
                name: format!("private-{name}"),
                nodes: 1,
            },
            &say,
        )?;
        Ok(Self(plane, turn))
    }
}

impl Drop for Private {
    fn drop(&mut self) {
        self.0.stop();
    }
}

/// The kubectl the control plane's pins build (v1.36.3; built now if it is not).
pub fn kubectl() -> TestResult<PathBuf> {
    static KUBECTL: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    KUBECTL
        .get_or_init(|| {
            let (root, target) = paths();
            let say = |line: &str| eprintln_line(line);
            census_cluster::kubectl(&root, &target, &say).map_err(|e| e.to_string())
        })
        .clone()
        .map_err(Into::into)
}

/// A client of the control plane as its administrator, with or without kube's own
/// retries.
pub async fn admin_client(retry: bool) -> TestResult<kube::Client> {
    kubeconfig_client(&plane()?.kubeconfig(), retry).await
}

/// A client that authenticates as the kubeconfig at `path` says.
pub async fn kubeconfig_client(path: &Path, retry: bool) -> TestResult<kube::Client> {
    let kubeconfig = kube::config::Kubeconfig::read_from(path)?;
    let mut config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await?;
    config.default_retry = retry;
    Ok(kube::Client::try_from(config)?)
}

/// A namespace `<prefix>-<random>`, with the `privileged` PodSecurity level (census's
/// agent runs privileged), deleted when dropped.
#[derive(Debug)]
pub struct Namespace {
    pub name: String,
    plane: &'static ControlPlane,
}

impl Namespace {
    pub fn create(prefix: &str) -> TestResult<Self> {
        let plane = plane()?;
        let name = format!("{prefix}-{:06x}", rand_suffix());
        plane.apply(&serde_json::json!({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "labels": {
                "census.dev/test": "true",
                "pod-security.kubernetes.io/enforce": "privileged",
            }},
        }))?;
        Ok(Self { name, plane })
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        let _ = self
            .plane
            .kubectl_ok(&["delete", "namespace", &self.name, "--wait=false"]);
    }
}

fn rand_suffix() -> u32 {
    use std::hash::{BuildHasher as _, Hasher as _};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    (h.finish() & 0xff_ffff) as u32
}
