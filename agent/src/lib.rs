//! census's node agent and the `census` CLI.
//!
//! The agent (`census-agent`, [`daemon`]): endpoints from a [`source`] go through the
//! core ([`endpoints`]), get identities from the operator ([`identities`]), are written
//! to the datapath ([`reconcile`] over [`bpf`]) and reported to the operator
//! ([`sync`]); [`admin`] serves metrics, health and the JSON API. `unsafe` is denied
//! everywhere (workspace lints) but in `bpf`'s raw `bpf(2)` calls.
pub mod admin;
pub mod backoff;
pub mod bpf;
pub mod cli;
pub mod config;
pub mod daemon;
pub mod endpoints;
pub mod host;
pub mod identities;
pub mod metrics;
pub mod reconcile;
pub mod shutdown;
pub mod source;
pub mod sync;
#[cfg(test)]
mod testing;
