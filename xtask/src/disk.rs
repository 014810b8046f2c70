//! How much room the build has: `cargo xtask test` checks before it starts, so a
//! full disk is one clear error instead of a linker killed by SIGBUS halfway through
//! the tests (the linker writes its output through a memory map, and a write to a
//! mapped page of a file on a full filesystem faults).

use std::path::Path;

use anyhow::{Context as _, bail};

const GIB: u64 = 1 << 30;

/// Bytes free to an unprivileged writer on the filesystem holding `path`.
fn available(path: &Path) -> anyhow::Result<u64> {
    let stat =
        nix::sys::statvfs::statvfs(path).with_context(|| format!("statvfs {}", path.display()))?;
    Ok(stat.blocks_available().saturating_mul(stat.fragment_size()))
}

/// Fails, naming the filesystem and what to free, unless `needed_gib` GiB are free
/// where `dir` (or its nearest existing parent) lives.
#[expect(clippy::print_stdout, reason = "xtask reports each check")]
pub(crate) fn require_free(dir: &Path, needed_gib: u64, what: &str) -> anyhow::Result<()> {
    let existing = dir
        .ancestors()
        .find(|p| p.exists())
        .context("no existing directory above the target directory")?;
    let free = available(existing)?;
    println!(
        "disk: {:.1} GiB free under {} ({what} needs up to {needed_gib} GiB)",
        free as f64 / GIB as f64,
        existing.display()
    );
    if free < needed_gib * GIB {
        bail!(
            "only {:.1} GiB free on the filesystem holding {}: {what} writes up to \
             {needed_gib} GiB there; free some space (e.g. `cargo clean`, or remove stale \
             `target/debug/incremental`) and run it again",
            free as f64 / GIB as f64,
            existing.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_more_than_the_filesystem_has() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let Err(err) = require_free(dir.path(), u64::MAX / GIB, "the test") else {
            anyhow::bail!("no filesystem has that much room");
        };
        assert!(
            err.to_string().contains("GiB free on the filesystem"),
            "{err}"
        );
        require_free(dir.path(), 0, "the test")
    }
}
