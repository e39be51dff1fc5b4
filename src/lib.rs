//! kvroute: a standalone KV-cache-aware routing service for LLM inference
//! fleets. The library holds everything; `main.rs` only parses the command
//! line and runs it.

pub mod admission;
pub mod app;
pub mod bench;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod ctl;
pub mod engine_events;
pub mod fleet;
/// Entry points of the fuzz targets (`fuzz/`) and their corpus replay test.
#[doc(hidden)]
pub mod fuzzing;
pub mod grpc;
pub mod hashing;
pub mod index;
pub mod ingest;
pub mod metrics;
pub mod oplog;
pub mod predict;
pub mod registry;
pub mod router;
pub mod security;
pub mod select;
pub mod sim;
pub mod snapshot;
pub mod telemetry;
pub mod tools;
pub mod trace;
pub mod types;

/// Code generated from `proto/kvroute/v1/*.proto`, and `TokenIds`, one of
/// its messages decoded by hand (`pb/token_ids.rs`).
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod pb {
    tonic::include_proto!("kvroute.v1");

    pub mod token_ids;
    pub use token_ids::TokenIds;

    /// The encoded file descriptor set of the kvroute API, for reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/kvroute_descriptor.bin"));
}
