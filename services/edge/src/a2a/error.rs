//! A2A errors ([`A2aError`]) and their renderings in both bindings: a gRPC status with a
//! `google.rpc.ErrorInfo` in domain `a2a-protocol.org` (the A2A v1 gRPC binding), and a
//! JSON-RPC error object with the A2A code and the same ErrorInfo in `data` (the JSON-RPC
//! binding). Codes and reasons are the specification's error table (A2A v1 §"Error codes"),
//! as the official a2a-sdk maps them.

use std::collections::HashMap;

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

/// The ErrorInfo domain of every A2A error.
pub const A2A_DOMAIN: &str = "a2a-protocol.org";

/// Why the edge refused or failed an A2A request.
#[derive(Debug, thiserror::Error)]
pub enum A2aError {
    /// The task does not exist (or the caller may not see it).
    #[error("task {0:?} not found; list tasks with ListTasks")]
    TaskNotFound(String),
    /// The task has ended, so it cannot be cancelled.
    #[error("task {id:?} is {state} and cannot be cancelled: only tasks that have not ended can")]
    TaskNotCancelable {
        /// The task id.
        id: String,
        /// Its A2A state.
        state: &'static str,
    },
    /// Push notifications are not offered (the card says `pushNotifications: false`).
    #[error(
        "push notifications need the mesh's orchestrator, which this edge cannot reach: stream the task with SubscribeToTask or poll GetTask"
    )]
    PushNotificationNotSupported,
    /// The operation does not apply to the task in its state.
    #[error("{0}")]
    UnsupportedOperation(String),
    /// A part's media type is not accepted.
    #[error("{0}")]
    ContentTypeNotSupported(String),
    /// The mesh answered with something that cannot be an A2A answer.
    #[error("{0}")]
    InvalidAgentResponse(String),
    /// The `A2A-Version` the client asked for is not served.
    #[error(
        "A2A version {0:?} is not supported: this edge serves A2A 1.0; send the header A2A-Version: 1.0 (gRPC metadata a2a-version)"
    )]
    VersionNotSupported(String),
    /// The request's parameters are invalid.
    #[error("{0}")]
    InvalidParams(String),
    /// The request is not a valid JSON-RPC request.
    #[error("{0}")]
    InvalidRequest(String),
    /// The JSON-RPC method does not exist.
    #[error(
        "method {0:?} not found: A2A v1 methods are SendMessage, SendStreamingMessage, GetTask, ListTasks, CancelTask, SubscribeToTask, GetExtendedAgentCard and the TaskPushNotificationConfig methods"
    )]
    MethodNotFound(String),
    /// The JSON-RPC body is not JSON.
    #[error("the body is not JSON: {0}")]
    ParseError(String),
    /// The caller is known only by its client certificate: the edge acts in the mesh with the
    /// caller's bearer token, so that the policy applies to the caller and not to the edge.
    #[error(
        "the A2A edge acts for callers with a bearer token: send Authorization: Bearer <token> (a client certificate alone would make the edge's own identity act for you)"
    )]
    BearerRequired,
    /// The mesh failed the request with a status the caller should see as it is
    /// (UNAVAILABLE, DEADLINE_EXCEEDED, PERMISSION_DENIED, …).
    #[error("{}", .0.message())]
    Mesh(Status),
}

impl A2aError {
    /// The A2A reason (ErrorInfo `reason`), as the specification names it.
    pub fn reason(&self) -> &'static str {
        match self {
            A2aError::TaskNotFound(_) => "TASK_NOT_FOUND",
            A2aError::TaskNotCancelable { .. } => "TASK_NOT_CANCELABLE",
            A2aError::PushNotificationNotSupported => "PUSH_NOTIFICATION_NOT_SUPPORTED",
            A2aError::UnsupportedOperation(_) => "UNSUPPORTED_OPERATION",
            A2aError::ContentTypeNotSupported(_) => "CONTENT_TYPE_NOT_SUPPORTED",
            A2aError::InvalidAgentResponse(_) => "INVALID_AGENT_RESPONSE",
            A2aError::VersionNotSupported(_) => "VERSION_NOT_SUPPORTED",
            A2aError::InvalidParams(_) => "INVALID_PARAMS",
            A2aError::InvalidRequest(_) | A2aError::ParseError(_) => "INVALID_REQUEST",
            A2aError::MethodNotFound(_) => "METHOD_NOT_FOUND",
            A2aError::BearerRequired => "UNAUTHENTICATED",
            A2aError::Mesh(_) => "INTERNAL_ERROR",
        }
    }

    /// The gRPC code of the A2A gRPC binding.
    pub fn code(&self) -> Code {
        match self {
            A2aError::TaskNotFound(_) | A2aError::MethodNotFound(_) => Code::NotFound,
            A2aError::TaskNotCancelable { .. }
            | A2aError::PushNotificationNotSupported
            | A2aError::UnsupportedOperation(_)
            | A2aError::VersionNotSupported(_) => Code::FailedPrecondition,
            A2aError::ContentTypeNotSupported(_)
            | A2aError::InvalidParams(_)
            | A2aError::InvalidRequest(_)
            | A2aError::ParseError(_) => Code::InvalidArgument,
            A2aError::InvalidAgentResponse(_) => Code::Internal,
            A2aError::BearerRequired => Code::Unauthenticated,
            A2aError::Mesh(status) => status.code(),
        }
    }

    /// The JSON-RPC error code of the A2A JSON-RPC binding (-32001… for A2A errors, the
    /// JSON-RPC 2.0 codes otherwise).
    pub fn json_rpc_code(&self) -> i64 {
        match self {
            A2aError::TaskNotFound(_) => -32001,
            A2aError::TaskNotCancelable { .. } => -32002,
            A2aError::PushNotificationNotSupported => -32003,
            A2aError::UnsupportedOperation(_) => -32004,
            A2aError::ContentTypeNotSupported(_) => -32005,
            A2aError::InvalidAgentResponse(_) => -32006,
            A2aError::VersionNotSupported(_) => -32009,
            A2aError::InvalidParams(_) => -32602,
            A2aError::InvalidRequest(_) => -32600,
            A2aError::MethodNotFound(_) => -32601,
            A2aError::ParseError(_) => -32700,
            A2aError::BearerRequired => -32600,
            A2aError::Mesh(_) => -32603,
        }
    }

    /// The ErrorInfo metadata: for a mesh failure, its gRPC code and Reach reason, so a client
    /// can still branch on them.
    fn metadata(&self) -> HashMap<String, String> {
        match self {
            A2aError::Mesh(status) => {
                let mut metadata = HashMap::from([(
                    "grpc_code".to_string(),
                    reach_rpc::errors::code_name(status.code()).to_string(),
                )]);
                if let Some(reason) = reach_rpc::errors::reason_of(status) {
                    metadata.insert("reach_reason".into(), reason);
                }
                metadata
            }
            A2aError::TaskNotFound(id) | A2aError::TaskNotCancelable { id, .. } => {
                HashMap::from([("taskId".to_string(), id.clone())])
            }
            _ => HashMap::new(),
        }
    }

    /// The gRPC status: the binding's code, this message, and an ErrorInfo in
    /// [`A2A_DOMAIN`] with [`A2aError::reason`]. A mesh failure is passed through as the mesh
    /// answered it (code, message and Reach ErrorInfo), since A2A has no error for it.
    pub fn to_status(&self) -> Status {
        match self {
            A2aError::Mesh(status) => return status.clone(),
            // Not an A2A error: the caller's credentials, as the mesh's own ports answer.
            A2aError::BearerRequired => {
                return reach_rpc::errors::status_with_reason(
                    Code::Unauthenticated,
                    self.to_string(),
                    reach_rpc::errors::reason::UNAUTHENTICATED,
                    [],
                );
            }
            _ => {}
        }
        Status::with_error_details(
            self.code(),
            self.to_string(),
            ErrorDetails::with_error_info(self.reason(), A2A_DOMAIN, self.metadata()),
        )
    }

    /// The JSON-RPC `error` object: `{code, message, data: [ErrorInfo]}`, the ErrorInfo
    /// rendered as proto3 JSON with its `@type`, as the a2a-sdk reads it.
    pub fn to_json_rpc(&self) -> serde_json::Value {
        serde_json::json!({
            "code": self.json_rpc_code(),
            "message": self.to_string(),
            "data": [{
                "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                "reason": self.reason(),
                "domain": A2A_DOMAIN,
                "metadata": self.metadata(),
            }],
        })
    }
}

impl From<A2aError> for Status {
    fn from(error: A2aError) -> Self {
        error.to_status()
    }
}

/// The A2A error for a failed orchestrator call about task `id`: NOT_FOUND is
/// [`A2aError::TaskNotFound`], INVALID_ARGUMENT (a resume input the node's schema refused)
/// [`A2aError::InvalidParams`], anything else passed through as [`A2aError::Mesh`].
pub fn task_error(id: &str, status: Status) -> A2aError {
    match status.code() {
        Code::NotFound => A2aError::TaskNotFound(id.to_string()),
        Code::InvalidArgument => A2aError::InvalidParams(status.message().to_string()),
        _ => A2aError::Mesh(status),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_refusal_is_failed_precondition_with_a2a_error_info() {
        let status = A2aError::VersionNotSupported("0.3".into()).to_status();
        assert_eq!(status.code(), Code::FailedPrecondition);
        let info = status.get_error_details().error_info().cloned().unwrap();
        assert_eq!(info.domain, A2A_DOMAIN);
        assert_eq!(info.reason, "VERSION_NOT_SUPPORTED");
        let rpc = A2aError::VersionNotSupported("0.3".into()).to_json_rpc();
        assert_eq!(rpc["code"], -32009);
        assert_eq!(rpc["data"][0]["reason"], "VERSION_NOT_SUPPORTED");
    }

    #[test]
    fn orchestrator_not_found_is_task_not_found() {
        let error = task_error("t1", Status::not_found("no task t1"));
        assert_eq!(error.reason(), "TASK_NOT_FOUND");
        assert_eq!(error.code(), Code::NotFound);
        assert_eq!(error.json_rpc_code(), -32001);
    }
}
