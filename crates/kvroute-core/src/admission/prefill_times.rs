//! What the router measures of each worker's prefills: how long the prefill
//! queued on it takes to drain, and how much slower than the TTFT policy's
//! prior its own prefills run.
//!
//! Why it exists: booked prefill tokens say what was sent to a worker, not
//! what it has left: a request booked a second ago is half computed. And the
//! prior is one engine's timings; real workers differ. Invariants:
//! * each target has a tracked queue, `busy_until`: the time its queued
//!   prefill is predicted to end. A booking the TTFT policy predicted ends
//!   at `now + prediction` and moves `busy_until` there; time drains it;
//!   each MarkPrefillComplete moves it by how late (or early) that request
//!   finished against its prediction (moved by what the queue moved since
//!   its booking), since what queues behind it moves alike. `queue_ms` is
//!   `busy_until - now`, at least 0;
//! * a target's scale is the exponentially weighted mean, in log space, of
//!   `(measured - queue predicted ahead) / own predicted` with weight
//!   [`LEARNING_RATE`], each ratio clamped to `[1/RATIO_CLAMP, RATIO_CLAMP]`
//!   first, so one stalled or instant request cannot swing it;
//! * only requests the TTFT policy predicted are measured, once each, at
//!   their first MarkPrefillComplete; memory is one entry per open booking
//!   (dropped at release, expiry or the worker's leaving) and one per
//!   target; the last [`ERROR_WINDOW`] errors are kept for operators.

use std::collections::{HashMap, VecDeque};

use crate::select::{PrefillTiming, TtftParts};
use crate::types::{WorkerId, WorkerRank};

/// Weight of each new measurement in a target's scale.
pub const LEARNING_RATE: f64 = 0.1;
/// Largest factor one measurement may claim against the prediction.
pub const RATIO_CLAMP: f64 = 8.0;
/// Predictions whose errors are kept.
pub const ERROR_WINDOW: usize = 4096;
/// Own prefills predicted shorter than this (ms) teach no scale: timer
/// noise dominates.
const MIN_PREDICTED_MS: f64 = 1.0;

#[derive(Clone, Copy, Debug)]
struct Pending {
    target: WorkerRank,
    /// The request's own prefill and decode as predicted, before scale.
    own_unscaled_ms: f64,
    /// The queue predicted ahead of it.
    queued_ms: f64,
    /// The whole prediction as made.
    predicted_ms: f64,
    booked_at_ms: u64,
    /// The target's `shift_ms` when it was booked.
    shift_at_booking_ms: f64,
}

#[derive(Clone, Copy, Debug, Default)]
struct Target {
    log_scale: f64,
    samples: u64,
    /// When the target's queued prefill is predicted to end (router ms).
    busy_until_ms: f64,
    /// How far completions have moved the queue so far, in all: a request
    /// is expected to finish at its prediction moved by what the queue
    /// moved since it was booked.
    shift_ms: f64,
}

/// One measured prediction.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PredictionError {
    pub target: WorkerRank,
    pub predicted_ms: f64,
    pub measured_ms: f64,
}

/// Tracked queues and learned scales per target, and the predictions
/// awaiting their measurement.
#[derive(Debug, Default)]
pub struct PrefillTimes {
    pending: HashMap<String, Pending>,
    targets: HashMap<WorkerRank, Target>,
    errors: VecDeque<PredictionError>,
}

impl PrefillTiming for PrefillTimes {
    fn scale(&self, target: WorkerRank) -> f64 {
        self.targets
            .get(&target)
            .filter(|t| t.samples > 0)
            .map_or(1.0, |t| t.log_scale.exp())
    }

    fn queue_ms(&self, target: WorkerRank, now_ms: u64) -> Option<f64> {
        self.targets
            .get(&target)
            .map(|t| (t.busy_until_ms - now_ms as f64).max(0.0))
    }
}

impl PrefillTimes {
    pub fn new() -> Self {
        Self::default()
    }

    /// Remembers the prediction made for a request booked on `target`, and
    /// queues its prefill there.
    pub fn predicted(
        &mut self,
        request_id: &str,
        target: WorkerRank,
        parts: TtftParts,
        now_ms: u64,
    ) {
        let predicted_ms = parts.total_ms();
        if !(predicted_ms.is_finite() && parts.scale.is_finite() && parts.scale > 0.0) {
            return;
        }
        let now = now_ms as f64;
        let entry = self.targets.entry(target).or_default();
        entry.busy_until_ms = entry.busy_until_ms.max(now + predicted_ms);
        let shift_at_booking_ms = entry.shift_ms;
        self.pending.insert(
            request_id.to_owned(),
            Pending {
                target,
                own_unscaled_ms: (parts.own_prefill_ms + parts.decode_ms) / parts.scale,
                queued_ms: parts.queued_prefill_ms,
                predicted_ms,
                booked_at_ms: now_ms,
                shift_at_booking_ms,
            },
        );
    }

    /// The request's prefill completed at `now_ms`: learn from it.
    pub fn completed(&mut self, request_id: &str, now_ms: u64) {
        let Some(p) = self.pending.remove(request_id) else {
            return;
        };
        let measured_ms = now_ms.saturating_sub(p.booked_at_ms) as f64;
        if self.errors.len() == ERROR_WINDOW {
            self.errors.pop_front();
        }
        self.errors.push_back(PredictionError {
            target: p.target,
            predicted_ms: p.predicted_ms,
            measured_ms,
        });
        let Some(target) = self.targets.get_mut(&p.target) else {
            return;
        };
        // what queues behind this request finishes as late (or early) as it
        let expected_ms = p.predicted_ms + (target.shift_ms - p.shift_at_booking_ms);
        let late_ms = measured_ms - expected_ms;
        target.shift_ms += late_ms;
        target.busy_until_ms = (target.busy_until_ms + late_ms).max(now_ms as f64);
        if p.own_unscaled_ms < MIN_PREDICTED_MS {
            return;
        }
        let own_measured = (measured_ms - p.queued_ms).max(MIN_PREDICTED_MS);
        let ratio = (own_measured / p.own_unscaled_ms).clamp(1.0 / RATIO_CLAMP, RATIO_CLAMP);
        target.log_scale = if target.samples == 0 {
            ratio.ln()
        } else {
            (1.0 - LEARNING_RATE) * target.log_scale + LEARNING_RATE * ratio.ln()
        };
        target.samples += 1;
    }

    /// The request ended (released) without more to learn.
    pub fn forget(&mut self, request_id: &str) {
        self.pending.remove(request_id);
    }

    /// Drops predictions older than `ttl_ms` (their bookings expired).
    pub fn expire(&mut self, now_ms: u64, ttl_ms: u64) {
        self.pending
            .retain(|_, p| now_ms.saturating_sub(p.booked_at_ms) <= ttl_ms);
    }

    /// A worker left: its targets and pending predictions go.
    pub fn forget_worker(&mut self, worker_id: WorkerId) {
        self.targets.retain(|t, _| t.worker_id != worker_id);
        self.pending.retain(|_, p| p.target.worker_id != worker_id);
    }

    #[cfg(test)]
    /// The learned scale of `target` and how many measurements made it.
    pub(crate) fn learned(&self, target: WorkerRank) -> Option<(f64, u64)> {
        self.targets
            .get(&target)
            .filter(|t| t.samples > 0)
            .map(|t| (t.log_scale.exp(), t.samples))
    }

    #[cfg(test)]
    /// The last measured predictions, oldest first.
    pub(crate) fn errors(&self) -> impl Iterator<Item = &PredictionError> {
        self.errors.iter()
    }

    #[cfg(test)]
    /// Predictions awaiting their measurement.
    pub(crate) fn pending(&self) -> usize {
        self.pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(w: u64) -> WorkerRank {
        WorkerRank::new(w, 0)
    }

    /// A prediction of `own` ms (before scale) behind `queued` ms.
    fn parts(times: &PrefillTimes, target: WorkerRank, queued: f64, own: f64) -> TtftParts {
        let scale = times.scale(target);
        TtftParts {
            queued_prefill_ms: queued,
            own_prefill_ms: scale * own,
            scale,
            ..TtftParts::default()
        }
    }

    #[test]
    fn a_worker_twice_as_slow_as_the_prior_is_learned() {
        let mut times = PrefillTimes::new();
        for i in 0..60 {
            let id = format!("r{i}");
            let p = parts(&times, t(1), 0.0, 100.0);
            times.predicted(&id, t(1), p, i * 1000);
            times.completed(&id, i * 1000 + 200);
        }
        let (scale, samples) = times.learned(t(1)).unwrap_or((0.0, 0));
        assert!((scale - 2.0).abs() < 0.01, "{scale}");
        assert_eq!(samples, 60);
        let last = times.errors().last().copied();
        assert!(
            last.is_some_and(|e| (e.predicted_ms - e.measured_ms).abs() < 5.0),
            "{last:?}"
        );
        // another worker is untouched
        assert_eq!(times.scale(t(2)), 1.0);
        assert_eq!(times.queue_ms(t(2), 0), None);
    }

    #[test]
    fn the_tracked_queue_grows_with_bookings_drains_with_time_and_follows_completions() {
        let mut times = PrefillTimes::new();
        times.predicted("a", t(1), parts(&times, t(1), 0.0, 300.0), 1000);
        let queued = times.queue_ms(t(1), 1000).unwrap_or(0.0);
        times.predicted("b", t(1), parts(&times, t(1), queued, 200.0), 1000);
        assert_eq!(times.queue_ms(t(1), 1000), Some(500.0));
        assert_eq!(times.queue_ms(t(1), 1100), Some(400.0));
        // "a" finished 100 ms late: "b" is behind it
        times.completed("a", 1400);
        assert_eq!(times.queue_ms(t(1), 1400), Some(200.0));
        // "b" finished early: nothing left
        times.completed("b", 1450);
        assert_eq!(times.queue_ms(t(1), 1450), Some(0.0));
        assert_eq!(times.queue_ms(t(1), 9999), Some(0.0));
    }

    #[test]
    fn outliers_are_clamped_and_unmatched_completions_ignored() {
        let mut times = PrefillTimes::new();
        times.predicted("a", t(1), parts(&times, t(1), 0.0, 10.0), 0);
        times.completed("a", 1_000_000);
        assert!((times.scale(t(1)) - RATIO_CLAMP).abs() < 1e-9);
        times.completed("a", 2_000_000);
        times.completed("never-booked", 5);
        assert_eq!(times.learned(t(1)).map(|l| l.1), Some(1));
        let mut bad = parts(&times, t(1), 0.0, 10.0);
        bad.scale = f64::NAN;
        times.predicted("b", t(1), bad, 0);
        assert_eq!(times.pending(), 0);
        times.predicted("c", t(1), parts(&times, t(1), 0.0, 10.0), 0);
        times.expire(10_000, 5_000);
        assert_eq!(times.pending(), 0);
        times.predicted("d", t(1), parts(&times, t(1), 0.0, 10.0), 0);
        times.forget_worker(1);
        assert_eq!((times.pending(), times.scale(t(1))), (0, 1.0));
        assert_eq!(times.queue_ms(t(1), 0), None);
    }
}
