//! census's node agent (`census-agent`, [`daemon`]). At its heart a synchronous core
//! (the `census-agent-core` crate in `agent/core`: the endpoints, the identity cache,
//! the datapath state they want and the agent's status) with shells around it that know the core and never each other:
//! the endpoint [`source`]s, the allocate client (`allocate`), the EndpointSync
//! client (`sync`), the EndpointMap client (`map`: other nodes' endpoints),
//! reconcile against the datapath (`reconcile` over [`bpf`]) and [`admin`]
//! (metrics, health and the JSON API). The [`daemon`] wires them.
//!
//! The public API is what the two binaries and the benchmarks use: the datapath and
//! its pinned maps ([`bpf`]), the admin API's types ([`admin::api`], which the `census`
//! CLI reads), the command line ([`config`]), the endpoint [`source`]s, the host's
//! addresses ([`host`]), the [`daemon`], and the core with reconcile driven by hand
//! for the reconcile-throughput benchmark ([`bench`]). The core, the operator
//! clients and their plumbing are private. `unsafe` is denied everywhere (workspace
//! lints) but in `bpf`'s raw `bpf(2)` calls.
pub mod admin;
/// The core, a crate of its own (`agent/core`).
pub(crate) use census_agent_core as agent_core;
mod allocate;
mod backoff;
pub mod bench;
pub mod bpf;
pub mod client;
pub mod config;
pub mod daemon;
pub mod host;
#[cfg(test)]
mod layering;
mod links;
mod map;
mod metrics;
mod netlink;
mod reconcile;
mod shutdown;
pub mod source;
mod sync;
