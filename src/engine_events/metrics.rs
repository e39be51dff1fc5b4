//! Per-worker counters of the engine-event subscriber, ready for export.
//!
//! Why this exists: a subscriber that silently drops data makes routing
//! quietly worse, so every decision (gap, replay, restart, skip) is counted
//! here. Plain atomics keep this crate free of a metrics dependency; the
//! service maps a [`MetricsSnapshot`] onto its Prometheus registry with the
//! worker id as a label and `reason` / `kind` / `medium` labels as named.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::wire::DecodeReason;

/// Counters of one worker (all its dp ranks together).
#[derive(Debug, Default)]
pub struct WorkerEventMetrics {
    pub batches: AtomicU64,
    pub events_stored: AtomicU64,
    pub events_removed: AtomicU64,
    pub events_cleared: AtomicU64,
    /// Store/remove events on a medium not counted as cached (counted only).
    pub events_other_medium: AtomicU64,
    /// Events of a KV cache group other than the configured one.
    pub events_other_group: AtomicU64,
    /// Events the index rejected (unknown parent, hash conflict).
    pub index_rejected: AtomicU64,
    /// Gaps detected on the live stream.
    pub gaps: AtomicU64,
    /// Batches lost for good (no replay endpoint, or beyond its buffer).
    pub batches_lost: AtomicU64,
    pub replays_requested: AtomicU64,
    pub replay_batches: AtomicU64,
    /// Replays that timed out or failed at the socket level.
    pub replay_failures: AtomicU64,
    /// Engine restarts (sequence went backwards); the rank was cleared.
    pub restarts: AtomicU64,
    pub connects: AtomicU64,
    pub disconnects: AtomicU64,
    pub connect_failures: AtomicU64,
    /// Batches whose dp rank differs from the subscription's rank.
    pub rank_mismatch: AtomicU64,
    decode_errors: [AtomicU64; DecodeReason::ALL.len()],
    /// Unix time (ms) of the last batch received; 0 before the first.
    last_batch_unix_ms: AtomicU64,
    /// The last sequence admitted, plus one; 0 before the first.
    last_seq_plus_one: AtomicU64,
}

/// A point-in-time copy of [`WorkerEventMetrics`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    pub batches: u64,
    pub events_stored: u64,
    pub events_removed: u64,
    pub events_cleared: u64,
    pub events_other_medium: u64,
    pub events_other_group: u64,
    pub index_rejected: u64,
    pub gaps: u64,
    pub batches_lost: u64,
    pub replays_requested: u64,
    pub replay_batches: u64,
    pub replay_failures: u64,
    pub restarts: u64,
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
    pub fn decode_errors_total(&self) -> u64 {
        self.decode_errors.iter().map(|(_, n)| n).sum()
    }

    pub fn decode_error(&self, reason: DecodeReason) -> u64 {
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
    pub fn new() -> Self {
        Self::default()
    }

    pub fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Relaxed);
    }

    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
    }

    pub fn decode_error(&self, reason: DecodeReason) {
        if let Some(c) = self.decode_errors.get(reason.index()) {
            c.fetch_add(1, Relaxed);
        }
    }

    /// Note that batch `seq` arrived now.
    pub fn touch(&self, seq: u64) {
        self.last_batch_unix_ms.store(now_ms(), Relaxed);
        self.last_seq_plus_one.store(seq.saturating_add(1), Relaxed);
    }

    pub fn snapshot(&self) -> MetricsSnapshot {
        let last = self.last_batch_unix_ms.load(Relaxed);
        let g = |c: &AtomicU64| c.load(Relaxed);
        MetricsSnapshot {
            batches: g(&self.batches),
            events_stored: g(&self.events_stored),
            events_removed: g(&self.events_removed),
            events_cleared: g(&self.events_cleared),
            events_other_medium: g(&self.events_other_medium),
            events_other_group: g(&self.events_other_group),
            index_rejected: g(&self.index_rejected),
            gaps: g(&self.gaps),
            batches_lost: g(&self.batches_lost),
            replays_requested: g(&self.replays_requested),
            replay_batches: g(&self.replay_batches),
            replay_failures: g(&self.replay_failures),
            restarts: g(&self.restarts),
            connects: g(&self.connects),
            disconnects: g(&self.disconnects),
            connect_failures: g(&self.connect_failures),
            rank_mismatch: g(&self.rank_mismatch),
            decode_errors: DecodeReason::ALL
                .iter()
                .map(|r| {
                    (
                        r.label(),
                        self.decode_errors
                            .get(r.index())
                            .map_or(0, |c| c.load(Relaxed)),
                    )
                })
                .collect(),
            last_event_age: (last > 0)
                .then(|| Duration::from_millis(now_ms().saturating_sub(last))),
            last_seq: self.last_seq_plus_one.load(Relaxed).checked_sub(1),
        }
    }
}
