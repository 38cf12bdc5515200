//! Call slots, shared by `task` nodes (one slot, the node) and `parallel` nodes (one slot per
//! branch, `node/branch`): attempts, their timeouts, retries with back-off, and results.

use std::collections::HashSet;

use rand::{Rng, RngCore};
use serde_json::Value;
use tonic::Code;

use crate::event::{Event, Inflight, SlotState, TimerPurpose};
use crate::expr::InputTemplate;
use crate::failure::NodeError;
use crate::flow::Node;

use super::clock::ms;
use super::step::{CallResult, CallSpec, Cx, Delivery, Step, message_id, timer_id};

/// One call slot of a node.
pub(super) struct Slot<'a> {
    /// `node` or `node/branch`.
    pub(super) id: String,
    /// The capability it calls.
    pub(super) capability: &'a str,
    /// How its input is built; `None` sends the task input.
    pub(super) input: Option<&'a InputTemplate>,
}

/// Moves every slot of `node` one step: starts attempts (recording them first), re-sends
/// attempts in the log that are not in `running` (after a restart), fires due timeouts and
/// back-offs. Once every slot is done, `finish` gets their outcomes in slot order.
pub(super) fn decide(
    cx: &Cx<'_>,
    node: &Node,
    slots: &[Slot<'_>],
    running: &HashSet<String>,
    rng: &mut dyn RngCore,
    finish: impl FnOnce(&[Result<Value, NodeError>]) -> Vec<Event>,
) -> Step {
    let state = cx.state;
    let now = cx.now_ms;
    let mut events = Vec::new();
    let mut calls = Vec::new();
    let mut outcomes = Vec::new();
    for slot in slots {
        let s = state.slots.get(&slot.id).cloned().unwrap_or_default();
        if let Some(done) = &s.done {
            outcomes.push(done.clone());
            continue;
        }
        if let Some(inf) = &s.inflight {
            if running.contains(&slot.id) {
                continue;
            }
            let window_end = delivery_window_end(cx, inf);
            let timed_out = match (&inf.timer, inf.deadline_ms) {
                (Some(timer), Some(deadline)) => deadline <= now && state.timer_pending(timer),
                // Without a deadline, only a try that was not delivered has a window to miss.
                _ => inf.undelivered.is_some() && window_end <= now,
            };
            if timed_out {
                if let (Some(timer), Some(_)) = (&inf.timer, inf.deadline_ms) {
                    events.push(Event::TimerFired {
                        timer: timer.clone(),
                    });
                }
                if let Some(t) = &inf.redelivery_timer
                    && state.timer_pending(t)
                {
                    events.push(Event::TimerCancelled {
                        timer: t.clone(),
                        purpose: Some(TimerPurpose::Redelivery),
                    });
                }
                let error = match &inf.undelivered {
                    Some(last) => nothing_routable(inf, window_end, last),
                    None => NodeError::new(
                        Code::DeadlineExceeded,
                        "the attempt timed out (its deadline passed while the orchestrator was down)",
                    ),
                };
                events.extend(attempt_failed(
                    cx,
                    &node.id,
                    &slot.id,
                    &s,
                    inf.attempt,
                    error,
                    rng,
                ));
                continue;
            }
            // Not delivered last time: send again once the redelivery timer fired.
            if let Some(t) = &inf.redelivery_timer
                && state.timer_pending(t)
            {
                if state.timers.get(t).is_some_and(|t| t.fire_at_ms <= now) {
                    events.push(Event::TimerFired { timer: t.clone() });
                }
                continue;
            }
            calls.push(CallSpec {
                slot: slot.id.clone(),
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
        let input = match slot.input {
            None => Ok(state.input.clone()),
            Some(t) => t.render(&cx.scope()),
        };
        let input = match input {
            Ok(v) => v,
            Err(e) => {
                let code = if e.exhausted {
                    Code::ResourceExhausted
                } else {
                    Code::InvalidArgument
                };
                events.push(Event::SlotCompleted {
                    node: node.id.clone(),
                    slot: slot.id.clone(),
                    ok: false,
                    output: Value::Null,
                    error: Some(NodeError::new(code, format!("cannot build the input: {e}"))),
                });
                continue;
            }
        };
        let attempt = state.attempts_total.get(&slot.id).copied().unwrap_or(0) + 1;
        let timer = node.timeout.map(|d| {
            (
                timer_id(
                    &state.id,
                    cx.visit(),
                    "timeout",
                    &format!("{}#{attempt}", slot.id),
                ),
                now + ms(d),
            )
        });
        if let Some((tid, at)) = &timer {
            events.push(Event::TimerScheduled {
                timer: tid.clone(),
                node: node.id.clone(),
                slot: Some(slot.id.clone()),
                purpose: TimerPurpose::AttemptTimeout,
                fire_at_ms: *at,
            });
        }
        events.push(Event::AttemptStarted {
            node: node.id.clone(),
            slot: slot.id.clone(),
            attempt,
            message_id: message_id(&state.id, &slot.id, attempt),
            capability: slot.capability.to_string(),
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

/// The back-off between tries of an attempt that was not delivered: 50 ms doubling to 1 s,
/// ±20 % jitter.
const REDELIVERY: reach_rpc::backoff::Exponential = reach_rpc::backoff::Exponential {
    initial: std::time::Duration::from_millis(50),
    multiplier: 2.0,
    max: std::time::Duration::from_secs(1),
};

/// When an attempt stops waiting for a routable instance (unix ms): its deadline, else its
/// start plus the default call timeout.
fn delivery_window_end(cx: &Cx<'_>, inf: &Inflight) -> i64 {
    inf.deadline_ms
        .unwrap_or(inf.started_ms + cx.bounds.default_call_timeout_ms)
}

/// The failure of an attempt whose window passed while nothing was routable.
fn nothing_routable(inf: &Inflight, window_end: i64, last: &NodeError) -> NodeError {
    let waited =
        std::time::Duration::from_millis(u64::try_from(window_end - inf.started_ms).unwrap_or(0));
    NodeError::new(
        Code::DeadlineExceeded,
        format!(
            "nothing routable took `{}` within {} ({} tries not delivered; the last: {}: {})",
            inf.capability,
            humantime::format_duration(waited),
            inf.deferrals + 1,
            reach_rpc::errors::code_name(last.code),
            crate::expr::cut(&last.message, 300),
        ),
    )
}

/// The events of attempt `attempt` of `slot` failing with `error`: a back-off timer when the
/// node's retry policy retries it (jitter drawn from `rng`), else the slot's final failure.
fn attempt_failed(
    cx: &Cx<'_>,
    node_id: &str,
    slot: &str,
    s: &SlotState,
    attempt: u32,
    error: NodeError,
    rng: &mut dyn RngCore,
) -> Vec<Event> {
    let policy = cx
        .flow
        .node(node_id)
        .map(|n| n.retry.clone())
        .unwrap_or_default();
    if policy.retries(s.attempts, error.code) {
        let unit: f64 = rng.random::<f64>() * 2.0 - 1.0;
        let delay = policy.delay(s.attempts, unit);
        let timer = timer_id(
            &cx.state.id,
            cx.visit(),
            "backoff",
            &format!("{slot}#{attempt}"),
        );
        vec![
            Event::AttemptFailed {
                node: node_id.to_string(),
                slot: slot.to_string(),
                attempt,
                code: error.code,
                error: error.message,
                retry_timer: Some(timer.clone()),
            },
            Event::TimerScheduled {
                timer,
                node: node_id.to_string(),
                slot: Some(slot.to_string()),
                purpose: TimerPurpose::Backoff,
                fire_at_ms: cx.now_ms + ms(delay),
            },
        ]
    } else {
        vec![
            Event::AttemptFailed {
                node: node_id.to_string(),
                slot: slot.to_string(),
                attempt,
                code: error.code,
                error: error.message.clone(),
                retry_timer: None,
            },
            Event::SlotCompleted {
                node: node_id.to_string(),
                slot: slot.to_string(),
                ok: false,
                output: Value::Null,
                error: Some(error),
            },
        ]
    }
}

/// See [`super::decide::on_call_result`].
pub(super) fn on_call_result(cx: &Cx<'_>, done: CallResult, rng: &mut dyn RngCore) -> Vec<Event> {
    let state = cx.state;
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
    let mut events = Vec::new();
    match done.result {
        Ok(output) => {
            if let Some(t) = &inf.timer
                && state.timer_pending(t)
            {
                events.push(Event::TimerCancelled {
                    timer: t.clone(),
                    purpose: Some(TimerPurpose::AttemptTimeout),
                });
            }
            if !done.usage.is_zero() {
                events.push(Event::ModelUsage {
                    node: node.clone(),
                    slot: done.slot.clone(),
                    attempt: done.attempt,
                    input_tokens: done.usage.input_tokens,
                    output_tokens: done.usage.output_tokens,
                    model_calls: done.usage.model_calls,
                });
            }
            events.push(Event::SlotCompleted {
                node,
                slot: done.slot,
                ok: true,
                output,
                error: None,
            });
        }
        Err(error) if done.delivery == Delivery::NotDelivered => {
            let window_end = delivery_window_end(cx, inf);
            if cx.now_ms < window_end {
                let unit: f64 = rng.random::<f64>() * 2.0 - 1.0;
                let delay = REDELIVERY.delay_with_jitter(inf.deferrals + 1, 0.2, unit);
                let timer = timer_id(
                    &state.id,
                    cx.visit(),
                    "redeliver",
                    &format!("{}#{}.{}", done.slot, inf.attempt, inf.deferrals + 1),
                );
                events.push(Event::TimerScheduled {
                    timer: timer.clone(),
                    node: node.clone(),
                    slot: Some(done.slot.clone()),
                    purpose: TimerPurpose::Redelivery,
                    fire_at_ms: (cx.now_ms + ms(delay)).min(window_end),
                });
                events.push(Event::AttemptDeferred {
                    node,
                    slot: done.slot,
                    attempt: inf.attempt,
                    code: error.code,
                    error: crate::expr::cut(&error.message, 500),
                    timer,
                });
                return events;
            }
            if let Some(t) = &inf.timer
                && state.timer_pending(t)
            {
                events.push(Event::TimerFired { timer: t.clone() });
            }
            let error = nothing_routable(inf, window_end, &error);
            events.extend(attempt_failed(
                cx,
                &node,
                &done.slot,
                s,
                inf.attempt,
                error,
                rng,
            ));
        }
        Err(error) => {
            if let Some(t) = &inf.timer
                && state.timer_pending(t)
            {
                let due = inf.deadline_ms.is_some_and(|d| d <= cx.now_ms);
                events.push(if error.code == Code::DeadlineExceeded && due {
                    Event::TimerFired { timer: t.clone() }
                } else {
                    Event::TimerCancelled {
                        timer: t.clone(),
                        purpose: Some(TimerPurpose::AttemptTimeout),
                    }
                });
            }
            events.extend(attempt_failed(
                cx,
                &node,
                &done.slot,
                s,
                inf.attempt,
                error,
                rng,
            ));
        }
    }
    events
}
