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
mod tests {
    use super::*;
    use crate::types::WorkerRank;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    fn input(worker: u64, prefill: u64, decode: u64, cached: u64) -> ScoreInput {
        ScoreInput {
            target: WorkerRank::new(worker, 0),
            overlap_blocks: 0,
            request_blocks: 0,
            potential_prefill_blocks: prefill,
            potential_prefill_tokens: prefill * 16,
            potential_decode_blocks: decode,
            cached_blocks_total: cached,
            soft_affinity: false,
            booked: Default::default(),
            reported: Default::default(),
            expected_output_tokens: None,
        }
    }

    fn params(weight: f64, temperature: f64) -> ScoreParams {
        ScoreParams {
            overlap_weight: weight,
            temperature,
            soft_affinity_discount: 0.1,
            overlap_credit: 0.0,
        }
    }

    #[test]
    fn empty_is_none() {
        let mut rng = StdRng::seed_from_u64(1);
        assert!(CostScorer.score(&[], &params(1.0, 0.0), &mut rng).is_none());
    }

    #[test]
    fn weight_shifts_the_choice() {
        let mut rng = StdRng::seed_from_u64(1);
        // a: little prefill, much decode; b: the opposite.
        let c = [input(1, 2, 10, 0), input(2, 6, 4, 0)];
        let out = CostScorer.score(&c, &params(1.0, 0.0), &mut rng).unwrap();
        assert_eq!(out.chosen, 1, "12 vs 10");
        let out = CostScorer.score(&c, &params(3.0, 0.0), &mut rng).unwrap();
        assert_eq!(out.chosen, 0, "16 vs 22");
        assert_eq!(out.scores[1].prefill_cost, 18.0);
        assert_eq!(out.scores[1].decode_cost, 4.0);
        assert_eq!(out.scores[0].probability, 1.0);
        assert_eq!(out.scores[1].probability, 0.0);
    }

    #[test]
    fn overlap_credit_keeps_a_busier_prefix_holder() {
        let mut rng = StdRng::seed_from_u64(1);
        // a holds 4 prompt blocks but has more prefill queued (10 vs 6).
        let mut holder = input(1, 10, 4, 0);
        holder.overlap_blocks = 4;
        let c = [holder, input(2, 6, 4, 0)];
        let out = CostScorer.score(&c, &params(1.0, 0.0), &mut rng).unwrap();
        assert_eq!(out.chosen, 1, "14 vs 10 without credit");
        let credited = ScoreParams {
            overlap_credit: 2.0,
            ..params(1.0, 0.0)
        };
        let out = CostScorer.score(&c, &credited, &mut rng).unwrap();
        assert_eq!(out.chosen, 0, "14 - 8 = 6 vs 10 with credit");
        assert_eq!(out.scores[0].cost, 6.0);
    }

    #[test]
    fn ties_go_to_soft_affinity_then_fewer_cached_then_random() {
        let mut rng = StdRng::seed_from_u64(7);
        let mut c = [input(1, 5, 5, 3), input(2, 5, 5, 9), input(3, 5, 5, 3)];
        // Fewer cached blocks: 1 or 3, evenly.
        let out = CostScorer.score(&c, &params(1.0, 0.0), &mut rng).unwrap();
        assert!(out.chosen == 0 || out.chosen == 2);
        assert_eq!(out.scores[0].probability, 0.5);
        assert_eq!(out.scores[1].probability, 0.0);
        // The random pick covers both over many seeds, deterministically.
        let picks_by_seed = |c: &[ScoreInput]| -> Vec<usize> {
            (0..32)
                .map(|s| {
                    let mut r = StdRng::seed_from_u64(s);
                    CostScorer
                        .score(c, &params(1.0, 0.0), &mut r)
                        .unwrap()
                        .chosen
                })
                .collect()
        };
        let picks = picks_by_seed(&c);
        assert!(picks.contains(&0) && picks.contains(&2) && !picks.contains(&1));
        assert_eq!(picks, picks_by_seed(&c));
        // A SOFT affinity target wins even without discount.
        c[1].soft_affinity = true;
        let mut p = params(1.0, 0.0);
        p.soft_affinity_discount = 0.0;
        let out = CostScorer.score(&c, &p, &mut rng).unwrap();
        assert_eq!(out.chosen, 1);
    }

    #[test]
    fn soft_affinity_discount_beats_small_differences_only() {
        let mut rng = StdRng::seed_from_u64(1);
        let mut c = [input(1, 5, 5, 0), input(2, 5, 6, 0)];
        c[1].soft_affinity = true;
        // 11 * 0.9 = 9.9 < 10.
        assert_eq!(
            CostScorer
                .score(&c, &params(1.0, 0.0), &mut rng)
                .unwrap()
                .chosen,
            1
        );
        c[1].potential_decode_blocks = 8; // 13 * 0.9 = 11.7 > 10
        assert_eq!(
            CostScorer
                .score(&c, &params(1.0, 0.0), &mut rng)
                .unwrap()
                .chosen,
            0
        );
    }

    #[test]
    fn temperature_samples_a_softmax_deterministically_per_seed() {
        let c = [input(1, 0, 10, 0), input(2, 0, 15, 0), input(3, 0, 20, 0)];
        let p = params(1.0, 0.5);
        let run = |seed| {
            let mut rng = StdRng::seed_from_u64(seed);
            CostScorer.score(&c, &p, &mut rng).unwrap()
        };
        let out = run(42);
        assert_eq!(out, run(42));
        // Normalised costs 0, 0.5, 1 -> logits 0, -1, -2.
        let logits: Vec<f64> = out.scores.iter().map(|s| s.logit.unwrap()).collect();
        assert_eq!(logits, vec![0.0, -1.0, -2.0]);
        let z = 1.0 + (-1.0f64).exp() + (-2.0f64).exp();
        assert!((out.scores[0].probability - 1.0 / z).abs() < 1e-12);
        let total: f64 = out.scores.iter().map(|s| s.probability).sum();
        assert!((total - 1.0).abs() < 1e-12);
        // Over many seeds every candidate is drawn, the best most often.
        let mut counts = [0usize; 3];
        for seed in 0..2_000 {
            counts[run(seed).chosen] += 1;
        }
        assert!(counts[0] > counts[1] && counts[1] > counts[2] && counts[2] > 0);
    }

    #[test]
    fn equal_costs_at_temperature_are_uniform() {
        let c = [input(1, 1, 1, 0), input(2, 1, 1, 0)];
        let mut rng = StdRng::seed_from_u64(3);
        let out = CostScorer.score(&c, &params(1.0, 2.0), &mut rng).unwrap();
        assert_eq!(out.scores[0].probability, 0.5);
        assert_eq!(out.scores[1].logit, Some(0.0));
    }
}
