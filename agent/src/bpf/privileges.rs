//! What the datapath needs from the system before anything is loaded: the
//! capabilities, and a BPF file system to pin in.

use std::{
    fs, io,
    path::{Path, PathBuf},
};

use nix::sys::statfs::statfs;

use super::{Error, error::CapabilityList};

const STATUS: &str = "/proc/self/status";

const CAP_NET_ADMIN: u32 = 12;
const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

/// `statfs(2)`'s `f_type` of a BPF file system.
const BPF_FS_MAGIC: u64 = 0xcafe_4a11;

/// Checks the effective capabilities of this process: CAP_BPF, CAP_NET_ADMIN and
/// CAP_PERFMON. CAP_SYS_ADMIN stands in for CAP_BPF and CAP_PERFMON, as it does
/// in the kernel.
pub fn check_capabilities() -> Result<(), Error> {
    let status = fs::read_to_string(STATUS).map_err(|source| Error::ReadCapabilities {
        path: STATUS.into(),
        source,
    })?;
    let effective = effective_capabilities(&status).ok_or_else(|| Error::ReadCapabilities {
        path: STATUS.into(),
        source: io::Error::new(io::ErrorKind::InvalidData, "no parsable CapEff line"),
    })?;
    let missing = missing_capabilities(effective);
    if missing.is_empty() {
        Ok(())
    } else {
        Err(Error::MissingCapabilities {
            missing: CapabilityList(missing),
        })
    }
}

fn effective_capabilities(status: &str) -> Option<u64> {
    let hex = status
        .lines()
        .find_map(|line| line.strip_prefix("CapEff:"))?;
    u64::from_str_radix(hex.trim(), 16).ok()
}

fn missing_capabilities(effective: u64) -> Vec<&'static str> {
    let has = |cap: u32| effective & (1 << cap) != 0;
    let sys_admin = has(CAP_SYS_ADMIN);
    let mut missing = Vec::new();
    if !has(CAP_BPF) && !sys_admin {
        missing.push("CAP_BPF");
    }
    if !has(CAP_NET_ADMIN) {
        missing.push("CAP_NET_ADMIN");
    }
    if !has(CAP_PERFMON) && !sys_admin {
        missing.push("CAP_PERFMON");
    }
    missing
}

/// Whether `path` is on a BPF file system.
pub(super) fn is_bpffs(path: &Path) -> Result<bool, Error> {
    Ok(fs_type(path)? == BPF_FS_MAGIC)
}

/// `CGROUP2_SUPER_MAGIC`.
const CGROUP2_MAGIC: u64 = 0x6367_7270;

/// Whether `path` is on a cgroup v2 file system.
pub(super) fn is_cgroup2(path: &Path) -> Result<bool, Error> {
    Ok(fs_type(path)? == CGROUP2_MAGIC)
}

fn fs_type(path: &Path) -> Result<u64, Error> {
    let stat = statfs(path).map_err(|errno| Error::Io {
        operation: "statfs",
        path: path.to_owned(),
        source: errno.into(),
    })?;
    // `f_type` is signed on glibc and its width differs between libcs.
    Ok(u64::try_from(stat.filesystem_type().0).unwrap_or_default())
}

/// Makes sure `pin_dir` is, or can be created, on a BPF file system: its closest
/// existing ancestor must be on one. bpffs is the host's to mount: one mounted
/// here, in the agent's container, would take the pins with it when the container
/// goes, and the next agent could not adopt the programs.
pub(super) fn ensure_bpffs(pin_dir: &Path) -> Result<(), Error> {
    let existing = closest_existing(pin_dir);
    if is_bpffs(&existing)? {
        Ok(())
    } else {
        Err(Error::NotBpffs { path: existing })
    }
}

fn closest_existing(path: &Path) -> PathBuf {
    let mut path = path.to_owned();
    while !path.exists() {
        path = parent_of(&path);
    }
    path
}

fn parent_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent.to_owned(),
        _ => PathBuf::from("."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_effective_set() {
        let status = "Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t000001ffffffffff\n";
        assert_eq!(effective_capabilities(status), Some(0x1ff_ffff_ffff));
        assert_eq!(effective_capabilities("Name:\tx\n"), None);
    }

    #[test]
    fn root_misses_nothing() {
        assert!(missing_capabilities(0x1ff_ffff_ffff).is_empty());
    }

    #[test]
    fn names_each_missing_capability() {
        assert_eq!(
            missing_capabilities(0),
            vec!["CAP_BPF", "CAP_NET_ADMIN", "CAP_PERFMON"]
        );
        assert_eq!(
            missing_capabilities(1 << CAP_BPF | 1 << CAP_PERFMON),
            vec!["CAP_NET_ADMIN"]
        );
    }

    #[test]
    fn sys_admin_stands_in_for_bpf_and_perfmon() {
        assert!(missing_capabilities(1 << CAP_SYS_ADMIN | 1 << CAP_NET_ADMIN).is_empty());
    }
}
