//! The Reach agent kit: an LLM agent on the mesh in a few lines, every tool call a
//! validated, traced call.
//!
//! ```
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use reach_agent::{Agent, RunContext, ScriptedProvider, Step, Tool, ToolContext, ToolRegistry};
//!
//! /// Arguments of `math.add`.
//! #[derive(serde::Deserialize, schemars::JsonSchema)]
//! struct Add { a: i64, b: i64 }
//!
//! let add = Tool::from_fn::<Add, i64, _, _>(
//!     "math.add",
//!     "Adds two integers. Use it for exact sums; not for estimates.",
//!     |args: Add, _ctx: ToolContext| async move { Ok(args.a + args.b) },
//! )?;
//! // A model that calls the tool with sloppy arguments, then answers.
//! let model = ScriptedProvider::new([
//!     Step::tool_call("math.add", "{'a': '2', b: 3,}"),
//!     Step::reply("5"),
//! ]);
//! let agent = Agent::new(model.shared(), ToolRegistry::new().with(add)?).max_turns(4);
//! let outcome = agent.run(RunContext::default(), "what is 2 + 3?").await?;
//! assert_eq!(outcome.answer, "5");
//! assert_eq!(outcome.tool_calls[0].result.data, Some(serde_json::json!(5)));
//! # Ok(()) }
//! ```
//!
//! With a real model: `OpenAiProvider::new(ModelConfig::new(base_url, model))`, or both from
//! a file with [`config::AgentFileConfig::load`]. On the mesh: [`mesh::mesh_tool`] turns a
//! capability into a tool, [`mesh::serve_tools`] serves tools as capabilities, and
//! [`handoff`] lets a supervisor hand questions to worker agents.
//!
//! # Layout
//! - [`tool`] — [`Tool`] (from a Rust function or JSON Schemas), [`ToolContext`],
//!   [`ToolRegistry`] (the OpenAI `tools` list) and the capability ↔ function name mapping.
//! - [`arguments`] — lenient reading of the model's argument text (JSON, fenced or in prose,
//!   JSON5, Python literals, YAML), bounded.
//! - [`repair`] — validation against the tool's schema and safe repairs, each recorded as a
//!   [`repair::Repair`]; what cannot be repaired named by JSON pointer.
//! - [`result`] — normalised tool results and errors; JSON-safe data (bytes, timestamps,
//!   non-finite floats).
//! - [`provider`] — the [`ModelProvider`] trait, chat messages, tool calls, streamed deltas,
//!   and [`ModelError`] with its gRPC statuses.
//! - [`openai`] — [`OpenAiProvider`], the OpenAI chat-completions API over reqwest (SSE
//!   streaming, retries, timeouts, bounded responses).
//! - [`scripted`] — [`ScriptedProvider`], a deterministic model for tests and demos.
//! - [`config`] — [`ModelConfig`] and agent config files with `${ENV}` substitution.
//! - [`gen_ai`] — model call spans with the OpenTelemetry GenAI attributes, and metrics.
//! - [`agent_loop`] — [`Agent`], the tool-calling loop with max turns, and its outcome.
//! - [`memory`] — per-task conversation memory with folding into a summary.
//! - [`mesh`] — mesh tools (capabilities called through the router) and serving tools as
//!   capabilities.
//! - [`handoff`] — `reach.handoff` messages, the [`handoff::Supervisor`] and
//!   [`handoff::handoff_worker`].
//! - [`serve`] — an agent as a capability ([`serve::agent_handler`]), its token usage
//!   reported in the reply header.

pub mod agent_loop;
pub mod arguments;
pub mod config;
pub mod gen_ai;
pub mod handoff;
pub mod memory;
pub mod mesh;
pub mod openai;
pub mod provider;
pub mod repair;
pub mod result;
pub mod scripted;
pub mod serve;
pub mod tool;

pub use agent_loop::{Agent, AgentError, AgentOutcome, RunContext, Stopped};
pub use config::{AgentFileConfig, ModelConfig};
pub use openai::OpenAiProvider;
pub use provider::{
    ChatMessage, ChatRequest, ChatResponse, ModelError, ModelProvider, ToolCall, Usage,
};
pub use result::{ToolError, ToolResult};
pub use scripted::{ScriptedProvider, Step};
pub use tool::{Tool, ToolContext, ToolRegistry};
