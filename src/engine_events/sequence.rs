//! Per-publisher sequence tracking: in order, duplicate, gap, restart, jump.
//!
//! Why this exists: a ZeroMQ PUB socket drops messages silently (slow joiner
//! at connect, high-water mark, reconnects), replays overlap what already
//! arrived, and an engine that restarts starts numbering from 0 again with an
//! empty cache. The index is only exact if every batch is applied once, in
//! order, and a restarted engine's old blocks are dropped; and when it cannot
//! be exact, that must be known. These decisions are pure so they can be
//! tested without sockets; the subscriber acts on them.
//!
//! Model. An engine numbers its batches 0, 1, 2, ... per dp rank and never
//! goes back while it lives; a PUB connection delivers only batches
//! published after it was made, in order; the replay socket returns the
//! buffered batches from a requested sequence on (the engines keep
//! [`REPLAY_WINDOW`] of them by default), which may overlap live traffic.
//! * `applied` is the last sequence admitted (live or replayed); it can be
//!   seeded from a saved value ([`SequenceTracker::resumed`]).
//! * `live` is the highest sequence seen on the PUB stream; a connection's
//!   first live batch is *fresh* ([`SequenceTracker::connected`]).
//!
//! Rules for a live sequence `s` (in this order):
//! 1. **Restart** (the rank is cleared, numbering starts over) only when `s`
//!    really means one:
//!    * *back to near zero*: `s < RESTART_FLOOR` and `s` is strictly below
//!      the previous sequence (the last live one; for a fresh connection the
//!      highest seen, live or applied); or
//!    * *far back on a new connection*: a fresh connection's first `s` is
//!      more than [`REPLAY_WINDOW`] below `applied`: no replay overlap
//!      reaches that far, only a new engine numbering from 0 again.
//! 2. **Jump**: `s` more than [`MAX_JUMP`] beyond the next expected sequence
//!    is one anomaly: the batch is skipped, no replay is asked for, the
//!    position does not move (so the engine's next real sequence carries on,
//!    and is not taken for a restart), and the rank is unsynced. If the very
//!    next live batch is `s + 1`, the engine really numbers from there and it
//!    is taken as the new position (the rank stays unsynced). Two numbers
//!    are weak evidence, though (a corrupt or hostile pair such as 2^63,
//!    2^63 + 1): while the new position has advanced less than
//!    [`RESTART_FLOOR`] batches, a live sequence just past the old position
//!    (within [`MAX_JUMP`]) is the old numbering carrying on, and the
//!    position goes back to it, never a restart.
//! 3. **Duplicate**: `s <= applied` otherwise (a repeat of the same number,
//!    replay overlap, a small step back): skipped and counted, never a wipe.
//!    A fresh connection that starts *below* `applied` is a step back no live
//!    engine makes (it may be a restart that rule 1 cannot prove), so the
//!    rank is also marked unsynced.
//! 4. **Gap**: `s > applied + 1` (or a first batch above 0): batches
//!    `[applied + 1, s)` are missing and should be replayed before `s` is
//!    applied. Batches the replay cannot deliver (no replay endpoint, beyond
//!    the engine's buffer, a failed replay) are lost for good: counted (at
//!    most `MAX_JUMP` per gap, by rule 2) and the rank is unsynced.
//!
//! A batch (live or replayed) is admitted when it is `applied + 1`, or the
//! first one after a hole that could not be filled; a replayed batch beyond
//! `MAX_JUMP` is skipped as a jump.
//!
//! **Unsynced**: the rank's index may differ from the engine's cache
//! (lost batches, a jump, a step back on a new connection, or carried over
//! from a saved state). It stays so until the engine reports
//! `AllBlocksCleared` ([`SequenceTracker::cleared`]) or restarts (the rank
//! is cleared and the new engine starts empty); then it is exact again.

use std::ops::Range;

/// A live sequence below this, and below the previous one, is an engine
/// that restarted and numbers from 0 again (the few first batches may be
/// lost to the slow joiner).
pub const RESTART_FLOOR: u64 = 16;

/// How far back an engine's replay socket reaches: vLLM's and SGLang's
/// default `buffer_steps`. A fresh connection starting further below the
/// applied sequence than this is a restarted engine.
pub const REPLAY_WINDOW: u64 = 10_000;

/// The largest gap taken at face value: about three hours of a busy rank's
/// batches, a hundred times more than any replay can deliver. A sequence
/// further ahead is one anomaly, not that many lost batches, so a hostile
/// or corrupt number cannot inflate a counter or move the position.
pub const MAX_JUMP: u64 = 1 << 20;

/// What a newly received live sequence means.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LiveObservation {
    /// The engine restarted (the highest sequence seen before was this
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
    /// Apply it, but these batches before it were lost for good (never more
    /// than [`MAX_JUMP`]); the rank is unsynced.
    ApplyAfterLoss(Range<u64>),
    /// More than [`MAX_JUMP`] ahead: skip it; the rank is unsynced.
    Jump,
}

/// Why a rank's index may differ from its engine's cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unsynced {
    /// These batches were lost for good.
    Lost(Range<u64>),
    /// A sequence more than [`MAX_JUMP`] ahead.
    Jump(u64),
    /// A new connection started at `seq`, below the applied sequence, but
    /// not far enough for a restart.
    StepBack { seq: u64, applied: u64 },
    /// The saved state it resumed from was unsynced.
    Resumed,
}

/// Sequence state of one publisher (one worker's dp rank).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SequenceTracker {
    live: Option<u64>,
    applied: Option<u64>,
    /// The next live sequence is the first of a connection.
    fresh: bool,
    /// The last live sequence skipped as a jump (rule 2), when it was the
    /// latest live one.
    jumped: Option<u64>,
    /// While a jump taken as the new position is young (rule 2): the
    /// position before it (`applied`, `live`) and where the new one began.
    before_jump: Option<(Option<u64>, Option<u64>, u64)>,
    unsynced: Option<Unsynced>,
}

impl Default for SequenceTracker {
    fn default() -> Self {
        Self::new()
    }
}

impl SequenceTracker {
    /// A tracker that has applied nothing: the first batch is expected to
    /// be 0.
    pub(crate) fn new() -> Self {
        Self {
            live: None,
            applied: None,
            fresh: true,
            jumped: None,
            before_jump: None,
            unsynced: None,
        }
    }

    /// A tracker that already applied everything up to `last_applied` (a
    /// saved state): a first live batch above `last_applied + 1` is a gap,
    /// replayed from `last_applied + 1`.
    pub(crate) fn resumed(last_applied: u64) -> Self {
        Self {
            applied: Some(last_applied),
            ..Self::new()
        }
    }

    /// Last sequence applied, if any.
    pub(crate) fn applied(&self) -> Option<u64> {
        self.applied
    }

    /// The first sequence not yet applied.
    pub(crate) fn next_expected(&self) -> u64 {
        self.applied.map_or(0, |a| a.saturating_add(1))
    }

    /// Why the rank is unsynced (the first cause since it was last exact),
    /// `None` while it is exact.
    pub(crate) fn unsynced(&self) -> Option<&Unsynced> {
        self.unsynced.as_ref()
    }

    /// Marks the rank unsynced (keeps an earlier cause).
    pub(crate) fn mark_unsynced(&mut self, why: Unsynced) {
        self.unsynced.get_or_insert(why);
    }

    /// The engine reported `AllBlocksCleared` (applied): the rank is exact
    /// again.
    pub(crate) fn cleared(&mut self) {
        self.unsynced = None;
    }

    /// A new connection to the publisher was made: its first live sequence
    /// is judged as fresh (rules 1 and 3).
    pub(crate) fn connected(&mut self) {
        self.fresh = true;
    }

    /// Record a sequence read from the PUB stream (before admitting it).
    pub(crate) fn observe_live(&mut self, seq: u64) -> LiveObservation {
        let mut obs = LiveObservation::default();
        self.return_from_a_young_jump(seq);
        let fresh = std::mem::replace(&mut self.fresh, false);
        let highest = self.live.max(self.applied);
        let previous = if fresh { highest } else { self.live };
        let near_zero = seq < RESTART_FLOOR && previous.is_some_and(|p| seq < p);
        let far_back = fresh
            && self
                .applied
                .is_some_and(|a| a.saturating_sub(seq) > REPLAY_WINDOW);
        if near_zero || far_back {
            obs.restarted_from = highest;
            self.live = None;
            self.applied = None;
            self.jumped = None;
            self.before_jump = None;
            self.unsynced = None;
        }
        let expected = self.next_expected();
        if seq.saturating_sub(expected) > MAX_JUMP {
            if self.jumped.and_then(|j| j.checked_add(1)) == Some(seq) {
                // The engine numbers from there: the jumped batch is gone.
                self.before_jump = Some((self.applied, self.live, seq));
                self.applied = Some(seq - 1);
                self.live = Some(seq);
                self.jumped = None;
            } else {
                self.jumped = Some(seq);
                // The connection's first real sequence is still to come.
                self.fresh = fresh;
            }
            return obs;
        }
        self.jumped = None;
        if fresh
            && obs.restarted_from.is_none()
            && let Some(applied) = self.applied
            && seq < applied
        {
            self.mark_unsynced(Unsynced::StepBack { seq, applied });
        }
        self.live = self.live.max(Some(seq));
        if seq > expected {
            obs.missing = Some(expected..seq);
        }
        obs
    }

    /// Rule 2's way back: `seq` just past the position held before a young
    /// jump means the old numbering carries on; the position returns to it.
    /// A new position that has advanced [`RESTART_FLOOR`] batches is the
    /// engine's own.
    fn return_from_a_young_jump(&mut self, seq: u64) {
        let Some((applied, live, adopted_at)) = self.before_jump else {
            return;
        };
        let old_next = applied.map_or(0, |a| a.saturating_add(1));
        let old_carries_on = seq >= old_next && seq - old_next <= MAX_JUMP;
        if old_carries_on {
            self.applied = applied;
            self.live = live;
            self.before_jump = None;
        } else if seq > adopted_at && seq - adopted_at >= RESTART_FLOOR {
            self.before_jump = None;
        }
    }

    /// Decide on a batch (live or replayed) and, when it applies, record it
    /// as applied.
    pub(crate) fn admit(&mut self, seq: u64) -> Admit {
        if self.applied.is_some_and(|a| seq <= a) {
            return Admit::Duplicate;
        }
        let expected = self.next_expected();
        if seq.saturating_sub(expected) > MAX_JUMP {
            self.mark_unsynced(Unsynced::Jump(seq));
            return Admit::Jump;
        }
        self.applied = Some(seq);
        if seq == expected {
            Admit::Apply
        } else {
            self.mark_unsynced(Unsynced::Lost(expected..seq));
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
    pub(crate) fn new(initial: std::time::Duration, max: std::time::Duration) -> Self {
        Self {
            initial,
            max,
            current: initial,
        }
    }

    /// The delay to wait now; the next one doubles (up to the cap).
    pub(crate) fn next_delay(&mut self) -> std::time::Duration {
        let d = self.current;
        self.current = (self.current * 2).min(self.max);
        d
    }

    /// Back to the initial delay (after a successful connection).
    pub(crate) fn reset(&mut self) {
        self.current = self.initial;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A tracker that saw and applied `0..=last` live on one connection.
    fn fed(last: u64) -> SequenceTracker {
        let mut t = SequenceTracker::new();
        for s in 0..=last {
            assert_eq!(t.observe_live(s), LiveObservation::default());
            assert_eq!(t.admit(s), Admit::Apply);
        }
        t
    }

    fn restart_from(prev: u64, missing: Option<Range<u64>>) -> LiveObservation {
        LiveObservation {
            restarted_from: Some(prev),
            missing,
        }
    }

    #[test]
    fn in_order_from_zero() {
        let t = fed(4);
        assert_eq!(t.applied(), Some(4));
        assert_eq!(t.unsynced(), None);
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
        let mut t = fed(0);
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
        assert_eq!(t.unsynced(), None);
    }

    #[test]
    fn slow_joiner_overlap_near_zero_is_not_a_restart() {
        // first live batch 2, the replay delivers 0..=5, then live 3, 4, 5
        let mut t = SequenceTracker::new();
        assert_eq!(t.observe_live(2).missing, Some(0..2));
        for s in 0..=5 {
            assert_eq!(t.admit(s), Admit::Apply);
        }
        for s in 3..=5 {
            assert_eq!(t.observe_live(s), LiveObservation::default());
            assert_eq!(t.admit(s), Admit::Duplicate);
        }
        assert_eq!(t.applied(), Some(5));
    }

    #[test]
    fn unrecoverable_gap_is_counted_and_unsyncs_the_rank() {
        let mut t = fed(0);
        assert_eq!(t.observe_live(3).missing, Some(1..3));
        assert_eq!(t.admit(3), Admit::ApplyAfterLoss(1..3));
        assert_eq!(t.unsynced(), Some(&Unsynced::Lost(1..3)));
        assert_eq!(t.observe_live(4).missing, None);
        assert_eq!(t.admit(4), Admit::Apply);
        // a second loss keeps the first cause
        assert_eq!(t.observe_live(6).missing, Some(5..6));
        assert_eq!(t.admit(6), Admit::ApplyAfterLoss(5..6));
        assert_eq!(t.unsynced(), Some(&Unsynced::Lost(1..3)));
        // AllBlocksCleared: exact again
        t.cleared();
        assert_eq!(t.unsynced(), None);
        assert_eq!(t.applied(), Some(6));
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
        assert_eq!(t.unsynced(), Some(&Unsynced::Lost(0..6)));
    }

    #[test]
    fn back_to_near_zero_is_a_restart() {
        let mut t = fed(9);
        assert_eq!(t.observe_live(0), restart_from(9, None));
        assert_eq!(t.applied(), None);
        assert_eq!(t.admit(0), Admit::Apply);
        // restart observed mid-stream (first batches after restart lost)
        for s in 1..5 {
            t.observe_live(s);
            t.admit(s);
        }
        assert_eq!(t.observe_live(2), restart_from(4, Some(0..2)));
        // the floor: 15 is near zero, 16 is not
        let mut t = fed(40);
        assert_eq!(t.observe_live(RESTART_FLOOR - 1).restarted_from, Some(40));
        let mut t = fed(40);
        assert_eq!(t.observe_live(RESTART_FLOOR).restarted_from, None);
        assert_eq!(t.admit(RESTART_FLOOR), Admit::Duplicate);
    }

    #[test]
    fn same_sequence_twice_is_a_duplicate_not_a_restart() {
        for last in [0, 3, 40, 20_000] {
            let mut t = SequenceTracker::resumed(last);
            assert_eq!(t.observe_live(last + 1).missing, None);
            assert_eq!(t.admit(last + 1), Admit::Apply);
            // the same number again, on the same connection and on a new one
            assert_eq!(t.observe_live(last + 1), LiveObservation::default());
            assert_eq!(t.admit(last + 1), Admit::Duplicate);
            t.connected();
            assert_eq!(t.observe_live(last + 1), LiveObservation::default());
            assert_eq!(t.admit(last + 1), Admit::Duplicate);
            assert_eq!(t.applied(), Some(last + 1), "{last}");
            assert_eq!(t.unsynced(), None, "{last}");
        }
    }

    #[test]
    fn small_step_back_is_a_duplicate() {
        let mut t = fed(40);
        assert_eq!(t.observe_live(30), LiveObservation::default());
        assert_eq!(t.admit(30), Admit::Duplicate);
        assert_eq!(t.applied(), Some(40));
        assert_eq!(t.unsynced(), None);
        // far back, but on the same connection: still not a restart
        let mut t = SequenceTracker::resumed(50_000);
        t.observe_live(50_001);
        t.admit(50_001);
        assert_eq!(t.observe_live(100), LiveObservation::default());
        assert_eq!(t.admit(100), Admit::Duplicate);
        assert_eq!(t.observe_live(50_002), LiveObservation::default());
        assert_eq!(t.admit(50_002), Admit::Apply);
    }

    #[test]
    fn new_connection_far_back_is_a_restart() {
        let mut t = fed(20);
        t.admit(20_000 - 1); // (pretend) applied up to 19_999 through a replay
        let mut t2 = SequenceTracker::resumed(20_000);
        for t in [&mut t, &mut t2] {
            let applied = t.applied().unwrap_or_default();
            t.connected();
            let s = applied - REPLAY_WINDOW - 1;
            assert_eq!(t.observe_live(s), restart_from(applied, Some(0..s)));
            assert_eq!(t.unsynced(), None);
        }
    }

    #[test]
    fn new_connection_step_back_within_the_window_unsyncs_without_a_wipe() {
        let mut t = SequenceTracker::resumed(20_000);
        t.connected();
        let s = 20_000 - REPLAY_WINDOW;
        assert_eq!(t.observe_live(s), LiveObservation::default());
        assert_eq!(t.admit(s), Admit::Duplicate);
        assert_eq!(
            t.unsynced(),
            Some(&Unsynced::StepBack {
                seq: s,
                applied: 20_000
            })
        );
        assert_eq!(t.applied(), Some(20_000));
        // numbering carries on past the applied sequence
        for s in s + 1..=20_000 {
            assert_eq!(t.observe_live(s), LiveObservation::default());
            assert_eq!(t.admit(s), Admit::Duplicate);
        }
        assert_eq!(t.observe_live(20_001), LiveObservation::default());
        assert_eq!(t.admit(20_001), Admit::Apply);
    }

    #[test]
    fn absurd_jump_is_skipped_and_the_next_real_sequence_carries_on() {
        for absurd in [1 << 63, u64::MAX, 3 + MAX_JUMP + 2] {
            let mut t = fed(3);
            assert_eq!(t.observe_live(absurd), LiveObservation::default());
            assert_eq!(t.admit(absurd), Admit::Jump);
            assert_eq!(t.applied(), Some(3));
            assert_eq!(t.unsynced(), Some(&Unsynced::Jump(absurd)));
            assert_eq!(t.observe_live(4), LiveObservation::default());
            assert_eq!(t.admit(4), Admit::Apply);
            // and again after it: not a restart, not a duplicate
            assert_eq!(t.observe_live(5), LiveObservation::default());
            assert_eq!(t.admit(5), Admit::Apply);
        }
    }

    #[test]
    fn the_largest_gap_taken_at_face_value_is_max_jump() {
        let mut t = fed(3);
        assert_eq!(t.observe_live(4 + MAX_JUMP).missing, Some(4..4 + MAX_JUMP));
        assert_eq!(
            t.admit(4 + MAX_JUMP),
            Admit::ApplyAfterLoss(4..4 + MAX_JUMP)
        );
        let mut t = fed(3);
        assert_eq!(t.observe_live(5 + MAX_JUMP).missing, None);
        assert_eq!(t.admit(5 + MAX_JUMP), Admit::Jump);
    }

    #[test]
    fn a_jump_continued_by_the_next_batch_is_the_new_position() {
        let j = 5 * MAX_JUMP;
        let mut t = fed(3);
        assert_eq!(t.observe_live(j), LiveObservation::default());
        assert_eq!(t.admit(j), Admit::Jump);
        assert_eq!(t.observe_live(j + 1), LiveObservation::default());
        assert_eq!(t.admit(j + 1), Admit::Apply);
        assert_eq!(t.applied(), Some(j + 1));
        assert_eq!(t.unsynced(), Some(&Unsynced::Jump(j)));
        // not when something else came between
        let mut t = fed(3);
        t.observe_live(j);
        assert_eq!(t.admit(j), Admit::Jump);
        t.observe_live(4);
        assert_eq!(t.admit(4), Admit::Apply);
        assert_eq!(t.observe_live(j + 1), LiveObservation::default());
        assert_eq!(t.admit(j + 1), Admit::Jump);
        assert_eq!(t.applied(), Some(4));
        // a skipped jump leaves a new connection's first real batch fresh
        let mut t = SequenceTracker::resumed(50_000);
        t.connected();
        t.observe_live(u64::MAX);
        assert_eq!(t.admit(u64::MAX), Admit::Jump);
        assert_eq!(t.observe_live(100).restarted_from, Some(50_000));
        // a first batch far ahead (kvroute meets an old engine) likewise
        let mut t = SequenceTracker::new();
        t.observe_live(j);
        assert_eq!(t.admit(j), Admit::Jump);
        t.observe_live(j + 1);
        assert_eq!(t.admit(j + 1), Admit::Apply);
    }

    /// #38: two bogus sequences (2^63, 2^63 + 1) took the position; the
    /// engine's real next batch was then a restart (the rank wiped), or,
    /// past RESTART_FLOOR, a duplicate forever.
    #[test]
    fn a_bogus_pair_of_sequences_does_not_take_the_engines_numbering() {
        for last in [5, 40] {
            let mut t = fed(last);
            for bogus in [1 << 63, (1 << 63) + 1] {
                assert_eq!(t.observe_live(bogus), LiveObservation::default());
                t.admit(bogus);
            }
            let real = last + 1;
            assert_eq!(
                t.observe_live(real),
                LiveObservation::default(),
                "after {last}: neither a restart nor a gap"
            );
            assert_eq!(t.admit(real), Admit::Apply);
            assert_eq!(t.applied(), Some(real));
            assert_eq!(t.unsynced(), Some(&Unsynced::Jump(1 << 63)));
            // The old numbering carries on from there, lost batches too.
            assert_eq!(t.observe_live(real + 3).missing, Some(real + 1..real + 3));
        }
        // An engine that really renumbered keeps its new position once it
        // has advanced: a low number later is a restart again.
        let j = 5 * MAX_JUMP;
        let mut t = fed(5);
        for s in j..j + 2 * RESTART_FLOOR {
            t.observe_live(s);
            t.admit(s);
        }
        assert_eq!(t.applied(), Some(j + 2 * RESTART_FLOOR - 1));
        assert_eq!(t.before_jump, None, "the new position is the engine's own");
        assert!(t.observe_live(0).restarted_from.is_some());
    }

    #[test]
    fn replayed_jump_is_skipped() {
        let mut t = fed(0);
        assert_eq!(t.observe_live(3).missing, Some(1..3));
        assert_eq!(t.admit(1), Admit::Apply);
        assert_eq!(t.admit(u64::MAX), Admit::Jump);
        assert_eq!(t.admit(2), Admit::Apply);
        assert_eq!(t.admit(3), Admit::Apply);
        assert!(matches!(t.unsynced(), Some(Unsynced::Jump(_))));
    }

    #[test]
    fn resumed_tracker_replays_from_the_saved_sequence() {
        let mut t = SequenceTracker::resumed(9);
        assert_eq!(t.next_expected(), 10);
        assert_eq!(
            t.observe_live(15),
            LiveObservation {
                restarted_from: None,
                missing: Some(10..15)
            }
        );
        let mut t = SequenceTracker::resumed(9);
        assert_eq!(t.observe_live(10), LiveObservation::default());
        assert_eq!(t.admit(10), Admit::Apply);
        // the engine restarted meanwhile: back to near zero
        let mut t = SequenceTracker::resumed(9);
        assert_eq!(t.observe_live(3), restart_from(9, Some(0..3)));
        // or far back
        let mut t = SequenceTracker::resumed(50_000);
        assert_eq!(t.observe_live(100), restart_from(50_000, Some(0..100)));
    }

    #[test]
    fn restart_and_clear_make_the_rank_exact_again() {
        let mut t = SequenceTracker::resumed(40);
        t.mark_unsynced(Unsynced::Resumed);
        t.mark_unsynced(Unsynced::Jump(1));
        assert_eq!(t.unsynced(), Some(&Unsynced::Resumed));
        assert_eq!(t.observe_live(0).restarted_from, Some(40));
        assert_eq!(t.unsynced(), None);
        t.mark_unsynced(Unsynced::Resumed);
        t.cleared();
        assert_eq!(t.unsynced(), None);
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
