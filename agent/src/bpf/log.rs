//! The datapath's log: the programs' rare events (a FLOWS insert the kernel
//! refuses, an IP frame too short to read, a LOCAL endpoint whose interface has no
//! INTERFACES entry), sent with aya-log and forwarded into `tracing`.
//!
//! Off by default. aya-log-ebpf compiles every level in and turns it on unless told
//! otherwise, so the loader always sets its `AYA_LOG_LEVEL` global
//! ([`DatapathLog::aya_level`]); the global is read-only data, so the verifier drops
//! the disabled calls and logging off costs the programs nothing. The program
//! rate-limits what it sends (one event per CPU per 100 ms, the rest counted in
//! STATS as suppressed).
//!
//! aya-log speaks the `log` crate; this module is the one place that does: a
//! [`log::Log`] that turns each record into a `tracing` event of the same level,
//! target `census_datapath`. It is a local logger handed to aya-log, never installed
//! as the process's `log` logger.

use std::{
    fmt,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::Duration,
};

use aya::Ebpf;
use aya_log::EbpfLogger;

use super::Error;

/// How often the forwarding thread drains the programs' ring buffer. Events are
/// rare and rate-limited in the kernel; the 128 KiB ring holds hundreds of them.
const DRAIN_INTERVAL: Duration = Duration::from_millis(100);

/// The `tracing` target of the programs' events.
pub(super) const TARGET: &str = "census_datapath";

/// The least severe datapath event forwarded (`--datapath-log`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum DatapathLog {
    /// Nothing (the programs' log calls are removed by the verifier).
    #[default]
    Off,
    Error,
    /// FLOWS inserts the kernel refused.
    Warn,
    /// And IP frames too short to read.
    Info,
    /// And packets counted by address because their interface has no INTERFACES
    /// entry although their endpoint is LOCAL (normal for a moment after attaching).
    Debug,
}

impl DatapathLog {
    /// The value of aya-log-ebpf's `AYA_LOG_LEVEL` global: events of a level at
    /// most this are sent (`aya_log_common::Level`: error 1 .. trace 5; 0 is none).
    pub(super) fn aya_level(self) -> u8 {
        match self {
            Self::Off => 0,
            Self::Error => aya_log::Level::Error as u8,
            Self::Warn => aya_log::Level::Warn as u8,
            Self::Info => aya_log::Level::Info as u8,
            Self::Debug => aya_log::Level::Debug as u8,
        }
    }
}

impl fmt::Display for DatapathLog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Off => "off",
            Self::Error => "error",
            Self::Warn => "warn",
            Self::Info => "info",
            Self::Debug => "debug",
        })
    }
}

/// Drains the programs' aya-log ring buffer into `tracing` on a thread of its own,
/// until dropped.
pub(super) struct LogForwarder {
    stop: Arc<AtomicBool>,
}

impl LogForwarder {
    /// Takes the loaded object's `AYA_LOGS` ring buffer and starts forwarding.
    pub(super) fn start(ebpf: &mut Ebpf, level: DatapathLog) -> Result<Self, Error> {
        let mut logger = EbpfLogger::init_with_logger(ebpf, TracingLog)
            .map_err(|source| Error::DatapathLog { source })?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        // The events go where the caller's would: its subscriber, scoped or global.
        let dispatch = tracing::dispatcher::get_default(Clone::clone);
        thread::Builder::new()
            .name("datapath-log".to_owned())
            .spawn(move || {
                tracing::dispatcher::with_default(&dispatch, || {
                    while !stopped.load(Ordering::Relaxed) {
                        logger.flush();
                        thread::sleep(DRAIN_INTERVAL);
                    }
                    logger.flush();
                });
            })
            .map_err(|source| Error::DatapathLogThread { source })?;
        tracing::info!(
            level = %level,
            target = TARGET,
            "forwarding the datapath's log"
        );
        Ok(Self { stop })
    }
}

impl Drop for LogForwarder {
    fn drop(&mut self) {
        // The thread ends within one drain interval; nothing waits for it.
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// aya-log's records as `tracing` events of the same level.
struct TracingLog;

impl log::Log for TracingLog {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        // The kernel already filtered by `--datapath-log`; `tracing`'s filter decides
        // the rest.
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        forward(record);
    }

    fn flush(&self) {}
}

fn forward(record: &log::Record<'_>) {
    let message = record.args();
    let line = record.line().unwrap_or(0);
    match record.level() {
        log::Level::Error => {
            tracing::error!(target: TARGET, line, "{message}");
        }
        log::Level::Warn => tracing::warn!(target: TARGET, line, "{message}"),
        log::Level::Info => tracing::info!(target: TARGET, line, "{message}"),
        log::Level::Debug => tracing::debug!(target: TARGET, line, "{message}"),
        log::Level::Trace => tracing::trace!(target: TARGET, line, "{message}"),
    }
}

#[cfg(test)]
mod tests {
    use std::{
        fs,
        path::{Path, PathBuf},
        sync::Mutex,
    };

    use tracing_subscriber::{fmt::MakeWriter, layer::SubscriberExt as _};

    use super::*;

    #[test]
    fn levels_map_to_aya_logs_numbers() {
        assert_eq!(DatapathLog::Off.aya_level(), 0);
        assert_eq!(DatapathLog::Error.aya_level(), 1);
        assert_eq!(DatapathLog::Warn.aya_level(), 2);
        assert_eq!(DatapathLog::Info.aya_level(), 3);
        assert_eq!(DatapathLog::Debug.aya_level(), 4);
        assert_eq!(DatapathLog::default(), DatapathLog::Off);
    }

    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .map_err(|_| std::io::Error::other("poisoned"))?
                .extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Lines {
        type Writer = Self;
        fn make_writer(&'a self) -> Self {
            self.clone()
        }
    }

    #[test]
    fn records_become_tracing_events_of_their_level() {
        let lines = Lines::default();
        let subscriber = tracing_subscriber::registry().with(
            tracing_subscriber::fmt::layer()
                .with_writer(lines.clone())
                .with_ansi(false),
        );
        tracing::subscriber::with_default(subscriber, || {
            for (level, text) in [
                (
                    log::Level::Warn,
                    "FLOWS refused a new pair 256 -> 257 (error -12)",
                ),
                (log::Level::Debug, "interface 7 has no INTERFACES entry"),
            ] {
                forward(
                    &log::Record::builder()
                        .level(level)
                        .target("census_ebpf")
                        .line(Some(42))
                        .args(format_args!("{text}"))
                        .build(),
                );
            }
        });
        let text = String::from_utf8(lines.0.lock().map(|l| l.clone()).unwrap_or_default())
            .unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert!(
            lines[0].contains(" WARN census_datapath: FLOWS refused a new pair 256 -> 257")
                && lines[0].contains("line=42"),
            "{text}"
        );
        assert!(
            lines[1].contains("DEBUG census_datapath: interface 7 has no INTERFACES entry"),
            "{text}"
        );
    }

    fn lock_versions(lock: &Path, package: &str) -> Vec<String> {
        let text = fs::read_to_string(lock).unwrap_or_default();
        let mut versions = Vec::new();
        let mut lines = text.lines();
        while let Some(line) = lines.next() {
            if line == format!("name = \"{package}\"")
                && let Some(version) = lines.next().and_then(|l| l.strip_prefix("version = "))
            {
                versions.push(version.trim_matches('"').to_owned());
            }
        }
        versions
    }

    /// aya-log decodes what aya-log-ebpf encodes with aya-log-common's types: the
    /// agent's and the programs' lock files must name the same one.
    #[test]
    fn both_sides_use_one_aya_log_common() {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        let agent = lock_versions(&root.join("Cargo.lock"), "aya-log-common");
        let programs = lock_versions(&root.join("agent-ebpf/Cargo.lock"), "aya-log-common");
        assert_eq!(agent.len(), 1, "the agent's Cargo.lock: {agent:?}");
        assert_eq!(agent, programs, "agent vs agent-ebpf");
    }

    /// Whether `line` has a path starting at the `log` crate (`log::`, not
    /// `aya_log::`, `dialog::` or this module, `super::log::`).
    fn names_the_log_crate(line: &str) -> bool {
        line.match_indices("log::").any(|(at, _)| {
            !line[..at]
                .chars()
                .next_back()
                .is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':')
        })
    }

    #[test]
    fn finds_the_log_crate_only() {
        assert!(names_the_log_crate("use log::Log;"));
        assert!(names_the_log_crate("    log::info!(\"x\");"));
        assert!(!names_the_log_crate("use aya_log::EbpfLogger;"));
        assert!(!names_the_log_crate("let d = dialog::open();"));
        assert!(!names_the_log_crate("use super::log::LogForwarder;"));
    }

    /// `log` is aya-log's interface only: everything else logs with `tracing`.
    #[test]
    fn only_this_module_uses_the_log_crate() {
        let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut offenders = Vec::new();
        let mut dirs = vec![src.clone()];
        while let Some(dir) = dirs.pop() {
            for entry in fs::read_dir(&dir).into_iter().flatten().flatten() {
                let path = entry.path();
                if path.is_dir() {
                    dirs.push(path);
                } else if path.extension().is_some_and(|ext| ext == "rs")
                    && path != src.join("bpf/log.rs")
                {
                    let text = fs::read_to_string(&path).unwrap_or_default();
                    if text.lines().any(|line| {
                        let line = line.trim_start();
                        !line.starts_with("//") && names_the_log_crate(line)
                    }) {
                        offenders.push(path);
                    }
                }
            }
        }
        assert!(
            offenders.is_empty(),
            "the log crate is used in {offenders:?}"
        );
    }
}
