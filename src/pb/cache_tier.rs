//! The wire form of cache tiers and of a worker's declared tiers, which
//! events, registrations, the Admin API and snapshots all carry alike.

use kvroute_core::index::Tier;
use kvroute_core::types::TierSpec;

use kvroute_core::types::{TIERS, TierBlocks};

use super::{BlocksByTier, CacheTier, CacheTierSpec};

impl BlocksByTier {
    /// Counts by [`Tier::index`].
    pub fn from_counts(counts: [u64; TIERS]) -> Self {
        let [device, host, storage, external] = counts;
        Self {
            device,
            host,
            storage,
            external,
        }
    }
}

impl From<TierBlocks> for BlocksByTier {
    fn from(blocks: TierBlocks) -> Self {
        Self::from_counts(blocks.0.map(u64::from))
    }
}

impl From<Tier> for CacheTier {
    fn from(tier: Tier) -> Self {
        match tier {
            Tier::Device => CacheTier::Device,
            Tier::Host => CacheTier::Host,
            Tier::Storage => CacheTier::Storage,
            Tier::External => CacheTier::External,
        }
    }
}

impl From<CacheTier> for Tier {
    /// Unset is the device.
    fn from(tier: CacheTier) -> Self {
        match tier {
            CacheTier::Unspecified | CacheTier::Device => Tier::Device,
            CacheTier::Host => Tier::Host,
            CacheTier::Storage => Tier::Storage,
            CacheTier::External => Tier::External,
        }
    }
}

/// The tier of a raw enum field; `None` for a value no version of the API
/// defines (the caller refuses it rather than guess).
pub fn tier_of(raw: i32) -> Option<Tier> {
    CacheTier::try_from(raw).ok().map(Tier::from)
}

impl From<&TierSpec> for CacheTierSpec {
    fn from(spec: &TierSpec) -> Self {
        Self {
            tier: CacheTier::from(spec.tier) as i32,
            capacity_blocks: spec.capacity_blocks,
            prefill_saving: spec.prefill_saving,
        }
    }
}

/// A declared tier from the wire; an error names what is wrong (the
/// registry checks the rest: duplicates, the device, the saving's range).
pub fn tier_spec(spec: &CacheTierSpec) -> Result<TierSpec, String> {
    let tier = tier_of(spec.tier).ok_or_else(|| format!("unknown cache tier {}", spec.tier))?;
    Ok(TierSpec {
        tier,
        capacity_blocks: spec.capacity_blocks,
        prefill_saving: spec.prefill_saving,
    })
}
