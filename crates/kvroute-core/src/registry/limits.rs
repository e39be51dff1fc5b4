//! Server-side bounds on what registrations may claim.
//!
//! Why this exists: a registration is untrusted input, and what it
//! declares (a capacity, dp ranks, a new model) decides how much memory
//! the index may come to take. These bounds are the operator's, not the
//! caller's: past one, the registration is refused with
//! RESOURCE_EXHAUSTED naming the limit, and nothing is reserved.
//!
//! The memory budget is kept by declared capacity: each dp rank may hold
//! at most its `total_kv_blocks` in the index (stores beyond it are
//! rejected, see `IndexError::OverCapacity`) and at most each declared
//! lower tier's capacity there (past it, the least recently stored go), so the sum of every rank's
//! capacity times [`INDEX_BYTES_PER_BLOCK`] bounds what the index can
//! take. A worker that declares no capacity is counted, and held to,
//! `default_kv_blocks_per_rank`. Capacity given back by a deregistration,
//! a lapse or a smaller re-registration is free for others at once.

/// Index memory one cached block of one dp rank may take, for the budget:
/// above the measured worst case (about 83 bytes for blocks no other rank
/// shares; shared blocks cost a fraction of that).
pub const INDEX_BYTES_PER_BLOCK: u64 = 96;

/// What registrations may claim in all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegistryLimits {
    /// Workers registered at once.
    pub max_workers: usize,
    /// Models with a registered worker at once.
    pub max_models: usize,
    /// dp ranks one worker may declare.
    pub max_ranks_per_worker: u32,
    /// Largest `total_kv_blocks` one dp rank may declare.
    pub max_kv_blocks_per_rank: u64,
    /// The capacity of a rank whose worker declares none (0).
    pub default_kv_blocks_per_rank: u64,
    /// Largest capacity one dp rank may declare for a tier below the device
    /// (host memory is often many times the device's).
    pub max_tier_blocks_per_rank: u64,
    /// Index memory all ranks' capacities may come to, in bytes.
    pub index_memory_budget: u64,
}

impl Default for RegistryLimits {
    fn default() -> Self {
        Self {
            max_workers: 4096,
            max_models: 256,
            max_ranks_per_worker: 256,
            max_kv_blocks_per_rank: 1 << 22,
            default_kv_blocks_per_rank: 1 << 18,
            max_tier_blocks_per_rank: 1 << 24,
            index_memory_budget: 16 << 30,
        }
    }
}

impl RegistryLimits {
    /// The capacity a rank is held to: what its worker declared, or the
    /// default when it declared none.
    pub fn rank_capacity(&self, declared: u64) -> u64 {
        if declared == 0 {
            self.default_kv_blocks_per_rank
        } else {
            declared
        }
    }

    /// Blocks every rank's capacity may add up to under the budget.
    pub(crate) fn budget_blocks(&self) -> u64 {
        self.index_memory_budget / INDEX_BYTES_PER_BLOCK
    }
}
