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

/// Remembers outcomes by message id for `window`, holding at most `capacity` ids and at most
/// `max_bytes` of outcomes (as [`DedupeCache::charge`]d), the oldest forgotten first.
pub struct DedupeCache<T> {
    window: Duration,
    capacity: usize,
    max_bytes: usize,
    inner: Mutex<Inner<T>>,
}

struct Inner<T> {
    slots: HashMap<String, Entry<T>>,
    /// Insertion order, for expiry and eviction.
    order: VecDeque<(Instant, String)>,
    /// The bytes charged to the remembered ids.
    bytes: usize,
}

struct Entry<T> {
    slot: Slot<T>,
    /// The bytes charged to this id.
    bytes: usize,
}

impl<T> Inner<T> {
    fn forget_oldest(&mut self) {
        if let Some((_, id)) = self.order.pop_front()
            && let Some(entry) = self.slots.remove(&id)
        {
            self.bytes -= entry.bytes;
        }
    }
}

impl<T> DedupeCache<T> {
    /// An empty cache remembering ids for `window`, at most `capacity` of them and
    /// `max_bytes` of charged outcomes.
    pub fn new(window: Duration, capacity: usize, max_bytes: usize) -> Self {
        Self {
            window,
            capacity: capacity.max(1),
            max_bytes,
            inner: Mutex::new(Inner {
                slots: HashMap::new(),
                order: VecDeque::new(),
                bytes: 0,
            }),
        }
    }

    /// Charges `bytes` (an outcome's size) to `message_id`, then forgets the oldest ids until
    /// the charged total is within `max_bytes` again — possibly `message_id` itself, when its
    /// outcome alone is larger. A redelivery of a forgotten id runs the handler again. An id
    /// no longer remembered is not charged.
    pub fn charge(&self, message_id: &str, bytes: usize) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let Some(entry) = inner.slots.get_mut(message_id) else {
            return;
        };
        entry.bytes += bytes;
        inner.bytes += bytes;
        while inner.bytes > self.max_bytes && !inner.order.is_empty() {
            inner.forget_oldest();
        }
    }

    /// The bytes charged to the remembered ids.
    pub fn bytes(&self) -> usize {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).bytes
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
            inner.forget_oldest();
        }
        if let Some(entry) = inner.slots.get(message_id) {
            return entry.slot.clone();
        }
        let slot = Slot::default();
        inner.slots.insert(
            message_id.to_string(),
            Entry {
                slot: slot.clone(),
                bytes: 0,
            },
        );
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
        let cache = DedupeCache::<u32>::new(Duration::from_secs(10), 100, 1 << 20);
        cache.slot("a").get_or_init(|| async { 1 }).await;
        assert_eq!(cache.slot("a").get(), Some(&1));
        tokio::time::advance(Duration::from_secs(11)).await;
        assert_eq!(cache.slot("a").get(), None);
    }

    #[tokio::test]
    async fn capacity_bounds_memory() {
        let cache = DedupeCache::<u32>::new(Duration::from_secs(60), 3, 1 << 20);
        for id in ["a", "b", "c", "d", "e"] {
            cache.slot(id);
        }
        assert!(cache.len() <= 3);
    }

    #[tokio::test]
    async fn charged_bytes_bound_memory_forgetting_the_oldest_first() {
        let cache = DedupeCache::<u32>::new(Duration::from_secs(60), 100, 10_000);
        for (n, id) in ["a", "b", "c", "d"].into_iter().enumerate() {
            cache.slot(id).get_or_init(|| async move { n as u32 }).await;
            cache.charge(id, 4_000);
        }
        // 16 000 bytes charged against 10 000: a and b are forgotten, c and d remembered.
        assert_eq!(cache.bytes(), 8_000);
        assert_eq!(cache.slot("c").get(), Some(&2));
        assert_eq!(cache.slot("d").get(), Some(&3));
        assert_eq!(cache.slot("a").get(), None, "the oldest went first");
        // An outcome larger than the whole budget is not kept at all.
        cache.slot("huge");
        cache.charge("huge", 20_000);
        assert_eq!(cache.slot("huge").get(), None);
        assert!(cache.bytes() <= 10_000, "{}", cache.bytes());
    }
}
