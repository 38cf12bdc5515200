//! The first health probe: a `grpc.health.v1.Health/Check` of the instance's endpoint. An
//! instance becomes READY only once it answers SERVING, so the router never sends work to an
//! endpoint that is not listening yet. Until then each new reason the probe fails for is
//! logged once and recorded as the instance's `health_probe_error`, so `reach agents` and the
//! router's ROUTE_NOT_FOUND can say why the instance is still REGISTERED.

use std::time::Duration;

use std::sync::Arc;

use reach_rpc::backoff::Backoff;
use reach_trust::Identity;
use reach_trust::tls::TlsSource;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
use tracing::{debug, info};

/// The gRPC service every agent serves; its health status is what the probe checks.
const AGENT_SERVICE: &str = "reach.v1.AgentService";

/// TLS for probes: the registry's certificates, and the identity the instance must prove
/// (`spiffe://<td>/agent/<service>`; `None` checks only that it is of the trust domain).
pub type ProbeTls = (Arc<TlsSource>, Option<Identity>);

/// What a first health probe reports to: the registry backend that holds the instance.
pub trait ProbeTarget: Send + Sync + 'static {
    /// How long one probe attempt may take.
    fn probe_timeout(&self) -> Duration;
    /// Whether the probe of `lease_id` should go on (the lease lives, the probe has not
    /// passed, and this replica still probes the instance).
    fn should_probe(&self, instance_id: &str, lease_id: &str) -> bool;
    /// Records that the probe passed: REGISTERED becomes READY.
    fn probe_passed(&self, instance_id: &str, lease_id: &str) -> impl Future<Output = ()> + Send;
    /// Records why the probe failed; resolves to whether the reason changed.
    fn probe_failed(
        &self,
        instance_id: &str,
        lease_id: &str,
        reason: &str,
    ) -> impl Future<Output = bool> + Send;
}

/// Probes `endpoint` until it answers SERVING or the lease is gone (for etcd: or another
/// replica took over probing it), backing off from 5 ms to
/// 500 ms between attempts, then marks the probe passed. With `tls`, probes connect over TLS
/// presenting the registry's certificate and expecting the instance's identity.
pub async fn probe_until_ready(
    registry: impl ProbeTarget,
    instance_id: String,
    lease_id: String,
    endpoint: String,
    tls: Option<ProbeTls>,
) {
    let timeout = registry.probe_timeout();
    let mut backoff = Backoff::doubling(Duration::from_millis(5), Duration::from_millis(500));
    loop {
        if !registry.should_probe(&instance_id, &lease_id) {
            return;
        }
        match check(&endpoint, timeout, tls.as_ref()).await {
            Ok(()) => {
                registry.probe_passed(&instance_id, &lease_id).await;
                return;
            }
            Err(reason) => {
                if registry
                    .probe_failed(&instance_id, &lease_id, &reason)
                    .await
                {
                    info!(instance = %instance_id, "instance stays REGISTERED: {reason}");
                } else {
                    debug!(instance = %instance_id, "{reason}");
                }
            }
        }
        backoff.wait().await;
    }
}

/// One probe attempt. `Err` is why it failed, as a user reads it: what was asked of whom, what
/// came back, and what the agent must do about it.
async fn check(endpoint: &str, timeout: Duration, tls: Option<&ProbeTls>) -> Result<(), String> {
    let failed = |what: String| format!("health probe: {AGENT_SERVICE} on {endpoint}: {what}");
    let target = tonic::transport::Endpoint::from_shared(endpoint.to_string())
        .map_err(|error| failed(format!("the endpoint is not a URL ({error})")))?
        .connect_timeout(timeout)
        .timeout(timeout);
    let channel = reach_rpc::http2::channel(
        &target,
        tls.map(|(source, _)| source),
        tls.and_then(|(_, expected)| expected.clone()),
    )
    .await
    .map_err(|error| {
        failed(format!(
            "cannot connect ({}); is the agent listening there?",
            reach_rpc::errors::chain(&error)
        ))
    })?;
    let request = HealthCheckRequest {
        // The agent's own service, not the server as a whole: an endpoint that serves
        // something else (a router, say) must not pass for an agent.
        service: AGENT_SERVICE.to_string(),
    };
    let status = match HealthClient::new(channel).check(request).await {
        Ok(response) => response.into_inner().status(),
        Err(status) => {
            return Err(failed(match status.code() {
                Code::NotFound => format!(
                    "NOT_FOUND: the endpoint serves grpc.health.v1 but not for {AGENT_SERVICE}; set {AGENT_SERVICE} to SERVING in its health service"
                ),
                Code::Unimplemented => format!(
                    "UNIMPLEMENTED: the endpoint serves no grpc.health.v1.Health; serve it, with {AGENT_SERVICE} SERVING"
                ),
                Code::DeadlineExceeded | Code::Cancelled => {
                    format!("no answer within {} ms", timeout.as_millis())
                }
                code => format!("{code:?}: {}", status.message()),
            }));
        }
    };
    match status {
        ServingStatus::Serving => Ok(()),
        other => Err(failed(format!(
            "{} (the agent has not reported SERVING yet)",
            other.as_str_name()
        ))),
    }
}
