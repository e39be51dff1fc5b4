use super::*;

/// An event that names itself: a removal of engine hash `id`, so the order
/// the index saw events in can be read back.
fn ev(id: u64) -> IngestEvent {
    IngestEvent {
        event_id: id,
        event: TieredEvent::device(KvEvent::Removed { blocks: vec![id] }),
    }
}

/// A removal of `n` engine hashes (all `id`).
fn heavy(id: u64, n: usize) -> IngestEvent {
    IngestEvent {
        event_id: id,
        event: TieredEvent::device(KvEvent::Removed {
            blocks: vec![id; n],
        }),
    }
}

fn clear(id: u64) -> IngestEvent {
    IngestEvent {
        event_id: id,
        event: TieredEvent::device(KvEvent::Cleared),
    }
}

/// A cursor with a recorder standing in for the index.
#[derive(Default)]
struct Harness {
    cursor: EventCursor,
    /// What the index saw, in order: the id of a named event, or `C` for a
    /// `cleared`.
    seen: Vec<String>,
    /// Ids the index rejects.
    reject: Vec<u64>,
}

impl Harness {
    fn send(&mut self, events: Vec<IngestEvent>) -> Receipt {
        let (seen, reject) = (&mut self.seen, &self.reject);
        self.cursor.receive(events, |event| match event.event {
            KvEvent::Removed { blocks } => {
                seen.push(blocks[0].to_string());
                !reject.contains(&blocks[0])
            }
            KvEvent::Cleared => {
                seen.push("C".into());
                true
            }
            KvEvent::Stored { .. } | KvEvent::StoredKnown { .. } => true,
        })
    }

    fn seen(&mut self) -> String {
        std::mem::take(&mut self.seen).join(" ")
    }
}

#[test]
fn contiguous_events_apply_in_order() {
    let mut h = Harness::default();
    let receipt = h.send((0..5).map(ev).collect());
    assert_eq!(receipt.applied, 5);
    assert_eq!(h.seen(), "0 1 2 3 4");
    assert_eq!(h.cursor.last_applied(), Some(4));
    assert_eq!(h.cursor.resend_from(), None);
    assert_eq!(h.cursor.applied, 5);
}

#[test]
fn the_first_batch_sets_the_start() {
    let mut h = Harness::default();
    h.send(vec![ev(5), ev(6)]);
    assert_eq!(h.seen(), "5 6");
    assert_eq!(
        h.cursor.resend_from(),
        None,
        "nothing before 5 is asked for"
    );
    // Its lowest id, whatever the order inside the batch.
    let mut h = Harness::default();
    h.send(vec![ev(9), ev(7), ev(8)]);
    assert_eq!(h.seen(), "7 8 9");
    assert_eq!(h.cursor.resend_from(), None);
    assert_eq!(h.cursor.gaps, 1);
    // An empty batch sets nothing.
    let mut h = Harness::default();
    h.send(Vec::new());
    h.send(vec![ev(3)]);
    assert_eq!(h.seen(), "3");
}

#[test]
fn a_resumed_cursor_expects_the_id_after_its_last() {
    let mut h = Harness {
        cursor: EventCursor::resumed(Some(9)),
        ..Harness::default()
    };
    assert_eq!(h.cursor.last_applied(), Some(9));
    h.send(vec![ev(9), ev(12)]);
    assert_eq!(h.seen(), "");
    assert_eq!(h.cursor.resend_from(), Some(10));
    h.send(vec![ev(10), ev(11)]);
    assert_eq!(h.seen(), "10 11 12");
    assert_eq!(EventCursor::resumed(None), EventCursor::default());
}

#[test]
fn events_past_a_gap_wait_for_it_and_then_apply_in_order() {
    let mut h = Harness::default();
    h.send(vec![ev(0)]);
    let receipt = h.send(vec![ev(3), ev(4)]);
    assert_eq!((receipt.applied, receipt.held), (0, 2));
    assert_eq!(h.seen(), "0");
    assert_eq!(h.cursor.resend_from(), Some(1));
    assert_eq!(h.cursor.last_applied(), Some(0));
    assert_eq!((h.cursor.held_events(), h.cursor.held_blocks()), (2, 2));
    // 2 arrives first: held too; then 1 lets everything through.
    h.send(vec![ev(2)]);
    assert_eq!(h.cursor.resend_from(), Some(1));
    let receipt = h.send(vec![ev(1)]);
    assert_eq!(receipt.applied, 4);
    assert_eq!(h.seen(), "1 2 3 4");
    assert_eq!(h.cursor.resend_from(), None);
    assert_eq!((h.cursor.held_events(), h.cursor.held_blocks()), (0, 0));
    assert_eq!(h.cursor.last_applied(), Some(4));
    assert_eq!(h.cursor.gaps, 1);
}

#[test]
fn duplicates_of_passed_and_held_ids_are_skipped() {
    let mut h = Harness::default();
    h.send(vec![ev(0), ev(1)]);
    h.send(vec![ev(3)]);
    let receipt = h.send(vec![ev(1), ev(0), ev(3)]);
    assert_eq!(receipt.skipped(SkipReason::Duplicate), 3);
    assert_eq!(h.cursor.skipped, 3);
    // A resend from 2 brings 3 again: it applies once.
    let receipt = h.send(vec![ev(2), ev(3), ev(4)]);
    assert_eq!((receipt.applied, receipt.skipped_total()), (3, 1));
    assert_eq!(h.seen(), "0 1 2 3 4");
}

#[test]
fn an_event_the_index_rejects_is_rejected_for_good() {
    let mut h = Harness {
        reject: vec![1],
        ..Harness::default()
    };
    h.send(vec![ev(0), ev(2)]);
    let receipt = h.send(vec![ev(1)]);
    assert_eq!((receipt.applied, receipt.rejected), (1, 1));
    assert_eq!(h.cursor.last_applied(), Some(2));
    assert_eq!(h.cursor.resend_from(), None);
    assert_eq!((h.cursor.applied, h.cursor.rejected), (2, 1));
}

#[test]
fn a_cleared_past_a_gap_is_a_barrier() {
    let mut h = Harness::default();
    h.send(vec![ev(0)]);
    h.send(vec![ev(2), ev(3), ev(6)]);
    let receipt = h.send(vec![clear(5)]);
    assert_eq!(receipt.skipped(SkipReason::Superseded), 2, "2 and 3");
    assert_eq!(receipt.applied, 2, "the clear, then the held 6");
    assert_eq!(h.seen(), "0 C 6");
    assert_eq!(h.cursor.resend_from(), None);
    // What came before the barrier is stale now.
    let receipt = h.send(vec![ev(1), ev(4), ev(7)]);
    assert_eq!(receipt.skipped(SkipReason::Duplicate), 2);
    assert_eq!(h.seen(), "7");
}

#[test]
fn a_batch_starting_with_a_cleared_already_passed_asks_for_a_resync() {
    let mut h = Harness::default();
    h.send((0..10).map(ev).collect());
    h.send(vec![ev(12)]);
    assert_eq!(h.cursor.resend_from(), Some(10));
    // A late copy of an old batch, or an engine that restarted and numbers
    // from 0 again: either way nothing of it applies, and a resync is asked.
    let receipt = h.send(vec![clear(0), ev(1)]);
    assert_eq!(
        receipt.skipped(SkipReason::Resync),
        3,
        "the held 12 and the batch"
    );
    assert!(h.cursor.resync_required());
    assert_eq!(h.seen(), "0 1 2 3 4 5 6 7 8 9");
    assert_eq!(h.cursor.last_applied(), Some(9));
    // The answer must start at the floor, one past the highest id received
    // (12): another late copy below it is skipped, not taken for it.
    assert_eq!(h.cursor.resync_floor(), Some(13));
    let receipt = h.send(vec![clear(0), ev(1)]);
    assert_eq!(receipt.skipped(SkipReason::Resync), 2);
    assert!(h.cursor.resync_required());
    // The answer starts the stream anew.
    h.send(vec![clear(13), ev(14)]);
    assert!(!h.cursor.resync_required());
    assert_eq!(h.cursor.resync_floor(), None);
    assert_eq!(h.seen(), "C 14");
    assert_eq!(h.cursor.last_applied(), Some(14));
    // A cleared already passed that is not first in its batch is only a
    // duplicate.
    let receipt = h.send(vec![ev(15), clear(13)]);
    assert_eq!(receipt.skipped(SkipReason::Duplicate), 1);
    assert!(!h.cursor.resync_required());
    assert_eq!(h.seen(), "15");
}

#[test]
fn an_id_jump_past_the_hold_bound_asks_for_a_resync() {
    let mut h = Harness::default();
    h.send(vec![ev(0), ev(2)]);
    let receipt = h.send(vec![ev(1 << 63), ev(1)]);
    assert!(h.cursor.resync_required());
    assert_eq!(
        h.cursor.resend_from(),
        None,
        "never a resend during a resync"
    );
    assert_eq!(
        receipt.skipped(SkipReason::Resync),
        3,
        "the held 2, the jump and 1"
    );
    assert_eq!(h.cursor.resyncs, 1);
    assert_eq!(h.seen(), "0");
    // Everything is skipped until a batch starts with cleared.
    let receipt = h.send(vec![ev(1), clear(2)]);
    assert_eq!(receipt.skipped(SkipReason::Resync), 2);
    assert!(h.cursor.resync_required());
    // An answer below the floor (one past the jump) is skipped; at or past
    // it, wherever the worker likes, it starts the stream anew.
    let floor = (1 << 63) + 1;
    assert_eq!(h.cursor.resync_floor(), Some(floor));
    let receipt = h.send(vec![clear(500), ev(501)]);
    assert_eq!(receipt.skipped(SkipReason::Resync), 2);
    let receipt = h.send(vec![clear(floor + 10), ev(floor + 11), ev(floor + 12)]);
    assert_eq!(receipt.applied, 3);
    assert!(!h.cursor.resync_required());
    assert_eq!(h.seen(), "C 9223372036854775820 9223372036854775821");
    assert_eq!(h.cursor.last_applied(), Some(floor + 12));
}

#[test]
fn the_hold_bound_counts_ids_past_the_next_one() {
    let mut h = Harness::default();
    h.send(vec![ev(0)]);
    h.send(vec![ev(1 + MAX_HELD_EVENTS)]);
    assert!(!h.cursor.resync_required());
    assert_eq!(h.cursor.held_events(), 1);
    h.send(vec![ev(2 + MAX_HELD_EVENTS)]);
    assert!(h.cursor.resync_required());
    assert_eq!(h.cursor.held_events(), 0);
}

#[test]
fn the_blocks_of_held_events_are_bounded() {
    let mut h = Harness::default();
    h.send(vec![ev(0)]);
    h.send(vec![
        heavy(2, MAX_HELD_BLOCKS / 2),
        heavy(3, MAX_HELD_BLOCKS / 2),
    ]);
    assert_eq!(h.cursor.held_blocks(), MAX_HELD_BLOCKS);
    assert!(!h.cursor.resync_required());
    h.send(vec![ev(4)]);
    assert!(h.cursor.resync_required());
    assert_eq!((h.cursor.held_events(), h.cursor.held_blocks()), (0, 0));
    assert_eq!(h.cursor.skipped, 3);
}

#[test]
fn the_last_id_can_be_passed_and_a_resync_follows() {
    let mut h = Harness::default();
    h.send(vec![ev(u64::MAX - 1), ev(u64::MAX)]);
    assert_eq!(h.cursor.last_applied(), Some(u64::MAX));
    let receipt = h.send(vec![ev(u64::MAX), ev(3)]);
    assert_eq!(receipt.skipped(SkipReason::Duplicate), 2);
    assert_eq!(EventCursor::resumed(Some(u64::MAX)).resend_from(), None);
    h.send(vec![clear(0), ev(1)]);
    assert!(h.cursor.resync_required());
    // Nothing is above the last id: no answer numbered below it is taken
    // (a worker at the end of the id space registers again instead).
    assert_eq!(h.cursor.resync_floor(), Some(u64::MAX));
    h.send(vec![clear(0), ev(1)]);
    assert!(h.cursor.resync_required());
    h.send(vec![clear(u64::MAX)]);
    assert!(!h.cursor.resync_required());
    assert_eq!(h.seen(), format!("{} {} C", u64::MAX - 1, u64::MAX));
}

#[test]
fn a_first_batch_starting_with_cleared_starts_there() {
    let mut h = Harness::default();
    h.send(vec![clear(40), ev(41)]);
    assert_eq!(h.seen(), "C 41");
    assert_eq!(h.cursor.last_applied(), Some(41));
}
