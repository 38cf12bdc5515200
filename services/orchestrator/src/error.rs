//! The orchestrator's error type and its mapping to gRPC statuses.
//!
//! Every variant that a program may branch on maps to a status carrying a
//! `google.rpc.ErrorInfo` with a reason from [`reach_rpc::errors::reason`] (domain
//! `reach.dev`) and the variant's fields as metadata; request errors also carry a
//! `google.rpc.BadRequest` naming the field. The mapping is exhaustive: a new variant must
//! choose its code.

use std::collections::HashMap;
use std::path::PathBuf;

use reach_rpc::errors::{ERROR_DOMAIN, reason};
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::config::ConfigError;
use crate::event::TaskStatus;
use crate::flow::FlowErrors;
use crate::store::{StoreError, StoreErrorKind};

/// Why an orchestrator operation failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The trust layer refused the caller: PERMISSION_DENIED with ErrorInfo reason
    /// `NOT_AUTHORIZED`.
    #[error(transparent)]
    Denied(#[from] reach_trust::Denied),
    /// No task has this id (never started, or purged after the context TTL).
    #[error("task {task_id:?} does not exist (or was purged after its TTL)")]
    TaskNotFound {
        /// The id asked for.
        task_id: String,
    },
    /// The task id given to StartTask is not valid.
    #[error(
        "task id {task_id:?} is not valid: use 1 to 128 characters of A-Z a-z 0-9 . _ : -, not dots alone"
    )]
    InvalidTaskId {
        /// The id given.
        task_id: String,
    },
    /// StartTask's labels, or ListTasks' label filter, break a limit.
    #[error("invalid labels: {detail}")]
    InvalidLabels {
        /// What is wrong, naming the label.
        detail: String,
    },
    /// The task id given to StartTask belongs to a task of another flow.
    #[error("task {task_id:?} exists and runs flow {flow_id:?}; choose another task id")]
    TaskIdInUse {
        /// The id given.
        task_id: String,
        /// The flow the existing task runs.
        flow_id: String,
    },
    /// ResumeTask of a task that does not wait in a human node.
    #[error(
        "task {task_id} is {} at node {node:?}; only a task waiting in a human node can be resumed",
        status.as_str()
    )]
    TaskNotWaiting {
        /// The task.
        task_id: String,
        /// Its status.
        status: TaskStatus,
        /// Its current node (empty when it has none).
        node: String,
    },
    /// ResumeTask naming another node than the one the task waits in.
    #[error(
        "task {task_id} waits in node {waiting:?}, not {requested:?}; resume {waiting:?} or leave the node empty"
    )]
    NodeNotWaiting {
        /// The task.
        task_id: String,
        /// The human node it waits in.
        waiting: String,
        /// The node the request named.
        requested: String,
    },
    /// The resume input does not match the human node's schema.
    #[error("resume input does not match the schema of node {node}: {}", list(.violations))]
    InvalidInput {
        /// The task.
        task_id: String,
        /// The human node.
        node: String,
        /// `(JSON pointer in the input, what the schema says)`; never empty.
        violations: Vec<(String, String)>,
    },
    /// CancelTask of a task that already ended.
    #[error("task {task_id} already ended ({})", status.as_str())]
    TaskEnded {
        /// The task.
        task_id: String,
        /// How it ended.
        status: TaskStatus,
    },
    /// RetryTask of a task that is not FAILED or PARTIAL.
    #[error(
        "task {task_id} is {}; only FAILED or PARTIAL tasks can be retried",
        status.as_str()
    )]
    TaskNotRetryable {
        /// The task.
        task_id: String,
        /// Its status.
        status: TaskStatus,
    },
    /// RetryTask of a FAILED or PARTIAL task without a node to restart at.
    #[error("task {task_id} has no failed node to retry from")]
    NoNodeToRetry {
        /// The task.
        task_id: String,
    },
    /// A command kept losing the race with the task's own progress.
    #[error("task {task_id:?} changes too fast to apply the command; try again")]
    TaskContended {
        /// The task.
        task_id: String,
    },
    /// StartTask of a flow (or flow version) that is not applied.
    #[error(
        "flow {flow_id:?}{} is not applied; known flows: [{}]; apply it with `reach flow apply FILE`",
        version_suffix(*.version),
        .known.join(", ")
    )]
    FlowNotFound {
        /// The flow asked for.
        flow_id: String,
        /// The version asked for; 0 for the latest.
        version: u32,
        /// The applied flow ids, sorted.
        known: Vec<String>,
    },
    /// A task's flow version is not loaded in this orchestrator.
    #[error(
        "flow {flow_id} v{version} is not loaded; apply that version again to act on its tasks"
    )]
    FlowNotLoaded {
        /// The flow.
        flow_id: String,
        /// The version.
        version: u32,
    },
    /// A flow failed validation.
    #[error("{0}")]
    InvalidFlow(#[from] FlowErrors),
    /// The flow version is applied already with different text.
    #[error(
        "flow {flow_id} version {version} is already applied with different content; bump `version` (running tasks keep the version they started with)"
    )]
    FlowVersionConflict {
        /// The flow.
        flow_id: String,
        /// The version.
        version: u32,
    },
    /// A request field is required and empty.
    #[error("{field} is required; {hint}")]
    MissingField {
        /// The field.
        field: &'static str,
        /// What to put there.
        hint: &'static str,
    },
    /// A page token this server did not issue.
    #[error("page_token {token:?} is not valid; pass the next_page_token of the previous page")]
    InvalidPageToken {
        /// The token given.
        token: String,
    },
    /// A CreateTaskWebhook field is not valid.
    #[error("webhook {field} is not valid: {detail}")]
    InvalidWebhook {
        /// The field (`url`, `webhook_id`, `token`, `auth_scheme`, `auth_credentials`,
        /// `format`).
        field: &'static str,
        /// What is wrong and what to write instead.
        detail: String,
    },
    /// CreateTaskWebhook of a new webhook on a task that has the most it may have.
    #[error(
        "task {task_id} has {limit} webhooks, the most it may have; delete one, or create with the webhook_id of one to replace it"
    )]
    TooManyWebhooks {
        /// The task.
        task_id: String,
        /// The limit ([`crate::webhooks::MAX_WEBHOOKS_PER_TASK`]).
        limit: usize,
    },
    /// GetTaskWebhook or DeleteTaskWebhook of a webhook the task does not have.
    #[error("task {task_id} has no webhook {webhook_id:?}; ListTaskWebhooks shows those it has")]
    WebhookNotFound {
        /// The task.
        task_id: String,
        /// The webhook id asked for.
        webhook_id: String,
    },
    /// WatchTask by a caller that has as many streams open as it may.
    #[error(
        "{identity} has {limit} WatchTask streams open, the most a caller may have; close one (or raise orchestrator.max_watches_per_caller)"
    )]
    TooManyWatches {
        /// The caller's identity (`anonymous` without trust).
        identity: String,
        /// The limit (`orchestrator.max_watches_per_caller`).
        limit: usize,
    },
    /// StartTask with the id of an existing task the caller may not view: refused without
    /// saying anything of that task.
    #[error("task id {task_id:?} is taken; choose another task id")]
    TaskIdTaken {
        /// The id given.
        task_id: String,
    },
    /// A file (a flow file, a benchmark's directory) cannot be read or written.
    #[error("cannot access {}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// Bad configuration.
    #[error("configuration: {0}")]
    Config(#[from] ConfigError),
    /// The store failed; [`StoreError::kind`] decides the code.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Serving failed.
    #[error(transparent)]
    Serve(#[from] reach_rpc::server::ServeError),
}

fn list(violations: &[(String, String)]) -> String {
    violations
        .iter()
        .map(|(p, m)| format!("{p}: {m}"))
        .collect::<Vec<_>>()
        .join("; ")
}

fn version_suffix(version: u32) -> String {
    if version == 0 {
        String::new()
    } else {
        format!(" version {version}")
    }
}

/// The longest status message sent, in bytes: `grpc-message` and the details travel in
/// HTTP/2 headers, which clients cap (8 KiB is common), and percent-encoding can triple it.
pub const MAX_MESSAGE_BYTES: usize = 1024;
/// The most BadRequest violations sent (the rest are counted in a last one).
pub const MAX_VIOLATIONS: usize = 10;
/// The longest field path or description of a violation, in characters.
const MAX_VIOLATION_CHARS: usize = 200;
/// The longest ErrorInfo metadata value, in characters.
const MAX_METADATA_CHARS: usize = 200;

/// `text` cut to at most `max` bytes at a character boundary, with `…` when cut.
fn cap_bytes(text: String, max: usize) -> String {
    if text.len() <= max {
        return text;
    }
    let mut end = max.saturating_sub('…'.len_utf8());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// A status with an ErrorInfo of `reason` carrying `metadata`, and a BadRequest of
/// `violations` (`(field path, description)`) when there are any. Message, metadata and
/// violations are capped ([`MAX_MESSAGE_BYTES`], [`MAX_VIOLATIONS`]) so the status always
/// fits in gRPC metadata, whatever the request echoed.
fn status(
    code: Code,
    message: String,
    reason: &str,
    metadata: impl IntoIterator<Item = (&'static str, String)>,
    violations: impl IntoIterator<Item = (String, String)>,
) -> Status {
    use crate::expr::cut;
    let metadata: HashMap<String, String> = metadata
        .into_iter()
        .map(|(k, v)| (k.to_string(), cut(&v, MAX_METADATA_CHARS)))
        .collect();
    let mut details = ErrorDetails::with_error_info(reason, ERROR_DOMAIN, metadata);
    let mut left_off = 0usize;
    for (i, (field, description)) in violations.into_iter().enumerate() {
        if i >= MAX_VIOLATIONS {
            left_off += 1;
            continue;
        }
        details.add_bad_request_violation(
            cut(&field, MAX_VIOLATION_CHARS),
            cut(&description, MAX_VIOLATION_CHARS),
        );
    }
    if left_off > 0 {
        details.add_bad_request_violation("…", format!("{left_off} more not shown"));
    }
    Status::with_error_details(code, cap_bytes(message, MAX_MESSAGE_BYTES), details)
}

const NO_VIOLATIONS: [(String, String); 0] = [];

impl From<Error> for Status {
    fn from(err: Error) -> Self {
        let message = err.to_string();
        match err {
            Error::Denied(denied) => denied.to_status(),
            Error::TaskNotFound { task_id } => status(
                Code::NotFound,
                message,
                reason::TASK_NOT_FOUND,
                [("task_id", task_id)],
                NO_VIOLATIONS,
            ),
            Error::InvalidTaskId { task_id } => status(
                Code::InvalidArgument,
                message,
                reason::INVALID_TASK_ID,
                [("task_id", task_id)],
                [(
                    "task_id".to_string(),
                    "must be 1 to 128 characters of A-Z a-z 0-9 . _ : -".to_string(),
                )],
            ),
            Error::InvalidLabels { detail } => status(
                Code::InvalidArgument,
                message,
                reason::INVALID_LABELS,
                [("detail", detail.clone())],
                [("labels".to_string(), detail)],
            ),
            Error::TaskIdInUse { task_id, flow_id } => status(
                Code::AlreadyExists,
                message,
                reason::TASK_ID_IN_USE,
                [("task_id", task_id), ("flow_id", flow_id)],
                NO_VIOLATIONS,
            ),
            Error::TaskNotWaiting {
                task_id,
                status: task_status,
                node,
            } => status(
                Code::FailedPrecondition,
                message,
                reason::TASK_NOT_WAITING,
                [
                    ("task_id", task_id),
                    ("status", task_status.as_str().to_string()),
                    ("node_id", node),
                ],
                NO_VIOLATIONS,
            ),
            Error::NodeNotWaiting {
                task_id,
                waiting,
                requested,
            } => status(
                Code::FailedPrecondition,
                message,
                reason::NODE_NOT_WAITING,
                [
                    ("task_id", task_id),
                    ("waiting_node_id", waiting),
                    ("node_id", requested),
                ],
                NO_VIOLATIONS,
            ),
            Error::InvalidInput {
                task_id,
                node,
                violations,
            } => status(
                Code::InvalidArgument,
                message,
                reason::INVALID_INPUT,
                [("task_id", task_id), ("node_id", node)],
                violations
                    .into_iter()
                    .map(|(path, m)| (format!("input{path}"), m)),
            ),
            Error::TaskEnded {
                task_id,
                status: task_status,
            } => status(
                Code::FailedPrecondition,
                message,
                reason::TASK_ENDED,
                [
                    ("task_id", task_id),
                    ("status", task_status.as_str().to_string()),
                ],
                NO_VIOLATIONS,
            ),
            Error::TaskNotRetryable {
                task_id,
                status: task_status,
            } => status(
                Code::FailedPrecondition,
                message,
                reason::TASK_NOT_RETRYABLE,
                [
                    ("task_id", task_id),
                    ("status", task_status.as_str().to_string()),
                ],
                NO_VIOLATIONS,
            ),
            Error::NoNodeToRetry { task_id } => status(
                Code::FailedPrecondition,
                message,
                reason::TASK_NOT_RETRYABLE,
                [("task_id", task_id)],
                NO_VIOLATIONS,
            ),
            Error::TaskContended { task_id } => status(
                Code::Aborted,
                message,
                reason::TASK_CONTENDED,
                [("task_id", task_id)],
                NO_VIOLATIONS,
            ),
            Error::FlowNotFound {
                flow_id, version, ..
            } => status(
                Code::NotFound,
                message,
                reason::FLOW_NOT_FOUND,
                [("flow_id", flow_id), ("flow_version", version.to_string())],
                NO_VIOLATIONS,
            ),
            Error::FlowNotLoaded { flow_id, version } => status(
                Code::FailedPrecondition,
                message,
                reason::FLOW_NOT_LOADED,
                [("flow_id", flow_id), ("flow_version", version.to_string())],
                NO_VIOLATIONS,
            ),
            Error::InvalidFlow(errors) => status(
                Code::InvalidArgument,
                message,
                reason::INVALID_FLOW,
                [("errors", errors.errors.len().to_string())],
                errors.errors.into_iter().map(|e| {
                    (
                        format!("{}:{}:{}", e.source, e.line, e.column),
                        format!("{}; {}", e.message, e.hint),
                    )
                }),
            ),
            Error::FlowVersionConflict { flow_id, version } => status(
                Code::FailedPrecondition,
                message,
                reason::FLOW_VERSION_CONFLICT,
                [("flow_id", flow_id), ("flow_version", version.to_string())],
                NO_VIOLATIONS,
            ),
            Error::MissingField { field, .. } => {
                let mut details = ErrorDetails::new();
                details.add_bad_request_violation(field, "required");
                Status::with_error_details(
                    Code::InvalidArgument,
                    cap_bytes(message, MAX_MESSAGE_BYTES),
                    details,
                )
            }
            Error::InvalidPageToken { .. } => status(
                Code::InvalidArgument,
                message,
                reason::INVALID_PAGE_TOKEN,
                [],
                [(
                    "page_token".to_string(),
                    "not a token this server issued".to_string(),
                )],
            ),
            Error::InvalidWebhook { field, detail } => status(
                Code::InvalidArgument,
                message,
                reason::INVALID_WEBHOOK,
                [("field", field.to_string())],
                [(field.to_string(), detail)],
            ),
            Error::TooManyWebhooks { task_id, limit } => status(
                Code::FailedPrecondition,
                message,
                reason::TOO_MANY_WEBHOOKS,
                [("task_id", task_id), ("limit", limit.to_string())],
                NO_VIOLATIONS,
            ),
            Error::WebhookNotFound {
                task_id,
                webhook_id,
            } => status(
                Code::NotFound,
                message,
                reason::WEBHOOK_NOT_FOUND,
                [("task_id", task_id), ("webhook_id", webhook_id)],
                NO_VIOLATIONS,
            ),
            Error::TooManyWatches { identity, limit } => status(
                Code::ResourceExhausted,
                message,
                reason::TOO_MANY_WATCHES,
                [("identity", identity), ("limit", limit.to_string())],
                NO_VIOLATIONS,
            ),
            Error::TaskIdTaken { task_id } => status(
                Code::AlreadyExists,
                message,
                reason::TASK_ID_IN_USE,
                [("task_id", task_id)],
                NO_VIOLATIONS,
            ),
            Error::Store(e) => match e.kind() {
                StoreErrorKind::Unavailable => status(
                    Code::Unavailable,
                    message,
                    reason::STORE_UNAVAILABLE,
                    [],
                    NO_VIOLATIONS,
                ),
                StoreErrorKind::Conflict => status(
                    Code::Aborted,
                    message,
                    reason::STORE_CONFLICT,
                    [],
                    NO_VIOLATIONS,
                ),
                StoreErrorKind::Corrupt => status(
                    Code::DataLoss,
                    message,
                    reason::STORE_CORRUPT,
                    [],
                    NO_VIOLATIONS,
                ),
                StoreErrorKind::Internal => Status::internal(cap_bytes(message, MAX_MESSAGE_BYTES)),
            },
            Error::Io { .. } | Error::Config(_) | Error::Serve(_) => {
                Status::internal(cap_bytes(message, MAX_MESSAGE_BYTES))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reach_rpc::errors::{metadata_of, reason_of};

    fn status_of(e: Error) -> Status {
        Status::from(e)
    }

    /// Store failures keep their kind on the way out: a lost connection is worth retrying, a
    /// collision is a conflict, an undecodable event is data loss.
    #[test]
    fn store_errors_map_by_kind() {
        let s = status_of(Error::Store(StoreError::Db(sqlx::Error::PoolTimedOut)));
        assert_eq!(s.code(), Code::Unavailable);
        assert_eq!(reason_of(&s).as_deref(), Some(reason::STORE_UNAVAILABLE));
        let s = status_of(Error::Store(StoreError::WriterGone));
        assert_eq!(s.code(), Code::Unavailable);
        let s = status_of(Error::Store(StoreError::Batch {
            kind: StoreErrorKind::Conflict,
            message: "duplicate key".into(),
        }));
        assert_eq!(s.code(), Code::Aborted);
        assert_eq!(reason_of(&s).as_deref(), Some(reason::STORE_CONFLICT));
        let s = status_of(Error::Store(StoreError::Corrupt {
            task_id: "t".into(),
            seq: 3,
            message: "unknown variant".into(),
        }));
        assert_eq!(s.code(), Code::DataLoss);
        assert_eq!(reason_of(&s).as_deref(), Some(reason::STORE_CORRUPT));
        assert_eq!(
            s.message(),
            "stored event t#3 cannot be decoded: unknown variant"
        );
        let s = status_of(Error::Store(StoreError::Db(sqlx::Error::RowNotFound)));
        assert_eq!(s.code(), Code::Internal);
    }

    #[test]
    fn task_errors_carry_reason_and_metadata() {
        let s = status_of(Error::TaskNotWaiting {
            task_id: "t1".into(),
            status: TaskStatus::Processing,
            node: "act".into(),
        });
        assert_eq!(s.code(), Code::FailedPrecondition);
        assert_eq!(reason_of(&s).as_deref(), Some(reason::TASK_NOT_WAITING));
        let meta = metadata_of(&s);
        assert_eq!(meta["task_id"], "t1");
        assert_eq!(meta["status"], "PROCESSING");
        assert_eq!(meta["node_id"], "act");
        assert_eq!(
            s.message(),
            "task t1 is PROCESSING at node \"act\"; only a task waiting in a human node can be resumed"
        );
        let s = status_of(Error::InvalidInput {
            task_id: "t1".into(),
            node: "ask".into(),
            violations: vec![(
                "/approved".into(),
                "\"yes\" is not of type \"boolean\"".into(),
            )],
        });
        assert_eq!(s.code(), Code::InvalidArgument);
        assert_eq!(reason_of(&s).as_deref(), Some(reason::INVALID_INPUT));
        let fields: Vec<String> = s
            .get_details_bad_request()
            .unwrap()
            .field_violations
            .into_iter()
            .map(|v| v.field)
            .collect();
        assert_eq!(fields, ["input/approved"]);
        let s = status_of(Error::FlowNotFound {
            flow_id: "nope".into(),
            version: 0,
            known: vec!["a".into(), "b".into()],
        });
        assert_eq!(s.code(), Code::NotFound);
        assert_eq!(
            s.message(),
            "flow \"nope\" is not applied; known flows: [a, b]; apply it with `reach flow apply FILE`"
        );
    }
}
