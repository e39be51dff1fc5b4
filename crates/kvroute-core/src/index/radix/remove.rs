//! Removes: a target drops blocks, and the positions it no longer holds
//! leave its holder set (and the tree, when no one holds them).
//!
//! Why this exists: eviction is half the event traffic and must not
//! fragment the tree. Invariants kept here: a `Removed` event takes every
//! block's entry out of the maps first (one probe each), then unholds the
//! positions whose last reference went, in event order, while splits
//! rename those still pending. A run that descends one by one in a segment
//! the slot holds alone is unheld at once: the end of the held part lowers
//! `held`, an earlier run becomes a hole. The last position of a shared
//! segment joins its only child when that child has the other holders;
//! any other position is isolated by splits. What no one holds any more
//! is pruned. Clearing a slot and removing a target end here too.

use super::slots::drop_extra_ref;
use super::tree::engine_in;
use super::{FREE, IndexCore, Pos, engine_hash, pos, pos_abs, pos_seg};
use crate::index::ApplyOutcome;
use crate::index::tier::{Holder, Tier};
use crate::types::{EngineHash, WorkerId, WorkerRank};
use rustc_hash::FxHashMap;

impl IndexCore {
    pub(super) fn remove(&mut self, holder: Holder, blocks: &[EngineHash]) -> ApplyOutcome {
        let Some(&s) = self.slot_of.get(&holder) else {
            return ApplyOutcome {
                skipped: blocks.len() as u64,
                ..ApplyOutcome::default()
            };
        };
        // pass 1: take every block's entry out of the maps (one probe each);
        // positions whose last reference went are unheld in pass 2
        let mut out = ApplyOutcome::default();
        let mut pending = std::mem::take(&mut self.pending);
        pending.clear();
        pending.reserve(blocks.len());
        let segs = &self.segs;
        let extra_refs = &mut self.extra_refs;
        let Some(slot) = self.slots.get_mut(s as usize) else {
            self.pending = pending;
            out.skipped = blocks.len() as u64;
            return out;
        };
        for (k, &e) in blocks.iter().enumerate() {
            slot.table
                .prefetch_ahead(k, |i| blocks.get(i).map(|&x| engine_hash(x)));
            let taken = match slot
                .table
                .remove(engine_hash(e), |x| engine_in(segs, x) == Some(e))
            {
                Some(p) => Some(p),
                None if slot.alias.is_empty() => None,
                None => slot.remove_alias(e),
            };
            let Some(p) = taken else {
                out.skipped += 1;
                continue;
            };
            out.applied += 1;
            if !drop_extra_ref(extra_refs, p, s) {
                pending.push(p);
            }
        }
        slot.count -= out.applied;
        // pass 2: in event order (LRU sends the deepest of the oldest blocks
        // first, which lowers `held` or grows a hole run); a split renames
        // the positions still pending
        self.pending = pending;
        let mut i = 0;
        while let Some(&p) = self.pending.get(i) {
            let (n, shift) = self.descending_run(s, i);
            i += n;
            self.pending_from = i;
            match shift {
                Some(c) => self.shift_into_child(pos_seg(p), c, n as u32),
                None if n == 1 => self.unhold(s, p),
                None => self.unhold_run(p, n as u32),
            }
        }
        self.pending.clear();
        self.pending_from = 0;
        out
    }

    /// How many pending positions from `pending[i]` on descend one by one
    /// in one segment held by slot `s` alone, or from the end of a shared
    /// segment that they all leave for its child (then that child); 1 and
    /// None if neither.
    fn descending_run(&self, s: u32, i: usize) -> (usize, Option<u32>) {
        let Some(&p) = self.pending.get(i) else {
            return (0, None);
        };
        let Some(g) = self.seg(pos_seg(p)) else {
            return (1, None);
        };
        // how far below `p` a run may reach: to the segment's first
        // position if `s` holds it alone, and leaving one position behind
        // if the run joins the child
        let (reach, shift) = if g.only(s) {
            (pos_abs(p), None)
        } else if let Some(c) = self.shift_child(s, p) {
            (g.pairs.len() as u32 - 2, Some(c))
        } else {
            return (1, None);
        };
        let tail = self.pending.get(i + 1..).unwrap_or(&[]);
        let n = 1 + tail
            .iter()
            .zip(1..=reach)
            .take_while(|&(&q, k)| q == p - u64::from(k))
            .count();
        (n, shift)
    }

    /// Unhold `n` positions ending at `p` (`p` and the `n - 1` before it),
    /// all held by one slot alone: lower `held` past them if they end the
    /// held part, else make them one hole run.
    fn unhold_run(&mut self, p: Pos, n: u32) {
        let id = pos_seg(p);
        let Some(g) = self.seg_mut(id) else {
            return;
        };
        let (lo, hi) = (pos_abs(p) + 1 - n, pos_abs(p) + 1);
        if hi == g.start + g.held {
            g.held = lo - g.start;
            g.normalize();
            self.prune(id);
        } else {
            g.add_holes(lo, hi);
        }
    }

    /// Slot `s` no longer holds position `p` (its last reference is gone).
    fn unhold(&mut self, s: u32, p: Pos) {
        let abs = pos_abs(p);
        if let Some(g) = self.seg_mut(pos_seg(p))
            && g.only(s)
            && abs + 1 < g.start + g.held
        {
            // a block from the middle of a chain only `s` holds: a hole,
            // no split
            g.add_holes(abs, abs + 1);
            return;
        }
        self.unhold_uniform(s, p);
    }

    /// `unhold` without making holes: the last held position is dropped by
    /// lowering `held`, any other is isolated by splits.
    fn unhold_uniform(&mut self, s: u32, p: Pos) {
        let id = pos_seg(p);
        let Some(g) = self.seg_mut(id) else {
            return;
        };
        let Some(i) = pos_abs(p).checked_sub(g.start) else {
            return;
        };
        if i + 1 == g.held && g.only(s) {
            // the usual eviction: the last held position, held by `s` alone
            g.held -= 1;
            g.normalize();
            self.prune(id);
            return;
        }
        let len = g.pairs.len() as u32;
        if let Some(c) = self.shift_child(s, p) {
            // the last position of a shared segment joins its only child,
            // held by the others alone
            self.shift_into_child(id, c, 1);
            return;
        }
        let Some(g) = self.seg(id) else {
            return;
        };
        if g.held < len {
            // make the segment fully held: its unheld tail moves out
            let k = g.held;
            self.split_tail(id, k);
        }
        let Some(g) = self.seg(id) else {
            return;
        };
        let len = g.pairs.len() as u32;
        // isolate the position in a segment of its own
        let mut t = id;
        if i + 1 < len {
            t = self.split(t, i + 1).0;
        }
        if i > 0 {
            t = self.split(t, i).1;
        }
        if let Some(g) = self.seg_mut(t) {
            g.clear(s);
        }
        self.prune(t);
    }

    /// Turn the holes of segment `id` (held by one slot) into unheld
    /// segments, so that another slot can join part of it. `at`, a position
    /// the caller keeps, is renamed if a split moves it.
    pub(super) fn flatten(&mut self, id: u32, at: Option<Pos>) -> Option<Pos> {
        let (s, holes) = match self.seg_mut(id) {
            Some(g) if !g.holes.is_empty() => {
                (g.mask.trailing_zeros(), std::mem::take(&mut g.holes))
            }
            _ => return at,
        };
        let base = self.pending.len();
        let outer_from = std::mem::replace(&mut self.pending_from, base);
        self.pending.extend(at);
        let first_hole = self.pending.len();
        for r in holes.iter().rev() {
            self.pending
                .extend((r[0]..r[1]).rev().map(|abs| pos(id, abs)));
        }
        let mut k = first_hole;
        while let Some(&p) = self.pending.get(k) {
            self.unhold_uniform(s, p);
            k += 1;
        }
        let at = at.and_then(|_| self.pending.get(base).copied());
        self.pending.truncate(base);
        self.pending_from = outer_from;
        at
    }

    pub(super) fn remove_engine_hash(&mut self, s: u32, e: EngineHash) -> bool {
        match self.lookup(s, e) {
            Some(p) => self.remove_at(s, e, p),
            None => false,
        }
    }

    /// Drop slot `s`'s engine hash `e`, which it holds at position `p`
    /// (false if that entry is gone, e.g. removed earlier in the event).
    fn remove_at(&mut self, s: u32, e: EngineHash, p: Pos) -> bool {
        let canonical = self.engine_at(p) == Some(e);
        let Some(slot) = self.slots.get_mut(s as usize) else {
            return false;
        };
        let removed = if canonical {
            slot.table.remove(engine_hash(e), |x| x == p).is_some()
        } else {
            slot.remove_alias(e).is_some()
        };
        if !removed {
            return false;
        }
        slot.count -= 1;
        if !drop_extra_ref(&mut self.extra_refs, p, s) {
            self.unhold(s, p);
        }
        true
    }

    /// Drop every block of slot `s`; the slot stays registered.
    pub(super) fn clear_slot(&mut self, s: u32) -> u64 {
        let n = match self.slots.get_mut(s as usize) {
            Some(slot) => {
                slot.table.clear();
                slot.alias = FxHashMap::default();
                slot.alias_at = FxHashMap::default();
                slot.alias_more = FxHashMap::default();
                std::mem::replace(&mut slot.count, 0)
            }
            None => return 0,
        };
        if n == 0 {
            return 0;
        }
        if !self.extra_refs.is_empty() {
            self.extra_refs.retain(|&(_, x), _| x != s);
        }
        for id in 1..self.segs.len() as u32 {
            let held = self.seg(id).is_some_and(|g| g.parent != FREE && g.has(s));
            if held {
                if let Some(g) = self.seg_mut(id) {
                    g.clear(s);
                }
                self.prune(id);
            }
        }
        n
    }

    /// Drop one holder and its blocks (and its reservation, capacity and
    /// store order); returns blocks dropped.
    pub(crate) fn remove_holder(&mut self, holder: Holder) -> u64 {
        self.reserved.remove(&holder);
        self.capacity.remove(&holder);
        self.bounded.remove(&holder);
        match self.slot_of.get(&holder).copied() {
            Some(s) => {
                let n = self.clear_slot(s);
                self.release_slot(s);
                n
            }
            None => 0,
        }
    }

    /// Drop every tier of one target.
    pub(crate) fn remove_rank(&mut self, worker: WorkerRank) -> u64 {
        Tier::ALL
            .into_iter()
            .map(|tier| self.remove_holder(Holder::new(worker, tier)))
            .sum()
    }

    pub(crate) fn remove_worker(&mut self, worker: WorkerId) -> u64 {
        self.reserved.retain(|r, _| r.target.worker_id != worker);
        self.capacity.retain(|r, _| r.target.worker_id != worker);
        self.bounded.retain(|r, _| r.target.worker_id != worker);
        let mut ranks: Vec<WorkerRank> = self
            .slot_of
            .keys()
            .filter(|r| r.target.worker_id == worker)
            .map(|r| r.target)
            .collect();
        ranks.sort_unstable();
        ranks.dedup();
        ranks.into_iter().map(|r| self.remove_rank(r)).sum()
    }
}
