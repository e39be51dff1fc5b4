//! The simulated engine's host-memory tier: blocks the device evicted,
//! kept until the tier is full, oldest out first.
//!
//! Why a tier of its own: engines with KV offloading (vLLM's offloading
//! connector, SGLang's HiCache) keep what the GPU evicts in host memory and
//! load it back for a later prompt at a fraction of recomputing it. The
//! engine moves a block here when the device evicts it and takes it back out
//! when a prompt loads it; a block is in one tier at a time. Each entry keeps
//! its parent hash and tokens, so the engine can publish self-describing
//! events for it and move it back to the device.
//!
//! Only plain data here: the engine (`super`) emits the events.

use std::collections::{BTreeMap, HashMap};

use crate::sim::determinism::FastBuild;

/// One block held in host memory.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct HostBlock {
    /// The chain's previous block (`None`: the first block of a sequence).
    pub(super) parent: Option<u64>,
    pub(super) tokens: Vec<u32>,
}

/// Host blocks by engine hash, and their order of arrival.
#[derive(Debug)]
pub(super) struct HostTier {
    capacity: usize,
    /// Hash -> (arrival stamp, block).
    blocks: HashMap<u64, (u64, HostBlock), FastBuild>,
    /// Arrival stamp -> hash, oldest first.
    order: BTreeMap<u64, u64>,
    next_stamp: u64,
}

impl HostTier {
    /// A tier of `capacity` blocks (at least one).
    pub(super) fn new(capacity: usize) -> Self {
        HostTier {
            capacity: capacity.max(1),
            blocks: HashMap::with_capacity_and_hasher(capacity.min(1 << 20), FastBuild::default()),
            order: BTreeMap::new(),
            next_stamp: 0,
        }
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.blocks.len()
    }

    pub(super) fn contains(&self, hash: u64) -> bool {
        self.blocks.contains_key(&hash)
    }

    /// Makes room for one block: evicts the oldest while the tier is full.
    /// Returns the hash evicted, if any. Call before [`Self::insert`] so the
    /// tier never holds more than its capacity, not even for an instant.
    pub(super) fn make_room(&mut self) -> Option<u64> {
        if self.blocks.len() < self.capacity {
            return None;
        }
        let (_, hash) = self.order.pop_first()?;
        self.blocks.remove(&hash);
        Some(hash)
    }

    /// Keeps `block` under `hash` as the newest entry. The caller made room
    /// first ([`Self::make_room`]); a hash already here is refreshed.
    pub(super) fn insert(&mut self, hash: u64, block: HostBlock) {
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        if let Some((old, _)) = self.blocks.insert(hash, (stamp, block)) {
            self.order.remove(&old);
        }
        self.order.insert(stamp, hash);
    }

    /// Takes `hash` out of the tier (it moves to the device).
    pub(super) fn take(&mut self, hash: u64) -> Option<HostBlock> {
        let (stamp, block) = self.blocks.remove(&hash)?;
        self.order.remove(&stamp);
        Some(block)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(t: u32) -> HostBlock {
        HostBlock {
            parent: None,
            tokens: vec![t; 4],
        }
    }

    #[test]
    fn oldest_leaves_first_and_the_bound_holds() {
        let mut host = HostTier::new(2);
        for h in 1..=2 {
            assert_eq!(host.make_room(), None);
            host.insert(h, block(h as u32));
        }
        assert_eq!(host.make_room(), Some(1));
        host.insert(3, block(3));
        assert_eq!(host.len(), 2);
        assert!(!host.contains(1) && host.contains(2) && host.contains(3));
        // taking one out frees its room; the rest keep their order
        assert_eq!(host.take(2), Some(block(2)));
        assert_eq!(host.take(2), None);
        assert_eq!(host.make_room(), None);
        host.insert(4, block(4));
        assert_eq!(host.make_room(), Some(3));
    }
}
