//! What the core reports about itself: blocks per target, tree size,
//! event counts and estimated heap bytes.
//!
//! Why this exists: these answers read every part of the core but change
//! none, and are asked off the event and query paths (metrics, the admin
//! API, the benchmarks). Invariants: a target's block count is its number
//! of engine hashes (`count`); `nodes` counts live positions; bytes are
//! estimated from capacities, so they follow what was allocated, not what
//! is in use.

use super::IndexCore;
use super::segment::Seg;
use super::slots::Slot;
use crate::index::IndexStats;
use crate::index::tier::{Holder, TIERS, Tier};
use crate::types::WorkerRank;

impl IndexCore {
    /// Blocks in `worker`'s device tier (its cache occupancy).
    pub(crate) fn worker_blocks(&self, worker: WorkerRank) -> u64 {
        self.holder_blocks(Holder::device(worker))
    }

    pub(crate) fn holder_blocks(&self, holder: Holder) -> u64 {
        self.slot_of
            .get(&holder)
            .and_then(|&s| self.slots.get(s as usize))
            .map_or(0, |slot| slot.count)
    }

    pub(crate) fn stats(&self) -> IndexStats {
        let held = || self.slots.iter().filter(|s| s.live && s.count > 0);
        let mut per_worker: Vec<(WorkerRank, u64)> = held()
            .filter(|s| s.holder.tier == Tier::Device)
            .map(|s| (s.holder.target, s.count))
            .collect();
        per_worker.sort_unstable();
        let mut per_tier = [0u64; TIERS];
        for s in held() {
            per_tier[s.holder.tier.index()] += s.count;
        }
        let mut targets: Vec<WorkerRank> = held().map(|s| s.holder.target).collect();
        targets.sort_unstable();
        targets.dedup();
        IndexStats {
            blocks: per_tier.iter().sum(),
            nodes: self.positions,
            workers: targets.len() as u64,
            per_worker,
            per_tier,
            blocks_unresolved: self.blocks_unresolved,
            blocks_evicted: self.blocks_evicted,
            bytes_used: self.bytes_used(),
            events_applied: self.events_applied,
            events_rejected: self.events_rejected,
            blocks_skipped: self.blocks_skipped,
        }
    }

    /// Heap bytes estimated from capacities (hash tables: buckets times
    /// entry size plus one control byte each).
    pub(crate) fn bytes_used(&self) -> u64 {
        fn table_bytes(capacity: usize, entry: usize) -> u64 {
            if capacity == 0 {
                return 0;
            }
            let buckets = (capacity * 8 / 7).next_power_of_two();
            (buckets * (entry + 1) + 16) as u64
        }
        let mut b = (self.segs.capacity() * size_of::<Seg>()) as u64;
        b += self
            .segs
            .iter()
            .map(|g| {
                (g.pairs.capacity() * 16 + g.wide.capacity() * 8 + g.holes.capacity() * 8) as u64
            })
            .sum::<u64>();
        b += table_bytes(self.edges.capacity(), 4);
        b += (self.slots.capacity() * size_of::<Slot>()) as u64;
        for s in &self.slots {
            b += s.table.bytes() as u64;
            b += table_bytes(s.alias.capacity(), 16);
            b += table_bytes(s.alias_at.capacity(), 16);
            b += table_bytes(s.alias_more.capacity(), 32);
            b += s
                .alias_more
                .values()
                .map(|v| (v.capacity() * 8) as u64)
                .sum::<u64>();
        }
        b += table_bytes(self.slot_of.capacity(), 24);
        b += table_bytes(self.tier_slots.capacity(), 28);
        b += self.bounded_bytes() as u64;
        b += table_bytes(self.extra_refs.capacity(), 24);
        b += (self.undo.capacity() * 8 + self.pending.capacity() * 8) as u64;
        b += (self.shifted.capacity() * 16 + self.pool.bytes()) as u64;
        b
    }
}
