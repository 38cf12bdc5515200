//! The `reach` binary's library: configuration, the in-process control plane, the admin
//! HTTP port, and the CLI commands. `main.rs` only parses arguments and calls in here, so
//! tests start the same control plane in-process on ephemeral ports.
//!
//! # Layout
//! - [`config`] — [`config::ReachConfig`], layered from defaults, a TOML file, `REACH_*`
//!   environment variables and flags (figment).
//! - [`control_plane`] — registry and router (and, later, orchestrator) served together on
//!   one gRPC listener.
//! - [`bench`] — `reach bench router`, the router's cost against direct calls and NATS.
//! - [`admin`] — the HTTP admin port: reach-telemetry's `/metrics` and `/health`, plus
//!   `/agents`.
//! - [`demo`] — `reach demo`, the main job: the example fleet triaging the CFPB complaints.
//! - [`cli`] — client commands against a running mesh (`reach agents`).

pub mod admin;
pub mod bench;
pub mod cli;
pub mod config;
pub mod control_plane;
pub mod demo;
