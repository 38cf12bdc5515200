//! `task` nodes: one call slot (the node itself) calling a capability through the router.

use std::collections::HashSet;

use rand::RngCore;

use crate::event::NodeOutcome;
use crate::expr::InputTemplate;
use crate::failure::FailureCode;
use crate::flow::Node;

use super::slots::{self, Slot};
use super::step::{Cx, Step, complete};

/// Runs the node's slot; completes with the reply's output, or fails the node with the last
/// attempt's code and message once its retries are spent.
pub(super) fn decide(
    cx: &Cx<'_>,
    node: &Node,
    capability: &str,
    input: Option<&InputTemplate>,
    next: &str,
    running: &HashSet<String>,
    rng: &mut dyn RngCore,
) -> Step {
    let id = node.id.as_str();
    let slot = Slot {
        id: id.to_string(),
        capability,
        input,
    };
    slots::decide(
        cx,
        node,
        &[slot],
        running,
        rng,
        |outcomes| match &outcomes[0] {
            Ok(output) => complete(id, NodeOutcome::Succeeded, output.clone(), next),
            Err(e) => cx.fail_node(id, FailureCode::Grpc(e.code), e.message.clone(), None),
        },
    )
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use serde_json::{Value, json};
    use tonic::Code;

    use super::*;
    use crate::engine::decide::{
        Bounds, CallResult, CallSpec, Delivery, message_id, on_call_result,
    };
    use crate::engine::testing::*;
    use crate::event::{Event, TaskStatus, TimerPurpose};
    use crate::failure::NodeError;
    use reach_rpc::usage::TokenUsage;

    const FLOW: &str = "id: f\nversion: 1\ninitial: act\nstates:\n  act:\n    type: task\n    capability: test.act\n    input: {n: \"input.n\", via: \"'orchestrator'\"}\n    timeout: 10s\n    retry: {max_attempts: 3, initial_interval: 1s, multiplier: 2, jitter: 0.5, retry_on: [UNAVAILABLE]}\n    catch: recover\n    next: done\n  recover: {type: succeed}\n  done: {type: succeed}\n";

    fn result(attempt: u32, result: Result<Value, NodeError>) -> CallResult {
        CallResult {
            slot: "act".into(),
            attempt,
            result,
            delivery: Delivery::Maybe,
            usage: TokenUsage::default(),
        }
    }

    /// The attempt is recorded (with its timeout timer) before the call is made, and the
    /// call carries the recorded message id, input and deadline.
    #[test]
    fn records_the_attempt_then_calls() {
        let f = flow(FLOW);
        let mut s = started(&f, json!({"n": 1}));
        let (appended, step) = run(&mut s, &f, T0);
        let id = message_id("t1", "act", 1);
        assert_eq!(
            appended,
            [
                Event::TimerScheduled {
                    timer: "t1:1:timeout:act#1".into(),
                    node: "act".into(),
                    slot: Some("act".into()),
                    purpose: TimerPurpose::AttemptTimeout,
                    fire_at_ms: T0 + 10_000,
                },
                Event::AttemptStarted {
                    node: "act".into(),
                    slot: "act".into(),
                    attempt: 1,
                    message_id: id.clone(),
                    capability: "test.act".into(),
                    input: json!({"n": 1, "via": "orchestrator"}),
                    timer: Some("t1:1:timeout:act#1".into()),
                    deadline_ms: Some(T0 + 10_000),
                },
            ]
        );
        let call = CallSpec {
            slot: "act".into(),
            attempt: 1,
            message_id: id,
            capability: "test.act".into(),
            input: json!({"n": 1, "via": "orchestrator"}),
            deadline_ms: Some(T0 + 10_000),
        };
        assert_eq!(step, Step::Calls(vec![call]));
        // A call this driver has in flight is not sent twice.
        let running = HashSet::from(["act".to_string()]);
        assert_eq!(
            crate::engine::decide::decide(&s, &f, T0, &running, &Bounds::default(), &mut rng()),
            Step::Park
        );
    }

    /// What a reply reports its model calls cost is recorded before the slot completes,
    /// and summed into the node visit and the task; a reply that reports none adds no event.
    #[test]
    fn a_replys_token_usage_is_recorded_and_summed() {
        let f = flow(FLOW);
        let mut s = started(&f, json!({"n": 1}));
        run(&mut s, &f, T0);
        let usage = TokenUsage {
            input_tokens: 1200,
            output_tokens: 300,
            model_calls: 2,
        };
        let events = on_call_result(
            &s,
            &f,
            T0 + 5,
            CallResult {
                usage,
                ..result(1, Ok(json!({"ok": 1})))
            },
            &Bounds::default(),
            &mut rng(),
        );
        assert_eq!(
            events[1],
            Event::ModelUsage {
                node: "act".into(),
                slot: "act".into(),
                attempt: 1,
                input_tokens: 1200,
                output_tokens: 300,
                model_calls: 2,
            }
        );
        assert!(matches!(events[2], Event::SlotCompleted { ok: true, .. }));
        apply(&mut s, &events, T0 + 5);
        assert_eq!(s.usage, usage);
        assert_eq!(s.visits[0].usage, usage);
        // The stored form round-trips, so a restarted orchestrator folds the same sum.
        let stored = serde_json::to_string(&events[1]).unwrap();
        assert_eq!(serde_json::from_str::<Event>(&stored).unwrap(), events[1]);

        let mut plain = started(&f, json!({"n": 1}));
        run(&mut plain, &f, T0);
        let events = on_call_result(
            &plain,
            &f,
            T0 + 5,
            result(1, Ok(json!({"ok": 1}))),
            &Bounds::default(),
            &mut rng(),
        );
        assert!(
            !events
                .iter()
                .any(|e| matches!(e, Event::ModelUsage { .. }))
        );
    }

    #[test]
    fn a_reply_completes_the_node() {
        let f = flow(FLOW);
        let mut s = started(&f, json!({"n": 1}));
        run(&mut s, &f, T0);
        let events = on_call_result(
            &s,
            &f,
            T0 + 5,
            result(1, Ok(json!({"ok": 1}))),
            &Bounds::default(),
            &mut rng(),
        );
        assert_eq!(
            events,
            [
                Event::TimerCancelled {
                    timer: "t1:1:timeout:act#1".into(),
                    purpose: Some(TimerPurpose::AttemptTimeout),
                },
                Event::SlotCompleted {
                    node: "act".into(),
                    slot: "act".into(),
                    ok: true,
                    output: json!({"ok": 1}),
                    error: None,
                },
            ]
        );
        apply(&mut s, &events, T0 + 5);
        run(&mut s, &f, T0 + 5);
        assert_eq!(s.status, TaskStatus::Succeeded);
        assert_eq!(s.output, json!({"ok": 1}));
        // A stale result (an attempt that is no longer in flight) adds nothing.
        assert_eq!(
            on_call_result(
                &s,
                &f,
                T0 + 6,
                result(1, Ok(json!(1))),
                &Bounds::default(),
                &mut rng()
            ),
            []
        );
    }

    /// A retried code schedules the back-off the policy gives for the seeded jitter, and the
    /// next attempt starts only when its timer fired.
    #[test]
    fn a_retried_code_backs_off_then_tries_again() {
        let f = flow(FLOW);
        let mut s = started(&f, json!({"n": 1}));
        run(&mut s, &f, T0);
        let failed = NodeError::new(Code::Unavailable, "down");
        let events = on_call_result(
            &s,
            &f,
            T0 + 5,
            result(1, Err(failed)),
            &Bounds::default(),
            &mut rng(),
        );
        // The same draw the decider makes: first delay 1s with jitter 0.5.
        let mut r = rng();
        let unit: f64 = rand::Rng::random::<f64>(&mut r) * 2.0 - 1.0;
        let delay = f.nodes["act"].retry.delay(1, unit);
        let fire_at = T0 + 5 + i64::try_from(delay.as_millis()).unwrap();
        assert!((T0 + 505..=T0 + 1505).contains(&fire_at), "{fire_at}");
        assert_eq!(
            events,
            [
                Event::TimerCancelled {
                    timer: "t1:1:timeout:act#1".into(),
                    purpose: Some(TimerPurpose::AttemptTimeout),
                },
                Event::AttemptFailed {
                    node: "act".into(),
                    slot: "act".into(),
                    attempt: 1,
                    code: Code::Unavailable,
                    error: "down".into(),
                    retry_timer: Some("t1:1:backoff:act#1".into()),
                },
                Event::TimerScheduled {
                    timer: "t1:1:backoff:act#1".into(),
                    node: "act".into(),
                    slot: Some("act".into()),
                    purpose: TimerPurpose::Backoff,
                    fire_at_ms: fire_at,
                },
            ]
        );
        // Deterministic: the same seed gives the same events.
        assert_eq!(
            on_call_result(
                &s,
                &f,
                T0 + 5,
                result(1, Err(NodeError::new(Code::Unavailable, "down"))),
                &Bounds::default(),
                &mut rng()
            ),
            events
        );
        apply(&mut s, &events, T0 + 5);
        assert_eq!(decide_at(&s, &f, fire_at - 1), Step::Park);
        let (appended, step) = run(&mut s, &f, fire_at);
        assert_eq!(
            appended[0],
            Event::TimerFired {
                timer: "t1:1:backoff:act#1".into()
            }
        );
        assert!(
            matches!(&appended[2], Event::AttemptStarted { attempt: 2, .. }),
            "{appended:#?}"
        );
        assert!(matches!(step, Step::Calls(c) if c[0].attempt == 2));
    }

    /// A code the policy does not retry fails the node at once, into its `catch`.
    #[test]
    fn a_code_not_retried_fails_the_node_into_its_catch() {
        let f = flow(FLOW);
        let mut s = started(&f, json!({"n": 1}));
        run(&mut s, &f, T0);
        let refused = NodeError::new(Code::InvalidArgument, "refused");
        let events = on_call_result(
            &s,
            &f,
            T0 + 5,
            result(1, Err(refused.clone())),
            &Bounds::default(),
            &mut rng(),
        );
        assert_eq!(
            events[2],
            Event::SlotCompleted {
                node: "act".into(),
                slot: "act".into(),
                ok: false,
                output: Value::Null,
                error: Some(refused),
            }
        );
        apply(&mut s, &events, T0 + 5);
        let (appended, _) = run(&mut s, &f, T0 + 5);
        assert_eq!(
            appended[0],
            Event::NodeFailed {
                node: "act".into(),
                code: FailureCode::Grpc(Code::InvalidArgument),
                error: "refused".into(),
                next: Some("recover".into()),
                output: Value::Null,
            }
        );
        assert_eq!(s.status, TaskStatus::Succeeded);
        assert_eq!(s.visits.len(), 2);
    }

    /// After a restart past an attempt's deadline, the attempt counts as timed out instead
    /// of being sent again.
    #[test]
    fn an_attempt_past_its_deadline_times_out_on_restart() {
        let f = flow(FLOW);
        let mut s = started(&f, json!({"n": 1}));
        run(&mut s, &f, T0);
        // Before the deadline, a new driver re-sends the recorded attempt.
        assert!(matches!(decide_at(&s, &f, T0 + 9_999), Step::Calls(_)));
        let events = events(decide_at(&s, &f, T0 + 10_000));
        assert_eq!(
            events[..2],
            [
                Event::TimerFired {
                    timer: "t1:1:timeout:act#1".into()
                },
                Event::AttemptFailed {
                    node: "act".into(),
                    slot: "act".into(),
                    attempt: 1,
                    code: Code::DeadlineExceeded,
                    error: "the attempt timed out (its deadline passed while the orchestrator was down)".into(),
                    retry_timer: None,
                },
            ]
        );
    }

    #[test]
    fn an_input_that_cannot_be_built_fails_with_invalid_argument() {
        let f = flow(FLOW);
        let mut s = started(&f, json!({}));
        let (appended, _) = run(&mut s, &f, T0);
        match &appended[0] {
            Event::SlotCompleted {
                ok: false,
                error: Some(e),
                ..
            } => {
                assert_eq!(e.code, Code::InvalidArgument);
                assert!(e.message.starts_with("cannot build the input: "), "{e}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(s.failed_node, None, "caught by recover");
        assert_eq!(s.status, TaskStatus::Succeeded);
    }

    /// A try that provably reached no agent waits for its redelivery timer and is sent again
    /// as the same attempt (same message id), not counted; once the attempt's deadline
    /// passes with nothing routable, it fails with DEADLINE_EXCEEDED saying so.
    #[test]
    fn an_undelivered_try_is_sent_again_without_counting() {
        let f = flow(FLOW);
        let mut s = started(&f, json!({"n": 1}));
        run(&mut s, &f, T0);
        let undelivered = |at: u32| CallResult {
            slot: "act".into(),
            attempt: at,
            result: Err(NodeError::new(Code::NotFound, "no routable instance")),
            delivery: Delivery::NotDelivered,
            usage: TokenUsage::default(),
        };
        let events = on_call_result(
            &s,
            &f,
            T0 + 5,
            undelivered(1),
            &Bounds::default(),
            &mut rng(),
        );
        let fire_at = match &events[..] {
            [
                Event::TimerScheduled {
                    purpose: TimerPurpose::Redelivery,
                    fire_at_ms,
                    ..
                },
                Event::AttemptDeferred { attempt: 1, .. },
            ] => *fire_at_ms,
            other => panic!("{other:#?}"),
        };
        assert!((T0 + 45..=T0 + 65).contains(&fire_at), "{fire_at}");
        apply(&mut s, &events, T0 + 5);
        assert_eq!(decide_at(&s, &f, fire_at - 1), Step::Park);
        let (appended, step) = run(&mut s, &f, fire_at);
        assert!(
            matches!(appended[..], [Event::TimerFired { .. }]),
            "{appended:#?}"
        );
        match step {
            Step::Calls(calls) => {
                assert_eq!(calls[0].attempt, 1);
                assert_eq!(calls[0].message_id, message_id("t1", "act", 1));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(s.slots["act"].attempts, 1);
        assert_eq!(s.visits[0].attempts, 1);
        // The attempt's deadline passes with nothing routable: DEADLINE_EXCEEDED, said so.
        let events = on_call_result(
            &s,
            &f,
            T0 + 10_000,
            undelivered(1),
            &Bounds::default(),
            &mut rng(),
        );
        match &events[..] {
            [
                Event::TimerFired { .. },
                Event::AttemptFailed {
                    code: Code::DeadlineExceeded,
                    error,
                    ..
                },
                ..,
            ] => assert!(
                error.starts_with("nothing routable took `test.act` within 10s (2 tries not delivered; the last: NOT_FOUND: no routable instance)"),
                "{error}"
            ),
            other => panic!("{other:#?}"),
        }
    }
}
