//! The digest kvroute's index would have for this engine's cache.
//!
//! Why: "kvroute holds what the engine holds" should be checked entry for
//! entry, not only counted. kvroute's index digest is a sum over its
//! cached (worker, rank, block) entries of a hash of the block's depth and
//! kvroute's own hash of its tokens (`kvroute_core::index::digest_term`).
//! The mock engine knows both for every block it publishes, so it keeps
//! them per cached block (at most its cache's size) and answers
//! `GET /mock/digest?worker_id=N` with the digest that worker's entries
//! must have in an exact index.

use std::collections::HashMap;

use kvroute_core::{
    hashing::{HashOptions, compute_block_hashes},
    index::{IndexDigest, digest_term},
    types::WorkerRank,
};

use kvroute_core::types::Tier;

use crate::sim::EngineKvEvent;

/// One rank's cached blocks: engine hash -> (depth, kvroute's local hash).
#[derive(Debug, Default)]
pub struct CacheLedger {
    blocks: HashMap<u64, (u64, u64)>,
}

impl CacheLedger {
    /// Follows one step's events, as the index applies them.
    pub fn apply(&mut self, events: &[EngineKvEvent], block_size: usize) {
        for event in events {
            match event {
                // the device's content only (a host tier's is not digested)
                EngineKvEvent::Stored { tier, .. } | EngineKvEvent::Removed { tier, .. }
                    if *tier != Tier::Device => {}
                EngineKvEvent::Stored { parent, blocks, .. } => {
                    // A stored block's parent is held by the sequence that
                    // stores it, so its depth is known here.
                    let first = parent
                        .and_then(|p| self.blocks.get(&p))
                        .map_or(0, |(d, _)| d + 1);
                    for (depth, (hash, tokens)) in (first..).zip(blocks) {
                        let local = compute_block_hashes(
                            tokens,
                            block_size as u32,
                            &HashOptions::plain(),
                            None,
                        )
                        .first()
                        .copied()
                        .unwrap_or_default();
                        self.blocks.insert(*hash, (depth, local));
                    }
                }
                EngineKvEvent::Removed { engine_hashes, .. } => {
                    for hash in engine_hashes {
                        self.blocks.remove(hash);
                    }
                }
            }
        }
    }

    /// The digest of these blocks as `target`'s entries.
    pub fn digest(&self, target: WorkerRank) -> IndexDigest {
        let mut out = IndexDigest::default();
        for &(depth, local) in self.blocks.values() {
            out.entries += 1;
            out.digest = out.digest.wrapping_add(digest_term(target, depth, local));
        }
        out
    }
}
