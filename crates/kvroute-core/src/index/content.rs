//! What one target (worker, dp_rank) holds, as plain data: every block it
//! caches with its engine hashes, and the unheld blocks that connect them
//! to the root, in an order where a block's parent comes before it.
//!
//! Why this exists: a snapshot must rebuild the index exactly, engine
//! hashes included (the next event names blocks by them), and whatever
//! the history left behind (blocks held below an evicted parent, several
//! engine hashes for one block). [`TargetContent::events`] turns the
//! content into ordinary events that rebuild it through the index's own
//! code, so a restored index is built by the same rules as a live one;
//! [`digest_term`] defines the index digest that proves two indexes equal.

use xxhash_rust::xxh3::xxh3_64;

use super::KvEvent;
use super::tier::Tier;
use crate::types::{EngineHash, LocalHash, WorkerRank};

/// One block of a target's content.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContentNode {
    /// Index of the parent block in [`TargetContent::nodes`]; `None` at the
    /// root. Always lower than this node's own index.
    pub parent: Option<u32>,
    pub local: LocalHash,
    /// The engine hash the target names this block by; `None` for a block
    /// the target does not hold, kept because held blocks lie below it.
    pub engine: Option<EngineHash>,
}

/// Everything one target holds (see the module docs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TargetContent {
    /// Blocks in depth-first order: a chain is a run of consecutive nodes.
    pub nodes: Vec<ContentNode>,
    /// Engine hashes beyond a held node's first: `(node index, hash)`.
    pub more_engines: Vec<(u32, EngineHash)>,
    /// What the target holds in its tiers below the device, each as its
    /// own content (a tier's own `lower_tiers` are empty). Empty for a
    /// target that holds blocks only on the device.
    pub lower_tiers: Vec<(Tier, TargetContent)>,
}

/// The digest contribution of one cached (target, block) entry: XXH3-64
/// (seed 0) of `worker_id`, `dp_rank`, the block's depth (its position in
/// its sequence, from 0) and its local hash, each a little-endian u64. An
/// index's digest is the wrapping sum over its entries, so it depends on
/// the content only, never on the order it was built in.
pub fn digest_term(target: WorkerRank, depth: u64, local: LocalHash) -> u64 {
    digest_term_in(target, Tier::Device, depth, local)
}

/// [`digest_term`] of an entry in any tier: the tier's index goes in the
/// high half of the `dp_rank` word (0 for the device, so device entries
/// digest as they always did).
pub fn digest_term_in(target: WorkerRank, tier: Tier, depth: u64, local: LocalHash) -> u64 {
    let rank_word = u64::from(target.dp_rank) | ((tier.index() as u64) << 32);
    let mut bytes = [0u8; 32];
    bytes[0..8].copy_from_slice(&target.worker_id.to_le_bytes());
    bytes[8..16].copy_from_slice(&rank_word.to_le_bytes());
    bytes[16..24].copy_from_slice(&depth.to_le_bytes());
    bytes[24..32].copy_from_slice(&local.to_le_bytes());
    xxh3_64(&bytes)
}

/// Cached entries and their digest (see [`digest_term`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexDigest {
    pub entries: u64,
    pub digest: u64,
}

impl IndexDigest {
    pub fn add(&mut self, other: IndexDigest) {
        self.entries += other.entries;
        self.digest = self.digest.wrapping_add(other.digest);
    }
}

impl TargetContent {
    /// Blocks the target holds, every tier.
    pub fn held(&self) -> usize {
        self.nodes.iter().filter(|n| n.engine.is_some()).count()
            + self
                .lower_tiers
                .iter()
                .map(|(_, c)| c.held())
                .sum::<usize>()
    }

    /// The digest of this target's entries, every tier.
    pub fn digest(&self, target: WorkerRank) -> IndexDigest {
        let mut out = self.digest_in(target, Tier::Device);
        for (tier, lower) in &self.lower_tiers {
            out.add(lower.digest_in(target, *tier));
        }
        out
    }

    fn digest_in(&self, target: WorkerRank, tier: Tier) -> IndexDigest {
        let mut depth: Vec<u64> = Vec::with_capacity(self.nodes.len());
        let mut out = IndexDigest::default();
        for node in &self.nodes {
            let d = node
                .parent
                .and_then(|p| depth.get(p as usize))
                .map_or(0, |d| d + 1);
            depth.push(d);
            if node.engine.is_some() {
                out.entries += 1;
                out.digest = out
                    .digest
                    .wrapping_add(digest_term_in(target, tier, d, node.local));
            }
        }
        out
    }

    /// Whether every parent index points before its node, in every tier,
    /// and each lower tier appears once with no tiers of its own.
    pub fn is_well_formed(&self) -> bool {
        let mut seen = [false; super::tier::TIERS];
        let tiers_ok = self.lower_tiers.iter().all(|(tier, c)| {
            let fresh = *tier != Tier::Device && !std::mem::replace(&mut seen[tier.index()], true);
            fresh && c.lower_tiers.is_empty() && c.is_well_formed_tier()
        });
        tiers_ok && self.is_well_formed_tier()
    }

    fn is_well_formed_tier(&self) -> bool {
        let n = self.nodes.len();
        self.nodes
            .iter()
            .enumerate()
            .all(|(i, node)| node.parent.is_none_or(|p| (p as usize) < i))
            && self.more_engines.iter().all(|&(i, _)| {
                self.nodes
                    .get(i as usize)
                    .is_some_and(|n| n.engine.is_some())
                    && (i as usize) < n
            })
    }

    /// Events that rebuild this content for a target holding nothing:
    /// stores of every chain (unheld blocks under engine hashes the target
    /// does not otherwise use), stores of the extra engine hashes, then one
    /// remove of the stand-in hashes, which leaves the unheld blocks unheld.
    /// A store carries at most `max_blocks` blocks (the index's limit).
    pub(crate) fn events(&self, max_blocks: usize) -> Vec<KvEvent> {
        let used: rustc_hash::FxHashSet<EngineHash> = self
            .nodes
            .iter()
            .filter_map(|n| n.engine)
            .chain(self.more_engines.iter().map(|&(_, e)| e))
            .collect();
        let mut next_stand_in = 0x5eed_0f5a_1a5e_0001_u64;
        let mut stand_ins = Vec::new();
        // The engine hash each node is stored under.
        let names: Vec<EngineHash> = self
            .nodes
            .iter()
            .map(|n| {
                n.engine.unwrap_or_else(|| {
                    while used.contains(&next_stand_in) {
                        next_stand_in = next_stand_in.wrapping_add(0x9e37_79b9_7f4a_7c15);
                    }
                    let e = next_stand_in;
                    next_stand_in = next_stand_in.wrapping_add(0x9e37_79b9_7f4a_7c15);
                    stand_ins.push(e);
                    e
                })
            })
            .collect();
        let name_of = |p: Option<u32>| p.and_then(|p| names.get(p as usize).copied());
        let mut events = Vec::new();
        let mut i = 0;
        while i < self.nodes.len() {
            // A chain: each next node's parent is the node before it.
            let start = i;
            let mut blocks = vec![(names[i], self.nodes[i].local)];
            i += 1;
            while i < self.nodes.len()
                && self.nodes[i].parent == Some((i - 1) as u32)
                && blocks.len() < max_blocks
            {
                blocks.push((names[i], self.nodes[i].local));
                i += 1;
            }
            events.push(KvEvent::Stored {
                parent: name_of(self.nodes[start].parent),
                blocks,
            });
        }
        for &(node, engine) in &self.more_engines {
            if let Some(n) = self.nodes.get(node as usize) {
                events.push(KvEvent::Stored {
                    parent: name_of(n.parent),
                    blocks: vec![(engine, n.local)],
                });
            }
        }
        if !stand_ins.is_empty() {
            events.push(KvEvent::Removed { blocks: stand_ins });
        }
        events
    }
}
