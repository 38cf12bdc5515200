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

/// The most capabilities `reach capabilities` reads (page by page); it stops there with a
/// warning.
pub const MAX_LISTED: usize = 10_000;
/// The page size `reach capabilities` asks ListCapabilities for.
const PAGE_SIZE: u32 = 500;

/// `reach capabilities`: the merged capability descriptors of the registry at `endpoint`,
/// sorted by name: name, versions, instances (routable/total), where the description came
/// from, and the description (with `--schemas` or `--json`, the schemas too). Reads every
/// page of ListCapabilities, at most [`MAX_LISTED`] capabilities (then warns on stderr).
/// The table replaces control and bidirectional-override characters in what it prints, so
/// a registry cannot drive the terminal.
///
/// # Errors
/// When the registry is unreachable or answers with an error.
pub async fn capabilities(
    endpoint: &str,
    args: &CapabilitiesArgs,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let channel = super::credentials::connect(endpoint).await?;
    let mut client = RegistryServiceClient::new(channel);
    let mut capabilities: Vec<CapabilityDescriptor> = Vec::new();
    let mut revision = 0;
    let mut token = String::new();
    loop {
        let page = client
            .list_capabilities(ListCapabilitiesRequest {
                name_prefix: args.prefix.clone(),
                page_size: PAGE_SIZE,
                page_token: token.clone(),
            })
            .await
            .map_err(|s| {
                anyhow::anyhow!(
                    "registry at {endpoint} refused: {}",
                    super::CliError::Rpc(s)
                )
            })?
            .into_inner();
        revision = revision.max(page.revision);
        let empty = page.capabilities.is_empty();
        capabilities.extend(page.capabilities);
        if page.next_page_token.is_empty() {
            break;
        }
        if page.next_page_token <= token || empty {
            eprintln!(
                "warning: the registry's next page token does not advance; listing what was read"
            );
            break;
        }
        if capabilities.len() >= MAX_LISTED {
            eprintln!(
                "warning: the registry lists more than {MAX_LISTED} capabilities; showing the first {}; narrow with --prefix",
                capabilities.len()
            );
            break;
        }
        token = page.next_page_token;
    }
    if args.json {
        let rows: Vec<serde_json::Value> = capabilities.iter().map(json_row).collect();
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
    for capability in &capabilities {
        table.add_row(vec![
            printable(&capability.name),
            printable(&capability.versions.join(",")),
            format!("{}/{}", capability.routable_instances, capability.instances),
            source_name(capability.source()).to_string(),
            printable(&capability.description),
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
                        printable(schema),
                    ]);
                }
            }
        }
    }
    writeln!(out, "{table}")?;
    writeln!(
        out,
        "{} capabilities at registry revision {}",
        capabilities.len(),
        revision
    )?;
    Ok(())
}

/// `text` safe to print to a terminal: line breaks kept, tabs as spaces, every other
/// control character (ESC, CR, NUL, C1 controls) and every bidirectional override or
/// isolate character (U+202A to U+202E, U+2066 to U+2069) replaced by U+FFFD. The registry
/// refuses such descriptions; this is defence in depth against another registry.
pub fn printable(text: &str) -> String {
    text.chars()
        .map(|c| match c {
            '\n' => '\n',
            '\t' => ' ',
            c if c.is_control()
                || matches!(c, '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}') =>
            {
                '\u{FFFD}'
            }
            c => c,
        })
        .collect()
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
