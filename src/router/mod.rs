//! The router core: the state every routing decision reads, behind locks
//! that nothing outside this module can take. One `RouterCore` exists per
//! server (and per replay); the fleet, the ingest writer and the gRPC
//! handlers hold an `Arc` of it and call the methods below, each of which
//! says what it reads or changes.
//!
//! It holds three things, each with its own locks and its own methods that
//! take them:
//! * `members` (`members.rs`): the worker registry and the map of each
//!   model's index, changed together under one write lock (so a model's
//!   index always has the block size of its workers' registration).
//!   Written by registration, heartbeat, cordon, deregistration and lease
//!   lapse, which the fleet (`crate::fleet`) serialises per worker. Each
//!   model's `KvIndex` contents are written only by the ingest writer
//!   (`crate::ingest`), through the `Arc<KvIndex>` it gets from
//!   [`RouterCore::index_of`]; routing reads them. A SelectWorker call
//!   reads the lock once, for the [`ModelView`] (block size, workers,
//!   index) its prompt is hashed with and its decision made on.
//! * `routing` (`routing_state.rs`): bookings, sessions, the WAIT queue,
//!   peer estimates and prefill times under the `routing` lock, and the
//!   `feed` and `released` mutexes only it takes. Its operations (decide
//!   and book, release, prefill complete, drain, expire) take the lock
//!   themselves.
//! * `views` (`views.rs`): which view of its cache each worker is scored
//!   on: the predicted caches, trust (`trust.rs`), cached-token feedback
//!   (`feedback.rs`) and the AUTO workers whose events have come, under
//!   the `predictions`, `trust`, `feedback` and `events_seen` locks.
//!
//! Lock order where two meet (docs/ARCHITECTURE.md names every lock):
//! `routing` → `members` → an index's own lock; `routing` → `feed`,
//! `released`; `routing` → the views' locks, which are taken last
//! (`predictions` → `trust` for a read → `events_seen`, and `predictions`
//! → `events_seen`).
//! No path takes `routing` while holding `members`, and none takes
//! `members` while holding an index lock or a view's lock.

mod clock;
pub mod config;
pub mod decisions;
pub mod feedback;
mod members;
pub mod ordered;
#[cfg(test)]
mod replica_tests;
mod routing;
mod routing_state;
pub mod sync;
pub mod trust;
mod views;

use std::{sync::Arc, time::Duration};

use parking_lot::RwLock;

use crate::metrics::Metrics;
use clock::Clock;
use kvroute_core::{
    index::{IndexDigest, IndexStats, KvIndex},
    registry::{
        EventTarget, RegisterOutcome, Registration, Registry, RegistryError, SavedWorker,
        WorkerRecord,
    },
    types::{CacheView, DpRank, RankLoad, Tier, WorkerId, WorkerRank, WorkerSnapshot},
};
use members::Members;

pub use config::{
    DEFAULT_OVERLAP_CREDIT, DEFAULT_OVERLAP_WEIGHT, InputLimits, ReplicaSettings, RouterConfig,
    ScorerChoice, TrustSettings,
};
pub use members::ModelView;
pub use routing::{Admitted, RouteOutcome};
pub use routing_state::{PreparedRequest, RouteError};
pub use sync::RoutingChange;

/// The router's shared state (see the module docs).
pub struct RouterCore {
    config: RouterConfig,
    metrics: Arc<Metrics>,
    /// The routing clock, shared with `routing` and `views`.
    clock: Clock,
    /// The registry and each model's index (`members.rs`).
    members: RwLock<Members>,
    /// Bookings, sessions, the WAIT queue and their feed (`routing_state.rs`).
    routing: routing_state::Routing,
    /// Predictions, trust, feedback and events seen (`views.rs`).
    views: views::CacheViews,
    /// The last decisions, for the web view (`decisions.rs`).
    decisions: decisions::DecisionLog,
    /// Where RESERVE calls are decided when they are decided in the
    /// shared log's order (cluster mode, `ordered.rs`).
    ordered: std::sync::OnceLock<Arc<dyn ordered::OrderedLog>>,
    /// Woken when an ordered booking step frees load (a call WAIT would
    /// queue tries again).
    ordered_changed: tokio::sync::Notify,
    /// RESERVE calls waiting for load to free (WAIT on a busy fleet,
    /// ordered decisions): bounded by the queue's capacity.
    ordered_waiting: std::sync::atomic::AtomicUsize,
    /// Booking steps taken while the log was away, waiting to be appended.
    steps_awaiting_log: Arc<std::sync::atomic::AtomicUsize>,
}

impl std::fmt::Debug for RouterCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterCore").finish_non_exhaustive()
    }
}

/// The clock every lease, booking and queue wait uses: tokio's, so tests
/// can pause it.
pub(crate) fn now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}

impl RouterCore {
    pub fn new(config: RouterConfig, metrics: Arc<Metrics>) -> Self {
        Self::with_clock(config, metrics, Clock::tokio())
    }

    /// A core whose routing clock (bookings, sessions, peer estimates;
    /// not leases) reads what [`Self::set_clock_ms`] last set, from 0: the
    /// replay simulator runs it on virtual time.
    pub fn with_manual_clock(config: RouterConfig, metrics: Arc<Metrics>) -> Self {
        Self::with_clock(config, metrics, Clock::manual())
    }

    fn with_clock(config: RouterConfig, metrics: Arc<Metrics>, clock: Clock) -> Self {
        Self {
            members: RwLock::new(Members::new(config.registry_limits)),
            routing: routing_state::Routing::new(&config, metrics.clone(), clock.clone()),
            views: views::CacheViews::new(&config, metrics.clone(), clock.clone()),
            decisions: decisions::DecisionLog::default(),
            ordered: std::sync::OnceLock::new(),
            ordered_changed: tokio::sync::Notify::new(),
            ordered_waiting: std::sync::atomic::AtomicUsize::new(0),
            steps_awaiting_log: Arc::default(),
            clock,
            config,
            metrics,
        }
    }

    /// Sets a manual routing clock (never back); does nothing to tokio's.
    pub fn set_clock_ms(&self, now_ms: u64) {
        self.clock.set_ms(now_ms);
    }

    /// The routing clock's reading.
    pub(crate) fn clock_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    pub(crate) fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The index of a model, if any worker of it ever registered.
    pub fn index_of(&self, model: &str) -> Option<Arc<KvIndex>> {
        self.members.read().index_of(model)
    }

    /// The view a SelectWorker call on `model` hashes its prompt with and
    /// is decided on: the model's block size (its workers', or the
    /// configured default when it has none), worker snapshots and index,
    /// read together under one hold of the members lock.
    pub(crate) fn model_view(&self, model: &str) -> ModelView {
        self.members
            .read()
            .model_view(model, self.config.default_block_size)
    }

    /// Registers a worker, or registers it again (which starts it anew:
    /// `Registry::register`), and gives its model an index of the
    /// registered block size, both under the members lock. The caller (the
    /// fleet) drops the blocks and event cursors of an invalidated previous
    /// registration through the ingest writer.
    pub fn register_worker(
        &self,
        registration: Registration,
    ) -> Result<RegisterOutcome, RegistryError> {
        let lease_ttl = self.config.lease_ttl;
        self.admit_worker(|registry| registry.register(registration, lease_ttl, now()))
    }

    /// [`Self::register_worker`] for a configured engine, whose blocks and
    /// streams continue (`Registry::register_continuing`).
    pub(crate) fn register_configured_worker(
        &self,
        registration: Registration,
    ) -> Result<RegisterOutcome, RegistryError> {
        let lease_ttl = self.config.lease_ttl;
        self.admit_worker(|registry| registry.register_continuing(registration, lease_ttl, now()))
    }

    /// See `Registry::set_next_generation`.
    pub(crate) fn set_next_generation(&self, generation: u64) {
        self.members
            .write()
            .registry
            .set_next_generation(generation);
    }

    /// Registers a worker saved by a snapshot (see `Registry::restore`).
    pub(crate) fn restore_worker(
        &self,
        saved: SavedWorker,
    ) -> Result<RegisterOutcome, RegistryError> {
        self.admit_worker(|registry| registry.restore(saved, now()))
    }

    /// Runs a registration and gives the worker's model an index of its
    /// block size, under one hold of the members lock; then the cache
    /// views learn of it.
    fn admit_worker(
        &self,
        register: impl FnOnce(&mut Registry) -> Result<RegisterOutcome, RegistryError>,
    ) -> Result<RegisterOutcome, RegistryError> {
        let outcome = self.members.write().admit(register)?;
        self.views
            .registered(&outcome.record.registration, outcome.invalidated.is_some());
        self.refresh_worker_gauges();
        Ok(outcome)
    }

    /// Renews a worker's lease and records the load it reports per rank.
    pub fn heartbeat(
        &self,
        worker_id: WorkerId,
        loads: &[(DpRank, RankLoad)],
    ) -> Result<Duration, RegistryError> {
        self.members
            .write()
            .registry
            .heartbeat(worker_id, loads, now())
    }

    /// Renews a worker's lease to end `remaining` from now, as another
    /// replica's heartbeat set it, and records the load it carried.
    pub(crate) fn renew_until(
        &self,
        worker_id: WorkerId,
        loads: &[(DpRank, RankLoad)],
        remaining: Duration,
    ) -> Result<Duration, RegistryError> {
        self.members
            .write()
            .registry
            .renew_until(worker_id, loads, remaining, now())
    }

    /// Forgets a worker in the registry (the fleet drops its blocks,
    /// subscription and bookings).
    pub(crate) fn deregister_worker(
        &self,
        worker_id: WorkerId,
    ) -> Result<WorkerRecord, RegistryError> {
        let record = self.members.write().registry.deregister(worker_id)?;
        self.refresh_worker_gauges();
        Ok(record)
    }

    /// Workers whose lease has lapsed by now.
    pub(crate) fn lapsed_workers(&self) -> Vec<WorkerId> {
        self.members.read().registry.lapsed(now())
    }

    /// Forgets `worker_id` if its lease has lapsed by now (it may have been
    /// renewed or re-registered since [`Self::lapsed_workers`] named it).
    pub(crate) fn remove_if_lapsed(&self, worker_id: WorkerId) -> Option<WorkerRecord> {
        let record = self
            .members
            .write()
            .registry
            .remove_if_lapsed(worker_id, now())?;
        self.metrics.leases_expired.inc();
        self.refresh_worker_gauges();
        Some(record)
    }

    pub(crate) fn set_cordoned(
        &self,
        worker_id: WorkerId,
        cordoned: bool,
    ) -> Result<WorkerRecord, RegistryError> {
        let record = self
            .members
            .write()
            .registry
            .set_cordoned(worker_id, cordoned)?;
        self.refresh_worker_gauges();
        Ok(record)
    }

    /// A copy of one worker's record.
    pub(crate) fn worker(&self, worker_id: WorkerId) -> Option<WorkerRecord> {
        self.members.read().registry.get(worker_id).cloned()
    }

    /// One worker's snapshot, if it is registered.
    fn worker_snapshot(&self, worker_id: WorkerId) -> Option<WorkerSnapshot> {
        self.worker(worker_id).map(|w| w.snapshot())
    }

    /// Copies of the records of every worker (of `model`, if given), by id.
    pub(crate) fn workers(&self, model: Option<&str>) -> Vec<WorkerRecord> {
        self.members
            .read()
            .registry
            .all()
            .into_iter()
            .filter(|w| model.is_none_or(|m| w.registration.model == m))
            .cloned()
            .collect()
    }

    /// What a batch of events for `(worker_id, dp_rank)` is validated and
    /// applied against; an error if that rank is not registered.
    pub fn event_target(
        &self,
        worker_id: WorkerId,
        dp_rank: DpRank,
    ) -> Result<EventTarget, RegistryError> {
        self.members
            .read()
            .registry
            .event_target(worker_id, dp_rank)
    }

    /// The index a batch validated against registration `generation` of
    /// `worker_id` may write: `None` when the worker has since been
    /// deregistered or re-registered (or moved to another model).
    pub(crate) fn current_index(
        &self,
        worker_id: WorkerId,
        generation: u64,
        model: &str,
    ) -> Option<Arc<KvIndex>> {
        self.members
            .read()
            .current_index(worker_id, generation, model)
    }

    /// Blocks the index holds for one (worker, rank).
    pub(crate) fn cached_blocks(&self, model: &str, target: WorkerRank) -> u64 {
        self.index_of(model)
            .map(|index| index.worker_blocks(target))
            .unwrap_or(0)
    }

    /// Every model's index statistics, summed.
    pub(crate) fn index_totals(&self) -> IndexStats {
        let indexes = self.members.read().indexes();
        let mut total = IndexStats::default();
        for index in indexes {
            let stats = index.stats();
            total.blocks += stats.blocks;
            total.nodes += stats.nodes;
            total.workers += stats.workers;
            total.bytes_used += stats.bytes_used;
            total.events_applied += stats.events_applied;
            total.events_rejected += stats.events_rejected;
            total.blocks_skipped += stats.blocks_skipped;
            total.blocks_unresolved += stats.blocks_unresolved;
            total.blocks_evicted += stats.blocks_evicted;
            for (sum, tier) in total.per_tier.iter_mut().zip(stats.per_tier) {
                *sum += tier;
            }
        }
        total
    }

    /// Every model's index digest, summed (a wrapping sum, as each is).
    pub(crate) fn index_digest(&self) -> IndexDigest {
        let indexes = self.members.read().indexes();
        let mut total = IndexDigest::default();
        for index in indexes {
            total.add(index.digest());
        }
        total
    }

    pub(crate) fn refresh_index_gauges(&self) {
        let totals = self.index_totals();
        self.metrics
            .index_blocks
            .set(i64::try_from(totals.blocks).unwrap_or(i64::MAX));
        self.metrics
            .index_bytes
            .set(i64::try_from(totals.bytes_used).unwrap_or(i64::MAX));
        for tier in Tier::ALL {
            self.metrics
                .index_tier_blocks
                .with_label_values(&[tier.name()])
                .set(i64::try_from(totals.per_tier[tier.index()]).unwrap_or(i64::MAX));
        }
        self.metrics
            .predicted_blocks
            .set(i64::try_from(self.views.predicted_blocks_total()).unwrap_or(i64::MAX));
    }

    /// Sets `kvroute_worker_booked` for the (worker, rank)s with the most
    /// booked load now, at most `--max-engine-metric-workers` of them (the
    /// bound on per-worker series), dropping every other series: the hot
    /// workers are the ones worth a series.
    pub(crate) fn refresh_booked_gauges(&self) {
        let mut booked = Vec::new();
        for record in self.workers(None) {
            let r = &record.registration;
            for dp_rank in r.dp_start_rank..r.dp_start_rank.saturating_add(r.dp_size) {
                let target = WorkerRank {
                    worker_id: r.worker_id,
                    dp_rank,
                };
                booked.push((target, self.booked_load(target)));
            }
        }
        let cap = self.metrics.engine.series_cap();
        if booked.len() > cap {
            // Ties (idle workers) go to the lowest ids: the same each scrape.
            booked.select_nth_unstable_by_key(cap, |(target, load)| {
                (
                    std::cmp::Reverse((load.prefill_tokens, load.active_requests)),
                    *target,
                )
            });
            booked.truncate(cap);
        }
        let gauge = &self.metrics.worker_booked;
        gauge.reset();
        for (target, load) in booked {
            let (worker, rank) = (target.worker_id.to_string(), target.dp_rank.to_string());
            let set = |kind: &str, value: u64| {
                gauge
                    .with_label_values(&[&worker, &rank, kind])
                    .set(i64::try_from(value).unwrap_or(i64::MAX));
            };
            set("prefill_tokens", load.prefill_tokens);
            set("decode_blocks", load.decode_blocks);
            set("requests", load.active_requests);
        }
    }

    fn refresh_worker_gauges(&self) {
        let (active, cordoned) = self.members.read().registry.counts();
        let gauge = |state: &str, n: usize| {
            self.metrics
                .workers
                .with_label_values(&[state])
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        };
        gauge("active", active);
        gauge("cordoned", cordoned);
    }

    // The cache views (`views.rs`): the registry is read, when needed,
    // before or after them, never under them.

    /// Notes that events of `worker_id` arrived (the ingest writer): an
    /// AUTO worker is scored on the exact index from now on, its
    /// predictions dropped, and trust learns the worker is not behind.
    pub(crate) fn note_events(&self, worker_id: WorkerId) {
        self.views.note_events(worker_id);
    }

    /// Which view of its cache `worker` is scored on now, and why.
    pub(crate) fn cache_view(&self, worker: &WorkerSnapshot) -> CacheView {
        self.views.view_of(worker)
    }

    /// Notes whether a rank's PublishEvents stream has an unhealed gap
    /// (the ingest writer, after each batch).
    pub(crate) fn note_stream_gap(&self, target: WorkerRank, open: bool) {
        self.views.note_gap(target, open);
    }

    /// Whether `worker_id` is scored on events (EXACT, or AUTO once they
    /// came): only such a worker can owe events or be untrusted.
    fn sends_events(&self, worker_id: WorkerId) -> bool {
        let mode = self
            .members
            .read()
            .registry
            .get(worker_id)
            .map(|w| w.registration.kv_events);
        mode.is_some_and(|mode| self.views.sends_events(mode, worker_id))
    }

    /// Notes whether a worker's engine subscription is connected.
    pub(crate) fn note_subscription(&self, worker_id: WorkerId, connected: bool) {
        self.views.note_subscription(worker_id, connected);
    }

    /// Takes the cached tokens an engine reported for a request (with
    /// MarkPrefillComplete or ReleaseRequest) and compares them with what
    /// was predicted (`feedback.rs`); a persistent contradiction of an
    /// exact worker's index makes it untrusted at the next evaluation.
    pub fn report_cached_tokens(&self, request_id: &str, cached_tokens: u64) {
        self.views
            .report_cached_tokens(request_id, cached_tokens, |worker_id| {
                self.members.read().registry.get(worker_id).is_some()
            });
    }

    /// A worker's cached-token reports so far, if any.
    pub(crate) fn cached_tokens_feedback(
        &self,
        worker_id: WorkerId,
    ) -> Option<feedback::WorkerFeedback> {
        self.views.feedback_of(worker_id)
    }

    /// Downgrades exact workers whose stream has been in trouble past a
    /// deadline and recovers those whose trouble is over (`trust.rs`);
    /// each change is logged and counted once.
    pub fn evaluate_trust(&self) {
        self.views
            .evaluate_trust(|worker_id| self.sends_events(worker_id));
    }

    /// Blocks `target` is predicted to hold (0 for targets scored exactly).
    pub(crate) fn predicted_blocks(&self, target: WorkerRank) -> u64 {
        self.views.predicted_blocks(target)
    }
}
