//! The control plane's processes: started with their output in a log file and their
//! pid in a file, found again by a later command, and stopped only if the pid is still
//! the program that was started.

use std::{
    fs::File,
    io::{Read as _, Seek as _, SeekFrom},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};

use crate::Error;

/// How much of a log a failure quotes.
const TAIL_BYTES: u64 = 3000;

/// A started component: its name, its program and its pid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Component {
    pub name: String,
    pub program: PathBuf,
    pub pid: u32,
    pub log: PathBuf,
    /// What it was started with, to start it again the same way.
    pub args: Vec<String>,
}

impl Component {
    /// Starts `program` with `args`, in a process group of its own (it outlives the
    /// command that started it, and a terminal's Ctrl-C does not reach it), its
    /// output appended to `logs/<name>.log`.
    pub(crate) fn start(
        dir: &Path,
        name: &str,
        program: &Path,
        args: &[String],
    ) -> Result<Self, Error> {
        use std::os::unix::process::CommandExt as _;
        let logs = dir.join("logs");
        std::fs::create_dir_all(&logs).map_err(|source| Error::Io {
            what: "create",
            path: logs.clone(),
            source,
        })?;
        let log = logs.join(format!("{name}.log"));
        let open = || {
            File::options()
                .create(true)
                .append(true)
                .open(&log)
                .map_err(|source| Error::Io {
                    what: "open",
                    path: log.clone(),
                    source,
                })
        };
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(open()?)
            .stderr(open()?)
            .process_group(0)
            .spawn()
            .map_err(|source| Error::Spawn {
                what: "a control-plane component",
                source,
            })?;
        // Reaped by whoever outlives it: a detached component is not waited for.
        let pid = child.id();
        drop(child);
        Ok(Self {
            name: name.to_owned(),
            // As /proc/<pid>/exe names it, for `alive`.
            program: program
                .canonicalize()
                .unwrap_or_else(|_| program.to_owned()),
            pid,
            log,
            args: args.to_vec(),
        })
    }

    /// Whether the pid is alive and still runs this component's program (a pid
    /// reused by another program is not it).
    pub fn alive(&self) -> bool {
        let exe = std::fs::read_link(format!("/proc/{}/exe", self.pid));
        let zombie = std::fs::read_to_string(format!("/proc/{}/stat", self.pid))
            .map(|stat| {
                stat.rsplit_once(')')
                    .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
            })
            .unwrap_or(true);
        exe.is_ok_and(|exe| exe == self.program) && !zombie
    }

    /// Starts the same program with the same arguments again (after [`Self::stop`]).
    pub(crate) fn restart(&self, dir: &Path) -> Result<Self, Error> {
        Self::start(dir, &self.name, &self.program, &self.args)
    }

    /// Fails with the log's tail if the component has exited.
    pub(crate) fn check(&self) -> Result<(), Error> {
        if self.alive() {
            Ok(())
        } else {
            Err(Error::Died {
                component: self.name.clone(),
                log: self.log.clone(),
                tail: self.tail(),
            })
        }
    }

    /// The last few KiB of the log.
    pub fn tail(&self) -> String {
        tail(&self.log)
    }

    /// SIGTERM, then SIGKILL after `grace`; nothing if it is no longer this program.
    pub(crate) fn stop(&self, grace: Duration) {
        if !self.alive() {
            return;
        }
        let Ok(raw) = i32::try_from(self.pid) else {
            return;
        };
        let pid = Pid::from_raw(raw);
        let _ = kill(pid, Signal::SIGTERM);
        let deadline = Instant::now() + grace;
        while self.alive() && Instant::now() < deadline {
            reap(self.pid);
            std::thread::sleep(Duration::from_millis(50));
        }
        if self.alive() {
            let _ = kill(pid, Signal::SIGKILL);
            while self.alive() {
                reap(self.pid);
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// Stops every process running one of the control plane's programs (a file under
/// a `control-plane/` directory) whose command line names `dir`, the control
/// plane's directory; returns their pids.
pub(crate) fn stop_strays(dir: &Path) -> Vec<u32> {
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_owned());
    let needle = dir.display().to_string();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut stopped = Vec::new();
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(exe) = std::fs::read_link(format!("/proc/{pid}/exe")) else {
            continue;
        };
        let ours = exe
            .parent()
            .and_then(Path::parent)
            .and_then(Path::file_name)
            .is_some_and(|d| d == "control-plane");
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let names_dir = String::from_utf8_lossy(&cmdline)
            .split('\0')
            .any(|arg| arg.contains(&needle));
        if ours && names_dir {
            let component = Component {
                name: format!("pid {pid}"),
                program: exe,
                pid,
                log: PathBuf::new(),
                args: Vec::new(),
            };
            component.stop(Duration::from_secs(10));
            stopped.push(pid);
        }
    }
    stopped
}

/// Reaps `pid` if it is an exited child of this process (a component it started),
/// so it does not linger as a zombie while the process runs. Only that pid: a
/// `waitpid(-1)` here took the exit of other threads' children (a test's kubectl),
/// whose own wait then failed with ECHILD.
fn reap(pid: u32) {
    use nix::sys::wait::{WaitPidFlag, waitpid};
    if let Ok(raw) = i32::try_from(pid) {
        let _ = waitpid(Pid::from_raw(raw), Some(WaitPidFlag::WNOHANG));
    }
}

pub(crate) fn tail(path: &Path) -> String {
    let Ok(mut file) = File::open(path) else {
        return String::new();
    };
    let len = file.metadata().map_or(0, |m| m.len());
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(TAIL_BYTES)));
    let mut bytes = Vec::new();
    let _ = file.read_to_end(&mut bytes);
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The lowest port [`listen_port`] picks.
const FIRST_LISTEN_PORT: u16 = 20_000;

/// A loopback port for a component to listen on: free when chosen, and below the
/// kernel's ephemeral range (`net.ipv4.ip_local_port_range`), where no outgoing
/// connection of another process can take it between the choice and the component's
/// bind. A port from the ephemeral range (bind to port 0, read, release) was taken so
/// by the connections of the tests running beside it: kube-controller-manager exited
/// with `bind: address already in use`. Another chooser can still pick the same port
/// at the same moment; [`port_taken`] tells the caller to choose again.
pub fn listen_port() -> Result<u16, Error> {
    use std::hash::BuildHasher as _;
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    let bind = |port: u16| std::net::TcpListener::bind(("127.0.0.1", port));
    if ephemeral > FIRST_LISTEN_PORT + 1_000 {
        let span = u64::from(ephemeral - FIRST_LISTEN_PORT);
        let random = std::collections::hash_map::RandomState::new();
        for attempt in 0..200_u32 {
            let pick = random.hash_one((std::process::id(), attempt, Instant::now())) % span;
            let port = FIRST_LISTEN_PORT + u16::try_from(pick).unwrap_or(0);
            if bind(port).is_ok() {
                return Ok(port);
            }
        }
    }
    // A kernel whose ephemeral range starts low: a port the kernel picks.
    let listener = bind(0).map_err(|source| Error::Io {
        what: "bind",
        path: PathBuf::from("127.0.0.1:0"),
        source,
    })?;
    listener
        .local_addr()
        .map(|a| a.port())
        .map_err(|source| Error::Io {
            what: "bind",
            path: PathBuf::from("127.0.0.1:0"),
            source,
        })
}

/// Whether a component's failure to start was a port another process took first (the
/// caller picks new ports and starts it again).
pub(crate) fn port_taken(error: &Error) -> bool {
    matches!(error, Error::Died { tail, .. } if tail.contains("address already in use"))
}

/// Polls `ready` every 200 ms until it holds, failing if `component` dies or
/// `within` passes.
pub(crate) fn wait_ready(
    component: &Component,
    what: &'static str,
    within: Duration,
    mut ready: impl FnMut() -> bool,
) -> Result<(), Error> {
    let deadline = Instant::now() + within;
    loop {
        component.check()?;
        if ready() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(Error::NotReady {
                component: component.name.clone(),
                what,
                waited: within,
                log: component.log.clone(),
                tail: component.tail(),
            });
        }
        reap(component.pid);
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    /// A chosen port is below the ephemeral range, and bindable.
    #[test]
    fn a_listen_port_is_free_and_outside_the_ephemeral_range()
    -> Result<(), Box<dyn std::error::Error>> {
        let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")?;
        let ephemeral: u16 = range.split_whitespace().next().unwrap_or("0").parse()?;
        // Free: `listen_port` returns only a port it has just bound. Binding it
        // again here would race every other process choosing in the same range
        // (a CI run once lost that race: AddrInUse).
        for _ in 0..50 {
            let port = listen_port()?;
            assert!(
                (FIRST_LISTEN_PORT..ephemeral).contains(&port),
                "{port} outside {FIRST_LISTEN_PORT}..{ephemeral}"
            );
        }
        Ok(())
    }

    /// Reaping a component leaves the exit of every other child to its own waiter:
    /// a kubectl another thread started and waits for.
    #[test]
    fn reaping_a_component_leaves_other_children_alone() -> Result<(), Box<dyn std::error::Error>> {
        let mut component = Command::new("sleep").arg("30").spawn()?;
        let mut other = Command::new("true").spawn()?;
        // `other` has exited and waits, a zombie, for its own wait.
        let stat = format!("/proc/{}/stat", other.id());
        let deadline = Instant::now() + Duration::from_secs(10);
        while !std::fs::read_to_string(&stat)?
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
        {
            assert!(Instant::now() < deadline, "`true` did not exit");
            std::thread::sleep(Duration::from_millis(10));
        }
        reap(component.id());
        let status = other.wait()?;
        assert!(status.success());
        component.kill()?;
        component.wait()?;
        Ok(())
    }
}
