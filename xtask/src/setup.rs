//! `cargo xtask setup`: installs what the eBPF side needs, and says what it does.
//!
//! Idempotent: each item is checked first and only missing ones are installed.
//! Debian packages need root; bpf-linker is installed with the workspace's cargo
//! into `~/.cargo/bin`.

use std::process::Command;

use anyhow::{Context as _, bail};

use crate::{cmd, ebpf};

/// Debian 12 packages: the toolchain that builds and lints the eBPF crate (1.96,
/// LLVM 22), the LLVM bpf-linker links against, and the tools the privileged tests
/// use.
const PACKAGES: [&str; 7] = [
    "rustc-web",
    "cargo-web",
    "rust-web-src",
    "rust-web-clippy",
    "llvm-22-dev",
    "bpftool",
    "iproute2",
];
const LLVM_PREFIX: &str = "/usr/lib/llvm-22";

#[derive(Debug, Clone, Copy, clap::Args)]
pub(crate) struct Options {}

#[expect(clippy::print_stdout, reason = "xtask reports each check")]
pub(crate) fn run(options: Options) -> anyhow::Result<()> {
    let Options {} = options;
    println!("Debian packages:");
    let mut missing = Vec::new();
    for package in PACKAGES {
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
                 `cargo xtask setup` as root, or `apt-get install {}`",
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
    println!("ready: `cargo xtask build-ebpf`");
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
