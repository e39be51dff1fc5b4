//! Targets as dense slots, and each slot's maps from engine hash to
//! position.
//!
//! Why this exists: holder sets are bitmasks of slots, and events name
//! blocks by engine hash, which only the target's own maps turn into
//! positions. Invariants kept here: a registered target has one slot (the
//! lowest free one is reused); its `table` holds its positions keyed by
//! their creation engine hash, `alias` its other engine hashes, and
//! `alias_at` / `alias_more` exactly the reverse of `alias`; `count` is its
//! number of engine hashes, and references to one position beyond the
//! first are counted in the core's `extra_refs`. A table is sized once by a
//! reservation, within one budget for all slots.

use super::NIL;
use super::tree::engine_in;
use super::{IndexCore, MAX_RESERVED_BLOCKS, Pos, engine_hash};
use crate::index::group_table::GroupTable;
use crate::index::tier::{Holder, TIERS, Tier};
use crate::types::EngineHash;
use rustc_hash::FxHashMap;

pub(super) struct Slot {
    pub(super) holder: Holder,
    pub(super) live: bool,
    /// Positions, keyed by their creation engine hash.
    pub(super) table: GroupTable,
    /// Engine hashes that differ from their position's creation hash.
    pub(super) alias: FxHashMap<EngineHash, Pos>,
    /// The reverse of `alias`, so a split renames an aliased position
    /// without a scan: one alias hash per position here, any others in
    /// `alias_more`.
    pub(super) alias_at: FxHashMap<Pos, EngineHash>,
    pub(super) alias_more: FxHashMap<Pos, Vec<EngineHash>>,
    pub(super) count: u64,
    /// Blocks of table room granted by a reservation.
    reserved: u64,
}

impl Slot {
    fn new(holder: Holder) -> Self {
        Self {
            holder,
            live: true,
            table: GroupTable::new(),
            alias: FxHashMap::default(),
            alias_at: FxHashMap::default(),
            alias_more: FxHashMap::default(),
            count: 0,
            reserved: 0,
        }
    }
}

impl Slot {
    fn add_alias(&mut self, e: EngineHash, p: Pos) {
        self.alias.insert(e, p);
        match self.alias_at.entry(p) {
            std::collections::hash_map::Entry::Occupied(_) => {
                self.alias_more.entry(p).or_default().push(e);
            }
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(e);
            }
        }
    }

    pub(super) fn remove_alias(&mut self, e: EngineHash) -> Option<Pos> {
        let p = self.alias.remove(&e)?;
        if self.alias_at.get(&p) == Some(&e) {
            let next = self.alias_more.get_mut(&p).and_then(|v| v.pop());
            match next {
                Some(x) => {
                    self.alias_at.insert(p, x);
                }
                None => {
                    self.alias_at.remove(&p);
                }
            }
        } else if let Some(v) = self.alias_more.get_mut(&p) {
            v.retain(|&x| x != e);
        }
        if self.alias_more.get(&p).is_some_and(|v| v.is_empty()) {
            self.alias_more.remove(&p);
        }
        Some(p)
    }

    /// Position `old` is now named `new`.
    pub(super) fn rename_alias(&mut self, old: Pos, new: Pos) {
        let Some(e) = self.alias_at.remove(&old) else {
            return;
        };
        self.alias_at.insert(new, e);
        self.alias.insert(e, new);
        if let Some(v) = self.alias_more.remove(&old) {
            for &x in &v {
                self.alias.insert(x, new);
            }
            self.alias_more.insert(new, v);
        }
    }
}

impl IndexCore {
    pub(super) fn slot_or_create(&mut self, holder: Holder) -> u32 {
        if let Some(&s) = self.slot_of.get(&holder) {
            return s;
        }
        let s = match self.free_slots.pop_first() {
            Some(s) => {
                if let Some(slot) = self.slots.get_mut(s as usize) {
                    *slot = Slot::new(holder);
                }
                s
            }
            None => {
                self.slots.push(Slot::new(holder));
                (self.slots.len() - 1) as u32
            }
        };
        self.slot_of.insert(holder, s);
        let tiers = self.tier_slots.entry(holder.target).or_insert([NIL; TIERS]);
        tiers[holder.tier.index()] = s;
        if holder.tier != Tier::Device {
            self.lower_slots += 1;
        }
        if let Some(&blocks) = self.reserved.get(&holder) {
            self.reserve_slot(s, blocks);
        }
        s
    }

    /// The slots of `target`'s other tiers, device first (where a store's
    /// parent or a placeholder's block is looked up when the tier's own
    /// slot does not hold it).
    pub(super) fn sibling_slots(&self, holder: Holder) -> impl Iterator<Item = u32> + '_ {
        let own = holder.tier.index();
        self.tier_slots
            .get(&holder.target)
            .into_iter()
            .flat_map(move |t| t.iter().enumerate().filter(move |&(i, _)| i != own))
            .map(|(_, &s)| s)
            .filter(|&s| s != NIL)
    }

    /// The position any tier of `holder`'s target holds under `e`, its own
    /// tier first.
    pub(super) fn lookup_target(&self, holder: Holder, e: EngineHash) -> Option<Pos> {
        let own = self.slot_of.get(&holder).and_then(|&s| self.lookup(s, e));
        own.or_else(|| self.sibling_slots(holder).find_map(|s| self.lookup(s, e)))
    }

    /// Give `holder`'s table room for `blocks` blocks (at most
    /// [`MAX_RESERVED_BLOCKS`]) once it holds anything: now if it already
    /// does, else when its first block is stored (a new slot takes its
    /// reservation from `reserved` as it is made). Not at registration: a
    /// capacity claimed and never used must cost nothing.
    pub(crate) fn reserve(&mut self, holder: impl Into<Holder>, blocks: u64) {
        let holder = holder.into();
        let blocks = blocks.min(MAX_RESERVED_BLOCKS);
        self.reserved.insert(holder, blocks);
        if let Some(&s) = self.slot_of.get(&holder) {
            self.reserve_slot(s, blocks);
        }
    }

    /// Hold `holder` to `blocks` engine hashes (its KV capacity):
    /// stores past it are rejected. Forgotten with the target.
    pub(crate) fn limit_capacity(&mut self, holder: Holder, blocks: u64) {
        self.capacity.insert(holder, blocks);
    }

    fn reserve_slot(&mut self, s: u32, blocks: u64) {
        let others = self.reserved_room() - self.slots.get(s as usize).map_or(0, |x| x.reserved);
        let grant = blocks.min(self.reserve_budget.saturating_sub(others));
        let segs = &self.segs;
        if let Some(slot) = self.slots.get_mut(s as usize)
            && grant > slot.reserved
        {
            slot.table.reserve(grant as usize, |x| {
                engine_hash(engine_in(segs, x).unwrap_or(0))
            });
            slot.reserved = grant;
        }
    }

    /// Room granted to live slots, in blocks (a released slot's is gone
    /// with it).
    pub(super) fn reserved_room(&self) -> u64 {
        self.slots.iter().map(|x| x.reserved).sum()
    }

    pub(super) fn release_slot(&mut self, s: u32) {
        if let Some(slot) = self.slots.get_mut(s as usize)
            && slot.live
        {
            let holder = slot.holder;
            self.slot_of.remove(&holder);
            *slot = Slot::new(holder);
            slot.live = false;
            self.free_slots.insert(s);
            if holder.tier != Tier::Device {
                self.lower_slots -= 1;
            }
            if let Some(tiers) = self.tier_slots.get_mut(&holder.target) {
                tiers[holder.tier.index()] = NIL;
                if tiers.iter().all(|&x| x == NIL) {
                    self.tier_slots.remove(&holder.target);
                }
            }
        }
    }

    /// The position slot `s` holds under engine hash `e`.
    pub(super) fn lookup(&self, s: u32, e: EngineHash) -> Option<Pos> {
        let slot = self.slots.get(s as usize)?;
        if let Some(p) = slot
            .table
            .find(engine_hash(e), |p| self.engine_at(p) == Some(e))
        {
            return Some(p);
        }
        if slot.alias.is_empty() {
            None
        } else {
            slot.alias.get(&e).copied()
        }
    }

    /// Record that slot `s` holds position `p` under `e` (known not yet in
    /// its maps); the caller sets the holder bit or counts the extra ref.
    pub(super) fn map_insert(&mut self, s: u32, p: Pos, e: EngineHash) {
        let canonical = self.engine_at(p) == Some(e);
        let segs = &self.segs;
        let Some(slot) = self.slots.get_mut(s as usize) else {
            return;
        };
        if canonical {
            slot.table.insert_new(engine_hash(e), p, |x| {
                engine_hash(engine_in(segs, x).unwrap_or(0))
            });
        } else {
            slot.add_alias(e, p);
        }
        slot.count += 1;
    }

    /// [`GroupTable::prefetch_ahead`] in slot `s`'s table, for a loop over
    /// the engine hashes `engine_of(0)`, `engine_of(1)`, ...
    #[inline(always)]
    pub(super) fn prefetch_ahead(
        &self,
        s: u32,
        k: usize,
        engine_of: impl Fn(usize) -> Option<EngineHash>,
    ) {
        if let Some(slot) = self.slots.get(s as usize) {
            slot.table
                .prefetch_ahead(k, |i| engine_of(i).map(engine_hash));
        }
    }
}

/// Drop one of slot `s`'s extra references to position `p`: true if it
/// had one (so `s` still holds `p`), false if the reference that went was
/// its last (the caller unholds `p`).
#[inline(always)]
pub(super) fn drop_extra_ref(extra_refs: &mut FxHashMap<(Pos, u32), u32>, p: Pos, s: u32) -> bool {
    if extra_refs.is_empty() {
        return false;
    }
    let Some(r) = extra_refs.get_mut(&(p, s)) else {
        return false;
    };
    *r -= 1;
    if *r == 0 {
        extra_refs.remove(&(p, s));
    }
    true
}
