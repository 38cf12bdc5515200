//! The driver: one tokio task per task being driven, looping claim → decide → append → call
//! until the task waits or ends.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use rand::SeedableRng;
use rand::rngs::SmallRng;
use tokio::sync::Notify;
use tokio::task::JoinSet;

use crate::error::Error;
use crate::event::{Event, TaskState, TaskStatus};
use crate::flow::{Flow, NodeKind};
use crate::store::{Append, AppendOutcome, Guard};

use super::call::{self, CallContext};
use super::clock::ms;
use super::decide::{self, Bounds, CallResult, Step};
use super::{Active, Engine, summary_of};

impl Engine {
    /// Makes sure the task is being driven (spawns a driver, or tells the running one to
    /// look again).
    pub fn poke(&self, task_id: &str) {
        self.poke_with(task_id, None);
    }

    /// [`Engine::poke`], handing a new driver the task's state as this process just appended
    /// it, so it does not read back the log it wrote. A running driver reloads instead.
    pub(super) fn poke_with(&self, task_id: &str, state: Option<TaskState>) {
        if self.stopped() {
            return;
        }
        let mut active = self.inner.active.lock().expect("active map lock");
        if let Some(a) = active.get_mut(task_id) {
            a.dirty = true;
            a.notify.notify_one();
            return;
        }
        let notify = Arc::new(Notify::new());
        active.insert(
            task_id.to_string(),
            Active {
                dirty: false,
                notify: notify.clone(),
            },
        );
        drop(active);
        let engine = self.clone();
        let id = task_id.to_string();
        let span = tracing::info_span!("task", task_id = %id);
        tokio::spawn(tracing::Instrument::instrument(
            async move { engine.drive(id, notify, state).await },
            span,
        ));
    }

    async fn drive(self, task_id: String, notify: Arc<Notify>, mut state: Option<TaskState>) {
        let Ok(_permit) = self.inner.permits.clone().acquire_owned().await else {
            return;
        };
        loop {
            if let Err(e) = self.drive_once(&task_id, &notify, state.take()).await {
                tracing::warn!(task_id = %task_id, error = %e, "driving task failed; will retry");
                let e2 = self.clone();
                let id = task_id.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    e2.poke(&id);
                });
            }
            let mut active = self.inner.active.lock().expect("active map lock");
            match active.get_mut(&task_id) {
                Some(a) if a.dirty && !self.stopped() => a.dirty = false,
                _ => {
                    active.remove(&task_id);
                    return;
                }
            }
        }
    }

    /// The guard of the engine's own appends.
    fn engine_guard(&self) -> Guard {
        if self.inner.exclusive {
            Guard::Seq
        } else {
            Guard::Owner(self.inner.settings.node_id.clone())
        }
    }

    async fn claim(&self, task_id: &str) -> Result<bool, Error> {
        if self.inner.exclusive {
            // One process owns an SQLite store: every task is ours.
            return Ok(true);
        }
        let now = self.inner.clock.now_ms();
        let lease = ms(self.inner.settings.lease);
        Ok(self
            .inner
            .store
            .claim(
                task_id,
                &self.inner.settings.node_id,
                now,
                now + lease,
                false,
            )
            .await?)
    }

    /// Drives the task until it waits or ends. `handed` is the state as this process last
    /// appended it (no reload needed); if another writer appended meanwhile, the first
    /// conflicting append reloads and carries on.
    async fn drive_once(
        &self,
        task_id: &str,
        notify: &Notify,
        handed: Option<TaskState>,
    ) -> Result<(), Error> {
        if !self.claim(task_id).await? {
            return Ok(());
        }
        let mut unverified = handed.is_some();
        let mut state = match handed {
            Some(state) => state,
            None => self.load(task_id).await?,
        };
        let Some(flow) = self.inner.flows.get(&state.flow_id, state.flow_version) else {
            if state.status.is_terminal() {
                return Ok(());
            }
            tracing::error!(
                task_id = %task_id,
                flow_id = %state.flow_id,
                flow_version = state.flow_version,
                "the task's flow version is not loaded; apply it again to resume the task"
            );
            return Ok(());
        };
        let mut rng = SmallRng::from_os_rng();
        let mut calls: JoinSet<CallResult> = JoinSet::new();
        let mut running: HashSet<String> = HashSet::new();
        let bounds = self.bounds();
        loop {
            if state.status.is_terminal() || self.stopped() {
                calls.abort_all();
                return Ok(());
            }
            if self.held(task_id) {
                // A command (CancelTask, ...) waits to append: let it in, then read its
                // result. Calls in flight keep running.
                while self.held(task_id) && !self.stopped() {
                    notify.notified().await;
                }
                if let Some(a) = self
                    .inner
                    .active
                    .lock()
                    .expect("active map lock")
                    .get_mut(task_id)
                {
                    a.dirty = false;
                }
                state = self.load(task_id).await?;
                unverified = false;
                continue;
            }
            let now = self.inner.clock.now_ms();
            match self
                .decide_step(&state, &flow, now, &running, &bounds, &mut rng)
                .await?
            {
                Step::Events(events) => {
                    if !self.append(&mut state, events, self.engine_guard()).await? {
                        if std::mem::take(&mut unverified) {
                            state = self.load(task_id).await?;
                            continue;
                        }
                        calls.abort_all();
                        return Ok(());
                    }
                    continue;
                }
                Step::Calls(specs) => {
                    for spec in specs {
                        running.insert(spec.slot.clone());
                        let router = self.inner.router.clone();
                        let clock = self.inner.clock;
                        let cx = CallContext {
                            task_id: state.id.clone(),
                            trace_id: state.trace_id.clone(),
                            flow_id: state.flow_id.clone(),
                            source: self.inner.settings.source.clone(),
                            default_timeout: self.inner.settings.default_call_timeout,
                        };
                        calls.spawn(async move { call::call(router, clock, cx, spec).await });
                    }
                }
                Step::Park => {}
            }
            if running.is_empty() {
                return Ok(());
            }
            tokio::select! {
                Some(done) = calls.join_next() => {
                    let Ok(done) = done else { continue };
                    running.remove(&done.slot);
                    let now = self.inner.clock.now_ms();
                    let events =
                        decide::on_call_result(&state, &flow, now, done, &bounds, &mut rng);
                    if !events.is_empty()
                        && !self.append(&mut state, events, self.engine_guard()).await?
                    {
                        calls.abort_all();
                        return Ok(());
                    }
                }
                () = notify.notified() => {
                    if let Some(a) = self.inner.active.lock().expect("active map lock").get_mut(task_id) {
                        a.dirty = false;
                    }
                    if !self.claim(task_id).await? {
                        calls.abort_all();
                        return Ok(());
                    }
                    state = self.load(task_id).await?;
                    unverified = false;
                }
            }
        }
    }

    /// The bounds the decider keeps to.
    fn bounds(&self) -> Bounds {
        Bounds {
            max_node_visits: self.inner.settings.max_node_visits,
            default_call_timeout_ms: ms(self.inner.settings.default_call_timeout),
        }
    }

    /// Decides the next step. A decision that evaluates expressions (a condition, a node
    /// input to build) runs on the blocking pool, at most `max_concurrent_evaluations` at
    /// once and `max_evaluations_per_flow` of one flow's tasks, so a slow expression never holds a thread that serves RPCs (each evaluation is
    /// bounded by its own budget too).
    async fn decide_step(
        &self,
        state: &TaskState,
        flow: &Arc<Flow>,
        now: i64,
        running: &HashSet<String>,
        bounds: &Bounds,
        rng: &mut SmallRng,
    ) -> Result<Step, Error> {
        if !evaluates(state, flow) {
            return Ok(decide::decide(state, flow, now, running, bounds, rng));
        }
        let Some(permit) = self.inner.evaluations.acquire(&flow.id).await else {
            return Ok(Step::Park);
        };
        let (state, flow, running, bounds) =
            (state.clone(), flow.clone(), running.clone(), *bounds);
        let mut rng = SmallRng::from_rng(rng);
        let step = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            decide::decide(&state, &flow, now, &running, &bounds, &mut rng)
        })
        .await;
        match step {
            Ok(step) => Ok(step),
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // The runtime is shutting down.
            Err(_) => Ok(Step::Park),
        }
    }

    /// Appends `events` to `state` under `guard`; `false` on conflict (state is then stale).
    pub(super) async fn append(
        &self,
        state: &mut TaskState,
        events: Vec<Event>,
        guard: Guard,
    ) -> Result<bool, Error> {
        let now = self.inner.clock.now_ms();
        let expected = state.seq;
        let fired_lags: Vec<i64> = events
            .iter()
            .filter_map(|e| match e {
                Event::TimerFired { timer } => state.timers.get(timer).map(|t| now - t.fire_at_ms),
                _ => None,
            })
            .collect();
        for e in &events {
            state.apply(e, now);
        }
        let schedules_timer = events
            .iter()
            .any(|e| matches!(e, Event::TimerScheduled { .. }));
        let n = events.len();
        let ended = events.iter().find_map(|e| match e {
            Event::TaskEnded { status, .. } => Some(*status),
            _ => None,
        });
        let outcome = self
            .inner
            .store
            .append(Append {
                expected_seq: expected,
                events,
                at_ms: now,
                summary: summary_of(state),
                guard,
            })
            .await?;
        match outcome {
            AppendOutcome::Appended(seq) => {
                state.seq = seq;
                let _ = self.inner.events.send(Arc::new((state.id.clone(), seq)));
                if schedules_timer {
                    self.inner.timer_wake.notify_one();
                }
                tracing::trace!(task_id = %state.id, events = n, seq, "appended");
                crate::metrics::transition(state.status);
                for lag in fired_lags {
                    crate::metrics::timer_lag(Duration::from_millis(
                        u64::try_from(lag).unwrap_or(0),
                    ));
                }
                if ended == Some(TaskStatus::Failed) {
                    crate::metrics::dead_letter();
                }
                if let Some(status) = ended {
                    export_task_span(state, status, now);
                    tracing::info!(
                        task_id = %state.id,
                        trace_id = %state.trace_id,
                        flow_id = %state.flow_id,
                        status = status.as_str(),
                        "task ended"
                    );
                }
                Ok(true)
            }
            AppendOutcome::Conflict => Ok(false),
        }
    }
}

/// Whether deciding at the task's current node may evaluate expressions: a condition, or a
/// task or parallel node with an input template.
fn evaluates(state: &TaskState, flow: &Flow) -> bool {
    let Some(node) = state.current.as_deref().and_then(|c| flow.node(c)) else {
        return false;
    };
    match &node.kind {
        NodeKind::Condition { .. } => true,
        NodeKind::Task { input, .. } => input.is_some(),
        NodeKind::Parallel { branches, .. } => branches.iter().any(|b| b.input.is_some()),
        _ => false,
    }
}

/// Exports the task's span, the root of its trace, now that it ended at `now_ms`: started
/// when the task was created, with the id every node span names as its parent.
fn export_task_span(state: &TaskState, status: TaskStatus, now_ms: i64) {
    let Ok(trace_id) = reach_rpc::trace::TraceId::parse(&state.trace_id) else {
        return;
    };
    let at =
        |ms: i64| std::time::UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0));
    let error = (status == TaskStatus::Failed).then(|| {
        state
            .error
            .clone()
            .unwrap_or_else(|| status.as_str().to_string())
    });
    reach_telemetry::export_root_span(
        "orchestrator.task",
        trace_id,
        super::call::task_span_id(&state.id),
        (at(state.created_ms), at(now_ms)),
        vec![
            ("task_id", state.id.clone()),
            ("flow_id", state.flow_id.clone()),
            ("flow_version", state.flow_version.to_string()),
            ("task.status", status.as_str().to_string()),
        ],
        error,
    );
}
