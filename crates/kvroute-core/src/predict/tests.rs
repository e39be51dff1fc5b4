use super::*;

const A: WorkerRank = WorkerRank::new(1, 0);
const B: WorkerRank = WorkerRank::new(2, 0);

/// Chained prefix keys, as the router passes them (its are the bookings'
/// `prefix_keys`; any well-mixed chaining does here).
fn chain(blocks: &[u64]) -> Vec<u64> {
    let mut previous = 0u64;
    blocks
        .iter()
        .map(|&b| {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&previous.to_le_bytes());
            bytes[8..].copy_from_slice(&b.to_le_bytes());
            previous = xxhash_rust::xxh3::xxh3_64(&bytes);
            previous
        })
        .collect()
}

#[test]
fn a_booked_prompt_is_predicted_whole_and_only_at_its_own_positions() {
    let mut caches = PredictedCaches::new(None);
    caches.record(A, &chain(&[10, 11, 12]), 100, 0);
    assert_eq!(caches.overlap(A, &chain(&[10, 11, 12, 13]), 0), 3);
    assert_eq!(caches.overlap(A, &chain(&[10, 11, 99]), 0), 2);
    // The same blocks in another order are other prefixes.
    assert_eq!(caches.overlap(A, &chain(&[11, 10]), 0), 0);
    assert_eq!(caches.overlap(B, &chain(&[10, 11, 12]), 0), 0);
    assert_eq!(caches.blocks(A), 3);
}

#[test]
fn capacity_evicts_the_least_recently_used_leaves_first() {
    let mut caches = PredictedCaches::new(None);
    caches.record(A, &chain(&[1, 2, 3, 4]), 6, 0);
    caches.record(A, &chain(&[1, 2, 7]), 6, 1);
    caches.record(A, &chain(&[8, 9]), 6, 2);
    // 4 + 1 + 2 = 7 blocks for 6 places: the oldest leaf, [1,2,3,4]'s
    // last block, goes; its prefix [1,2,3] stays.
    assert_eq!(caches.blocks(A), 6);
    assert_eq!(caches.overlap(A, &chain(&[1, 2, 3, 4]), 2), 3);
    assert_eq!(caches.overlap(A, &chain(&[1, 2, 7]), 2), 3);
    assert_eq!(caches.overlap(A, &chain(&[8, 9]), 2), 2);
    // A prompt longer than the capacity keeps its first blocks.
    caches.record(B, &chain(&[1, 2, 3, 4, 5]), 2, 3);
    assert_eq!(caches.overlap(B, &chain(&[1, 2, 3, 4, 5]), 3), 2);
}

#[test]
fn what_is_held_stays_prefix_closed_under_any_sequence() {
    use rand::{Rng, SeedableRng, rngs::StdRng};
    let mut rng = StdRng::seed_from_u64(7);
    let mut caches = PredictedCaches::new(None);
    let mut prompts: Vec<Vec<u64>> = Vec::new();
    for step in 0..2000u64 {
        let prompt: Vec<u64> = if !prompts.is_empty() && rng.random_bool(0.6) {
            let base = &prompts[rng.random_range(0..prompts.len())];
            let keep = rng.random_range(1..=base.len());
            let mut p = base[..keep].to_vec();
            p.extend((0..rng.random_range(0..4)).map(|_| rng.random_range(0..50u64)));
            p
        } else {
            (0..rng.random_range(1..8))
                .map(|_| rng.random_range(0..50u64))
                .collect()
        };
        caches.record(A, &chain(&prompt), 40, step);
        prompts.push(prompt);
        assert!(caches.blocks(A) <= 40);
    }
    // Every held block's parent is held: the overlap of any prompt ever
    // recorded ends at its first unheld block, and no deeper block of it
    // is held.
    let cache = &caches.targets[&A];
    for prompt in &prompts {
        let c = chain(prompt);
        let overlap = caches.overlap(A, &c, 0) as usize;
        assert!(c[overlap..].iter().all(|h| cache.slot(*h).is_none()));
    }
}

#[test]
fn a_time_to_live_forgets_untouched_prefixes_and_touching_renews_them() {
    let mut caches = PredictedCaches::new(Some(1000));
    caches.record(A, &chain(&[1, 2, 3]), 100, 0);
    caches.record(A, &chain(&[1, 2]), 100, 800);
    assert_eq!(caches.overlap(A, &chain(&[1, 2, 3]), 900), 3);
    // At 1500 block 3 (touched at 0) is stale; [1, 2] (800) is not.
    assert_eq!(caches.overlap(A, &chain(&[1, 2, 3]), 1500), 2);
    assert_eq!(caches.expire(1500), 1);
    assert_eq!(caches.blocks(A), 2);
    assert_eq!(caches.expire(5000), 2);
    assert_eq!(caches.total_blocks(), 0);
    assert!(caches.targets.is_empty());
}

#[test]
fn forgetting_a_worker_drops_every_rank_and_no_other_worker() {
    let mut caches = PredictedCaches::new(None);
    caches.record(A, &chain(&[1]), 10, 0);
    caches.record(WorkerRank::new(1, 1), &chain(&[1]), 10, 0);
    caches.record(B, &chain(&[1]), 10, 0);
    caches.forget_worker(1);
    assert_eq!(caches.total_blocks(), 1);
    assert_eq!(caches.overlap(B, &chain(&[1]), 0), 1);
}

#[test]
fn a_held_prompt_counts_only_once_settled_and_forgetting_drops_it() {
    let mut caches = PredictedCaches::new(None);
    caches.hold("r1", A, chain(&[1, 2, 3]), 100, 0);
    assert_eq!(
        caches.overlap(A, &chain(&[1, 2, 3]), 0),
        0,
        "not yet computed"
    );
    caches.settle("r1", 5);
    assert_eq!(caches.overlap(A, &chain(&[1, 2, 3]), 5), 3);
    caches.settle("r1", 6); // a second settle (Release after MarkPrefillComplete)
    assert_eq!(caches.blocks(A), 3);

    caches.hold("r2", B, chain(&[7]), 100, 10);
    caches.forget_worker(B.worker_id);
    caches.settle("r2", 11);
    assert_eq!(
        caches.blocks(B),
        0,
        "its worker left before the prefill ended"
    );

    caches.hold("old", A, chain(&[9]), 100, 20);
    caches.hold("new", A, chain(&[8]), 100, 40);
    caches.expire_pending(30);
    caches.settle("old", 50);
    caches.settle("new", 50);
    assert_eq!(
        caches.overlap(A, &chain(&[9]), 50),
        0,
        "its booking expired"
    );
    assert_eq!(caches.overlap(A, &chain(&[8]), 50), 1);
}

#[test]
fn held_prompts_are_bounded_whatever_the_callers_bookings() {
    let mut caches = PredictedCaches::new(None);
    let long: Vec<u64> = (0..MAX_PENDING_BLOCKS as u64 / 2).collect();
    let long = chain(&long);
    caches.hold("a", A, long.clone(), u64::MAX, 0);
    caches.hold("b", A, long.clone(), u64::MAX, 0);
    assert_eq!(caches.pending_blocks, MAX_PENDING_BLOCKS);
    // A third would pass the bound: recorded at once, nothing more held.
    caches.hold("c", B, chain(&[1, 2]), 100, 0);
    assert_eq!(caches.pending_blocks, MAX_PENDING_BLOCKS);
    assert_eq!(caches.overlap(B, &chain(&[1, 2]), 0), 2);
    // Holding a request id again replaces its prompt.
    caches.hold("a", A, chain(&[5]), 100, 0);
    assert_eq!(caches.pending_blocks, MAX_PENDING_BLOCKS / 2 + 1);
    caches.forget_worker(A.worker_id);
    assert_eq!(caches.pending_blocks, 0);
}
