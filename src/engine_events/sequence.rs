//! Per-publisher sequence tracking: in order, duplicate, gap or restart.
//!
//! Why this exists: a ZeroMQ PUB socket drops messages silently (slow joiner
//! at connect, high-water mark, reconnects), and an engine that restarts
//! starts numbering from 0 again with an empty cache. The index is only
//! exact if every batch is applied once, in order, and a restarted engine's
//! old blocks are dropped. These decisions are pure so they can be tested
//! without sockets; the subscriber acts on them.
//!
//! Model:
//! * `live` is the last sequence seen on the PUB stream. The engine numbers
//!   batches 0, 1, 2, ... and never goes back while it lives, so a live
//!   sequence `<= live` means the engine restarted.
//! * `applied` is the last sequence applied to the index (live or replayed).
//!   A batch is applied only when it is `applied + 1` (or any sequence after
//!   a hole that could not be filled); a batch at or below `applied` is a
//!   duplicate (e.g. live traffic that a replay already delivered).
//! * A first batch with a sequence above 0, or any live batch above
//!   `applied + 1`, is a gap: batches `[applied + 1, seq)` are missing and
//!   should be requested from the replay endpoint before `seq` is applied.

use std::ops::Range;

/// What a newly received live sequence means.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LiveObservation {
    /// The engine restarted (the live sequence went backwards from this
    /// value): the caller drops the rank's blocks before anything else.
    pub restarted_from: Option<u64>,
    /// Batches missing before this one (ask for a replay from `start`).
    pub missing: Option<Range<u64>>,
}

/// Whether to apply a batch now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Admit {
    /// Next in order: apply it.
    Apply,
    /// Already applied: skip it.
    Duplicate,
    /// Apply it, but these batches before it were lost for good.
    ApplyAfterLoss(Range<u64>),
}

/// Sequence state of one publisher (one worker's dp rank).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SequenceTracker {
    live: Option<u64>,
    applied: Option<u64>,
}

impl SequenceTracker {
    pub fn new() -> Self {
        Self::default()
    }

    /// Last sequence applied, if any.
    pub fn applied(&self) -> Option<u64> {
        self.applied
    }

    /// The first sequence not yet applied.
    pub fn next_expected(&self) -> u64 {
        self.applied.map_or(0, |a| a.saturating_add(1))
    }

    /// Record a sequence read from the PUB stream (before admitting it).
    pub fn observe_live(&mut self, seq: u64) -> LiveObservation {
        let mut obs = LiveObservation::default();
        if let Some(prev) = self.live
            && seq <= prev
        {
            obs.restarted_from = Some(prev);
            self.applied = None;
        }
        self.live = Some(seq);
        let expected = self.next_expected();
        if seq > expected {
            obs.missing = Some(expected..seq);
        }
        obs
    }

    /// Decide on a batch (live or replayed) and, unless it is a duplicate,
    /// record it as applied.
    pub fn admit(&mut self, seq: u64) -> Admit {
        let expected = self.next_expected();
        if self.applied.is_some_and(|a| seq <= a) {
            return Admit::Duplicate;
        }
        self.applied = Some(seq);
        if seq == expected {
            Admit::Apply
        } else {
            Admit::ApplyAfterLoss(expected..seq)
        }
    }
}

/// Exponential backoff between reconnect attempts, capped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Backoff {
    initial: std::time::Duration,
    max: std::time::Duration,
    current: std::time::Duration,
}

impl Backoff {
    pub fn new(initial: std::time::Duration, max: std::time::Duration) -> Self {
        Self {
            initial,
            max,
            current: initial,
        }
    }

    /// The delay to wait now; the next one doubles (up to the cap).
    pub fn next_delay(&mut self) -> std::time::Duration {
        let d = self.current;
        self.current = (self.current * 2).min(self.max);
        d
    }

    /// Back to the initial delay (after a successful connection).
    pub fn reset(&mut self) {
        self.current = self.initial;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn in_order_from_zero() {
        let mut t = SequenceTracker::new();
        for s in 0..5 {
            assert_eq!(t.observe_live(s), LiveObservation::default());
            assert_eq!(t.admit(s), Admit::Apply);
        }
        assert_eq!(t.applied(), Some(4));
    }

    #[test]
    fn first_message_nonzero_is_gap() {
        let mut t = SequenceTracker::new();
        let o = t.observe_live(7);
        assert_eq!(o.missing, Some(0..7));
        assert_eq!(o.restarted_from, None);
    }

    #[test]
    fn gap_filled_by_replay_then_live_duplicate() {
        let mut t = SequenceTracker::new();
        t.observe_live(0);
        t.admit(0);
        let o = t.observe_live(4);
        assert_eq!(o.missing, Some(1..4));
        // replay delivers 1..=5 (past the live one), then the live 4 and 5
        for s in 1..=5 {
            assert_eq!(t.admit(s), Admit::Apply);
        }
        assert_eq!(t.admit(4), Admit::Duplicate);
        assert_eq!(t.observe_live(5), LiveObservation::default());
        assert_eq!(t.admit(5), Admit::Duplicate);
        assert_eq!(t.observe_live(6).missing, None);
        assert_eq!(t.admit(6), Admit::Apply);
    }

    #[test]
    fn unrecoverable_gap_is_reported_once_and_routing_continues() {
        let mut t = SequenceTracker::new();
        t.observe_live(0);
        t.admit(0);
        assert_eq!(t.observe_live(3).missing, Some(1..3));
        assert_eq!(t.admit(3), Admit::ApplyAfterLoss(1..3));
        assert_eq!(t.observe_live(4).missing, None);
        assert_eq!(t.admit(4), Admit::Apply);
    }

    #[test]
    fn backwards_is_restart_and_resets_applied() {
        let mut t = SequenceTracker::new();
        for s in 0..10 {
            t.observe_live(s);
            t.admit(s);
        }
        let o = t.observe_live(0);
        assert_eq!(o.restarted_from, Some(9));
        assert_eq!(o.missing, None);
        assert_eq!(t.admit(0), Admit::Apply);
        // restart observed mid-stream (first batches after restart lost)
        for s in 1..5 {
            t.observe_live(s);
            t.admit(s);
        }
        let o = t.observe_live(2);
        assert_eq!(o.restarted_from, Some(4));
        assert_eq!(o.missing, Some(0..2));
    }

    #[test]
    fn same_sequence_twice_on_live_is_restart() {
        let mut t = SequenceTracker::new();
        t.observe_live(0);
        t.admit(0);
        assert_eq!(t.observe_live(0).restarted_from, Some(0));
    }

    #[test]
    fn replay_with_hole_reports_loss() {
        let mut t = SequenceTracker::new();
        let o = t.observe_live(10);
        assert_eq!(o.missing, Some(0..10));
        // the engine's replay buffer only reaches back to 6
        assert_eq!(t.admit(6), Admit::ApplyAfterLoss(0..6));
        for s in 7..10 {
            assert_eq!(t.admit(s), Admit::Apply);
        }
        assert_eq!(t.admit(10), Admit::Apply);
    }

    #[test]
    fn backoff_doubles_and_caps_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(350));
        assert_eq!(b.next_delay(), Duration::from_millis(100));
        assert_eq!(b.next_delay(), Duration::from_millis(200));
        assert_eq!(b.next_delay(), Duration::from_millis(350));
        assert_eq!(b.next_delay(), Duration::from_millis(350));
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_millis(100));
    }
}
