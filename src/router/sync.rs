//! Routing state shared between replicas (cluster mode): the changes this
//! core makes to booked load and sessions go out on a feed, and the
//! changes other replicas made come back in through
//! [`RouterCore::apply_remote`](super::RouterCore::apply_remote), which
//! does not feed them out again. The routing side (`routing_state.rs`)
//! holds the feed and the releases remembered; this file is their
//! vocabulary.
//!
//! Why a feed and not a shared store: a RESERVE decides under the routing
//! lock in microseconds; it cannot wait for a network round trip. Each
//! replica books locally at once and the others learn of it within
//! milliseconds (`crate::cluster::routing_sync` carries the feed).

use kvroute_core::{admission::bookings::SavedBooking, select::affinity::SavedSession};

/// Changes a feed holds before they are dropped (and counted); the
/// cluster's sync task empties it continuously.
pub const FEED_CAPACITY: usize = 65_536;

/// Releases of bookings not (yet) known here that are remembered, so the
/// booking is not taken when it arrives after its release (it was made at
/// another replica and released at this one, or released elsewhere and
/// the two changes crossed). The oldest are forgotten first.
pub const RELEASES_REMEMBERED: usize = 16_384;

/// The releases of [`RELEASES_REMEMBERED`].
#[derive(Debug, Default)]
pub(super) struct RecentReleases {
    order: std::collections::VecDeque<String>,
    ids: std::collections::HashSet<String>,
}

impl RecentReleases {
    pub(super) fn insert(&mut self, request_id: &str) {
        if self.ids.insert(request_id.to_owned()) {
            self.order.push_back(request_id.to_owned());
            if self.order.len() > RELEASES_REMEMBERED
                && let Some(oldest) = self.order.pop_front()
            {
                self.ids.remove(&oldest);
            }
        }
    }

    pub(super) fn take(&mut self, request_id: &str) -> bool {
        self.ids.remove(request_id)
    }
}

/// One change to the routing state another replica should make too.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RoutingChange {
    Booked(SavedBooking),
    PrefillComplete(String),
    Released(String),
    SessionBound(SavedSession),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        metrics::Metrics,
        router::{RouterConfig, RouterCore},
    };
    use kvroute_core::{
        registry::Registration,
        types::{WorkerRank, WorkerRole},
    };
    use tokio::sync::mpsc;

    fn core() -> RouterCore {
        let core = RouterCore::new(RouterConfig::default(), Metrics::new().expect("metrics"));
        core.register_worker(Registration {
            tiers: Vec::new(),
            worker_id: 1,
            model: "m".into(),
            role: WorkerRole::Aggregated,
            endpoint: String::new(),
            block_size: 16,
            dp_start_rank: 0,
            dp_size: 1,
            total_kv_blocks: 1000,
            max_num_batched_tokens: 8192,
            taints: Vec::new(),
            adapters: Vec::new(),
            loads_adapters: false,
            lease_ttl: None,
            kv_events: kvroute_core::types::KvEventsMode::Exact,
        })
        .expect("register");
        core
    }

    fn booking(request_id: &str, worker_id: u64) -> SavedBooking {
        SavedBooking {
            request_id: request_id.into(),
            target: WorkerRank::new(worker_id, 0),
            prefill: Some((32, 2)),
            keys: vec![7, 8],
            age_ms: 0,
            owner: None,
        }
    }

    #[test]
    fn a_peers_booking_on_an_approximate_worker_is_predicted_once_its_prefill_completes() {
        let core = core();
        let mut approximate = core.worker(1).expect("worker 1").registration;
        approximate.worker_id = 2;
        approximate.kv_events = kvroute_core::types::KvEventsMode::Approximate;
        core.register_worker(approximate).expect("register");
        let target = WorkerRank::new(2, 0);
        core.apply_remote(RoutingChange::Booked(booking("p", 2)));
        assert_eq!(core.predicted_blocks(target), 0, "not computed yet");
        core.apply_remote(RoutingChange::PrefillComplete("p".into()));
        assert_eq!(core.predicted_blocks(target), 2, "its two prefix keys");
        // On the exact worker a peer's booking predicts nothing.
        core.apply_remote(RoutingChange::Booked(booking("e", 1)));
        core.apply_remote(RoutingChange::Released("e".into()));
        assert_eq!(core.predicted_blocks(WorkerRank::new(1, 0)), 0);
    }

    #[test]
    fn a_remote_booking_counts_until_its_release() {
        let core = core();
        core.apply_remote(RoutingChange::Booked(booking("a", 1)));
        let load = core.booked_load(WorkerRank::new(1, 0));
        assert_eq!((load.active_requests, load.prefill_blocks), (1, 2));
        core.apply_remote(RoutingChange::PrefillComplete("a".into()));
        assert_eq!(core.booked_load(WorkerRank::new(1, 0)).prefill_blocks, 0);
        core.apply_remote(RoutingChange::Released("a".into()));
        assert_eq!(core.booked_load(WorkerRank::new(1, 0)).active_requests, 0);
    }

    #[test]
    fn a_release_that_overtakes_its_booking_still_releases_it() {
        let core = core();
        core.apply_remote(RoutingChange::Released("late".into()));
        core.apply_remote(RoutingChange::Booked(booking("late", 1)));
        assert_eq!(core.booked_load(WorkerRank::new(1, 0)).active_requests, 0);
        // Remembered once: a new booking under the same id counts.
        core.apply_remote(RoutingChange::Booked(booking("late", 1)));
        assert_eq!(core.booked_load(WorkerRank::new(1, 0)).active_requests, 1);
    }

    #[test]
    fn bookings_of_unknown_workers_are_dropped() {
        let core = core();
        core.apply_remote(RoutingChange::Booked(booking("x", 99)));
        assert_eq!(core.booked_load(WorkerRank::new(99, 0)).active_requests, 0);
    }

    #[test]
    fn a_release_here_of_a_booking_made_elsewhere_goes_out() {
        let core = core();
        let (tx, mut rx) = mpsc::channel(8);
        core.set_change_feed(tx);
        assert!(!core.release_request("elsewhere"));
        assert_eq!(
            rx.try_recv().ok(),
            Some(RoutingChange::Released("elsewhere".into()))
        );
        // And the booking, when it arrives, is not taken.
        core.apply_remote(RoutingChange::Booked(booking("elsewhere", 1)));
        assert_eq!(core.booked_load(WorkerRank::new(1, 0)).active_requests, 0);
    }

    #[test]
    fn remembered_releases_are_bounded() {
        let mut releases = RecentReleases::default();
        for i in 0..RELEASES_REMEMBERED + 10 {
            releases.insert(&i.to_string());
        }
        assert_eq!(releases.ids.len(), RELEASES_REMEMBERED);
        assert!(!releases.take("0"), "the oldest are forgotten");
        assert!(releases.take(&(RELEASES_REMEMBERED + 9).to_string()));
    }
}
