//! JSON views: conversions between `serde_json::Value` and `google.protobuf.Value` (the shared
//! ones of `reach_proto::json`, plus an optional-value helper), and a task as JSON, as
//! `GET /tasks/{id}` and the CLI's `--json` print it.

use reach_proto::v1 as pb;
use serde_json::{Value, json};

pub use reach_proto::json::{from_proto, to_proto};

/// An optional protobuf value as JSON (`null` when absent).
pub fn from_proto_opt(value: Option<&prost_types::Value>) -> serde_json::Value {
    value.map(from_proto).unwrap_or(serde_json::Value::Null)
}

/// A timestamp as RFC 3339 with milliseconds (`2026-12-01T12:00:00.123Z`); out-of-range
/// values print as the Unix epoch.
pub fn timestamp(t: &prost_types::Timestamp) -> String {
    let st = reach_rpc::time::system_time(t).unwrap_or(std::time::UNIX_EPOCH);
    humantime::format_rfc3339_millis(st).to_string()
}

/// A `reach.v1.TaskStatus` number as its short name (`WAITING_HUMAN`); `UNKNOWN` when the
/// number is not a status.
pub fn status_name(status: i32) -> String {
    pb::TaskStatus::try_from(status)
        .map(|s| {
            s.as_str_name()
                .trim_start_matches("TASK_STATUS_")
                .to_string()
        })
        .unwrap_or_else(|_| "UNKNOWN".into())
}

/// A task as JSON (for `task get --json`, `task start --json` and `GET /tasks/{id}`); values
/// are already masked. `output` is `null` until the task ended; `waiting` (the human node, its
/// prompt, `input_schema` and `deadline`) is set only while it is WAITING_HUMAN.
pub fn task_json(t: &pb::Task) -> Value {
    let ts = |t: &Option<prost_types::Timestamp>| t.as_ref().map(timestamp);
    json!({
        "task_id": t.task_id,
        "flow_id": t.flow_id,
        "flow_version": t.flow_version,
        "status": status_name(t.status),
        "current_node": t.current_node,
        "input": from_proto_opt(t.input.as_ref()),
        "output": from_proto_opt(t.output.as_ref()),
        "error": t.error,
        "failed_node": t.failed_node,
        "waiting": t.waiting.as_ref().map(|w| json!({
            "node_id": w.node_id,
            "prompt": w.prompt,
            "input_schema": from_proto_opt(w.input_schema.as_ref()),
            "deadline": w.deadline.as_ref().map(timestamp),
        })),
        "trace_id": t.trace_id,
        "created_at": ts(&t.created_at),
        "updated_at": ts(&t.updated_at),
        "ended_at": ts(&t.ended_at),
        "nodes": t.nodes.iter().map(|n| json!({
            "node_id": n.node_id,
            "type": n.node_type,
            "status": pb::NodeStatus::try_from(n.status).map(|s| s.as_str_name().trim_start_matches("NODE_STATUS_").to_string()).unwrap_or_default(),
            "attempts": n.attempts,
            "message_id": n.message_id,
            "input": from_proto_opt(n.input.as_ref()),
            "output": from_proto_opt(n.output.as_ref()),
            "error": n.error,
            "started_at": ts(&n.started_at),
            "ended_at": ts(&n.ended_at),
            "next": n.next_node,
            "usage": n.usage.as_ref().map(usage_json),
        })).collect::<Vec<_>>(),
        "usage": t.usage.as_ref().map(usage_json),
    })
}

/// Token usage as JSON: `{input_tokens, output_tokens, model_calls}`.
pub fn usage_json(u: &pb::TokenUsage) -> Value {
    json!({
        "input_tokens": u.input_tokens,
        "output_tokens": u.output_tokens,
        "model_calls": u.model_calls,
    })
}

/// A task event as JSON (the `reach` webhook format's body): `task_id`, `sequence`, `kind`,
/// `node_id`, `status` (its short name), `detail` (masked, as recorded) and `at` (RFC 3339).
pub fn event_json(e: &pb::TaskEvent) -> Value {
    json!({
        "task_id": e.task_id,
        "sequence": e.sequence,
        "kind": e.kind,
        "node_id": e.node_id,
        "status": status_name(e.status),
        "detail": from_proto_opt(e.detail.as_ref()),
        "at": e.at.as_ref().map(timestamp),
    })
}
