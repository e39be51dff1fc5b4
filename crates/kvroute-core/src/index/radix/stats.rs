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
use crate::types::WorkerRank;

impl IndexCore {
    pub(crate) fn worker_blocks(&self, worker: WorkerRank) -> u64 {
        self.slot_of
            .get(&worker)
            .and_then(|&s| self.slots.get(s as usize))
            .map_or(0, |slot| slot.count)
    }

    pub(crate) fn stats(&self) -> IndexStats {
        let mut per_worker: Vec<(WorkerRank, u64)> = self
            .slots
            .iter()
            .filter(|s| s.live && s.count > 0)
            .map(|s| (s.worker, s.count))
            .collect();
        per_worker.sort_unstable();
        IndexStats {
            blocks: per_worker.iter().map(|(_, n)| n).sum(),
            nodes: self.positions,
            workers: per_worker.len() as u64,
            per_worker,
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
        b += table_bytes(self.extra_refs.capacity(), 24);
        b += (self.undo.capacity() * 8 + self.pending.capacity() * 8) as u64;
        b += (self.shifted.capacity() * 16 + self.pool.bytes()) as u64;
        b
    }
}
