//! The flow engine: drives tasks node by node, appending every step to the store.
//!
//! A task is driven by at most one tokio task per process ([`Engine::poke`]), and by at most
//! one process at a time (the task's lease in the store; appends are guarded by owner and
//! sequence number). The driver folds the task's log into a [`TaskState`], asks
//! [`Engine::decide`] what to do, appends the resulting events and repeats until the task
//! waits (for a call, a timer or a person) or ends. Calls are made only after the attempt is
//! durably recorded, with a message id derived from task, slot and attempt, so re-sending
//! after a crash is deduplicated by the receiving SDK.
//!
//! Background loops: timers (poke tasks whose durable timers are due), leases (renew, claim
//! unowned or expired tasks — this is how a restarted or surviving replica resumes work) and
//! purge (drop ended tasks after the context TTL).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reach_proto::v1::router_service_client::RouterServiceClient;
use reach_proto::v1::{CallRequest, Header, Part, Payload, ReachMessage, header, part};
use reach_telemetry::grpc::GrpcClientTrace;
use serde_json::{Value, json};
use tokio::sync::{Notify, Semaphore, broadcast, watch};
use tokio::task::JoinSet;
use tonic::transport::Channel;

use crate::error::Error;
use crate::event::{Event, NodeOutcome, StoredEvent, TaskState, TaskStatus, TimerPurpose};
use crate::expr::{InputTemplate, Scope};
use crate::flow::{Flow, NodeKind};
use crate::flows::FlowRegistry;
use crate::store::{Append, AppendOutcome, Guard, Store, TaskSummary};

/// Wall-clock milliseconds that follow tokio's clock, so tests with paused time drive every
/// timer, back-off and lease deterministically.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    base_ms: i64,
    base: tokio::time::Instant,
}

impl Clock {
    /// A clock reading the system time now and advancing with `tokio::time::Instant`.
    pub fn new() -> Self {
        let base_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
            .unwrap_or(0);
        Self {
            base_ms,
            base: tokio::time::Instant::now(),
        }
    }

    /// Now, in unix milliseconds.
    pub fn now_ms(&self) -> i64 {
        self.base_ms + i64::try_from(self.base.elapsed().as_millis()).unwrap_or(i64::MAX / 2)
    }

    /// The tokio instant of unix millisecond `ms`.
    pub fn instant_at(&self, ms: i64) -> tokio::time::Instant {
        let offset = u64::try_from(ms.saturating_sub(self.base_ms)).unwrap_or(0);
        self.base + Duration::from_millis(offset)
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

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
    /// The `source` written in message headers.
    pub source: String,
}

struct Active {
    dirty: bool,
    notify: Arc<Notify>,
}

pub(crate) struct Inner {
    pub(crate) store: Store,
    pub(crate) flows: FlowRegistry,
    pub(crate) clock: Clock,
    pub(crate) settings: EngineSettings,
    router: RouterServiceClient<GrpcClientTrace<Channel>>,
    active: Mutex<HashMap<String, Active>>,
    permits: Arc<Semaphore>,
    timer_wake: Notify,
    pub(crate) events: broadcast::Sender<Arc<(String, i64)>>,
    stop: watch::Sender<bool>,
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

/// A call to make for one slot.
#[derive(Debug, Clone)]
struct CallSpec {
    slot: String,
    attempt: u32,
    message_id: String,
    capability: String,
    input: Value,
    deadline_ms: Option<i64>,
}

struct CallResult {
    slot: String,
    attempt: u32,
    result: Result<Value, (String, String)>,
}

enum Step {
    Events(Vec<Event>),
    Calls(Vec<CallSpec>),
    Park,
}

const MESSAGE_NAMESPACE: uuid::Uuid =
    uuid::Uuid::from_u128(0x6d1f_0c2b_7a4e_4f0e_9b1d_52c0_a1e3_77f1);

/// The message id of attempt `attempt` of `slot` in task `task_id`: a UUIDv5, so the same
/// attempt always carries the same id and a re-sent attempt is deduplicated.
pub fn message_id(task_id: &str, slot: &str, attempt: u32) -> String {
    uuid::Uuid::new_v5(
        &MESSAGE_NAMESPACE,
        format!("{task_id}/{slot}/{attempt}").as_bytes(),
    )
    .to_string()
}

fn timer_id(task_id: &str, visit: usize, purpose: &str, extra: &str) -> String {
    format!("{task_id}:{visit}:{purpose}:{extra}")
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
    /// `router_endpoint` (connected lazily). Call [`Engine::start`] to run it.
    ///
    /// # Errors
    /// [`Error::Config`] when the router endpoint is not a valid URI.
    pub fn new(
        store: Store,
        flows: FlowRegistry,
        router_endpoint: &str,
        settings: EngineSettings,
        clock: Clock,
    ) -> Result<Self, Error> {
        let endpoint = reach_rpc::http2::endpoint(router_endpoint)
            .map_err(|e| {
                Error::Config(format!(
                    "router endpoint {router_endpoint:?} is not a URI: {e}; use http://HOST:PORT"
                ))
            })?
            .connect_timeout(Duration::from_secs(5));
        let router =
            RouterServiceClient::new(reach_telemetry::traced_channel(endpoint.connect_lazy()));
        let (events, _) = broadcast::channel(8192);
        let (stop, _) = watch::channel(false);
        let exclusive = store.is_exclusive();
        Ok(Self {
            inner: Arc::new(Inner {
                store,
                flows,
                clock,
                permits: Arc::new(Semaphore::new(settings.max_concurrent_tasks.max(1))),
                settings,
                router,
                active: Mutex::new(HashMap::new()),
                timer_wake: Notify::new(),
                events,
                stop,
                exclusive,
            }),
        })
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.inner.store
    }

    /// The flow registry.
    pub fn flows(&self) -> &FlowRegistry {
        &self.inner.flows
    }

    /// The clock.
    pub fn clock(&self) -> Clock {
        self.inner.clock
    }

    /// Starts the background loops and resumes every unfinished task this replica can claim.
    /// Returns their join handles; [`Engine::stop`] ends them.
    pub fn start(&self) -> Vec<tokio::task::JoinHandle<()>> {
        let mut handles = Vec::new();
        let e = self.clone();
        handles.push(tokio::spawn(async move { e.lease_loop().await }));
        let e = self.clone();
        handles.push(tokio::spawn(async move { e.timer_loop().await }));
        let e = self.clone();
        handles.push(tokio::spawn(async move { e.purge_loop().await }));
        let e = self.clone();
        handles.push(tokio::spawn(async move { e.metrics_loop().await }));
        handles
    }

    /// Publishes the tasks-by-status gauges from the store every 2 s (the store is the truth
    /// when several replicas share it).
    async fn metrics_loop(self) {
        let mut stop = self.inner.stop.subscribe();
        loop {
            if let Ok(counts) = self.inner.store.count_by_status().await {
                for status in TaskStatus::ALL {
                    let count = counts
                        .iter()
                        .find(|(s, _)| *s == status)
                        .map_or(0, |(_, n)| *n);
                    reach_telemetry::metrics::orchestrator::tasks(
                        status_label(status),
                        usize::try_from(count).unwrap_or(0),
                    );
                }
            }
            tokio::select! {
                _ = stop.changed() => return,
                () = tokio::time::sleep(Duration::from_secs(2)) => {}
            }
            if *stop.borrow() {
                return;
            }
        }
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

    /// Makes sure the task is being driven (spawns a driver, or tells the running one to
    /// look again).
    pub fn poke(&self, task_id: &str) {
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
            async move { engine.drive(id, notify).await },
            span,
        ));
    }

    async fn drive(self, task_id: String, notify: Arc<Notify>) {
        let Ok(_permit) = self.inner.permits.clone().acquire_owned().await else {
            return;
        };
        loop {
            if let Err(e) = self.drive_once(&task_id, &notify).await {
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
        let lease = i64::try_from(self.inner.settings.lease.as_millis()).unwrap_or(30_000);
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

    /// Loads and folds a task's log.
    ///
    /// # Errors
    /// [`Error::NotFound`] when the task does not exist; store errors.
    pub async fn load(&self, task_id: &str) -> Result<TaskState, Error> {
        let events = self.inner.store.events(task_id, 0).await?;
        if events.is_empty() {
            return Err(Error::NotFound(format!(
                "task {task_id:?} does not exist (or was purged after its TTL)"
            )));
        }
        Ok(TaskState::fold(task_id, &events))
    }

    async fn drive_once(&self, task_id: &str, notify: &Notify) -> Result<(), Error> {
        if !self.claim(task_id).await? {
            return Ok(());
        }
        let mut state = self.load(task_id).await?;
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
        let mut calls: JoinSet<CallResult> = JoinSet::new();
        let mut running: HashSet<String> = HashSet::new();
        loop {
            if state.status.is_terminal() || self.stopped() {
                calls.abort_all();
                return Ok(());
            }
            match self.decide(&state, &flow, &running) {
                Step::Events(events) => {
                    if !self.append(&mut state, events, self.engine_guard()).await? {
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
                        let ctx = (
                            state.id.clone(),
                            state.trace_id.clone(),
                            state.flow_id.clone(),
                            self.inner.settings.clone(),
                        );
                        calls.spawn(async move { call(router, clock, ctx, spec).await });
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
                    let events = self.on_call_result(&state, &flow, done);
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
                }
            }
        }
    }

    /// Appends `events` to `state` under `guard`; `false` on conflict (state is then stale).
    async fn append(
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
                reach_telemetry::metrics::orchestrator::transition(status_label(state.status));
                for lag in fired_lags {
                    reach_telemetry::metrics::orchestrator::timer_lag(Duration::from_millis(
                        u64::try_from(lag).unwrap_or(0),
                    ));
                }
                if ended == Some(TaskStatus::Failed) {
                    reach_telemetry::metrics::orchestrator::dead_letter();
                }
                if let Some(status) = ended {
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

    fn scope(state: &TaskState) -> Scope {
        Scope {
            input: state.input.clone(),
            nodes: state.nodes_value(),
            task: json!({
                "id": state.id,
                "flow_id": state.flow_id,
                "flow_version": state.flow_version,
                "trace_id": state.trace_id,
            }),
        }
    }

    fn fail_node(
        state: &TaskState,
        flow: &Flow,
        node: &str,
        code: &str,
        error: String,
        handler: Option<String>,
    ) -> Vec<Event> {
        let catch = handler.or_else(|| flow.node(node).and_then(|n| n.catch.clone()));
        let mut events = vec![Event::NodeFailed {
            node: node.to_string(),
            code: code.to_string(),
            error: error.clone(),
            next: catch.clone(),
            output: Value::Null,
        }];
        match catch {
            Some(next) => events.push(Event::NodeEntered { node: next }),
            None => events.push(Event::TaskEnded {
                status: TaskStatus::Failed,
                output: state.output.clone(),
                error: Some(format!("node {node} failed: {error}")),
                failed_node: Some(node.to_string()),
            }),
        }
        events
    }

    fn complete(node: &str, outcome: NodeOutcome, output: Value, next: &str) -> Vec<Event> {
        vec![
            Event::NodeCompleted {
                node: node.to_string(),
                outcome,
                output,
                next: next.to_string(),
            },
            Event::NodeEntered {
                node: next.to_string(),
            },
        ]
    }

    /// Decides the next step of a task from its state alone.
    fn decide(&self, state: &TaskState, flow: &Flow, running: &HashSet<String>) -> Step {
        let now = self.inner.clock.now_ms();
        let Some(current) = state.current.clone() else {
            return Step::Events(vec![Event::NodeEntered {
                node: flow.initial.clone(),
            }]);
        };
        let Some(node) = flow.node(&current) else {
            return Step::Events(Self::fail_node(
                state,
                flow,
                &current,
                "FLOW",
                format!(
                    "node {current} is not in flow {} v{}",
                    flow.id, flow.version
                ),
                None,
            ));
        };
        let visit = state.visits.len();
        match &node.kind {
            NodeKind::Succeed => Step::Events(vec![
                Event::NodeCompleted {
                    node: current.clone(),
                    outcome: NodeOutcome::Succeeded,
                    output: state.output.clone(),
                    next: String::new(),
                },
                Event::TaskEnded {
                    status: if state.partial {
                        TaskStatus::Partial
                    } else {
                        TaskStatus::Succeeded
                    },
                    output: state.output.clone(),
                    error: None,
                    failed_node: None,
                },
            ]),
            NodeKind::Fail { error } => Step::Events(vec![
                Event::NodeFailed {
                    node: current.clone(),
                    code: "FLOW".into(),
                    error: error.clone(),
                    next: None,
                    output: Value::Null,
                },
                Event::TaskEnded {
                    status: TaskStatus::Failed,
                    output: state.output.clone(),
                    error: Some(error.clone()),
                    failed_node: Some(current.clone()),
                },
            ]),
            NodeKind::Condition { branches, default } => {
                let scope = Self::scope(state);
                let mut chosen = None;
                for (i, (expr, next)) in branches.iter().enumerate() {
                    match expr.eval_bool(&scope) {
                        Ok(true) => {
                            chosen = Some((Some(i), next.clone()));
                            break;
                        }
                        Ok(false) => {}
                        Err(e) => {
                            return Step::Events(Self::fail_node(
                                state,
                                flow,
                                &current,
                                "INVALID_ARGUMENT",
                                e.to_string(),
                                None,
                            ));
                        }
                    }
                }
                let (matched, next) = chosen.unwrap_or((None, default.clone()));
                Step::Events(Self::complete(
                    &current,
                    NodeOutcome::Succeeded,
                    json!({"next": next, "matched": matched}),
                    &next,
                ))
            }
            NodeKind::Wait { duration, next } => {
                let tid = timer_id(&state.id, visit, "wait", &current);
                match state.timers.get(&tid) {
                    None => Step::Events(vec![Event::TimerScheduled {
                        timer: tid,
                        node: current.clone(),
                        slot: None,
                        purpose: TimerPurpose::Wait,
                        fire_at_ms: now + ms(*duration),
                    }]),
                    Some(t) if t.fired => Step::Events(Self::complete(
                        &current,
                        NodeOutcome::Succeeded,
                        state.output.clone(),
                        next,
                    )),
                    Some(t) if !t.cancelled && t.fire_at_ms <= now => {
                        Step::Events(vec![Event::TimerFired { timer: tid }])
                    }
                    Some(_) => Step::Park,
                }
            }
            NodeKind::Human { next, prompt, .. } => {
                let tid = timer_id(&state.id, visit, "human", &current);
                if let Some(input) = &state.human_input {
                    let mut events = Vec::new();
                    if state.timer_pending(&tid) {
                        events.push(Event::TimerCancelled { timer: tid });
                    }
                    events.extend(Self::complete(
                        &current,
                        NodeOutcome::Succeeded,
                        input.clone(),
                        next,
                    ));
                    return Step::Events(events);
                }
                if !state.human_waiting {
                    let mut events = vec![Event::HumanWaiting {
                        node: current.clone(),
                        prompt: prompt.clone(),
                    }];
                    if let Some(timeout) = node.timeout {
                        events.push(Event::TimerScheduled {
                            timer: tid,
                            node: current.clone(),
                            slot: None,
                            purpose: TimerPurpose::HumanTimeout,
                            fire_at_ms: now + ms(timeout),
                        });
                    }
                    return Step::Events(events);
                }
                match state.timers.get(&tid) {
                    Some(t) if t.fired => Step::Events(Self::fail_node(
                        state,
                        flow,
                        &current,
                        "DEADLINE_EXCEEDED",
                        format!(
                            "no one resumed the task within {}",
                            humantime::format_duration(node.timeout.unwrap_or_default())
                        ),
                        None,
                    )),
                    Some(t) if !t.cancelled && t.fire_at_ms <= now => {
                        Step::Events(vec![Event::TimerFired { timer: tid }])
                    }
                    _ => Step::Park,
                }
            }
            NodeKind::Task {
                capability,
                input,
                next,
            } => {
                let specs = [(current.clone(), capability.as_str(), input.as_ref())];
                self.decide_slots(state, flow, &current, visit, &specs, running, |outcomes| {
                    let (ok, output, error) = outcomes[0].clone();
                    if ok {
                        Self::complete(&current, NodeOutcome::Succeeded, output, next)
                    } else {
                        let error = error.unwrap_or_default();
                        let (code, msg) = error
                            .split_once(": ")
                            .map(|(c, m)| (c.to_string(), m.to_string()))
                            .unwrap_or(("UNKNOWN".into(), error.clone()));
                        Self::fail_node(state, flow, &current, &code, msg, None)
                    }
                })
            }
            NodeKind::Parallel {
                branches,
                success_threshold,
                next,
                on_partial,
                on_failure,
            } => {
                let slots: Vec<(String, &str, Option<&InputTemplate>)> = branches
                    .iter()
                    .map(|b| {
                        (
                            format!("{current}/{}", b.name),
                            b.capability.as_str(),
                            b.input.as_ref(),
                        )
                    })
                    .collect();
                self.decide_slots(state, flow, &current, visit, &slots, running, |outcomes| {
                    let mut output = serde_json::Map::new();
                    let mut ok_count = 0u32;
                    let mut errors = Vec::new();
                    for (b, (ok, out, err)) in branches.iter().zip(outcomes) {
                        if *ok {
                            ok_count += 1;
                            output.insert(b.name.clone(), out.clone());
                        } else {
                            let e = err.clone().unwrap_or_default();
                            errors.push(format!("{}: {e}", b.name));
                            output.insert(b.name.clone(), json!({"error": e}));
                        }
                    }
                    let total = u32::try_from(branches.len()).unwrap_or(u32::MAX);
                    let output = Value::Object(output);
                    if ok_count == total {
                        Self::complete(&current, NodeOutcome::Succeeded, output, next)
                    } else if ok_count >= *success_threshold {
                        Self::complete(&current, NodeOutcome::Partial, output, on_partial.as_deref().unwrap_or(next))
                    } else {
                        let error = format!("{ok_count} of {total} branches succeeded, {success_threshold} needed ({})", errors.join("; "));
                        let mut events = Self::fail_node(state, flow, &current, "FAILED_PRECONDITION", error, on_failure.clone());
                        // Keep the branch results for inspection.
                        if let Some(Event::NodeFailed { output: failed_output, .. }) = events.first_mut() {
                            *failed_output = output;
                        }
                        events
                    }
                })
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn decide_slots(
        &self,
        state: &TaskState,
        flow: &Flow,
        node_id: &str,
        visit: usize,
        slots: &[(String, &str, Option<&InputTemplate>)],
        running: &HashSet<String>,
        finish: impl FnOnce(&[(bool, Value, Option<String>)]) -> Vec<Event>,
    ) -> Step {
        let now = self.inner.clock.now_ms();
        let node = flow.node(node_id).expect("decide checked the node");
        let mut events = Vec::new();
        let mut calls = Vec::new();
        let mut outcomes = Vec::new();
        for (slot, capability, template) in slots {
            let s = state.slots.get(slot).cloned().unwrap_or_default();
            if let Some(done) = &s.done {
                outcomes.push(done.clone());
                continue;
            }
            if let Some(inf) = &s.inflight {
                if running.contains(slot) {
                    continue;
                }
                if let (Some(timer), Some(deadline)) = (&inf.timer, inf.deadline_ms)
                    && deadline <= now
                    && state.timer_pending(timer)
                {
                    events.push(Event::TimerFired {
                        timer: timer.clone(),
                    });
                    events.extend(self.attempt_failed(state, node_id, slot, &s, inf.attempt, "DEADLINE_EXCEEDED", "the attempt timed out (its deadline passed while the orchestrator was down)".into()));
                    continue;
                }
                calls.push(CallSpec {
                    slot: slot.clone(),
                    attempt: inf.attempt,
                    message_id: inf.message_id.clone(),
                    capability: inf.capability.clone(),
                    input: inf.input.clone(),
                    deadline_ms: inf.deadline_ms,
                });
                continue;
            }
            if let Some(bt) = &s.backoff_timer
                && state.timer_pending(bt)
            {
                if state.timers.get(bt).is_some_and(|t| t.fire_at_ms <= now) {
                    events.push(Event::TimerFired { timer: bt.clone() });
                }
                continue;
            }
            // A new attempt.
            let input = match template {
                None => Ok(state.input.clone()),
                Some(t) => t.render(&Self::scope(state)),
            };
            let input = match input {
                Ok(v) => v,
                Err(e) => {
                    events.push(Event::SlotCompleted {
                        node: node_id.to_string(),
                        slot: slot.clone(),
                        ok: false,
                        output: Value::Null,
                        error: Some(format!("INVALID_ARGUMENT: cannot build the input: {e}")),
                    });
                    continue;
                }
            };
            let attempt = state.attempts_total.get(slot).copied().unwrap_or(0) + 1;
            let timer = node.timeout.map(|d| {
                (
                    timer_id(&state.id, visit, "timeout", &format!("{slot}#{attempt}")),
                    now + ms(d),
                )
            });
            if let Some((tid, at)) = &timer {
                events.push(Event::TimerScheduled {
                    timer: tid.clone(),
                    node: node_id.to_string(),
                    slot: Some(slot.clone()),
                    purpose: TimerPurpose::AttemptTimeout,
                    fire_at_ms: *at,
                });
            }
            events.push(Event::AttemptStarted {
                node: node_id.to_string(),
                slot: slot.clone(),
                attempt,
                message_id: message_id(&state.id, slot, attempt),
                capability: (*capability).to_string(),
                input,
                timer: timer.as_ref().map(|(t, _)| t.clone()),
                deadline_ms: timer.map(|(_, at)| at),
            });
        }
        if !events.is_empty() {
            return Step::Events(events);
        }
        if outcomes.len() == slots.len() {
            return Step::Events(finish(&outcomes));
        }
        if calls.is_empty() {
            Step::Park
        } else {
            Step::Calls(calls)
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn attempt_failed(
        &self,
        state: &TaskState,
        node_id: &str,
        slot: &str,
        s: &crate::event::SlotState,
        attempt: u32,
        code: &str,
        error: String,
    ) -> Vec<Event> {
        let now = self.inner.clock.now_ms();
        let flow_node = self
            .inner
            .flows
            .get(&state.flow_id, state.flow_version)
            .and_then(|f| f.node(node_id).map(|n| n.retry.clone()))
            .unwrap_or_default();
        if flow_node.retries(s.attempts, code) {
            let unit: f64 = rand::random::<f64>() * 2.0 - 1.0;
            let delay = flow_node.delay(s.attempts, unit);
            let tid = timer_id(
                &state.id,
                state.visits.len(),
                "backoff",
                &format!("{slot}#{attempt}"),
            );
            vec![
                Event::AttemptFailed {
                    node: node_id.to_string(),
                    slot: slot.to_string(),
                    attempt,
                    code: code.to_string(),
                    error,
                    retry_timer: Some(tid.clone()),
                },
                Event::TimerScheduled {
                    timer: tid,
                    node: node_id.to_string(),
                    slot: Some(slot.to_string()),
                    purpose: TimerPurpose::Backoff,
                    fire_at_ms: now + ms(delay),
                },
            ]
        } else {
            vec![
                Event::AttemptFailed {
                    node: node_id.to_string(),
                    slot: slot.to_string(),
                    attempt,
                    code: code.to_string(),
                    error: error.clone(),
                    retry_timer: None,
                },
                Event::SlotCompleted {
                    node: node_id.to_string(),
                    slot: slot.to_string(),
                    ok: false,
                    output: Value::Null,
                    error: Some(format!("{code}: {error}")),
                },
            ]
        }
    }

    fn on_call_result(&self, state: &TaskState, flow: &Flow, done: CallResult) -> Vec<Event> {
        let _ = flow;
        let Some(s) = state.slots.get(&done.slot) else {
            return vec![];
        };
        let Some(inf) = &s.inflight else {
            return vec![];
        };
        if inf.attempt != done.attempt {
            return vec![];
        }
        let node = state.current.clone().unwrap_or_default();
        let now = self.inner.clock.now_ms();
        let mut events = Vec::new();
        match done.result {
            Ok(output) => {
                if let Some(t) = &inf.timer
                    && state.timer_pending(t)
                {
                    events.push(Event::TimerCancelled { timer: t.clone() });
                }
                events.push(Event::SlotCompleted {
                    node,
                    slot: done.slot,
                    ok: true,
                    output,
                    error: None,
                });
            }
            Err((code, message)) => {
                if let Some(t) = &inf.timer
                    && state.timer_pending(t)
                {
                    let due = inf.deadline_ms.is_some_and(|d| d <= now);
                    events.push(if code == "DEADLINE_EXCEEDED" && due {
                        Event::TimerFired { timer: t.clone() }
                    } else {
                        Event::TimerCancelled { timer: t.clone() }
                    });
                }
                events.extend(self.attempt_failed(
                    state,
                    &node,
                    &done.slot,
                    s,
                    inf.attempt,
                    &code,
                    message,
                ));
            }
        }
        events
    }

    // === commands ===

    /// Starts a task of `flow_id` (`version` 0 = latest) with `input`. With a `task_id` that
    /// exists already, returns that task.
    ///
    /// # Errors
    /// [`Error::NotFound`] for an unknown flow; [`Error::InvalidArgument`] for a bad task id;
    /// [`Error::AlreadyExists`] when the id belongs to a task of another flow.
    pub async fn start_task(
        &self,
        flow_id: &str,
        version: u32,
        input: Value,
        task_id: Option<String>,
    ) -> Result<TaskState, Error> {
        let flow = if version == 0 {
            self.inner.flows.latest(flow_id)
        } else {
            self.inner.flows.get(flow_id, version)
        };
        let Some(flow) = flow else {
            let known = self.inner.flows.ids().join(", ");
            return Err(Error::NotFound(format!(
                "flow {flow_id:?}{} is not applied; known flows: [{known}]; apply it with `reach flow apply FILE`",
                if version == 0 {
                    String::new()
                } else {
                    format!(" version {version}")
                }
            )));
        };
        let id = match task_id.filter(|t| !t.is_empty()) {
            Some(id) => {
                let ok = id.len() <= 128
                    && id
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "._:-".contains(c));
                if !ok {
                    return Err(Error::InvalidArgument {
                        message: format!(
                            "task id {id:?} is not valid: use 1 to 128 characters of A-Z a-z 0-9 . _ : -"
                        ),
                        violations: vec![(
                            "task_id".into(),
                            "must be 1 to 128 characters of A-Z a-z 0-9 . _ : -".into(),
                        )],
                    });
                }
                id
            }
            None => reach_rpc::trace::new_message_id(),
        };
        let mut state = TaskState::new(&id);
        let events = vec![
            Event::TaskCreated {
                flow_id: flow.id.clone(),
                flow_version: flow.version,
                input,
                trace_id: reach_rpc::trace::TraceId::random().to_string(),
            },
            Event::NodeEntered {
                node: flow.initial.clone(),
            },
        ];
        let now = self.inner.clock.now_ms();
        let lease = i64::try_from(self.inner.settings.lease.as_millis()).unwrap_or(30_000);
        let guard = Guard::Create {
            owner: self.inner.settings.node_id.clone(),
            lease_until_ms: now + lease,
        };
        if !self.append(&mut state, events, guard).await? {
            let existing = self.load(&id).await?;
            if existing.flow_id != flow.id {
                return Err(Error::AlreadyExists(format!(
                    "task {id:?} exists and runs flow {:?}; choose another task id",
                    existing.flow_id
                )));
            }
            return Ok(existing);
        }
        tracing::info!(task_id = %id, flow_id = %flow.id, flow_version = flow.version, "task started");
        self.poke(&id);
        Ok(state)
    }

    async fn command(
        &self,
        task_id: &str,
        build: impl Fn(&TaskState) -> Result<Vec<Event>, Error>,
    ) -> Result<TaskState, Error> {
        for _ in 0..20 {
            let mut state = self.load(task_id).await?;
            let events = build(&state)?;
            let guard = if self.inner.exclusive {
                Guard::Seq
            } else {
                Guard::Command
            };
            if self.append(&mut state, events, guard).await? {
                self.poke(task_id);
                return Ok(state);
            }
        }
        Err(Error::Unavailable(format!(
            "task {task_id:?} changes too fast to apply the command; try again"
        )))
    }

    /// Gives a person's input to a task waiting in a human node.
    ///
    /// # Errors
    /// [`Error::FailedPrecondition`] when the task does not wait in a human node (or in
    /// `node_id`); [`Error::InvalidArgument`] with the field paths when the input fails the
    /// node's schema.
    pub async fn resume(
        &self,
        task_id: &str,
        node_id: Option<&str>,
        input: Value,
    ) -> Result<TaskState, Error> {
        self.command(task_id, |state| {
            let current = state.current.clone().unwrap_or_default();
            if state.status != TaskStatus::WaitingHuman || !state.human_waiting {
                return Err(Error::FailedPrecondition(format!("task {task_id} is {} at node {current:?}; only a task waiting in a human node can be resumed", state.status.as_str())));
            }
            if let Some(n) = node_id.filter(|n| !n.is_empty())
                && n != current {
                    return Err(Error::FailedPrecondition(format!("task {task_id} waits in node {current:?}, not {n:?}; resume {current:?} or leave the node empty")));
                }
            let flow = self.inner.flows.get(&state.flow_id, state.flow_version).ok_or_else(|| Error::Unavailable(format!("flow {} v{} is not loaded", state.flow_id, state.flow_version)))?;
            if let Some(NodeKind::Human { schema: Some(schema), .. }) = flow.node(&current).map(|n| &n.kind) {
                let violations: Vec<(String, String)> = schema
                    .iter_errors(&input)
                    .map(|e| {
                        let path = e.instance_path().to_string();
                        (if path.is_empty() { "/".to_string() } else { path }, e.to_string())
                    })
                    .collect();
                if !violations.is_empty() {
                    let list = violations.iter().map(|(p, m)| format!("{p}: {m}")).collect::<Vec<_>>().join("; ");
                    return Err(Error::InvalidArgument {
                        message: format!("resume input does not match the schema of node {current}: {list}"),
                        violations: violations.into_iter().map(|(p, m)| (format!("input{p}"), m)).collect(),
                    });
                }
            }
            Ok(vec![Event::HumanResumed { node: current, input: input.clone() }])
        })
        .await
    }

    /// Cancels a task; a task waiting in a human node with `on_cancel` continues there.
    ///
    /// # Errors
    /// [`Error::FailedPrecondition`] when the task already ended.
    pub async fn cancel(&self, task_id: &str, reason: &str) -> Result<TaskState, Error> {
        let reason = if reason.is_empty() {
            "cancelled by request"
        } else {
            reason
        };
        self.command(task_id, |state| {
            if state.status.is_terminal() {
                return Err(Error::FailedPrecondition(format!(
                    "task {task_id} already ended ({})",
                    state.status.as_str()
                )));
            }
            let current = state.current.clone().unwrap_or_default();
            let on_cancel = self
                .inner
                .flows
                .get(&state.flow_id, state.flow_version)
                .and_then(|f| match f.node(&current).map(|n| &n.kind) {
                    Some(NodeKind::Human {
                        on_cancel: Some(n), ..
                    }) if state.human_waiting => Some(n.clone()),
                    _ => None,
                });
            Ok(match on_cancel {
                Some(next) => Self::complete(
                    &current,
                    NodeOutcome::Cancelled,
                    json!({"cancelled": reason}),
                    &next,
                ),
                None => vec![Event::TaskEnded {
                    status: TaskStatus::Cancelled,
                    output: state.output.clone(),
                    error: Some(reason.to_string()),
                    failed_node: None,
                }],
            })
        })
        .await
    }

    /// Restarts a FAILED task at its failed node (a PARTIAL one at its partial parallel
    /// node), with fresh attempts.
    ///
    /// # Errors
    /// [`Error::FailedPrecondition`] for tasks in other states.
    pub async fn retry(&self, task_id: &str) -> Result<TaskState, Error> {
        self.command(task_id, |state| {
            let node = match state.status {
                TaskStatus::Failed => state.failed_node.clone(),
                TaskStatus::Partial => state
                    .visits
                    .iter()
                    .rev()
                    .find(|v| v.outcome == Some(NodeOutcome::Partial))
                    .map(|v| v.node.clone()),
                other => {
                    return Err(Error::FailedPrecondition(format!(
                        "task {task_id} is {}; only FAILED or PARTIAL tasks can be retried",
                        other.as_str()
                    )));
                }
            };
            let Some(node) = node else {
                return Err(Error::FailedPrecondition(format!(
                    "task {task_id} has no failed node to retry from"
                )));
            };
            Ok(vec![
                Event::TaskRetried { node: node.clone() },
                Event::NodeEntered { node },
            ])
        })
        .await
    }

    // === background loops ===

    async fn lease_loop(self) {
        let mut stop = self.inner.stop.subscribe();
        let owner = self.inner.settings.node_id.clone();
        let lease = ms(self.inner.settings.lease);
        let mut first = true;
        loop {
            let now = self.inner.clock.now_ms();
            if !first && let Err(e) = self.inner.store.renew(&owner, now + lease).await {
                tracing::warn!(error = %e, "lease renewal failed");
            }
            // On an exclusive (SQLite) store the first pass takes every unfinished task: the
            // previous process is gone, whatever owner id it had.
            let force = first && self.inner.exclusive;
            // The first pass also takes back this node id's own tasks (a restart), all at once.
            let limit = if first { 1_000_000 } else { 500 };
            match self
                .inner
                .store
                .claim_batch(&owner, now, now + lease, limit, first, force)
                .await
            {
                Ok(ids) => {
                    if !ids.is_empty() {
                        tracing::info!(count = ids.len(), "resuming tasks");
                    }
                    for id in ids {
                        self.poke(&id);
                    }
                }
                Err(e) => tracing::warn!(error = %e, "claiming tasks failed"),
            }
            first = false;
            if self.inner.exclusive {
                // One process owns an SQLite store: no leases to renew, nobody to take over
                // from, and commands poke the local engine directly.
                return;
            }
            let period = (self.inner.settings.lease / 3).min(
                self.inner
                    .settings
                    .poll_interval
                    .max(Duration::from_millis(50)),
            );
            tokio::select! {
                () = tokio::time::sleep(period) => {}
                _ = stop.changed() => return,
            }
        }
    }

    async fn timer_loop(self) {
        let mut stop = self.inner.stop.subscribe();
        let owner = self.inner.settings.node_id.clone();
        loop {
            let now = self.inner.clock.now_ms();
            let mut wake_at = now + ms(self.inner.settings.poll_interval);
            match self.inner.store.due_timers(&owner, now, 1000).await {
                Ok((due, next)) => {
                    if !due.is_empty() {
                        wake_at = wake_at.min(now + 10);
                    }
                    for id in due {
                        self.poke(&id);
                    }
                    if let Some(n) = next {
                        wake_at = wake_at.min(n);
                    }
                }
                Err(e) => tracing::warn!(error = %e, "reading due timers failed"),
            }
            tokio::select! {
                () = tokio::time::sleep_until(self.inner.clock.instant_at(wake_at)) => {}
                () = self.inner.timer_wake.notified() => {}
                _ = stop.changed() => return,
            }
        }
    }

    async fn purge_loop(self) {
        let mut stop = self.inner.stop.subscribe();
        let ttl = self.inner.settings.context_ttl;
        let period = (ttl / 4).clamp(Duration::from_secs(1), Duration::from_secs(600));
        loop {
            let cutoff = self.inner.clock.now_ms() - ms(ttl);
            match self.inner.store.purge(cutoff).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(tasks = n, "purged ended tasks past their ttl"),
                Err(e) => tracing::warn!(error = %e, "purge failed"),
            }
            tokio::select! {
                () = tokio::time::sleep(period) => {}
                _ = stop.changed() => return,
            }
        }
    }

    /// Subscribes to "task X appended up to seq N" notifications (used by WatchTask).
    pub(crate) fn subscribe(&self) -> broadcast::Receiver<Arc<(String, i64)>> {
        self.inner.events.subscribe()
    }

    /// Events of a task after `after_seq` (for watchers).
    ///
    /// # Errors
    /// Store errors.
    pub async fn events_after(
        &self,
        task_id: &str,
        after_seq: i64,
    ) -> Result<Vec<StoredEvent>, Error> {
        Ok(self.inner.store.events(task_id, after_seq).await?)
    }
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 4)
}

/// Makes one call through the router. Errors are `(gRPC code name, message)`.
async fn call(
    mut router: RouterServiceClient<GrpcClientTrace<Channel>>,
    clock: Clock,
    ctx: (String, String, String, EngineSettings),
    spec: CallSpec,
) -> CallResult {
    let (task_id, trace_id, flow_id, settings) = ctx;
    let now = clock.now_ms();
    let timeout = match spec.deadline_ms {
        Some(d) => Duration::from_millis(u64::try_from((d - now).max(1)).unwrap_or(1)),
        None => settings.default_call_timeout,
    };
    let slot_node = spec
        .slot
        .split('/')
        .next()
        .unwrap_or(&spec.slot)
        .to_string();
    let mut metadata = HashMap::new();
    metadata.insert("flow_id".to_string(), flow_id);
    metadata.insert("node_id".to_string(), slot_node);
    metadata.insert("attempt".to_string(), spec.attempt.to_string());
    let message = ReachMessage {
        header: Some(Header {
            message_id: spec.message_id.clone(),
            trace_id,
            task_id,
            source: settings.source.clone(),
            target: Some(header::Target::Capability(spec.capability.clone())),
            created_at: Some(reach_rpc::time::now()),
            metadata,
            ..Default::default()
        }),
        payload: Some(Payload {
            r#type: spec.capability.clone(),
            parts: vec![Part {
                content: Some(part::Content::Data(crate::json::to_proto(&spec.input))),
                media_type: "application/json".into(),
                ..Default::default()
            }],
        }),
    };
    // The node's span belongs to the task's trace; the traced channel sends its context as
    // `traceparent`, so the router and the agents join the trace under it.
    let span = reach_telemetry::message_span("orchestrator.node", &message);
    let mut request = tonic::Request::new(CallRequest {
        message: Some(message),
    });
    request.set_timeout(timeout);
    let started = tokio::time::Instant::now();
    let deadline_exceeded = || {
        Err((
            "DEADLINE_EXCEEDED".to_string(),
            format!("no reply within {}", humantime::format_duration(timeout)),
        ))
    };
    let sent = tracing::Instrument::instrument(router.call(request), span.clone());
    let result = match tokio::time::timeout(timeout, sent).await {
        Err(_) => deadline_exceeded(),
        // tonic enforces the grpc-timeout it sends too, answering CANCELLED: that is the
        // attempt's deadline passing, as the retry policy knows it.
        Ok(Err(status))
            if status.code() == tonic::Code::Cancelled && started.elapsed() >= timeout =>
        {
            deadline_exceeded()
        }
        Ok(Err(status)) => Err((
            code_name(status.code()).to_string(),
            status.message().to_string(),
        )),
        Ok(Ok(reply)) => {
            let parts = reply
                .into_inner()
                .message
                .and_then(|m| m.payload)
                .map(|p| p.parts)
                .unwrap_or_default();
            let data = parts.iter().find_map(|p| match &p.content {
                Some(part::Content::Data(v)) => Some(crate::json::from_proto(v)),
                _ => None,
            });
            let text = || {
                parts.iter().find_map(|p| match &p.content {
                    Some(part::Content::Text(t)) => Some(Value::String(t.clone())),
                    _ => None,
                })
            };
            Ok(data.or_else(text).unwrap_or(Value::Null))
        }
    };
    match &result {
        Ok(_) => reach_telemetry::record_status(&span, tonic::Code::Ok, ""),
        Err((code, message)) => {
            span.record("otel.status_code", "error");
            span.record(
                "otel.status_description",
                format!("{code}: {message}").as_str(),
            );
        }
    }
    CallResult {
        slot: spec.slot,
        attempt: spec.attempt,
        result,
    }
}

/// The metric label of a task status (`waiting_human`, ...).
fn status_label(status: TaskStatus) -> &'static str {
    match status {
        TaskStatus::Pending => "pending",
        TaskStatus::Dispatched => "dispatched",
        TaskStatus::Processing => "processing",
        TaskStatus::WaitingHuman => "waiting_human",
        TaskStatus::Succeeded => "succeeded",
        TaskStatus::Failed => "failed",
        TaskStatus::Partial => "partial",
        TaskStatus::Cancelled => "cancelled",
    }
}

/// The canonical name of a gRPC code (`UNAVAILABLE`, ...).
pub use reach_rpc::errors::code_name;
