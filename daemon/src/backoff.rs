//! Capped, jittered exponential backoff.

use std::time::Duration;

/// Delays that double from `initial` up to `max`; each one is drawn uniformly
/// from its upper half, so clients that failed together do not come back
/// together.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration) -> Self {
        let initial = initial.min(max);
        Self {
            initial,
            max,
            next: initial,
        }
    }

    /// The next delay to wait.
    pub fn next_delay(&mut self) -> Duration {
        let ceiling = self.next;
        self.next = (self.next * 2).min(self.max);
        ceiling.mul_f64(rand::random_range(0.5..=1.0))
    }

    /// Back to the initial delay, after a success.
    pub fn reset(&mut self) {
        self.next = self.initial;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_cap_and_resets() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let ceilings = [100, 200, 400, 800, 1000, 1000];
        for ceiling in ceilings {
            let delay = backoff.next_delay();
            let ceiling = Duration::from_millis(ceiling);
            assert!(
                delay <= ceiling && delay >= ceiling / 2,
                "{delay:?} for {ceiling:?}"
            );
        }
        backoff.reset();
        assert!(backoff.next_delay() <= Duration::from_millis(100));
    }
}
