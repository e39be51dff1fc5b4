//! One segment: a run of tree positions in path order, the holder set
//! they share, and the holes its only holder left in them.
//!
//! Why this exists: the core's whole layout rests on what one segment
//! promises (module docs, first point), and every operation asks it the
//! same questions (who holds it, how far, where the holes are). Here are
//! those answers, kept exact:
//! * positions `[0, held)` are held by the holder set except `holes`,
//!   `[held, len)` by no one; `held == 0` exactly when the set is empty;
//! * holder bits of slots 0..64 are in `mask`, higher ones in `wide`,
//!   which never ends with a zero word;
//! * `holes` are sorted, apart runs of absolute indices inside the held
//!   part, the last ending before it ends; only a segment with one holder
//!   (slot < 64) has any.

use super::{Block, INLINE_SLOTS, NIL};

#[derive(Clone, Debug)]
pub(super) struct Seg {
    /// `(creation engine hash, local hash)` per position: the layout of a
    /// stored event's blocks, so a new segment can adopt an event's array.
    pub(super) pairs: Vec<Block>,
    /// Absolute index of `pairs[0]`.
    pub(super) start: u32,
    /// Parent segment (NIL for the root, FREE for a free segment; then
    /// `first` links the free list).
    pub(super) parent: u32,
    /// Head of the children list (NIL if none); for a free segment, the
    /// next free segment.
    pub(super) first: u32,
    /// Sibling links in the parent's children list.
    pub(super) prev: u32,
    pub(super) next: u32,
    /// Live children.
    pub(super) kids: u32,
    /// Positions `[0, held)` are held by the holder set (except `holes`),
    /// the rest by no one (0 exactly when the holder set is empty).
    pub(super) held: u32,
    /// Holder bits of slots 0..64.
    pub(super) mask: u64,
    /// Holder bits of slots 64.., word i covering 64 + 64 * i...
    pub(super) wide: Vec<u64>,
    /// Runs `[a, b)` of absolute indices inside `[start, start + held)`
    /// that the holder dropped (sorted, apart, the last ending before
    /// `start + held`); only a segment with one holder (slot < 64) has any.
    pub(super) holes: Vec<[u32; 2]>,
}

impl Seg {
    pub(super) fn empty(parent: u32) -> Self {
        Self {
            pairs: Vec::new(),
            start: 0,
            parent,
            first: NIL,
            prev: NIL,
            next: NIL,
            kids: 0,
            held: 0,
            mask: 0,
            wide: Vec::new(),
            holes: Vec::new(),
        }
    }

    /// Positions from the start held by the whole holder set: up to the
    /// first hole, else `held`.
    #[inline(always)]
    pub(super) fn held_run(&self) -> u32 {
        self.holes.first().map_or(self.held, |r| r[0] - self.start)
    }

    pub(super) fn is_hole(&self, abs: u32) -> bool {
        let i = self.holes.partition_point(|r| r[1] <= abs);
        self.holes.get(i).is_some_and(|r| r[0] <= abs)
    }

    /// The holder dropped positions `[a, b)`, held and before the last
    /// held one.
    pub(super) fn add_holes(&mut self, a: u32, b: u32) {
        // runs touching `[a, b)` (at most one on each side) merge with it
        let i = self.holes.partition_point(|r| r[1] < a);
        let (mut lo, mut hi, mut j) = (a, b, i);
        while let Some(r) = self.holes.get(j)
            && r[0] <= hi
        {
            lo = lo.min(r[0]);
            hi = hi.max(r[1]);
            j += 1;
        }
        self.holes.splice(i..j, [[lo, hi]]);
    }

    /// The holder holds hole position `abs` again.
    pub(super) fn fill_hole(&mut self, abs: u32) {
        let i = self.holes.partition_point(|r| r[1] <= abs);
        let Some(r) = self.holes.get_mut(i) else {
            return;
        };
        let [a, b] = *r;
        if abs < a {
            return;
        }
        match (a == abs, b == abs + 1) {
            (true, true) => {
                self.holes.remove(i);
            }
            (true, false) => r[0] = abs + 1,
            (false, true) => r[1] = abs,
            (false, false) => {
                r[1] = abs;
                self.holes.insert(i + 1, [abs + 1, b]);
            }
        }
    }

    /// Restore the holes invariant after `held` went down: a run that now
    /// ends the held part becomes unheld tail; nothing held, no holders.
    pub(super) fn normalize(&mut self) {
        while let Some(&[a, b]) = self.holes.last()
            && b >= self.start + self.held
        {
            self.held = self.held.min(a - self.start);
            self.holes.pop();
        }
        if self.held == 0 {
            self.mask = 0;
            self.wide = Vec::new();
            self.holes = Vec::new();
        }
    }

    /// Split the holes at absolute index `at`: those from `at` on are
    /// returned, the rest stay.
    pub(super) fn split_holes(&mut self, at: u32) -> Vec<[u32; 2]> {
        if self.holes.is_empty() {
            return Vec::new();
        }
        let i = self.holes.partition_point(|r| r[1] <= at);
        let mut tail = self.holes.split_off(i);
        if let Some(r) = tail.first_mut()
            && r[0] < at
        {
            self.holes.push([r[0], at]);
            r[0] = at;
        }
        tail
    }

    pub(super) fn has(&self, s: u32) -> bool {
        if s < INLINE_SLOTS {
            self.mask & (1 << s) != 0
        } else {
            let i = ((s - INLINE_SLOTS) / 64) as usize;
            self.wide
                .get(i)
                .is_some_and(|w| w & (1 << ((s - INLINE_SLOTS) % 64)) != 0)
        }
    }

    /// Add holder `s` (to every position, if the segment was unheld).
    pub(super) fn set(&mut self, s: u32) {
        if self.held == 0 {
            self.held = self.pairs.len() as u32;
        }
        if s < INLINE_SLOTS {
            self.mask |= 1 << s;
        } else {
            let i = ((s - INLINE_SLOTS) / 64) as usize;
            if self.wide.len() <= i {
                self.wide.resize(i + 1, 0);
            }
            if let Some(w) = self.wide.get_mut(i) {
                *w |= 1 << ((s - INLINE_SLOTS) % 64);
            }
        }
    }

    pub(super) fn clear(&mut self, s: u32) {
        if s < INLINE_SLOTS {
            self.mask &= !(1 << s);
        } else {
            let i = ((s - INLINE_SLOTS) / 64) as usize;
            if let Some(w) = self.wide.get_mut(i) {
                *w &= !(1 << ((s - INLINE_SLOTS) % 64));
            }
            while self.wide.last() == Some(&0) {
                self.wide.pop();
            }
            if self.wide.is_empty() {
                self.wide = Vec::new();
            }
        }
        if self.mask == 0 && self.wide.is_empty() {
            self.held = 0;
            self.holes = Vec::new();
        }
    }

    /// Holder bits for a part of this segment holding `held` positions.
    pub(super) fn part(&self, held: u32) -> (u32, u64, Vec<u64>) {
        if held == 0 {
            (0, 0, Vec::new())
        } else {
            (held, self.mask, self.wide.clone())
        }
    }

    /// Held by slot `s` alone.
    pub(super) fn only(&self, s: u32) -> bool {
        s < INLINE_SLOTS && self.mask == 1 << s && self.wide.is_empty() && self.held > 0
    }

    /// The lowest holder slot >= `from`.
    pub(super) fn next_holder(&self, from: u32) -> Option<u32> {
        if from < INLINE_SLOTS {
            let m = self.mask & (u64::MAX << from);
            if m != 0 {
                return Some(m.trailing_zeros());
            }
        }
        let from = from.max(INLINE_SLOTS) - INLINE_SLOTS;
        let first = (from / 64) as usize;
        for (i, &w) in self.wide.iter().enumerate().skip(first) {
            let w = if i == first {
                w & (u64::MAX << (from % 64))
            } else {
                w
            };
            if w != 0 {
                return Some(INLINE_SLOTS + 64 * i as u32 + w.trailing_zeros());
            }
        }
        None
    }

    pub(super) fn end(&self) -> u32 {
        self.start + self.pairs.len() as u32
    }
}
