//! Routing errors and their gRPC statuses.

use std::collections::BTreeMap;
use std::time::Duration;

use reach_rpc::errors::{reason, status_with_reason};
use tonic::{Code, Status};

use crate::table::RouteKey;

/// Why the router refused or failed a message.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    /// The request carries no message.
    #[error(
        "the request has no message: set `message` with a header naming a service or capability"
    )]
    MissingMessage,
    /// The header names no service or capability.
    #[error("the message header has no target: set `header.service` or `header.capability`")]
    MissingTarget,
    /// The header targets a topic, which Call and Stream do not deliver.
    #[error(
        "topic {0:?} cannot be called: Call and Stream deliver to one instance; address a service or capability"
    )]
    TopicNotCallable(String),
    /// The header's trace id is malformed.
    #[error("invalid header.trace_id: {0}; leave it empty to have one assigned")]
    InvalidTraceId(#[from] reach_rpc::trace::TraceIdError),
    /// The `grpc-timeout` header is malformed.
    #[error("{0}")]
    InvalidTimeout(String),
    /// No routable instance is on the route.
    #[error(
        "no routable instance serves {key}; routable capabilities: {capabilities}; routable services: {services}. Start an agent that serves it, or check the name"
    )]
    RouteNotFound {
        /// What the message addressed.
        key: RouteKey,
        /// Routable capabilities with instance counts, rendered.
        capabilities: String,
        /// Routable services with instance counts, rendered.
        services: String,
    },
    /// The message is over the size limit.
    #[error(
        "message is {size} bytes, over the limit of {limit} bytes (router max_message_bytes); send large content by url, or raise the limit"
    )]
    PayloadTooLarge {
        /// The encoded size of the message, in bytes.
        size: usize,
        /// The configured limit, in bytes.
        limit: usize,
    },
    /// The caller's deadline passed.
    #[error("deadline of {0:?} exceeded before the instance answered")]
    DeadlineExceeded(Duration),
    /// The route had instances, but none became ready in time.
    #[error("no instance of {key} became ready within {waited:?}; try again")]
    NoReadyInstance {
        /// What the message addressed.
        key: RouteKey,
        /// How long the router waited.
        waited: Duration,
    },
    /// The balancer failed (internal).
    #[error("route {key} failed: {detail}")]
    Balancer {
        /// What the message addressed.
        key: RouteKey,
        /// What failed.
        detail: String,
    },
}

impl RouteError {
    /// Builds [`RouteError::RouteNotFound`] from the table's summary.
    pub fn route_not_found(
        key: RouteKey,
        capabilities: &BTreeMap<String, usize>,
        services: &BTreeMap<String, usize>,
    ) -> Self {
        let render = |m: &BTreeMap<String, usize>| {
            if m.is_empty() {
                "none".to_string()
            } else {
                m.iter()
                    .map(|(k, n)| format!("{k} ({n})"))
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        };
        RouteError::RouteNotFound {
            key,
            capabilities: render(capabilities),
            services: render(services),
        }
    }
}

impl From<RouteError> for Status {
    fn from(err: RouteError) -> Self {
        let message = err.to_string();
        match err {
            RouteError::MissingMessage | RouteError::InvalidTimeout(_) => {
                Status::invalid_argument(message)
            }
            RouteError::MissingTarget | RouteError::TopicNotCallable(_) => {
                status_with_reason(Code::InvalidArgument, message, reason::INVALID_TARGET, [])
            }
            RouteError::InvalidTraceId(_) => {
                status_with_reason(Code::InvalidArgument, message, reason::INVALID_TRACE_ID, [])
            }
            RouteError::RouteNotFound {
                key,
                capabilities,
                services,
            } => {
                let target = match key {
                    RouteKey::Service(name) => ("service".to_string(), name),
                    RouteKey::Capability(name) => ("capability".to_string(), name),
                };
                status_with_reason(
                    Code::NotFound,
                    message,
                    reason::ROUTE_NOT_FOUND,
                    [
                        target,
                        ("routable_capabilities".to_string(), capabilities),
                        ("routable_services".to_string(), services),
                    ],
                )
            }
            RouteError::PayloadTooLarge { size, limit } => status_with_reason(
                Code::ResourceExhausted,
                message,
                reason::PAYLOAD_TOO_LARGE,
                [
                    ("size_bytes".to_string(), size.to_string()),
                    ("limit_bytes".to_string(), limit.to_string()),
                ],
            ),
            RouteError::DeadlineExceeded(_) => status_with_reason(
                Code::DeadlineExceeded,
                message,
                reason::DEADLINE_EXCEEDED,
                [],
            ),
            RouteError::NoReadyInstance { .. } => {
                status_with_reason(Code::Unavailable, message, reason::INSTANCE_UNAVAILABLE, [])
            }
            RouteError::Balancer { .. } => Status::internal(message),
        }
    }
}
