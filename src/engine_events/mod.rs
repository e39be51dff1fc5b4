//! Engine-native KV events: subscribe to vLLM / SGLang ZeroMQ publishers.
//!
//! Why this exists: engines that cannot call kvroute's `PublishEvents` RPC
//! still announce every stored, removed and cleared KV block on a ZeroMQ PUB
//! socket (one per dp rank), with a ROUTER socket that replays recent batches.
//! This module subscribes per (worker, dp_rank), keeps the sequence exact
//! (gap -> replay, duplicate -> skip, back to near zero -> restart,
//! absurd jump -> skip; rules in [`sequence`]), turns engine events into
//! [`KvEvent`]s with kvroute's local hashes and hands them to an
//! [`EventSink`], which the service wires to its ingest path.
//!
//! Layout:
//! * [`wire`]: frames and msgpack payloads of both dialects and encodings.
//! * [`sequence`]: pure gap / restart / duplicate decisions and backoff.
//! * [`source`]: where an engine publishes (endpoints, dialect): value types.
//! * [`translate`]: engine events -> index events (hashing, media, groups).
//! * [`subscriber`]: the tokio tasks (SUB socket, reconnect, DEALER replay).
//! * [`metrics`]: per-worker counters.
//!
//! Failure policy: a malformed frame, payload or event is counted by reason
//! and skipped; it never stops the subscriber and never touches another
//! worker. A disconnected engine keeps its blocks (its lease or an
//! `AllBlocksCleared` removes them); a restarted engine's rank is cleared.
//! A rank whose blocks may no longer match the engine's cache (batches lost
//! for good, an absurd sequence jump, a new connection starting below what
//! was applied) is *unsynced* until the engine reports
//! `AllBlocksCleared`: counted, logged once, shown per worker
//! ([`RankProgress`], `engine_event_unsynced_ranks`).

pub mod metrics;
pub mod sequence;
pub mod source;
pub mod subscriber;
pub mod translate;
pub mod wire;

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;

use kvroute_core::index::{KvEvent, KvIndex, TieredEvent};
use kvroute_core::types::{DpRank, EngineHash, WorkerId, WorkerRank};

pub use metrics::{MetricsSnapshot, WorkerEventMetrics};
pub use sequence::{
    Admit, Backoff, LiveObservation, MAX_JUMP, REPLAY_WINDOW, RESTART_FLOOR, SequenceTracker,
    Unsynced,
};
pub use source::{EngineSource, EngineSpec, check_endpoint, dialect_name, parse_dialect};
pub use subscriber::{WorkerSubscription, spawn_worker};
pub use translate::{MEDIUM_GPU, TranslateOptions, Translated, Translator, mm_identifier_hash};
pub use wire::{DecodeError, DecodeReason, Dialect, EngineEvent};

/// How a sink fared with one batch of translated events.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SinkOutcome {
    pub applied: u32,
    /// Events the index refused (unknown parent, hash conflict); the sink is
    /// unchanged by them.
    pub rejected: u32,
}

/// Where translated events go. The service implements this over its ingest
/// writer (the index's one writer); [`KvIndex`] implements it directly for
/// tests and simple setups. Async because the writer answers over a
/// channel: each rank awaits one call before making the next, which keeps
/// that rank's events in order.
pub trait EventSink: Send + Sync + 'static {
    /// Apply one engine batch's translated events for one target, in order.
    /// `sequence` is the engine's batch sequence they came in (a sink that
    /// forwards them, as cluster mode's log does, keys them by it).
    fn apply(
        &self,
        target: WorkerRank,
        sequence: u64,
        events: Vec<TieredEvent>,
    ) -> BoxFuture<'_, SinkOutcome>;
    /// Drop everything the target holds (engine restart, noticed at the
    /// batch `sequence`).
    fn clear(&self, target: WorkerRank, sequence: u64) -> BoxFuture<'_, ()>;
}

impl EventSink for KvIndex {
    fn apply(
        &self,
        target: WorkerRank,
        _sequence: u64,
        events: Vec<TieredEvent>,
    ) -> BoxFuture<'_, SinkOutcome> {
        let mut outcome = SinkOutcome::default();
        for event in &events {
            match self.apply_tiered(target, event.clone()) {
                Ok(_) => outcome.applied += 1,
                Err(e) => {
                    outcome.rejected += 1;
                    tracing::debug!(%target, %e, "index rejected engine event");
                }
            }
        }
        Box::pin(std::future::ready(outcome))
    }

    fn clear(&self, target: WorkerRank, _sequence: u64) -> BoxFuture<'_, ()> {
        self.remove_rank(target);
        Box::pin(std::future::ready(()))
    }
}

/// A configuration the subscriber cannot run with.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("block_size must be positive")]
    ZeroBlockSize,
    #[error("no dp ranks configured")]
    NoRanks,
    #[error("cannot derive the endpoint of dp rank {rank} from {endpoint:?}: give it explicitly")]
    NoRankEndpoint { rank: DpRank, endpoint: String },
}

/// The endpoints of one dp rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankEndpoints {
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
}

/// Default of [`EngineEventsConfig::max_message_bytes`]: far above any
/// real batch (a few hundred kB at most).
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 16 << 20;

/// Engine-event subscription of one worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineEventsConfig {
    pub worker_id: WorkerId,
    pub model: String,
    /// The worker's KV block size (tokens); events of another size are skipped.
    pub block_size: u32,
    /// The dp ranks to subscribe to.
    pub dp_ranks: Vec<DpRank>,
    /// PUB endpoint of rank 0, e.g. `tcp://10.0.0.5:5557`. Rank `r` uses the
    /// port plus `r` (the engines' own convention) unless `rank_endpoints`
    /// names it.
    pub endpoint: String,
    /// Replay (ROUTER) endpoint of rank 0, offset the same way. `None`: gaps
    /// are counted and logged, routing continues.
    pub replay_endpoint: Option<String>,
    /// Explicit endpoints per rank (e.g. `ipc://` paths).
    pub rank_endpoints: HashMap<DpRank, RankEndpoints>,
    pub dialect: Dialect,
    /// Topic prefix to subscribe to (engines default to "").
    pub topic: String,
    /// KV cache group to index (hybrid models); `None` indexes every group.
    pub kv_group: Option<i64>,
    /// LoRA id -> name, for engines that report only the id (SGLang).
    pub lora_names: HashMap<i64, String>,
    pub reconnect_initial: Duration,
    pub reconnect_max: Duration,
    pub connect_timeout: Duration,
    /// How long one replay may take before it is abandoned.
    pub replay_timeout: Duration,
    /// Largest message (all frames) decoded; larger ones are counted as
    /// `too_large` and skipped (a live one is a lost batch, found as a gap).
    pub max_message_bytes: usize,
    /// Saved last-applied engine sequence per dp rank (from
    /// [`WorkerSubscription::last_sequences`] before a restart): such a rank
    /// starts as if it had applied everything up to it, so its first live
    /// batch above `saved + 1` is a gap replayed from `saved + 1`, and a
    /// first batch at or below it is judged by the restart / duplicate rules
    /// of [`sequence`]. Ranks not listed start from nothing; entries for
    /// ranks not subscribed to are ignored.
    pub resume_from: HashMap<DpRank, u64>,
    /// Ranks that were unsynced when `resume_from` was saved
    /// ([`WorkerSubscription::unsynced_ranks`]): they start unsynced.
    pub resume_unsynced: Vec<DpRank>,
    /// The cache salts of salted blocks each resumed rank holds (see
    /// [`RankProgress::salts`]).
    pub resume_salts: HashMap<DpRank, SavedSalts>,
}

impl EngineEventsConfig {
    /// A configuration with defaults for everything but the essentials.
    pub fn new(
        worker_id: WorkerId,
        model: impl Into<String>,
        block_size: u32,
        endpoint: impl Into<String>,
        dialect: Dialect,
    ) -> Self {
        Self {
            worker_id,
            model: model.into(),
            block_size,
            dp_ranks: vec![0],
            endpoint: endpoint.into(),
            replay_endpoint: None,
            rank_endpoints: HashMap::new(),
            dialect,
            topic: String::new(),
            kv_group: Some(0),
            lora_names: HashMap::new(),
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            reconnect_initial: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(2),
            replay_timeout: Duration::from_secs(5),
            resume_from: HashMap::new(),
            resume_unsynced: Vec::new(),
            resume_salts: HashMap::new(),
        }
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if self.block_size == 0 {
            return Err(ConfigError::ZeroBlockSize);
        }
        if self.dp_ranks.is_empty() {
            return Err(ConfigError::NoRanks);
        }
        for r in &self.dp_ranks {
            self.endpoints_for(*r)?;
        }
        Ok(())
    }

    /// The endpoints of `rank` (explicit, or rank 0's with the port offset).
    pub(crate) fn endpoints_for(&self, rank: DpRank) -> Result<RankEndpoints, ConfigError> {
        if let Some(e) = self.rank_endpoints.get(&rank) {
            return Ok(e.clone());
        }
        let endpoint =
            offset_port(&self.endpoint, rank).ok_or_else(|| ConfigError::NoRankEndpoint {
                rank,
                endpoint: self.endpoint.clone(),
            })?;
        let replay_endpoint = match &self.replay_endpoint {
            None => None,
            Some(r) => Some(
                offset_port(r, rank).ok_or_else(|| ConfigError::NoRankEndpoint {
                    rank,
                    endpoint: r.clone(),
                })?,
            ),
        };
        Ok(RankEndpoints {
            endpoint,
            replay_endpoint,
        })
    }

    pub(crate) fn translate_options(&self) -> TranslateOptions {
        TranslateOptions {
            block_size: self.block_size,
            kv_group: self.kv_group,
            lora_names: self.lora_names.clone(),
        }
    }
}

/// `tcp://host:port` with the port plus `rank`; other transports only for
/// rank 0.
pub(crate) fn offset_port(endpoint: &str, rank: DpRank) -> Option<String> {
    if rank == 0 {
        return Some(endpoint.to_owned());
    }
    let rest = endpoint.strip_prefix("tcp://")?;
    let (host, port) = rest.rsplit_once(':')?;
    let port: u32 = port.parse().ok()?;
    let port = u16::try_from(port.checked_add(rank)?).ok()?;
    Some(format!("tcp://{host}:{port}"))
}

/// The cache salts of one rank's salted blocks: (engine hash, salt).
pub type SavedSalts = Vec<(EngineHash, Arc<str>)>;

/// Where a worker's subscription carries on after a restart: what its
/// ranks had reached when the snapshot was taken.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ResumePoint {
    /// The last applied engine sequence per rank.
    pub sequences: HashMap<DpRank, u64>,
    /// Ranks that were unsynced.
    pub unsynced: Vec<DpRank>,
    /// The cache salts of salted blocks per rank.
    pub salts: HashMap<DpRank, SavedSalts>,
}

/// What one rank's subscription has reached, shared with whoever reads it
/// while the subscription runs (summaries, snapshots). Written by the rank's
/// processor: the last applied sequence once the sink is done with its
/// batch, the unsynced flag as soon as it is decided.
#[derive(Debug, Default)]
pub struct RankProgress {
    state: parking_lot::Mutex<RankState>,
    /// The rank's translator's salts (see [`translate::Salts`]).
    salts: translate::Salts,
}

#[derive(Debug, Default)]
struct RankState {
    last_applied: Option<u64>,
    unsynced: bool,
}

impl RankProgress {
    /// The cache salt of each salted block the rank holds.
    pub(crate) fn salts(&self) -> SavedSalts {
        let mut salts: SavedSalts = self
            .salts
            .lock()
            .iter()
            .map(|(&h, s)| (h, Arc::clone(s)))
            .collect();
        salts.sort_unstable_by_key(|&(h, _)| h);
        salts
    }

    /// The last engine sequence whose events were handed to the sink (and
    /// the sink finished with), `None` before the first or after a restart.
    pub(crate) fn last_applied(&self) -> Option<u64> {
        self.state.lock().last_applied
    }

    /// Whether the rank's blocks may differ from the engine's cache (see
    /// [`sequence`]).
    pub(crate) fn is_unsynced(&self) -> bool {
        self.state.lock().unsynced
    }

    fn set_last_applied(&self, last_applied: Option<u64>) {
        self.state.lock().last_applied = last_applied;
    }

    fn set_unsynced(&self, unsynced: bool) {
        self.state.lock().unsynced = unsynced;
    }
}

/// The core of one rank's subscription, free of sockets: sequence
/// decisions, decoding, translation and handing events to the sink, with
/// every outcome counted. Async only because the sink is. The subscriber
/// task feeds it frames; tests feed it directly.
pub struct RankProcessor<S: EventSink + ?Sized> {
    target: WorkerRank,
    dialect: Dialect,
    tracker: SequenceTracker,
    translator: Translator,
    metrics: Arc<WorkerEventMetrics>,
    sink: Arc<S>,
    progress: Arc<RankProgress>,
    /// Whether the metrics and the log know the rank as unsynced.
    reported_unsynced: bool,
    /// The first sequence to ask the replay socket for once connected (from
    /// 0 when new, after the saved sequence when resumed), so batches
    /// published while kvroute did not listen arrive without waiting for
    /// the engine's next live one.
    catch_up_from: Option<u64>,
}

impl<S: EventSink + ?Sized> RankProcessor<S> {
    pub(crate) fn new(
        target: WorkerRank,
        dialect: Dialect,
        opts: Arc<TranslateOptions>,
        metrics: Arc<WorkerEventMetrics>,
        sink: Arc<S>,
    ) -> Self {
        let translator = Translator::new(opts);
        let progress = Arc::new(RankProgress {
            salts: Arc::clone(translator.salts()),
            ..RankProgress::default()
        });
        Self {
            target,
            dialect,
            tracker: SequenceTracker::new(),
            translator,
            metrics,
            sink,
            progress,
            reported_unsynced: false,
            // What the engine published before kvroute subscribed is asked
            // of its replay socket at once (it may publish nothing else for
            // a while), as a live batch after a gap would ask.
            catch_up_from: Some(0),
        }
    }

    pub(crate) fn target(&self) -> WorkerRank {
        self.target
    }

    /// Start from a saved state instead of from nothing: everything up to
    /// `last_applied` counts as applied (see [`SequenceTracker::resumed`]);
    /// `unsynced`: the saved rank was unsynced, so this one is too. Call it
    /// before the first batch.
    pub(crate) fn resume_from(&mut self, last_applied: u64, unsynced: bool) {
        self.tracker = SequenceTracker::resumed(last_applied);
        self.catch_up_from = last_applied.checked_add(1);
        if unsynced {
            self.tracker.mark_unsynced(Unsynced::Resumed);
        }
        tracing::info!(target = %self.target, last_applied, unsynced, "resuming engine events after a saved sequence");
        self.sync_status();
        self.publish_applied();
    }

    /// Takes back the salts of the rank's salted blocks saved with its
    /// sequence, so chains continued after the resume hash with their salt.
    pub(crate) fn restore_salts(
        &mut self,
        salts: impl IntoIterator<Item = (EngineHash, Arc<str>)>,
    ) {
        self.translator.restore_salts(salts);
    }

    /// Marks the rank unsynced (a saved state said so) without a sequence.
    pub(crate) fn mark_unsynced(&mut self, why: Unsynced) {
        self.tracker.mark_unsynced(why);
        self.sync_status();
    }

    /// The rank's progress, readable from elsewhere while this runs.
    pub(crate) fn progress(&self) -> &Arc<RankProgress> {
        &self.progress
    }

    /// Publishes whether the rank is unsynced (at once, so it shows no later
    /// than the batch that made it so): progress, the gauge, and one log
    /// line when the rank becomes unsynced or exact again.
    fn sync_status(&mut self) {
        let why = self.tracker.unsynced();
        match (self.reported_unsynced, why) {
            (false, Some(why)) => {
                self.metrics.rank_unsynced();
                tracing::warn!(target = %self.target, ?why, "rank unsynced: its blocks may differ from the engine's cache until it reports AllBlocksCleared; routing continues");
            }
            (true, None) => {
                self.metrics.rank_resynced();
                tracing::info!(target = %self.target, "rank exact again");
            }
            _ => {}
        }
        self.reported_unsynced = why.is_some();
        self.progress.set_unsynced(self.reported_unsynced);
    }

    /// Publishes the last applied sequence, once the sink is done with it.
    fn publish_applied(&self) {
        self.progress.set_last_applied(self.tracker.applied());
    }

    /// A new connection to the rank's publisher was made (its first live
    /// sequence is judged as such, see [`sequence`]).
    pub(crate) fn on_connected(&mut self) {
        self.tracker.connected();
    }

    /// Once, at the first connection: where to ask the replay socket to
    /// start.
    pub(crate) fn take_catch_up(&mut self) -> Option<u64> {
        self.catch_up_from.take()
    }

    /// Record a live sequence. Handles a restart (clears the rank) and
    /// returns the missing range when a replay should be requested before
    /// [`Self::apply_batch`] is called for `seq`.
    pub(crate) async fn on_live(&mut self, seq: u64) -> Option<Range<u64>> {
        let obs = self.tracker.observe_live(seq);
        if let Some(prev) = obs.restarted_from {
            WorkerEventMetrics::inc(&self.metrics.restarts);
            tracing::warn!(target = %self.target, prev, seq, "engine restarted: clearing its blocks");
            self.sink.clear(self.target, seq).await;
            self.translator.reset();
        }
        if let Some(missing) = &obs.missing {
            WorkerEventMetrics::inc(&self.metrics.gaps);
            tracing::info!(target = %self.target, ?missing, "sequence gap");
        }
        self.sync_status();
        self.publish_applied();
        obs.missing
    }

    /// Count a frame-level decode failure.
    pub(crate) fn count_error(&self, err: &DecodeError) {
        self.metrics.decode_error(err.reason);
        tracing::debug!(target = %self.target, %err, "skipped malformed engine message");
    }

    /// Admit and apply one batch (live or replayed).
    pub(crate) async fn apply_batch(&mut self, seq: u64, payload: &[u8]) {
        match self.tracker.admit(seq) {
            Admit::Duplicate => {
                WorkerEventMetrics::inc(&self.metrics.skipped_duplicates);
                return;
            }
            Admit::Jump => {
                WorkerEventMetrics::inc(&self.metrics.skipped_jumps);
                tracing::debug!(target = %self.target, seq, expected = self.tracker.next_expected(), "engine sequence jumped absurdly far: batch skipped");
                self.sync_status();
                return;
            }
            Admit::Apply => {}
            Admit::ApplyAfterLoss(lost) => {
                // At most MAX_JUMP: a larger gap is a jump.
                let n = lost.end - lost.start;
                WorkerEventMetrics::add(&self.metrics.batches_lost, n);
                tracing::debug!(target = %self.target, ?lost, "engine batches lost for good");
                self.sync_status();
            }
        }
        WorkerEventMetrics::inc(&self.metrics.batches);
        self.metrics.touch(seq);
        if self.apply_events(seq, payload).await {
            self.tracker.cleared();
            self.sync_status();
        }
        self.publish_applied();
    }

    /// Decodes and translates an admitted batch and hands its events to the
    /// sink; returns whether they held an `AllBlocksCleared`.
    async fn apply_events(&mut self, seq: u64, payload: &[u8]) -> bool {
        let batch = match wire::decode_batch(payload, self.dialect) {
            Ok(b) => b,
            Err(e) => {
                self.count_error(&e);
                return false;
            }
        };
        if batch
            .dp_rank
            .is_some_and(|r| i64::from(self.target.dp_rank) != r)
        {
            WorkerEventMetrics::inc(&self.metrics.rank_mismatch);
        }
        let mut translated = Vec::new();
        for event in batch.events {
            let event = match event {
                Ok(e) => e,
                Err(e) => {
                    self.count_error(&e);
                    continue;
                }
            };
            let kind = match &event {
                EngineEvent::Stored(s) => {
                    self.metrics.count_medium(s.medium.as_deref());
                    &self.metrics.events_stored
                }
                EngineEvent::Removed(r) => {
                    self.metrics.count_medium(r.medium.as_deref());
                    &self.metrics.events_removed
                }
                EngineEvent::Cleared => &self.metrics.events_cleared,
            };
            WorkerEventMetrics::inc(kind);
            match self.translator.translate(event) {
                Err(e) => self.count_error(&e),
                Ok(Translated::UnknownMedium) => {
                    WorkerEventMetrics::inc(&self.metrics.events_unknown_medium);
                }
                Ok(Translated::OtherGroup) => {
                    WorkerEventMetrics::inc(&self.metrics.events_other_group);
                }
                Ok(Translated::Nothing) => {}
                Ok(Translated::Apply(ev)) => translated.push(ev),
            }
        }
        if translated.is_empty() {
            return false;
        }
        let cleared = translated
            .iter()
            .any(|e| matches!(e.event, KvEvent::Cleared));
        let outcome = self.sink.apply(self.target, seq, translated).await;
        WorkerEventMetrics::add(&self.metrics.index_rejected, u64::from(outcome.rejected));
        cleared
    }
}

#[cfg(test)]
mod tests;
