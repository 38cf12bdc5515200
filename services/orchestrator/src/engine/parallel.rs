//! `parallel` nodes: one call slot per branch (`node/branch`), run concurrently; SUCCEEDED,
//! PARTIAL or FAILED by the success threshold.

use std::collections::HashSet;

use rand::RngCore;
use serde_json::{Value, json};
use tonic::Code;

use crate::event::{Event, NodeOutcome};
use crate::failure::FailureCode;
use crate::flow::{Branch, Node};

use super::slots::{self, Slot};
use super::step::{Cx, Step, complete};

/// A parallel node's fields.
pub(super) struct Spec<'a> {
    pub(super) branches: &'a [Branch],
    pub(super) success_threshold: u32,
    pub(super) next: &'a str,
    pub(super) on_partial: Option<&'a str>,
    pub(super) on_failure: Option<&'a str>,
}

/// Runs every branch; the node's output maps each branch name to its output (or
/// `{"error": "CODE: message"}`). All succeeded: SUCCEEDED to `next`; at least the
/// threshold: PARTIAL to `on_partial` (else `next`); fewer: the node fails with
/// FAILED_PRECONDITION to `on_failure` (else `catch`, else the task fails), keeping the
/// branch results as the failed visit's output.
pub(super) fn decide(
    cx: &Cx<'_>,
    node: &Node,
    spec: &Spec<'_>,
    running: &HashSet<String>,
    rng: &mut dyn RngCore,
) -> Step {
    let id = node.id.as_str();
    let slots: Vec<Slot<'_>> = spec
        .branches
        .iter()
        .map(|b| Slot {
            id: format!("{id}/{}", b.name),
            capability: b.capability.as_str(),
            input: b.input.as_ref(),
        })
        .collect();
    slots::decide(cx, node, &slots, running, rng, |outcomes| {
        let mut output = serde_json::Map::new();
        let mut ok_count = 0u32;
        let mut errors = Vec::new();
        for (b, outcome) in spec.branches.iter().zip(outcomes) {
            match outcome {
                Ok(out) => {
                    ok_count += 1;
                    output.insert(b.name.clone(), out.clone());
                }
                Err(e) => {
                    errors.push(format!("{}: {e}", b.name));
                    output.insert(b.name.clone(), json!({"error": e.to_string()}));
                }
            }
        }
        let total = u32::try_from(spec.branches.len()).unwrap_or(u32::MAX);
        let output = Value::Object(output);
        let threshold = spec.success_threshold;
        if ok_count == total {
            complete(id, NodeOutcome::Succeeded, output, spec.next)
        } else if ok_count >= threshold {
            complete(
                id,
                NodeOutcome::Partial,
                output,
                spec.on_partial.unwrap_or(spec.next),
            )
        } else {
            let error = format!(
                "{ok_count} of {total} branches succeeded, {threshold} needed ({})",
                errors.join("; ")
            );
            let mut events = cx.fail_node(
                id,
                FailureCode::Grpc(Code::FailedPrecondition),
                error,
                spec.on_failure.map(str::to_string),
            );
            // Keep the branch results for inspection.
            if let Some(Event::NodeFailed {
                output: failed_output,
                ..
            }) = events.first_mut()
            {
                *failed_output = output;
            }
            events
        }
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::engine::decide::{Bounds, CallResult, Delivery, on_call_result};
    use crate::engine::testing::*;
    use crate::event::TaskStatus;
    use crate::failure::NodeError;

    const FLOW: &str = "id: f\nversion: 1\ninitial: notify\nstates:\n  notify:\n    type: parallel\n    branches:\n      - {name: email, capability: notify.email}\n      - {name: sms, capability: notify.sms}\n      - {name: push, capability: notify.push}\n    success_threshold: THRESHOLD\n    next: done\n  done: {type: succeed}\n";

    /// Starts every branch, then answers them in order with `replies`.
    fn finish(threshold: u32, replies: [Result<Value, NodeError>; 3]) -> (Vec<Event>, Step) {
        let f = flow(&FLOW.replace("THRESHOLD", &threshold.to_string()));
        let mut s = started(&f, json!({"to": "jane"}));
        let (appended, step) = run(&mut s, &f, T0);
        let slots: Vec<&str> = appended
            .iter()
            .filter_map(|e| match e {
                Event::AttemptStarted { slot, input, .. } => {
                    assert_eq!(*input, json!({"to": "jane"}));
                    Some(slot.as_str())
                }
                _ => None,
            })
            .collect();
        assert_eq!(slots, ["notify/email", "notify/sms", "notify/push"]);
        let Step::Calls(calls) = step else {
            panic!("{step:?}")
        };
        assert_eq!(calls.len(), 3);
        for (call, reply) in calls.into_iter().zip(replies) {
            let events = on_call_result(
                &s,
                &f,
                T0 + 1,
                CallResult {
                    slot: call.slot,
                    attempt: call.attempt,
                    result: reply,
                    delivery: Delivery::Maybe,
                    usage: Default::default(),
                },
                &Bounds::default(),
                &mut rng(),
            );
            apply(&mut s, &events, T0 + 1);
        }
        run(&mut s, &f, T0 + 1)
    }

    fn sent() -> Result<Value, NodeError> {
        Ok(json!({"sent": true}))
    }

    fn bad_phone() -> Result<Value, NodeError> {
        Err(NodeError::new(Code::InvalidArgument, "bad phone number"))
    }

    #[test]
    fn every_branch_succeeding_succeeds() {
        let (appended, _) = finish(2, [sent(), sent(), sent()]);
        assert_eq!(
            appended[..2],
            complete(
                "notify",
                NodeOutcome::Succeeded,
                json!({"email": {"sent": true}, "sms": {"sent": true}, "push": {"sent": true}}),
                "done"
            )
        );
    }

    #[test]
    fn reaching_the_threshold_is_partial() {
        let (appended, _) = finish(2, [sent(), bad_phone(), sent()]);
        assert_eq!(
            appended[..2],
            complete(
                "notify",
                NodeOutcome::Partial,
                json!({"email": {"sent": true}, "sms": {"error": "INVALID_ARGUMENT: bad phone number"}, "push": {"sent": true}}),
                "done"
            )
        );
        assert!(matches!(
            appended.last(),
            Some(Event::TaskEnded {
                status: TaskStatus::Partial,
                ..
            })
        ));
    }

    #[test]
    fn below_the_threshold_fails_with_the_branch_results() {
        let (appended, _) = finish(3, [sent(), bad_phone(), sent()]);
        assert_eq!(
            appended[0],
            Event::NodeFailed {
                node: "notify".into(),
                code: FailureCode::Grpc(Code::FailedPrecondition),
                error:
                    "2 of 3 branches succeeded, 3 needed (sms: INVALID_ARGUMENT: bad phone number)"
                        .into(),
                next: None,
                output: json!({"email": {"sent": true}, "sms": {"error": "INVALID_ARGUMENT: bad phone number"}, "push": {"sent": true}}),
            }
        );
        assert!(matches!(
            appended.last(),
            Some(Event::TaskEnded {
                status: TaskStatus::Failed,
                ..
            })
        ));
    }
}
