//! When a failed attempt may be sent again.
//!
//! A retry is safe when the request provably never reached a handler (the connection could
//! not be opened, a closing connection never carried it, or the instance refused it while
//! draining), or when the capability is
//! declared `idempotent` in the protocol registry. Everything else — in particular a
//! connection reset after the request was written — may have run the handler, so it is
//! returned to the caller, who may resend with the same `message_id` (the SDK's dedupe window
//! then answers a redelivery to the same instance from its cache instead of running the
//! handler again). Retries also draw from a [`tower::retry::budget::TpsBudget`] (Finagle's
//! `RetryBudget`; gRPC A6 retry throttling has the same intent) so retries cannot multiply
//! load during an outage.

use std::error::Error as _;

use reach_rpc::errors::reason;
use tonic::{Code, Status};

/// What a failed attempt says about delivery and about the instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Classified {
    /// The request never reached a handler: safe to send elsewhere.
    NotDelivered {
        /// Whether the instance failed (connect error) rather than refused (draining).
        instance_failed: bool,
    },
    /// The request may have reached a handler (a reset mid-call, an UNAVAILABLE answer).
    MaybeDelivered {
        /// Whether this counts as an instance failure for outlier ejection.
        instance_failed: bool,
    },
    /// The instance answered with an application status: not a delivery problem.
    Answered,
}

/// Classifies a failed attempt's status.
pub fn classify(status: &Status) -> Classified {
    // Refused before a handler saw it: the instance is draining, or its multiplexed stream
    // has too many calls open.
    if matches!(
        reach_rpc::errors::reason_of(status).as_deref(),
        Some(reason::INSTANCE_DRAINING | reason::OVERLOADED)
    ) {
        return Classified::NotDelivered {
            instance_failed: false,
        };
    }
    let local = status.source().is_some();
    if local && is_connect_error(status) {
        return Classified::NotDelivered {
            instance_failed: true,
        };
    }
    // A closing connection that never carried the request (the instance drains, or rotates
    // its connections): nothing ran, and nothing is wrong with the instance.
    if local && is_unprocessed(status) {
        return Classified::NotDelivered {
            instance_failed: false,
        };
    }
    if local {
        // A transport error after the connection was up: the request may have been read.
        return Classified::MaybeDelivered {
            instance_failed: true,
        };
    }
    match status.code() {
        Code::Unavailable => Classified::MaybeDelivered {
            instance_failed: true,
        },
        _ => Classified::Answered,
    }
}

/// Whether the status came from failing to open a connection (nothing was sent).
pub use reach_rpc::errors::is_connect_error;
/// Whether the status came from a closing connection that never carried the request.
pub use reach_rpc::errors::is_unprocessed;

#[cfg(test)]
mod tests {
    use super::*;
    use reach_rpc::errors::status_with_reason;

    #[test]
    fn refusals_before_a_handler_are_not_delivered_other_failures_may_be() {
        for refused in [reason::INSTANCE_DRAINING, reason::OVERLOADED] {
            let status = status_with_reason(Code::Unavailable, "refused", refused, []);
            assert_eq!(
                classify(&status),
                Classified::NotDelivered {
                    instance_failed: false
                },
                "{refused}"
            );
        }
        assert_eq!(
            classify(&Status::unavailable("the instance went away")),
            Classified::MaybeDelivered {
                instance_failed: true
            }
        );
        assert_eq!(
            classify(&Status::invalid_argument("bad payload")),
            Classified::Answered
        );
    }
}
