//! The registry's metrics: instances per lifecycle state, lease expiries and RPCs by code
//! (names in [`reach_telemetry::metrics::names`]).

use reach_telemetry::metrics::{code_label, names};

/// Sets how many instances are in `state` (lower-case: `ready`, `busy`, ...).
pub fn instances(state: &'static str, count: usize) {
    ::metrics::gauge!(names::REGISTRY_INSTANCES, "state" => state).set(count as f64);
}

/// Counts one expired lease.
pub fn lease_expired() {
    ::metrics::counter!(names::REGISTRY_LEASE_EXPIRIES).increment(1);
}

/// Counts one registry RPC (`operation`: `register`, `heartbeat`, `deregister`, ...).
pub fn operation(operation: &'static str, code: tonic::Code) {
    ::metrics::counter!(
        names::REGISTRY_OPERATIONS,
        "operation" => operation,
        "code" => code_label(code)
    )
    .increment(1);
}
