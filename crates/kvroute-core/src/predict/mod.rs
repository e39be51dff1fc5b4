//! Predicted caches: what each target is taken to hold when its own
//! events cannot say (a worker registered APPROXIMATE, or AUTO before its
//! first event).
//!
//! Why: many engines run without KV events, and they still cache the
//! prompts they serve. The router knows what it sent where: a RESERVE
//! booking holds the prompt for its target, and when the request's prefill
//! completes (MarkPrefillComplete, or its Release if that comes first) the
//! target is recorded as holding the prompt's blocks. Not at booking: the
//! blocks exist only once computed, and an exact worker's events show them
//! no sooner; a request sharing the prefix sent there meanwhile waits
//! behind the first and finds cached only what was computed by then. On
//! the replays (docs/ROUTING.md, "Workers without KV events") recording at prefill
//! completion beat recording at booking on TTFT p99 on both traces.
//!
//! Model: a target's prediction is a set of prefixes, kept as the chained
//! key of each prefix (the router passes the bookings' prefix keys, key
//! `i` covering blocks `0..=i`), so a block is only ever matched at its
//! own position, and a booking another replica (or a snapshot) hands over
//! carries what its prompt needs. Each target keeps at
//! most its declared capacity of blocks and forgets the least recently
//! used first, as the engines' own caches do. A request touches its blocks
//! deepest first, so a prefix's first block is always at least as recent
//! as any block below it: eviction takes leaves before their parents, and
//! what is held stays prefix-closed (a held block's parent is held). An
//! optional time to live forgets blocks untouched for that long; by the
//! same ordering, a walk from the root may stop at the first expired block.

use std::collections::{BTreeMap, HashMap};

use crate::types::{WorkerId, WorkerRank};

/// Most prompt blocks held awaiting their prefill, over every booking: a
/// caller's open bookings cannot make the held prompts take more than
/// this (32 MiB of hashes). Past it a booked prompt is recorded at once,
/// as if its prefill had completed.
pub const MAX_PENDING_BLOCKS: usize = 1 << 22;

/// One held prefix block: when it was last touched (order and clock).
#[derive(Clone, Copy, Debug)]
struct Touch {
    tick: u64,
    at_ms: u64,
}

/// One target's predicted cache.
#[derive(Debug, Default)]
struct TargetCache {
    blocks: HashMap<u64, Touch>,
    /// Chain hash by tick: the least recently used first.
    order: BTreeMap<u64, u64>,
}

impl TargetCache {
    fn touch(&mut self, chain: u64, tick: u64, at_ms: u64) {
        if let Some(old) = self.blocks.insert(chain, Touch { tick, at_ms }) {
            self.order.remove(&old.tick);
        }
        self.order.insert(tick, chain);
    }

    fn evict_oldest(&mut self) -> bool {
        match self.order.pop_first() {
            Some((_, chain)) => {
                self.blocks.remove(&chain);
                true
            }
            None => false,
        }
    }

    /// Drops blocks last touched before `cutoff_ms`.
    fn expire(&mut self, cutoff_ms: u64) -> u64 {
        let mut dropped = 0;
        while let Some((_, chain)) = self.order.first_key_value() {
            let chain = *chain;
            if self
                .blocks
                .get(&chain)
                .is_some_and(|t| t.at_ms >= cutoff_ms)
            {
                break;
            }
            self.evict_oldest();
            dropped += 1;
        }
        dropped
    }

    /// Leading blocks of `chain` held and, with a TTL, fresh at `cutoff_ms`.
    fn overlap(&self, chain: &[u64], cutoff_ms: u64) -> u32 {
        let held = chain
            .iter()
            .take_while(|c| self.blocks.get(c).is_some_and(|t| t.at_ms >= cutoff_ms))
            .count();
        u32::try_from(held).unwrap_or(u32::MAX)
    }

    fn shrink_if_sparse(&mut self) {
        if self.blocks.capacity() > 1024 && self.blocks.len() < self.blocks.capacity() / 4 {
            self.blocks.shrink_to_fit();
        }
    }
}

/// A booked prompt not yet recorded: it is, once its prefill completes.
#[derive(Debug)]
struct Pending {
    target: WorkerRank,
    chain: Vec<u64>,
    capacity: u64,
    booked_ms: u64,
}

/// Every target's predicted cache (see the module docs).
#[derive(Debug, Default)]
pub struct PredictedCaches {
    targets: HashMap<WorkerRank, TargetCache>,
    /// Booked prompts awaiting their prefill, by request id.
    pending: HashMap<String, Pending>,
    /// Blocks of every held prompt.
    pending_blocks: usize,
    /// Forget blocks untouched this long; `None`: only capacity ages them.
    ttl_ms: Option<u64>,
    /// Orders touches across every target (only ever grows).
    tick: u64,
}

impl PredictedCaches {
    pub fn new(ttl_ms: Option<u64>) -> Self {
        Self {
            ttl_ms: ttl_ms.filter(|&t| t > 0),
            ..Self::default()
        }
    }

    /// The oldest touch time that still counts at `now_ms`.
    fn cutoff(&self, now_ms: u64) -> u64 {
        self.ttl_ms.map_or(0, |ttl| now_ms.saturating_sub(ttl))
    }

    /// Records that `target` now holds the prefixes in `chain`, keeping at
    /// most `capacity` blocks (at least 1) by LRU.
    pub(crate) fn record(&mut self, target: WorkerRank, chain: &[u64], capacity: u64, now_ms: u64) {
        if chain.is_empty() {
            return;
        }
        let cache = self.targets.entry(target).or_default();
        // Deepest first, so each parent ends more recent than its children.
        for &block in chain.iter().rev() {
            self.tick += 1;
            cache.touch(block, self.tick, now_ms);
        }
        let capacity = usize::try_from(capacity.max(1)).unwrap_or(usize::MAX);
        while cache.blocks.len() > capacity && cache.evict_oldest() {}
    }

    /// Holds a booked prompt until [`Self::settle`] records it (or, past
    /// [`MAX_PENDING_BLOCKS`], records it at once).
    pub fn hold(
        &mut self,
        request_id: &str,
        target: WorkerRank,
        chain: Vec<u64>,
        capacity: u64,
        now_ms: u64,
    ) {
        self.unhold(request_id);
        if self.pending_blocks + chain.len() > MAX_PENDING_BLOCKS {
            self.record(target, &chain, capacity, now_ms);
            return;
        }
        self.pending_blocks += chain.len();
        self.pending.insert(
            request_id.to_owned(),
            Pending {
                target,
                chain,
                capacity,
                booked_ms: now_ms,
            },
        );
    }

    fn unhold(&mut self, request_id: &str) -> Option<Pending> {
        let pending = self.pending.remove(request_id)?;
        self.pending_blocks -= pending.chain.len();
        Some(pending)
    }

    /// Records a held prompt: its prefill completed (or it ended).
    pub fn settle(&mut self, request_id: &str, now_ms: u64) {
        if let Some(p) = self.unhold(request_id) {
            self.record(p.target, &p.chain, p.capacity, now_ms);
        }
    }

    /// Drops held prompts booked before `cutoff_ms` (bookings that expired).
    pub fn expire_pending(&mut self, cutoff_ms: u64) {
        self.pending.retain(|_, p| p.booked_ms >= cutoff_ms);
        self.pending_blocks = self.pending.values().map(|p| p.chain.len()).sum();
    }

    /// Leading blocks of `chain` that `target` is predicted to hold.
    pub fn overlap(&self, target: WorkerRank, chain: &[u64], now_ms: u64) -> u32 {
        self.targets
            .get(&target)
            .map_or(0, |cache| cache.overlap(chain, self.cutoff(now_ms)))
    }

    /// Blocks `target` is predicted to hold (expired ones included until
    /// [`Self::expire`] drops them).
    pub fn blocks(&self, target: WorkerRank) -> u64 {
        self.targets
            .get(&target)
            .map_or(0, |cache| cache.blocks.len() as u64)
    }

    /// Blocks predicted over every target.
    pub fn total_blocks(&self) -> u64 {
        self.targets.values().map(|c| c.blocks.len() as u64).sum()
    }

    /// Drops blocks past the time to live; returns how many.
    pub fn expire(&mut self, now_ms: u64) -> u64 {
        let Some(_) = self.ttl_ms else {
            return 0;
        };
        let cutoff = self.cutoff(now_ms);
        let mut dropped = 0;
        for cache in self.targets.values_mut() {
            dropped += cache.expire(cutoff);
            cache.shrink_if_sparse();
        }
        self.targets.retain(|_, cache| !cache.blocks.is_empty());
        dropped
    }

    /// Forgets every rank of a worker.
    pub fn forget_worker(&mut self, worker_id: WorkerId) {
        self.targets.retain(|t, _| t.worker_id != worker_id);
        self.pending.retain(|_, p| p.target.worker_id != worker_id);
        self.pending_blocks = self.pending.values().map(|p| p.chain.len()).sum();
    }
}

#[cfg(test)]
mod tests;
