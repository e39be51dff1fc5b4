//! The values the simulator's parts hand each other: the run's
//! configuration, a request as a router sees it, and the fleet view a router
//! may observe.
//!
//! They sit below the event loop (`fleet`), the policies (`policy`,
//! `kvroute_policy`) and the report (`report`) so those files can share them
//! without importing each other.

use super::engine::{EngineConfig, EngineLoad};
use kvroute_core::types::WorkerRank;

/// Fleet and run parameters.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SimConfig {
    /// Number of engines.
    pub workers: usize,
    /// Arrival times are trace timestamps divided by this.
    pub speedup: f64,
    /// Seed for randomised policies (passed to `policy_by_name`).
    pub seed: u64,
    pub engine: EngineConfig,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            workers: 4,
            speedup: 1.0,
            seed: 42,
            engine: EngineConfig::default(),
        }
    }
}

/// Several router replicas sharing one fleet (`kvroute replay
/// --router-replicas`): how many, and when one replica's booked load reaches
/// the others. Shown in the report so a reader knows what was run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReplicaSetup {
    /// Router replicas; request `i` is routed by replica `i % count`.
    pub count: usize,
    /// Virtual milliseconds after which a replica's bookings, prefill
    /// completions and releases reach the other replicas; `None`: never.
    /// With `ordered`, the time a decision's record takes through the log
    /// and back.
    pub sync_delay_ms: Option<f64>,
    /// Decisions ordered through the replicated log (`--ordered-decisions`):
    /// every replica applies every decision, in one order.
    pub ordered: bool,
}

impl std::fmt::Display for ReplicaSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} router replicas (request i routed by replica i mod {}), ",
            self.count, self.count
        )?;
        match self.sync_delay_ms {
            Some(ms) if self.ordered => write!(
                f,
                "decisions ordered through the log: each waits {ms} ms for its record, \
                 every replica applies it"
            ),
            Some(ms) => write!(f, "booked load reaches the other replicas after {ms} ms"),
            None => write!(f, "booked load never reaches the other replicas"),
        }
    }
}

/// A request as routers see it.
#[derive(Clone, Debug)]
pub struct SimRequest {
    /// Index of the request in the trace.
    pub id: u64,
    pub arrival_ms: f64,
    /// Prompt tokens.
    pub tokens: Vec<u32>,
    /// Engine hash chain of the prompt's full blocks (`engine::block_hashes`
    /// with the engine block size): what the engines' KV events name.
    pub block_hashes: Vec<u64>,
    pub output_length: usize,
}

/// What a router may observe about the fleet at routing time.
#[derive(Clone, Copy, Debug)]
pub struct FleetView<'a> {
    /// Per-engine load, indexed by engine.
    pub engines: &'a [EngineLoad],
    /// Engine KV block size in tokens.
    pub block_size: usize,
    /// Engine step token budget.
    pub max_num_batched_tokens: usize,
}

/// kvroute's routing target for engine `engine`: worker id = engine index,
/// a single data-parallel rank 0.
pub fn worker_rank(engine: usize) -> WorkerRank {
    WorkerRank::new(engine as u64, 0)
}

impl FleetView<'_> {
    #[cfg(test)]
    /// The fleet as kvroute's registry would describe it (one aggregated,
    /// single-rank worker per engine, ids as in [`worker_rank`]), so the real
    /// selection code can consume it.
    pub(crate) fn snapshots(&self, model: &str) -> Vec<kvroute_core::types::WorkerSnapshot> {
        use kvroute_core::types::{RankLoad, WorkerRole, WorkerSnapshot};
        self.engines
            .iter()
            .enumerate()
            .map(|(i, load)| WorkerSnapshot {
                tiers: Vec::new(),
                worker_id: worker_rank(i).worker_id,
                model: model.to_string(),
                endpoint: String::new(),
                role: WorkerRole::Aggregated,
                block_size: self.block_size as u32,
                dp_start_rank: 0,
                dp_size: 1,
                total_kv_blocks: load.total_blocks as u64,
                max_num_batched_tokens: self.max_num_batched_tokens as u64,
                taints: Vec::new(),
                adapters: Vec::new(),
                loads_adapters: false,
                cordoned: false,
                kv_events: Default::default(),
                load: vec![(
                    0,
                    RankLoad {
                        running_requests: load.running as u32,
                        waiting_requests: load.waiting as u32,
                        kv_blocks_used: load.active_blocks as u64,
                    },
                )],
            })
            .collect()
    }

    pub fn len(&self) -> usize {
        self.engines.len()
    }

    pub fn is_empty(&self) -> bool {
        self.engines.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_setup_says_how_load_is_shared() {
        let synced = ReplicaSetup {
            count: 3,
            sync_delay_ms: Some(10.0),
            ordered: false,
        };
        assert_eq!(
            synced.to_string(),
            "3 router replicas (request i routed by replica i mod 3), booked load reaches \
             the other replicas after 10 ms"
        );
        let ordered = ReplicaSetup {
            ordered: true,
            ..synced
        };
        assert!(
            ordered
                .to_string()
                .ends_with("decisions ordered through the log: each waits 10 ms for its record, every replica applies it"),
            "{ordered}"
        );
        let unsynced = ReplicaSetup {
            sync_delay_ms: None,
            ..synced
        };
        assert!(
            unsynced
                .to_string()
                .ends_with("never reaches the other replicas")
        );
    }

    #[test]
    fn snapshots_describe_each_engine_as_a_worker() {
        let loads = vec![
            EngineLoad {
                running: 2,
                waiting: 1,
                active_blocks: 30,
                total_blocks: 100,
                cached_blocks: 40,
                prefill_tokens_queued: 7,
                host_blocks: 0,
            };
            2
        ];
        let view = FleetView {
            engines: &loads,
            block_size: 64,
            max_num_batched_tokens: 8192,
        };
        let snaps = view.snapshots("m");
        assert_eq!(snaps.len(), 2);
        assert_eq!(snaps[1].worker_id, 1);
        assert_eq!(snaps[1].unique_dp_rank(), Some(0));
        assert_eq!(snaps[0].rank_load(0).kv_blocks_used, 30);
        assert_eq!(snaps[0].rank_load(0).running_requests, 2);
    }
}
