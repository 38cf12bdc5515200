//! The MCP edge server (built next).

/// The MCP edge.
#[derive(Clone)]
pub struct McpEdge;
