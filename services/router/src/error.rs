//! Routing errors and their gRPC statuses ([`RouteError`]), and why a router could not be
//! built ([`StartError`]).

use std::collections::BTreeMap;
use std::time::Duration;

use reach_rpc::errors::{reason, status_with_reason, status_with_retry};
use tonic::{Code, Status};

use crate::config::ConfigError;
use crate::key::RouteKey;
use crate::ledger::LedgerError;

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
    /// The target's name is over the limit ([`crate::envelope::MAX_TARGET_NAME_BYTES`]).
    #[error(
        "the message header's target name is {size} bytes, over the limit of {limit} bytes; service, capability and topic names are short identifiers such as complaint.classify"
    )]
    TargetNameTooLong {
        /// The name's length, in bytes.
        size: usize,
        /// The limit, in bytes.
        limit: usize,
    },
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
    /// No routable instance is on the route. When instances of it exist but none is READY
    /// (still REGISTERED behind a failing health probe, DRAINING, …), the message says which
    /// and why instead of listing what else is routable.
    #[error(
        "no routable instance serves {key}; {}",
        not_found_hint(capabilities, services, unroutable)
    )]
    RouteNotFound {
        /// What the message addressed.
        key: RouteKey,
        /// Routable capabilities with instance counts, rendered.
        capabilities: String,
        /// Routable services with instance counts, rendered.
        services: String,
        /// The instances on the route that are not routable, each with its state and why
        /// (at most [`MAX_UNROUTABLE_LISTED`] named), rendered; empty when there are none.
        unroutable: String,
    },
    /// The message's `header.turn` is above the router's `max_turn`: the conversation has
    /// taken more agent hops than allowed (agents calling each other in a loop).
    #[error(
        "message is at turn {turn}, over the router's limit of {limit} agent hops (router max_turn); an agent is probably calling others in a loop: stop the conversation, or raise max_turn if it is really this long"
    )]
    TurnLimitExceeded {
        /// The message's `header.turn`.
        turn: u32,
        /// The router's `max_turn`.
        limit: u32,
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
    /// The instance's reply is larger than the router forwards.
    #[error(
        "the reply of instance {instance} is {size} bytes, over the limit of {limit} bytes (router max_message_bytes); have the agent return large content by url, or raise the limit"
    )]
    ReplyTooLarge {
        /// The encoded size of the reply, in bytes.
        size: usize,
        /// The configured limit, in bytes.
        limit: usize,
        /// The instance that answered.
        instance: String,
    },
    /// The trust policy does not let the caller call the target.
    #[error("{0}")]
    NotAuthorized(reach_trust::Denied),
    /// The caller's deadline passed.
    #[error(
        "the caller's deadline passed {} after the call arrived, before an instance answered; allow more time (grpc-timeout, CallFrame.timeout_ms) or look at the instance's latency",
        readable(*.0)
    )]
    DeadlineExceeded(Duration),
    /// The router has not applied a registry snapshot yet (it is starting, or cannot reach
    /// the registry): it does not know whether anything serves the target. Nothing was sent.
    #[error(
        "the router has not synced with the registry at {registry} yet (it is starting, or cannot reach it), so it cannot tell who serves {key}; nothing was sent: retry shortly"
    )]
    NotSynced {
        /// What the message addressed.
        key: RouteKey,
        /// The registry the router watches.
        registry: String,
    },
    /// The route had instances, but none became ready in time.
    #[error("no instance of {key} became ready within {waited:?}: {detail}; try again")]
    NoReadyInstance {
        /// What the message addressed.
        key: RouteKey,
        /// How long the router waited.
        waited: Duration,
        /// Why the instance tried was not ready (its connection error).
        detail: String,
    },
    /// Every instance of the route is at its concurrency limit and the call could not wait
    /// (too many waiting, or it waited `admission.max_wait`).
    #[error(
        "every instance of {key} is at its concurrency limit; the call was shed, retry after {retry_after:?}"
    )]
    Overloaded {
        /// What the message addressed.
        key: RouteKey,
        /// When the caller should retry.
        retry_after: Duration,
    },
    /// The message's TTL passed before delivery.
    #[error(
        "message expired: created {} ago with a ttl of {}; send a fresh message or a longer header.ttl (header.created_at is stamped by the router when left unset)",
        readable(*age),
        readable(*ttl)
    )]
    MessageExpired {
        /// How old the message is.
        age: Duration,
        /// Its TTL.
        ttl: Duration,
    },
    /// `header.ttl` or `header.created_at` is malformed.
    #[error("invalid {field}: {detail}")]
    InvalidHeader {
        /// The header field.
        field: &'static str,
        /// What is wrong with it.
        detail: String,
    },
    /// No instance serves a compatible version and no adapter bridges the gap.
    #[error(
        "no instance of capability {capability:?} satisfies version {requirement:?} and no adapter in the protocol registry bridges to one; registered versions: {available}"
    )]
    VersionNotSupported {
        /// The capability.
        capability: String,
        /// The caller's semver requirement.
        requirement: String,
        /// The registered versions, rendered.
        available: String,
    },
    /// `header.capability_version` is not a semver requirement.
    #[error(
        "header.capability_version {0:?} is not a semver requirement; use e.g. \"^1.2\" or \">=2, <3\""
    )]
    InvalidVersionRequirement(String),
    /// A data part nests deeper than [`reach_proto::json::MAX_DATA_DEPTH`].
    #[error("{}", reach_rpc::errors::too_deep_message(*part, *depth))]
    PayloadTooDeep {
        /// The index of the part.
        part: usize,
        /// How deep it nests.
        depth: usize,
    },
    /// The payload does not match the capability's input schema.
    #[error("payload of {capability:?} does not match its input schema at {pointer:?}: {detail}")]
    InvalidPayload {
        /// The capability.
        capability: String,
        /// The JSON pointer of the bad field, within the payload's first data part.
        pointer: String,
        /// The schema keyword that failed (`type`, `required`, `format`, ...); empty when
        /// there is no data part to validate.
        keyword: String,
        /// The JSON pointer of that keyword within the schema (`/allOf/0/additionalProperties`);
        /// empty when there is no data part to validate.
        schema_path: String,
        /// What the schema says.
        detail: String,
    },
    /// A version adapter's transform failed.
    #[error(
        "version adapter {adapter} could not rewrite the {direction}: {detail}; {}",
        .direction.hint()
    )]
    AdapterFailed {
        /// The adapter, as `capability from -> to`.
        adapter: String,
        /// Which message it was rewriting.
        direction: AdapterDirection,
        /// What failed.
        detail: String,
    },
}

/// Which message a version adapter was rewriting when it failed: the caller's request (the
/// caller's payload did not fit: INVALID_ARGUMENT) or the instance's reply (INTERNAL).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdapterDirection {
    /// The caller's request, on its way to the instance.
    Request,
    /// The instance's reply, on its way back to the caller.
    Reply,
}

impl AdapterDirection {
    /// What to do about a failure in this direction.
    fn hint(self) -> &'static str {
        match self {
            AdapterDirection::Request => {
                "send a payload of the shape the adapter expects, or ask for a version an instance serves"
            }
            AdapterDirection::Reply => {
                "the instance's reply does not fit the adapter: fix the adapter in the protocol registry, or the agent"
            }
        }
    }
}

impl std::fmt::Display for AdapterDirection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AdapterDirection::Request => "request",
            AdapterDirection::Reply => "reply",
        })
    }
}

/// How many unroutable instances a ROUTE_NOT_FOUND message names; the rest are counted.
pub const MAX_UNROUTABLE_LISTED: usize = 3;

/// What follows "no routable instance serves …": why the route's instances are not routable
/// when it has some, or else what is routable (the name may be wrong).
fn not_found_hint(capabilities: &str, services: &str, unroutable: &str) -> String {
    if unroutable.is_empty() {
        format!(
            "routable capabilities: {capabilities}; routable services: {services}. Start an agent that serves it, or check the name"
        )
    } else {
        format!(
            "instances serve it but none is READY: {unroutable}. An instance is routable once READY or BUSY; `reach agents` shows each instance's state and why"
        )
    }
}

impl RouteError {
    /// Builds [`RouteError::RouteNotFound`] from the table's summary and `unroutable`: the
    /// route's instances that are not routable, as `(instance id, state, why)` sorted by id,
    /// `why` empty when the state says it all (DRAINING, say).
    pub fn route_not_found(
        key: RouteKey,
        capabilities: &BTreeMap<String, usize>,
        services: &BTreeMap<String, usize>,
        unroutable: &[(String, &'static str, String)],
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
        let mut listed: Vec<String> = unroutable
            .iter()
            .take(MAX_UNROUTABLE_LISTED)
            .map(|(id, state, why)| {
                if why.is_empty() {
                    format!("{id} is {state}")
                } else {
                    format!("{id} is {state} ({why})")
                }
            })
            .collect();
        if unroutable.len() > MAX_UNROUTABLE_LISTED {
            listed.push(format!(
                "and {} more",
                unroutable.len() - MAX_UNROUTABLE_LISTED
            ));
        }
        RouteError::RouteNotFound {
            key,
            capabilities: render(capabilities),
            services: render(services),
            unroutable: listed.join("; "),
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
            RouteError::MissingTarget
            | RouteError::TopicNotCallable(_)
            | RouteError::TargetNameTooLong { .. } => {
                status_with_reason(Code::InvalidArgument, message, reason::INVALID_TARGET, [])
            }
            RouteError::InvalidTraceId(_) => {
                status_with_reason(Code::InvalidArgument, message, reason::INVALID_TRACE_ID, [])
            }
            RouteError::RouteNotFound {
                key,
                capabilities,
                services,
                unroutable,
            } => {
                let target = match key {
                    RouteKey::Service(name) => ("service".to_string(), name),
                    RouteKey::Capability(name) => ("capability".to_string(), name),
                    RouteKey::Topic(name) => ("topic".to_string(), name),
                    RouteKey::GrpcService(name) => ("grpc_service".to_string(), name),
                };
                status_with_reason(
                    Code::NotFound,
                    message,
                    reason::ROUTE_NOT_FOUND,
                    [
                        target,
                        ("routable_capabilities".to_string(), capabilities),
                        ("routable_services".to_string(), services),
                    ]
                    .into_iter()
                    .chain(
                        (!unroutable.is_empty())
                            .then(|| ("unroutable_instances".to_string(), unroutable)),
                    ),
                )
            }
            RouteError::ReplyTooLarge { size, limit, .. } => status_with_reason(
                Code::ResourceExhausted,
                message,
                reason::PAYLOAD_TOO_LARGE,
                [
                    ("size_bytes".to_string(), size.to_string()),
                    ("limit_bytes".to_string(), limit.to_string()),
                ],
            ),
            RouteError::PayloadTooLarge { size, limit } => status_with_reason(
                Code::ResourceExhausted,
                message,
                reason::PAYLOAD_TOO_LARGE,
                [
                    ("size_bytes".to_string(), size.to_string()),
                    ("limit_bytes".to_string(), limit.to_string()),
                ],
            ),
            // FAILED_PRECONDITION, not RESOURCE_EXHAUSTED: no quota frees up with time, so
            // sending the same message again can never succeed; the conversation must end.
            RouteError::TurnLimitExceeded { turn, limit } => status_with_reason(
                Code::FailedPrecondition,
                message,
                reason::TURN_LIMIT_EXCEEDED,
                [
                    ("turn".to_string(), turn.to_string()),
                    ("limit".to_string(), limit.to_string()),
                ],
            ),
            // PERMISSION_DENIED / NOT_AUTHORIZED with the identity, action and target.
            RouteError::NotAuthorized(denied) => denied.to_status(),
            RouteError::DeadlineExceeded(_) => status_with_reason(
                Code::DeadlineExceeded,
                message,
                reason::DEADLINE_EXCEEDED,
                [],
            ),
            RouteError::NoReadyInstance { .. } => {
                status_with_reason(Code::Unavailable, message, reason::INSTANCE_UNAVAILABLE, [])
            }
            // Not delivered, and likely to succeed soon: the reason callers already retry.
            RouteError::NotSynced { registry, .. } => status_with_reason(
                Code::Unavailable,
                message,
                reason::INSTANCE_UNAVAILABLE,
                [("registry".to_string(), registry)],
            ),
            RouteError::Overloaded { key, retry_after } => status_with_retry(
                Code::Unavailable,
                message,
                reason::OVERLOADED,
                [
                    ("route".to_string(), key.to_string()),
                    (
                        "retry_after_ms".to_string(),
                        retry_after.as_millis().to_string(),
                    ),
                ],
                retry_after,
            ),
            RouteError::MessageExpired { age, ttl } => status_with_reason(
                Code::DeadlineExceeded,
                message,
                reason::MESSAGE_EXPIRED,
                [
                    ("age_ms".to_string(), age.as_millis().to_string()),
                    ("ttl_ms".to_string(), ttl.as_millis().to_string()),
                ],
            ),
            RouteError::InvalidHeader { field, .. } => status_with_reason(
                Code::InvalidArgument,
                message,
                reason::INVALID_HEADER,
                [("field".to_string(), field.to_string())],
            ),
            RouteError::InvalidVersionRequirement(_) => Status::invalid_argument(message),
            RouteError::VersionNotSupported {
                capability,
                requirement,
                available,
            } => status_with_reason(
                Code::FailedPrecondition,
                message,
                reason::VERSION_NOT_SUPPORTED,
                [
                    ("capability".to_string(), capability),
                    ("requirement".to_string(), requirement),
                    ("available".to_string(), available),
                ],
            ),
            RouteError::PayloadTooDeep { part, depth } => {
                reach_rpc::errors::payload_too_deep(part, depth)
            }
            RouteError::InvalidPayload {
                capability,
                pointer,
                keyword,
                schema_path,
                detail,
            } => {
                let mut details = tonic_types::ErrorDetails::with_error_info(
                    reason::INVALID_PAYLOAD,
                    reach_rpc::errors::ERROR_DOMAIN,
                    [
                        ("capability".to_string(), capability),
                        ("pointer".to_string(), pointer.clone()),
                        ("keyword".to_string(), keyword),
                        ("schema_path".to_string(), schema_path),
                    ],
                );
                details.add_bad_request_violation(pointer, detail);
                <Status as tonic_types::StatusExt>::with_error_details(
                    Code::InvalidArgument,
                    message,
                    details,
                )
            }
            RouteError::AdapterFailed {
                adapter, direction, ..
            } => status_with_reason(
                match direction {
                    AdapterDirection::Request => Code::InvalidArgument,
                    AdapterDirection::Reply => Code::Internal,
                },
                message,
                reason::ADAPTER_FAILED,
                [
                    ("adapter".to_string(), adapter),
                    ("direction".to_string(), direction.to_string()),
                ],
            ),
        }
    }
}

/// Why a [`crate::Router`] could not be built.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A setting cannot work.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// `protocol_registry` names a file that cannot be read or is invalid.
    #[error(transparent)]
    ProtocolRegistry(#[from] reach_protocol::LoadError),
    /// `ledger_endpoint` is not a URL.
    #[error(transparent)]
    Ledger(#[from] LedgerError),
}

/// A duration for people: milliseconds with one decimal below a second, else `humantime`'s
/// form rounded to the millisecond (`3s 250ms`, `6years 11months ...`).
fn readable(duration: Duration) -> String {
    if duration < Duration::from_secs(1) {
        format!("{:.1} ms", duration.as_secs_f64() * 1000.0)
    } else {
        let rounded =
            Duration::from_millis(u64::try_from(duration.as_millis()).unwrap_or(u64::MAX));
        humantime::format_duration(rounded).to_string()
    }
}
