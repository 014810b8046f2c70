//! The eBPF object embedded at build time (see `agent/build.rs`).

use super::Error;

/// The bytes of the eBPF object, or [`Error::ObjectNotBuilt`] when the agent was
/// built before `cargo xtask build-ebpf` had run.
pub(super) fn bytes() -> Result<&'static [u8], Error> {
    #[cfg(census_ebpf_object)]
    {
        static OBJECT: &[u8] = aya::include_bytes_aligned!(env!("CENSUS_EBPF_OBJECT_PATH"));
        Ok(OBJECT)
    }
    #[cfg(not(census_ebpf_object))]
    {
        Err(Error::ObjectNotBuilt)
    }
}

/// Whether this build embeds the eBPF object.
pub fn is_embedded() -> bool {
    cfg!(census_ebpf_object)
}
