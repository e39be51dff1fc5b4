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

use std::collections::HashMap;
use std::hash::BuildHasher;

use hashbrown::HashTable;

use crate::types::{WorkerId, WorkerRank};

/// Most prompt blocks held awaiting their prefill, over every booking: a
/// caller's open bookings cannot make the held prompts take more than
/// this (32 MiB of hashes). Past it a booked prompt is recorded at once,
/// as if its prefill had completed.
pub const MAX_PENDING_BLOCKS: usize = 1 << 22;

/// No node: the end of a list.
const NIL: u32 = u32::MAX;

/// One held prefix block, a link of its target's recency list.
#[derive(Clone, Copy, Debug)]
struct Node {
    chain: u64,
    /// When it was last touched.
    at_ms: u64,
    /// The next older and next newer node (the free list links `newer`).
    older: u32,
    newer: u32,
}

/// One target's predicted cache: its blocks in a slab, linked from least
/// to most recently used, and found by chain key through a table of slab
/// indexes (the key is the node's). A block takes a 24-byte node, the
/// slab growing by an eighth, and 5 bytes a table bucket: at most 23 a
/// block even when tombstones make the table double at 7/16 full. About
/// 52 in all, at worst, under the 96 bytes a declared block is budgeted
/// for; a map from key to index took 17 a bucket (up to 78 a block), a
/// tree ordered by tick about 106.
#[derive(Debug)]
struct TargetCache {
    slots: HashTable<u32>,
    /// Seeded per process: callers choose the keys (see `ChainMap`).
    hasher: foldhash::fast::RandomState,
    nodes: Vec<Node>,
    oldest: u32,
    newest: u32,
    /// Freed nodes, linked through `newer`.
    free: u32,
}

impl Default for TargetCache {
    fn default() -> Self {
        Self {
            slots: HashTable::new(),
            hasher: Default::default(),
            nodes: Vec::new(),
            oldest: NIL,
            newest: NIL,
            free: NIL,
        }
    }
}

impl TargetCache {
    fn len(&self) -> usize {
        self.slots.len()
    }

    /// The slab index holding `chain`.
    fn slot(&self, chain: u64) -> Option<u32> {
        let nodes = &self.nodes;
        self.slots
            .find(self.hasher.hash_one(chain), |&i| {
                nodes[i as usize].chain == chain
            })
            .copied()
    }

    fn node(&self, i: u32) -> &Node {
        &self.nodes[i as usize]
    }

    fn node_mut(&mut self, i: u32) -> &mut Node {
        &mut self.nodes[i as usize]
    }

    fn unlink(&mut self, i: u32) {
        let Node { older, newer, .. } = *self.node(i);
        match older {
            NIL => self.oldest = newer,
            o => self.node_mut(o).newer = newer,
        }
        match newer {
            NIL => self.newest = older,
            n => self.node_mut(n).older = older,
        }
    }

    fn push_newest(&mut self, i: u32) {
        let newest = self.newest;
        {
            let node = self.node_mut(i);
            node.older = newest;
            node.newer = NIL;
        }
        match newest {
            NIL => self.oldest = i,
            n => self.node_mut(n).newer = i,
        }
        self.newest = i;
    }

    fn touch(&mut self, chain: u64, at_ms: u64) {
        if let Some(i) = self.slot(chain) {
            self.unlink(i);
            self.node_mut(i).at_ms = at_ms;
            self.push_newest(i);
            return;
        }
        // Slab indexes stop short of NIL: a rank that big (2^32 blocks)
        // recycles its oldest block.
        if self.free == NIL && self.nodes.len() >= NIL as usize {
            self.evict_oldest();
        }
        let node = Node {
            chain,
            at_ms,
            older: NIL,
            newer: NIL,
        };
        let i = match self.free {
            NIL => {
                if self.nodes.len() == self.nodes.capacity() {
                    // An eighth more, not double: the slab's spare room
                    // counts against the bytes a block is budgeted.
                    self.nodes.reserve_exact((self.nodes.len() / 8).max(64));
                }
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
            free => {
                self.free = self.node(free).newer;
                *self.node_mut(free) = node;
                free
            }
        };
        let (nodes, hasher) = (&self.nodes, &self.hasher);
        self.slots.insert_unique(hasher.hash_one(chain), i, |&j| {
            hasher.hash_one(nodes[j as usize].chain)
        });
        self.push_newest(i);
    }

    fn evict_oldest(&mut self) -> bool {
        let i = self.oldest;
        if i == NIL {
            return false;
        }
        self.unlink(i);
        let chain = self.node(i).chain;
        if let Ok(entry) = self
            .slots
            .find_entry(self.hasher.hash_one(chain), |&j| j == i)
        {
            entry.remove();
        }
        self.node_mut(i).newer = self.free;
        self.free = i;
        true
    }

    /// Drops blocks last touched before `cutoff_ms`.
    fn expire(&mut self, cutoff_ms: u64) -> u64 {
        let mut dropped = 0;
        while self.oldest != NIL && self.node(self.oldest).at_ms < cutoff_ms {
            self.evict_oldest();
            dropped += 1;
        }
        dropped
    }

    /// Leading blocks of `chain` held and, with a TTL, fresh at `cutoff_ms`.
    fn overlap(&self, chain: &[u64], cutoff_ms: u64) -> u32 {
        let held = chain
            .iter()
            .take_while(|&&c| {
                self.slot(c)
                    .is_some_and(|i| self.node(i).at_ms >= cutoff_ms)
            })
            .count();
        u32::try_from(held).unwrap_or(u32::MAX)
    }

    /// Rebuilds a cache that holds under a quarter of what its tables
    /// hold room for, oldest first, so the same order comes out.
    fn shrink_if_sparse(&mut self) {
        if self.slots.capacity() <= 1024 || self.len() >= self.slots.capacity() / 4 {
            return;
        }
        let mut fresh = Self {
            slots: HashTable::with_capacity(self.len()),
            nodes: Vec::with_capacity(self.len()),
            ..Self::default()
        };
        let mut i = self.oldest;
        while i != NIL {
            let node = *self.node(i);
            fresh.touch(node.chain, node.at_ms);
            i = node.newer;
        }
        *self = fresh;
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
            cache.touch(block, now_ms);
        }
        let capacity = usize::try_from(capacity.max(1)).unwrap_or(usize::MAX);
        while cache.len() > capacity && cache.evict_oldest() {}
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
            .map_or(0, |cache| cache.len() as u64)
    }

    /// Heap bytes of `target`'s tables as allocated: the hash table's
    /// buckets and control bytes, and the slab's nodes.
    pub fn table_bytes(&self, target: WorkerRank) -> u64 {
        self.targets.get(&target).map_or(0, |cache| {
            let slab = cache.nodes.capacity() * std::mem::size_of::<Node>();
            (cache.slots.allocation_size() + slab) as u64
        })
    }

    /// Blocks predicted over every target.
    pub fn total_blocks(&self) -> u64 {
        self.targets.values().map(|c| c.len() as u64).sum()
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
        self.targets.retain(|_, cache| cache.len() > 0);
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
