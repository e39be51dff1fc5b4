//! The path of KV events from the simulated engines to the kvroute policy's
//! router, with the impairments replay can put on it: some engines' events
//! lost (a fraction, at random, each lost event's id skipped as a real
//! publisher's would be), and every engine's events late by a fixed delay.
//!
//! Why: trust per worker (`router::trust`) exists for streams that break;
//! replay measures what it saves against a lossless, prompt stream.

use std::collections::VecDeque;

use rand::{Rng, SeedableRng, rngs::StdRng};

use kvroute::pb;

/// How the link impairs events.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LinkImpairment {
    /// Fraction of a lossy engine's events lost, 0 to 1.
    pub loss: f64,
    /// The last this many engines lose events.
    pub lossy_engines: usize,
    /// Virtual ms every batch takes to arrive.
    pub delay_ms: f64,
}

/// Events on their way (see the module docs).
#[derive(Debug)]
pub struct EventLink {
    impairment: LinkImpairment,
    engines: usize,
    rng: StdRng,
    /// Batches in flight: when due, from which engine.
    in_flight: VecDeque<(f64, usize, Vec<pb::KvEvent>)>,
    /// Events lost so far.
    pub lost: u64,
}

impl EventLink {
    pub(crate) fn new(impairment: LinkImpairment, engines: usize, seed: u64) -> Self {
        Self {
            impairment,
            engines,
            rng: StdRng::seed_from_u64(seed ^ 0x6c6f_7373),
            in_flight: VecDeque::new(),
            lost: 0,
        }
    }

    /// Whether `engine` loses events.
    pub(crate) fn is_lossy(&self, engine: usize) -> bool {
        self.impairment.loss > 0.0
            && engine + self.impairment.lossy_engines >= self.engines
            && engine < self.engines
    }

    /// Sends one engine's batch at `now_ms` (its events numbered already).
    pub(crate) fn send(&mut self, engine: usize, mut events: Vec<pb::KvEvent>, now_ms: f64) {
        if self.is_lossy(engine) {
            let loss = self.impairment.loss.clamp(0.0, 1.0);
            let before = events.len();
            events.retain(|_| !self.rng.random_bool(loss));
            self.lost += (before - events.len()) as u64;
        }
        if !events.is_empty() {
            // Delays are equal, so arrival keeps sending order.
            self.in_flight
                .push_back((now_ms + self.impairment.delay_ms, engine, events));
        }
    }

    /// The next batch due by `now_ms`, in sending order.
    pub(crate) fn arrive(&mut self, now_ms: f64) -> Option<(usize, Vec<pb::KvEvent>)> {
        if self.in_flight.front()?.0 > now_ms {
            return None;
        }
        self.in_flight
            .pop_front()
            .map(|(_, engine, events)| (engine, events))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(ids: std::ops::Range<u64>) -> Vec<pb::KvEvent> {
        ids.map(|event_id| pb::KvEvent {
            event_id,
            kind: None,
        })
        .collect()
    }

    #[test]
    fn only_the_lossy_engines_lose_about_their_fraction_and_ids_keep_their_gaps() {
        let impairment = LinkImpairment {
            loss: 0.2,
            lossy_engines: 2,
            delay_ms: 0.0,
        };
        let mut link = EventLink::new(impairment, 4, 1);
        assert!(!link.is_lossy(1) && link.is_lossy(2) && link.is_lossy(3));
        link.send(0, events(0..1000), 0.0);
        let (engine, kept) = link.arrive(0.0).unwrap();
        assert_eq!((engine, kept.len()), (0, 1000));
        link.send(3, events(0..10_000), 0.0);
        let (_, kept) = link.arrive(0.0).unwrap();
        assert!((7_700..8_300).contains(&kept.len()), "{}", kept.len());
        assert_eq!(link.lost, 10_000 - kept.len() as u64);
        assert!(kept.windows(2).all(|w| w[0].event_id < w[1].event_id));
        assert!(kept.windows(2).any(|w| w[1].event_id > w[0].event_id + 1));
    }

    #[test]
    fn delayed_batches_arrive_when_due_in_order() {
        let impairment = LinkImpairment {
            delay_ms: 50.0,
            ..LinkImpairment::default()
        };
        let mut link = EventLink::new(impairment, 2, 1);
        link.send(0, events(0..1), 10.0);
        link.send(1, events(0..1), 20.0);
        assert!(link.arrive(59.0).is_none());
        assert_eq!(link.arrive(60.0).unwrap().0, 0);
        assert!(link.arrive(69.0).is_none());
        assert_eq!(link.arrive(70.0).unwrap().0, 1);
    }
}
