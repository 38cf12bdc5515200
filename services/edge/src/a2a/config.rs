//! The edges' settings (`[edge]` in the `reach` config file; the MCP edge's are
//! `[edge.mcp]`).

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Settings of the A2A edge (and, in `mcp`, of the MCP edge beside it).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct EdgeConfig {
    /// The registry the cards are generated from (`reach edge`); ignored when the registry
    /// runs in the same process (`reach dev`).
    pub registry_endpoint: String,
    /// The router capability calls go through; ignored when it runs in the same process.
    pub router_endpoint: String,
    /// The orchestrator flows run on; ignored when it runs in the same process.
    pub orchestrator_endpoint: String,
    /// The skill a message goes to when it names none (`complaint.classify`, or
    /// `flow:complaint-flow` for a flow); unset: such a message is refused with
    /// INVALID_PARAMS.
    pub default_skill: Option<String>,
    /// The deadline of a capability call made for a message (default 60 s).
    #[serde(with = "humantime_serde")]
    pub call_timeout: Duration,
    /// How long a flow's blocking SendMessage waits for the task to end or need input before
    /// it answers with the task as it is (default 60 s).
    #[serde(with = "humantime_serde")]
    pub max_wait: Duration,
    /// The largest request the edge accepts and reply it reads from the mesh, in bytes
    /// (default 4 MiB).
    pub max_message_bytes: usize,
    /// The JSON-RPC base URL the cards advertise (`https://a2a.example.com`); empty: the
    /// edge's HTTP listener address.
    pub public_url: String,
    /// The gRPC target the cards advertise (`a2a.example.com:443`); empty: the mesh port's
    /// address.
    pub public_grpc: String,
    /// The `Host` values the HTTP port answers (`mesh.example.com`, `mesh.example.com:443`):
    /// the defence against DNS rebinding (see [`crate::guard`]). Empty: `localhost`,
    /// `127.0.0.1`, `::1` and the host of `public_url`.
    pub allowed_hosts: Vec<String>,
    /// The browser `Origin`s (`https://app.example.com`, `http://localhost:*`) whose pages may
    /// POST to the HTTP port; empty: none (a POST carrying an `Origin` is refused).
    pub allowed_origins: Vec<String>,
    /// The MCP edge, served at `/mcp` on the same HTTP port (`[edge.mcp]`).
    pub mcp: crate::mcp::McpConfig,
}

impl Default for EdgeConfig {
    fn default() -> Self {
        Self {
            registry_endpoint: "http://127.0.0.1:7070".into(),
            router_endpoint: "http://127.0.0.1:7070".into(),
            orchestrator_endpoint: "http://127.0.0.1:7070".into(),
            default_skill: None,
            call_timeout: Duration::from_secs(60),
            max_wait: Duration::from_secs(60),
            max_message_bytes: 4 * 1024 * 1024,
            public_url: String::new(),
            public_grpc: String::new(),
            allowed_hosts: Vec::new(),
            allowed_origins: Vec::new(),
            mcp: crate::mcp::McpConfig::default(),
        }
    }
}

impl EdgeConfig {
    /// The Host and Origin checks of the edge's HTTP port, from `allowed_hosts`,
    /// `allowed_origins` and `public_url` (see [`crate::guard::HttpGuard::new`]).
    pub fn http_guard(&self) -> crate::guard::HttpGuard {
        crate::guard::HttpGuard::new(&self.allowed_hosts, &self.allowed_origins, &self.public_url)
    }
}
