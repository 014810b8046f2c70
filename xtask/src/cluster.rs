//! `cargo xtask cluster up | down | status | env | pin`: a real Kubernetes control
//! plane on loopback (census-cluster), for the tests, the benchmarks and by hand.

use std::path::PathBuf;

use anyhow::Context as _;
use census_cluster::ControlPlane;

use crate::cmd;

/// The name `cargo xtask test` gives its control plane.
pub(crate) const TEST_NAME: &str = "test";

#[derive(Debug, clap::Args)]
pub(crate) struct Options {
    #[command(subcommand)]
    action: Action,
    /// Which control plane (its directory under `target/cluster/`).
    #[arg(long, default_value = "dev", global = true)]
    name: String,
}

#[derive(Debug, clap::Subcommand)]
enum Action {
    /// Build the binaries if their pins changed, then start etcd, kube-apiserver,
    /// kube-controller-manager, kube-scheduler and kwok with N nodes (stopping a
    /// control plane of the same name first), and write an admin kubeconfig.
    Up {
        #[arg(long, default_value_t = 2)]
        nodes: u32,
    },
    /// Stop exactly the processes `up` started.
    Down,
    /// Each component: running, or exited with the end of its log.
    Status,
    /// Shell lines pointing kubectl and census's tests at it (`eval $(cargo xtask cluster env)`).
    Env,
    /// Re-pin test-support/control-plane to another Kubernetes release (its staging
    /// modules generated from k8s.io/kubernetes's go.mod), e.g. `v1.36.3`.
    Pin { release: String },
}

pub(crate) fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| cmd::workspace_root().join("target"), PathBuf::from)
}

#[expect(clippy::print_stdout, reason = "xtask reports each step")]
pub(crate) fn say(line: &str) {
    println!("{line}");
}

#[expect(clippy::print_stdout, reason = "the command's output")]
pub(crate) fn run(options: Options) -> anyhow::Result<()> {
    let Options { action, name } = options;
    let (root, target) = (cmd::workspace_root(), target_dir());
    match action {
        Action::Up { nodes } => {
            let plane = up(&name, nodes)?;
            println!(
                "\ncontrol plane `{name}` up: {}\n{}",
                plane.server(),
                plane.env()
            );
        }
        Action::Down => {
            if ControlPlane::down(&target, &name)? {
                println!("control plane `{name}` stopped");
            } else {
                println!("no control plane `{name}` was started");
            }
        }
        Action::Status => {
            let plane = ControlPlane::find(&target, &name)?
                .with_context(|| format!("no control plane `{name}` was started"))?;
            println!(
                "control plane `{name}`: Kubernetes {} at {}",
                plane.kubernetes(),
                plane.server()
            );
            for c in plane.components() {
                if c.alive() {
                    println!("  {:<24} running (pid {})", c.name, c.pid);
                } else {
                    println!(
                        "  {:<24} EXITED; the end of {}:\n{}",
                        c.name,
                        c.log.display(),
                        c.tail()
                    );
                }
            }
            let dead = plane.dead().len();
            anyhow::ensure!(dead == 0, "{dead} component(s) of `{name}` exited");
        }
        Action::Env => print!("{}", ControlPlane::running(&target, &name)?.env()),
        Action::Pin { release } => census_cluster::go::pin(&root, &release, &say)?,
    }
    Ok(())
}

/// Starts a fresh control plane named `name` with `nodes` kwok nodes.
pub(crate) fn up(name: &str, nodes: u32) -> anyhow::Result<ControlPlane> {
    let options = census_cluster::Options {
        name: name.to_owned(),
        nodes,
    };
    Ok(ControlPlane::up(
        &cmd::workspace_root(),
        &target_dir(),
        &options,
        &say,
    )?)
}

/// A control plane stopped when dropped (a test run's, also when a step fails).
#[derive(Debug)]
pub(crate) struct Running(pub(crate) ControlPlane);

impl Drop for Running {
    fn drop(&mut self) {
        say(&format!(
            "stopping the control plane at {}",
            self.0.dir().display()
        ));
        self.0.stop();
    }
}
