//! Process plumbing shared by census's daemons (the operator and the agent):
//!
//! - [`alloc`]: the global allocator, jemalloc, with a counter of live heap bytes
//!   and the jemalloc options that make freed memory go back to the OS;
//! - [`apiserver`]: the client of the Kubernetes API server, kube's stack over a
//!   connection pool with a cap on idle connections and an idle timeout;
//! - [`watch`]: the one list policy and the one driver of every Kubernetes watch
//!   (a list and a watch that resumes, into a [`watch::Watched`]);
//! - [`backoff`]: capped, jittered exponential backoff;
//! - [`profiling`]: jemalloc heap profiles in pprof format at `/debug/pprof/heap`,
//!   compiled in, inactive unless the daemon runs with `--heap-profiling`;
//! - [`metrics`]: `/metrics` in the Prometheus text format or OpenMetrics, as the
//!   scraper asks, and a Prometheus collector for the process's resident memory and
//!   live heap;
//! - [`http`]: the admin HTTP server, its connections capped and timed;
//! - [`log`]: the `--log`/`--log-format` flags and the `tracing` subscriber;
//! - [`pem`]: the PEM files of TLS flags, read and checked at start;
//! - [`signal`]: waiting for SIGTERM or SIGINT.
//!
//! A daemon declares the allocator in its `main.rs`, flattens [`LogArgs`] and
//! [`ProfilingArgs`] into its command line, merges [`profiling::routes`] into its
//! admin router (never the gRPC port), serves it with [`http::serve`] within the
//! flattened [`http::AdminLimits`], registers [`metrics::ProcessCollector`] and
//! stops on [`signal::shutdown`].

pub mod alloc;
pub mod apiserver;
pub mod backoff;
pub mod fds;
pub mod http;
pub mod log;
pub mod metrics;
pub mod pem;
pub mod profiling;
pub mod signal;
pub mod watch;

pub use self::{
    alloc::{CountingJemalloc, live_heap_bytes},
    log::{LogArgs, LogFormat},
    metrics::ProcessCollector,
    profiling::{ProfilingArgs, ProfilingError},
};
