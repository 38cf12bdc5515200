//! The Reach router: delivers each message to a healthy, lightly loaded instance of the
//! addressed service or capability.
//!
//! The router is stateless: its view of the mesh is a live copy of the registry, kept by a
//! `RegistryService.Watch` stream. Any number of replicas can run side by side.
//!
//! # Layout
//! - [`config`] — [`RouterConfig`].
//! - [`load`] — the per-instance load signal (peak-EWMA latency × pending requests) that the
//!   balancer compares.
//! - [`endpoint`] — one instance as a `tower::Service` that forwards unary calls and streams.
//! - [`table`] — the routing table — instances, and one tower p2c balancer per route (service
//!   name or capability) — updated from registry watch events.
//! - [`watch`] — the loop that follows the registry's Watch stream, reconnecting on failure.
//! - [`pump`] — the inbound and outbound halves of a routed stream.
//! - [`service`] — the `reach.v1.RouterService` gRPC implementation (Call, Stream).
//! - [`error`] — [`RouteError`] and its mapping to gRPC statuses with ErrorInfo.

pub mod config;
pub mod endpoint;
pub mod error;
pub mod load;
pub mod pump;
pub mod service;
pub mod table;
pub mod watch;

pub use config::RouterConfig;
pub use error::RouteError;
pub use service::Router;
pub use table::RoutingTable;
