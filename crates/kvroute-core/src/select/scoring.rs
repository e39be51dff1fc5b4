//! The scorer seam: how eligible candidates are ranked and one is chosen.
//!
//! Why it exists: routing policies change (tiered caches, output-length
//! prediction, fairness), and a new policy must be a new file implementing
//! [`Scorer`], not edits spread through the selection code. Invariants:
//! * selection builds one [`ScoreInput`] per candidate, sorted by
//!   `(worker_id, dp_rank)`, so a seeded scorer is reproducible whatever
//!   order the registry listed workers in;
//! * a scorer returns one [`CandidateScore`] per input, in input order, and
//!   the index of the chosen input; it returns `None` only for no input;
//! * scorers are pure apart from drawing from the given random source.

pub mod cost;
pub mod ttft;

pub use cost::CostScorer;
pub use ttft::{PrefillModel, TtftScorer, TtftSettings};

use rand::RngCore;

use crate::types::BookedLoad;
use crate::types::{RankLoad, WorkerRank};

/// What a scorer knows about one candidate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScoreInput {
    pub target: WorkerRank,
    /// Leading blocks of the prompt already cached on the target.
    pub overlap_blocks: u32,
    /// Blocks of this request (prompt, partial last block included).
    pub request_blocks: u32,
    /// Booked prefill blocks plus this request's uncached blocks.
    pub potential_prefill_blocks: u64,
    /// Booked prefill tokens plus this request's uncached tokens.
    pub potential_prefill_tokens: u64,
    /// Booked decode blocks plus this request's blocks.
    pub potential_decode_blocks: u64,
    /// Every block the target holds (the index's count), for tie-breaks.
    pub cached_blocks_total: u64,
    /// The request's SOFT session affinity points at this target.
    pub soft_affinity: bool,
    pub booked: BookedLoad,
    pub reported: RankLoad,
    pub expected_output_tokens: Option<u32>,
    /// The worker's batched-token budget per step (0: not registered).
    pub step_tokens: u64,
    /// The target's KV capacity in blocks (0: not registered).
    pub kv_capacity_blocks: u64,
    /// How much slower than the prior model the target's prefills ran
    /// (learned from RESERVE to MarkPrefillComplete; 1 until measured).
    pub prefill_scale: f64,
    /// ms until the target's queued prefill is done, as the router tracks
    /// it (`None`: estimate it from the booked prefill tokens).
    pub queued_prefill_ms: Option<f64>,
}

/// The effective scoring parameters of one request (config merged with the
/// request's overrides).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScoreParams {
    pub overlap_weight: f64,
    pub temperature: f64,
    /// Fraction of cost taken off a SOFT affinity target, in `[0, 1)`.
    pub soft_affinity_discount: f64,
    /// Cost taken off per cached prompt block, on top of the prefill it
    /// saves: staying where a prefix lives keeps it warm for the next turn.
    pub overlap_credit: f64,
}

/// A scorer's verdict on one candidate.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CandidateScore {
    pub prefill_cost: f64,
    pub decode_cost: f64,
    /// Final cost compared between candidates (lower wins).
    pub cost: f64,
    /// Sampling logit; `None` when the choice is deterministic (temperature 0).
    pub logit: Option<f64>,
    /// Probability of this candidate being chosen.
    pub probability: f64,
    /// The predicted time to first token and its parts (TTFT policy only).
    pub ttft: Option<TtftParts>,
}

/// A predicted time to first token, in its parts (ms, the target's learned
/// scale applied).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TtftParts {
    /// Prefill queued on the target ahead of this request.
    pub queued_prefill_ms: f64,
    /// This request's own uncached prefill.
    pub own_prefill_ms: f64,
    /// Decode work of the sequences the target holds, over those steps.
    pub decode_ms: f64,
    /// The target's learned slowness against the prior (1: as the prior).
    pub scale: f64,
    /// This request's uncached prompt tokens on the target.
    pub own_prefill_tokens: u64,
    /// The queue is the router's tracked one, not booked tokens.
    pub queue_tracked: bool,
}

impl TtftParts {
    /// The prediction: the parts' sum.
    pub fn total_ms(&self) -> f64 {
        self.queued_prefill_ms + self.own_prefill_ms + self.decode_ms
    }
}

/// Scores of every input plus the chosen input's index.
#[derive(Clone, Debug, PartialEq)]
pub struct ScoreOutcome {
    pub scores: Vec<CandidateScore>,
    pub chosen: usize,
}

/// A routing policy.
pub trait Scorer: Send + Sync {
    /// Short policy name, for logs and explain output.
    fn name(&self) -> &'static str;

    /// Scores `candidates` and picks one. `None` only when it is empty.
    fn score(
        &self,
        candidates: &[ScoreInput],
        params: &ScoreParams,
        rng: &mut dyn RngCore,
    ) -> Option<ScoreOutcome>;
}
