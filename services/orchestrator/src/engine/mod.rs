//! The flow engine: drives tasks node by node, appending every step to the store.
//!
//! A task is driven by at most one tokio task per process ([`Engine::poke`]), and by at most
//! one process at a time (the task's lease in the store; appends are guarded by owner and
//! sequence number). The driver folds the task's log into a [`TaskState`], asks the pure
//! decider ([`decide::decide`]) what to do, appends the resulting events and repeats until
//! the task waits (for a call, a timer or a person) or ends. Calls are made only after the
//! attempt is durably recorded, with a message id derived from task, slot and attempt, so
//! re-sending after a crash is deduplicated by the receiving SDK.
//!
//! # Modules
//! - [`budget`]: the evaluation slots, shared and per flow.
//! - [`clock`]: [`Clock`], wall-clock milliseconds that follow tokio's (paused) clock.
//! - [`decide`]: the decider, a pure function of state, flow, time and a random source,
//!   dispatching to one module per node kind: `task`, `parallel` (both over the call slots of
//!   `slots`), `condition`, `human`, `wait` and `end` (`succeed` and `fail`). `step` holds
//!   what they share (the [`decide::Step`] they return, completing and failing a node).
//! - `driver`: [`Engine::poke`] and the per-task driver loop (claim, decide — on the blocking
//!   pool when expressions are evaluated — append, call), and the task's span at its end.
//! - `call`: the router call of one attempt, whether a failure provably did not deliver, and
//!   the task span's id ([`task_span_id`]).
//! - `commands`: StartTask, ResumeTask, CancelTask and RetryTask, which hold the task's
//!   driver while they append.
//! - `loops`: the background loops — leases (renew; claim unowned or expired tasks, which is
//!   how a restarted or surviving replica resumes work), timers (poke tasks whose durable
//!   timers are due), purge (drop ended tasks after the context TTL), the tasks-by-status
//!   gauges, and the flows directory watch.
//! - `testing` (tests only): flows, folded states and a seeded RNG for the decider's tests.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, Semaphore, broadcast, watch};

use crate::config::ConfigError;
use crate::error::Error;
use crate::event::{StoredEvent, TaskState};
use crate::flows::FlowRegistry;
use crate::store::{Store, TaskSummary};

pub mod budget;
mod call;
pub mod clock;
mod commands;
mod condition;
pub mod decide;
mod driver;
mod end;
mod human;
mod loops;
mod parallel;
mod slots;
mod step;
mod task;
#[cfg(test)]
mod testing;
mod wait;

pub use call::task_span_id;
pub use clock::Clock;
pub use commands::StartOptions;
pub use decide::message_id;

/// Engine settings (a part of [`crate::OrchestratorConfig`]).
#[derive(Debug, Clone)]
pub struct EngineSettings {
    /// This replica's id (lease owner).
    pub node_id: String,
    /// How long a lease lasts; renewed every third of it.
    pub lease: Duration,
    /// Longest a call may take when its node has no `timeout`.
    pub default_call_timeout: Duration,
    /// Tasks driven concurrently.
    pub max_concurrent_tasks: usize,
    /// How often unowned tasks and timers are polled (other replicas' changes).
    pub poll_interval: Duration,
    /// Ended tasks are purged this long after they end.
    pub context_ttl: Duration,
    /// Node visits a task may make between retries before it fails.
    pub max_node_visits: usize,
    /// Expression evaluations run at once on the blocking pool.
    pub max_concurrent_evaluations: usize,
    /// Of those, the most one flow's tasks may run at once (see [`budget`]).
    pub max_evaluations_per_flow: usize,
    /// The `source` written in message headers.
    pub source: String,
}

/// A task being driven in this process.
struct Active {
    /// Set by [`Engine::poke`] while the driver runs: look at the log again when done.
    dirty: bool,
    /// Wakes the driver while it waits for calls.
    notify: Arc<Notify>,
}

pub(crate) struct Inner {
    pub(crate) store: Store,
    pub(crate) flows: FlowRegistry,
    pub(crate) clock: Clock,
    pub(crate) settings: EngineSettings,
    router: call::Router,
    /// Tasks with a driver in this process.
    active: Mutex<HashMap<String, Active>>,
    /// Commands waiting to append, per task: the task's driver pauses between steps while a
    /// task has one, so a command always gets in (see [`Engine::hold`]).
    held: Mutex<HashMap<String, usize>>,
    /// Bounds the drivers running at once (`max_concurrent_tasks`).
    permits: Arc<Semaphore>,
    /// Bounds the decisions that evaluate expressions, run on the blocking pool
    /// (`max_concurrent_evaluations` in all, `max_evaluations_per_flow` per flow).
    evaluations: Arc<budget::EvalBudgets>,
    /// Wakes the timer loop when a new timer is scheduled.
    timer_wake: Notify,
    /// "Task X appended up to seq N", for WatchTask.
    pub(crate) events: broadcast::Sender<Arc<(String, i64)>>,
    /// Flipped to true to stop the loops and drivers.
    stop: watch::Sender<bool>,
    /// Whether the store is an SQLite file this process owns alone (no leases).
    exclusive: bool,
}

impl Inner {
    pub(crate) fn stop_receiver(&self) -> watch::Receiver<bool> {
        self.stop.subscribe()
    }
}

/// The flow engine. Cheap to clone.
#[derive(Clone)]
pub struct Engine {
    pub(crate) inner: Arc<Inner>,
}

/// The task-row projection of a state.
pub fn summary_of(state: &TaskState) -> TaskSummary {
    TaskSummary {
        task_id: state.id.clone(),
        flow_id: state.flow_id.clone(),
        flow_version: state.flow_version,
        status: state.status,
        current_node: state.current.clone(),
        seq: state.seq,
        created_ms: state.created_ms,
        updated_ms: state.updated_ms,
        ended_ms: state.ended_ms,
        trace_id: state.trace_id.clone(),
        error: state.error.clone(),
        failed_node: state.failed_node.clone(),
    }
}

impl Engine {
    /// An engine over `store` and `flows`, calling capabilities through the router at
    /// `router_endpoint` (connected lazily; over TLS presenting `tls`'s certificate when
    /// given). Call [`Engine::start`] to run it.
    ///
    /// # Errors
    /// [`Error::Config`] ([`ConfigError::RouterEndpoint`]) when the router endpoint is not a
    /// valid URI.
    pub fn new(
        store: Store,
        flows: FlowRegistry,
        router_endpoint: &str,
        settings: EngineSettings,
        clock: Clock,
        tls: Option<&Arc<reach_trust::tls::TlsSource>>,
    ) -> Result<Self, Error> {
        let endpoint = reach_rpc::http2::endpoint(router_endpoint)
            .map_err(|e| ConfigError::RouterEndpoint {
                endpoint: router_endpoint.to_string(),
                detail: e.to_string(),
            })?
            .connect_timeout(Duration::from_secs(5));
        let router = call::Router::new(reach_telemetry::traced_channel(
            reach_rpc::http2::channel_lazy(&endpoint, tls, None),
        ));
        let (events, _) = broadcast::channel(8192);
        let (stop, _) = watch::channel(false);
        let exclusive = store.is_exclusive();
        Ok(Self {
            inner: Arc::new(Inner {
                store,
                flows,
                clock,
                permits: Arc::new(Semaphore::new(settings.max_concurrent_tasks.max(1))),
                evaluations: budget::EvalBudgets::new(
                    settings.max_concurrent_evaluations,
                    settings.max_evaluations_per_flow,
                ),
                settings,
                router,
                active: Mutex::new(HashMap::new()),
                held: Mutex::new(HashMap::new()),
                timer_wake: Notify::new(),
                events,
                stop,
                exclusive,
            }),
        })
    }

    /// Decisions evaluating expressions right now (at most `max_concurrent_evaluations`).
    pub fn evaluations_running(&self) -> usize {
        self.inner.evaluations.running()
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.inner.store
    }

    /// The flow registry.
    pub fn flows(&self) -> &FlowRegistry {
        &self.inner.flows
    }

    /// This replica's id, the owner of its task and webhook leases.
    pub fn node_id(&self) -> &str {
        &self.inner.settings.node_id
    }

    /// The clock.
    pub fn clock(&self) -> Clock {
        self.inner.clock
    }

    /// Stops the background loops (drivers in flight finish their current step) and, on a
    /// shared store, releases this replica's leases so others take over at once.
    pub async fn stop(&self) {
        self.halt();
        if !self.inner.exclusive
            && let Err(e) = self
                .inner
                .store
                .release_all(&self.inner.settings.node_id)
                .await
        {
            tracing::warn!(error = %e, "cannot release leases");
        }
    }

    /// Stops the background loops and drivers without releasing leases, as a crash would:
    /// other replicas take the tasks over once the leases expire.
    pub fn halt(&self) {
        let _ = self.inner.stop.send(true);
    }

    fn stopped(&self) -> bool {
        *self.inner.stop.borrow()
    }

    /// Loads and folds a task's log.
    ///
    /// # Errors
    /// [`Error::TaskNotFound`] when the task does not exist; [`Error::Store`].
    pub async fn load(&self, task_id: &str) -> Result<TaskState, Error> {
        let events = self.inner.store.events(task_id, 0).await?;
        if events.is_empty() {
            return Err(Error::TaskNotFound {
                task_id: task_id.to_string(),
            });
        }
        Ok(TaskState::fold(task_id, &events))
    }

    /// Subscribes to "task X appended up to seq N" notifications (used by WatchTask).
    pub(crate) fn subscribe(&self) -> broadcast::Receiver<Arc<(String, i64)>> {
        self.inner.events.subscribe()
    }

    /// Events of a task after `after_seq` (for watchers).
    ///
    /// # Errors
    /// [`Error::Store`].
    pub async fn events_after(
        &self,
        task_id: &str,
        after_seq: i64,
    ) -> Result<Vec<StoredEvent>, Error> {
        Ok(self.inner.store.events(task_id, after_seq).await?)
    }
}
