//! Balancing policies: which instance of a route takes the next call.
//!
//! Every policy picks among the route's *eligible* instances, in this order of preference:
//! 1. instances that are not ejected (see [`crate::endpoint`]); only when every instance is
//!    ejected are ejected ones considered (Envoy's "panic mode": better a suspect instance
//!    than none);
//! 2. among those, instances the registry reports READY with room under their concurrency
//!    limit; then BUSY instances with room (BUSY is avoided while others have room);
//! 3. when none has room the call waits for room or is shed (see [`crate::table::Route::reserve`]).
//!
//! Policies:
//! - `p2c_peak_ewma` (default): power of two choices (Mitzenmacher) over the peak-EWMA
//!   latency × (pending + 1) cost, as Finagle's and tower's `PeakEwma` balancers.
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
            let cost = |e: &InstanceEndpoint| match policy {
                Policy::P2cPending => e.load_tracker().pending_cost(),
                _ => e.load_tracker().cost(),
            };
            let (ca, cb) = (cost(candidates[a]), cost(candidates[b]));
            if cb < ca {
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
