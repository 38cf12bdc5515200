//! Balancing policies: which instance of a route takes the next call.
//!
//! Every policy picks among the route's *eligible* instances, in this order of preference:
//! 1. instances that are not ejected (see [`crate::endpoint`]); only when every instance is
//!    ejected are ejected ones considered (Envoy's "panic mode": better a suspect instance
//!    than none);
//! 2. among those, instances the registry reports READY with room under their concurrency
//!    limit; then BUSY instances with room (BUSY is avoided while others have room);
//! 3. when none has room the call waits for room or is shed (see [`crate::table::RoutingTable::reserve`]).
//!
//! Policies:
//! - `p2c_peak_ewma` (default): power of two choices (Mitzenmacher) over the peak-EWMA
//!   latency × (pending + 1) cost, as Finagle's and tower's `PeakEwma` balancers. An instance
//!   that has not answered yet is assumed as fast as the route's median instance (see
//!   [`crate::load`]), so a new or restarted one gets its share at once.
//! - `p2c_pending`: power of two choices over requests in flight (tower's `PendingRequests`).
//! - `round_robin`: each eligible instance in turn.
//! - `random`: uniformly at random.
//! - `weighted`: at random in proportion to the instance weight from registration.
//!
//! The random policies draw from a [`Random`] source the routing table is given: an
//! OS-seeded per-thread generator ([`ThreadRandom`]) in production, a seeded one
//! ([`SeededRandom`]) where picks must be reproducible (tests).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use reach_proto::v1::InstanceState;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::endpoint::InstanceEndpoint;

/// A balancing policy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Power of two choices over peak-EWMA latency × (pending + 1).
    #[default]
    #[serde(alias = "p2c")]
    P2cPeakEwma,
    /// Power of two choices over requests in flight.
    P2cPending,
    /// Round robin.
    RoundRobin,
    /// Uniformly random.
    Random,
    /// Random in proportion to registration weights.
    Weighted,
}

impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Policy::P2cPeakEwma => "p2c_peak_ewma",
            Policy::P2cPending => "p2c_pending",
            Policy::RoundRobin => "round_robin",
            Policy::Random => "random",
            Policy::Weighted => "weighted",
        })
    }
}

/// The randomness balancing draws from: one draw for a `random` pick, one for a `weighted`
/// pick, two for a power-of-two-choices pick, none when only one instance is eligible.
pub trait Random: Send + Sync + std::fmt::Debug {
    /// A uniformly distributed number in `0..n`; `n` is at least 1.
    fn below(&self, n: u64) -> u64;
}

/// The production source: the calling thread's OS-seeded generator (`rand::rng()`), with no
/// lock shared between calls.
#[derive(Debug, Clone, Copy, Default)]
pub struct ThreadRandom;

impl Random for ThreadRandom {
    fn below(&self, n: u64) -> u64 {
        rand::rng().random_range(0..n)
    }
}

/// A seeded generator ([`SmallRng`]) behind a lock: the same seed gives the same sequence of
/// draws, so the same sequence of picks over the same instances.
#[derive(Debug)]
pub struct SeededRandom(Mutex<SmallRng>);

impl SeededRandom {
    /// A source seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self(Mutex::new(SmallRng::seed_from_u64(seed)))
    }
}

impl Random for SeededRandom {
    fn below(&self, n: u64) -> u64 {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .random_range(0..n)
    }
}

/// Why no instance could be picked now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoPick {
    /// Every candidate is at its concurrency limit: wait for room or shed.
    Full,
    /// No candidate at all (all excluded).
    Empty,
}

/// Picks an instance of `members` under `policy`, skipping `excluded` instance ids (already
/// tried by this call) unless nothing else is left. `rr` is the route's round-robin cursor;
/// the random policies draw from `random`.
///
/// # Errors
/// [`NoPick::Full`] when every candidate is at its limit (or only ejected ones have room
/// while a healthy one is full); [`NoPick::Empty`] when there is no candidate.
pub fn pick<'a>(
    policy: Policy,
    members: &'a [Arc<InstanceEndpoint>],
    excluded: &[Arc<str>],
    rr: &AtomicUsize,
    random: &dyn Random,
) -> Result<&'a Arc<InstanceEndpoint>, NoPick> {
    if members.is_empty() {
        return Err(NoPick::Empty);
    }
    let now = Instant::now();
    // Tier 0: healthy, READY, room. Tier 1: healthy, BUSY, room. Tier 2: ejected with room
    // (only when every non-excluded instance is ejected).
    let mut best_tier = u8::MAX;
    let mut candidates: Vec<&Arc<InstanceEndpoint>> = Vec::with_capacity(members.len());
    let mut any_healthy = false;
    let mut any = false;
    for member in members {
        if excluded.iter().any(|id| **id == *member.info().instance_id) {
            continue;
        }
        any = true;
        let ejected = member.is_ejected(now);
        any_healthy |= !ejected;
        if !member.has_room() {
            continue;
        }
        let tier = match (ejected, member.state()) {
            (true, _) => 2,
            (false, InstanceState::Busy) => 1,
            (false, _) => 0,
        };
        if tier < best_tier {
            best_tier = tier;
            candidates.clear();
        }
        if tier == best_tier {
            candidates.push(member);
        }
    }
    if !any {
        // Everything was tried already: start over rather than fail.
        return if excluded.is_empty() {
            Err(NoPick::Empty)
        } else {
            pick(policy, members, &[], rr, random)
        };
    }
    if candidates.is_empty() || (best_tier == 2 && any_healthy) {
        return Err(NoPick::Full);
    }
    Ok(choose(policy, &candidates, rr, random))
}

fn choose<'a>(
    policy: Policy,
    candidates: &[&'a Arc<InstanceEndpoint>],
    rr: &AtomicUsize,
    random: &dyn Random,
) -> &'a Arc<InstanceEndpoint> {
    let n = candidates.len();
    if n == 1 {
        return candidates[0];
    }
    let below = |n: usize| random.below(n as u64) as usize;
    match policy {
        Policy::P2cPeakEwma | Policy::P2cPending => {
            let a = below(n);
            let mut b = below(n - 1);
            if b >= a {
                b += 1;
            }
            let (ta, tb) = (candidates[a].load_tracker(), candidates[b].load_tracker());
            let (ca, cb) = match policy {
                Policy::P2cPending => (ta.pending_cost(), tb.pending_cost()),
                _ => {
                    // Only a pick that drew an instance without samples needs the prior.
                    let prior = if ta.is_sampled() && tb.is_sampled() {
                        None
                    } else {
                        route_prior_ns(candidates)
                    };
                    (ta.cost_with_prior(prior), tb.cost_with_prior(prior))
                }
            };
            // Light load: with as many calls in flight on each, estimates that differ by less
            // than LIGHT_LOAD_BAND are noise (one slow answer is a peak that takes a time
            // constant to decay), not a signal, and comparing them strictly hands one instance
            // long runs of calls. Such a pair is a tie, drawn at random, so every instance of a
            // route gets its share whatever its latest sample was; an instance slower by more
            // than the band still loses every comparison. An instance without samples costs
            // the route's median (see `route_prior_ns`), so a new or restarted instance ties
            // with a typical one and gets its share at once.
            let tied = ta.pending() == tb.pending() && ca.max(cb) < LIGHT_LOAD_BAND * ca.min(cb);
            let prefer_b = if policy == Policy::P2cPeakEwma && tied {
                below(2) == 1
            } else {
                cb < ca
            };
            if prefer_b {
                candidates[b]
            } else {
                candidates[a]
            }
        }
        Policy::RoundRobin => candidates[rr.fetch_add(1, Ordering::Relaxed) % n],
        Policy::Random => candidates[below(n)],
        Policy::Weighted => {
            let total: u64 = candidates
                .iter()
                .map(|c| u64::from(c.info().weight.max(1)))
                .sum();
            let mut point = random.below(total);
            for candidate in candidates {
                let weight = u64::from(candidate.info().weight.max(1));
                if point < weight {
                    return candidate;
                }
                point -= weight;
            }
            candidates[n - 1]
        }
    }
}

/// Under p2c peak-EWMA, two candidates with as many calls in flight whose costs are within
/// this factor of each other are a tie, broken at random (see `choose`). 1.5 keeps a route's
/// shares within a few per cent of fair when latencies vary by ±30 % call to call, while an
/// instance 1.5× slower than the others is still avoided.
const LIGHT_LOAD_BAND: f64 = 1.5;

/// The latency a route's instance that has not answered yet is assumed to have: the median
/// of the decayed peak-EWMA estimates (ns) of the `candidates` that have answered; `None`
/// when none has (then the configured `default_rtt` stands).
fn route_prior_ns(candidates: &[&Arc<InstanceEndpoint>]) -> Option<f64> {
    let mut measured: Vec<f64> = candidates
        .iter()
        .filter_map(|c| c.load_tracker().rtt_estimate_ns())
        .collect();
    if measured.is_empty() {
        return None;
    }
    measured.sort_by(f64::total_cmp);
    let mid = measured.len() / 2;
    Some(if measured.len() % 2 == 1 {
        measured[mid]
    } else {
        (measured[mid - 1] + measured[mid]) / 2.0
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    use super::*;
    use crate::endpoint::EjectionConfig;
    use crate::endpoint::testing::endpoint;

    /// Draws the scripted values in turn (each must be below the `n` asked for).
    #[derive(Debug)]
    struct Script(Mutex<std::vec::IntoIter<u64>>);

    impl Script {
        fn new(values: impl IntoIterator<Item = u64>) -> Self {
            Self(Mutex::new(
                values.into_iter().collect::<Vec<_>>().into_iter(),
            ))
        }
    }

    impl Random for Script {
        fn below(&self, n: u64) -> u64 {
            let value = self.0.lock().unwrap().next().expect("a scripted draw");
            assert!(value < n, "scripted {value}, asked below {n}");
            value
        }
    }

    fn members(weights: &[u32]) -> Vec<Arc<InstanceEndpoint>> {
        weights
            .iter()
            .enumerate()
            .map(|(i, &w)| endpoint(&format!("i{i}"), w, 0, EjectionConfig::default()))
            .collect()
    }

    fn picks(
        policy: Policy,
        members: &[Arc<InstanceEndpoint>],
        random: &dyn Random,
        n: usize,
    ) -> Vec<String> {
        let rr = AtomicUsize::new(0);
        (0..n)
            .map(|_| {
                pick(policy, members, &[], &rr, random)
                    .unwrap()
                    .info()
                    .instance_id
                    .clone()
            })
            .collect()
    }

    #[tokio::test]
    async fn random_takes_the_drawn_instance() {
        let members = members(&[1, 1, 1]);
        let script = Script::new([2, 0, 1, 1]);
        assert_eq!(
            picks(Policy::Random, &members, &script, 4),
            ["i2", "i0", "i1", "i1"]
        );
    }

    #[tokio::test]
    async fn weighted_maps_each_draw_onto_the_weights() {
        // Weights 1, 1, 6: draws 0 → i0, 1 → i1, 2..=7 → i2.
        let members = members(&[1, 1, 6]);
        let script = Script::new(0..8);
        let mut counts: HashMap<String, usize> = HashMap::new();
        for id in picks(Policy::Weighted, &members, &script, 8) {
            *counts.entry(id).or_default() += 1;
        }
        assert_eq!(
            counts,
            HashMap::from([("i0".into(), 1), ("i1".into(), 1), ("i2".into(), 6)])
        );
    }

    #[tokio::test]
    async fn p2c_takes_the_less_loaded_of_the_two_drawn() {
        let members = members(&[1, 1, 1]);
        // i0 has two calls in flight, i1 one, i2 none.
        let _load = [
            members[0].load_tracker().start(),
            members[0].load_tracker().start(),
            members[1].load_tracker().start(),
        ];
        // Draws (a, b'): b' skips a, so (0, 0) compares i0 with i1, (2, 1) i2 with i1,
        // (1, 0) i1 with i0.
        let script = Script::new([0, 0, 2, 1, 1, 0]);
        assert_eq!(
            picks(Policy::P2cPending, &members, &script, 3),
            ["i1", "i2", "i1"]
        );
    }

    #[tokio::test]
    async fn round_robin_and_a_single_candidate_draw_nothing() {
        let members = members(&[1, 1, 1]);
        let none = Script::new([]);
        assert_eq!(
            picks(Policy::RoundRobin, &members, &none, 4),
            ["i0", "i1", "i2", "i0"]
        );
        assert_eq!(picks(Policy::Random, &members[..1], &none, 2), ["i0", "i0"]);
    }

    /// Sequential calls from one caller: each pick under p2c peak-EWMA is held for
    /// `latency(instance)` of paused time. Returns the calls each instance took.
    async fn sequential(
        members: &[Arc<InstanceEndpoint>],
        random: &dyn Random,
        calls: usize,
        latency: impl Fn(&str) -> Duration,
    ) -> HashMap<String, usize> {
        let rr = AtomicUsize::new(0);
        let mut counts = HashMap::new();
        for _ in 0..calls {
            let picked = pick(Policy::P2cPeakEwma, members, &[], &rr, random).unwrap();
            let reserved = picked.try_reserve().unwrap();
            let id = picked.info().instance_id.clone();
            tokio::time::advance(latency(&id)).await;
            drop(reserved);
            *counts.entry(id).or_default() += 1;
        }
        counts
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_instance_next_to_a_measured_fast_one_gets_a_fair_share_at_light_load() {
        // `old` has answered in 1 ms many times; `new` just joined (no sample yet, and the
        // configured default RTT, 5 ms, is slower than the route really is).
        let members = members(&[1, 1]);
        let millis = |_: &str| Duration::from_millis(1);
        let warm = sequential(&members[..1], &SeededRandom::new(1), 50, millis).await;
        assert_eq!(warm.get("i0"), Some(&50));

        let counts = sequential(&members, &SeededRandom::new(13), 200, millis).await;
        let share = counts.get("i1").copied().unwrap_or(0) as f64 / 200.0;
        assert!(
            (0.35..=0.65).contains(&share),
            "the new instance took {share:.2} of the calls: {counts:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn instances_that_start_together_share_light_load() {
        // As in `reach demo`: neither has answered when the calls start.
        let members = members(&[1, 1]);
        let millis = |_: &str| Duration::from_millis(1);
        let counts = sequential(&members, &SeededRandom::new(13), 200, millis).await;
        let share = counts.get("i1").copied().unwrap_or(0) as f64 / 200.0;
        assert!(
            (0.35..=0.65).contains(&share),
            "the second instance took {share:.2} of the calls: {counts:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_slow_instance_gets_its_first_calls_then_little() {
        let members = members(&[1, 1]);
        let latency = |id: &str| Duration::from_millis(if id == "i1" { 10 } else { 1 });
        sequential(&members[..1], &SeededRandom::new(1), 50, latency).await;
        let counts = sequential(&members, &SeededRandom::new(13), 200, latency).await;
        let slow = counts.get("i1").copied().unwrap_or(0);
        assert!(
            (1..=10).contains(&slow),
            "the slow instance was tried, then left alone: {counts:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_ten_times_slower_instance_gets_clearly_less_under_concurrent_load() {
        // Eight closed-loop callers; `i1` takes 10 ms, `i0` 1 ms. Paused time on one thread
        // and a seeded source make the run exact.
        let members = Arc::new(members(&[1, 1]));
        let random = Arc::new(SeededRandom::new(13));
        let rr = Arc::new(AtomicUsize::new(0));
        let workers = (0..8).map(|_| {
            let (members, random, rr) = (members.clone(), random.clone(), rr.clone());
            tokio::spawn(async move {
                let mut slow = 0;
                for _ in 0..50 {
                    let picked = pick(Policy::P2cPeakEwma, &members, &[], &rr, &*random).unwrap();
                    let reserved = picked.try_reserve().unwrap();
                    let is_slow = *picked.info().instance_id == *"i1";
                    slow += usize::from(is_slow);
                    let latency = if is_slow { 10 } else { 1 };
                    tokio::time::sleep(Duration::from_millis(latency)).await;
                    drop(reserved);
                }
                slow
            })
        });
        let mut slow = 0;
        for worker in workers {
            slow += worker.await.unwrap();
        }
        let share = slow as f64 / 400.0;
        assert!(
            share < 0.2,
            "the slow instance took {share:.2} of 400 concurrent calls"
        );
    }

    /// A call latency around 1 ms that varies by about ±30 % call to call (log-normal,
    /// σ = 0.3, by Box–Muller over `rng`), as sub-millisecond agents answer on a real host.
    fn noisy_latency(rng: &mut SmallRng) -> Duration {
        let (u1, u2): (f64, f64) = (rng.random_range(f64::EPSILON..1.0), rng.random());
        let normal = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        Duration::from_secs_f64(0.001 * (0.3 * normal).exp())
    }

    #[tokio::test(start_paused = true)]
    async fn light_load_is_shared_fairly_through_noise_and_a_restart() {
        // Three healthy instances, one caller at 50 calls/s (a call every 20 ms), latencies
        // varying call to call. 10,000 calls; halfway through, `i2` restarts (a fresh endpoint
        // with no samples). Every window of 1,000 calls must give each instance its third
        // within ±20 %, the restarted one included.
        let mut members = members(&[1, 1, 1]);
        let random = SeededRandom::new(42);
        let mut latencies = SmallRng::seed_from_u64(7);
        let rr = AtomicUsize::new(0);
        let mut window: HashMap<String, usize> = HashMap::new();
        for call in 1..=10_000 {
            if call == 5_001 {
                members[2] = endpoint("i2", 1, 0, EjectionConfig::default());
            }
            let picked = pick(Policy::P2cPeakEwma, &members, &[], &rr, &random).unwrap();
            let reserved = picked.try_reserve().unwrap();
            let latency = noisy_latency(&mut latencies);
            *window.entry(picked.info().instance_id.clone()).or_default() += 1;
            tokio::time::advance(latency).await;
            drop(reserved);
            tokio::time::advance(
                Duration::from_millis(20) - latency.min(Duration::from_millis(20)),
            )
            .await;
            if call % 1_000 == 0 {
                for id in ["i0", "i1", "i2"] {
                    let share = window.get(id).copied().unwrap_or(0) as f64 / 1_000.0;
                    assert!(
                        (1.0 / 3.0 * 0.8..=1.0 / 3.0 * 1.2).contains(&share),
                        "calls {}..={call}: {id} took {share:.3} (fair: 0.333 ± 20 %): {window:?}",
                        call - 999
                    );
                }
                window.clear();
            }
        }
    }

    #[test]
    fn a_seeded_source_repeats_its_draws() {
        let (a, b) = (SeededRandom::new(7), SeededRandom::new(7));
        let draws = |r: &SeededRandom| (0..100).map(|_| r.below(10)).collect::<Vec<_>>();
        let first = draws(&a);
        assert_eq!(first, draws(&b));
        assert_ne!(first, draws(&SeededRandom::new(8)));
    }
}
