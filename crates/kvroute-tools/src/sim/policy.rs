//! The routing seam and the baseline policies.
//!
//! The simulator only knows the [`Router`] trait, so kvroute's real
//! selection code can be plugged in by implementing it. The baselines here
//! (round-robin, seeded random, least-loaded, prefix-only) give reference
//! points to compare it with.

use std::collections::HashSet;

use kvroute_core::types::Tier;

use super::determinism::{FastBuild, SimRng};
use super::engine::{EngineKvEvent, EngineLoad};
use super::types::{FleetView, ReplicaSetup, SimRequest};

/// A routing policy driven by the simulator.
pub trait Router {
    /// Name shown in reports.
    fn name(&self) -> String;

    /// Choose an engine (`0..fleet.len()`) for a request arriving at `now_ms`.
    fn route(&mut self, request: &SimRequest, now_ms: f64, fleet: &FleetView) -> usize;

    /// KV events from engine `engine`, in the order they happened. Delivered
    /// when the engine step that caused them ends, at `now_ms`.
    fn on_kv_events(&mut self, _engine: usize, _events: &[EngineKvEvent], _now_ms: f64) {}

    /// The request's prefill finished (its first token was produced) at
    /// `now_ms`; its engine found `cached_tokens` of its prompt cached.
    fn on_prefill_complete(&mut self, _request_id: u64, _now_ms: f64, _cached_tokens: u64) {}

    /// The request finished (or was rejected by its engine) at `now_ms`.
    fn on_request_complete(&mut self, _request_id: u64, _now_ms: f64) {}

    /// `(predicted, actual)` TTFT in ms of every request whose TTFT the
    /// policy predicted, in the order their prefills completed.
    fn ttft_predictions(&self) -> Vec<(f64, f64)> {
        Vec::new()
    }

    /// `(predicted, engine)` cached prompt tokens of every request whose
    /// overlap the policy predicted, in the order their prefills completed.
    fn cached_token_predictions(&self) -> Vec<(f64, f64)> {
        Vec::new()
    }

    /// Virtual ms each decision waits before its request can go to its
    /// engine (ordered replicas wait for their record to come back from
    /// the log); a request's TTFT counts it.
    fn decision_delay_ms(&self) -> f64 {
        0.0
    }

    /// Decisions on which some replica chose another engine than the one
    /// that answered; `None` where replicas do not all decide.
    fn divergent_decisions(&self) -> Option<u64> {
        None
    }

    /// The router replicas this policy models; `None` for one router.
    fn replicas(&self) -> Option<ReplicaSetup> {
        None
    }
}

/// Names accepted by [`policy_by_name`].
pub const POLICY_NAMES: &[&str] = &["round-robin", "random", "least-loaded", "prefix-only"];

/// A baseline policy by name; `None` for an unknown name. `seed` feeds the
/// random policy.
pub fn policy_by_name(name: &str, seed: u64) -> Option<Box<dyn Router>> {
    match name {
        "round-robin" => Some(Box::new(RoundRobin::default())),
        "random" => Some(Box::new(RandomRouter::new(seed))),
        "least-loaded" => Some(Box::new(LeastLoaded)),
        "prefix-only" => Some(Box::new(PrefixOnly::default())),
        _ => None,
    }
}

/// Engines in turn.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: usize,
}

impl Router for RoundRobin {
    fn name(&self) -> String {
        "round-robin".into()
    }

    fn route(&mut self, _request: &SimRequest, _now_ms: f64, fleet: &FleetView) -> usize {
        let n = fleet.len().max(1);
        let pick = self.next % n;
        self.next = (pick + 1) % n;
        pick
    }
}

/// A uniformly random engine from a seeded stream.
#[derive(Debug)]
pub struct RandomRouter {
    rng: SimRng,
}

impl RandomRouter {
    pub(crate) fn new(seed: u64) -> Self {
        RandomRouter {
            rng: SimRng::new(seed),
        }
    }
}

impl Router for RandomRouter {
    fn name(&self) -> String {
        "random".into()
    }

    fn route(&mut self, _request: &SimRequest, _now_ms: f64, fleet: &FleetView) -> usize {
        self.rng.below(fleet.len().max(1))
    }
}

/// Load order used by the load-aware policies: fewest queued prefill tokens,
/// then fewest sequences, then fewest active blocks (lower index on ties).
fn load_key(load: &EngineLoad) -> (usize, usize, usize) {
    (
        load.prefill_tokens_queued,
        load.running + load.waiting,
        load.active_blocks,
    )
}

/// The engine with the least load (see `load_key`).
#[derive(Debug, Default)]
pub struct LeastLoaded;

impl Router for LeastLoaded {
    fn name(&self) -> String {
        "least-loaded".into()
    }

    fn route(&mut self, _request: &SimRequest, _now_ms: f64, fleet: &FleetView) -> usize {
        fleet
            .engines
            .iter()
            .enumerate()
            .min_by_key(|(i, l)| (load_key(l), *i))
            .map_or(0, |(i, _)| i)
    }
}

/// Longest cached prefix wins; ties go to the least-loaded engine.
///
/// Its overlap oracle is an exact per-engine set of cached engine block
/// hashes, kept from the KV events. Because engine hashes are chained, a
/// request's overlap with an engine is the number of leading entries of
/// `SimRequest::block_hashes` present in that engine's set.
#[derive(Debug, Default)]
pub struct PrefixOnly {
    cached: Vec<HashSet<u64, FastBuild>>,
}

impl PrefixOnly {
    /// Leading blocks of `hashes` cached on `engine`, as far as the events
    /// received so far tell.
    pub(crate) fn overlap(&self, engine: usize, hashes: &[u64]) -> usize {
        self.cached.get(engine).map_or(0, |set| {
            hashes.iter().take_while(|h| set.contains(*h)).count()
        })
    }
}

impl Router for PrefixOnly {
    fn name(&self) -> String {
        "prefix-only".into()
    }

    fn route(&mut self, request: &SimRequest, _now_ms: f64, fleet: &FleetView) -> usize {
        (0..fleet.len())
            .min_by_key(|&i| {
                let overlap = self.overlap(i, &request.block_hashes);
                (std::cmp::Reverse(overlap), load_key(&fleet.engines[i]), i)
            })
            .unwrap_or(0)
    }

    fn on_kv_events(&mut self, engine: usize, events: &[EngineKvEvent], _now_ms: f64) {
        if self.cached.len() <= engine {
            self.cached.resize_with(engine + 1, HashSet::default);
        }
        let set = &mut self.cached[engine];
        // device blocks only: this baseline knows nothing of tiers
        for event in events {
            match event {
                EngineKvEvent::Stored {
                    tier: Tier::Device,
                    blocks,
                    ..
                } => {
                    set.extend(blocks.iter().map(|(h, _)| *h));
                }
                EngineKvEvent::Removed {
                    tier: Tier::Device,
                    engine_hashes,
                } => {
                    for h in engine_hashes {
                        set.remove(h);
                    }
                }
                EngineKvEvent::Stored { .. } | EngineKvEvent::Removed { .. } => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(hashes: Vec<u64>) -> SimRequest {
        SimRequest {
            id: 0,
            arrival_ms: 0.0,
            tokens: Vec::new(),
            block_hashes: hashes,
            output_length: 1,
        }
    }

    fn loads(n: usize) -> Vec<EngineLoad> {
        vec![EngineLoad::default(); n]
    }

    #[test]
    fn round_robin_cycles() {
        let l = loads(3);
        let view = FleetView {
            engines: &l,
            block_size: 64,
            max_num_batched_tokens: 8192,
        };
        let mut rr = RoundRobin::default();
        let picks: Vec<usize> = (0..6)
            .map(|_| rr.route(&request(vec![]), 0.0, &view))
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn random_is_seeded() {
        let l = loads(4);
        let view = FleetView {
            engines: &l,
            block_size: 64,
            max_num_batched_tokens: 8192,
        };
        let run = |seed| {
            let mut r = RandomRouter::new(seed);
            (0..50)
                .map(|_| r.route(&request(vec![]), 0.0, &view))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(1), run(1));
        assert_ne!(run(1), run(2));
    }

    #[test]
    fn prefix_only_prefers_overlap_then_load() {
        let mut l = loads(3);
        l[0].prefill_tokens_queued = 10;
        let view = FleetView {
            engines: &l,
            block_size: 64,
            max_num_batched_tokens: 8192,
        };
        let mut p = PrefixOnly::default();
        // no overlap anywhere: least loaded (engine 1, lowest index among idle)
        assert_eq!(p.route(&request(vec![1, 2, 3]), 0.0, &view), 1);
        p.on_kv_events(
            0,
            &[EngineKvEvent::Stored {
                tier: Tier::Device,
                parent: None,
                blocks: vec![(1, vec![]), (2, vec![])],
            }],
            0.0,
        );
        p.on_kv_events(
            2,
            &[EngineKvEvent::Stored {
                tier: Tier::Device,
                parent: None,
                blocks: vec![(1, vec![])],
            }],
            0.0,
        );
        assert_eq!(p.overlap(0, &[1, 2, 3]), 2);
        assert_eq!(p.route(&request(vec![1, 2, 3]), 0.0, &view), 0);
        p.on_kv_events(
            0,
            &[EngineKvEvent::Removed {
                tier: Tier::Device,
                engine_hashes: vec![1],
            }],
            0.0,
        );
        // engine 0 lost its first block: its overlap is 0 now
        assert_eq!(p.overlap(0, &[1, 2, 3]), 0);
        assert_eq!(p.route(&request(vec![1, 2, 3]), 0.0, &view), 2);
    }

    #[test]
    fn least_loaded_picks_fewest_queued_tokens() {
        let mut l = loads(3);
        l[0].prefill_tokens_queued = 5;
        l[1].prefill_tokens_queued = 1;
        l[2].prefill_tokens_queued = 9;
        let view = FleetView {
            engines: &l,
            block_size: 64,
            max_num_batched_tokens: 8192,
        };
        assert_eq!(LeastLoaded.route(&request(vec![]), 0.0, &view), 1);
    }

    #[test]
    fn names_resolve() {
        for name in POLICY_NAMES {
            assert_eq!(policy_by_name(name, 1).unwrap().name(), *name);
        }
        assert!(policy_by_name("nope", 1).is_none());
    }
}
