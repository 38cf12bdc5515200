//! The mapping between Reach and A2A: task states both ways, parts, a Reach task as an A2A
//! [`Task`], and a task's event log as A2A stream events ([`EventMapper`]).
//!
//! Every decision here is written down in `docs/edges.md`:
//! - states: PENDING and DISPATCHED are SUBMITTED, PROCESSING is WORKING, WAITING_HUMAN is
//!   INPUT_REQUIRED, SUCCEEDED is COMPLETED, FAILED and PARTIAL are FAILED, CANCELLED is
//!   CANCELED;
//! - an artifact per `task` or `parallel` node that completed, its id the node id, its one
//!   data part the node's output (a node visited again replaces its artifact);
//! - the history: the message that started the task (its input as a data part) and each
//!   message that resumed a human node;
//! - every event carries `metadata["reach.sequence"]`, the orchestrator's event sequence
//!   number, and a task snapshot the sequence it reflects, so a client can resume a stream.

use std::collections::HashSet;

use reach_proto::v1 as reach;

use super::error::A2aError;
use super::proto::{
    Artifact, Message, Part, Role, StreamResponse, Task, TaskArtifactUpdateEvent, TaskState,
    TaskStatus, TaskStatusUpdateEvent, part, stream_response,
};

/// The metadata key of an event's orchestrator sequence number.
pub const SEQUENCE_KEY: &str = "reach.sequence";

/// What a task's A2A state depends on besides its Reach status.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Progress {
    /// A node has sent a call or completed: the task is being worked on, and stays WORKING
    /// (never back to SUBMITTED) between nodes.
    pub worked: bool,
    /// A node was cancelled (CancelTask), so a task its `on_cancel` then failed is CANCELED.
    pub cancelled: bool,
}

impl Progress {
    /// The progress a task's node history shows.
    pub fn of(task: &reach::Task) -> Self {
        Self {
            worked: task
                .nodes
                .iter()
                .any(|n| n.attempts > 0 || n.ended_at.is_some()),
            cancelled: task
                .nodes
                .iter()
                .any(|n| n.status() == reach::NodeStatus::Cancelled),
        }
    }
}

/// The A2A state of a Reach task status: PENDING (and a task whose first node has not
/// started) is SUBMITTED; DISPATCHED and PROCESSING are WORKING once a node started;
/// WAITING_HUMAN is INPUT_REQUIRED; SUCCEEDED is COMPLETED; FAILED and PARTIAL are FAILED,
/// or CANCELED when a node was cancelled; CANCELLED is CANCELED.
pub fn task_state(status: reach::TaskStatus, progress: Progress) -> TaskState {
    use reach::TaskStatus as S;
    match status {
        S::Unspecified | S::Pending => TaskState::Submitted,
        S::Dispatched | S::Processing if progress.worked => TaskState::Working,
        S::Dispatched | S::Processing => TaskState::Submitted,
        S::WaitingHuman => TaskState::InputRequired,
        S::Succeeded => TaskState::Completed,
        S::Failed | S::Partial if progress.cancelled => TaskState::Canceled,
        S::Failed | S::Partial => TaskState::Failed,
        S::Cancelled => TaskState::Canceled,
    }
}

/// The A2A state of a Reach task (from GetTask, with its node history).
pub fn state_of(task: &reach::Task) -> TaskState {
    task_state(task.status(), Progress::of(task))
}

/// The Reach statuses whose tasks may be in an A2A state (empty: none can, e.g. REJECTED);
/// a list filters on them, then on the exact A2A state.
pub fn reach_statuses(state: TaskState) -> &'static [reach::TaskStatus] {
    use reach::TaskStatus as S;
    match state {
        TaskState::Unspecified => &[],
        TaskState::Submitted => &[S::Pending, S::Dispatched, S::Processing],
        TaskState::Working => &[S::Dispatched, S::Processing],
        TaskState::InputRequired => &[S::WaitingHuman],
        TaskState::Completed => &[S::Succeeded],
        TaskState::Failed => &[S::Failed, S::Partial],
        TaskState::Canceled => &[S::Cancelled, S::Failed, S::Partial],
        TaskState::Rejected | TaskState::AuthRequired => &[],
    }
}

/// Whether a stream ends after an event in `state`: the task ended or waits for the client.
pub fn ends_stream(state: TaskState) -> bool {
    matches!(
        state,
        TaskState::Completed
            | TaskState::Failed
            | TaskState::Canceled
            | TaskState::Rejected
            | TaskState::InputRequired
            | TaskState::AuthRequired
    )
}

/// Whether `state` is terminal (the task will not change again).
pub fn is_terminal(state: TaskState) -> bool {
    matches!(
        state,
        TaskState::Completed | TaskState::Failed | TaskState::Canceled | TaskState::Rejected
    )
}

/// A JSON value as a `google.protobuf.Value` of the A2A types.
pub fn to_value(json: &serde_json::Value) -> pbjson_types::Value {
    // pbjson's Value deserialises from any JSON value; it cannot fail.
    serde_json::from_value(json.clone()).unwrap_or_default()
}

/// A `google.protobuf.Value` of the A2A types as JSON.
pub fn from_value(value: &pbjson_types::Value) -> serde_json::Value {
    serde_json::to_value(value).unwrap_or(serde_json::Value::Null)
}

/// A JSON object as a `google.protobuf.Struct`; `None` for anything else.
pub fn to_struct(json: serde_json::Value) -> Option<pbjson_types::Struct> {
    json.is_object()
        .then(|| serde_json::from_value(json).ok())
        .flatten()
}

/// A Reach part as an A2A part (the same oneof: text, data, raw, url).
pub fn part_from_reach(part: &reach::Part) -> Part {
    let content = part.content.as_ref().map(|content| match content {
        reach::part::Content::Text(text) => part::Content::Text(text.clone()),
        reach::part::Content::Data(data) => {
            part::Content::Data(to_value(&reach_proto::json::from_proto(data)))
        }
        reach::part::Content::Raw(raw) => part::Content::Raw(raw.to_vec()),
        reach::part::Content::Url(url) => part::Content::Url(url.clone()),
    });
    Part {
        content,
        metadata: None,
        filename: part.filename.clone(),
        media_type: part.media_type.clone(),
    }
}

/// An A2A part as a Reach part.
///
/// # Errors
/// [`A2aError::InvalidParams`] for a part with no content.
pub fn part_to_reach(index: usize, part: &Part) -> Result<reach::Part, A2aError> {
    let content = match &part.content {
        Some(part::Content::Text(text)) => reach::part::Content::Text(text.clone()),
        Some(part::Content::Data(data)) => {
            let value = reach_proto::json::to_proto(&from_value(data));
            check_depth(&format!("message.parts[{index}].data"), &value)?;
            reach::part::Content::Data(value)
        }
        Some(part::Content::Raw(raw)) => reach::part::Content::Raw(raw.clone().into()),
        Some(part::Content::Url(url)) => reach::part::Content::Url(url.clone()),
        None => {
            return Err(A2aError::InvalidParams(format!(
                "message.parts[{index}] has no content: set text, data, raw or url"
            )));
        }
    };
    Ok(reach::Part {
        content: Some(content),
        media_type: part.media_type.clone(),
        filename: part.filename.clone(),
    })
}

/// Refuses data nesting deeper than the mesh carries ([`reach_proto::json::MAX_DATA_DEPTH`]
/// object levels): past it, a message could not be decoded inside the mesh.
///
/// # Errors
/// [`A2aError::InvalidParams`] naming `what`.
pub fn check_depth(what: &str, value: &prost_types::Value) -> Result<(), A2aError> {
    let depth = reach_proto::json::depth(value);
    if depth > reach_proto::json::MAX_DATA_DEPTH {
        return Err(A2aError::InvalidParams(format!(
            "{what} nests {depth} levels deep, over the mesh's limit of {}: flatten it, or send it as a raw or url part",
            reach_proto::json::MAX_DATA_DEPTH
        )));
    }
    Ok(())
}

/// One data part holding `json`.
pub fn data_part(json: &serde_json::Value) -> Part {
    Part {
        content: Some(part::Content::Data(to_value(json))),
        media_type: "application/json".into(),
        ..Part::default()
    }
}

/// One text part.
pub fn text_part(text: impl Into<String>) -> Part {
    Part {
        content: Some(part::Content::Text(text.into())),
        media_type: "text/plain".into(),
        ..Part::default()
    }
}

/// The JSON a flow task starts with, or a human node resumes with, from a message: its first
/// data part; without one, `{"text": <its text parts joined by newlines>}`.
///
/// # Errors
/// [`A2aError::InvalidParams`] when the message has neither data nor text parts.
pub fn message_input(message: &Message) -> Result<serde_json::Value, A2aError> {
    if let Some(data) = message.parts.iter().find_map(|p| match &p.content {
        Some(part::Content::Data(data)) => Some(from_value(data)),
        _ => None,
    }) {
        return Ok(data);
    }
    let texts: Vec<&str> = message
        .parts
        .iter()
        .filter_map(|p| match &p.content {
            Some(part::Content::Text(text)) => Some(text.as_str()),
            _ => None,
        })
        .collect();
    if texts.is_empty() {
        return Err(A2aError::InvalidParams(
            "the message has no data or text part: a flow's input is the first data part (or the text parts, as {\"text\": …})".into(),
        ));
    }
    Ok(serde_json::json!({"text": texts.join("\n")}))
}

/// The agent message of a status: the prompt and input schema of a human wait, or a failed
/// task's error.
fn status_message(task: &reach::Task, context_id: &str, state: TaskState) -> Option<Message> {
    let parts = match (state, &task.waiting) {
        (TaskState::InputRequired, Some(wait)) => input_required_parts(
            &wait.node_id,
            &wait.prompt,
            wait.input_schema
                .as_ref()
                .map(reach_proto::json::from_proto),
        ),
        (TaskState::Failed, _) if !task.error.is_empty() => vec![text_part(task.error.clone())],
        _ => return None,
    };
    Some(agent_message(
        format!("{}-status-{}", task.task_id, task.last_sequence),
        &task.task_id,
        context_id,
        parts,
    ))
}

/// The parts of an INPUT_REQUIRED status message: the node's prompt as text, and
/// `{"node", "inputSchema"}` as data.
pub fn input_required_parts(
    node: &str,
    prompt: &str,
    schema: Option<serde_json::Value>,
) -> Vec<Part> {
    let mut parts = Vec::new();
    if !prompt.is_empty() {
        parts.push(text_part(prompt));
    }
    let mut data = serde_json::json!({"node": node});
    if let Some(schema) = schema {
        data["inputSchema"] = schema;
    }
    parts.push(data_part(&data));
    parts
}

/// An agent message.
pub fn agent_message(id: String, task_id: &str, context_id: &str, parts: Vec<Part>) -> Message {
    Message {
        message_id: id,
        context_id: context_id.to_string(),
        task_id: task_id.to_string(),
        role: Role::Agent.into(),
        parts,
        ..Message::default()
    }
}

fn user_message(id: String, task_id: &str, context_id: &str, input: &serde_json::Value) -> Message {
    Message {
        message_id: id,
        context_id: context_id.to_string(),
        task_id: task_id.to_string(),
        role: Role::User.into(),
        parts: vec![data_part(input)],
        ..Message::default()
    }
}

fn timestamp(ts: Option<&prost_types::Timestamp>) -> Option<pbjson_types::Timestamp> {
    ts.map(|ts| pbjson_types::Timestamp {
        seconds: ts.seconds,
        nanos: ts.nanos,
    })
}

fn sequence_metadata(sequence: u64, extra: serde_json::Value) -> Option<pbjson_types::Struct> {
    let mut json = serde_json::json!({ SEQUENCE_KEY: sequence });
    if let (Some(map), serde_json::Value::Object(extra)) = (json.as_object_mut(), extra) {
        map.extend(extra);
    }
    to_struct(json)
}

/// A Reach task (from GetTask, with its node history) as an A2A task in context
/// `context_id`, with at most `history_length` history messages (the latest; `None` for all).
pub fn task_from_reach(
    task: &reach::Task,
    context_id: &str,
    history_length: Option<usize>,
    include_artifacts: bool,
) -> Task {
    let state = state_of(task);
    let mut artifacts: Vec<Artifact> = Vec::new();
    if include_artifacts {
        for run in &task.nodes {
            let called = run.node_type == "task" || run.node_type == "parallel";
            let done = matches!(
                run.status(),
                reach::NodeStatus::Succeeded | reach::NodeStatus::Partial
            );
            if let (true, true, Some(output)) = (called, done, &run.output) {
                let artifact = node_artifact(&run.node_id, &reach_proto::json::from_proto(output));
                match artifacts.iter_mut().find(|a| a.artifact_id == run.node_id) {
                    Some(existing) => *existing = artifact,
                    None => artifacts.push(artifact),
                }
            }
        }
    }
    let mut history = Vec::new();
    if let Some(input) = &task.input {
        history.push(user_message(
            format!("{}-input", task.task_id),
            &task.task_id,
            context_id,
            &reach_proto::json::from_proto(input),
        ));
    }
    for (visit, run) in task.nodes.iter().enumerate() {
        if run.node_type == "human"
            && run.status() == reach::NodeStatus::Succeeded
            && let Some(output) = &run.output
        {
            history.push(user_message(
                format!("{}-resume-{visit}", task.task_id),
                &task.task_id,
                context_id,
                &reach_proto::json::from_proto(output),
            ));
        }
    }
    if let Some(limit) = history_length {
        let skip = history.len().saturating_sub(limit);
        history.drain(..skip);
    }
    Task {
        id: task.task_id.clone(),
        context_id: context_id.to_string(),
        status: Some(TaskStatus {
            state: state.into(),
            message: status_message(task, context_id, state),
            timestamp: timestamp(task.updated_at.as_ref()),
        }),
        artifacts,
        history,
        metadata: sequence_metadata(
            task.last_sequence,
            serde_json::json!({
                "reach.flowId": task.flow_id,
                "reach.flowVersion": task.flow_version,
                "reach.status": reach::TaskStatus::try_from(task.status)
                    .map(|s| s.as_str_name().trim_start_matches("TASK_STATUS_"))
                    .unwrap_or("UNSPECIFIED"),
                "reach.traceId": task.trace_id,
            }),
        ),
    }
}

fn node_artifact(node: &str, output: &serde_json::Value) -> Artifact {
    Artifact {
        artifact_id: node.to_string(),
        name: node.to_string(),
        description: format!("the output of node {node}"),
        parts: vec![data_part(output)],
        ..Artifact::default()
    }
}

/// Folds a task's event log, from its first event, into A2A stream events: a status update
/// whenever the A2A state changes (with the prompt and schema when it becomes
/// INPUT_REQUIRED, the error when it becomes FAILED) and an artifact update when a `task` or
/// `parallel` node completes. The same log always gives the same events, so a client that
/// resumes after a sequence number gets exactly the events it missed.
#[derive(Debug)]
pub struct EventMapper {
    task_id: String,
    context_id: String,
    state: TaskState,
    progress: Progress,
    /// Nodes that sent a call during their current visit (task and parallel nodes).
    called: HashSet<String>,
}

impl EventMapper {
    /// A mapper for task `task_id` in `context_id`, before its first event.
    pub fn new(task_id: &str, context_id: &str) -> Self {
        Self {
            task_id: task_id.to_string(),
            context_id: context_id.to_string(),
            state: TaskState::Unspecified,
            progress: Progress::default(),
            called: HashSet::new(),
        }
    }

    /// The A2A state after the events seen so far.
    pub fn state(&self) -> TaskState {
        self.state
    }

    /// The stream events `event` gives (none, one or two), in order.
    pub fn map(&mut self, event: &reach::TaskEvent) -> Vec<StreamResponse> {
        let detail = event
            .detail
            .as_ref()
            .map(reach_proto::json::from_proto)
            .unwrap_or_default();
        let mut out = Vec::new();
        match event.kind.as_str() {
            "attempt_started" => {
                self.progress.worked = true;
                self.called.insert(event.node_id.clone());
            }
            "node_entered" => {
                self.called.remove(&event.node_id);
            }
            "node_failed" => {
                self.progress.worked = true;
            }
            "node_completed"
                if detail.get("outcome").and_then(|o| o.as_str()) == Some("CANCELLED") =>
            {
                self.progress.cancelled = true;
            }
            "node_completed" if !self.called.remove(&event.node_id) => {
                self.progress.worked = true;
            }
            "node_completed" => {
                self.progress.worked = true;
                let output = detail.get("output").cloned().unwrap_or_default();
                out.push(StreamResponse {
                    payload: Some(stream_response::Payload::ArtifactUpdate(
                        TaskArtifactUpdateEvent {
                            task_id: self.task_id.clone(),
                            context_id: self.context_id.clone(),
                            artifact: Some(node_artifact(&event.node_id, &output)),
                            append: false,
                            last_chunk: true,
                            metadata: sequence_metadata(event.sequence, serde_json::json!({})),
                        },
                    )),
                });
            }
            _ => {}
        }
        let state = task_state(event.status(), self.progress);
        if state != self.state {
            self.state = state;
            let message = match state {
                // The orchestrator's `human_waiting` detail carries the node's prompt and
                // schema.
                TaskState::InputRequired => Some(agent_message(
                    format!("{}-status-{}", self.task_id, event.sequence),
                    &self.task_id,
                    &self.context_id,
                    input_required_parts(
                        &event.node_id,
                        detail.get("prompt").and_then(|p| p.as_str()).unwrap_or(""),
                        detail.get("schema").cloned(),
                    ),
                )),
                TaskState::Failed => detail.get("error").and_then(|e| e.as_str()).map(|error| {
                    agent_message(
                        format!("{}-status-{}", self.task_id, event.sequence),
                        &self.task_id,
                        &self.context_id,
                        vec![text_part(error)],
                    )
                }),
                _ => None,
            };
            out.push(StreamResponse {
                payload: Some(stream_response::Payload::StatusUpdate(
                    TaskStatusUpdateEvent {
                        task_id: self.task_id.clone(),
                        context_id: self.context_id.clone(),
                        status: Some(TaskStatus {
                            state: state.into(),
                            message,
                            timestamp: timestamp(event.at.as_ref()),
                        }),
                        metadata: sequence_metadata(event.sequence, serde_json::json!({})),
                    },
                )),
            });
        }
        out
    }
}

/// The A2A push notifications of a task's whole event log (from its first event): each
/// status and artifact update [`EventMapper`] gives, as the proto3 JSON of a
/// `StreamResponse` (what the official SDKs POST to a webhook), tagged with the sequence of
/// the event it came from. A pure function of the log, so a redelivery sends the same bodies.
pub fn push_notifications(
    task: &reach::Task,
    events: &[reach::TaskEvent],
) -> Vec<(u64, serde_json::Value)> {
    let mut mapper = EventMapper::new(&task.task_id, context_of(task));
    events
        .iter()
        .flat_map(|event| {
            mapper
                .map(event)
                .into_iter()
                .map(move |update| (event.sequence, update))
        })
        .filter_map(|(sequence, update)| Some((sequence, serde_json::to_value(update).ok()?)))
        .collect()
}

/// The label a task's A2A context id is kept in.
pub const CONTEXT_LABEL: &str = "a2a.context_id";

/// A task's A2A context: its [`CONTEXT_LABEL`], else its id (tasks not started through the
/// edge are each their own context).
pub fn context_of(task: &reach::Task) -> &str {
    task.labels
        .get(CONTEXT_LABEL)
        .map(String::as_str)
        .unwrap_or(&task.task_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(sequence: u64, kind: &str, node: &str, status: reach::TaskStatus) -> reach::TaskEvent {
        reach::TaskEvent {
            task_id: "t".into(),
            sequence,
            kind: kind.into(),
            node_id: node.into(),
            detail: Some(reach_proto::json::to_proto(
                &serde_json::json!({"kind": kind, "node": node, "output": {"n": sequence}}),
            )),
            status: status.into(),
            at: None,
        }
    }

    #[test]
    fn states_map_both_ways() {
        for status in [
            reach::TaskStatus::Pending,
            reach::TaskStatus::Dispatched,
            reach::TaskStatus::Processing,
            reach::TaskStatus::WaitingHuman,
            reach::TaskStatus::Succeeded,
            reach::TaskStatus::Failed,
            reach::TaskStatus::Partial,
            reach::TaskStatus::Cancelled,
        ] {
            for worked in [false, true] {
                let progress = Progress {
                    worked,
                    cancelled: false,
                };
                assert!(
                    reach_statuses(task_state(status, progress)).contains(&status),
                    "{status:?} does not map back"
                );
            }
        }
    }

    #[test]
    fn artifacts_only_for_nodes_that_called_and_status_only_on_change() {
        use reach::TaskStatus as S;
        let mut mapper = EventMapper::new("t", "t");
        let log = [
            event(1, "task_created", "", S::Pending),
            event(2, "node_entered", "classify", S::Pending),
            event(3, "attempt_started", "classify", S::Dispatched),
            event(4, "slot_completed", "classify", S::Processing),
            event(5, "node_completed", "classify", S::Processing),
            event(6, "node_entered", "route", S::Processing),
            event(7, "node_completed", "route", S::Processing),
            event(8, "task_ended", "", S::Succeeded),
        ];
        let kinds: Vec<String> = log
            .iter()
            .flat_map(|e| mapper.map(e))
            .map(|r| match r.payload.unwrap() {
                stream_response::Payload::StatusUpdate(s) => {
                    format!("status:{}", s.status.unwrap().state().as_str_name())
                }
                stream_response::Payload::ArtifactUpdate(a) => {
                    format!("artifact:{}", a.artifact.unwrap().artifact_id)
                }
                _ => "other".into(),
            })
            .collect();
        // SUBMITTED until the first call goes out, then WORKING throughout (never back).
        assert_eq!(
            kinds,
            [
                "status:TASK_STATE_SUBMITTED",
                "status:TASK_STATE_WORKING",
                "artifact:classify",
                "status:TASK_STATE_COMPLETED"
            ]
        );
    }

    #[test]
    fn text_only_messages_become_a_text_input() {
        let message = Message {
            parts: vec![text_part("hello"), text_part("world")],
            ..Message::default()
        };
        assert_eq!(
            message_input(&message).unwrap(),
            serde_json::json!({"text": "hello\nworld"})
        );
        assert!(message_input(&Message::default()).is_err());
    }
}
