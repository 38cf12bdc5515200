//! The first health probe: a `grpc.health.v1.Health/Check` of the instance's endpoint. An
//! instance becomes READY only once it answers SERVING, so the router never sends work to an
//! endpoint that is not listening yet.

use std::time::Duration;

use reach_rpc::backoff::Backoff;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
use tracing::debug;

use crate::store::Registry;

/// The gRPC service every agent serves; its health status is what the probe checks.
const AGENT_SERVICE: &str = "reach.v1.AgentService";

/// Probes `endpoint` until it answers SERVING or the lease is gone, backing off from 5 ms to
/// 500 ms between attempts, then marks the probe passed.
pub async fn probe_until_ready(
    registry: Registry,
    instance_id: String,
    lease_id: String,
    endpoint: String,
) {
    let timeout = registry.config().probe_timeout;
    let mut backoff = Backoff::doubling(Duration::from_millis(5), Duration::from_millis(500));
    loop {
        if !registry.holds_lease(&instance_id, &lease_id) {
            return;
        }
        match check(&endpoint, timeout).await {
            Ok(true) => {
                registry.probe_passed(&instance_id, &lease_id);
                return;
            }
            Ok(false) => debug!(instance = %instance_id, "health probe: not serving yet"),
            Err(error) => debug!(instance = %instance_id, %error, "health probe failed"),
        }
        backoff.wait().await;
    }
}

async fn check(
    endpoint: &str,
    timeout: Duration,
) -> Result<bool, Box<dyn std::error::Error + Send + Sync>> {
    let channel = tonic::transport::Endpoint::from_shared(endpoint.to_string())?
        .connect_timeout(timeout)
        .timeout(timeout)
        .connect()
        .await?;
    let response = HealthClient::new(channel)
        .check(HealthCheckRequest {
            // The agent's own service, not the server as a whole: an endpoint that serves
            // something else (a router, say) must not pass for an agent.
            service: AGENT_SERVICE.to_string(),
        })
        .await?;
    Ok(response.into_inner().status == ServingStatus::Serving as i32)
}
