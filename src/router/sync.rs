//! Routing state shared between replicas (cluster mode): the changes this
//! core makes to booked load and sessions go out on a feed, and the
//! changes other replicas made come back in through
//! [`RouterCore::apply_remote`], which does not feed them out again.
//!
//! Why a feed and not a shared store: a RESERVE decides under the routing
//! lock in microseconds; it cannot wait for a network round trip. Each
//! replica books locally at once and the others learn of it within
//! milliseconds (`crate::cluster::routing_sync` carries the feed).

use tokio::sync::mpsc;

use super::RouterCore;
use crate::{admission::bookings::SavedBooking, select::affinity::SavedSession};

/// Changes a feed holds before they are dropped (and counted); the
/// cluster's sync task empties it continuously.
pub const FEED_CAPACITY: usize = 65_536;

/// One change to the routing state another replica should make too.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RoutingChange {
    Booked(SavedBooking),
    PrefillComplete(String),
    Released(String),
    SessionBound(SavedSession),
}

impl RouterCore {
    /// Sends this core's own routing changes to `feed` from now on.
    pub fn set_change_feed(&self, feed: mpsc::Sender<RoutingChange>) {
        *self.feed.lock() = Some(feed);
    }

    /// Sends a change on the feed, if there is one; a full feed drops it.
    pub(super) fn feed(&self, change: RoutingChange) {
        let feed = self.feed.lock();
        if let Some(feed) = feed.as_ref()
            && feed.try_send(change).is_err()
        {
            self.metrics.cluster.changes_dropped.inc();
        }
    }

    /// Whether changes are fed out (cluster mode).
    pub(super) fn feeding(&self) -> bool {
        self.feed.lock().is_some()
    }

    /// Makes a change another replica made. Bookings of workers not
    /// registered here are dropped (the worker left meanwhile).
    pub fn apply_remote(&self, change: RoutingChange) {
        let now_ms = self.now_ms();
        let known = |worker_id| self.worker(worker_id).is_some();
        let changed = {
            let mut state = self.routing.write();
            let changed = match change {
                RoutingChange::Booked(booking) => {
                    known(booking.target.worker_id) && state.ledger.restore(booking, now_ms).is_ok()
                }
                RoutingChange::PrefillComplete(request_id) => {
                    state.ledger.mark_prefill_complete(&request_id)
                }
                RoutingChange::Released(request_id) => state.ledger.release(&request_id),
                RoutingChange::SessionBound(session) => {
                    if known(session.target.worker_id) {
                        state.sessions.restore(session, now_ms);
                    }
                    false
                }
            };
            self.metrics.bookings_active.set(state.ledger.len() as i64);
            changed
        };
        if changed {
            self.drain_queue();
        }
    }
}
