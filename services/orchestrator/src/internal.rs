//! Who may call the orchestrator's internal RPCs. `RecordMessages` writes the message ledger
//! (what `reach dump` and the console's timeline show as recorded by the router), so with
//! trust on only router replicas may call it: the router identity
//! (`spiffe://<trust domain>/router`), or this process's own identity (a process serving the
//! router and the orchestrator together records to itself under one certificate).

use reach_trust::{Caller, Denied, Identity, Trust};

/// Checks that `caller` may record ledger entries (`OrchestratorService.RecordMessages`).
/// With trust off, anyone may.
///
/// # Errors
/// [`Denied`] (`PERMISSION_DENIED` / `NOT_AUTHORIZED`, audited) for any other identity.
pub fn check_record_messages(trust: &Trust, caller: &Caller) -> Result<(), Denied> {
    if !trust.is_enabled() || is_router(trust, caller) {
        return Ok(());
    }
    let denied = Denied {
        identity: caller.name().to_string(),
        action: "record ledger entries in".into(),
        target: "the message ledger".into(),
        reason: format!(
            "only router replicas (spiffe://{}/router) record the messages they route; the ledger is written by the router named in its ledger_endpoint",
            trust.trust_domain()
        ),
    };
    denied.audit();
    Err(denied)
}

/// Whether `caller` is a router replica: the router identity, or this process's own.
fn is_router(trust: &Trust, caller: &Caller) -> bool {
    let Some(identity) = caller.identity() else {
        return false;
    };
    Identity::service(trust.trust_domain(), "router").is_ok_and(|router| router == *identity)
        || trust
            .tls()
            .and_then(|tls| tls.identity())
            .is_some_and(|own| own == *identity)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_trust_off_anyone_records() {
        check_record_messages(&Trust::disabled(), &Caller::anonymous()).unwrap();
    }
}
