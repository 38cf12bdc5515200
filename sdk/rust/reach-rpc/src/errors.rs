//! Statuses that carry `google.rpc.ErrorInfo`, so programs can branch on a stable reason.

use std::collections::HashMap;

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

/// The ErrorInfo domain of every Reach error.
pub const ERROR_DOMAIN: &str = "reach.dev";

/// Stable ErrorInfo reasons Reach returns.
pub mod reason {
    /// The trust policy does not let the caller do what it asked (`reach_trust::Denied`).
    pub const NOT_AUTHORIZED: &str = "NOT_AUTHORIZED";
    /// The caller's credentials were refused, or it sent none where some are needed.
    pub const UNAUTHENTICATED: &str = "UNAUTHENTICATED";
    /// No routable instance serves the addressed service or capability.
    pub const ROUTE_NOT_FOUND: &str = "ROUTE_NOT_FOUND";
    /// The message is larger than the configured limit.
    pub const PAYLOAD_TOO_LARGE: &str = "PAYLOAD_TOO_LARGE";
    /// The header's trace id is not a valid W3C trace id.
    pub const INVALID_TRACE_ID: &str = "INVALID_TRACE_ID";
    /// The message lacks a target or carries an invalid one.
    pub const INVALID_TARGET: &str = "INVALID_TARGET";
    /// The caller's deadline passed before the instance answered.
    pub const DEADLINE_EXCEEDED: &str = "DEADLINE_EXCEEDED";
    /// The instance is draining and takes no new work.
    pub const INSTANCE_DRAINING: &str = "INSTANCE_DRAINING";
    /// No handler is registered for the message's capability.
    pub const CAPABILITY_NOT_HANDLED: &str = "CAPABILITY_NOT_HANDLED";
    /// The lease is unknown or expired.
    pub const LEASE_NOT_FOUND: &str = "LEASE_NOT_FOUND";
    /// An operator drained the instance: it must not register again.
    pub const INSTANCE_DRAINED: &str = "INSTANCE_DRAINED";
    /// The instance could not be reached, or nothing routable was ready: the message was not
    /// delivered.
    pub const INSTANCE_UNAVAILABLE: &str = "INSTANCE_UNAVAILABLE";
    /// The instance's connection broke while the call or stream was in flight
    /// (`instance_id` in the metadata): the message may or may not have been handled, so a
    /// retry must carry the same `message_id` (UNAVAILABLE).
    pub const INSTANCE_LOST: &str = "INSTANCE_LOST";
    /// A router could not forward an asynchronous reply to the replica its `reply_to` names:
    /// that replica did not answer as a router of the mesh (unreachable, or it did not prove the
    /// router identity). Nothing was delivered (UNAVAILABLE).
    pub const REPLY_PEER_UNAVAILABLE: &str = "REPLY_PEER_UNAVAILABLE";
    /// Every instance is at its concurrency limit and the wait queue is full or timed out;
    /// retry after the hinted delay (`retry_after_ms`).
    pub const OVERLOADED: &str = "OVERLOADED";
    /// The message's TTL (`created_at` + `ttl`) passed before it was delivered.
    pub const MESSAGE_EXPIRED: &str = "MESSAGE_EXPIRED";
    /// No instance speaks a compatible capability version and no adapter bridges the gap.
    pub const VERSION_NOT_SUPPORTED: &str = "VERSION_NOT_SUPPORTED";
    /// The payload does not match the capability's input schema.
    pub const INVALID_PAYLOAD: &str = "INVALID_PAYLOAD";
    /// The capability is not declared in the protocol registry (strict mode).
    pub const CAPABILITY_NOT_DECLARED: &str = "CAPABILITY_NOT_DECLARED";
    /// A multiplexed call frame reused the id of a call still open on its stream; the open
    /// call is unaffected and still gets its own reply (`call_id` in the metadata).
    pub const CALL_ID_IN_USE: &str = "CALL_ID_IN_USE";
    /// A multiplexed call frame neither starts a call (no message) nor cancels one.
    pub const INVALID_FRAME: &str = "INVALID_FRAME";
    /// A message header field is malformed or out of range (`field` in the metadata:
    /// `header.ttl`, `header.created_at`, `header.topic`).
    pub const INVALID_HEADER: &str = "INVALID_HEADER";
    /// The message's `header.turn` is above the router's `max_turn` (`turn` and `limit` in
    /// the metadata): agents are calling each other in a loop. FAILED_PRECONDITION.
    pub const TURN_LIMIT_EXCEEDED: &str = "TURN_LIMIT_EXCEEDED";
    /// A version adapter's transform failed (`adapter` and `direction` in the metadata):
    /// INVALID_ARGUMENT when it was rewriting the caller's request, INTERNAL when it was
    /// rewriting the instance's reply.
    pub const ADAPTER_FAILED: &str = "ADAPTER_FAILED";

    // === agent kit (reach-agent): model calls ===
    // Metadata keys, where present: `http_status`, `attempts`, `timeout_ms`.

    /// The model server answered 429 on every attempt (retries honour `Retry-After`):
    /// RESOURCE_EXHAUSTED, with a RetryInfo when the server sent `Retry-After`.
    pub const MODEL_RATE_LIMITED: &str = "MODEL_RATE_LIMITED";
    /// The model did not answer within the configured timeout: DEADLINE_EXCEEDED.
    pub const MODEL_TIMEOUT: &str = "MODEL_TIMEOUT";
    /// The model server answered something that is not a usable chat completion (malformed
    /// JSON, no choices, over the response size limit): UNAVAILABLE.
    pub const MODEL_BAD_RESPONSE: &str = "MODEL_BAD_RESPONSE";
    /// The model server could not be reached or answered 5xx on every attempt: UNAVAILABLE.
    pub const MODEL_UNAVAILABLE: &str = "MODEL_UNAVAILABLE";
    /// The model server refused the request with a 4xx other than 429 (not retried):
    /// INVALID_ARGUMENT (400, 413, 422), UNAUTHENTICATED (401), PERMISSION_DENIED (403),
    /// NOT_FOUND (404), FAILED_PRECONDITION otherwise.
    pub const MODEL_REFUSED: &str = "MODEL_REFUSED";

    // === orchestrator (reach-orchestrator) ===
    // Metadata keys, where present: `task_id`, `flow_id`, `flow_version`, `node_id`, `status`.

    /// No task has the id (never started, or purged after the context TTL): NOT_FOUND.
    pub const TASK_NOT_FOUND: &str = "TASK_NOT_FOUND";
    /// StartTask's `task_id` is not 1 to 128 characters of `A-Z a-z 0-9 . _ : -`:
    /// INVALID_ARGUMENT.
    pub const INVALID_TASK_ID: &str = "INVALID_TASK_ID";
    /// StartTask's or ListTasks' `labels` break the limits (how many, key characters and
    /// lengths, value lengths; `detail` in the metadata): INVALID_ARGUMENT.
    pub const INVALID_LABELS: &str = "INVALID_LABELS";
    /// StartTask's `task_id` belongs to a task of another flow (`flow_id` in the metadata):
    /// ALREADY_EXISTS. Starting the same id of the same flow again returns that task.
    pub const TASK_ID_IN_USE: &str = "TASK_ID_IN_USE";
    /// ResumeTask of a task that does not wait in a human node (`status` and `node_id` in
    /// the metadata): FAILED_PRECONDITION.
    pub const TASK_NOT_WAITING: &str = "TASK_NOT_WAITING";
    /// ResumeTask names another node than the human node the task waits in
    /// (`waiting_node_id` in the metadata): FAILED_PRECONDITION.
    pub const NODE_NOT_WAITING: &str = "NODE_NOT_WAITING";
    /// ResumeTask's input does not match the human node's schema (a BadRequest names each
    /// field as `input/<pointer>`): INVALID_ARGUMENT.
    pub const INVALID_INPUT: &str = "INVALID_INPUT";
    /// CancelTask of a task that already ended (`status` in the metadata):
    /// FAILED_PRECONDITION.
    pub const TASK_ENDED: &str = "TASK_ENDED";
    /// RetryTask of a task that is not FAILED or PARTIAL, or has no failed node:
    /// FAILED_PRECONDITION.
    pub const TASK_NOT_RETRYABLE: &str = "TASK_NOT_RETRYABLE";
    /// A command kept conflicting with the task's own progress; send it again: ABORTED.
    pub const TASK_CONTENDED: &str = "TASK_CONTENDED";
    /// StartTask names a flow (or flow version; 0 is the latest) that is not applied:
    /// NOT_FOUND.
    pub const FLOW_NOT_FOUND: &str = "FLOW_NOT_FOUND";
    /// The task's flow version is not loaded in the orchestrator; apply it again:
    /// FAILED_PRECONDITION.
    pub const FLOW_NOT_LOADED: &str = "FLOW_NOT_LOADED";
    /// ApplyFlow's YAML fails validation (a BadRequest names each problem as
    /// `file:line:column`; `errors` in the metadata counts them): INVALID_ARGUMENT.
    pub const INVALID_FLOW: &str = "INVALID_FLOW";
    /// ApplyFlow of a flow version that is applied with different text; bump `version`:
    /// FAILED_PRECONDITION.
    pub const FLOW_VERSION_CONFLICT: &str = "FLOW_VERSION_CONFLICT";
    /// A list request's `page_token` was not issued by this server: INVALID_ARGUMENT.
    pub const INVALID_PAGE_TOKEN: &str = "INVALID_PAGE_TOKEN";
    /// CreateTaskWebhook's request is not valid (a BadRequest names the field: `url`,
    /// `webhook_id`, `token`, `auth_scheme`, `auth_credentials` or `format`; `field` in the
    /// metadata): INVALID_ARGUMENT.
    pub const INVALID_WEBHOOK: &str = "INVALID_WEBHOOK";
    /// CreateTaskWebhook of a new webhook on a task that has as many as it may have (`limit`
    /// in the metadata): FAILED_PRECONDITION. Delete one, or replace one by its id.
    pub const TOO_MANY_WEBHOOKS: &str = "TOO_MANY_WEBHOOKS";
    /// GetTaskWebhook or DeleteTaskWebhook of a webhook the task does not have
    /// (`webhook_id` in the metadata): NOT_FOUND.
    pub const WEBHOOK_NOT_FOUND: &str = "WEBHOOK_NOT_FOUND";
    /// The task store cannot be reached or is busy; retry later: UNAVAILABLE.
    pub const STORE_UNAVAILABLE: &str = "STORE_UNAVAILABLE";
    /// A store write collided with a concurrent one on a unique key: ABORTED.
    pub const STORE_CONFLICT: &str = "STORE_CONFLICT";
    /// Stored task data cannot be decoded (written by a newer version?): DATA_LOSS.
    pub const STORE_CORRUPT: &str = "STORE_CORRUPT";
    /// The registry serves as many Watch streams as it may to this caller (its identity's
    /// cap, or every slot not held back for routers): `RESOURCE_EXHAUSTED`. The orchestrator
    /// returns it for WatchTask by a caller with `orchestrator.max_watches_per_caller` streams
    /// open (`identity` and `limit` in the metadata).
    pub const TOO_MANY_WATCHES: &str = "TOO_MANY_WATCHES";
    /// The registrant's identity started health probes faster than the registry allows
    /// (`registry.probes_per_second_per_identity`): `RESOURCE_EXHAUSTED` with RetryInfo.
    pub const PROBE_RATE_LIMITED: &str = "PROBE_RATE_LIMITED";
}

/// A status with `code`, `message` and an ErrorInfo of `reason` in [`ERROR_DOMAIN`] carrying
/// `metadata`.
pub fn status_with_reason(
    code: Code,
    message: impl Into<String>,
    reason: &str,
    metadata: impl IntoIterator<Item = (String, String)>,
) -> Status {
    let metadata: HashMap<String, String> = metadata.into_iter().collect();
    Status::with_error_details(
        code,
        message,
        ErrorDetails::with_error_info(reason, ERROR_DOMAIN, metadata),
    )
}

/// Like [`status_with_reason`], plus a `google.rpc.RetryInfo` telling the caller when to retry.
pub fn status_with_retry(
    code: Code,
    message: impl Into<String>,
    reason: &str,
    metadata: impl IntoIterator<Item = (String, String)>,
    retry_after: std::time::Duration,
) -> Status {
    let metadata: HashMap<String, String> = metadata.into_iter().collect();
    let mut details = ErrorDetails::with_error_info(reason, ERROR_DOMAIN, metadata);
    details.set_retry_info(Some(retry_after));
    Status::with_error_details(code, message, details)
}

/// The `google.rpc.RetryInfo` delay of a status, if it carries one.
pub fn retry_after_of(status: &Status) -> Option<std::time::Duration> {
    status
        .get_details_retry_info()
        .and_then(|info| info.retry_delay)
}

/// The ErrorInfo reason of a status, if it carries one.
pub fn reason_of(status: &Status) -> Option<String> {
    status.get_details_error_info().map(|info| info.reason)
}

/// The ErrorInfo metadata of a status (empty when it has none).
pub fn metadata_of(status: &Status) -> HashMap<String, String> {
    status
        .get_details_error_info()
        .map(|info| info.metadata)
        .unwrap_or_default()
}

/// The canonical upper-case name of a gRPC code (`OK`, `NOT_FOUND`, ...), as the gRPC
/// spec (`doc/statuscodes.md`) writes it.
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code;
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// Whether `status` came from failing to open a connection (so nothing was sent): an I/O
/// error refusing or unable to route the connection, or hyper's connect error, anywhere in
/// its sources. A caller may resend such a call anywhere without risk of running it twice.
pub fn is_connect_error(status: &Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(error) = source {
        if let Some(io) = error.downcast_ref::<std::io::Error>()
            && matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionRefused
                    | std::io::ErrorKind::AddrNotAvailable
                    | std::io::ErrorKind::HostUnreachable
                    | std::io::ErrorKind::NetworkUnreachable
            )
        {
            return true;
        }
        let text = error.to_string();
        if text.contains("tcp connect error")
            || text.contains("error trying to connect")
            || text.contains("client error (Connect)")
        {
            return true;
        }
        source = error.source();
    }
    false
}

/// The HTTP status a gRPC code maps to, as grpc-gateway maps them (CANCELLED is 499, the
/// client-closed-request status), for HTTP routes that answer with a service's status.
pub fn http_status(code: Code) -> http::StatusCode {
    use http::StatusCode;
    match code {
        Code::Ok => StatusCode::OK,
        Code::InvalidArgument | Code::OutOfRange => StatusCode::BAD_REQUEST,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::AlreadyExists | Code::Aborted | Code::FailedPrecondition => StatusCode::CONFLICT,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Cancelled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        Code::Unknown | Code::Internal | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// Whether `status` is tonic's own answer to a response that ended without a gRPC status
/// (END_STREAM on a DATA frame with no trailers, or a RST_STREAM(NO_ERROR) that hyper turns
/// into a clean end): UNKNOWN, "missing grpc-status trailer" after HTTP 200, or "grpc-status
/// header missing" after another HTTP status. The gRPC over HTTP/2 protocol requires the
/// status in the trailers, so such a response may have been cut short anywhere.
pub fn is_missing_status(status: &Status) -> bool {
    status.code() == Code::Unknown
        && std::error::Error::source(status).is_none()
        && (status
            .message()
            .starts_with("protocol error: missing grpc-status trailer")
            || status.message().starts_with("grpc-status header missing"))
}

/// Whether `status` came from a request that a live but closing connection never carried to
/// the peer's handler: hyper dropped it unsent (`operation was canceled`: the connection
/// closed or was not ready), the peer refused the stream unprocessed (`REFUSED_STREAM`, RFC
/// 9113 §8.7), the peer's graceful GOAWAY (`NO_ERROR`) left it above the last stream it
/// processes (RFC 9113 §6.8), or a multiplexed link knew nothing was sent ([`Unsent`]) —
/// anywhere in its sources. Unlike [`is_connect_error`] this says nothing against the peer
/// (a draining or connection-rotating server does this); the call may go anywhere again.
pub fn is_unprocessed(status: &Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(error) = source {
        if error.is::<Unsent>() {
            return true;
        }
        if let Some(hyper) = error.downcast_ref::<hyper::Error>()
            && hyper.is_canceled()
        {
            return true;
        }
        if let Some(h2) = error.downcast_ref::<h2::Error>() {
            let refused = h2.is_reset() && h2.reason() == Some(h2::Reason::REFUSED_STREAM);
            let going_away =
                h2.is_go_away() && h2.is_remote() && h2.reason() == Some(h2::Reason::NO_ERROR);
            if refused || going_away {
                return true;
            }
        }
        source = error.source();
    }
    false
}

/// The source of a status for a call that provably never left this process (its stream had
/// ended, or closed before the frame was queued): see [`is_unprocessed`].
#[derive(Debug, thiserror::Error)]
#[error("nothing was sent")]
pub struct Unsent;

/// `status` marked as never sent (its source becomes [`Unsent`]), so [`is_unprocessed`]
/// holds for it.
pub fn unsent(mut status: Status) -> Status {
    status.set_source(std::sync::Arc::new(Unsent));
    status
}

/// INVALID_ARGUMENT / `INVALID_PAYLOAD` for a message whose data part `part` nests `depth`
/// levels deep, over [`reach_proto::json::MAX_DATA_DEPTH`]: metadata `depth` and `limit`, and a
/// `BadRequest` violation on `message.payload.parts[N].data`. What the router answers such a
/// message, and what the SDK's client answers without sending it.
pub fn payload_too_deep(part: usize, depth: usize) -> Status {
    let limit = reach_proto::json::MAX_DATA_DEPTH;
    let mut details = ErrorDetails::with_error_info(
        reason::INVALID_PAYLOAD,
        ERROR_DOMAIN,
        [
            ("depth".to_string(), depth.to_string()),
            ("limit".to_string(), limit.to_string()),
        ],
    );
    details.add_bad_request_violation(
        format!("message.payload.parts[{part}].data"),
        format!("nests {depth} levels deep, over the limit of {limit}"),
    );
    Status::with_error_details(
        Code::InvalidArgument,
        too_deep_message(part, depth),
        details,
    )
}

/// The message of [`payload_too_deep`].
pub fn too_deep_message(part: usize, depth: usize) -> String {
    let limit = reach_proto::json::MAX_DATA_DEPTH;
    format!(
        "payload.parts[{part}] nests {depth} levels deep, over the limit of {limit}; flatten the data (each object or list is one level)"
    )
}

/// `error` and its sources joined with ": ", leaving out a source whose text the line already
/// holds: many errors both print their source and return it from `source()`, and a plain walk
/// (or anyhow's `{:#}`) would repeat it (`task store: unable to open database file: unable to
/// open database file`).
pub fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// `text` cut to `max` characters, with `…` when it was cut: what error messages and tool
/// errors echo of a caller's value, so a message stays small whatever the input.
pub fn cut(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        None => text.to_string(),
        Some((at, _)) => format!("{}…", &text[..at]),
    }
}
