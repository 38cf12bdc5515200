//! Compiles `proto/reach/v1/*.proto` with protox (pure Rust, no system protoc) and generates
//! tonic clients and servers plus a file descriptor set for gRPC server reflection.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let proto_root = manifest_dir.join("../../../proto").canonicalize()?;
    let mut files: Vec<PathBuf> = std::fs::read_dir(proto_root.join("reach/v1"))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "proto"))
        .collect();
    files.sort();
    println!("cargo:rerun-if-changed={}", proto_root.display());
    for file in &files {
        println!("cargo:rerun-if-changed={}", file.display());
    }

    let descriptors = protox::compile(&files, [&proto_root])?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out_dir.join("reach_descriptor.bin"),
        prost::Message::encode_to_vec(&descriptors),
    )?;
    tonic_prost_build::configure()
        // `bytes` fields (raw parts, error details) as `bytes::Bytes`: decoding slices the
        // receive buffer instead of copying, and a router cloning a message for a retry
        // shares the payload instead of copying it.
        .bytes(".reach.v1")
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}
