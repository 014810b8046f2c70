//! What is measured: the operator's RSS and CPU from `/proc/<pid>`, and everything
//! else from its `/metrics` (live heap, identities by state, corrections, snapshot
//! apply histogram), sampled every second by a background task.

use std::{collections::BTreeMap, net::SocketAddr, sync::Arc, time::Duration};

use anyhow::{Context as _, bail};
use parking_lot::Mutex;
use serde::Serialize;
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpStream,
    sync::watch,
    task::JoinHandle,
    time::Instant,
};

/// A minimal HTTP/1.1 GET (the admin port speaks HTTP/1): status and body.
pub(crate) async fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, Vec<u8>)> {
    let fetch = async {
        let mut stream = TcpStream::connect(addr).await?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await?;
        anyhow::Ok(raw)
    };
    let raw = tokio::time::timeout(Duration::from_secs(10), fetch)
        .await
        .context("HTTP GET timed out")??;
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("no end of HTTP headers")?;
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("no HTTP status")?;
    let body = &raw[split + 4..];
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
    });
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_vec()
    };
    Ok((status, body))
}

fn dechunk(mut body: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = body
            .windows(2)
            .position(|w| w == b"\r\n")
            .context("bad chunk")?;
        let size_text = String::from_utf8_lossy(&body[..line_end]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .context("bad chunk size")?;
        body = &body[line_end + 2..];
        if size == 0 {
            return Ok(out);
        }
        if body.len() < size + 2 {
            bail!("truncated chunk");
        }
        out.extend_from_slice(&body[..size]);
        body = &body[size + 2..];
    }
}

/// One scrape of `/metrics`, parsed.
#[derive(Debug, Default, Clone)]
pub(crate) struct Metrics {
    /// `name{labels}` (labels as written) -> value.
    values: BTreeMap<String, f64>,
}

impl Metrics {
    pub(crate) async fn scrape(admin: SocketAddr) -> anyhow::Result<Self> {
        let (status, body) = http_get(admin, "/metrics").await?;
        if status != 200 {
            bail!("/metrics answered {status}");
        }
        Ok(Self::parse(&String::from_utf8_lossy(&body)))
    }

    pub(crate) fn parse(text: &str) -> Self {
        let mut values = BTreeMap::new();
        for line in text.lines() {
            if line.starts_with('#') || line.is_empty() {
                continue;
            }
            let Some((key, value)) = line.rsplit_once(' ') else {
                continue;
            };
            if let Ok(v) = value.parse::<f64>() {
                values.insert(key.to_owned(), v);
            }
        }
        Self { values }
    }

    /// A metric without labels, or with exactly these labels (`state="live"`).
    pub(crate) fn get(&self, name: &str, labels: &str) -> Option<f64> {
        if labels.is_empty() {
            self.values.get(name).copied()
        } else {
            self.values.get(&format!("{name}{{{labels}}}")).copied()
        }
    }

    pub(crate) fn or_zero(&self, name: &str, labels: &str) -> f64 {
        self.get(name, labels).unwrap_or(0.0)
    }

    /// Every series of `name` by the value of its one label `label`.
    pub(crate) fn labelled(&self, name: &str, label: &str) -> BTreeMap<String, u64> {
        let prefix = format!("{name}{{{label}=\"");
        self.values
            .iter()
            .filter_map(|(k, v)| {
                let value = k.strip_prefix(&prefix)?.strip_suffix("\"}")?;
                Some((value.to_owned(), *v as u64))
            })
            .collect()
    }

    pub(crate) fn identities(&self, state: &str) -> u64 {
        self.or_zero("census_identities", &format!("state=\"{state}\"")) as u64
    }

    /// Identities that are not gone: live, protected, creating, released, deleting.
    pub(crate) fn bound(&self) -> u64 {
        ["live", "protected", "creating", "released", "deleting"]
            .iter()
            .map(|s| self.identities(s))
            .sum()
    }

    pub(crate) fn heap(&self) -> Option<u64> {
        self.get("census_process_heap_live_bytes", "")
            .map(|v| v as u64)
    }

    /// Cumulative histogram buckets `(upper bound, count)` of `name`.
    pub(crate) fn histogram(&self, name: &str) -> Vec<(f64, f64)> {
        let prefix = format!("{name}_bucket{{le=\"");
        let mut buckets: Vec<(f64, f64)> = self
            .values
            .iter()
            .filter_map(|(k, v)| {
                let le = k.strip_prefix(&prefix)?.strip_suffix("\"}")?;
                let bound = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().ok()?
                };
                Some((bound, *v))
            })
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        buckets
    }
}

/// A quantile of the observations between two scrapes of a histogram, by linear
/// interpolation inside the bucket (as Prometheus' `histogram_quantile`).
pub(crate) fn histogram_quantile(
    before: &[(f64, f64)],
    after: &[(f64, f64)],
    q: f64,
) -> Option<f64> {
    let delta: Vec<(f64, f64)> = after
        .iter()
        .map(|(le, n)| {
            let old = before
                .iter()
                .find(|(b, _)| b == le)
                .map_or(0.0, |(_, n)| *n);
            (*le, n - old)
        })
        .collect();
    let total = delta.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut lower = 0.0;
    let mut below = 0.0;
    for (le, count) in delta {
        if count >= rank {
            if le.is_infinite() {
                return Some(lower);
            }
            let inside = count - below;
            let share = if inside > 0.0 {
                (rank - below) / inside
            } else {
                1.0
            };
            return Some(lower + (le - lower) * share);
        }
        lower = le;
        below = count;
    }
    None
}

/// Latency figures of a set of observations, in microseconds.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Latency {
    pub(crate) count: usize,
    pub(crate) p50_us: f64,
    pub(crate) p99_us: f64,
    pub(crate) p999_us: f64,
    pub(crate) max_us: f64,
}

impl Latency {
    pub(crate) fn of(mut samples: Vec<Duration>) -> Self {
        if samples.is_empty() {
            return Self::default();
        }
        samples.sort_unstable();
        let at = |q: f64| {
            let i = ((samples.len() as f64 - 1.0) * q).round() as usize;
            samples[i.min(samples.len() - 1)].as_secs_f64() * 1e6
        };
        Self {
            count: samples.len(),
            p50_us: at(0.5),
            p99_us: at(0.99),
            p999_us: at(0.999),
            max_us: at(1.0),
        }
    }
}

/// `/proc/<pid>`: resident set size (VmRSS) and CPU time.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Proc {
    pub(crate) rss: u64,
    pub(crate) cpu: Duration,
}

impl Proc {
    pub(crate) fn read(pid: u32) -> anyhow::Result<Self> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        let rss_kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .context("no VmRSS")?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
        Ok(Self {
            rss: rss_kb * 1024,
            cpu: cpu_of_stat(&stat)?,
        })
    }

    /// This process (the harness), for its own CPU share.
    pub(crate) fn own_cpu() -> anyhow::Result<Duration> {
        cpu_of_stat(&std::fs::read_to_string("/proc/self/stat")?)
    }
}

fn cpu_of_stat(stat: &str) -> anyhow::Result<Duration> {
    // Fields after the command name (which may hold spaces), from field 3 on.
    let rest = stat.rsplit_once(')').context("bad stat")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields
        .get(11)
        .zip(fields.get(12))
        .and_then(|(u, s)| Some(u.parse::<u64>().ok()? + s.parse::<u64>().ok()?))
        .context("no utime/stime")?;
    let hz = rustix::param::clock_ticks_per_second().max(1);
    Ok(Duration::from_nanos(ticks * 1_000_000_000 / hz))
}

/// One sample, every second.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Sample {
    /// Seconds since the sampler started.
    pub(crate) t: f64,
    pub(crate) phase: String,
    pub(crate) rss_bytes: u64,
    pub(crate) heap_live_bytes: Option<u64>,
    /// CPU time over wall time since the previous sample (1.0 = one core).
    pub(crate) cpu_share: f64,
    /// The harness's own CPU share, as the operator's neighbour on the same cores.
    pub(crate) harness_cpu_share: f64,
    pub(crate) identities_live: u64,
    pub(crate) identities_released: u64,
    pub(crate) identities_deleting: u64,
    pub(crate) identities_quarantined: u64,
    pub(crate) identities_creating: u64,
    pub(crate) corrections: u64,
    pub(crate) endpoints: u64,
    pub(crate) gc_deleted: u64,
}

#[derive(Debug, Default)]
struct Shared {
    samples: Vec<Sample>,
    phase: String,
    pid: u32,
    admin: Option<SocketAddr>,
}

/// Samples the operator every second until stopped. The target (pid, admin port)
/// can change, for restarts.
#[derive(Debug)]
pub(crate) struct Sampler {
    shared: Arc<Mutex<Shared>>,
    stop: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
    started: Instant,
}

impl Sampler {
    pub(crate) fn start(pid: u32, admin: SocketAddr, every: Duration) -> Self {
        let shared = Arc::new(Mutex::new(Shared {
            pid,
            admin: Some(admin),
            phase: "start".into(),
            ..Shared::default()
        }));
        let (stop, mut stopped) = watch::channel(false);
        let started = Instant::now();
        let task = {
            let shared = shared.clone();
            tokio::spawn(async move {
                let mut interval = tokio::time::interval(every);
                interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let mut last: Option<(Instant, Duration, Duration)> = None;
                loop {
                    tokio::select! {
                        _ = interval.tick() => {}
                        _ = stopped.changed() => return,
                    }
                    let (pid, admin, phase) = {
                        let s = shared.lock();
                        (s.pid, s.admin, s.phase.clone())
                    };
                    let Some(admin) = admin else { continue };
                    let Ok(proc_now) = Proc::read(pid) else {
                        continue;
                    };
                    let Ok(metrics) = Metrics::scrape(admin).await else {
                        continue;
                    };
                    let own = Proc::own_cpu().unwrap_or_default();
                    let now = Instant::now();
                    let (cpu_share, harness_cpu_share) = match last {
                        Some((t, cpu, own_before)) if now > t => {
                            let wall = (now - t).as_secs_f64();
                            (
                                proc_now.cpu.saturating_sub(cpu).as_secs_f64() / wall,
                                own.saturating_sub(own_before).as_secs_f64() / wall,
                            )
                        }
                        _ => (0.0, 0.0),
                    };
                    last = Some((now, proc_now.cpu, own));
                    let sample = Sample {
                        t: (now - started).as_secs_f64(),
                        phase,
                        rss_bytes: proc_now.rss,
                        heap_live_bytes: metrics.heap(),
                        cpu_share,
                        harness_cpu_share,
                        identities_live: metrics.identities("live"),
                        identities_released: metrics.identities("released"),
                        identities_deleting: metrics.identities("deleting"),
                        identities_quarantined: metrics.identities("quarantined"),
                        identities_creating: metrics.identities("creating"),
                        corrections: metrics.or_zero("census_corrections_total", "") as u64,
                        endpoints: metrics.or_zero("census_endpoints", "") as u64,
                        gc_deleted: metrics
                            .or_zero("census_gc_outcomes_total", "outcome=\"deleted\"")
                            as u64,
                    };
                    shared.lock().samples.push(sample);
                }
            })
        };
        Self {
            shared,
            stop,
            task: Some(task),
            started,
        }
    }

    pub(crate) fn set_phase(&self, phase: impl Into<String>) {
        self.shared.lock().phase = phase.into();
    }

    /// Points the sampler at another process (after a restart); `None` pauses it.
    pub(crate) fn retarget(&self, target: Option<(u32, SocketAddr)>) {
        let mut s = self.shared.lock();
        match target {
            Some((pid, admin)) => {
                s.pid = pid;
                s.admin = Some(admin);
            }
            None => s.admin = None,
        }
    }

    pub(crate) fn elapsed(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// Samples so far.
    pub(crate) fn samples(&self) -> Vec<Sample> {
        self.shared.lock().samples.clone()
    }

    /// Samples taken from `since` (seconds since start) on.
    pub(crate) fn samples_since(&self, since: f64) -> Vec<Sample> {
        self.shared
            .lock()
            .samples
            .iter()
            .filter(|s| s.t >= since)
            .cloned()
            .collect()
    }

    pub(crate) async fn stop(mut self) -> Vec<Sample> {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
        self.samples()
    }
}

/// The median of some values.
pub(crate) fn median(mut values: Vec<u64>) -> u64 {
    if values.is_empty() {
        return 0;
    }
    values.sort_unstable();
    values[values.len() / 2]
}
