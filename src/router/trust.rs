//! Per-worker trust in KV events: an exact worker whose event stream is in
//! trouble past a deadline is scored on a blended view until it is healthy
//! again.
//!
//! Why: an exact worker whose events stop arriving, or arrive past a gap
//! that never heals, keeps an index that was right up to the trouble and
//! misses everything since. Routing on it alone keeps sending the worker's
//! prefixes elsewhere and its new prompts nowhere. While untrusted, the
//! worker is scored on the larger of the index's overlap and the predicted
//! cache's (`kvroute_core::predict`, fed by what is booked there from the moment
//! it is untrusted): the index keeps what it knew, the predictions add what
//! was sent since. Neither knows what the engine evicted meanwhile; the
//! blend errs towards staying, as a sticky router would.
//!
//! Signals, each with a deadline (`TrustSettings`): a rank's PublishEvents
//! stream with a gap not healed (events held, a resend or a resync asked
//! for and not answered), an engine subscription not connected, and
//! events behind: a prefill that computed new blocks there completed
//! (MarkPrefillComplete) and no event has come from the worker since,
//! though none had come since the request was booked either (so its
//! blocks cannot have been in an earlier batch); and, at once, cached
//! tokens reported by the engine that persistently contradict the index
//! (`feedback.rs`). A
//! downgrade and a recovery are each logged once and counted
//! (`kvroute_worker_trust_changes_total`).

use std::{collections::HashMap, time::Duration};

use kvroute_core::types::{Distrust, WorkerId, WorkerRank};

/// When a worker's events stop being trusted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TrustSettings {
    /// Off: every exact worker is scored on its index, whatever its stream.
    pub enabled: bool,
    /// A gap unhealed this long makes the worker untrusted.
    pub gap_deadline: Duration,
    /// A subscription down this long makes the worker untrusted.
    pub subscription_deadline: Duration,
    /// Events this far behind a completed prefill make it untrusted.
    pub events_behind_deadline: Duration,
}

impl Default for TrustSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            gap_deadline: Duration::from_secs(5),
            subscription_deadline: Duration::from_secs(10),
            events_behind_deadline: Duration::from_secs(10),
        }
    }
}

/// A change of one worker's trust.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrustChange {
    Downgraded(WorkerId, Distrust),
    Recovered(WorkerId, Distrust),
}

/// Each worker's stream troubles and who is untrusted (see the module
/// docs). Plain data; time is passed in.
#[derive(Debug, Default)]
pub struct TrustBook {
    /// Since when (routing clock, ms) each rank has had an unhealed gap.
    gaps: HashMap<WorkerRank, u64>,
    /// Since when each worker's subscription has been down.
    down: HashMap<WorkerId, u64>,
    /// Workers whose engine's reports contradict their index now.
    contradicted: std::collections::HashSet<WorkerId>,
    /// When each worker's latest events arrived.
    last_events: HashMap<WorkerId, u64>,
    /// Since when each worker has owed events for a completed prefill.
    awaiting: HashMap<WorkerId, u64>,
    /// Workers untrusted now, and why.
    untrusted: HashMap<WorkerId, Distrust>,
}

impl TrustBook {
    /// Whether recording `open` for `target` would change anything (so the
    /// caller takes the write lock only then).
    pub(crate) fn gap_changes(&self, target: WorkerRank, open: bool) -> bool {
        self.gaps.contains_key(&target) != open
    }

    /// A rank's stream has (`open`) or has not an unhealed gap.
    pub(crate) fn note_gap(&mut self, target: WorkerRank, open: bool, now_ms: u64) {
        if open {
            self.gaps.entry(target).or_insert(now_ms);
        } else {
            self.gaps.remove(&target);
        }
    }

    /// A worker's engine subscription is (or is not) connected.
    pub(crate) fn note_subscription(&mut self, worker_id: WorkerId, connected: bool, now_ms: u64) {
        if connected {
            self.down.remove(&worker_id);
        } else {
            self.down.entry(worker_id).or_insert(now_ms);
        }
    }

    /// Whether recording events of `worker_id` at `now_ms` would change
    /// anything (so the caller takes the write lock only then, at most
    /// once a millisecond per worker).
    pub(crate) fn events_change(&self, worker_id: WorkerId, now_ms: u64) -> bool {
        self.awaiting.contains_key(&worker_id) || self.last_events.get(&worker_id) != Some(&now_ms)
    }

    /// Events of `worker_id` arrived.
    pub(crate) fn note_events(&mut self, worker_id: WorkerId, now_ms: u64) {
        self.last_events.insert(worker_id, now_ms);
        self.awaiting.remove(&worker_id);
    }

    /// A prefill booked at `booked_ms` that computed new blocks completed
    /// on `worker_id`: unless events came since the booking, the worker
    /// owes some.
    pub(crate) fn note_prefill_completed(
        &mut self,
        worker_id: WorkerId,
        booked_ms: u64,
        now_ms: u64,
    ) {
        let since_booking = self
            .last_events
            .get(&worker_id)
            .is_some_and(|&at| at >= booked_ms);
        if !since_booking {
            self.awaiting.entry(worker_id).or_insert(now_ms);
        }
    }

    /// Whether the engine's reports contradict a worker's index now.
    pub(crate) fn note_contradiction(&mut self, worker_id: WorkerId, contradicted: bool) {
        if contradicted {
            self.contradicted.insert(worker_id);
        } else {
            self.contradicted.remove(&worker_id);
        }
    }

    /// Why `worker_id` is untrusted now, if it is.
    pub(crate) fn distrust(&self, worker_id: WorkerId) -> Option<Distrust> {
        self.untrusted.get(&worker_id).copied()
    }

    /// Workers untrusted now.
    pub(crate) fn untrusted_count(&self) -> usize {
        self.untrusted.len()
    }

    /// The trouble of `worker_id` past its deadline at `now_ms`, if any.
    fn trouble(
        &self,
        worker_id: WorkerId,
        settings: &TrustSettings,
        now_ms: u64,
    ) -> Option<Distrust> {
        let past = |since: u64, deadline: Duration| {
            now_ms.saturating_sub(since) >= u64::try_from(deadline.as_millis()).unwrap_or(u64::MAX)
        };
        let gap = self
            .gaps
            .iter()
            .any(|(t, &since)| t.worker_id == worker_id && past(since, settings.gap_deadline));
        if gap {
            return Some(Distrust::GapUnhealed);
        }
        if self.contradicted.contains(&worker_id) {
            return Some(Distrust::Contradicted);
        }
        if self
            .awaiting
            .get(&worker_id)
            .is_some_and(|&since| past(since, settings.events_behind_deadline))
        {
            return Some(Distrust::EventsBehind);
        }
        self.down
            .get(&worker_id)
            .filter(|&&since| past(since, settings.subscription_deadline))
            .map(|_| Distrust::SubscriptionDown)
    }

    /// Downgrades workers in trouble past a deadline and recovers those no
    /// longer in trouble; returns what changed, once per change.
    pub(crate) fn evaluate(&mut self, settings: &TrustSettings, now_ms: u64) -> Vec<TrustChange> {
        if !settings.enabled {
            return self
                .untrusted
                .drain()
                .map(|(w, d)| TrustChange::Recovered(w, d))
                .collect();
        }
        let mut troubled: Vec<WorkerId> = self
            .gaps
            .keys()
            .map(|t| t.worker_id)
            .chain(self.down.keys().copied())
            .chain(self.contradicted.iter().copied())
            .chain(self.awaiting.keys().copied())
            .chain(self.untrusted.keys().copied())
            .collect();
        troubled.sort_unstable();
        troubled.dedup();
        let mut changes = Vec::new();
        for worker_id in troubled {
            let now = self.trouble(worker_id, settings, now_ms);
            match (self.untrusted.get(&worker_id).copied(), now) {
                (None, Some(why)) => {
                    self.untrusted.insert(worker_id, why);
                    changes.push(TrustChange::Downgraded(worker_id, why));
                }
                (Some(why), None) if !self.in_trouble(worker_id) => {
                    self.untrusted.remove(&worker_id);
                    changes.push(TrustChange::Recovered(worker_id, why));
                }
                _ => {}
            }
        }
        changes
    }

    /// Whether any trouble of the worker is open, past its deadline or not:
    /// an untrusted worker recovers only once none is.
    fn in_trouble(&self, worker_id: WorkerId) -> bool {
        self.gaps.keys().any(|t| t.worker_id == worker_id)
            || self.down.contains_key(&worker_id)
            || self.contradicted.contains(&worker_id)
            || self.awaiting.contains_key(&worker_id)
    }

    /// Forgets a worker that left (or re-registered with another layout).
    pub(crate) fn forget_worker(&mut self, worker_id: WorkerId) {
        self.gaps.retain(|t, _| t.worker_id != worker_id);
        self.down.remove(&worker_id);
        self.contradicted.remove(&worker_id);
        self.last_events.remove(&worker_id);
        self.awaiting.remove(&worker_id);
        self.untrusted.remove(&worker_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> TrustSettings {
        TrustSettings {
            enabled: true,
            gap_deadline: Duration::from_millis(100),
            subscription_deadline: Duration::from_millis(300),
            events_behind_deadline: Duration::from_millis(200),
        }
    }

    #[test]
    fn a_worker_owing_events_for_a_completed_prefill_past_the_deadline_is_behind() {
        let mut book = TrustBook::default();
        book.note_events(5, 0);
        // Booked at 10, completed at 50: no event since the booking.
        book.note_prefill_completed(5, 10, 50);
        assert!(book.evaluate(&settings(), 249).is_empty());
        assert_eq!(
            book.evaluate(&settings(), 250),
            vec![TrustChange::Downgraded(5, Distrust::EventsBehind)]
        );
        assert!(book.events_change(5, 251));
        book.note_events(5, 300);
        assert_eq!(
            book.evaluate(&settings(), 301),
            vec![TrustChange::Recovered(5, Distrust::EventsBehind)]
        );
        // Events that came after the booking may hold its blocks: nothing
        // is owed for it.
        book.note_prefill_completed(5, 290, 400);
        assert!(book.evaluate(&settings(), 10_000).is_empty());
        assert!(!book.events_change(5, 300), "written once a millisecond");
    }

    #[test]
    fn a_gap_unhealed_past_its_deadline_downgrades_once_and_healing_recovers_once() {
        let mut book = TrustBook::default();
        let rank = WorkerRank::new(1, 0);
        book.note_gap(rank, true, 1000);
        assert!(
            book.evaluate(&settings(), 1099).is_empty(),
            "within the deadline"
        );
        assert_eq!(
            book.evaluate(&settings(), 1100),
            vec![TrustChange::Downgraded(1, Distrust::GapUnhealed)]
        );
        assert!(book.evaluate(&settings(), 5000).is_empty(), "logged once");
        assert_eq!(book.distrust(1), Some(Distrust::GapUnhealed));
        // A second gap opening later does not restart the first's clock.
        book.note_gap(rank, true, 4000);
        book.note_gap(rank, false, 5001);
        assert_eq!(
            book.evaluate(&settings(), 5002),
            vec![TrustChange::Recovered(1, Distrust::GapUnhealed)]
        );
        assert_eq!(book.distrust(1), None);
        assert!(book.evaluate(&settings(), 9000).is_empty());
    }

    #[test]
    fn a_worker_recovers_only_when_every_trouble_is_over() {
        let mut book = TrustBook::default();
        book.note_subscription(2, false, 0);
        book.note_gap(WorkerRank::new(2, 1), true, 0);
        assert_eq!(
            book.evaluate(&settings(), 150),
            vec![TrustChange::Downgraded(2, Distrust::GapUnhealed)]
        );
        book.note_gap(WorkerRank::new(2, 1), false, 200);
        assert!(book.evaluate(&settings(), 250).is_empty(), "still down");
        book.note_subscription(2, true, 260);
        assert_eq!(
            book.evaluate(&settings(), 270),
            vec![TrustChange::Recovered(2, Distrust::GapUnhealed)]
        );
        book.note_subscription(2, false, 300);
        assert!(book.evaluate(&settings(), 599).is_empty());
        assert_eq!(
            book.evaluate(&settings(), 600),
            vec![TrustChange::Downgraded(2, Distrust::SubscriptionDown)]
        );
    }

    #[test]
    fn trust_switched_off_recovers_everyone_and_forgetting_drops_a_worker() {
        let mut book = TrustBook::default();
        book.note_gap(WorkerRank::new(3, 0), true, 0);
        book.note_gap(WorkerRank::new(4, 0), true, 0);
        assert_eq!(book.evaluate(&settings(), 100).len(), 2);
        book.forget_worker(4);
        assert_eq!(book.untrusted_count(), 1);
        let off = TrustSettings {
            enabled: false,
            ..settings()
        };
        assert_eq!(
            book.evaluate(&off, 200),
            vec![TrustChange::Recovered(3, Distrust::GapUnhealed)]
        );
        assert_eq!(book.distrust(3), None);
    }
}
