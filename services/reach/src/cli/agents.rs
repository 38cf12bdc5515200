//! `reach agents`: the registered instances, as a table or JSON.

use std::io::Write;
use std::time::SystemTime;

use reach_proto::v1::ListInstancesRequest;
use reach_proto::v1::registry_service_client::RegistryServiceClient;

/// `reach agents`: the registered instances as a table (or JSON), sorted by service.
///
/// # Errors
/// When the registry is unreachable or answers with an error.
pub async fn agents(endpoint: &str, json: bool, out: &mut impl Write) -> anyhow::Result<()> {
    let channel = super::credentials::connect(endpoint).await?;
    let list = RegistryServiceClient::new(channel)
        .max_decoding_message_size(reach_rpc::limits::REGISTRY_LIST_BYTES)
        .list_instances(ListInstancesRequest::default())
        .await
        .map_err(|s| {
            anyhow::anyhow!(
                "registry at {endpoint} refused: {}",
                super::CliError::Rpc(s)
            )
        })?
        .into_inner();
    if json {
        let rows: Vec<serde_json::Value> = list
            .instances
            .iter()
            .map(|i| {
                let spec = i.spec.clone().unwrap_or_default();
                serde_json::json!({
                    "service": spec.service,
                    "instance_id": spec.instance_id,
                    "state": i.state().short_name(),
                    "health_probe_error": i.health_probe_error,
                    "in_flight": i.in_flight,
                    "model_calls_in_flight": i.model_calls_in_flight,
                    "model_slots_free": i.model_slots_free,
                    "max_concurrency": spec.max_concurrency,
                    "endpoint": spec.endpoint,
                    "capabilities": spec.capabilities.iter().map(|c| format!("{}@{}", c.name, c.version)).collect::<Vec<_>>(),
                })
            })
            .collect();
        writeln!(out, "{}", serde_json::to_string_pretty(&rows)?)?;
        return Ok(());
    }
    let mut table = comfy_table::Table::new();
    table
        .load_preset(comfy_table::presets::NOTHING)
        .set_header(vec![
            "SERVICE",
            "INSTANCE",
            "STATE",
            "LOAD",
            "MODEL",
            "ENDPOINT",
            "CAPABILITIES",
            "LEASE",
        ]);
    let now = SystemTime::now();
    for i in &list.instances {
        let spec = i.spec.clone().unwrap_or_default();
        // Unset on an etcd-backed registry, where etcd alone holds the lease's deadline.
        let lease = match i
            .lease_expires_at
            .as_ref()
            .and_then(reach_rpc::time::system_time)
        {
            None => "-".to_string(),
            Some(t) => t.duration_since(now).map_or_else(
                |_| "expired".to_string(),
                |d| format!("{:.1}s", d.as_secs_f64()),
            ),
        };
        table.add_row(vec![
            spec.service,
            spec.instance_id,
            i.state().short_name().to_string(),
            format!("{}/{}", i.in_flight, spec.max_concurrency),
            model_load(i),
            spec.endpoint,
            spec.capabilities
                .iter()
                .map(|c| format!("{}@{}", c.name, c.version))
                .collect::<Vec<_>>()
                .join(","),
            lease,
        ]);
    }
    writeln!(out, "{table}")?;
    writeln!(
        out,
        "{} instances at registry revision {}",
        list.instances.len(),
        list.revision
    )?;
    // Why an instance is still REGISTERED is a sentence, too long for a column.
    let waiting: Vec<_> = list
        .instances
        .iter()
        .filter(|i| !i.health_probe_error.is_empty())
        .collect();
    if !waiting.is_empty() {
        writeln!(out, "not READY yet:")?;
        for i in waiting {
            let id = i.spec.as_ref().map_or("", |s| s.instance_id.as_str());
            writeln!(out, "  {id}: {}", i.health_probe_error)?;
        }
    }
    Ok(())
}

/// Model calls in flight / in flight + free (`2/4`), or `-` for an instance that reports no
/// model load.
fn model_load(instance: &reach_proto::v1::Instance) -> String {
    if instance.model_calls_in_flight == 0 && instance.model_slots_free == 0 {
        "-".to_string()
    } else {
        format!(
            "{}/{}",
            instance.model_calls_in_flight,
            instance
                .model_calls_in_flight
                .saturating_add(instance.model_slots_free)
        )
    }
}
