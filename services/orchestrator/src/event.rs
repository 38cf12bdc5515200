//! Task events and the task state folded from them.
//!
//! Every change of a task is one [`Event`] appended to its log; [`TaskState`] is the fold of
//! the log ([`TaskState::apply`]). The engine decides from the state alone, so a restarted
//! orchestrator continues exactly where the log ends.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use reach_rpc::usage::TokenUsage;

use crate::failure::{FailureCode, NodeError};

/// Task status (the proto's `TaskStatus` without the unspecified value).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum TaskStatus {
    /// Recorded, not yet picked up.
    Pending,
    /// A node's call is in flight.
    Dispatched,
    /// Between nodes, in back-off or in a wait.
    Processing,
    /// Waiting in a human node.
    WaitingHuman,
    /// Ended at a succeed node.
    Succeeded,
    /// Failed for good (a dead letter).
    Failed,
    /// Ended after a parallel node that was PARTIAL.
    Partial,
    /// Cancelled.
    Cancelled,
}

impl TaskStatus {
    /// Whether the task ended.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            TaskStatus::Succeeded
                | TaskStatus::Failed
                | TaskStatus::Partial
                | TaskStatus::Cancelled
        )
    }

    /// The name stored and shown (`SUCCEEDED`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            TaskStatus::Pending => "PENDING",
            TaskStatus::Dispatched => "DISPATCHED",
            TaskStatus::Processing => "PROCESSING",
            TaskStatus::WaitingHuman => "WAITING_HUMAN",
            TaskStatus::Succeeded => "SUCCEEDED",
            TaskStatus::Failed => "FAILED",
            TaskStatus::Partial => "PARTIAL",
            TaskStatus::Cancelled => "CANCELLED",
        }
    }

    /// Parses a stored or typed name (case-insensitive, `TASK_STATUS_` prefix optional).
    pub fn parse(text: &str) -> Option<Self> {
        let upper = text.trim().to_ascii_uppercase().replace('-', "_");
        let name = upper.strip_prefix("TASK_STATUS_").unwrap_or(&upper);
        Some(match name {
            "PENDING" => TaskStatus::Pending,
            "DISPATCHED" => TaskStatus::Dispatched,
            "PROCESSING" => TaskStatus::Processing,
            "WAITING_HUMAN" => TaskStatus::WaitingHuman,
            "SUCCEEDED" => TaskStatus::Succeeded,
            "FAILED" => TaskStatus::Failed,
            "PARTIAL" => TaskStatus::Partial,
            "CANCELLED" | "CANCELED" => TaskStatus::Cancelled,
            _ => return None,
        })
    }

    /// Every status, in lifecycle order.
    pub const ALL: [TaskStatus; 8] = [
        TaskStatus::Pending,
        TaskStatus::Dispatched,
        TaskStatus::Processing,
        TaskStatus::WaitingHuman,
        TaskStatus::Succeeded,
        TaskStatus::Failed,
        TaskStatus::Partial,
        TaskStatus::Cancelled,
    ];
}

/// Why a durable timer exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TimerPurpose {
    /// The deadline of one attempt.
    AttemptTimeout,
    /// The back-off before the next attempt.
    Backoff,
    /// A `wait` node.
    Wait,
    /// The timeout of a `human` node.
    HumanTimeout,
    /// The pause before an attempt that was not delivered (nothing routable) is sent again.
    Redelivery,
}

/// How a node visit ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum NodeOutcome {
    /// Completed.
    Succeeded,
    /// A parallel node where only some branches succeeded.
    Partial,
    /// Failed after its retries.
    Failed,
    /// Cancelled with its task.
    Cancelled,
}

/// One entry of a task's log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Event {
    /// The task was started.
    TaskCreated {
        /// The flow.
        flow_id: String,
        /// Its version, fixed for the task's life.
        flow_version: u32,
        /// The task input.
        input: Value,
        /// The task's W3C trace id.
        trace_id: String,
        /// Who started it (the caller's SPIFFE ID, or `anonymous`); absent in tasks started
        /// before it was recorded.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        started_by: Option<String>,
        /// The labels it was started with (StartTaskRequest.labels); absent when none.
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        labels: BTreeMap<String, String>,
    },
    /// The task moved to a node.
    NodeEntered {
        /// The node.
        node: String,
    },
    /// An attempt of a call slot (a task node, or one branch of a parallel node) was sent.
    AttemptStarted {
        /// The node.
        node: String,
        /// `node` for a task node, `node/branch` for a branch.
        slot: String,
        /// The attempt number, counted over the task's whole life (message ids stay unique).
        attempt: u32,
        /// The message id, derived from task, slot and attempt.
        message_id: String,
        /// The capability called.
        capability: String,
        /// The input sent.
        input: Value,
        /// The attempt's timeout timer, if the node has a timeout.
        timer: Option<String>,
        /// When the attempt times out (unix ms).
        deadline_ms: Option<i64>,
    },
    /// An attempt failed.
    AttemptFailed {
        /// The node.
        node: String,
        /// The slot.
        slot: String,
        /// The attempt.
        attempt: u32,
        /// The failure's gRPC code, stored by name (`UNAVAILABLE`).
        #[serde(with = "crate::failure::code_serde")]
        code: tonic::Code,
        /// The failure's message.
        error: String,
        /// The back-off timer when the attempt will be retried.
        retry_timer: Option<String>,
    },
    /// An attempt provably never reached an agent (the router could not be reached, or it
    /// had no routable instance: ROUTE_NOT_FOUND, INSTANCE_UNAVAILABLE, OVERLOADED,
    /// INSTANCE_DRAINING). It stays in flight, is sent again (same attempt, same message
    /// id) when `timer` fires, and does not count as an attempt.
    AttemptDeferred {
        /// The node.
        node: String,
        /// The slot.
        slot: String,
        /// The attempt.
        attempt: u32,
        /// The failure's gRPC code, stored by name.
        #[serde(with = "crate::failure::code_serde")]
        code: tonic::Code,
        /// The failure's message.
        error: String,
        /// The redelivery timer.
        timer: String,
    },
    /// A slot finished (for good).
    SlotCompleted {
        /// The node.
        node: String,
        /// The slot.
        slot: String,
        /// Whether it succeeded.
        ok: bool,
        /// The output (the reply's first data part) or null.
        output: Value,
        /// The last error when it failed, stored as `"CODE: message"`.
        error: Option<NodeError>,
    },
    /// A slot's reply reported what its model calls cost (the reply header's
    /// `reach.gen_ai.*` metadata, [`reach_rpc::usage`]); summed into the task's usage.
    ModelUsage {
        /// The node.
        node: String,
        /// The slot.
        slot: String,
        /// The attempt whose reply reported it.
        attempt: u32,
        /// Input (prompt) tokens.
        input_tokens: u64,
        /// Output (completion) tokens.
        output_tokens: u64,
        /// Model calls.
        model_calls: u64,
    },
    /// A durable timer was scheduled.
    TimerScheduled {
        /// The timer id.
        timer: String,
        /// The node.
        node: String,
        /// The slot, for attempt timeouts and back-offs.
        slot: Option<String>,
        /// Why.
        purpose: TimerPurpose,
        /// When it fires (unix ms).
        fire_at_ms: i64,
    },
    /// A timer fired (at most once per timer).
    TimerFired {
        /// The timer id.
        timer: String,
    },
    /// A timer was cancelled before firing.
    TimerCancelled {
        /// The timer id.
        timer: String,
        /// Why the timer existed, when the cancelling code names it (a cancelled task lists
        /// every timer it still had).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        purpose: Option<TimerPurpose>,
    },
    /// The task waits for a person.
    HumanWaiting {
        /// The node.
        node: String,
        /// A message for the person.
        prompt: Option<String>,
    },
    /// A person resumed the task.
    HumanResumed {
        /// The node.
        node: String,
        /// The input given.
        input: Value,
        /// Who resumed it: the caller's identity with trust on, else the reviewer name the
        /// client sent in the `reach-reviewer` metadata; absent when neither is known (and in
        /// tasks resumed before it was recorded).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        by: Option<String>,
    },
    /// A node visit ended and chose the next node.
    NodeCompleted {
        /// The node.
        node: String,
        /// How it ended.
        outcome: NodeOutcome,
        /// Its output.
        output: Value,
        /// The next node (empty at the end of the task).
        next: String,
    },
    /// A node failed for good.
    NodeFailed {
        /// The node.
        node: String,
        /// The gRPC code, or `FLOW` when the flow failed the task.
        code: FailureCode,
        /// Why.
        error: String,
        /// The node that handles the failure (`catch` / `on_failure`), if any.
        next: Option<String>,
        /// What the node produced before failing (a parallel node's branch results).
        #[serde(default)]
        output: Value,
    },
    /// The task ended.
    TaskEnded {
        /// SUCCEEDED, FAILED, PARTIAL or CANCELLED.
        status: TaskStatus,
        /// The output of the last completed node.
        output: Value,
        /// Why it failed or was cancelled.
        error: Option<String>,
        /// The node it failed at.
        failed_node: Option<String>,
    },
    /// A person asked to retry a failed task from its failed node.
    TaskRetried {
        /// The node the task restarts at.
        node: String,
    },
}

impl Event {
    /// The snake-case kind, as stored.
    pub fn kind(&self) -> &'static str {
        match self {
            Event::TaskCreated { .. } => "task_created",
            Event::NodeEntered { .. } => "node_entered",
            Event::AttemptStarted { .. } => "attempt_started",
            Event::AttemptFailed { .. } => "attempt_failed",
            Event::AttemptDeferred { .. } => "attempt_deferred",
            Event::SlotCompleted { .. } => "slot_completed",
            Event::ModelUsage { .. } => "model_usage",
            Event::TimerScheduled { .. } => "timer_scheduled",
            Event::TimerFired { .. } => "timer_fired",
            Event::TimerCancelled { .. } => "timer_cancelled",
            Event::HumanWaiting { .. } => "human_waiting",
            Event::HumanResumed { .. } => "human_resumed",
            Event::NodeCompleted { .. } => "node_completed",
            Event::NodeFailed { .. } => "node_failed",
            Event::TaskEnded { .. } => "task_ended",
            Event::TaskRetried { .. } => "task_retried",
        }
    }

    /// The node the event concerns, if any.
    pub fn node(&self) -> Option<&str> {
        match self {
            Event::NodeEntered { node }
            | Event::AttemptStarted { node, .. }
            | Event::AttemptFailed { node, .. }
            | Event::AttemptDeferred { node, .. }
            | Event::SlotCompleted { node, .. }
            | Event::ModelUsage { node, .. }
            | Event::TimerScheduled { node, .. }
            | Event::HumanWaiting { node, .. }
            | Event::HumanResumed { node, .. }
            | Event::NodeCompleted { node, .. }
            | Event::NodeFailed { node, .. }
            | Event::TaskRetried { node } => Some(node),
            Event::TaskEnded { failed_node, .. } => failed_node.as_deref(),
            Event::TaskCreated { .. } | Event::TimerFired { .. } | Event::TimerCancelled { .. } => {
                None
            }
        }
    }
}

/// A stored event with its position and time.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredEvent {
    /// Position in the task's log, from 1.
    pub seq: i64,
    /// When it was appended (unix ms).
    pub at_ms: i64,
    /// The event.
    pub event: Event,
}

/// A call in flight (or to be re-sent after a restart) for one slot.
#[derive(Debug, Clone, PartialEq)]
pub struct Inflight {
    /// The attempt.
    pub attempt: u32,
    /// Its message id.
    pub message_id: String,
    /// The capability.
    pub capability: String,
    /// The input.
    pub input: Value,
    /// The timeout timer.
    pub timer: Option<String>,
    /// When it times out (unix ms).
    pub deadline_ms: Option<i64>,
    /// When it was started (unix ms).
    pub started_ms: i64,
    /// The pending redelivery timer, after a try that was not delivered.
    pub redelivery_timer: Option<String>,
    /// Tries that were not delivered.
    pub deferrals: u32,
    /// The last try's failure, when it was not delivered.
    pub undelivered: Option<NodeError>,
}

/// The state of one call slot in the current node visit.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SlotState {
    /// Attempts made in this visit.
    pub attempts: u32,
    /// The attempt in flight.
    pub inflight: Option<Inflight>,
    /// The pending back-off timer.
    pub backoff_timer: Option<String>,
    /// The output, or the last attempt's error, once finished for good.
    pub done: Option<Result<Value, NodeError>>,
    /// The last failed attempt's error.
    pub last_error: Option<NodeError>,
}

/// A durable timer as the fold sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct TimerState {
    /// The node.
    pub node: String,
    /// The slot.
    pub slot: Option<String>,
    /// Why.
    pub purpose: TimerPurpose,
    /// When it fires (unix ms).
    pub fire_at_ms: i64,
    /// Whether it fired.
    pub fired: bool,
    /// Whether it was cancelled.
    pub cancelled: bool,
}

/// One node visit, for GetTask.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeVisit {
    /// The node.
    pub node: String,
    /// How it ended (`None` while running).
    pub outcome: Option<NodeOutcome>,
    /// Attempts dispatched.
    pub attempts: u32,
    /// The last attempt's message id.
    pub message_id: Option<String>,
    /// The input (the last attempt's, or the resume input).
    pub input: Value,
    /// The output.
    pub output: Value,
    /// The last error.
    pub error: Option<String>,
    /// When it started (unix ms).
    pub started_ms: i64,
    /// When it ended (unix ms).
    pub ended_ms: Option<i64>,
    /// The next node.
    pub next: Option<String>,
    /// What the visit's model calls cost, as its replies reported.
    pub usage: TokenUsage,
}

/// The fold of a task's events.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskState {
    /// The task id.
    pub id: String,
    /// The flow.
    pub flow_id: String,
    /// The flow version.
    pub flow_version: u32,
    /// The task input.
    pub input: Value,
    /// The W3C trace id.
    pub trace_id: String,
    /// The status.
    pub status: TaskStatus,
    /// The last applied sequence number (0 before the first event).
    pub seq: i64,
    /// When created (unix ms).
    pub created_ms: i64,
    /// When last changed (unix ms).
    pub updated_ms: i64,
    /// When ended (unix ms).
    pub ended_ms: Option<i64>,
    /// The current node.
    pub current: Option<String>,
    /// Slots of the current visit.
    pub slots: BTreeMap<String, SlotState>,
    /// Attempts per slot over the task's life.
    pub attempts_total: BTreeMap<String, u32>,
    /// Timers by id.
    pub timers: BTreeMap<String, TimerState>,
    /// The current human node's wait has been recorded.
    pub human_waiting: bool,
    /// The resume input, once given.
    pub human_input: Option<Value>,
    /// Latest `{output, input, error}` per node, for expressions.
    pub context: BTreeMap<String, serde_json::Map<String, Value>>,
    /// Every visit in order.
    pub visits: Vec<NodeVisit>,
    /// The output of the last completed node.
    pub output: Value,
    /// Why the task failed or was cancelled.
    pub error: Option<String>,
    /// The node the task failed at.
    pub failed_node: Option<String>,
    /// A parallel node ended PARTIAL on the way.
    pub partial: bool,
    /// `visits.len()` at the last retry: visits since then count towards the bound.
    pub visits_base: usize,
    /// What the task's model calls cost, summed over every node's replies.
    pub usage: TokenUsage,
    /// Who started the task (`None` for tasks started before starters were recorded).
    pub started_by: Option<String>,
    /// The labels it was started with.
    pub labels: BTreeMap<String, String>,
}

impl TaskState {
    /// The empty state of task `id`, before its first event.
    pub fn new(id: &str) -> Self {
        Self {
            id: id.to_string(),
            flow_id: String::new(),
            flow_version: 0,
            input: Value::Null,
            trace_id: String::new(),
            status: TaskStatus::Pending,
            seq: 0,
            created_ms: 0,
            updated_ms: 0,
            ended_ms: None,
            current: None,
            slots: BTreeMap::new(),
            attempts_total: BTreeMap::new(),
            timers: BTreeMap::new(),
            human_waiting: false,
            human_input: None,
            context: BTreeMap::new(),
            visits: Vec::new(),
            output: Value::Null,
            error: None,
            failed_node: None,
            partial: false,
            visits_base: 0,
            usage: TokenUsage::default(),
            started_by: None,
            labels: BTreeMap::new(),
        }
    }

    /// Folds stored events into a state.
    pub fn fold<'a>(id: &str, events: impl IntoIterator<Item = &'a StoredEvent>) -> Self {
        let mut state = Self::new(id);
        for e in events {
            state.apply(&e.event, e.at_ms);
            state.seq = e.seq;
        }
        state
    }

    fn ctx(&mut self, node: &str) -> &mut serde_json::Map<String, Value> {
        self.context.entry(node.to_string()).or_default()
    }

    fn visit(&mut self) -> Option<&mut NodeVisit> {
        self.visits.last_mut().filter(|v| v.outcome.is_none())
    }

    fn refresh_running_status(&mut self) {
        if self.status.is_terminal() || self.status == TaskStatus::WaitingHuman {
            return;
        }
        self.status = if self.slots.values().any(|s| s.inflight.is_some()) {
            TaskStatus::Dispatched
        } else {
            TaskStatus::Processing
        };
    }

    /// Applies one event (does not change `seq`).
    pub fn apply(&mut self, event: &Event, at_ms: i64) {
        self.updated_ms = at_ms;
        match event {
            Event::TaskCreated {
                flow_id,
                flow_version,
                input,
                trace_id,
                started_by,
                labels,
            } => {
                self.started_by.clone_from(started_by);
                self.labels.clone_from(labels);
                self.flow_id.clone_from(flow_id);
                self.flow_version = *flow_version;
                self.input = input.clone();
                self.trace_id.clone_from(trace_id);
                self.created_ms = at_ms;
                self.status = TaskStatus::Pending;
            }
            Event::NodeEntered { node } => {
                self.current = Some(node.clone());
                self.slots.clear();
                self.human_waiting = false;
                self.human_input = None;
                self.status = TaskStatus::Processing;
                self.visits.push(NodeVisit {
                    node: node.clone(),
                    outcome: None,
                    attempts: 0,
                    message_id: None,
                    input: Value::Null,
                    output: Value::Null,
                    error: None,
                    started_ms: at_ms,
                    ended_ms: None,
                    next: None,
                    usage: TokenUsage::default(),
                });
            }
            Event::AttemptStarted {
                node,
                slot,
                attempt,
                message_id,
                capability,
                input,
                timer,
                deadline_ms,
            } => {
                let s = self.slots.entry(slot.clone()).or_default();
                s.attempts += 1;
                s.backoff_timer = None;
                s.inflight = Some(Inflight {
                    attempt: *attempt,
                    message_id: message_id.clone(),
                    capability: capability.clone(),
                    input: input.clone(),
                    timer: timer.clone(),
                    deadline_ms: *deadline_ms,
                    started_ms: at_ms,
                    redelivery_timer: None,
                    deferrals: 0,
                    undelivered: None,
                });
                self.attempts_total.insert(slot.clone(), *attempt);
                let is_node = slot == node;
                if is_node {
                    self.ctx(node).insert("input".into(), input.clone());
                }
                if let Some(v) = self.visit() {
                    v.attempts += 1;
                    v.message_id = Some(message_id.clone());
                    if is_node {
                        v.input = input.clone();
                    } else if let Value::Object(map) = &mut v.input {
                        map.insert(
                            slot.rsplit('/').next().unwrap_or(slot).to_string(),
                            input.clone(),
                        );
                    } else {
                        let mut map = serde_json::Map::new();
                        map.insert(
                            slot.rsplit('/').next().unwrap_or(slot).to_string(),
                            input.clone(),
                        );
                        v.input = Value::Object(map);
                    }
                }
                self.refresh_running_status();
            }
            Event::AttemptFailed {
                slot,
                code,
                error,
                retry_timer,
                ..
            } => {
                let s = self.slots.entry(slot.clone()).or_default();
                s.inflight = None;
                s.backoff_timer = retry_timer.clone();
                s.last_error = Some(NodeError::new(*code, error.clone()));
                if let Some(v) = self.visit() {
                    v.error = Some(error.clone());
                }
                self.refresh_running_status();
            }
            Event::AttemptDeferred {
                slot,
                attempt,
                code,
                error,
                timer,
                ..
            } => {
                if let Some(inf) = self
                    .slots
                    .get_mut(slot)
                    .and_then(|s| s.inflight.as_mut())
                    .filter(|inf| inf.attempt == *attempt)
                {
                    inf.redelivery_timer = Some(timer.clone());
                    inf.deferrals += 1;
                    inf.undelivered = Some(NodeError::new(*code, error.clone()));
                }
            }
            Event::ModelUsage {
                input_tokens,
                output_tokens,
                model_calls,
                ..
            } => {
                let usage = TokenUsage {
                    input_tokens: *input_tokens,
                    output_tokens: *output_tokens,
                    model_calls: *model_calls,
                };
                self.usage.add(usage);
                if let Some(v) = self.visit() {
                    v.usage.add(usage);
                }
            }
            Event::SlotCompleted {
                slot,
                ok,
                output,
                error,
                ..
            } => {
                let s = self.slots.entry(slot.clone()).or_default();
                s.inflight = None;
                s.backoff_timer = None;
                s.done = Some(if *ok {
                    Ok(output.clone())
                } else {
                    Err(error
                        .clone()
                        .unwrap_or_else(|| NodeError::new(tonic::Code::Unknown, "")))
                });
                self.refresh_running_status();
            }
            Event::TimerScheduled {
                timer,
                node,
                slot,
                purpose,
                fire_at_ms,
            } => {
                self.timers.insert(
                    timer.clone(),
                    TimerState {
                        node: node.clone(),
                        slot: slot.clone(),
                        purpose: *purpose,
                        fire_at_ms: *fire_at_ms,
                        fired: false,
                        cancelled: false,
                    },
                );
            }
            Event::TimerFired { timer } => {
                if let Some(t) = self.timers.get_mut(timer) {
                    t.fired = true;
                }
            }
            Event::TimerCancelled { timer, .. } => {
                if let Some(t) = self.timers.get_mut(timer) {
                    t.cancelled = true;
                }
            }
            Event::HumanWaiting { .. } => {
                self.human_waiting = true;
                self.status = TaskStatus::WaitingHuman;
            }
            Event::HumanResumed { node, input, .. } => {
                self.human_input = Some(input.clone());
                self.ctx(node).insert("input".into(), input.clone());
                if let Some(v) = self.visit() {
                    v.input = input.clone();
                }
                self.status = TaskStatus::Processing;
            }
            Event::NodeCompleted {
                node,
                outcome,
                output,
                next,
            } => {
                if *outcome == NodeOutcome::Partial {
                    self.partial = true;
                }
                let c = self.ctx(node);
                c.insert("output".into(), output.clone());
                c.remove("error");
                self.output = output.clone();
                if let Some(v) = self.visit() {
                    v.outcome = Some(*outcome);
                    v.output = output.clone();
                    v.ended_ms = Some(at_ms);
                    v.next = (!next.is_empty()).then(|| next.clone());
                }
                self.slots.clear();
                self.status = TaskStatus::Processing;
            }
            Event::NodeFailed {
                node,
                error,
                next,
                output,
                ..
            } => {
                self.ctx(node)
                    .insert("error".into(), Value::String(error.clone()));
                self.failed_node = Some(node.clone());
                self.error = Some(error.clone());
                if let Some(v) = self.visit() {
                    v.outcome = Some(NodeOutcome::Failed);
                    v.error = Some(error.clone());
                    if !output.is_null() {
                        v.output = output.clone();
                    }
                    v.ended_ms = Some(at_ms);
                    v.next.clone_from(next);
                }
                self.slots.clear();
                self.status = TaskStatus::Processing;
            }
            Event::TaskEnded {
                status,
                output,
                error,
                failed_node,
            } => {
                self.status = *status;
                self.output = output.clone();
                if error.is_some() {
                    self.error.clone_from(error);
                }
                if failed_node.is_some() {
                    self.failed_node.clone_from(failed_node);
                }
                if *status == TaskStatus::Cancelled
                    && let Some(v) = self.visit()
                {
                    v.outcome = Some(NodeOutcome::Cancelled);
                    v.ended_ms = Some(at_ms);
                }
                if *status == TaskStatus::Succeeded {
                    self.error = None;
                    self.failed_node = None;
                }
                for t in self.timers.values_mut() {
                    if !t.fired {
                        t.cancelled = true;
                    }
                }
                self.current = None;
                self.slots.clear();
                self.ended_ms = Some(at_ms);
            }
            Event::TaskRetried { .. } => {
                self.visits_base = self.visits.len();
                self.status = TaskStatus::Processing;
                self.ended_ms = None;
                self.error = None;
                self.partial = false;
            }
        }
    }

    /// The `nodes` variable for expressions.
    pub fn nodes_value(&self) -> Value {
        Value::Object(
            self.context
                .iter()
                .map(|(k, v)| (k.clone(), Value::Object(v.clone())))
                .collect(),
        )
    }

    /// Timers scheduled, not fired nor cancelled, due at or before `now_ms`.
    pub fn due_timers(&self, now_ms: i64) -> impl Iterator<Item = (&String, &TimerState)> {
        self.timers
            .iter()
            .filter(move |(_, t)| !t.fired && !t.cancelled && t.fire_at_ms <= now_ms)
    }

    /// Whether timer `id` is pending (neither fired nor cancelled).
    pub fn timer_pending(&self, id: &str) -> bool {
        self.timers
            .get(id)
            .is_some_and(|t| !t.fired && !t.cancelled)
    }

    /// Node visits since the task started or was last retried.
    pub fn visits_since_retry(&self) -> usize {
        self.visits.len().saturating_sub(self.visits_base)
    }

    /// Whether timer `id` fired.
    pub fn timer_fired(&self, id: &str) -> bool {
        self.timers.get(id).is_some_and(|t| t.fired)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Events as earlier versions stored them (failure codes as names, a slot's error as one
    /// `"CODE: message"` string, `FLOW` for flow failures) read back typed and are written
    /// back byte for byte the same, so SQLite and PostgreSQL logs stay readable both ways.
    #[test]
    fn stored_failure_events_keep_their_shape() {
        let stored = [
            r#"{"kind":"attempt_failed","node":"act","slot":"act","attempt":2,"code":"UNAVAILABLE","error":"down","retry_timer":"t:1:backoff:act#2"}"#,
            r#"{"kind":"slot_completed","node":"n","slot":"n/sms","ok":false,"output":null,"error":"INVALID_ARGUMENT: bad phone: +1"}"#,
            r#"{"kind":"slot_completed","node":"n","slot":"n","ok":true,"output":{"a":1},"error":null}"#,
            r#"{"kind":"node_failed","node":"no","code":"FLOW","error":"refused","next":null,"output":null}"#,
            r#"{"kind":"node_failed","node":"ask","code":"DEADLINE_EXCEEDED","error":"late","next":"x","output":null}"#,
        ];
        for text in stored {
            let event: Event = serde_json::from_str(text).unwrap();
            assert_eq!(serde_json::to_string(&event).unwrap(), text);
        }
        let event: Event = serde_json::from_str(stored[0]).unwrap();
        assert!(matches!(
            event,
            Event::AttemptFailed {
                code: tonic::Code::Unavailable,
                ..
            }
        ));
        let mut s = TaskState::new("t");
        s.apply(&serde_json::from_str(stored[1]).unwrap(), 0);
        assert_eq!(
            s.slots["n/sms"].done,
            Some(Err(NodeError::new(
                tonic::Code::InvalidArgument,
                "bad phone: +1"
            )))
        );
        let event: Event = serde_json::from_str(stored[3]).unwrap();
        assert!(matches!(
            event,
            Event::NodeFailed {
                code: FailureCode::Flow,
                ..
            }
        ));
    }
}
