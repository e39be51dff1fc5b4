//! The gRPC edge: thin handlers that translate protobuf to domain calls and
//! back (`convert`), the Admin messages as JSON (`json`), one error mapping to `tonic::Status` (`status`), and the
//! RPC metrics layer. The Workers and Admin handlers change state through
//! the fleet's seam (`fleet::changes`), the same alone or as a replica.

pub mod admin;
pub mod convert;
pub mod event_inbox;
pub mod json;
pub mod metadata_budget;
pub mod router;
pub mod rpc_metrics;
pub mod startup_gate;
pub mod status;
pub mod workers;
