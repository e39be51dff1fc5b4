//! The tree of segments: the slab that owns them, the links between a
//! parent and its children, and the freeing of what no one holds.
//!
//! Why this exists: every operation moves through the tree the same way
//! (a segment by id, the child whose first local hash is the next one),
//! and every structural change must keep the links consistent. Invariants
//! kept here: segment ids index a slab whose free entries (`parent ==
//! FREE`) form a LIFO list from `free_head`; id 0 is the always-empty
//! root; each live segment but the root is in its parent's doubly linked
//! children list from `first` (counted in `kids`) and in the tree-wide
//! `edges` table under (parent id, first local hash); a childless segment
//! holds all its positions, and a segment with none held and no children
//! is freed (`prune`).

use super::segment::Seg;
use super::{FREE, IndexCore, NIL, Pos, ROOT, edge_hash, pos, pos_abs, pos_seg};
use crate::types::{EngineHash, LocalHash};

impl IndexCore {
    #[inline(always)]
    pub(super) fn seg(&self, id: u32) -> Option<&Seg> {
        self.segs.get(id as usize)
    }

    #[inline(always)]
    pub(super) fn seg_mut(&mut self, id: u32) -> Option<&mut Seg> {
        self.segs.get_mut(id as usize)
    }

    pub(super) fn alloc(&mut self, seg: Seg) -> u32 {
        match self.free_head {
            NIL => {
                self.segs.push(seg);
                (self.segs.len() - 1) as u32
            }
            id => {
                let next = self.seg(id).map_or(NIL, |s| s.first);
                self.free_head = next;
                self.free_len -= 1;
                if let Some(s) = self.seg_mut(id) {
                    *s = seg;
                }
                id
            }
        }
    }

    /// The local hash at `pairs[0]` of `id` (its edge key).
    pub(super) fn head_local(&self, id: u32) -> LocalHash {
        self.seg(id)
            .and_then(|s| s.pairs.first())
            .map_or(0, |p| p.1)
    }

    /// The child segment of `parent` whose first local hash is `local`.
    #[inline(always)]
    pub(super) fn child(&self, parent: u32, local: LocalHash) -> u32 {
        let Some(p) = self.seg(parent) else {
            return NIL;
        };
        if p.kids == 0 {
            return NIL;
        }
        if let Some(c) = self.seg(p.first)
            && c.parent == parent
            && c.pairs.first().is_some_and(|x| x.1 == local)
        {
            return p.first;
        }
        if p.kids == 1 {
            return NIL;
        }
        self.edges
            .find(edge_hash(parent, local), |&id| {
                self.seg(id).is_some_and(|n| {
                    n.parent == parent && n.pairs.first().is_some_and(|x| x.1 == local)
                })
            })
            .copied()
            .unwrap_or(NIL)
    }

    pub(super) fn insert_edge(&mut self, parent: u32, id: u32) {
        let h = edge_hash(parent, self.head_local(id));
        let segs = &self.segs;
        self.edges.insert_unique(h, id, |&x| {
            segs.get(x as usize).map_or(0, |n| {
                edge_hash(n.parent, n.pairs.first().map_or(0, |p| p.1))
            })
        });
    }

    pub(super) fn remove_edge(&mut self, parent: u32, id: u32) {
        let h = edge_hash(parent, self.head_local(id));
        if let Ok(e) = self.edges.find_entry(h, |&x| x == id) {
            e.remove();
        }
    }

    /// A new child segment of `parent`.
    pub(super) fn new_child(&mut self, parent: u32, seg: Seg) -> u32 {
        let id = self.alloc(seg);
        self.link(parent, id);
        id
    }

    /// Put `id` (whose `parent` is set) into `parent`'s children.
    pub(super) fn link(&mut self, parent: u32, id: u32) {
        self.insert_edge(parent, id);
        let head = self.seg(parent).map_or(NIL, |p| p.first);
        if let Some(c) = self.seg_mut(id) {
            c.prev = NIL;
            c.next = head;
        }
        if let Some(h) = self.seg_mut(head) {
            h.prev = id;
        }
        if let Some(p) = self.seg_mut(parent) {
            p.first = id;
            p.kids += 1;
        }
    }

    /// Take `id` out of `parent`'s children.
    fn unlink(&mut self, parent: u32, id: u32) {
        self.remove_edge(parent, id);
        let (prev, next) = self.seg(id).map_or((NIL, NIL), |c| (c.prev, c.next));
        if let Some(p) = self.seg_mut(prev) {
            p.next = next;
        }
        if let Some(n) = self.seg_mut(next) {
            n.prev = prev;
        }
        if let Some(p) = self.seg_mut(parent) {
            if p.first == id {
                p.first = next;
            }
            p.kids = p.kids.saturating_sub(1);
        }
    }

    /// Restore the invariants of a segment that may have lost holders or
    /// children: a childless segment drops its unheld tail; one left with
    /// no held position is freed, and its parent is checked in turn.
    pub(super) fn prune(&mut self, mut id: u32) {
        while id != ROOT {
            let Some(g) = self.seg_mut(id) else {
                return;
            };
            let len = g.pairs.len() as u32;
            if g.parent == FREE || g.kids != 0 || (g.held == len && len > 0) {
                return;
            }
            if g.held > 0 {
                g.pairs.truncate(g.held as usize);
                if g.pairs.len() * 4 < g.pairs.capacity() {
                    g.pairs.shrink_to_fit();
                }
                self.positions -= u64::from(len - g.held);
                return;
            }
            let parent = g.parent;
            self.unlink(parent, id);
            let next_free = self.free_head;
            if let Some(x) = self.seg_mut(id) {
                let freed = std::mem::replace(x, Seg::empty(FREE));
                x.first = next_free;
                self.pool.give(freed.pairs);
            }
            self.free_head = id;
            self.free_len += 1;
            self.positions -= u64::from(len);
            id = parent;
        }
    }

    /// The creation engine hash at position `p`.
    #[inline(always)]
    pub(super) fn engine_at(&self, p: Pos) -> Option<EngineHash> {
        engine_in(&self.segs, p)
    }
}

/// The creation engine hash at position `p` (a free function, for closures
/// that borrow the segments while a slot is borrowed mutably).
#[inline(always)]
pub(super) fn engine_in(segs: &[Seg], p: Pos) -> Option<EngineHash> {
    let s = segs.get(pos_seg(p) as usize)?;
    let i = pos_abs(p).checked_sub(s.start)? as usize;
    s.pairs.get(i).map(|x| x.0)
}

impl IndexCore {
    /// The local hash at position `p`.
    pub(super) fn local_at(&self, p: Pos) -> Option<LocalHash> {
        let g = self.seg(pos_seg(p))?;
        let i = pos_abs(p).checked_sub(g.start)? as usize;
        g.pairs.get(i).map(|x| x.1)
    }

    /// The position before `p` on its path (`None`: `p` is a root block).
    pub(super) fn parent_of(&self, p: Pos) -> Option<Pos> {
        let (id, abs) = (pos_seg(p), pos_abs(p));
        let seg = self.segs.get(id as usize)?;
        if abs > seg.start {
            return Some(pos(id, abs - 1));
        }
        if seg.parent == ROOT {
            return None;
        }
        let parent = self.segs.get(seg.parent as usize)?;
        let len = u32::try_from(parent.pairs.len()).ok()?;
        Some(pos(seg.parent, parent.start + len.checked_sub(1)?))
    }
}
