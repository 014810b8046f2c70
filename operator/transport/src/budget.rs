//! The bytes of large messages in flight, shared by every stream: a message above
//! the request limit (a snapshot) reserves its declared length before its first
//! byte is buffered (`codec`), and waits for room when others hold the budget, so
//! a herd of large snapshots is taken a few at a time instead of all at once.

use std::{future::Future, sync::Arc};

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The bytes of large messages being received at once, shared by every stream. A reservation is a semaphore's permits, one per byte: waiters are
/// served in order, so a large message is not starved by smaller ones.
#[derive(Debug, Clone)]
pub struct MessageBudget {
    permits: Arc<Semaphore>,
    total: usize,
    reserved: Gauge,
}

/// A reservation of a [`MessageBudget`]: given back when dropped.
#[derive(Debug)]
pub struct Reserved {
    _permit: OwnedSemaphorePermit,
    bytes: usize,
    reserved: Gauge,
}

impl Drop for Reserved {
    fn drop(&mut self) {
        self.reserved.dec_by(self.bytes as i64);
    }
}

impl MessageBudget {
    pub fn new(total: usize, reserved: Gauge) -> Self {
        let total = total.min(Semaphore::MAX_PERMITS);
        Self {
            permits: Arc::new(Semaphore::new(total)),
            total,
            reserved,
        }
    }

    /// The whole budget in bytes.
    pub fn total(&self) -> usize {
        self.total
    }

    /// Bytes reserved now.
    pub fn in_use(&self) -> usize {
        self.total - self.permits.available_permits()
    }

    fn reserved(&self, permit: OwnedSemaphorePermit, bytes: usize) -> Reserved {
        self.reserved.inc_by(bytes as i64);
        Reserved {
            _permit: permit,
            bytes,
            reserved: self.reserved.clone(),
        }
    }

    /// `bytes` at once if there is room and nobody waits before them.
    pub fn try_reserve(&self, bytes: usize) -> Option<Reserved> {
        let n = u32::try_from(bytes).ok()?;
        let permit = Arc::clone(&self.permits).try_acquire_many_owned(n).ok()?;
        Some(self.reserved(permit, bytes))
    }

    /// `bytes` once there is room (never, when `bytes` is over the whole budget: the
    /// message limit is checked against it at start).
    pub fn reserve(&self, bytes: usize) -> impl Future<Output = Option<Reserved>> + Send + 'static {
        let budget = self.clone();
        async move {
            let n = u32::try_from(bytes).ok()?;
            let permit = Arc::clone(&budget.permits)
                .acquire_many_owned(n)
                .await
                .ok()?;
            Some(budget.reserved(permit, bytes))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    #[tokio::test]
    async fn the_budget_reserves_in_order_and_gives_back_on_drop() -> TestResult {
        let reserved = Gauge::default();
        let budget = MessageBudget::new(100, reserved.clone());
        let sixty = budget.try_reserve(60).ok_or("no room for 60 of 100")?;
        assert!(budget.try_reserve(50).is_none());
        assert_eq!((budget.in_use(), reserved.get()), (60, 60));
        let waiting = tokio::spawn(budget.reserve(50));
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        assert!(
            budget.try_reserve(10).is_none(),
            "a small message does not pass one that waits"
        );
        drop(sixty);
        let fifty = waiting.await?.ok_or("the budget closed")?;
        assert_eq!(budget.in_use(), 50);
        drop(fifty);
        assert_eq!((budget.in_use(), reserved.get()), (0, 0));
        Ok(())
    }
}
