//! kvroute's integration tests: the real server over real gRPC (and, for
//! the cluster tests, real `nats-server` replicas), as one test binary so
//! that tonic, async-nats and rustls are linked once. Each module is one
//! area; `common` starts servers, workers and replicas for them.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

mod adapters;
mod approximate;
mod cli;
mod cluster;
mod durable_state;
mod engine_reconnect;
mod error_codes;
mod event_stream;
mod foundation;
mod gateway;
mod layering;
mod limits;
mod ordered;
mod packed_tokens;
mod pools;
mod routing;
mod security;
mod tiers;
mod workers;
