//! The Reach capability registry: which agent instances exist, what they can do, and whether
//! they may take work.
//!
//! Registration is soft state held by leases, in the manner of etcd leases and Consul
//! sessions: an instance stays routable only while it renews its lease with heartbeats.
//!
//! # Layout
//! - [`config`] — [`RegistryConfig`], lease bounds and probing.
//! - [`store`] — [`Registry`], the in-memory instance table, its revisions and its watchers.
//! - [`capabilities`] — capability descriptors: checking what a registration declares
//!   (description, input and output JSON Schemas) and merging them with the protocol
//!   registry's for ListCapabilities.
//! - [`backend`] — [`Backend`]: the table in memory or, with the `etcd` feature, in etcd.
//! - [`etcd`](mod@etcd) — the etcd v3 backend (feature `etcd`): instances as keys on etcd leases, a
//!   mirrored table per replica, health probing split between replicas.
//! - [`etcd_tls`](mod@etcd_tls) — TLS to etcd with rustls (CA, client certificate).
//! - [`service`] — the `reach.v1.RegistryService` gRPC implementation over a [`Registry`].
//! - [`probe`] — the first health probe that moves an instance from REGISTERED to READY.
//! - [`limits`] — with trust on: Watch slots per identity (and held back for routers), and the
//!   pace of health probes per registrant identity.
//! - [`tokens`] — one-time join tokens already used.
//! - [`error`] — [`RegistryError`] and its mapping to gRPC statuses; [`InitError`].
//! - [`metrics`] — instances per state, lease expiries and RPCs by code.

pub mod backend;
pub mod capabilities;
pub mod config;
pub mod error;
#[cfg(feature = "etcd")]
pub mod etcd;
#[cfg(feature = "etcd")]
pub mod etcd_tls;
pub mod limits;
pub mod metrics;
pub mod probe;
pub mod service;
pub mod store;
pub mod tokens;

pub use backend::Backend;
pub use config::{ConfigError, RegistryConfig};
pub use error::{InitError, RegistryError};
pub use service::RegistryGrpc;
pub use store::Registry;
