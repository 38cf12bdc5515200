//! Capped exponential back-off, the one schedule every Reach retry loop uses: the router's
//! registry watch, the registry's health probe, the SDK's registration loop and the
//! orchestrator's node retries.
//!
//! A delay starts at `initial`, grows by `multiplier` after each failure and is capped at
//! `max`. Jitter is applied by the caller from a unit value it draws (so a pure caller, such
//! as the orchestrator's decider, passes its seeded RNG's draw), following the "full range
//! multiplicative jitter" of the AWS Architecture Blog's *Exponential Backoff And Jitter*.

use std::time::Duration;

/// A capped exponential schedule: `initial × multiplier^(attempt-1)`, at most `max`.
///
/// `Exponential` is a value (no state): [`Exponential::delay`] answers for any attempt, and
/// [`Backoff`] walks it for loops that only need "the next delay".
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Exponential {
    /// The delay after the first failure.
    pub initial: Duration,
    /// The factor each further delay grows by (`2.0` doubles); values below 1 are taken as 1.
    pub multiplier: f64,
    /// The cap on any delay.
    pub max: Duration,
}

impl Exponential {
    /// A schedule that doubles from `initial` up to `max`.
    pub const fn doubling(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            multiplier: 2.0,
            max,
        }
    }

    /// The delay after failed attempt `attempt` (1-based; 0 is taken as 1), with no jitter.
    pub fn delay(&self, attempt: u32) -> Duration {
        let exponent = i32::try_from(attempt.saturating_sub(1)).unwrap_or(i32::MAX);
        let secs = self.initial.as_secs_f64() * self.multiplier.max(1.0).powi(exponent);
        // `min` first: an overflowing power is `inf`, which the cap brings back.
        Duration::from_secs_f64(secs.min(self.max.as_secs_f64()).max(0.0))
    }

    /// The delay after failed attempt `attempt` with relative `jitter` (clamped to `[0, 1]`)
    /// drawn from `unit` (clamped to `[-1, 1]`): a nominal delay `d` becomes
    /// `d × (1 + jitter × unit)`, so a uniform `unit` spreads it over `[d(1-j), d(1+j)]`.
    pub fn delay_with_jitter(&self, attempt: u32, jitter: f64, unit: f64) -> Duration {
        let nominal = self.delay(attempt).as_secs_f64();
        let factor = 1.0 + jitter.clamp(0.0, 1.0) * unit.clamp(-1.0, 1.0);
        Duration::from_secs_f64((nominal * factor).max(0.0))
    }
}

/// A back-off loop's state: how many failures in a row, walking an [`Exponential`] schedule.
///
/// ```
/// # use std::time::Duration;
/// # use reach_rpc::backoff::Backoff;
/// let mut backoff = Backoff::doubling(Duration::from_millis(20), Duration::from_secs(2));
/// assert_eq!(backoff.next_delay(), Duration::from_millis(20));
/// assert_eq!(backoff.next_delay(), Duration::from_millis(40));
/// backoff.reset(); // after a success
/// assert_eq!(backoff.next_delay(), Duration::from_millis(20));
/// ```
#[derive(Debug, Clone)]
pub struct Backoff {
    schedule: Exponential,
    /// Failures since the last [`Backoff::reset`]; the next delay is for attempt `failures + 1`.
    failures: u32,
}

impl Backoff {
    /// A loop over `schedule`, starting at its first delay.
    pub const fn new(schedule: Exponential) -> Self {
        Self {
            schedule,
            failures: 0,
        }
    }

    /// A loop that doubles from `initial` up to `max`.
    pub const fn doubling(initial: Duration, max: Duration) -> Self {
        Self::new(Exponential::doubling(initial, max))
    }

    /// The delay to wait after one more failure; each call moves one step along the schedule.
    pub fn next_delay(&mut self) -> Duration {
        self.failures = self.failures.saturating_add(1);
        self.schedule.delay(self.failures)
    }

    /// [`Backoff::next_delay`] with relative `jitter` drawn from `unit` (see
    /// [`Exponential::delay_with_jitter`]): one more step along the schedule.
    pub fn next_delay_with_jitter(&mut self, jitter: f64, unit: f64) -> Duration {
        self.failures = self.failures.saturating_add(1);
        self.schedule.delay_with_jitter(self.failures, jitter, unit)
    }

    /// Starts the schedule over (call it after a success).
    pub fn reset(&mut self) {
        self.failures = 0;
    }

    /// Sleeps for [`Backoff::next_delay`] (tokio's clock, so paused time in tests applies).
    pub async fn wait(&mut self) {
        tokio::time::sleep(self.next_delay()).await;
    }
}

/// A uniform draw from `[-1, 1]` (the thread's generator, seeded by the OS): the `unit` of
/// [`Exponential::delay_with_jitter`] for loops that need no reproducible jitter.
pub fn uniform_unit() -> f64 {
    rand::random_range(-1.0..=1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn delays_grow_by_the_multiplier_and_stop_at_the_cap() {
        let schedule = Exponential {
            initial: MS(200),
            multiplier: 2.0,
            max: MS(500),
        };
        assert_eq!(schedule.delay(0), MS(200));
        assert_eq!(schedule.delay(1), MS(200));
        assert_eq!(schedule.delay(2), MS(400));
        assert_eq!(schedule.delay(3), MS(500));
        assert_eq!(schedule.delay(u32::MAX), MS(500));
    }

    #[test]
    fn jitter_spreads_the_delay_within_its_fraction() {
        let schedule = Exponential::doubling(MS(1000), MS(10_000));
        assert_eq!(schedule.delay_with_jitter(1, 0.2, -1.0), MS(800));
        assert_eq!(schedule.delay_with_jitter(1, 0.2, 1.0), MS(1200));
        assert_eq!(schedule.delay_with_jitter(1, 0.2, 7.0), MS(1200));
        assert_eq!(schedule.delay_with_jitter(1, 0.0, 1.0), MS(1000));
    }

    #[test]
    fn a_shrinking_multiplier_is_taken_as_constant() {
        let schedule = Exponential {
            initial: MS(100),
            multiplier: 0.5,
            max: MS(1000),
        };
        assert_eq!(schedule.delay(5), MS(100));
    }

    #[test]
    fn a_loop_walks_the_schedule_and_starts_over_after_reset() {
        let mut backoff = Backoff::doubling(MS(5), MS(20));
        let delays: Vec<_> = (0..4).map(|_| backoff.next_delay()).collect();
        assert_eq!(delays, [MS(5), MS(10), MS(20), MS(20)]);
        backoff.reset();
        assert_eq!(backoff.next_delay(), MS(5));
    }
}
