//! The MCP edge's settings (`[edge.mcp]` in the `reach` config file).

use serde::{Deserialize, Serialize};

use super::names::ToolNaming;

/// Settings of the MCP edge. Its call deadline, size limit and accepted hosts and origins are
/// the edge's (`edge.call_timeout`, `edge.max_message_bytes`, `edge.allowed_hosts`,
/// `edge.allowed_origins`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct McpConfig {
    /// Serve the MCP edge at `/mcp` on the edge's HTTP port (default true).
    pub enabled: bool,
    /// How tools are named after capabilities: `capability` (`complaint.classify`, the
    /// default) or `underscored` (`complaint__classify`, for hosts that refuse dots).
    pub tool_names: ToolNaming,
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
            authorization_servers: Vec::new(),
        }
    }
}
