//! Engine-native KV event subscriptions (`subscriptions`): what each
//! worker's engine sent, lost, replayed and how its sockets fare. The one
//! area whose label values are not a fixed set (the `worker` label), so it
//! also caps how many workers get series of their own.

use std::sync::Arc;

use prometheus::{GaugeVec, IntCounterVec, IntGauge, IntGaugeVec, Registry};

use super::registrar::Registrar;

/// Engine-native KV event subscriptions, per worker (`subscriptions`).
#[derive(Clone)]
pub struct EngineEventFamilies {
    /// `worker`
    pub batches: IntCounterVec,
    /// `worker`, `kind` (stored, removed, cleared)
    pub events: IntCounterVec,
    /// `worker`, `reason` (unknown_medium, other_group, index_rejected)
    pub ignored: IntCounterVec,
    /// `medium`: store and remove events by the medium they name, over
    /// every worker (`engine_events::translate::MEDIUM_LABELS`: a known name, `none`,
    /// or `unknown`, so an engine cannot grow the label set)
    pub media: IntCounterVec,
    /// `value`: events naming a medium kvroute does not know, by what they
    /// named (see [`UnknownMedia`]).
    pub unknown_media: UnknownMedia,
    /// `worker`: batches stamped with another dp rank than the socket's
    /// (still applied to the socket's rank)
    pub rank_mismatch: IntCounterVec,
    /// `worker`
    pub gaps: IntCounterVec,
    /// `worker`
    pub batches_lost: IntCounterVec,
    /// `worker`, `outcome` (requested, failed)
    pub replays: IntCounterVec,
    /// `worker`
    pub replayed_batches: IntCounterVec,
    /// `worker`
    pub restarts: IntCounterVec,
    /// `worker`, `reason` (duplicate, jump)
    pub skipped_batches: IntCounterVec,
    /// `worker`: dp ranks whose index may differ from the engine's cache
    pub unsynced_ranks: IntGaugeVec,
    /// `worker`, `reason` (`DecodeReason::label`)
    pub decode_errors: IntCounterVec,
    /// `worker`, `event` (connected, disconnected, failed)
    pub connections: IntCounterVec,
    /// `worker`
    pub connected_ranks: IntGaugeVec,
    /// `worker`; absent before the first batch
    pub last_event_age: GaugeVec,
    /// Which workers have series of their own (`None` in the shadow).
    series: Option<Arc<SeriesBudget>>,
}

/// Events naming an unknown medium, counted by the name they gave, so an
/// operator sees what an engine sends: each name made printable and cut to
/// [`UnknownMedia::MAX_LEN`] bytes, and at most [`UnknownMedia::MAX_VALUES`]
/// names over the process's life, the rest as `(other)`. An engine cannot
/// grow the scrape, only fill the table once.
#[derive(Clone)]
pub struct UnknownMedia {
    family: IntCounterVec,
    seen: Arc<parking_lot::Mutex<std::collections::HashSet<String>>>,
}

impl std::fmt::Debug for UnknownMedia {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnknownMedia")
            .field("values", &self.seen.lock().len())
            .finish()
    }
}

impl UnknownMedia {
    pub const MAX_VALUES: usize = 16;
    pub const MAX_LEN: usize = 32;

    /// Counts one event that named `medium`.
    pub fn count(&self, medium: &str) {
        let value: String = medium
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || "_-.:".contains(c) {
                    c
                } else {
                    '?'
                }
            })
            .take(Self::MAX_LEN)
            .collect();
        let mut seen = self.seen.lock();
        let label = if seen.contains(&value) || seen.len() < Self::MAX_VALUES {
            seen.insert(value.clone());
            value
        } else {
            "(other)".to_owned()
        };
        drop(seen);
        self.family.with_label_values(&[label.as_str()]).inc();
    }

    /// Events counted under `label`.
    #[cfg(test)]
    pub fn get(&self, label: &str) -> u64 {
        self.family.with_label_values(&[label]).get()
    }
}

/// At most `cap` workers get engine-event series: each one adds about 30,
/// and a fleet of engines must not grow the scrape without bound. Workers
/// past the cap count in `shadow`, the same families in a registry nobody
/// scrapes, so `GetWorker` still reads their own counters; how many there
/// are is `engine_event_workers_without_series`.
struct SeriesBudget {
    cap: std::sync::atomic::AtomicUsize,
    workers: parking_lot::Mutex<SeriesWorkers>,
    shadow: EngineEventFamilies,
    without_series: IntGauge,
}

/// Which workers' series are exported, and which count in the shadow.
#[derive(Default)]
struct SeriesWorkers {
    exported: std::collections::HashSet<kvroute_core::types::WorkerId>,
    without: std::collections::HashSet<kvroute_core::types::WorkerId>,
}

/// Default of `--max-engine-metric-workers`.
pub const DEFAULT_ENGINE_SERIES_WORKERS: usize = 64;

impl EngineEventFamilies {
    /// Most workers with series of their own (also the per-worker booked
    /// load's bound, `RouterCore::refresh_booked_gauges`).
    pub(crate) fn series_cap(&self) -> usize {
        self.series
            .as_ref()
            .map_or(DEFAULT_ENGINE_SERIES_WORKERS, |s| {
                s.cap.load(std::sync::atomic::Ordering::Relaxed)
            })
    }

    /// Most workers with series of their own.
    pub(crate) fn set_series_cap(&self, cap: usize) {
        if let Some(series) = &self.series {
            series.cap.store(cap, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The families `worker_id`'s counters go to: these while it has (or
    /// can get) series of its own, the unscraped shadow past the cap.
    pub(crate) fn families_for(
        &self,
        worker_id: kvroute_core::types::WorkerId,
    ) -> &EngineEventFamilies {
        let Some(series) = &self.series else {
            return self;
        };
        let cap = series.cap.load(std::sync::atomic::Ordering::Relaxed);
        let mut workers = series.workers.lock();
        if workers.exported.contains(&worker_id) || workers.exported.len() < cap {
            workers.exported.insert(worker_id);
            return self;
        }
        workers.without.insert(worker_id);
        series.without_series.set(workers.without.len() as i64);
        &series.shadow
    }

    /// Forgets `worker_id` (its subscription stopped): the families its
    /// series were in, so the caller removes them there.
    pub(crate) fn release(&self, worker_id: kvroute_core::types::WorkerId) -> &EngineEventFamilies {
        let Some(series) = &self.series else {
            return self;
        };
        let mut workers = series.workers.lock();
        if workers.exported.remove(&worker_id) {
            return self;
        }
        workers.without.remove(&worker_id);
        series.without_series.set(workers.without.len() as i64);
        &series.shadow
    }
}

impl EngineEventFamilies {
    /// Creates the engine-event families and registers them, with their cap
    /// of workers with series.
    pub(super) fn register(families: Registrar<'_>) -> Result<Self, prometheus::Error> {
        let mut exported = Self::families(families)?;
        exported.series = Some(Arc::new(SeriesBudget {
            cap: std::sync::atomic::AtomicUsize::new(DEFAULT_ENGINE_SERIES_WORKERS),
            workers: Default::default(),
            shadow: Self::families(Registrar::new(&Registry::new()))?,
            without_series: families.int_gauge(
                "engine_event_workers_without_series",
                "Engine-subscribed workers past --max-engine-metric-workers: counted, not exported",
            )?,
        }));
        Ok(exported)
    }

    fn families(families: Registrar<'_>) -> Result<Self, prometheus::Error> {
        Ok(Self {
            batches: families.counter_vec(
                "engine_event_batches_total",
                "Engine KV event batches admitted (live or replayed), per worker",
                &["worker"],
            )?,
            events: families.counter_vec(
                "engine_events_total",
                "Engine KV events decoded, per worker and kind",
                &["worker", "kind"],
            )?,
            ignored: families.counter_vec(
                "engine_events_ignored_total",
                "Engine KV events not routed on, per worker and reason",
                &["worker", "reason"],
            )?,
            media: families.counter_vec(
                "engine_event_media_total",
                "Engine KV store and remove events by the medium they name (none: no medium, the device; unknown: any name kvroute does not know)",
                &["medium"],
            )?,
            unknown_media: UnknownMedia {
                family: families.counter_vec(
                    "engine_event_unknown_media_total",
                    "Engine KV events ignored for naming a medium kvroute does not know, by the name (printable, cut to 32 bytes; 16 names at most, then (other))",
                    &["value"],
                )?,
                seen: Arc::default(),
            },
            rank_mismatch: families.counter_vec(
                "engine_event_rank_mismatch_total",
                "Engine batches stamped with another dp rank than their socket's",
                &["worker"],
            )?,
            gaps: families.counter_vec(
                "engine_event_gaps_total",
                "Sequence gaps seen on an engine's live stream",
                &["worker"],
            )?,
            batches_lost: families.counter_vec(
                "engine_event_batches_lost_total",
                "Engine batches neither received live nor replayed",
                &["worker"],
            )?,
            replays: families.counter_vec(
                "engine_event_replays_total",
                "Replay requests to an engine's replay socket, by outcome",
                &["worker", "outcome"],
            )?,
            replayed_batches: families.counter_vec(
                "engine_event_replayed_batches_total",
                "Batches received through an engine's replay socket",
                &["worker"],
            )?,
            restarts: families.counter_vec(
                "engine_event_restarts_total",
                "Engine restarts detected (sequence back to near zero, or far back on a new connection); the rank was cleared",
                &["worker"],
            )?,
            skipped_batches: families.counter_vec(
                "engine_event_skipped_batches_total",
                "Engine batches not applied: already applied (duplicate) or an absurd sequence jump",
                &["worker", "reason"],
            )?,
            unsynced_ranks: families.int_gauge_vec(
                "engine_event_unsynced_ranks",
                "Dp ranks whose blocks may differ from the engine's cache (lost batches, a sequence jump) until it reports AllBlocksCleared",
                &["worker"],
            )?,
            decode_errors: families.counter_vec(
                "engine_event_decode_errors_total",
                "Malformed engine frames, payloads or events skipped, by reason",
                &["worker", "reason"],
            )?,
            connections: families.counter_vec(
                "engine_event_connections_total",
                "Engine event socket connects, disconnects and failed connects",
                &["worker", "event"],
            )?,
            connected_ranks: families.int_gauge_vec(
                "engine_event_connected_ranks",
                "Dp ranks whose engine event socket is connected",
                &["worker"],
            )?,
            last_event_age: families.gauge_vec(
                "engine_event_last_age_seconds",
                "Seconds since the worker's engine last sent a batch",
                &["worker"],
            )?,
            series: None,
        })
    }
}
