//! The envelope rules: what the router checks and completes on every message it routes,
//! applied the same way by Call, Stream (its first and every later message), Publish and Reply.
//!
//! Every path calls, in this order:
//! 1. [`EnvelopeRules::admit`], on the message as it arrived: refuses a `header.turn` above
//!    `max_turn` (the loop guard across agents), completes its header (validates
//!    the trace id or assigns one from its [`TraceOrigin`], assigns a message id and a
//!    creation time), checks its size (encoded, with the completed header: the size the
//!    instance receives), how deep its data nests and the target name's length
//!    ([`MAX_TARGET_NAME_BYTES`]);
//! 2. [`EnvelopeRules::deadline`]: checks the TTL (and `created_at` against
//!    `max_clock_skew`) and folds the expiry into the caller's deadline. Call does this once
//!    the call is counted in the route's metrics and the ledger, so expired messages are.
//!
//! [`EnvelopeRules::check_bounds`] is the one size and nesting check of every message: `admit`
//! calls it, and so does every path again after a version adapter rewrote a message.
//!
//! The target itself is read by [`route_key`] (Call, Stream) or [`topic`] (Publish). Also
//! here: the caller's deadline ([`read_deadline`]) and the metadata forwarded to instances
//! ([`forwarded_metadata`], without hop-by-hop fields).

use std::time::{Duration, SystemTime};

use prost::Message as _;
use reach_proto::v1::{Header, ReachMessage, header};
use reach_rpc::deadline;
use reach_rpc::trace::{self, TraceId};
use tokio::time::Instant;
use tonic::metadata::{MetadataMap, MetadataValue};

use crate::config::RouterConfig;
use crate::error::RouteError;
use crate::key::RouteKey;

/// The longest service, capability or topic name the router accepts, in bytes.
pub const MAX_TARGET_NAME_BYTES: usize = 256;

/// The limits every routed message is held to (from the router's config).
#[derive(Debug, Clone, Copy)]
pub struct EnvelopeRules {
    /// The size limit, bytes (encoded protobuf size, header completed).
    pub max_message_bytes: usize,
    /// How far ahead of the router's clock `created_at` may be on a message with a TTL.
    pub max_clock_skew: Duration,
    /// The highest `header.turn` admitted (the loop guard across agents).
    pub max_turn: u32,
}

/// Where a message without a trace id gets one.
#[derive(Debug, Clone, Copy)]
pub enum TraceOrigin<'a> {
    /// The caller's `traceparent` metadata when it is valid, else a fresh id (Call, Publish,
    /// the first message of a stream).
    Caller(&'a MetadataMap),
    /// The trace of the stream the message travels on (a stream's later messages).
    Stream(&'a str),
}

impl EnvelopeRules {
    /// The rules of `config` (`max_message_bytes`, `max_clock_skew`, `max_turn`).
    pub fn of(config: &RouterConfig) -> Self {
        Self {
            max_message_bytes: config.max_message_bytes,
            max_clock_skew: config.max_clock_skew,
            max_turn: config.max_turn,
        }
    }

    /// Checks `message`'s turn, completes its header and checks its size and target name
    /// (see the module docs).
    ///
    /// # Errors
    /// [`RouteError::TurnLimitExceeded`] when `header.turn` is above `max_turn`;
    /// [`RouteError::InvalidTraceId`] for a malformed trace id;
    /// [`RouteError::PayloadTooLarge`] over `max_message_bytes`;
    /// [`RouteError::PayloadTooDeep`] for data nesting deeper than
    /// [`reach_proto::json::MAX_DATA_DEPTH`];
    /// [`RouteError::TargetNameTooLong`] for a target name over [`MAX_TARGET_NAME_BYTES`].
    pub fn admit(
        &self,
        message: &mut ReachMessage,
        origin: TraceOrigin<'_>,
    ) -> Result<(), RouteError> {
        let turn = message.header.as_ref().map_or(0, |h| h.turn);
        if turn > self.max_turn {
            return Err(RouteError::TurnLimitExceeded {
                turn,
                limit: self.max_turn,
            });
        }
        complete_header(message, origin)?;
        self.check_bounds(message)?;
        check_target_name(message.header.as_ref())
    }

    /// The delivery deadline of an admitted message: `deadline` (the caller's, `None` for
    /// none), or the message's TTL expiry when that comes first.
    ///
    /// # Errors
    /// [`RouteError::MessageExpired`] when `created_at + ttl` has passed;
    /// [`RouteError::InvalidHeader`] for a negative TTL, or a `created_at` out of range or
    /// more than `max_clock_skew` ahead of the router's clock.
    pub fn deadline(
        &self,
        message: &ReachMessage,
        deadline: Option<Instant>,
    ) -> Result<Option<Instant>, RouteError> {
        let Some(header) = &message.header else {
            return Ok(deadline);
        };
        Ok(match ttl_expiry(header, self.max_clock_skew)? {
            Some(expiry) => Some(deadline.map_or(expiry, |d| d.min(expiry))),
            None => deadline,
        })
    }

    /// Checks `message`'s encoded size against `max_message_bytes`, and how deep its data
    /// parts nest against [`reach_proto::json::MAX_DATA_DEPTH`] (a message deeper than that
    /// could not be decoded once wrapped in a multiplexed frame).
    ///
    /// # Errors
    /// [`RouteError::PayloadTooLarge`] with both sizes, in bytes;
    /// [`RouteError::PayloadTooDeep`] naming the part and its depth.
    pub fn check_bounds(&self, message: &ReachMessage) -> Result<(), RouteError> {
        let size = message.encoded_len();
        if size > self.max_message_bytes {
            return Err(RouteError::PayloadTooLarge {
                size,
                limit: self.max_message_bytes,
            });
        }
        if let Some((part, depth)) = message.payload.as_ref().and_then(|p| p.too_deep()) {
            return Err(RouteError::PayloadTooDeep { part, depth });
        }
        Ok(())
    }
}

/// Completes a message header in place: validates the trace id or assigns one from
/// `origin`, assigns a message id (UUIDv7) and a creation time when they are unset.
fn complete_header(message: &mut ReachMessage, origin: TraceOrigin<'_>) -> Result<(), RouteError> {
    let header = message.header.get_or_insert_with(Header::default);
    if header.trace_id.is_empty() {
        header.trace_id = match origin {
            TraceOrigin::Caller(metadata) => metadata
                .get(trace::TRACEPARENT)
                .and_then(|v| v.to_str().ok())
                .and_then(TraceId::from_traceparent)
                .unwrap_or_else(TraceId::random)
                .to_string(),
            TraceOrigin::Stream(trace_id) => trace_id.to_string(),
        };
    } else {
        TraceId::parse(&header.trace_id)?;
    }
    if header.message_id.is_empty() {
        header.message_id = trace::new_message_id();
    }
    if header.created_at.is_none() {
        header.created_at = Some(reach_rpc::time::now());
    }
    Ok(())
}

/// When the message's TTL runs out (`None`: no TTL).
///
/// # Errors
/// [`RouteError::MessageExpired`] when `created_at + ttl` has passed;
/// [`RouteError::InvalidHeader`] for a negative TTL, a `created_at` out of range or more than
/// `max_clock_skew` in the future.
fn ttl_expiry(header: &Header, max_clock_skew: Duration) -> Result<Option<Instant>, RouteError> {
    let Some(ttl) = &header.ttl else {
        return Ok(None);
    };
    let ttl = reach_rpc::time::std_duration(ttl).ok_or_else(|| RouteError::InvalidHeader {
        field: "header.ttl",
        detail: "it is negative; leave it unset for no limit".into(),
    })?;
    if ttl.is_zero() {
        return Ok(None);
    }
    let created = header
        .created_at
        .as_ref()
        .and_then(reach_rpc::time::system_time)
        .ok_or_else(|| RouteError::InvalidHeader {
            field: "header.created_at",
            detail: "it is out of range; leave it unset to have the router stamp it".into(),
        })?;
    let now = SystemTime::now();
    if let Ok(ahead) = created.duration_since(now)
        && ahead > max_clock_skew
    {
        return Err(RouteError::InvalidHeader {
            field: "header.created_at",
            detail: format!(
                "it is {:.1} s ahead of the router's clock (allowed: {}, router max_clock_skew); fix the sender's clock, or leave it unset to have the router stamp it",
                ahead.as_secs_f64(),
                humantime::format_duration(max_clock_skew),
            ),
        });
    }
    let age = now.duration_since(created).unwrap_or(Duration::ZERO);
    if age >= ttl {
        return Err(RouteError::MessageExpired { age, ttl });
    }
    Ok(Some(Instant::now() + (ttl - age)))
}

/// How old a message is by its `created_at` (zero when unset, unreadable or in the future).
pub fn age(message: &ReachMessage) -> Duration {
    message
        .header
        .as_ref()
        .and_then(|h| h.created_at.as_ref())
        .and_then(reach_rpc::time::system_time)
        .and_then(|created| SystemTime::now().duration_since(created).ok())
        .unwrap_or_default()
}

/// The message's TTL (zero when unset or negative).
pub fn ttl(message: &ReachMessage) -> Duration {
    message
        .header
        .as_ref()
        .and_then(|h| h.ttl.as_ref())
        .and_then(reach_rpc::time::std_duration)
        .unwrap_or_default()
}

/// Refuses a target name (service, capability or topic) over [`MAX_TARGET_NAME_BYTES`].
fn check_target_name(header: Option<&Header>) -> Result<(), RouteError> {
    if let Some(
        header::Target::Service(name)
        | header::Target::Capability(name)
        | header::Target::Topic(name),
    ) = header.and_then(|h| h.target.as_ref())
        && name.len() > MAX_TARGET_NAME_BYTES
    {
        return Err(RouteError::TargetNameTooLong {
            size: name.len(),
            limit: MAX_TARGET_NAME_BYTES,
        });
    }
    Ok(())
}

/// The route a Call or Stream message takes: its service or capability target.
///
/// # Errors
/// [`RouteError::TopicNotCallable`] for a topic; [`RouteError::MissingTarget`] for none (or
/// an empty name).
pub fn route_key(message: &ReachMessage) -> Result<RouteKey, RouteError> {
    match message.header.as_ref().and_then(|h| h.target.as_ref()) {
        Some(header::Target::Service(name)) if !name.is_empty() => {
            Ok(RouteKey::Service(name.clone()))
        }
        Some(header::Target::Capability(name)) if !name.is_empty() => {
            Ok(RouteKey::Capability(name.clone()))
        }
        Some(header::Target::Topic(topic)) => Err(RouteError::TopicNotCallable(topic.clone())),
        _ => Err(RouteError::MissingTarget),
    }
}

/// The topic a Publish message goes to.
///
/// # Errors
/// [`RouteError::InvalidHeader`] (`header.topic`) when the target is not a topic.
pub fn topic(message: &ReachMessage) -> Result<String, RouteError> {
    match message.header.as_ref().and_then(|h| h.target.as_ref()) {
        Some(header::Target::Topic(topic)) if !topic.is_empty() => Ok(topic.clone()),
        _ => Err(RouteError::InvalidHeader {
            field: "header.topic",
            detail: "Publish needs a topic target; use Call for a service or capability".into(),
        }),
    }
}

/// The trace id and message id of a (completed) message.
pub fn ids_of(message: &ReachMessage) -> (String, String) {
    message
        .header
        .as_ref()
        .map(|h| (h.trace_id.clone(), h.message_id.clone()))
        .unwrap_or_default()
}

/// Reads the caller's deadline from `grpc-timeout`, counted from `started`.
///
/// # Errors
/// [`RouteError::InvalidTimeout`] for a malformed `grpc-timeout`.
pub fn read_deadline(
    metadata: &MetadataMap,
    started: Instant,
) -> Result<Option<Instant>, RouteError> {
    let timeout = deadline::grpc_timeout(metadata).map_err(RouteError::InvalidTimeout)?;
    Ok(timeout.map(|t| started + t))
}

/// Request metadata the router sets on every forwarded message to the verified identity of
/// its caller (a SPIFFE ID, or `anonymous`) when it serves with trust; a value the caller sent
/// is never forwarded. An agent that sees this from a connection whose client certificate is
/// the router's can rely on it without authenticating the caller again.
pub const CALLER_METADATA: &str = "x-reach-caller";

/// Holds a call of `caller` to `key` to the router's trust policy, and makes `metadata` what
/// the instance may see of the caller: [`CALLER_METADATA`] set to the verified identity (and a
/// forged one removed), and, when trust is on, the caller's `authorization` removed unless the
/// policy rule that grants the call says to pass it (`pass_authorization`). Without trust,
/// `authorization` is forwarded as before and no caller is named.
///
/// Typed pass-through calls are matched as capabilities by their gRPC service's full name.
///
/// # Errors
/// [`RouteError::NotAuthorized`] when no rule of a loaded policy grants the call.
pub fn authorize(
    trust: &reach_trust::Trust,
    caller: &reach_trust::Caller,
    key: &RouteKey,
    metadata: &mut MetadataMap,
) -> Result<(), RouteError> {
    use reach_trust::CallTarget;
    metadata.remove(CALLER_METADATA);
    if !trust.is_enabled() {
        return Ok(());
    }
    let target = match key {
        RouteKey::Service(name) => CallTarget::Service(name),
        RouteKey::Capability(name) | RouteKey::GrpcService(name) => CallTarget::Capability(name),
        RouteKey::Topic(name) => CallTarget::Topic(name),
    };
    let grant = trust
        .check_call(caller, target)
        .map_err(RouteError::NotAuthorized)?;
    if !grant.pass_authorization {
        metadata.remove("authorization");
    }
    if let Ok(value) = MetadataValue::try_from(caller.name()) {
        metadata.insert(CALLER_METADATA, value);
    }
    Ok(())
}

/// Connection-specific (hop-by-hop) HTTP fields, which describe the caller's connection to the
/// router and are never forwarded (RFC 9110 §7.6.1; `proxy-authorization` is the router's to
/// consume, `host` names the router, not the instance).
pub const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "host",
    "keep-alive",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "transfer-encoding",
    "upgrade",
];

/// The caller's metadata as forwarded to the instance: end-to-end application metadata
/// (including `authorization`, so agents can authenticate the end caller, as HTTP proxies
/// do) and W3C trace context, without
/// - `grpc-timeout`, which is re-sent as the time that remains;
/// - hop-by-hop fields ([`HOP_BY_HOP`]);
/// - a malformed `traceparent` and the `tracestate` that goes with it (W3C Trace Context §3.3:
///   an invalid parent is ignored, not propagated).
pub fn forwarded_metadata(mut metadata: MetadataMap) -> MetadataMap {
    metadata.remove(deadline::GRPC_TIMEOUT);
    for key in HOP_BY_HOP {
        metadata.remove(key);
    }
    let parent = metadata
        .get(trace::TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .filter(|v| TraceId::from_traceparent(v).is_some());
    match parent {
        None => {
            metadata.remove(trace::TRACEPARENT);
            metadata.remove("tracestate");
        }
        // Valid, with surrounding whitespace a lenient parse allowed: forwarded trimmed.
        Some(parent) if parent.trim() != parent => {
            if let Ok(trimmed) = MetadataValue::try_from(parent.trim()) {
                metadata.insert(trace::TRACEPARENT, trimmed);
            }
        }
        Some(_) => {}
    }
    metadata
}
