//! Re-checking files on an interval for as long as their owner lives.

use std::sync::Weak;
use std::time::Duration;

/// Runs a check of an owner's files every interval while the owner is alive.
pub(crate) struct Reloader;

impl Reloader {
    /// Spawns a task on the current tokio runtime that calls `check(owner)` every `interval`
    /// until `owner` is dropped. Without a runtime (a synchronous caller), does nothing.
    pub(crate) fn spawn<T: Send + Sync + 'static>(
        owner: Weak<T>,
        interval: Duration,
        check: impl Fn(&T) + Send + 'static,
    ) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let interval = interval.max(Duration::from_millis(10));
        runtime.spawn(async move {
            let mut ticks = tokio::time::interval(interval);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticks.tick().await;
            loop {
                ticks.tick().await;
                let Some(owner) = owner.upgrade() else { return };
                // File reads are blocking but small and bounded (MAX_PEM_BYTES).
                check(&owner);
            }
        });
    }
}
