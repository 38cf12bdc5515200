//! `reach capabilities`: the capabilities the mesh knows (the registry's ListCapabilities),
//! as a table or JSON.

use std::io::Write;

use reach_proto::v1::registry_service_client::RegistryServiceClient;
use reach_proto::v1::{CapabilityDescriptor, DescriptorSource, ListCapabilitiesRequest};

/// What `reach capabilities` shows.
#[derive(Debug, Clone, Default)]
pub struct CapabilitiesArgs {
    /// Only capabilities whose name starts with this ("" for all).
    pub prefix: String,
    /// Print one JSON array (schemas included, as JSON values).
    pub json: bool,
    /// In the table, print each capability's input and output schemas under its row.
    pub schemas: bool,
}

/// `reach capabilities`: the merged capability descriptors of the registry at `endpoint`,
/// sorted by name: name, versions, instances (routable/total), where the description came
/// from, and the description (with `--schemas` or `--json`, the schemas too).
///
/// # Errors
/// When the registry is unreachable or answers with an error.
pub async fn capabilities(
    endpoint: &str,
    args: &CapabilitiesArgs,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let channel = tonic::transport::Endpoint::from_shared(endpoint.to_string())?
        .connect_timeout(std::time::Duration::from_secs(3))
        .connect()
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "cannot reach the registry at {endpoint}: {e}; is `reach dev` running? (--endpoint)"
            )
        })?;
    let list = RegistryServiceClient::new(channel)
        .list_capabilities(ListCapabilitiesRequest {
            name_prefix: args.prefix.clone(),
        })
        .await
        .map_err(|s| anyhow::anyhow!("registry at {endpoint} refused: {}", s.message()))?
        .into_inner();
    if args.json {
        let rows: Vec<serde_json::Value> = list.capabilities.iter().map(json_row).collect();
        writeln!(out, "{}", serde_json::to_string_pretty(&rows)?)?;
        return Ok(());
    }
    let mut table = comfy_table::Table::new();
    table
        .load_preset(comfy_table::presets::NOTHING)
        .set_header(vec![
            "CAPABILITY",
            "VERSIONS",
            "INSTANCES",
            "SOURCE",
            "DESCRIPTION",
        ]);
    for capability in &list.capabilities {
        table.add_row(vec![
            capability.name.clone(),
            capability.versions.join(","),
            format!("{}/{}", capability.routable_instances, capability.instances),
            source_name(capability.source()).to_string(),
            capability.description.clone(),
        ]);
        if args.schemas {
            for (label, schema) in [
                ("input", &capability.input_schema),
                ("output", &capability.output_schema),
            ] {
                if !schema.is_empty() {
                    table.add_row(vec![
                        String::new(),
                        String::new(),
                        String::new(),
                        label.to_string(),
                        schema.clone(),
                    ]);
                }
            }
        }
    }
    writeln!(out, "{table}")?;
    writeln!(
        out,
        "{} capabilities at registry revision {}",
        list.capabilities.len(),
        list.revision
    )?;
    Ok(())
}

/// `protocol_registry`, `registration` or `none`.
fn source_name(source: DescriptorSource) -> &'static str {
    match source {
        DescriptorSource::ProtocolRegistry => "protocol_registry",
        DescriptorSource::Registration => "registration",
        DescriptorSource::None | DescriptorSource::Unspecified => "none",
    }
}

/// One capability as JSON: its schemas as JSON values (`null` when none is declared).
fn json_row(capability: &CapabilityDescriptor) -> serde_json::Value {
    let schema = |text: &str| {
        if text.is_empty() {
            serde_json::Value::Null
        } else {
            serde_json::from_str(text).unwrap_or_else(|_| serde_json::Value::String(text.into()))
        }
    };
    serde_json::json!({
        "name": capability.name,
        "description": capability.description,
        "versions": capability.versions,
        "idempotent": capability.idempotent,
        "routable_instances": capability.routable_instances,
        "instances": capability.instances,
        "source": source_name(capability.source()),
        "input_schema": schema(&capability.input_schema),
        "output_schema": schema(&capability.output_schema),
    })
}
