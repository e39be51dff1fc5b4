//! An obviously-correct reference index, the oracle for the fast one.
//!
//! Why this exists: `crates/kvroute-core/tests/it/index_oracle.rs` drives it and [`super::KvIndex`]
//! with the same random operations and requires identical answers. It also
//! runs through the op-log replay (`--impl naive`) as a slow cross-check.
//!
//! How (invariants): per holder (a tier of a target), a map from engine hash to the block's full
//! path of local hashes (computed when stored), and a count of engine hashes
//! per path. A holder holds a path while that count is non-zero. A query
//! checks each query prefix against each of a target's tiers, and counts
//! the block for the first tier holding it. A store's parent, or a
//! placeholder's block, not held by the tier itself is looked up in the
//! target's tiers, device first. An event that fails
//! restores a copy of the target's state taken before it, so it is
//! all-or-nothing by construction. Speed is not a goal.

use super::radix::MAX_EVENT_BLOCKS;
use super::tier::{Holder, TIERS, Tier, TierBlocks};
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
    targets: BTreeMap<Holder, Target>,
}

impl NaiveIndex {
    /// Cached entries and their digest: one entry per (target, path) held,
    /// at depth `path.len() - 1` (see [`super::content::digest_term`]).
    pub fn digest(&self) -> super::IndexDigest {
        let mut out = super::IndexDigest::default();
        for (&holder, t) in &self.targets {
            for (path, &count) in &t.paths {
                if let (true, Some(&local)) = (count > 0, path.last()) {
                    out.entries += 1;
                    let depth = (path.len() - 1) as u64;
                    out.digest = out.digest.wrapping_add(super::content::digest_term_in(
                        holder.target,
                        holder.tier,
                        depth,
                        local,
                    ));
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

    /// An event of `worker`'s device tier.
    pub fn apply(
        &mut self,
        worker: WorkerRank,
        event: &KvEvent,
    ) -> Result<ApplyOutcome, IndexError> {
        self.apply_in(Holder::device(worker), event)
    }

    /// The path of `e` in `holder`'s own tier, else in its target's tiers,
    /// device first.
    fn path_of(&self, holder: Holder, e: EngineHash) -> Option<Vec<LocalHash>> {
        let own = self.targets.get(&holder).and_then(|t| t.engine.get(&e));
        own.or_else(|| {
            Tier::ALL.iter().find_map(|&tier| {
                let h = Holder::new(holder.target, tier);
                self.targets.get(&h).and_then(|t| t.engine.get(&e))
            })
        })
        .cloned()
    }

    pub fn apply_in(
        &mut self,
        worker: Holder,
        event: &KvEvent,
    ) -> Result<ApplyOutcome, IndexError> {
        match event {
            KvEvent::StoredKnown { blocks } => {
                let mut out = ApplyOutcome::default();
                for &e in blocks {
                    if self
                        .targets
                        .get(&worker)
                        .is_some_and(|t| t.engine.contains_key(&e))
                    {
                        out.skipped += 1;
                        continue;
                    }
                    let Some(path) = self.path_of(worker, e) else {
                        out.unresolved += 1;
                        continue;
                    };
                    let t = self.targets.entry(worker).or_default();
                    t.engine.insert(e, path.clone());
                    *t.paths.entry(path).or_insert(0) += 1;
                    out.applied += 1;
                }
                Ok(out)
            }
            KvEvent::Stored { parent, blocks } => {
                let existed = self.targets.contains_key(&worker);
                let before = self.targets.get(&worker).cloned().unwrap_or_default();
                let parent_path = match parent {
                    None => Some(Vec::new()),
                    Some(p) => self.path_of(worker, *p),
                };
                let t = self.targets.entry(worker).or_default();
                let res = Self::store(t, worker.target, *parent, parent_path, blocks);
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
        parent_path: Option<Vec<LocalHash>>,
        blocks: &[(EngineHash, LocalHash)],
    ) -> Result<ApplyOutcome, IndexError> {
        if blocks.len() > MAX_EVENT_BLOCKS {
            return Err(IndexError::TooManyBlocks {
                worker,
                blocks: blocks.len(),
                max: MAX_EVENT_BLOCKS,
            });
        }
        let mut path = match (parent, parent_path) {
            (_, Some(path)) => path,
            (Some(p), None) => return Err(IndexError::UnknownParent { worker, parent: p }),
            (None, None) => Vec::new(),
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

    /// Drop every tier of a target.
    pub fn remove_rank(&mut self, worker: WorkerRank) -> u64 {
        Tier::ALL
            .iter()
            .filter_map(|&tier| self.targets.remove(&Holder::new(worker, tier)))
            .map(|t| t.engine.len() as u64)
            .sum()
    }

    pub fn remove_worker(&mut self, worker: WorkerId) -> u64 {
        let mut ranks: Vec<WorkerRank> = self
            .targets
            .keys()
            .filter(|r| r.target.worker_id == worker)
            .map(|r| r.target)
            .collect();
        ranks.dedup();
        ranks.into_iter().map(|r| self.remove_rank(r)).sum()
    }

    /// Every target's prefix, sorted by target.
    pub fn find_matches(&self, query: &[LocalHash]) -> OverlapScores {
        let mut scores = Vec::new();
        let mut targets: Vec<WorkerRank> = self.targets.keys().map(|h| h.target).collect();
        targets.dedup();
        for w in targets {
            let tiers: Vec<Option<&Target>> = Tier::ALL
                .iter()
                .map(|&tier| self.targets.get(&Holder::new(w, tier)))
                .collect();
            let mut by_tier = TierBlocks::default();
            let mut k = 0;
            while k < query.len() {
                let holding = (0..TIERS)
                    .find(|&i| tiers[i].is_some_and(|t| t.paths.contains_key(&query[..=k])));
                let Some(i) = holding else {
                    break;
                };
                by_tier.add(Tier::ALL[i], 1);
                k += 1;
            }
            if k > 0 {
                scores.push(WorkerOverlap {
                    worker: w,
                    blocks: k as u32,
                    tiers: by_tier,
                    cached_tokens: k as u64 * u64::from(self.block_size),
                    worker_blocks: tiers[0].map_or(0, |t| t.engine.len() as u64),
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
        let mut per_tier = [0u64; TIERS];
        let mut targets = Vec::new();
        for (h, t) in &self.targets {
            for p in t.paths.keys() {
                for k in 1..=p.len() {
                    prefixes.insert(&p[..k]);
                }
            }
            if !t.engine.is_empty() {
                if h.tier == Tier::Device {
                    per_worker.push((h.target, t.engine.len() as u64));
                }
                per_tier[h.tier.index()] += t.engine.len() as u64;
                targets.push(h.target);
            }
        }
        targets.dedup();
        IndexStats {
            blocks: per_tier.iter().sum(),
            nodes: prefixes.len() as u64,
            workers: targets.len() as u64,
            per_worker,
            per_tier,
            ..IndexStats::default()
        }
    }
}
