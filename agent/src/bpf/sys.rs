//! What aya 0.14 does not expose: four `bpf(2)` commands (the TCX and cgroup part
//! of a link's info, `BPF_LINK_UPDATE` of a pinned cgroup link, `BPF_LINK_DETACH`, and
//! `BPF_OBJ_GET` with `BPF_F_RDONLY`), and a read-only mapping of an mmapable
//! array map.
#![allow(unsafe_code)]

use std::{
    ffi::CString,
    io,
    os::{
        fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::Path,
    ptr::NonNull,
};

const BPF_OBJ_GET: libc::c_long = 7;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_LINK_UPDATE: libc::c_long = 29;
const BPF_LINK_DETACH: libc::c_long = 34;

/// `enum bpf_link_type`'s `BPF_LINK_TYPE_CGROUP`.
pub(super) const BPF_LINK_TYPE_CGROUP: u32 = 3;
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

impl LinkInfo {
    /// For a cgroup link: the cgroup's id (`cgroup.cgroup_id`, a `u64` where a
    /// TCX link has its ifindex and attach type).
    pub(super) fn cgroup_id(&self) -> u64 {
        (u64::from(self.tcx_attach_type) << 32) | u64::from(self.tcx_ifindex)
    }
}

/// `union bpf_attr` for `BPF_LINK_UPDATE`.
#[repr(C)]
struct LinkUpdateAttr {
    link_fd: u32,
    new_prog_fd: u32,
    flags: u32,
    old_prog_fd: u32,
}

/// Makes the link `link` run the program `program` instead of its own, in
/// place (`BPF_LINK_UPDATE`): the hook is never without a program.
pub(super) fn link_update(link: BorrowedFd<'_>, program: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = LinkUpdateAttr {
        link_fd: fd_u32(link)?,
        new_prog_fd: fd_u32(program)?,
        flags: 0,
        old_prog_fd: 0,
    };
    bpf(BPF_LINK_UPDATE, &mut attr).map(drop)
}

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

/// `BPF_F_RDONLY`: a descriptor through which the map can only be read.
const BPF_F_RDONLY: u32 = 1 << 3;

/// Opens the object pinned at `path`.
pub(super) fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    obj_get_with_flags(path, 0)
}

/// Opens the map pinned at `path` for reading only (`BPF_F_RDONLY`): the kernel
/// refuses every update and delete through the descriptor, whatever the caller
/// does with it (aya's `MapData::from_pin` asks for read-write).
pub(super) fn obj_get_read_only(path: &Path) -> io::Result<OwnedFd> {
    obj_get_with_flags(path, BPF_F_RDONLY)
}

fn obj_get_with_flags(path: &Path, file_flags: u32) -> io::Result<OwnedFd> {
    let path = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let mut attr = ObjGetAttr {
        pathname: path.as_ptr() as u64,
        bpf_fd: 0,
        file_flags,
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

/// A read-only, shared mapping of the values of an array map created with
/// `BPF_F_MMAPABLE`: element `i` of `u32` words `[i * words, (i + 1) * words)`.
/// It sees every update as it happens, without a syscall per element.
#[derive(Debug)]
pub(super) struct MappedArray {
    base: NonNull<u32>,
    /// Bytes mapped.
    len: usize,
    entries: usize,
    /// `u32` words per element (the kernel rounds each value up to 8 bytes).
    words: usize,
}

// SAFETY: the mapping is read-only and only read with volatile loads; it is not
// tied to the thread that made it.
unsafe impl Send for MappedArray {}
// SAFETY: as above; shared reads race only with the kernel's writes, which
// volatile word loads tolerate (a word is read whole).
unsafe impl Sync for MappedArray {}

impl MappedArray {
    /// Maps the `entries` values of `value_size` bytes of the array map `fd`
    /// refers to.
    pub(super) fn new(fd: BorrowedFd<'_>, entries: u32, value_size: u32) -> io::Result<Self> {
        let invalid = || io::Error::from(io::ErrorKind::InvalidInput);
        let element = usize::try_from(value_size.next_multiple_of(8)).map_err(|_| invalid())?;
        let entries = usize::try_from(entries).map_err(|_| invalid())?;
        let len = element.checked_mul(entries).ok_or_else(invalid)?;
        if len == 0 {
            return Err(invalid());
        }
        // SAFETY: a new mapping (no address hint) of `len` bytes of a BPF map fd,
        // read-only and shared as the kernel requires for map mmaps; the result is
        // checked before use.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = NonNull::new(base.cast::<u32>()).ok_or_else(invalid)?;
        Ok(Self {
            base,
            len,
            entries,
            words: element / size_of::<u32>(),
        })
    }

    pub(super) fn entries(&self) -> u32 {
        u32::try_from(self.entries).unwrap_or(u32::MAX)
    }

    /// The first `N` words of element `index`, or `None` past the end. A value
    /// being rewritten meanwhile may be read half old, half new.
    pub(super) fn read<const N: usize>(&self, index: u32) -> Option<[u32; N]> {
        let index = usize::try_from(index).ok()?;
        if index >= self.entries || N > self.words {
            return None;
        }
        let mut words = [0; N];
        for (i, word) in words.iter_mut().enumerate() {
            // SAFETY: `index < entries` and `i < N <= words`, so the word lies
            // inside the mapping, which lives as long as `self`; it is 4-byte
            // aligned (the mapping is page-aligned, elements 8-byte multiples).
            *word = unsafe {
                self.base
                    .as_ptr()
                    .add(index * self.words + i)
                    .read_volatile()
            };
        }
        Some(words)
    }
}

impl Drop for MappedArray {
    fn drop(&mut self) {
        // SAFETY: `base` and `len` are those of a mapping this value made and
        // nothing else unmaps; no reference into it outlives `self`.
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.len);
        }
    }
}
