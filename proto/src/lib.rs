//! census's wire protocol (gRPC, generated from `proto/census/v1/census.proto`), the
//! label model, and the domain types agent and operator share, with the conversions
//! between wire and domain at one edge.
#![forbid(unsafe_code)]

pub mod convert;
pub mod domain;
pub mod labels;
#[cfg(feature = "grpc")]
pub mod status;
pub mod text;

/// Generated from `proto/census/v1/census.proto` by `cargo xtask codegen`.
#[allow(
    missing_debug_implementations,
    unreachable_pub,
    unused_qualifications,
    clippy::all,
    clippy::pedantic
)]
pub mod pb {
    include!("generated/census.v1.rs");

    /// The encoded `FileDescriptorSet`, for gRPC reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!("generated/census.v1.bin");
}

/// The protocol version this build speaks. Carried by every request and by Hello.
pub const PROTOCOL_VERSION: u32 = 1;
