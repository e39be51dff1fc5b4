//! The service's engine-native KV event subscriptions: which workers kvroute
//! subscribes to over ZeroMQ, started, restarted and stopped with their
//! registration, and what each one reports (Prometheus, Admin `GetWorker`).
//!
//! Why this exists: `engine_events` knows how to follow one engine's
//! publisher; the service must decide *when* (a `kvroute serve --engine`
//! setting, or `RegisterWorker` with an `events_endpoint`), stop it when the
//! worker goes (deregistration, lapsed lease, shutdown) and route its events
//! through the index's one writer. Every subscription task is spawned on
//! this module's `TaskTracker`, which `app::run` waits for at shutdown.
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
    core::RouterCore,
    engine_events::{
        Dialect, EngineEventsConfig, EventSink, MetricsSnapshot, SinkOutcome, WorkerSubscription,
        spawn_worker,
    },
    index::KvEvent,
    ingest::{EngineBatch, IngestError, IngestHandle},
    metrics::Metrics,
    registry::WorkerRecord,
    types::{WorkerId, WorkerRank},
};

/// Where and how a worker's engine publishes its KV events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineSource {
    pub dialect: Dialect,
    /// PUB endpoint as configured in the engine (rank 0's; rank `r` listens
    /// on the port plus `r`).
    pub endpoint: String,
    /// The engine's replay (ROUTER) endpoint, offset the same way.
    pub replay_endpoint: Option<String>,
}

impl EngineSource {
    /// Reads the three `RegisterWorkerRequest` fields: `None` when no events
    /// endpoint is given, an error message naming the field otherwise.
    pub fn from_fields(
        endpoint: &str,
        dialect: &str,
        replay: &str,
    ) -> Result<Option<Self>, String> {
        if endpoint.is_empty() {
            if !dialect.is_empty() || !replay.is_empty() {
                return Err(
                    "events_dialect and replay_endpoint need an events_endpoint".to_string()
                );
            }
            return Ok(None);
        }
        check_endpoint("events_endpoint", endpoint)?;
        let dialect = parse_dialect(dialect)?;
        let replay_endpoint = if replay.is_empty() {
            None
        } else {
            check_endpoint("replay_endpoint", replay)?;
            Some(replay.to_string())
        };
        Ok(Some(Self {
            dialect,
            endpoint: endpoint.to_string(),
            replay_endpoint,
        }))
    }

    /// The subscriber's configuration for a worker with these ranks; an
    /// error when a rank's endpoint cannot be derived (e.g. `ipc://` with
    /// several ranks) or the layout is unusable.
    pub fn events_config(
        &self,
        worker_id: WorkerId,
        model: &str,
        block_size: u32,
        dp_start_rank: u32,
        dp_size: u32,
    ) -> Result<EngineEventsConfig, String> {
        let mut cfg = EngineEventsConfig::new(
            worker_id,
            model,
            block_size,
            self.endpoint.clone(),
            self.dialect,
        );
        cfg.replay_endpoint = self.replay_endpoint.clone();
        let end = dp_start_rank
            .checked_add(dp_size.max(1))
            .ok_or_else(|| "dp_start_rank + dp_size overflows".to_string())?;
        cfg.dp_ranks = (dp_start_rank..end).collect();
        cfg.validate().map_err(|e| e.to_string())?;
        Ok(cfg)
    }
}

/// `vllm` or `sglang` (any case).
pub fn parse_dialect(text: &str) -> Result<Dialect, String> {
    match text.to_ascii_lowercase().as_str() {
        "vllm" => Ok(Dialect::Vllm),
        "sglang" => Ok(Dialect::Sglang),
        "" => Err("events_dialect is required with an events_endpoint: vllm or sglang".into()),
        other => Err(format!(
            "events_dialect {other:?} is not supported: use vllm or sglang"
        )),
    }
}

fn dialect_name(dialect: Dialect) -> &'static str {
    match dialect {
        Dialect::Vllm => "vllm",
        Dialect::Sglang => "sglang",
    }
}

/// A ZeroMQ endpoint kvroute can connect to: `tcp://HOST:PORT` or
/// `ipc://PATH`.
pub fn check_endpoint(field: &str, endpoint: &str) -> Result<(), String> {
    if let Some(rest) = endpoint.strip_prefix("tcp://") {
        let ok = rest.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty() && host != "*" && port.parse::<u16>().is_ok_and(|p| p > 0)
        });
        if ok {
            return Ok(());
        }
        return Err(format!(
            "{field} {endpoint:?}: expected tcp://HOST:PORT with a connectable host and a port 1-65535"
        ));
    }
    if let Some(path) = endpoint.strip_prefix("ipc://") {
        if !path.is_empty() {
            return Ok(());
        }
        return Err(format!("{field} {endpoint:?}: ipc:// needs a socket path"));
    }
    Err(format!(
        "{field} {endpoint:?}: only tcp://HOST:PORT and ipc://PATH endpoints are supported"
    ))
}

/// The [`EventSink`] of one registration: the ingest writer, with the
/// generation the subscription was started for.
pub struct IngestSink {
    ingest: IngestHandle,
    worker_id: WorkerId,
    generation: u64,
    model: String,
}

impl IngestSink {
    async fn send(&self, target: WorkerRank, events: Vec<KvEvent>) -> SinkOutcome {
        let batch = EngineBatch {
            worker_id: self.worker_id,
            generation: self.generation,
            model: self.model.clone(),
            dp_rank: target.dp_rank,
            events,
        };
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
    fn apply(&self, target: WorkerRank, events: Vec<KvEvent>) -> BoxFuture<'_, SinkOutcome> {
        Box::pin(self.send(target, events))
    }

    fn clear(&self, target: WorkerRank) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            self.send(target, vec![KvEvent::Cleared]).await;
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
    /// What the Prometheus counters last got (they take deltas).
    exported: MetricsSnapshot,
}

/// Every running subscription of the service.
pub struct Subscriptions {
    ingest: IngestHandle,
    metrics: Arc<Metrics>,
    tracker: TaskTracker,
    stop_all: CancellationToken,
    running: Mutex<HashMap<WorkerId, Running>>,
}

impl std::fmt::Debug for Subscriptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscriptions").finish_non_exhaustive()
    }
}

impl Subscriptions {
    pub fn new(ingest: IngestHandle, metrics: Arc<Metrics>) -> Arc<Self> {
        Arc::new(Self {
            ingest,
            metrics,
            tracker: TaskTracker::new(),
            stop_all: CancellationToken::new(),
            running: Mutex::new(HashMap::new()),
        })
    }

    /// Whether `worker_id` was configured by `kvroute serve --engine` (and
    /// still runs).
    pub fn is_configured(&self, worker_id: WorkerId) -> bool {
        self.running
            .lock()
            .get(&worker_id)
            .is_some_and(|r| r.configured)
    }

    /// Makes the worker's subscription match its registration `record` and
    /// `source`: keeps one that already matches, otherwise stops the old one
    /// (its blocks came from a publisher kvroute no longer follows, so they
    /// are dropped) and starts the new one. `None` only stops.
    pub async fn update(
        &self,
        record: &WorkerRecord,
        source: Option<EngineSource>,
        configured: bool,
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
        let cfg = source.events_config(
            worker_id,
            &r.model,
            r.block_size,
            r.dp_start_rank,
            r.dp_size,
        )?;
        let sink = Arc::new(IngestSink {
            ingest: self.ingest.clone(),
            worker_id,
            generation: record.generation,
            model: r.model.clone(),
        });
        let subscription = spawn_worker(cfg, sink, self.stop_all.child_token(), &self.tracker)
            .map_err(|e| e.to_string())?;
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
                exported: MetricsSnapshot::default(),
            },
        );
        Ok(())
    }

    /// Stops a worker's subscription and waits for its tasks; returns whether
    /// it had one. Its metric series are removed.
    pub async fn stop(&self, worker_id: WorkerId) -> bool {
        let Some(running) = self.running.lock().remove(&worker_id) else {
            return false;
        };
        remove_series(&self.metrics, worker_id);
        running.subscription.shutdown().await;
        tracing::info!(worker_id, "engine event subscription stopped");
        true
    }

    /// Renews the leases of configured engines: they have no one to
    /// heartbeat for them, and stay registered while their subscription runs.
    pub fn renew_configured(&self, core: &RouterCore) {
        let ids: Vec<WorkerId> = self
            .running
            .lock()
            .iter()
            .filter(|(_, r)| r.configured)
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            if let Err(error) = core.heartbeat(id, &[]) {
                tracing::warn!(worker_id = id, %error, "configured engine lease not renewed");
            }
        }
    }

    /// A one-line summary of a worker's subscription, empty when it has none,
    /// e.g. `vllm tcp://10.0.0.5:5557 connected, last seq 812, 3 gaps,
    /// 2 replays, last event 0.4s ago`.
    pub fn summary(&self, worker_id: WorkerId) -> String {
        let running = self.running.lock();
        let Some(r) = running.get(&worker_id) else {
            return String::new();
        };
        summarize(r, &r.subscription.metrics().snapshot())
    }

    /// Brings the Prometheus families up to date with every subscription's
    /// counters (called before each scrape and by housekeeping).
    pub fn export_metrics(&self) {
        let mut running = self.running.lock();
        for (worker_id, r) in running.iter_mut() {
            let now = r.subscription.metrics().snapshot();
            export(&self.metrics, *worker_id, r.ranks, &r.exported, &now);
            r.exported = now;
        }
    }

    /// Stops every subscription and waits for all their tasks.
    pub async fn shutdown(&self) {
        self.stop_all.cancel();
        let ids: Vec<WorkerId> = self.running.lock().keys().copied().collect();
        for id in ids {
            self.stop(id).await;
        }
        self.tracker.close();
        self.tracker.wait().await;
    }
}

fn summarize(r: &Running, m: &MetricsSnapshot) -> String {
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
    let errors = m.decode_errors_total();
    if errors > 0 {
        parts.push(plural(errors, "decode error", "decode errors"));
    }
    if let Some(age) = m.last_event_age {
        parts.push(format!("last event {:.1}s ago", age.as_secs_f64()));
    }
    parts.join(", ")
}

const EVENT_KINDS: [&str; 3] = ["stored", "removed", "cleared"];
const IGNORED_REASONS: [&str; 3] = ["other_medium", "other_group", "index_rejected"];
const REPLAY_OUTCOMES: [&str; 2] = ["requested", "failed"];
const CONNECTION_EVENTS: [&str; 3] = ["connected", "disconnected", "failed"];

fn export(
    metrics: &Metrics,
    worker_id: WorkerId,
    ranks: u32,
    old: &MetricsSnapshot,
    now: &MetricsSnapshot,
) {
    let e = &metrics.engine;
    let w = worker_id.to_string();
    let add = |family: &prometheus::IntCounterVec, labels: &[&str], old: u64, now: u64| {
        // Always touch the series so it exists from the start (at 0).
        family
            .with_label_values(labels)
            .inc_by(now.saturating_sub(old));
    };
    add(&e.batches, &[&w], old.batches, now.batches);
    let kinds = |s: &MetricsSnapshot| [s.events_stored, s.events_removed, s.events_cleared];
    for ((kind, o), n) in EVENT_KINDS.iter().zip(kinds(old)).zip(kinds(now)) {
        add(&e.events, &[&w, kind], o, n);
    }
    let ignored = |s: &MetricsSnapshot| {
        [
            s.events_other_medium,
            s.events_other_group,
            s.index_rejected,
        ]
    };
    for ((reason, o), n) in IGNORED_REASONS.iter().zip(ignored(old)).zip(ignored(now)) {
        add(&e.ignored, &[&w, reason], o, n);
    }
    add(
        &e.rank_mismatch,
        &[&w],
        old.rank_mismatch,
        now.rank_mismatch,
    );
    add(&e.gaps, &[&w], old.gaps, now.gaps);
    add(&e.batches_lost, &[&w], old.batches_lost, now.batches_lost);
    let replays = |s: &MetricsSnapshot| [s.replays_requested, s.replay_failures];
    for ((outcome, o), n) in REPLAY_OUTCOMES.iter().zip(replays(old)).zip(replays(now)) {
        add(&e.replays, &[&w, outcome], o, n);
    }
    add(
        &e.replayed_batches,
        &[&w],
        old.replay_batches,
        now.replay_batches,
    );
    add(&e.restarts, &[&w], old.restarts, now.restarts);
    for (reason, n) in &now.decode_errors {
        let o = old
            .decode_errors
            .iter()
            .find(|(r, _)| r == reason)
            .map_or(0, |(_, o)| *o);
        add(&e.decode_errors, &[&w, reason], o, *n);
    }
    let conns = |s: &MetricsSnapshot| [s.connects, s.disconnects, s.connect_failures];
    for ((event, o), n) in CONNECTION_EVENTS.iter().zip(conns(old)).zip(conns(now)) {
        add(&e.connections, &[&w, event], o, n);
    }
    let connected = now
        .connects
        .saturating_sub(now.disconnects)
        .min(u64::from(ranks));
    e.connected_ranks
        .with_label_values(&[&w])
        .set(i64::try_from(connected).unwrap_or(i64::MAX));
    if let Some(age) = now.last_event_age {
        e.last_event_age
            .with_label_values(&[&w])
            .set(age.as_secs_f64());
    }
}

/// Drops every series of a worker (its subscription stopped).
fn remove_series(metrics: &Metrics, worker_id: WorkerId) {
    let e = &metrics.engine;
    let w = worker_id.to_string();
    let w = w.as_str();
    for family in [
        &e.batches,
        &e.rank_mismatch,
        &e.gaps,
        &e.batches_lost,
        &e.replayed_batches,
        &e.restarts,
    ] {
        let _ = family.remove_label_values(&[w]);
    }
    for kind in EVENT_KINDS {
        let _ = e.events.remove_label_values(&[w, kind]);
    }
    for reason in IGNORED_REASONS {
        let _ = e.ignored.remove_label_values(&[w, reason]);
    }
    for outcome in REPLAY_OUTCOMES {
        let _ = e.replays.remove_label_values(&[w, outcome]);
    }
    for reason in crate::engine_events::DecodeReason::ALL {
        let _ = e.decode_errors.remove_label_values(&[w, reason.label()]);
    }
    for event in CONNECTION_EVENTS {
        let _ = e.connections.remove_label_values(&[w, event]);
    }
    let _ = e.connected_ranks.remove_label_values(&[w]);
    let _ = e.last_event_age.remove_label_values(&[w]);
}
