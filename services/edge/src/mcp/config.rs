//! The MCP edge's settings (`[edge.mcp]` in the `reach` config file).

use serde::{Deserialize, Serialize};

use super::names::ToolNaming;

/// Settings of the MCP edge. Its call deadline and size limit are the edge's
/// (`edge.call_timeout`, `edge.max_message_bytes`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct McpConfig {
    /// Serve the MCP edge at `/mcp` on the edge's HTTP port (default true).
    pub enabled: bool,
    /// How tools are named after capabilities: `capability` (`complaint.classify`, the
    /// default) or `underscored` (`complaint__classify`, for hosts that refuse dots).
    pub tool_names: ToolNaming,
    /// The `Host` values a request may carry (`mcp.example.com`, `mcp.example.com:443`): the
    /// defence against DNS rebinding that MCP's transport spec asks of servers. Empty: the
    /// loopback names (`localhost`, `127.0.0.1`, `::1`) and the host of `edge.public_url`.
    pub allowed_hosts: Vec<String>,
    /// The browser `Origin`s a request may come from (`https://app.example.com:443`); empty:
    /// any request carrying an `Origin` header is refused.
    pub allowed_origins: Vec<String>,
    /// The OAuth 2.1 authorization servers (issuer URLs) whose tokens the edge accepts,
    /// published in its protected resource metadata (RFC 9728). Empty: `trust.jwt.issuer`
    /// when that is set.
    pub authorization_servers: Vec<String>,
}

impl Default for McpConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            tool_names: ToolNaming::default(),
            allowed_hosts: Vec::new(),
            allowed_origins: Vec::new(),
            authorization_servers: Vec::new(),
        }
    }
}
