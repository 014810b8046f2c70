//! What counting live heap bytes costs: alloc + free pairs through plain jemalloc and
//! through [`CountingJemalloc`] (jemalloc plus one atomic add per call), on 1 and 2
//! threads. Run with `cargo bench -p census-daemon --bench alloc`.

#![allow(unsafe_code, clippy::print_stdout)]

use std::{
    alloc::{GlobalAlloc, Layout},
    hint::black_box,
    time::Instant,
};

use census_daemon::CountingJemalloc;
use tikv_jemallocator::Jemalloc;

const PAIRS: usize = 20_000_000;

/// ns per alloc+free pair, over `threads` threads each doing `PAIRS` pairs.
fn measure<A: GlobalAlloc + Sync>(a: &A, threads: usize) -> f64 {
    let started = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            s.spawn(move || {
                // A few blocks stay live, so frees do not always hit the block just
                // allocated.
                let mut held = [(std::ptr::null_mut::<u8>(), 0usize); 8];
                for i in 0..PAIRS {
                    let size = 16 << ((i + t) % 5);
                    let slot = i % held.len();
                    // SAFETY: `size` is non-zero and 8 is a power of two; every block
                    // is freed once, with the size it was allocated with.
                    unsafe {
                        let p = a.alloc(Layout::from_size_align_unchecked(size, 8));
                        black_box(p);
                        let (old, old_size) = std::mem::replace(&mut held[slot], (p, size));
                        if !old.is_null() {
                            a.dealloc(old, Layout::from_size_align_unchecked(old_size, 8));
                        }
                    }
                }
                for (p, size) in held {
                    if !p.is_null() {
                        // SAFETY: as above.
                        unsafe { a.dealloc(p, Layout::from_size_align_unchecked(size, 8)) };
                    }
                }
            });
        }
    });
    started.elapsed().as_nanos() as f64 / PAIRS as f64
}

fn main() {
    println!("alloc+free pair, ns (wall time per pair on each thread; lower is better)\n");
    for threads in [1, 2] {
        // Interleave runs so machine noise hits both alike; keep the best of 3.
        let (mut plain, mut counting) = (f64::MAX, f64::MAX);
        for _ in 0..3 {
            plain = plain.min(measure(&Jemalloc, threads));
            counting = counting.min(measure(&CountingJemalloc::new(), threads));
        }
        println!(
            "{threads} thread(s): jemalloc {plain:.2} ns, jemalloc + live-heap counter {counting:.2} ns ({:+.2} ns, {:+.1}%)",
            counting - plain,
            (counting / plain - 1.0) * 100.0
        );
    }
}
