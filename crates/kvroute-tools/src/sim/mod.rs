//! Discrete-event trace replay simulator.
//!
//! Replays a Mooncake-format trace against a fleet of simulated inference
//! engines in virtual time, so routing policies can be compared offline,
//! deterministically and fast, without GPUs or wall-clock sleeps. The engine
//! model follows the published behaviour of NVIDIA Dynamo's "mocker" (vLLM
//! style paged KV cache with prefix caching, continuous batching, chunked
//! prefill and polynomial step timings); see `engine` for the details.
//!
//! Entry point: [`replay`]. Routing policies plug in through [`Router`].
//!
//! # Dependency order
//!
//! The files depend on each other one way only. Each one below imports only
//! files above it (and `crate::trace` for the trace itself); none imports a
//! file further down:
//!
//! 1. `determinism`: seedless hasher, seeded random numbers.
//! 2. `engine`: one simulated engine (KV cache, scheduler, step timings).
//! 3. `types`: the values shared by the loop, the policies and the report
//!    (`SimConfig`, `SimRequest`, `FleetView`).
//! 4. `policy`: the `Router` seam and the baseline policies.
//! 5. `kvroute_policy`: kvroute's own core behind the `Router` seam.
//! 6. `replicas`: several `kvroute` policies as router replicas whose booked
//!    load reaches each other late or never.
//! 7. `report`: per-policy results (`Report`, `EngineStats`, `RequestOutcome`).
//! 8. `bounds`: TTFT floors from the trace alone (no queueing), under
//!    three cache models, printed under the replay table.
//! 9. `fleet`: the discrete-event loop, `replay`.
//! 10. `plot`: the `--plot` chart of reports (only with the `plot` feature).
//! 11. `cli`: `kvroute replay`, which uses all of the above.
//!
//! This file only declares the files and re-exports their main items.

pub mod bounds;
pub mod cli;
pub mod determinism;
pub mod engine;
pub mod event_link;
pub mod fleet;
pub mod kvroute_policy;
#[cfg(feature = "plot")]
pub mod plot;
pub mod policy;
pub mod replicas;
pub mod report;
pub mod types;

pub use engine::{EngineConfig, EngineKvEvent, EngineLoad, SimEngine, block_hashes};
pub use fleet::{replay, replay_with_progress};
pub use kvroute_policy::{DYNAMO_TIER_WEIGHTS, KvRouteKnobs, KvRoutePolicy};
pub use policy::{
    LeastLoaded, POLICY_NAMES, PrefixOnly, RandomRouter, RoundRobin, Router, policy_by_name,
};
pub use replicas::ReplicatedKvRoute;
pub use report::{Distribution, EngineStats, Report};
pub use types::{FleetView, ReplicaSetup, SimConfig, SimRequest, worker_rank};
