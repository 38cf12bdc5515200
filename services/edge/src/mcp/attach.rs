//! An MCP server attached to the mesh: a stdio child process or a Streamable HTTP URL whose
//! tools are served as mesh capabilities `<prefix>.<tool>` (default prefix `mcp.<name>`).
//!
//! - [`capability_name`] / [`tool_name`]: the reversible tool ↔ capability mapping.
//! - [`plan`]: a tool list → the capabilities to register, and the tools refused (with why).
//! - [`attach`]: connect, list, register, relay calls, follow `tools/list` changes, and
//!   deregister on shutdown or when the server goes away.
//!
//! Mapping decisions (also in `docs/edges.md`):
//! - A tool's name is kept as it is: the capability is `<prefix>.<tool>`, and the tool is the
//!   capability with `<prefix>.` removed. A tool name is refused (logged and skipped; the
//!   other tools are served) when `<prefix>.<tool>` is not a registry name (dotted segments of
//!   ASCII letters, digits, `_` and `-`, at most 256 bytes), and a second tool of a name
//!   already seen is refused too.
//! - A call's first data part (a JSON object) is the tool's `arguments`; a call without one
//!   passes no arguments; any other JSON value is INVALID_ARGUMENT.
//! - A result's `structuredContent` is the reply's data part and each text content a text
//!   part; `isError: true` is FAILED_PRECONDITION with the tool's text; an MCP error from the
//!   server is INVALID_ARGUMENT (invalid params), NOT_FOUND (unknown tool) or INTERNAL; a
//!   server that went away is UNAVAILABLE; the caller's deadline bounds the tool call
//!   (DEADLINE_EXCEEDED, the call is cancelled at the server).

mod http_client;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use reach_proto::v1::{Part, Payload, ReachMessage};
use reach_sdk::runtime::RunningAgent;
use reach_sdk::{AgentConfig, AgentRuntime, DescribedCapability, HandlerContext};
use rmcp::model::{CallToolRequestParams, PaginatedRequestParams, SubscriptionFilter, Tool};
use rmcp::service::{NotificationContext, Peer, RoleClient, ServiceError, ServiceExt};
use rmcp::{ClientHandler, ErrorData};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tonic::Status;
use tracing::{info, warn};

pub use http_client::HttpClient;

/// The most tools taken from one server: the capabilities one instance may declare
/// ([`reach_registry::store::MAX_LIST`]).
pub const MAX_TOOLS: usize = reach_registry::store::MAX_LIST;

/// The most `tools/list` pages followed (a server paging one tool at a time still fits).
const MAX_PAGES: usize = MAX_TOOLS + 1;

/// The longest capability name the registry takes, in bytes.
pub const MAX_CAPABILITY_BYTES: usize = reach_proto::names::MAX_NAME_BYTES;

/// The version every attached tool's capability is registered at.
pub const CAPABILITY_VERSION: &str = "1.0.0";

/// The payload type of a tool call's reply.
pub const RESULT_TYPE: &str = "mcp.tool_result";

/// How long the connection to the server (start, initialize) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// One MCP server to attach (`[[mcp.attach]]` in the reach config; `reach mcp attach`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AttachConfig {
    /// The server's name: the default prefix is `mcp.<name>`, the service `mcp.<name>`.
    /// A dotted name (ASCII letters, digits, `_`, `-`).
    pub name: String,
    /// The stdio server's program and arguments (`["python", "words.py"]`); exactly one of
    /// `command` and `url` is set.
    pub command: Vec<String>,
    /// The Streamable HTTP server's URL (`http://127.0.0.1:8000/mcp`); "" for a stdio server.
    pub url: String,
    /// HTTP headers sent with every request to `url` (`"Authorization" = "Bearer …"`).
    pub headers: BTreeMap<String, String>,
    /// The capability prefix; "" means `mcp.<name>`.
    pub prefix: String,
    /// Environment variables set for the child process (added to the inherited ones).
    pub env: BTreeMap<String, String>,
}

impl AttachConfig {
    /// The capability prefix: `prefix`, or `mcp.<name>` when it is empty.
    pub fn effective_prefix(&self) -> String {
        if self.prefix.is_empty() {
            format!("mcp.{}", self.name)
        } else {
            self.prefix.clone()
        }
    }

    /// Checks the entry.
    ///
    /// # Errors
    /// A message naming the field (`name`, `command`/`url`, `prefix`).
    pub fn validate(&self) -> Result<(), String> {
        if !reach_proto::names::is_dotted_name(&self.name) {
            return Err(format!(
                "mcp attach name {:?} must be a dotted name of ASCII letters, digits, '_' and '-' (e.g. \"words\")",
                self.name
            ));
        }
        match (self.command.is_empty(), self.url.is_empty()) {
            (true, true) => {
                return Err(format!(
                    "mcp attach {:?} has neither command nor url: set command = [\"program\", \"arg\"] for a stdio server or url = \"http://host:port/mcp\"",
                    self.name
                ));
            }
            (false, false) => {
                return Err(format!(
                    "mcp attach {:?} has both command and url: set one",
                    self.name
                ));
            }
            _ => {}
        }
        let http = self.url.starts_with("http://") || self.url.starts_with("https://");
        if !self.url.is_empty() && !http {
            return Err(format!(
                "mcp attach {:?} url {:?} must start with http:// or https://",
                self.name, self.url
            ));
        }
        if !self.url.is_empty() && !self.env.is_empty() {
            return Err(format!(
                "mcp attach {:?}: env applies to a child process only, not to a url",
                self.name
            ));
        }
        let prefix = self.effective_prefix();
        if !reach_proto::names::is_dotted_name(&prefix) || prefix.len() >= MAX_CAPABILITY_BYTES {
            return Err(format!(
                "mcp attach {:?} prefix {prefix:?} must be a dotted name shorter than {MAX_CAPABILITY_BYTES} bytes",
                self.name
            ));
        }
        for name in self.headers.keys() {
            if ::http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                return Err(format!(
                    "mcp attach {:?} header {name:?} is not an HTTP header name",
                    self.name
                ));
            }
        }
        Ok(())
    }
}

// === names ===

/// Why a tool name cannot be a capability.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// `<prefix>.<tool>` is not a registry name.
    #[error(
        "tool {tool:?} cannot be capability {capability:?}: capability names are dotted segments of ASCII letters, digits, '_' and '-', at most 256 bytes"
    )]
    Invalid {
        /// The tool's name.
        tool: String,
        /// The capability name it would have had.
        capability: String,
    },
    /// Another tool of the server already has the name.
    #[error("tool {tool:?} is listed twice; the second one is not served")]
    Duplicate {
        /// The tool's name.
        tool: String,
    },
    /// The registry would refuse the tool's description or schemas (too long, too deep, not
    /// a JSON Schema): the tool is not served, the others are.
    #[error("tool {tool:?} is not served: its {field} {detail}")]
    Descriptor {
        /// The tool's name.
        tool: String,
        /// `description`, `input_schema` or `output_schema`.
        field: &'static str,
        /// What is wrong, as the registry says it.
        detail: String,
    },
}

/// The capability serving `tool` under `prefix`: `<prefix>.<tool>`.
///
/// # Errors
/// [`NameError::Invalid`] when that is not a registry name.
pub fn capability_name(prefix: &str, tool: &str) -> Result<String, NameError> {
    let capability = format!("{prefix}.{tool}");
    if reach_proto::names::is_dotted_name(&capability) && reach_proto::names::is_dotted_name(tool) {
        Ok(capability)
    } else {
        Err(NameError::Invalid {
            tool: tool.chars().take(128).collect(),
            capability: capability.chars().take(300).collect(),
        })
    }
}

/// The tool a capability under `prefix` serves (the inverse of [`capability_name`]); `None`
/// when the capability is not under `prefix`.
pub fn tool_name<'a>(prefix: &str, capability: &'a str) -> Option<&'a str> {
    capability
        .strip_prefix(prefix)?
        .strip_prefix('.')
        .filter(|tool| !tool.is_empty())
}

/// One tool to serve.
#[derive(Debug, Clone, PartialEq)]
pub struct Mapped {
    /// The capability name.
    pub capability: String,
    /// The tool as the server listed it.
    pub tool: Tool,
}

/// The capabilities for `tools` under `prefix`, in the server's order, and the tools refused.
pub fn plan(prefix: &str, tools: Vec<Tool>) -> (Vec<Mapped>, Vec<NameError>) {
    let mut seen = HashSet::new();
    let mut mapped = Vec::new();
    let mut refused = Vec::new();
    for tool in tools {
        match capability_name(prefix, &tool.name) {
            Err(e) => refused.push(e),
            Ok(_) if !seen.insert(tool.name.to_string()) => refused.push(NameError::Duplicate {
                tool: tool.name.to_string(),
            }),
            Ok(capability) => match check_descriptor(&capability, &tool) {
                Err(problem) => refused.push(problem),
                Ok(()) => mapped.push(Mapped { capability, tool }),
            },
        }
    }
    (mapped, refused)
}

/// The registry's descriptor checks ([`reach_registry::capabilities::check_descriptor`]) of
/// `tool` served as `capability`, so one tool the registry would refuse is skipped instead of
/// refusing the whole instance.
fn check_descriptor(capability: &str, tool: &Tool) -> Result<(), NameError> {
    let json = |object: &serde_json::Map<String, serde_json::Value>| {
        serde_json::Value::Object(object.clone()).to_string()
    };
    let declared = reach_proto::v1::Capability {
        name: capability.to_string(),
        version: CAPABILITY_VERSION.to_string(),
        description: tool.description.as_deref().unwrap_or_default().to_string(),
        input_schema: json(&tool.input_schema),
        output_schema: tool.output_schema.as_deref().map(json).unwrap_or_default(),
    };
    reach_registry::capabilities::check_descriptor(&declared).map_err(|problem| {
        NameError::Descriptor {
            tool: tool.name.chars().take(128).collect(),
            field: problem.field,
            detail: problem.detail,
        }
    })
}

// === errors ===

/// Why an attachment stopped (or could not start).
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// The entry is invalid; the message names the field.
    #[error("{0}")]
    Config(String),
    /// The child process could not be started.
    #[error(
        "cannot start mcp server {name:?} ({program}): {source}; check the command and that it is installed"
    )]
    Spawn {
        /// The server's name.
        name: String,
        /// The program.
        program: String,
        /// Why.
        source: std::io::Error,
    },
    /// The MCP handshake failed.
    #[error("mcp server {name:?} did not initialize: {detail}")]
    Initialize {
        /// The server's name.
        name: String,
        /// Why.
        detail: String,
    },
    /// `tools/list` failed.
    #[error("mcp server {name:?} failed tools/list: {source}")]
    ListTools {
        /// The server's name.
        name: String,
        /// Why.
        source: ServiceError,
    },
    /// The server lists more tools than [`MAX_TOOLS`].
    #[error("mcp server {name:?} lists more than {limit} tools; attach fewer, or split the server")]
    TooManyTools {
        /// The server's name.
        name: String,
        /// [`MAX_TOOLS`].
        limit: usize,
    },
    /// The agent runtime failed (a refused registration, a listener that cannot bind).
    #[error("mcp server {name:?} cannot be served in the mesh: {source}")]
    Agent {
        /// The server's name.
        name: String,
        /// Why.
        source: reach_sdk::AgentError,
    },
    /// The listener for the capabilities could not be bound.
    #[error("cannot listen on {addr} for mcp server {name:?}: {source}")]
    Listen {
        /// The server's name.
        name: String,
        /// The address.
        addr: String,
        /// Why.
        source: std::io::Error,
    },
    /// The child process exited or the HTTP server went away; its capabilities were drained.
    #[error(
        "mcp server {name:?} went away (the child process exited or the connection closed); its capabilities were deregistered"
    )]
    ServerGone {
        /// The server's name.
        name: String,
    },
}

/// Why a relayed tool call failed; each variant maps to one gRPC code.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The message's data part is not a JSON object.
    #[error(
        "the arguments of tool {tool:?} must be a JSON object in the message's data part, got {kind}"
    )]
    ArgumentsNotObject {
        /// The tool.
        tool: String,
        /// The JSON type given.
        kind: &'static str,
    },
    /// The tool answered `isError: true`.
    #[error("tool {tool:?} failed: {text}")]
    ToolFailed {
        /// The tool.
        tool: String,
        /// The tool's text content.
        text: String,
    },
    /// The server answered with a JSON-RPC error.
    #[error("mcp server answered tools/call {tool:?} with error {code}: {message}")]
    Protocol {
        /// The tool.
        tool: String,
        /// The JSON-RPC error code.
        code: i32,
        /// The server's message.
        message: String,
    },
    /// The server is gone or the transport failed.
    #[error("mcp server for tool {tool:?} is unavailable: {detail}")]
    Unavailable {
        /// The tool.
        tool: String,
        /// Why.
        detail: String,
    },
    /// The caller's deadline passed before the tool answered.
    #[error(
        "tool {tool:?} did not answer within the call's deadline ({after:?}); the call was cancelled at the mcp server"
    )]
    DeadlineExceeded {
        /// The tool.
        tool: String,
        /// The time it had.
        after: Duration,
    },
    /// The caller went away.
    #[error("the call of tool {tool:?} was cancelled by the caller")]
    Cancelled {
        /// The tool.
        tool: String,
    },
}

impl From<CallError> for Status {
    fn from(err: CallError) -> Self {
        let message = err.to_string();
        match err {
            CallError::ArgumentsNotObject { .. } => Status::invalid_argument(message),
            CallError::ToolFailed { .. } => Status::failed_precondition(message),
            CallError::Protocol { code, .. } => match code {
                // Invalid params: the arguments did not fit the tool.
                -32602 => Status::invalid_argument(message),
                // Method not found (an unknown tool on some servers).
                -32601 => Status::not_found(message),
                _ => Status::internal(message),
            },
            CallError::Unavailable { .. } => Status::unavailable(message),
            CallError::DeadlineExceeded { .. } => Status::deadline_exceeded(message),
            CallError::Cancelled { .. } => Status::cancelled(message),
        }
    }
}

fn service_error(tool: &str, error: ServiceError) -> CallError {
    match error {
        ServiceError::McpError(ErrorData { code, message, .. }) => CallError::Protocol {
            tool: tool.to_string(),
            code: code.0,
            message: message.chars().take(4096).collect(),
        },
        ServiceError::Timeout { timeout } => CallError::DeadlineExceeded {
            tool: tool.to_string(),
            after: timeout,
        },
        other => CallError::Unavailable {
            tool: tool.to_string(),
            detail: other.to_string(),
        },
    }
}

// === calls ===

/// Relays one call of `tool` to `peer`.
async fn call_tool(
    peer: Peer<RoleClient>,
    tool: Arc<str>,
    ctx: HandlerContext,
    message: ReachMessage,
) -> Result<Payload, CallError> {
    let payload = message.payload.unwrap_or_default();
    let mut params = CallToolRequestParams::new(tool.to_string());
    match payload.first_json() {
        None => {}
        Some(serde_json::Value::Object(arguments)) => params = params.with_arguments(arguments),
        Some(other) => {
            return Err(CallError::ArgumentsNotObject {
                tool: tool.to_string(),
                kind: json_kind(&other),
            });
        }
    }
    let call = peer.call_tool(params);
    let result = match ctx.deadline {
        Some(deadline) => {
            let after = deadline.saturating_duration_since(tokio::time::Instant::now());
            tokio::select! {
                result = tokio::time::timeout_at(deadline, call) => result.map_err(|_| CallError::DeadlineExceeded { tool: tool.to_string(), after })?,
                () = ctx.cancellation.cancelled() => return Err(CallError::Cancelled { tool: tool.to_string() }),
            }
        }
        None => tokio::select! {
            result = call => result,
            () = ctx.cancellation.cancelled() => return Err(CallError::Cancelled { tool: tool.to_string() }),
        },
    }
    .map_err(|e| service_error(&tool, e))?;
    let texts: Vec<String> = result
        .content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect();
    if result.is_error == Some(true) {
        return Err(CallError::ToolFailed {
            tool: tool.to_string(),
            text: texts.join("\n").chars().take(4096).collect(),
        });
    }
    let mut parts = Vec::with_capacity(texts.len() + 1);
    if let Some(structured) = &result.structured_content {
        parts.push(Part::data(structured));
    }
    parts.extend(texts.into_iter().map(Part::text));
    Ok(Payload {
        r#type: RESULT_TYPE.to_string(),
        parts,
    })
}

fn json_kind(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

// === the client ===

/// The MCP client's handler: wakes the attachment when the server's tool list changes.
#[derive(Clone)]
struct Listener {
    changed: Arc<Notify>,
}

impl ClientHandler for Listener {
    async fn on_tool_list_changed(&self, _context: NotificationContext<RoleClient>) {
        self.changed.notify_one();
    }
}

/// Lists every tool (following pagination), at most [`MAX_TOOLS`].
async fn list_tools(name: &str, peer: &Peer<RoleClient>) -> Result<Vec<Tool>, AttachError> {
    let mut tools = Vec::new();
    let mut cursor = None;
    for _ in 0..MAX_PAGES {
        let page = peer
            .list_tools(Some(PaginatedRequestParams::default().with_cursor(cursor)))
            .await
            .map_err(|source| AttachError::ListTools {
                name: name.to_string(),
                source,
            })?;
        tools.extend(page.tools);
        if tools.len() > MAX_TOOLS {
            break;
        }
        match page.next_cursor {
            Some(next) if !next.is_empty() => cursor = Some(next),
            _ => return Ok(tools),
        }
    }
    Err(AttachError::TooManyTools {
        name: name.to_string(),
        limit: MAX_TOOLS,
    })
}

/// Where and how the attachment's agent runtimes serve.
#[derive(Debug, Clone)]
pub struct Serving {
    /// The agent settings (registry endpoint, trust, limits); `service` is set to `mcp.<name>`
    /// when empty. With `agent.tls` the attachment serves TLS and, as every SDK agent, answers
    /// only the mesh's routers (and the registry's health checks): a tool is called through a
    /// router, under its call policy, never directly ([`reach_sdk::DirectCallers`]).
    pub agent: AgentConfig,
    /// Where the first runtime listens (`127.0.0.1:0`); a runtime started after a tool list
    /// change listens on the same host, port 0 (the old one still holds the port while it
    /// drains).
    pub listen: String,
    /// How often a Streamable HTTP server is pinged; [`PROBE_FAILURES`] failed pings in a row
    /// (no answer within the interval, or a transport error) mean it went away. Default 5 s.
    /// (A stdio server going away closes its pipes, which is seen at once.)
    pub probe_interval: Duration,
}

/// Failed pings in a row after which a Streamable HTTP server is taken as gone.
pub const PROBE_FAILURES: u32 = 3;

impl Serving {
    /// Serving with `agent`'s settings on `listen`, pinging HTTP servers every 5 s.
    pub fn new(agent: AgentConfig, listen: impl Into<String>) -> Self {
        Self {
            agent,
            listen: listen.into(),
            probe_interval: Duration::from_secs(5),
        }
    }
}

/// Resolves once `peer` failed [`PROBE_FAILURES`] pings in a row. An MCP error answer (a
/// server without `ping`) counts as alive: the server answered.
async fn probe(peer: Peer<RoleClient>, interval: Duration) {
    let mut failures = 0;
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        let ping = peer.send_request(rmcp::model::ClientRequest::PingRequest(
            rmcp::model::PingRequest {
                method: Default::default(),
                extensions: Default::default(),
            },
        ));
        match tokio::time::timeout(interval, ping).await {
            Ok(Ok(_)) | Ok(Err(ServiceError::McpError(_))) => failures = 0,
            Ok(Err(_)) | Err(_) => {
                failures += 1;
                if failures >= PROBE_FAILURES {
                    return;
                }
            }
        }
    }
}

/// A started attachment's runtime.
struct Generation {
    agent: RunningAgent,
    capabilities: Vec<(String, Tool)>,
}

/// Attaches the server of `config` until `shutdown` resolves, then deregisters (drains) its
/// capabilities and stops the server (a child process is killed).
///
/// Returns `Ok` after a shutdown. A tool list change starts a new runtime with the new
/// capabilities, then drains the old one (its in-flight calls finish), so no call is lost.
///
/// # Errors
/// [`AttachError::ServerGone`] (after draining) when the child exits or the HTTP server goes
/// away; [`AttachError`] when the server cannot be started, initialized or listed, or the
/// registry refuses the registration.
pub async fn attach(
    config: AttachConfig,
    serving: Serving,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), AttachError> {
    config.validate().map_err(AttachError::Config)?;
    let name = config.name.clone();
    let prefix = config.effective_prefix();
    let changed = Arc::new(Notify::new());
    let handler = Listener {
        changed: changed.clone(),
    };
    let init_error = |detail: String| AttachError::Initialize {
        name: name.clone(),
        detail,
    };
    let service = if config.url.is_empty() {
        let mut command = tokio::process::Command::new(&config.command[0]);
        command.args(&config.command[1..]).envs(&config.env);
        let transport = rmcp::transport::TokioChildProcess::new(command).map_err(|source| {
            AttachError::Spawn {
                name: name.clone(),
                program: config.command[0].clone(),
                source,
            }
        })?;
        tokio::time::timeout(CONNECT_TIMEOUT, handler.serve(transport))
            .await
            .map_err(|_| init_error(format!("no answer within {CONNECT_TIMEOUT:?}")))?
            .map_err(|e| init_error(e.to_string()))?
    } else {
        let transport =
            http_client::transport(&config.url, &config.headers).map_err(AttachError::Config)?;
        tokio::time::timeout(CONNECT_TIMEOUT, handler.serve(transport))
            .await
            .map_err(|_| init_error(format!("no answer within {CONNECT_TIMEOUT:?}")))?
            .map_err(|e| init_error(e.to_string()))?
    };
    let peer = service.peer().clone();
    let stop_service = service.cancellation_token();
    let lists_changes = service
        .peer_info()
        .and_then(|info| {
            info.capabilities
                .tools
                .as_ref()
                .and_then(|t| t.list_changed)
        })
        .unwrap_or(false);
    let waiting = service.waiting();
    let mut closed = if config.url.is_empty() {
        tokio::spawn(async move {
            let _ = waiting.await;
        })
    } else {
        let peer = peer.clone();
        let interval = serving.probe_interval;
        tokio::spawn(async move {
            tokio::select! {
                _ = waiting => {}
                () = probe(peer, interval) => {}
            }
        })
    };
    // On 2026-07-28, list changes come on a listen stream that asked for them; servers on
    // earlier revisions send them unscoped (to `Listener`).
    if lists_changes {
        let listen = peer.listen(SubscriptionFilter::builder().tools_list_changed().build());
        match tokio::time::timeout(CONNECT_TIMEOUT, listen)
            .await
            .unwrap_or(Err(ServiceError::Timeout {
                timeout: CONNECT_TIMEOUT,
            })) {
            Ok(mut subscription) => {
                let changed = changed.clone();
                tokio::spawn(async move {
                    while let Ok(Some(_)) = subscription.next().await {
                        changed.notify_one();
                    }
                });
            }
            Err(error) => {
                tracing::debug!(server = %name, %error, "no listen stream; following unscoped list changes")
            }
        }
    }

    let mut agent = serving.agent.clone();
    if agent.service.is_empty() {
        agent.service = format!("mcp.{name}");
    }
    let host = serving
        .listen
        .rsplit_once(':')
        .map_or("127.0.0.1".to_string(), |(host, _)| host.to_string());
    let mut listen = serving.listen.clone();
    let mut current: Option<Generation> = None;
    let mut shutdown = std::pin::pin!(shutdown);
    let mut server_exited = false;
    let result = loop {
        // (Re)list and, when the set differs, start a new runtime before draining the old one.
        let tools = match list_tools(&name, &peer).await {
            Ok(tools) => tools,
            Err(e) => break Err(e),
        };
        let (mapped, refused) = plan(&prefix, tools);
        for problem in &refused {
            warn!(server = %name, "{problem}");
        }
        let capabilities: Vec<(String, Tool)> =
            mapped.into_iter().map(|m| (m.capability, m.tool)).collect();
        if current.as_ref().map(|g| &g.capabilities) != Some(&capabilities) {
            let next = match start(&name, &agent, &listen, &peer, &capabilities).await {
                Ok(agent) => agent,
                Err(e) => break Err(e),
            };
            listen = format!("{host}:0");
            info!(
                server = %name,
                instance = next.instance_id(),
                tools = capabilities.len(),
                refused = refused.len(),
                "mcp server attached"
            );
            if let Some(old) = current.take() {
                // The old instance drains once the new one is routable, so every call finds one.
                wait_ready(&agent.registry_endpoint, &agent.service, next.instance_id()).await;
                let _ = old.agent.drain().await;
            }
            current = Some(Generation {
                agent: next,
                capabilities,
            });
        }
        let refusal = async {
            match &current {
                Some(g) => g.agent.registration_refused().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = &mut shutdown => break Ok(()),
            _ = &mut closed => {
                server_exited = true;
                break Err(AttachError::ServerGone { name: name.clone() });
            }
            () = changed.notified() => {}
            refused = refusal => break Err(AttachError::Agent {
                name: name.clone(),
                source: reach_sdk::AgentError::RegistrationRefused(refused),
            }),
        }
    };
    if let Some(generation) = current.take() {
        let _ = generation.agent.drain().await;
    }
    stop_service.cancel();
    if !server_exited {
        let _ = closed.await;
    }
    result
}

/// How long a new instance may take to become READY before the old one drains anyway.
const READY_WITHIN: Duration = Duration::from_secs(10);

/// Waits (at most [`READY_WITHIN`]) until the registry at `registry` lists `instance` of
/// `service` as READY or BUSY; logs and returns when it does not.
async fn wait_ready(registry: &str, service: &str, instance: &str) {
    use reach_proto::v1::registry_service_client::RegistryServiceClient;
    use reach_proto::v1::{InstanceState, ListInstancesRequest};

    let ready = async {
        let endpoint = tonic::transport::Endpoint::from_shared(registry.to_string()).ok()?;
        let mut client = RegistryServiceClient::new(endpoint.connect().await.ok()?)
            .max_decoding_message_size(reach_rpc::limits::REGISTRY_LIST_BYTES);
        loop {
            let listed = client
                .list_instances(ListInstancesRequest {
                    service: service.to_string(),
                    ..Default::default()
                })
                .await;
            let routable = listed.is_ok_and(|listed| {
                listed.into_inner().instances.iter().any(|i| {
                    i.spec.as_ref().is_some_and(|s| s.instance_id == instance)
                        && matches!(i.state(), InstanceState::Ready | InstanceState::Busy)
                })
            });
            if routable {
                return Some(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    if tokio::time::timeout(READY_WITHIN, ready)
        .await
        .ok()
        .flatten()
        .is_none()
    {
        warn!(
            instance,
            "the new instance is not READY after {READY_WITHIN:?}; draining the old one anyway"
        );
    }
}

/// Starts a runtime serving `capabilities` on `listen`.
async fn start(
    name: &str,
    agent: &AgentConfig,
    listen: &str,
    peer: &Peer<RoleClient>,
    capabilities: &[(String, Tool)],
) -> Result<RunningAgent, AttachError> {
    let mut runtime = AgentRuntime::new(agent.clone());
    for (capability, tool) in capabilities {
        let mut described = DescribedCapability::new(capability, CAPABILITY_VERSION)
            .input_schema(serde_json::Value::Object((*tool.input_schema).clone()));
        if let Some(description) = &tool.description {
            described = described.description(description.to_string());
        }
        if let Some(output) = &tool.output_schema {
            described = described.output_schema(serde_json::Value::Object((**output).clone()));
        }
        let peer = peer.clone();
        let tool: Arc<str> = Arc::from(tool.name.as_ref());
        runtime = runtime.handle_described(
            described,
            move |ctx: HandlerContext, message: ReachMessage| {
                let peer = peer.clone();
                let tool = tool.clone();
                async move {
                    call_tool(peer, tool, ctx, message)
                        .await
                        .map_err(Status::from)
                }
            },
        );
    }
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|source| AttachError::Listen {
            name: name.to_string(),
            addr: listen.to_string(),
            source,
        })?;
    let (running, _endpoint) =
        runtime
            .start(listener)
            .await
            .map_err(|source| AttachError::Agent {
                name: name.to_string(),
                source,
            })?;
    Ok(running)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str) -> Tool {
        Tool::new(name.to_string(), "", Arc::new(serde_json::Map::new()))
    }

    #[test]
    fn a_tool_the_registry_would_refuse_is_skipped_and_the_others_served() {
        let long = Tool::new(
            "long".to_string(),
            "d".repeat(2000),
            Arc::new(serde_json::Map::new()),
        );
        let mut bad_schema = tool("bad_schema");
        bad_schema.input_schema = Arc::new(
            serde_json::json!({"type": "object", "properties": {"x": {"type": 5}}})
                .as_object()
                .unwrap()
                .clone(),
        );
        let (mapped, refused) = plan("mcp.s", vec![long, tool("fine"), bad_schema]);
        let names: Vec<_> = mapped.iter().map(|m| m.capability.as_str()).collect();
        assert_eq!(names, ["mcp.s.fine"]);
        let [first, second] = refused.as_slice() else {
            panic!("two refused: {refused:?}");
        };
        assert!(
            matches!(first, NameError::Descriptor { tool, field: "description", detail } if tool == "long" && detail.contains("1024")),
            "{first}"
        );
        assert!(
            matches!(second, NameError::Descriptor { tool, field: "input_schema", .. } if tool == "bad_schema"),
            "{second}"
        );
    }

    #[test]
    fn names_map_both_ways() {
        let capability = capability_name("mcp.words", "count_words").unwrap();
        assert_eq!(capability, "mcp.words.count_words");
        assert_eq!(tool_name("mcp.words", &capability), Some("count_words"));
        assert_eq!(
            capability_name("mcp.fs", "dir.list-all").unwrap(),
            "mcp.fs.dir.list-all"
        );
        assert_eq!(
            tool_name("mcp.fs", "mcp.fs.dir.list-all"),
            Some("dir.list-all")
        );
        assert_eq!(tool_name("mcp.fs", "mcp.fsx.a"), None);
        for bad in ["", "a b", "a/b", ".a", "a.", "a..b", "ü"] {
            assert!(capability_name("mcp.x", bad).is_err(), "{bad:?}");
        }
        assert!(capability_name("mcp.x", &"a".repeat(300)).is_err());
    }

    #[test]
    fn plan_refuses_unmappable_and_duplicate_tools() {
        let (mapped, refused) = plan(
            "mcp.s",
            vec![tool("ok"), tool("not ok"), tool("ok"), tool("b")],
        );
        let names: Vec<_> = mapped.iter().map(|m| m.capability.as_str()).collect();
        assert_eq!(names, ["mcp.s.ok", "mcp.s.b"]);
        assert_eq!(refused.len(), 2);
        assert!(refused[0].to_string().contains("\"not ok\""));
        assert_eq!(
            refused[1],
            NameError::Duplicate {
                tool: "ok".to_string()
            }
        );
    }

    #[test]
    fn config_is_checked() {
        let mut config = AttachConfig {
            name: "words".into(),
            command: vec!["python".into()],
            ..AttachConfig::default()
        };
        assert!(config.validate().is_ok());
        assert_eq!(config.effective_prefix(), "mcp.words");
        config.url = "http://127.0.0.1:1/mcp".into();
        assert!(config.validate().unwrap_err().contains("both"));
        config.command.clear();
        assert!(config.validate().is_ok());
        config.url.clear();
        assert!(config.validate().unwrap_err().contains("neither"));
    }
}
