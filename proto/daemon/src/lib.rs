//! Process plumbing shared by census's daemons (the operator and the agent):
//!
//! - [`alloc`]: the global allocator, jemalloc, with a counter of live heap bytes
//!   and the jemalloc options that make freed memory go back to the OS;
//! - [`profiling`]: jemalloc heap profiles in pprof format at `/debug/pprof/heap`,
//!   compiled in, inactive unless the daemon runs with `--heap-profiling`;
//! - [`metrics`]: a Prometheus collector for the process's resident memory and live
//!   heap;
//! - [`thread_count`]: for tests, a global allocator that counts live bytes per
//!   thread, to measure what one component holds.
//!
//! A daemon declares the allocator in its `main.rs`, merges [`profiling::routes`]
//! into its admin router (never the gRPC port), registers
//! [`metrics::ProcessCollector`] and flattens [`profiling::ProfilingArgs`] into its
//! command line.

pub mod alloc;
pub mod metrics;
pub mod profiling;
pub mod thread_count;

pub use self::{
    alloc::{DaemonAllocator, live_heap_bytes},
    metrics::ProcessCollector,
    profiling::{ProfilingArgs, ProfilingError},
    thread_count::{PerThreadCounting, thread_net_bytes},
};
