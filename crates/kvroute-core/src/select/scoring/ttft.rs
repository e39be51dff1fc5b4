//! The TTFT policy: predict each candidate's time to first token, then take
//! the longest cached prefix among the candidates predicted close to the
//! fastest.
//!
//! Why it exists: the cost policy adds prefill and decode load linearly, so
//! it cannot tell that a long prompt behind another long prompt waits for
//! both, nor how much slower a worker's steps run while it decodes a lot.
//! What a user feels is the time to first token; this policy estimates it.
//! Invariants:
//! * a candidate's prediction is the time its engine needs to compute the
//!   prefill queued ahead of the request plus the request's own uncached
//!   prefill ([`PrefillModel::predict`]): chunked-prefill steps of at most the
//!   worker's batched-token budget, each costing the step's prefill time
//!   plus the decode time of the sequences the worker holds, all multiplied
//!   by the worker's learned `prefill_scale` (1 until it has learned one);
//! * the cache-affinity trade-off is explicit: every candidate whose
//!   prediction is within `slack_fraction` (plus `slack_ms`) of the best is
//!   acceptable, and among those the longest overlap wins, then the lower
//!   prediction, then (as in the cost policy) the SOFT affinity target,
//!   fewer cached blocks in total, and a uniform draw;
//! * `CandidateScore::cost` is the prediction in ms, so explain output and
//!   the replay's reports compare candidates in the unit users feel.

use rand::{Rng, RngCore};

use super::{CandidateScore, ScoreInput, ScoreOutcome, ScoreParams, Scorer, TtftParts};

/// A worker's prefill timing, as the router assumes it before it has
/// measured the worker (the prior).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillModel {
    /// ms of a step computing `n` new prompt tokens:
    /// `quadratic * n^2 + linear * n + constant`.
    pub quadratic: f64,
    pub linear: f64,
    pub constant: f64,
    /// ms a step adds for decoding at KV utilisation `u`:
    /// `decode_quadratic * u^2 + decode_linear * u + decode_constant`; a
    /// worker holding many sequences runs slower steps.
    pub decode_quadratic: f64,
    pub decode_linear: f64,
    pub decode_constant: f64,
    /// Batched-token budget of a step when the worker did not register one.
    pub default_step_tokens: u64,
}

impl Default for PrefillModel {
    /// The step timings of the replay simulator's engines (the published
    /// vLLM mocker polynomials of an H100-class engine: 8,192 new tokens a
    /// step take about 170 ms; decoding adds 6 to 34 ms a step with the KV
    /// cache's fill).
    fn default() -> Self {
        Self {
            quadratic: 4.21e-7,
            linear: 1.518e-2,
            constant: 16.5,
            decode_quadratic: -25.74,
            decode_linear: 54.01,
            decode_constant: 5.74,
            default_step_tokens: 8192,
        }
    }
}

impl PrefillModel {
    /// ms of one step computing `tokens` new prompt tokens.
    pub(crate) fn step_prefill_ms(&self, tokens: u64) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        let n = tokens as f64;
        (self.quadratic * n * n + self.linear * n + self.constant).max(0.0)
    }

    /// ms decoding adds to each of the target's steps: none while it holds
    /// no sequence, else by its KV utilisation (the larger of what it
    /// reported and what the router booked on it).
    pub(crate) fn decode_step_ms(&self, c: &ScoreInput) -> f64 {
        if c.booked.active_requests == 0 && c.reported.running_requests == 0 {
            return 0.0;
        }
        let used = c.reported.kv_blocks_used.max(c.booked.decode_blocks);
        let u = if c.kv_capacity_blocks > 0 {
            (used as f64 / c.kv_capacity_blocks as f64).clamp(0.0, 1.0)
        } else {
            0.0
        };
        (self.decode_quadratic * u * u + self.decode_linear * u + self.decode_constant).max(0.0)
    }

    /// The predicted time to first token on `c`, and its parts, for a
    /// target whose prefills run `scale` times the prior's time. The queue
    /// ahead is the router's tracked queue when it has one (already in real
    /// ms), else the booked prefill tokens run through the prior.
    pub(crate) fn predict(&self, c: &ScoreInput, scale: f64) -> TtftParts {
        let step = if c.step_tokens > 0 {
            c.step_tokens
        } else {
            self.default_step_tokens
        }
        .max(1);
        let own = c
            .potential_prefill_tokens
            .saturating_sub(c.booked.prefill_tokens);
        let queued = c.booked.prefill_tokens;
        let total = c.potential_prefill_tokens;
        let prefill = |tokens: u64| {
            let full = tokens / step;
            full as f64 * self.step_prefill_ms(step) + self.step_prefill_ms(tokens % step)
        };
        let decode_step = self.decode_step_ms(c);
        if let Some(tracked) = c.queued_prefill_ms.filter(|q| q.is_finite()) {
            return TtftParts {
                queued_prefill_ms: tracked.max(0.0),
                own_prefill_ms: scale * prefill(own),
                decode_ms: scale * own.div_ceil(step) as f64 * decode_step,
                scale,
                own_prefill_tokens: own,
                queue_tracked: true,
            };
        }
        let steps = total.div_ceil(step);
        let queued_ms = prefill(queued);
        TtftParts {
            queued_prefill_ms: scale * queued_ms,
            own_prefill_ms: scale * (prefill(total) - queued_ms).max(0.0),
            decode_ms: scale * steps as f64 * decode_step,
            scale,
            own_prefill_tokens: own,
            queue_tracked: false,
        }
    }
}

/// Settings of the TTFT policy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TtftSettings {
    pub prior: PrefillModel,
    /// Candidates predicted within this fraction of the best are acceptable.
    pub slack_fraction: f64,
    /// ... plus this many ms.
    pub slack_ms: f64,
}

impl Default for TtftSettings {
    fn default() -> Self {
        Self {
            prior: PrefillModel::default(),
            slack_fraction: 0.10,
            slack_ms: 10.0,
        }
    }
}

/// The TTFT scorer. Stateless: what it learns about workers comes in
/// through `ScoreInput::prefill_scale`.
#[derive(Clone, Copy, Debug, Default)]
pub struct TtftScorer {
    pub settings: TtftSettings,
}

impl Scorer for TtftScorer {
    fn name(&self) -> &'static str {
        "ttft"
    }

    fn score(
        &self,
        candidates: &[ScoreInput],
        params: &ScoreParams,
        rng: &mut dyn RngCore,
    ) -> Option<ScoreOutcome> {
        if candidates.is_empty() {
            return None;
        }
        let mut scores: Vec<CandidateScore> = candidates
            .iter()
            .map(|c| {
                let scale = if c.prefill_scale.is_finite() && c.prefill_scale > 0.0 {
                    c.prefill_scale
                } else {
                    1.0
                };
                let parts = self.settings.prior.predict(c, scale);
                let mut predicted = parts.total_ms();
                if c.soft_affinity {
                    predicted *= 1.0 - params.soft_affinity_discount;
                }
                CandidateScore {
                    prefill_cost: parts.queued_prefill_ms + parts.own_prefill_ms,
                    decode_cost: parts.decode_ms,
                    cost: predicted,
                    logit: None,
                    probability: 0.0,
                    ttft: Some(parts),
                }
            })
            .collect();
        let best = scores.iter().map(|s| s.cost).fold(f64::INFINITY, f64::min);
        let limit =
            best * (1.0 + self.settings.slack_fraction.max(0.0)) + self.settings.slack_ms.max(0.0);
        let acceptable: Vec<usize> = (0..scores.len())
            .filter(|&i| scores[i].cost <= limit)
            .collect();
        let longest = acceptable
            .iter()
            .map(|&i| candidates[i].overlap_blocks)
            .max()
            .unwrap_or(0);
        let mut ties: Vec<usize> = acceptable
            .into_iter()
            .filter(|&i| candidates[i].overlap_blocks == longest)
            .collect();
        let fastest = ties
            .iter()
            .map(|&i| scores[i].cost)
            .fold(f64::INFINITY, f64::min);
        ties.retain(|&i| scores[i].cost <= fastest * (1.0 + 1e-9));
        if ties.iter().any(|&i| candidates[i].soft_affinity) {
            ties.retain(|&i| candidates[i].soft_affinity);
        }
        let least_cached = ties
            .iter()
            .map(|&i| candidates[i].cached_blocks_total)
            .min()
            .unwrap_or(0);
        ties.retain(|&i| candidates[i].cached_blocks_total == least_cached);
        let share = 1.0 / ties.len().max(1) as f64;
        for &i in &ties {
            scores[i].probability = share;
        }
        let pick = if ties.len() > 1 {
            rng.random_range(0..ties.len())
        } else {
            0
        };
        let chosen = ties.get(pick).copied().unwrap_or(0);
        Some(ScoreOutcome { scores, chosen })
    }
}

#[cfg(test)]
mod tests;
