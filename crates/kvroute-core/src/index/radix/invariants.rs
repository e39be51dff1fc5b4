//! The layout invariants of the module docs, checked from scratch (tests
//! only).
//!
//! Why this exists: every test and the proptest of `tests.rs` call
//! `check_invariants` after each event, so that a change that breaks the
//! layout fails where it happens, not at some later answer. It recomputes
//! everything the core keeps incrementally: positions per segment, links
//! and edges, each slot's maps and counts, and the references behind
//! every held position.

use super::segment::Seg;
use super::slots::Slot;
use super::{FREE, IndexCore, NIL, Pos, ROOT, engine_hash, pos, pos_abs, pos_seg};

impl IndexCore {
    /// Every layout invariant of the module docs.
    pub(super) fn check_invariants(&self) -> Result<(), String> {
        self.check_tree()?;
        for (s, slot) in self.slots.iter().enumerate() {
            self.check_slot(s as u32, slot)?;
        }
        self.check_tiers()?;
        self.check_holders()
    }

    /// `slot_of`, `tier_slots` and `lower_slots` name exactly the live
    /// slots, each under its own holder.
    fn check_tiers(&self) -> Result<(), String> {
        let live: Vec<(u32, &Slot)> = (0u32..)
            .zip(self.slots.iter())
            .filter(|(_, x)| x.live)
            .collect();
        if live.len() != self.slot_of.len() {
            return Err("slot_of does not name every live slot".into());
        }
        let lower = live
            .iter()
            .filter(|(_, x)| x.holder.tier != crate::index::Tier::Device)
            .count();
        if lower != self.lower_slots as usize {
            return Err(format!("lower_slots {} != {lower}", self.lower_slots));
        }
        for &(s, x) in &live {
            let by_tier = self
                .tier_slots
                .get(&x.holder.target)
                .map(|t| t[x.holder.tier.index()]);
            if self.slot_of.get(&x.holder) != Some(&s) || by_tier != Some(s) {
                return Err(format!("slot {s} of {} not mapped", x.holder));
            }
        }
        let named = self
            .tier_slots
            .values()
            .flatten()
            .filter(|&&s| s != NIL)
            .count();
        if named != live.len() {
            return Err("tier_slots names dead slots".into());
        }
        Ok(())
    }

    /// Every live segment and its children list, then the totals kept for
    /// all of them: live positions, and one edge per segment but the root.
    fn check_tree(&self) -> Result<(), String> {
        let mut positions = 0u64;
        let mut live = 0usize;
        for (id, g) in self.segs.iter().enumerate() {
            let id = id as u32;
            if g.parent == FREE {
                continue;
            }
            live += 1;
            let len = g.pairs.len() as u32;
            if id == ROOT {
                if len != 0 {
                    return Err("root has positions".into());
                }
            } else {
                self.check_segment(id, g)?;
            }
            positions += u64::from(len);
            self.check_children(id, g)?;
        }
        if positions != self.positions {
            return Err(format!("positions {} != {positions}", self.positions));
        }
        if self.edges.len() + 1 != live {
            return Err(format!("{} edges for {live} segments", self.edges.len()));
        }
        Ok(())
    }

    /// A segment other than the root: not empty, its held part and holder
    /// bits agree, a childless one holds all its positions, its hole runs
    /// are well formed, and its parent's lookup finds it.
    fn check_segment(&self, id: u32, g: &Seg) -> Result<(), String> {
        let len = g.pairs.len() as u32;
        if len == 0 {
            return Err(format!("seg {id} empty"));
        }
        if g.held > len {
            return Err(format!("seg {id} held > len"));
        }
        if (g.held == 0) != (g.mask == 0 && g.wide.is_empty()) {
            return Err(format!("seg {id} held/mask mismatch"));
        }
        if g.wide.last() == Some(&0) {
            return Err(format!("seg {id} wide not trimmed"));
        }
        if g.kids == 0 && g.held != len {
            return Err(format!("seg {id} childless with unheld tail"));
        }
        check_holes(id, g)?;
        if self.child(g.parent, self.head_local(id)) != id {
            return Err(format!("seg {id} not found under its parent"));
        }
        Ok(())
    }

    /// Segment `id`'s children list: each child names `id` as its parent
    /// and the previous one as `prev`, and `kids` counts them.
    fn check_children(&self, id: u32, g: &Seg) -> Result<(), String> {
        let (mut n, mut c, mut prev) = (0u32, g.first, NIL);
        while c != NIL {
            let k = self.seg(c).ok_or("dangling child")?;
            if k.parent != id || k.prev != prev {
                return Err(format!("seg {id}: bad child link {c}"));
            }
            n += 1;
            prev = c;
            c = k.next;
        }
        if n != g.kids {
            return Err(format!("seg {id}: kids {} but {n} linked", g.kids));
        }
        Ok(())
    }

    /// Slot `s`'s maps: its table's layout; every entry at a position it
    /// holds, a table entry found again by lookup, an alias not the
    /// position's creation hash; the aliases' reverse; `count` entries.
    fn check_slot(&self, s: u32, slot: &Slot) -> Result<(), String> {
        slot.table
            .check(|p| engine_hash(self.engine_at(p).unwrap_or(0)))?;
        let mut n = 0u64;
        let held_at = |p: Pos| -> Result<(), String> {
            let g = self.seg(pos_seg(p)).ok_or("entry to no segment")?;
            let i = pos_abs(p)
                .checked_sub(g.start)
                .ok_or("entry before segment")?;
            if g.parent == FREE || i >= g.held || !g.has(s) || g.is_hole(pos_abs(p)) {
                return Err(format!("slot {s}: entry at unheld position {p:x}"));
            }
            Ok(())
        };
        for p in slot.table.iter() {
            held_at(p)?;
            let e = self.engine_at(p).ok_or("no engine")?;
            if self.lookup(s, e) != Some(p) {
                return Err(format!("slot {s}: entry {e} not found by lookup"));
            }
            n += 1;
        }
        for (&e, &p) in &slot.alias {
            held_at(p)?;
            if self.engine_at(p) == Some(e) {
                return Err(format!("slot {s}: canonical hash {e} in alias"));
            }
            n += 1;
        }
        check_reverse_aliases(s, slot)?;
        if n != slot.count {
            return Err(format!("slot {s}: count {} but {n} entries", slot.count));
        }
        Ok(())
    }

    /// Every held position (but a hole) is referenced by each holder's
    /// maps: once, plus its extra references.
    fn check_holders(&self) -> Result<(), String> {
        for (id, g) in self.segs.iter().enumerate() {
            if g.parent == FREE {
                continue;
            }
            let mut next = 0;
            while let Some(s) = g.next_holder(next) {
                next = s + 1;
                let slot = self.slots.get(s as usize).ok_or("holder slot")?;
                for abs in (g.start..g.start + g.held).filter(|&a| !g.is_hole(a)) {
                    let p = pos(id as u32, abs);
                    let refs = slot.table.iter().filter(|&x| x == p).count()
                        + slot.alias.values().filter(|&&x| x == p).count();
                    let extra = self.extra_refs.get(&(p, s)).copied().unwrap_or(0);
                    if refs == 0 || refs != 1 + extra as usize {
                        return Err(format!("slot {s}: {refs} refs to {p:x}, extra {extra}"));
                    }
                }
            }
        }
        Ok(())
    }
}

/// Segment `id`'s hole runs: only with one holder (slot < 64), sorted
/// and apart, inside the held part and ending before it does.
fn check_holes(id: u32, g: &Seg) -> Result<(), String> {
    if !g.holes.is_empty() && (g.mask.count_ones() != 1 || !g.wide.is_empty()) {
        return Err(format!("seg {id} has holes but not one holder"));
    }
    let mut prev_end = None;
    for r in &g.holes {
        if r[0] >= r[1] || r[0] < g.start || prev_end.is_some_and(|e| r[0] <= e) {
            return Err(format!("seg {id} bad hole run {r:?}"));
        }
        prev_end = Some(r[1]);
    }
    if prev_end.is_some_and(|e| e >= g.start + g.held) {
        return Err(format!("seg {id} hole run ends the held part"));
    }
    Ok(())
}

/// Slot `s`'s `alias_at` / `alias_more` are exactly the reverse of its
/// `alias`: as many entries, and each alias found back through them.
fn check_reverse_aliases(s: u32, slot: &Slot) -> Result<(), String> {
    let rev = slot.alias_at.len() + slot.alias_more.values().map(Vec::len).sum::<usize>();
    if rev != slot.alias.len() {
        return Err(format!(
            "slot {s}: {rev} reverse aliases for {}",
            slot.alias.len()
        ));
    }
    for (&e, &p) in &slot.alias {
        let back = slot.alias_at.get(&p) == Some(&e)
            || slot.alias_more.get(&p).is_some_and(|v| v.contains(&e));
        if !back {
            return Err(format!("slot {s}: alias {e} has no reverse"));
        }
    }
    Ok(())
}
