//! `cargo xtask demo --cluster`: the demo's story on a local Kubernetes control plane,
//! told by `census-bench --cluster-demo` (bench/src/seeds/demo.rs) on the world the
//! seed presets run in: the plane built from the pinned upstream modules, `deploy/`
//! applied, census's operator in Kubernetes mode and one agent per kwok node. This
//! checks Go and root, builds what it needs in release (the eBPF object, census-bench,
//! census-operator, census-agent and census) and runs it.

use std::process::Command;

use anyhow::{Context as _, bail};

use super::{say, step};
use crate::{cmd, ebpf, setup};

pub(super) fn run(no_setup: bool) -> anyhow::Result<()> {
    if !cmd::is_root() {
        bail!(
            "`cargo xtask demo --cluster` runs census's agents, which load BPF programs, \
             in network namespaces: run it as root (`cargo xtask demo --operator-only` \
             needs none)"
        );
    }
    let go = census_cluster::go::check(&cmd::workspace_root())?;
    say(&format!(
        "{go}: builds the control plane from test-support/control-plane (7-8 minutes the \
         first time, nothing while its pins are unchanged)"
    ));
    if no_setup {
        setup::mount_bpffs()?;
    } else {
        step("set-up (idempotent)");
        setup::run(setup::Options {})?;
    }
    step("eBPF build");
    ebpf::build(ebpf::Profile::Release)?;
    step("building census-bench, census-operator, census-agent and census (release)");
    let built = cmd::build_binaries(&[
        "build",
        "--release",
        "-p",
        "census-bench",
        "-p",
        "census-operator",
        "-p",
        "census-agent",
    ])?;
    let path = |name: &str| {
        built
            .get(name)
            .cloned()
            .with_context(|| format!("cargo built no {name}"))
    };
    cmd::run(
        Command::new(path("census-bench")?)
            .arg("--cluster-demo")
            .arg("--operator")
            .arg(path("census-operator")?)
            .arg("--agent")
            .arg(path("census-agent")?)
            .arg("--cli")
            .arg(path("census")?),
    )
}
