//! The time the core is given.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crate::allocator::Timestamp;

/// Wall-clock milliseconds that never go backwards within the process: a monotonic
/// clock anchored at the wall-clock time of start.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    start: Instant,
    start_ms: u64,
}

impl Clock {
    pub fn new() -> Self {
        let start_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        Self {
            start: Instant::now(),
            start_ms,
        }
    }

    pub fn now(&self) -> Timestamp {
        Timestamp::from_millis(self.start_ms + self.start.elapsed().as_millis() as u64)
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}
