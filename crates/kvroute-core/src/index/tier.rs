//! Cache tiers: where in an engine a cached block lives.
//!
//! Why this exists: engines keep reusable KV blocks beyond GPU memory (vLLM's
//! offloading connector, SGLang's HiCache, LMCache), and say so per event.
//! A block loaded from host memory costs a fraction of computing it again, so
//! the index records, per (worker, dp_rank, block), every tier that holds
//! it. Each tier of a target is its own holder in the index ([`Holder`]):
//! device-only traffic keeps the layout and cost it always had.

use crate::index::KvEvent;
use crate::types::WorkerRank;
pub use crate::types::{TIERS, Tier, TierBlocks};

/// One holder in the index: one tier of one target.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Holder {
    pub target: WorkerRank,
    pub tier: Tier,
}

impl Holder {
    pub const fn new(target: WorkerRank, tier: Tier) -> Self {
        Self { target, tier }
    }

    /// A target's device tier.
    pub const fn device(target: WorkerRank) -> Self {
        Self::new(target, Tier::Device)
    }
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.tier {
            Tier::Device => write!(f, "{}", self.target),
            tier => write!(f, "{} ({tier} tier)", self.target),
        }
    }
}

/// An index event for one tier of a target: what every ingest path (gRPC
/// events, engine events, the cluster log) carries to the index's writer.
/// Applied with [`crate::index::KvIndex::apply_tiered`], a `Cleared` drops
/// every tier of the target, whatever `tier` says: engines clear their whole
/// cache (vLLM's and SGLang's `AllBlocksCleared` name no medium), never one
/// tier alone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TieredEvent {
    pub tier: Tier,
    pub event: KvEvent,
}

impl TieredEvent {
    pub const fn new(tier: Tier, event: KvEvent) -> Self {
        Self { tier, event }
    }

    /// An event of the device tier.
    pub const fn device(event: KvEvent) -> Self {
        Self::new(Tier::Device, event)
    }
}

/// A target alone names its device tier.
impl From<WorkerRank> for Holder {
    fn from(target: WorkerRank) -> Self {
        Holder::device(target)
    }
}
