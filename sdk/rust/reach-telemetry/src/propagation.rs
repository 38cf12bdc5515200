//! W3C Trace Context (`traceparent`, `tracestate`) across gRPC hops, and the link between a
//! Reach envelope's `trace_id` and the OpenTelemetry trace it belongs to.
//!
//! The envelope's `header.trace_id` IS the OpenTelemetry trace id: [`message_span`] makes the
//! span of a message belong to that trace even when the caller sent no `traceparent`
//! (a Python client, a replayed message), and [`current_trace_id`] gives the edge the id to
//! stamp on new messages.

use std::cell::Cell;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{SpanContext, TraceContextExt};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator};
use reach_proto::v1::{Header, ReachMessage};
use reach_rpc::trace::TraceId;
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The metadata key of the W3C `tracestate` header.
pub const TRACESTATE: &str = "tracestate";

// === carriers ===

/// Adapts tonic metadata to the OpenTelemetry propagation API.
struct MetadataCarrier<'a>(&'a mut MetadataMap);

impl Injector for MetadataCarrier<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(key), Ok(value)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(key, value);
        }
    }
}

struct MetadataReader<'a>(&'a MetadataMap);

impl Extractor for MetadataReader<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// Adapts HTTP headers to the OpenTelemetry propagation API.
struct HeaderCarrier<'a>(&'a mut http::HeaderMap);

impl Injector for HeaderCarrier<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(key), Ok(value)) = (
            http::HeaderName::from_bytes(key.as_bytes()),
            http::HeaderValue::from_str(&value),
        ) {
            self.0.insert(key, value);
        }
    }
}

struct HeaderReader<'a>(&'a http::HeaderMap);

impl Extractor for HeaderReader<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

// === inject / extract ===

/// Writes `span`'s context as `traceparent` (and `tracestate`) into gRPC metadata.
/// Does nothing when the span is disabled or OpenTelemetry is not set up.
pub fn inject_span(span: &Span, metadata: &mut MetadataMap) {
    let cx = span.context();
    TraceContextPropagator::new().inject_context(&cx, &mut MetadataCarrier(metadata));
}

/// Writes the current span's context as `traceparent` (and `tracestate`) into gRPC metadata.
pub fn inject_current(metadata: &mut MetadataMap) {
    inject_span(&Span::current(), metadata);
}

/// Writes `span`'s context as `traceparent` (and `tracestate`) into HTTP headers.
pub fn inject_span_headers(span: &Span, headers: &mut http::HeaderMap) {
    let cx = span.context();
    TraceContextPropagator::new().inject_context(&cx, &mut HeaderCarrier(headers));
}

/// A tonic interceptor that adds the current span's `traceparent` to every outgoing call:
/// `AgentServiceClient::with_interceptor(channel, reach_telemetry::inject_trace_context)`.
///
/// # Errors
/// Never fails; the signature is the one tonic interceptors have.
#[allow(clippy::result_large_err)]
pub fn inject_trace_context(
    mut request: tonic::Request<()>,
) -> Result<tonic::Request<()>, tonic::Status> {
    inject_current(request.metadata_mut());
    Ok(request)
}

/// `span`'s context as W3C `traceparent` / `tracestate` entries of a plain map: the per-call
/// metadata of a multiplexed call (`reach.v1.CallFrame.metadata`).
pub fn inject_span_map(span: &Span, map: &mut std::collections::HashMap<String, String>) {
    let cx = span.context();
    TraceContextPropagator::new().inject_context(&cx, map);
}

/// The remote span context in a plain map's `traceparent` / `tracestate` (a multiplexed call's
/// metadata); an empty context when there is none or it is malformed.
pub fn extract_map(map: &std::collections::HashMap<String, String>) -> opentelemetry::Context {
    TraceContextPropagator::new().extract(map)
}

/// The remote parent carried by gRPC metadata; an empty context when there is no valid
/// `traceparent`.
pub fn extract_metadata(metadata: &MetadataMap) -> opentelemetry::Context {
    TraceContextPropagator::new().extract(&MetadataReader(metadata))
}

/// The remote parent carried by HTTP headers; an empty context when there is no valid
/// `traceparent`.
pub fn extract_headers(headers: &http::HeaderMap) -> opentelemetry::Context {
    TraceContextPropagator::new().extract(&HeaderReader(headers))
}

/// Makes the caller described by `metadata` the parent of `span`, if it sent a valid
/// `traceparent`. Returns whether a parent was set. Call it before the span is entered.
pub fn set_parent_from_metadata(span: &Span, metadata: &MetadataMap) -> bool {
    set_remote_parent(span, extract_metadata(metadata))
}

/// Like [`set_parent_from_metadata`] for HTTP headers.
pub fn set_parent_from_headers(span: &Span, headers: &http::HeaderMap) -> bool {
    set_remote_parent(span, extract_headers(headers))
}

fn set_remote_parent(span: &Span, cx: opentelemetry::Context) -> bool {
    cx.span().span_context().is_valid() && span.set_parent(cx).is_ok()
}

// === trace ids ===

/// The trace id of `span`; `None` when it is disabled or OpenTelemetry is not set up.
pub fn span_trace_id(span: &Span) -> Option<TraceId> {
    let cx = span.context();
    let span_ref = cx.span();
    let sc = span_ref.span_context();
    sc.is_valid().then(|| to_trace_id(sc))
}

/// The trace id of the current span: the id an edge stamps on the `trace_id` of a new
/// message so its envelope and its trace line up.
pub fn current_trace_id() -> Option<TraceId> {
    span_trace_id(&Span::current())
}

fn to_trace_id(sc: &SpanContext) -> TraceId {
    TraceId::parse(&sc.trace_id().to_string()).expect("a valid span context has a valid trace id")
}

thread_local! {
    static NEXT_TRACE_ID: Cell<Option<opentelemetry::trace::TraceId>> = const { Cell::new(None) };
    static NEXT_SPAN_ID: Cell<Option<opentelemetry::trace::SpanId>> = const { Cell::new(None) };
}

/// The id generator installed by [`crate::init()`]: random ids, except while
/// [`adopt_trace_id`] starts a root span that must carry a given trace id.
#[derive(Debug, Default, Clone, Copy)]
pub struct ReachIdGenerator;

impl IdGenerator for ReachIdGenerator {
    fn new_trace_id(&self) -> opentelemetry::trace::TraceId {
        NEXT_TRACE_ID
            .with(Cell::take)
            .unwrap_or_else(|| RandomIdGenerator::default().new_trace_id())
    }

    fn new_span_id(&self) -> opentelemetry::trace::SpanId {
        NEXT_SPAN_ID
            .with(Cell::take)
            .unwrap_or_else(|| RandomIdGenerator::default().new_span_id())
    }
}

/// Makes `span`, which must be a root span not yet entered, the root of trace `trace_id`.
/// Returns whether `span` now belongs to that trace (also when it already did through its
/// parent); `false` when it has a parent in another trace, was already started, or
/// OpenTelemetry is not set up.
pub fn adopt_trace_id(span: &Span, trace_id: TraceId) -> bool {
    let wanted = opentelemetry::trace::TraceId::from_bytes(trace_id.to_bytes());
    NEXT_TRACE_ID.with(|next| next.set(Some(wanted)));
    // Reading the context starts the span, which asks the id generator for a trace id
    // only when the span has no parent.
    let got = span_trace_id(span);
    NEXT_TRACE_ID.with(|next| next.set(None));
    got == Some(trace_id)
}

// === spans that outlive a process ===

/// The parent context of spans under a span that is exported later, possibly by another
/// process ([`export_root_span`]): span `span_id` of trace `trace_id`, sampled. An
/// orchestrator task's node spans hang under the task's span this way, across restarts.
pub fn remote_parent(trace_id: TraceId, span_id: [u8; 8]) -> opentelemetry::Context {
    use opentelemetry::trace::{TraceFlags, TraceState};
    let sc = SpanContext::new(
        opentelemetry::trace::TraceId::from_bytes(trace_id.to_bytes()),
        opentelemetry::trace::SpanId::from_bytes(span_id),
        TraceFlags::SAMPLED,
        true,
        TraceState::default(),
    );
    opentelemetry::Context::new().with_remote_span_context(sc)
}

/// Exports a finished root span of trace `trace_id` with id `span_id`, started at `start`
/// and ended at `end` — a span whose work spanned restarts (an orchestrator task), whose
/// children named it with [`remote_parent`]. `error` marks it failed. Does nothing unless
/// [`crate::init()`] installed the pipeline with an exporter (it uses the global tracer
/// provider and the [`ReachIdGenerator`]).
pub fn export_root_span(
    name: &'static str,
    trace_id: TraceId,
    span_id: [u8; 8],
    (start, end): (std::time::SystemTime, std::time::SystemTime),
    attributes: Vec<(&'static str, String)>,
    error: Option<String>,
) {
    use opentelemetry::trace::{Span as _, Status, Tracer as _};
    let tracer = opentelemetry::global::tracer("reach");
    let builder = tracer
        .span_builder(name)
        .with_start_time(start)
        .with_attributes(
            attributes
                .into_iter()
                .map(|(k, v)| opentelemetry::KeyValue::new(k, v)),
        );
    NEXT_TRACE_ID.with(|next| {
        next.set(Some(opentelemetry::trace::TraceId::from_bytes(
            trace_id.to_bytes(),
        )));
    });
    NEXT_SPAN_ID.with(|next| next.set(Some(opentelemetry::trace::SpanId::from_bytes(span_id))));
    let mut span = tracer.build_with_context(builder, &opentelemetry::Context::new());
    NEXT_TRACE_ID.with(|next| next.set(None));
    NEXT_SPAN_ID.with(|next| next.set(None));
    if let Some(message) = error {
        span.set_status(Status::error(message));
    }
    span.end_with_timestamp(end);
}

// === message spans ===

/// The span of one message's handling, named `otel_name` in OpenTelemetry (`agent.handle`,
/// `router.call`, `orchestrator.node`, ...), a child of the current span, carrying the
/// message's `trace_id`, `task_id`, `message_id`, `message.type`, `source` and target
/// (`capability` / `service` / `topic`) so every log line inside it has them. Fields to
/// fill in later: `instance`, `rpc.grpc.status_code`, `otel.status_code`, `otel.status_description`.
///
/// Its `tracing` target names the role, so log filters can treat them apart:
/// `reach::message::router` (`router.call`), `reach::message::client` (`mesh.call`),
/// `reach::message::agent` (`agent.handle`), `reach::message` (the rest).
/// [`crate::DEFAULT_LOG_FILTER`] keeps the router's and the client's out of log lines.
///
/// When the envelope names a trace the current span is not part of (no `traceparent`
/// arrived), the span becomes the root of the envelope's trace instead, linked to the
/// current span; so the envelope's `trace_id` is always the span's trace id.
pub fn message_span(otel_name: &str, message: &ReachMessage) -> Span {
    message_span_with_parent(otel_name, message, None)
}

/// Like [`message_span`], but a child of `remote` — the caller's span context carried with the
/// message (a multiplexed call's `traceparent` metadata, see [`extract_map`]) — instead of the
/// current span. A `remote` that is absent or invalid falls back to [`message_span`]'s rules.
pub fn message_span_with_parent(
    otel_name: &str,
    message: &ReachMessage,
    remote: Option<opentelemetry::Context>,
) -> Span {
    let empty;
    let header = match &message.header {
        Some(header) => header,
        None => {
            empty = Header::default();
            &empty
        }
    };
    let message_type = message
        .payload
        .as_ref()
        .map(|p| p.r#type.as_str())
        .unwrap_or_default();
    let wanted = TraceId::parse(&header.trace_id).ok();
    // A remote parent is followed when it belongs to the envelope's trace, linked otherwise.
    let (remote, remote_other) = match remote {
        Some(cx) if cx.span().span_context().is_valid() => {
            let same = wanted.is_none_or(|id| to_trace_id(cx.span().span_context()) == id);
            if same {
                (Some(cx), None)
            } else {
                (None, Some(cx))
            }
        }
        _ => (None, None),
    };
    let current = Span::current();
    let current_trace = if remote.is_some() || remote_other.is_some() {
        None
    } else {
        span_trace_id(&current)
    };
    let as_root = remote_other.is_some()
        || (remote.is_none()
            && wanted.is_some()
            && current_trace.is_some()
            && current_trace != wanted);
    let (capability, service, topic) = target_fields(header);
    // A root of the envelope's trace when the current span belongs to another trace.
    let parent = if as_root || remote.is_some() || remote_other.is_some() {
        None
    } else {
        current.id()
    };
    // The span's trace id is the envelope's whenever that is valid (followed, adopted or
    // inherited), so it is set at creation rather than recorded afterwards.
    // One invocation per target: a `tracing` target is fixed at the call site.
    macro_rules! span_with_target {
        ($target:literal) => {
            tracing::info_span!(
                target: $target,
                parent: parent,
                "reach.message",
                otel.name = otel_name,
                trace_id = wanted.as_ref().map(tracing::field::display),
                // Displayed rather than debug-formatted: no escaping pass over each value when the
                // log layer formats the span's fields (ids and names need none).
                task_id = %header.task_id,
                message_id = %header.message_id,
                "message.type" = %message_type,
                source = %header.source,
                capability = capability.map(tracing::field::display),
                service = service.map(tracing::field::display),
                topic = topic.map(tracing::field::display),
                instance = tracing::field::Empty,
                rpc.grpc.status_code = tracing::field::Empty,
                otel.status_code = tracing::field::Empty,
                otel.status_description = tracing::field::Empty,
            )
        };
    }
    let span = match otel_name {
        "router.call" => span_with_target!("reach::message::router"),
        "mesh.call" => span_with_target!("reach::message::client"),
        "agent.handle" => span_with_target!("reach::message::agent"),
        _ => span_with_target!("reach::message"),
    };
    let followed = remote.is_some();
    if let Some(cx) = remote {
        let _ = span.set_parent(cx);
    } else if let Some(cx) = remote_other {
        span.add_link(cx.span().span_context().clone());
    } else if as_root {
        let cx = current.context();
        span.add_link(cx.span().span_context().clone());
    }
    match wanted {
        Some(id) if !followed && (current_trace.is_none() || as_root) => {
            adopt_trace_id(&span, id);
        }
        Some(_) => {}
        None => {
            if let Some(trace_id) = span_trace_id(&span) {
                span.record("trace_id", tracing::field::display(trace_id));
            }
        }
    }
    span
}

fn target_fields(header: &Header) -> (Option<&str>, Option<&str>, Option<&str>) {
    use reach_proto::v1::header::Target;
    match &header.target {
        Some(Target::Capability(c)) => (Some(c.as_str()), None, None),
        Some(Target::Service(s)) => (None, Some(s.as_str()), None),
        Some(Target::Topic(t)) => (None, None, Some(t.as_str())),
        None => (None, None, None),
    }
}

/// Records the gRPC outcome on a span declared with `rpc.grpc.status_code`,
/// `otel.status_code` and `otel.status_description` fields (every span this crate makes):
/// the numeric code, and for failures `otel.status_code = "error"` and the message.
pub fn record_status(span: &Span, code: tonic::Code, message: &str) {
    span.record("rpc.grpc.status_code", code as i32);
    if code != tonic::Code::Ok {
        span.record("otel.status_code", "error");
        if !message.is_empty() {
            span.record("otel.status_description", message);
        }
    }
}
