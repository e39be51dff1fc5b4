//! Identifiers shared by every area of the router.
//!
//! A routing target is a `(worker_id, dp_rank)` pair; cache state and booked
//! load are kept per pair. Local hashes are kvroute's own hashes of one
//! block's tokens (see `hashing`); engine hashes are the engine's opaque ids
//! of a block, used only to link parents and removals in events.

/// One inference engine instance.
pub type WorkerId = u64;
/// A data-parallel rank inside a worker.
pub type DpRank = u32;
/// kvroute's hash of one block's tokens (`hashing::compute_block_hashes`).
pub type LocalHash = u64;
/// The engine's own id of a block: opaque, never used for matching.
pub type EngineHash = u64;

/// A map keyed by routing target, with a fast non-cryptographic hasher (keys
/// are server-side ids, and these maps are rebuilt on every routing call).
pub type RankMap<V> = std::collections::HashMap<WorkerRank, V, rustc_hash::FxBuildHasher>;

/// A map keyed by prompt chain keys (a block and its whole prefix, hashed),
/// touched once per block on every booking and prediction. Callers choose
/// the blocks they send, so the hasher is seeded per process (foldhash):
/// crafted keys cannot pile into one bucket, as they could under Fx; and it
/// costs a fraction of std's SipHash on a `u64`.
pub type ChainMap<V> = std::collections::HashMap<u64, V, foldhash::fast::RandomState>;

/// A routing target: one data-parallel rank of one worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerRank {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
}

impl WorkerRank {
    pub const fn new(worker_id: WorkerId, dp_rank: DpRank) -> Self {
        Self { worker_id, dp_rank }
    }
}

impl std::fmt::Display for WorkerRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "worker {} dp_rank {}", self.worker_id, self.dp_rank)
    }
}

/// What a worker serves in disaggregated serving. A PREFILL-phase request is
/// routed among prefill workers, a DECODE-phase one among decode workers;
/// aggregated workers serve every phase.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum WorkerRole {
    #[default]
    Aggregated,
    Prefill,
    Decode,
}

/// The phase of the request being routed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum RequestPhase {
    #[default]
    Aggregated,
    Prefill,
    Decode,
}

impl WorkerRole {
    /// Whether a worker of this role may serve a request in `phase`.
    pub(crate) fn serves(self, phase: RequestPhase) -> bool {
        matches!(
            (self, phase),
            (WorkerRole::Aggregated, _)
                | (WorkerRole::Prefill, RequestPhase::Prefill)
                | (WorkerRole::Decode, RequestPhase::Decode)
        )
    }
}

/// Whether a worker reports its KV cache through events, which decides
/// what its overlap is read from (`crate::predict`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvEventsMode {
    /// It publishes events: scored on the exact index.
    #[default]
    Exact,
    /// It publishes none: scored on what kvroute predicts from its own
    /// routing.
    Approximate,
    /// Predicted until its first event arrives, exact from then on.
    Auto,
}

/// Which view of a target's cache a decision read, and why.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CacheView {
    /// The exact index, fed by the worker's events.
    #[default]
    Exact,
    /// The predicted cache (`crate::predict`).
    Predicted(PredictedBecause),
    /// An exact worker whose event stream is not trusted now: the larger
    /// of the exact index's overlap (right up to the trouble) and the
    /// predicted cache's (what was routed there since).
    Blended(Distrust),
}

/// Why an exact worker's events are not trusted now (`router::trust`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Distrust {
    /// A gap in its event stream stayed unhealed past the deadline.
    GapUnhealed,
    /// Its engine subscription stayed disconnected past the deadline.
    SubscriptionDown,
    /// The cached tokens its engine reports contradict its index
    /// (`router::feedback`).
    Contradicted,
    /// A prefill that computed new blocks completed there and no event
    /// has come from it since, past the deadline.
    EventsBehind,
}

impl Distrust {
    pub fn label(self) -> &'static str {
        match self {
            Distrust::GapUnhealed => "gap_unhealed",
            Distrust::SubscriptionDown => "subscription_down",
            Distrust::Contradicted => "cached_tokens_contradict",
            Distrust::EventsBehind => "events_behind",
        }
    }
}

/// Why a target is scored on its predicted cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PredictedBecause {
    /// It registered APPROXIMATE.
    Approximate,
    /// It registered AUTO and no event of it has arrived yet.
    NoEventsYet,
}

impl CacheView {
    /// Whether bookings predict for it (every view but the exact one).
    pub fn reads_predictions(self) -> bool {
        !matches!(self, CacheView::Exact)
    }

    /// Every view's [`Self::label`].
    pub const LABELS: [&'static str; 3] = ["exact", "predicted", "blended"];

    /// The view's name without its reason (a metric label).
    pub fn label(self) -> &'static str {
        match self {
            CacheView::Exact => Self::LABELS[0],
            CacheView::Predicted(_) => Self::LABELS[1],
            CacheView::Blended(_) => Self::LABELS[2],
        }
    }

    /// A short name and reason, for operators.
    pub fn describe(self) -> &'static str {
        match self {
            CacheView::Exact => "exact",
            CacheView::Predicted(PredictedBecause::Approximate) => {
                "predicted: registered approximate"
            }
            CacheView::Predicted(PredictedBecause::NoEventsYet) => "predicted: auto, no events yet",
            CacheView::Blended(Distrust::GapUnhealed) => {
                "blended: events untrusted, a gap stayed unhealed past the deadline"
            }
            CacheView::Blended(Distrust::SubscriptionDown) => {
                "blended: events untrusted, the subscription stayed down past the deadline"
            }
            CacheView::Blended(Distrust::Contradicted) => {
                "blended: events untrusted, the engine's reported cached tokens contradict them"
            }
            CacheView::Blended(Distrust::EventsBehind) => {
                "blended: events untrusted, none came for a prefill it completed, past the deadline"
            }
        }
    }
}

/// Load a worker reports for one dp rank in its heartbeat.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankLoad {
    pub running_requests: u32,
    pub waiting_requests: u32,
    pub kv_blocks_used: u64,
}

/// A read-only view of one registered worker: what selection needs to know.
/// A cache tier below the device that a worker declares: how many blocks
/// each of its dp ranks keeps there, and optionally what a block there
/// saves of its prefill (else the router's setting for the tier).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TierSpec {
    pub tier: Tier,
    pub capacity_blocks: u64,
    pub prefill_saving: Option<f64>,
}

/// The registry produces these; selection consumes them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WorkerSnapshot {
    pub worker_id: WorkerId,
    pub model: String,
    /// Where the engine serves, as registered (the endpoint picker routes
    /// HTTP requests there; informational otherwise).
    pub endpoint: String,
    pub role: WorkerRole,
    pub block_size: u32,
    pub dp_start_rank: DpRank,
    pub dp_size: u32,
    pub total_kv_blocks: u64,
    pub max_num_batched_tokens: u64,
    /// Taints a request must tolerate to be routed here.
    pub taints: Vec<String>,
    /// Names of the LoRA adapters it serves; empty: not declared (serves
    /// a request for any adapter).
    pub adapters: Vec<String>,
    /// It loads an adapter it does not serve on request (vLLM's runtime
    /// LoRA loading): such a request may go there, paying the load.
    pub loads_adapters: bool,
    pub cordoned: bool,
    /// Whether its overlap comes from events or from predictions.
    pub kv_events: KvEventsMode,
    /// Its cache tiers below the device, as declared (none: only the
    /// device's blocks are indexed).
    pub tiers: Vec<TierSpec>,
    /// Reported load per dp rank (ranks that never reported are absent).
    pub load: Vec<(DpRank, RankLoad)>,
}

impl WorkerSnapshot {
    /// Every dp rank of this worker, in order.
    pub fn ranks(&self) -> impl Iterator<Item = DpRank> + '_ {
        (0..self.dp_size).map(move |i| self.dp_start_rank + i)
    }

    /// The worker's only dp rank, if it has exactly one.
    pub fn unique_dp_rank(&self) -> Option<DpRank> {
        (self.dp_size == 1).then_some(self.dp_start_rank)
    }

    pub(crate) fn has_rank(&self, dp_rank: DpRank) -> bool {
        dp_rank >= self.dp_start_rank && dp_rank - self.dp_start_rank < self.dp_size
    }

    pub fn rank_load(&self, dp_rank: DpRank) -> RankLoad {
        self.load
            .iter()
            .find(|(r, _)| *r == dp_rank)
            .map(|(_, l)| *l)
            .unwrap_or_default()
    }
}

/// Load the router has booked on one worker rank and not yet seen finish
/// (kept by `admission::bookings`, read by selection).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct BookedLoad {
    pub prefill_tokens: u64,
    pub prefill_blocks: u64,
    pub decode_blocks: u64,
    pub active_requests: u64,
}

// ---- cache tiers (the index keeps blocks per tier; selection weighs them)

/// Number of tiers.
pub const TIERS: usize = 4;

/// Where a target holds a block, fastest first.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// The engine's own KV cache (GPU memory); what an event without a
    /// medium names.
    #[default]
    Device = 0,
    /// Host (CPU) memory of the engine's machine.
    Host = 1,
    /// Local storage (disk, a local file system).
    Storage = 2,
    /// A pool shared beyond the machine (remote storage, an object store).
    External = 3,
}

impl Tier {
    pub const ALL: [Tier; TIERS] = [Tier::Device, Tier::Host, Tier::Storage, Tier::External];

    pub const fn index(self) -> usize {
        self as usize
    }

    pub const fn name(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Storage => "storage",
            Tier::External => "external",
        }
    }

    /// The tier a name from [`Self::name`] stands for.
    pub fn from_name(name: &str) -> Option<Tier> {
        Tier::ALL.into_iter().find(|t| t.name() == name)
    }
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Blocks per tier, indexed by [`Tier::index`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct TierBlocks(pub [u32; TIERS]);

impl TierBlocks {
    /// Only device blocks.
    pub const fn device(blocks: u32) -> Self {
        Self([blocks, 0, 0, 0])
    }

    pub fn get(&self, tier: Tier) -> u32 {
        self.0[tier.index()]
    }

    pub fn add(&mut self, tier: Tier, blocks: u32) {
        self.0[tier.index()] += blocks;
    }

    pub fn total(&self) -> u32 {
        self.0.iter().sum()
    }

    /// Blocks outside the device.
    pub fn lower(&self) -> u32 {
        self.total() - self.0[0]
    }
}
