//! [`McpEdge`]: the mesh as one MCP server (Streamable HTTP, stateless as the 2026-07-28
//! revision is), a mapping onto the registry and the router.
//!
//! - `tools/list`: the capabilities of `ListCapabilities` that have a routable instance and
//!   declare an input schema, sorted by tool name, each with its description, input schema,
//!   output schema (when it describes an object, as MCP requires) and `idempotentHint`; with
//!   trust on, only those the caller's policy lets it call. Pages of [`TOOLS_PER_PAGE`].
//! - `tools/call`: the arguments are checked against the capability's input schema (a
//!   failure is a tool error naming each bad field's JSON pointer), then sent through the
//!   router as the capability's data part, under the caller's bearer token, continuing the
//!   caller's trace (`_meta.traceparent`, SEP-414, or the `traceparent` header). The reply's
//!   first data part is `structuredContent`; every part is also rendered as text content.
//!   Whatever the mesh answers with a failure status is a tool error (`isError`), readable by
//!   the model; an unknown tool is the protocol error INVALID_PARAMS.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reach_agent::repair::ArgumentSchema;
use reach_proto::v1 as reach;
use reach_proto::v1::registry_service_client::RegistryServiceClient;
use reach_proto::v1::router_service_client::RouterServiceClient;
use reach_sdk::{CallOptions, MeshClient};
use rmcp::model::{
    CacheScope, CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock,
    Implementation, JsonObject, ListToolsResult, MetaObject, PaginatedRequestParams,
    ServerCapabilities, ServerConfig, Tool, ToolAnnotations,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler};
use serde_json::{Value, json};
use tonic::transport::Channel;

use super::config::McpConfig;
use super::names::ToolNaming;

/// Tools per `tools/list` page.
pub const TOOLS_PER_PAGE: usize = 200;
/// The most registry pages read for one listing (500 capabilities each).
const MAX_CATALOGUE_PAGES: usize = 20;
/// How long a capability's compiled input schema is reused before it is read again.
const SCHEMA_TTL: Duration = Duration::from_secs(5);
/// The most compiled schemas kept (the cache starts over beyond).
const MAX_CACHED_SCHEMAS: usize = 4096;
/// How long an MCP client may treat a tool list as fresh (`ttlMs`, SEP-2549).
const TOOL_LIST_TTL_MS: u64 = 5_000;

/// The channels an [`McpEdge`] calls the mesh on.
#[derive(Debug, Clone)]
pub struct McpChannels {
    /// The registry (tool list and schemas).
    pub registry: Channel,
    /// The router (tool calls) as the edge itself.
    pub router: Channel,
    /// The router on a connection without the edge's client certificate, for calls under a
    /// caller's bearer token (`None` without TLS): the policy then judges the caller, never
    /// the edge (no confused deputy).
    pub as_caller: Option<Channel>,
}

/// The edge's limits, from `[edge]`.
#[derive(Debug, Clone, Copy)]
pub struct McpLimits {
    /// The deadline of one tool call through the router.
    pub call_timeout: Duration,
    /// The largest request body and reply the edge takes (bytes).
    pub max_message_bytes: usize,
}

/// The MCP edge. Cheap to clone; every clone serves any request (no session state).
#[derive(Clone)]
pub struct McpEdge {
    inner: Arc<Inner>,
}

struct Inner {
    config: McpConfig,
    limits: McpLimits,
    registry: RegistryServiceClient<Channel>,
    router: RouterServiceClient<Channel>,
    as_caller: Option<RouterServiceClient<Channel>>,
    mesh: MeshClient,
    trust: Arc<reach_trust::Trust>,
    schemas: Mutex<HashMap<String, CachedSchema>>,
}

/// A capability's compiled input schema (`None`: it declares none), as read at `read`.
#[derive(Clone)]
struct CachedSchema {
    read: Instant,
    schema: Option<Arc<ArgumentSchema>>,
}

/// Who asks, as a method sees it: the caller the trust layer established, and what goes
/// with its calls into the mesh (its `authorization`, its trace).
struct CallerContext {
    caller: reach_trust::Caller,
    authorization: Option<String>,
    traceparent: Option<String>,
}

impl CallerContext {
    fn of(context: &RequestContext<RoleServer>) -> Self {
        let parts = context.extensions.get::<http::request::Parts>();
        let header = |name: &str| {
            parts
                .and_then(|p| p.headers.get(name))
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let traceparent = context
            .meta
            .get("traceparent")
            .and_then(Value::as_str)
            .map(str::to_string)
            .or_else(|| header("traceparent"));
        Self {
            caller: parts.map_or_else(reach_trust::Caller::anonymous, |p| {
                reach_trust::Caller::of(&p.extensions)
            }),
            authorization: header("authorization"),
            traceparent,
        }
    }

    /// `message` with the caller's `authorization` and `traceparent` as metadata.
    fn request<T>(&self, message: T) -> tonic::Request<T> {
        crate::forward::request(
            message,
            self.authorization.as_deref(),
            self.traceparent.as_deref(),
        )
    }
}

impl McpEdge {
    /// An edge calling the mesh on `channels`, listing tools as `trust`'s policy lets each
    /// caller call them.
    pub fn new(
        config: McpConfig,
        limits: McpLimits,
        channels: McpChannels,
        trust: Arc<reach_trust::Trust>,
    ) -> Self {
        let router = |channel: Channel| {
            RouterServiceClient::new(channel)
                .max_decoding_message_size(limits.max_message_bytes + 64 * 1024)
        };
        Self {
            inner: Arc::new(Inner {
                config,
                limits,
                registry: RegistryServiceClient::new(channels.registry)
                    .max_decoding_message_size(reach_rpc::limits::REGISTRY_LIST_BYTES),
                mesh: MeshClient::new(channels.router.clone(), "mcp.edge"),
                router: router(channels.router),
                as_caller: channels.as_caller.map(router),
                trust,
                schemas: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// The edge's settings.
    pub fn config(&self) -> &McpConfig {
        &self.inner.config
    }

    /// The edge's limits.
    pub fn limits(&self) -> McpLimits {
        self.inner.limits
    }

    /// Whether callers are authenticated (trust on).
    pub(super) fn authenticates(&self) -> bool {
        self.inner.trust.is_enabled()
    }

    fn naming(&self) -> ToolNaming {
        self.inner.config.tool_names
    }

    /// The router a caller's call goes through: under its own bearer token when it sent one
    /// and the mesh runs TLS, else the edge's channel.
    fn router_for(&self, caller: &CallerContext) -> RouterServiceClient<Channel> {
        crate::forward::client_for(
            self.inner.as_caller.as_ref(),
            &self.inner.router,
            caller.authorization.as_deref(),
        )
    }

    /// Every capability descriptor the registry lists (bounded by [`MAX_CATALOGUE_PAGES`]).
    async fn descriptors(
        &self,
        caller: &CallerContext,
        name_prefix: &str,
        page_size: u32,
        pages: usize,
    ) -> Result<Vec<reach::CapabilityDescriptor>, tonic::Status> {
        let mut registry = self.inner.registry.clone();
        let mut descriptors = Vec::new();
        let mut token = String::new();
        for _ in 0..pages {
            let page = registry
                .list_capabilities(caller.request(reach::ListCapabilitiesRequest {
                    name_prefix: name_prefix.to_string(),
                    page_size,
                    page_token: token,
                }))
                .await?
                .into_inner();
            descriptors.extend(page.capabilities);
            token = page.next_page_token;
            if token.is_empty() {
                break;
            }
        }
        Ok(descriptors)
    }

    /// The tools `caller` may call, sorted by name.
    async fn tools(&self, caller: &CallerContext) -> Result<Vec<Tool>, tonic::Status> {
        let descriptors = self
            .descriptors(caller, "", 500, MAX_CATALOGUE_PAGES)
            .await?;
        let mut tools: Vec<Tool> = descriptors
            .iter()
            .filter(|d| d.routable_instances > 0)
            .filter(|d| {
                self.inner.trust.would_allow_call(
                    &caller.caller,
                    reach_trust::policy::CallTarget::Capability(&d.name),
                )
            })
            .filter_map(|d| tool_of(self.naming(), d))
            .collect();
        tools.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(tools)
    }

    /// The compiled input schema of `capability` (`None`: it declares none), from the cache
    /// while fresh.
    ///
    /// # Errors
    /// The registry's status; NOT_FOUND when no capability is so named.
    async fn input_schema(
        &self,
        caller: &CallerContext,
        capability: &str,
    ) -> Result<Option<Arc<ArgumentSchema>>, tonic::Status> {
        if let Some(cached) = self.cached_schema(capability) {
            return Ok(cached);
        }
        let descriptor = self
            .descriptors(caller, capability, 1, 1)
            .await?
            .into_iter()
            .find(|d| d.name == capability)
            .ok_or_else(|| {
                tonic::Status::not_found(format!(
                    "no capability is named {capability:?}; list the tools with tools/list"
                ))
            })?;
        let schema = parse_object(&descriptor.input_schema)
            .and_then(|schema| ArgumentSchema::new(Value::Object(schema)).ok())
            .map(Arc::new);
        let mut schemas = self.inner.schemas.lock().unwrap_or_else(|p| p.into_inner());
        if schemas.len() >= MAX_CACHED_SCHEMAS {
            schemas.clear();
        }
        schemas.insert(
            capability.to_string(),
            CachedSchema {
                read: Instant::now(),
                schema: schema.clone(),
            },
        );
        Ok(schema)
    }

    fn cached_schema(&self, capability: &str) -> Option<Option<Arc<ArgumentSchema>>> {
        let schemas = self.inner.schemas.lock().unwrap_or_else(|p| p.into_inner());
        schemas
            .get(capability)
            .filter(|c| c.read.elapsed() < SCHEMA_TTL)
            .map(|c| c.schema.clone())
    }

    /// Calls `capability` with `arguments` for `caller`: the tool result, or a tool error.
    ///
    /// # Errors
    /// INVALID_PARAMS when no capability is so named (an unknown tool, as the MCP spec says).
    async fn call(
        &self,
        caller: &CallerContext,
        tool: &str,
        capability: &str,
        arguments: JsonObject,
    ) -> Result<CallToolResult, ErrorData> {
        let arguments = Value::Object(arguments);
        match self.input_schema(caller, capability).await {
            Ok(Some(schema)) => {
                if let Err(invalid) = schema.validate(&arguments) {
                    return Ok(tool_error(format!("tool {tool:?}: {invalid}")));
                }
            }
            Ok(None) => {}
            Err(status) if status.code() == tonic::Code::NotFound => {
                return Err(ErrorData::invalid_params(
                    format!("no tool is named {tool:?}; list the tools with tools/list"),
                    None,
                ));
            }
            Err(status) => return Ok(mesh_error(tool, &status)),
        }
        Ok(self.send(caller, tool, capability, &arguments).await)
    }

    /// Sends `arguments` through the router to `capability`.
    async fn send(
        &self,
        caller: &CallerContext,
        tool: &str,
        capability: &str,
        arguments: &Value,
    ) -> CallToolResult {
        let payload = reach::Payload::json(capability, arguments);
        if let Some((_, depth)) = payload.too_deep() {
            return tool_error(format!(
                "the arguments of tool {tool:?} nest {depth} levels deep, over the mesh's limit of {}; flatten them",
                reach_proto::json::MAX_DATA_DEPTH
            ));
        }
        let options = CallOptions {
            timeout: Some(self.inner.limits.call_timeout),
            trace_id: crate::forward::trace_id(caller.traceparent.as_deref()),
            ..CallOptions::default()
        };
        let envelope = self
            .inner
            .mesh
            .message_to_capability(capability, payload, &options);
        let mut request = caller.request(reach::CallRequest {
            message: Some(envelope),
        });
        let timeout = self.inner.limits.call_timeout;
        request.set_timeout(timeout);
        let started = Instant::now();
        let reply = match self.router_for(caller).call(request).await {
            Ok(reply) => reply.into_inner(),
            // tonic reports its own timeout as CANCELLED: say what ran out.
            Err(status)
                if status.code() == tonic::Code::Cancelled && started.elapsed() >= timeout =>
            {
                let status = tonic::Status::deadline_exceeded(format!(
                    "no answer within edge.call_timeout ({}); raise it for longer tools",
                    humantime::format_duration(timeout)
                ));
                return mesh_error(tool, &status);
            }
            Err(status) => return mesh_error(tool, &status),
        };
        let route = reply.route.unwrap_or_default();
        let parts = reply
            .message
            .and_then(|m| m.payload)
            .map(|p| p.parts)
            .unwrap_or_default();
        let mut result = result_of(&parts);
        let mut meta = MetaObject::default();
        meta.insert("reach.traceId".into(), json!(route.trace_id));
        meta.insert("reach.instanceId".into(), json!(route.instance_id));
        result.meta = Some(meta);
        result
    }
}

/// The tool of capability `descriptor` under `naming`; `None` when it declares no input
/// schema (or one that is not a JSON object) or its name makes no tool name.
fn tool_of(naming: ToolNaming, descriptor: &reach::CapabilityDescriptor) -> Option<Tool> {
    let input_schema = parse_object(&descriptor.input_schema)?;
    let name = match naming.tool_name(&descriptor.name) {
        Ok(name) => name,
        Err(error) => {
            tracing::debug!(capability = %descriptor.name, %error, "capability not listed as a tool");
            return None;
        }
    };
    let description = (!descriptor.description.is_empty())
        .then(|| std::borrow::Cow::Owned(descriptor.description.clone()));
    let mut tool = Tool::new_with_raw(name, description, Arc::new(input_schema));
    // MCP output schemas describe objects (the structured content of a result).
    if let Some(output) = parse_object(&descriptor.output_schema)
        .filter(|schema| schema.get("type").and_then(Value::as_str) == Some("object"))
    {
        tool = tool.with_raw_output_schema(Arc::new(output));
    }
    if descriptor.idempotent {
        tool = tool.with_annotations(ToolAnnotations::new().idempotent(true));
    }
    Some(tool)
}

/// `text` parsed as a JSON object; `None` when empty or anything else.
fn parse_object(text: &str) -> Option<JsonObject> {
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(object)) => Some(object),
        _ => None,
    }
}

/// The tool result of a reply's `parts`: the first data part as `structuredContent`, and
/// each part as content (text as text, data as its JSON, a URL as text, bytes as a note).
fn result_of(parts: &[reach::Part]) -> CallToolResult {
    use reach::part::Content;
    let mut structured = None;
    let mut content = Vec::with_capacity(parts.len());
    for part in parts {
        match &part.content {
            Some(Content::Text(text)) => content.push(ContentBlock::text(text.clone())),
            Some(Content::Data(data)) => {
                let value = reach_proto::json::from_proto(data);
                content.push(ContentBlock::text(value.to_string()));
                if structured.is_none() {
                    structured = Some(value);
                }
            }
            Some(Content::Url(url)) => content.push(ContentBlock::text(url.clone())),
            Some(Content::Raw(bytes)) => content.push(ContentBlock::text(format!(
                "({} bytes of {})",
                bytes.len(),
                if part.media_type.is_empty() {
                    "binary data"
                } else {
                    part.media_type.as_str()
                }
            ))),
            None => {}
        }
    }
    let mut result = CallToolResult::success(content);
    result.structured_content = structured;
    result
}

fn tool_error(message: String) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(message)])
}

/// A failure status of the mesh as a tool error the model can read: the code, the message
/// and the ErrorInfo reason.
fn mesh_error(tool: &str, status: &tonic::Status) -> CallToolResult {
    let reason = reach_rpc::errors::reason_of(status)
        .map(|r| format!(" [{r}]"))
        .unwrap_or_default();
    tool_error(format!(
        "tool {tool:?} failed: {}{reason}: {}",
        reach_rpc::errors::code_name(status.code()),
        status.message()
    ))
}

impl ServerHandler for McpEdge {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(
                Implementation::new("reach", env!("CARGO_PKG_VERSION")).with_title("Reach mesh"),
            )
            .with_instructions(
                "The tools are the capabilities of a Reach mesh: each call is routed to a healthy, lightly loaded instance that serves it.",
            )
    }

    async fn list_tools(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let caller = CallerContext::of(&context);
        let cursor = request.and_then(|r| r.cursor);
        if cursor
            .as_ref()
            .is_some_and(|c| c.len() > super::names::MAX_TOOL_NAME)
        {
            return Err(ErrorData::invalid_params(
                "the cursor is not one tools/list gave; start again without a cursor",
                None,
            ));
        }
        let tools = self.tools(&caller).await.map_err(|status| {
            ErrorData::internal_error(
                format!(
                    "the mesh's registry could not list capabilities: {}",
                    status.message()
                ),
                None,
            )
        })?;
        let start = cursor.map_or(0, |after| {
            tools.partition_point(|tool| tool.name.as_ref() <= after.as_str())
        });
        let page: Vec<Tool> = tools
            .iter()
            .skip(start)
            .take(TOOLS_PER_PAGE)
            .cloned()
            .collect();
        let next_cursor = (start + page.len() < tools.len())
            .then(|| page.last().map(|t| t.name.to_string()))
            .flatten();
        let mut result = ListToolsResult::with_all_items(page).with_ttl_ms(TOOL_LIST_TTL_MS);
        result.next_cursor = next_cursor;
        // With trust on the list depends on who asks.
        result.cache_scope = Some(if self.inner.trust.is_enabled() {
            CacheScope::Private
        } else {
            CacheScope::Public
        });
        Ok(result)
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let caller = CallerContext::of(&context);
        let capability = self
            .naming()
            .capability_name(&request.name)
            .map_err(|error| ErrorData::invalid_params(error.to_string(), None))?;
        let arguments = request.arguments.unwrap_or_default();
        let result = tokio::select! {
            result = self.call(&caller, &request.name, &capability, arguments) => result?,
            () = context.ct.cancelled() => {
                tool_error(format!("the call of tool {:?} was cancelled", request.name))
            }
        };
        Ok(result.into())
    }
}
