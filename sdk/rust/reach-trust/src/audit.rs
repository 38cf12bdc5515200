//! Audit events: every refused authorization and every operator action, as a structured
//! tracing event on the target `reach::audit` (fields `who`, `action`, `target`, `decision`,
//! `reason`) and counted in [`AUTHZ_DECISIONS`].

use crate::identity::Caller;

/// Counter of authorization decisions recorded, labelled `action` and `decision`
/// (`allowed` / `denied`).
pub const AUTHZ_DECISIONS: &str = "reach_authz_decisions_total";

/// The outcome of a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Allowed.
    Allowed,
    /// Denied.
    Denied,
}

impl Decision {
    fn as_str(self) -> &'static str {
        match self {
            Self::Allowed => "allowed",
            Self::Denied => "denied",
        }
    }
}

/// Records a decision `caller` got for `action` on `target`.
pub fn record(caller: &Caller, action: &str, target: &str, decision: Decision, reason: &str) {
    metrics::counter!(AUTHZ_DECISIONS, "action" => action.to_string(), "decision" => decision.as_str())
        .increment(1);
    tracing::info!(
        target: "reach::audit",
        who = caller.name(),
        action,
        target,
        decision = decision.as_str(),
        reason,
        "audit"
    );
}

/// Records a refusal: `identity` may not `action` `target`, because `reason` (the fields of a
/// [`crate::Denied`]; see [`crate::Denied::audit`]).
pub fn denied(identity: &str, action: &str, target: &str, reason: &str) {
    metrics::counter!(AUTHZ_DECISIONS, "action" => action.to_string(), "decision" => "denied")
        .increment(1);
    tracing::warn!(
        target: "reach::audit",
        who = %identity,
        action = %action,
        target = %target,
        decision = "denied",
        reason = %reason,
        "audit"
    );
}
