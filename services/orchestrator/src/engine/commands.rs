//! The commands of the API: start a task, resume it, cancel it, retry it.
//!
//! Each command decides its events from the task's state and flow alone (the `*_events`
//! functions, tested without I/O), appends them guarded by sequence number (retrying on a
//! race with the task's driver) and hands the new state to the driver.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::error::Error;
use crate::event::{Event, NodeOutcome, TaskState, TaskStatus};
use crate::flow::{Flow, NodeKind};
use crate::store::Guard;

use super::Engine;
use super::clock::ms;
use super::step::complete;

/// How often a command re-reads the task and tries again when the driver appended first.
const COMMAND_TRIES: usize = 20;

/// How [`Engine::start_task_with`] starts a task, besides its flow and input.
#[derive(Debug, Clone, Default)]
pub struct StartOptions {
    /// A client-chosen task id; `None` assigns a UUIDv7.
    pub task_id: Option<String>,
    /// Who starts it (the caller's identity), when trust is on.
    pub started_by: Option<String>,
    /// The W3C trace id (32 lowercase hex digits) to continue; `None` starts a new trace.
    pub trace_id: Option<String>,
    /// The labels the task keeps (validated by the caller).
    pub labels: BTreeMap<String, String>,
}

impl Engine {
    /// Starts a task of `flow_id` (`version` 0 = latest) with `input`. With a `task_id` that
    /// exists already, returns that task.
    ///
    /// # Errors
    /// [`Error::FlowNotFound`] for an unknown flow; [`Error::InvalidTaskId`] for a bad task
    /// id; [`Error::TaskIdInUse`] when the id belongs to a task of another flow;
    /// [`Error::Store`].
    pub async fn start_task(
        &self,
        flow_id: &str,
        version: u32,
        input: Value,
        task_id: Option<String>,
    ) -> Result<TaskState, Error> {
        self.start_task_with(
            flow_id,
            version,
            input,
            StartOptions {
                task_id,
                ..StartOptions::default()
            },
        )
        .await
    }

    /// [`Engine::start_task`] with `options`: the caller's identity as the task's starter
    /// (the identity that may resume and cancel it besides operators), the trace to continue
    /// and the task's labels.
    ///
    /// # Errors
    /// As [`Engine::start_task`].
    pub async fn start_task_with(
        &self,
        flow_id: &str,
        version: u32,
        input: Value,
        options: StartOptions,
    ) -> Result<TaskState, Error> {
        let StartOptions {
            task_id,
            started_by,
            trace_id,
            labels,
        } = options;
        let flow = if version == 0 {
            self.inner.flows.latest(flow_id)
        } else {
            self.inner.flows.get(flow_id, version)
        };
        let Some(flow) = flow else {
            return Err(Error::FlowNotFound {
                flow_id: flow_id.to_string(),
                version,
                known: self.inner.flows.ids(),
            });
        };
        let id = match task_id.filter(|t| !t.is_empty()) {
            Some(id) => {
                if !valid_task_id(&id) {
                    return Err(Error::InvalidTaskId { task_id: id });
                }
                id
            }
            None => reach_rpc::trace::new_message_id(),
        };
        let mut state = TaskState::new(&id);
        let events = vec![
            Event::TaskCreated {
                flow_id: flow.id.clone(),
                flow_version: flow.version,
                input,
                trace_id: trace_id
                    .unwrap_or_else(|| reach_rpc::trace::TraceId::random().to_string()),
                started_by,
                labels,
            },
            Event::NodeEntered {
                node: flow.initial.clone(),
            },
        ];
        let now = self.inner.clock.now_ms();
        let guard = Guard::Create {
            owner: self.inner.settings.node_id.clone(),
            lease_until_ms: now + ms(self.inner.settings.lease),
        };
        if !self.append(&mut state, events, guard).await? {
            let existing = self.load(&id).await?;
            if existing.flow_id != flow.id {
                return Err(Error::TaskIdInUse {
                    task_id: id,
                    flow_id: existing.flow_id,
                });
            }
            return Ok(existing);
        }
        tracing::info!(task_id = %id, flow_id = %flow.id, flow_version = flow.version, "task started");
        self.poke_with(&id, Some(state.clone()));
        Ok(state)
    }

    /// Holds the task's driver in this process between steps until the returned gate is
    /// dropped (the driver then reads the log again): a task that moves on without pause —
    /// a loop of condition nodes — cannot keep a command out.
    pub(super) fn hold(&self, task_id: &str) -> HoldGate {
        *self
            .inner
            .held
            .lock()
            .expect("held map lock")
            .entry(task_id.to_string())
            .or_insert(0) += 1;
        HoldGate {
            engine: self.clone(),
            task_id: task_id.to_string(),
        }
    }

    /// Whether a command holds the task's driver.
    pub(super) fn held(&self, task_id: &str) -> bool {
        self.inner
            .held
            .lock()
            .expect("held map lock")
            .contains_key(task_id)
    }

    /// Appends the events `build` decides from the task's state and flow (`None` when its
    /// version is not loaded), retrying when the driver appended first; then pokes the driver.
    /// The driver in this process is held meanwhile ([`Engine::hold`]); a driver in another
    /// replica is waited out with a short back-off between tries.
    async fn command(
        &self,
        task_id: &str,
        build: impl Fn(&TaskState, Option<&Flow>) -> Result<Vec<Event>, Error>,
    ) -> Result<TaskState, Error> {
        let _gate = self.hold(task_id);
        let backoff = reach_rpc::backoff::Exponential::doubling(
            std::time::Duration::from_millis(5),
            std::time::Duration::from_millis(200),
        );
        for tried in 0..COMMAND_TRIES {
            if tried > 0 {
                tokio::time::sleep(backoff.delay(u32::try_from(tried).unwrap_or(u32::MAX))).await;
            }
            let mut state = self.load(task_id).await?;
            let flow = self.inner.flows.get(&state.flow_id, state.flow_version);
            let events = build(&state, flow.as_deref())?;
            let guard = if self.inner.exclusive {
                Guard::Seq
            } else {
                Guard::Command
            };
            if self.append(&mut state, events, guard).await? {
                self.poke_with(task_id, Some(state.clone()));
                return Ok(state);
            }
        }
        Err(Error::TaskContended {
            task_id: task_id.to_string(),
        })
    }

    /// Gives a person's input to a task waiting in a human node.
    ///
    /// # Errors
    /// [`Error::TaskNotWaiting`] when the task does not wait in a human node;
    /// [`Error::NodeNotWaiting`] when it waits in another node than `node_id`;
    /// [`Error::InvalidInput`] with the field paths when the input fails the node's schema;
    /// [`Error::FlowNotLoaded`]; [`Error::TaskNotFound`]; [`Error::TaskContended`];
    /// [`Error::Store`].
    pub async fn resume(
        &self,
        task_id: &str,
        node_id: Option<&str>,
        input: Value,
    ) -> Result<TaskState, Error> {
        self.resume_by(task_id, node_id, input, None).await
    }

    /// [`Engine::resume`], recording `by` (who resumed: an identity or a reviewer's name) in
    /// the `human_resumed` event, so a second reviewer can be told who was first.
    ///
    /// # Errors
    /// As [`Engine::resume`].
    pub async fn resume_by(
        &self,
        task_id: &str,
        node_id: Option<&str>,
        input: Value,
        by: Option<String>,
    ) -> Result<TaskState, Error> {
        self.command(task_id, |state, flow| {
            let mut events = resume_events(state, flow, node_id, &input)?;
            if let Some(Event::HumanResumed { by: slot, .. }) = events.first_mut() {
                slot.clone_from(&by);
            }
            Ok(events)
        })
        .await
    }

    /// Cancels a task; a task waiting in a human node with `on_cancel` continues there.
    ///
    /// # Errors
    /// [`Error::TaskEnded`] when the task already ended; [`Error::TaskNotFound`];
    /// [`Error::TaskContended`]; [`Error::Store`].
    pub async fn cancel(&self, task_id: &str, reason: &str) -> Result<TaskState, Error> {
        self.command(task_id, |state, flow| cancel_events(state, flow, reason))
            .await
    }

    /// Restarts a FAILED task at its failed node (a PARTIAL one at its partial parallel
    /// node), with fresh attempts.
    ///
    /// # Errors
    /// [`Error::TaskNotRetryable`] for tasks in other states; [`Error::NoNodeToRetry`];
    /// [`Error::TaskNotFound`]; [`Error::TaskContended`]; [`Error::Store`].
    pub async fn retry(&self, task_id: &str) -> Result<TaskState, Error> {
        let state = self
            .command(task_id, |state, _| retry_events(state))
            .await?;
        // The task runs again: its webhooks, parked once it ended and they had everything,
        // are polled again (after the retry's events are stored, so none parks again).
        if let Err(e) = self.inner.store.unpark_webhooks(Some(task_id)).await {
            tracing::warn!(task_id, error = %e, "cannot resume the webhooks of a retried task");
        }
        Ok(state)
    }
}

/// Holds a task's driver while a command appends ([`Engine::hold`]); dropping it lets the
/// driver go on from the log.
pub(super) struct HoldGate {
    engine: Engine,
    task_id: String,
}

impl Drop for HoldGate {
    fn drop(&mut self) {
        {
            let mut held = self.engine.inner.held.lock().expect("held map lock");
            if let Some(n) = held.get_mut(&self.task_id) {
                *n -= 1;
                if *n == 0 {
                    held.remove(&self.task_id);
                }
            }
        }
        // Wake the held driver (a command that appended has poked it already).
        let active = self.engine.inner.active.lock().expect("active map lock");
        if let Some(a) = active.get(&self.task_id) {
            a.notify.notify_one();
        }
    }
}

/// Whether `id` is 1 to 128 characters of `A-Z a-z 0-9 . _ : -`.
/// Whether `id` can name a task: 1 to 128 of `A-Z a-z 0-9 . _ : -`, not dots alone (`.`
/// and `..` are path segments a URL resolves away: the console's and the admin port's task
/// pages could not be reached).
fn valid_task_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "._:-".contains(c))
        && !id.chars().all(|c| c == '.')
}

/// The events of resuming `state` at `node_id` (empty or `None`: wherever it waits) with
/// `input`, checked against the human node's schema.
fn resume_events(
    state: &TaskState,
    flow: Option<&Flow>,
    node_id: Option<&str>,
    input: &Value,
) -> Result<Vec<Event>, Error> {
    let current = state.current.clone().unwrap_or_default();
    if state.status != TaskStatus::WaitingHuman || !state.human_waiting {
        return Err(Error::TaskNotWaiting {
            task_id: state.id.clone(),
            status: state.status,
            node: current,
        });
    }
    if let Some(n) = node_id.filter(|n| !n.is_empty())
        && n != current
    {
        return Err(Error::NodeNotWaiting {
            task_id: state.id.clone(),
            waiting: current,
            requested: n.to_string(),
        });
    }
    let flow = flow.ok_or_else(|| Error::FlowNotLoaded {
        flow_id: state.flow_id.clone(),
        version: state.flow_version,
    })?;
    if let Some(NodeKind::Human {
        schema: Some(schema),
        ..
    }) = flow.node(&current).map(|n| &n.kind)
    {
        let violations: Vec<(String, String)> = schema
            .iter_errors(input)
            .map(|e| {
                let path = e.instance_path().to_string();
                (
                    if path.is_empty() {
                        "/".to_string()
                    } else {
                        path
                    },
                    e.to_string(),
                )
            })
            .collect();
        if !violations.is_empty() {
            return Err(Error::InvalidInput {
                task_id: state.id.clone(),
                node: current,
                violations,
            });
        }
    }
    Ok(vec![Event::HumanResumed {
        node: current,
        input: input.clone(),
        by: None,
    }])
}

/// The events of cancelling `state` for `reason` (empty: "cancelled by request"): on to the
/// human node's `on_cancel` when it waits in one that has it, else the task ends CANCELLED.
fn cancel_events(
    state: &TaskState,
    flow: Option<&Flow>,
    reason: &str,
) -> Result<Vec<Event>, Error> {
    let reason = if reason.is_empty() {
        "cancelled by request"
    } else {
        reason
    };
    if state.status.is_terminal() {
        return Err(Error::TaskEnded {
            task_id: state.id.clone(),
            status: state.status,
        });
    }
    let current = state.current.clone().unwrap_or_default();
    // Every timer the task still has is cancelled, in the log, with its purpose: a cancelled
    // wait, human timeout or retry back-off shows in the task's history.
    let mut events: Vec<Event> = state
        .timers
        .iter()
        .filter(|(_, t)| !t.fired && !t.cancelled)
        .map(|(id, t)| Event::TimerCancelled {
            timer: id.clone(),
            purpose: Some(t.purpose),
        })
        .collect();
    let on_cancel = flow.and_then(|f| match f.node(&current).map(|n| &n.kind) {
        Some(NodeKind::Human {
            on_cancel: Some(n), ..
        }) if state.human_waiting => Some(n.clone()),
        _ => None,
    });
    events.extend(match on_cancel {
        Some(next) => complete(
            &current,
            NodeOutcome::Cancelled,
            json!({"cancelled": reason}),
            &next,
        ),
        None => vec![Event::TaskEnded {
            status: TaskStatus::Cancelled,
            output: state.output.clone(),
            error: Some(reason.to_string()),
            failed_node: None,
        }],
    });
    Ok(events)
}

/// The events of retrying `state` from its failed (or partial) node.
fn retry_events(state: &TaskState) -> Result<Vec<Event>, Error> {
    let node = match state.status {
        TaskStatus::Failed => state.failed_node.clone(),
        TaskStatus::Partial => state
            .visits
            .iter()
            .rev()
            .find(|v| v.outcome == Some(NodeOutcome::Partial))
            .map(|v| v.node.clone()),
        status => {
            return Err(Error::TaskNotRetryable {
                task_id: state.id.clone(),
                status,
            });
        }
    };
    let Some(node) = node else {
        return Err(Error::NoNodeToRetry {
            task_id: state.id.clone(),
        });
    };
    Ok(vec![
        Event::TaskRetried { node: node.clone() },
        Event::NodeEntered { node },
    ])
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn task_ids_are_url_safe_names() {
        for ok in ["t1", "complaint-42", "a.b:c_d", "..x", "x.."] {
            assert!(valid_task_id(ok), "{ok}");
        }
        let long = "x".repeat(129);
        for bad in ["", ".", "..", "...", "a/b", "a b", "é", long.as_str()] {
            assert!(!valid_task_id(bad), "{bad}");
        }
    }
    use crate::engine::testing::*;

    const FLOW: &str = "id: f\nversion: 1\ninitial: ask\nstates:\n  ask:\n    type: human\n    schema: {type: object, required: [approved], properties: {approved: {type: boolean}}}\n    on_cancel: withdrawn\n    next: done\n  withdrawn: {type: fail, error: withdrawn}\n  done: {type: succeed}\n";

    fn waiting(f: &Flow) -> TaskState {
        let mut s = started(f, json!({}));
        run(&mut s, f, T0);
        assert_eq!(s.status, TaskStatus::WaitingHuman);
        s
    }

    #[test]
    fn task_ids_are_checked() {
        assert!(valid_task_id("order-42:v1.a_b"));
        assert!(!valid_task_id(""));
        assert!(!valid_task_id("no spaces"));
        assert!(!valid_task_id(&"x".repeat(129)));
    }

    #[test]
    fn resume_checks_state_node_and_schema() {
        let f = flow(FLOW);
        let s = waiting(&f);
        let ok = json!({"approved": true});
        assert_eq!(
            resume_events(&s, Some(&f), Some(""), &ok).unwrap(),
            [Event::HumanResumed {
                node: "ask".into(),
                input: ok.clone(),
                by: None,
            }]
        );
        assert!(matches!(
            resume_events(&s, Some(&f), Some("other"), &ok),
            Err(Error::NodeNotWaiting { waiting, requested, .. }) if waiting == "ask" && requested == "other"
        ));
        match resume_events(&s, Some(&f), None, &json!({"approved": "yes"})) {
            Err(Error::InvalidInput {
                node, violations, ..
            }) => {
                assert_eq!(node, "ask");
                assert_eq!(violations[0].0, "/approved");
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            resume_events(&s, None, None, &ok),
            Err(Error::FlowNotLoaded { version: 1, .. })
        ));
        let running = started(&f, json!({}));
        assert!(matches!(
            resume_events(&running, Some(&f), None, &ok),
            Err(Error::TaskNotWaiting {
                status: TaskStatus::Processing,
                ..
            })
        ));
    }

    #[test]
    fn cancel_goes_to_on_cancel_or_ends_the_task() {
        let f = flow(FLOW);
        let s = waiting(&f);
        assert_eq!(
            cancel_events(&s, Some(&f), "").unwrap(),
            complete(
                "ask",
                NodeOutcome::Cancelled,
                json!({"cancelled": "cancelled by request"}),
                "withdrawn"
            )
        );
        let entering = started(&f, json!({}));
        assert_eq!(
            cancel_events(&entering, Some(&f), "customer withdrew").unwrap(),
            [Event::TaskEnded {
                status: TaskStatus::Cancelled,
                output: Value::Null,
                error: Some("customer withdrew".into()),
                failed_node: None,
            }]
        );
        let mut ended = s.clone();
        apply(
            &mut ended,
            &cancel_events(&entering, Some(&f), "x").unwrap(),
            T0,
        );
        assert!(matches!(
            cancel_events(&ended, Some(&f), ""),
            Err(Error::TaskEnded {
                status: TaskStatus::Cancelled,
                ..
            })
        ));
    }

    #[test]
    fn retry_restarts_failed_tasks_at_the_failed_node() {
        let f = flow(FLOW);
        let mut s = waiting(&f);
        assert!(matches!(
            retry_events(&s),
            Err(Error::TaskNotRetryable {
                status: TaskStatus::WaitingHuman,
                ..
            })
        ));
        let cancel = cancel_events(&s, Some(&f), "").unwrap();
        apply(&mut s, &cancel, T0);
        run(&mut s, &f, T0);
        assert_eq!(s.status, TaskStatus::Failed);
        assert_eq!(
            retry_events(&s).unwrap(),
            [
                Event::TaskRetried {
                    node: "withdrawn".into()
                },
                Event::NodeEntered {
                    node: "withdrawn".into()
                },
            ]
        );
    }
}
