//! One agent per pin directory: an exclusive advisory lock (`flock(2)`) on the pin
//! directory itself, held as long as the [`Datapath`](super::Datapath) lives.
//!
//! Two agents on one node's pins (an old and a new DaemonSet overlapping while the
//! agent moves to another namespace, or an agent started by hand beside the
//! DaemonSet's) would each reconcile the maps to their own view and undo each other's
//! work. The lock is on the directory, not on a file beside it: bpffs refuses regular
//! files (`open(O_CREAT)` is `EPERM` there), while `flock` on a directory works on any
//! file system, bpffs included. Whoever sees the pins sees the lock, in whatever mount
//! namespace, as the lock belongs to the directory's inode; a lock file elsewhere (under
//! `/run`) would protect nothing in a container that does not mount the same host
//! directory. The kernel drops the lock when the holder exits, also on SIGKILL.
//!
//! The holder is named by its pid from `/proc/locks`, which shows it only to
//! processes of its own pid namespace (or an ancestor's).

use std::{fmt, fs, io, os::unix::fs::MetadataExt as _, path::Path};

use nix::{
    errno::Errno,
    fcntl::{Flock, FlockArg},
};

use super::Error;

/// Who holds a pin directory's lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LockHolder {
    /// Its pid in this process's pid namespace; `None` when it is in another one
    /// (another container).
    pub pid: Option<u32>,
}

impl fmt::Display for LockHolder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.pid {
            Some(pid) => write!(f, "pid {pid}"),
            None => f.write_str(
                "a process outside this pid namespace, e.g. the agent of another pod on this node",
            ),
        }
    }
}

/// An exclusive lock on a pin directory, released when dropped (or when the process
/// exits).
pub(super) struct PinLock {
    _dir: Flock<fs::File>,
}

impl fmt::Debug for PinLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinLock").finish_non_exhaustive()
    }
}

fn open_dir(pin_dir: &Path) -> Result<fs::File, Error> {
    // A directory opens read-only; `flock` needs no write access.
    fs::File::open(pin_dir).map_err(|source| Error::Io {
        operation: "opening the pin directory to lock it",
        path: pin_dir.to_owned(),
        source,
    })
}

fn lock_error(pin_dir: &Path, errno: Errno) -> Error {
    Error::Io {
        operation: "locking the pin directory",
        path: pin_dir.to_owned(),
        source: io::Error::from(errno),
    }
}

impl PinLock {
    /// Whether this lock is on the directory now at `pin_dir` (not on one removed
    /// since, with another created in its place).
    pub(super) fn is_on(&self, pin_dir: &Path) -> bool {
        use std::os::unix::fs::MetadataExt as _;
        match (self._dir.metadata(), fs::metadata(pin_dir)) {
            (Ok(locked), Ok(now)) => (locked.dev(), locked.ino()) == (now.dev(), now.ino()),
            _ => false,
        }
    }

    /// Takes the lock of `pin_dir` (which must exist), or says who holds it.
    pub(super) fn try_acquire(pin_dir: &Path) -> Result<Result<Self, LockHolder>, Error> {
        let dir = open_dir(pin_dir)?;
        match Flock::lock(dir, FlockArg::LockExclusiveNonblock) {
            Ok(dir) => Ok(Ok(Self { _dir: dir })),
            Err((dir, Errno::EWOULDBLOCK)) => Ok(Err(holder(&dir))),
            Err((_, errno)) => Err(lock_error(pin_dir, errno)),
        }
    }

    /// Takes the lock of `pin_dir`, failing at once when another process holds it.
    pub(super) fn acquire(pin_dir: &Path) -> Result<Self, Error> {
        Self::try_acquire(pin_dir)?.map_err(|holder| Error::PinDirLocked {
            pin_dir: pin_dir.to_owned(),
            holder,
        })
    }

    /// Takes the lock of `pin_dir`, waiting for the holder to exit if there is one
    /// (after telling `on_busy` who it is).
    pub(super) fn acquire_waiting(
        pin_dir: &Path,
        on_busy: impl FnOnce(&LockHolder),
    ) -> Result<Self, Error> {
        match Self::try_acquire(pin_dir)? {
            Ok(lock) => return Ok(lock),
            Err(holder) => on_busy(&holder),
        }
        let mut dir = open_dir(pin_dir)?;
        loop {
            match Flock::lock(dir, FlockArg::LockExclusive) {
                Ok(dir) => return Ok(Self { _dir: dir }),
                Err((again, Errno::EINTR)) => dir = again,
                Err((_, errno)) => return Err(lock_error(pin_dir, errno)),
            }
        }
    }
}

/// The holder of the `flock` on `dir`, from `/proc/locks`.
fn holder(dir: &fs::File) -> LockHolder {
    let pid = dir.metadata().ok().and_then(|meta| {
        let locks = fs::read_to_string("/proc/locks").ok()?;
        flock_holder(&locks, meta.dev(), meta.ino())
    });
    LockHolder { pid }
}

/// The pid holding a `FLOCK` on inode `ino` of device `dev`, in `/proc/locks`'s
/// format (`1: FLOCK  ADVISORY  WRITE 4711 00:28:227108 0 EOF`, the device as hex
/// major:minor; waiting requests are marked `->` and skipped). The kernel writes 0
/// or leaves the line out for a holder outside the reader's pid namespace.
fn flock_holder(locks: &str, dev: u64, ino: u64) -> Option<u32> {
    let (major, minor) = (u64::from(libc::major(dev)), u64::from(libc::minor(dev)));
    locks.lines().find_map(|line| {
        let mut fields = line.split_whitespace().skip(1);
        if fields.next()? != "FLOCK" {
            return None;
        }
        let _advisory = fields.next()?;
        let _mode = fields.next()?;
        let pid: u32 = fields.next()?.parse().ok()?;
        let mut id = fields.next()?.split(':');
        let found = (
            u64::from_str_radix(id.next()?, 16).ok()?,
            u64::from_str_radix(id.next()?, 16).ok()?,
            id.next()?.parse::<u64>().ok()?,
        );
        (found == (major, minor, ino) && pid != 0).then_some(pid)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_holder_is_read_from_proc_locks() {
        let dev = libc::makedev(0, 0x28);
        let locks = "1: POSIX  ADVISORY  WRITE 11 00:28:227108 0 EOF\n\
                     2: FLOCK  ADVISORY  WRITE 8419 00:28:227108 0 EOF\n\
                     2: -> FLOCK  ADVISORY  WRITE 9000 00:28:227108 0 EOF\n\
                     3: FLOCK  ADVISORY  WRITE 77 fe:00:227108 0 EOF\n";
        assert_eq!(flock_holder(locks, dev, 227_108), Some(8419));
        assert_eq!(flock_holder(locks, dev, 1), None);
        let other = libc::makedev(0xfe, 0);
        assert_eq!(flock_holder(locks, other, 227_108), Some(77));
        let hidden = "2: FLOCK  ADVISORY  WRITE 0 00:28:227108 0 EOF\n";
        assert_eq!(flock_holder(hidden, dev, 227_108), None);
    }

    #[test]
    fn one_lock_per_directory_named_by_its_holder() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let first = PinLock::acquire(dir.path())?;
        match PinLock::acquire(dir.path()) {
            Err(Error::PinDirLocked { pin_dir, holder }) => {
                assert_eq!(pin_dir, dir.path());
                // This process holds it (a second open file description conflicts).
                assert_eq!(holder.pid, Some(std::process::id()));
                let message = Error::PinDirLocked { pin_dir, holder }.to_string();
                assert!(
                    message.contains(&format!("pid {}", std::process::id())),
                    "{message}"
                );
            }
            other => return Err(format!("expected PinDirLocked, got {other:?}").into()),
        }
        // Another directory has a lock of its own.
        let elsewhere = tempfile::tempdir()?;
        drop(PinLock::acquire(elsewhere.path())?);
        // A waiter gets the lock once the holder lets go.
        let path = dir.path().to_owned();
        let (busy_tx, busy_rx) = std::sync::mpsc::channel();
        let waiter = std::thread::spawn(move || {
            PinLock::acquire_waiting(&path, |holder| {
                let _ = busy_tx.send(*holder);
            })
            .map(drop)
            .map_err(|e| e.to_string())
        });
        let seen = busy_rx.recv()?;
        assert_eq!(seen.pid, Some(std::process::id()));
        drop(first);
        waiter.join().map_err(|_| "the waiter panicked")??;
        // Free again.
        drop(PinLock::acquire(dir.path())?);
        Ok(())
    }

    #[test]
    fn a_missing_directory_is_an_error_naming_it() {
        let err = PinLock::acquire(Path::new("/nonexistent/census-pins"))
            .err()
            .map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("/nonexistent/census-pins")));
    }
}
