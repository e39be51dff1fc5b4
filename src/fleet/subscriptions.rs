//! The service's engine-native KV event subscriptions: which workers kvroute
//! follows over ZeroMQ, and what each one reports (Prometheus series bound
//! while it runs, the one-line summary of Admin `GetWorker`).
//!
//! Why this exists: `engine_events` knows how to follow one engine's
//! publisher; the fleet decides *when* (a `kvroute serve --engine` setting,
//! or `RegisterWorker` with an `events_endpoint`) and stops it when the
//! worker goes (deregistration, lapsed lease, shutdown), always in the
//! worker's lifecycle turn, so this module's check-then-act across awaits
//! never races another operation on the same worker. Every subscription
//! task is spawned on this module's `TaskTracker`, which the fleet's
//! shutdown waits for.
//!
//! Events go through [`IngestSink`]: one `EngineBatch` job per engine batch
//! and rank, awaited before the next, so per-rank order holds and the
//! writer's registration-generation check drops events of a worker that was
//! re-registered or removed meanwhile.

use std::{collections::HashMap, sync::Arc};

use futures::future::BoxFuture;
use parking_lot::Mutex;
use tokio_util::{sync::CancellationToken, task::TaskTracker};

use crate::{
    engine_events::{
        EngineSource, EventSink, MetricsSnapshot, ResumePoint, SinkOutcome, WorkerEventMetrics,
        WorkerSubscription, dialect_name, spawn_worker,
    },
    ingest::{EngineBatch, IngestError, IngestHandle},
    metrics::Metrics,
};
use kvroute_core::{
    index::TieredEvent,
    registry::WorkerRecord,
    types::{DpRank, WorkerId, WorkerRank},
};

/// Where a subscription's batches go instead of the local writer: cluster
/// mode appends them to the shared log, which every replica's writer then
/// applies (`crate::cluster`). `sequence` is the engine's batch sequence.
pub trait EngineForward: Send + Sync + 'static {
    fn forward(&self, batch: EngineBatch, sequence: u64) -> BoxFuture<'_, SinkOutcome>;
}

/// The [`EventSink`] of one registration: the ingest writer (or the
/// forward, when set), with the generation the subscription was started
/// for.
pub struct IngestSink {
    ingest: IngestHandle,
    forward: Option<Arc<dyn EngineForward>>,
    worker_id: WorkerId,
    generation: u64,
    model: String,
}

impl IngestSink {
    async fn send(
        &self,
        target: WorkerRank,
        sequence: u64,
        events: Vec<TieredEvent>,
    ) -> SinkOutcome {
        let batch = EngineBatch {
            worker_id: self.worker_id,
            generation: self.generation,
            model: self.model.clone(),
            dp_rank: target.dp_rank,
            events,
        };
        if let Some(forward) = &self.forward {
            return forward.forward(batch, sequence).await;
        }
        match self.ingest.apply_engine(batch).await {
            Ok(outcome) => {
                if let Some(rejection) = &outcome.first_rejection {
                    tracing::debug!(%target, %rejection, rejected = outcome.rejected, "engine events rejected");
                }
                SinkOutcome {
                    applied: outcome.applied,
                    rejected: outcome.rejected,
                }
            }
            // The subscription is being stopped with its registration.
            Err(error @ IngestError::WorkerGone { .. }) => {
                tracing::debug!(%target, %error, "engine events dropped");
                SinkOutcome::default()
            }
            Err(error) => {
                tracing::warn!(%target, %error, "engine events dropped");
                SinkOutcome::default()
            }
        }
    }
}

impl EventSink for IngestSink {
    fn apply(
        &self,
        target: WorkerRank,
        sequence: u64,
        events: Vec<TieredEvent>,
    ) -> BoxFuture<'_, SinkOutcome> {
        Box::pin(self.send(target, sequence, events))
    }

    fn clear(&self, target: WorkerRank, sequence: u64) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let clear = TieredEvent::device(kvroute_core::index::KvEvent::Cleared);
            self.send(target, sequence, vec![clear]).await;
        })
    }
}

struct Running {
    source: EngineSource,
    generation: u64,
    /// Started from `kvroute serve --engine`: its lease is renewed while it runs.
    configured: bool,
    ranks: u32,
    subscription: WorkerSubscription,
    metrics: Arc<WorkerEventMetrics>,
}

/// Every running subscription of the service.
pub struct Subscriptions {
    ingest: IngestHandle,
    /// Set in cluster mode (see [`EngineForward`]).
    forward: Mutex<Option<Arc<dyn EngineForward>>>,
    metrics: Arc<Metrics>,
    tracker: TaskTracker,
    stop_all: CancellationToken,
    running: Mutex<HashMap<WorkerId, Running>>,
    /// Largest engine message decoded (`InputLimits::max_engine_message_bytes`).
    max_message_bytes: usize,
}

impl std::fmt::Debug for Subscriptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscriptions").finish_non_exhaustive()
    }
}

impl Subscriptions {
    /// Decode engine messages of at most `bytes`.
    pub(crate) fn with_max_message_bytes(mut self, bytes: usize) -> Self {
        self.max_message_bytes = bytes;
        self
    }

    pub(crate) fn new(ingest: IngestHandle, metrics: Arc<Metrics>) -> Self {
        Self {
            ingest,
            forward: Mutex::new(None),
            metrics,
            tracker: TaskTracker::new(),
            stop_all: CancellationToken::new(),
            running: Mutex::new(HashMap::new()),
            max_message_bytes: crate::engine_events::DEFAULT_MAX_MESSAGE_BYTES,
        }
    }

    /// Sends the batches of subscriptions started from now on to `forward`
    /// instead of the local writer (cluster mode, set before any starts).
    pub(crate) fn set_forward(&self, forward: Arc<dyn EngineForward>) {
        *self.forward.lock() = Some(forward);
    }

    /// Whether `worker_id` was configured by `kvroute serve --engine` (and
    /// still runs).
    pub(crate) fn is_configured(&self, worker_id: WorkerId) -> bool {
        self.running
            .lock()
            .get(&worker_id)
            .is_some_and(|r| r.configured)
    }

    /// Makes the worker's subscription match its registration `record` and
    /// `source` (the caller holds the worker's lifecycle turn, so nothing
    /// else starts or stops this worker's subscription meanwhile): keeps one
    /// that already matches, otherwise stops the old one (its blocks came
    /// from a publisher kvroute no longer follows, so they are dropped) and
    /// starts the new one; `None` only stops. A subscription it starts
    /// carries on from saved state: each dp rank in `resume.sequences` from its last applied engine
    /// sequence (the batches after it are replayed from the engine's replay
    /// socket, as any gap is), the ranks in `resume.unsynced` start
    /// unsynced, and salted blocks keep their salts. What
    /// [`Self::resume_point`] returned before a restart. A subscription that already runs and
    /// matches is kept as it is (it is live, and ahead of any saved state).
    pub(crate) async fn update_resuming(
        &self,
        record: &WorkerRecord,
        source: Option<EngineSource>,
        configured: bool,
        resume: ResumePoint,
    ) -> Result<(), String> {
        let r = &record.registration;
        let worker_id = r.worker_id;
        let unchanged = self.running.lock().get(&worker_id).is_some_and(|old| {
            Some(&old.source) == source.as_ref() && old.generation == record.generation
        });
        if unchanged {
            return Ok(());
        }
        if self.stop(worker_id).await {
            let removed = self.ingest.remove_worker(worker_id, r.model.clone()).await;
            tracing::info!(
                worker_id,
                removed,
                "engine event source changed: blocks dropped"
            );
        }
        let Some(source) = source else {
            return Ok(());
        };
        let mut cfg = source.events_config(
            worker_id,
            &r.model,
            r.block_size,
            r.dp_start_rank,
            r.dp_size,
        )?;
        cfg.max_message_bytes = self.max_message_bytes;
        // SGLang's events name an adapter by id only.
        cfg.lora_names = r.adapters.iter().map(|a| (a.id, a.name.clone())).collect();
        cfg.resume_from = resume.sequences;
        cfg.resume_unsynced = resume.unsynced;
        cfg.resume_salts = resume.salts;
        let sink = Arc::new(IngestSink {
            ingest: self.ingest.clone(),
            forward: self.forward.lock().clone(),
            worker_id,
            generation: record.generation,
            model: r.model.clone(),
        });
        let metrics = Arc::new(WorkerEventMetrics::bound(&self.metrics.engine, worker_id));
        let subscription = spawn_worker(
            cfg,
            sink,
            metrics.clone(),
            self.stop_all.child_token(),
            &self.tracker,
        )
        .map_err(|e| {
            WorkerEventMetrics::unbind(&self.metrics.engine, worker_id);
            e.to_string()
        })?;
        tracing::info!(
            worker_id,
            dialect = dialect_name(source.dialect),
            endpoint = %source.endpoint,
            replay = ?source.replay_endpoint,
            configured,
            "engine event subscription started"
        );
        self.running.lock().insert(
            worker_id,
            Running {
                source,
                generation: record.generation,
                configured,
                ranks: r.dp_size.max(1),
                subscription,
                metrics,
            },
        );
        Ok(())
    }

    /// Counts events of `worker_id`'s subscription (started for
    /// `generation`) that the index refused where they were applied later:
    /// cluster mode applies them from the shared log.
    pub(crate) fn count_index_rejected(&self, worker_id: WorkerId, generation: u64, rejected: u32) {
        if let Some(running) = self
            .running
            .lock()
            .get(&worker_id)
            .filter(|r| r.generation == generation)
        {
            WorkerEventMetrics::add(&running.metrics.index_rejected, u64::from(rejected));
        }
    }

    /// Stops a worker's subscription and waits for its tasks; returns whether
    /// it had one. Its metric series are removed.
    pub(crate) async fn stop(&self, worker_id: WorkerId) -> bool {
        let Some(running) = self.running.lock().remove(&worker_id) else {
            return false;
        };
        running.subscription.shutdown().await;
        WorkerEventMetrics::unbind(&self.metrics.engine, worker_id);
        tracing::info!(worker_id, "engine event subscription stopped");
        true
    }

    /// The engine a worker's subscription follows, and whether it was
    /// started from `kvroute serve --engine`.
    pub(crate) fn source_of(&self, worker_id: WorkerId) -> Option<(EngineSource, bool)> {
        self.running
            .lock()
            .get(&worker_id)
            .map(|r| (r.source.clone(), r.configured))
    }

    /// The workers started from `kvroute serve --engine`: they have no one
    /// to heartbeat for them, so the fleet renews their leases.
    pub(crate) fn configured_ids(&self) -> Vec<WorkerId> {
        self.running
            .lock()
            .iter()
            .filter(|(_, r)| r.configured)
            .map(|(id, _)| *id)
            .collect()
    }

    /// A one-line summary of a worker's subscription, empty when it has none,
    /// e.g. `vllm tcp://10.0.0.5:5557 connected, last seq 812, 3 gaps,
    /// 2 replays, last event 0.4s ago`; ranks whose blocks may differ from
    /// the engine's cache show as `unsynced [0, 2]`.
    pub(crate) fn summary(&self, worker_id: WorkerId) -> String {
        let running = self.running.lock();
        let Some(r) = running.get(&worker_id) else {
            return String::new();
        };
        summarize(
            r,
            &r.subscription.metrics().snapshot(),
            &r.subscription.unsynced_ranks(),
        )
    }

    #[cfg(test)]
    /// Each dp rank's last applied engine sequence in a worker's
    /// subscription, ascending by rank (ranks with nothing applied left
    /// out); `None` when the worker has no subscription. A snapshot saves
    /// it, read before the index (see
    /// [`WorkerSubscription::last_sequences`]), and gives it back to
    /// [`Self::update_resuming`] after a restart.
    pub(crate) fn last_sequences(&self, worker_id: WorkerId) -> Option<Vec<(DpRank, u64)>> {
        self.running
            .lock()
            .get(&worker_id)
            .map(|r| r.subscription.last_sequences())
    }

    /// Where a worker's subscription would carry on from after a restart:
    /// each rank's last applied sequence, its unsynced ranks and the salts
    /// of its salted blocks. Read before the index (see
    /// [`WorkerSubscription::last_sequences`]).
    pub(crate) fn resume_point(&self, worker_id: WorkerId) -> ResumePoint {
        let running = self.running.lock();
        let Some(r) = running.get(&worker_id) else {
            return ResumePoint::default();
        };
        ResumePoint {
            sequences: r.subscription.last_sequences().into_iter().collect(),
            unsynced: r.subscription.unsynced_ranks(),
            salts: r.subscription.salts().into_iter().collect(),
        }
    }

    #[cfg(test)]
    /// The dp ranks of a worker's subscription whose blocks may differ from
    /// the engine's cache (see `engine_events::sequence`), ascending; empty
    /// when it has no subscription.
    pub(crate) fn unsynced_ranks(&self, worker_id: WorkerId) -> Vec<DpRank> {
        self.running
            .lock()
            .get(&worker_id)
            .map(|r| r.subscription.unsynced_ranks())
            .unwrap_or_default()
    }

    /// Each subscribed worker's stream health: whether every rank is
    /// connected, and its ranks whose events were lost for good (unsynced).
    pub(crate) fn stream_health(&self) -> Vec<(WorkerId, bool, Vec<DpRank>)> {
        self.running
            .lock()
            .iter()
            .map(|(&worker_id, r)| {
                let m = r.subscription.metrics().snapshot();
                let connected = m.connects.saturating_sub(m.disconnects) >= u64::from(r.ranks);
                (worker_id, connected, r.subscription.unsynced_ranks())
            })
            .collect()
    }

    /// Sets each subscription's last-batch age gauge from the clock (the
    /// counters need nothing: they count into Prometheus directly).
    pub(crate) fn refresh_ages(&self) {
        for r in self.running.lock().values() {
            r.subscription.metrics().refresh_age();
        }
    }

    /// Subscription tasks still running (tests).
    #[cfg(test)]
    pub(super) fn tracker_len(&self) -> usize {
        self.tracker.len()
    }

    /// Stops every subscription and waits for all their tasks.
    pub(crate) async fn shutdown(&self) {
        self.stop_all.cancel();
        let ids: Vec<WorkerId> = self.running.lock().keys().copied().collect();
        for id in ids {
            self.stop(id).await;
        }
        self.tracker.close();
        self.tracker.wait().await;
    }
}

fn summarize(r: &Running, m: &MetricsSnapshot, unsynced: &[DpRank]) -> String {
    let connected = m.connects.saturating_sub(m.disconnects);
    let state = if connected >= u64::from(r.ranks) {
        "connected".to_string()
    } else if r.ranks > 1 && connected > 0 {
        format!("{connected}/{} ranks connected", r.ranks)
    } else if m.connects == 0 && m.connect_failures > 0 {
        format!("connecting ({} failed attempts)", m.connect_failures)
    } else if m.connects == 0 {
        "connecting".to_string()
    } else {
        "disconnected, reconnecting".to_string()
    };
    let mut parts = vec![format!(
        "{} {} {state}",
        dialect_name(r.source.dialect),
        r.source.endpoint
    )];
    parts.push(match m.last_seq {
        Some(seq) => format!("last seq {seq}"),
        None => "no events yet".to_string(),
    });
    let plural = |n: u64, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
    parts.push(plural(m.gaps, "gap", "gaps"));
    parts.push(plural(m.replays_requested, "replay", "replays"));
    if r.source.replay_endpoint.is_none() {
        parts.push("no replay endpoint".to_string());
    }
    if m.batches_lost > 0 {
        parts.push(plural(m.batches_lost, "batch lost", "batches lost"));
    }
    if m.restarts > 0 {
        parts.push(plural(m.restarts, "restart", "restarts"));
    }
    if m.skipped_duplicates > 0 {
        parts.push(plural(m.skipped_duplicates, "duplicate", "duplicates"));
    }
    if m.skipped_jumps > 0 {
        parts.push(plural(m.skipped_jumps, "sequence jump", "sequence jumps"));
    }
    if !unsynced.is_empty() {
        parts.push(format!("unsynced {unsynced:?}"));
    }
    let errors = m.decode_errors_total();
    if errors > 0 {
        parts.push(plural(errors, "decode error", "decode errors"));
    }
    if let Some(age) = m.last_event_age {
        parts.push(format!("last event {:.1}s ago", age.as_secs_f64()));
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        engine_events::Dialect,
        ingest::{EventWriter, start_writer},
        router::{RouterConfig, RouterCore},
    };
    use kvroute_core::{registry::Registration, types::WorkerRole};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_resumed_subscription_reports_its_saved_state_until_stopped() {
        let metrics = Metrics::new().unwrap_or_else(|e| panic!("metrics: {e}"));
        let router = Arc::new(RouterCore::new(RouterConfig::default(), metrics.clone()));
        let ingest = start_writer(Arc::new(EventWriter::new(router.clone())))
            .unwrap_or_else(|e| panic!("writer: {e}"));
        let subscriptions = Subscriptions::new(ingest, metrics.clone());
        let record = router
            .register_worker(Registration {
                tiers: Vec::new(),
                worker_id: 7,
                model: "m".into(),
                role: WorkerRole::Aggregated,
                endpoint: String::new(),
                block_size: 16,
                dp_start_rank: 0,
                dp_size: 2,
                total_kv_blocks: 0,
                max_num_batched_tokens: 8192,
                taints: Vec::new(),
                adapters: Vec::new(),
                loads_adapters: false,
                lease_ttl: None,
                kv_events: kvroute_core::types::KvEventsMode::Exact,
            })
            .unwrap_or_else(|e| panic!("register: {e}"))
            .record;
        // Nothing listens there: the subscription keeps retrying, and reports
        // what it resumed from.
        let source = EngineSource {
            dialect: Dialect::Vllm,
            endpoint: "tcp://127.0.0.1:9".into(),
            replay_endpoint: None,
        };
        let saved = ResumePoint {
            sequences: HashMap::from([(0, 41), (1, 7), (5, 3)]),
            unsynced: vec![1],
            ..ResumePoint::default()
        };
        subscriptions
            .update_resuming(&record, Some(source), false, saved)
            .await
            .unwrap_or_else(|e| panic!("update: {e}"));
        assert_eq!(subscriptions.last_sequences(7), Some(vec![(0, 41), (1, 7)]));
        assert_eq!(subscriptions.unsynced_ranks(7), vec![1]);
        let summary = subscriptions.summary(7);
        assert!(summary.contains(", unsynced [1]"), "{summary}");
        let gauge = r#"kvroute_engine_event_unsynced_ranks{worker="7"} 1"#;
        assert!(metrics.render().contains(gauge), "{}", metrics.render());
        assert_eq!(subscriptions.last_sequences(8), None);

        assert!(subscriptions.stop(7).await);
        assert_eq!(subscriptions.last_sequences(7), None);
        assert!(subscriptions.unsynced_ranks(7).is_empty());
        assert!(!metrics.render().contains("engine_event_unsynced_ranks{"));
        subscriptions.shutdown().await;
    }
}
