//! Router replicas: several `kvroute` routers in front of one fleet, each
//! learning of the others' booked load late, or never (issue 18).
//!
//! Why it exists: a router books the load it sends to a worker at once, so
//! its next decision counts it. A replica beside it counts that load only
//! once it is shared; until then it sends its own requests where the first
//! went, to the worker holding the longest cached prefix: the replicas herd.
//! This measures what that costs for a given sync delay.
//!
//! The model:
//! * request `i` (its index in the trace) is routed by replica `i mod N`:
//!   round robin, as a load balancer in front of the replicas spreads calls;
//! * each replica is its own [`KvRoutePolicy`] (its own `RouterCore`), all
//!   with the same knobs and seed;
//! * every replica receives every engine's KV events when the step that
//!   caused them ends, as one router does (the index is shared exactly),
//!   and the engines' reported load when it routes;
//! * the routing replica books at once and gets its request's prefill
//!   completion and release when they happen; the other replicas get the
//!   same booking (`RouterCore::saved_booking`, booked as a snapshot's would
//!   be), then the completion and the release, each `sync_delay_ms` of
//!   virtual time later, in the order they happened; or never.
//!
//! Only booked load is delayed. With a 0 ms delay every replica holds every
//! booking before the next decision, so N replicas route exactly as one
//! router does (tested below).
//!
//! **Ordered decisions** (`--ordered-decisions`, issue 35) are the other
//! way: each decision is a record of the replicated log, and every replica
//! applies every record (decision, prefill completion, release, KV event)
//! in the log's one order, so each replica makes every decision itself and
//! books the same worker. Every record takes the sync delay `d` to come
//! back from the log. So a request arriving at `t` is decided at `t + d`
//! and goes to its engine then, from the state of everything that happened
//! by `t`. The model decides at the request's trace time, counts `d` in its
//! TTFT (as if it had arrived `d` earlier), and hands every replica the KV
//! events, prefill completions and releases `d` late (the engines'
//! reported load it reads at the decision, as one router does); it checks the
//! premise as it goes: a decision on which some replica chose differently
//! from the one that answers is counted ([`Router::divergent_decisions`]).
//!
//! Each replica's core is told what cluster mode tells it
//! (`RouterConfig::replicas`): `count` replicas, its index, and the sync
//! delay, so it estimates the load its peers book before it hears of it
//! (`admission::peers`). Replicas that never sync are told nothing: there
//! is no delay after which an estimate could give way to the real load.

use std::{collections::VecDeque, time::Duration};

use kvroute::router::ReplicaSettings;
use kvroute_core::admission::bookings::SavedBooking;

use super::engine::EngineKvEvent;
use super::kvroute_policy::{KvRouteKnobs, KvRoutePolicy};
use super::policy::Router;
use super::types::{FleetView, ReplicaSetup, SimRequest};

/// What a replica tells the others about a request it routed; with
/// ordered decisions, what the log hands every replica.
#[derive(Debug)]
enum Shared {
    Booked(SavedBooking),
    PrefillComplete(u64, u64),
    Released(u64),
    KvEvents(usize, Vec<EngineKvEvent>),
}

/// A message on its way from replica `from` to every other replica
/// (`None`: from the log to every replica).
#[derive(Debug)]
struct InFlight {
    due_ms: f64,
    from: Option<usize>,
    what: Shared,
}

/// What replica `index` of `count` knows of its peers: the sync delay, as
/// cluster mode would configure it; nothing when they never sync.
fn replica_settings(setup: ReplicaSetup, count: usize, index: usize) -> ReplicaSettings {
    if setup.ordered {
        // Every replica holds every booking when it decides: no estimate.
        return ReplicaSettings::default();
    }
    match setup.sync_delay_ms {
        Some(delay_ms) if delay_ms > 0.0 => ReplicaSettings {
            count: u32::try_from(count).unwrap_or(u32::MAX),
            index: u32::try_from(index).unwrap_or(u32::MAX),
            sync_delay: Duration::from_secs_f64(delay_ms / 1000.0),
        },
        _ => ReplicaSettings::default(),
    }
}

/// N `kvroute` policies behind the simulator's [`Router`] seam (see the
/// module docs).
pub struct ReplicatedKvRoute {
    replicas: Vec<KvRoutePolicy>,
    setup: ReplicaSetup,
    /// Oldest first. Every message is delayed alike and virtual time never
    /// goes back, so due times never decrease along the queue.
    in_flight: VecDeque<InFlight>,
    /// Ordered decisions some replica made differently.
    divergent: u64,
}

impl ReplicatedKvRoute {
    /// `setup.count` replicas (at least one) with the same `knobs`.
    pub(crate) fn new(knobs: KvRouteKnobs, setup: ReplicaSetup) -> Result<Self, prometheus::Error> {
        let count = setup.count.max(1);
        let replicas = (0..count)
            .map(|index| KvRoutePolicy::replica(knobs, replica_settings(setup, count, index)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            replicas,
            setup: ReplicaSetup { count, ..setup },
            in_flight: VecDeque::new(),
            divergent: 0,
        })
    }

    #[cfg(test)]
    /// Routing or ingest failures over every replica (none are expected).
    pub(crate) fn errors(&self) -> u64 {
        self.replicas.iter().map(|r| r.errors).sum()
    }

    /// The replica that routes request `request_id`.
    fn replica_of(&self, request_id: u64) -> usize {
        (request_id % self.replicas.len() as u64) as usize
    }

    /// Sends `what` from replica `from` (`None`: the log) at `now_ms`,
    /// unless replicas never share.
    fn share(&mut self, from: Option<usize>, now_ms: f64, what: Shared) {
        if let Some(delay) = self.setup.sync_delay_ms {
            self.in_flight.push_back(InFlight {
                due_ms: now_ms + delay,
                from,
                what,
            });
        }
    }

    /// Hands every message due by `now_ms` to every replica but its sender.
    /// Only decisions read what messages change, so delivering them just
    /// before each decision is as good as at their due time.
    fn deliver(&mut self, now_ms: f64) {
        while self.in_flight.front().is_some_and(|m| m.due_ms <= now_ms) {
            let Some(message) = self.in_flight.pop_front() else {
                break;
            };
            let others = self
                .replicas
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| Some(*i) != message.from);
            for (_, replica) in others {
                match &message.what {
                    Shared::Booked(booking) => replica.book_for_peer(booking.clone(), now_ms),
                    Shared::PrefillComplete(id, cached) => {
                        replica.on_prefill_complete(*id, now_ms, *cached)
                    }
                    Shared::Released(id) => replica.on_request_complete(*id, now_ms),
                    Shared::KvEvents(engine, events) => {
                        replica.on_kv_events(*engine, events, now_ms)
                    }
                }
            }
        }
    }
}

impl ReplicatedKvRoute {
    /// An ordered decision: every replica applies the record and decides;
    /// the answer is replica `from`'s, and any other choice is counted.
    fn decide_everywhere(
        &mut self,
        request: &SimRequest,
        now_ms: f64,
        fleet: &FleetView,
        from: usize,
    ) -> usize {
        let choices: Vec<usize> = self
            .replicas
            .iter_mut()
            .map(|replica| replica.route(request, now_ms, fleet))
            .collect();
        let answer = choices.get(from).copied().unwrap_or(0);
        if choices.iter().any(|&c| c != answer) {
            self.divergent += 1;
        }
        answer
    }
}

impl Router for ReplicatedKvRoute {
    /// The policy's name, as one router's; the replicas show in
    /// [`Router::replicas`].
    fn name(&self) -> String {
        self.replicas
            .first()
            .map_or_else(|| "kvroute".into(), Router::name)
    }

    fn route(&mut self, request: &SimRequest, now_ms: f64, fleet: &FleetView) -> usize {
        for replica in &mut self.replicas {
            replica.ensure_registered(fleet);
        }
        self.deliver(now_ms);
        let from = self.replica_of(request.id);
        if self.setup.ordered {
            return self.decide_everywhere(request, now_ms, fleet, from);
        }
        let Some(replica) = self.replicas.get_mut(from) else {
            return 0;
        };
        let engine = replica.route(request, now_ms, fleet);
        if self.setup.sync_delay_ms.is_some()
            && let Some(booking) = replica.booking(request.id)
        {
            self.share(Some(from), now_ms, Shared::Booked(booking));
        }
        engine
    }

    fn on_kv_events(&mut self, engine: usize, events: &[EngineKvEvent], now_ms: f64) {
        if self.setup.ordered {
            self.share(None, now_ms, Shared::KvEvents(engine, events.to_vec()));
            return;
        }
        for replica in &mut self.replicas {
            replica.on_kv_events(engine, events, now_ms);
        }
    }

    fn on_prefill_complete(&mut self, request_id: u64, now_ms: f64, cached_tokens: u64) {
        if self.setup.ordered {
            let what = Shared::PrefillComplete(request_id, cached_tokens);
            self.share(None, now_ms, what);
            return;
        }
        let from = self.replica_of(request_id);
        if let Some(replica) = self.replicas.get_mut(from) {
            replica.on_prefill_complete(request_id, now_ms, cached_tokens);
        }
        self.share(
            Some(from),
            now_ms,
            Shared::PrefillComplete(request_id, cached_tokens),
        );
    }

    fn cached_token_predictions(&self) -> Vec<(f64, f64)> {
        if self.setup.ordered {
            // Every replica made every decision: one's predictions are all.
            return self
                .replicas
                .first()
                .map(Router::cached_token_predictions)
                .unwrap_or_default();
        }
        self.replicas
            .iter()
            .flat_map(Router::cached_token_predictions)
            .collect()
    }

    fn on_request_complete(&mut self, request_id: u64, now_ms: f64) {
        if self.setup.ordered {
            self.share(None, now_ms, Shared::Released(request_id));
            return;
        }
        let from = self.replica_of(request_id);
        if let Some(replica) = self.replicas.get_mut(from) {
            replica.on_request_complete(request_id, now_ms);
        }
        self.share(Some(from), now_ms, Shared::Released(request_id));
    }

    fn decision_delay_ms(&self) -> f64 {
        match self.setup.sync_delay_ms {
            Some(delay) if self.setup.ordered => delay,
            _ => 0.0,
        }
    }

    fn divergent_decisions(&self) -> Option<u64> {
        self.setup.ordered.then_some(self.divergent)
    }

    fn replicas(&self) -> Option<ReplicaSetup> {
        Some(self.setup)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::sim::{fleet::replay, report::Report, types::SimConfig};
    use crate::trace::{Trace, TraceRequest};

    /// A router that records where each request went.
    struct Recorder<R> {
        inner: R,
        engines: Vec<usize>,
    }

    impl<R: Router> Router for Recorder<R> {
        fn name(&self) -> String {
            self.inner.name()
        }

        fn route(&mut self, request: &SimRequest, now_ms: f64, fleet: &FleetView) -> usize {
            let engine = self.inner.route(request, now_ms, fleet);
            self.engines.push(engine);
            engine
        }

        fn on_kv_events(&mut self, engine: usize, events: &[EngineKvEvent], now_ms: f64) {
            self.inner.on_kv_events(engine, events, now_ms);
        }

        fn on_prefill_complete(&mut self, request_id: u64, now_ms: f64, cached_tokens: u64) {
            self.inner
                .on_prefill_complete(request_id, now_ms, cached_tokens);
        }

        fn on_request_complete(&mut self, request_id: u64, now_ms: f64) {
            self.inner.on_request_complete(request_id, now_ms);
        }

        fn decision_delay_ms(&self) -> f64 {
            self.inner.decision_delay_ms()
        }

        fn divergent_decisions(&self) -> Option<u64> {
            self.inner.divergent_decisions()
        }

        fn replicas(&self) -> Option<ReplicaSetup> {
            self.inner.replicas()
        }
    }

    /// The engine of every request, and the report, of one replay.
    fn run(trace: &Trace, cfg: &SimConfig, replicas: Option<ReplicaSetup>) -> (Vec<usize>, Report) {
        let knobs = KvRouteKnobs::default();
        match replicas {
            None => {
                let mut router = Recorder {
                    inner: KvRoutePolicy::new(knobs).expect("metrics"),
                    engines: Vec::new(),
                };
                let report = replay(trace, cfg, &mut router);
                assert_eq!(router.inner.errors, 0);
                (router.engines, report)
            }
            Some(setup) => {
                let mut router = Recorder {
                    inner: ReplicatedKvRoute::new(knobs, setup).expect("metrics"),
                    engines: Vec::new(),
                };
                let report = replay(trace, cfg, &mut router);
                assert_eq!(router.inner.errors(), 0);
                (router.engines, report)
            }
        }
    }

    fn three(sync_delay_ms: Option<f64>) -> Option<ReplicaSetup> {
        Some(ReplicaSetup {
            count: 3,
            sync_delay_ms,
            ordered: false,
        })
    }

    /// `count` replicas deciding in the log's order, each record back
    /// `delay_ms` later.
    fn ordered(count: usize, delay_ms: f64) -> Option<ReplicaSetup> {
        Some(ReplicaSetup {
            count,
            sync_delay_ms: Some(delay_ms),
            ordered: true,
        })
    }

    fn sample() -> Trace {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/data/conversation_sample.jsonl");
        Trace::load(&path).expect("the committed sample trace loads")
    }

    /// One request caches a 128-block prefix (16 trace blocks of 512
    /// tokens, 64-token engine blocks) on the engine it goes to; long after,
    /// `burst` requests arrive at one instant, each with that prefix and 64
    /// blocks of its own.
    fn shared_prefix_burst(burst: u64) -> Trace {
        let prefix: Vec<u64> = (0..16).collect();
        let mut records = vec![TraceRequest {
            timestamp: 0,
            input_length: 16 * 512,
            output_length: 1,
            hash_ids: prefix.clone(),
        }];
        records.extend((0..burst).map(|i| {
            TraceRequest {
                timestamp: 10_000,
                input_length: 24 * 512,
                output_length: 32,
                hash_ids: prefix
                    .iter()
                    .copied()
                    .chain((0..8).map(|j| 1_000 + 8 * i + j))
                    .collect(),
            }
        }));
        Trace { records }
    }

    /// Burst requests sent to the engine that holds the prefix.
    fn on_cached_engine(engines: &[usize]) -> usize {
        let cached = engines[0];
        engines[1..].iter().filter(|&&e| e == cached).count()
    }

    #[test]
    fn replicas_synced_at_zero_route_exactly_as_one_router() {
        let trace = sample();
        let cfg = SimConfig {
            speedup: 4.0,
            ..SimConfig::default()
        };
        let (one, one_report) = run(&trace, &cfg, None);
        let (synced, synced_report) = run(&trace, &cfg, three(Some(0.0)));
        assert_eq!(one.len(), 300);
        assert_eq!(one, synced, "same engine for every request");
        assert_eq!(synced_report.replicas, three(Some(0.0)));
        let timings = |r: &Report| Report {
            replicas: None,
            ..r.without_wall_time()
        };
        assert_eq!(timings(&one_report), timings(&synced_report));
        // ... and on the crafted burst, where sharing decides everything
        let burst = shared_prefix_burst(6);
        let cfg = SimConfig::default();
        assert_eq!(
            run(&burst, &cfg, None).0,
            run(&burst, &cfg, three(Some(0.0))).0
        );
    }

    #[test]
    fn unsynced_replicas_herd_onto_the_cached_engine() {
        let trace = shared_prefix_burst(6);
        let cfg = SimConfig::default();
        let (one, _) = run(&trace, &cfg, None);
        let (synced, _) = run(&trace, &cfg, three(Some(0.0)));
        let (unsynced, _) = run(&trace, &cfg, three(None));
        let (one, synced, unsynced) = (
            on_cached_engine(&one),
            on_cached_engine(&synced),
            on_cached_engine(&unsynced),
        );
        assert_eq!(synced, one);
        // Each replica routes 2 of the 6 and counts only its own bookings:
        // too few to outweigh the cached prefix, so all 6 herd.
        assert_eq!(unsynced, 6, "synced: {synced}");
        assert!(synced < unsynced, "synced replicas spread: {synced} of 6");
    }

    #[test]
    fn ordered_replicas_make_the_decisions_of_one_router_fed_the_same_log() {
        let trace = sample();
        let cfg = SimConfig {
            speedup: 4.0,
            ..SimConfig::default()
        };
        for delay_ms in [1.0, 10.0, 50.0] {
            // One router given the same ordered inputs (the log, one reader).
            let (one, one_report) = run(&trace, &cfg, ordered(1, delay_ms));
            for count in [2, 3, 5] {
                let (replicas, report) = run(&trace, &cfg, ordered(count, delay_ms));
                assert_eq!(
                    one, replicas,
                    "{count} replicas, {delay_ms} ms: same engines"
                );
                assert_eq!(report.divergent_decisions, Some(0));
                assert_eq!(report.ttft_ms, one_report.ttft_ms);
                assert_eq!(report.reuse_ratio, one_report.reuse_ratio);
            }
        }
    }

    #[test]
    fn ordered_decisions_wait_for_the_log_but_without_delay_are_one_routers() {
        let trace = sample();
        let cfg = SimConfig {
            speedup: 4.0,
            ..SimConfig::default()
        };
        let (one, one_report) = run(&trace, &cfg, None);
        let (at_zero, zero_report) = run(&trace, &cfg, ordered(3, 0.0));
        assert_eq!(one, at_zero, "no delay: one router's engines");
        assert_eq!(zero_report.ttft_ms, one_report.ttft_ms);
        // A lone request (nothing else to read late) only waits.
        let lone = Trace {
            records: vec![TraceRequest {
                timestamp: 0,
                input_length: 4 * 512,
                output_length: 8,
                hash_ids: (0..4).collect(),
            }],
        };
        let plain = run(&lone, &cfg, None).1.ttft_ms.mean;
        let waited = run(&lone, &cfg, ordered(3, 10.0)).1.ttft_ms.mean;
        assert!(
            (waited - plain - 10.0).abs() < 1e-9,
            "{plain} then {waited}"
        );
    }

    #[test]
    fn ordered_replicas_do_not_herd_where_synced_ones_do() {
        let trace = shared_prefix_burst(6);
        let cfg = SimConfig::default();
        let one = on_cached_engine(&run(&trace, &cfg, None).0);
        let synced = on_cached_engine(&run(&trace, &cfg, three(Some(10.0))).0);
        let in_order = on_cached_engine(&run(&trace, &cfg, ordered(3, 10.0)).0);
        // The burst arrives at one instant: 10 ms later every ordered
        // replica has applied every earlier decision's booking, as one
        // router has; synced replicas have not heard of each other's yet.
        assert_eq!(in_order, one);
        assert!(
            in_order < synced,
            "ordered {in_order}, synced {synced} of 6"
        );
    }

    /// `burst` requests of 24 trace blocks each, nothing shared, at one
    /// instant.
    fn cold_burst(burst: u64) -> Trace {
        let records = (0..burst)
            .map(|i| TraceRequest {
                timestamp: 1_000,
                input_length: 24 * 512,
                output_length: 32,
                hash_ids: (0..24).map(|j| 100 * i + j).collect(),
            })
            .collect();
        Trace { records }
    }

    /// Requests per engine, busiest first.
    fn spread(engines: &[usize]) -> Vec<usize> {
        let mut counts = std::collections::BTreeMap::new();
        for engine in engines {
            *counts.entry(*engine).or_insert(0) += 1;
        }
        let mut counts: Vec<usize> = counts.into_values().collect();
        counts.sort_unstable_by(|a, b| b.cmp(a));
        counts
    }

    #[test]
    fn replicas_told_of_the_delay_spread_a_cold_burst_as_one_router_does() {
        // 1 ms is longer than the burst, which arrives at one instant: no
        // booking of it reaches another replica in time, and each replica
        // estimates what the others book meanwhile.
        let trace = cold_burst(12);
        let cfg = SimConfig::default();
        let (one, _) = run(&trace, &cfg, None);
        let (late, _) = run(&trace, &cfg, three(Some(1.0)));
        assert_eq!(spread(&one), [3, 3, 3, 3], "one router: {one:?}");
        assert_eq!(spread(&late), spread(&one), "synced 1 ms late: {late:?}");
    }

    #[test]
    fn a_burst_sharing_a_prefix_still_herds_when_bookings_come_late() {
        // The estimate takes a peer's request to hold none of this one's
        // prefix (on conversations it does not); here all of them do, and
        // every replica sends its two to the engine that holds it, as
        // replicas that never sync do. One router sends three.
        let trace = shared_prefix_burst(6);
        let cfg = SimConfig::default();
        let (one, _) = run(&trace, &cfg, None);
        let (late, _) = run(&trace, &cfg, three(Some(1.0)));
        let (unsynced, _) = run(&trace, &cfg, three(None));
        assert_eq!(on_cached_engine(&one), 3);
        assert_eq!(late, unsynced);
    }
}
