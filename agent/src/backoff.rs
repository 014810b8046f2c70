//! Capped, jittered exponential backoff (census-daemon's, shared with the
//! operator), and jittered intervals.

use std::time::Duration;

pub(crate) use census_daemon::backoff::Backoff;

/// `base` plus or minus up to `fraction` of it, uniformly.
pub(crate) fn jittered(base: Duration, fraction: f64) -> Duration {
    let fraction = fraction.clamp(0.0, 1.0);
    base.mul_f64(rand::random_range((1.0 - fraction)..=(1.0 + fraction)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_within_its_fraction() {
        let base = Duration::from_secs(30);
        for _ in 0..1000 {
            let d = jittered(base, 0.1);
            assert!(
                d >= Duration::from_secs(27) && d <= Duration::from_secs(33),
                "{d:?}"
            );
        }
    }
}
