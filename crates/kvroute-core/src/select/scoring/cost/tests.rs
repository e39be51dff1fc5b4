//! The cost policy's unit tests: the formula, ties, sampling, overrides.

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
        step_tokens: 0,
        kv_capacity_blocks: 0,
        prefill_scale: 1.0,
        queued_prefill_ms: None,
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
