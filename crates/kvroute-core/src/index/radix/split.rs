//! Splits and shifts: positions move from one segment to another, and
//! every map that names them follows.
//!
//! Why this exists: a store that diverges mid-segment or adds a holder to
//! part of one, and a remove that isolates a position, need a segment
//! boundary where there was none; a shared tail that loses a holder joins
//! its child. Invariants kept here: a split moves the smaller side
//! (counting children to re-parent) to a new segment; a shift moves the
//! last positions of a segment to the front of its only child. Absolute
//! indices never change, so only the segment id of the moved positions is
//! rewritten: in every holder's table, aliases and extra references, and
//! in the pending positions of the remove being applied. `splits` counts
//! both kinds of move.

use super::segment::Seg;
use super::{INLINE_SLOTS, IndexCore, NIL, Pos, edge_hash, engine_hash, pos, pos_abs, pos_seg};

impl IndexCore {
    /// Split segment `id` before relative index `k` (0 < k < len) and
    /// return (head, tail); one of them is `id`. The side with fewer
    /// positions (plus children to re-parent) moves to a new segment.
    pub(super) fn split(&mut self, id: u32, k: u32) -> (u32, u32) {
        let Some(s) = self.seg(id) else {
            return (NIL, NIL);
        };
        let len = s.pairs.len() as u32;
        if k <= len - k + s.kids {
            (self.split_head(id, k), id)
        } else {
            (id, self.split_tail(id, k))
        }
    }

    /// Split moving the head `[0, k)` to a new segment (returned), which
    /// takes `id`'s place under its parent; `id` becomes its only child.
    fn split_head(&mut self, id: u32, k: u32) -> u32 {
        self.splits += 1;
        let mut head_pairs = self.pool.take(k as usize);
        let Some(s) = self.seg_mut(id) else {
            return NIL;
        };
        head_pairs.extend(s.pairs.drain(..k as usize));
        let tail_holes = s.split_holes(s.start + k);
        let head_holes = std::mem::replace(&mut s.holes, tail_holes);
        let (held, mask, wide) = s.part(s.held.min(k));
        let (t_held, t_mask, t_wide) = s.part(s.held.saturating_sub(k));
        (s.held, s.mask, s.wide) = (t_held, t_mask, t_wide);
        let mut head = Seg {
            pairs: head_pairs,
            start: s.start,
            parent: s.parent,
            first: id,
            prev: s.prev,
            next: s.next,
            kids: 1,
            held,
            mask,
            wide,
            holes: head_holes,
        };
        head.normalize();
        let old_start = s.start;
        s.start += k;
        s.normalize();
        let (parent, prev, next) = (s.parent, s.prev, s.next);
        let h = self.alloc(head);
        // the head takes the segment's place under its parent
        let key = edge_hash(parent, self.head_local(h));
        if let Some(slot) = self.edges.find_mut(key, |&x| x == id) {
            *slot = h;
        }
        if let Some(p) = self.seg_mut(prev) {
            p.next = h;
        }
        if let Some(n) = self.seg_mut(next) {
            n.prev = h;
        }
        if let Some(p) = self.seg_mut(parent)
            && p.first == id
        {
            p.first = h;
        }
        if let Some(s) = self.seg_mut(id) {
            s.parent = h;
            s.prev = NIL;
            s.next = NIL;
        }
        self.insert_edge(h, id);
        self.moved(id, h, old_start, old_start + k);
        h
    }

    /// Split moving the tail `[k, len)` and `id`'s children to a new
    /// segment (returned), `id`'s only child.
    pub(super) fn split_tail(&mut self, id: u32, k: u32) -> u32 {
        self.splits += 1;
        let n = self
            .seg(id)
            .map_or(0, |s| s.pairs.len().saturating_sub(k as usize));
        let mut tail_pairs = self.pool.take(n);
        let Some(s) = self.seg_mut(id) else {
            return NIL;
        };
        tail_pairs.extend(s.pairs.drain(k as usize..));
        let tail_holes = s.split_holes(s.start + k);
        let (held, mask, wide) = s.part(s.held.saturating_sub(k));
        let (h_held, h_mask, h_wide) = s.part(s.held.min(k));
        (s.held, s.mask, s.wide) = (h_held, h_mask, h_wide);
        s.normalize();
        if s.pairs.len() * 4 < s.pairs.capacity() {
            s.pairs.shrink_to_fit();
        }
        let mut tail = Seg {
            pairs: tail_pairs,
            start: s.start + k,
            parent: id,
            first: s.first,
            prev: NIL,
            next: NIL,
            kids: s.kids,
            held,
            mask,
            wide,
            holes: tail_holes,
        };
        tail.normalize();
        let (from, to) = (tail.start, tail.start + tail.pairs.len() as u32);
        s.first = NIL;
        s.kids = 0;
        let t = self.alloc(tail);
        let mut c = self.seg(t).map_or(NIL, |g| g.first);
        while c != NIL {
            self.remove_edge(id, c);
            if let Some(g) = self.seg_mut(c) {
                g.parent = t;
            }
            self.insert_edge(t, c);
            c = self.seg(c).map_or(NIL, |g| g.next);
        }
        self.link(id, t);
        self.moved(id, t, from, to);
        t
    }

    /// Move the last `n` positions of `id` (fully held, more than `n`
    /// positions) to the front of its only child `c`, contiguous with it;
    /// the caller has checked that `c`'s holders are those positions'
    /// holders after the change.
    pub(super) fn shift_into_child(&mut self, id: u32, c: u32, n: u32) {
        self.splits += 1;
        self.remove_edge(id, c);
        let mut moved = std::mem::take(&mut self.shifted);
        moved.clear();
        if let Some(g) = self.seg_mut(id) {
            let keep = g.pairs.len().saturating_sub(n as usize);
            moved.extend(g.pairs.drain(keep..));
            g.held -= moved.len() as u32;
        }
        let n = moved.len() as u32;
        let need = self.seg(c).map_or(0, |k| k.pairs.len()) + moved.len();
        if self.seg(c).is_some_and(|k| k.pairs.capacity() < need) {
            // a bigger array for the child, from the pool when it can,
            // filled in order (the moved positions, then the child's), so
            // that the splice below has nothing left to insert
            let mut bigger = self.pool.take(need.next_power_of_two());
            if let Some(k) = self.seg_mut(c) {
                bigger.append(&mut moved);
                bigger.append(&mut k.pairs);
                std::mem::swap(&mut k.pairs, &mut bigger);
            }
            self.pool.give(bigger);
        }
        if let Some(k) = self.seg_mut(c) {
            k.pairs.splice(0..0, moved.drain(..));
            k.start -= n;
            k.held += n;
            let abs = k.start;
            self.insert_edge(id, c);
            // the moved positions are the ones being unheld, not pending ones
            self.moved_in_maps(id, c, abs, abs + n);
        }
        self.shifted = moved;
    }

    /// The child that the last position `p` of a shared segment joins
    /// when slot `s` drops it: the segment's only child, contiguous with
    /// it and held by exactly the segment's other holders.
    pub(super) fn shift_child(&self, s: u32, p: Pos) -> Option<u32> {
        let g = self.seg(pos_seg(p))?;
        let len = g.pairs.len() as u32;
        if s >= INLINE_SLOTS
            || pos_abs(p) + 1 != g.end()
            || g.held != len
            || len < 2
            || g.kids != 1
            || !g.wide.is_empty()
        {
            return None;
        }
        let others = g.mask & !(1u64 << s);
        let (c, end) = (g.first, g.end());
        self.seg(c)
            .is_some_and(|k| k.start == end && k.held > 0 && k.mask == others && k.wide.is_empty())
            .then_some(c)
    }

    /// Positions `[from, to)` of segment `old` now belong to `new`: update
    /// every holder's maps and the remove's pending positions.
    fn moved(&mut self, old: u32, new: u32, from: u32, to: u32) {
        let from_pending = self.pending_from.min(self.pending.len());
        for p in self.pending.iter_mut().skip(from_pending) {
            if pos_seg(*p) == old && (from..to).contains(&pos_abs(*p)) {
                *p = pos(new, pos_abs(*p));
            }
        }
        self.moved_in_maps(old, new, from, to);
    }

    /// The holders' maps part of `moved`.
    fn moved_in_maps(&mut self, old: u32, new: u32, from: u32, to: u32) {
        let Some(n) = self.segs.get(new as usize) else {
            return;
        };
        let start = n.start;
        let to = to.min(start + n.held);
        let mut next = 0u32;
        while let Some(s) = n.next_holder(next) {
            next = s + 1;
            let Some(slot) = self.slots.get_mut(s as usize) else {
                continue;
            };
            let first = (from - start) as usize;
            for abs in from..to {
                let k = (abs - from) as usize;
                slot.table
                    .prefetch_ahead(k, |i| n.pairs.get(first + i).map(|b| engine_hash(b.0)));
                let Some(&(e, _)) = n.pairs.get(first + k) else {
                    continue;
                };
                let (old_p, new_p) = (pos(old, abs), pos(new, abs));
                slot.table.replace(engine_hash(e), |p| p == old_p, new_p);
                if !slot.alias.is_empty() {
                    slot.rename_alias(old_p, new_p);
                }
                if !self.extra_refs.is_empty()
                    && let Some(r) = self.extra_refs.remove(&(old_p, s))
                {
                    self.extra_refs.insert((new_p, s), r);
                }
            }
        }
    }
}
