//! `succeed` and `fail` nodes: the task ends.

use crate::event::{Event, NodeOutcome, TaskStatus};
use crate::failure::FailureCode;

use super::step::{Cx, Step};
use serde_json::Value;

/// A `succeed` node: the task ends SUCCEEDED (PARTIAL when a parallel node was PARTIAL on the
/// way) with the last completed node's output.
pub(super) fn succeed(cx: &Cx<'_>, node: &str) -> Step {
    let state = cx.state;
    Step::Events(vec![
        Event::NodeCompleted {
            node: node.to_string(),
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
    ])
}

/// A `fail` node: the task ends FAILED with the node's `error` (code `FLOW`).
pub(super) fn fail(cx: &Cx<'_>, node: &str, error: &str) -> Step {
    Step::Events(vec![
        Event::NodeFailed {
            node: node.to_string(),
            code: FailureCode::Flow,
            error: error.to_string(),
            next: None,
            output: Value::Null,
        },
        Event::TaskEnded {
            status: TaskStatus::Failed,
            output: cx.state.output.clone(),
            error: Some(error.to_string()),
            failed_node: Some(node.to_string()),
        },
    ])
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::engine::testing::*;

    #[test]
    fn succeed_ends_with_the_last_output() {
        let f = flow("id: f\nversion: 1\ninitial: done\nstates:\n  done: {type: succeed}\n");
        let mut s = started(&f, json!({}));
        s.output = json!({"n": 1});
        assert_eq!(
            events(decide_at(&s, &f, T0)),
            [
                Event::NodeCompleted {
                    node: "done".into(),
                    outcome: NodeOutcome::Succeeded,
                    output: json!({"n": 1}),
                    next: String::new(),
                },
                Event::TaskEnded {
                    status: TaskStatus::Succeeded,
                    output: json!({"n": 1}),
                    error: None,
                    failed_node: None,
                },
            ]
        );
    }

    #[test]
    fn succeed_after_a_partial_parallel_node_is_partial() {
        let f = flow("id: f\nversion: 1\ninitial: done\nstates:\n  done: {type: succeed}\n");
        let mut s = started(&f, json!({}));
        s.partial = true;
        let events = events(decide_at(&s, &f, T0));
        assert!(
            matches!(
                events.last(),
                Some(Event::TaskEnded {
                    status: TaskStatus::Partial,
                    ..
                })
            ),
            "{events:?}"
        );
    }

    #[test]
    fn fail_ends_failed_with_the_flow_code() {
        let f =
            flow("id: f\nversion: 1\ninitial: no\nstates:\n  no: {type: fail, error: refused}\n");
        let s = started(&f, json!({}));
        assert_eq!(
            events(decide_at(&s, &f, T0)),
            [
                Event::NodeFailed {
                    node: "no".into(),
                    code: FailureCode::Flow,
                    error: "refused".into(),
                    next: None,
                    output: Value::Null,
                },
                Event::TaskEnded {
                    status: TaskStatus::Failed,
                    output: Value::Null,
                    error: Some("refused".into()),
                    failed_node: Some("no".into()),
                },
            ]
        );
    }
}
