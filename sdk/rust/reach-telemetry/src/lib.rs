//! Observability for every Reach service and the SDK.
//!
//! # Layout
//! - [`config`]: [`TelemetryConfig`], read from `REACH_LOG`, `REACH_LOG_FORMAT` and the
//!   standard `OTEL_*` variables (or an injected map, for tests).
//! - [`init`](mod@init): [`init()`] installs the process-wide `tracing` subscriber (log lines
//!   plain or JSON, spans to OpenTelemetry, OTLP/gRPC export batched and bounded) and returns
//!   the [`TelemetryGuard`] whose `shutdown` flushes with a time limit.
//! - [`propagation`]: W3C `traceparent` in gRPC metadata and HTTP headers, the envelope's
//!   `trace_id` as the OpenTelemetry trace id ([`message_span`], [`current_trace_id`]).
//! - [`grpc`]: tower middleware: [`traced`] / [`GrpcServerTraceLayer`] for servers,
//!   [`traced_channel`] / [`GrpcClientTraceLayer`] for clients.
//! - [`metrics`]: the Prometheus recorder ([`metrics::install`]), every metric name
//!   ([`metrics::names`]) and recording helpers per service.
//! - [`admin`]: the HTTP admin router (`/metrics`, `/health`).
//! - [`top`]: `reach top`, the live terminal board.

pub mod admin;
pub mod config;
pub mod grpc;
pub mod init;
pub mod metrics;
pub mod propagation;
pub mod top;

pub use admin::{admin_router, serve_admin};
pub use config::{DEFAULT_LOG_FILTER, LogFormat, TelemetryConfig};
pub use grpc::{GrpcClientTraceLayer, GrpcServerTraceLayer, traced, traced_channel};
pub use init::{InitError, ShutdownError, TelemetryGuard, dispatch, init};
pub use propagation::{
    current_trace_id, inject_current, inject_trace_context, message_span, record_status,
    set_parent_from_metadata,
};
