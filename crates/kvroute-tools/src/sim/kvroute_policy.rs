//! The `kvroute` policy of the simulator: routes with the service's own
//! core, not a copy of it. Requests go through the same protobuf conversion
//! (hashing), selection, booking and lifecycle code as `SelectWorker`; each
//! engine's KV events go through the same batch validation and index writer
//! code as `PublishEvents` (called directly, without the channel).
//!
//! Differences from the service, on purpose: admission never queues (the
//! simulated engines keep their own waiting queues), workers report load
//! on every routing call instead of by heartbeat, and the core's routing
//! clock (bookings, sessions, peer estimates) is the replay's virtual time
//! in whole milliseconds.

use std::sync::Arc;

use kvroute::{
    grpc::convert::{self, BatchLimits},
    ingest::EventWriter,
    pb,
    router::{
        DEFAULT_OVERLAP_CREDIT, DEFAULT_OVERLAP_WEIGHT, ReplicaSettings, RouterConfig, RouterCore,
        ScorerChoice, TrustSettings,
    },
};
use kvroute_core::{
    admission::bookings::SavedBooking,
    registry::Registration,
    select::{Selection, TierSavings},
    types::{KvEventsMode, RankLoad, Tier, TierSpec, WorkerRole},
};

use super::{
    engine::{EngineKvEvent, EngineLoad},
    event_link::{EventLink, LinkImpairment},
    policy::Router,
    types::{FleetView, SimRequest, worker_rank},
};

const MODEL: &str = "sim";

/// Scoring knobs of one `kvroute` run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvRouteKnobs {
    pub overlap_weight: f64,
    pub overlap_credit: f64,
    pub temperature: f64,
    pub seed: u64,
    pub scorer: ScorerChoice,
    /// The first this many engines register APPROXIMATE: their events
    /// never reach the router, which predicts their caches instead.
    pub approximate_workers: usize,
    /// Loss and delay on the other engines' events (`event_link`).
    pub impairment: LinkImpairment,
    /// Trust per worker (`router::trust`) on.
    pub trust: bool,
    /// What a block in each tier saves. [`TierSavings::DEVICE_ONLY`] is
    /// routing before tiers: the engines' host tiers are not declared and
    /// their host events never reach the router (they were dropped as an
    /// unknown medium).
    pub tier_savings: TierSavings,
}

/// Dynamo's router weighs host hits at 0.75 and disk hits at 0.25 of a
/// device hit: the replay's reference row for tier-aware scoring.
pub const DYNAMO_TIER_WEIGHTS: TierSavings = TierSavings([1.0, 0.75, 0.25, 0.25]);

impl Default for KvRouteKnobs {
    fn default() -> Self {
        Self {
            overlap_weight: DEFAULT_OVERLAP_WEIGHT,
            overlap_credit: DEFAULT_OVERLAP_CREDIT,
            temperature: 0.0,
            seed: 42,
            scorer: ScorerChoice::Cost,
            approximate_workers: 0,
            impairment: LinkImpairment::default(),
            trust: true,
            tier_savings: TierSavings::DEFAULT,
        }
    }
}

/// kvroute's router core behind the simulator's [`Router`] seam.
pub struct KvRoutePolicy {
    core: Arc<RouterCore>,
    /// The index's writer, called directly (no thread, no channel).
    writer: EventWriter,
    knobs: KvRouteKnobs,
    registered: bool,
    next_event_id: Vec<u64>,
    /// TTFT predicted per request awaiting its first token, and when it
    /// was routed (the TTFT policy only).
    predicted: std::collections::HashMap<u64, (f64, f64)>,
    /// `(predicted, actual)` TTFT of requests whose first token came.
    measured: Vec<(f64, f64)>,
    /// Cached prompt tokens each routed request was predicted to find.
    predicted_cached: std::collections::HashMap<u64, u64>,
    /// `(predicted, engine)` cached tokens of requests whose prefill ended.
    cached_measured: Vec<(f64, f64)>,
    /// Events on their way to the router (made at first use, after
    /// registration has told the fleet's size).
    link: Option<EventLink>,
    /// Routing or ingest failures (none are expected; counted, not hidden).
    /// Stores of a lossy engine rejected past a lost event are expected,
    /// and not counted.
    pub errors: u64,
}

impl KvRoutePolicy {
    /// One router.
    pub fn new(knobs: KvRouteKnobs) -> Result<Self, prometheus::Error> {
        Self::replica(knobs, ReplicaSettings::default())
    }

    /// One of several router replicas (`super::replicas`), told what the
    /// service's cluster mode tells its core.
    pub(crate) fn replica(
        knobs: KvRouteKnobs,
        replicas: ReplicaSettings,
    ) -> Result<Self, prometheus::Error> {
        let config = RouterConfig {
            overlap_weight: knobs.overlap_weight,
            overlap_credit: knobs.overlap_credit,
            temperature: knobs.temperature,
            seed: knobs.seed.max(1),
            replicas,
            scorer: knobs.scorer,
            trust: TrustSettings {
                enabled: knobs.trust,
                ..TrustSettings::default()
            },
            tier_savings: knobs.tier_savings,
            ..RouterConfig::default()
        };
        let metrics = kvroute::metrics::Metrics::new()?;
        let core = Arc::new(RouterCore::with_manual_clock(config, metrics));
        Ok(Self {
            writer: EventWriter::new(core.clone()),
            core,
            knobs,
            registered: false,
            next_event_id: Vec::new(),
            predicted: Default::default(),
            measured: Vec::new(),
            predicted_cached: Default::default(),
            cached_measured: Vec::new(),
            link: None,
            errors: 0,
        })
    }

    fn register(&mut self, fleet: &FleetView) {
        for (engine, load) in fleet.engines.iter().enumerate() {
            let registration = Registration {
                tiers: self.declared_tiers(load),
                worker_id: worker_rank(engine).worker_id,
                model: MODEL.into(),
                role: WorkerRole::Aggregated,
                endpoint: format!("sim://engine/{engine}"),
                block_size: fleet.block_size as u32,
                dp_start_rank: 0,
                dp_size: 1,
                total_kv_blocks: load.total_blocks as u64,
                max_num_batched_tokens: fleet.max_num_batched_tokens as u64,
                taints: Vec::new(),
                adapters: Vec::new(),
                loads_adapters: false,
                // The longest a worker may ask for; the replay never
                // reaps leases, so they do not lapse in virtual time.
                lease_ttl: Some(kvroute_core::registry::MAX_LEASE_TTL),
                kv_events: if engine < self.knobs.approximate_workers {
                    KvEventsMode::Approximate
                } else {
                    KvEventsMode::Exact
                },
            };
            match self.core.register_worker(registration) {
                // as the service does at registration: size the index
                // tables for the engine's KV capacity
                Ok(outcome) => self.writer.reserve(&outcome.record.snapshot()),
                Err(_) => self.errors += 1,
            }
        }
        self.next_event_id = vec![0; fleet.len()];
        self.registered = true;
    }

    /// Whether the router sees the engines' lower tiers at all.
    fn sees_tiers(&self) -> bool {
        self.knobs.tier_savings != TierSavings::DEVICE_ONLY
    }

    /// The tiers an engine declares: its host tier, sized as the engine's
    /// (saving: the router's), unless the router is device-only.
    fn declared_tiers(&self, load: &EngineLoad) -> Vec<TierSpec> {
        if load.host_blocks == 0 || !self.sees_tiers() {
            return Vec::new();
        }
        vec![TierSpec {
            tier: Tier::Host,
            capacity_blocks: load.host_blocks as u64,
            prefill_saving: None,
        }]
    }

    /// Registers the fleet's engines unless done already. The first
    /// `route` does it; a router replica that has not routed yet needs it
    /// before the engines' KV events reach it.
    pub(super) fn ensure_registered(&mut self, fleet: &FleetView) {
        if !self.registered {
            self.register(fleet);
        }
    }

    /// What this router has booked for `request_id`, as another replica
    /// would receive it.
    pub(super) fn booking(&self, request_id: u64) -> Option<SavedBooking> {
        self.core.saved_booking(&request_id.to_string())
    }

    /// Books load another router replica booked (its prefill completion
    /// and release come through `on_prefill_complete` and
    /// `on_request_complete`, as this router's own do).
    pub(super) fn book_for_peer(&mut self, booking: SavedBooking, now_ms: f64) {
        self.set_clock(now_ms);
        let refused = self.core.restore_routing(Vec::new(), vec![booking]);
        self.errors += refused as u64;
    }

    /// Moves the core's routing clock to the replay's virtual time.
    fn link_mut(&mut self) -> &mut EventLink {
        let engines = self.next_event_id.len();
        let (impairment, seed) = (self.knobs.impairment, self.knobs.seed);
        self.link
            .get_or_insert_with(|| EventLink::new(impairment, engines, seed))
    }

    /// Moves the routing clock to `now_ms` and applies every batch the
    /// link has delivered by then, through the service's validation and
    /// index writer.
    fn deliver_events(&mut self, now_ms: f64) {
        self.set_clock(now_ms);
        while let Some((engine, events)) = self.link_mut().arrive(now_ms) {
            let lossy = self.link_mut().is_lossy(engine);
            let batch = pb::KvEventBatch {
                worker_id: worker_rank(engine).worker_id,
                dp_rank: 0,
                events,
            };
            let limits = BatchLimits {
                max_events: usize::MAX,
                max_blocks_per_event: usize::MAX,
            };
            let validated = self
                .core
                .event_target(batch.worker_id, 0)
                .ok()
                .and_then(|target| convert::batch_from_pb(batch, &target, limits).ok());
            match validated.map(|batch| self.writer.apply_batch(batch)) {
                Some(Ok(_)) if lossy => {}
                Some(Ok(outcome)) => self.errors += u64::from(outcome.rejected),
                _ => self.errors += 1,
            }
        }
    }

    fn set_clock(&self, now_ms: f64) {
        // virtual time is finite and non-negative; `as` floors it
        self.core.set_clock_ms(now_ms.max(0.0) as u64);
    }

    fn report_load(&mut self, fleet: &FleetView) {
        for (engine, load) in fleet.engines.iter().enumerate() {
            let rank_load = RankLoad {
                running_requests: load.running as u32,
                waiting_requests: load.waiting as u32,
                kv_blocks_used: load.active_blocks as u64,
            };
            if self
                .core
                .heartbeat(worker_rank(engine).worker_id, &[(0, rank_load)])
                .is_err()
            {
                self.errors += 1;
            }
        }
    }

    /// Routes through the service's conversion and routing code; the error is
    /// either stage's message (the simulator only logs and counts it).
    fn select(&self, request: &SimRequest, block_size: u32) -> Result<Selection, String> {
        let request = pb::SelectWorkerRequest {
            request_id: request.id.to_string(),
            model: MODEL.into(),
            prompt: Some(pb::Prompt {
                content: Some(pb::prompt::Content::TokenIds(pb::TokenIds {
                    ids: request.tokens.clone(),
                })),
            }),
            ..Default::default()
        };
        let max_blocks = self.core.config().limits.max_blocks_per_event as usize;
        let prepared = convert::select_request_from_pb(request, block_size, max_blocks)
            .map_err(|e| e.to_string())?;
        let outcome = self
            .core
            .route_unqueued(prepared)
            .map_err(|e| e.to_string())?;
        Ok(outcome.selection)
    }
}

/// One simulated engine event as PublishEvents carries it.
fn engine_event_to_pb(event_id: u64, event: &EngineKvEvent) -> pb::KvEvent {
    let kind = match event {
        EngineKvEvent::Stored {
            tier,
            parent,
            blocks,
        } => pb::kv_event::Kind::Stored(pb::BlocksStored {
            tier: pb::CacheTier::from(*tier) as i32,
            parent_engine_hash: *parent,
            blocks: blocks
                .iter()
                .map(|(engine_hash, tokens)| pb::StoredBlock {
                    engine_hash: *engine_hash,
                    content: Some(pb::stored_block::Content::TokenIds(pb::TokenIds {
                        ids: tokens.clone(),
                    })),
                    mm_info: None,
                })
                .collect(),
            lora_name: String::new(),
            cache_namespace: String::new(),
        }),
        EngineKvEvent::Removed {
            tier,
            engine_hashes,
        } => pb::kv_event::Kind::Removed(pb::BlocksRemoved {
            tier: pb::CacheTier::from(*tier) as i32,
            engine_hashes: engine_hashes.clone(),
        }),
    };
    pb::KvEvent {
        event_id,
        kind: Some(kind),
    }
}

impl Router for KvRoutePolicy {
    fn name(&self) -> String {
        let k = self.knobs;
        let base = match k.scorer {
            ScorerChoice::Cost => "kvroute",
            ScorerChoice::Ttft(_) => "kvroute-ttft",
        };
        let mut base = match k.approximate_workers {
            0 => base.to_owned(),
            n => format!("{base}~{n}"),
        };
        let i = k.impairment;
        if i.loss > 0.0 && i.lossy_engines > 0 {
            base.push_str(&format!("-loss{}%x{}", i.loss * 100.0, i.lossy_engines));
        }
        if i.delay_ms > 0.0 {
            base.push_str(&format!("-delay{}ms", i.delay_ms));
        }
        if !k.trust {
            base.push_str("-notrust");
        }
        if k.tier_savings == TierSavings::DEVICE_ONLY {
            base.push_str("-device-only");
        } else if k.tier_savings == DYNAMO_TIER_WEIGHTS {
            base.push_str("-dynamo-tiers");
        } else if k.tier_savings != TierSavings::DEFAULT {
            let [_, host, storage, external] = k.tier_savings.0;
            base.push_str(&format!("-tiers({host},{storage},{external})"));
        }
        if k == (KvRouteKnobs {
            seed: k.seed,
            scorer: k.scorer,
            approximate_workers: k.approximate_workers,
            impairment: k.impairment,
            trust: k.trust,
            tier_savings: k.tier_savings,
            ..KvRouteKnobs::default()
        }) {
            base
        } else {
            format!(
                "{base}(w={},c={},t={})",
                k.overlap_weight, k.overlap_credit, k.temperature
            )
        }
    }

    fn route(&mut self, request: &SimRequest, now_ms: f64, fleet: &FleetView) -> usize {
        self.ensure_registered(fleet);
        self.deliver_events(now_ms);
        self.core.evaluate_trust();
        self.report_load(fleet);
        match self.select(request, fleet.block_size as u32) {
            Ok(selection) => {
                self.predicted_cached
                    .insert(request.id, selection.cached_tokens);
                if let Some(parts) = selection.chosen_ttft() {
                    self.predicted
                        .insert(request.id, (parts.total_ms(), now_ms));
                }
                usize::try_from(selection.target.worker_id)
                    .ok()
                    .filter(|engine| *engine < fleet.len())
                    .unwrap_or(0)
            }
            Err(error) => {
                tracing::warn!(%error, "kvroute policy could not route; engine 0");
                self.errors += 1;
                0
            }
        }
    }

    fn on_kv_events(&mut self, engine: usize, events: &[EngineKvEvent], now_ms: f64) {
        if engine < self.knobs.approximate_workers {
            return; // an engine without KV events
        }
        let sees_tiers = self.sees_tiers();
        let Some(next_id) = self.next_event_id.get_mut(engine) else {
            self.errors += 1;
            return;
        };
        let events = events
            .iter()
            .filter(|event| sees_tiers || event.tier() == Tier::Device)
            .map(|event| {
                let event_id = *next_id;
                *next_id += 1;
                engine_event_to_pb(event_id, event)
            })
            .collect();
        self.link_mut().send(engine, events, now_ms);
        self.deliver_events(now_ms);
    }

    fn on_prefill_complete(&mut self, request_id: u64, now_ms: f64, cached_tokens: u64) {
        if let Some((predicted, routed_at)) = self.predicted.remove(&request_id) {
            self.measured.push((predicted, now_ms - routed_at));
        }
        if let Some(predicted) = self.predicted_cached.remove(&request_id) {
            self.cached_measured
                .push((predicted as f64, cached_tokens as f64));
        }
        self.deliver_events(now_ms);
        // As a frontend passes back the engine's usage.cached_tokens.
        let request_id = request_id.to_string();
        self.core.report_cached_tokens(&request_id, cached_tokens);
        self.core.mark_prefill_complete(&request_id);
    }

    fn ttft_predictions(&self) -> Vec<(f64, f64)> {
        self.measured.clone()
    }

    fn cached_token_predictions(&self) -> Vec<(f64, f64)> {
        self.cached_measured.clone()
    }

    fn on_request_complete(&mut self, request_id: u64, now_ms: f64) {
        self.predicted.remove(&request_id);
        self.predicted_cached.remove(&request_id);
        self.deliver_events(now_ms);
        self.core.release_request(&request_id.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::engine::EngineLoad;

    fn engine(total_blocks: usize) -> EngineLoad {
        EngineLoad {
            total_blocks,
            ..EngineLoad::default()
        }
    }

    /// Each engine's first stored block, as its KV events bring it.
    fn first_store(policy: &mut KvRoutePolicy, engines: usize) {
        for engine in 0..engines {
            let stored = EngineKvEvent::Stored {
                tier: Tier::Device,
                parent: None,
                blocks: vec![(engine as u64 + 1, vec![7; 16])],
            };
            policy.on_kv_events(engine, &[stored], 0.0);
        }
    }

    #[test]
    fn registering_the_fleet_sizes_the_index_for_each_engine() -> Result<(), String> {
        let mut policy = KvRoutePolicy::new(KvRouteKnobs::default()).map_err(|e| e.to_string())?;
        let bytes = |p: &KvRoutePolicy| p.core.index_of(MODEL).map(|i| i.stats().bytes_used);
        let small = [engine(1_000), engine(1_000)];
        let fleet = |engines| FleetView {
            engines,
            block_size: 16,
            max_num_batched_tokens: 8192,
        };
        policy.register(&fleet(&small));
        // The tables are sized at each engine's first block, not before.
        first_store(&mut policy, small.len());
        let after_small = bytes(&policy).ok_or("no index for the sim model")?;
        // tables sized for 2 x 1,000 blocks: at least 8 bytes per block
        assert!(after_small >= 16_000, "{after_small} bytes");
        let mut bigger = KvRoutePolicy::new(KvRouteKnobs::default()).map_err(|e| e.to_string())?;
        bigger.register(&fleet(&[engine(100_000), engine(100_000)]));
        first_store(&mut bigger, 2);
        let after_big = bytes(&bigger).ok_or("no index for the sim model")?;
        assert!(
            after_big >= 1_600_000 && after_big > 10 * after_small,
            "{after_big} bytes for 2 x 100,000 blocks against {after_small} for 2 x 1,000"
        );
        assert_eq!(policy.errors, 0);
        Ok(())
    }
}
