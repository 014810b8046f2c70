//! census's node agent (`census-agent`, [`daemon`]): endpoints from a [`source`] go
//! through the core ([`endpoints`]), get identities from the operator (`identities`),
//! are written to the datapath ([`reconcile`] over [`bpf`]) and reported to the
//! operator (`sync`); [`admin`] serves metrics, health and the JSON API.
//!
//! The public API is what the two binaries and the benchmarks use: the datapath and
//! its pinned maps ([`bpf`]), the admin API's types ([`admin::api`], which the `census`
//! CLI reads), the command line ([`config`]), the endpoint [`source`]s, the host's
//! addresses ([`host`]) and the [`daemon`]; the core, reconcile and metrics are public
//! for the reconcile-throughput benchmark (`benches/agent.rs`). The operator clients
//! and their plumbing are private. `unsafe` is denied everywhere (workspace lints)
//! but in `bpf`'s raw `bpf(2)` calls.
pub mod admin;
mod backoff;
pub mod bpf;
pub mod config;
pub mod daemon;
pub mod endpoints;
pub mod host;
mod identities;
pub mod metrics;
pub mod reconcile;
mod shutdown;
pub mod source;
mod sync;
