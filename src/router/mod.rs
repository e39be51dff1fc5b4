//! The router's shared state and the domain operations the gRPC handlers
//! call. One `RouterCore` exists per server; handlers hold an `Arc` of it.
//!
//! Who writes what:
//! * `registry`: the Workers and Admin handlers and the lease reaper, under
//!   its write lock (held for map updates only, never across an await);
//! * each model's `KvIndex`: only the ingest writer thread (`ingest`);
//! * `cursors`: only the ingest writer;
//! * `bookings` and `sessions`: the Router handlers and the expiry task.
//!
//! Lock order where two meet: routing (bookings, sessions, queue) →
//! registry → cursors; no path takes the routing lock while holding another.
//! Index locks are internal to `KvIndex` and never held with another lock.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use parking_lot::{Mutex, RwLock};

use crate::{
    config::ServeConfig,
    index::KvIndex,
    ingest::cursor::EventCursor,
    metrics::Metrics,
    registry::{RegisterOutcome, Registration, Registry, RegistryError, WorkerRecord},
    types::{DpRank, RankLoad, WorkerId, WorkerRank},
};

/// Everything the services share.
pub struct RouterCore {
    pub config: ServeConfig,
    pub metrics: Arc<Metrics>,
    pub registry: RwLock<Registry>,
    /// One exact index per model (block sizes differ between models).
    indexes: RwLock<HashMap<String, Arc<KvIndex>>>,
    pub cursors: Mutex<HashMap<WorkerRank, EventCursor>>,
    /// Bookings, sessions and the WAIT queue (`routing`).
    pub routing: RwLock<crate::routing::RoutingState>,
    /// When this core started: zero of the routing clock.
    pub started: Instant,
}

impl std::fmt::Debug for RouterCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterCore").finish_non_exhaustive()
    }
}

/// The clock every lease and booking uses: tokio's, so tests can pause it.
pub fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

impl RouterCore {
    pub fn new(config: ServeConfig, metrics: Arc<Metrics>) -> Self {
        Self {
            registry: RwLock::new(Registry::new()),
            indexes: RwLock::new(HashMap::new()),
            cursors: Mutex::new(HashMap::new()),
            routing: RwLock::new(crate::routing::RoutingState::new(
                config.queue_capacity,
                config.session_ttl,
                config.seed,
            )),
            started: now(),
            config,
            metrics,
        }
    }

    /// The index of a model, if any worker of it ever registered.
    pub fn index_of(&self, model: &str) -> Option<Arc<KvIndex>> {
        self.indexes.read().get(model).cloned()
    }

    /// The block size requests of `model` are hashed at: its workers', or
    /// the configured default when it has none.
    pub fn model_block_size(&self, model: &str) -> u32 {
        self.registry
            .read()
            .model_block_size(model)
            .unwrap_or(self.config.block_size)
    }

    /// Registers or updates a worker. The caller drops the blocks of an
    /// invalidated previous registration through the ingest writer.
    pub fn register_worker(
        &self,
        registration: Registration,
    ) -> Result<RegisterOutcome, RegistryError> {
        let model = registration.model.clone();
        let block_size = registration.block_size;
        let outcome = self
            .registry
            .write()
            .register(registration, self.config.lease_ttl, now())?;
        let mut indexes = self.indexes.write();
        let stale = indexes
            .get(&model)
            .is_some_and(|index| index.block_size() != block_size);
        if stale || !indexes.contains_key(&model) {
            // A model's block size only changes when its only worker
            // re-registers, whose blocks are dropped anyway.
            indexes.insert(model, Arc::new(KvIndex::new(block_size)));
        }
        drop(indexes);
        self.refresh_worker_gauges();
        Ok(outcome)
    }

    pub fn heartbeat(
        &self,
        worker_id: WorkerId,
        loads: &[(DpRank, RankLoad)],
    ) -> Result<Duration, RegistryError> {
        self.registry.write().heartbeat(worker_id, loads, now())
    }

    /// Forgets a worker in the registry (its blocks are dropped by the caller
    /// through the ingest writer).
    pub fn deregister_worker(&self, worker_id: WorkerId) -> Result<WorkerRecord, RegistryError> {
        let record = self.registry.write().deregister(worker_id)?;
        self.refresh_worker_gauges();
        Ok(record)
    }

    /// Removes every worker whose lease lapsed.
    pub fn reap_expired_leases(&self) -> Vec<WorkerRecord> {
        let reaped = self.registry.write().reap_expired(now());
        if !reaped.is_empty() {
            self.metrics.leases_expired.inc_by(reaped.len() as u64);
            self.refresh_worker_gauges();
        }
        reaped
    }

    pub fn set_cordoned(
        &self,
        worker_id: WorkerId,
        cordoned: bool,
    ) -> Result<WorkerRecord, RegistryError> {
        let record = self
            .registry
            .write()
            .set_cordoned(worker_id, cordoned)
            .cloned()?;
        self.refresh_worker_gauges();
        Ok(record)
    }

    /// The cursor of one (worker, rank), if it has seen events.
    pub fn cursor(&self, target: WorkerRank) -> Option<EventCursor> {
        self.cursors.lock().get(&target).cloned()
    }

    /// Blocks the index holds for one (worker, rank).
    pub fn cached_blocks(&self, model: &str, target: WorkerRank) -> u64 {
        self.index_of(model)
            .map(|index| index.worker_blocks(target))
            .unwrap_or(0)
    }

    pub fn count_events(&self, outcome: &str, reason: &str, count: u64) {
        if count > 0 {
            self.metrics
                .events
                .with_label_values(&[outcome, reason])
                .inc_by(count);
        }
    }

    /// Every model's index statistics, summed.
    pub fn index_totals(&self) -> crate::index::IndexStats {
        let indexes: Vec<Arc<KvIndex>> = self.indexes.read().values().cloned().collect();
        let mut total = crate::index::IndexStats::default();
        for index in indexes {
            let stats = index.stats();
            total.blocks += stats.blocks;
            total.nodes += stats.nodes;
            total.workers += stats.workers;
            total.bytes_used += stats.bytes_used;
            total.events_applied += stats.events_applied;
            total.events_rejected += stats.events_rejected;
            total.blocks_skipped += stats.blocks_skipped;
        }
        total
    }

    pub fn refresh_index_gauges(&self) {
        let totals = self.index_totals();
        self.metrics
            .index_blocks
            .set(i64::try_from(totals.blocks).unwrap_or(i64::MAX));
        self.metrics
            .index_bytes
            .set(i64::try_from(totals.bytes_used).unwrap_or(i64::MAX));
    }

    fn refresh_worker_gauges(&self) {
        let (active, cordoned) = self.registry.read().counts();
        let gauge = |state: &str, n: usize| {
            self.metrics
                .workers
                .with_label_values(&[state])
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        };
        gauge("active", active);
        gauge("cordoned", cordoned);
    }
}
