//! Unit tests of [`KvIndex`]: the event rules of the module docs, one
//! behaviour per test, through the public, locked API (the core's layout
//! is tested with the core, in `radix`).

use super::test_events::{rm, store, w};
use super::*;

fn blocks_of(idx: &KvIndex, q: &[u64], who: WorkerRank) -> u32 {
    idx.find_matches(q).get(who).map_or(0, |s| s.blocks)
}

#[test]
fn send_sync() {
    fn check<T: Send + Sync>() {}
    check::<KvIndex>();
}

#[test]
fn store_and_match_prefix() -> Result<(), IndexError> {
    let idx = KvIndex::new(16);
    idx.apply(w(1), &store(None, &[(10, 1), (11, 2), (12, 3)]))?;
    idx.apply(w(2), &store(None, &[(20, 1), (21, 2)]))?;
    let s = idx.find_matches(&[1, 2, 3, 4]);
    assert_eq!(
        s.get(w(1)).map(|x| (x.blocks, x.cached_tokens)),
        Some((3, 48))
    );
    assert_eq!(
        s.get(w(2)).map(|x| (x.blocks, x.worker_blocks)),
        Some((2, 2))
    );
    assert!(idx.find_matches(&[2, 3]).scores.is_empty());
    assert!(idx.find_matches(&[]).scores.is_empty());
    Ok(())
}

#[test]
fn parent_attaches_under_workers_own_node() -> Result<(), IndexError> {
    let idx = KvIndex::new(1);
    idx.apply(w(1), &store(None, &[(10, 1)]))?;
    idx.apply(w(1), &store(Some(10), &[(11, 2)]))?;
    assert_eq!(blocks_of(&idx, &[1, 2], w(1)), 2);
    // worker 2 does not hold 10: rejected, index untouched
    let before = idx.stats();
    assert_eq!(
        idx.apply(w(2), &store(Some(10), &[(11, 2)])),
        Err(IndexError::UnknownParent {
            worker: w(2),
            parent: 10
        })
    );
    assert_eq!(idx.stats().blocks, before.blocks);
    assert_eq!(idx.stats().nodes, before.nodes);
    Ok(())
}

#[test]
fn mid_chain_remove_ends_prefix() -> Result<(), IndexError> {
    let idx = KvIndex::new(1);
    idx.apply(w(1), &store(None, &[(10, 1), (11, 2), (12, 3)]))?;
    let out = idx.apply(w(1), &rm(&[11, 99]))?;
    assert_eq!(
        out,
        ApplyOutcome {
            applied: 1,
            skipped: 1,
            ..ApplyOutcome::default()
        }
    );
    assert_eq!(blocks_of(&idx, &[1, 2, 3], w(1)), 1);
    // the deeper block is still held and can still be a parent
    idx.apply(w(1), &store(Some(12), &[(13, 4)]))?;
    assert_eq!(idx.worker_blocks(w(1)), 3);
    // re-storing the middle block restores the prefix
    idx.apply(w(1), &store(Some(10), &[(11, 2)]))?;
    assert_eq!(blocks_of(&idx, &[1, 2, 3, 4], w(1)), 4);
    Ok(())
}

#[test]
fn duplicate_store_is_counted_noop() -> Result<(), IndexError> {
    let idx = KvIndex::new(1);
    idx.apply(w(1), &store(None, &[(10, 1), (11, 2)]))?;
    let out = idx.apply(w(1), &store(None, &[(10, 1), (11, 2), (12, 3)]))?;
    assert_eq!(
        out,
        ApplyOutcome {
            applied: 1,
            skipped: 2,
            ..ApplyOutcome::default()
        }
    );
    assert_eq!(idx.worker_blocks(w(1)), 3);
    Ok(())
}

#[test]
fn conflicting_engine_hash_rejects_whole_event() -> Result<(), IndexError> {
    let idx = KvIndex::new(1);
    idx.apply(w(1), &store(None, &[(10, 1), (11, 2)]))?;
    let before = idx.stats();
    let ev = store(Some(11), &[(12, 3), (13, 4), (10, 5)]);
    assert_eq!(
        idx.apply(w(1), &ev),
        Err(IndexError::EngineHashConflict {
            worker: w(1),
            engine_hash: 10
        })
    );
    let after = idx.stats();
    assert_eq!((after.blocks, after.nodes), (before.blocks, before.nodes));
    assert_eq!(blocks_of(&idx, &[1, 2, 3], w(1)), 2);
    // the same hash twice in one event
    let ev = store(None, &[(30, 7), (30, 8)]);
    assert!(idx.apply(w(2), &ev).is_err());
    assert_eq!(idx.stats().per_worker.len(), 1);
    Ok(())
}

#[test]
fn two_engine_hashes_same_path() -> Result<(), IndexError> {
    let idx = KvIndex::new(1);
    idx.apply(w(1), &store(None, &[(10, 1)]))?;
    idx.apply(w(1), &store(None, &[(20, 1)]))?;
    assert_eq!(idx.worker_blocks(w(1)), 2);
    idx.apply(w(1), &rm(&[10]))?;
    assert_eq!(blocks_of(&idx, &[1], w(1)), 1);
    idx.apply(w(1), &rm(&[20]))?;
    assert_eq!(blocks_of(&idx, &[1], w(1)), 0);
    assert_eq!(idx.stats().nodes, 0);
    Ok(())
}

#[test]
fn clear_remove_rank_remove_worker() -> Result<(), IndexError> {
    let idx = KvIndex::new(1);
    let r0 = WorkerRank::new(1, 0);
    let r1 = WorkerRank::new(1, 1);
    idx.apply(r0, &store(None, &[(10, 1), (11, 2)]))?;
    idx.apply(r1, &store(None, &[(10, 1), (11, 2)]))?;
    idx.apply(w(2), &store(None, &[(10, 1)]))?;
    assert_eq!(idx.find_matches(&[1, 2]).scores.len(), 3);
    idx.apply(r0, &KvEvent::Cleared)?;
    assert_eq!(blocks_of(&idx, &[1, 2], r0), 0);
    assert_eq!(blocks_of(&idx, &[1, 2], r1), 2);
    assert_eq!(idx.remove_rank(r1), 2);
    assert_eq!(idx.stats().nodes, 1);
    idx.apply(r0, &store(None, &[(10, 1)]))?;
    assert_eq!(idx.remove_worker(1), 1);
    assert_eq!(idx.remove_worker(1), 0);
    assert_eq!(idx.stats().per_worker, vec![(w(2), 1)]);
    assert_eq!(idx.remove_rank(w(2)), 1);
    let st = idx.stats();
    assert_eq!((st.blocks, st.nodes, st.workers), (0, 0, 0));
    // unknown targets are no-ops
    assert_eq!(idx.apply(w(9), &KvEvent::Cleared)?, ApplyOutcome::default());
    Ok(())
}

#[test]
fn more_than_64_targets() -> Result<(), IndexError> {
    let idx = KvIndex::new(1);
    for i in 0..150u64 {
        let depth = 1 + i % 5;
        let blocks: Vec<(u64, u64)> = (0..depth).map(|d| (1000 * i + d, d)).collect();
        idx.apply(WorkerRank::new(i, 0), &store(None, &blocks))?;
    }
    let s = idx.find_matches(&[0, 1, 2, 3, 4, 5]);
    assert_eq!(s.scores.len(), 150);
    for i in 0..150u64 {
        assert_eq!(
            s.get(WorkerRank::new(i, 0)).map(|x| x.blocks),
            Some(1 + (i % 5) as u32)
        );
    }
    for i in (0..150u64).step_by(2) {
        idx.apply(WorkerRank::new(i, 0), &rm(&[1000 * i]))?;
    }
    assert_eq!(idx.find_matches(&[0, 1]).scores.len(), 75);
    Ok(())
}

/// Target `id`'s tier `tier`.
fn t(id: u64, tier: Tier) -> Holder {
    Holder::new(w(id), tier)
}

fn tiers_of(idx: &KvIndex, q: &[u64], who: WorkerRank) -> [u32; TIERS] {
    idx.find_matches(q)
        .get(who)
        .map_or([0; TIERS], |s| s.tiers.0)
}

#[test]
fn a_device_eviction_leaves_the_host_copy() -> Result<(), IndexError> {
    let idx = KvIndex::new(16);
    idx.apply(w(1), &store(None, &[(10, 1), (11, 2), (12, 3)]))?;
    idx.apply_in(t(1, Tier::Host), &store(None, &[(10, 1), (11, 2), (12, 3)]))?;
    // both tiers hold all three: each block counts once, for the device
    assert_eq!(tiers_of(&idx, &[1, 2, 3], w(1)), [3, 0, 0, 0]);
    idx.apply(w(1), &rm(&[12, 11]))?;
    assert_eq!(tiers_of(&idx, &[1, 2, 3], w(1)), [1, 2, 0, 0]);
    assert_eq!(idx.worker_blocks(w(1)), 1);
    assert_eq!(idx.holder_blocks(t(1, Tier::Host)), 3);
    // the host's own removal takes only the host copy
    idx.apply_in(t(1, Tier::Host), &rm(&[10]))?;
    assert_eq!(tiers_of(&idx, &[1, 2, 3], w(1)), [1, 2, 0, 0]);
    idx.apply_in(t(1, Tier::Host), &rm(&[11]))?;
    assert_eq!(tiers_of(&idx, &[1, 2, 3], w(1)), [1, 0, 0, 0]);
    assert_eq!(idx.stats().per_tier, [1, 1, 0, 0]);
    Ok(())
}

#[test]
fn lower_tiers_extend_the_device_prefix_under_its_parents() -> Result<(), IndexError> {
    let idx = KvIndex::new(16);
    idx.apply(w(1), &store(None, &[(10, 1), (11, 2)]))?;
    // the host's block hangs under a parent only the device holds
    idx.apply_in(t(1, Tier::Host), &store(Some(11), &[(12, 3)]))?;
    idx.apply_in(t(1, Tier::Storage), &store(Some(12), &[(13, 4)]))?;
    assert_eq!(tiers_of(&idx, &[1, 2, 3, 4, 5], w(1)), [2, 1, 1, 0]);
    assert_eq!(blocks_of(&idx, &[1, 2, 3, 4, 5], w(1)), 4);
    // a gap in every tier ends the prefix
    idx.apply_in(t(1, Tier::Host), &rm(&[12]))?;
    assert_eq!(tiers_of(&idx, &[1, 2, 3, 4], w(1)), [2, 0, 0, 0]);
    // a parent no tier holds is still refused
    let err = idx.apply_in(t(1, Tier::Host), &store(Some(99), &[(14, 5)]));
    assert!(matches!(err, Err(IndexError::UnknownParent { .. })));
    Ok(())
}

#[test]
fn placeholders_join_blocks_other_tiers_hold() -> Result<(), IndexError> {
    let idx = KvIndex::new(16);
    idx.apply(w(1), &store(None, &[(10, 1), (11, 2), (12, 3)]))?;
    let out = idx.apply_in(
        t(1, Tier::Host),
        &KvEvent::StoredKnown {
            blocks: vec![10, 11, 12, 77],
        },
    )?;
    assert_eq!((out.applied, out.skipped, out.unresolved), (3, 0, 1));
    idx.apply(w(1), &rm(&[10, 11, 12]))?;
    assert_eq!(tiers_of(&idx, &[1, 2, 3], w(1)), [0, 3, 0, 0]);
    // again: held already
    let again = idx.apply_in(t(1, Tier::Host), &KvEvent::StoredKnown { blocks: vec![11] })?;
    assert_eq!((again.applied, again.skipped), (0, 1));
    assert_eq!(idx.stats().blocks_unresolved, 1);
    // another target's blocks never resolve a placeholder
    let other = idx.apply_in(t(2, Tier::Host), &KvEvent::StoredKnown { blocks: vec![10] })?;
    assert_eq!(other.unresolved, 1);
    assert_eq!(idx.holder_blocks(t(2, Tier::Host)), 0);
    Ok(())
}

#[test]
fn a_bounded_tier_evicts_the_least_recently_stored() -> Result<(), IndexError> {
    let idx = KvIndex::new(16);
    let host = t(1, Tier::Host);
    idx.bound_tier(host, 3);
    idx.apply_in(host, &store(None, &[(10, 1), (11, 2)]))?;
    idx.apply_in(host, &store(None, &[(20, 5)]))?;
    // a store again of a held block does not renew it
    idx.apply_in(host, &store(None, &[(10, 1)]))?;
    idx.apply_in(host, &store(Some(20), &[(21, 6)]))?;
    assert_eq!(idx.holder_blocks(host), 3);
    assert_eq!(tiers_of(&idx, &[1, 2], w(1)), [0, 0, 0, 0]);
    assert_eq!(tiers_of(&idx, &[5, 6], w(1)), [0, 2, 0, 0]);
    // removed and stored again: it is the newest now
    idx.apply_in(host, &rm(&[11]))?;
    idx.apply_in(host, &store(None, &[(30, 7)]))?;
    idx.apply_in(host, &store(None, &[(11, 9)]))?;
    assert_eq!(idx.holder_blocks(host), 3);
    assert_eq!(tiers_of(&idx, &[9], w(1)), [0, 1, 0, 0]);
    assert_eq!(tiers_of(&idx, &[7], w(1)), [0, 1, 0, 0]);
    // 10, then 20 (11's older entry was not its last)
    assert_eq!(idx.stats().blocks_evicted, 2);
    Ok(())
}

#[test]
fn a_bounded_tier_of_zero_holds_nothing_and_churn_keeps_its_queue_small() -> Result<(), IndexError>
{
    let idx = KvIndex::new(16);
    idx.bound_tier(t(1, Tier::Host), 0);
    idx.apply_in(t(1, Tier::Host), &store(None, &[(10, 1), (11, 2)]))?;
    assert_eq!(idx.holder_blocks(t(1, Tier::Host)), 0);
    // 2^63: table room is capped (MAX_RESERVED_BLOCKS), and stores and
    // removes of the same blocks over and over keep the order's memory flat
    let big = t(2, Tier::Host);
    idx.bound_tier(big, 1 << 63);
    idx.apply_in(big, &store(None, &[(99, 99)]))?;
    let before = idx.stats().bytes_used;
    for round in 0..20_000u64 {
        idx.apply_in(big, &store(None, &[(round % 4, 1 + round % 4)]))?;
        idx.apply_in(big, &rm(&[round % 4]))?;
    }
    assert!(idx.stats().bytes_used < before + (64 << 10));
    // removals for tiers never stored are counted no-ops
    let out = idx.apply_in(t(3, Tier::External), &rm(&[1, 2]))?;
    assert_eq!((out.applied, out.skipped), (0, 2));
    Ok(())
}

#[test]
fn a_target_restored_from_its_content_keeps_its_tiers() -> Result<(), IndexError> {
    let idx = KvIndex::new(16);
    idx.apply(w(1), &store(None, &[(10, 1), (11, 2)]))?;
    idx.apply_in(t(1, Tier::Host), &store(Some(11), &[(12, 3)]))?;
    idx.apply_in(t(1, Tier::Storage), &store(None, &[(10, 1)]))?;
    let content = idx.export_target(w(1));
    assert_eq!(content.lower_tiers.len(), 2);
    let copy = KvIndex::new(16);
    copy.restore_target(w(1), &content)?;
    assert_eq!(copy.digest(), idx.digest());
    assert_eq!(tiers_of(&copy, &[1, 2, 3], w(1)), [2, 1, 0, 0]);
    assert_eq!(copy.stats().per_tier, idx.stats().per_tier);
    Ok(())
}
