//! `condition` nodes: go to the `next` of the first expression that holds, else `default`.

use serde_json::json;
use tonic::Code;

use crate::event::NodeOutcome;
use crate::expr::Expr;
use crate::failure::FailureCode;

use super::step::{Cx, Step, complete};

/// Evaluates `branches` in order; the node's output is `{next, matched}` (`matched` is the
/// index of the expression that held, null for `default`). An expression that cannot be
/// evaluated fails the node with INVALID_ARGUMENT; one that exceeds its evaluation budget
/// (steps, time or value size, see [`crate::expr::ExprLimits`]) with RESOURCE_EXHAUSTED.
pub(super) fn decide(cx: &Cx<'_>, node: &str, branches: &[(Expr, String)], default: &str) -> Step {
    let scope = cx.scope();
    let mut chosen = None;
    for (i, (expr, next)) in branches.iter().enumerate() {
        match expr.eval_bool(&scope) {
            Ok(true) => {
                chosen = Some((Some(i), next.as_str()));
                break;
            }
            Ok(false) => {}
            Err(e) if e.exhausted => {
                return Step::Events(cx.fail_node(
                    node,
                    FailureCode::Grpc(Code::ResourceExhausted),
                    format!(
                        "condition of node `{node}` {} (`{}`)",
                        e.message,
                        crate::expr::snippet(e.source_text.as_str())
                    ),
                    None,
                ));
            }
            Err(e) => {
                return Step::Events(cx.fail_node(
                    node,
                    FailureCode::Grpc(Code::InvalidArgument),
                    e.to_string(),
                    None,
                ));
            }
        }
    }
    let (matched, next) = chosen.unwrap_or((None, default));
    Step::Events(complete(
        node,
        NodeOutcome::Succeeded,
        json!({"next": next, "matched": matched}),
        next,
    ))
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;
    use crate::engine::testing::*;
    use crate::event::{Event, TaskStatus};

    const FLOW: &str = "id: f\nversion: 1\ninitial: route\nstates:\n  route:\n    type: condition\n    conditions:\n      - {if: \"input.n > 10\", next: big}\n      - {if: \"input.n > 5\", next: mid}\n    default: small\n  big: {type: succeed}\n  mid: {type: succeed}\n  small: {type: succeed}\n";

    #[test]
    fn the_first_expression_that_holds_wins() {
        let f = flow(FLOW);
        for (n, next, matched) in [
            (20, "big", json!(0)),
            (7, "mid", json!(1)),
            (1, "small", Value::Null),
        ] {
            let s = started(&f, json!({"n": n}));
            assert_eq!(
                events(decide_at(&s, &f, T0)),
                complete(
                    "route",
                    NodeOutcome::Succeeded,
                    json!({"next": next, "matched": matched}),
                    next
                ),
                "n = {n}"
            );
        }
    }

    #[test]
    fn an_expression_that_cannot_be_evaluated_fails_the_node() {
        let f = flow(FLOW);
        let s = started(&f, json!({}));
        let events = events(decide_at(&s, &f, T0));
        match &events[..] {
            [
                Event::NodeFailed {
                    node, code, next, ..
                },
                Event::TaskEnded {
                    status: TaskStatus::Failed,
                    failed_node: Some(failed),
                    ..
                },
            ] => {
                assert_eq!(node, "route");
                assert_eq!(*code, FailureCode::Grpc(Code::InvalidArgument));
                assert_eq!(*next, None);
                assert_eq!(failed, "route");
            }
            other => panic!("{other:#?}"),
        }
    }

    /// A condition that would take 10⁹ steps fails its node at the budget, with
    /// RESOURCE_EXHAUSTED naming the node and the budget.
    #[test]
    fn a_condition_over_its_budget_fails_the_node() {
        let list = format!("[{}]", vec!["1"; 500].join(","));
        let yaml = format!(
            "id: f\nversion: 1\ninitial: route\nstates:\n  route:\n    type: condition\n    conditions:\n      - {{if: \"{list}.all(x, {list}.all(y, {list}.all(z, true)))\", next: done}}\n    default: done\n  done: {{type: succeed}}\n"
        );
        let limits = crate::expr::ExprLimits {
            max_bytes: 1 << 16,
            max_time: std::time::Duration::from_secs(60),
            ..Default::default()
        };
        let f = crate::flow::Flow::parse_with("f.yaml", &yaml, &limits).unwrap();
        let s = started(&f, json!({}));
        match &events(decide_at(&s, &f, T0))[0] {
            Event::NodeFailed { code, error, .. } => {
                assert_eq!(*code, FailureCode::Grpc(Code::ResourceExhausted));
                assert!(
                    error.starts_with(
                        "condition of node `route` exceeded its evaluation budget of 100000 steps"
                    ),
                    "{error}"
                );
            }
            other => panic!("{other:?}"),
        }
    }
}
