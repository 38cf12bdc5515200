//! Reach's benchmarks, apart from the services and the SDK so that neither links a load
//! generator, HDR histograms or a NATS client. Each prints its figures side by side in one run
//! and ends with one tracking line (`docs/benchmarks.md` has the latest figures).
//!
//! # Layout
//! - [`router`] — `reach-bench router`: a routed call's cost next to a direct call, the same
//!   unary call through nginx and HAProxy, and NATS request-reply, unary and multiplexed, at
//!   several payload sizes and concurrencies.
//! - [`mtls`](mod@mtls) — the router bench's mutual-TLS mesh (`--mtls`): certificates made at start, and
//!   the table of plaintext and mTLS cells side by side.
//! - [`flows`] — `reach-bench flows`: durable node transitions per second on SQLite (and
//!   PostgreSQL).
//! - [`mcp`] — `reach-bench mcp`: a tool call through the MCP edge next to the same call
//!   through the router.
//! - [`registry`] — `reach-bench registry`: registration, register → routable and Watch
//!   fan-out at 10,000 instances and 100 watchers, and memory per instance.

pub mod flows;
pub mod mcp;
mod mtls;
pub mod registry;
pub mod router;
