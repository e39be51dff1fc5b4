//! kvroute: a standalone KV-cache-aware routing service for LLM inference
//! fleets. This crate is the server: gRPC, the worker lifecycle, ingest,
//! the router core, cluster mode, security, snapshots, engine events and
//! the wiring; the routing domain is `kvroute_core`, and the tools
//! (`crates/kvroute-tools`) use this crate as a library. `main.rs` only
//! parses the command line and runs it.

pub mod app;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod engine_events;
pub mod fleet;
/// Entry points of the fuzz targets (`fuzz/`, feature `fuzzing`) and
/// their corpus replay (a unit test), never in the server binary.
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
pub mod gateway;
pub mod grpc;
pub mod http_listener;
pub mod ingest;
pub mod metrics;
pub mod pools;
pub mod router;
pub mod security;
pub mod snapshot;
pub mod telemetry;
pub mod tools;
pub mod web;

/// Code generated from `proto/kvroute/v1/*.proto`, and `TokenIds`, one of
/// its messages decoded by hand (`pb/token_ids.rs`).
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod pb {
    tonic::include_proto!("kvroute.v1");

    pub mod cache_tier;
    mod kv_events_mode;
    mod lora_adapter;
    pub mod token_ids;
    pub use token_ids::TokenIds;

    /// The encoded file descriptor set of the kvroute API, for reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/kvroute_descriptor.bin"));
}
