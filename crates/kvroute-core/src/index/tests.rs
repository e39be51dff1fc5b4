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
            skipped: 1
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
            skipped: 2
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
