//! The daemons' global allocator: jemalloc behind a counter of live heap bytes.
//!
//! # Why jemalloc, and the options that make RSS come back
//!
//! glibc malloc keeps freed memory in per-thread arenas and returns it to the OS only
//! from the top of the heap, so a daemon whose maps grew and shrank can keep its peak
//! RSS for good. jemalloc purges unused pages on a clock instead. [`MALLOC_CONF`]
//! sets:
//!
//! - `background_thread:true`: purging runs on jemalloc's own thread, so memory goes
//!   back even while the daemon is idle (without it, decay only advances when the
//!   process allocates);
//! - `dirty_decay_ms:1000`: freed pages are returned (`MADV_DONTNEED`) within about a
//!   second instead of jemalloc's default 10 s;
//! - `muzzy_decay_ms:0`: no `MADV_FREE` stage, whose pages still count in RSS until
//!   the kernel is short of memory;
//! - `prof:true,prof_active:false,lg_prof_sample:19`: heap profiling compiled in and
//!   off; [`crate::profiling::activate`] turns sampling on (one sample per 512 KiB
//!   allocated, on average).
//!
//! # The live heap counter
//!
//! Bytes requested and not yet freed, summed over sharded atomics (one shard per
//! thread, 16 shards), so the count is exact and cheap: one uncontended atomic add per
//! allocation (measured in `benches/alloc.rs`, see docs/benchmarks.md). It is what
//! the benchmarks gate on: unlike RSS it does not depend on when the allocator gives
//! pages back.

use std::{
    alloc::{GlobalAlloc, Layout},
    cell::Cell,
    sync::atomic::{AtomicIsize, AtomicUsize, Ordering},
};

use tikv_jemallocator::Jemalloc;

/// jemalloc's options, read once when it initializes (see the module docs).
pub const MALLOC_CONF: &str = "background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0,prof:true,prof_active:false,lg_prof_sample:19";

/// The C string jemalloc reads: [`MALLOC_CONF`] with its terminating NUL.
const MALLOC_CONF_C: &[u8] = b"background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0,prof:true,prof_active:false,lg_prof_sample:19\0";

// jemalloc (built with the `_rjem_` prefix by tikv-jemalloc-sys) reads its options
// from the C global `const char *_rjem_malloc_conf`, a weak symbol this definition
// replaces. A `&u8` is a thin pointer, laid out like `const char *`.
#[allow(unsafe_code, non_upper_case_globals)]
// SAFETY: the symbol is defined nowhere else in the program (jemalloc's own is
// weak); the value is a pointer to a NUL-terminated string with static lifetime,
// which is what jemalloc expects and only ever reads.
#[unsafe(export_name = "_rjem_malloc_conf")]
pub static _rjem_malloc_conf: &u8 = &MALLOC_CONF_C[0];

const SHARDS: usize = 16;

/// One counter per cache line, so threads on different shards never contend.
#[repr(align(128))]
struct Shard(AtomicIsize);

static LIVE: [Shard; SHARDS] = [const { Shard(AtomicIsize::new(0)) }; SHARDS];
/// Threads that have allocated through the counter; 0 means it is not installed.
static THREADS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    // Const-initialized and without a destructor: reading it never allocates, so it
    // is safe inside the allocator, also while a thread is being torn down.
    static SHARD: Cell<usize> = const { Cell::new(usize::MAX) };
}

#[inline]
fn shard() -> usize {
    SHARD
        .try_with(|s| {
            let mine = s.get();
            if mine != usize::MAX {
                return mine;
            }
            let mine = THREADS.fetch_add(1, Ordering::Relaxed) % SHARDS;
            s.set(mine);
            mine
        })
        .unwrap_or(0)
}

#[inline]
fn count(delta: isize) {
    LIVE[shard()].0.fetch_add(delta, Ordering::Relaxed);
}

/// Live heap bytes (requested and not yet freed) of the process, or `None` when
/// [`CountingJemalloc`] is not its global allocator (tests, benchmarks).
pub fn live_heap_bytes() -> Option<u64> {
    if THREADS.load(Ordering::Relaxed) == 0 {
        return None;
    }
    let total: isize = LIVE.iter().map(|s| s.0.load(Ordering::Relaxed)).sum();
    Some(total.max(0) as u64)
}

/// jemalloc, counting live heap bytes. Declare it in the daemon's `main.rs`:
///
/// ```ignore
/// #[global_allocator]
/// static GLOBAL: census_daemon::CountingJemalloc = census_daemon::CountingJemalloc::new();
/// ```
#[derive(Debug, Default)]
pub struct CountingJemalloc {
    inner: Jemalloc,
}

impl CountingJemalloc {
    pub const fn new() -> Self {
        Self { inner: Jemalloc }
    }
}

// SAFETY: every call is forwarded to jemalloc with the caller's arguments unchanged,
// so jemalloc's implementation upholds the `GlobalAlloc` contract; the counter only
// observes sizes and never allocates.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for CountingJemalloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller upholds `alloc`'s contract, which is jemalloc's.
        let p = unsafe { self.inner.alloc(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let p = unsafe { self.inner.alloc_zeroed(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller passes a block this allocator (jemalloc) returned, with
        // its layout.
        unsafe { self.inner.dealloc(ptr, layout) };
        count(-(layout.size() as isize));
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as for `dealloc`, and `new_size` is valid per the caller's contract.
        let p = unsafe { self.inner.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(new_size as isize - layout.size() as isize);
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_conf_string_is_its_c_string() {
        assert_eq!(MALLOC_CONF_C.last(), Some(&0));
        assert_eq!(
            &MALLOC_CONF_C[..MALLOC_CONF_C.len() - 1],
            MALLOC_CONF.as_bytes()
        );
    }

    #[test]
    fn counts_what_it_hands_out_and_takes_back() -> Result<(), std::alloc::LayoutError> {
        let a = CountingJemalloc::new();
        let layout = Layout::from_size_align(4096, 8)?;
        let sum = || {
            LIVE.iter()
                .map(|s| s.0.load(Ordering::Relaxed))
                .sum::<isize>()
        };
        let before = sum();
        #[allow(unsafe_code)]
        // SAFETY: the block is allocated, grown and freed with matching layouts.
        unsafe {
            let p = a.alloc(layout);
            assert!(!p.is_null());
            assert_eq!(sum() - before, 4096);
            let p = a.realloc(p, layout, 10_000);
            assert!(!p.is_null());
            assert_eq!(sum() - before, 10_000);
            a.dealloc(p, Layout::from_size_align(10_000, 8)?);
        }
        assert_eq!(sum(), before);
        assert!(live_heap_bytes().is_some());
        Ok(())
    }
}
