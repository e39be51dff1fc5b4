//! Cache tiers: where in an engine a cached block lives.
//!
//! Why this exists: engines keep reusable KV blocks beyond GPU memory (vLLM's
//! offloading connector, SGLang's HiCache, LMCache), and say so per event.
//! A block loaded from host memory costs a fraction of computing it again, so
//! the index records, per (worker, dp_rank, block), every tier that holds
//! it. Each tier of a target is its own holder in the index ([`Holder`]):
//! device-only traffic keeps the layout and cost it always had.

use crate::types::WorkerRank;

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

/// A target alone names its device tier.
impl From<WorkerRank> for Holder {
    fn from(target: WorkerRank) -> Self {
        Holder::device(target)
    }
}
