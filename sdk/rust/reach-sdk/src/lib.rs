//! The Reach Rust SDK.
//!
//! An agent is a process that serves `reach.v1.AgentService` and registers its capabilities
//! with the registry; [`AgentRuntime`] does all of that around your handlers. A caller
//! addresses capabilities through the router; [`MeshClient`] does that.
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use reach_sdk::{AgentConfig, AgentRuntime, HandlerContext};
//! use reach_proto::v1::{Payload, ReachMessage};
//!
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! AgentRuntime::new(AgentConfig::new("echo", "http://127.0.0.1:7070"))
//!     .handle("echo", "1.0.0", |_ctx: HandlerContext, message: ReachMessage| async move {
//!         Ok(message.payload.unwrap_or_default())
//!     })
//!     .run(listener, reach_sdk::signal::terminate())
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! # Layout
//! - [`config`] — the agent settings, [`AgentConfig`].
//! - [`callers`] — [`DirectCallers`]: who may call an agent's port directly (routers; the
//!   registry's health probes) when it serves TLS.
//! - [`capability`] — [`DescribedCapability`]: a capability with the description and
//!   input/output JSON Schemas it registers.
//! - [`handler`] — the [`Handler`] and [`StreamHandler`] traits and the [`HandlerContext`]
//!   a handler gets (trace id, turn, deadline, cancellation, reply metadata).
//! - [`models`] — [`ModelSlots`]: model calls in flight and free slots, reported in
//!   heartbeats.
//! - [`runtime`] — [`AgentRuntime`] — serve, register, heartbeat, bounded concurrency,
//!   duplicate suppression, drain.
//! - [`dedupe`] — the window of recently handled message ids.
//! - [`client`] — [`MeshClient`], calls and streams through the router.
//! - [`signal`] — SIGTERM / Ctrl-C as a future.
//! - [`metrics`] — handler latency, messages waiting for a slot and in flight.

pub mod callers;
pub mod capability;
pub mod client;
pub mod config;
pub mod dedupe;
pub mod handler;
pub mod metrics;
pub mod models;
pub mod runtime;
pub mod signal;

pub use callers::DirectCallers;
pub use capability::DescribedCapability;
pub use client::{CallOptions, MeshClient};
pub use config::AgentConfig;
pub use handler::{Handler, HandlerContext, ReplyMetadata, StreamHandler};
pub use models::{ModelCallGuard, ModelLoad, ModelSlots};
pub use runtime::{AgentError, AgentRuntime};
