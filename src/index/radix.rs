//! The single-writer core of the exact index: a block tree in a slab.
//!
//! Why this exists: it is the fast, compact data structure behind
//! [`super::KvIndex`]; the rules it implements are in the parent module.
//!
//! Layout (invariants):
//! * Nodes live in a chunked slab (fixed 4096-node chunks, so growth never
//!   copies or doubles) and are named by `u32` ids; id 0 is the root. Freed
//!   ids go on a LIFO free list and are reused. A node is live while some
//!   target holds it or it has live children; a node left with neither is
//!   freed at once, and so, in turn, are its ancestors that end up alike.
//! * Children: a node with at most one child keeps it in `first`; once a node
//!   has had two children at once it is a BRANCH, and ALL its children are
//!   in one tree-wide table of node ids hashed by (parent id, local hash) and
//!   compared against the node itself (4 bytes plus a control byte per edge);
//!   `first` is then only a hint. The root is always a branch. A branch with
//!   no children left reverts to a plain node. So chains, the common shape of
//!   a KV tree, are stored and walked without hashing.
//! * Targets (worker, dp_rank) are interned into dense slots; the lowest free
//!   slot is reused. A node records its holders as a bitmask: slots 0..32
//!   inline, higher slots in the `wide` side table (only nodes with such
//!   holders have an entry there, flagged by `WIDE`).
//! * Engine hashes: a node remembers the engine hash it was created with.
//!   Each slot has a compact table of node ids for the engine hashes that
//!   equal their node's creation hash (the usual case), and an `alias` map
//!   for the others. When one slot holds a node through several engine
//!   hashes, the extra references are counted in `extra_refs`; the holder
//!   bit is cleared only with the last one.
//! * A query walks the path once, ANDing the set of still-matching slots
//!   with each node's holders; a slot that drops out scores the depth
//!   reached, and the walk stops as soon as the set is empty.

use super::{ApplyOutcome, IndexError, IndexStats, KvEvent, OverlapScores, WorkerOverlap};
use crate::types::{EngineHash, LocalHash, WorkerId, WorkerRank};
use hashbrown::HashTable;
use rustc_hash::FxHashMap;
use std::collections::BTreeSet;

const NIL: u32 = u32::MAX;
const ROOT: u32 = 0;
type Mask = u32;
const INLINE_SLOTS: u32 = Mask::BITS;
const CHUNK_BITS: u32 = 12;
const CHUNK: usize = 1 << CHUNK_BITS;
const BRANCH: u32 = 1 << 31;
const WIDE: u32 = 1 << 30;
const KIDS: u32 = WIDE - 1;

#[derive(Clone, Copy, Debug)]
struct Node {
    local: LocalHash,
    /// The engine hash the node was created with (see the module docs).
    engine: EngineHash,
    parent: u32,
    /// The only child, or (for a branch) a hint; NIL if none.
    first: u32,
    /// Live children (low bits) | WIDE | BRANCH.
    kids: u32,
    /// Holder bits of slots 0..32.
    mask: Mask,
}

impl Node {
    fn held(&self) -> bool {
        self.mask != 0 || self.kids & WIDE != 0
    }
}

const FREE_NODE: Node = Node {
    local: 0,
    engine: 0,
    parent: NIL,
    first: NIL,
    kids: 0,
    mask: 0,
};

struct Slot {
    worker: WorkerRank,
    live: bool,
    /// Node ids, keyed by their node's creation engine hash.
    table: HashTable<u32>,
    /// Engine hashes that differ from their node's creation hash.
    alias: FxHashMap<EngineHash, u32>,
    count: u64,
}

impl Slot {
    fn new(worker: WorkerRank) -> Self {
        Self {
            worker,
            live: true,
            table: HashTable::new(),
            alias: FxHashMap::default(),
            count: 0,
        }
    }
}

/// The index core. Not synchronized: [`super::KvIndex`] wraps it in a lock.
pub struct IndexCore {
    block_size: u32,
    chunks: Vec<Box<[Node]>>,
    len: u32,
    free: Vec<u32>,
    edges: HashTable<u32>,
    slots: Vec<Slot>,
    slot_of: FxHashMap<WorkerRank, u32>,
    free_slots: BTreeSet<u32>,
    /// Holder bits of slots >= 32, per node: word i covers slots 32+64*i...
    wide: FxHashMap<u32, Vec<u64>>,
    /// (node, slot) -> references beyond the first.
    extra_refs: FxHashMap<(u32, u32), u32>,
    /// Scratch: engine hashes newly added by the event being applied.
    undo: Vec<EngineHash>,
    events_applied: u64,
    events_rejected: u64,
    blocks_skipped: u64,
}

#[inline(always)]
fn mix(a: u64, b: u64) -> u64 {
    let x = (a ^ 0x243F_6A88_85A3_08D3).wrapping_add(b.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let m = u128::from(x) * 0xD6E8_FEB8_6659_FD93_u128;
    (m as u64) ^ ((m >> 64) as u64)
}

#[inline(always)]
fn edge_hash(parent: u32, local: LocalHash) -> u64 {
    mix(local, u64::from(parent))
}

#[inline(always)]
fn engine_hash(e: EngineHash) -> u64 {
    mix(e, 0x5851_F42D_4C95_7F2D)
}

impl IndexCore {
    pub fn new(block_size: u32) -> Self {
        let mut core = Self {
            block_size,
            chunks: Vec::new(),
            len: 0,
            free: Vec::new(),
            edges: HashTable::new(),
            slots: Vec::new(),
            slot_of: FxHashMap::default(),
            free_slots: BTreeSet::new(),
            wide: FxHashMap::default(),
            extra_refs: FxHashMap::default(),
            undo: Vec::new(),
            events_applied: 0,
            events_rejected: 0,
            blocks_skipped: 0,
        };
        let root = core.alloc(Node {
            kids: BRANCH,
            ..FREE_NODE
        });
        debug_assert_eq!(root, ROOT);
        core
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    // ---- slab ------------------------------------------------------------

    #[inline(always)]
    fn node(&self, id: u32) -> Option<&Node> {
        self.chunks
            .get((id >> CHUNK_BITS) as usize)
            .and_then(|c| c.get(id as usize & (CHUNK - 1)))
    }

    #[inline(always)]
    fn node_mut(&mut self, id: u32) -> Option<&mut Node> {
        self.chunks
            .get_mut((id >> CHUNK_BITS) as usize)
            .and_then(|c| c.get_mut(id as usize & (CHUNK - 1)))
    }

    fn alloc(&mut self, node: Node) -> u32 {
        if let Some(id) = self.free.pop() {
            if let Some(n) = self.node_mut(id) {
                *n = node;
            }
            return id;
        }
        let id = self.len;
        if id as usize >= self.chunks.len() * CHUNK {
            self.chunks.push(vec![FREE_NODE; CHUNK].into_boxed_slice());
        }
        self.len += 1;
        if let Some(n) = self.node_mut(id) {
            *n = node;
        }
        id
    }

    // ---- tree primitives -------------------------------------------------

    /// The child of `parent` (whose node is `p`) with `local`, or NIL.
    #[inline(always)]
    fn child_of(&self, parent: u32, p: &Node, local: LocalHash) -> u32 {
        if let Some(c) = self.node(p.first)
            && c.local == local
        {
            return p.first;
        }
        if p.kids & BRANCH == 0 {
            return NIL;
        }
        self.edges
            .find(edge_hash(parent, local), |&id| {
                self.node(id)
                    .is_some_and(|n| n.parent == parent && n.local == local)
            })
            .copied()
            .unwrap_or(NIL)
    }

    #[inline(always)]
    fn child(&self, parent: u32, local: LocalHash) -> u32 {
        match self.node(parent) {
            Some(p) => self.child_of(parent, p, local),
            None => NIL,
        }
    }

    fn insert_edge(&mut self, id: u32) {
        let Some(n) = self.node(id) else {
            return;
        };
        let h = edge_hash(n.parent, n.local);
        let chunks = &self.chunks;
        self.edges.insert_unique(h, id, |&x| {
            chunks
                .get((x >> CHUNK_BITS) as usize)
                .and_then(|c| c.get(x as usize & (CHUNK - 1)))
                .map_or(0, |n| edge_hash(n.parent, n.local))
        });
    }

    /// Create a child of `parent` (known not to have one with `local`).
    fn new_child(&mut self, parent: u32, local: LocalHash, engine: EngineHash) -> u32 {
        let id = self.alloc(Node {
            local,
            engine,
            parent,
            ..FREE_NODE
        });
        let Some(p) = self.node(parent).copied() else {
            return id;
        };
        let kids = p.kids & KIDS;
        let mut branch = p.kids & BRANCH != 0;
        if !branch && kids >= 1 {
            // second child at once: the node becomes a branch
            branch = true;
            if p.first != NIL {
                self.insert_edge(p.first);
            }
        }
        if branch {
            self.insert_edge(id);
        }
        if let Some(pm) = self.node_mut(parent) {
            pm.kids = (pm.kids & !KIDS) | (kids + 1) | if branch { BRANCH } else { 0 };
            pm.first = id;
        }
        id
    }

    /// Free `id` and then its ancestors while each is unheld and childless.
    fn prune(&mut self, mut id: u32) {
        while id != ROOT {
            let Some(&n) = self.node(id) else {
                return;
            };
            if n.held() || n.kids & KIDS != 0 {
                return;
            }
            let Some(p) = self.node(n.parent).copied() else {
                return;
            };
            if p.kids & BRANCH != 0
                && let Ok(e) = self
                    .edges
                    .find_entry(edge_hash(n.parent, n.local), |&x| x == id)
            {
                e.remove();
            }
            if let Some(slot) = self.node_mut(id) {
                *slot = FREE_NODE;
            }
            self.free.push(id);
            let parent = n.parent;
            if let Some(pm) = self.node_mut(parent) {
                let kids = (pm.kids & KIDS).saturating_sub(1);
                let mut flags = pm.kids & !KIDS;
                if kids == 0 && parent != ROOT {
                    flags &= !BRANCH;
                }
                pm.kids = flags | kids;
                if pm.first == id {
                    pm.first = NIL;
                }
            }
            id = parent;
        }
    }

    /// Set `slot`'s holder bit on `id`; returns false if it was already set.
    fn set_bit(&mut self, id: u32, slot: u32) -> bool {
        if slot < INLINE_SLOTS {
            return match self.node_mut(id) {
                Some(n) => {
                    let b: Mask = 1 << slot;
                    let newly = n.mask & b == 0;
                    n.mask |= b;
                    newly
                }
                None => false,
            };
        }
        let word = ((slot - INLINE_SLOTS) / 64) as usize;
        let b = 1u64 << ((slot - INLINE_SLOTS) % 64);
        let words = self.wide.entry(id).or_default();
        if words.len() <= word {
            words.resize(word + 1, 0);
        }
        let newly = words.get_mut(word).is_some_and(|w| {
            let newly = *w & b == 0;
            *w |= b;
            newly
        });
        if let Some(n) = self.node_mut(id) {
            n.kids |= WIDE;
        }
        newly
    }

    fn clear_bit(&mut self, id: u32, slot: u32) {
        if slot < INLINE_SLOTS {
            if let Some(n) = self.node_mut(id) {
                n.mask &= !(1 << slot);
            }
            return;
        }
        let word = ((slot - INLINE_SLOTS) / 64) as usize;
        let b = 1u64 << ((slot - INLINE_SLOTS) % 64);
        let mut empty = false;
        if let Some(words) = self.wide.get_mut(&id) {
            if let Some(w) = words.get_mut(word) {
                *w &= !b;
            }
            empty = words.iter().all(|&w| w == 0);
        }
        if empty {
            self.wide.remove(&id);
            if let Some(n) = self.node_mut(id) {
                n.kids &= !WIDE;
            }
        }
    }

    /// Drop one reference of `slot` to node `id`, pruning if it was the last.
    fn release(&mut self, id: u32, slot: u32) {
        if !self.extra_refs.is_empty()
            && let Some(r) = self.extra_refs.get_mut(&(id, slot))
        {
            *r -= 1;
            if *r == 0 {
                self.extra_refs.remove(&(id, slot));
            }
            return;
        }
        self.clear_bit(id, slot);
        self.prune(id);
    }

    // ---- slots -----------------------------------------------------------

    fn slot_or_create(&mut self, worker: WorkerRank) -> u32 {
        if let Some(&s) = self.slot_of.get(&worker) {
            return s;
        }
        let s = match self.free_slots.pop_first() {
            Some(s) => {
                if let Some(slot) = self.slots.get_mut(s as usize) {
                    *slot = Slot::new(worker);
                }
                s
            }
            None => {
                self.slots.push(Slot::new(worker));
                (self.slots.len() - 1) as u32
            }
        };
        self.slot_of.insert(worker, s);
        s
    }

    fn release_slot(&mut self, s: u32) {
        if let Some(slot) = self.slots.get_mut(s as usize) {
            self.slot_of.remove(&slot.worker);
            *slot = Slot::new(slot.worker);
            slot.live = false;
            self.free_slots.insert(s);
        }
    }

    /// The node slot `s` holds under engine hash `e`.
    fn lookup(&self, s: u32, e: EngineHash) -> Option<u32> {
        let slot = self.slots.get(s as usize)?;
        if let Some(&id) = slot.table.find(engine_hash(e), |&id| {
            self.node(id).is_some_and(|n| n.engine == e)
        }) {
            return Some(id);
        }
        if slot.alias.is_empty() {
            None
        } else {
            slot.alias.get(&e).copied()
        }
    }

    /// Drop every block of slot `s`; the slot stays registered.
    fn clear_slot(&mut self, s: u32) -> u64 {
        let (table, alias, n) = match self.slots.get_mut(s as usize) {
            Some(slot) => (
                std::mem::take(&mut slot.table),
                std::mem::take(&mut slot.alias),
                std::mem::replace(&mut slot.count, 0),
            ),
            None => return 0,
        };
        for id in table.into_iter().chain(alias.into_values()) {
            self.release(id, s);
        }
        n
    }

    fn remove_engine_hash(&mut self, s: u32, e: EngineHash) -> bool {
        let chunks = &self.chunks;
        let Some(slot) = self.slots.get_mut(s as usize) else {
            return false;
        };
        let found = match slot.table.find_entry(engine_hash(e), |&id| {
            chunks
                .get((id >> CHUNK_BITS) as usize)
                .and_then(|c| c.get(id as usize & (CHUNK - 1)))
                .is_some_and(|n| n.engine == e)
        }) {
            Ok(entry) => Some(entry.remove().0),
            Err(_) => {
                if slot.alias.is_empty() {
                    None
                } else {
                    slot.alias.remove(&e)
                }
            }
        };
        match found {
            Some(id) => {
                slot.count -= 1;
                self.release(id, s);
                true
            }
            None => false,
        }
    }

    /// Record that slot `s` holds node `id` under `e` (known not yet held).
    fn hold(&mut self, s: u32, id: u32, e: EngineHash) {
        let canonical = self.node(id).is_some_and(|n| n.engine == e);
        let chunks = &self.chunks;
        let Some(slot) = self.slots.get_mut(s as usize) else {
            return;
        };
        if canonical {
            slot.table.insert_unique(engine_hash(e), id, |&x| {
                chunks
                    .get((x >> CHUNK_BITS) as usize)
                    .and_then(|c| c.get(x as usize & (CHUNK - 1)))
                    .map_or(0, |n| engine_hash(n.engine))
            });
        } else {
            slot.alias.insert(e, id);
        }
        slot.count += 1;
        self.undo.push(e);
        if !self.set_bit(id, s) {
            *self.extra_refs.entry((id, s)).or_insert(0) += 1;
        }
    }

    // ---- events ----------------------------------------------------------

    pub fn apply(
        &mut self,
        worker: WorkerRank,
        event: &KvEvent,
    ) -> Result<ApplyOutcome, IndexError> {
        let res = match event {
            KvEvent::Stored { parent, blocks } => self.store(worker, *parent, blocks),
            KvEvent::Removed { blocks } => Ok(self.remove(worker, blocks)),
            KvEvent::Cleared => Ok(ApplyOutcome {
                applied: self
                    .slot_of
                    .get(&worker)
                    .copied()
                    .map_or(0, |s| self.clear_slot(s)),
                skipped: 0,
            }),
        };
        match &res {
            Ok(o) => {
                self.events_applied += 1;
                self.blocks_skipped += o.skipped;
            }
            Err(_) => self.events_rejected += 1,
        }
        res
    }

    fn remove(&mut self, worker: WorkerRank, blocks: &[EngineHash]) -> ApplyOutcome {
        let Some(&s) = self.slot_of.get(&worker) else {
            return ApplyOutcome {
                applied: 0,
                skipped: blocks.len() as u64,
            };
        };
        let mut out = ApplyOutcome::default();
        for &e in blocks {
            if self.remove_engine_hash(s, e) {
                out.applied += 1;
            } else {
                out.skipped += 1;
            }
        }
        out
    }

    fn store(
        &mut self,
        worker: WorkerRank,
        parent: Option<EngineHash>,
        blocks: &[(EngineHash, LocalHash)],
    ) -> Result<ApplyOutcome, IndexError> {
        let existing = self.slot_of.get(&worker).copied();
        let mut cur = match parent {
            None => ROOT,
            Some(p) => match existing.and_then(|s| self.lookup(s, p)) {
                Some(id) => id,
                None => return Err(IndexError::UnknownParent { worker, parent: p }),
            },
        };
        if blocks.is_empty() {
            return Ok(ApplyOutcome::default());
        }
        let s = self.slot_or_create(worker);
        self.undo.clear();
        let mut out = ApplyOutcome::default();
        // once a block is new to the tree, every later block is too
        let mut fresh = false;
        for &(e, local) in blocks {
            let id = if fresh { NIL } else { self.child(cur, local) };
            let (id, created) = if id == NIL {
                fresh = true;
                (self.new_child(cur, local, e), true)
            } else {
                (id, false)
            };
            let held = if created
                && self
                    .slots
                    .get(s as usize)
                    .is_some_and(|sl| sl.alias.is_empty())
            {
                // only a canonical entry could clash; probe the table alone
                self.table_get(s, e)
            } else {
                self.lookup(s, e)
            };
            match held {
                Some(h) if h == id => out.skipped += 1,
                Some(_) => {
                    self.rollback(s, id, existing.is_none());
                    return Err(IndexError::EngineHashConflict {
                        worker,
                        engine_hash: e,
                    });
                }
                None => {
                    self.hold(s, id, e);
                    out.applied += 1;
                }
            }
            cur = id;
        }
        Ok(out)
    }

    fn table_get(&self, s: u32, e: EngineHash) -> Option<u32> {
        self.slots.get(s as usize).and_then(|slot| {
            slot.table
                .find(engine_hash(e), |&id| {
                    self.node(id).is_some_and(|n| n.engine == e)
                })
                .copied()
        })
    }

    /// Undo the blocks the current store added, prune `pending` (a node the
    /// store may have created without holding it), and drop a slot the store
    /// created.
    fn rollback(&mut self, s: u32, pending: u32, new_slot: bool) {
        self.prune(pending);
        let undo = std::mem::take(&mut self.undo);
        for &e in undo.iter().rev() {
            self.remove_engine_hash(s, e);
        }
        self.undo = undo;
        if new_slot {
            self.release_slot(s);
        }
    }

    pub fn remove_rank(&mut self, worker: WorkerRank) -> u64 {
        match self.slot_of.get(&worker).copied() {
            Some(s) => {
                let n = self.clear_slot(s);
                self.release_slot(s);
                n
            }
            None => 0,
        }
    }

    pub fn remove_worker(&mut self, worker: WorkerId) -> u64 {
        let ranks: Vec<WorkerRank> = self
            .slot_of
            .keys()
            .filter(|r| r.worker_id == worker)
            .copied()
            .collect();
        ranks.into_iter().map(|r| self.remove_rank(r)).sum()
    }

    // ---- queries ---------------------------------------------------------

    fn push_score(&self, out: &mut OverlapScores, s: u32, depth: u32) {
        if let Some(slot) = self.slots.get(s as usize) {
            out.scores.push(WorkerOverlap {
                worker: slot.worker,
                blocks: depth,
                cached_tokens: u64::from(depth) * u64::from(self.block_size),
                worker_blocks: slot.count,
            });
        }
    }

    pub fn find_matches_into(&self, query: &[LocalHash], out: &mut OverlapScores) {
        out.scores.clear();
        if self.slots.len() > INLINE_SLOTS as usize {
            return self.find_matches_wide(query, out);
        }
        let Some((&first, rest)) = query.split_first() else {
            return;
        };
        let mut cur = self.child(ROOT, first);
        let Some(mut n) = self.node(cur) else {
            return;
        };
        let mut active = n.mask;
        let mut depth = 1u32;
        for &local in rest {
            if active == 0 {
                return;
            }
            let next = self.child_of(cur, n, local);
            let Some(nn) = self.node(next) else {
                break;
            };
            DBGC[0].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if next == cur + 1 {
                DBGC[1].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            if next.abs_diff(cur) < 64 {
                DBGC[2].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            if next != n.first {
                DBGC[3].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            let kept = active & nn.mask;
            let mut dropped = active & !kept;
            while dropped != 0 {
                let b = dropped.trailing_zeros();
                dropped &= dropped - 1;
                self.push_score(out, b, depth);
            }
            active = kept;
            cur = next;
            n = nn;
            depth += 1;
        }
        while active != 0 {
            let b = active.trailing_zeros();
            active &= active - 1;
            self.push_score(out, b, depth);
        }
    }

    /// The holder words of node `id`: word 0 is the inline mask (32 bits),
    /// word i > 0 is wide word i - 1.
    fn holder_word(&self, id: u32, n: &Node, i: usize) -> u64 {
        if i == 0 {
            u64::from(n.mask)
        } else if n.kids & WIDE == 0 {
            0
        } else {
            self.wide
                .get(&id)
                .and_then(|w| w.get(i - 1))
                .copied()
                .unwrap_or(0)
        }
    }

    fn slot_of_bit(i: usize, b: u32) -> u32 {
        if i == 0 {
            b
        } else {
            INLINE_SLOTS + (i as u32 - 1) * 64 + b
        }
    }

    /// The same walk as `find_matches_into`, for more than 32 slots.
    fn find_matches_wide(&self, query: &[LocalHash], out: &mut OverlapScores) {
        let words = 1 + (self.slots.len() - INLINE_SLOTS as usize).div_ceil(64);
        let mut active: Vec<u64> = vec![0; words];
        let mut cur = ROOT;
        let mut depth = 0u32;
        for &local in query {
            let next = self.child(cur, local);
            let Some(n) = self.node(next) else {
                break;
            };
            let mut any = false;
            for (i, a) in active.iter_mut().enumerate() {
                let w = self.holder_word(next, n, i);
                if depth == 0 {
                    *a = w;
                } else {
                    let kept = *a & w;
                    let mut dropped = *a & !kept;
                    while dropped != 0 {
                        let b = dropped.trailing_zeros();
                        dropped &= dropped - 1;
                        self.push_score(out, Self::slot_of_bit(i, b), depth);
                    }
                    *a = kept;
                }
                any |= *a != 0;
            }
            cur = next;
            depth += 1;
            if !any {
                return;
            }
        }
        for (i, a) in active.iter().enumerate() {
            let mut a = *a;
            while a != 0 {
                let b = a.trailing_zeros();
                a &= a - 1;
                self.push_score(out, Self::slot_of_bit(i, b), depth);
            }
        }
    }

    pub fn worker_blocks(&self, worker: WorkerRank) -> u64 {
        self.slot_of
            .get(&worker)
            .and_then(|&s| self.slots.get(s as usize))
            .map_or(0, |slot| slot.count)
    }

    pub fn stats(&self) -> IndexStats {
        let mut per_worker: Vec<(WorkerRank, u64)> = self
            .slots
            .iter()
            .filter(|s| s.live && s.count > 0)
            .map(|s| (s.worker, s.count))
            .collect();
        per_worker.sort_unstable();
        IndexStats {
            blocks: per_worker.iter().map(|(_, n)| n).sum(),
            nodes: u64::from(self.len) - 1 - self.free.len() as u64,
            workers: self.slot_of.len() as u64,
            per_worker,
            bytes_used: self.bytes_used(),
            events_applied: self.events_applied,
            events_rejected: self.events_rejected,
            blocks_skipped: self.blocks_skipped,
        }
    }

    /// Heap bytes estimated from capacities (hash tables: buckets times
    /// entry size plus one control byte each).
    pub fn bytes_used(&self) -> u64 {
        fn table_bytes(capacity: usize, entry: usize) -> u64 {
            if capacity == 0 {
                return 0;
            }
            let buckets = (capacity * 8 / 7).next_power_of_two();
            (buckets * (entry + 1) + 16) as u64
        }
        let mut b = (self.chunks.len() * CHUNK * size_of::<Node>()) as u64;
        b += (self.chunks.capacity() * size_of::<Box<[Node]>>()) as u64;
        b += (self.free.capacity() * 4) as u64;
        b += table_bytes(self.edges.capacity(), 4);
        b += (self.slots.capacity() * size_of::<Slot>()) as u64;
        for s in &self.slots {
            b += table_bytes(s.table.capacity(), 4);
            b += table_bytes(s.alias.capacity(), 16);
        }
        b += table_bytes(self.slot_of.capacity(), 24);
        b += table_bytes(self.wide.capacity(), 32);
        b += self
            .wide
            .values()
            .map(|w| (w.capacity() * 8) as u64)
            .sum::<u64>();
        b += table_bytes(self.extra_refs.capacity(), 12);
        b += (self.undo.capacity() * 8) as u64;
        b
    }
}

pub static DBGC: [std::sync::atomic::AtomicU64; 4] =
    [const { std::sync::atomic::AtomicU64::new(0) }; 4];
