//! The tools' tests: `ctl` against a real server, the replay simulator's
//! invariants on the committed trace sample, the soak benchmark's short
//! run, real vLLM / SGLang publishers fed by trace prompts, and the mock
//! engine as kvroute subscribes to it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

/// The server test helpers of kvroute's own tests (`tests/it/common`).
#[path = "../../../../tests/it/common/mod.rs"]
mod common;

mod bench_soak;
mod ctl;
mod demo;
mod engine_publishers;
mod mock_engine;
mod replay_invariants;
