//! What aya 0.14 does not expose: four `bpf(2)` commands (the TCX and cgroup part
//! of a link's info, `BPF_LINK_UPDATE` of a pinned cgroup link, `BPF_LINK_DETACH`, and
//! `BPF_OBJ_GET` with `BPF_F_RDONLY`), a read-only mapping of an mmapable array
//! map, and a writable mapping of a one-`u64` mmapable array (a counter the agent
//! bumps with a store). The one raw `bpf()` wrapper ([`bpf`]; the TCX probe uses it too),
//! with the kernel's types and numbers from aya's generated bindings (`aya-obj`).
#![allow(unsafe_code)]

use aya_obj::generated::{BPF_F_RDONLY, bpf_attr, bpf_cmd, bpf_link_info, bpf_link_type};
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

/// `enum bpf_link_type`'s `BPF_LINK_TYPE_CGROUP`.
pub(super) const BPF_LINK_TYPE_CGROUP: u32 = bpf_link_type::BPF_LINK_TYPE_CGROUP as u32;
/// `enum bpf_link_type`'s `BPF_LINK_TYPE_TCX`.
pub(super) const BPF_LINK_TYPE_TCX: u32 = bpf_link_type::BPF_LINK_TYPE_TCX as u32;

/// What census reads of a link's `struct bpf_link_info`: its type and ids, and the
/// TCX or cgroup member (by its type).
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct LinkInfo {
    pub(super) link_type: u32,
    pub(super) id: u32,
    pub(super) prog_id: u32,
    /// For a TCX link: 0 once its device is gone.
    pub(super) tcx_ifindex: u32,
    pub(super) tcx_attach_type: u32,
    cgroup_id: u64,
}

impl LinkInfo {
    /// For a cgroup link: the cgroup's id.
    pub(super) fn cgroup_id(&self) -> u64 {
        self.cgroup_id
    }
}

/// A `union bpf_attr` of zeros, for a command to fill in.
pub(super) fn zeroed_attr() -> bpf_attr {
    // SAFETY: `bpf_attr` is a union of plain integer structs (the kernel's UAPI), for
    // which all zeros is a valid value, and the one the kernel expects in every byte
    // a command does not use.
    unsafe { std::mem::zeroed() }
}

/// `bpf(2)`: `cmd` with `attr` (the kernel's `union bpf_attr`, aya's bindings of
/// it). Every raw `bpf()` call census makes goes through here.
pub(super) fn bpf(cmd: bpf_cmd, attr: &mut bpf_attr) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a live, initialized `union bpf_attr` whose size is passed
    // along; the kernel reads and writes back at most that many bytes.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd as libc::c_long,
            std::ptr::from_mut(attr),
            size_of::<bpf_attr>() as libc::c_uint,
        )
    };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// [`bpf`] for a command that returns a new file descriptor.
pub(super) fn bpf_fd(cmd: bpf_cmd, attr: &mut bpf_attr) -> io::Result<OwnedFd> {
    let fd = bpf(cmd, attr)?;
    let fd = i32::try_from(fd).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
    // SAFETY: on success, the commands this is called for (object get, program load,
    // link create) return a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Makes the link `link` run the program `program` instead of its own, in
/// place (`BPF_LINK_UPDATE`): the hook is never without a program.
pub(super) fn link_update(link: BorrowedFd<'_>, program: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = zeroed_attr();
    attr.link_update.link_fd = fd_u32(link)?;
    attr.link_update.__bindgen_anon_1.new_prog_fd = fd_u32(program)?;
    bpf(bpf_cmd::BPF_LINK_UPDATE, &mut attr).map(drop)
}

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
    let mut attr = zeroed_attr();
    attr.__bindgen_anon_4.pathname = path.as_ptr() as u64;
    attr.__bindgen_anon_4.file_flags = file_flags;
    bpf_fd(bpf_cmd::BPF_OBJ_GET, &mut attr)
}

/// The info of the link `fd` refers to.
pub(super) fn link_info(fd: BorrowedFd<'_>) -> io::Result<LinkInfo> {
    // SAFETY: `bpf_link_info` is plain integers (a union of integer structs): all
    // zeros is valid.
    let mut info: bpf_link_info = unsafe { std::mem::zeroed() };
    let mut attr = zeroed_attr();
    attr.info.bpf_fd = fd_u32(fd)?;
    attr.info.info_len = size_of::<bpf_link_info>() as u32;
    attr.info.info = std::ptr::from_mut(&mut info) as u64;
    bpf(bpf_cmd::BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    let mut read = LinkInfo {
        link_type: info.type_,
        id: info.id,
        prog_id: info.prog_id,
        ..LinkInfo::default()
    };
    // SAFETY: the kernel filled the member of the union that the link's type names;
    // each is plain integers, and the rest stayed zero.
    unsafe {
        match info.type_ {
            BPF_LINK_TYPE_TCX => {
                read.tcx_ifindex = info.__bindgen_anon_1.tcx.ifindex;
                read.tcx_attach_type = info.__bindgen_anon_1.tcx.attach_type;
            }
            BPF_LINK_TYPE_CGROUP => read.cgroup_id = info.__bindgen_anon_1.cgroup.cgroup_id,
            _ => {}
        }
    }
    Ok(read)
}

/// Detaches the link `fd` refers to from its hook now, whoever else holds it
/// (pins, other processes): they keep a defunct link.
pub(super) fn link_detach(fd: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = zeroed_attr();
    attr.link_detach.link_fd = fd_u32(fd)?;
    bpf(bpf_cmd::BPF_LINK_DETACH, &mut attr).map(drop)
}

pub(super) fn fd_u32(fd: BorrowedFd<'_>) -> io::Result<u32> {
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

/// A writable, shared mapping of the one `u64` of an array map created with
/// `BPF_F_MMAPABLE` and one entry: the programs read what [`Self::advance`]
/// stores, without a syscall.
#[derive(Debug)]
pub(super) struct MappedCounter {
    value: NonNull<std::sync::atomic::AtomicU64>,
}

// SAFETY: the mapping is only accessed through an atomic; it is not tied to the
// thread that made it.
unsafe impl Send for MappedCounter {}
// SAFETY: as above.
unsafe impl Sync for MappedCounter {}

/// Bytes a [`MappedCounter`] maps: one element of 8 bytes (the kernel maps whole
/// pages of the map's values; the first 8 bytes are the element).
const COUNTER_LEN: usize = 8;

impl MappedCounter {
    /// Maps the value of the one-entry `u64` array map `fd` refers to, for reads
    /// and writes.
    pub(super) fn new(fd: BorrowedFd<'_>) -> io::Result<Self> {
        // SAFETY: a new mapping (no address hint) of the map's first 8 bytes, shared
        // as the kernel requires for map mmaps; the result is checked before use.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                COUNTER_LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let value = NonNull::new(base.cast::<std::sync::atomic::AtomicU64>())
            .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        Ok(Self { value })
    }

    /// Adds one, after every write before it (a program that reads the new value
    /// then reads what those writes wrote).
    pub(super) fn advance(&self) {
        // SAFETY: the mapping lives as long as `self`; page-aligned, so aligned
        // for a u64.
        unsafe { self.value.as_ref() }.fetch_add(1, std::sync::atomic::Ordering::Release);
    }
}

impl Drop for MappedCounter {
    fn drop(&mut self) {
        // SAFETY: the mapping this value made, which nothing else unmaps; no
        // reference into it outlives `self`.
        unsafe {
            libc::munmap(self.value.as_ptr().cast(), COUNTER_LEN);
        }
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
