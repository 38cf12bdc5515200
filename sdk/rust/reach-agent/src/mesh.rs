//! Tools are capabilities: mesh tools call a capability through the router
//! ([`mesh_tool`]), and [`serve_tools`] serves a registry's tools as capabilities.
//!
//! **Wire shapes.** A mesh tool sends a payload of type [`TOOL_CALL_TYPE`] with one `data`
//! part holding the (validated, repaired) arguments object. A capability served by
//! [`serve_tools`] answers with a payload of type [`TOOL_RESULT_TYPE`] whose data part is the
//! normalised [`ToolResult`] — `ok` or `error` (invalid arguments with their pointers, the
//! tool's own failure) — so a model sees the same structure whether a tool ran here or on
//! another agent. A reply of any other type is read as data: its first data part (else its
//! first text part as a string, else `null`). A failed call's status becomes a tool error
//! ([`ToolError::from_status`]).
//!
//! **Traces.** The tool context carries the agent's trace id, task id and deadline; the
//! call is made inside the `tool.call` span, so the client's `mesh.call` span (and the
//! router's and the serving agent's after it) are its children, in the task's trace.
//!
//! **Discovery.** [`discover`] asks the registry's `ListCapabilities` for the capabilities
//! that declare an input schema (from `protocol-registry.yaml` or from registrations, such
//! as [`serve_tools`] makes) and turns each into a [`MeshToolSpec`]; [`mesh_tools`] turns
//! them into tools. The same tool may then run in this process or on another machine, in
//! another language. Discovery reads every page of `ListCapabilities` (at most
//! [`MAX_DISCOVERED`] capabilities) and skips, with a warning naming it and why, each
//! capability that cannot be a tool: one whose name is no function name
//! ([`crate::tool::function_name`], e.g. `complaint.x__y`), one no instance can take work
//! for now (`routable_instances` is 0), one without an input schema. One bad registration
//! thus never takes the other tools away.

use std::time::Duration;

use reach_proto::v1::registry_service_client::RegistryServiceClient;
use reach_proto::v1::{CapabilityDescriptor, ListCapabilitiesRequest, Payload, ReachMessage};
use reach_sdk::{AgentRuntime, CallOptions, DescribedCapability, HandlerContext, MeshClient};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tonic::Status;
use tonic::transport::Channel;

use crate::result::{ToolError, ToolResult};
use crate::tool::{Tool, ToolContext, ToolDefinitionError, ToolRegistry};

/// The payload type of a tool call sent to a capability.
pub const TOOL_CALL_TYPE: &str = "reach.tool_call";
/// The payload type of a normalised tool result.
pub const TOOL_RESULT_TYPE: &str = "reach.tool_result";
/// The most capabilities [`discover`] reads from the registry; it stops there with a
/// warning.
pub const MAX_DISCOVERED: usize = 10_000;
/// The page size [`discover`] asks `ListCapabilities` for.
const DISCOVERY_PAGE_SIZE: u32 = 500;

/// A capability offered to a model as a tool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MeshToolSpec {
    /// The capability (dotted; the tool's function name maps dots to `__`).
    pub capability: String,
    /// What it does, when to use it and when not.
    pub description: String,
    /// The JSON Schema of its arguments.
    pub input_schema: Value,
    /// The JSON Schema of its result, when declared.
    #[serde(default)]
    pub output_schema: Option<Value>,
    /// A semver requirement on the capability version, when set.
    #[serde(default)]
    pub version: Option<String>,
    /// The longest one call may take (the agent's deadline applies too).
    #[serde(default, with = "humantime_serde")]
    pub timeout: Option<Duration>,
}

impl MeshToolSpec {
    /// A spec with no version requirement and no timeout of its own.
    pub fn new(
        capability: impl Into<String>,
        description: impl Into<String>,
        input_schema: Value,
        output_schema: Option<Value>,
    ) -> Self {
        Self {
            capability: capability.into(),
            description: description.into(),
            input_schema,
            output_schema,
            version: None,
            timeout: None,
        }
    }
}

/// A tool calling `capability` through the router with `client`.
///
/// # Errors
/// [`ToolDefinitionError`] for a capability name that cannot be a function name, or an
/// invalid schema.
pub fn mesh_tool(
    client: MeshClient,
    capability: &str,
    description: &str,
    input_schema: Value,
    output_schema: Option<Value>,
) -> Result<Tool, ToolDefinitionError> {
    mesh_tool_from_spec(
        client,
        MeshToolSpec::new(capability, description, input_schema, output_schema),
    )
}

/// A tool from a [`MeshToolSpec`].
///
/// # Errors
/// As [`mesh_tool`].
pub fn mesh_tool_from_spec(
    client: MeshClient,
    spec: MeshToolSpec,
) -> Result<Tool, ToolDefinitionError> {
    let capability = spec.capability.clone();
    let version = spec.version.clone();
    let own_timeout = spec.timeout;
    Tool::dynamic(
        spec.capability,
        spec.description,
        spec.input_schema,
        spec.output_schema,
        move |arguments: Value, ctx: ToolContext| {
            let client = client.clone();
            let capability = capability.clone();
            let version = version.clone();
            async move {
                let timeout = match (ctx.remaining(), own_timeout) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                let options = CallOptions {
                    timeout,
                    trace_id: (!ctx.trace_id.is_empty()).then(|| ctx.trace_id.clone()),
                    task_id: (!ctx.task_id.is_empty()).then(|| ctx.task_id.clone()),
                    capability_version: version,
                    message_id: None,
                    turn: Some(ctx.turn),
                };
                let payload = Payload::json(TOOL_CALL_TYPE, &arguments);
                let response = client
                    .call(&capability, payload, options)
                    .await
                    .map_err(|status| ToolError::from_status(&status))?;
                reply_data(response.message.and_then(|m| m.payload))
            }
        },
    )
}

impl MeshToolSpec {
    /// The spec of a capability the registry describes (`ListCapabilities`), when it can be
    /// a tool: it declares an input schema (a capability without one takes arguments no
    /// model could be told about) and some instance serves it. Unparseable schemas (the
    /// registry checks them at registration, so only a foreign registry sends them) make it
    /// no tool either.
    pub fn from_descriptor(descriptor: &CapabilityDescriptor) -> Option<Self> {
        if descriptor.input_schema.trim().is_empty() || descriptor.instances == 0 {
            return None;
        }
        let input_schema = serde_json::from_str(&descriptor.input_schema).ok()?;
        let output_schema = match descriptor.output_schema.trim() {
            "" => None,
            text => Some(serde_json::from_str(text).ok()?),
        };
        Some(Self {
            capability: descriptor.name.clone(),
            description: descriptor.description.clone(),
            input_schema,
            output_schema,
            version: None,
            timeout: None,
        })
    }
}

/// The mesh tools on offer: every capability the registry at `registry` describes whose
/// name starts with `prefix` ("" for all) and that can be a tool, sorted by name. Give them
/// to [`mesh_tools`].
///
/// Reads `ListCapabilities` page by page, at most [`MAX_DISCOVERED`] capabilities (then
/// stops with a warning). Skips, with a warning naming the capability and why:
/// - a name that cannot be a function name ([`crate::tool::function_name`] fails, e.g.
///   `complaint.x__y`);
/// - a capability with no routable instance (`routable_instances` is 0: nothing could take
///   the call now);
/// - one without an input schema, or with a schema that is not JSON
///   ([`MeshToolSpec::from_descriptor`]; logged at debug, as it is common).
///
/// # Errors
/// The registry's status (UNAVAILABLE when it cannot be reached).
pub async fn discover(registry: Channel, prefix: &str) -> Result<Vec<MeshToolSpec>, Status> {
    let mut client = RegistryServiceClient::new(registry);
    let mut specs = Vec::new();
    let mut read = 0usize;
    let mut token = String::new();
    loop {
        let response = client
            .list_capabilities(ListCapabilitiesRequest {
                name_prefix: prefix.to_string(),
                page_size: DISCOVERY_PAGE_SIZE,
                page_token: token.clone(),
            })
            .await?
            .into_inner();
        for descriptor in &response.capabilities {
            read += 1;
            if let Some(spec) = tool_spec(descriptor) {
                specs.push(spec);
            }
        }
        if response.next_page_token.is_empty() {
            break;
        }
        // A token that does not move forward would page forever (a foreign registry).
        if response.next_page_token <= token || response.capabilities.is_empty() {
            tracing::warn!(
                token = %response.next_page_token,
                "the registry's next page token does not advance; discovery stops here"
            );
            break;
        }
        if read >= MAX_DISCOVERED {
            tracing::warn!(
                read,
                limit = MAX_DISCOVERED,
                "the registry lists more capabilities than discovery reads; the rest are not tools (narrow the prefix)"
            );
            break;
        }
        token = response.next_page_token;
    }
    Ok(specs)
}

/// The spec of one discovered capability, or `None` (logged) when it cannot be a tool.
fn tool_spec(descriptor: &CapabilityDescriptor) -> Option<MeshToolSpec> {
    if let Err(e) = crate::tool::function_name(&descriptor.name) {
        tracing::warn!(
            capability = %descriptor.name,
            error = %e,
            "skipping a capability that cannot be a tool: its name is no function name"
        );
        return None;
    }
    if descriptor.routable_instances == 0 {
        tracing::warn!(
            capability = %descriptor.name,
            instances = descriptor.instances,
            "skipping a capability that cannot be a tool now: no routable instance serves it"
        );
        return None;
    }
    let spec = MeshToolSpec::from_descriptor(descriptor);
    if spec.is_none() {
        tracing::debug!(
            capability = %descriptor.name,
            "not a mesh tool: no input schema (or one that is not JSON)"
        );
    }
    spec
}

/// Tools for every spec (what discovery produces), into `registry`.
///
/// # Errors
/// The first spec that cannot be a tool, or a duplicate name.
pub fn mesh_tools(
    client: &MeshClient,
    specs: impl IntoIterator<Item = MeshToolSpec>,
    registry: &mut ToolRegistry,
) -> Result<(), ToolDefinitionError> {
    for spec in specs {
        registry.add(mesh_tool_from_spec(client.clone(), spec)?)?;
    }
    Ok(())
}

/// The data of a capability's reply (see the module docs).
fn reply_data(payload: Option<Payload>) -> Result<Value, ToolError> {
    let Some(payload) = payload else {
        return Ok(Value::Null);
    };
    if payload.r#type == TOOL_RESULT_TYPE {
        let value = payload.first_json().unwrap_or(Value::Null);
        let result: ToolResult = serde_json::from_value(value).map_err(|e| {
            ToolError::failed(format!("the capability's tool result is malformed: {e}"))
        })?;
        return match (result.data, result.error) {
            (_, Some(error)) => Err(error),
            (Some(data), None) => Ok(data),
            (None, None) => Ok(Value::Null),
        };
    }
    if let Some(value) = payload.first_json() {
        return Ok(value);
    }
    Ok(payload
        .first_text()
        .map_or(Value::Null, |t| Value::String(t.to_string())))
}

/// Serves every tool of `registry` as a capability of version `1.0.0` on `runtime`.
///
/// Each handler reads the request's first data part (or its first text part, read
/// leniently as argument text), validates and repairs it against the tool's schema, runs
/// the tool with the message's trace, task and deadline, and answers with the normalised
/// result ([`TOOL_RESULT_TYPE`]).
pub fn serve_tools(runtime: AgentRuntime, registry: &ToolRegistry) -> AgentRuntime {
    serve_tools_as(runtime, registry, "1.0.0")
}

/// [`serve_tools`] with capability version `version`.
pub fn serve_tools_as(
    mut runtime: AgentRuntime,
    registry: &ToolRegistry,
    version: &str,
) -> AgentRuntime {
    for tool in registry.iter() {
        let tool = tool.clone();
        let capability = tool.name().to_string();
        let mut described = DescribedCapability::new(&capability, version)
            .description(tool.description())
            .input_schema(tool.input_schema().clone());
        if let Some(output) = tool.output_schema() {
            described = described.output_schema(output.clone());
        }
        runtime = runtime.handle_described(
            described,
            move |ctx: HandlerContext, message: ReachMessage| {
                let tool = tool.clone();
                async move {
                    let tool_ctx = ToolContext {
                        trace_id: ctx.trace_id.clone(),
                        task_id: ctx.task_id.clone(),
                        deadline: ctx.deadline,
                        turn: ctx.turn.saturating_add(1),
                        call_id: ctx.message_id.clone(),
                        tool: tool.name().to_string(),
                    };
                    let payload = message.payload.unwrap_or_default();
                    let result = match payload.first_json() {
                        Some(value) => tool.call_value(value, tool_ctx).await,
                        None => {
                            let text = payload.first_text().unwrap_or_default().to_string();
                            tool.call(&text, tool_ctx).await
                        }
                    };
                    Ok(Payload::json(TOOL_RESULT_TYPE, &result.to_json()))
                }
            },
        );
    }
    runtime
}
