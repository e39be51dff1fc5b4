//! Stores: a target's chain of blocks hangs under its parent position,
//! sharing every position that already exists on its path.
//!
//! Why this exists: a store is the event that shapes the tree, and it
//! must stay one pass with one table probe per new block. Invariants kept
//! here: the walk goes from the parent position block by block; a block
//! the target already holds there is a counted no-op (or one more
//! reference, under another engine hash); a run of existing positions it
//! does not hold gets its holder bit, split off the rest of their segment
//! (after that segment's unheld tail and holes are split out); the new
//! rest extends a childless segment the target holds alone (within
//! `abs_limit`) or starts a new segment, which adopts an owned event's
//! array. A conflict (an engine hash already held elsewhere, or repeated)
//! rejects the event: the engine hashes it added are removed again, and
//! only its splits remain, which no answer or stat can see.

use super::segment::Seg;
use super::tree::engine_in;
use super::{Block, IndexCore, Pos, ROOT, engine_hash, pos, pos_abs, pos_seg};
use crate::index::tier::Holder;
use crate::index::{ApplyOutcome, IndexError};
use crate::types::{EngineHash, LocalHash};
use std::borrow::Cow;

/// Where a store's walk stands: after `used` positions of segment `seg`
/// (relative to its start).
#[derive(Clone, Copy)]
struct Cursor {
    seg: u32,
    used: u32,
}

impl IndexCore {
    pub(super) fn store(
        &mut self,
        holder: Holder,
        parent: Option<EngineHash>,
        blocks: Cow<'_, [Block]>,
    ) -> Result<ApplyOutcome, IndexError> {
        let worker = holder.target;
        if blocks.len() >= self.abs_limit as usize {
            return Err(IndexError::TooManyBlocks {
                worker,
                blocks: blocks.len(),
                max: self.abs_limit as usize - 1,
            });
        }
        // a lower tier's blocks may hang under a parent another tier holds
        let parent_pos = match parent {
            None => None,
            Some(p) => match self.lookup_target(holder, p) {
                Some(x) => Some(x),
                None => return Err(IndexError::UnknownParent { worker, parent: p }),
            },
        };
        self.store_at(holder, parent_pos, blocks)
    }

    /// A store under a resolved parent position (`None`: the root).
    pub(super) fn store_at(
        &mut self,
        holder: Holder,
        parent_pos: Option<Pos>,
        blocks: Cow<'_, [Block]>,
    ) -> Result<ApplyOutcome, IndexError> {
        let worker = holder.target;
        let existing = self.slot_of.get(&holder).copied();
        if blocks.is_empty() {
            return Ok(ApplyOutcome::default());
        }
        // Held to capacity before anything changes. Near it, only blocks
        // the target does not hold yet count (one probe each).
        // (a bounded tier makes room after the store instead: `bound.rs`)
        if let Some(&capacity) = self.capacity.get(&holder)
            && !self.bounded.contains_key(&holder)
        {
            let held = existing
                .and_then(|s| self.slots.get(s as usize))
                .map_or(0, |x| x.count);
            let new = if held.saturating_add(blocks.len() as u64) <= capacity {
                0
            } else {
                let fresh =
                    |&&(e, _): &&Block| existing.is_none_or(|s| self.lookup(s, e).is_none());
                blocks.iter().filter(fresh).count() as u64
            };
            if held.saturating_add(new) > capacity {
                return Err(IndexError::OverCapacity {
                    worker,
                    blocks: blocks.len(),
                    held,
                    capacity,
                });
            }
        }
        let s = self.slot_or_create(holder);
        self.undo.clear();
        match self.store_blocks(s, parent_pos, blocks) {
            Ok(out) => Ok(out),
            Err(engine_hash) => {
                self.rollback(s, existing.is_none());
                Err(IndexError::EngineHashConflict {
                    worker,
                    engine_hash,
                })
            }
        }
    }

    /// A store of blocks named only by engine hash (vLLM's host-tier events
    /// before its self-describing events carry no tokens): each is found
    /// where another tier of the same target holds it, and `holder` joins
    /// it there. Blocks it already holds are skipped; blocks no tier of the
    /// target holds are counted `unresolved` and left alone.
    pub(super) fn store_known(
        &mut self,
        holder: Holder,
        blocks: &[EngineHash],
    ) -> Result<ApplyOutcome, IndexError> {
        let mut out = ApplyOutcome::default();
        for &e in blocks {
            let own = self.slot_of.get(&holder).copied();
            if own.is_some_and(|s| self.lookup(s, e).is_some()) {
                out.skipped += 1;
                continue;
            }
            let Some(p) = self.sibling_slots(holder).find_map(|s| self.lookup(s, e)) else {
                out.unresolved += 1;
                continue;
            };
            let Some(local) = self.local_at(p) else {
                out.unresolved += 1;
                continue;
            };
            let parent = self.parent_of(p);
            let one = self.store_at(holder, parent, Cow::Owned(vec![(e, local)]))?;
            out.applied += one.applied;
            out.skipped += one.skipped;
        }
        Ok(out)
    }

    /// Undo the blocks the failed store added (every structural change it
    /// made either goes with them or is a split, which changes nothing a
    /// query or the stats can see), and drop a slot the store created.
    fn rollback(&mut self, s: u32, new_slot: bool) {
        let undo = std::mem::take(&mut self.undo);
        for &e in undo.iter().rev() {
            self.remove_engine_hash(s, e);
        }
        self.undo = undo;
        if new_slot {
            self.release_slot(s);
        }
    }

    /// The store proper, in one pass; on a conflict returns the engine hash
    /// with everything it added recorded in `undo`.
    fn store_blocks(
        &mut self,
        s: u32,
        parent_pos: Option<Pos>,
        blocks: Cow<'_, [Block]>,
    ) -> Result<ApplyOutcome, EngineHash> {
        let mut out = ApplyOutcome::default();
        let mut c = self.start_cursor(parent_pos);
        let mut i = 0usize;
        while i < blocks.len() {
            let Some(&(e, local)) = blocks.get(i) else {
                break;
            };
            let Some(g) = self.seg(c.seg) else {
                break;
            };
            let len = g.pairs.len() as u32;
            let mut next = c;
            let Some(p) = self.step(&mut next, local) else {
                // the rest is new
                if c.used < len {
                    c = Cursor {
                        seg: self.split(c.seg, c.used).0,
                        used: c.used,
                    };
                }
                out.applied += (blocks.len() - i) as u64;
                self.append_new(s, c.seg, blocks, i)?;
                break;
            };
            let id = pos_seg(p);
            let Some(g) = self.seg(id) else {
                break;
            };
            let rel = pos_abs(p) - g.start;
            let glen = g.pairs.len() as u32;
            if rel < g.held && g.has(s) && !g.holes.is_empty() && g.is_hole(pos_abs(p)) {
                // `s` stores again a block it dropped from the middle
                self.refill_hole(s, p, e)?;
                out.applied += 1;
                c = next;
                i += 1;
                continue;
            }
            if rel < g.held && g.has(s) {
                self.store_held(s, p, e, &mut out)?;
                c = next;
                i += 1;
                continue;
            }
            if g.held > 0 && g.held < glen {
                // make the segment uniform first: its unheld tail moves out
                let k = g.held;
                c = self.split_off_unheld_tail(id, k, c);
                continue;
            }
            if !g.holes.is_empty() {
                // another slot's holes become unheld segments first
                c = self.flatten_before(id, c);
                continue;
            }
            // `s` holds no position of this segment: add it to the run of
            // positions the event covers, splitting off the rest
            let run = run_len(g, rel, glen, &blocks, i);
            let run_blocks = blocks.get(i..i + run as usize).unwrap_or(&[]);
            let r = self.hold_run(s, id, rel, run, glen, run_blocks)?;
            out.applied += u64::from(run);
            i += run as usize;
            c = Cursor { seg: r, used: run };
        }
        Ok(out)
    }

    /// Slot `s` stores again, under `e`, position `p` of a segment it
    /// holds, where it had dropped it (a hole): the hole is filled.
    #[inline(always)]
    fn refill_hole(&mut self, s: u32, p: Pos, e: EngineHash) -> Result<(), EngineHash> {
        if self.lookup(s, e).is_some() {
            return Err(e);
        }
        if let Some(g) = self.seg_mut(pos_seg(p)) {
            g.fill_hole(pos_abs(p));
        }
        self.map_insert(s, p, e);
        self.undo.push(e);
        Ok(())
    }

    /// Slot `s` stores `e` at position `p`, which it holds already: a
    /// counted no-op if under `e`, one more reference if under another
    /// engine hash, a conflict if `e` is held elsewhere.
    #[inline(always)]
    fn store_held(
        &mut self,
        s: u32,
        p: Pos,
        e: EngineHash,
        out: &mut ApplyOutcome,
    ) -> Result<(), EngineHash> {
        match self.lookup(s, e) {
            Some(x) if x == p => out.skipped += 1,
            Some(_) => return Err(e),
            None => {
                self.map_insert(s, p, e);
                self.undo.push(e);
                *self.extra_refs.entry((p, s)).or_insert(0) += 1;
                out.applied += 1;
            }
        }
        Ok(())
    }

    /// Split the unheld tail `[k, len)` of segment `id` off, so that the
    /// store meets a uniform segment; returns the cursor `c`, moved along
    /// if it stood in the tail.
    #[inline(always)]
    fn split_off_unheld_tail(&mut self, id: u32, k: u32, c: Cursor) -> Cursor {
        let t = self.split_tail(id, k);
        if c.seg == id && c.used > k {
            return Cursor {
                seg: t,
                used: c.used - k,
            };
        }
        c
    }

    /// Turn another slot's holes in segment `id` into unheld segments
    /// before the store joins it; returns the cursor `c`, renamed if a
    /// split moved the position it stands after.
    #[inline(always)]
    fn flatten_before(&mut self, id: u32, c: Cursor) -> Cursor {
        let at = (c.seg != ROOT && c.used > 0).then(|| {
            let start = self.seg(c.seg).map_or(0, |g| g.start);
            pos(c.seg, start + c.used - 1)
        });
        if let Some(at) = self.flatten(id, at) {
            let start = self.seg(pos_seg(at)).map_or(0, |g| g.start);
            return Cursor {
                seg: pos_seg(at),
                used: pos_abs(at) - start + 1,
            };
        }
        c
    }

    /// Make slot `s` a holder of the `run` positions of segment `id` from
    /// relative index `rel` (of its `glen`), which the event's `run_blocks`
    /// cover: after checking that none of their engine hashes is held or
    /// repeated, the run is split off the rest of the segment, gets the
    /// holder bit, and its blocks are mapped. Returns the run's segment.
    #[inline(always)]
    fn hold_run(
        &mut self,
        s: u32,
        id: u32,
        rel: u32,
        run: u32,
        glen: u32,
        run_blocks: &[Block],
    ) -> Result<u32, EngineHash> {
        self.check_new(s, run_blocks)?;
        let mut r = id;
        if rel > 0 {
            r = self.split(r, rel).1;
        }
        if run < glen - rel {
            r = self.split(r, run).0;
        }
        if let Some(g) = self.seg_mut(r) {
            g.set(s);
        }
        let start = self.seg(r).map_or(0, |g| g.start);
        for (k, &(e, _)) in run_blocks.iter().enumerate() {
            self.map_insert(s, pos(r, start + k as u32), e);
            self.undo.push(e);
        }
        Ok(r)
    }

    /// Err(e) for the first of `blocks` whose engine hash slot `s`
    /// already holds or that repeats an earlier one of them.
    fn check_new(&mut self, s: u32, blocks: &[Block]) -> Result<(), EngineHash> {
        let held = blocks.iter().enumerate().position(|(k, b)| {
            self.prefetch_ahead(s, k, |i| blocks.get(i).map(|b| b.0));
            self.lookup(s, b.0).is_some()
        });
        let dup = self.first_dup(blocks);
        match (held, dup) {
            (Some(i), Some(j)) => Err(blocks.get(i.min(j)).map_or(0, |b| b.0)),
            (Some(i), None) | (None, Some(i)) => Err(blocks.get(i).map_or(0, |b| b.0)),
            (None, None) => Ok(()),
        }
    }

    /// The first index of `blocks` whose engine hash repeats an earlier one.
    fn first_dup(&mut self, blocks: &[Block]) -> Option<usize> {
        if blocks.len() < 2 {
            return None;
        }
        let sorted = &mut self.scratch;
        sorted.clear();
        sorted.extend(blocks.iter().enumerate().map(|(i, b)| (b.0, i)));
        sorted.sort_unstable();
        sorted
            .windows(2)
            .filter_map(|w| match w {
                [a, b] if a.0 == b.0 => Some(b.1),
                _ => None,
            })
            .min()
    }

    /// Hang new `blocks[from..]` under the end of segment `at` for slot
    /// `s`; on a conflict, the blocks added so far are in `undo`. A new
    /// segment takes an owned `blocks` as its array.
    fn append_new(
        &mut self,
        s: u32,
        at: u32,
        blocks: Cow<'_, [Block]>,
        from: usize,
    ) -> Result<(), EngineHash> {
        let Some(&(e0, _)) = blocks.get(from) else {
            return Ok(());
        };
        let appendable = self.appendable(s, at, blocks.len() - from);
        let (id, first_abs) = if appendable {
            let Some(g) = self.segs.get_mut(at as usize) else {
                return Ok(());
            };
            let first_abs = g.end();
            g.pairs.extend_from_slice(blocks.get(from..).unwrap_or(&[]));
            (at, first_abs)
        } else {
            self.new_segment(s, at, blocks, from, e0)?
        };
        self.map_written(s, id, first_abs, appendable)
    }

    /// Whether `n` new blocks of slot `s` extend segment `at` itself: not
    /// the root, childless, held wholly by `s` alone, with room below
    /// `abs_limit`.
    #[inline(always)]
    fn appendable(&self, s: u32, at: u32, n: usize) -> bool {
        let room = self.abs_limit as usize;
        at != ROOT
            && self.seg(at).is_some_and(|g| {
                g.kids == 0
                    && g.only(s)
                    && g.held as usize == g.pairs.len()
                    && g.end() as usize + n <= room
            })
    }

    /// A new child segment of `at` for `blocks[from..]` (an owned array is
    /// adopted, a borrowed one copied into a pooled one), held by slot `s`,
    /// with its first block `e0` mapped (after a probe: no segment is made
    /// for a conflict). Returns the segment and the absolute index of its
    /// second position, the first still to map.
    #[inline(always)]
    fn new_segment(
        &mut self,
        s: u32,
        at: u32,
        blocks: Cow<'_, [Block]>,
        from: usize,
        e0: EngineHash,
    ) -> Result<(u32, u32), EngineHash> {
        // probe the first block before a segment exists for it
        if self.lookup(s, e0).is_some() {
            return Err(e0);
        }
        let pairs = match blocks {
            Cow::Owned(mut v) => {
                v.drain(..from);
                if v.capacity() > 2 * v.len() {
                    v.shrink_to_fit();
                }
                v
            }
            Cow::Borrowed(b) => {
                let b = b.get(from..).unwrap_or(&[]);
                let mut v = self.pool.take(b.len());
                v.extend_from_slice(b);
                v
            }
        };
        let mut g = Seg {
            pairs,
            ..Seg::empty(at)
        };
        g.set(s);
        let id = self.new_child(at, g);
        let abs = self.seg(id).map_or(0, |g| g.start);
        self.map_insert(s, pos(id, abs), e0);
        self.undo.push(e0);
        Ok((id, abs + 1))
    }

    /// Map slot `s`'s blocks written to segment `id` from absolute index
    /// `first_abs` to its end, one table probe each, and count the new
    /// positions (the first one too, for a new segment: not
    /// `appendable`); on a conflict, the positions from it on are dropped
    /// again and the engine hashes mapped so far are recorded in `undo`.
    #[inline(always)]
    fn map_written(
        &mut self,
        s: u32,
        id: u32,
        first_abs: u32,
        appendable: bool,
    ) -> Result<(), EngineHash> {
        // insert each written block's table entry; the first block already
        // held (or repeated within the event) shows up as an occupied
        // entry, and the positions from it on are dropped again
        let segs = &self.segs;
        let Some(g) = segs.get(id as usize) else {
            return Ok(());
        };
        let todo = g.pairs.get((first_abs - g.start) as usize..).unwrap_or(&[]);
        let fresh = todo.len() + usize::from(!appendable);
        let Some(slot) = self.slots.get_mut(s as usize) else {
            return Ok(());
        };
        let has_alias = !slot.alias.is_empty();
        let mut done = todo.len();
        for (k, &(e, _)) in todo.iter().enumerate() {
            slot.table
                .prefetch_ahead(k, |i| todo.get(i).map(|b| engine_hash(b.0)));
            let p = pos(id, first_abs + k as u32);
            let clash = has_alias && slot.alias.contains_key(&e);
            if clash
                || !slot.table.insert_unless(
                    engine_hash(e),
                    p,
                    |x| x != p && engine_in(segs, x) == Some(e),
                    |x| engine_hash(engine_in(segs, x).unwrap_or(0)),
                )
            {
                done = k;
                break;
            }
        }
        slot.count += done as u64;
        let conflict = todo.get(done).map(|b| b.0);
        if conflict.is_some() {
            // nothing after this can fail, so only a conflict needs the
            // blocks it added recorded for the rollback
            self.undo.extend(todo.iter().take(done).map(|b| b.0));
        }
        let drop = (todo.len() - done) as u32;
        let Some(g) = self.segs.get_mut(id as usize) else {
            return Ok(());
        };
        g.held = g.pairs.len() as u32 - drop;
        g.pairs.truncate(g.held as usize);
        self.positions += (fresh - drop as usize) as u64;
        match conflict {
            // the positions written for the blocks not added are dropped
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The existing position a walk reaches from `c` with `local`, advancing
    /// the cursor; None if the path ends (the block would be new).
    #[inline(always)]
    fn step(&self, c: &mut Cursor, local: LocalHash) -> Option<Pos> {
        let g = self.seg(c.seg)?;
        if (c.used as usize) < g.pairs.len() {
            if g.pairs.get(c.used as usize).is_some_and(|x| x.1 == local) {
                let p = pos(c.seg, g.start + c.used);
                c.used += 1;
                return Some(p);
            }
            return None;
        }
        let ch = self.child(c.seg, local);
        let g = self.seg(ch)?;
        c.seg = ch;
        c.used = 1;
        Some(pos(ch, g.start))
    }

    fn start_cursor(&self, parent: Option<Pos>) -> Cursor {
        match parent {
            None => Cursor { seg: ROOT, used: 0 },
            Some(p) => {
                let id = pos_seg(p);
                let start = self.seg(id).map_or(0, |g| g.start);
                Cursor {
                    seg: id,
                    used: pos_abs(p) - start + 1,
                }
            }
        }
    }
}

/// How many of the event's blocks from `blocks[i]` on follow segment
/// `g`'s positions from relative index `rel` (of its `glen`) by local
/// hash; at least 1 (the caller matched `blocks[i]` already).
#[inline(always)]
fn run_len(g: &Seg, rel: u32, glen: u32, blocks: &[Block], i: usize) -> u32 {
    let mut run = 1u32;
    while rel + run < glen
        && let (Some(x), Some(b)) = (
            g.pairs.get((rel + run) as usize),
            blocks.get(i + run as usize),
        )
        && x.1 == b.1
    {
        run += 1;
    }
    run
}
