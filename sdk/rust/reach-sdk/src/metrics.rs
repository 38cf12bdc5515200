//! The agent runtime's metrics: handler latency by capability and code, messages waiting for
//! a slot, messages in flight (names in [`reach_telemetry::metrics::names`]).

use std::time::Duration;

use reach_telemetry::metrics::{GaugeGuard, code_label, names};

/// Records one handled message.
pub fn handler(capability: &str, code: tonic::Code, elapsed: Duration) {
    ::metrics::histogram!(
        names::SDK_HANDLER_DURATION,
        "capability" => capability.to_string(),
        "code" => code_label(code)
    )
    .record(elapsed.as_secs_f64());
}

/// Counts a message waiting for a handler slot (the instance is at `max_concurrency`) until
/// the guard drops: when it gets a slot, or its caller gives up.
pub fn waiting(capability: &str) -> GaugeGuard {
    GaugeGuard::raise(
        ::metrics::gauge!(names::SDK_QUEUE_DEPTH, "capability" => capability.to_string()),
    )
}

/// Counts a message being handled until the guard drops.
pub fn in_flight(capability: &str) -> GaugeGuard {
    GaugeGuard::raise(
        ::metrics::gauge!(names::SDK_IN_FLIGHT, "capability" => capability.to_string()),
    )
}
