//! census operator: the identity allocator core, its stores, the gRPC services and
//! the daemon around them.
//!
//! The public API is what the daemon is made of and what its component tests and
//! benchmarks compose: the core ([`allocator`]), the [`store`]s, leadership
//! ([`replica`], [`k8s`]), the [`runtime`] that feeds the core and its store
//! [`writer`]s, the [`api`] through which the gRPC services reach the runtime,
//! the cluster's Service addresses ([`services`]), [`metrics`], the command line ([`config`]) and the [`daemon`] that starts it all.
//! The gRPC services and the admin port are reached only over the network, and are
//! private.
#![forbid(unsafe_code)]

pub use census_allocator as allocator;

mod admin;
pub mod api;
pub mod certs;
pub mod config;
pub mod daemon;
mod grpc;
pub mod k8s;
#[cfg(test)]
mod layering;
pub mod metrics;
pub mod replica;
pub mod runtime;
pub mod security;
pub mod services;
pub mod store;
mod summary;
pub mod writer;
