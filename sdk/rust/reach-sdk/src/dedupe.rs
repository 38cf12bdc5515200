//! Duplicate suppression: a bounded, time-windowed memory of handled message ids.
//!
//! A message redelivered (a retry after a lost reply, or a replayed orchestrator step) gets
//! the reply of its first delivery and does not run the handler again. A duplicate that
//! arrives while the first is still running waits for it.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::OnceCell;
use tokio::time::Instant;

/// The shared outcome slot of one message id.
pub type Slot<T> = Arc<OnceCell<T>>;

/// Remembers outcomes by message id for `window`, holding at most `capacity` ids.
pub struct DedupeCache<T> {
    window: Duration,
    capacity: usize,
    inner: Mutex<Inner<T>>,
}

struct Inner<T> {
    slots: HashMap<String, Slot<T>>,
    /// Insertion order, for expiry and eviction.
    order: VecDeque<(Instant, String)>,
}

impl<T> DedupeCache<T> {
    /// An empty cache.
    pub fn new(window: Duration, capacity: usize) -> Self {
        Self {
            window,
            capacity: capacity.max(1),
            inner: Mutex::new(Inner {
                slots: HashMap::new(),
                order: VecDeque::new(),
            }),
        }
    }

    /// The slot for `message_id`: a new empty one the first time, the same one for every
    /// repeat within the window. Initialise it with `get_or_init` / `get_or_try_init`.
    pub fn slot(&self, message_id: &str) -> Slot<T> {
        let now = Instant::now();
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        while let Some((at, _)) = inner.order.front() {
            if now.duration_since(*at) < self.window && inner.order.len() < self.capacity {
                break;
            }
            if let Some((_, id)) = inner.order.pop_front() {
                inner.slots.remove(&id);
            }
        }
        if let Some(slot) = inner.slots.get(message_id) {
            return slot.clone();
        }
        let slot = Slot::default();
        inner.slots.insert(message_id.to_string(), slot.clone());
        inner.order.push_back((now, message_id.to_string()));
        slot
    }

    /// How many ids are remembered.
    pub fn len(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .slots
            .len()
    }

    /// Whether no id is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn repeats_share_a_slot_until_the_window_passes() {
        let cache = DedupeCache::<u32>::new(Duration::from_secs(10), 100);
        cache.slot("a").get_or_init(|| async { 1 }).await;
        assert_eq!(cache.slot("a").get(), Some(&1));
        tokio::time::advance(Duration::from_secs(11)).await;
        assert_eq!(cache.slot("a").get(), None);
    }

    #[tokio::test]
    async fn capacity_bounds_memory() {
        let cache = DedupeCache::<u32>::new(Duration::from_secs(60), 3);
        for id in ["a", "b", "c", "d", "e"] {
            cache.slot(id);
        }
        assert!(cache.len() <= 3);
    }
}
