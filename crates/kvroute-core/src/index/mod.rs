//! The exact KV block index: which (worker, dp_rank) holds which blocks.
//!
//! Why this exists: routing asks, for the local block hashes of a request,
//! how many leading blocks each target already caches. Workers report their
//! cache through events; this module keeps the answer exact and fast.
//!
//! Model (invariants):
//! * A node is identified by its PATH of local hashes from the root; local
//!   hashes are per block, not chained. A `Stored` event with a parent hangs
//!   its blocks under the node that the *same* (worker, dp_rank) holds under
//!   that parent engine hash; parent `None` means the root.
//! * A target's prefix for a query is the number of leading query blocks it
//!   holds contiguously from block 0; removing a block mid-chain ends the
//!   prefix there even though deeper blocks stay held.
//! * A target's block count is the number of distinct engine hashes it holds.
//! * Tiers ([`tier`]): each tier of a target is a holder of its own; an
//!   event applies to one tier ([`KvIndex::apply_in`]; [`KvIndex::apply`]
//!   is the device). A lower tier's store may name a parent that any tier
//!   of the target holds. A target's prefix is the longest run of query
//!   blocks each held in some tier, each counted for the fastest tier
//!   holding it ([`WorkerOverlap::tiers`]); its block count is its device's.
//!
//! Event rules (each checked by the naive oracle in `crates/kvroute-core/tests/it/index_oracle.rs`):
//! * `Stored` whose parent the target does not hold: rejected with
//!   [`IndexError::UnknownParent`]; the index is untouched.
//! * `Stored` of an engine hash the target already holds at the same path:
//!   a counted no-op for that block ([`ApplyOutcome::skipped`]), so a resent
//!   event is harmless. Held at a *different* path (also: the same hash twice
//!   in one event at different depths): the whole event is rejected with
//!   [`IndexError::EngineHashConflict`] and the index is left untouched.
//! * Two different engine hashes of one target at the same path are both
//!   kept; the target holds the node until both are removed.
//! * `Stored` of more than [`radix::MAX_EVENT_BLOCKS`] blocks (16.7 M):
//!   rejected with [`IndexError::TooManyBlocks`]; the index is untouched.
//! * `Removed` of an engine hash the target does not hold: a counted no-op per
//!   block; the other blocks of the event are still removed.
//! * `Cleared`, `remove_rank` and `remove_worker` of unknown targets: no-ops.
//!
//! Concurrency: [`KvIndex`] is `Send + Sync` and every method takes `&self`.
//! It wraps a single-writer core ([`radix::IndexCore`]) in a
//! `parking_lot::RwLock`. Whoever ingests events (one task per deployment)
//! applies them one at a time under the write lock, so a router thread never
//! waits for more than one event's worth of work, and every read sees the
//! index between two whole events (never half an event). Routing reads take
//! the read lock and run in parallel on every core.

mod array_pool;
pub mod content;
pub mod group_table;
pub mod naive;
pub mod radix;
pub mod tier;

use crate::types::{EngineHash, LocalHash, WorkerId, WorkerRank};
use parking_lot::RwLock;
use serde::Serialize;

pub use content::{IndexDigest, TargetContent, digest_term, digest_term_in};
pub use radix::IndexCore;
pub use tier::{Holder, TIERS, Tier, TierBlocks, TieredEvent};

/// One KV event of one (worker, dp_rank).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// The target now caches `blocks` (engine hash, local hash), in chain
    /// order, the first one a child of `parent` (`None`: a root block).
    Stored {
        parent: Option<EngineHash>,
        blocks: Vec<(EngineHash, LocalHash)>,
    },
    /// The target evicted these blocks.
    Removed { blocks: Vec<EngineHash> },
    /// The target dropped its whole cache (of the tier applied to).
    Cleared,
    /// The target now also caches these blocks, which another of its
    /// tiers holds: events that name blocks only by engine hash (vLLM's
    /// host tier before its self-describing events). Each is placed where
    /// the other tier holds it.
    StoredKnown { blocks: Vec<EngineHash> },
}

impl KvEvent {
    /// Blocks the event names: stored blocks or removed engine hashes.
    pub fn block_count(&self) -> usize {
        match self {
            KvEvent::Stored { blocks, .. } => blocks.len(),
            KvEvent::Removed { blocks } | KvEvent::StoredKnown { blocks } => blocks.len(),
            KvEvent::Cleared => 0,
        }
    }
}

/// Why an event was rejected. A rejected event leaves the index untouched.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    #[error("{worker}: stored blocks under parent engine hash {parent} which it does not hold")]
    UnknownParent {
        worker: WorkerRank,
        parent: EngineHash,
    },
    #[error("{worker}: engine hash {engine_hash} is already held at a different position")]
    EngineHashConflict {
        worker: WorkerRank,
        engine_hash: EngineHash,
    },
    #[error(
        "{worker}: storing {blocks} blocks would take it past its KV capacity of {capacity} blocks (it holds {held})"
    )]
    OverCapacity {
        worker: WorkerRank,
        blocks: usize,
        held: u64,
        capacity: u64,
    },
    #[error(
        "{worker}: an event for its {tier} tier, which its worker did not declare (cache_tiers)"
    )]
    TierNotDeclared { worker: WorkerRank, tier: Tier },
    #[error("{worker}: stored {blocks} blocks in one event, more than the {max} the index takes")]
    TooManyBlocks {
        worker: WorkerRank,
        blocks: usize,
        max: usize,
    },
}

/// What an accepted event did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ApplyOutcome {
    /// Blocks added (store) or dropped (remove, clear).
    pub applied: u64,
    /// Blocks that were counted no-ops: duplicate stores, unknown removes.
    pub skipped: u64,
    /// Blocks of a [`KvEvent::StoredKnown`] that no tier of the target
    /// held, so their place in the tree is unknown: left out.
    pub unresolved: u64,
}

/// One target's overlap with a query.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerOverlap {
    pub worker: WorkerRank,
    /// Leading query blocks held contiguously from block 0, in any tier
    /// (always > 0).
    pub blocks: u32,
    /// `blocks` by the fastest tier holding each; they sum to `blocks`.
    pub tiers: TierBlocks,
    /// `blocks * block_size`.
    pub cached_tokens: u64,
    /// Blocks this target holds in total (its cache occupancy).
    pub worker_blocks: u64,
}

/// The answer to [`KvIndex::find_matches`]: every target with a non-zero
/// prefix, in an unspecified order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OverlapScores {
    pub scores: Vec<WorkerOverlap>,
}

impl OverlapScores {
    /// The overlap of one target (0 blocks when absent).
    pub fn get(&self, worker: WorkerRank) -> Option<&WorkerOverlap> {
        self.scores.iter().find(|s| s.worker == worker)
    }

    /// Scores sorted by target, for comparisons.
    pub fn sorted(mut self) -> Self {
        self.scores.sort_by_key(|s| s.worker);
        self
    }
}

/// Size and occupancy of the index.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Cached (block, target, tier) entries.
    pub blocks: u64,
    /// Tree nodes (distinct paths), root excluded.
    pub nodes: u64,
    /// Targets holding at least one block (a registered target that has
    /// stored nothing yet is not one).
    pub workers: u64,
    /// Device blocks per target, sorted by target; targets holding nothing
    /// there omitted.
    pub per_worker: Vec<(WorkerRank, u64)>,
    /// Cached entries per tier (indexed by [`Tier::index`]); they sum to
    /// `blocks`.
    pub per_tier: [u64; TIERS],
    /// Blocks of placeholder stores that no tier of their target held,
    /// left out.
    pub blocks_unresolved: u64,
    /// Blocks bounded tiers evicted to stay within their capacity.
    pub blocks_evicted: u64,
    /// Estimated heap bytes, from the capacities of every table.
    pub bytes_used: u64,
    pub events_applied: u64,
    pub events_rejected: u64,
    pub blocks_skipped: u64,
}

/// The concurrent exact index (see the module docs for the rules).
pub struct KvIndex {
    block_size: u32,
    core: RwLock<IndexCore>,
}

impl KvIndex {
    /// An empty index for blocks of `block_size` tokens.
    pub fn new(block_size: u32) -> Self {
        Self {
            block_size,
            core: RwLock::new(IndexCore::new(block_size)),
        }
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Apply one event of `worker` (see the module docs for the rules).
    /// Apply one event of `worker`'s device tier (see the module docs for
    /// the rules).
    pub fn apply(&self, worker: WorkerRank, event: &KvEvent) -> Result<ApplyOutcome, IndexError> {
        self.core.write().apply(Holder::device(worker), event)
    }

    /// Apply one event of one tier of a target. A lower tier's store may
    /// name a parent that another tier of the target holds.
    pub fn apply_in(&self, holder: Holder, event: &KvEvent) -> Result<ApplyOutcome, IndexError> {
        self.core.write().apply(holder, event)
    }

    /// [`Self::apply`] for an event the caller is done with: a store that
    /// starts a new run of blocks keeps the event's array instead of
    /// copying it.
    pub fn apply_owned(
        &self,
        worker: WorkerRank,
        event: KvEvent,
    ) -> Result<ApplyOutcome, IndexError> {
        self.core.write().apply_owned(Holder::device(worker), event)
    }

    /// [`Self::apply_owned`] for one tier of a target.
    pub fn apply_owned_in(
        &self,
        holder: Holder,
        event: KvEvent,
    ) -> Result<ApplyOutcome, IndexError> {
        self.core.write().apply_owned(holder, event)
    }

    /// Applies an ingest event (see [`TieredEvent`]): a store or removal to
    /// its tier; a `Cleared` to every tier of `worker`, under one lock.
    pub fn apply_tiered(
        &self,
        worker: WorkerRank,
        event: TieredEvent,
    ) -> Result<ApplyOutcome, IndexError> {
        let mut core = self.core.write();
        match event.event {
            KvEvent::Cleared => {
                let mut total = ApplyOutcome::default();
                for tier in Tier::ALL {
                    let out = core.apply(Holder::new(worker, tier), &KvEvent::Cleared)?;
                    total.applied += out.applied;
                }
                Ok(total)
            }
            other => core.apply_owned(Holder::new(worker, event.tier), other),
        }
    }

    /// Expect `worker` to cache up to `blocks` blocks (its KV capacity, from
    /// registration): its engine-hash table is sized for them once, at its
    /// first store, instead of growing, which would stall readers while it
    /// rehashes; a target that stores nothing takes no room. Capped at
    /// [`radix::MAX_RESERVED_BLOCKS`] per target and a fixed budget in all
    /// (room comes back when a target goes); forgotten with the target.
    pub fn reserve(&self, worker: WorkerRank, blocks: u64) {
        self.core.write().reserve(Holder::device(worker), blocks);
    }

    /// Holds `worker` to `blocks` cached blocks, its KV capacity: a store
    /// that would take it past them is rejected
    /// ([`IndexError::OverCapacity`]). Forgotten with the target.
    pub fn limit_capacity(&self, worker: WorkerRank, blocks: u64) {
        self.core
            .write()
            .limit_capacity(Holder::device(worker), blocks);
    }

    /// Holds a tier below the device to `blocks` blocks by evicting the
    /// least recently stored ones when a store takes it past them (for
    /// engines that report no evictions from it); the index also makes
    /// table room for them. Forgotten with the target.
    pub fn bound_tier(&self, holder: Holder, blocks: u64) {
        let mut core = self.core.write();
        core.bound_tier(holder, blocks);
        if blocks > 0 {
            core.reserve(holder, blocks);
        }
    }

    /// Drops one tier of a target and every block it holds there (a tier
    /// its worker no longer declares); returns the blocks dropped.
    pub fn remove_tier(&self, holder: Holder) -> u64 {
        self.core.write().remove_holder(holder)
    }

    /// Drop every dp rank of `worker` and all their blocks; returns blocks dropped.
    pub fn remove_worker(&self, worker: WorkerId) -> u64 {
        self.core.write().remove_worker(worker)
    }

    /// Drop one target, every tier, and all its blocks; returns blocks dropped.
    pub fn remove_rank(&self, worker: WorkerRank) -> u64 {
        self.core.write().remove_rank(worker)
    }

    /// Every target's contiguous prefix of `query`.
    pub fn find_matches(&self, query: &[LocalHash]) -> OverlapScores {
        let mut out = OverlapScores::default();
        self.core.read().find_matches_into(query, &mut out);
        out
    }

    /// Like [`Self::find_matches`], reusing `out`'s allocation.
    pub fn find_matches_into(&self, query: &[LocalHash], out: &mut OverlapScores) {
        self.core.read().find_matches_into(query, out);
    }

    /// Blocks one tier of a target holds.
    pub fn holder_blocks(&self, holder: Holder) -> u64 {
        self.core.read().holder_blocks(holder)
    }

    /// Blocks held in one target's device tier.
    pub fn worker_blocks(&self, worker: WorkerRank) -> u64 {
        self.core.read().worker_blocks(worker)
    }

    /// Blocks held by each of `targets`, under one read lock.
    pub fn worker_blocks_many(&self, targets: &[WorkerRank]) -> Vec<u64> {
        let core = self.core.read();
        targets.iter().map(|t| core.worker_blocks(*t)).collect()
    }

    pub fn stats(&self) -> IndexStats {
        self.core.read().stats()
    }

    /// The targets holding blocks in any tier, by target.
    pub fn targets(&self) -> Vec<WorkerRank> {
        let mut targets: Vec<WorkerRank> = self
            .core
            .read()
            .holders()
            .into_iter()
            .map(|h| h.target)
            .collect();
        targets.dedup();
        targets
    }

    /// Everything one target holds, every tier (see
    /// [`content::TargetContent`]).
    pub fn export_target(&self, worker: WorkerRank) -> TargetContent {
        let core = self.core.read();
        let mut content = core.export_holder(Holder::device(worker));
        for tier in &Tier::ALL[1..] {
            let lower = core.export_holder(Holder::new(worker, *tier));
            if !lower.nodes.is_empty() {
                content.lower_tiers.push((*tier, lower));
            }
        }
        content
    }

    /// Rebuilds `content` for a target that holds nothing yet, through
    /// ordinary events (see [`TargetContent::events`]); stops at the first
    /// event the index rejects (a malformed content).
    pub fn restore_target(
        &self,
        worker: WorkerRank,
        content: &TargetContent,
    ) -> Result<(), IndexError> {
        let mut core = self.core.write();
        for event in content.events(radix::MAX_EVENT_BLOCKS) {
            core.apply_owned(Holder::device(worker), event)?;
        }
        for (tier, lower) in &content.lower_tiers {
            for event in lower.events(radix::MAX_EVENT_BLOCKS) {
                core.apply_owned(Holder::new(worker, *tier), event)?;
            }
        }
        Ok(())
    }

    /// Cached entries and their digest, summed over every target (see
    /// [`content::digest_term`]). Each target is read under its own short
    /// read lock.
    pub fn digest(&self) -> IndexDigest {
        let mut total = IndexDigest::default();
        for target in self.targets() {
            total.add(self.export_target(target).digest(target));
        }
        total
    }
}

/// Event builders for the index's unit tests.
#[cfg(test)]
mod test_events {
    use super::KvEvent;
    use crate::types::WorkerRank;

    /// Target `id`, dp rank 0.
    pub(crate) fn w(id: u64) -> WorkerRank {
        WorkerRank::new(id, 0)
    }

    /// A store of `(engine hash, local hash)` blocks under parent `p`.
    pub(crate) fn store(p: Option<u64>, b: &[(u64, u64)]) -> KvEvent {
        KvEvent::Stored {
            parent: p,
            blocks: b.to_vec(),
        }
    }

    /// A remove of engine hashes `b`.
    pub(crate) fn rm(b: &[u64]) -> KvEvent {
        KvEvent::Removed { blocks: b.to_vec() }
    }
}

#[cfg(test)]
mod tests;
