//! The router core's own settings, apart from the command line's
//! `ServeConfig`: the core is built by the service, the replay simulator and
//! the benchmarks alike, and only needs what routing, leases and bookings
//! use. `config::ServeConfig::router_config` maps the flags onto it.

use std::time::Duration;

use kvroute_core::admission::bookings::BookingLimits;
use kvroute_core::registry::RegistryLimits;
use kvroute_core::select::{TierSavings, TtftSettings};

pub use super::trust::TrustSettings;

/// Default weight of prefill cost against decode cost. Dynamo's router uses
/// 1.0 (and `--overlap-weight 1 --overlap-credit 0` reproduces its choices);
/// trace replay showed a high weight best for time to first token on both
/// Mooncake traces: prefill is what a request waits for, while booked decode
/// blocks only measure KV occupancy (see docs/ARCHITECTURE.md, "Scoring").
pub const DEFAULT_OVERLAP_WEIGHT: f64 = 64.0;

/// Default credit per cached prompt block (see `overlap_credit`): a quarter
/// of a block's prefill weight, so a worker holding a prefix keeps its
/// conversation unless its prefill queue is clearly longer.
pub const DEFAULT_OVERLAP_CREDIT: f64 = 16.0;

/// Limits of what one request or event batch may carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InputLimits {
    /// Most events in one `KvEventBatch`.
    pub max_events_per_batch: u32,
    /// Most blocks in one stored event, and prompt blocks per request.
    pub max_blocks_per_event: u32,
    /// Largest ZeroMQ message decoded from an engine, in bytes.
    pub max_engine_message_bytes: usize,
}

impl Default for InputLimits {
    fn default() -> Self {
        Self {
            max_events_per_batch: 4096,
            max_blocks_per_event: 16384,
            max_engine_message_bytes: crate::engine_events::DEFAULT_MAX_MESSAGE_BYTES,
        }
    }
}

/// The router replicas this core is one of (cluster mode), for the
/// estimate of the load its peers book meanwhile (`admission::peers`).
///
/// A replica learns of its peers' bookings `sync_delay` late. Until then
/// it counts, for each request it routes, `count - 1` peers' requests as
/// large as it, placed as one router would place them before and after
/// its own (its place is `index`): replicas deciding from the same view
/// then spread a burst as one router does instead of all choosing the same
/// workers. One replica, or no delay, changes nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplicaSettings {
    /// Replicas routing for the same fleet; 1 alone.
    pub count: u32,
    /// This replica's place among them, `0..count`: replicas with distinct
    /// places make distinct choices from the same view.
    pub index: u32,
    /// How late a peer's booking reaches this replica; zero turns the
    /// estimate off.
    pub sync_delay: Duration,
}

impl Default for ReplicaSettings {
    fn default() -> Self {
        Self {
            count: 1,
            index: 0,
            sync_delay: Duration::ZERO,
        }
    }
}

impl ReplicaSettings {
    /// Whether decisions estimate peer load: several replicas, learning of
    /// each other late.
    pub(crate) fn estimates_peers(&self) -> bool {
        self.count > 1 && !self.sync_delay.is_zero()
    }

    /// How long an estimate counts: the sync delay in whole milliseconds
    /// of the routing clock, rounded up; 0 when the estimate is off.
    pub(crate) fn horizon_ms(&self) -> u64 {
        if self.estimates_peers() {
            u64::try_from(self.sync_delay.as_micros().div_ceil(1000)).unwrap_or(u64::MAX)
        } else {
            0
        }
    }
}

/// What the router core is configured with (see `kvroute serve --help` for
/// each setting's meaning; the defaults here are the flags' defaults).
#[derive(Clone, Debug, PartialEq)]
pub struct RouterConfig {
    /// Block size of a model until its first worker registers.
    pub default_block_size: u32,
    /// Lease of a worker that does not ask for one.
    pub lease_ttl: Duration,
    /// Bookings never released expire after this.
    pub booking_ttl: Duration,
    /// What open bookings may hold, in all and per identity.
    pub booking_limits: BookingLimits,
    pub overlap_weight: f64,
    pub overlap_credit: f64,
    /// What a block in each cache tier saves of its prefill.
    pub tier_savings: TierSavings,
    /// Prefill tokens a worker that loads adapters on request is charged
    /// for loading one it does not serve.
    pub adapter_load_tokens: u64,
    pub temperature: f64,
    pub busy_threshold: f64,
    pub kv_busy_fraction: f64,
    /// SelectWorker calls that may wait at once.
    pub queue_capacity: usize,
    /// Session affinity entries expire after this long unused.
    pub session_ttl: Duration,
    /// Seed of tie-breaks and sampling; 0 draws one per process.
    pub seed: u64,
    pub limits: InputLimits,
    /// The replicas this core is one of (cluster mode); one by default.
    pub replicas: ReplicaSettings,
    /// What registrations may claim (workers, models, ranks, capacity).
    pub registry_limits: RegistryLimits,
    /// The scoring policy of SelectWorker.
    pub scorer: ScorerChoice,
    /// How long a predicted cache block lasts untouched (`kvroute_core::predict`);
    /// `None`: only the worker's capacity ages predictions out.
    pub prediction_ttl: Option<Duration>,
    /// When an exact worker's events stop being trusted (`trust.rs`).
    pub trust: TrustSettings,
}

/// The scoring policy SelectWorker uses (`select::scoring`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum ScorerChoice {
    /// Overlap-weighted prefill plus decode blocks ([`kvroute_core::select::CostScorer`]).
    #[default]
    Cost,
    /// Predicted time to first token ([`kvroute_core::select::TtftScorer`]).
    Ttft(TtftSettings),
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            default_block_size: 16,
            lease_ttl: Duration::from_secs(10),
            booking_ttl: Duration::from_secs(300),
            booking_limits: BookingLimits::default(),
            overlap_weight: DEFAULT_OVERLAP_WEIGHT,
            overlap_credit: DEFAULT_OVERLAP_CREDIT,
            tier_savings: TierSavings::DEFAULT,
            adapter_load_tokens: kvroute_core::select::DEFAULT_ADAPTER_LOAD_TOKENS,
            temperature: 0.0,
            busy_threshold: 4.0,
            kv_busy_fraction: 0.98,
            queue_capacity: 1024,
            session_ttl: Duration::from_secs(600),
            seed: 0,
            limits: InputLimits::default(),
            replicas: ReplicaSettings::default(),
            registry_limits: RegistryLimits::default(),
            scorer: ScorerChoice::default(),
            prediction_ttl: None,
            trust: TrustSettings::default(),
        }
    }
}
