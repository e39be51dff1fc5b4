//! kvroute's tools beside the service: the trace replay simulator, the
//! benchmarks that print figures, `ctl` (the operator's client) and the
//! hash tool. They use the server (`kvroute`) and the routing domain
//! (`kvroute_core`) as a library; the server links none of them.

pub mod bench;
pub mod cli;
pub mod ctl;
pub mod demo;
pub mod hash_tool;
pub mod loadgen;
pub mod mock_engine;
pub mod oplog;
pub mod sim;
pub mod trace;
