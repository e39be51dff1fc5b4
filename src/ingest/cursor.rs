//! The event cursor of one (worker, dp_rank): decides, for each incoming
//! `event_id`, whether to apply it, skip it, or apply it and ask for a resend.
//!
//! Rules:
//! * the next id after the last applied one applies;
//! * an id already applied, or older than the last `cleared` barrier, is a
//!   duplicate or stale: skipped and counted;
//! * an id beyond the next one opens a gap: the event applies (routing keeps
//!   working on what arrived) and the ids in between are remembered as holes;
//!   replies ask the worker to resend from the first hole for as long as one
//!   is open. Resent events that fill a hole apply.
//! * an event the index rejects while an earlier one is missing becomes a
//!   hole itself, so the resend that brings its parent brings it again;
//! * a `cleared` event is a barrier: every hole before it is forgotten (the
//!   cache they described is gone) and older ids become stale.
//!
//! Holes are kept as at most `MAX_HOLES` ranges; when more open, the oldest
//! are given up (counted) rather than growing without bound.

use std::ops::Range;

/// Most hole ranges remembered per cursor.
pub const MAX_HOLES: usize = 64;

/// What to do with one event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Apply it.
    Apply,
    /// Apply it; events from `resend_from` are missing.
    ApplyAfterGap { resend_from: u64 },
    /// Skip it: already applied, or older than a barrier.
    Skip,
}

/// Cursor state and counters of one (worker, dp_rank).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EventCursor {
    /// The highest event id seen and applied (None before the first).
    last_applied: Option<u64>,
    /// Ids below this are stale (before the last `cleared`).
    barrier: u64,
    /// Missing id ranges below `last_applied`, oldest first.
    holes: Vec<Range<u64>>,
    pub applied: u64,
    pub skipped: u64,
    pub rejected: u64,
    pub gaps: u64,
    pub holes_given_up: u64,
}

impl EventCursor {
    /// A cursor restored from a snapshot: the next expected id is
    /// `last_applied + 1`; nothing is missing.
    pub fn resumed(last_applied: Option<u64>) -> Self {
        Self {
            last_applied,
            ..Self::default()
        }
    }

    pub fn last_applied(&self) -> Option<u64> {
        self.last_applied
    }

    /// The first missing id, if any event is missing.
    pub fn first_missing(&self) -> Option<u64> {
        self.holes.first().map(|h| h.start)
    }

    /// Classifies `event_id` and advances the cursor as if it will be applied
    /// (the caller applies every `Apply*` verdict). `is_clear` marks a
    /// `cleared` event, which becomes a barrier.
    pub fn admit(&mut self, event_id: u64, is_clear: bool) -> Verdict {
        if event_id < self.barrier {
            self.skipped += 1;
            return Verdict::Skip;
        }
        let verdict = match self.last_applied {
            None if event_id == self.barrier => Verdict::Apply,
            // A first event past 0 means earlier ones never arrived (a worker
            // that started before it connected): ask for them.
            None => {
                self.open_hole(self.barrier..event_id);
                self.gaps += 1;
                Verdict::ApplyAfterGap {
                    resend_from: self.barrier,
                }
            }
            Some(last) if Some(event_id) == last.checked_add(1) => Verdict::Apply,
            Some(last) if event_id > last => {
                // last < event_id, so last + 1 cannot overflow.
                self.open_hole(last + 1..event_id);
                self.gaps += 1;
                Verdict::ApplyAfterGap {
                    resend_from: self.first_missing().unwrap_or(last + 1),
                }
            }
            Some(_) => {
                if self.fill_hole(event_id) {
                    Verdict::Apply
                } else {
                    self.skipped += 1;
                    return Verdict::Skip;
                }
            }
        };
        if self.last_applied.is_none_or(|last| event_id > last) {
            self.last_applied = Some(event_id);
        }
        if is_clear {
            self.barrier = event_id;
            self.holes.clear();
        }
        self.applied += 1;
        verdict
    }

    /// Counts an event that was admitted but then rejected by the index. When
    /// an earlier event is still missing, the rejection is likely caused by
    /// that gap (a parent in the lost events), so the id becomes a hole again
    /// and a resend of it applies; with nothing missing it stays rejected.
    pub fn record_rejected(&mut self, event_id: u64) {
        self.rejected += 1;
        self.applied = self.applied.saturating_sub(1);
        if self.holes.iter().any(|h| h.start < event_id) {
            self.open_hole(event_id..event_id.saturating_add(1));
        }
    }

    fn open_hole(&mut self, range: Range<u64>) {
        if range.is_empty() {
            return;
        }
        let at = self.holes.partition_point(|h| h.start < range.start);
        self.holes.insert(at, range);
        while self.holes.len() > MAX_HOLES {
            self.holes.remove(0);
            self.holes_given_up += 1;
        }
    }

    fn fill_hole(&mut self, id: u64) -> bool {
        let Some(index) = self.holes.iter().position(|h| h.contains(&id)) else {
            return false;
        };
        let hole = self.holes.remove(index);
        let mut pieces = Vec::with_capacity(2);
        if hole.start < id {
            pieces.push(hole.start..id);
        }
        if id + 1 < hole.end {
            pieces.push(id + 1..hole.end);
        }
        for (offset, piece) in pieces.into_iter().enumerate() {
            self.holes.insert(index + offset, piece);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_events_apply() {
        let mut cursor = EventCursor::default();
        for id in 0..5 {
            assert_eq!(cursor.admit(id, false), Verdict::Apply);
        }
        assert_eq!(cursor.last_applied(), Some(4));
        assert_eq!(cursor.applied, 5);
    }

    #[test]
    fn a_first_event_past_zero_asks_for_the_earlier_ones() {
        let mut cursor = EventCursor::default();
        assert_eq!(
            cursor.admit(3, false),
            Verdict::ApplyAfterGap { resend_from: 0 }
        );
        assert_eq!(cursor.admit(0, false), Verdict::Apply);
        assert_eq!(cursor.first_missing(), Some(1));
    }

    #[test]
    fn duplicates_and_stale_ids_are_skipped() {
        let mut cursor = EventCursor::default();
        cursor.admit(0, false);
        cursor.admit(1, false);
        assert_eq!(cursor.admit(1, false), Verdict::Skip);
        assert_eq!(cursor.admit(0, false), Verdict::Skip);
        assert_eq!(cursor.skipped, 2);
        assert_eq!(cursor.admit(2, false), Verdict::Apply);
    }

    #[test]
    fn a_gap_applies_asks_for_a_resend_and_accepts_the_resent_events() {
        let mut cursor = EventCursor::default();
        cursor.admit(0, false);
        assert_eq!(
            cursor.admit(3, false),
            Verdict::ApplyAfterGap { resend_from: 1 }
        );
        assert_eq!(cursor.first_missing(), Some(1));
        // Resent 1 fills part of the hole; 2 is still missing.
        assert_eq!(cursor.admit(1, false), Verdict::Apply);
        assert_eq!(cursor.first_missing(), Some(2));
        assert_eq!(cursor.admit(2, false), Verdict::Apply);
        assert_eq!(cursor.first_missing(), None);
        // The resent 3 is now a duplicate.
        assert_eq!(cursor.admit(3, false), Verdict::Skip);
        assert_eq!(cursor.admit(4, false), Verdict::Apply);
        assert_eq!(cursor.gaps, 1);
    }

    #[test]
    fn a_rejection_behind_a_gap_is_asked_for_again() {
        let mut cursor = EventCursor::default();
        cursor.admit(0, false);
        cursor.admit(3, false);
        cursor.record_rejected(3);
        assert_eq!(cursor.first_missing(), Some(1));
        cursor.admit(1, false);
        cursor.admit(2, false);
        assert_eq!(cursor.first_missing(), Some(3));
        assert_eq!(cursor.admit(3, false), Verdict::Apply);
        assert_eq!(cursor.first_missing(), None);
        // Without a gap before it, a rejection is final.
        cursor.admit(4, false);
        cursor.record_rejected(4);
        assert_eq!(cursor.first_missing(), None);
        assert_eq!(cursor.admit(4, false), Verdict::Skip);
        assert_eq!(cursor.rejected, 2);
    }

    #[test]
    fn cleared_is_a_barrier() {
        let mut cursor = EventCursor::default();
        cursor.admit(0, false);
        cursor.admit(5, false); // holes 1..5
        assert_eq!(cursor.admit(6, true), Verdict::Apply);
        assert_eq!(cursor.first_missing(), None);
        assert_eq!(cursor.admit(2, false), Verdict::Skip);
        assert_eq!(cursor.admit(7, false), Verdict::Apply);
    }

    #[test]
    fn holes_are_bounded() {
        let mut cursor = EventCursor::default();
        cursor.admit(0, false);
        for i in 1..=(MAX_HOLES as u64 + 10) {
            cursor.admit(i * 2, false);
        }
        assert_eq!(cursor.holes.len(), MAX_HOLES);
        assert_eq!(cursor.holes_given_up, 10);
        assert_eq!(
            cursor.admit(u64::MAX, false),
            Verdict::ApplyAfterGap {
                resend_from: cursor.first_missing().unwrap()
            }
        );
        assert_eq!(cursor.admit(u64::MAX, false), Verdict::Skip);
    }
}
