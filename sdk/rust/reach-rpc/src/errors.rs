//! Statuses that carry `google.rpc.ErrorInfo`, so programs can branch on a stable reason.

use std::collections::HashMap;

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

/// The ErrorInfo domain of every Reach error.
pub const ERROR_DOMAIN: &str = "reach.dev";

/// Stable ErrorInfo reasons Reach returns.
pub mod reason {
    /// No routable instance serves the addressed service or capability.
    pub const ROUTE_NOT_FOUND: &str = "ROUTE_NOT_FOUND";
    /// The message is larger than the configured limit.
    pub const PAYLOAD_TOO_LARGE: &str = "PAYLOAD_TOO_LARGE";
    /// The header's trace id is not a valid W3C trace id.
    pub const INVALID_TRACE_ID: &str = "INVALID_TRACE_ID";
    /// The message lacks a target or carries an invalid one.
    pub const INVALID_TARGET: &str = "INVALID_TARGET";
    /// The caller's deadline passed before the instance answered.
    pub const DEADLINE_EXCEEDED: &str = "DEADLINE_EXCEEDED";
    /// The instance is draining and takes no new work.
    pub const INSTANCE_DRAINING: &str = "INSTANCE_DRAINING";
    /// No handler is registered for the message's capability.
    pub const CAPABILITY_NOT_HANDLED: &str = "CAPABILITY_NOT_HANDLED";
    /// The lease is unknown or expired.
    pub const LEASE_NOT_FOUND: &str = "LEASE_NOT_FOUND";
    /// An operator drained the instance: it must not register again.
    pub const INSTANCE_DRAINED: &str = "INSTANCE_DRAINED";
    /// The instance could not be reached.
    pub const INSTANCE_UNAVAILABLE: &str = "INSTANCE_UNAVAILABLE";
}

/// A status with `code`, `message` and an ErrorInfo of `reason` in [`ERROR_DOMAIN`] carrying
/// `metadata`.
pub fn status_with_reason(
    code: Code,
    message: impl Into<String>,
    reason: &str,
    metadata: impl IntoIterator<Item = (String, String)>,
) -> Status {
    let metadata: HashMap<String, String> = metadata.into_iter().collect();
    Status::with_error_details(
        code,
        message,
        ErrorDetails::with_error_info(reason, ERROR_DOMAIN, metadata),
    )
}

/// The ErrorInfo reason of a status, if it carries one.
pub fn reason_of(status: &Status) -> Option<String> {
    status.get_details_error_info().map(|info| info.reason)
}

/// The ErrorInfo metadata of a status (empty when it has none).
pub fn metadata_of(status: &Status) -> HashMap<String, String> {
    status
        .get_details_error_info()
        .map(|info| info.metadata)
        .unwrap_or_default()
}
