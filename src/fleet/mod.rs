//! The fleet: the one owner of the worker lifecycle. Registration,
//! re-registration, deregistration, lease lapse and the start and stop of
//! engine event subscriptions are this module's operations; the Workers and
//! Admin handlers and the housekeeping task only translate and call them.
//!
//! Why it exists: one worker's lifecycle touches four pieces of state owned
//! elsewhere (the registry and indexes in the router core, the blocks and
//! cursors behind the ingest writer, the ZeroMQ subscription, the bookings
//! and sessions), and its steps await between them. Two operations on the
//! same worker must not interleave, or a subscription could be left running
//! that nobody stops. So each operation on a worker takes that worker's
//! *turn* first: a per-worker async mutex in a `DashMap`, which serialises
//! one worker's lifecycle while other workers proceed. An entry exists only
//! while some operation on the worker holds or waits for its turn, so the
//! map stays as small as the operations in flight.
//!
//! There is one removal sequence ([`Fleet::remove`]): stop the subscription,
//! drop the blocks and cursors through the writer (in order with the batches
//! queued before), forget bookings and sessions. Deregistration and lease
//! lapse both end in it.

pub mod changes;
pub mod state;
pub mod subscriptions;

use std::{collections::HashMap, sync::Arc, time::Duration};

use dashmap::DashMap;
use tokio::sync::{Mutex, OwnedMutexGuard};

use crate::{
    engine_events::{EngineSource, EngineSpec, ResumePoint},
    ingest::{BatchOutcome, IngestError, IngestHandle, ValidatedBatch, cursor::EventCursor},
    router::RouterCore,
};
use kvroute_core::{
    index::{IndexDigest, IndexStats},
    registry::{EventTarget, RegisterOutcome, Registration, RegistryError, WorkerRecord},
    types::{BookedLoad, CacheView, DpRank, RankLoad, WorkerId, WorkerRank, WorkerRole},
};
use subscriptions::Subscriptions;

/// Why a lifecycle operation failed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum FleetError {
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error("worker {worker_id}: {message}")]
    InvalidSource {
        worker_id: WorkerId,
        message: String,
    },
    #[error(
        "worker {worker_id} is configured by `kvroute serve --engine` or `--pool`; it cannot be registered over gRPC"
    )]
    ConfiguredEngine { worker_id: WorkerId },
    #[error("worker {worker_id}: configured twice with --engine")]
    DuplicateEngine { worker_id: WorkerId },
    #[error("worker {worker_id}: a pool member's id, already registered over gRPC")]
    MemberIdTaken { worker_id: WorkerId },
    #[error(transparent)]
    Ingest(#[from] IngestError),
    /// Cluster mode: the change could not go through the other replicas.
    #[error(transparent)]
    Replication(#[from] changes::ReplicationError),
}

/// What kvroute knows of one registered worker, for the Admin API.
#[derive(Clone, Debug)]
pub struct WorkerView {
    pub record: WorkerRecord,
    pub ranks: Vec<RankView>,
    /// One line on its engine subscription; empty when it has none.
    pub subscription: String,
    /// Which view of its cache routing reads now, and why.
    pub cache_view: CacheView,
    /// Its engine's cached-token reports against the predictions.
    pub feedback: Option<crate::router::feedback::WorkerFeedback>,
}

/// One dp rank of a [`WorkerView`].
#[derive(Clone, Debug)]
pub struct RankView {
    pub dp_rank: DpRank,
    pub reported: RankLoad,
    pub booked: BookedLoad,
    pub cached_blocks: u64,
    /// Blocks kvroute predicts it holds (0 unless scored on predictions).
    pub predicted_blocks: u64,
    pub cursor: EventCursor,
}

/// Index statistics with the event cursors' counts and the digest.
#[derive(Clone, Debug, Default)]
pub struct IndexView {
    pub stats: IndexStats,
    pub events_skipped: u64,
    pub events_rejected: u64,
    pub digest: IndexDigest,
}

/// The worker lifecycle's owner (see the module docs).
pub struct Fleet {
    router: Arc<RouterCore>,
    ingest: IngestHandle,
    subscriptions: Subscriptions,
    turns: DashMap<WorkerId, Arc<Mutex<()>>>,
    /// Saved engine sequences (and unsynced ranks) of configured engines,
    /// restored from a snapshot, for when the configuration starts them.
    configured_resume: parking_lot::Mutex<HashMap<WorkerId, ResumePoint>>,
    /// Cluster mode: leases lapse through the shared log, decided by one
    /// replica, so [`Self::tick`] does not reap them here.
    leases_shared: std::sync::atomic::AtomicBool,
    /// Whether kvroute may connect to a restored worker's engine endpoint
    /// with no registering peer to check it against (`app.rs` gives the
    /// allow-list's answer for a loopback peer: `security::EndpointAllow`).
    restored_endpoints: EndpointRule,
}

/// Whether kvroute may connect to an engine endpoint.
pub(crate) type EndpointRule = Arc<dyn Fn(&str) -> bool + Send + Sync>;

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet").finish_non_exhaustive()
    }
}

/// A worker's turn: held for the whole of one lifecycle operation. Dropping
/// it lets the next operation on the worker go, and removes the worker's
/// entry when no other operation holds or waits for it.
struct Turn<'a> {
    turns: &'a DashMap<WorkerId, Arc<Mutex<()>>>,
    worker_id: WorkerId,
    guard: Option<OwnedMutexGuard<()>>,
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        // The guard holds a reference to the mutex: release it first, so a
        // count of one means the map's own reference is the last.
        drop(self.guard.take());
        self.turns
            .remove_if(&self.worker_id, |_, lock| Arc::strong_count(lock) == 1);
    }
}

impl Fleet {
    pub(crate) fn new(
        router: Arc<RouterCore>,
        ingest: IngestHandle,
        restored_endpoints: EndpointRule,
    ) -> Self {
        let subscriptions = Subscriptions::new(ingest.clone(), router.metrics().clone())
            .with_max_message_bytes(router.config().limits.max_engine_message_bytes);
        Self {
            router,
            ingest,
            subscriptions,
            turns: DashMap::new(),
            configured_resume: parking_lot::Mutex::new(HashMap::new()),
            leases_shared: std::sync::atomic::AtomicBool::new(false),
            restored_endpoints,
        }
    }

    pub(crate) fn router(&self) -> &Arc<RouterCore> {
        &self.router
    }

    /// Cluster mode, in one place: engine subscriptions started from now
    /// on send their batches to `forward` (the shared log) instead of the
    /// local writer, leases lapse through the log, not by this fleet's own
    /// tick, and the router's own booking changes go to `feed`, for the
    /// other replicas. The fleet exists (and answers health) before its
    /// replica has joined, so this is how the replica attaches; nothing
    /// books before it, the Router service being gated until then.
    pub(crate) fn join_cluster(
        &self,
        forward: Arc<dyn subscriptions::EngineForward>,
        feed: tokio::sync::mpsc::Sender<crate::router::sync::RoutingChange>,
    ) {
        self.subscriptions.set_forward(forward);
        self.leases_shared
            .store(true, std::sync::atomic::Ordering::Relaxed);
        self.router.set_change_feed(feed);
    }

    /// Applies engine events through the index's one writer (cluster mode:
    /// what the shared log carries of an engine subscription).
    pub(crate) async fn apply_engine_events(
        &self,
        batch: crate::ingest::EngineBatch,
    ) -> Result<crate::ingest::EngineOutcome, FleetError> {
        Ok(self.ingest.apply_engine(batch).await?)
    }

    /// Counts engine events the index refused when they were applied from
    /// the shared log, on the subscription that forwarded them.
    pub(crate) fn count_engine_rejected(
        &self,
        worker_id: WorkerId,
        generation: u64,
        rejected: u32,
    ) {
        self.subscriptions
            .count_index_rejected(worker_id, generation, rejected);
    }

    /// Waits for `worker_id`'s turn (see the module docs).
    async fn turn(&self, worker_id: WorkerId) -> Turn<'_> {
        let lock = self.turns.entry(worker_id).or_default().clone();
        Turn {
            turns: &self.turns,
            worker_id,
            guard: Some(lock.lock_owned().await),
        }
    }

    /// Registers or updates a worker, and starts, restarts or stops its
    /// engine subscription to match `source`.
    pub(crate) async fn register(
        &self,
        registration: Registration,
        source: Option<EngineSource>,
    ) -> Result<RegisterOutcome, FleetError> {
        let worker_id = registration.worker_id;
        if let Some(source) = &source {
            check_source(source, &registration)?;
        }
        let _turn = self.turn(worker_id).await;
        if self.subscriptions.is_configured(worker_id) {
            return Err(FleetError::ConfiguredEngine { worker_id });
        }
        self.register_in_turn(registration, source, false).await
    }

    /// The checks [`Self::register`] makes before anything changes (a
    /// replica makes them before it appends a registration to the log).
    pub(crate) fn check_registration(
        &self,
        registration: &Registration,
        source: Option<&EngineSource>,
    ) -> Result<(), FleetError> {
        if let Some(source) = source {
            check_source(source, registration)?;
        }
        if self.subscriptions.is_configured(registration.worker_id) {
            return Err(FleetError::ConfiguredEngine {
                worker_id: registration.worker_id,
            });
        }
        Ok(())
    }

    /// Removes a worker whose lease lapsed, if `generation` is still its
    /// registration (cluster mode: the lapse comes through the log).
    pub(crate) async fn remove_generation(
        &self,
        worker_id: WorkerId,
        generation: u64,
    ) -> Option<u64> {
        let _turn = self.turn(worker_id).await;
        let current = self.router.worker(worker_id)?;
        if current.generation != generation {
            return None;
        }
        let record = self.router.deregister_worker(worker_id).ok()?;
        let blocks = self.remove(record).await;
        tracing::warn!(worker_id, blocks, "lease lapsed: worker removed");
        Some(blocks)
    }

    /// Registers every `kvroute serve --engine` as a worker and starts its
    /// subscription; their leases are renewed while kvroute runs.
    pub(crate) async fn start_configured(&self, specs: &[EngineSpec]) -> Result<(), FleetError> {
        for spec in specs {
            let worker_id = spec.worker_id;
            let registration = Registration {
                worker_id,
                model: spec.model.clone(),
                role: WorkerRole::Aggregated,
                endpoint: spec.source.endpoint.clone(),
                block_size: spec.block_size,
                dp_start_rank: spec.dp_start_rank,
                dp_size: spec.dp_size,
                total_kv_blocks: 0,
                max_num_batched_tokens: 0,
                taints: Vec::new(),
                adapters: Vec::new(),
                loads_adapters: false,
                lease_ttl: None,
                kv_events: kvroute_core::types::KvEventsMode::Exact,
                tiers: Vec::new(),
            };
            check_source(&spec.source, &registration)?;
            let _turn = self.turn(worker_id).await;
            if self.subscriptions.is_configured(worker_id) {
                return Err(FleetError::DuplicateEngine { worker_id });
            }
            self.register_in_turn(registration, Some(spec.source.clone()), true)
                .await?;
        }
        Ok(())
    }

    /// Registers a pool member (`crate::pools`) as a configured engine:
    /// its lease renewed while kvroute runs, not registrable over gRPC. A
    /// member registered again (its pool changed) gets a new event stream;
    /// an id a gRPC-registered worker holds is refused.
    pub(crate) async fn register_member(
        &self,
        registration: Registration,
        source: EngineSource,
    ) -> Result<(), FleetError> {
        let worker_id = registration.worker_id;
        check_source(&source, &registration)?;
        let _turn = self.turn(worker_id).await;
        if self.router.worker(worker_id).is_some() {
            if !self.subscriptions.is_configured(worker_id) {
                return Err(FleetError::MemberIdTaken { worker_id });
            }
            let record = self.router.deregister_worker(worker_id)?;
            self.remove(record).await;
        }
        self.register_in_turn(registration, Some(source), true)
            .await
            .map(|_| ())
    }

    async fn register_in_turn(
        &self,
        registration: Registration,
        source: Option<EngineSource>,
        configured: bool,
    ) -> Result<RegisterOutcome, FleetError> {
        let worker_id = registration.worker_id;
        let outcome = if configured {
            self.router.register_configured_worker(registration)?
        } else {
            self.router.register_worker(registration)?
        };
        let record = &outcome.record;
        if let Some(previous) = &outcome.invalidated {
            let removed = self
                .ingest
                .remove_worker(worker_id, previous.model.clone())
                .await;
            tracing::info!(
                worker_id,
                removed,
                "registered again: a new event stream; the blocks of the previous registration dropped"
            );
            crate::metrics::return_freed_memory();
        }
        self.ingest.reserve(&record.snapshot()).await;
        let resume = if configured {
            self.configured_resume
                .lock()
                .remove(&worker_id)
                .unwrap_or_default()
        } else {
            ResumePoint::default()
        };
        self.subscriptions
            .update_resuming(record, source, configured, resume)
            .await
            .map_err(|message| FleetError::InvalidSource { worker_id, message })?;
        tracing::info!(worker_id, created = outcome.created, "worker registered");
        self.router.drain_queue();
        Ok(outcome)
    }

    /// Renews a worker's lease and records its reported load.
    pub(crate) fn heartbeat(
        &self,
        worker_id: WorkerId,
        loads: &[(DpRank, RankLoad)],
    ) -> Result<Duration, FleetError> {
        let ttl = self.router.heartbeat(worker_id, loads)?;
        self.router.drain_queue();
        Ok(ttl)
    }

    /// Removes a worker with all its blocks; returns the blocks removed.
    pub(crate) async fn deregister(&self, worker_id: WorkerId) -> Result<u64, FleetError> {
        let _turn = self.turn(worker_id).await;
        let record = self.router.deregister_worker(worker_id)?;
        let blocks = self.remove(record).await;
        tracing::info!(worker_id, blocks, "worker deregistered");
        Ok(blocks)
    }

    /// Removes every worker whose lease lapsed; returns how many.
    pub(crate) async fn reap_lapsed(&self) -> usize {
        let mut reaped = 0;
        for worker_id in self.router.lapsed_workers() {
            let _turn = self.turn(worker_id).await;
            // Renewed or re-registered while waiting for the turn: keep it.
            let Some(record) = self.router.remove_if_lapsed(worker_id) else {
                continue;
            };
            let blocks = self.remove(record).await;
            tracing::warn!(worker_id, blocks, "lease lapsed: worker removed");
            reaped += 1;
        }
        reaped
    }

    /// The one removal sequence, for a worker the registry has just
    /// forgotten; the caller holds the worker's turn.
    async fn remove(&self, record: WorkerRecord) -> u64 {
        let worker_id = record.registration.worker_id;
        self.subscriptions.stop(worker_id).await;
        let blocks = self
            .ingest
            .remove_worker(worker_id, record.registration.model)
            .await;
        self.router.forget_worker(worker_id);
        // Its tables are dropped: their pages go back to the OS now.
        crate::metrics::return_freed_memory();
        blocks
    }

    /// Cordons or uncordons a worker; uncordoning lets queued calls go.
    pub(crate) fn set_cordoned(
        &self,
        worker_id: WorkerId,
        cordoned: bool,
    ) -> Result<WorkerView, FleetError> {
        let record = self.router.set_cordoned(worker_id, cordoned)?;
        if !cordoned {
            self.router.drain_queue();
        }
        tracing::info!(worker_id, cordoned, "worker cordon changed");
        Ok(self.view(record))
    }

    /// Periodic upkeep: configured engines' leases, lapsed leases, expired
    /// bookings and sessions, index gauges.
    pub(crate) async fn tick(&self) {
        for worker_id in self.subscriptions.configured_ids() {
            if let Err(error) = self.router.heartbeat(worker_id, &[]) {
                tracing::warn!(worker_id, %error, "configured engine lease not renewed");
            }
        }
        if !self
            .leases_shared
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            self.reap_lapsed().await;
        }
        if !self.router.decides_in_order() {
            // Ordered decisions expire in log order (`RouterCore::log_time`).
            self.router.expire_bookings();
        }
        self.note_stream_health();
        self.router.evaluate_trust();
        self.router.refresh_index_gauges();
    }

    /// Tells the router how each engine subscription is doing (its
    /// PublishEvents streams tell it themselves, batch by batch).
    fn note_stream_health(&self) {
        for (worker_id, connected, unsynced) in self.subscriptions.stream_health() {
            self.router.note_subscription(worker_id, connected);
            if let Some(record) = self.router.worker(worker_id) {
                let r = &record.registration;
                for dp_rank in (0..r.dp_size).map(|i| r.dp_start_rank + i) {
                    let target = WorkerRank::new(worker_id, dp_rank);
                    self.router
                        .note_stream_gap(target, unsynced.contains(&dp_rank));
                }
            }
        }
    }

    /// Sets the subscriptions' last-batch age gauges (before a scrape).
    pub(crate) fn refresh_subscription_ages(&self) {
        self.subscriptions.refresh_ages();
    }

    /// Stops every subscription and waits for their tasks.
    pub(crate) async fn shutdown(&self) {
        self.subscriptions.shutdown().await;
    }

    /// What events for `(worker_id, dp_rank)` are checked against.
    pub(crate) fn event_target(
        &self,
        worker_id: WorkerId,
        dp_rank: DpRank,
    ) -> Result<EventTarget, FleetError> {
        Ok(self.router.event_target(worker_id, dp_rank)?)
    }

    /// Counts events of a registered rank rejected before reaching the writer
    /// (a malformed batch), for the Admin API.
    pub(crate) fn count_rejected(&self, target: EventTarget, events: u64) {
        self.ingest
            .count_rejected(WorkerRank::new(target.worker_id, target.dp_rank), events);
    }

    /// Applies a validated batch through the index's one writer.
    pub(crate) async fn apply_events(
        &self,
        batch: ValidatedBatch,
    ) -> Result<BatchOutcome, FleetError> {
        Ok(self.ingest.apply(batch).await?)
    }

    /// One worker's view; an error if it is not registered.
    pub(crate) fn worker_view(&self, worker_id: WorkerId) -> Result<WorkerView, FleetError> {
        let record = self
            .router
            .worker(worker_id)
            .ok_or(RegistryError::UnknownWorker { worker_id })?;
        Ok(self.view(record))
    }

    /// Views of every worker (of `model`, if given), by id.
    pub(crate) fn worker_views(&self, model: Option<&str>) -> Vec<WorkerView> {
        self.router
            .workers(model)
            .into_iter()
            .map(|record| self.view(record))
            .collect()
    }

    fn view(&self, record: WorkerRecord) -> WorkerView {
        let r = &record.registration;
        let ranks = (0..r.dp_size)
            .map(|i| {
                let dp_rank = r.dp_start_rank + i;
                let target = WorkerRank::new(r.worker_id, dp_rank);
                RankView {
                    dp_rank,
                    reported: record.load.get(&dp_rank).copied().unwrap_or_default(),
                    booked: self.router.booked_load(target),
                    cached_blocks: self.router.cached_blocks(&r.model, target),
                    predicted_blocks: self.router.predicted_blocks(target),
                    cursor: self.ingest.cursor(target).unwrap_or_default(),
                }
            })
            .collect();
        let subscription = self.subscriptions.summary(r.worker_id);
        let cache_view = self.router.cache_view(&record.snapshot());
        WorkerView {
            cache_view,
            feedback: self.router.cached_tokens_feedback(r.worker_id),
            record,
            ranks,
            subscription,
        }
    }

    /// Index statistics of one model, or of all summed.
    pub(crate) fn index_view(&self, model: Option<&str>) -> IndexView {
        let (stats, digest) = match model {
            Some(model) => self
                .router
                .index_of(model)
                .map(|index| (index.stats(), index.digest()))
                .unwrap_or_default(),
            None => (self.router.index_totals(), self.router.index_digest()),
        };
        let (events_skipped, events_rejected) = self.ingest.cursor_totals();
        IndexView {
            stats,
            events_skipped,
            events_rejected,
            digest,
        }
    }
}

/// Checks that a worker's ranks can follow `source` (every rank's endpoint
/// derivable, the layout usable).
fn check_source(source: &EngineSource, r: &Registration) -> Result<(), FleetError> {
    source
        .events_config(
            r.worker_id,
            &r.model,
            r.block_size.max(1),
            r.dp_start_rank,
            r.dp_size,
        )
        .map(|_| ())
        .map_err(|message| FleetError::InvalidSource {
            worker_id: r.worker_id,
            message,
        })
}

#[cfg(test)]
mod tests;
