//! Prometheus metrics: the process-wide recorder, every metric name Reach uses (the shared
//! catalogue, [`names`]) and the helpers every service shares ([`GaugeGuard`]); the router, registry, orchestrator and SDK record their own metrics with
//! them in their own `metrics` modules.
//!
//! All durations are in seconds (`*_seconds` histograms with [`LATENCY_BUCKETS`], except
//! the SDK handler histogram with [`HANDLER_BUCKETS`], since model calls take minutes).
//! Status labels are gRPC code names (`OK`, `UNAVAILABLE`, ...; see [`code_label`]).

use std::sync::OnceLock;

/// The handle that renders the Prometheus text format (from metrics-exporter-prometheus).
pub use metrics_exporter_prometheus::PrometheusHandle;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};

/// Histogram buckets (seconds) for request latencies: 0.5 ms to 60 s.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
];

/// Histogram buckets (seconds) for agent handlers, which may call models: 1 ms to 10 min.
pub const HANDLER_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

/// Histogram buckets (seconds) for timer lag: 1 ms to 60 s.
pub const LAG_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Metric names. Labels are listed with each; keep their values bounded (capabilities,
/// instances, states, code names: never ids of messages or tasks).
pub mod names {
    /// Counter `{capability, code}`: calls the router finished; `CANCELLED` when the caller
    /// went away first.
    pub const ROUTER_REQUESTS: &str = "reach_router_requests_total";
    /// Histogram `{capability, code}`: end-to-end latency of routed calls, seconds.
    pub const ROUTER_REQUEST_DURATION: &str = "reach_router_request_duration_seconds";
    /// Gauge `{capability}`: calls the router is forwarding now.
    pub const ROUTER_IN_FLIGHT: &str = "reach_router_in_flight";
    /// Counter `{capability, code}`: streams (`RouterService.Stream`) the router finished;
    /// `CANCELLED` when the caller went away.
    pub const ROUTER_STREAMS: &str = "reach_router_streams_total";
    /// Histogram `{capability, code}`: how long routed streams lived, seconds.
    pub const ROUTER_STREAM_DURATION: &str = "reach_router_stream_duration_seconds";
    /// Gauge `{capability}`: streams (`RouterService.Stream`) the router is forwarding now.
    pub const ROUTER_OPEN_STREAMS: &str = "reach_router_open_streams";
    /// Histogram `{service, instance}`: latency of each attempt to an upstream instance
    /// (calls, retried attempts, deliveries to subscribers), seconds (`reach top` shows its p99).
    pub const ROUTER_INSTANCE_DURATION: &str = "reach_router_instance_duration_seconds";
    /// Counter `{capability}`: retried attempts.
    pub const ROUTER_RETRIES: &str = "reach_router_retries_total";
    /// Counter `{capability, reason}`: calls and streams the router's admission shed with
    /// `OVERLOADED` (`reason`: `max_waiting` when `admission.max_waiting` calls were waiting
    /// for room already, `max_wait` when it waited `admission.max_wait` without room).
    pub const ROUTER_SHED: &str = "reach_router_shed_total";
    /// Counter `{service, instance}`: instances ejected from balancing after failures.
    pub const ROUTER_EJECTIONS: &str = "reach_router_ejections_total";
    /// Gauge: instances the router still routes to after the registry came back without its
    /// state, not yet registered again (`router.registry_restart_grace`).
    pub const ROUTER_UNCONFIRMED_INSTANCES: &str = "reach_router_unconfirmed_instances";
    /// Counter `{message_type, reason}`: failed calls by message type; `reason` is the
    /// ErrorInfo reason, else the gRPC code name.
    pub const ROUTER_MESSAGE_FAILURES: &str = "reach_router_message_failures_total";

    /// Gauge `{state}`: instances by lifecycle state (`registered`, `ready`, `busy`,
    /// `draining`, `offline`).
    pub const REGISTRY_INSTANCES: &str = "reach_registry_instances";
    /// Counter: leases that expired without a heartbeat.
    pub const REGISTRY_LEASE_EXPIRIES: &str = "reach_registry_lease_expiries_total";
    /// Counter `{operation, code}`: registry RPCs (`register`, `heartbeat`, ...).
    pub const REGISTRY_OPERATIONS: &str = "reach_registry_operations_total";

    /// Gauge `{status}`: tasks by status now (`pending`, `dispatched`, `processing`,
    /// `waiting_human`, `succeeded`, `failed`, `partial`, `cancelled`).
    pub const ORCHESTRATOR_TASKS: &str = "reach_orchestrator_tasks";
    /// Counter `{status}`: task status transitions, by the status entered.
    pub const ORCHESTRATOR_TRANSITIONS: &str = "reach_orchestrator_transitions_total";
    /// Histogram: how late timers fire, seconds.
    pub const ORCHESTRATOR_TIMER_LAG: &str = "reach_orchestrator_timer_lag_seconds";
    /// Counter: tasks moved to the dead-letter list.
    pub const ORCHESTRATOR_DEAD_LETTERS: &str = "reach_orchestrator_dead_letters_total";
    /// Counter `{outcome}`: task webhook notifications POSTed (`outcome`: `delivered` for a
    /// 2xx answer, `failed` for a connection error, a timeout or another status).
    pub const WEBHOOK_DELIVERIES: &str = "reach_webhook_deliveries_total";

    /// Histogram `{capability, code}`: agent handler latency, seconds.
    pub const SDK_HANDLER_DURATION: &str = "reach_sdk_handler_duration_seconds";
    /// Gauge `{capability}`: messages waiting for a handler slot.
    pub const SDK_QUEUE_DEPTH: &str = "reach_sdk_queue_depth";
    /// Gauge `{capability}`: messages being handled now.
    pub const SDK_IN_FLIGHT: &str = "reach_sdk_in_flight";
    /// Counter `{model, type}`: tokens model calls spent (`type`: `input` or `output`), from
    /// the agent kit (OpenTelemetry GenAI `gen_ai.client.token.usage`, as a counter).
    pub const GEN_AI_TOKEN_USAGE: &str = "reach_gen_ai_client_token_usage_total";
    /// Histogram `{model}`: model call latency, seconds, with [`super::HANDLER_BUCKETS`]
    /// (OpenTelemetry GenAI `gen_ai.client.operation.duration`).
    pub const GEN_AI_OPERATION_DURATION: &str = "reach_gen_ai_client_operation_duration_seconds";
    /// Counter `{model}`: model calls made (each may take several HTTP attempts).
    pub const GEN_AI_CALLS: &str = "reach_gen_ai_client_calls_total";
    /// Counter `{model, error_type}`: model calls that failed, by ErrorInfo reason in lower
    /// case (`model_timeout`, `model_rate_limited`, ...).
    pub const GEN_AI_ERRORS: &str = "reach_gen_ai_client_errors_total";
    /// Counter `{model, reason}`: HTTP attempts to a model server that were retried
    /// (`reason`: `rate_limited`, `server_error`, `connect`).
    pub const GEN_AI_RETRIES: &str = "reach_gen_ai_client_retries_total";
    /// Counter `{tool, status}`: tool calls the agent kit ran (`status`: `ok` or `error`).
    pub const AGENT_TOOL_CALLS: &str = "reach_agent_tool_calls_total";
    /// Counter `{reason}`: finished spans that were never exported: `queue_full` (the export
    /// queue, `OTEL_BSP_MAX_QUEUE_SIZE`, was full when the span ended), `export_failed` (the
    /// collector refused the batch, could not be reached, or did not answer within the export
    /// timeout), `shutdown` (still queued when shutdown's time limit ran out).
    pub const TELEMETRY_SPANS_DROPPED: &str = "reach_telemetry_spans_dropped_total";
}

/// Why the Prometheus recorder could not be installed.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// Another `metrics` recorder owns this process.
    #[error("cannot install the prometheus recorder: {0}")]
    Install(String),
}

static HANDLE: OnceLock<Result<PrometheusHandle, String>> = OnceLock::new();

/// Whether [`install`] installed the recorder: metric handles looked up before that would be
/// no-ops forever, so cached handles ([`router::RouteMetrics`]) are only taken after it.
static INSTALLED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Installs the process-wide Prometheus recorder on first call and returns a handle to
/// render it; later calls (several services in one process, as `reach dev` runs them)
/// return the same handle. No HTTP listener is started: serve it with
/// [`crate::admin::admin_router`].
///
/// # Errors
/// [`MetricsError::Install`] when another recorder was installed first.
pub fn install() -> Result<PrometheusHandle, MetricsError> {
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets(LATENCY_BUCKETS)
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full(names::SDK_HANDLER_DURATION.to_string()),
                        HANDLER_BUCKETS,
                    )
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full(names::GEN_AI_OPERATION_DURATION.to_string()),
                        HANDLER_BUCKETS,
                    )
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full(names::ORCHESTRATOR_TIMER_LAG.to_string()),
                        LAG_BUCKETS,
                    )
                })
                .map_err(|e| e.to_string())?;
            let handle = builder.install_recorder().map_err(|e| e.to_string())?;
            describe();
            INSTALLED.store(true, std::sync::atomic::Ordering::Release);
            Ok(handle)
        })
        .clone()
        .map_err(MetricsError::Install)
}

fn describe() {
    use ::metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    use names::*;
    describe_counter!(ROUTER_REQUESTS, "calls the router finished");
    describe_histogram!(
        ROUTER_REQUEST_DURATION,
        Unit::Seconds,
        "latency of routed calls"
    );
    describe_gauge!(ROUTER_IN_FLIGHT, "calls the router is forwarding now");
    describe_counter!(ROUTER_STREAMS, "streams the router finished");
    describe_gauge!(ROUTER_OPEN_STREAMS, "streams the router is forwarding now");
    describe_histogram!(
        ROUTER_STREAM_DURATION,
        Unit::Seconds,
        "how long routed streams lived"
    );
    describe_histogram!(
        ROUTER_INSTANCE_DURATION,
        Unit::Seconds,
        "latency per upstream instance"
    );
    describe_counter!(ROUTER_RETRIES, "retried attempts");
    describe_counter!(ROUTER_SHED, "calls refused because of overload");
    describe_counter!(ROUTER_EJECTIONS, "instances ejected from balancing");
    describe_gauge!(
        ROUTER_UNCONFIRMED_INSTANCES,
        "instances kept routable through a registry restart, not registered again yet"
    );
    describe_counter!(
        ROUTER_MESSAGE_FAILURES,
        "failed calls by message type and reason"
    );
    describe_gauge!(REGISTRY_INSTANCES, "instances by lifecycle state");
    describe_counter!(REGISTRY_LEASE_EXPIRIES, "leases that expired");
    describe_counter!(REGISTRY_OPERATIONS, "registry operations by outcome");
    describe_gauge!(ORCHESTRATOR_TASKS, "tasks by status");
    describe_counter!(ORCHESTRATOR_TRANSITIONS, "task status transitions");
    describe_histogram!(
        ORCHESTRATOR_TIMER_LAG,
        Unit::Seconds,
        "how late timers fire"
    );
    describe_counter!(
        ORCHESTRATOR_DEAD_LETTERS,
        "tasks moved to the dead-letter list"
    );
    describe_counter!(WEBHOOK_DELIVERIES, "task webhook notifications posted");
    describe_histogram!(SDK_HANDLER_DURATION, Unit::Seconds, "agent handler latency");
    describe_gauge!(SDK_QUEUE_DEPTH, "messages waiting for a handler slot");
    describe_gauge!(SDK_IN_FLIGHT, "messages being handled");
    describe_counter!(GEN_AI_TOKEN_USAGE, "tokens model calls spent");
    describe_histogram!(
        GEN_AI_OPERATION_DURATION,
        Unit::Seconds,
        "model call latency"
    );
    describe_counter!(GEN_AI_CALLS, "model calls made");
    describe_counter!(GEN_AI_ERRORS, "model calls that failed");
    describe_counter!(GEN_AI_RETRIES, "model server attempts retried");
    describe_counter!(AGENT_TOOL_CALLS, "tool calls the agent kit ran");
    describe_counter!(TELEMETRY_SPANS_DROPPED, "finished spans never exported");
    describe_gauge!(
        reach_rpc::limits::OPEN_CONNECTIONS,
        "connections a listener is serving"
    );
    describe_counter!(
        reach_rpc::limits::CONNECTIONS_REFUSED,
        "connections a listener closed because of a limit"
    );
    describe_counter!(
        reach_rpc::limits::BUFFER_REFUSALS,
        "calls and streams refused because partly received messages filled a buffer budget"
    );
}

/// The label value of a gRPC code: its canonical upper-case name (`OK`, `NOT_FOUND`, ...).
pub use reach_rpc::errors::code_name as code_label;

/// Decrements a gauge when dropped; the services' `*_in_flight` helpers return it.
#[must_use = "the gauge goes back down when this guard is dropped"]
#[derive(Debug)]
pub struct GaugeGuard(::metrics::Gauge);

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.decrement(1.0);
    }
}

impl GaugeGuard {
    /// Increments `gauge` now and decrements it when the guard drops (an in-flight count).
    pub fn raise(gauge: ::metrics::Gauge) -> Self {
        gauge.increment(1.0);
        Self(gauge)
    }
}

/// Whether [`install`] has installed the recorder. Metric handles looked up before that are
/// no-ops forever, so helpers that cache handles take them only once this is true.
pub fn installed() -> bool {
    INSTALLED.load(std::sync::atomic::Ordering::Acquire)
}
