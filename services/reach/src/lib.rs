//! The `reach` binary's library: configuration, the in-process control plane, the admin
//! HTTP port, and the CLI commands. `main.rs` only parses arguments and calls in here, so
//! tests start the same control plane in-process on ephemeral ports.
//!
//! # Layout
//! - [`config`] — [`config::ReachConfig`], layered from defaults, a TOML file, `REACH_*`
//!   environment variables and flags (figment).
//! - [`control_plane`] — registry and router (and, later, orchestrator) served together on
//!   one gRPC listener.
//! - [`admin`] — the HTTP admin port: reach-telemetry's `/metrics`, `/health` and `/ready`,
//!   plus `/agents` and `DELETE /agents/{service}` (the orchestrator adds its `/tasks` routes),
//!   and the list of paths the startup banner prints.
//! - [`demo`] — `reach demo`, the main job: the example fleet triaging the CFPB complaints.
//! - [`demo_report`] — `reach demo report`: an LLM agent with mesh and local tools writes a
//!   complaint report from the CSV.
//! - [`cli`] — client commands against a running mesh: `reach agents`, `reach flow`,
//!   `reach task`, `reach dump`; and local ones: `reach certs`, `reach token`.
//! - [`owner_only`] — files and directories created readable by their owner alone (keys,
//!   `reach dev`'s data directory).
//! - [`top`] — `reach top`, the live terminal board (registry instances and the admin port's
//!   metrics, drawn with ratatui).
//!
//! Output goes to stdout through `write!` and errors, never `print!`, whose panic on a closed
//! stdout would bypass the binary's quiet exit when the reader went away.
#![warn(clippy::print_stdout)]

pub mod admin;
pub mod cli;
pub mod config;
pub mod control_plane;
pub mod demo;
pub mod demo_report;
pub mod owner_only;
pub mod top;
