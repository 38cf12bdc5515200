//! The MCP edge (Model Context Protocol, revision 2026-07-28, over the official Rust SDK
//! `rmcp`): the mesh's capabilities as tools for any MCP client, and MCP servers brought into
//! the mesh as capabilities.
//!
//! # Layout
//! - [`config`]: the `[edge.mcp]` settings.
//! - [`names`]: tool names ↔ capability names.
//! - [`server`]: [`McpEdge`], the MCP server — `tools/list` from the registry's capability
//!   descriptors, `tools/call` as router calls.
//! - [`http`]: its Streamable HTTP routes and OAuth protected resource metadata.
//! - [`attach`]: an MCP server (stdio child process or Streamable HTTP URL) served as mesh
//!   capabilities `mcp.<server>.<tool>`.

pub mod attach;
pub mod config;
pub mod http;
pub mod names;
pub mod server;

pub use config::McpConfig;
pub use server::{McpChannels, McpEdge, McpLimits};
