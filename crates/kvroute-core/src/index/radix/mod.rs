//! The single-writer core of the exact index: a path-compressed block tree.
//!
//! Why this exists: it is the fast, compact data structure behind
//! [`super::KvIndex`]; the rules it implements are in the parent module.
//! KV trees are mostly long chains (a conversation's turns extend one
//! chain), so runs of blocks are stored as SEGMENTS: a query compares its
//! hashes against a segment's contiguous array (no lookup per block) and
//! does one child lookup per segment.
//!
//! Layout (invariants, checked by `check_invariants`, in `invariants.rs`,
//! after every event of the tests):
//! * A segment is a non-empty run of tree positions (blocks) in path order,
//!   each stored as `(creation engine hash, local hash)`. Positions
//!   `[0, held)` share the segment's holder set, except its `holes`;
//!   positions `[held, len)` are held by no one (they stay only because
//!   deeper positions are held); `held == 0` exactly when the holder set is
//!   empty, and a childless segment has `held == len`. Only the last
//!   position has children (each child segment's first position). Segments live in a slab of `u32` ids
//!   with a LIFO free list; id 0 is the root, an always-empty segment.
//! * A position is named by `(segment id, absolute index)` packed in a u64;
//!   `Seg::start` is the absolute index of `pairs[0]`, so a split renames
//!   only the positions that change segment.
//! * Children: a doubly linked sibling list from `first` (so a split can
//!   re-parent them), plus one tree-wide table of segment ids hashed by
//!   (parent id, first local hash) for lookups; `first` is tried first.
//! * Changes: a store that extends a childless segment held by the storing
//!   target alone appends to it (turn-by-turn chains stay one array); a
//!   store that diverges mid-segment, or adds a target to part of one,
//!   splits it. A remove of the last held position by the only holder just
//!   lowers `held` (and drops the unheld tail when childless); a remove of
//!   an earlier one by the only holder makes a HOLE (runs of absolute
//!   indices in `holes`, no split: LRU evicts the oldest blocks of a chain
//!   while its newer ones stay). A store by that holder fills a hole again;
//!   before another target joins a segment with holes, they are turned
//!   into unheld segments by splits (`flatten`). The last position of a
//!   shared segment joins the front of its only child when that child has
//!   the remaining holders (a run of them, evicted deepest first, in one
//!   move); any other remove isolates the position by splits. A split
//!   moves the smaller side (counting children to re-parent) to a new
//!   segment and rewrites the moved positions in the holders' maps.
//!   Segments are not merged otherwise. A segment left with no held
//!   position and no children is freed, and so, in turn, are its
//!   ancestors alike.
//! * Arrays: a store that starts a new segment with an event handed over
//!   (`apply_owned`) keeps the event's array as the segment's; freed
//!   segments' arrays wait in a bounded `ArrayPool` for the next split,
//!   shift or copied store.
//! * Holders (a tier of a target (worker, dp_rank), see `index::tier`)
//!   are interned into dense slots; the lowest free slot is reused.
//!   `tier_slots` lists each target's slots by tier: a lower tier's store
//!   may hang under a parent another of its target's tiers holds, and the
//!   query follows a target through all its tiers while any lower-tier
//!   slot lives (`lower_slots`); device-only traffic never sees them. Holder sets are bitmasks: slots 0..64 inline in
//!   `mask`, higher slots in a per-segment `wide` vector (empty for most).
//! * Engine hashes: each slot maps engine hash -> position in a table of
//!   positions keyed by the position's creation engine hash (the usual
//!   case; compared through the segment; a [`GroupTable`], whose probes
//!   read one cache line) and an `alias` map for the others.
//!   When one slot holds a position through several engine hashes, the
//!   extra references are counted in `extra_refs`; the holder bit goes only
//!   with the last one. `count` is the slot's number of engine hashes.
//!   `alias_at` / `alias_more` index the aliases by position, so a split
//!   renames exactly the moved entries (no scans), even when every target
//!   has its own engine hashes and aliases are the norm.
//! * A store runs in one pass and probes each new block's table slot once
//!   (the insert finds a block already held); the rare conflict is undone
//!   by removing the engine hashes it added (`undo`), which restores every
//!   observable (splits it made remain; they change no answer or stat).
//!   A remove first takes every block's entry out of the maps (one probe
//!   each), then unholds the positions; splits rename those still pending.
//!   Positions that descend one by one in a segment the slot holds alone
//!   (LRU evicts a chain's tail deepest first) are unheld as one run: one
//!   change of `held`, or one hole run. Both a store and a remove prefetch
//!   the table lines of the block `PREFETCH_AHEAD` places ahead of the one
//!   they probe, so that the cache misses overlap with the probes.
//! * A query walks segment by segment, ANDing the still-matching slots with
//!   each segment's holders and comparing hashes linearly up to the first
//!   hole or `held`.
//!
//! Files, one concept each. The first eight form a chain: each calls only
//! into files listed after it (and into this root: the struct, its
//! constants, position names and hashes), never back.
//! * `events.rs`: the entry point; each event kind to its mechanism, and
//!   the event counts.
//! * `bound.rs`: tiers held to a capacity by evicting the least recently
//!   stored blocks (engines that report no evictions).
//! * `store.rs`: a store's walk, joining existing runs, appending or
//!   starting segments, and the rollback of a conflict.
//! * `remove.rs`: a remove's two passes, unholding (holes, lowered
//!   `held`, shifts, isolating splits), flattening holes, clearing.
//! * `split.rs`: splits and shifts, and renaming the moved positions.
//! * `slots.rs`: targets as slots, reservations, each slot's engine-hash
//!   maps.
//! * `tree.rs`: the segment slab, parent/child links and edges, pruning.
//! * `segment.rs`: one segment, its holder set and its holes.
//! * `query.rs` (the prefix walk), `stats.rs` (counts, bytes) and
//!   `export.rs` (a target's content, for snapshots and the digest) only read.
//! * `invariants.rs` and `tests.rs`, for tests only: the layout checked
//!   from scratch, and the unit tests.
//!
//! [`GroupTable`]: super::group_table::GroupTable

use super::array_pool::ArrayPool;
use super::group_table::CHECK_BITS;
use crate::index::tier::{Holder, TIERS};
use crate::types::{EngineHash, LocalHash, WorkerRank};
use hashbrown::HashTable;
use rustc_hash::FxHashMap;
use std::collections::BTreeSet;

mod bound;
mod events;
mod export;
mod query;
mod remove;
mod segment;
mod slots;
mod split;
mod stats;
mod store;
mod tree;

use segment::Seg;
use slots::Slot;

const NIL: u32 = u32::MAX;
/// `parent` of a free segment.
const FREE: u32 = u32::MAX - 1;
const ROOT: u32 = 0;
const INLINE_SLOTS: u32 = 64;
/// The most blocks capacity reservations make table room for, per target
/// and in all (a registration is untrusted input: one stored block must
/// not be able to claim gigabytes).
pub const MAX_RESERVED_BLOCKS: u64 = 1 << 20;
const MAX_RESERVED_TOTAL: u64 = 1 << 24;
/// Most bytes of freed segment arrays kept for reuse.
const POOL_BYTES: usize = 1 << 18;
/// Absolute indices stay below this, so that a position leaves the group
/// table's `CHECK_BITS` clear: a store that would append past it starts a
/// new segment instead (which starts at 0), and a store of more blocks
/// than [`MAX_EVENT_BLOCKS`] is rejected.
const ABS_LIMIT: u32 = 1 << CHECK_BITS.trailing_zeros();
const _: () = assert!(CHECK_BITS >> 32 == 0 && CHECK_BITS & (ABS_LIMIT as u64 - 1) == 0);
/// Most blocks one stored event may carry.
pub const MAX_EVENT_BLOCKS: usize = ABS_LIMIT as usize - 1;

type Pos = u64;

/// A stored block: (engine hash, local hash).
type Block = (EngineHash, LocalHash);

#[inline(always)]
fn pos(seg: u32, abs: u32) -> Pos {
    debug_assert!(abs < ABS_LIMIT);
    (u64::from(seg) << 32) | u64::from(abs)
}

#[inline(always)]
fn pos_seg(p: Pos) -> u32 {
    (p >> 32) as u32
}

#[inline(always)]
fn pos_abs(p: Pos) -> u32 {
    p as u32
}

/// The index core. Not synchronized: [`super::KvIndex`] wraps it in a lock.
pub struct IndexCore {
    block_size: u32,
    segs: Vec<Seg>,
    free_head: u32,
    free_len: u32,
    /// Live positions (tree nodes).
    positions: u64,
    edges: HashTable<u32>,
    slots: Vec<Slot>,
    slot_of: FxHashMap<Holder, u32>,
    /// Each target's slot per tier (`NIL` where it has none).
    tier_slots: FxHashMap<WorkerRank, [u32; TIERS]>,
    /// Live slots of tiers below the device: while there are none, a
    /// query takes the device-only walk.
    lower_slots: u32,
    free_slots: BTreeSet<u32>,
    /// Blocks each target expects to cache (its KV capacity): its table
    /// is sized for them when it registers (again, if its slot was dropped,
    /// when it next stores), and never grows after (growing reads every key
    /// back through the tree, under the lock).
    reserved: FxHashMap<Holder, u64>,
    /// Most room granted to all slots together, in blocks.
    reserve_budget: u64,
    /// Most engine hashes each target may hold (its declared KV capacity):
    /// an engine cannot cache more, so a store past it is rejected, and one
    /// worker cannot grow the index without bound. Targets not here are
    /// not held to one (the index's own tests and benchmarks).
    capacity: FxHashMap<Holder, u64>,
    /// Tiers below the device that engines fill without reporting
    /// evictions (LMCache): held to their capacity by evicting the least
    /// recently stored blocks (`bound.rs`).
    bounded: FxHashMap<Holder, bound::StoreOrder>,
    /// (position, slot) -> references beyond the first.
    extra_refs: FxHashMap<(Pos, u32), u32>,
    /// Scratch: engine hashes added by the store being applied.
    undo: Vec<EngineHash>,
    /// Scratch: positions the remove being applied still has to unhold
    /// (splits rename them).
    pending: Vec<Pos>,
    /// `pending[pending_from..]` are the ones still to do.
    pending_from: usize,
    /// Scratch: (engine hash, index) pairs, sorted to find repeats.
    scratch: Vec<(EngineHash, usize)>,
    /// Scratch: the positions a shift moves into a child.
    shifted: Vec<Block>,
    /// Freed segment arrays, for the next segments.
    pool: ArrayPool<Block>,
    /// [`ABS_LIMIT`], lowered by tests to reach it.
    abs_limit: u32,
    /// Splits so far (a split moves positions).
    splits: u64,
    events_applied: u64,
    events_rejected: u64,
    blocks_skipped: u64,
    blocks_unresolved: u64,
    /// Blocks bounded tiers evicted to stay within their capacity.
    blocks_evicted: u64,
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
    pub(crate) fn new(block_size: u32) -> Self {
        Self {
            block_size,
            segs: vec![Seg::empty(NIL)],
            free_head: NIL,
            free_len: 0,
            positions: 0,
            edges: HashTable::new(),
            slots: Vec::new(),
            slot_of: FxHashMap::default(),
            tier_slots: FxHashMap::default(),
            lower_slots: 0,
            free_slots: BTreeSet::new(),
            reserved: FxHashMap::default(),
            reserve_budget: MAX_RESERVED_TOTAL,
            capacity: FxHashMap::default(),
            bounded: FxHashMap::default(),
            extra_refs: FxHashMap::default(),
            undo: Vec::new(),
            pending: Vec::new(),
            pending_from: 0,
            scratch: Vec::new(),
            shifted: Vec::new(),
            pool: ArrayPool::new(POOL_BYTES),
            abs_limit: ABS_LIMIT,
            splits: 0,
            events_applied: 0,
            events_rejected: 0,
            blocks_skipped: 0,
            blocks_unresolved: 0,
            blocks_evicted: 0,
        }
    }
}

#[cfg(test)]
mod invariants;
#[cfg(test)]
mod tests;
