//! census operator: the identity allocator core, its stores, the gRPC services and
//! the daemon around them.
#![forbid(unsafe_code)]

pub mod admin;
pub mod allocator;
pub mod config;
pub mod daemon;
pub mod grpc;
pub mod k8s;
pub mod metrics;
pub mod replica;
pub mod runtime;
pub mod store;
pub mod writer;
