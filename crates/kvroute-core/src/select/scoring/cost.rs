//! The default policy: overlap-weighted prefill cost plus decode cost.
//!
//! Why it exists: it is the router's baseline, balancing cache reuse (less
//! prefill) against load (fewer blocks to hold while decoding). Invariants:
//! * `cost = overlap_weight * potential_prefill_blocks + potential_decode_blocks - overlap_credit * overlap_blocks`,
//!   multiplied by `1 - soft_affinity_discount` for a SOFT affinity target;
//!   lower is better;
//! * temperature 0: the minimum cost wins; exact ties (within a relative
//!   1e-9) go to the SOFT affinity target, then to the candidate with fewer
//!   cached blocks in total (it has more room), then to a uniform draw from
//!   the random source, whose probability is reported;
//! * temperature > 0: costs are range-normalised to `[0, 1]`, the logit is
//!   `-normalised / temperature`, and the choice is drawn from the softmax.

use rand::{Rng, RngCore};

use super::{CandidateScore, ScoreInput, ScoreOutcome, ScoreParams, Scorer};

/// The default scorer. Stateless.
#[derive(Clone, Copy, Debug, Default)]
pub struct CostScorer;

fn same_cost(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

impl CostScorer {
    fn costs(candidates: &[ScoreInput], params: &ScoreParams) -> Vec<CandidateScore> {
        candidates
            .iter()
            .map(|c| {
                let prefill_cost = params.overlap_weight * c.potential_prefill_blocks as f64;
                let decode_cost = c.potential_decode_blocks as f64;
                let mut cost = prefill_cost + decode_cost
                    - params.overlap_credit * f64::from(c.overlap_blocks);
                if c.soft_affinity {
                    cost *= 1.0 - params.soft_affinity_discount;
                }
                CandidateScore {
                    prefill_cost,
                    decode_cost,
                    cost,
                    logit: None,
                    probability: 0.0,
                    ttft: None,
                }
            })
            .collect()
    }

    fn pick_min(
        candidates: &[ScoreInput],
        scores: &mut [CandidateScore],
        rng: &mut dyn RngCore,
    ) -> usize {
        let min = scores.iter().map(|s| s.cost).fold(f64::INFINITY, f64::min);
        let mut ties: Vec<usize> = (0..scores.len())
            .filter(|&i| same_cost(scores[i].cost, min))
            .collect();
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
        ties.get(pick).copied().unwrap_or(0)
    }

    fn sample(scores: &mut [CandidateScore], temperature: f64, rng: &mut dyn RngCore) -> usize {
        let min = scores.iter().map(|s| s.cost).fold(f64::INFINITY, f64::min);
        let max = scores
            .iter()
            .map(|s| s.cost)
            .fold(f64::NEG_INFINITY, f64::max);
        let range = max - min;
        for s in scores.iter_mut() {
            let normalised = if range > 0.0 {
                (s.cost - min) / range
            } else {
                0.0
            };
            s.logit = Some(-normalised / temperature);
        }
        // The best logit is 0, so exp() cannot overflow and the sum is >= 1.
        let weights: Vec<f64> = scores
            .iter()
            .map(|s| s.logit.unwrap_or(f64::NEG_INFINITY).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        for (s, w) in scores.iter_mut().zip(&weights) {
            s.probability = w / total;
        }
        let mut draw = rng.random::<f64>() * total;
        let mut last_positive = 0;
        for (i, w) in weights.iter().enumerate() {
            if *w > 0.0 {
                last_positive = i;
                if draw < *w {
                    return i;
                }
                draw -= w;
            }
        }
        last_positive
    }
}

impl Scorer for CostScorer {
    fn name(&self) -> &'static str {
        "cost"
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
        let mut scores = Self::costs(candidates, params);
        let chosen = if params.temperature > 0.0 {
            Self::sample(&mut scores, params.temperature, rng)
        } else {
            Self::pick_min(candidates, &mut scores, rng)
        };
        Some(ScoreOutcome { scores, chosen })
    }
}

#[cfg(test)]
mod tests;
