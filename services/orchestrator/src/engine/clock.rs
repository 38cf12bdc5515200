//! The engine's clock: wall-clock milliseconds that follow tokio's clock.

use std::time::Duration;

/// Wall-clock milliseconds that follow tokio's clock, so tests with paused time drive every
/// timer, back-off and lease deterministically.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    base_ms: i64,
    base: tokio::time::Instant,
}

impl Clock {
    /// A clock reading the system time now and advancing with `tokio::time::Instant`.
    pub fn new() -> Self {
        let base_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
            .unwrap_or(0);
        Self {
            base_ms,
            base: tokio::time::Instant::now(),
        }
    }

    /// Now, in unix milliseconds.
    pub fn now_ms(&self) -> i64 {
        self.base_ms + i64::try_from(self.base.elapsed().as_millis()).unwrap_or(i64::MAX / 2)
    }

    /// The tokio instant of unix millisecond `ms` (now or later; an earlier `ms` is the
    /// clock's start).
    pub fn instant_at(&self, ms: i64) -> tokio::time::Instant {
        let offset = u64::try_from(ms.saturating_sub(self.base_ms)).unwrap_or(0);
        self.base + Duration::from_millis(offset)
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

/// `d` in whole milliseconds (saturating far beyond any timer).
pub(crate) fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 4)
}
