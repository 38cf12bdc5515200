//! `human` nodes: wait for ResumeTask, optionally until a timeout.

use tonic::Code;

use crate::event::{Event, NodeOutcome, TimerPurpose};
use crate::failure::FailureCode;
use crate::flow::Node;

use super::clock::ms;
use super::step::{Cx, Step, complete, timer_id};

/// Records the wait (and schedules the node's timeout) on entry; completes with the resume
/// input once given (cancelling the timeout); fails the node with DEADLINE_EXCEEDED when the
/// timeout fires first.
pub(super) fn decide(cx: &Cx<'_>, node: &Node, next: &str, prompt: &Option<String>) -> Step {
    let state = cx.state;
    let id = node.id.as_str();
    let timer = timer_id(&state.id, cx.visit(), "human", id);
    if let Some(input) = &state.human_input {
        let mut events = Vec::new();
        if state.timer_pending(&timer) {
            events.push(Event::TimerCancelled {
                timer,
                purpose: Some(TimerPurpose::HumanTimeout),
            });
        }
        events.extend(complete(id, NodeOutcome::Succeeded, input.clone(), next));
        return Step::Events(events);
    }
    if !state.human_waiting {
        let mut events = vec![Event::HumanWaiting {
            node: id.to_string(),
            prompt: prompt.clone(),
        }];
        if let Some(timeout) = node.timeout {
            events.push(Event::TimerScheduled {
                timer,
                node: id.to_string(),
                slot: None,
                purpose: TimerPurpose::HumanTimeout,
                fire_at_ms: cx.now_ms + ms(timeout),
            });
        }
        return Step::Events(events);
    }
    match state.timers.get(&timer) {
        Some(t) if t.fired => Step::Events(cx.fail_node(
            id,
            FailureCode::Grpc(Code::DeadlineExceeded),
            format!(
                "no one resumed the task within {}",
                humantime::format_duration(node.timeout.unwrap_or_default())
            ),
            None,
        )),
        Some(t) if !t.cancelled && t.fire_at_ms <= cx.now_ms => {
            Step::Events(vec![Event::TimerFired { timer }])
        }
        _ => Step::Park,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;
    use crate::engine::testing::*;
    use crate::event::TaskStatus;

    const FLOW: &str = "id: f\nversion: 1\ninitial: ask\nstates:\n  ask: {type: human, prompt: Approve?, timeout: 300ms, catch: late, next: done}\n  late: {type: fail, error: late}\n  done: {type: succeed}\n";

    #[test]
    fn waits_then_completes_with_the_resume_input() {
        let f = flow(FLOW);
        let mut s = started(&f, json!({}));
        let (appended, step) = run(&mut s, &f, T0);
        assert_eq!(
            appended,
            [
                Event::HumanWaiting {
                    node: "ask".into(),
                    prompt: Some("Approve?".into()),
                },
                Event::TimerScheduled {
                    timer: "t1:1:human:ask".into(),
                    node: "ask".into(),
                    slot: None,
                    purpose: TimerPurpose::HumanTimeout,
                    fire_at_ms: T0 + 300,
                },
            ]
        );
        assert_eq!(step, Step::Park);
        assert_eq!(s.status, TaskStatus::WaitingHuman);
        apply(
            &mut s,
            &[Event::HumanResumed {
                node: "ask".into(),
                input: json!({"approved": true}),
                by: None,
            }],
            T0 + 100,
        );
        let mut expected = vec![Event::TimerCancelled {
            timer: "t1:1:human:ask".into(),
            purpose: Some(TimerPurpose::HumanTimeout),
        }];
        expected.extend(complete(
            "ask",
            NodeOutcome::Succeeded,
            json!({"approved": true}),
            "done",
        ));
        assert_eq!(events(decide_at(&s, &f, T0 + 100)), expected);
    }

    #[test]
    fn the_timeout_fails_the_node_into_its_catch() {
        let f = flow(FLOW);
        let mut s = started(&f, json!({}));
        run(&mut s, &f, T0);
        assert_eq!(decide_at(&s, &f, T0 + 299), Step::Park);
        let (appended, _) = run(&mut s, &f, T0 + 300);
        assert_eq!(
            appended[..3],
            [
                Event::TimerFired {
                    timer: "t1:1:human:ask".into()
                },
                Event::NodeFailed {
                    node: "ask".into(),
                    code: FailureCode::Grpc(Code::DeadlineExceeded),
                    error: "no one resumed the task within 300ms".into(),
                    next: Some("late".into()),
                    output: Value::Null,
                },
                Event::NodeEntered {
                    node: "late".into()
                },
            ]
        );
        assert_eq!(s.failed_node.as_deref(), Some("late"));
    }

    #[test]
    fn without_a_timeout_it_waits_forever() {
        let f = flow(&FLOW.replace("timeout: 300ms, ", ""));
        let mut s = started(&f, json!({}));
        let (appended, _) = run(&mut s, &f, T0);
        assert_eq!(appended.len(), 1, "{appended:?}");
        assert_eq!(decide_at(&s, &f, T0 + 86_400_000), Step::Park);
    }
}
