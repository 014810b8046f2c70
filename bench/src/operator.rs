//! The process under test: a release `census-operator` on a redb file in a temporary
//! directory, with its stderr in the results folder. Started, killed (SIGKILL, to
//! test recovery) and restarted on the same store and ports.

use std::{
    fs::File,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

use anyhow::{Context as _, bail};
use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};
use tokio::{
    process::{Child, Command},
    time::{Instant, sleep},
};

use super::{report::say, sample::http_get};
use crate::cmd;

/// The operator binary.
#[derive(Debug, Clone)]
pub(crate) struct Binary {
    path: PathBuf,
}

impl Binary {
    pub(crate) fn at(path: PathBuf) -> anyhow::Result<Self> {
        if !path.is_file() {
            bail!("{}: no such file", path.display());
        }
        Ok(Self { path })
    }

    /// `cargo build --release -p census-operator`, into the target directory cargo
    /// would use anyway (CARGO_TARGET_DIR is honoured).
    pub(crate) fn build_release() -> anyhow::Result<Self> {
        let root = cmd::workspace_root();
        let mut build = cmd::host_cargo();
        build.current_dir(&root).args([
            "build",
            "--release",
            "-p",
            "census-operator",
            "--bin",
            "census-operator",
        ]);
        cmd::run(&mut build)?;
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .map(|t| if t.is_absolute() { t } else { root.join(t) })
            .unwrap_or_else(|| root.join("target"));
        Self::at(target.join("release").join("census-operator"))
    }
}

/// What one operator process is started with.
#[derive(Debug, Clone)]
pub(crate) struct Launch {
    pub(crate) store_dir: PathBuf,
    pub(crate) grpc: SocketAddr,
    pub(crate) admin: SocketAddr,
    pub(crate) args: Vec<String>,
    /// Environment variables set for it.
    pub(crate) env: Vec<(String, String)>,
    pub(crate) log: PathBuf,
}

impl Launch {
    /// Free loopback ports, a store in `store_dir`, stderr to `log`.
    pub(crate) fn new(store_dir: &Path, log: PathBuf, args: Vec<String>) -> anyhow::Result<Self> {
        Ok(Self {
            store_dir: store_dir.to_owned(),
            grpc: free_port()?,
            admin: free_port()?,
            args,
            env: Vec::new(),
            log,
        })
    }
}

/// A loopback address for the operator to listen on (a port no outgoing connection
/// of the tests around it can take first).
fn free_port() -> anyhow::Result<SocketAddr> {
    let port = census_cluster::listen_port().context("finding a free port")?;
    Ok(SocketAddr::from(([127, 0, 0, 1], port)))
}

/// A running operator. Killed when dropped.
#[derive(Debug)]
pub(crate) struct Operator {
    child: Child,
    pub(crate) pid: u32,
    pub(crate) launch: Launch,
}

impl Operator {
    pub(crate) async fn start(binary: &Binary, launch: Launch) -> anyhow::Result<Self> {
        let log = File::options()
            .create(true)
            .append(true)
            .open(&launch.log)
            .with_context(|| format!("opening {}", launch.log.display()))?;
        let store = launch.store_dir.join("census.redb");
        let mut command = Command::new(&binary.path);
        command
            .arg("--grpc-listen")
            .arg(launch.grpc.to_string())
            .arg("--admin-listen")
            .arg(launch.admin.to_string())
            .arg("--store-path")
            .arg(&store)
            .args(&launch.args)
            .env_remove("CENSUS_HEAP_PROFILING")
            .envs(launch.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true);
        let child = command
            .spawn()
            .with_context(|| format!("starting {}", binary.path.display()))?;
        let pid = child.id().context("the operator exited at once")?;
        let mut op = Self { child, pid, launch };
        op.wait_ready(Duration::from_secs(30)).await?;
        Ok(op)
    }

    pub(crate) fn grpc_url(&self) -> String {
        format!("http://{}", self.launch.grpc)
    }

    pub(crate) fn admin(&self) -> SocketAddr {
        self.launch.admin
    }

    async fn wait_ready(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "census-operator exited during start ({status}); see {}",
                    self.launch.log.display()
                );
            }
            if let Ok((200, _)) = http_get(self.launch.admin, "/readyz").await {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("census-operator not ready after {timeout:?}");
            }
            sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILL, and reap.
    pub(crate) async fn kill(mut self) -> anyhow::Result<Launch> {
        let pid = Pid::from_raw(i32::try_from(self.pid)?);
        kill(pid, Signal::SIGKILL).context("SIGKILL")?;
        self.child.wait().await?;
        Ok(self.launch.clone())
    }

    /// SIGTERM, and wait for a clean exit.
    pub(crate) async fn stop(mut self) -> anyhow::Result<()> {
        let pid = Pid::from_raw(i32::try_from(self.pid)?);
        kill(pid, Signal::SIGTERM).context("SIGTERM")?;
        match tokio::time::timeout(Duration::from_secs(20), self.child.wait()).await {
            Ok(status) => {
                let status = status?;
                if !status.success() {
                    say(format!("census-operator exited with {status}"));
                }
            }
            Err(_) => {
                say("census-operator did not stop within 20 s of SIGTERM; killing it");
                self.child.kill().await?;
            }
        }
        Ok(())
    }
}
