//! What a run writes: a folder per run, JSON, and the lines people read.

use std::{
    fmt::Display,
    path::{Path, PathBuf},
    time::{SystemTime, UNIX_EPOCH},
};

use anyhow::Context as _;
use serde::Serialize;

/// Prints one line of a preset's parameters, progress or summary.
#[expect(clippy::print_stdout, reason = "the benchmark's report is its output")]
pub(crate) fn say(line: impl Display) {
    println!("{line}");
}

/// Prints a serializable value as indented `key: value` lines.
pub(crate) fn say_params(title: &str, params: &impl Serialize) {
    say(format!("{title}:"));
    if let Ok(serde_json::Value::Object(map)) = serde_json::to_value(params) {
        for (k, v) in map {
            say(format!("  {k:<28} {v}"));
        }
    }
}

/// The folder of one run.
#[derive(Debug)]
pub(crate) struct Results {
    dir: PathBuf,
}

impl Results {
    /// `<out>/<preset>-<UTC timestamp>/`.
    pub(crate) fn create(out: &Path, preset: &str) -> anyhow::Result<Self> {
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let dir = out.join(format!("{preset}-{}", timestamp(secs)));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Self { dir })
    }

    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    pub(crate) fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    pub(crate) fn write_json(&self, name: &str, value: &impl Serialize) -> anyhow::Result<()> {
        let path = self.path(name);
        let text = serde_json::to_string_pretty(value)?;
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
    }
}

/// `YYYYmmdd-HHMMSS` in UTC, from seconds since the epoch (no date crate needed).
fn timestamp(secs: u64) -> String {
    let days = secs / 86_400;
    let rem = secs % 86_400;
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}{m:02}{d:02}-{:02}{:02}{:02}",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

/// The machine a run was measured on, and how busy it was.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Machine {
    pub(crate) cpu: String,
    pub(crate) cores: usize,
    pub(crate) memory_gib: f64,
    pub(crate) kernel: String,
    /// 1-minute load average when the run started and ended.
    pub(crate) load_start: f64,
    pub(crate) load_end: f64,
}

impl Machine {
    pub(crate) fn now() -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .and_then(|l| l.split_once(':'))
            .map_or_else(|| "unknown".to_owned(), |(_, v)| v.trim().to_owned());
        let memory_gib = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| {
                m.lines()
                    .find_map(|l| l.strip_prefix("MemTotal:"))
                    .and_then(|v| v.split_whitespace().next())
                    .and_then(|v| v.parse::<f64>().ok())
            })
            .map_or(0.0, |kb| kb / 1024.0 / 1024.0);
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_owned())
            .unwrap_or_default();
        let load = load();
        Self {
            cpu,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            memory_gib,
            kernel,
            load_start: load,
            load_end: load,
        }
    }

    pub(crate) fn finish(&mut self) {
        self.load_end = load();
    }

    pub(crate) fn line(&self) -> String {
        format!(
            "machine: {} x{} cores, {:.0} GiB, kernel {}; load average {:.2} at start, {:.2} at end",
            self.cpu, self.cores, self.memory_gib, self.kernel, self.load_start, self.load_end
        )
    }
}

fn load() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0.0)
}

pub(crate) fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

pub(crate) fn kib(bytes: i64) -> String {
    format!("{:+.1} KiB", bytes as f64 / 1024.0)
}
