//! Reach's protocol edges: the mesh for clients of the ecosystem's agent protocols, each a
//! mapping onto the registry, router and orchestrator (their gRPC APIs), never a second
//! engine.
//!
//! # Layout
//! - [`a2a`]: the A2A v1 edge — the `lf.a2a.v1` contract, agent cards generated from the
//!   registry, messages as router calls and orchestrator tasks, the gRPC and JSON-RPC
//!   bindings (`docs/edges.md`).
//! - [`forward`]: what both edges pass on for their caller (its `authorization` and
//!   `traceparent`) and which channel a call goes on.
//! - [`guard`]: the HTTP port's Host, Origin and content-type checks (DNS rebinding and
//!   cross-site requests), in front of both edges' HTTP routes.
//! - [`mcp`]: the MCP edge — the mesh's capabilities as MCP tools over Streamable HTTP, and
//!   existing MCP servers attached to the mesh as capabilities (`docs/edges.md`).

pub mod a2a;
mod forward;
pub mod guard;
pub mod mcp;
