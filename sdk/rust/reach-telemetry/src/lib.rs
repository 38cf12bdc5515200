//! Observability for every Reach service and the SDK.
//!
//! # Layout
//! - [`config`] — [`TelemetryConfig`], read from `REACH_LOG`, `REACH_LOG_FORMAT` and the
//!   standard `OTEL_*` variables (or an injected map, for tests).
//! - [`init`](mod@init): [`init()`] installs the process-wide `tracing` subscriber (log lines
//!   plain or JSON, spans to OpenTelemetry, OTLP/gRPC export batched and bounded, dropped spans
//!   counted ([`DroppedSpans`])) and returns the [`TelemetryGuard`] whose `shutdown` flushes
//!   within the export timeout.
//! - [`propagation`] — W3C `traceparent` in gRPC metadata and HTTP headers, the envelope's
//!   `trace_id` as the OpenTelemetry trace id ([`message_span`], [`current_trace_id`]).
//! - [`grpc`] — tower middleware: [`traced`] / [`GrpcServerTraceLayer`] for servers,
//!   [`traced_channel`] / [`GrpcClientTraceLayer`] for clients.
//! - [`metrics`] — the Prometheus recorder ([`metrics::install`]), every metric name
//!   ([`metrics::names`]) and the shared helpers ([`metrics::GaugeGuard`]); each service
//!   records its own metrics in its own `metrics` module.
//! - [`admin`] — the HTTP admin router (`/metrics`, `/health`, `/ready`).
//!
//! # Wiring a service
//!
//! ```text
//! // main: first thing, inside the tokio runtime
//! let config = reach_telemetry::TelemetryConfig::from_env("reach-router")?;
//! let telemetry = reach_telemetry::init(&config)?;
//! let metrics = reach_telemetry::metrics::install()?;          // once per process; idempotent
//!
//! // gRPC server: wrap each generated server (health and reflection stay untraced)
//! let server =
//!     GrpcServer::new().add_service(reach_telemetry::traced(RouterServiceServer::new(router)));
//!
//! // gRPC client: wrap the channel; every call gets a client span and sends traceparent
//! AgentServiceClient::new(reach_telemetry::traced_channel(channel))
//!
//! // handling one message: logs inside carry trace_id and task_id
//! let span = reach_telemetry::message_span("router.call", &message);
//! async { ... reach_telemetry::record_status(&Span::current(), status.code(), status.message()) }
//!     .instrument(span).await
//!
//! // admin port: /metrics, /health and /ready (the gRPC server's health as one flag), plus
//! // the service's own JSON routes
//! let ready = server.readiness();
//! let admin = reach_telemetry::admin_router(metrics, ready).route("/v1/instances", get(list));
//! reach_telemetry::serve_admin(admin_listener, admin, shutdown, grace).await;
//!
//! // on exit, after draining
//! telemetry.shutdown().await?;
//! ```

pub mod admin;
pub mod config;
pub mod grpc;
pub mod init;
pub mod metrics;
pub mod propagation;

pub use admin::{
    ADMIN_MAX_CONNECTIONS, ADMIN_MAX_CONNECTIONS_PER_PEER, ADMIN_PATHS, admin_limits, admin_router,
    serve_admin, serve_admin_with_limits, serve_admin_with_trust,
};
pub use config::{DEFAULT_LOG_FILTER, LogFormat, TelemetryConfig};
pub use grpc::{GrpcClientTraceLayer, GrpcServerTraceLayer, traced, traced_channel};
pub use init::{DroppedSpans, InitError, ShutdownError, TelemetryGuard, dispatch, init};
/// An OpenTelemetry context (a remote parent extracted with [`extract_map`]).
pub use opentelemetry::Context as OtelContext;
pub use propagation::{
    adopt_trace_id, current_trace_id, export_root_span, extract_map, inject_current,
    inject_span_map, inject_trace_context, message_span, message_span_with_parent, record_status,
    remote_parent, set_parent_from_metadata, span_trace_id,
};
