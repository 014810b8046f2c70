//! One-instruction loads of packet data, shared by census's programs and the
//! bench's.

/// The 4 bytes of linear packet data at `address`, as one word in memory order,
/// with one load, aligned or not: an IP header is where the link layer leaves it
/// (2 bytes past a word behind Ethernet), and `read_unaligned` would load it byte
/// by byte. The kernels census runs on (x86-64, arm64) load a misaligned word as
/// an aligned one, and their verifier does not ask packet loads to be aligned.
/// The caller has checked that the 4 bytes are within `data_end`.
#[inline(always)]
pub(crate) fn load_word(address: usize) -> u32 {
    let word: u64;
    // SAFETY: a 4-byte load from packet data the caller checked is in bounds
    // (the verifier checks it again); nothing is written.
    unsafe {
        core::arch::asm!(
            "{word} = *(u32 *)({address} + 0)",
            address = in(reg) address,
            word = lateout(reg) word,
            options(nostack, readonly, preserves_flags),
        );
    }
    #[expect(clippy::cast_possible_truncation, reason = "a 32-bit load")]
    let word = word as u32;
    word
}

/// As [`load_word`], 8 bytes as one 64-bit word in memory order: an IPv6
/// address in two loads.
#[inline(always)]
pub(crate) fn load_dword(address: usize) -> u64 {
    let word: u64;
    // SAFETY: as `load_word`'s, an 8-byte load.
    unsafe {
        core::arch::asm!(
            "{word} = *(u64 *)({address} + 0)",
            address = in(reg) address,
            word = lateout(reg) word,
            options(nostack, readonly, preserves_flags),
        );
    }
    word
}
