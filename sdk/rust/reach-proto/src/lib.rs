//! Rust bindings for the `reach.v1` protobuf contracts.
//!
//! # Layout
//! - [`v1`]: messages, clients (`*_client`) and servers (`*_server`) generated from
//!   `proto/reach/v1/*.proto` by `build.rs` (protox + tonic-prost-build; no protoc needed).
//! - [`json`] — conversions between `serde_json::Value` and `google.protobuf.Value`, and
//!   helpers to build and read message parts.
//! - [`names`] — the dotted-name rule of capabilities and topics.
//! - [`FILE_DESCRIPTOR_SET`]: the encoded descriptor set of every reach.v1 file, for gRPC
//!   server reflection (`tonic-reflection`).

/// The `reach.v1` package: envelope, registry, agent and router contracts.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod v1 {
    tonic::include_proto!("reach.v1");
}

impl v1::InstanceState {
    /// The state without the proto's `INSTANCE_STATE_` prefix ("READY", "DRAINING", …), as
    /// `reach agents`, the registry's logs and the router's errors name it.
    pub fn short_name(self) -> &'static str {
        let name = self.as_str_name();
        name.strip_prefix("INSTANCE_STATE_").unwrap_or(name)
    }
}

/// The encoded `google.protobuf.FileDescriptorSet` of every `reach.v1` file (and its imports).
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/reach_descriptor.bin"));

pub mod json;
pub mod names;
