//! The two `bpf(2)` commands aya 0.14 does not expose: the TCX part of a link's
//! info (which interface it is attached to) and `BPF_LINK_DETACH`.
#![allow(unsafe_code)]

use std::{
    ffi::CString,
    io,
    os::{
        fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::Path,
};

const BPF_OBJ_GET: libc::c_long = 7;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_LINK_DETACH: libc::c_long = 34;

/// `enum bpf_link_type`'s `BPF_LINK_TYPE_TCX`.
pub(super) const BPF_LINK_TYPE_TCX: u32 = 11;

/// The head of `struct bpf_link_info` and its `tcx` member: the union that
/// follows `prog_id` is 8-byte aligned, so `tcx` starts at offset 16. The kernel
/// copies at most the size we pass and zero-fills nothing beyond it.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct LinkInfo {
    pub(super) link_type: u32,
    pub(super) id: u32,
    pub(super) prog_id: u32,
    _pad: u32,
    /// For a TCX link: 0 once its device is gone.
    pub(super) tcx_ifindex: u32,
    pub(super) tcx_attach_type: u32,
}

const _: () = assert!(size_of::<LinkInfo>() == 24);

/// `union bpf_attr` for `BPF_OBJ_GET`.
#[repr(C)]
struct ObjGetAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
    path_fd: i32,
    _pad: u32,
}

/// `union bpf_attr` for `BPF_OBJ_GET_INFO_BY_FD`.
#[repr(C)]
struct InfoByFdAttr {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

/// `union bpf_attr` for `BPF_LINK_DETACH`.
#[repr(C)]
struct LinkDetachAttr {
    link_fd: u32,
}

fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a live, initialized `#[repr(C)]` prefix of `union bpf_attr`
    // for `cmd`, and its size is passed along; the kernel zero-extends the rest
    // and writes back at most that many bytes.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            std::ptr::from_mut(attr),
            size_of::<T>() as libc::c_uint,
        )
    };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// Opens the object pinned at `path`.
pub(super) fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let path = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let mut attr = ObjGetAttr {
        pathname: path.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
        path_fd: 0,
        _pad: 0,
    };
    let fd = bpf(BPF_OBJ_GET, &mut attr)?;
    let fd = i32::try_from(fd).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
    // SAFETY: on success BPF_OBJ_GET returns a new file descriptor that nothing
    // else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The info of the link `fd` refers to.
pub(super) fn link_info(fd: BorrowedFd<'_>) -> io::Result<LinkInfo> {
    let mut info = LinkInfo::default();
    let mut attr = InfoByFdAttr {
        bpf_fd: fd_u32(fd)?,
        info_len: size_of::<LinkInfo>() as u32,
        info: std::ptr::from_mut(&mut info) as u64,
    };
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    Ok(info)
}

/// Detaches the link `fd` refers to from its hook now, whoever else holds it
/// (pins, other processes): they keep a defunct link.
pub(super) fn link_detach(fd: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = LinkDetachAttr {
        link_fd: fd_u32(fd)?,
    };
    bpf(BPF_LINK_DETACH, &mut attr).map(drop)
}

fn fd_u32(fd: BorrowedFd<'_>) -> io::Result<u32> {
    u32::try_from(fd.as_raw_fd()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}
