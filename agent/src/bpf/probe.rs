//! What the running kernel offers, found by asking it: the minimum kernel census
//! runs on, and whether TCX links exist (tried, not guessed from the version:
//! distributions backport, and aya's `attach()` guesses by version).
use std::{fmt, fs, io, os::fd::AsFd as _, str::FromStr};

use aya_obj::generated::{bpf_attach_type, bpf_cmd, bpf_prog_type};

use super::{Error, sys};

/// How census attaches its programs to an interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttachMode {
    /// TCX links (Linux 6.6+), pinned under `links/`.
    Tcx,
    /// A clsact qdisc and TC filters over netlink, recorded under `links/`.
    Tc,
}

impl AttachMode {
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Tcx => "tcx",
            Self::Tc => "tc",
        }
    }
}

impl fmt::Display for AttachMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which [`AttachMode`] to use: `auto` probes for TCX.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum AttachModeChoice {
    #[default]
    Auto,
    Tcx,
    Tc,
}

impl FromStr for AttachModeChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "tcx" => Ok(Self::Tcx),
            "tc" => Ok(Self::Tc),
            other => Err(format!("attach mode {other:?}: expected auto, tcx or tc")),
        }
    }
}

impl AttachModeChoice {
    /// The mode to attach with on this kernel; fails when TCX is asked for and
    /// the kernel has none.
    pub fn resolve(self) -> Result<AttachMode, Error> {
        match self {
            Self::Tc => Ok(AttachMode::Tc),
            Self::Tcx => match probe_tcx() {
                Ok(()) => Ok(AttachMode::Tcx),
                Err(source) => Err(Error::TcxUnavailable { source }),
            },
            Self::Auto => match probe_tcx() {
                Ok(()) => Ok(AttachMode::Tcx),
                Err(error) => {
                    tracing::info!(%error, "this kernel has no TCX links: attaching with TC filters");
                    Ok(AttachMode::Tc)
                }
            },
        }
    }
}

/// The oldest kernel census runs on (`major`, `minor`).
pub const MINIMUM_KERNEL: (u32, u32) = (5, 15);

const OSRELEASE: &str = "/proc/sys/kernel/osrelease";

/// Fails with [`Error::KernelTooOld`] on a kernel older than [`MINIMUM_KERNEL`].
pub fn check_kernel() -> Result<(), Error> {
    let release = fs::read_to_string(OSRELEASE).map_err(|source| Error::Io {
        operation: "reading the kernel release from",
        path: OSRELEASE.into(),
        source,
    })?;
    check_release(release.trim())
}

fn check_release(release: &str) -> Result<(), Error> {
    let version = parse_release(release).ok_or_else(|| Error::UnknownKernel {
        release: release.to_owned(),
    })?;
    if version < MINIMUM_KERNEL {
        return Err(Error::KernelTooOld {
            release: release.to_owned(),
        });
    }
    Ok(())
}

/// `6.1.0-18-amd64` -> (6, 1).
fn parse_release(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// The loopback device of every network namespace.
const LOOPBACK_IFINDEX: u32 = 1;

/// Tries a TCX link on the loopback of this thread's network namespace with a
/// program that only returns TC_ACT_UNSPEC (`r0 = -1; exit`), and removes both
/// at once (closing the link's only descriptor detaches it).
fn probe_tcx() -> io::Result<()> {
    // BPF_ALU64 | BPF_MOV | BPF_K, r0, imm -1; BPF_JMP | BPF_EXIT.
    let insns: [u64; 2] = [
        u64::from_le_bytes([0xb7, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]),
        u64::from_le_bytes([0x95, 0, 0, 0, 0, 0, 0, 0]),
    ];
    let license = c"Apache-2.0";
    let mut name: [libc::c_char; 16] = [0; 16];
    for (to, from) in name.iter_mut().zip(b"census_probe") {
        *to = *from as libc::c_char;
    }
    let mut load = sys::zeroed_attr();
    load.__bindgen_anon_3.prog_type = bpf_prog_type::BPF_PROG_TYPE_SCHED_CLS as u32;
    load.__bindgen_anon_3.insn_cnt = insns.len() as u32;
    load.__bindgen_anon_3.insns = insns.as_ptr() as u64;
    load.__bindgen_anon_3.license = license.as_ptr() as u64;
    load.__bindgen_anon_3.prog_name = name;
    let program = sys::bpf_fd(bpf_cmd::BPF_PROG_LOAD, &mut load)?;
    let mut create = sys::zeroed_attr();
    create.link_create.__bindgen_anon_1.prog_fd = sys::fd_u32(program.as_fd())?;
    create.link_create.__bindgen_anon_2.target_ifindex = LOOPBACK_IFINDEX;
    create.link_create.attach_type = bpf_attach_type::BPF_TCX_INGRESS as u32;
    let link = sys::bpf_fd(bpf_cmd::BPF_LINK_CREATE, &mut create)?;
    drop(link);
    drop(program);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_distribution_releases() {
        assert_eq!(parse_release("6.1.0-18-amd64"), Some((6, 1)));
        assert_eq!(parse_release("5.15.0-91-generic"), Some((5, 15)));
        assert_eq!(parse_release("6.18.44-fc-v1045"), Some((6, 18)));
        assert_eq!(parse_release("garbage"), None);
    }

    #[test]
    fn refuses_kernels_before_5_15() {
        assert!(check_release("5.15.0-91-generic").is_ok());
        assert!(check_release("6.1.0-18-amd64").is_ok());
        for old in ["5.10.0-28-amd64", "4.19.0-26-amd64"] {
            let error = check_release(old).err().map(|e| e.to_string());
            assert!(
                error
                    .as_deref()
                    .is_some_and(|e| e.contains("5.15") && e.contains(old)),
                "{old}: {error:?}"
            );
        }
        assert!(matches!(
            check_release("x"),
            Err(Error::UnknownKernel { .. })
        ));
    }

    #[test]
    fn attach_modes_parse() {
        assert_eq!("auto".parse(), Ok(AttachModeChoice::Auto));
        assert_eq!("tc".parse(), Ok(AttachModeChoice::Tc));
        assert!("xdp".parse::<AttachModeChoice>().is_err());
    }
}
