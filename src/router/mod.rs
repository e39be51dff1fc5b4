//! The router core: the state every routing decision reads, behind locks
//! that nothing outside this module can take. One `RouterCore` exists per
//! server (and per replay); the fleet, the ingest writer and the gRPC
//! handlers hold an `Arc` of it and call the methods below, each of which
//! says what it reads or changes.
//!
//! What it owns, and who writes it:
//! * `members`: the worker registry and the map of each model's index,
//!   changed together under one write lock (so a model's index always has
//!   the block size of its workers' registration). Written by registration,
//!   heartbeat, cordon, deregistration and lease lapse, which the fleet
//!   (`crate::fleet`) serialises per worker.
//! * each model's `KvIndex` contents: only the ingest writer
//!   (`crate::ingest`), through the `Arc<KvIndex>` it gets from
//!   [`RouterCore::index_of`]; routing reads it.
//! * `routing`: bookings, sessions and the WAIT queue (`routing.rs`).
//! * `predictions`: the predicted caches of targets scored on them
//!   (`kvroute_core::predict`), written when a RESERVE books one, read by routing;
//!   `events_seen`: which AUTO workers have sent events (the ingest writer).
//! * `trust`: stream troubles and untrusted workers (`trust.rs`), written
//!   by the ingest writer, housekeeping and engine reports; `feedback`:
//!   what bookings expect engines to report cached (`feedback.rs`).
//!
//! Lock order where two meet: `routing` → `members` → an index's own lock;
//! `predictions`, `trust` and `feedback` are taken last (`predictions` may
//! hold `trust` for a read), never two of them otherwise.
//! `routing` is taken first (a RESERVE decides and books under its write
//! lock, reading members and indexes inside); no path takes `routing` while
//! holding `members`, and none takes `members` while holding an index lock.

pub mod config;
pub mod feedback;
#[cfg(test)]
mod replica_tests;
mod routing;
pub mod sync;
pub mod trust;

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use parking_lot::RwLock;

use crate::metrics::Metrics;
use kvroute_core::{
    admission::bookings::SavedBooking,
    index::{IndexDigest, IndexStats, KvIndex},
    predict::PredictedCaches,
    registry::{
        EventTarget, RegisterOutcome, Registration, Registry, RegistryError, SavedWorker,
        WorkerRecord,
    },
    select::affinity::SavedSession,
    types::{
        BookedLoad, CacheView, DpRank, KvEventsMode, PredictedBecause, RankLoad, WorkerId,
        WorkerRank, WorkerSnapshot,
    },
};

pub use config::{
    DEFAULT_OVERLAP_CREDIT, DEFAULT_OVERLAP_WEIGHT, InputLimits, ReplicaSettings, RouterConfig,
    ScorerChoice, TrustSettings,
};
pub use routing::{Admitted, PreparedRequest, RouteError, RouteOutcome};
pub use sync::RoutingChange;

/// The registry and each model's index: changed together (see the module
/// docs).
struct Members {
    registry: Registry,
    /// One exact index per model (block sizes differ between models).
    indexes: HashMap<String, Arc<KvIndex>>,
}

/// The router's shared state (see the module docs).
pub struct RouterCore {
    config: RouterConfig,
    metrics: Arc<Metrics>,
    members: RwLock<Members>,
    /// Bookings, sessions and the WAIT queue (`routing.rs`).
    routing: RwLock<routing::RoutingState>,
    /// Predicted caches of the targets scored on them (`kvroute_core::predict`).
    predictions: RwLock<PredictedCaches>,
    /// Stream troubles and untrusted workers (`trust.rs`).
    trust: RwLock<trust::TrustBook>,
    /// What each booking expects its engine to report cached, and each
    /// worker's reports (`feedback.rs`).
    feedback: parking_lot::Mutex<feedback::FeedbackBook>,
    /// Workers whose events have arrived since they registered (AUTO
    /// workers are scored exactly from then on).
    events_seen: dashmap::DashSet<WorkerId>,
    /// When this core started: zero of the routing clock.
    started: Instant,
    /// The routing clock's reading when a caller drives it (the replay
    /// simulator's virtual time); `None`: tokio's clock since `started`.
    manual_clock: Option<std::sync::atomic::AtomicU64>,
    /// Where this core's own routing changes go (cluster mode, `sync.rs`).
    feed: parking_lot::Mutex<Option<tokio::sync::mpsc::Sender<sync::RoutingChange>>>,
    /// Releases that came before their booking (`sync.rs`).
    released: parking_lot::Mutex<sync::RecentReleases>,
}

impl std::fmt::Debug for RouterCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterCore").finish_non_exhaustive()
    }
}

/// The clock every lease, booking and queue wait uses: tokio's, so tests
/// can pause it.
pub fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

impl RouterCore {
    pub fn new(config: RouterConfig, metrics: Arc<Metrics>) -> Self {
        Self {
            members: RwLock::new(Members {
                registry: Registry::with_limits(config.registry_limits),
                indexes: HashMap::new(),
            }),
            routing: RwLock::new(routing::RoutingState::new(
                config.queue_capacity,
                config.session_ttl,
                config.seed,
                config.replicas.horizon_ms(),
            )),
            predictions: RwLock::new(PredictedCaches::new(
                config.prediction_ttl.map(routing::millis),
            )),
            events_seen: dashmap::DashSet::new(),
            trust: RwLock::new(trust::TrustBook::default()),
            feedback: parking_lot::Mutex::new(feedback::FeedbackBook::default()),
            started: now(),
            manual_clock: None,
            feed: parking_lot::Mutex::new(None),
            released: parking_lot::Mutex::new(sync::RecentReleases::default()),
            config,
            metrics,
        }
    }

    /// A core whose routing clock (bookings, sessions, peer estimates;
    /// not leases) reads what [`Self::set_clock_ms`] last set, from 0: the
    /// replay simulator runs it on virtual time.
    pub fn with_manual_clock(config: RouterConfig, metrics: Arc<Metrics>) -> Self {
        Self {
            manual_clock: Some(std::sync::atomic::AtomicU64::new(0)),
            ..Self::new(config, metrics)
        }
    }

    /// Sets a manual routing clock (never back); does nothing to tokio's.
    pub fn set_clock_ms(&self, now_ms: u64) {
        if let Some(clock) = &self.manual_clock {
            clock.fetch_max(now_ms, std::sync::atomic::Ordering::Relaxed);
        }
    }

    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The index of a model, if any worker of it ever registered.
    pub fn index_of(&self, model: &str) -> Option<Arc<KvIndex>> {
        self.members.read().indexes.get(model).cloned()
    }

    /// The block size requests of `model` are hashed at: its workers', or
    /// the configured default when it has none.
    pub fn model_block_size(&self, model: &str) -> u32 {
        self.members
            .read()
            .registry
            .model_block_size(model)
            .unwrap_or(self.config.default_block_size)
    }

    /// Registers or updates a worker and gives its model an index of the
    /// registered block size, both under the members lock. The caller (the
    /// fleet) drops the blocks of an invalidated previous registration
    /// through the ingest writer.
    pub fn register_worker(
        &self,
        registration: Registration,
    ) -> Result<RegisterOutcome, RegistryError> {
        let lease_ttl = self.config.lease_ttl;
        self.admit_worker(|registry| registry.register(registration, lease_ttl, now()))
    }

    /// See `Registry::set_next_generation`.
    pub fn set_next_generation(&self, generation: u64) {
        self.members
            .write()
            .registry
            .set_next_generation(generation);
    }

    /// Registers a worker saved by a snapshot (see `Registry::restore`).
    pub fn restore_worker(&self, saved: SavedWorker) -> Result<RegisterOutcome, RegistryError> {
        self.admit_worker(|registry| registry.restore(saved, now()))
    }

    /// Runs a registration and gives the worker's model an index of its
    /// block size, under one hold of the members lock.
    fn admit_worker(
        &self,
        register: impl FnOnce(&mut Registry) -> Result<RegisterOutcome, RegistryError>,
    ) -> Result<RegisterOutcome, RegistryError> {
        let outcome = {
            let mut members = self.members.write();
            let outcome = register(&mut members.registry)?;
            let r = &outcome.record.registration;
            let (model, block_size) = (r.model.clone(), r.block_size);
            let stale = members
                .indexes
                .get(&model)
                .is_none_or(|index| index.block_size() != block_size);
            if stale {
                // A model's block size only changes when its only worker
                // re-registers, whose blocks are dropped anyway.
                members
                    .indexes
                    .insert(model, Arc::new(KvIndex::new(block_size)));
            }
            outcome
        };
        let registration = &outcome.record.registration;
        if outcome.invalidated.is_some() {
            // Another layout: what it held, whether it sent events and how
            // its stream went are of the previous registration.
            self.events_seen.remove(&registration.worker_id);
            self.trust.write().forget_worker(registration.worker_id);
            self.forget_feedback(registration.worker_id);
        }
        if outcome.invalidated.is_some() || registration.kv_events == KvEventsMode::Exact {
            self.predictions
                .write()
                .forget_worker(registration.worker_id);
        }
        self.refresh_worker_gauges();
        Ok(outcome)
    }

    /// Notes that events of `worker_id` arrived (the ingest writer): an
    /// AUTO worker is scored on the exact index from now on, its
    /// predictions dropped, and trust learns the worker is not behind.
    pub fn note_events(&self, worker_id: WorkerId) {
        if !self.events_seen.contains(&worker_id) {
            // Under the predictions lock, so a booking racing with this
            // sees either the mark or its prediction forgotten.
            let mut predictions = self.predictions.write();
            self.events_seen.insert(worker_id);
            predictions.forget_worker(worker_id);
        }
        let now_ms = self.now_ms();
        if self.trust.read().events_change(worker_id, now_ms) {
            self.trust.write().note_events(worker_id, now_ms);
        }
    }

    /// Why a worker registered with `mode` is scored on predictions
    /// whatever its stream's health; `None`: it is scored on its events.
    fn predicted_because(
        &self,
        mode: KvEventsMode,
        worker_id: WorkerId,
    ) -> Option<PredictedBecause> {
        match mode {
            KvEventsMode::Exact => None,
            KvEventsMode::Approximate => Some(PredictedBecause::Approximate),
            KvEventsMode::Auto if self.events_seen.contains(&worker_id) => None,
            KvEventsMode::Auto => Some(PredictedBecause::NoEventsYet),
        }
    }

    /// Which view of its cache `worker` is scored on now, and why.
    pub fn cache_view(&self, worker: &WorkerSnapshot) -> CacheView {
        self.view_with(worker, &self.trust.read())
    }

    /// [`Self::cache_view`] with the trust book already read (routing
    /// reads it once for every candidate).
    fn view_with(&self, worker: &WorkerSnapshot, trust: &trust::TrustBook) -> CacheView {
        match self.predicted_because(worker.kv_events, worker.worker_id) {
            Some(why) => CacheView::Predicted(why),
            None => trust
                .distrust(worker.worker_id)
                .map_or(CacheView::Exact, CacheView::Blended),
        }
    }

    /// Notes whether a rank's PublishEvents stream has an unhealed gap
    /// (the ingest writer, after each batch).
    pub fn note_stream_gap(&self, target: WorkerRank, open: bool) {
        if self.trust.read().gap_changes(target, open) {
            let now_ms = self.now_ms();
            self.trust.write().note_gap(target, open, now_ms);
        }
    }

    /// Whether `worker_id` is scored on events (EXACT, or AUTO once they
    /// came): only such a worker can owe events or be untrusted.
    pub fn sends_events(&self, worker_id: WorkerId) -> bool {
        let mode = self
            .members
            .read()
            .registry
            .get(worker_id)
            .map(|w| w.registration.kv_events);
        mode.is_some_and(|mode| self.predicted_because(mode, worker_id).is_none())
    }

    /// Notes whether a worker's engine subscription is connected.
    pub fn note_subscription(&self, worker_id: WorkerId, connected: bool) {
        let now_ms = self.now_ms();
        self.trust
            .write()
            .note_subscription(worker_id, connected, now_ms);
    }

    /// Takes the cached tokens an engine reported for a request (with
    /// MarkPrefillComplete or ReleaseRequest) and compares them with what
    /// was predicted (`feedback.rs`); a persistent contradiction of an
    /// exact worker's index makes it untrusted at the next evaluation.
    pub fn report_cached_tokens(&self, request_id: &str, cached_tokens: u64) {
        let (outcome, series) = {
            let mut book = self.feedback.lock();
            let outcome = book.report(request_id, cached_tokens);
            let series = match outcome {
                feedback::ReportOutcome::Recorded { worker_id, .. } => book.series_label(worker_id),
                _ => String::new(),
            };
            (outcome, series)
        };
        let label = match outcome {
            feedback::ReportOutcome::Unknown => "unknown",
            feedback::ReportOutcome::Implausible => "implausible",
            feedback::ReportOutcome::Recorded {
                worker_id,
                error,
                view,
                contradicted,
            } => {
                self.metrics
                    .cached_tokens_error
                    .with_label_values(&[series.as_str(), view.label()])
                    .observe(error);
                // Not for a worker that left meanwhile.
                if self.members.read().registry.get(worker_id).is_some() {
                    self.trust
                        .write()
                        .note_contradiction(worker_id, contradicted);
                }
                "recorded"
            }
        };
        self.metrics
            .cached_tokens_reports
            .with_label_values(&[label])
            .inc();
    }

    /// Forgets a worker's reports and its histogram series.
    fn forget_feedback(&self, worker_id: WorkerId) {
        if self.feedback.lock().forget_worker(worker_id) {
            let worker = worker_id.to_string();
            for view in CacheView::LABELS {
                let _ = self
                    .metrics
                    .cached_tokens_error
                    .remove_label_values(&[worker.as_str(), view]);
            }
        }
    }

    /// A worker's cached-token reports so far, if any.
    pub fn cached_tokens_feedback(&self, worker_id: WorkerId) -> Option<feedback::WorkerFeedback> {
        self.feedback.lock().worker(worker_id).cloned()
    }

    /// Downgrades exact workers whose stream has been in trouble past a
    /// deadline and recovers those whose trouble is over (`trust.rs`);
    /// each change is logged and counted once.
    pub fn evaluate_trust(&self) {
        let now_ms = self.now_ms();
        let (changes, untrusted) = {
            let mut book = self.trust.write();
            let changes = book.evaluate(&self.config.trust, now_ms);
            (changes, book.untrusted_count())
        };
        for change in changes {
            let (worker_id, why, label) = match change {
                trust::TrustChange::Downgraded(w, why) => {
                    tracing::warn!(
                        worker_id = w,
                        reason = why.label(),
                        "KV events untrusted: scoring the worker on its index blended with predictions"
                    );
                    (w, why, "downgraded")
                }
                trust::TrustChange::Recovered(w, why) => {
                    tracing::info!(
                        worker_id = w,
                        reason = why.label(),
                        "KV events trusted again"
                    );
                    (w, why, "recovered")
                }
            };
            // Predictions start afresh at a downgrade and end at recovery
            // (those of a worker scored on predictions anyway stay).
            if self.sends_events(worker_id) {
                self.predictions.write().forget_worker(worker_id);
            }
            self.metrics
                .worker_trust_changes
                .with_label_values(&[label, why.label()])
                .inc();
        }
        self.metrics
            .workers_untrusted
            .set(i64::try_from(untrusted).unwrap_or(i64::MAX));
    }

    /// Blocks `target` is predicted to hold (0 for targets scored exactly).
    pub fn predicted_blocks(&self, target: WorkerRank) -> u64 {
        self.predictions.read().blocks(target)
    }

    /// Blocks predicted over every target.
    pub fn predicted_blocks_total(&self) -> u64 {
        self.predictions.read().total_blocks()
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

    /// Forgets a worker in the registry (the fleet drops its blocks,
    /// subscription and bookings).
    pub fn deregister_worker(&self, worker_id: WorkerId) -> Result<WorkerRecord, RegistryError> {
        let record = self.members.write().registry.deregister(worker_id)?;
        self.refresh_worker_gauges();
        Ok(record)
    }

    /// Workers whose lease has lapsed by now.
    pub fn lapsed_workers(&self) -> Vec<WorkerId> {
        self.members.read().registry.lapsed(now())
    }

    /// Forgets `worker_id` if its lease has lapsed by now (it may have been
    /// renewed or re-registered since [`Self::lapsed_workers`] named it).
    pub fn remove_if_lapsed(&self, worker_id: WorkerId) -> Option<WorkerRecord> {
        let record = self
            .members
            .write()
            .registry
            .remove_if_lapsed(worker_id, now())?;
        self.metrics.leases_expired.inc();
        self.refresh_worker_gauges();
        Some(record)
    }

    pub fn set_cordoned(
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
    pub fn worker(&self, worker_id: WorkerId) -> Option<WorkerRecord> {
        self.members.read().registry.get(worker_id).cloned()
    }

    /// Copies of the records of every worker (of `model`, if given), by id.
    pub fn workers(&self, model: Option<&str>) -> Vec<WorkerRecord> {
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
    pub fn current_index(
        &self,
        worker_id: WorkerId,
        generation: u64,
        model: &str,
    ) -> Option<Arc<KvIndex>> {
        let members = self.members.read();
        let current = members.registry.get(worker_id)?;
        if current.generation != generation || current.registration.model != model {
            return None;
        }
        members.indexes.get(model).cloned()
    }

    /// Blocks the index holds for one (worker, rank).
    pub fn cached_blocks(&self, model: &str, target: WorkerRank) -> u64 {
        self.index_of(model)
            .map(|index| index.worker_blocks(target))
            .unwrap_or(0)
    }

    /// Every registered worker as a snapshot keeps it, by id.
    pub fn saved_workers(&self) -> Vec<SavedWorker> {
        let at = now();
        self.members
            .read()
            .registry
            .all()
            .into_iter()
            .map(|w| w.saved(at))
            .collect()
    }

    /// Live sessions and open bookings, as a snapshot keeps them (one hold
    /// of the routing read lock).
    pub fn saved_routing(&self) -> (Vec<SavedSession>, Vec<SavedBooking>) {
        let now_ms = self.now_ms();
        let state = self.routing.read();
        (state.sessions.export(now_ms), state.ledger.export(now_ms))
    }

    /// One open booking as a snapshot keeps it, or `None` when the request
    /// has none: what another router replica books to learn of this
    /// routing ([`Self::restore_routing`]).
    pub fn saved_booking(&self, request_id: &str) -> Option<SavedBooking> {
        let now_ms = self.now_ms();
        self.routing.read().ledger.export_one(request_id, now_ms)
    }

    /// Restores saved sessions and bookings (those of workers not
    /// registered are dropped); returns how many bookings were refused.
    pub fn restore_routing(
        &self,
        sessions: Vec<SavedSession>,
        bookings: Vec<SavedBooking>,
    ) -> usize {
        let now_ms = self.now_ms();
        let known = |worker_id: WorkerId| self.members.read().registry.get(worker_id).is_some();
        let sessions: Vec<SavedSession> = sessions
            .into_iter()
            .filter(|s| known(s.target.worker_id))
            .collect();
        let bookings: Vec<SavedBooking> = bookings
            .into_iter()
            .filter(|b| known(b.target.worker_id))
            .collect();
        let mut state = self.routing.write();
        for session in sessions {
            state.sessions.restore(session, now_ms);
        }
        let mut refused = 0;
        for booking in bookings {
            if state.ledger.restore(booking.clone(), now_ms).is_ok() {
                self.predict_restored(&booking, now_ms);
            } else {
                refused += 1;
            }
        }
        self.metrics.bookings_active.set(state.ledger.len() as i64);
        refused
    }

    /// Holds the prompt of a booking this core did not make (another
    /// replica's, or a snapshot's) for its target, when that target is
    /// scored on predictions: its keys are the prompt's prefix keys.
    pub(super) fn predict_restored(&self, booking: &SavedBooking, now_ms: u64) {
        if booking.prefill.is_none() {
            return;
        }
        if let Some(worker) = self.worker(booking.target.worker_id) {
            self.hold_prediction(
                &booking.request_id,
                booking.target,
                &worker.snapshot(),
                booking.keys.clone(),
                now_ms,
            );
        }
    }

    /// Holds a booked prompt (its prefix keys) for `target` of `worker`
    /// until its prefill completes, if the worker is scored on
    /// predictions now (`kvroute_core::predict`), at the worker's capacity.
    fn hold_prediction(
        &self,
        request_id: &str,
        target: WorkerRank,
        worker: &WorkerSnapshot,
        keys: Vec<u64>,
        now_ms: u64,
    ) {
        let capacity = self
            .config
            .registry_limits
            .rank_capacity(worker.total_kv_blocks);
        let mut predictions = self.predictions.write();
        // An AUTO worker's first event may have come since the caller
        // looked; `note_events` marks it under this same lock.
        if self.cache_view(worker).reads_predictions() {
            predictions.hold(request_id, target, keys, capacity, now_ms);
        }
    }

    /// Load booked on one (worker, rank) and not yet released.
    pub fn booked_load(&self, target: WorkerRank) -> BookedLoad {
        self.routing.read().ledger.load(target)
    }

    /// Every model's index statistics, summed.
    pub fn index_totals(&self) -> IndexStats {
        let indexes: Vec<Arc<KvIndex>> = self.members.read().indexes.values().cloned().collect();
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
        }
        total
    }

    /// Every model's index digest, summed (a wrapping sum, as each is).
    pub fn index_digest(&self) -> IndexDigest {
        let indexes: Vec<Arc<KvIndex>> = self.members.read().indexes.values().cloned().collect();
        let mut total = IndexDigest::default();
        for index in indexes {
            total.add(index.digest());
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
        self.metrics
            .predicted_blocks
            .set(i64::try_from(self.predicted_blocks_total()).unwrap_or(i64::MAX));
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
}
