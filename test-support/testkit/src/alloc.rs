//! A global allocator for tests that measure what one component holds: the system
//! allocator, counting per thread the bytes allocated and not freed.
//!
//! Run the component (its runtime, clients and connections) on a thread of its own
//! and read [`thread_net_bytes`] there; whatever else the test process does on other
//! threads (a fake API server and its growing store, say) is not counted. Memory
//! allocated on one thread and freed on another is counted on both, so measure
//! components that keep their work on their thread (a current-thread runtime).
//!
//! ```ignore
//! #[global_allocator]
//! static GLOBAL: census_testkit::alloc::PerThreadCounting = census_testkit::alloc::PerThreadCounting;
//! ```

use std::{
    alloc::{GlobalAlloc, Layout, System},
    cell::Cell,
};

thread_local! {
    // Const-initialized, without a destructor: using it never allocates.
    static NET: Cell<i64> = const { Cell::new(0) };
}

fn count(delta: i64) {
    let _ = NET.try_with(|net| net.set(net.get() + delta));
}

fn size(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Bytes this thread allocated and has not freed, through [`PerThreadCounting`].
pub fn thread_net_bytes() -> i64 {
    NET.try_with(Cell::get).unwrap_or(0)
}

/// The system allocator, counting per thread (see the module docs).
#[derive(Debug, Default, Clone, Copy)]
pub struct PerThreadCounting;

#[allow(unsafe_code)]
// SAFETY: every method forwards to `System` with the caller's arguments, so
// `System` upholds the `GlobalAlloc` contract; the counting beside it touches
// only a const-initialized thread-local `Cell` that never allocates.
unsafe impl GlobalAlloc for PerThreadCounting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is (see the impl).
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            count(size(layout.size()));
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is (see the impl).
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            count(size(layout.size()));
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as is (see the impl).
        unsafe { System.dealloc(ptr, layout) };
        count(-size(layout.size()));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded as is (see the impl).
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            count(size(new_size) - size(layout.size()));
        }
        new
    }
}
