//! The tools' tests: `ctl` against a real server, the replay simulator's
//! invariants on the committed trace sample, the soak benchmark's short
//! run, and real vLLM / SGLang publishers fed by trace prompts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

/// The server test helpers of kvroute's own tests (`tests/it/common`).
#[path = "../../../../tests/it/common/mod.rs"]
mod common;

mod bench_soak;
mod ctl;
mod engine_publishers;
mod replay_invariants;
