//! The worker-selection decision: which (worker, dp rank) serves a request.
//!
//! Why it exists: this is the router's core choice, and it must be the same
//! whether it is called to route (RESERVE), to preview (QUERY_ONLY) or to
//! explain. Invariants:
//! * [`select`] is pure: it reads the registry snapshots, index overlaps,
//!   booked loads and session table it is given and changes none of them.
//!   RESERVE callers book afterwards (`admission::commit`);
//! * a pin (hints, HARD session affinity, planned worker) is resolved and
//!   validated before scoring; a pinned target is never replaced by another;
//! * eligibility never depends on load: busy candidates are skipped only
//!   while some eligible candidate is not busy, and when every eligible
//!   candidate is busy the best busy one is returned with `all_busy` set so
//!   the caller can queue, reject or answer advisorily. A candidate busy
//!   with prefill backlog is still scored when its backlog plus the
//!   request's own uncached prefill is no more than the least of the idle
//!   candidates' (it holds the prompt; they would compute it all again);
//! * candidates are scored in `(worker_id, dp_rank)` order, so a seeded
//!   random source gives the same choice for the same inputs;
//! * every candidate of the model appears in [`Selection::candidates`], with
//!   why it was not eligible or its score.

pub mod affinity;
mod constraints;
pub mod eligibility;
pub mod error;
pub mod pins;
pub mod scoring;
pub mod tier_savings;

use std::collections::HashSet;

use crate::types::RankMap;
use crate::types::{Tier, TierBlocks};

use rand::RngCore;

use crate::types::{
    BookedLoad, CacheView, DpRank, RankLoad, RequestPhase, WorkerId, WorkerRank, WorkerSnapshot,
};

pub use affinity::{AffinityMode, SessionRef, SessionTable};
use constraints::Constraints;
pub use eligibility::{Busy, BusyThresholds, Eligibility, Ineligible};
pub use error::{ErrorCode, SelectError};
pub use pins::PinTarget;
pub use scoring::{
    CandidateScore, CostScorer, ScoreInput, ScoreParams, Scorer, TtftParts, TtftScorer,
    TtftSettings,
};
pub use tier_savings::TierSavings;

/// Read access to the load booked per (worker, rank): selection is fed by
/// the router's booking ledger (`admission::bookings`) or, in tests and
/// previews, by a plain map.
pub trait BookedLoads {
    fn booked(&self, target: WorkerRank) -> BookedLoad;
}

impl BookedLoads for std::collections::HashMap<WorkerRank, BookedLoad> {
    fn booked(&self, target: WorkerRank) -> BookedLoad {
        self.get(&target).copied().unwrap_or_default()
    }
}

/// What the router has measured of each target's prefills (the TTFT
/// policy reads it; `admission::prefill_times` keeps it).
pub trait PrefillTiming {
    /// How much slower than the prior the target's prefills run; 1 = as
    /// the prior.
    fn scale(&self, target: WorkerRank) -> f64;
    /// ms until the prefill queued on the target is done, as the router
    /// tracks it; `None` when it tracks none there.
    fn queue_ms(&self, target: WorkerRank, now_ms: u64) -> Option<f64>;
}

/// Nothing measured: every target runs as the prior, from booked tokens.
impl PrefillTiming for () {
    fn scale(&self, _target: WorkerRank) -> f64 {
        1.0
    }

    fn queue_ms(&self, _target: WorkerRank, _now_ms: u64) -> Option<f64> {
        None
    }
}

/// Routing hints a frontend attaches to a request.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RoutingHints {
    pub backend_instance_id: Option<WorkerId>,
    pub prefill_worker_id: Option<WorkerId>,
    pub decode_worker_id: Option<WorkerId>,
    pub dp_rank: Option<DpRank>,
    pub prefill_dp_rank: Option<DpRank>,
    /// `None`: every worker allowed. `Some(empty)` allows none, so the gRPC
    /// layer maps an empty repeated field to `None`.
    pub allowed_worker_ids: Option<HashSet<WorkerId>>,
    /// Taints the request tolerates (exact string match).
    pub tolerated_taints: Vec<String>,
    /// Passed to the scorer; the default policy does not use it.
    pub expected_output_tokens: Option<u32>,
    /// Seconds the request jumps ahead in the WAIT queue (admission only).
    pub priority_jump: f64,
    /// Higher classes leave the WAIT queue first (admission only).
    pub strict_priority: u32,
    pub policy_class: Option<String>,
}

/// RESERVE books the request's load once routed; QUERY_ONLY changes nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SelectMode {
    #[default]
    Reserve,
    QueryOnly,
}

/// Per-request overrides of the scoring configuration.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ScoringOverrides {
    pub overlap_weight: Option<f64>,
    pub temperature: Option<f64>,
}

/// Everything about one request that selection needs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SelectRequest {
    pub request_id: String,
    pub model: String,
    /// The LoRA adapter asked for: only workers that serve it, declare no
    /// adapters, or load adapters on request are eligible.
    pub adapter: Option<String>,
    pub phase: RequestPhase,
    /// Prompt length in tokens. With precomputed hashes only, the caller
    /// passes `hashes * block_size`.
    pub prompt_tokens: u64,
    pub block_size: u32,
    pub hints: RoutingHints,
    pub session: Option<SessionRef>,
    /// A target chosen by an earlier preview; must agree with any pin.
    pub planned_worker: Option<WorkerRank>,
    /// Workers this request already failed on (migration).
    pub excluded_worker_ids: HashSet<WorkerId>,
    pub mode: SelectMode,
    pub overrides: ScoringOverrides,
}

impl SelectRequest {
    /// Blocks of the prompt, the partial last one included.
    pub(crate) fn total_blocks(&self) -> u64 {
        if self.block_size == 0 {
            0
        } else {
            self.prompt_tokens.div_ceil(u64::from(self.block_size))
        }
    }
}

/// Router-wide selection settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SelectConfig {
    /// Weight of prefill blocks against decode blocks. Default 1.0.
    pub overlap_weight: f64,
    /// 0 picks the cheapest; above 0 samples a softmax. Default 0.0.
    pub temperature: f64,
    pub busy: BusyThresholds,
    /// Fraction of cost taken off a SOFT affinity target. Default 0.1.
    pub soft_affinity_discount: f64,
    /// Cost taken off per cached prompt block beyond the prefill it saves.
    /// Default 0.0.
    pub overlap_credit: f64,
    /// What a block in each tier saves of its prefill, for workers that
    /// declare no saving of their own.
    pub tier_savings: TierSavings,
    /// What loading a LoRA adapter costs a worker that loads adapters on
    /// request and does not serve the one asked for, in prefill tokens.
    /// Default 4096.
    pub adapter_load_tokens: u64,
}

impl Default for SelectConfig {
    fn default() -> Self {
        Self {
            overlap_weight: 1.0,
            temperature: 0.0,
            busy: BusyThresholds::default(),
            soft_affinity_discount: 0.1,
            overlap_credit: 0.0,
            tier_savings: TierSavings::DEFAULT,
            adapter_load_tokens: DEFAULT_ADAPTER_LOAD_TOKENS,
        }
    }
}

/// Default of [`SelectConfig::adapter_load_tokens`]: loading an adapter
/// from host memory takes about as long as a 4k-token prefill (a rank-16
/// adapter of an 8B model is some 50-100 MB).
pub const DEFAULT_ADAPTER_LOAD_TOKENS: u64 = 4096;

/// Most [`SelectConfig::adapter_load_tokens`] a configuration may set
/// (`kvroute serve --adapter-load-tokens`): far above any real load, and
/// far below what could overflow a prefill estimate.
pub const MAX_ADAPTER_LOAD_TOKENS: u64 = 1 << 24;

fn non_negative(name: &str, v: f64) -> Result<(), String> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(format!("{name} must be a finite number >= 0, got {v}"))
    }
}

impl SelectConfig {
    #[cfg(test)]
    /// Checks the settings; call once when loading configuration.
    pub(crate) fn validate(&self) -> Result<(), String> {
        non_negative("overlap_weight", self.overlap_weight)?;
        non_negative("temperature", self.temperature)?;
        non_negative("overlap_credit", self.overlap_credit)?;
        self.tier_savings.validate()?;
        if self.adapter_load_tokens > MAX_ADAPTER_LOAD_TOKENS {
            return Err(format!(
                "adapter_load_tokens must be at most {MAX_ADAPTER_LOAD_TOKENS}, got {}",
                self.adapter_load_tokens
            ));
        }
        non_negative("busy prefill factor", self.busy.prefill_factor)?;
        non_negative("busy kv usage fraction", self.busy.kv_usage_fraction)?;
        if !(0.0..1.0).contains(&self.soft_affinity_discount) {
            return Err(format!(
                "soft_affinity_discount must be in [0, 1), got {}",
                self.soft_affinity_discount
            ));
        }
        Ok(())
    }
}

/// The state selection reads. Nothing in it is modified.
#[derive(Clone, Copy)]
pub struct SelectContext<'a> {
    /// Registry snapshots of the request's model.
    pub workers: &'a [WorkerSnapshot],
    /// Leading prompt blocks cached per target (index lookup), in any
    /// tier; absent = 0.
    pub overlaps: &'a RankMap<u32>,
    /// How the overlaps of targets holding some of them below the device
    /// split by tier; absent = all on the device.
    pub tier_overlaps: &'a RankMap<TierBlocks>,
    /// Total blocks cached per target (index); absent = 0. Tie-break input.
    pub cached_blocks: &'a RankMap<u64>,
    pub booked: &'a dyn BookedLoads,
    pub sessions: &'a SessionTable,
    /// Time for session lookups, in the session table's milliseconds.
    pub now_ms: u64,
    /// Measured prefill speed and queue per target (the TTFT policy reads
    /// it).
    pub prefill_timing: &'a dyn PrefillTiming,
}

/// What fixed the target when it was not scored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PinSource {
    /// The phase's routing hints (possibly with the affinity's rank).
    Hint,
    /// A HARD session affinity that names a rank.
    Affinity,
    /// A previewed worker.
    Planned,
}

/// How the target was chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Route {
    Scored,
    Pinned(PinSource),
}

/// One candidate as explain shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct CandidateReport {
    pub target: WorkerRank,
    /// `Err` says why the candidate could not be chosen.
    pub eligible: Result<(), Ineligible>,
    pub busy: Option<Busy>,
    /// Leading prompt blocks the target holds, in any tier.
    pub overlap_blocks: u32,
    /// `overlap_blocks` by the fastest tier holding each block.
    pub tiers: TierBlocks,
    /// `overlap_blocks` weighed by what each tier saves (see
    /// [`TierSavings`]); what the prefill estimate takes off.
    pub effective_overlap_blocks: f64,
    /// It must load the request's adapter first; its prefill estimate
    /// includes the load.
    pub loads_adapter: bool,
    pub potential_prefill_tokens: u64,
    pub potential_prefill_blocks: u64,
    pub potential_decode_blocks: u64,
    pub booked: BookedLoad,
    /// `None` when not scored: ineligible, not pinned, or busy while a
    /// non-busy candidate existed.
    pub score: Option<CandidateScore>,
    pub chosen: bool,
    /// Which view of its cache `overlap_blocks` came from (set by the
    /// router, which chose the view; exact unless it says otherwise).
    pub view: CacheView,
}

/// The decision.
#[derive(Clone, Debug, PartialEq)]
pub struct Selection {
    pub target: WorkerRank,
    pub route: Route,
    pub overlap_blocks: u32,
    /// `overlap_blocks` by tier.
    pub tiers: TierBlocks,
    /// `overlap_blocks` weighed by what each tier saves; equal to it when
    /// every block is on the device.
    pub effective_overlap_blocks: f64,
    pub cached_tokens: u64,
    pub total_blocks: u32,
    /// This request's own prefill: uncached tokens and blocks (what RESERVE
    /// books).
    pub request_prefill_tokens: u64,
    pub request_prefill_blocks: u64,
    pub potential_prefill_tokens: u64,
    pub potential_prefill_blocks: u64,
    pub potential_decode_blocks: u64,
    /// The target's current booked and reported load (ADVISORY answers).
    pub booked: BookedLoad,
    pub reported: RankLoad,
    /// Why the target is busy, if it is.
    pub busy: Option<Busy>,
    /// Every eligible candidate (for a pin: the pinned one) is busy.
    pub all_busy: bool,
    pub policy: &'static str,
    pub candidates: Vec<CandidateReport>,
}

impl Selection {
    /// The TTFT policy's prediction for the chosen target, if it made one.
    pub fn chosen_ttft(&self) -> Option<TtftParts> {
        self.candidates
            .iter()
            .find(|c| c.chosen)
            .and_then(|c| c.score.as_ref())
            .and_then(|s| s.ttft)
    }
}

struct Prepared<'a> {
    worker: &'a WorkerSnapshot,
    report: CandidateReport,
    input: ScoreInput,
}

fn invalid(req: &SelectRequest, reason: impl Into<String>) -> SelectError {
    SelectError::InvalidArgument {
        request_id: req.request_id.clone(),
        reason: reason.into(),
    }
}

fn validate(req: &SelectRequest) -> Result<u32, SelectError> {
    if req.request_id.is_empty() {
        return Err(invalid(req, "request_id is empty"));
    }
    if req.block_size == 0 {
        return Err(invalid(req, "block_size is 0"));
    }
    if req.prompt_tokens == 0 {
        return Err(invalid(req, "the prompt is empty"));
    }
    let total = u32::try_from(req.total_blocks())
        .map_err(|_| invalid(req, "the prompt has more than u32::MAX blocks"))?;
    if let Some(w) = req.overrides.overlap_weight {
        non_negative("overlap_weight override", w).map_err(|e| invalid(req, e))?;
    }
    if let Some(t) = req.overrides.temperature {
        non_negative("temperature override", t).map_err(|e| invalid(req, e))?;
    }
    if !req.hints.priority_jump.is_finite() {
        return Err(invalid(req, "priority_jump is not finite"));
    }
    if req
        .session
        .as_ref()
        .is_some_and(|s| s.session_id.is_empty())
    {
        return Err(invalid(req, "session_id is empty"));
    }
    Ok(total)
}

/// Chooses the target of `req`. Pure: books nothing, binds no session.
///
/// `scorer` is the policy (normally [`CostScorer`]); `rng` only breaks
/// exact ties and samples at temperature > 0.
pub fn select(
    req: &SelectRequest,
    ctx: &SelectContext<'_>,
    config: &SelectConfig,
    scorer: &dyn Scorer,
    rng: &mut dyn RngCore,
) -> Result<Selection, SelectError> {
    let total_blocks = validate(req)?;
    let workers = model_workers(req, ctx)?;
    let no_exclusions = HashSet::new();
    let constraints = Constraints::resolve(req, ctx, &workers, &no_exclusions)?;
    let mut prepared = candidates(req, ctx, config, &workers, &constraints, total_blocks);
    let (scored, all_busy) = to_score(req, &constraints, &prepared)?;
    let params = score_params(req, config);
    let chosen = score_and_choose(req, scorer, &params, rng, &mut prepared, &scored)?;
    Ok(selection(
        req,
        scorer,
        constraints.pinned,
        total_blocks,
        all_busy,
        prepared,
        chosen,
    ))
}

/// The request's scoring parameters: its overrides, else the router's.
fn score_params(req: &SelectRequest, config: &SelectConfig) -> ScoreParams {
    ScoreParams {
        overlap_weight: req
            .overrides
            .overlap_weight
            .unwrap_or(config.overlap_weight),
        temperature: req.overrides.temperature.unwrap_or(config.temperature),
        soft_affinity_discount: config.soft_affinity_discount.clamp(0.0, 0.999),
        overlap_credit: config.overlap_credit,
    }
}

/// The registry's workers by id, once each; an error if one of the
/// request's model hashes at another block size than the request did.
fn model_workers<'a>(
    req: &SelectRequest,
    ctx: &SelectContext<'a>,
) -> Result<Vec<&'a WorkerSnapshot>, SelectError> {
    let mut workers: Vec<&WorkerSnapshot> = ctx.workers.iter().collect();
    workers.sort_by_key(|w| w.worker_id);
    workers.dedup_by_key(|w| w.worker_id);
    if let Some(w) = workers
        .iter()
        .find(|w| w.model == req.model && w.block_size != 0 && w.block_size != req.block_size)
    {
        return Err(SelectError::BlockSizeMismatch {
            request_id: req.request_id.clone(),
            worker_id: w.worker_id,
            worker_block_size: w.block_size,
            request_block_size: req.block_size,
        });
    }
    Ok(workers)
}

/// Every candidate of the model, in (worker, rank) order, with why it is
/// not eligible or what it would cost.
fn candidates<'a>(
    req: &SelectRequest,
    ctx: &SelectContext<'_>,
    config: &SelectConfig,
    workers: &[&'a WorkerSnapshot],
    constraints: &Constraints<'_>,
    total_blocks: u32,
) -> Vec<Prepared<'a>> {
    let elig = constraints.eligibility();
    let mut prepared = Vec::new();
    for w in workers {
        let worker_ok = elig.check_worker(w);
        for dp_rank in w.ranks() {
            let target = WorkerRank::new(w.worker_id, dp_rank);
            let eligible = match (&worker_ok, constraints.pinned) {
                (Err(e), _) => Err(e.clone()),
                (Ok(()), Some((p, _))) if p != target => Err(Ineligible::NotPinned),
                (Ok(()), _) => Ok(()),
            };
            prepared.push(prepare(
                req,
                ctx,
                config,
                w,
                target,
                eligible,
                total_blocks,
                constraints.soft,
            ));
        }
    }
    prepared
}

/// The indexes of the candidates to score (the eligible ones that are not
/// busy, or every eligible one when all are busy) and whether all are
/// busy; an error when none is eligible.
fn to_score(
    req: &SelectRequest,
    constraints: &Constraints<'_>,
    prepared: &[Prepared<'_>],
) -> Result<(Vec<usize>, bool), SelectError> {
    let eligible: Vec<usize> = (0..prepared.len())
        .filter(|&i| prepared[i].report.eligible.is_ok())
        .collect();
    if eligible.is_empty() {
        if constraints.exclusions_in_force() {
            return Err(constraints::exhausted(req));
        }
        let mut rejected: Vec<(WorkerId, Ineligible)> = Vec::new();
        for p in prepared {
            if let Err(why) = &p.report.eligible
                && rejected
                    .last()
                    .is_none_or(|(w, _)| *w != p.report.target.worker_id)
            {
                rejected.push((p.report.target.worker_id, why.clone()));
            }
        }
        return Err(SelectError::NoEligibleWorker {
            request_id: req.request_id.clone(),
            model: req.model.clone(),
            phase: req.phase,
            rejected,
        });
    }
    let idle: Vec<usize> = eligible
        .iter()
        .copied()
        .filter(|&i| prepared[i].report.busy.is_none())
        .collect();
    let all_busy = idle.is_empty();
    if all_busy {
        return Ok((eligible, true));
    }
    // A backlog is no reason to skip the candidate where the request's
    // prefill, queue included, is still no longer than on any idle one:
    // typically it holds the prompt's prefix, and the idle ones would
    // compute the whole prompt again.
    let least_idle_prefill = idle
        .iter()
        .map(|&i| prepared[i].report.potential_prefill_tokens)
        .min()
        .unwrap_or(u64::MAX);
    let scored = eligible
        .into_iter()
        .filter(|&i| {
            let report = &prepared[i].report;
            match report.busy {
                None => true,
                Some(Busy::PrefillBacklog { .. }) => {
                    report.potential_prefill_tokens <= least_idle_prefill
                }
                Some(Busy::KvUsage { .. }) => false,
            }
        })
        .collect();
    Ok((scored, false))
}

/// Scores the candidates at `scored`, records each score in its report
/// and returns the index of the chosen one.
fn score_and_choose(
    req: &SelectRequest,
    scorer: &dyn Scorer,
    params: &ScoreParams,
    rng: &mut dyn RngCore,
    prepared: &mut [Prepared<'_>],
    scored: &[usize],
) -> Result<usize, SelectError> {
    let inputs: Vec<ScoreInput> = scored.iter().map(|&i| prepared[i].input).collect();
    let scorer_failed = |reason: &str| SelectError::ScorerFailed {
        request_id: req.request_id.clone(),
        policy: scorer.name(),
        reason: reason.to_owned(),
    };
    let outcome = scorer
        .score(&inputs, params, rng)
        .ok_or_else(|| scorer_failed("no choice among a non-empty candidate list"))?;
    if outcome.scores.len() != inputs.len() {
        return Err(scorer_failed(
            "returned a score count unlike the input count",
        ));
    }
    for (&i, score) in scored.iter().zip(&outcome.scores) {
        prepared[i].report.score = Some(*score);
    }
    let chosen = scored
        .get(outcome.chosen)
        .copied()
        .ok_or_else(|| scorer_failed("chose a candidate that does not exist"))?;
    prepared[chosen].report.chosen = true;
    Ok(chosen)
}

/// The decision, from the chosen candidate and every candidate's report.
fn selection(
    req: &SelectRequest,
    scorer: &dyn Scorer,
    pinned: Option<(WorkerRank, PinSource)>,
    total_blocks: u32,
    all_busy: bool,
    prepared: Vec<Prepared<'_>>,
    chosen: usize,
) -> Selection {
    let report = &prepared[chosen].report;
    let target = report.target;
    let overlap = report.overlap_blocks;
    let cached_tokens = cached_tokens(req, overlap);
    let saved = saved_prefill(req, report.effective_overlap_blocks);
    let reported = prepared[chosen].worker.rank_load(target.dp_rank);
    let (busy, booked) = (report.busy, report.booked);
    let potential_prefill_tokens = report.potential_prefill_tokens;
    let potential_prefill_blocks = report.potential_prefill_blocks;
    let potential_decode_blocks = report.potential_decode_blocks;
    Selection {
        target,
        route: pinned.map_or(Route::Scored, |(_, s)| Route::Pinned(s)),
        overlap_blocks: overlap,
        tiers: report.tiers,
        effective_overlap_blocks: report.effective_overlap_blocks,
        cached_tokens,
        total_blocks,
        request_prefill_tokens: req.prompt_tokens - saved.tokens,
        request_prefill_blocks: u64::from(total_blocks) - saved.blocks,
        potential_prefill_tokens,
        potential_prefill_blocks,
        potential_decode_blocks,
        booked,
        reported,
        busy,
        all_busy,
        policy: scorer.name(),
        candidates: prepared.into_iter().map(|p| p.report).collect(),
    }
}

fn cached_tokens(req: &SelectRequest, overlap: u32) -> u64 {
    (u64::from(overlap) * u64::from(req.block_size)).min(req.prompt_tokens)
}

/// Prefill a candidate's cached prefix saves the request.
struct SavedPrefill {
    tokens: u64,
    blocks: u64,
}

/// The prefill `effective` blocks save, rounded down: a prefix partly held
/// below the device never saves as much as the same prefix on the device.
fn saved_prefill(req: &SelectRequest, effective: f64) -> SavedPrefill {
    let tokens = (effective * f64::from(req.block_size)).floor() as u64;
    SavedPrefill {
        tokens: tokens.min(req.prompt_tokens),
        blocks: (effective.floor() as u64).min(req.total_blocks()),
    }
}

/// `target`'s overlap by tier and its effective blocks: the worker's own
/// savings where it declared them, else the router's.
fn tier_overlap(
    ctx: &SelectContext<'_>,
    config: &SelectConfig,
    worker: &WorkerSnapshot,
    target: WorkerRank,
    overlap: u32,
) -> (TierBlocks, f64) {
    let Some(split) = ctx.tier_overlaps.get(&target) else {
        return (TierBlocks::device(overlap), f64::from(overlap));
    };
    // Clamp the split to the prompt: lower tiers are the prefix's tail.
    let mut tiers = *split;
    let mut excess = tiers.total().saturating_sub(overlap);
    for tier in Tier::ALL.iter().rev() {
        let cut = excess.min(tiers.get(*tier));
        tiers.0[tier.index()] -= cut;
        excess -= cut;
    }
    let mut savings = config.tier_savings;
    for spec in &worker.tiers {
        if let Some(saving) = spec.prefill_saving {
            savings = savings.with(spec.tier, saving);
        }
    }
    (tiers, savings.effective_blocks(&tiers))
}

#[allow(clippy::too_many_arguments)]
fn prepare<'a>(
    req: &SelectRequest,
    ctx: &SelectContext<'_>,
    config: &SelectConfig,
    worker: &'a WorkerSnapshot,
    target: WorkerRank,
    eligible: Result<(), Ineligible>,
    total_blocks: u32,
    soft: Option<PinTarget>,
) -> Prepared<'a> {
    let overlap = ctx
        .overlaps
        .get(&target)
        .copied()
        .unwrap_or(0)
        .min(total_blocks);
    let (tiers, effective) = tier_overlap(ctx, config, worker, target, overlap);
    let saved = saved_prefill(req, effective);
    let booked = ctx.booked.booked(target);
    // Only a worker able to load it pays the load: one that is not is
    // ineligible, and its report shows no load it would never make.
    let loads_adapter = worker.loads_adapters
        && req
            .adapter
            .as_deref()
            .is_some_and(|a| eligibility::needs_adapter_load(worker, a));
    let load_tokens = if loads_adapter {
        config.adapter_load_tokens
    } else {
        0
    };
    let uncached_tokens = (req.prompt_tokens - saved.tokens).saturating_add(load_tokens);
    let uncached_blocks = (u64::from(total_blocks) - saved.blocks)
        .saturating_add(load_tokens.div_ceil(u64::from(req.block_size.max(1))));
    let potential_prefill_tokens = booked.prefill_tokens.saturating_add(uncached_tokens);
    let potential_prefill_blocks = booked.prefill_blocks.saturating_add(uncached_blocks);
    let potential_decode_blocks = booked.decode_blocks.saturating_add(u64::from(total_blocks));
    let busy = config.busy.check(worker, target.dp_rank, &booked);
    let reported = worker.rank_load(target.dp_rank);
    Prepared {
        worker,
        input: ScoreInput {
            target,
            overlap_blocks: overlap,
            request_blocks: total_blocks,
            potential_prefill_blocks,
            potential_prefill_tokens,
            potential_decode_blocks,
            cached_blocks_total: ctx.cached_blocks.get(&target).copied().unwrap_or(0),
            soft_affinity: soft.is_some_and(|t| t.covers(target)),
            booked,
            reported,
            expected_output_tokens: req.hints.expected_output_tokens,
            step_tokens: worker.max_num_batched_tokens,
            kv_capacity_blocks: worker.total_kv_blocks,
            prefill_scale: ctx.prefill_timing.scale(target),
            queued_prefill_ms: ctx.prefill_timing.queue_ms(target, ctx.now_ms),
        },
        report: CandidateReport {
            target,
            eligible,
            busy,
            overlap_blocks: overlap,
            tiers,
            effective_overlap_blocks: effective,
            loads_adapter,
            potential_prefill_tokens,
            potential_prefill_blocks,
            potential_decode_blocks,
            booked,
            score: None,
            chosen: false,
            view: CacheView::Exact,
        },
    }
}

#[cfg(test)]
mod tests;
