//! The decider: what a task does next, as a pure function of its state, its flow, the time
//! and a random source (for back-off jitter).
//!
//! [`decide`] returns the next [`Step`]: events to append, calls to make, or nothing until a
//! call returns, a timer is due or a command arrives. [`on_call_result`] turns a finished
//! call into events. Neither reads a clock, a store, the flow registry or a global random
//! generator, so every node kind is tested without I/O (see the tests of each node module)
//! and the same inputs always give the same step.

use std::collections::HashSet;

use rand::RngCore;
use serde_json::{Value, json};

use crate::event::{Event, NodeOutcome, TaskState, TaskStatus};
use crate::expr::Scope;
use crate::failure::{FailureCode, NodeError};
use crate::flow::{Flow, NodeKind};

use super::{condition, end, human, parallel, slots, task, wait};

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
}

/// What one decision sees: the task, its flow and the time.
pub(super) struct Cx<'a> {
    /// The task.
    pub(super) state: &'a TaskState,
    /// The task's flow version.
    pub(super) flow: &'a Flow,
    /// Now, in unix ms.
    pub(super) now_ms: i64,
}

/// Decides the next step of a task from its state alone.
///
/// `now_ms` is the time (unix ms) timers and deadlines are compared with; `running` holds the
/// slots whose calls the caller has in flight (they are not re-sent); `rng` draws back-off
/// jitter.
pub fn decide(
    state: &TaskState,
    flow: &Flow,
    now_ms: i64,
    running: &HashSet<String>,
    rng: &mut dyn RngCore,
) -> Step {
    let cx = Cx {
        state,
        flow,
        now_ms,
    };
    let Some(current) = state.current.as_deref() else {
        return Step::Events(vec![Event::NodeEntered {
            node: flow.initial.clone(),
        }]);
    };
    let Some(node) = flow.node(current) else {
        return Step::Events(cx.fail_node(
            current,
            FailureCode::Flow,
            format!(
                "node {current} is not in flow {} v{}",
                flow.id, flow.version
            ),
            None,
        ));
    };
    match &node.kind {
        NodeKind::Succeed => end::succeed(&cx, current),
        NodeKind::Fail { error } => end::fail(&cx, current, error),
        NodeKind::Condition { branches, default } => {
            condition::decide(&cx, current, branches, default)
        }
        NodeKind::Wait { duration, next } => wait::decide(&cx, current, *duration, next),
        NodeKind::Human { next, prompt, .. } => human::decide(&cx, node, next, prompt),
        NodeKind::Task {
            capability,
            input,
            next,
        } => task::decide(&cx, node, capability, input.as_ref(), next, running, rng),
        NodeKind::Parallel {
            branches,
            success_threshold,
            next,
            on_partial,
            on_failure,
        } => parallel::decide(
            &cx,
            node,
            &parallel::Spec {
                branches,
                success_threshold: *success_threshold,
                next,
                on_partial: on_partial.as_deref(),
                on_failure: on_failure.as_deref(),
            },
            running,
            rng,
        ),
    }
}

/// The events a finished call adds: the slot's result, or the failed attempt with its retry
/// (a back-off timer) or its final error. Empty when the result is stale (the slot moved on
/// to another attempt or node).
pub fn on_call_result(
    state: &TaskState,
    flow: &Flow,
    now_ms: i64,
    done: CallResult,
    rng: &mut dyn RngCore,
) -> Vec<Event> {
    slots::on_call_result(
        &Cx {
            state,
            flow,
            now_ms,
        },
        done,
        rng,
    )
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

/// Test support for the node modules: flows, folded states and a seeded RNG, no I/O.
#[cfg(test)]
pub(super) mod testing {
    use std::collections::HashSet;

    use rand::SeedableRng;
    use rand::rngs::SmallRng;
    use serde_json::Value;

    use super::Step;
    use crate::event::{Event, TaskState};
    use crate::flow::Flow;

    /// The time every test starts at (unix ms).
    pub const T0: i64 = 1_000_000;

    /// A flow from YAML (panics on an invalid one).
    pub fn flow(yaml: &str) -> Flow {
        Flow::parse("test.yaml", yaml).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A task of `flow` created at [`T0`] with `input`, at its initial node.
    pub fn started(flow: &Flow, input: Value) -> TaskState {
        let mut s = TaskState::new("t1");
        for e in [
            Event::TaskCreated {
                flow_id: flow.id.clone(),
                flow_version: flow.version,
                input,
                trace_id: "0af7651916cd43dd8448eb211c80319c".into(),
            },
            Event::NodeEntered {
                node: flow.initial.clone(),
            },
        ] {
            s.apply(&e, T0);
        }
        s.seq = 2;
        s
    }

    /// A seeded RNG, so jittered delays are the same on every run.
    pub fn rng() -> SmallRng {
        SmallRng::seed_from_u64(7)
    }

    /// Decides at `now` with no call in flight.
    pub fn decide_at(state: &TaskState, flow: &Flow, now: i64) -> Step {
        super::decide(state, flow, now, &HashSet::new(), &mut rng())
    }

    /// The events of a step that must be `Step::Events`.
    pub fn events(step: Step) -> Vec<Event> {
        match step {
            Step::Events(e) => e,
            other => panic!("expected events, got {other:?}"),
        }
    }

    /// Applies `events` at `at` (as the driver does after appending them).
    pub fn apply(state: &mut TaskState, events: &[Event], at: i64) {
        for e in events {
            state.apply(e, at);
            state.seq += 1;
        }
    }

    /// Decides and applies event steps at `now` until the task parks, calls or ends;
    /// returns every event appended and the last step.
    pub fn run(state: &mut TaskState, flow: &Flow, now: i64) -> (Vec<Event>, Step) {
        let mut all = Vec::new();
        for _ in 0..100 {
            if state.status.is_terminal() {
                return (all, Step::Park);
            }
            match decide_at(state, flow, now) {
                Step::Events(events) => {
                    apply(state, &events, now);
                    all.extend(events);
                }
                other => return (all, other),
            }
        }
        panic!("the decider did not settle: {all:#?}");
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;

    #[test]
    fn a_new_task_enters_the_initial_node() {
        let f = flow("id: f\nversion: 1\ninitial: done\nstates:\n  done: {type: succeed}\n");
        let s = TaskState::new("t1");
        assert_eq!(
            events(decide_at(&s, &f, T0)),
            [Event::NodeEntered {
                node: "done".into()
            }]
        );
    }

    #[test]
    fn a_node_missing_from_the_flow_fails_the_task() {
        let f = flow("id: f\nversion: 3\ninitial: done\nstates:\n  done: {type: succeed}\n");
        let mut s = started(&f, json!({}));
        s.current = Some("gone".into());
        assert_eq!(
            events(decide_at(&s, &f, T0)),
            [
                Event::NodeFailed {
                    node: "gone".into(),
                    code: FailureCode::Flow,
                    error: "node gone is not in flow f v3".into(),
                    next: None,
                    output: Value::Null,
                },
                Event::TaskEnded {
                    status: TaskStatus::Failed,
                    output: Value::Null,
                    error: Some("node gone failed: node gone is not in flow f v3".into()),
                    failed_node: Some("gone".into()),
                },
            ]
        );
    }

    #[test]
    fn message_ids_are_stable_per_attempt() {
        assert_eq!(message_id("t", "a", 1), message_id("t", "a", 1));
        assert_ne!(message_id("t", "a", 1), message_id("t", "a", 2));
        assert_ne!(message_id("t", "a", 1), message_id("t", "b", 1));
    }
}
