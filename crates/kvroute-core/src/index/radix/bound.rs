//! Tiers held to a capacity by evicting what was stored longest ago.
//!
//! Why this exists: some engines fill a tier and never say what leaves it
//! (LMCache publishes stores but no removals), so without a bound the
//! index would keep blocks the engine dropped long ago and grow without
//! end. A bounded holder keeps its engine hashes in store order; when a
//! store takes it past its capacity, the oldest go, as an engine evicting
//! least recently stored first would. Invariants kept here: the queue
//! holds every engine hash the holder holds, each counted in `queued` once
//! per entry; entries of hashes no longer held are skipped when they come
//! up, and the queue is compacted to the held ones when it passes twice
//! their number, so its memory follows the capacity, never the traffic.

use super::{Block, IndexCore};
use crate::index::tier::Holder;
use crate::index::{ApplyOutcome, IndexError};
use crate::types::EngineHash;
use rustc_hash::FxHashMap;
use std::borrow::Cow;
use std::collections::VecDeque;

/// A bounded holder's engine hashes, oldest store first.
#[derive(Default)]
pub(super) struct StoreOrder {
    queue: VecDeque<EngineHash>,
    /// Entries of each hash in `queue`: only its last entry evicts it.
    queued: FxHashMap<EngineHash, u32>,
}

impl StoreOrder {
    fn push(&mut self, e: EngineHash) {
        self.queue.push_back(e);
        *self.queued.entry(e).or_default() += 1;
    }

    /// The oldest entry that is its hash's last (so the hash was not stored
    /// again since).
    fn pop_last_entry(&mut self) -> Option<EngineHash> {
        while let Some(e) = self.queue.pop_front() {
            let left = match self.queued.get_mut(&e) {
                Some(n) => {
                    *n -= 1;
                    *n
                }
                None => 0,
            };
            if left == 0 {
                self.queued.remove(&e);
                return Some(e);
            }
        }
        None
    }

    pub(super) fn bytes(&self) -> usize {
        self.queue.capacity() * 8 + self.queued.capacity() * 13
    }
}

impl IndexCore {
    /// Hold `holder` (a tier below the device) to `blocks` engine hashes
    /// by evicting the least recently stored; forgotten with the holder.
    pub(crate) fn bound_tier(&mut self, holder: Holder, blocks: u64) {
        self.capacity.insert(holder, blocks);
        if !self.bounded.contains_key(&holder) {
            let mut order = StoreOrder::default();
            if let Some(&s) = self.slot_of.get(&holder) {
                for e in self.engine_hashes_of(s) {
                    order.push(e);
                }
            }
            self.bounded.insert(holder, order);
        }
        self.evict_to_capacity(holder);
    }

    /// A store, through the holder's bound when it has one.
    pub(super) fn store_any(
        &mut self,
        holder: Holder,
        parent: Option<EngineHash>,
        blocks: Cow<'_, [Block]>,
    ) -> Result<ApplyOutcome, IndexError> {
        if !self.bounded.contains_key(&holder) {
            return self.store(holder, parent, blocks);
        }
        let fresh = self.fresh_hashes(holder, blocks.iter().map(|b| b.0));
        let out = self.store(holder, parent, blocks)?;
        self.record_stored(holder, fresh);
        Ok(out)
    }

    /// [`Self::store_known`], through the holder's bound when it has one.
    pub(super) fn store_known_any(
        &mut self,
        holder: Holder,
        blocks: &[EngineHash],
    ) -> Result<ApplyOutcome, IndexError> {
        if !self.bounded.contains_key(&holder) {
            return self.store_known(holder, blocks);
        }
        let fresh = self.fresh_hashes(holder, blocks.iter().copied());
        let out = self.store_known(holder, blocks);
        // blocks stored before a rejection are held: record them too
        let held: Vec<EngineHash> = {
            let s = self.slot_of.get(&holder).copied();
            fresh
                .into_iter()
                .filter(|&e| s.is_some_and(|s| self.lookup(s, e).is_some()))
                .collect()
        };
        self.record_stored(holder, held);
        out
    }

    /// Engine hashes of `hashes` the holder does not hold yet.
    fn fresh_hashes(
        &self,
        holder: Holder,
        hashes: impl Iterator<Item = EngineHash>,
    ) -> Vec<EngineHash> {
        let own = self.slot_of.get(&holder).copied();
        hashes
            .filter(|&e| own.is_none_or(|s| self.lookup(s, e).is_none()))
            .collect()
    }

    /// Queue a store's new hashes, then evict down to the capacity.
    fn record_stored(&mut self, holder: Holder, fresh: Vec<EngineHash>) {
        let held = self.held_by(holder);
        if let Some(order) = self.bounded.get_mut(&holder) {
            for e in fresh {
                order.push(e);
            }
            if order.queue.len() as u64 > 2 * held + 64 {
                self.compact_order(holder);
            }
        }
        self.evict_to_capacity(holder);
    }

    fn held_by(&self, holder: Holder) -> u64 {
        self.slot_of
            .get(&holder)
            .and_then(|&s| self.slots.get(s as usize))
            .map_or(0, |x| x.count)
    }

    /// Evict the least recently stored blocks until the holder is within
    /// its capacity.
    fn evict_to_capacity(&mut self, holder: Holder) {
        let capacity = self.capacity.get(&holder).copied().unwrap_or(u64::MAX);
        while self.held_by(holder) > capacity {
            let Some(e) = self
                .bounded
                .get_mut(&holder)
                .and_then(|o| o.pop_last_entry())
            else {
                return;
            };
            let out = self.remove(holder, &[e]);
            self.blocks_evicted += out.applied;
        }
    }

    /// Keep only the last entry of each held hash, in order.
    fn compact_order(&mut self, holder: Holder) {
        let Some(mut order) = self.bounded.remove(&holder) else {
            return;
        };
        let own = self.slot_of.get(&holder).copied();
        let mut kept = StoreOrder::default();
        let mut left = std::mem::take(&mut order.queued);
        for e in order.queue.drain(..) {
            let Some(n) = left.get_mut(&e) else {
                continue;
            };
            *n -= 1;
            if *n == 0 && own.is_some_and(|s| self.lookup(s, e).is_some()) {
                kept.push(e);
            }
        }
        self.bounded.insert(holder, kept);
    }

    /// Every engine hash slot `s` holds a position by.
    fn engine_hashes_of(&self, s: u32) -> Vec<EngineHash> {
        let Some(slot) = self.slots.get(s as usize) else {
            return Vec::new();
        };
        slot.table
            .iter()
            .filter_map(|p| self.engine_at(p))
            .chain(slot.alias.keys().copied())
            .collect()
    }

    pub(super) fn bounded_bytes(&self) -> usize {
        self.bounded.values().map(|o| o.bytes()).sum::<usize>() + self.bounded.capacity() * 40
    }
}
