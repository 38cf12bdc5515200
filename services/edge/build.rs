//! Compiles `proto/lf/a2a/v1/a2a.proto` with protox (no system protoc): prost messages and a
//! tonic server for the gRPC binding, pbjson serde impls (proto3 JSON: camelCase names, enum
//! names, well-known types as JSON) for the JSON-RPC binding, and a descriptor set for
//! server reflection.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let proto_root = manifest_dir.join("../../proto").canonicalize()?;
    let file = proto_root.join("lf/a2a/v1/a2a.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let descriptors = protox::compile([&file], [&proto_root])?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    let encoded = prost::Message::encode_to_vec(&descriptors);
    std::fs::write(out_dir.join("a2a_descriptor.bin"), &encoded)?;
    tonic_prost_build::configure()
        // Struct, Value and Timestamp with serde impls, so the JSON binding renders them as
        // proto3 JSON does.
        .compile_well_known_types(true)
        .extern_path(".google.protobuf", "::pbjson_types")
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    pbjson_build::Builder::new()
        .register_descriptors(&encoded)?
        .ignore_unknown_fields()
        .build(&[".lf.a2a.v1"])?;
    Ok(())
}
