//! Per-worker counters of the engine-event subscriber, as Prometheus series.
//!
//! Why this exists: a subscriber that silently drops data makes routing
//! quietly worse, so every decision (gap, replay, restart, skip) is counted
//! here, straight into the service's `engine_event_*` families with the
//! worker id as a label. A [`MetricsSnapshot`] reads the same handles back
//! for the one-line summary of `GetWorker`.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus::{GaugeVec, IntCounter, IntGauge};

use super::{
    translate::{MEDIUM_LABELS, medium_index},
    wire::DecodeReason,
};
use crate::metrics::EngineEventFamilies;
use kvroute_core::types::WorkerId;

/// Counters of one worker (all its dp ranks together): handles of the
/// worker's series in the service's Prometheus families, bound when its
/// subscription starts ([`WorkerEventMetrics::bound`]) and removed when it
/// stops ([`WorkerEventMetrics::unbind`]). Counting is the handle's own
/// atomic add; nothing is copied at scrape time except the age of the last
/// batch, which is a function of the clock ([`WorkerEventMetrics::refresh_age`]).
#[derive(Debug)]
pub struct WorkerEventMetrics {
    pub batches: IntCounter,
    pub events_stored: IntCounter,
    pub events_removed: IntCounter,
    pub events_cleared: IntCounter,
    /// Store/remove events on a medium kvroute does not know (ignored).
    pub events_unknown_medium: IntCounter,
    /// Events of a KV cache group other than the configured one.
    pub events_other_group: IntCounter,
    /// Events the index rejected (unknown parent, hash conflict).
    pub index_rejected: IntCounter,
    /// Gaps detected on the live stream.
    pub gaps: IntCounter,
    /// Batches lost for good (no replay endpoint, or beyond its buffer).
    pub batches_lost: IntCounter,
    pub replays_requested: IntCounter,
    pub replay_batches: IntCounter,
    /// Replays that timed out or failed at the socket level.
    pub replay_failures: IntCounter,
    /// Engine restarts (see `sequence`); the rank was cleared.
    pub restarts: IntCounter,
    /// Batches skipped as already applied (replay overlap, repeats, step backs).
    pub skipped_duplicates: IntCounter,
    /// Batches skipped for a sequence absurdly far ahead (one per batch).
    pub skipped_jumps: IntCounter,
    connects: IntCounter,
    disconnects: IntCounter,
    pub connect_failures: IntCounter,
    /// Batches whose dp rank differs from the subscription's rank.
    pub rank_mismatch: IntCounter,
    /// Indexed by [`DecodeReason::index`].
    decode_errors: Vec<IntCounter>,
    /// Store and remove events by medium, over every worker (the scraped
    /// family's, whatever this worker's series budget), in the order of
    /// [`MEDIUM_LABELS`].
    media: Vec<IntCounter>,
    unknown_media: crate::metrics::UnknownMedia,
    connected_ranks: IntGauge,
    /// Ranks whose blocks may differ from the engine's cache.
    unsynced_ranks: IntGauge,
    /// The family and this worker's label: the series appears with the
    /// first batch, not at zero before it.
    last_event_age: (GaugeVec, String),
    /// Unix time (ms) of the last batch received; 0 before the first.
    last_batch_unix_ms: AtomicU64,
    /// The last sequence admitted, plus one; 0 before the first.
    last_seq_plus_one: AtomicU64,
}

/// The `kind` labels of `engine_events_total`.
const EVENT_KINDS: [&str; 3] = ["stored", "removed", "cleared"];
/// The `reason` labels of `engine_events_ignored_total`.
const IGNORED_REASONS: [&str; 3] = ["unknown_medium", "other_group", "index_rejected"];
/// The `outcome` labels of `engine_event_replays_total`.
const REPLAY_OUTCOMES: [&str; 2] = ["requested", "failed"];
/// The `event` labels of `engine_event_connections_total`.
const CONNECTION_EVENTS: [&str; 3] = ["connected", "disconnected", "failed"];
/// The `reason` labels of `engine_event_skipped_batches_total`.
const SKIP_REASONS: [&str; 2] = ["duplicate", "jump"];

/// A point-in-time copy of [`WorkerEventMetrics`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    pub batches: u64,
    pub events_stored: u64,
    pub events_removed: u64,
    pub events_cleared: u64,
    pub events_unknown_medium: u64,
    pub events_other_group: u64,
    pub index_rejected: u64,
    pub gaps: u64,
    pub batches_lost: u64,
    pub replays_requested: u64,
    pub replay_batches: u64,
    pub replay_failures: u64,
    pub restarts: u64,
    pub skipped_duplicates: u64,
    pub skipped_jumps: u64,
    /// Ranks unsynced now.
    pub unsynced_ranks: u64,
    pub connects: u64,
    pub disconnects: u64,
    pub connect_failures: u64,
    pub rank_mismatch: u64,
    /// `(reason label, count)` for every reason, in a fixed order.
    pub decode_errors: Vec<(&'static str, u64)>,
    /// Time since the last batch, `None` before the first.
    pub last_event_age: Option<Duration>,
    /// The last engine sequence admitted (any rank), `None` before the first.
    pub last_seq: Option<u64>,
}

impl MetricsSnapshot {
    pub(crate) fn decode_errors_total(&self) -> u64 {
        self.decode_errors.iter().map(|(_, n)| n).sum()
    }

    #[cfg(test)]
    pub(crate) fn decode_error(&self, reason: DecodeReason) -> u64 {
        self.decode_errors
            .iter()
            .find(|(l, _)| *l == reason.label())
            .map_or(0, |(_, n)| *n)
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl WorkerEventMetrics {
    /// Binds `worker_id`'s series in `families`: from now on they exist (at
    /// zero until counted) and count through the returned handles.
    pub fn bound(families: &EngineEventFamilies, worker_id: WorkerId) -> Self {
        let media = MEDIUM_LABELS
            .iter()
            .map(|label| families.media.with_label_values(&[label]))
            .collect();
        let unknown_media = families.unknown_media.clone();
        let families = families.families_for(worker_id);
        let w = worker_id.to_string();
        let w = w.as_str();
        let one = |family: &prometheus::IntCounterVec| family.with_label_values(&[w]);
        let two =
            |family: &prometheus::IntCounterVec, label: &str| family.with_label_values(&[w, label]);
        let f = families;
        Self {
            batches: one(&f.batches),
            events_stored: two(&f.events, EVENT_KINDS[0]),
            events_removed: two(&f.events, EVENT_KINDS[1]),
            events_cleared: two(&f.events, EVENT_KINDS[2]),
            events_unknown_medium: two(&f.ignored, IGNORED_REASONS[0]),
            events_other_group: two(&f.ignored, IGNORED_REASONS[1]),
            index_rejected: two(&f.ignored, IGNORED_REASONS[2]),
            gaps: one(&f.gaps),
            batches_lost: one(&f.batches_lost),
            replays_requested: two(&f.replays, REPLAY_OUTCOMES[0]),
            replay_batches: one(&f.replayed_batches),
            replay_failures: two(&f.replays, REPLAY_OUTCOMES[1]),
            restarts: one(&f.restarts),
            skipped_duplicates: two(&f.skipped_batches, SKIP_REASONS[0]),
            skipped_jumps: two(&f.skipped_batches, SKIP_REASONS[1]),
            connects: two(&f.connections, CONNECTION_EVENTS[0]),
            disconnects: two(&f.connections, CONNECTION_EVENTS[1]),
            connect_failures: two(&f.connections, CONNECTION_EVENTS[2]),
            rank_mismatch: one(&f.rank_mismatch),
            decode_errors: DecodeReason::ALL
                .iter()
                .map(|r| two(&f.decode_errors, r.label()))
                .collect(),
            media,
            unknown_media,
            connected_ranks: f.connected_ranks.with_label_values(&[w]),
            unsynced_ranks: f.unsynced_ranks.with_label_values(&[w]),
            last_event_age: (f.last_event_age.clone(), w.to_string()),
            last_batch_unix_ms: AtomicU64::new(0),
            last_seq_plus_one: AtomicU64::new(0),
        }
    }

    /// Removes every series of `worker_id` from `families` (its
    /// subscription stopped); handles still held count into nothing.
    pub(crate) fn unbind(families: &EngineEventFamilies, worker_id: WorkerId) {
        let f = families.release(worker_id);
        let w = worker_id.to_string();
        let w = w.as_str();
        for family in [
            &f.batches,
            &f.rank_mismatch,
            &f.gaps,
            &f.batches_lost,
            &f.replayed_batches,
            &f.restarts,
        ] {
            let _ = family.remove_label_values(&[w]);
        }
        let pairs = [
            (&f.events, &EVENT_KINDS[..]),
            (&f.ignored, &IGNORED_REASONS[..]),
            (&f.replays, &REPLAY_OUTCOMES[..]),
            (&f.connections, &CONNECTION_EVENTS[..]),
            (&f.skipped_batches, &SKIP_REASONS[..]),
        ];
        for (family, labels) in pairs {
            for label in labels {
                let _ = family.remove_label_values(&[w, label]);
            }
        }
        for reason in DecodeReason::ALL {
            let _ = f.decode_errors.remove_label_values(&[w, reason.label()]);
        }
        let _ = f.connected_ranks.remove_label_values(&[w]);
        let _ = f.unsynced_ranks.remove_label_values(&[w]);
        let _ = f.last_event_age.remove_label_values(&[w]);
    }

    pub(crate) fn inc(counter: &IntCounter) {
        counter.inc();
    }

    pub(crate) fn add(counter: &IntCounter, n: u64) {
        counter.inc_by(n);
    }

    /// A rank's socket connected.
    pub(crate) fn connected(&self) {
        self.connects.inc();
        self.connected_ranks.inc();
    }

    /// A rank's socket, connected before, was lost.
    pub(crate) fn disconnected(&self) {
        self.disconnects.inc();
        self.connected_ranks.dec();
    }

    /// A rank became unsynced.
    pub(crate) fn rank_unsynced(&self) {
        self.unsynced_ranks.inc();
    }

    /// An unsynced rank is exact again.
    pub(crate) fn rank_resynced(&self) {
        self.unsynced_ranks.dec();
    }

    pub(crate) fn decode_error(&self, reason: DecodeReason) {
        if let Some(c) = self.decode_errors.get(reason.index()) {
            c.inc();
        }
    }

    /// Note that batch `seq` arrived now.
    pub(crate) fn touch(&self, seq: u64) {
        self.last_batch_unix_ms.store(now_ms(), Relaxed);
        self.last_seq_plus_one.store(seq.saturating_add(1), Relaxed);
    }

    /// Sets the last-batch age gauge from the clock (before a scrape).
    pub(crate) fn refresh_age(&self) {
        let last = self.last_batch_unix_ms.load(Relaxed);
        if last > 0 {
            let age = Duration::from_millis(now_ms().saturating_sub(last));
            let (family, worker) = &self.last_event_age;
            family
                .with_label_values(&[worker.as_str()])
                .set(age.as_secs_f64());
        }
    }

    /// Counts a store or remove event naming `medium`.
    pub fn count_medium(&self, medium: Option<&str>) {
        let index = medium_index(medium);
        if let Some(counter) = self.media.get(index) {
            counter.inc();
        }
        if let Some(name) = medium
            && MEDIUM_LABELS[index] == "unknown"
        {
            self.unknown_media.count(name);
        }
    }

    /// Unknown-medium events counted under `label`.
    #[cfg(test)]
    pub(crate) fn unknown_medium_count(&self, label: &str) -> u64 {
        self.unknown_media.get(label)
    }

    /// Events counted under a medium label, over every worker.
    #[cfg(test)]
    pub(crate) fn medium_count(&self, label: &str) -> u64 {
        MEDIUM_LABELS
            .iter()
            .position(|l| *l == label)
            .and_then(|i| self.media.get(i))
            .map_or(0, IntCounter::get)
    }

    pub fn snapshot(&self) -> MetricsSnapshot {
        let last = self.last_batch_unix_ms.load(Relaxed);
        let g = |c: &IntCounter| c.get();
        MetricsSnapshot {
            batches: g(&self.batches),
            events_stored: g(&self.events_stored),
            events_removed: g(&self.events_removed),
            events_cleared: g(&self.events_cleared),
            events_unknown_medium: g(&self.events_unknown_medium),
            events_other_group: g(&self.events_other_group),
            index_rejected: g(&self.index_rejected),
            gaps: g(&self.gaps),
            batches_lost: g(&self.batches_lost),
            replays_requested: g(&self.replays_requested),
            replay_batches: g(&self.replay_batches),
            replay_failures: g(&self.replay_failures),
            restarts: g(&self.restarts),
            skipped_duplicates: g(&self.skipped_duplicates),
            skipped_jumps: g(&self.skipped_jumps),
            unsynced_ranks: u64::try_from(self.unsynced_ranks.get()).unwrap_or(0),
            connects: g(&self.connects),
            disconnects: g(&self.disconnects),
            connect_failures: g(&self.connect_failures),
            rank_mismatch: g(&self.rank_mismatch),
            decode_errors: DecodeReason::ALL
                .iter()
                .map(|r| {
                    (
                        r.label(),
                        self.decode_errors.get(r.index()).map_or(0, IntCounter::get),
                    )
                })
                .collect(),
            last_event_age: (last > 0)
                .then(|| Duration::from_millis(now_ms().saturating_sub(last))),
            last_seq: self.last_seq_plus_one.load(Relaxed).checked_sub(1),
        }
    }
}
