//! `cargo xtask setup`: installs what the eBPF side needs, and says what it does.
//!
//! Idempotent: each item is checked first and only missing ones are installed.
//! Debian packages need root; bpf-linker is installed with the workspace's cargo
//! into `~/.cargo/bin`.

use std::process::Command;

use anyhow::{Context as _, bail};

use crate::{cmd, ebpf};

/// Debian 12 packages: the toolchain that builds and lints the eBPF crate (1.96,
/// LLVM 22), the LLVM bpf-linker links against, the tools the privileged tests
/// use (bpftool, ip, and iptables for the masquerading router of the SNAT lab), and the linters of `/metrics` (`census_testkit::promlint`): `promtool`
/// from `prometheus` for the text format, the Prometheus Python client's strict
/// OpenMetrics parser for OpenMetrics. (`prometheus` is the server package: where
/// apt may start services, on a machine with systemd, it also starts a Prometheus
/// server on :9090; in containers `policy-rc.d` keeps it stopped.)
const PACKAGES: [&str; 10] = [
    "rustc-web",
    "cargo-web",
    "rust-web-src",
    "rust-web-clippy",
    "llvm-22-dev",
    "bpftool",
    "iproute2",
    "iptables",
    "prometheus",
    "python3-prometheus-client",
];
const LLVM_PREFIX: &str = "/usr/lib/llvm-22";
/// The schema validator the manifest tests (`operator/tests/kubernetes/manifests.rs`)
/// check `deploy/` with, against the Kubernetes 1.30 and 1.33 schemas it bundles.
const MANIFEST_VALIDATOR: &str = "kubernetes-validate==1.37.0";

#[derive(Debug, Clone, Copy, clap::Args)]
pub(crate) struct Options {}

#[expect(clippy::print_stdout, reason = "xtask reports each check")]
pub(crate) fn run(options: Options) -> anyhow::Result<()> {
    let Options {} = options;
    install_packages(&PACKAGES, "cargo xtask setup")?;

    println!("bpf-linker:");
    match ebpf::bpf_linker() {
        Ok(path) => {
            let version = ebpf::bpf_linker_version(&path).unwrap_or_default();
            println!("  present     bpf-linker {version} ({})", path.display());
        }
        Err(problem) => {
            println!("  missing     {problem}");
            println!("  installing  bpf-linker 0.13 (LLVM 22) with cargo install");
            cmd::run(
                cmd::host_cargo()
                    .env("LLVM_PREFIX", LLVM_PREFIX)
                    .args(["install", "bpf-linker", "--version", "^0.13", "--locked"])
                    .args(["--no-default-features", "--features", "llvm-22"]),
            )?;
            let path = ebpf::bpf_linker()
                .map_err(|problem| anyhow::anyhow!("after installing: {problem}"))?;
            println!("  installed   {}", path.display());
        }
    }
    install_manifest_validator()?;
    if cmd::is_root() {
        mount_bpffs()?;
    }
    println!("ready: `cargo xtask build-ebpf`");
    Ok(())
}

/// Where the demo and the privileged tests pin census's maps (each under a directory
/// of its own), as the DaemonSet mounts the host's.
const BPFFS: &str = "/sys/fs/bpf";

/// Mounts a BPF file system at [`BPFFS`] when none is there (a fresh container or VM
/// often has none; a node with systemd has one), saying so; idempotent. Needs root.
#[expect(clippy::print_stdout, reason = "xtask reports each check")]
pub(crate) fn mount_bpffs() -> anyhow::Result<()> {
    use nix::sys::statfs::{BPF_FS_MAGIC, statfs};
    println!("BPF file system:");
    let is_bpffs = |path: &str| statfs(path).is_ok_and(|s| s.filesystem_type() == BPF_FS_MAGIC);
    if is_bpffs(BPFFS) {
        println!("  present     bpffs at {BPFFS}");
        return Ok(());
    }
    println!("  missing     bpffs at {BPFFS}");
    println!("  mounting    mount -t bpf bpf {BPFFS}");
    cmd::run(Command::new("mount").args(["-t", "bpf", "bpf", BPFFS]))?;
    if !is_bpffs(BPFFS) {
        bail!("mount -t bpf bpf {BPFFS} succeeded, yet {BPFFS} is not a BPF file system");
    }
    Ok(())
}

/// The PyPI package the manifest tests use, with the `python3` on `PATH`.
#[expect(clippy::print_stdout, reason = "xtask reports each check")]
fn install_manifest_validator() -> anyhow::Result<()> {
    println!("Python packages:");
    let present = Command::new("python3")
        .args([
            "-c",
            "import importlib.metadata as m, sys; \
             sys.exit(m.version('kubernetes-validate') != '1.37.0')",
        ])
        .stderr(std::process::Stdio::null())
        .status()
        .context("running python3 (the manifest tests need it)")?
        .success();
    if present {
        println!("  present     {MANIFEST_VALIDATOR}");
        return Ok(());
    }
    println!("  installing  {MANIFEST_VALIDATOR} with pip");
    cmd::run(Command::new("python3").args(["-m", "pip", "install", "--quiet", MANIFEST_VALIDATOR]))
}

/// Installs those of the Debian `packages` that are missing, with apt, saying which
/// are present and which it installs; idempotent. `command` is what to run as root
/// when this process is not.
#[expect(clippy::print_stdout, reason = "xtask reports each check")]
pub(crate) fn install_packages(packages: &[&str], command: &str) -> anyhow::Result<()> {
    println!("Debian packages:");
    let mut missing = Vec::new();
    for &package in packages {
        match installed_version(package)? {
            Some(version) => println!("  present     {package} {version}"),
            None => {
                println!("  missing     {package}");
                missing.push(package);
            }
        }
    }
    if !missing.is_empty() {
        if !cmd::is_root() {
            bail!(
                "missing Debian packages: {}; installing them needs root: run \
                 `{command}` as root, or `apt-get install {}`",
                missing.join(" "),
                missing.join(" ")
            );
        }
        println!("  installing  {}", missing.join(" "));
        cmd::run(Command::new("apt-get").arg("update"))?;
        cmd::run(
            Command::new("apt-get")
                .env("DEBIAN_FRONTEND", "noninteractive")
                .args(["install", "-y", "--no-install-recommends"])
                .args(&missing),
        )?;
        for package in &missing {
            if installed_version(package)?.is_none() {
                bail!("apt-get did not install {package}");
            }
        }
    }
    Ok(())
}

/// The installed version of a Debian package, `None` if it is not installed.
fn installed_version(package: &str) -> anyhow::Result<Option<String>> {
    let output = Command::new("dpkg-query")
        .args(["--show", "--showformat=${Status}\t${Version}", package])
        .output()
        .context(
            "running dpkg-query: `cargo xtask setup` supports Debian 12 and derivatives \
             (apt); elsewhere install the equivalents of the packages it lists yourself",
        )?;
    if !output.status.success() {
        // dpkg-query fails for packages it has never heard of.
        return Ok(None);
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    Ok(match stdout.split_once('\t') {
        Some(("install ok installed", version)) => Some(version.to_owned()),
        _ => None,
    })
}
