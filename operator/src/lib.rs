//! census operator: the identity allocator core, its stores, the gRPC services and
//! the daemon around them.
#![forbid(unsafe_code)]

pub mod admin;
pub mod allocator;
pub mod config;
pub mod daemon;
pub mod grpc;
pub mod metrics;
pub mod runtime;
pub mod store;
pub mod writer;
