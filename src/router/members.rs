//! The fleet's members: the worker registry and each model's index,
//! behind the core's `members` lock, and the view of one model a
//! SelectWorker call routes on.
//!
//! Why together: a model's index has the block size of its workers'
//! registration, so both change under one write lock. And why a view:
//! a request is hashed at its model's block size and decided on that
//! model's workers and index; one read of the lock returns the three as
//! they were together, so the hashes and the decision agree, and the call
//! takes the lock once instead of once for each.

use std::{collections::HashMap, sync::Arc};

use kvroute_core::{
    index::{KvIndex, TierBlocks},
    registry::{RegisterOutcome, Registry, RegistryError, RegistryLimits},
    types::{LocalHash, RankMap, WorkerId, WorkerRank, WorkerSnapshot},
};

/// The registry and each model's index (see the module docs).
pub(super) struct Members {
    pub(super) registry: Registry,
    /// One exact index per model (block sizes differ between models).
    indexes: HashMap<String, Arc<KvIndex>>,
}

/// One model as a SelectWorker call sees it: the block size its prompt is
/// hashed at, its workers and its index, read together (see the module
/// docs). Cheap to make: two `Arc`s and a number.
#[derive(Clone)]
pub struct ModelView {
    block_size: u32,
    workers: Arc<[WorkerSnapshot]>,
    index: Option<Arc<KvIndex>>,
}

impl std::fmt::Debug for ModelView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelView")
            .field("block_size", &self.block_size)
            .field("workers", &self.workers.len())
            .field("index", &self.index.is_some())
            .finish()
    }
}

impl ModelView {
    /// The block size the model's requests are hashed at: its workers', or
    /// the configured default when it has none.
    pub(crate) fn block_size(&self) -> u32 {
        self.block_size
    }

    /// The model's worker snapshots (an `Arc` the registry rebuilds only
    /// when a worker of the model changes).
    pub(crate) fn workers(&self) -> &Arc<[WorkerSnapshot]> {
        &self.workers
    }

    /// What the model's index holds of the prompt `hashes`: each rank's
    /// prefix overlap (`find_matches`, one read lock), its split by tier
    /// where some of it is below the device, and each rank's total cached
    /// blocks (one more); all empty when the model has no index.
    pub(super) fn index_overlaps(&self, hashes: &[LocalHash]) -> IndexOverlaps {
        let targets: Vec<WorkerRank> = self
            .workers
            .iter()
            .flat_map(|w| w.ranks().map(|r| WorkerRank::new(w.worker_id, r)))
            .collect();
        let mut overlaps = RankMap::with_capacity_and_hasher(targets.len(), Default::default());
        let mut cached_blocks =
            RankMap::with_capacity_and_hasher(targets.len(), Default::default());
        let mut tiers = RankMap::default();
        if let Some(index) = &self.index {
            for overlap in index.find_matches(hashes).scores {
                overlaps.insert(overlap.worker, overlap.blocks);
                if overlap.tiers.lower() > 0 {
                    tiers.insert(overlap.worker, overlap.tiers);
                }
            }
            let counts = index.worker_blocks_many(&targets);
            cached_blocks.extend(targets.into_iter().zip(counts));
        }
        IndexOverlaps {
            overlaps,
            tiers,
            cached_blocks,
        }
    }
}

/// What [`ModelView::index_overlaps`] finds.
pub(super) struct IndexOverlaps {
    pub(super) overlaps: RankMap<u32>,
    /// Targets holding part of their overlap below the device: its split.
    pub(super) tiers: RankMap<TierBlocks>,
    pub(super) cached_blocks: RankMap<u64>,
}

impl Members {
    pub(super) fn new(limits: RegistryLimits) -> Self {
        Self {
            registry: Registry::with_limits(limits),
            indexes: HashMap::new(),
        }
    }

    /// The view of `model` (see [`ModelView`]); `default_block_size` when
    /// no worker of it is registered.
    pub(super) fn model_view(&self, model: &str, default_block_size: u32) -> ModelView {
        ModelView {
            block_size: self
                .registry
                .model_block_size(model)
                .unwrap_or(default_block_size),
            workers: self.registry.model_snapshots(model),
            index: self.indexes.get(model).cloned(),
        }
    }

    /// The index of a model, if any worker of it ever registered.
    pub(super) fn index_of(&self, model: &str) -> Option<Arc<KvIndex>> {
        self.indexes.get(model).cloned()
    }

    /// Every model's index.
    pub(super) fn indexes(&self) -> Vec<Arc<KvIndex>> {
        self.indexes.values().cloned().collect()
    }

    /// Runs a registration and gives the worker's model an index of its
    /// block size, under the caller's one hold of the write lock.
    pub(super) fn admit(
        &mut self,
        register: impl FnOnce(&mut Registry) -> Result<RegisterOutcome, RegistryError>,
    ) -> Result<RegisterOutcome, RegistryError> {
        let outcome = register(&mut self.registry)?;
        let r = &outcome.record.registration;
        let (model, block_size) = (r.model.clone(), r.block_size);
        let stale = self
            .indexes
            .get(&model)
            .is_none_or(|index| index.block_size() != block_size);
        if stale {
            // A model's block size only changes when its only worker
            // re-registers, whose blocks are dropped anyway.
            self.indexes
                .insert(model, Arc::new(KvIndex::new(block_size)));
        }
        Ok(outcome)
    }

    /// The index a batch validated against registration `generation` of
    /// `worker_id` may write: `None` when the worker has since been
    /// deregistered or re-registered (or moved to another model).
    pub(super) fn current_index(
        &self,
        worker_id: WorkerId,
        generation: u64,
        model: &str,
    ) -> Option<Arc<KvIndex>> {
        let current = self.registry.get(worker_id)?;
        if current.generation != generation || current.registration.model != model {
            return None;
        }
        self.indexes.get(model).cloned()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use kvroute_core::{
        registry::Registration,
        types::{KvEventsMode, WorkerRole},
    };

    fn registration(worker_id: WorkerId, model: &str, block_size: u32) -> Registration {
        Registration {
            tiers: Vec::new(),
            worker_id,
            model: model.into(),
            role: WorkerRole::Aggregated,
            endpoint: String::new(),
            block_size,
            dp_start_rank: 0,
            dp_size: 2,
            total_kv_blocks: 1000,
            max_num_batched_tokens: 8192,
            taints: Vec::new(),
            adapters: Vec::new(),
            loads_adapters: false,
            lease_ttl: None,
            kv_events: KvEventsMode::Exact,
        }
    }

    #[test]
    fn a_model_view_holds_the_block_size_workers_and_index_of_one_read() {
        let mut members = Members::new(RegistryLimits::default());
        let unknown = members.model_view("m", 16);
        assert_eq!(unknown.block_size(), 16, "the default without workers");
        assert!(unknown.workers().is_empty());
        assert!(unknown.index.is_none());

        let now = crate::router::now();
        for (worker_id, model) in [(1, "m"), (2, "m"), (3, "other")] {
            members
                .admit(|r| {
                    r.register(
                        registration(worker_id, model, 32),
                        Duration::from_secs(10),
                        now,
                    )
                })
                .expect("registers");
        }
        let view = members.model_view("m", 16);
        assert_eq!(view.block_size(), 32, "the workers' block size");
        let ids: Vec<WorkerId> = view.workers().iter().map(|w| w.worker_id).collect();
        assert_eq!(ids, [1, 2], "the model's workers only");
        let index = members.index_of("m").expect("an index");
        assert!(view.index.as_ref().is_some_and(|i| Arc::ptr_eq(i, &index)));
        assert_eq!(index.block_size(), 32);

        // An empty index: every rank counted, none overlapping.
        let found = view.index_overlaps(&[7, 8]);
        let (overlaps, cached) = (found.overlaps, found.cached_blocks);
        assert!(overlaps.is_empty());
        assert_eq!(cached.len(), 4, "two workers of two ranks");
        assert!(cached.values().all(|&blocks| blocks == 0));
    }
}
