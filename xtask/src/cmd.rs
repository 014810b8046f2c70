//! Helpers shared by the commands: paths, running programs, cargo's JSON.

use std::{
    env,
    ffi::{OsStr, OsString},
    io::{BufRead as _, BufReader},
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context as _, bail};

/// The workspace root (xtask lives in `<root>/xtask`).
pub(crate) fn workspace_root() -> PathBuf {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest_dir
        .parent()
        .map_or_else(|| manifest_dir.to_owned(), Path::to_owned)
}

/// The cargo that runs this xtask (the workspace's toolchain).
pub(crate) fn host_cargo() -> Command {
    Command::new(host_cargo_program())
}

/// The program [`host_cargo`] runs.
pub(crate) fn host_cargo_program() -> OsString {
    env::var_os("CARGO").unwrap_or_else(|| "cargo".into())
}

/// Prints a command before running it, as `+ program args…`.
#[expect(clippy::print_stdout, reason = "xtask reports what it runs")]
pub(crate) fn announce(command: &Command) {
    let args: Vec<_> = command.get_args().map(OsStr::to_string_lossy).collect();
    println!(
        "+ {} {}",
        command.get_program().to_string_lossy(),
        args.join(" ")
    );
}

/// Runs `command` with inherited stdio; fails unless it exits successfully.
pub(crate) fn run(command: &mut Command) -> anyhow::Result<()> {
    announce(command);
    let status = command
        .status()
        .with_context(|| format!("running {:?}", command.get_program()))?;
    if !status.success() {
        bail!("{:?} failed: {status}", command.get_program());
    }
    Ok(())
}

/// Whether this process runs as root.
pub(crate) fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Searches `PATH`, then cargo's bin directory, for `program`.
pub(crate) fn find_program(program: &str) -> Option<PathBuf> {
    let cargo_bin = env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|home| Path::new(&home).join(".cargo")))
        .map(|cargo_home| cargo_home.join("bin"));
    let path = env::var_os("PATH").unwrap_or_default();
    env::split_paths(&path)
        .chain(cargo_bin)
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
}

/// Runs `cargo <args> --message-format=json` (a `--no-run` test or bench
/// build), passing its diagnostics through, and returns the executables it
/// built, as aya's xtask does.
pub(crate) fn build_test_executables(args: &[&str]) -> anyhow::Result<Vec<PathBuf>> {
    let mut command = host_cargo();
    command
        .current_dir(workspace_root())
        .args(args)
        .arg("--message-format=json-diagnostic-rendered-ansi")
        .stdout(Stdio::piped());
    announce(&command);
    let mut child = command.spawn().context("running cargo")?;
    let stdout = child.stdout.take().context("cargo's stdout")?;
    let mut executables = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let line = line.context("reading cargo's output")?;
        let Ok(message) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        match message["reason"].as_str() {
            Some("compiler-artifact") => {
                let kinds = message["target"]["kind"].as_array();
                let is_test = kinds
                    .into_iter()
                    .flatten()
                    .any(|kind| kind == "test" || kind == "bench");
                if let (true, Some(executable)) = (is_test, message["executable"].as_str()) {
                    executables.push(PathBuf::from(executable));
                }
            }
            Some("compiler-message") => {
                if let Some(rendered) = message["message"]["rendered"].as_str() {
                    #[expect(clippy::print_stderr, reason = "passing cargo's diagnostics on")]
                    {
                        eprint!("{rendered}");
                    }
                }
            }
            _ => {}
        }
    }
    let status = child.wait().context("waiting for cargo")?;
    if !status.success() {
        bail!("building {} failed: {status}", args.join(" "));
    }
    if executables.is_empty() {
        bail!("cargo {} built no executable", args.join(" "));
    }
    Ok(executables)
}

/// Runs `cargo <args> --message-format=json` (a `build` of binaries), passing its
/// diagnostics through, and returns the binaries it built by name.
pub(crate) fn build_binaries(
    args: &[&str],
) -> anyhow::Result<std::collections::BTreeMap<String, PathBuf>> {
    build_binaries_with(host_cargo(), args)
}

/// [`build_binaries`] with the given cargo command (e.g. one run under `nice`, or with
/// its stderr sent to a file).
pub(crate) fn build_binaries_with(
    mut command: Command,
    args: &[&str],
) -> anyhow::Result<std::collections::BTreeMap<String, PathBuf>> {
    command
        .current_dir(workspace_root())
        .args(args)
        .arg("--message-format=json-diagnostic-rendered-ansi")
        .stdout(Stdio::piped());
    announce(&command);
    let mut child = command.spawn().context("running cargo")?;
    let stdout = child.stdout.take().context("cargo's stdout")?;
    let mut binaries = std::collections::BTreeMap::new();
    for line in BufReader::new(stdout).lines() {
        let line = line.context("reading cargo's output")?;
        let Ok(message) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        match message["reason"].as_str() {
            Some("compiler-artifact") => {
                let is_bin = message["target"]["kind"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|kind| kind == "bin");
                if let (true, Some(name), Some(executable)) = (
                    is_bin,
                    message["target"]["name"].as_str(),
                    message["executable"].as_str(),
                ) {
                    binaries.insert(name.to_owned(), PathBuf::from(executable));
                }
            }
            Some("compiler-message") => {
                if let Some(rendered) = message["message"]["rendered"].as_str() {
                    #[expect(clippy::print_stderr, reason = "passing cargo's diagnostics on")]
                    {
                        eprint!("{rendered}");
                    }
                }
            }
            _ => {}
        }
    }
    let status = child.wait().context("waiting for cargo")?;
    if !status.success() {
        bail!("cargo {} failed: {status}", args.join(" "));
    }
    Ok(binaries)
}
