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

use crate::event::{Event, TaskState};
use crate::failure::FailureCode;
use crate::flow::{Flow, NodeKind};

use super::step::Cx;
pub use super::step::{Bounds, CallResult, CallSpec, Delivery, Step, message_id};
use super::{condition, end, human, parallel, slots, task, wait};

/// Decides the next step of a task from its state alone.
///
/// `now_ms` is the time (unix ms) timers and deadlines are compared with; `running` holds the
/// slots whose calls the caller has in flight (they are not re-sent); `rng` draws back-off
/// jitter; `bounds` caps the task's node visits (a task over them fails with
/// RESOURCE_EXHAUSTED, never into a `catch`, which could loop too).
pub fn decide(
    state: &TaskState,
    flow: &Flow,
    now_ms: i64,
    running: &HashSet<String>,
    bounds: &Bounds,
    rng: &mut dyn RngCore,
) -> Step {
    let cx = Cx {
        state,
        flow,
        now_ms,
        bounds,
    };
    let Some(current) = state.current.as_deref() else {
        return Step::Events(vec![Event::NodeEntered {
            node: flow.initial.clone(),
        }]);
    };
    let visits = state.visits_since_retry();
    if visits > bounds.max_node_visits {
        let error = format!(
            "the task made {visits} node visits, over the bound of {} (orchestrator.max_node_visits); do its nodes loop without end? raise the bound for longer flows",
            bounds.max_node_visits
        );
        return Step::Events(vec![
            Event::NodeFailed {
                node: current.to_string(),
                code: FailureCode::Grpc(tonic::Code::ResourceExhausted),
                error: error.clone(),
                next: None,
                output: serde_json::Value::Null,
            },
            Event::TaskEnded {
                status: crate::event::TaskStatus::Failed,
                output: state.output.clone(),
                error: Some(format!("node {current} failed: {error}")),
                failed_node: Some(current.to_string()),
            },
        ]);
    }
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
///
/// A failure that provably did not deliver ([`Delivery::NotDelivered`]) is not an attempt:
/// the slot waits for a redelivery timer (capped exponential back-off) and sends the same
/// attempt again, until the attempt's deadline (or, without one, `bounds`' default call
/// timeout) passes — then it fails with DEADLINE_EXCEEDED, saying nothing was routable.
pub fn on_call_result(
    state: &TaskState,
    flow: &Flow,
    now_ms: i64,
    done: CallResult,
    bounds: &Bounds,
    rng: &mut dyn RngCore,
) -> Vec<Event> {
    slots::on_call_result(
        &Cx {
            state,
            flow,
            now_ms,
            bounds,
        },
        done,
        rng,
    )
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;
    use crate::engine::testing::*;
    use crate::event::TaskStatus;

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

    /// Condition nodes that point at each other end at the visit bound, failing the task
    /// with RESOURCE_EXHAUSTED (not into a `catch`, which could loop too).
    #[test]
    fn a_loop_of_nodes_ends_at_the_visit_bound() {
        let f = flow(
            "id: f\nversion: 1\ninitial: a\nstates:\n  a: {type: condition, conditions: [{if: 'true', next: b}], default: done, catch: a}\n  b: {type: condition, conditions: [{if: 'true', next: a}], default: done}\n  done: {type: succeed}\n",
        );
        let bounds = Bounds {
            max_node_visits: 7,
            ..Bounds::default()
        };
        let mut s = started(&f, json!({}));
        for _ in 0..100 {
            if s.status.is_terminal() {
                break;
            }
            let step = decide(&s, &f, T0, &HashSet::new(), &bounds, &mut rng());
            apply(&mut s, &events(step), T0);
        }
        assert_eq!(s.status, TaskStatus::Failed);
        assert_eq!(s.visits.len(), 8);
        let error = s.error.clone().unwrap();
        assert!(
            error.contains(
                "the task made 8 node visits, over the bound of 7 (orchestrator.max_node_visits)"
            ),
            "{error}"
        );
        // A retry starts counting again.
        apply(
            &mut s,
            &[
                Event::TaskRetried { node: "a".into() },
                Event::NodeEntered { node: "a".into() },
            ],
            T0,
        );
        assert_eq!(s.visits_since_retry(), 1);
    }
}
