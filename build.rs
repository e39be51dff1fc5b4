//! Generates the gRPC code from `proto/` with protox (a pure-Rust protobuf
//! compiler), so no system `protoc` is needed, and writes the file descriptor
//! set that server reflection serves.

use std::{env, path::PathBuf};

const PROTOS: &[&str] = &[
    "proto/kvroute/v1/common.proto",
    "proto/kvroute/v1/router.proto",
    "proto/kvroute/v1/workers.proto",
    "proto/kvroute/v1/admin.proto",
    "proto/kvroute/v1/snapshot.proto",
    "proto/kvroute/v1/cluster.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    let file_descriptors = protox::compile(PROTOS, ["proto"])?;
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    let descriptor_path = out_dir.join("kvroute_descriptor.bin");
    std::fs::write(
        &descriptor_path,
        prost::Message::encode_to_vec(&file_descriptors),
    )?;
    tonic_prost_build::configure()
        // Packed prompts are hashed where they lie in the received buffer:
        // as `Bytes` the field is a view of it, not a copy.
        .bytes(".kvroute.v1.Prompt.packed_token_ids")
        // The same message with a decoder that reads varint token ids
        // straight from the received slice (src/pb/token_ids.rs).
        .extern_path(".kvroute.v1.TokenIds", "crate::pb::token_ids::TokenIds")
        .build_client(true)
        .build_server(true)
        .compile_fds(file_descriptors)?;
    Ok(())
}
