//! Client commands against a running mesh: one module per command group, each a set of
//! async functions that talk to `--endpoint` over gRPC and write to any `std::io::Write`.
//!
//! # Layout
//! - [`agents`] — `reach agents`: the registered instances.
//! - [`call`] — `reach call CAPABILITY`: one call through the router, the reply as JSON.
//! - [`capabilities`] — `reach capabilities`: the capability descriptors the registry serves.
//! - [`flow`] — `reach flow validate | apply | list`.
//! - [`task`] — `reach task start | get | list | resume | cancel | retry | watch | dead-letters`.
//! - [`dump`] — `reach dump --task ID`: a task's messages and events in time order.
//! - [`credentials`] — TLS and bearer-token settings from `REACH_TLS_*` / `REACH_TOKEN`.
//! - [`certs`] — `reach certs init | issue`: a development CA and the mesh's certificates
//!   (local files only, no endpoint).
//! - [`token`] — `reach token join | operator`: bearer tokens signed with the mesh's token key.
//!
//! Every orchestrator command returns the process exit code (0 ok, 1 failure such as an
//! invalid flow); [`CliError`] is for transport problems (unreachable endpoint, gRPC errors).

pub mod agents;
pub mod call;
pub mod capabilities;
pub mod certs;
pub mod credentials;
pub mod dump;
pub mod flow;
pub mod mcp;
pub mod task;
pub mod token;

use reach_proto::v1::orchestrator_service_client::OrchestratorServiceClient;
use serde_json::Value;

pub(crate) use reach_orchestrator::json::{status_name, timestamp as fmt_ts};

pub use agents::agents;
pub use call::{CallArgs, call};
pub use capabilities::{CapabilitiesArgs, capabilities};
pub use certs::{CertsCommand, certs};
pub use dump::{DumpArgs, dump};
pub use flow::{FlowArgs, FlowCommand, flow};
pub use mcp::{AttachArgs, McpCommand, mcp_attach};
pub use task::{TaskArgs, TaskCommand, task};
pub use token::{TokenCommand, token};

/// The orchestrator endpoint the commands use when `--endpoint` is not given (`reach dev`'s
/// default gRPC address).
pub const DEFAULT_ENDPOINT: &str = "http://127.0.0.1:7070";

/// Why a command could not run.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The endpoint could not be reached.
    #[error(
        "cannot reach {endpoint}: {message}; is it running (`reach dev`, or the service alone)? pass --endpoint otherwise"
    )]
    Connect {
        /// The endpoint.
        endpoint: String,
        /// The transport error.
        message: String,
    },
    /// The orchestrator answered with an error.
    #[error("{}", describe_status(.0))]
    Rpc(tonic::Status),
    /// A flag value was not valid.
    #[error("{0}")]
    Usage(String),
    /// Writing the output failed (its source is the `std::io::Error`, which `{:#}` of an
    /// `anyhow::Error` prints after this message).
    #[error("cannot write output")]
    Io(#[from] std::io::Error),
}

/// `code: message`, with the transport's own error after it (a refused TLS handshake reads
/// "transport error" alone otherwise) and, for a connection the server broke off, which
/// credential is probably missing.
fn describe_status(status: &tonic::Status) -> String {
    let mut text = format!(
        "{}: {}",
        reach_rpc::errors::code_name(status.code())
            .to_lowercase()
            .replace('_', " "),
        status.message()
    );
    if let Some(source) = std::error::Error::source(status) {
        text.push_str(&format!(": {}", reach_rpc::errors::chain(source)));
    }
    let broken = matches!(
        status.code(),
        tonic::Code::Unknown
            | tonic::Code::Internal
            | tonic::Code::Unavailable
            | tonic::Code::Cancelled
    ) && (text.contains("transport error") || text.contains("h2 protocol error"));
    if broken {
        let set = |name: &str| std::env::var_os(name).is_some_and(|v| !v.is_empty());
        if !set("REACH_TLS_CA") {
            text.push_str("; if the server serves TLS, set REACH_TLS_CA to the mesh CA (and REACH_TLS_CERT / REACH_TLS_KEY or REACH_TOKEN)");
        } else if !set("REACH_TLS_CERT") {
            text.push_str("; the server may require a client certificate: set REACH_TLS_CERT and REACH_TLS_KEY (an operator certificate from `reach certs init`); a bearer token alone needs the server's trust.tls.client_auth = \"optional\"");
        }
    }
    text
}

impl From<tonic::Status> for CliError {
    fn from(s: tonic::Status) -> Self {
        CliError::Rpc(s)
    }
}

/// A gRPC client of the orchestrator at `endpoint` (connect timeout 3 s), with the
/// environment's credentials ([`credentials`]).
///
/// # Errors
/// [`CliError::Usage`] when `endpoint` is not a URI or the credentials do not load,
/// [`CliError::Connect`] when nothing answers there.
pub(crate) async fn client(
    endpoint: &str,
) -> Result<OrchestratorServiceClient<credentials::Authorized>, CliError> {
    Ok(OrchestratorServiceClient::new(
        credentials::connect(endpoint).await?,
    ))
}

pub(crate) fn parse_json(flag: &str, text: &str) -> Result<Value, CliError> {
    serde_json::from_str(text).map_err(|e| {
        CliError::Usage(format!(
            "{flag} is not valid JSON ({e}); quote it, for example {flag} '{{\"text\": \"hello\"}}'"
        ))
    })
}

/// Writes `value` as one pretty JSON document (what `--json` prints).
pub(crate) fn write_json(
    out: &mut dyn std::io::Write,
    value: &impl serde::Serialize,
) -> std::io::Result<()> {
    writeln!(
        out,
        "{}",
        serde_json::to_string_pretty(value).unwrap_or_default()
    )
}

/// A value as compact JSON, cut at 80 characters for a table cell.
pub(crate) fn compact(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 80 {
        format!("{}…", s.chars().take(79).collect::<String>())
    } else {
        s
    }
}
