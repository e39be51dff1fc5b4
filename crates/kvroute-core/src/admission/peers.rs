//! Load that peer router replicas are likely booking and this replica has
//! not seen yet (cluster mode), and the view of booked load a decision
//! reads: the ledger's, plus those estimates, plus the copies of the
//! request placed earlier in the same decision.
//!
//! Why it exists: replicas learn of each other's bookings a sync delay
//! late (`router::sync`). Requests that arrive together are spread over the
//! replicas, and each replica decides from the same view of the fleet; if
//! it counts only its own bookings, every replica makes the same choices
//! and a burst lands on a few workers while one router would have spread
//! it (docs/CLUSTER.md, "Router replicas"). A replica therefore takes the request it
//! routes as a sample of what every replica may be routing at that moment:
//! the router (`router::routing`, `decide`) places `count` requests one
//! after another, as one router would, its own in the place its replica
//! index gives and its peers' likely ones before and after it, and keeps
//! the peers' placements here as estimated load until their real bookings
//! can have reached it.
//!
//! Invariants:
//! * an estimate counts from its booking until `horizon_ms` later, then
//!   nothing: by then the bookings it stands for have arrived as real ones;
//! * estimates are never shared and never released, they only age out, so
//!   they never outlive the horizon and never touch the ledger;
//! * with no estimates and no copies, the view is the ledger exactly.

use std::collections::VecDeque;

use crate::select::BookedLoads;
use crate::types::{BookedLoad, WorkerRank};

use super::bookings::BookingLedger;

/// The sum of two loads (saturating).
pub(crate) fn plus(a: BookedLoad, b: BookedLoad) -> BookedLoad {
    BookedLoad {
        prefill_tokens: a.prefill_tokens.saturating_add(b.prefill_tokens),
        prefill_blocks: a.prefill_blocks.saturating_add(b.prefill_blocks),
        decode_blocks: a.decode_blocks.saturating_add(b.decode_blocks),
        active_requests: a.active_requests.saturating_add(b.active_requests),
    }
}

/// One estimated peer booking.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Estimate {
    target: WorkerRank,
    load: BookedLoad,
    at_ms: u64,
}

/// Estimated peer load, oldest first.
#[derive(Clone, Debug, Default)]
pub struct PeerEstimates {
    horizon_ms: u64,
    live: VecDeque<Estimate>,
}

impl PeerEstimates {
    /// Estimates that count for `horizon_ms` after their booking (0: they
    /// never count).
    pub fn new(horizon_ms: u64) -> Self {
        Self {
            horizon_ms,
            live: VecDeque::new(),
        }
    }

    fn counts(&self, estimate: &Estimate, now_ms: u64) -> bool {
        now_ms.saturating_sub(estimate.at_ms) < self.horizon_ms
    }

    /// Adds an estimate of `load` booked on `target` at `at_ms` (the
    /// routing clock never goes back, so the queue stays oldest first).
    pub fn add(&mut self, target: WorkerRank, load: BookedLoad, at_ms: u64) {
        self.expire(at_ms);
        if self.horizon_ms > 0 {
            self.live.push_back(Estimate {
                target,
                load,
                at_ms,
            });
        }
    }

    /// Forgets the estimates that no longer count at `now_ms`.
    pub(crate) fn expire(&mut self, now_ms: u64) {
        while let Some(oldest) = self.live.front() {
            if self.counts(oldest, now_ms) {
                break;
            }
            self.live.pop_front();
        }
    }

    /// The estimated load on `target` at `now_ms`.
    pub(crate) fn load(&self, target: WorkerRank, now_ms: u64) -> BookedLoad {
        self.live
            .iter()
            .filter(|e| e.target == target && self.counts(e, now_ms))
            .fold(BookedLoad::default(), |sum, e| plus(sum, e.load))
    }

    #[cfg(test)]
    /// Estimates held (some may no longer count until the next `expire`).
    pub(crate) fn len(&self) -> usize {
        self.live.len()
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.live.is_empty()
    }
}

/// Booked load as one decision counts it (see the module docs).
pub struct LoadView<'a> {
    pub ledger: &'a BookingLedger,
    pub estimates: &'a PeerEstimates,
    pub now_ms: u64,
    /// Requests placed earlier in this decision (its own, peers' estimated).
    pub placed: &'a [(WorkerRank, BookedLoad)],
}

impl BookedLoads for LoadView<'_> {
    fn booked(&self, target: WorkerRank) -> BookedLoad {
        let placed = self
            .placed
            .iter()
            .filter(|(t, _)| *t == target)
            .fold(BookedLoad::default(), |sum, (_, load)| plus(sum, *load));
        plus(
            plus(
                self.ledger.load(target),
                self.estimates.load(target, self.now_ms),
            ),
            placed,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const R0: WorkerRank = WorkerRank::new(1, 0);
    const R1: WorkerRank = WorkerRank::new(2, 0);

    fn load(prefill_blocks: u64) -> BookedLoad {
        BookedLoad {
            prefill_tokens: prefill_blocks * 16,
            prefill_blocks,
            decode_blocks: prefill_blocks,
            active_requests: 1,
        }
    }

    #[test]
    fn estimates_count_until_the_horizon_then_nothing() {
        let mut e = PeerEstimates::new(3);
        e.add(R0, load(4), 10);
        e.add(R0, load(2), 11);
        e.add(R1, load(1), 11);
        assert_eq!(e.load(R0, 10).prefill_blocks, 6);
        assert_eq!(e.load(R0, 12).active_requests, 2);
        assert_eq!(e.load(R0, 13).prefill_blocks, 2, "the first aged out");
        assert_eq!(e.load(R1, 13), load(1));
        assert_eq!(e.load(R0, 14), BookedLoad::default());
        assert_eq!(e.len(), 3, "reading never forgets");
        e.expire(13);
        assert_eq!(e.len(), 2);
        e.expire(14);
        assert!(e.is_empty());
    }

    #[test]
    fn a_zero_horizon_keeps_nothing() {
        let mut e = PeerEstimates::new(0);
        e.add(R0, load(4), 10);
        assert!(e.is_empty());
        assert_eq!(e.load(R0, 10), BookedLoad::default());
    }

    #[test]
    fn the_view_adds_estimates_and_placed_copies_to_the_ledger() {
        let mut ledger = BookingLedger::new();
        ledger.book("a", R0, 100, 7, &[1, 2, 3], 0, None).unwrap();
        let mut estimates = PeerEstimates::new(5);
        estimates.add(R0, load(2), 0);
        let placed = [(R0, load(1)), (R1, load(3))];
        let view = LoadView {
            ledger: &ledger,
            estimates: &estimates,
            now_ms: 1,
            placed: &placed,
        };
        assert_eq!(
            view.booked(R0),
            BookedLoad {
                prefill_tokens: 100 + 32 + 16,
                prefill_blocks: 7 + 2 + 1,
                decode_blocks: 3 + 2 + 1,
                active_requests: 3,
            }
        );
        assert_eq!(view.booked(R1), load(3));
        let bare = LoadView {
            ledger: &ledger,
            estimates: &PeerEstimates::new(5),
            now_ms: 1,
            placed: &[],
        };
        assert_eq!(bare.booked(R0), ledger.load(R0));
    }
}
