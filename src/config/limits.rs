//! `kvroute serve`'s bounds on what callers may make kvroute hold
//! (`registry::RegistryLimits` enforces the registration ones; the engine
//! ones are enforced by `engine_events`).

use clap::Args;

use kvroute_core::admission::bookings::BookingLimits;
use kvroute_core::registry::RegistryLimits;

/// Server-side limits: what registrations may claim, and what engines'
/// ZeroMQ streams may make kvroute decode and export.
#[derive(Clone, Debug, Args)]
pub struct LimitOptions {
    /// Workers registered at once; more get RESOURCE_EXHAUSTED.
    #[arg(long, env = "KVROUTE_MAX_WORKERS", default_value_t = 4096,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub max_workers: u64,

    /// Models with registered workers at once; a worker of one more gets
    /// RESOURCE_EXHAUSTED.
    #[arg(long, env = "KVROUTE_MAX_MODELS", default_value_t = 256,
          value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub max_models: u64,

    /// dp ranks one worker may declare (at most 1024).
    #[arg(long, env = "KVROUTE_MAX_RANKS_PER_WORKER", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub max_ranks_per_worker: u32,

    /// Largest `total_kv_blocks` (per dp rank) a worker may declare.
    #[arg(long, env = "KVROUTE_MAX_KV_BLOCKS_PER_RANK", default_value_t = 1 << 22,
          value_parser = clap::value_parser!(u64).range(1..=1 << 32))]
    pub max_kv_blocks_per_rank: u64,

    /// The KV capacity (blocks per dp rank) of a worker that declares none,
    /// for the memory budget and the capacity stores are held to.
    #[arg(long, env = "KVROUTE_DEFAULT_KV_BLOCKS_PER_RANK", default_value_t = 1 << 18,
          value_parser = clap::value_parser!(u64).range(1..=1 << 32))]
    pub default_kv_blocks_per_rank: u64,

    /// Largest capacity (blocks per dp rank) a worker may declare for one
    /// cache tier below the device (host memory, storage, an external
    /// pool); each declared tier counts against the memory budget.
    #[arg(long, env = "KVROUTE_MAX_TIER_BLOCKS_PER_RANK", default_value_t = 1 << 24,
          value_parser = clap::value_parser!(u64).range(0..=1 << 34))]
    pub max_tier_blocks_per_rank: u64,

    /// Index memory every registered rank's KV capacity may add up to, in
    /// bytes (suffixes KiB, MiB, GiB), at 96 bytes a block: a registration
    /// past it gets RESOURCE_EXHAUSTED. Size it below the container's
    /// memory limit.
    #[arg(long, env = "KVROUTE_INDEX_MEMORY_BUDGET", default_value = "16GiB",
          value_parser = parse_bytes)]
    pub index_memory_budget: u64,

    /// Memory open RESERVE bookings may hold in all, in bytes (48 bytes a
    /// booked prompt block, 160 a booking): one past it gets
    /// RESOURCE_EXHAUSTED until requests are released or expire.
    #[arg(long, env = "KVROUTE_MAX_BOOKING_MEMORY", default_value = "1GiB",
          value_parser = parse_bytes)]
    pub max_booking_memory: u64,

    /// Memory one authenticated identity's open bookings may hold (with
    /// an auth policy loaded; unauthenticated callers share the total).
    #[arg(long, env = "KVROUTE_MAX_BOOKING_MEMORY_PER_IDENTITY", default_value = "256MiB",
          value_parser = parse_bytes)]
    pub max_booking_memory_per_identity: u64,

    /// Largest ZeroMQ message (all frames) decoded from an engine; larger
    /// ones are dropped and counted.
    #[arg(long, env = "KVROUTE_MAX_ENGINE_MESSAGE_BYTES", default_value = "16MiB",
          value_parser = parse_bytes)]
    pub max_engine_message_bytes: u64,

    /// Engine subscriptions that get per-worker Prometheus series; the
    /// others are counted under `worker="other"`.
    #[arg(long, env = "KVROUTE_MAX_ENGINE_METRIC_WORKERS", default_value_t = 64,
          value_parser = clap::value_parser!(u64).range(0..=100_000))]
    pub max_engine_metric_workers: u64,
}

impl Default for LimitOptions {
    fn default() -> Self {
        let r = RegistryLimits::default();
        Self {
            max_workers: r.max_workers as u64,
            max_models: r.max_models as u64,
            max_ranks_per_worker: r.max_ranks_per_worker,
            max_kv_blocks_per_rank: r.max_kv_blocks_per_rank,
            default_kv_blocks_per_rank: r.default_kv_blocks_per_rank,
            max_tier_blocks_per_rank: r.max_tier_blocks_per_rank,
            index_memory_budget: r.index_memory_budget,
            max_booking_memory: BookingLimits::default().max_bytes,
            max_booking_memory_per_identity: BookingLimits::default().max_bytes_per_owner,
            max_engine_message_bytes: 16 << 20,
            max_engine_metric_workers: 64,
        }
    }
}

impl LimitOptions {
    pub(crate) fn registry_limits(&self) -> RegistryLimits {
        RegistryLimits {
            max_workers: usize::try_from(self.max_workers).unwrap_or(usize::MAX),
            max_models: usize::try_from(self.max_models).unwrap_or(usize::MAX),
            max_ranks_per_worker: self.max_ranks_per_worker,
            max_kv_blocks_per_rank: self.max_kv_blocks_per_rank,
            default_kv_blocks_per_rank: self.default_kv_blocks_per_rank,
            max_tier_blocks_per_rank: self.max_tier_blocks_per_rank,
            index_memory_budget: self.index_memory_budget,
        }
    }
}

impl LimitOptions {
    pub(crate) fn booking_limits(&self) -> BookingLimits {
        BookingLimits {
            max_bytes: self.max_booking_memory,
            max_bytes_per_owner: self.max_booking_memory_per_identity,
        }
    }
}

/// A byte count: digits with an optional `KiB`, `MiB`, `GiB` or `TiB`
/// (also `K`, `M`, `G`, `T`, powers of 1024).
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{text:?}: expected a number of bytes, e.g. 16GiB"))?;
    let shift = match unit.trim() {
        "" | "B" => 0,
        "K" | "KiB" => 10,
        "M" | "MiB" => 20,
        "G" | "GiB" => 30,
        "T" | "TiB" => 40,
        other => {
            return Err(format!(
                "{text:?}: unknown unit {other:?} (KiB, MiB, GiB, TiB)"
            ));
        }
    };
    n.checked_mul(1 << shift)
        .filter(|&b| b > 0)
        .ok_or_else(|| format!("{text:?}: must be between 1 byte and 2^64"))
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn byte_counts_take_binary_units() {
        assert_eq!(parse_bytes("16GiB"), Ok(16 << 30));
        assert_eq!(parse_bytes("512"), Ok(512));
        assert_eq!(parse_bytes("4 MiB"), Ok(4 << 20));
        assert!(parse_bytes("0").is_err());
        assert!(parse_bytes("99999999999TiB").is_err());
        assert!(parse_bytes("1PB").is_err());
        assert!(parse_bytes("").is_err());
    }
}
