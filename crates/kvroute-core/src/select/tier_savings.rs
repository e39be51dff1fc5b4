//! What a cached block saves, by the tier that holds it.
//!
//! Why this exists: a block in host memory or on storage is not free to use.
//! The engine loads it, at a fraction of what computing it again costs, so a
//! candidate holding a prompt's prefix in host memory is worth less than one
//! holding it on the device and much more than one holding nothing. Each tier
//! saves a fraction of a block's prefill: 1 for the device, less for each
//! tier below it. Selection turns a candidate's overlap, split by tier, into
//! *effective* blocks (the sum of each tier's blocks times its saving) and
//! books only the prefill that remains.
//!
//! The router sets the fractions for every worker; a worker may declare its
//! own (a mixed fleet, where one machine's storage is faster than
//! another's). Defaults come from the replay (`docs/TIERS.md`).

use crate::types::{TIERS, Tier, TierBlocks};

/// The fraction of a block's prefill each tier saves, by [`Tier::index`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TierSavings(pub [f64; TIERS]);

impl Default for TierSavings {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl TierSavings {
    /// The router's defaults: device 1; host 0.7, storage 0.3 and external
    /// 0.2, chosen from the replay's sweeps (docs/TIERS.md#choosing-the-defaults):
    /// the best saving follows what loading a block really saves, 0.7 for
    /// host memory over PCIe, less for tiers several times slower.
    pub const DEFAULT: TierSavings = TierSavings([1.0, 0.7, 0.3, 0.2]);

    /// Device hits only (what routing did before tiers).
    pub const DEVICE_ONLY: TierSavings = TierSavings([1.0, 0.0, 0.0, 0.0]);

    pub fn get(&self, tier: Tier) -> f64 {
        self.0[tier.index()]
    }

    /// Sets one tier's saving (the device's is always 1).
    pub fn with(mut self, tier: Tier, saving: f64) -> Self {
        if tier != Tier::Device {
            self.0[tier.index()] = saving;
        }
        self
    }

    /// Every saving is in `[0, 1]` and the device's is 1. A lower tier may
    /// save more than a faster one (a fast shared pool can beat a slow local
    /// disk), so only the range is checked.
    pub fn validate(&self) -> Result<(), String> {
        for tier in Tier::ALL {
            let saving = self.get(tier);
            if !(saving.is_finite() && (0.0..=1.0).contains(&saving)) {
                return Err(format!(
                    "the {tier} tier's prefill saving must be in [0, 1], got {saving}"
                ));
            }
        }
        if self.get(Tier::Device) != 1.0 {
            return Err("the device tier's saving is always 1".into());
        }
        Ok(())
    }

    /// The blocks' worth in device blocks: each tier's blocks times its
    /// saving. Exactly `blocks.total()` when every block is on the device.
    pub fn effective_blocks(&self, blocks: &TierBlocks) -> f64 {
        if blocks.lower() == 0 {
            return f64::from(blocks.total());
        }
        Tier::ALL
            .iter()
            .map(|&t| f64::from(blocks.get(t)) * self.get(t))
            .sum()
    }

    /// Parses `host=0.9,storage=0.5` onto `self` (the device cannot be
    /// set). Used by the command line and the pool file.
    pub fn parse_onto(mut self, text: &str) -> Result<TierSavings, String> {
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, value) = part
                .split_once('=')
                .ok_or_else(|| format!("{part:?} is not tier=fraction"))?;
            let tier = Tier::from_name(name.trim())
                .filter(|t| *t != Tier::Device)
                .ok_or_else(|| {
                    format!("{name:?} is not a tier below the device (host, storage, external)")
                })?;
            let saving: f64 = value
                .trim()
                .parse()
                .map_err(|_| format!("{value:?} is not a number"))?;
            self = self.with(tier, saving);
        }
        self.validate()?;
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_only_blocks_are_worth_themselves() {
        let s = TierSavings::DEFAULT;
        assert_eq!(s.effective_blocks(&TierBlocks::device(7)), 7.0);
        let mixed = TierBlocks([2, 4, 0, 0]);
        assert!((s.effective_blocks(&mixed) - (2.0 + 4.0 * s.get(Tier::Host))).abs() < 1e-12);
        assert_eq!(TierSavings::DEVICE_ONLY.effective_blocks(&mixed), 2.0);
    }

    #[test]
    fn parse_sets_lower_tiers_and_refuses_the_rest() {
        let s = TierSavings::DEFAULT
            .parse_onto("host=0.5, external=0")
            .unwrap_or(TierSavings::DEVICE_ONLY);
        assert_eq!(
            s.0,
            [1.0, 0.5, TierSavings::DEFAULT.get(Tier::Storage), 0.0]
        );
        for bad in [
            "device=0.5",
            "host",
            "host=x",
            "host=1.5",
            "host=-0.1",
            "disk=1",
            "host=NaN",
        ] {
            assert!(TierSavings::DEFAULT.parse_onto(bad).is_err(), "{bad}");
        }
    }
}
