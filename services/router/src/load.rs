//! The load signal the balancer compares: peak-EWMA round-trip time multiplied by the number
//! of requests in flight plus one, as in Finagle's `PeakEwma` balancer (and tower's
//! `load::PeakEwma`). Unlike tower's type, one [`LoadTracker`] is shared by every route an
//! instance is on, so a capability route and a service-name route see the same load.
//!
//! An instance that has answered nothing yet has no latency of its own. Rather than a fixed
//! guess (which a route whose instances answer faster than the guess would never pick, so a
//! new or restarted instance got no traffic at light load), the balancer hands its tracker a
//! *prior* — the median estimate of the route's measured instances ([`LoadTracker::cost_with_prior`]);
//! the configured `default_rtt` is the prior only when no instance of the route has answered.
//! The prior stands until the first sample, which replaces it (as in Finagle's `PeakEwma`,
//! whose first sample is a peak); from then on the estimate decays with the configured time
//! constant (`rtt_decay`), as tower's and linkerd's `PeakEwma` do. Blending a first sample
//! into a fixed guess instead (tower) leaves a new instance's estimate near the guess for
//! about one time constant, and the instance used first looks cheaper than an idle one all
//! that time, so it keeps every call.
//!
//! Also here: [`Room`], which wakes calls waiting for an instance with room when a call
//! ends, and [`InFlight`], the guard that counts one call against its instance.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// Wakes calls waiting for room when any instance finishes a call. Shared by every endpoint
/// of a routing table.
#[derive(Debug, Default)]
pub struct Room {
    notify: Notify,
    /// Calls waiting now; completions notify only when someone waits.
    waiting: AtomicUsize,
}

impl Room {
    /// Wakes every waiting call (cheap when none waits).
    pub fn release(&self) {
        if self.waiting.load(Ordering::Acquire) > 0 {
            self.notify.notify_waiters();
        }
    }

    /// A future that resolves at the next [`Room::release`].
    pub fn notified(&self) -> tokio::sync::futures::Notified<'_> {
        self.notify.notified()
    }

    /// How many calls wait for room now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    /// Counts a call as waiting if fewer than `max` wait already; the guard stops counting
    /// it when dropped. `None` when `max` calls wait already.
    pub fn try_wait(&self, max: usize) -> Option<Waiting<'_>> {
        self.waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| Waiting(self))
    }
}

/// One call waiting for room (see [`Room::try_wait`]); dropping it ends the wait.
#[derive(Debug)]
pub struct Waiting<'a>(&'a Room);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Per-instance load: requests in flight and a peak-sensitive latency estimate.
#[derive(Debug)]
pub struct LoadTracker {
    pending: AtomicUsize,
    estimate: Mutex<RttEstimate>,
    /// Whether a latency sample was taken yet; until then the estimate is a prior.
    sampled: AtomicBool,
    decay_ns: f64,
}

#[derive(Debug)]
struct RttEstimate {
    /// The estimate in ns: the prior until the first sample, then the decayed peak-EWMA.
    rtt_ns: f64,
    updated_at: Instant,
}

impl LoadTracker {
    /// A tracker that assumes `default_rtt` until it measures (unless a balancer hands it a
    /// prior, see [`LoadTracker::cost_with_prior`]), forgetting peaks over `decay` (the
    /// EWMA's time constant).
    pub fn new(default_rtt: Duration, decay: Duration) -> Self {
        Self {
            pending: AtomicUsize::new(0),
            estimate: Mutex::new(RttEstimate {
                rtt_ns: default_rtt.as_nanos() as f64,
                updated_at: Instant::now(),
            }),
            sampled: AtomicBool::new(false),
            decay_ns: decay.as_nanos().max(1) as f64,
        }
    }

    /// Whether the instance has answered at least once (its estimate is measured, not a
    /// prior).
    pub fn is_sampled(&self) -> bool {
        self.sampled.load(Ordering::Acquire)
    }

    /// The decayed latency estimate now, in ns, when the instance has answered at least
    /// once; `None` while it has not (for the route's prior, see
    /// [`LoadTracker::cost_with_prior`]).
    pub fn rtt_estimate_ns(&self) -> Option<f64> {
        if !self.is_sampled() {
            return None;
        }
        let estimate = self.estimate.lock().unwrap_or_else(|p| p.into_inner());
        Some(estimate.decay(Instant::now(), self.decay_ns))
    }

    /// Counts a request as in flight until the returned guard drops, then feeds its latency
    /// into the estimate.
    pub fn start(self: &Arc<Self>) -> InFlight {
        self.pending.fetch_add(1, Ordering::Relaxed);
        InFlight {
            tracker: self.clone(),
            started: Instant::now(),
            room: None,
            observe_latency: true,
        }
    }

    /// Counts a request as in flight if fewer than `limit` are (0: no limit). The guard wakes
    /// `room` waiters when it drops.
    pub fn try_start(self: &Arc<Self>, limit: usize, room: Arc<Room>) -> Option<InFlight> {
        if limit == 0 {
            self.pending.fetch_add(1, Ordering::Relaxed);
        } else {
            self.pending
                .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                    (n < limit).then_some(n + 1)
                })
                .ok()?;
        }
        Some(InFlight {
            tracker: self.clone(),
            started: Instant::now(),
            room: Some(room),
            observe_latency: true,
        })
    }

    /// The pending-requests cost (p2c over pending): requests in flight now.
    pub fn pending_cost(&self) -> f64 {
        self.pending() as f64
    }

    /// Requests in flight now.
    pub fn pending(&self) -> usize {
        self.pending.load(Ordering::Relaxed)
    }

    /// The cost the balancer compares: decayed RTT estimate (ns) × (pending + 1), with the
    /// configured default RTT as the estimate of an instance that has not answered yet.
    pub fn cost(&self) -> f64 {
        self.cost_with_prior(None)
    }

    /// [`LoadTracker::cost`], with `prior_ns` (ns; the route's typical estimate) as the
    /// estimate of an instance that has not answered yet. A prior stands, undecayed, until
    /// the first sample, which replaces it (Finagle's `PeakEwma` takes its first sample as a
    /// peak, too); from then on the estimate is the tracker's own. `None` makes the
    /// configured default RTT the prior.
    pub fn cost_with_prior(&self, prior_ns: Option<f64>) -> f64 {
        let pending = self.pending() as f64;
        let mut estimate = self.estimate.lock().unwrap_or_else(|p| p.into_inner());
        if !self.is_sampled() {
            return prior_ns.unwrap_or(estimate.rtt_ns) * (pending + 1.0);
        }
        let now = Instant::now();
        let rtt = estimate.decay(now, self.decay_ns);
        estimate.rtt_ns = rtt;
        estimate.updated_at = now;
        rtt * (pending + 1.0)
    }

    fn observe(&self, rtt: Duration) {
        let rtt_ns = rtt.as_nanos() as f64;
        let mut estimate = self.estimate.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        if !self.is_sampled() || rtt_ns > estimate.rtt_ns {
            // The first sample replaces the prior; a peak is taken at once; either decays
            // only with time.
            estimate.rtt_ns = rtt_ns;
        } else {
            let decayed = estimate.decay(now, self.decay_ns);
            let elapsed = now
                .saturating_duration_since(estimate.updated_at)
                .as_nanos() as f64;
            let weight = (-elapsed / self.decay_ns).exp();
            estimate.rtt_ns = decayed * weight + rtt_ns * (1.0 - weight);
        }
        estimate.updated_at = now;
        self.sampled.store(true, Ordering::Release);
    }
}

impl RttEstimate {
    fn decay(&self, now: Instant, decay_ns: f64) -> f64 {
        let elapsed = now.saturating_duration_since(self.updated_at).as_nanos() as f64;
        self.rtt_ns * (-elapsed / decay_ns).exp()
    }
}

/// A request in flight on one instance; dropping it ends the request.
#[derive(Debug)]
pub struct InFlight {
    tracker: Arc<LoadTracker>,
    started: Instant,
    room: Option<Arc<Room>>,
    /// Whether the request's duration feeds the latency estimate. A stream's lifetime is
    /// how long the caller keeps talking, not how fast the instance answers, so streams
    /// count as pending only.
    observe_latency: bool,
}

impl InFlight {
    /// Marks the request as a stream: it counts as in flight until it ends, but its duration
    /// is not taken as the instance's latency.
    pub fn for_stream(mut self) -> Self {
        self.observe_latency = false;
        self
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.tracker.pending.fetch_sub(1, Ordering::AcqRel);
        if self.observe_latency {
            self.tracker.observe(self.started.elapsed());
        }
        if let Some(room) = &self.room {
            room.release();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn pending_requests_raise_the_cost() {
        let tracker = Arc::new(LoadTracker::new(
            Duration::from_millis(5),
            Duration::from_secs(10),
        ));
        let idle = tracker.cost();
        let a = tracker.start();
        let _b = tracker.start();
        assert!(tracker.cost() > 2.5 * idle);
        drop(a);
        assert_eq!(tracker.pending(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_response_is_a_peak_that_decays() {
        let tracker = Arc::new(LoadTracker::new(
            Duration::from_millis(1),
            Duration::from_secs(1),
        ));
        let slow = tracker.start();
        tokio::time::advance(Duration::from_millis(100)).await;
        drop(slow);
        let peak = tracker.cost();
        assert!(peak > 90e6, "{peak}");
        tokio::time::advance(Duration::from_secs(5)).await;
        assert!(tracker.cost() < peak / 100.0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_long_stream_counts_as_pending_but_not_as_latency() {
        let tracker = Arc::new(LoadTracker::new(
            Duration::from_millis(1),
            Duration::from_secs(10),
        ));
        let idle = tracker.cost();
        let stream = tracker.start().for_stream();
        tokio::time::advance(Duration::from_secs(4)).await;
        assert!(tracker.cost() > idle, "an open stream is load");
        drop(stream);
        assert!(
            tracker.cost() <= idle * 1.01,
            "its 4 s lifetime is not the instance's latency: {}",
            tracker.cost()
        );
    }
}
