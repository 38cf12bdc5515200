//! `reach call`: one message to a capability through the router, with the SDK's
//! `MeshClient` (CallMux, or unary Call on a router without it), the reply printed as JSON.

use std::io::Write;
use std::time::Duration;

use reach_proto::v1::{Part, Payload, part};
use reach_sdk::{CallOptions, MeshClient};

/// What `reach call` sends.
#[derive(Debug, Clone)]
pub struct CallArgs {
    /// The capability to call.
    pub capability: String,
    /// The payload's message type; `None` sends the capability name, as flows do.
    pub message_type: Option<String>,
    /// One data part: a JSON value, usually an object.
    pub json: Option<serde_json::Value>,
    /// One text part.
    pub text: Option<String>,
    /// The call's deadline.
    pub timeout: Duration,
    /// A semver requirement on the capability's version (`^1`), or `None` for any.
    pub capability_version: Option<String>,
    /// The trace to continue (32 lowercase hex digits); `None` starts a new trace.
    pub trace_id: Option<String>,
}

/// The `source` `reach call` sends as (what the callee sees as the caller).
const SOURCE: &str = "reach.cli";

/// `reach call`: sends one message to `args.capability` through the router at `endpoint`
/// and writes the reply as one JSON object: `{"trace_id", "request_message_id" (the id the
/// request carried: resend with it to be deduplicated), "instance_id", "service", "type" (the
/// reply's message type), "parts": [{"data": …} | {"text": …} | {"raw_base64": …} | {"url":
/// …}]}` (each part also carries `media_type` and `filename` when set).
///
/// # Errors
/// When the router is unreachable, or the router or the agent answers with an error status
/// (its code, message and, when the status carries one, its ErrorInfo reason).
pub async fn call(endpoint: &str, args: CallArgs, out: &mut impl Write) -> anyhow::Result<()> {
    // TLS from REACH_TLS_*; the router knows the caller by its certificate.
    let channel = super::credentials::channel(endpoint).await?;
    let client = MeshClient::new(channel, SOURCE);
    let mut parts = Vec::new();
    if let Some(value) = &args.json {
        parts.push(Part::data(value));
    }
    if let Some(text) = args.text {
        parts.push(Part::text(text));
    }
    let payload = Payload {
        r#type: args.message_type.unwrap_or_else(|| args.capability.clone()),
        parts,
    };
    let options = CallOptions {
        timeout: Some(args.timeout),
        trace_id: args.trace_id,
        capability_version: args.capability_version,
        ..CallOptions::default()
    };
    let reply = client
        .call(&args.capability, payload, options)
        .await
        .map_err(|status| {
            let reason = reach_rpc::errors::reason_of(&status)
                .map(|r| format!(" [{r}]"))
                .unwrap_or_default();
            anyhow::anyhow!(
                "{}{reason}: {}",
                reach_rpc::errors::code_name(status.code()),
                status.message()
            )
        })?;
    let route = reply.route.unwrap_or_default();
    let message = reply.message.unwrap_or_default();
    let payload = message.payload.unwrap_or_default();
    let json = serde_json::json!({
        "trace_id": route.trace_id,
        "request_message_id": route.message_id,
        "instance_id": route.instance_id,
        "service": route.service,
        "type": payload.r#type,
        "parts": payload.parts.iter().map(part_json).collect::<Vec<_>>(),
    });
    writeln!(out, "{}", serde_json::to_string_pretty(&json)?)?;
    Ok(())
}

/// One reply part as JSON: its content under the key naming its kind.
fn part_json(part: &Part) -> serde_json::Value {
    use base64::Engine as _;
    let mut json = serde_json::Map::new();
    match &part.content {
        Some(part::Content::Text(text)) => {
            json.insert("text".into(), text.clone().into());
        }
        Some(part::Content::Data(value)) => {
            json.insert("data".into(), reach_proto::json::from_proto(value));
        }
        Some(part::Content::Raw(bytes)) => {
            let encoded = base64::engine::general_purpose::STANDARD.encode(bytes);
            json.insert("raw_base64".into(), encoded.into());
        }
        Some(part::Content::Url(url)) => {
            json.insert("url".into(), url.clone().into());
        }
        None => {}
    }
    if !part.media_type.is_empty() {
        json.insert("media_type".into(), part.media_type.clone().into());
    }
    if !part.filename.is_empty() {
        json.insert("filename".into(), part.filename.clone().into());
    }
    json.into()
}
