//! A target's content read out of the tree (see `index::content`): the
//! positions it holds, with every engine hash it names them by, and the
//! unheld positions that connect them to the root, in depth-first order.
//!
//! Why this exists: snapshots and the index digest need what a target
//! holds independently of how the tree happens to be cut into segments.
//! Read-only; it walks up from each held position, so its cost is the
//! target's positions plus their unheld ancestors.

use rustc_hash::FxHashMap;

use super::{IndexCore, Pos, ROOT, pos_abs, pos_seg};
use crate::index::content::{ContentNode, TargetContent};
use crate::index::tier::Holder;
use crate::types::{EngineHash, LocalHash};

impl IndexCore {
    /// The holders holding blocks, in order (a target's tiers together).
    pub(crate) fn holders(&self) -> Vec<Holder> {
        let mut holders: Vec<Holder> = self
            .slots
            .iter()
            .filter(|s| s.live && s.count > 0)
            .map(|s| s.holder)
            .collect();
        holders.sort_unstable();
        holders
    }

    /// Everything `holder` holds; empty when it holds nothing.
    pub(crate) fn export_holder(&self, holder: Holder) -> TargetContent {
        let Some(slot) = self
            .slot_of
            .get(&holder)
            .and_then(|&s| self.slots.get(s as usize))
        else {
            return TargetContent::default();
        };
        // Every (position, engine hash) reference of the target.
        let refs: Vec<(Pos, EngineHash)> = slot
            .table
            .iter()
            .filter_map(|p| self.engine_at(p).map(|e| (p, e)))
            .chain(slot.alias.iter().map(|(&e, &p)| (p, e)))
            .collect();
        // Held positions and, walking up, the unheld ones above them.
        let mut node_of: FxHashMap<Pos, usize> = FxHashMap::default();
        let mut found: Vec<(Pos, Option<Pos>, LocalHash, Option<EngineHash>)> = Vec::new();
        let mut more: Vec<(Pos, EngineHash)> = Vec::new();
        for &(p, e) in &refs {
            match node_of.get(&p) {
                Some(&i) => match found[i].3 {
                    Some(_) => more.push((p, e)),
                    None => found[i].3 = Some(e),
                },
                None => {
                    node_of.insert(p, found.len());
                    found.push((p, self.parent_of(p), self.local_at(p).unwrap_or(0), Some(e)));
                }
            }
            // Unheld ancestors, up to the first position already found.
            let mut up = found[node_of[&p]].1;
            while let Some(a) = up {
                if node_of.contains_key(&a) {
                    break;
                }
                node_of.insert(a, found.len());
                let parent = self.parent_of(a);
                found.push((a, parent, self.local_at(a).unwrap_or(0), None));
                up = parent;
            }
        }
        // Parents before children, and each segment's run of positions
        // together (a chain is consecutive): by the depth at which the
        // position's segment starts, then by segment, then along it.
        let mut start_depth: FxHashMap<u32, u64> = FxHashMap::default();
        let mut keyed: Vec<((u64, u32, u32), usize)> = found
            .iter()
            .enumerate()
            .map(|(i, &(p, ..))| {
                let seg = pos_seg(p);
                (
                    (self.start_depth(seg, &mut start_depth), seg, pos_abs(p)),
                    i,
                )
            })
            .collect();
        keyed.sort_unstable_by_key(|&(key, _)| key);
        let order = keyed.into_iter().map(|(_, i)| i);
        let mut index_of: FxHashMap<Pos, u32> = FxHashMap::default();
        let mut content = TargetContent::default();
        for i in order {
            let (p, parent, local, engine) = found[i];
            index_of.insert(p, content.nodes.len() as u32);
            content.nodes.push(ContentNode {
                parent: parent.and_then(|a| index_of.get(&a).copied()),
                local,
                engine,
            });
        }
        content.more_engines = more
            .into_iter()
            .filter_map(|(p, e)| index_of.get(&p).map(|&i| (i, e)))
            .collect();
        content.more_engines.sort_unstable();
        content
    }

    /// The depth of segment `id`'s first position (its distance from the
    /// root), memoised in `memo` for every segment on the way up.
    fn start_depth(&self, id: u32, memo: &mut FxHashMap<u32, u64>) -> u64 {
        let mut path = Vec::new();
        let mut at = id;
        let mut depth = loop {
            if let Some(&d) = memo.get(&at) {
                break d;
            }
            match self.segs.get(at as usize) {
                Some(seg) if seg.parent != ROOT && seg.parent != super::NIL => {
                    path.push(at);
                    at = seg.parent;
                }
                _ => {
                    memo.insert(at, 0);
                    break 0;
                }
            }
        };
        // Walk back down: each segment starts where its parent's run ends.
        while let Some(child) = path.pop() {
            let parent = self.segs.get(child as usize).map_or(ROOT, |s| s.parent);
            let parent_len = self
                .segs
                .get(parent as usize)
                .map_or(0, |s| s.pairs.len() as u64);
            depth += parent_len;
            memo.insert(child, depth);
        }
        memo.get(&id).copied().unwrap_or(depth)
    }
}
