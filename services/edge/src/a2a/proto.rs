//! The `lf.a2a.v1` types, server and client.
#![allow(missing_docs, clippy::all, clippy::pedantic)]
tonic::include_proto!("lf.a2a.v1");
include!(concat!(env!("OUT_DIR"), "/lf.a2a.v1.serde.rs"));

/// The encoded descriptor set of `proto/lf/a2a/v1/a2a.proto` (and its imports), for reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/a2a_descriptor.bin"));
