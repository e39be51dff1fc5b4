#![allow(clippy::unwrap_used, clippy::expect_used)]

use rand::{SeedableRng, rngs::StdRng};

use super::*;
use crate::types::{BookedLoad, WorkerRank};

/// A candidate with `overlap` of a 64-block (4,096-token) prompt cached and
/// `queued` prefill tokens booked ahead of the request.
fn input(worker: u64, overlap: u32, queued: u64) -> ScoreInput {
    let own = u64::from(64 - overlap) * 64;
    ScoreInput {
        target: WorkerRank::new(worker, 0),
        overlap_blocks: overlap,
        request_blocks: 64,
        potential_prefill_blocks: (queued + own) / 64,
        potential_prefill_tokens: queued + own,
        potential_decode_blocks: 64,
        cached_blocks_total: 0,
        soft_affinity: false,
        booked: BookedLoad {
            prefill_tokens: queued,
            prefill_blocks: queued / 64,
            decode_blocks: 0,
            active_requests: 0,
        },
        reported: Default::default(),
        expected_output_tokens: None,
        step_tokens: 8192,
        kv_capacity_blocks: 16_384,
        prefill_scale: 1.0,
        queued_prefill_ms: None,
    }
}

fn params() -> ScoreParams {
    ScoreParams {
        overlap_weight: 1.0,
        temperature: 0.0,
        soft_affinity_discount: 0.0,
        overlap_credit: 0.0,
    }
}

fn choose(candidates: &[ScoreInput]) -> (usize, Vec<CandidateScore>) {
    let outcome = TtftScorer::default()
        .score(candidates, &params(), &mut StdRng::seed_from_u64(1))
        .unwrap();
    (outcome.chosen, outcome.scores)
}

#[test]
fn one_step_prediction_is_the_prior_polynomial() {
    let model = PrefillModel::default();
    let parts = model.predict(&input(1, 0, 0), 1.0);
    let expected = 4.21e-7 * 4096.0 * 4096.0 + 1.518e-2 * 4096.0 + 16.5;
    assert!((parts.own_prefill_ms - expected).abs() < 1e-6, "{parts:?}");
    assert_eq!(parts.queued_prefill_ms, 0.0);
    // nothing running: no decode slows the step
    assert_eq!(parts.decode_ms, 0.0);
    assert_eq!(parts.own_prefill_tokens, 4096);
}

#[test]
fn queued_prefill_is_chunked_by_the_step_budget() {
    let model = PrefillModel::default();
    // 20,000 queued tokens: two full 8,192-token steps and one of 3,616;
    // with the request's 4,096 tokens the third step computes 7,712
    let parts = model.predict(&input(1, 0, 20_000), 1.0);
    let full = model.step_prefill_ms(8192);
    let queued = 2.0 * full + model.step_prefill_ms(20_000 - 16_384);
    assert!((parts.queued_prefill_ms - queued).abs() < 1e-6, "{parts:?}");
    let total = 2.0 * full + model.step_prefill_ms(24_096 - 2 * 8192);
    assert!((parts.queued_prefill_ms + parts.own_prefill_ms - total).abs() < 1e-6);
    // a long queue costs more than the same tokens as the request's own
    assert!(parts.total_ms() > model.predict(&input(2, 0, 0), 1.0).total_ms() * 4.0);
}

#[test]
fn decode_slows_each_step_with_the_kv_fill() {
    let model = PrefillModel::default();
    let mut busy = input(1, 0, 0);
    busy.booked.active_requests = 3;
    busy.booked.decode_blocks = 8192;
    let half = model.predict(&busy, 1.0).decode_ms;
    busy.reported.kv_blocks_used = 16_384;
    let full = model.predict(&busy, 1.0).decode_ms;
    assert!(
        (half - (-25.74 * 0.25 + 54.01 * 0.5 + 5.74)).abs() < 1e-9,
        "{half}"
    );
    assert!((full - (-25.74 + 54.01 + 5.74)).abs() < 1e-9, "{full}");
}

#[test]
fn the_learned_scale_multiplies_the_prediction() {
    let mut slow = input(1, 0, 0);
    slow.prefill_scale = 2.0;
    let (_, scores) = choose(&[input(0, 0, 0), slow]);
    assert!((scores[1].cost - 2.0 * scores[0].cost).abs() < 1e-9);
    assert_eq!(scores[1].ttft.map(|t| t.scale), Some(2.0));
    // a tracked queue is taken as it is, in real ms; the scale applies to
    // the request's own prefill
    let mut tracked = input(1, 0, 40_000);
    tracked.queued_prefill_ms = Some(50.0);
    tracked.prefill_scale = 2.0;
    let (_, scores) = choose(&[input(0, 0, 0), tracked]);
    let parts = scores[1].ttft.unwrap();
    assert!(
        parts.queue_tracked && parts.queued_prefill_ms == 50.0,
        "{parts:?}"
    );
    assert!(
        (parts.own_prefill_ms - 2.0 * scores[0].cost).abs() < 1e-9,
        "{parts:?}"
    );
    // a nonsensical scale counts as none
    slow.prefill_scale = f64::NAN;
    let (_, scores) = choose(&[input(0, 0, 0), slow]);
    assert_eq!(scores[1].cost, scores[0].cost);
}

#[test]
fn the_longest_overlap_within_the_slack_wins() {
    // worker 1 caches half the prompt but has some queued ahead: it is
    // predicted slower than the idle worker 0, within the slack
    let cached_but_queued = input(1, 32, 2500);
    let idle = input(0, 0, 0);
    let (chosen, scores) = choose(&[idle, cached_but_queued]);
    assert!(scores[1].cost > scores[0].cost, "{scores:?}");
    assert!(scores[1].cost <= scores[0].cost * 1.1 + 10.0, "{scores:?}");
    assert_eq!(chosen, 1, "{scores:?}");
    assert_eq!(scores[1].probability, 1.0);
}

#[test]
fn a_cached_prefix_behind_a_long_queue_loses() {
    // worker 1 caches half the prompt, but 40,000 tokens wait ahead
    let (chosen, scores) = choose(&[input(0, 0, 0), input(1, 32, 40_000)]);
    assert_eq!(chosen, 0, "{scores:?}");
    assert!(scores[1].cost > 3.0 * scores[0].cost, "{scores:?}");
}

#[test]
fn ties_go_to_soft_affinity_then_fewer_cached_blocks() {
    let mut a = input(0, 0, 0);
    let mut b = input(1, 0, 0);
    a.cached_blocks_total = 10;
    b.cached_blocks_total = 5;
    assert_eq!(choose(&[a, b]).0, 1);
    a.soft_affinity = true;
    assert_eq!(choose(&[a, b]).0, 0);
}

#[test]
fn exact_ties_are_drawn_uniformly() {
    let candidates = [input(0, 0, 0), input(1, 0, 0), input(2, 0, 0)];
    let scorer = TtftScorer::default();
    let mut counts = [0usize; 3];
    let mut rng = StdRng::seed_from_u64(9);
    for _ in 0..3000 {
        counts[scorer
            .score(&candidates, &params(), &mut rng)
            .unwrap()
            .chosen] += 1;
    }
    assert!(counts.iter().all(|&c| c > 850), "{counts:?}");
    assert!(
        TtftScorer::default()
            .score(&[], &params(), &mut rng)
            .is_none()
    );
}
