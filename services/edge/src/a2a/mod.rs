//! The A2A v1 edge: any A2A client (gRPC or JSON-RPC) reaches the mesh's capabilities and
//! flows through it, as a mapping onto registry, router and orchestrator — never a second
//! engine, so routing, balancing, flows, human steps, tracing and the trust policy apply to
//! every call that comes through.
//!
//! - [`proto`]: the `lf.a2a.v1` contract (`proto/lf/a2a/v1/a2a.proto`, from the A2A v1
//!   specification).
//! - [`edge`]: the operations ([`A2aEdge`]).
//! - [`card`]: agent cards generated from the registry.
//! - [`mapping`]: states, parts, tasks and events between Reach and A2A.
//! - [`grpc`] and [`jsonrpc`]: the two bindings.
//! - [`error`]: A2A errors and their codes in both bindings.

pub mod card;
pub mod config;
pub mod edge;
pub mod error;
pub mod grpc;
pub mod jsonrpc;
pub mod mapping;
pub mod proto;

pub use config::EdgeConfig;
pub use edge::{A2aEdge, MeshChannels, RequestContext};
pub use grpc::A2aGrpc;
