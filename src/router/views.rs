//! The cache views: which view of its cache each worker is scored on (its
//! exact index, its predicted cache, or the blend of the two) and the
//! state that decides it and learns from it.
//!
//! Why one object: the predicted caches (`kvroute_core::predict`), trust
//! (`trust.rs`), cached-token feedback (`feedback.rs`) and the set of AUTO
//! workers whose events have come are read together to pick a worker's
//! view, written together when a worker leaves or changes layout, and a
//! booking writes the predictions and the expectation of the view it was
//! scored on. The rules that combine them (an AUTO worker's first event
//! ends its predictions; a downgrade starts them afresh; an engine's
//! contradicting reports distrust the index) sit here beside each other,
//! and the core holds one object instead of four locks.
//!
//! Its locks: `predictions`, `trust` (read-write), `feedback` (a mutex)
//! and `events_seen` (a `DashSet`, whose shards lock). Where they meet
//! here: `predictions` → `events_seen` (a first event is marked under the
//! predictions lock, so a racing booking sees the mark or its prediction
//! forgotten), `predictions` → `trust` (a read, to check the view of a
//! booking's target) and `trust` → `events_seen` (a worker's view is read
//! under the trust read lock). Nothing here takes `members` or `routing`;
//! the routing side takes these under `routing` (docs/ARCHITECTURE.md).

use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use super::{
    RouterConfig,
    clock::{Clock, millis},
    feedback::{Expectation, FeedbackBook, ReportOutcome, WorkerFeedback},
    members::ModelView,
    trust::{TrustBook, TrustChange, TrustSettings},
};
use crate::metrics::Metrics;
use kvroute_core::{
    admission,
    index::TierBlocks,
    predict::PredictedCaches,
    registry::{Registration, RegistryLimits},
    select::{SelectRequest, Selection},
    types::{
        CacheView, KvEventsMode, LocalHash, PredictedBecause, RankMap, WorkerId, WorkerRank,
        WorkerSnapshot,
    },
};

/// Predictions, trust, feedback and events seen (see the module docs).
pub(super) struct CacheViews {
    /// Predicted caches of the targets scored on them.
    predictions: RwLock<PredictedCaches>,
    /// Stream troubles and untrusted workers.
    trust: RwLock<TrustBook>,
    /// What each booking expects its engine to report cached, and each
    /// worker's reports.
    feedback: Mutex<FeedbackBook>,
    /// Workers whose events have arrived since they registered (AUTO
    /// workers are scored exactly from then on).
    events_seen: dashmap::DashSet<WorkerId>,
    /// When a worker's events stop being trusted.
    trust_settings: TrustSettings,
    /// What registrations may claim: a predicted cache's capacity.
    limits: RegistryLimits,
    clock: Clock,
    metrics: Arc<Metrics>,
}

/// The inputs of one decision: the model's workers, and each target's
/// overlap and cached blocks on the view it is scored on.
pub(super) struct Inputs {
    pub(super) workers: Arc<[WorkerSnapshot]>,
    pub(super) overlaps: RankMap<u32>,
    /// The tier split of overlaps partly below the device (exact view only).
    pub(super) tier_overlaps: RankMap<TierBlocks>,
    pub(super) cached_blocks: RankMap<u64>,
    /// Targets scored on their predicted cache, and why (the rest: exact).
    predicted: RankMap<CacheView>,
    /// The prompt's prefix keys, when some target is predicted.
    chain: Vec<u64>,
    /// The exact index's own overlap of blended targets (their `overlaps`
    /// entry is the blend).
    index_overlaps: RankMap<u32>,
}

impl Inputs {
    /// The view `target` was scored on.
    pub(super) fn view(&self, target: WorkerRank) -> CacheView {
        self.predicted.get(&target).copied().unwrap_or_default()
    }

    /// The exact index's overlap of a target, if it sends events.
    fn index_overlap(&self, target: WorkerRank) -> Option<u32> {
        match self.view(target) {
            CacheView::Exact => Some(self.overlaps.get(&target).copied().unwrap_or(0)),
            CacheView::Blended(_) => Some(self.index_overlaps.get(&target).copied().unwrap_or(0)),
            CacheView::Predicted(_) => None,
        }
    }
}

impl CacheViews {
    pub(super) fn new(config: &RouterConfig, metrics: Arc<Metrics>, clock: Clock) -> Self {
        Self {
            predictions: RwLock::new(PredictedCaches::new(config.prediction_ttl.map(millis))),
            trust: RwLock::new(TrustBook::default()),
            feedback: Mutex::new(FeedbackBook::default()),
            events_seen: dashmap::DashSet::new(),
            trust_settings: config.trust,
            limits: config.registry_limits,
            clock,
            metrics,
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

    /// Whether a worker registered with `mode` is scored on events (EXACT,
    /// or AUTO once they came): only such a worker can owe events or be
    /// untrusted.
    pub(super) fn sends_events(&self, mode: KvEventsMode, worker_id: WorkerId) -> bool {
        self.predicted_because(mode, worker_id).is_none()
    }

    /// Which view of its cache `worker` is scored on now, and why.
    pub(super) fn view_of(&self, worker: &WorkerSnapshot) -> CacheView {
        self.view_with(worker, &self.trust.read())
    }

    /// [`Self::view_of`] with the trust book already read (a decision
    /// reads it once for every candidate).
    fn view_with(&self, worker: &WorkerSnapshot, trust: &TrustBook) -> CacheView {
        match self.predicted_because(worker.kv_events, worker.worker_id) {
            Some(why) => CacheView::Predicted(why),
            None => trust
                .distrust(worker.worker_id)
                .map_or(CacheView::Exact, CacheView::Blended),
        }
    }

    /// The inputs of a decision on `model` for a prompt of `hashes`: the
    /// index's overlaps and cached blocks, with those of every target
    /// scored on predictions taken from its predicted cache, read through
    /// the chained hashes of the prompt's blocks (blended targets: the
    /// larger of the two).
    pub(super) fn inputs(&self, model: &ModelView, hashes: &[LocalHash]) -> Inputs {
        let workers = model.workers().clone();
        let found = model.index_overlaps(hashes);
        let (mut overlaps, mut tier_overlaps, mut cached_blocks) =
            (found.overlaps, found.tiers, found.cached_blocks);
        let mut predicted = RankMap::default();
        let trust = self.trust.read();
        for worker in workers.iter() {
            let view = self.view_with(worker, &trust);
            if view.reads_predictions() {
                predicted.extend(
                    worker
                        .ranks()
                        .map(|r| (WorkerRank::new(worker.worker_id, r), view)),
                );
            }
        }
        drop(trust);
        let mut chain = Vec::new();
        let mut index_overlaps = RankMap::default();
        if !predicted.is_empty() {
            chain = admission::bookings::prefix_keys(hashes);
            let now_ms = self.clock.now_ms();
            let predictions = self.predictions.read();
            for &target in predicted.keys() {
                let mut blocks = predictions.overlap(target, &chain, now_ms);
                let mut held = predictions.blocks(target);
                if let Some(CacheView::Blended(_)) = predicted.get(&target) {
                    // The index up to the trouble, the predictions since.
                    let index = overlaps.get(&target).copied().unwrap_or(0);
                    index_overlaps.insert(target, index);
                    blocks = blocks.max(index);
                    held = held.max(cached_blocks.get(&target).copied().unwrap_or(0));
                }
                if blocks > overlaps.get(&target).copied().unwrap_or(0) {
                    // Predictions know no tiers: the prefix is the device's.
                    tier_overlaps.remove(&target);
                }
                match blocks {
                    0 => overlaps.remove(&target),
                    blocks => overlaps.insert(target, blocks),
                };
                cached_blocks.insert(target, held);
            }
        }
        Inputs {
            workers,
            overlaps,
            tier_overlaps,
            cached_blocks,
            predicted,
            chain,
            index_overlaps,
        }
    }

    /// Notes that events of `worker_id` arrived: an AUTO worker is scored
    /// on the exact index from now on, its predictions dropped, and trust
    /// learns the worker is not behind.
    pub(super) fn note_events(&self, worker_id: WorkerId) {
        if !self.events_seen.contains(&worker_id) {
            // Under the predictions lock, so a booking racing with this
            // sees either the mark or its prediction forgotten.
            let mut predictions = self.predictions.write();
            self.events_seen.insert(worker_id);
            predictions.forget_worker(worker_id);
        }
        let now_ms = self.clock.now_ms();
        if self.trust.read().events_change(worker_id, now_ms) {
            self.trust.write().note_events(worker_id, now_ms);
        }
    }

    /// Notes whether a rank's PublishEvents stream has an unhealed gap.
    pub(super) fn note_gap(&self, target: WorkerRank, open: bool) {
        if self.trust.read().gap_changes(target, open) {
            let now_ms = self.clock.now_ms();
            self.trust.write().note_gap(target, open, now_ms);
        }
    }

    /// Notes whether a worker's engine subscription is connected.
    pub(super) fn note_subscription(&self, worker_id: WorkerId, connected: bool) {
        let now_ms = self.clock.now_ms();
        self.trust
            .write()
            .note_subscription(worker_id, connected, now_ms);
    }

    /// A prefill booked at `booked_ms` that computed new blocks completed
    /// on `worker_id` (`TrustBook::note_prefill_completed`).
    pub(super) fn note_prefill_completed(&self, worker_id: WorkerId, booked_ms: u64, now_ms: u64) {
        self.trust
            .write()
            .note_prefill_completed(worker_id, booked_ms, now_ms);
    }

    /// Downgrades exact workers whose stream has been in trouble past a
    /// deadline and recovers those whose trouble is over (`trust.rs`);
    /// each change is logged and counted once. `sends_events` says whether
    /// a worker is scored on events (it reads the registry).
    pub(super) fn evaluate_trust(&self, sends_events: impl Fn(WorkerId) -> bool) {
        let now_ms = self.clock.now_ms();
        let (changes, untrusted) = {
            let mut book = self.trust.write();
            let changes = book.evaluate(&self.trust_settings, now_ms);
            (changes, book.untrusted_count())
        };
        for change in changes {
            let (worker_id, why, label) = match change {
                TrustChange::Downgraded(w, why) => {
                    tracing::warn!(
                        worker_id = w,
                        reason = why.label(),
                        "KV events untrusted: scoring the worker on its index blended with predictions"
                    );
                    (w, why, "downgraded")
                }
                TrustChange::Recovered(w, why) => {
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
            if sends_events(worker_id) {
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

    /// Holds a booked prompt (its prefix keys) for `target` of `worker`
    /// until its prefill completes, if the worker is scored on
    /// predictions now (`kvroute_core::predict`), at the worker's capacity.
    pub(super) fn hold(
        &self,
        request_id: &str,
        target: WorkerRank,
        worker: &WorkerSnapshot,
        keys: Vec<u64>,
        now_ms: u64,
    ) {
        let capacity = self.limits.rank_capacity(worker.total_kv_blocks);
        let mut predictions = self.predictions.write();
        // An AUTO worker's first event may have come since the caller
        // looked; `note_events` marks it under this same lock.
        if self.view_of(worker).reads_predictions() {
            predictions.hold(request_id, target, keys, capacity, now_ms);
        }
    }

    /// Holds a booked prompt for its target, when the decision scored the
    /// target on its predicted cache: recorded at MarkPrefillComplete, or
    /// at Release if that comes first (`kvroute_core::predict`).
    pub(super) fn hold_booked(
        &self,
        request_id: &str,
        inputs: &Inputs,
        target: WorkerRank,
        now_ms: u64,
    ) {
        if !inputs.view(target).reads_predictions() {
            return;
        }
        if let Some(worker) = inputs
            .workers
            .iter()
            .find(|w| w.worker_id == target.worker_id)
        {
            self.hold(request_id, target, worker, inputs.chain.clone(), now_ms);
        }
    }

    /// Records a request's held prompt as cached, if one is held
    /// (prefill complete, or released first).
    pub(super) fn settle(&self, request_id: &str, now_ms: u64) {
        self.predictions.write().settle(request_id, now_ms);
    }

    /// Blocks `target` is predicted to hold (0 for targets scored exactly).
    pub(super) fn predicted_blocks(&self, target: WorkerRank) -> u64 {
        self.predictions.read().blocks(target)
    }

    /// Blocks predicted over every target.
    pub(super) fn predicted_blocks_total(&self) -> u64 {
        self.predictions.read().total_blocks()
    }

    /// Leaves what the booked request's engine should report cached
    /// (`feedback.rs`).
    pub(super) fn expect_report(
        &self,
        request: &SelectRequest,
        inputs: &Inputs,
        selection: &Selection,
        now_ms: u64,
    ) {
        let tokens = |blocks: u32| {
            (u64::from(blocks) * u64::from(request.block_size)).min(request.prompt_tokens)
        };
        let target = selection.target;
        self.feedback.lock().expect(
            &request.request_id,
            Expectation {
                target,
                prompt_tokens: request.prompt_tokens,
                block_size: request.block_size,
                scored_tokens: selection.cached_tokens,
                index_tokens: inputs.index_overlap(target).map(tokens),
                view: inputs.view(target),
                booked_ms: now_ms,
            },
        );
    }

    /// Drops a request's expectation (released without a report).
    pub(super) fn forget_expectation(&self, request_id: &str) {
        self.feedback.lock().forget(request_id);
    }

    /// Takes the cached tokens an engine reported for a request and
    /// compares them with what was predicted (`feedback.rs`); a persistent
    /// contradiction of an exact worker's index makes it untrusted at the
    /// next evaluation, unless `registered` says the worker has left.
    pub(super) fn report_cached_tokens(
        &self,
        request_id: &str,
        cached_tokens: u64,
        registered: impl Fn(WorkerId) -> bool,
    ) {
        let (outcome, series) = {
            let mut book = self.feedback.lock();
            let outcome = book.report(request_id, cached_tokens);
            let series = match outcome {
                ReportOutcome::Recorded { worker_id, .. } => book.series_label(worker_id),
                _ => String::new(),
            };
            (outcome, series)
        };
        let label = match outcome {
            ReportOutcome::Unknown => "unknown",
            ReportOutcome::Implausible => "implausible",
            ReportOutcome::Recorded {
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
                if registered(worker_id) {
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

    /// A worker's cached-token reports so far, if any.
    pub(super) fn feedback_of(&self, worker_id: WorkerId) -> Option<WorkerFeedback> {
        self.feedback.lock().worker(worker_id).cloned()
    }

    /// A worker (re-)registered: what it held, whether it sent events and
    /// how its stream went are of a previous registration it `invalidated`;
    /// an exact worker is never scored on predictions.
    pub(super) fn registered(&self, registration: &Registration, invalidated: bool) {
        let worker_id = registration.worker_id;
        if invalidated {
            self.events_seen.remove(&worker_id);
            self.trust.write().forget_worker(worker_id);
            self.forget_feedback(worker_id);
        }
        if invalidated || registration.kv_events == KvEventsMode::Exact {
            self.predictions.write().forget_worker(worker_id);
        }
    }

    /// Forgets everything of a worker that left.
    pub(super) fn forget_worker(&self, worker_id: WorkerId) {
        self.predictions.write().forget_worker(worker_id);
        self.events_seen.remove(&worker_id);
        self.trust.write().forget_worker(worker_id);
        self.forget_feedback(worker_id);
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

    /// Ages predictions out at `now_ms`, and drops held prompts and
    /// expectations of bookings made before `cutoff_ms`.
    pub(super) fn expire(&self, now_ms: u64, cutoff_ms: u64) {
        let mut predictions = self.predictions.write();
        predictions.expire(now_ms);
        predictions.expire_pending(cutoff_ms);
        drop(predictions);
        self.feedback.lock().expire(cutoff_ms);
    }
}
