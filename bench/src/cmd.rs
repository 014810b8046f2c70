//! Paths and running programs: what xtask's helpers of the same names do, for the
//! one build this binary may run itself (the operator, when `--operator` is not given).

use std::{
    env,
    ffi::OsStr,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};

/// The workspace root (this crate lives in `<root>/bench`).
pub(crate) fn workspace_root() -> PathBuf {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest_dir
        .parent()
        .map_or_else(|| manifest_dir.to_owned(), Path::to_owned)
}

/// The cargo that ran this (`cargo xtask bench`), or the one on `PATH`.
pub(crate) fn host_cargo() -> Command {
    Command::new(env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// Runs `command` with inherited stdio, printed first as `+ program args…`; fails
/// unless it exits successfully.
pub(crate) fn run(command: &mut Command) -> anyhow::Result<()> {
    let args: Vec<_> = command.get_args().map(OsStr::to_string_lossy).collect();
    crate::report::say(format!(
        "+ {} {}",
        command.get_program().to_string_lossy(),
        args.join(" ")
    ));
    let status = command
        .status()
        .with_context(|| format!("running {:?}", command.get_program()))?;
    if !status.success() {
        bail!("{:?} failed: {status}", command.get_program());
    }
    Ok(())
}
