//! Named network namespaces, removed on drop, and running code inside them.

use std::{
    ffi::OsStr,
    fs::File,
    io::{self, Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    panic,
    path::PathBuf,
    process::{Child, Command, Output},
    sync::atomic::{AtomicU32, Ordering},
    thread,
    time::Duration,
};

use nix::sched::{CloneFlags, setns};

use crate::Error;

/// `<prefix>-<pid>-<n>`: unique among the namespaces (and pin directories)
/// of every process running tests at the same time.
pub fn unique_name(prefix: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}-{}-{n}", std::process::id())
}

/// A named network namespace (`/run/netns/<name>`), deleted on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
}

impl Netns {
    /// Creates a namespace named `census-<pid>-<n>-<role>` with `lo` up.
    pub fn create(role: &str) -> Result<Self, Error> {
        Self::create_with_prefix("census", role)
    }

    /// Creates a namespace named `<prefix>-<pid>-<n>-<role>` with `lo` up (a
    /// benchmark's own prefix keeps its namespaces apart from the tests').
    pub fn create_with_prefix(prefix: &str, role: &str) -> Result<Self, Error> {
        let name = format!("{}-{role}", unique_name(prefix));
        run_command(Command::new("ip").args(["netns", "add", &name]))?;
        let netns = Self { name };
        netns.ip(&["link", "set", "lo", "up"])?;
        // No duplicate address detection: addresses (link-local ones too) are
        // usable at once, so the first packets are not lost while it runs.
        netns.sysctl("net.ipv6.conf.all.accept_dad", "0")?;
        netns.sysctl("net.ipv6.conf.default.accept_dad", "0")?;
        // MLD reports at link-up all go at once: by default each is sent again
        // up to a second later (a node's 150-byte report to a pod's interface,
        // from a link-local address ENDPOINTS does not hold, landed in a test's
        // world counter that way).
        for version in ["mldv1", "mldv2"] {
            for scope in ["all", "default"] {
                netns.sysctl(
                    &format!("net.ipv6.conf.{scope}.{version}_unsolicited_report_interval"),
                    "0",
                )?;
            }
        }
        // No router solicitations: nothing in a lab answers them, and a host sends
        // one at link-up and again 4 and 8 seconds later (a pod's 70-byte
        // solicitation to ff02::2 landed in a count-once row as (pod, world) on a
        // slow kernel run).
        for scope in ["all", "default"] {
            netns.sysctl(&format!("net.ipv6.conf.{scope}.router_solicitations"), "0")?;
        }
        Ok(netns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The namespace's bind mount.
    pub fn path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.name)
    }

    /// Runs `ip -n <name> <args>` (see [`ip_in`]).
    pub fn ip(&self, args: &[&str]) -> Result<(), Error> {
        ip_in(&self.name, args)
    }

    /// A veth pair: `host` here, its peer `eth0` in `peer` (see [`add_veth`]).
    pub fn add_veth(&self, host: &str, peer: &Netns) -> Result<(), Error> {
        add_veth(&self.name, host, peer)
    }

    /// Runs `f` on a new thread that entered this namespace, and returns its
    /// result; a panic in `f` is resumed on the calling thread. Sockets `f`
    /// creates stay in this namespace wherever they are used afterwards.
    pub fn run<F, R>(&self, f: F) -> Result<R, Error>
    where
        F: FnOnce() -> R + Send,
        R: Send,
    {
        let path = self.path();
        let file = File::open(&path).map_err(Error::io(format!("opening {}", path.display())))?;
        thread::scope(|scope| {
            let thread = scope.spawn(move || {
                setns(&file, CloneFlags::CLONE_NEWNET).map_err(|source| Error::Setns {
                    netns: self.name.clone(),
                    source,
                })?;
                Ok(f())
            });
            match thread.join() {
                Ok(result) => result,
                Err(payload) => panic::resume_unwind(payload),
            }
        })
    }

    /// An HTTP/1.0 GET of `path` from `127.0.0.1:port` inside this namespace (a
    /// daemon's admin endpoint): the status and the body. Reads for at most 5 s.
    pub fn http_get(&self, port: u16, path: &str) -> Result<(u16, String), Error> {
        let what = format!("GET {path} from 127.0.0.1:{port} in {}", self.name);
        let request = format!("GET {path} HTTP/1.0\r\nHost: census\r\n\r\n");
        let response = self
            .run(|| -> io::Result<String> {
                let mut stream = TcpStream::connect(SocketAddr::from(([127, 0, 0, 1], port)))?;
                stream.set_read_timeout(Some(Duration::from_secs(5)))?;
                stream.write_all(request.as_bytes())?;
                let mut response = String::new();
                stream.read_to_string(&mut response)?;
                Ok(response)
            })?
            .map_err(Error::io(what.clone()))?;
        let invalid = |problem: &str| Error::Io {
            what: what.clone(),
            source: io::Error::new(io::ErrorKind::InvalidData, problem.to_owned()),
        };
        let (head, body) = response
            .split_once("\r\n\r\n")
            .ok_or_else(|| invalid("no HTTP header"))?;
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| invalid("no HTTP status"))?;
        Ok((status, body.to_owned()))
    }

    /// Spawns `command` inside this namespace: it is forked by a thread that
    /// entered the namespace, so the child starts there (namespaces are inherited
    /// from the forking thread), with the caller's mounts, `/sys/fs/bpf`
    /// included. The child is killed when the guard drops.
    pub fn spawn(&self, command: &mut Command) -> Result<ChildGuard, Error> {
        let what = format!("spawning {command:?} in {}", self.name);
        let child = self.run(|| command.spawn())?.map_err(Error::io(what))?;
        Ok(ChildGuard(child))
    }

    /// Runs `program args…` inside this namespace and returns its output if it
    /// exited successfully.
    pub fn output<S: AsRef<OsStr>>(&self, program: &str, args: &[S]) -> Result<Output, Error> {
        let mut command = Command::new(program);
        command.args(args);
        self.run(|| run_command(&mut command))?
    }

    /// Writes a sysctl of this namespace (`net.ipv4.ip_forward` ->
    /// `/proc/sys/net/ipv4/ip_forward`): the `net` tree of `/proc/sys` is that of
    /// the namespace of the thread that opens it.
    pub fn sysctl(&self, key: &str, value: &str) -> Result<(), Error> {
        let path = PathBuf::from("/proc/sys").join(key.replace('.', "/"));
        let what = format!("writing {} in {}", path.display(), self.name);
        self.run(|| std::fs::write(&path, value))?
            .map_err(Error::io(what))
    }
}

/// Runs `ip -n <netns> <args>` in the namespace named `netns`. (`ip -n` switches
/// namespace inside the `ip` process only; the caller's view of `/sys` is
/// untouched.)
pub fn ip_in(netns: &str, args: &[&str]) -> Result<(), Error> {
    run_command(Command::new("ip").arg("-n").arg(netns).args(args)).map(drop)
}

/// A veth pair, as a CNI plugin wires a pod: `host` in the namespace named `netns`
/// (the node's), its peer `eth0` in `peer` (the pod's).
pub fn add_veth(netns: &str, host: &str, peer: &Netns) -> Result<(), Error> {
    let args = ["link", "add", host, "type", "veth", "peer", "name", "eth0"];
    ip_in(netns, &[&args[..], &["netns", peer.name()]].concat())
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Err(error) = run_command(Command::new("ip").args(["netns", "del", &self.name])) {
            #[expect(
                clippy::print_stderr,
                reason = "a guard's drop cannot return its error"
            )]
            {
                eprintln!("netlab: deleting network namespace {}: {error}", self.name);
            }
        }
    }
}

/// A child process, killed and reaped on drop.
#[derive(Debug)]
pub struct ChildGuard(Child);

impl ChildGuard {
    pub fn child(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        // Already exited is fine: kill fails, wait reaps.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `command` to completion; its output if it succeeded.
pub(crate) fn run_command(command: &mut Command) -> Result<Output, Error> {
    let output = command
        .output()
        .map_err(Error::io(format!("running {command:?}")))?;
    if output.status.success() {
        Ok(output)
    } else {
        Err(Error::Command {
            command: format!("{command:?}"),
            status: output.status,
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        })
    }
}
