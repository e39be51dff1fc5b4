//! The booked-load ledger: load the router has sent to each worker rank and
//! not yet seen finish.
//!
//! Why it exists: workers report load only every heartbeat; between reports
//! the router must account for what it just routed, or it would send a burst
//! of requests to the same worker. Invariants:
//! * a booking is keyed by request id; booking an id twice is an error;
//! * per rank, `prefill_tokens`, `prefill_blocks` and `active_requests` are
//!   always the sums over that rank's live bookings (prefill parts only for
//!   bookings whose prefill is not complete);
//! * `decode_blocks` counts distinct prompt *prefixes* booked on the rank:
//!   each block is keyed by a hash chained over the local hashes of the
//!   blocks up to and including it ([`prefix_keys`]), and refcounted per
//!   (rank, key). Two requests sharing a prompt prefix count its blocks once
//!   (the engine's prefix cache holds them once); a block whose content
//!   repeats at another position counts again, as the engine stores it again;
//! * `mark_prefill_complete`, `release`, `expire` are idempotent; releasing
//!   every booking returns every total to zero and leaves no per-rank entry;
//! * what open bookings hold is bounded ([`BookingLimits`]): in all, and per
//!   owning identity. A booking past either bound is refused and changes
//!   nothing. Callers choose how many bookings they open, and a prompt's
//!   keys are its length, so without the bound their numbers would decide
//!   how much memory the router takes.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::Arc;

use crate::select::BookedLoads;
use crate::types::{BookedLoad, ChainMap, LocalHash, WorkerId, WorkerRank};

use super::AdmissionError;

fn mix64(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Position-aware keys of a prompt's blocks: key `i` depends on local hashes
/// `0..=i`, so equal keys mean an equal prefix (up to 64-bit collisions).
pub fn prefix_keys(block_hashes: &[LocalHash]) -> Vec<u64> {
    let mut prev = 0x6b76_726f_7574_6521_u64; // "kvroute!"
    block_hashes
        .iter()
        .map(|h| {
            prev = mix64(prev.rotate_left(23) ^ mix64(*h));
            prev
        })
        .collect()
}

/// What open bookings may hold, in bytes as [`booking_cost`] counts them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BookingLimits {
    /// Every open booking together.
    pub max_bytes: u64,
    /// The open bookings of one owning identity.
    pub max_bytes_per_owner: u64,
}

impl BookingLimits {
    /// No bound (tests and tools).
    pub const UNBOUNDED: Self = Self {
        max_bytes: u64::MAX,
        max_bytes_per_owner: u64::MAX,
    };
}

impl Default for BookingLimits {
    fn default() -> Self {
        Self {
            max_bytes: 1 << 30,
            max_bytes_per_owner: 256 << 20,
        }
    }
}

/// Bytes one booked block costs: its prefix key in the booking (8), its
/// count on the rank (up to 24 with the table's slack), and its key again
/// while the router holds the prompt for a predicted cache (8), rounded up.
pub const BOOKED_BLOCK_BYTES: u64 = 48;

/// Bytes of a booking beyond its blocks: the entry, its request id's
/// allocation and the rank's totals, rounded up.
const BOOKING_OVERHEAD_BYTES: u64 = 160;

/// What a booking of `blocks` prompt blocks under `request_id` costs
/// against [`BookingLimits`].
pub fn booking_cost(request_id: &str, blocks: usize) -> u64 {
    BOOKING_OVERHEAD_BYTES
        .saturating_add(request_id.len() as u64)
        .saturating_add((blocks as u64).saturating_mul(BOOKED_BLOCK_BYTES))
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Booking {
    target: WorkerRank,
    /// `(tokens, blocks)` while the prefill is outstanding.
    prefill: Option<(u64, u64)>,
    keys: Vec<u64>,
    booked_at_ms: u64,
    /// The identity that booked it, when callers are authenticated.
    owner: Option<Arc<str>>,
}

#[derive(Clone, Debug, Default)]
struct RankTotals {
    prefill_tokens: u64,
    prefill_blocks: u64,
    active_requests: u64,
    refs: ChainMap<u32>,
}

/// An open booking as a snapshot keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavedBooking {
    pub request_id: String,
    pub target: WorkerRank,
    /// `(tokens, blocks)` while the prefill is outstanding.
    pub prefill: Option<(u64, u64)>,
    /// The prompt's prefix keys ([`prefix_keys`]).
    pub keys: Vec<u64>,
    pub age_ms: u64,
    /// The identity that booked it (`None`: callers were not authenticated).
    pub owner: Option<Arc<str>>,
}

/// What is booked for one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BookingInfo {
    pub target: WorkerRank,
    pub prefill_outstanding: bool,
    /// Uncached prompt blocks booked for prefill (0 once it completed).
    pub prefill_blocks: u64,
    pub blocks: usize,
    pub booked_at_ms: u64,
}

/// Booked load per worker rank, keyed by request id.
#[derive(Clone, Debug)]
pub struct BookingLedger {
    bookings: HashMap<String, Booking>,
    ranks: HashMap<WorkerRank, RankTotals>,
    limits: BookingLimits,
    /// [`booking_cost`] summed over open bookings, and per owner.
    held_bytes: u64,
    held_by_owner: HashMap<Arc<str>, u64>,
}

impl Default for BookingLedger {
    fn default() -> Self {
        Self::with_limits(BookingLimits::UNBOUNDED)
    }
}

impl BookedLoads for BookingLedger {
    fn booked(&self, target: WorkerRank) -> BookedLoad {
        self.load(target)
    }
}

impl BookingLedger {
    /// An empty ledger without bounds.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty ledger that refuses bookings past `limits`.
    pub fn with_limits(limits: BookingLimits) -> Self {
        Self {
            bookings: HashMap::new(),
            ranks: HashMap::new(),
            limits,
            held_bytes: 0,
            held_by_owner: HashMap::new(),
        }
    }

    /// Books a request's load on `target` at time `now_ms`, owned by
    /// `owner` (the authenticated caller, if any).
    #[allow(clippy::too_many_arguments)]
    pub fn book(
        &mut self,
        request_id: &str,
        target: WorkerRank,
        prefill_tokens: u64,
        prefill_blocks: u64,
        block_hashes: &[LocalHash],
        now_ms: u64,
        owner: Option<Arc<str>>,
    ) -> Result<(), AdmissionError> {
        // Checked before the keys are made, so a refused booking
        // allocates nothing.
        self.admissible(request_id, block_hashes.len(), owner.as_ref())?;
        self.insert(
            request_id,
            Booking {
                target,
                prefill: Some((prefill_tokens, prefill_blocks)),
                keys: prefix_keys(block_hashes),
                booked_at_ms: now_ms,
                owner,
            },
        )
    }

    /// Refuses a booking of `blocks` under a request id already booked, or
    /// one that would take open bookings past their bounds; otherwise
    /// returns what it costs.
    fn admissible(
        &self,
        request_id: &str,
        blocks: usize,
        owner: Option<&Arc<str>>,
    ) -> Result<u64, AdmissionError> {
        if let Some(existing) = self.bookings.get(request_id) {
            return Err(AdmissionError::DuplicateBooking {
                request_id: request_id.to_owned(),
                target: existing.target,
            });
        }
        let cost = booking_cost(request_id, blocks);
        let full = |held: u64, limit: u64, owner: Option<&Arc<str>>| AdmissionError::BookingsFull {
            request_id: request_id.to_owned(),
            owner: owner.map(|o| o.to_string()),
            held,
            cost,
            limit,
        };
        if self.held_bytes.saturating_add(cost) > self.limits.max_bytes {
            return Err(full(self.held_bytes, self.limits.max_bytes, None));
        }
        if let Some(owner) = owner {
            let held = self.held_by_owner.get(owner).copied().unwrap_or(0);
            if held.saturating_add(cost) > self.limits.max_bytes_per_owner {
                return Err(full(held, self.limits.max_bytes_per_owner, Some(owner)));
            }
        }
        Ok(cost)
    }

    fn insert(&mut self, request_id: &str, booking: Booking) -> Result<(), AdmissionError> {
        let cost = self.admissible(request_id, booking.keys.len(), booking.owner.as_ref())?;
        self.held_bytes += cost;
        if let Some(owner) = &booking.owner {
            *self.held_by_owner.entry(owner.clone()).or_insert(0) += cost;
        }
        let totals = self.ranks.entry(booking.target).or_default();
        if let Some((tokens, blocks)) = booking.prefill {
            totals.prefill_tokens = totals.prefill_tokens.saturating_add(tokens);
            totals.prefill_blocks = totals.prefill_blocks.saturating_add(blocks);
        }
        totals.active_requests += 1;
        for k in &booking.keys {
            *totals.refs.entry(*k).or_insert(0) += 1;
        }
        self.bookings.insert(request_id.to_owned(), booking);
        Ok(())
    }

    /// Every open booking, as a snapshot keeps it, by request id.
    pub fn export(&self, now_ms: u64) -> Vec<SavedBooking> {
        let mut saved: Vec<SavedBooking> = self
            .bookings
            .iter()
            .map(|(id, b)| Self::saved(id, b, now_ms))
            .collect();
        saved.sort_by(|a, b| a.request_id.cmp(&b.request_id));
        saved
    }

    /// One open booking as [`Self::export`] gives it: what another router
    /// needs to book the same load ([`Self::restore`]).
    pub fn export_one(&self, request_id: &str, now_ms: u64) -> Option<SavedBooking> {
        self.bookings
            .get_key_value(request_id)
            .map(|(id, b)| Self::saved(id, b, now_ms))
    }

    fn saved(request_id: &str, b: &Booking, now_ms: u64) -> SavedBooking {
        SavedBooking {
            request_id: request_id.to_owned(),
            target: b.target,
            prefill: b.prefill,
            keys: b.keys.clone(),
            age_ms: now_ms.saturating_sub(b.booked_at_ms),
            owner: b.owner.clone(),
        }
    }

    /// Books a saved booking again, aged as it was (as far as the clock
    /// reaches back: a booking older than `now_ms` counts from 0).
    pub fn restore(&mut self, saved: SavedBooking, now_ms: u64) -> Result<(), AdmissionError> {
        self.insert(
            &saved.request_id,
            Booking {
                target: saved.target,
                prefill: saved.prefill,
                keys: saved.keys,
                booked_at_ms: now_ms.saturating_sub(saved.age_ms),
                owner: saved.owner,
            },
        )
    }

    /// The identity that made an open booking: `None` when there is no such
    /// booking, `Some(None)` when it was made unauthenticated.
    pub fn owner(&self, request_id: &str) -> Option<Option<&Arc<str>>> {
        self.bookings.get(request_id).map(|b| b.owner.as_ref())
    }

    /// Drops the prefill part of a booking. Returns whether anything changed.
    pub fn mark_prefill_complete(&mut self, request_id: &str) -> bool {
        let Some(booking) = self.bookings.get_mut(request_id) else {
            return false;
        };
        let Some((tokens, blocks)) = booking.prefill.take() else {
            return false;
        };
        if let Some(t) = self.ranks.get_mut(&booking.target) {
            t.prefill_tokens = t.prefill_tokens.saturating_sub(tokens);
            t.prefill_blocks = t.prefill_blocks.saturating_sub(blocks);
        }
        true
    }

    /// Restarts a booking's age, e.g. while a long generation is still
    /// streaming. Returns whether the booking exists.
    pub fn touch(&mut self, request_id: &str, now_ms: u64) -> bool {
        match self.bookings.get_mut(request_id) {
            Some(b) => {
                b.booked_at_ms = b.booked_at_ms.max(now_ms);
                true
            }
            None => false,
        }
    }

    /// Drops a booking entirely. Returns whether it existed.
    pub fn release(&mut self, request_id: &str) -> bool {
        match self.bookings.remove(request_id) {
            Some(b) => {
                self.unbook(request_id, b);
                true
            }
            None => false,
        }
    }

    fn unbook(&mut self, request_id: &str, b: Booking) {
        let cost = booking_cost(request_id, b.keys.len());
        self.held_bytes = self.held_bytes.saturating_sub(cost);
        if let Some(owner) = &b.owner
            && let Entry::Occupied(mut held) = self.held_by_owner.entry(owner.clone())
        {
            *held.get_mut() = held.get().saturating_sub(cost);
            if *held.get() == 0 {
                held.remove();
            }
        }
        let Some(t) = self.ranks.get_mut(&b.target) else {
            return;
        };
        if let Some((tokens, blocks)) = b.prefill {
            t.prefill_tokens = t.prefill_tokens.saturating_sub(tokens);
            t.prefill_blocks = t.prefill_blocks.saturating_sub(blocks);
        }
        t.active_requests = t.active_requests.saturating_sub(1);
        for k in &b.keys {
            if let Some(n) = t.refs.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    t.refs.remove(k);
                }
            }
        }
        if t.active_requests == 0 {
            self.ranks.remove(&b.target);
        }
    }

    fn drop_where(&mut self, mut pred: impl FnMut(&Booking) -> bool) -> usize {
        let ids: Vec<String> = self
            .bookings
            .iter()
            .filter(|(_, b)| pred(b))
            .map(|(id, _)| id.clone())
            .collect();
        for id in &ids {
            self.release(id);
        }
        ids.len()
    }

    /// Drops bookings older than `ttl_ms` at `now_ms`. Returns how many.
    pub fn expire(&mut self, now_ms: u64, ttl_ms: u64) -> usize {
        self.drop_where(|b| now_ms.saturating_sub(b.booked_at_ms) > ttl_ms)
    }

    /// Drops every booking on `worker_id` (it deregistered or its lease
    /// lapsed). Returns how many.
    pub fn release_worker(&mut self, worker_id: WorkerId) -> usize {
        self.drop_where(|b| b.target.worker_id == worker_id)
    }

    /// The load booked on `target`.
    pub fn load(&self, target: WorkerRank) -> BookedLoad {
        self.ranks
            .get(&target)
            .map(|t| BookedLoad {
                prefill_tokens: t.prefill_tokens,
                prefill_blocks: t.prefill_blocks,
                decode_blocks: t.refs.len() as u64,
                active_requests: t.active_requests,
            })
            .unwrap_or_default()
    }

    /// Every rank with live bookings and its load, sorted by rank.
    pub fn loads(&self) -> Vec<(WorkerRank, BookedLoad)> {
        let mut v: Vec<_> = self.ranks.keys().map(|r| (*r, self.load(*r))).collect();
        v.sort_by_key(|(r, _)| *r);
        v
    }

    /// What is booked for `request_id`.
    pub fn booking(&self, request_id: &str) -> Option<BookingInfo> {
        self.bookings.get(request_id).map(|b| BookingInfo {
            target: b.target,
            prefill_outstanding: b.prefill.is_some(),
            prefill_blocks: b.prefill.map_or(0, |(_, blocks)| blocks),
            blocks: b.keys.len(),
            booked_at_ms: b.booked_at_ms,
        })
    }

    /// Number of live bookings.
    pub fn len(&self) -> usize {
        self.bookings.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bookings.is_empty()
    }

    /// Number of ranks with live bookings.
    pub fn ranks_with_bookings(&self) -> usize {
        self.ranks.len()
    }

    /// What open bookings hold, as [`booking_cost`] counts it.
    pub fn held_bytes(&self) -> u64 {
        self.held_bytes
    }

    /// What `owner`'s open bookings hold.
    pub fn held_by(&self, owner: &str) -> u64 {
        self.held_by_owner.get(owner).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const R0: WorkerRank = WorkerRank::new(1, 0);
    const R1: WorkerRank = WorkerRank::new(1, 1);

    #[test]
    fn book_complete_release() {
        let mut l = BookingLedger::new();
        l.book("a", R0, 100, 7, &[1, 2, 3], 0, None).unwrap();
        assert_eq!(
            l.load(R0),
            BookedLoad {
                prefill_tokens: 100,
                prefill_blocks: 7,
                decode_blocks: 3,
                active_requests: 1
            }
        );
        assert_eq!(l.load(R1), BookedLoad::default());
        assert!(l.mark_prefill_complete("a"));
        assert!(!l.mark_prefill_complete("a"), "idempotent");
        assert_eq!(l.load(R0).prefill_tokens, 0);
        assert_eq!(l.load(R0).decode_blocks, 3);
        assert!(l.release("a"));
        assert!(!l.release("a"), "idempotent");
        assert!(!l.mark_prefill_complete("a"));
        assert_eq!(l.load(R0), BookedLoad::default());
        assert_eq!(l.ranks_with_bookings(), 0);
    }

    #[test]
    fn duplicate_booking_is_an_error_and_changes_nothing() {
        let mut l = BookingLedger::new();
        l.book("a", R0, 10, 1, &[1], 0, None).unwrap();
        let e = l.book("a", R1, 10, 1, &[1], 0, None).unwrap_err();
        assert!(e.to_string().contains("request a"), "{e}");
        assert!(e.to_string().contains("worker 1 dp_rank 0"), "{e}");
        assert_eq!(l.load(R1), BookedLoad::default());
        assert_eq!(l.load(R0).active_requests, 1);
    }

    #[test]
    fn bookings_past_their_bounds_are_refused_and_change_nothing() {
        let one = booking_cost("a", 100);
        let mut l = BookingLedger::with_limits(BookingLimits {
            max_bytes: 3 * one,
            max_bytes_per_owner: 2 * one,
        });
        let alice: Arc<str> = Arc::from("alice");
        let prompt: Vec<LocalHash> = (0..100).collect();
        l.book("a", R0, 1, 1, &prompt, 0, Some(alice.clone()))
            .unwrap();
        l.book("b", R0, 1, 1, &prompt, 0, Some(alice.clone()))
            .unwrap();
        let e = l
            .book("c", R0, 1, 1, &prompt, 0, Some(alice.clone()))
            .unwrap_err();
        assert_eq!(e.code(), crate::select::ErrorCode::ResourceExhausted);
        assert!(e.to_string().contains("identity alice"), "{e}");
        assert_eq!(l.held_by("alice"), 2 * one);
        // Another identity, and an unauthenticated caller, still have room
        // up to the total.
        l.book("d", R1, 1, 1, &prompt, 0, None).unwrap();
        let e = l
            .book("e", R1, 1, 1, &prompt, 0, Some(Arc::from("bob")))
            .unwrap_err();
        assert!(e.to_string().contains("all callers"), "{e}");
        assert_eq!(l.len(), 3);
        assert_eq!(l.load(R0).active_requests, 2);
        assert_eq!(l.held_bytes(), 3 * one);
        // A duplicate is a duplicate, however full the ledger.
        let e = l.book("a", R1, 1, 1, &[], 0, None).unwrap_err();
        assert!(matches!(e, AdmissionError::DuplicateBooking { .. }), "{e}");
        // Releasing gives the room back, to the owner too.
        assert!(l.release("a"));
        assert_eq!(l.held_by("alice"), one);
        l.book("c", R0, 1, 1, &prompt, 0, Some(alice.clone()))
            .unwrap();
        // A restore is held to the same bounds.
        let saved = l.export_one("c", 0).unwrap();
        let mut other = BookingLedger::with_limits(BookingLimits {
            max_bytes: one - 1,
            max_bytes_per_owner: u64::MAX,
        });
        assert!(other.restore(saved, 0).is_err());
        assert!(other.is_empty());
        for id in ["b", "c", "d"] {
            assert!(l.release(id));
        }
        assert_eq!((l.held_bytes(), l.held_by("alice")), (0, 0));
        assert!(l.held_by_owner.is_empty(), "no entry left per owner");
    }

    #[test]
    fn shared_prefixes_count_once_per_rank() {
        let mut l = BookingLedger::new();
        l.book("a", R0, 0, 0, &[1, 2, 3], 0, None).unwrap();
        l.book("b", R0, 0, 0, &[1, 2, 4], 0, None).unwrap();
        l.book("c", R1, 0, 0, &[1, 2, 3], 0, None).unwrap();
        assert_eq!(l.load(R0).decode_blocks, 4, "1,2 shared; 3 and 4 own");
        assert_eq!(l.load(R1).decode_blocks, 3, "other rank counts alone");
        l.release("a");
        assert_eq!(l.load(R0).decode_blocks, 3);
        // The same content at another position is a different block.
        l.book("d", R1, 0, 0, &[2, 1], 0, None).unwrap();
        assert_eq!(l.load(R1).decode_blocks, 5);
        // A prompt repeating one block holds each position.
        l.book("e", R1, 0, 0, &[9, 9, 9], 0, None).unwrap();
        assert_eq!(l.load(R1).decode_blocks, 8);
    }

    #[test]
    fn expire_and_touch() {
        let mut l = BookingLedger::new();
        l.book("old", R0, 5, 1, &[1], 0, None).unwrap();
        l.book("new", R0, 5, 1, &[1], 200, None).unwrap();
        l.book("kept", R1, 5, 1, &[1], 0, None).unwrap();
        assert!(l.touch("kept", 250));
        assert!(!l.touch("nope", 250));
        assert_eq!(l.expire(300, 300), 0, "age 300 is not older than 300");
        assert_eq!(l.expire(301, 300), 1);
        assert!(l.booking("old").is_none());
        assert_eq!(l.load(R0).active_requests, 1);
        assert_eq!(l.load(R0).decode_blocks, 1);
        assert_eq!(l.expire(301, 300), 0, "idempotent");
        assert_eq!(l.len(), 2);
    }

    #[test]
    fn release_worker_drops_all_its_ranks() {
        let mut l = BookingLedger::new();
        l.book("a", R0, 1, 1, &[1], 0, None).unwrap();
        l.book("b", R1, 1, 1, &[1], 0, None).unwrap();
        l.book("c", WorkerRank::new(2, 0), 1, 1, &[1], 0, None)
            .unwrap();
        assert_eq!(l.release_worker(1), 2);
        assert_eq!(l.loads().len(), 1);
        assert_eq!(
            l.booking("c")
                .map(|b| (b.target, b.prefill_outstanding, b.blocks)),
            Some((WorkerRank::new(2, 0), true, 1))
        );
    }

    #[test]
    fn one_exported_booking_restores_the_same_load_elsewhere() {
        let mut l = BookingLedger::new();
        l.book("a", R0, 100, 7, &[1, 2, 3], 10, None).unwrap();
        l.book("b", R0, 50, 2, &[1, 2], 10, None).unwrap();
        assert!(l.export_one("nope", 30).is_none());
        let a = l.export_one("a", 30).unwrap();
        assert_eq!(Some(&a), l.export(30).iter().find(|s| s.request_id == "a"));
        assert_eq!(a.age_ms, 20);
        let mut other = BookingLedger::new();
        other.restore(a, 30).unwrap();
        assert_eq!(other.load(R0).prefill_tokens, 100);
        assert_eq!(other.load(R0).decode_blocks, 3);
        assert_eq!(other.booking("a"), l.booking("a"));
    }

    #[test]
    fn prefix_keys_depend_on_the_whole_prefix() {
        let a = prefix_keys(&[1, 2, 3]);
        let b = prefix_keys(&[1, 2, 4]);
        let c = prefix_keys(&[0, 2, 3]);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        assert!(a.iter().zip(&c).all(|(x, y)| x != y));
        assert!(prefix_keys(&[]).is_empty());
    }
}
