//! Per-identity limits of the registry's gRPC face: Watch slots (capped per identity, with
//! slots held back for routers) and the pace of health probes a registrant may start.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reach_rpc::errors::{reason, status_with_reason, status_with_retry};
use tonic::{Code, Status};

/// The most Watch streams a registry serves at once (routers hold one each).
pub const MAX_WATCHES: usize = 1024;

/// Who asks for a Watch slot.
#[derive(Debug, Clone, Copy)]
pub enum Watcher<'a> {
    /// Trust is off: callers are not told apart; only the total applies.
    Anyone,
    /// A router (the policy's `registry.routers`): any slot, no per-identity cap.
    Router,
    /// Any other identity: capped per identity, and not in the slots held for routers.
    Other(&'a str),
}

#[derive(Debug, Default)]
struct Open {
    total: usize,
    /// Streams of identities other than routers.
    others: usize,
    per_identity: HashMap<String, usize>,
}

/// The Watch streams a registry replica serves: at most `total`; of them, identities other
/// than routers hold at most `total - router_slots` together, and each at most
/// `per_identity`. Routers may take any free slot.
#[derive(Debug, Clone)]
pub struct WatchSlots {
    total: usize,
    router_slots: usize,
    per_identity: usize,
    open: Arc<Mutex<Open>>,
}

/// An open Watch stream's slot, given back when dropped.
#[derive(Debug)]
pub struct WatchSlot {
    open: Arc<Mutex<Open>>,
    identity: Option<String>,
}

impl Drop for WatchSlot {
    fn drop(&mut self) {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        open.total = open.total.saturating_sub(1);
        if self.identity.is_some() {
            open.others = open.others.saturating_sub(1);
        }
        if let Some(identity) = &self.identity
            && let Some(count) = open.per_identity.get_mut(identity)
        {
            *count -= 1;
            if *count == 0 {
                open.per_identity.remove(identity);
            }
        }
    }
}

impl WatchSlots {
    /// At most `total` streams, `router_slots` of them for routers only, `per_identity` for
    /// each other identity.
    pub fn new(total: usize, router_slots: usize, per_identity: usize) -> Self {
        Self {
            total,
            router_slots: router_slots.min(total),
            per_identity,
            open: Arc::default(),
        }
    }

    /// Takes a slot for `watcher`.
    ///
    /// # Errors
    /// `RESOURCE_EXHAUSTED` with reason `TOO_MANY_WATCHES` saying which limit and the setting.
    pub fn acquire(&self, watcher: Watcher<'_>) -> Result<WatchSlot, Status> {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        // Metadata as the orchestrator's WatchTask refusals carry it (`identity`, `limit`),
        // plus the `setting` that sets the limit reached.
        let refuse = |message: String, limit: usize, setting: &str| {
            let identity = match watcher {
                Watcher::Other(identity) => identity,
                Watcher::Router | Watcher::Anyone => "",
            };
            status_with_reason(
                Code::ResourceExhausted,
                message,
                reason::TOO_MANY_WATCHES,
                [
                    ("identity".to_string(), identity.to_string()),
                    ("limit".to_string(), limit.to_string()),
                    ("setting".to_string(), setting.to_string()),
                ],
            )
        };
        if open.total >= self.total {
            return Err(refuse(
                format!(
                    "the registry serves {} Watch streams already; close unused watches (each router needs one), or spread watchers over more registry replicas",
                    self.total
                ),
                self.total,
                "",
            ));
        }
        let identity = match watcher {
            Watcher::Anyone | Watcher::Router => None,
            Watcher::Other(identity) => {
                let shared = self.total - self.router_slots;
                if open.others >= shared {
                    return Err(refuse(
                        format!(
                            "the registry serves {} Watch streams to identities other than routers, all it may: it holds {} of its {} (registry.router_watch_slots) for routers; close unused watches, or watch another registry replica",
                            open.others, self.router_slots, self.total
                        ),
                        shared,
                        "registry.router_watch_slots",
                    ));
                }
                let held = open.per_identity.get(identity).copied().unwrap_or(0);
                if held >= self.per_identity {
                    return Err(refuse(
                        format!(
                            "{identity} holds {held} Watch streams on this registry, its limit (registry.max_watches_per_identity = {}); close one before opening another",
                            self.per_identity
                        ),
                        self.per_identity,
                        "registry.max_watches_per_identity",
                    ));
                }
                *open.per_identity.entry(identity.to_string()).or_default() += 1;
                open.others += 1;
                Some(identity.to_string())
            }
        };
        open.total += 1;
        Ok(WatchSlot {
            open: Arc::clone(&self.open),
            identity,
        })
    }
}

/// The most identities whose probe allowance is remembered; beyond it, full allowances
/// (identities quiet long enough to have refilled) are forgotten first.
const MAX_TRACKED_IDENTITIES: usize = 100_000;

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    updated: Instant,
}

/// A token bucket per registrant identity for the health probes its registrations start:
/// `burst` at once, refilled at `per_second`.
#[derive(Debug, Clone)]
pub struct ProbeLimiter {
    burst: f64,
    per_second: f64,
    buckets: Arc<Mutex<HashMap<String, Bucket>>>,
}

impl ProbeLimiter {
    /// `burst` probes at once per identity, refilled at `per_second`.
    pub fn new(burst: u32, per_second: u32) -> Self {
        Self {
            burst: f64::from(burst.max(1)),
            per_second: f64::from(per_second.max(1)),
            buckets: Arc::default(),
        }
    }

    /// Takes one probe from `identity`'s allowance.
    ///
    /// # Errors
    /// `RESOURCE_EXHAUSTED` with reason `PROBE_RATE_LIMITED` and RetryInfo (when a probe is
    /// next allowed), naming the settings.
    pub fn take(&self, identity: &str) -> Result<(), Status> {
        self.take_at(identity, Instant::now())
    }

    fn take_at(&self, identity: &str, now: Instant) -> Result<(), Status> {
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let refill = |bucket: &Bucket| {
            let elapsed = now.saturating_duration_since(bucket.updated).as_secs_f64();
            (bucket.tokens + elapsed * self.per_second).min(self.burst)
        };
        if !buckets.contains_key(identity) && buckets.len() >= MAX_TRACKED_IDENTITIES {
            buckets.retain(|_, bucket| refill(bucket) < self.burst);
        }
        let bucket = buckets.entry(identity.to_string()).or_insert(Bucket {
            tokens: self.burst,
            updated: now,
        });
        let tokens = refill(bucket);
        if tokens >= 1.0 {
            *bucket = Bucket {
                tokens: tokens - 1.0,
                updated: now,
            };
            return Ok(());
        }
        *bucket = Bucket {
            tokens,
            updated: now,
        };
        let retry_after = Duration::from_secs_f64((1.0 - tokens) / self.per_second);
        Err(status_with_retry(
            Code::ResourceExhausted,
            format!(
                "{identity} registered instances that need a health probe faster than this registry probes for one identity ({} at once, then {} a second: registry.probe_burst_per_identity and registry.probes_per_second_per_identity); retry in {} ms",
                self.burst,
                self.per_second,
                retry_after.as_millis().max(1)
            ),
            reason::PROBE_RATE_LIMITED,
            [("identity".to_string(), identity.to_string())],
            retry_after,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn others_are_capped_per_identity_and_kept_out_of_the_router_slots() {
        let slots = WatchSlots::new(4, 2, 1);
        let alice = slots.acquire(Watcher::Other("alice")).unwrap();
        let refused = slots.acquire(Watcher::Other("alice")).unwrap_err();
        assert_eq!(refused.code(), Code::ResourceExhausted);
        assert!(refused.message().contains("max_watches_per_identity"));
        let _bob = slots.acquire(Watcher::Other("bob")).unwrap();
        // Two of four taken: the rest are the routers'.
        let refused = slots.acquire(Watcher::Other("carol")).unwrap_err();
        assert!(refused.message().contains("router_watch_slots"));
        let _r1 = slots.acquire(Watcher::Router).unwrap();
        let r2 = slots.acquire(Watcher::Router).unwrap();
        let refused = slots.acquire(Watcher::Router).unwrap_err();
        assert!(refused.message().contains("serves 4 Watch streams"));
        drop(r2);
        drop(alice);
        // Alice's slot is hers again; the router's freed slot stays the routers'.
        let _alice = slots.acquire(Watcher::Other("alice")).unwrap();
        assert!(slots.acquire(Watcher::Other("dave")).is_err());
        let _r2 = slots.acquire(Watcher::Router).unwrap();
    }

    #[test]
    fn probes_beyond_the_burst_wait_for_the_refill() {
        let limiter = ProbeLimiter::new(2, 4);
        let start = Instant::now();
        limiter.take_at("a", start).unwrap();
        limiter.take_at("a", start).unwrap();
        let refused = limiter.take_at("a", start).unwrap_err();
        assert_eq!(refused.code(), Code::ResourceExhausted);
        assert_eq!(
            reach_rpc::errors::reason_of(&refused).as_deref(),
            Some(reason::PROBE_RATE_LIMITED)
        );
        let retry = reach_rpc::errors::retry_after_of(&refused).unwrap();
        assert!(retry <= Duration::from_millis(250), "{retry:?}");
        // Another identity has its own allowance.
        limiter.take_at("b", start).unwrap();
        limiter
            .take_at("a", start + Duration::from_millis(250))
            .unwrap();
        assert!(
            limiter
                .take_at("a", start + Duration::from_millis(260))
                .is_err()
        );
    }
}
