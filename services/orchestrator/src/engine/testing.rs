//! Test support for the decider's tests: flows, folded states and a seeded RNG, no I/O.

use std::collections::HashSet;

use rand::SeedableRng;
use rand::rngs::SmallRng;
use serde_json::Value;

use super::step::Step;
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
            started_by: None,
            labels: Default::default(),
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
    super::decide::decide(
        state,
        flow,
        now,
        &HashSet::new(),
        &super::step::Bounds::default(),
        &mut rng(),
    )
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
