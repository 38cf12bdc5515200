//! The Reach router: delivers each message to a healthy, lightly loaded instance of the
//! addressed service or capability.
//!
//! The router is stateless: its view of the mesh is a live copy of the registry, kept by a
//! `RegistryService.Watch` stream. Any number of replicas can run side by side.
//!
//! # Layout
//! - [`config`] — [`RouterConfig`]: policies, ejection, admission, retry budget, protocol registry.
//! - [`ledger`] — the bounded, batched sink through which the router records every message
//!   it routes in the orchestrator's message ledger (`OrchestratorService.RecordMessages`).
//! - [`load`] — the per-instance load signal (peak-EWMA latency × pending requests) and the
//!   in-flight guard that counts a call against an instance's concurrency limit.
//! - [`endpoint`] — one instance: its connection, load, registry state and outlier-ejection record.
//! - [`balance`] — the balancing policies (p2c over peak-EWMA or pending, round robin, random,
//!   weighted) and the eligibility rules (ejected and BUSY instances avoided).
//! - [`table`] — the routing table — instances grouped into routes (service, capability, topic),
//!   updated from registry watch events — and admission (bounded wait for room, then shedding).
//! - [`retry`] — when a failed attempt may be sent again.
//! - [`protocol`] — versioned capabilities, version adapters and input validation from the
//!   protocol registry.
//! - [`watch`] — the loop that follows the registry's Watch stream, reconnecting on failure.
//! - [`pump`] — the inbound and outbound halves of a routed stream.
//! - [`passthrough`] — typed pass-through of agents' own gRPC services (raw HTTP/2 proxy).
//! - [`service`] — the `reach.v1.RouterService` gRPC implementation (Call, Stream, Publish, Reply).
//! - [`error`] — [`RouteError`] and its mapping to gRPC statuses with ErrorInfo.

pub mod balance;
pub mod config;
pub mod endpoint;
pub mod error;
pub mod ledger;
pub mod load;
pub mod passthrough;
pub mod protocol;
pub mod pump;
pub mod retry;
pub mod service;
pub mod table;
pub mod watch;

pub use balance::Policy;
pub use config::RouterConfig;
pub use error::RouteError;
pub use service::Router;
pub use table::RoutingTable;
