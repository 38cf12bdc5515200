//! Evaluation slots: how many decisions that evaluate expressions run at once, in all and
//! per flow.
//!
//! Expression evaluations (conditions, node inputs) run on the blocking pool, at most
//! `max_concurrent_evaluations` at once. Without a bound per flow, one flow with heavy
//! conditions and many tasks would hold every slot, and every other flow's conditions would
//! wait behind it. So each flow's tasks first take one of their flow's own slots (at most
//! `max_evaluations_per_flow`), then one of the shared ones: a flow can hold at most its own
//! share of the shared slots, and tasks of the same flow queue on their flow's slots, not in
//! front of other flows. The per-flow map keeps only flows with an evaluation running or
//! waiting (an entry is removed when its last permit or waiter goes), so it stays as small
//! as the work in flight.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The evaluation slots, shared and per flow. Cheap to share behind an `Arc`.
#[derive(Debug)]
pub struct EvalBudgets {
    shared: Arc<Semaphore>,
    capacity: usize,
    per_flow: usize,
    /// Per flow in use: its slots, and how many evaluations hold or wait for one.
    flows: Mutex<HashMap<String, (Arc<Semaphore>, usize)>>,
}

/// A running evaluation's slots; released when dropped.
#[derive(Debug)]
pub struct EvalPermit {
    _shared: OwnedSemaphorePermit,
    _flow: FlowPermit,
}

/// A flow's slot, which forgets the flow's entry when it was the last use of it.
#[derive(Debug)]
struct FlowPermit {
    budgets: Arc<EvalBudgets>,
    flow: String,
    permit: Option<OwnedSemaphorePermit>,
}

impl Drop for FlowPermit {
    fn drop(&mut self) {
        drop(self.permit.take());
        self.budgets.release(&self.flow);
    }
}

impl EvalBudgets {
    /// `shared` slots in all, at most `per_flow` of them (capped at `shared`) for one flow's
    /// tasks at once; both at least 1.
    pub fn new(shared: usize, per_flow: usize) -> Arc<Self> {
        let shared = shared.max(1);
        Arc::new(Self {
            shared: Arc::new(Semaphore::new(shared)),
            capacity: shared,
            per_flow: per_flow.clamp(1, shared),
            flows: Mutex::default(),
        })
    }

    /// The most slots one flow may hold at once.
    pub fn per_flow(&self) -> usize {
        self.per_flow
    }

    /// Waits for one of `flow`'s slots, then one of the shared ones. `None` when the
    /// semaphores are closed (never, in practice).
    pub async fn acquire(self: &Arc<Self>, flow: &str) -> Option<EvalPermit> {
        let semaphore = {
            let mut flows = self.flows.lock().unwrap_or_else(PoisonError::into_inner);
            let (semaphore, users) = flows
                .entry(flow.to_string())
                .or_insert_with(|| (Arc::new(Semaphore::new(self.per_flow)), 0));
            *users += 1;
            semaphore.clone()
        };
        // Built before waiting, so a waiter dropped midway (the task is stopped) is counted
        // out too.
        let mut flow_permit = FlowPermit {
            budgets: self.clone(),
            flow: flow.to_string(),
            permit: None,
        };
        flow_permit.permit = Some(semaphore.acquire_owned().await.ok()?);
        let shared = self.shared.clone().acquire_owned().await.ok()?;
        Some(EvalPermit {
            _shared: shared,
            _flow: flow_permit,
        })
    }

    /// Evaluations running now (holding a shared slot).
    pub fn running(&self) -> usize {
        self.capacity - self.shared.available_permits()
    }

    /// Flows with an evaluation running or waiting.
    pub fn flows_in_use(&self) -> usize {
        self.flows
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Counts out one holder or waiter of `flow`'s slots; the last one removes the entry.
    fn release(&self, flow: &str) {
        let mut flows = self.flows.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, users)) = flows.get_mut(flow) {
            *users = users.saturating_sub(1);
            if *users == 0 {
                flows.remove(flow);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;

    /// A flow that holds its share waits for its own slots, while another flow's evaluation
    /// still gets a shared slot at once.
    #[tokio::test]
    async fn a_busy_flow_waits_on_its_own_slots_and_others_run() {
        let budgets = EvalBudgets::new(4, 2);
        let heavy1 = budgets.acquire("heavy").await.unwrap();
        let _heavy2 = budgets.acquire("heavy").await.unwrap();
        // The heavy flow's third evaluation waits although two shared slots are free.
        let mut heavy3 = Box::pin(budgets.acquire("heavy"));
        assert!((&mut heavy3).now_or_never().is_none());
        // Another flow runs at once.
        let light = budgets
            .acquire("light")
            .now_or_never()
            .expect("another flow is not held up")
            .unwrap();
        drop(light);
        // When the heavy flow frees one of its slots, its waiter runs.
        drop(heavy1);
        assert!(
            heavy3
                .now_or_never()
                .expect("the waiter got the slot")
                .is_some()
        );
    }

    /// With many busy flows, the shared cap still bounds the total.
    #[tokio::test]
    async fn the_shared_cap_bounds_all_flows_together() {
        let budgets = EvalBudgets::new(2, 1);
        let _a = budgets.acquire("a").await.unwrap();
        let _b = budgets.acquire("b").await.unwrap();
        assert!(budgets.acquire("c").now_or_never().is_none());
    }

    /// Entries of flows with nothing running or waiting are dropped, waiters abandoned
    /// midway included: the map stays as small as the work in flight.
    #[tokio::test]
    async fn idle_flows_are_forgotten() {
        let budgets = EvalBudgets::new(4, 1);
        let held = budgets.acquire("f").await.unwrap();
        assert_eq!(budgets.flows_in_use(), 1);
        let mut waiter = Box::pin(budgets.acquire("f"));
        assert!((&mut waiter).now_or_never().is_none());
        drop(waiter);
        assert_eq!(budgets.flows_in_use(), 1, "the holder still uses it");
        drop(held);
        assert_eq!(budgets.flows_in_use(), 0);
        for i in 0..1000 {
            drop(budgets.acquire(&format!("flow-{i}")).await.unwrap());
        }
        assert_eq!(budgets.flows_in_use(), 0);
    }

    #[test]
    fn the_per_flow_share_is_at_most_the_shared_cap() {
        assert_eq!(EvalBudgets::new(4, 10).per_flow(), 4);
        assert_eq!(EvalBudgets::new(0, 0).per_flow(), 1);
    }
}
