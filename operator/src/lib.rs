//! census operator: the identity allocator, its stores, the gRPC services and the daemon.
#![forbid(unsafe_code)]

pub mod allocator;
pub mod store;
