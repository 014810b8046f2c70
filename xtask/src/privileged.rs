//! `cargo xtask test-privileged`: the tests that need root.
//!
//! Builds `census-agent`'s `privileged` test target (the datapath against the
//! kernel, and in its `e2e` module real operator and agent processes, network
//! namespaces, traffic) as the calling user would (`cargo test --no-run --message-format=json`), and the
//! `census-operator` and `census-agent` binaries the end-to-end tests run, then runs
//! the test executable with `--ignored --test-threads=1`, once per attach mode
//! (`CENSUS_TEST_ATTACH_MODE=tcx`, then `tc`). Only these tests need
//! root: nothing sets a global `runner = "sudo -E"`.

use std::{
    ffi::OsString,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};

use crate::{cmd, ebpf, setup};

#[derive(Debug, clap::Args)]
pub(crate) struct Options {
    /// Do not (re)build the eBPF object first.
    #[arg(long)]
    pub(crate) no_build_ebpf: bool,
    /// Passed to the test executables (a test name filter, `--nocapture`, …).
    #[arg(last = true)]
    pub(crate) test_args: Vec<OsString>,
    /// The real control plane's admin kubeconfig for the tests that use one
    /// (`cargo xtask test` passes its own; otherwise the tests start or reuse one).
    #[arg(skip)]
    pub(crate) kubeconfig: Option<PathBuf>,
    /// How the suite is built (`cargo xtask test` reuses its workspace build).
    #[arg(skip)]
    pub(crate) selection: Selection,
}

pub(crate) fn run(options: Options) -> anyhow::Result<()> {
    let Options {
        no_build_ebpf,
        test_args,
        kubeconfig,
        selection,
    } = options;
    if !cmd::is_root() {
        bail!(
            "the privileged tests load BPF programs and create network namespaces: run \
             `cargo xtask test-privileged` as root"
        );
    }
    // The tests pin under /sys/fs/bpf, as the agent does on a node.
    setup::mount_bpffs()?;
    let suite = Suite::build(no_build_ebpf, Profile::Dev, selection)?;
    // Every test in both attach modes: TCX, and TC filters forced (the path of
    // kernels before 6.6), on this kernel.
    for mode in ["tcx", "tc"] {
        // Devices this kernel may lack (ipvlan, netkit, wireguard).
        let skip = ["needs_other_kernel::"];
        for mut command in suite.commands(mode, &skip, &test_args) {
            if let Some(kubeconfig) = &kubeconfig {
                command.env("CENSUS_TEST_KUBECONFIG", kubeconfig);
            }
            cmd::run(&mut command)?;
        }
    }
    Ok(())
}

/// How the suite is compiled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Profile {
    /// cargo's `dev` profile, as `cargo test` builds.
    Dev,
    /// `--release`: for an emulated CPU, where debug code is too slow for the
    /// tests' deadlines.
    Release,
}

/// Which packages the suite's build selects.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum Selection {
    /// The operator's and the agent's binaries and the `privileged` test alone: the
    /// least to build after a change.
    #[default]
    Packages,
    /// `cargo test --workspace --no-run`: what `cargo test --workspace` has just built
    /// is reused as it is. Built alone, the two packages unify their dependencies'
    /// features differently, and cargo would build tokio, hyper, kube and tonic again.
    Workspace,
}

/// The privileged suite, built: its test executables and the binaries the
/// end-to-end tests run.
#[derive(Debug)]
pub(crate) struct Suite {
    executables: Vec<PathBuf>,
    operator: PathBuf,
    agent: PathBuf,
}

impl Suite {
    /// Builds the eBPF object (unless `no_build_ebpf`), the operator and agent
    /// binaries, and the `privileged` test executable, in `profile`, selecting
    /// `selection`.
    pub(crate) fn build(
        no_build_ebpf: bool,
        profile: Profile,
        selection: Selection,
    ) -> anyhow::Result<Self> {
        if !no_build_ebpf {
            ebpf::build(ebpf::Profile::Release)?;
        }
        let release: &[&str] = match profile {
            Profile::Dev => &[],
            Profile::Release => &["--release"],
        };
        let built = match selection {
            Selection::Packages => {
                let mut built = cmd::build_artifacts(
                    cmd::host_cargo(),
                    &[
                        &[
                            "build",
                            "--package",
                            "census-operator",
                            "--package",
                            "census-agent",
                            "--bins",
                        ],
                        release,
                    ]
                    .concat(),
                )?;
                let tests = cmd::build_artifacts(
                    cmd::host_cargo(),
                    &[
                        &[
                            "test",
                            "--no-run",
                            "--package",
                            "census-agent",
                            "--test",
                            "privileged",
                        ],
                        release,
                    ]
                    .concat(),
                )?;
                built.tests = tests.tests;
                built
            }
            Selection::Workspace => cmd::build_artifacts(
                cmd::host_cargo(),
                &[&["test", "--workspace", "--no-run"], release].concat(),
            )?,
        };
        let binary = |name: &str| {
            built
                .binaries
                .get(name)
                .cloned()
                .with_context(|| format!("cargo built no {name} binary"))
        };
        let (operator, agent) = (binary("census-operator")?, binary("census-agent")?);
        let executables: Vec<PathBuf> = built
            .tests
            .iter()
            .filter(|(name, _)| name == "privileged")
            .map(|(_, path)| path.clone())
            .collect();
        if executables.is_empty() {
            bail!("cargo built no `privileged` test executable");
        }
        Ok(Self {
            executables,
            operator,
            agent,
        })
    }

    /// The `census-agent` binary the end-to-end tests run.
    pub(crate) fn agent(&self) -> &Path {
        &self.agent
    }

    /// One command per test executable running its tests in attach `mode` (`tcx`,
    /// `tc` or `auto`), one at a time, without the tests whose names contain one
    /// of `skip`, with `test_args` after.
    pub(crate) fn commands(
        &self,
        mode: &str,
        skip: &[&str],
        test_args: &[OsString],
    ) -> Vec<Command> {
        self.executables
            .iter()
            .map(|executable| {
                let mut command = Command::new(executable);
                command.args(["--ignored", "--test-threads=1"]);
                for name in skip {
                    command.args(["--skip", name]);
                }
                command
                    .args(test_args)
                    .env("CENSUS_TEST_ATTACH_MODE", mode)
                    .env("CENSUS_OPERATOR_BIN", &self.operator)
                    .env("CENSUS_AGENT_BIN", &self.agent);
                command
            })
            .collect()
    }
}
