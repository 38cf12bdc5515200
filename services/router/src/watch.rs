//! Following the registry: a `RegistryService.Watch` stream applied to the routing table,
//! reconnected with capped exponential back-off when it breaks, resuming from the last
//! revision applied (the registry replays what was missed, or sends a snapshot).

use std::sync::Arc;
use std::time::Duration;

use reach_proto::v1::registry_service_client::RegistryServiceClient;
use reach_proto::v1::{Instance, WatchRequest, watch_response};
use reach_rpc::backoff::Backoff;
use tracing::{info, warn};

use crate::table::RoutingTable;

/// Watches the registry at `table.config().registry_endpoint` forever, applying every event.
/// After a broken stream it reconnects (20 ms doubling to 2 s, jittered ±50 %, starting over
/// after every stream that delivered events) and resumes after the last
/// revision it applied: the registry replays the events missed, or sends a snapshot (of a new
/// epoch when it lost its state, see [`RoutingTable::apply_snapshot`]), so the table converges
/// to the registry after any outage. Also runs the expiry of instances kept unconfirmed
/// through a registry restart.
pub async fn follow_registry(table: Arc<RoutingTable>) {
    // Ends with this task (the router's shutdown aborts the watch).
    let _expiry = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(
        table.clone().run_unconfirmed_expiry(),
    ));
    let endpoint = table.config().registry_endpoint.clone();
    let mut backoff = Backoff::doubling(Duration::from_millis(20), Duration::from_secs(2));
    loop {
        let mut received = false;
        let ended = watch_once(&table, &endpoint, &mut received).await;
        // A stream that delivered something was a success: the next break starts over at
        // 20 ms. Jitter keeps a fleet of routers from reconnecting in step.
        if received {
            backoff.reset();
        }
        let delay = backoff.next_delay_with_jitter(0.5, reach_rpc::backoff::uniform_unit());
        match ended {
            Ok(()) => {
                warn!(registry = %endpoint, retry_in = ?delay, "registry watch ended; reconnecting")
            }
            Err(error) => warn!(
                registry = %endpoint,
                retry_in = ?delay,
                error = %reach_rpc::errors::chain(&*error),
                "registry watch failed; reconnecting"
            ),
        }
        tokio::time::sleep(delay).await;
    }
}

/// One watch stream, applied until it ends; sets `received` once an event arrived. A
/// snapshot sent in parts is applied whole, when its last part arrives; a stream that breaks
/// before then changes nothing.
async fn watch_once(
    table: &RoutingTable,
    endpoint: &str,
    received: &mut bool,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let channel = reach_rpc::http2::channel(
        &tonic::transport::Endpoint::from_shared(endpoint.to_string())?
            .connect_timeout(table.config().connect_timeout)
            .tcp_nodelay(true),
        table.trust().tls(),
        None,
    )
    .await?;
    let (epoch, after_revision) = table.position();
    let mut stream = RegistryServiceClient::new(channel)
        .max_decoding_message_size(reach_rpc::limits::REGISTRY_LIST_BYTES)
        .watch(WatchRequest {
            after_revision,
            epoch,
        })
        .await?
        .into_inner();
    info!(registry = %endpoint, after_revision, "watching registry");
    // The parts of a snapshot read so far (see `WatchSnapshot.continues`).
    let mut parts: Vec<Instance> = Vec::new();
    while let Some(event) = stream.message().await? {
        *received = true;
        match event.event {
            Some(watch_response::Event::Snapshot(snapshot)) if snapshot.continues => {
                parts.extend(snapshot.instances);
            }
            Some(watch_response::Event::Snapshot(snapshot)) => {
                let mut instances = std::mem::take(&mut parts);
                instances.extend(snapshot.instances);
                table.apply_snapshot(event.revision, &event.epoch, instances);
            }
            Some(watch_response::Event::Upserted(instance)) => {
                table.apply_upsert(event.revision, instance)
            }
            Some(watch_response::Event::Removed(instance)) => {
                table.apply_remove(event.revision, &instance)
            }
            None => {}
        }
    }
    Ok(())
}
