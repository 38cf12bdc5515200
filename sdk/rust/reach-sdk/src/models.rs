//! [`ModelSlots`]: how many model (LLM) calls an agent runs at once and how many more it
//! could start, reported in every heartbeat so the router balances model-bound agents as
//! they are.
//!
//! An agent that calls a model wraps each call in a guard:
//!
//! ```no_run
//! # async fn model_call(slots: reach_sdk::ModelSlots) {
//! let _slot = slots.acquire().await; // waits while every slot is taken
//! // ... call the model; the slot frees when `_slot` drops ...
//! # }
//! ```
//!
//! With a limit (`AgentConfig::model_slots`), a heartbeat reports
//! `model_calls_in_flight` and `model_slots_free`, and the instance reports BUSY while
//! every slot is taken (so the router sends work to an instance whose model has room); a
//! change into or out of that state sends a heartbeat at once. Without a limit (0, the
//! default) guards never wait and nothing is reported, unless the agent reports its own
//! figures with [`ModelSlots::set`] (a model client that keeps its own limits).

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// The most a heartbeat may report for either figure (the registry refuses more).
pub const MAX_REPORTED: u32 = 1_000_000;

/// The model load an instance reports: calls in flight and slots free.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ModelLoad {
    /// Model calls in flight now.
    pub in_flight: u32,
    /// Model calls that could start at once now.
    pub free: u32,
}

impl ModelLoad {
    /// Whether every slot is taken while calls run: the instance should report BUSY.
    pub fn saturated(&self) -> bool {
        self.in_flight > 0 && self.free == 0
    }
}

/// The model call slots of one agent instance. Cheap to clone; clones share the slots.
#[derive(Clone, Debug)]
pub struct ModelSlots {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// The most model calls at once; 0: unlimited (guards never wait, nothing reported).
    limit: u32,
    /// One permit per free slot (`limit` of them; unused when unlimited).
    permits: Arc<Semaphore>,
    /// Guards alive now.
    in_flight: AtomicU32,
    /// What the agent reported itself with [`ModelSlots::set`]; wins over the guards' count.
    reported: Mutex<Option<ModelLoad>>,
    /// Whether the last load read was saturated; a change wakes the heartbeat loop.
    saturated: AtomicBool,
    /// Woken when the load goes into or out of saturation.
    changed: Notify,
}

impl Default for ModelSlots {
    /// Unlimited slots: guards never wait and nothing is reported.
    fn default() -> Self {
        Self::new(0)
    }
}

impl ModelSlots {
    /// Slots for at most `limit` model calls at once (clamped to [`MAX_REPORTED`]); 0 means
    /// unlimited and unreported.
    pub fn new(limit: u32) -> Self {
        let limit = limit.min(MAX_REPORTED);
        Self {
            inner: Arc::new(Inner {
                limit,
                permits: Arc::new(Semaphore::new(limit as usize)),
                in_flight: AtomicU32::new(0),
                reported: Mutex::new(None),
                saturated: AtomicBool::new(false),
                changed: Notify::new(),
            }),
        }
    }

    /// The limit (0: unlimited).
    pub fn limit(&self) -> u32 {
        self.inner.limit
    }

    /// Takes a slot for one model call, waiting while every slot is taken; the slot frees
    /// when the guard drops. Cancel-safe: dropping the future while it waits takes nothing.
    pub async fn acquire(&self) -> ModelCallGuard {
        let permit = if self.inner.limit == 0 {
            None
        } else {
            // The semaphore is never closed.
            self.inner.permits.clone().acquire_owned().await.ok()
        };
        self.guard(permit)
    }

    /// Takes a slot when one is free now; `None` when every slot is taken.
    pub fn try_acquire(&self) -> Option<ModelCallGuard> {
        let permit = if self.inner.limit == 0 {
            None
        } else {
            Some(self.inner.permits.clone().try_acquire_owned().ok()?)
        };
        Some(self.guard(permit))
    }

    fn guard(&self, permit: Option<OwnedSemaphorePermit>) -> ModelCallGuard {
        self.inner.in_flight.fetch_add(1, Ordering::SeqCst);
        self.note_change();
        ModelCallGuard {
            slots: self.clone(),
            _permit: permit,
        }
    }

    /// Reports the agent's own figures (each clamped to [`MAX_REPORTED`]) instead of the
    /// guards' count, for a model client that keeps its own limits; every later heartbeat
    /// sends them until the next `set`.
    pub fn set(&self, in_flight: u32, free: u32) {
        *self
            .inner
            .reported
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(ModelLoad {
            in_flight: in_flight.min(MAX_REPORTED),
            free: free.min(MAX_REPORTED),
        });
        self.note_change();
    }

    /// What the next heartbeat reports: [`ModelSlots::set`]'s figures if any, else the
    /// guards' (zeros when unlimited).
    pub fn load(&self) -> ModelLoad {
        if let Some(reported) = *self
            .inner
            .reported
            .lock()
            .unwrap_or_else(|p| p.into_inner())
        {
            return reported;
        }
        if self.inner.limit == 0 {
            return ModelLoad::default();
        }
        let in_flight = self.inner.in_flight.load(Ordering::SeqCst);
        ModelLoad {
            in_flight,
            free: u32::try_from(self.inner.permits.available_permits()).unwrap_or(u32::MAX),
        }
    }

    /// Resolves at the next change into or out of saturation (for the heartbeat loop).
    pub(crate) async fn changed(&self) {
        self.inner.changed.notified().await;
    }

    fn note_change(&self) {
        let saturated = self.load().saturated();
        if self.inner.saturated.swap(saturated, Ordering::SeqCst) != saturated {
            self.inner.changed.notify_one();
        }
    }
}

/// One model call's slot, from [`ModelSlots::acquire`]; dropping it frees the slot.
#[derive(Debug)]
#[must_use = "the slot frees when the guard drops: hold it for the model call"]
pub struct ModelCallGuard {
    slots: ModelSlots,
    _permit: Option<OwnedSemaphorePermit>,
}

impl Drop for ModelCallGuard {
    fn drop(&mut self) {
        self.slots.inner.in_flight.fetch_sub(1, Ordering::SeqCst);
        // The permit returns after this body; count the slot as free for the report now.
        drop(self._permit.take());
        self.slots.note_change();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn guards_count_calls_and_saturation_is_signalled() {
        let slots = ModelSlots::new(2);
        assert_eq!(
            slots.load(),
            ModelLoad {
                in_flight: 0,
                free: 2
            }
        );
        let a = slots.acquire().await;
        let b = slots.try_acquire().expect("a second slot");
        assert!(slots.try_acquire().is_none());
        assert_eq!(
            slots.load(),
            ModelLoad {
                in_flight: 2,
                free: 0
            }
        );
        assert!(slots.load().saturated());
        // The change into saturation is waiting for the heartbeat loop.
        tokio::time::timeout(std::time::Duration::from_secs(1), slots.changed())
            .await
            .expect("signalled");
        drop(a);
        assert_eq!(
            slots.load(),
            ModelLoad {
                in_flight: 1,
                free: 1
            }
        );
        drop(b);
        assert_eq!(
            slots.load(),
            ModelLoad {
                in_flight: 0,
                free: 2
            }
        );
    }

    #[tokio::test]
    async fn unlimited_slots_report_nothing_until_set() {
        let slots = ModelSlots::default();
        let _a = slots.acquire().await;
        let _b = slots.acquire().await;
        assert_eq!(slots.load(), ModelLoad::default());
        slots.set(3, 0);
        assert!(slots.load().saturated());
        slots.set(u32::MAX, 1);
        assert_eq!(
            slots.load(),
            ModelLoad {
                in_flight: MAX_REPORTED,
                free: 1
            }
        );
    }
}
