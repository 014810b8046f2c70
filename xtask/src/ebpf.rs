//! `cargo xtask build-ebpf`: builds agent-ebpf for `bpfel-unknown-none`.
//!
//! With Debian's rustc/cargo 1.96 (LLVM 22; `rustc-web`, `cargo-web`,
//! `rust-web-src`), `RUSTC_BOOTSTRAP=1` for `-Z build-std=core`, linked by
//! bpf-linker 0.13 (LLVM 22), BTF on. rustup's proxies in `~/.cargo/bin` shadow
//! Debian's cargo, so every tool is named by its path, and nothing from the
//! calling environment (RUSTFLAGS, target dir, toolchain override) leaks in.

use std::{
    fmt,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};

use crate::cmd;

pub(crate) const DEBIAN_CARGO: &str = "/usr/bin/cargo";
pub(crate) const DEBIAN_RUSTC: &str = "/usr/bin/rustc";
pub(crate) const DEBIAN_RUSTDOC: &str = "/usr/bin/rustdoc";
pub(crate) const DEBIAN_CARGO_CLIPPY: &str = "/usr/bin/cargo-clippy";
pub(crate) const BPF_LINKER: &str = "bpf-linker";
/// The bpf-linker series that matches aya-ebpf 0.2 and LLVM 22.
pub(crate) const BPF_LINKER_SERIES: &str = "0.13.";

const TARGET: &str = "bpfel-unknown-none";
const PACKAGE: &str = "census-ebpf";

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Profile {
    /// What the agent embeds.
    #[default]
    Release,
    /// Unoptimized; for reading the code, not loadable by the agent.
    Dev,
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Release => "release",
            Self::Dev => "dev",
        })
    }
}

#[derive(Debug, Clone, Copy, clap::Args)]
pub(crate) struct Options {
    /// Cargo profile.
    #[arg(long, value_enum, default_value_t)]
    pub(crate) profile: Profile,
}

/// Where the object of `profile` lands (`agent/build.rs` embeds the release one).
pub(crate) fn object_path(profile: Profile) -> PathBuf {
    let dir = match profile {
        Profile::Release => "release",
        Profile::Dev => "debug",
    };
    ebpf_dir()
        .join("target")
        .join(TARGET)
        .join(dir)
        .join(PACKAGE)
}

fn ebpf_dir() -> PathBuf {
    cmd::workspace_root().join("agent-ebpf")
}

pub(crate) fn run(options: Options) -> anyhow::Result<()> {
    let Options { profile } = options;
    build(profile)
}

/// Builds the object, failing clearly when a tool is missing.
#[expect(clippy::print_stdout, reason = "xtask reports what it built")]
pub(crate) fn build(profile: Profile) -> anyhow::Result<()> {
    let linker = check_toolchain()?;
    let dir = ebpf_dir();
    let mut command = debian_cargo(DEBIAN_CARGO, &linker);
    command
        .current_dir(&dir)
        .args(["build", "--package", PACKAGE, "--target", TARGET])
        .args(["-Z", "build-std=core", "--profile", &profile.to_string()])
        .arg("--target-dir")
        .arg(dir.join("target"));
    cmd::run(&mut command).context("building the eBPF object")?;
    let object = object_path(profile);
    let size = std::fs::metadata(&object)
        .with_context(|| format!("the build did not produce {}", object.display()))?
        .len();
    println!("eBPF object: {} ({size} bytes)", object.display());
    Ok(())
}

/// Lints the kernel-side crates (the programs and the `#[repr(C)]` types they share
/// with the agent) for their own target, with Debian's clippy of the same toolchain,
/// warnings denied. Its own target directory: clippy's metadata would otherwise make
/// the next build of the object start over.
pub(crate) fn clippy() -> anyhow::Result<()> {
    let linker = check_toolchain()?;
    if !Path::new(DEBIAN_CARGO_CLIPPY).is_file() {
        bail!(
            "cannot lint the eBPF crates: {DEBIAN_CARGO_CLIPPY} is missing (Debian package \
             rust-web-clippy); run `cargo xtask setup` (as root) to install it"
        );
    }
    let dir = ebpf_dir();
    let mut command = debian_cargo(DEBIAN_CARGO_CLIPPY, &linker);
    command
        .current_dir(&dir)
        // cargo-clippy runs the cargo it is given, not the first one on PATH (rustup's).
        .env("CARGO", DEBIAN_CARGO)
        .args(["clippy", "--workspace", "--target", TARGET])
        .args(["-Z", "build-std=core", "--profile", "release"])
        .arg("--target-dir")
        .arg(dir.join("target").join("clippy"))
        .args(["--", "-D", "warnings"]);
    cmd::run(&mut command).context("linting the eBPF crates")
}

/// `program` (Debian's cargo or cargo-clippy) set up for the eBPF target: Debian's
/// rustc, `-Z build-std` allowed, bpf-linker named, and nothing from the calling
/// environment (RUSTFLAGS, target dir, toolchain override) leaking in.
fn debian_cargo(program: &str, linker: &Path) -> Command {
    let mut command = Command::new(program);
    for variable in [
        "RUSTUP_TOOLCHAIN",
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_BUILD_RUSTFLAGS",
        "CARGO_BUILD_TARGET",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET_DIR",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
    ] {
        command.env_remove(variable);
    }
    command
        .env("RUSTC", DEBIAN_RUSTC)
        .env("RUSTDOC", DEBIAN_RUSTDOC)
        // -Z build-std on a stable toolchain.
        .env("RUSTC_BOOTSTRAP", "1")
        .env("CARGO_TARGET_BPFEL_UNKNOWN_NONE_LINKER", linker)
        .env(
            "CARGO_TARGET_BPFEL_UNKNOWN_NONE_RUSTFLAGS",
            "-C debuginfo=2 -C link-arg=--btf",
        );
    command
}

/// Checks Debian's toolchain and bpf-linker are there; returns the linker.
fn check_toolchain() -> anyhow::Result<PathBuf> {
    let mut missing = Vec::new();
    for (tool, package) in [
        (DEBIAN_CARGO, "cargo-web"),
        (DEBIAN_RUSTC, "rustc-web"),
        (DEBIAN_RUSTDOC, "rustc-web"),
    ] {
        if !Path::new(tool).is_file() {
            missing.push(format!("{tool} (Debian package {package})"));
        }
    }
    if Path::new(DEBIAN_RUSTC).is_file() && !rust_src_present() {
        missing.push("the core library's source (Debian package rust-web-src)".to_owned());
    }
    let linker = match bpf_linker() {
        Ok(linker) => Some(linker),
        Err(problem) => {
            missing.push(problem);
            None
        }
    };
    match linker {
        Some(linker) if missing.is_empty() => Ok(linker),
        _ => bail!(
            "cannot build the eBPF object; missing: {}. Run `cargo xtask setup` (as root) to \
             install them",
            missing.join("; ")
        ),
    }
}

fn rust_src_present() -> bool {
    let Ok(output) = Command::new(DEBIAN_RUSTC)
        .args(["--print", "sysroot"])
        .output()
    else {
        return false;
    };
    let sysroot = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    Path::new(&sysroot)
        .join("lib/rustlib/src/rust/library/core/Cargo.toml")
        .is_file()
}

/// bpf-linker's path if it runs and is of the 0.13 series, else what is wrong.
pub(crate) fn bpf_linker() -> Result<PathBuf, String> {
    let Some(path) = cmd::find_program(BPF_LINKER) else {
        return Err("bpf-linker 0.13 (not found on PATH nor in ~/.cargo/bin)".to_owned());
    };
    match bpf_linker_version(&path) {
        Some(version) if version.starts_with(BPF_LINKER_SERIES) => Ok(path),
        Some(version) => Err(format!(
            "bpf-linker 0.13 ({} is version {version})",
            path.display()
        )),
        None => Err(format!(
            "bpf-linker 0.13 ({} does not run; is llvm-22-dev installed?)",
            path.display()
        )),
    }
}

/// `bpf-linker --version`'s version (`bpf-linker 0.13.0` -> `0.13.0`).
pub(crate) fn bpf_linker_version(path: &Path) -> Option<String> {
    let output = Command::new(path).arg("--version").output().ok()?;
    if !output.status.success() {
        return None;
    }
    String::from_utf8_lossy(&output.stdout)
        .split_whitespace()
        .nth(1)
        .map(str::to_owned)
}
