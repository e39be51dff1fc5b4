//! The event cursor of one (worker, dp_rank): puts the worker's events
//! into id order before they reach the index, so that once every gap is
//! healed the index holds exactly what the worker holds, whatever order
//! the events arrived in.
//!
//! Why events wait: an event applied past a gap can meet the wrong state.
//! A removal of a block that a missing event stored does nothing; when the
//! missing store is resent, the block comes back and stays. So an event is
//! applied only when every id before it has been: events past a gap are
//! HELD, in id order, and applied as soon as the gap fills.
//!
//! Rules, per (worker, dp_rank):
//! * **Start.** The first batch after the cursor is created (the worker's
//!   registration, or the cursor's reset when the worker was removed) sets
//!   where the stream starts: its lowest id. No resend is ever asked for an
//!   id before the start.
//! * **In order.** The next id applies; so do the held events that follow
//!   it without a gap. An event the index rejects (its parent unknown, an
//!   engine hash conflict) is rejected for good and counted; the cursor
//!   moves past it.
//! * **Gap.** An id beyond the next one is held, and replies ask the worker
//!   to resend from the next id (the first missing one) for as long as
//!   anything is held. That id is always one after the last acknowledged,
//!   so a worker that keeps what was not acknowledged can always resend it.
//! * **Duplicate.** An id already passed, or already held, is skipped.
//! * **Barrier.** A `cleared` at or past the next id applies at once: the
//!   events before it no longer matter, so its gap is forgotten and held
//!   events before it are dropped (skipped as superseded).
//! * **Resync.** When an event would be held more than [`MAX_HELD_EVENTS`]
//!   ids past the next one (a gap no worker can be expected to fill: an id
//!   jump, or a hole the worker never filled while it sent that many events
//!   after it), or would make the held events' blocks exceed
//!   [`MAX_HELD_BLOCKS`], the cursor drops what it holds and asks the worker
//!   to resynchronise: every reply says so, and every event is skipped,
//!   until the answer, a batch whose FIRST event is `cleared`. The index
//!   keeps what was applied in order until then.
//! * **New start.** That answer starts the stream anew at its `cleared`'s
//!   id. The id must be at least the *resync floor*, one past the highest
//!   id the cursor has ever received (replies that ask for the resync say
//!   it): a batch starting with a `cleared` below it is a late copy of an
//!   old batch (the network may deliver one between the request and the
//!   answer), and is skipped. A worker may renumber upwards; one that
//!   counts from 0 again (its engine restarted) registers again, which
//!   starts a new stream.
//! * **Cleared behind.** A batch whose first event is a `cleared` at an id
//!   already passed, while no resync was asked for, is either a late copy
//!   of an old batch or a worker that renumbered (its engine restarted).
//!   The cursor cannot tell which: applying it could take the index back
//!   to an old state with nobody asked to correct it, skipping it could
//!   ignore a restarted worker. So it asks for a resync (the batch is
//!   skipped), which is right in both cases.
//!
//! Counters: `applied` and `rejected` count events applied to the index or
//! rejected by it; `skipped` counts every event not applied, for any
//! [`SkipReason`]. Held events are counted once their fate is known.

use std::{collections::BTreeMap, sync::Arc};

use kvroute_core::index::{KvEvent, TieredEvent};

/// Ids past the next expected one that may be held: at most this many
/// events wait per (worker, rank). A full batch (4096 events, the default
/// `max_events_per_batch`) that arrives right after a lost one still fits.
pub const MAX_HELD_EVENTS: u64 = 4096;

/// Blocks (stored blocks and removed engine hashes) the held events of one
/// (worker, rank) may carry: 65536 blocks, four of the largest events the
/// default `max_blocks_per_event` allows, about 1 MiB.
pub const MAX_HELD_BLOCKS: usize = 65_536;

/// One validated event: its id and what it does to the index.
#[derive(Clone, Debug)]
pub struct IngestEvent {
    pub event_id: u64,
    pub event: TieredEvent,
}

/// Why an event was skipped (not applied, not rejected by the index).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SkipReason {
    /// An id already passed or already held.
    Duplicate,
    /// A held event that a later `cleared` made moot.
    Superseded,
    /// Dropped because the cursor asked for a resync: the events it held
    /// then, the event that overflowed (or the batch starting with a
    /// `cleared` behind), and every event until the answer.
    Resync,
}

impl SkipReason {
    pub const ALL: [SkipReason; 3] = [Self::Duplicate, Self::Superseded, Self::Resync];

    /// The `reason` label of `kv_events_total{outcome="skipped"}`.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::Duplicate => "duplicate",
            Self::Superseded => "superseded",
            Self::Resync => "resync",
        }
    }
}

/// What one batch did, as seen from the cursor. Events of earlier batches
/// applied or dropped now are counted here too.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Receipt {
    pub applied: u32,
    pub rejected: u32,
    /// Events of this batch now held.
    pub held: u32,
    /// Skipped events by reason, in the order of [`SkipReason::ALL`].
    skipped: [u32; 3],
}

impl Receipt {
    pub(crate) fn skipped(&self, reason: SkipReason) -> u32 {
        self.skipped[reason as usize]
    }

    /// Skipped events of every reason.
    pub(crate) fn skipped_total(&self) -> u32 {
        self.skipped.iter().sum()
    }

    fn skip(&mut self, reason: SkipReason, count: u32) {
        self.skipped[reason as usize] += count;
    }
}

/// Where the stream stands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Next {
    /// Nothing received since the cursor was made: the next batch sets the
    /// start.
    #[default]
    Unstarted,
    /// This id applies next.
    At(u64),
    /// `u64::MAX` was passed: only a resync can follow.
    Exhausted,
}

/// Cursor state and counters of one (worker, dp_rank).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EventCursor {
    next: Next,
    /// The last id the cursor passed in order (applied or rejected).
    last_applied: Option<u64>,
    /// Events past a gap, by id, waiting for it to fill. Shared, so that a
    /// copy of the cursor for the Admin API costs nothing; the writer copies
    /// the map only if such a copy is alive when it changes it.
    held: Arc<BTreeMap<u64, TieredEvent>>,
    /// Blocks of the held events (see [`MAX_HELD_BLOCKS`]).
    held_blocks: usize,
    /// A resync was asked for and not yet answered.
    resync_required: bool,
    /// The highest id received since the stream started (see the resync
    /// floor in the module docs).
    seen_max: Option<u64>,
    pub applied: u64,
    pub skipped: u64,
    pub rejected: u64,
    /// Times events started to be held behind a gap.
    pub gaps: u64,
    /// Times a resync was asked for.
    pub resyncs: u64,
}

impl EventCursor {
    /// A cursor restored from a snapshot: the next expected id is
    /// `last_applied + 1`, nothing held, nothing missing. `None`: nothing
    /// was applied yet, so the next batch sets the start.
    pub(crate) fn resumed(last_applied: Option<u64>) -> EventCursor {
        let next = match last_applied {
            None => Next::Unstarted,
            Some(last) => last.checked_add(1).map_or(Next::Exhausted, Next::At),
        };
        EventCursor {
            next,
            last_applied,
            ..EventCursor::default()
        }
    }

    /// The last id passed in order: every event up to it was applied or
    /// rejected (None before the first).
    pub(crate) fn last_applied(&self) -> Option<u64> {
        self.last_applied
    }

    /// The id to ask the worker to resend from: the first missing one,
    /// while events are held behind it (never during a resync).
    pub fn resend_from(&self) -> Option<u64> {
        match self.next {
            Next::At(next) if !self.held.is_empty() && !self.resync_required => Some(next),
            _ => None,
        }
    }

    /// A resync was asked for and not yet answered (see the module docs).
    pub fn resync_required(&self) -> bool {
        self.resync_required
    }

    /// While a resync is asked for: the lowest id its answer's `cleared`
    /// may carry (see the module docs).
    pub(crate) fn resync_floor(&self) -> Option<u64> {
        self.resync_required
            .then(|| self.seen_max.map_or(0, |m| m.saturating_add(1)))
    }

    /// Events held behind a gap.
    pub fn held_events(&self) -> usize {
        self.held.len()
    }

    #[cfg(any(test, feature = "fuzzing"))]
    /// Blocks of the events held behind a gap.
    pub(crate) fn held_blocks(&self) -> usize {
        self.held_blocks
    }

    /// Runs one batch through the cursor. `apply` is called for every
    /// event that is due, in id order (this batch's and held ones), and
    /// returns false when the index rejected it.
    pub(crate) fn receive<F>(&mut self, events: Vec<IngestEvent>, mut apply: F) -> Receipt
    where
        F: FnMut(TieredEvent) -> bool,
    {
        let mut receipt = Receipt::default();
        let Some(first) = events.first() else {
            return receipt;
        };
        let leading_clear = matches!(first.event.event, KvEvent::Cleared);
        let answers_resync = self.resync_required
            && self
                .resync_floor()
                .is_some_and(|floor| first.event_id >= floor);
        let highest = events.iter().map(|e| e.event_id).max();
        self.seen_max = self.seen_max.max(highest);
        if leading_clear && (answers_resync || self.next == Next::Unstarted) {
            // A new start (the cursor holds nothing during a resync).
            self.resync_required = false;
            self.next = Next::At(first.event_id);
        } else if leading_clear && !self.resync_required && self.passed(first.event_id) {
            self.ask_resync(&mut receipt);
        } else if self.next == Next::Unstarted {
            let start = events.iter().map(|e| e.event_id).min().unwrap_or(0);
            self.next = Next::At(start);
        }
        for IngestEvent { event_id, event } in events {
            self.receive_one(event_id, event, &mut apply, &mut receipt);
        }
        self.applied += u64::from(receipt.applied);
        self.rejected += u64::from(receipt.rejected);
        self.skipped += u64::from(receipt.skipped_total());
        receipt
    }

    /// Whether the stream has gone past `id`.
    fn passed(&self, id: u64) -> bool {
        match self.next {
            Next::Unstarted => false,
            Next::At(next) => id < next,
            Next::Exhausted => true,
        }
    }

    /// Drops what is held and asks the worker to resynchronise.
    fn ask_resync(&mut self, receipt: &mut Receipt) {
        self.drop_held(SkipReason::Resync, receipt);
        self.resync_required = true;
        self.resyncs += 1;
    }

    fn receive_one<F>(&mut self, id: u64, event: TieredEvent, apply: &mut F, receipt: &mut Receipt)
    where
        F: FnMut(TieredEvent) -> bool,
    {
        if self.resync_required {
            receipt.skip(SkipReason::Resync, 1);
            return;
        }
        let Next::At(next) = self.next else {
            // Exhausted: every id has been passed. (Unstarted cannot be
            // seen here: the batch set the start.)
            receipt.skip(SkipReason::Duplicate, 1);
            return;
        };
        if id < next || self.held.contains_key(&id) {
            receipt.skip(SkipReason::Duplicate, 1);
            return;
        }
        if id > next && matches!(event.event, KvEvent::Cleared) {
            // A barrier: what came before it no longer matters.
            let held = Arc::make_mut(&mut self.held);
            let kept = held.split_off(&id);
            let superseded = std::mem::replace(held, kept);
            let blocks: usize = superseded.values().map(event_blocks).sum();
            self.held_blocks -= blocks;
            receipt.skip(SkipReason::Superseded, count(superseded.len()));
        } else if id > next {
            self.hold(id, next, event, receipt);
            return;
        }
        self.pass(id, event, apply, receipt);
        self.release(apply, receipt);
    }

    /// Holds `event` past the gap before it, or asks for a resync when it
    /// does not fit.
    fn hold(&mut self, id: u64, next: u64, event: TieredEvent, receipt: &mut Receipt) {
        let blocks = event_blocks(&event);
        if id - next > MAX_HELD_EVENTS || self.held_blocks + blocks > MAX_HELD_BLOCKS {
            self.ask_resync(receipt);
            receipt.skip(SkipReason::Resync, 1);
            return;
        }
        if self.held.is_empty() {
            self.gaps += 1;
        }
        self.held_blocks += blocks;
        Arc::make_mut(&mut self.held).insert(id, event);
        receipt.held += 1;
    }

    /// Applies the event with the next id and moves past it.
    fn pass<F>(&mut self, id: u64, event: TieredEvent, apply: &mut F, receipt: &mut Receipt)
    where
        F: FnMut(TieredEvent) -> bool,
    {
        if apply(event) {
            receipt.applied += 1;
        } else {
            receipt.rejected += 1;
        }
        self.last_applied = Some(id);
        self.next = id.checked_add(1).map_or(Next::Exhausted, Next::At);
    }

    /// Applies the held events that now follow without a gap.
    fn release<F>(&mut self, apply: &mut F, receipt: &mut Receipt)
    where
        F: FnMut(TieredEvent) -> bool,
    {
        while let Next::At(next) = self.next {
            if !self.held.contains_key(&next) {
                break;
            }
            let Some(event) = Arc::make_mut(&mut self.held).remove(&next) else {
                break;
            };
            self.held_blocks -= event_blocks(&event);
            // A held event was counted as held by its own batch.
            self.pass(next, event, apply, receipt);
        }
    }

    fn drop_held(&mut self, reason: SkipReason, receipt: &mut Receipt) {
        receipt.skip(reason, count(self.held.len()));
        self.held = Arc::default();
        self.held_blocks = 0;
    }
}

/// What an event weighs in the held buffer: its stored blocks or removed
/// engine hashes.
fn event_blocks(event: &TieredEvent) -> usize {
    event.event.block_count()
}

fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests;
