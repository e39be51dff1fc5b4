//! Unit tests of the core's layout: each test drives one mechanism of the
//! module docs (holes, shifts, appends, splits, aliases, reservations,
//! wide slots) and checks every layout invariant after each step; a
//! proptest does the same for random events.

use super::super::test_events::{rm, store, w};
use super::*;
use crate::index::tier::{Holder, Tier};
use crate::index::{ApplyOutcome, IndexError, KvEvent, OverlapScores};

/// `c.apply`, with the error as text for a test's `?`.
fn try_apply(c: &mut IndexCore, who: WorkerRank, ev: &KvEvent) -> Result<ApplyOutcome, String> {
    c.apply(who, ev).map_err(|e| e.to_string())
}

fn prefix(c: &IndexCore, q: &[u64], who: WorkerRank) -> u32 {
    let mut out = OverlapScores::default();
    c.find_matches_into(q, &mut out);
    out.get(who).map_or(0, |s| s.blocks)
}

/// A chain of `n` blocks: engine hashes `base + i`, local hashes `i`.
fn chain(base: u64, n: u64) -> Vec<(u64, u64)> {
    (0..n).map(|i| (base + i, i)).collect()
}

fn ok(c: &IndexCore) -> Result<(), String> {
    c.check_invariants()
}

#[test]
fn mid_chain_removes_make_holes_not_splits() -> Result<(), String> {
    let mut c = IndexCore::new(1);
    try_apply(&mut c, w(1), &store(None, &chain(100, 20)))?;
    let splits = c.splits;
    // LRU order: the deepest of the oldest blocks first
    try_apply(&mut c, w(1), &rm(&[107, 106, 105]))?;
    ok(&c)?;
    assert_eq!(c.splits, splits, "a run of holes, no split");
    let q: Vec<u64> = (0..20).collect();
    assert_eq!(prefix(&c, &q, w(1)), 5);
    assert_eq!(c.stats().blocks, 17);
    // stored again, the chain counts whole again
    try_apply(
        &mut c,
        w(1),
        &store(Some(104), &[(105, 5), (106, 6), (107, 7)]),
    )?;
    ok(&c)?;
    assert_eq!(prefix(&c, &q, w(1)), 20);
    // a hole, then the tail behind it: the held part ends at the hole
    try_apply(&mut c, w(1), &rm(&[110]))?;
    try_apply(
        &mut c,
        w(1),
        &rm(&[119, 118, 117, 116, 115, 114, 113, 112, 111]),
    )?;
    ok(&c)?;
    assert_eq!(prefix(&c, &q, w(1)), 10);
    assert_eq!(c.stats().nodes, 10, "the unheld tail is gone");
    // another target joins a chain with a hole: the hole becomes an
    // unheld segment first, and both answers stay exact
    try_apply(&mut c, w(1), &rm(&[103]))?;
    try_apply(&mut c, w(2), &store(None, &chain(200, 12)))?;
    ok(&c)?;
    assert_eq!(prefix(&c, &q, w(1)), 3);
    assert_eq!(prefix(&c, &q, w(2)), 12);
    try_apply(&mut c, w(1), &store(Some(102), &[(103, 3)]))?;
    ok(&c)?;
    assert_eq!(prefix(&c, &q, w(1)), 10);
    Ok(())
}

#[test]
fn evicting_a_shared_tail_moves_it_into_the_child_at_once() -> Result<(), String> {
    let mut c = IndexCore::new(1);
    // worker 1 holds blocks 0..8, worker 2 the same 8 and 4 more
    try_apply(&mut c, w(1), &store(None, &chain(100, 8)))?;
    try_apply(&mut c, w(2), &store(None, &chain(200, 12)))?;
    ok(&c)?;
    let segments = c.stats().nodes;
    let splits = c.splits;
    // worker 1 evicts its last five, deepest first: a split isolates
    // the deepest (worker 2's tail began a segment of its own), and
    // the other four join it in one shift (one at a time, that was
    // four)
    try_apply(&mut c, w(1), &rm(&[107, 106, 105, 104, 103]))?;
    ok(&c)?;
    assert_eq!(
        c.splits,
        splits + 2,
        "one split, then one shift for the run"
    );
    assert_eq!(
        c.stats().nodes,
        segments,
        "no position was added or dropped"
    );
    let q: Vec<u64> = (0..12).collect();
    assert_eq!(prefix(&c, &q, w(1)), 3);
    assert_eq!(prefix(&c, &q, w(2)), 12);
    // the moved blocks are still worker 2's under its engine hashes
    try_apply(&mut c, w(2), &rm(&[211, 210, 209, 208, 207]))?;
    ok(&c)?;
    assert_eq!(prefix(&c, &q, w(2)), 7);
    // and worker 1 can store them again under its own
    try_apply(
        &mut c,
        w(1),
        &store(Some(102), &[(103, 3), (104, 4), (105, 5)]),
    )?;
    ok(&c)?;
    assert_eq!(prefix(&c, &q, w(1)), 6);
    assert_eq!(prefix(&c, &q, w(2)), 7);
    Ok(())
}

#[test]
fn appends_keep_one_segment() -> Result<(), String> {
    let mut c = IndexCore::new(1);
    try_apply(&mut c, w(1), &store(None, &chain(100, 10)))?;
    for t in 1..5u64 {
        let b: Vec<(u64, u64)> = (0..10).map(|i| (100 + 10 * t + i, 10 * t + i)).collect();
        try_apply(&mut c, w(1), &store(Some(100 + 10 * t - 1), &b))?;
    }
    ok(&c)?;
    assert_eq!(c.segs.len(), 2, "root + one segment");
    let q: Vec<u64> = (0..50).collect();
    assert_eq!(prefix(&c, &q, w(1)), 50);
    Ok(())
}

#[test]
fn appends_stop_at_the_abs_limit_and_longer_stores_are_rejected() -> Result<(), String> {
    let mut c = IndexCore::new(1);
    c.abs_limit = 8;
    try_apply(&mut c, w(1), &store(None, &chain(100, 5)))?;
    // 5 + 5 positions would pass index 8: a new segment, starting at 0
    let b: Vec<(u64, u64)> = (5..10).map(|i| (100 + i, i)).collect();
    try_apply(&mut c, w(1), &store(Some(104), &b))?;
    ok(&c)?;
    assert_eq!(c.segs.len(), 3, "root + two segments");
    assert!(c.segs.iter().all(|g| g.end() <= 8));
    let q: Vec<u64> = (0..10).collect();
    assert_eq!(prefix(&c, &q, w(1)), 10);
    // a store must fit one segment: 7 blocks do, 8 do not
    try_apply(&mut c, w(2), &store(None, &chain(200, 7)))?;
    let before = c.stats();
    assert_eq!(
        c.apply(w(2), &store(Some(206), &chain(300, 8))),
        Err(IndexError::TooManyBlocks {
            worker: w(2),
            blocks: 8,
            max: 7
        })
    );
    let after = c.stats();
    assert_eq!(
        (
            after.blocks,
            after.nodes,
            after.per_worker,
            after.events_rejected
        ),
        (before.blocks, before.nodes, before.per_worker, 1)
    );
    ok(&c)
}

#[test]
fn store_branching_mid_segment() -> Result<(), String> {
    let mut c = IndexCore::new(1);
    try_apply(&mut c, w(1), &store(None, &chain(100, 8)))?;
    // worker 2 shares the first 3 blocks, then diverges
    let b = vec![(100, 0), (101, 1), (102, 2), (900, 77), (901, 78)];
    try_apply(&mut c, w(2), &store(None, &b))?;
    ok(&c)?;
    assert_eq!(prefix(&c, &[0, 1, 2, 3, 4], w(1)), 5);
    assert_eq!(prefix(&c, &[0, 1, 2, 3, 4], w(2)), 3);
    assert_eq!(prefix(&c, &[0, 1, 2, 77, 78], w(2)), 5);
    assert_eq!(prefix(&c, &[0, 1, 2, 77, 78], w(1)), 3);
    // worker 1 branches off its own chain mid-segment, by parent
    try_apply(&mut c, w(1), &store(Some(104), &[(500, 9)]))?;
    ok(&c)?;
    assert_eq!(prefix(&c, &[0, 1, 2, 3, 4, 9], w(1)), 6);
    assert_eq!(c.stats().nodes, 8 + 2 + 1);
    Ok(())
}

#[test]
fn remove_mid_segment_and_restore() -> Result<(), String> {
    let mut c = IndexCore::new(1);
    try_apply(&mut c, w(1), &store(None, &chain(100, 10)))?;
    try_apply(&mut c, w(2), &store(None, &chain(100, 10)))?;
    try_apply(&mut c, w(1), &rm(&[104]))?;
    ok(&c)?;
    let q: Vec<u64> = (0..10).collect();
    assert_eq!(prefix(&c, &q, w(1)), 4);
    assert_eq!(prefix(&c, &q, w(2)), 10);
    try_apply(&mut c, w(1), &store(Some(103), &[(104, 4)]))?;
    ok(&c)?;
    assert_eq!(prefix(&c, &q, w(1)), 10);
    // tail evictions of a shared chain, deepest first
    let tail: Vec<u64> = (100..110).rev().collect();
    try_apply(&mut c, w(1), &rm(&tail))?;
    ok(&c)?;
    assert_eq!(prefix(&c, &q, w(1)), 0);
    assert_eq!(prefix(&c, &q, w(2)), 10);
    assert_eq!(c.stats().nodes, 10);
    try_apply(&mut c, w(2), &rm(&tail))?;
    ok(&c)?;
    assert_eq!((c.stats().nodes, c.stats().blocks), (0, 0));
    Ok(())
}

#[test]
fn evicting_a_held_tail_keeps_deeper_blocks() -> Result<(), String> {
    let mut c = IndexCore::new(1);
    try_apply(&mut c, w(1), &store(None, &chain(100, 6)))?;
    try_apply(&mut c, w(2), &store(None, &chain(100, 3)))?;
    // worker 1 drops blocks 2 and 1, keeps 0 and 3..6
    try_apply(&mut c, w(1), &rm(&[102, 101]))?;
    ok(&c)?;
    let q: Vec<u64> = (0..6).collect();
    assert_eq!(prefix(&c, &q, w(1)), 1);
    assert_eq!(prefix(&c, &q, w(2)), 3);
    try_apply(&mut c, w(1), &store(Some(100), &[(101, 1), (102, 2)]))?;
    ok(&c)?;
    assert_eq!(prefix(&c, &q, w(1)), 6);
    Ok(())
}

#[test]
fn batch_removes_in_any_order() -> Result<(), String> {
    let mut c = IndexCore::new(1);
    let q: Vec<u64> = (0..10).collect();
    // head first, whole chain
    try_apply(&mut c, w(1), &store(None, &chain(100, 10)))?;
    let out = try_apply(&mut c, w(1), &rm(&(100..110).collect::<Vec<_>>()))?;
    assert_eq!(
        out,
        ApplyOutcome {
            applied: 10,
            skipped: 0,
            ..ApplyOutcome::default()
        }
    );
    ok(&c)?;
    assert_eq!((c.stats().nodes, c.segs.len()), (0, 2));
    // a shuffled suffix, with a deeper branch keeping the tail alive
    try_apply(&mut c, w(1), &store(None, &chain(100, 10)))?;
    try_apply(&mut c, w(1), &store(Some(109), &[(500, 50)]))?;
    try_apply(&mut c, w(1), &rm(&[107, 109, 105, 108, 106]))?;
    ok(&c)?;
    assert_eq!(prefix(&c, &q, w(1)), 5);
    assert_eq!(c.stats().nodes, 11);
    // not a suffix (a hole, a repeat, an unknown hash): general path
    try_apply(&mut c, w(1), &rm(&[100, 102]))?;
    ok(&c)?;
    assert_eq!(prefix(&c, &q, w(1)), 0);
    let out = try_apply(&mut c, w(1), &rm(&[104, 104, 999]))?;
    assert_eq!(
        out,
        ApplyOutcome {
            applied: 1,
            skipped: 2,
            ..ApplyOutcome::default()
        }
    );
    ok(&c)?;
    assert_eq!(c.worker_blocks(w(1)), 3);
    Ok(())
}

#[test]
fn store_remove_cycles_reuse_one_segment() -> Result<(), String> {
    let mut c = IndexCore::new(1);
    let blocks: Vec<(u64, u64)> = (0..64).map(|d| (mix(7, d), mix(8, d))).collect();
    let removes: Vec<u64> = blocks.iter().map(|b| b.0).collect();
    for _ in 0..3 {
        let s0 = c.splits;
        try_apply(&mut c, w(9), &store(None, &blocks))?;
        try_apply(&mut c, w(9), &rm(&removes))?;
        ok(&c)?;
        assert_eq!((c.splits - s0, c.segs.len(), c.stats().nodes), (0, 2, 0));
    }
    Ok(())
}

#[test]
fn splits_rename_aliases_and_extra_refs() -> Result<(), String> {
    // per-worker engine hashes: worker 2 holds worker 1's path by alias
    let mut c = IndexCore::new(1);
    try_apply(&mut c, w(1), &store(None, &chain(100, 8)))?;
    try_apply(&mut c, w(2), &store(None, &chain(200, 8)))?;
    try_apply(&mut c, w(2), &store(None, &chain(300, 3)))?;
    ok(&c)?;
    // splits in the middle move aliased and doubly held positions
    try_apply(&mut c, w(1), &rm(&[104]))?;
    try_apply(&mut c, w(3), &store(None, &[(1, 0), (2, 1), (3, 99)]))?;
    ok(&c)?;
    let q: Vec<u64> = (0..8).collect();
    assert_eq!(prefix(&c, &q, w(1)), 4);
    assert_eq!(prefix(&c, &q, w(2)), 8);
    try_apply(&mut c, w(2), &rm(&[201, 300, 302]))?;
    ok(&c)?;
    // position 1 is still held through 301
    assert_eq!(prefix(&c, &q, w(2)), 8);
    try_apply(&mut c, w(2), &rm(&[301]))?;
    ok(&c)?;
    assert_eq!(prefix(&c, &q, w(2)), 1);
    assert_eq!(c.worker_blocks(w(2)), 7);
    Ok(())
}

#[test]
fn remove_worker_on_shared_segments() -> Result<(), String> {
    let mut c = IndexCore::new(1);
    for r in 0..3u32 {
        let who = WorkerRank::new(7, r);
        try_apply(&mut c, who, &store(None, &chain(100, 5 + u64::from(r))))?;
    }
    try_apply(&mut c, w(8), &store(None, &chain(100, 4)))?;
    ok(&c)?;
    assert_eq!(c.remove_worker(7), 5 + 6 + 7);
    ok(&c)?;
    let st = c.stats();
    assert_eq!((st.nodes, st.blocks, st.workers), (4, 4, 1));
    assert_eq!(prefix(&c, &[0, 1, 2, 3, 4], w(8)), 4);
    Ok(())
}

#[test]
fn same_engine_hash_twice_and_aliases() -> Result<(), String> {
    let mut c = IndexCore::new(1);
    try_apply(&mut c, w(1), &store(None, &chain(100, 4)))?;
    // same path, other engine hashes: kept as aliases (refcounted)
    try_apply(&mut c, w(1), &store(None, &[(200, 0), (201, 1)]))?;
    ok(&c)?;
    assert_eq!(c.worker_blocks(w(1)), 6);
    // a resent event is a no-op
    let out = try_apply(&mut c, w(1), &store(None, &chain(100, 4)))?;
    assert_eq!(
        out,
        ApplyOutcome {
            applied: 0,
            skipped: 4,
            ..ApplyOutcome::default()
        }
    );
    // the same hash twice in one event: rejected, nothing changes
    let before = c.stats();
    let bad = store(Some(103), &[(300, 4), (301, 5), (300, 6)]);
    assert_eq!(
        c.apply(w(1), &bad),
        Err(IndexError::EngineHashConflict {
            worker: w(1),
            engine_hash: 300
        })
    );
    ok(&c)?;
    let after = c.stats();
    assert_eq!((after.nodes, after.blocks), (before.nodes, before.blocks));
    // a held hash at another path, after new blocks were written
    let bad = store(Some(103), &[(400, 4), (401, 5), (102, 6)]);
    assert!(c.apply(w(1), &bad).is_err());
    ok(&c)?;
    assert_eq!(c.stats().nodes, before.nodes);
    // removing the canonical hash keeps the aliased prefix
    try_apply(&mut c, w(1), &rm(&[100, 101]))?;
    ok(&c)?;
    assert_eq!(prefix(&c, &[0, 1, 2, 3], w(1)), 4);
    try_apply(&mut c, w(1), &rm(&[200]))?;
    ok(&c)?;
    assert_eq!(prefix(&c, &[0, 1, 2, 3], w(1)), 0);
    Ok(())
}

#[test]
fn reservations_size_tables_once_within_a_budget() -> Result<(), String> {
    let mut c = IndexCore::new(1);
    c.reserve_budget = 3000;
    let table_bytes = |c: &IndexCore, who: WorkerRank| {
        c.slot_of
            .get(&Holder::device(who))
            .and_then(|&s| c.slots.get(s as usize))
            .map_or(0, |s| s.table.bytes())
    };
    // reserved before the first store: nothing is built until a block
    // arrives (a claim never used costs nothing); then the table is built
    // at its full size, and never grows
    c.reserve(w(1), 2000);
    assert_eq!(table_bytes(&c, w(1)), 0, "no table before a block arrives");
    assert_eq!(c.reserved_room(), 0);
    try_apply(&mut c, w(1), &store(None, &chain(0, 1)))?;
    let sized = table_bytes(&c, w(1));
    assert!(sized >= 2000 * 8, "sized at the first store: {sized} bytes");
    try_apply(&mut c, w(1), &store(Some(0), &chain(1, 1999)))?;
    assert_eq!(table_bytes(&c, w(1)), sized);
    // without a reservation the same stores grow it from nothing
    try_apply(&mut c, w(2), &store(None, &chain(0, 1)))?;
    let small = table_bytes(&c, w(2));
    try_apply(&mut c, w(2), &store(Some(0), &chain(1, 1999)))?;
    assert!(small < sized && table_bytes(&c, w(2)) >= sized);
    // reserving a target that already stores resizes it once, within
    // what is left of the budget
    c.reserve(w(2), 2000);
    assert_eq!(c.reserved_room(), 3000);
    ok(&c)?;
    // a removed target gives its room back
    c.remove_rank(w(1));
    c.reserve(w(3), 2500);
    try_apply(&mut c, w(3), &store(None, &chain(0, 1)))?;
    assert_eq!(c.reserved_room(), 3000);
    c.remove_worker(3);
    assert_eq!(c.reserved_room(), 1000);
    ok(&c)
}

#[test]
fn clear_and_wide_slots() -> Result<(), String> {
    let mut c = IndexCore::new(1);
    for i in 0..100u64 {
        try_apply(&mut c, w(i), &store(None, &chain(1000 * i, 1 + i % 7)))?;
    }
    ok(&c)?;
    for i in (0..100u64).step_by(3) {
        try_apply(&mut c, w(i), &KvEvent::Cleared)?;
    }
    ok(&c)?;
    let mut out = OverlapScores::default();
    c.find_matches_into(&[0, 1, 2, 3, 4, 5, 6], &mut out);
    assert_eq!(out.scores.len(), 66);
    for s in &out.scores {
        assert_eq!(u64::from(s.blocks), 1 + s.worker.worker_id % 7);
    }
    for i in 0..100u64 {
        c.remove_rank(w(i));
    }
    ok(&c)?;
    assert_eq!((c.stats().nodes, c.stats().workers), (0, 0));
    Ok(())
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 300, ..Default::default() })]

    /// Random events on long chains over a tiny alphabet keep every
    /// layout invariant.
    #[test]
    fn invariants_hold(ops in proptest::collection::vec(
        (0u64..4, 0usize..3, 0u8..16, proptest::option::of(0u64..40),
         proptest::collection::vec((0u64..40, 0u64..2), 0..12)), 1..80)) {
        let mut c = IndexCore::new(1);
        for (who, tier, kind, parent, blocks) in ops {
            // most events on the device, some on lower tiers
            let tier = [Tier::Device, Tier::Host, Tier::Device][tier];
            let who = Holder::new(WorkerRank::new(who, 0), tier);
            match kind {
                0..=2 => { let _ = c.apply(who, &store(parent, &blocks)); }
                3..=5 => { let _ = c.apply_owned(who, store(parent, &blocks)); }
                6..=8 => { let _ = c.apply(who, &rm(&blocks.iter().map(|b| b.0).collect::<Vec<_>>())); }
                9 => { let _ = c.apply(who, &KvEvent::Cleared); }
                // chains as engines send them: consecutive engine
                // hashes, evicted deepest first
                10 | 11 => {
                    let first = parent.unwrap_or(0);
                    let chain: Vec<(u64, u64)> = blocks.iter().enumerate()
                        .map(|(i, b)| (first + i as u64, b.1)).collect();
                    let _ = c.apply_owned(who, store(first.checked_sub(1), &chain));
                }
                12 | 13 => {
                    let first = parent.unwrap_or(0);
                    let ids: Vec<u64> = (first..first + blocks.len() as u64).rev().collect();
                    let _ = c.apply(who, &rm(&ids));
                }
                14 => {
                    let ids = blocks.iter().map(|b| b.0).collect();
                    let _ = c.apply(who, &KvEvent::StoredKnown { blocks: ids });
                }
                _ => {
                    c.bound_tier(Holder::new(who.target, Tier::Host), blocks.len() as u64);
                }
            }
            if let Err(e) = c.check_invariants() {
                proptest::prop_assert!(false, "{}", e);
            }
        }
    }
}
