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

/// What a cargo build made: its binaries by name (`cargo build`'s, or the ones
/// `cargo test` builds for integration tests) and its test and bench executables.
#[derive(Debug, Default)]
pub(crate) struct Artifacts {
    pub(crate) binaries: std::collections::BTreeMap<String, PathBuf>,
    /// `(target name, executable)`.
    pub(crate) tests: Vec<(String, PathBuf)>,
}

/// Runs `cargo <args> --message-format=json` (a `--no-run` test or bench build, or
/// a `build`), passing its diagnostics through, and returns the executables it
/// built, as aya's xtask does.
pub(crate) fn build_artifacts(mut command: Command, args: &[&str]) -> anyhow::Result<Artifacts> {
    command
        .current_dir(workspace_root())
        .args(args)
        .arg("--message-format=json-diagnostic-rendered-ansi")
        .stdout(Stdio::piped());
    announce(&command);
    let mut child = command.spawn().context("running cargo")?;
    let stdout = child.stdout.take().context("cargo's stdout")?;
    let mut built = Artifacts::default();
    for line in BufReader::new(stdout).lines() {
        let line = line.context("reading cargo's output")?;
        let Ok(message) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        match message["reason"].as_str() {
            Some("compiler-artifact") => {
                let (Some(name), Some(executable)) = (
                    message["target"]["name"].as_str(),
                    message["executable"].as_str(),
                ) else {
                    continue;
                };
                let kind = |wanted: &str| {
                    message["target"]["kind"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .any(|kind| kind == wanted)
                };
                // A binary's own unit tests are built as a test of kind "bin".
                let unit_tests = message["profile"]["test"].as_bool() == Some(true);
                if kind("test") || kind("bench") || unit_tests {
                    built
                        .tests
                        .push((name.to_owned(), PathBuf::from(executable)));
                } else if kind("bin") {
                    built
                        .binaries
                        .insert(name.to_owned(), PathBuf::from(executable));
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
    Ok(built)
}

/// [`build_artifacts`]' test and bench executables, for a `--no-run` build.
pub(crate) fn build_test_executables(args: &[&str]) -> anyhow::Result<Vec<PathBuf>> {
    let built = build_artifacts(host_cargo(), args)?;
    Ok(built.tests.into_iter().map(|(_, path)| path).collect())
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
    command: Command,
    args: &[&str],
) -> anyhow::Result<std::collections::BTreeMap<String, PathBuf>> {
    Ok(build_artifacts(command, args)?.binaries)
}
