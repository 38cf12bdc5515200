//! `wait` nodes: a durable timer, then `next`.

use std::time::Duration;

use crate::event::{Event, NodeOutcome, TimerPurpose};

use super::clock::ms;
use super::step::{Cx, Step, complete, timer_id};

/// Schedules the node's timer on entry, fires it once due, then completes with the last
/// completed node's output (a wait passes its input through).
pub(super) fn decide(cx: &Cx<'_>, node: &str, duration: Duration, next: &str) -> Step {
    let state = cx.state;
    let timer = timer_id(&state.id, cx.visit(), "wait", node);
    match state.timers.get(&timer) {
        None => Step::Events(vec![Event::TimerScheduled {
            timer,
            node: node.to_string(),
            slot: None,
            purpose: TimerPurpose::Wait,
            fire_at_ms: cx.now_ms + ms(duration),
        }]),
        Some(t) if t.fired => Step::Events(complete(
            node,
            NodeOutcome::Succeeded,
            state.output.clone(),
            next,
        )),
        Some(t) if !t.cancelled && t.fire_at_ms <= cx.now_ms => {
            Step::Events(vec![Event::TimerFired { timer }])
        }
        Some(_) => Step::Park,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::engine::testing::*;
    use crate::event::TaskStatus;

    const FLOW: &str = "id: f\nversion: 1\ninitial: pause\nstates:\n  pause: {type: wait, duration: 4s, next: done}\n  done: {type: succeed}\n";

    #[test]
    fn waits_for_its_timer_exactly() {
        let f = flow(FLOW);
        let mut s = started(&f, json!({}));
        s.output = json!({"carried": true});
        let (appended, step) = run(&mut s, &f, T0);
        assert_eq!(
            appended,
            [Event::TimerScheduled {
                timer: "t1:1:wait:pause".into(),
                node: "pause".into(),
                slot: None,
                purpose: TimerPurpose::Wait,
                fire_at_ms: T0 + 4000,
            }]
        );
        assert_eq!(step, Step::Park);
        // One millisecond early: still parked.
        assert_eq!(decide_at(&s, &f, T0 + 3999), Step::Park);
        // Due: the timer fires, then the node completes and passes its input on.
        let (appended, _) = run(&mut s, &f, T0 + 4000);
        assert_eq!(
            appended[0],
            Event::TimerFired {
                timer: "t1:1:wait:pause".into()
            }
        );
        assert_eq!(
            appended[1..3],
            complete(
                "pause",
                NodeOutcome::Succeeded,
                json!({"carried": true}),
                "done"
            )
        );
        assert_eq!(s.status, TaskStatus::Succeeded);
    }

    #[test]
    fn a_cancelled_timer_never_fires() {
        let f = flow(FLOW);
        let mut s = started(&f, json!({}));
        run(&mut s, &f, T0);
        apply(
            &mut s,
            &[Event::TimerCancelled {
                timer: "t1:1:wait:pause".into(),
                purpose: Some(TimerPurpose::Wait),
            }],
            T0,
        );
        assert_eq!(decide_at(&s, &f, T0 + 10_000), Step::Park);
    }
}
