//! The vocabulary of the decider: [`Step`], the calls it asks for and their results, and
//! the helpers every node kind uses (the decision context, completing or failing a node,
//! timer and message ids).

use serde_json::{Value, json};

use crate::event::{Event, NodeOutcome, TaskState, TaskStatus};
use crate::expr::Scope;
use crate::failure::{FailureCode, NodeError};
use crate::flow::Flow;

/// What the driver does next.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Append these events, then decide again.
    Events(Vec<Event>),
    /// Make these calls; each attempt is in the log already ([`Event::AttemptStarted`]).
    Calls(Vec<CallSpec>),
    /// Nothing to do until a call returns, a timer is due or a command arrives.
    Park,
}

/// A call to make for one slot (a task node, or one branch of a parallel node).
#[derive(Debug, Clone, PartialEq)]
pub struct CallSpec {
    /// `node` or `node/branch`.
    pub slot: String,
    /// The attempt number (over the task's life).
    pub attempt: u32,
    /// The message id, derived from task, slot and attempt ([`message_id`]).
    pub message_id: String,
    /// The capability to call.
    pub capability: String,
    /// The input to send.
    pub input: Value,
    /// When the attempt times out (unix ms); `None` uses the default call timeout.
    pub deadline_ms: Option<i64>,
}

/// What a call for one slot came back with.
#[derive(Debug, Clone, PartialEq)]
pub struct CallResult {
    /// The slot.
    pub slot: String,
    /// The attempt.
    pub attempt: u32,
    /// The reply's first data part (else its first text part, else null), or the failure.
    pub result: Result<Value, NodeError>,
    /// Whether a failure provably never reached an agent.
    pub delivery: Delivery,
    /// What the reply's model calls cost, as its header metadata reported (zero when it
    /// reported none, or failed).
    pub usage: reach_rpc::usage::TokenUsage,
}

/// What a failed call says about delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// The message may have reached an agent (or the call succeeded): the attempt counts.
    Maybe,
    /// The message provably reached no agent: the router could not be reached, or it had no
    /// routable instance (ROUTE_NOT_FOUND, INSTANCE_UNAVAILABLE, OVERLOADED,
    /// INSTANCE_DRAINING). The attempt is sent again after a pause, within its deadline,
    /// without counting.
    NotDelivered,
}

/// The bounds a decision keeps to (from the configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// Node visits a task may make between retries before it fails.
    pub max_node_visits: usize,
    /// How long an attempt without a deadline may wait for a routable instance (ms): the
    /// default call timeout.
    pub default_call_timeout_ms: i64,
}

impl Default for Bounds {
    fn default() -> Self {
        Self {
            max_node_visits: 1000,
            default_call_timeout_ms: 300_000,
        }
    }
}

/// What one decision sees: the task, its flow and the time.
pub(super) struct Cx<'a> {
    /// The task.
    pub(super) state: &'a TaskState,
    /// The task's flow version.
    pub(super) flow: &'a Flow,
    /// Now, in unix ms.
    pub(super) now_ms: i64,
    /// The configured bounds.
    pub(super) bounds: &'a Bounds,
}

impl Cx<'_> {
    /// The variables expressions see: `input`, `nodes` and `task`.
    pub(super) fn scope(&self) -> Scope {
        let state = self.state;
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

    /// The index of the current node visit (part of timer ids, so a revisit gets new ones).
    pub(super) fn visit(&self) -> usize {
        self.state.visits.len()
    }

    /// The events of `node` failing for good with `code` and `error`: on to `handler` (or the
    /// node's `catch`) when there is one, else the task fails.
    pub(super) fn fail_node(
        &self,
        node: &str,
        code: FailureCode,
        error: String,
        handler: Option<String>,
    ) -> Vec<Event> {
        let catch = handler.or_else(|| self.flow.node(node).and_then(|n| n.catch.clone()));
        let mut events = vec![Event::NodeFailed {
            node: node.to_string(),
            code,
            error: error.clone(),
            next: catch.clone(),
            output: Value::Null,
        }];
        match catch {
            Some(next) => events.push(Event::NodeEntered { node: next }),
            None => events.push(Event::TaskEnded {
                status: TaskStatus::Failed,
                output: self.state.output.clone(),
                error: Some(format!("node {node} failed: {error}")),
                failed_node: Some(node.to_string()),
            }),
        }
        events
    }
}

/// The events of `node` completing with `outcome` and `output`, then entering `next`.
pub(super) fn complete(node: &str, outcome: NodeOutcome, output: Value, next: &str) -> Vec<Event> {
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

/// The id of a durable timer: unique per task, node visit, purpose and slot attempt.
pub(super) fn timer_id(task_id: &str, visit: usize, purpose: &str, extra: &str) -> String {
    format!("{task_id}:{visit}:{purpose}:{extra}")
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
