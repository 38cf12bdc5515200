//! The Reach router: delivers each message to a healthy, lightly loaded instance of the
//! addressed service or capability.
//!
//! The router is stateless: its view of the mesh is a live copy of the registry, kept by a
//! `RegistryService.Watch` stream. Any number of replicas can run side by side.
//!
//! # Layout
//! Modules in dependency order: each uses only modules listed above it.
//! - [`key`] — [`RouteKey`]: what a message addresses (service, capability, topic, gRPC service).
//! - [`metrics`] — recording helpers for every `reach_router_*` metric.
//! - [`ledger`] — the bounded, batched sink through which the router records every message
//!   it routes in the orchestrator's message ledger (`OrchestratorService.RecordMessages`).
//! - [`retry`] — when a failed attempt may be sent again.
//! - [`load`] — the per-instance load signal (peak-EWMA latency × pending requests), the
//!   in-flight guard that counts a call against an instance's concurrency limit, and the
//!   [`load::Room`] that wakes calls waiting for one.
//! - [`endpoint`] — one instance: its connection, load, registry state and outlier-ejection
//!   record ([`endpoint::EjectionConfig`]), and a slot reserved on it.
//! - [`balance`] — the balancing policies (p2c over peak-EWMA or pending, round robin, random,
//!   weighted), the eligibility rules (ejected and BUSY instances avoided) and the injected
//!   randomness they draw from.
//! - [`config`] — [`RouterConfig`]: policies, ejection, admission, retry budget, protocol
//!   registry; its validation ([`config::ConfigError`]).
//! - [`error`] — [`RouteError`] and its mapping to gRPC statuses with ErrorInfo, and
//!   [`StartError`].
//! - [`envelope`] — the envelope rules every routed message is held to: header completion,
//!   size, target, TTL, deadline, forwarded metadata.
//! - [`table`] — the routing table — instances grouped into routes (service, capability, topic),
//!   updated from registry watch events — and admission (bounded wait for room, then shedding).
//! - [`protocol`] — versioned capabilities, version adapters and input validation from the
//!   protocol registry.
//! - [`watch`] — the loop that follows the registry's Watch stream, reconnecting on failure.
//! - [`pump`] — the inbound and outbound halves of a routed stream.
//! - [`passthrough`] — typed pass-through of agents' own gRPC services (raw HTTP/2 proxy).
//! - [`reflection`] — the agents' typed services' descriptors, fetched from their instances'
//!   reflection and kept (bounded), for server reflection on the router's port.
//! - [`service`] — [`Router`] and the `reach.v1.RouterService` RPCs, one submodule each:
//!   `call` (Call, CallMux), `stream` (Stream), `publish` (Publish), `reply` (Reply).

pub mod balance;
pub mod config;
pub mod endpoint;
pub mod envelope;
pub mod error;
pub mod key;
pub mod ledger;
pub mod load;
pub mod metrics;
pub mod passthrough;
pub mod protocol;
pub mod pump;
pub mod reflection;
pub mod retry;
pub mod service;
pub mod table;
pub mod watch;

pub use balance::Policy;
pub use config::RouterConfig;
pub use error::{RouteError, StartError};
pub use key::RouteKey;
pub use service::{FORWARDED_REPLY_METADATA, MAX_REPLY_PEERS, REPLIER_METADATA, Router};
pub use table::RoutingTable;
