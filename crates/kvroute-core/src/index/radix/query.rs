//! The query: every target's contiguous prefix of a request's local
//! hashes, in one walk down the tree.
//!
//! Why this exists: it is the routing hot path, run under the read lock
//! for every request. Invariants it relies on: a target holds a
//! segment's positions from its start up to the first hole or `held`, so
//! a walk ANDs the still-matching slots with each segment's holder set,
//! compares the segment's local hashes linearly (4 at a time) and takes
//! one child lookup per segment; a slot that drops out scores the depth
//! reached before that segment. At most 64 slots live in one word
//! (`find_matches_into`); more take the wide walk. While any target holds
//! blocks below the device, the tiered walk follows targets instead of
//! slots.

use super::segment::Seg;
use super::{Block, INLINE_SLOTS, IndexCore, ROOT};
use crate::index::tier::{TIERS, TierBlocks};
use crate::index::{OverlapScores, WorkerOverlap};
use crate::types::{LocalHash, WorkerRank};

impl IndexCore {
    fn push_score(&self, out: &mut OverlapScores, s: u32, depth: u32) {
        if let Some(slot) = self.slots.get(s as usize) {
            out.scores.push(WorkerOverlap {
                worker: slot.holder.target,
                blocks: depth,
                tiers: TierBlocks::device(depth),
                cached_tokens: u64::from(depth) * u64::from(self.block_size),
                worker_blocks: slot.count,
            });
        }
    }

    fn push_word(&self, out: &mut OverlapScores, word: usize, bits: u64, depth: u32) {
        let mut bits = bits;
        while bits != 0 {
            let b = bits.trailing_zeros();
            bits &= bits - 1;
            let s = if word == 0 {
                b
            } else {
                INLINE_SLOTS + 64 * (word as u32 - 1) + b
            };
            self.push_score(out, s, depth);
        }
    }

    pub(crate) fn find_matches_into(&self, query: &[LocalHash], out: &mut OverlapScores) {
        out.scores.clear();
        if self.lower_slots > 0 {
            return self.find_matches_tiered(query, out);
        }
        if self.slots.len() > INLINE_SLOTS as usize {
            return self.find_matches_wide(query, out);
        }
        let mut active = u64::MAX;
        let mut depth = 0usize;
        let mut cur = ROOT;
        while let Some(&q) = query.get(depth) {
            let id = self.child(cur, q);
            let Some(g) = self.seg(id) else {
                break;
            };
            let kept = active & g.mask;
            if depth > 0 {
                self.push_word(out, 0, active & !kept, depth as u32);
            }
            active = kept;
            if active == 0 {
                return;
            }
            let m = g.matched(query.get(depth..).unwrap_or(&[]));
            depth += m;
            if m < g.pairs.len() {
                break;
            }
            cur = id;
        }
        if depth > 0 {
            self.push_word(out, 0, active, depth as u32);
        }
    }

    /// The same walk as `find_matches_into`, for more than 64 slots.
    fn find_matches_wide(&self, query: &[LocalHash], out: &mut OverlapScores) {
        let words = 1 + (self.slots.len() - INLINE_SLOTS as usize).div_ceil(64);
        let mut active: Vec<u64> = vec![u64::MAX; words];
        let mut depth = 0usize;
        let mut cur = ROOT;
        while let Some(&q) = query.get(depth) {
            let id = self.child(cur, q);
            let Some(g) = self.seg(id) else {
                break;
            };
            let mut any = false;
            for (i, a) in active.iter_mut().enumerate() {
                let w = if i == 0 {
                    g.mask
                } else {
                    g.wide.get(i - 1).copied().unwrap_or(0)
                };
                let kept = *a & w;
                if depth > 0 {
                    self.push_word(out, i, *a & !kept, depth as u32);
                }
                *a = kept;
                any |= kept != 0;
            }
            if !any {
                return;
            }
            let m = g.matched(query.get(depth..).unwrap_or(&[]));
            depth += m;
            if m < g.pairs.len() {
                break;
            }
            cur = id;
        }
        if depth > 0 {
            for (i, &a) in active.iter().enumerate() {
                self.push_word(out, i, a, depth as u32);
            }
        }
    }
}

impl IndexCore {
    /// The walk when some target holds blocks below the device: a target
    /// goes on while any of its tiers holds the next segment, and each
    /// segment's blocks count for the fastest of its tiers there (a block
    /// held in two tiers counts once). Within one segment every holder
    /// holds the same positions (holes only exist with a single holder),
    /// so the segment's matched run is each holding target's run.
    fn find_matches_tiered(&self, query: &[LocalHash], out: &mut OverlapScores) {
        let mut alive: Vec<(WorkerRank, [u32; TIERS], TierBlocks)> = self
            .tier_slots
            .iter()
            .map(|(&target, &slots)| (target, slots, TierBlocks::default()))
            .collect();
        let mut depth = 0usize;
        let mut cur = ROOT;
        while let Some(&q) = query.get(depth) {
            let id = self.child(cur, q);
            let Some(g) = self.seg(id) else {
                break;
            };
            let m = g.matched(query.get(depth..).unwrap_or(&[]));
            let mut i = 0;
            while let Some(entry) = alive.get_mut(i) {
                let best = entry.1.iter().position(|&s| s != super::NIL && g.has(s));
                match best {
                    Some(t) => {
                        entry.2.0[t] += m as u32;
                        i += 1;
                    }
                    None => {
                        let (target, slots, tiers) = alive.swap_remove(i);
                        self.push_tiered(out, target, slots, tiers);
                    }
                }
            }
            if alive.is_empty() {
                return;
            }
            depth += m;
            if m < g.pairs.len() {
                break;
            }
            cur = id;
        }
        for (target, slots, tiers) in alive {
            self.push_tiered(out, target, slots, tiers);
        }
    }

    fn push_tiered(
        &self,
        out: &mut OverlapScores,
        target: WorkerRank,
        slots: [u32; TIERS],
        tiers: TierBlocks,
    ) {
        let blocks = tiers.total();
        if blocks == 0 {
            return;
        }
        out.scores.push(WorkerOverlap {
            worker: target,
            blocks,
            tiers,
            cached_tokens: u64::from(blocks) * u64::from(self.block_size),
            // the device slot's count, read through the walk's own slots
            worker_blocks: self.slots.get(slots[0] as usize).map_or(0, |x| x.count),
        });
    }
}

impl Seg {
    /// How many leading positions `rest` of a query matches and the whole
    /// holder set holds (a walk's step through this segment).
    #[inline(always)]
    fn matched(&self, rest: &[LocalHash]) -> usize {
        let n = self.pairs.len().min(rest.len());
        match_len(&self.pairs[..n], &rest[..n]).min(self.held_run() as usize)
    }
}

/// How many leading positions of `pairs` match `query` (equal lengths).
#[inline(always)]
fn match_len(pairs: &[Block], query: &[LocalHash]) -> usize {
    // compare 4 at a time without early exits, then find the first miss
    let mut i = 0;
    let mut pc = pairs.chunks_exact(4);
    let mut qc = query.chunks_exact(4);
    for (p, q) in (&mut pc).zip(&mut qc) {
        if let ([p0, p1, p2, p3], [q0, q1, q2, q3]) = (p, q) {
            let all = (p0.1 == *q0) & (p1.1 == *q1) & (p2.1 == *q2) & (p3.1 == *q3);
            if !all {
                break;
            }
        }
        i += 4;
    }
    while let (Some(p), Some(q)) = (pairs.get(i), query.get(i)) {
        if p.1 != *q {
            break;
        }
        i += 1;
    }
    i
}
