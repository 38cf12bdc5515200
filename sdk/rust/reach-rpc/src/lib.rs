//! gRPC plumbing shared by every Reach service and the SDK.
//!
//! # Layout
//! - [`backoff`] — capped exponential back-off ([`backoff::Backoff`]), shared by every retry
//!   loop.
//! - [`server`] — [`GrpcServer`] serves tonic services on a caller-bound listener, always with
//!   `grpc.health.v1` and server reflection (v1 and v1alpha, so grpcurl 1.8 works).
//! - [`reflection`] — server reflection over descriptor sets plus a [`reflection::ReflectionSource`]
//!   asked at request time.
//! - [`hosts`] — which `Host`s an HTTP port answers ([`hosts::AllowedHosts`]: the defence
//!   against DNS rebinding).
//! - [`http2`] — the HTTP/2 settings servers and data-path channels advertise, and
//!   [`http2::endpoint`] to build such a channel.
//! - [`admission`] — [`admission::Admission`]: a check every request to a [`GrpcServer`]
//!   passes before routing (an agent answers only routers).
//! - [`authenticate`] — TLS on accepted connections and each request's caller
//!   ([`reach_trust::Caller`]), for servers given a [`reach_trust::Trust`].
//! - [`limits`] — [`limits::ConnectionLimits`]: connections at once, handshake time and
//!   buffered message bytes per listener, enforced by [`server::serve_http`].
//! - [`deadline`] — the `grpc-timeout` header (gRPC over HTTP/2 spec), parsed and written.
//! - [`trace`] — W3C trace ids (`traceparent`), validated and generated.
//! - [`errors`] — statuses with `google.rpc.ErrorInfo` details, and their reasons.
//! - [`mux`] — many concurrent request-reply calls over one bidirectional stream
//!   (`CallFrame` / `ReplyFrame`): [`mux::MuxLink`] for callers, [`mux::serve`] for callees.
//! - [`time`] — conversions between `std::time` and the protobuf well-known types.
//! - [`usage`] — model token usage in reply metadata ([`usage::TokenUsage`]).

pub mod admission;
pub mod authenticate;
pub mod backoff;
pub mod deadline;
pub mod errors;
pub mod hosts;
pub mod http2;
pub mod limits;
pub mod mux;
pub mod reflection;
pub mod server;
pub mod time;
pub mod trace;
pub mod usage;

pub use limits::{ConnectionLimits, ReplyBudget};
pub use server::GrpcServer;

/// The payload type of an acknowledgement: an agent that will answer asynchronously (the
/// request carried `header.reply_to`) returns a payload of this type at once and sends the
/// real answer later through `RouterService.Reply`.
pub const ACK_PAYLOAD_TYPE: &str = "reach.ack";
