//! An obviously-correct reference index, the oracle for the fast one.
//!
//! Why this exists: `crates/kvroute-core/tests/it/index_oracle.rs` drives it and [`super::KvIndex`]
//! with the same random operations and requires identical answers. It also
//! runs through the op-log replay (`--impl naive`) as a slow cross-check.
//!
//! How (invariants): per target, a map from engine hash to the block's full
//! path of local hashes (computed when stored), and a count of engine hashes
//! per path. A target holds a path while that count is non-zero. A query
//! checks each query prefix against each target's paths. An event that fails
//! restores a copy of the target's state taken before it, so it is
//! all-or-nothing by construction. Speed is not a goal.

use super::radix::MAX_EVENT_BLOCKS;
use super::{ApplyOutcome, IndexError, IndexStats, KvEvent, OverlapScores, WorkerOverlap};
use crate::types::{EngineHash, LocalHash, WorkerId, WorkerRank};
use std::collections::{BTreeMap, HashMap, HashSet};

#[derive(Clone, Default)]
struct Target {
    engine: HashMap<EngineHash, Vec<LocalHash>>,
    paths: HashMap<Vec<LocalHash>, u32>,
}

/// The reference index (single-threaded, `&mut self`).
#[derive(Default)]
pub struct NaiveIndex {
    block_size: u32,
    targets: BTreeMap<WorkerRank, Target>,
}

impl NaiveIndex {
    /// Cached entries and their digest: one entry per (target, path) held,
    /// at depth `path.len() - 1` (see [`super::content::digest_term`]).
    pub fn digest(&self) -> super::IndexDigest {
        let mut out = super::IndexDigest::default();
        for (&worker, t) in &self.targets {
            for (path, &count) in &t.paths {
                if let (true, Some(&local)) = (count > 0, path.last()) {
                    out.entries += 1;
                    let depth = (path.len() - 1) as u64;
                    out.digest = out
                        .digest
                        .wrapping_add(super::content::digest_term(worker, depth, local));
                }
            }
        }
        out
    }

    pub fn new(block_size: u32) -> Self {
        Self {
            block_size,
            targets: BTreeMap::new(),
        }
    }

    pub fn apply(
        &mut self,
        worker: WorkerRank,
        event: &KvEvent,
    ) -> Result<ApplyOutcome, IndexError> {
        match event {
            KvEvent::Stored { parent, blocks } => {
                let existed = self.targets.contains_key(&worker);
                let before = self.targets.get(&worker).cloned().unwrap_or_default();
                let t = self.targets.entry(worker).or_default();
                let res = Self::store(t, worker, *parent, blocks);
                if res.is_err() || blocks.is_empty() {
                    if existed {
                        self.targets.insert(worker, before);
                    } else {
                        self.targets.remove(&worker);
                    }
                }
                res
            }
            KvEvent::Removed { blocks } => {
                let mut out = ApplyOutcome::default();
                for e in blocks {
                    let gone = self.targets.get_mut(&worker).and_then(|t| {
                        let path = t.engine.remove(e)?;
                        if let Some(c) = t.paths.get_mut(&path) {
                            *c -= 1;
                            if *c == 0 {
                                t.paths.remove(&path);
                            }
                        }
                        Some(())
                    });
                    match gone {
                        Some(()) => out.applied += 1,
                        None => out.skipped += 1,
                    }
                }
                Ok(out)
            }
            KvEvent::Cleared => {
                let mut out = ApplyOutcome::default();
                if let Some(t) = self.targets.get_mut(&worker) {
                    out.applied = t.engine.len() as u64;
                    *t = Target::default();
                }
                Ok(out)
            }
        }
    }

    fn store(
        t: &mut Target,
        worker: WorkerRank,
        parent: Option<EngineHash>,
        blocks: &[(EngineHash, LocalHash)],
    ) -> Result<ApplyOutcome, IndexError> {
        if blocks.len() > MAX_EVENT_BLOCKS {
            return Err(IndexError::TooManyBlocks {
                worker,
                blocks: blocks.len(),
                max: MAX_EVENT_BLOCKS,
            });
        }
        let mut path = match parent {
            None => Vec::new(),
            Some(p) => match t.engine.get(&p) {
                Some(path) => path.clone(),
                None => return Err(IndexError::UnknownParent { worker, parent: p }),
            },
        };
        let mut out = ApplyOutcome::default();
        for &(e, local) in blocks {
            path.push(local);
            match t.engine.get(&e) {
                Some(held) if *held == path => out.skipped += 1,
                Some(_) => {
                    return Err(IndexError::EngineHashConflict {
                        worker,
                        engine_hash: e,
                    });
                }
                None => {
                    t.engine.insert(e, path.clone());
                    *t.paths.entry(path.clone()).or_insert(0) += 1;
                    out.applied += 1;
                }
            }
        }
        Ok(out)
    }

    pub fn remove_rank(&mut self, worker: WorkerRank) -> u64 {
        self.targets
            .remove(&worker)
            .map_or(0, |t| t.engine.len() as u64)
    }

    pub fn remove_worker(&mut self, worker: WorkerId) -> u64 {
        let ranks: Vec<WorkerRank> = self
            .targets
            .keys()
            .filter(|r| r.worker_id == worker)
            .copied()
            .collect();
        ranks.into_iter().map(|r| self.remove_rank(r)).sum()
    }

    /// Every target's prefix, sorted by target.
    pub fn find_matches(&self, query: &[LocalHash]) -> OverlapScores {
        let mut scores = Vec::new();
        for (w, t) in &self.targets {
            let mut k = 0;
            while k < query.len() && t.paths.contains_key(&query[..=k]) {
                k += 1;
            }
            if k > 0 {
                scores.push(WorkerOverlap {
                    worker: *w,
                    blocks: k as u32,
                    cached_tokens: k as u64 * u64::from(self.block_size),
                    worker_blocks: t.engine.len() as u64,
                });
            }
        }
        OverlapScores { scores }
    }

    /// Blocks, nodes (distinct prefixes of held paths) and per-target counts;
    /// memory and event counters are left at zero.
    pub fn stats(&self) -> IndexStats {
        let mut prefixes: HashSet<&[LocalHash]> = HashSet::new();
        let mut per_worker = Vec::new();
        for (w, t) in &self.targets {
            for p in t.paths.keys() {
                for k in 1..=p.len() {
                    prefixes.insert(&p[..k]);
                }
            }
            if !t.engine.is_empty() {
                per_worker.push((*w, t.engine.len() as u64));
            }
        }
        IndexStats {
            blocks: per_worker.iter().map(|(_, n)| n).sum(),
            nodes: prefixes.len() as u64,
            workers: per_worker.len() as u64,
            per_worker,
            ..IndexStats::default()
        }
    }
}
