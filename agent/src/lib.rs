//! census agent
pub mod bpf;
