//! Another process's resident memory and open descriptors, from `/proc/<pid>`, read
//! once or sampled for their peaks while something runs.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use crate::TestResult;

/// How often a [`Watch`] samples.
const SAMPLE_EVERY: Duration = Duration::from_millis(10);

/// The resident memory of `pid` in KiB (`VmRSS` of `/proc/<pid>/status`).
pub fn rss_kib(pid: u32) -> TestResult<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .ok_or("no VmRSS")?;
    Ok(line
        .split_whitespace()
        .nth(1)
        .ok_or("no VmRSS value")?
        .parse()?)
}

/// How many descriptors `pid` has open (the entries of `/proc/<pid>/fd`).
pub fn fds(pid: u32) -> TestResult<usize> {
    Ok(std::fs::read_dir(format!("/proc/{pid}/fd"))?.count())
}

/// The most a [`Watch`] saw; 0 for what it could never read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Peaks {
    pub rss_kib: u64,
    pub fds: usize,
}

/// Samples a process's RSS and descriptors every 10 ms on a thread of its own until
/// [`Watch::stop`] (or drop).
#[derive(Debug)]
pub struct Watch {
    stop: Arc<AtomicBool>,
    rss_kib: Arc<AtomicU64>,
    fds: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl Watch {
    pub fn start(pid: u32) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let rss_kib = Arc::new(AtomicU64::new(0));
        let fds = Arc::new(AtomicU64::new(0));
        let thread = {
            let (stop, rss_peak, fds_peak) = (stop.clone(), rss_kib.clone(), fds.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(now) = self::rss_kib(pid) {
                        rss_peak.fetch_max(now, Ordering::Relaxed);
                    }
                    if let Ok(now) = self::fds(pid) {
                        fds_peak.fetch_max(now as u64, Ordering::Relaxed);
                    }
                    std::thread::sleep(SAMPLE_EVERY);
                }
            })
        };
        Self {
            stop,
            rss_kib,
            fds,
            thread: Some(thread),
        }
    }

    /// Stops sampling: the peaks seen.
    pub fn stop(mut self) -> Peaks {
        self.join();
        Peaks {
            rss_kib: self.rss_kib.load(Ordering::Relaxed),
            fds: self.fds.load(Ordering::Relaxed) as usize,
        }
    }

    fn join(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.join();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_has_memory_and_descriptors_and_a_watch_sees_them() -> TestResult {
        let pid = std::process::id();
        let (rss, open) = (rss_kib(pid)?, fds(pid)?);
        assert!(rss > 0 && open > 0, "{rss} KiB, {open} descriptors");
        let watch = Watch::start(pid);
        // The first sample is taken before the thread first sleeps.
        let seen = crate::wait_for(Duration::from_secs(10), || {
            Ok::<_, ()>(watch.rss_kib.load(Ordering::Relaxed) > 0)
        });
        let peaks = watch.stop();
        assert_eq!(seen, Ok(true));
        assert!(peaks.rss_kib > 0 && peaks.fds > 0, "{peaks:?}");
        assert!(rss_kib(u32::MAX).is_err(), "no such process");
        Ok(())
    }
}

/// A daemon started as a process by a test, with the addresses its `serving` log
/// line named; killed (and reaped) when dropped.
#[derive(Debug)]
pub struct Spawned {
    pub child: std::process::Child,
    pub grpc: std::net::SocketAddr,
    pub admin: std::net::SocketAddr,
    /// Bytes the process has logged since, counted as they are drained.
    pub log_bytes: Arc<AtomicU64>,
}

impl Spawned {
    /// Starts `command` (a `census-operator`, its flags given) with JSON logs at
    /// `info` on a pipe, and waits up to `wait` for the line naming its gRPC and
    /// admin addresses. The log is drained from then on, so the process never
    /// blocks on a full pipe.
    pub fn start(command: &mut std::process::Command, wait: Duration) -> TestResult<Self> {
        use std::io::{BufRead as _, BufReader};
        let mut child = command
            .args(["--log-format", "json", "--log", "info"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        let Some(stderr) = child.stderr.take() else {
            kill(&mut child);
            return Err("no stderr".into());
        };
        let mut lines = BufReader::new(stderr).lines();
        let deadline = std::time::Instant::now() + wait;
        while std::time::Instant::now() < deadline {
            let Some(Ok(line)) = lines.next() else { break };
            let Ok(json) = serde_json::from_str::<serde_json::Value>(&line) else {
                continue;
            };
            let field = |name: &str| {
                json.pointer(&format!("/fields/{name}"))
                    .and_then(|v| v.as_str())
                    .and_then(|a| a.parse::<std::net::SocketAddr>().ok())
            };
            if let (Some(grpc), Some(admin)) = (field("grpc_addr"), field("admin_addr")) {
                let log_bytes = Arc::new(AtomicU64::new(0));
                let counted = Arc::clone(&log_bytes);
                std::thread::spawn(move || {
                    for line in lines.by_ref() {
                        let Ok(line) = line else { return };
                        counted.fetch_add(line.len() as u64 + 1, Ordering::Relaxed);
                    }
                });
                return Ok(Self {
                    child,
                    grpc,
                    admin,
                    log_bytes,
                });
            }
        }
        kill(&mut child);
        Err("the process did not report its addresses".into())
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills the process and waits for it.
    pub fn kill(&mut self) {
        kill(&mut self.child);
    }
}

fn kill(child: &mut std::process::Child) {
    let _ = child.kill();
    let _ = child.wait();
}

impl Drop for Spawned {
    fn drop(&mut self) {
        kill(&mut self.child);
    }
}
