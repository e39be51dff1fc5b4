//! Eligibility (may this worker rank serve this request at all?) and
//! busyness (should it take more work right now?).
//!
//! Why it exists: both the scored path and the pinned path must apply the
//! same filters, and explain must say why each candidate was dropped.
//! Invariants:
//! * eligibility is static for a request: model, role vs phase, dp rank
//!   existence, cordon, allowed set, migration exclusions, taints, LoRA
//!   adapter. It never
//!   depends on load, so a transiently overloaded worker is still eligible
//!   (a HARD affinity or explicit pin to it is not refused for being busy);
//! * busyness depends only on booked and reported load and is reported
//!   separately, never as an ineligibility.

use std::collections::HashSet;
use std::fmt;

use crate::types::BookedLoad;
use crate::types::{DpRank, RequestPhase, WorkerId, WorkerRole, WorkerSnapshot};

/// Why a worker rank cannot serve a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ineligible {
    ModelMismatch {
        worker_model: String,
        request_model: String,
    },
    RoleMismatch {
        role: WorkerRole,
        phase: RequestPhase,
    },
    NoSuchRank {
        dp_rank: DpRank,
        dp_start_rank: DpRank,
        dp_size: u32,
    },
    Cordoned,
    NotAllowed,
    MigrationExcluded,
    TaintNotTolerated {
        taint: String,
    },
    /// The worker declares its adapters, not this one, and does not load
    /// adapters on request.
    AdapterNotServed {
        adapter: String,
    },
    /// Eligible in itself, but the request is pinned to another target.
    NotPinned,
}

impl fmt::Display for Ineligible {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ModelMismatch {
                worker_model,
                request_model,
            } => write!(
                f,
                "serves model {worker_model:?}, request is for {request_model:?}"
            ),
            Self::RoleMismatch { role, phase } => {
                write!(f, "role {role:?} does not serve phase {phase:?}")
            }
            Self::NoSuchRank {
                dp_rank,
                dp_start_rank,
                dp_size,
            } => write!(
                f,
                "dp_rank {dp_rank} is outside the worker's ranks {dp_start_rank}..{}",
                u64::from(*dp_start_rank) + u64::from(*dp_size)
            ),
            Self::Cordoned => write!(f, "worker is cordoned"),
            Self::NotAllowed => write!(f, "worker is not in the allowed set"),
            Self::MigrationExcluded => {
                write!(f, "worker already failed this request (migration)")
            }
            Self::TaintNotTolerated { taint } => {
                write!(f, "taint {taint:?} is not tolerated by the request")
            }
            Self::AdapterNotServed { adapter } => {
                write!(f, "does not serve LoRA adapter {adapter:?}")
            }
            Self::NotPinned => write!(f, "request is pinned to another target"),
        }
    }
}

/// The static filters of one request.
#[derive(Clone, Copy, Debug)]
pub struct Eligibility<'a> {
    pub model: &'a str,
    pub phase: RequestPhase,
    /// `None`: every worker is allowed.
    pub allowed: Option<&'a HashSet<WorkerId>>,
    /// Workers the request already failed on (empty when explicitly pinned).
    pub excluded: &'a HashSet<WorkerId>,
    pub tolerated_taints: &'a [String],
    /// The LoRA adapter asked for.
    pub adapter: Option<&'a str>,
}

impl Eligibility<'_> {
    /// Checks the worker as a whole (every rank shares the result).
    pub(crate) fn check_worker(&self, w: &WorkerSnapshot) -> Result<(), Ineligible> {
        if w.model != self.model {
            return Err(Ineligible::ModelMismatch {
                worker_model: w.model.clone(),
                request_model: self.model.to_owned(),
            });
        }
        if !w.role.serves(self.phase) {
            return Err(Ineligible::RoleMismatch {
                role: w.role,
                phase: self.phase,
            });
        }
        if w.cordoned {
            return Err(Ineligible::Cordoned);
        }
        if self.allowed.is_some_and(|a| !a.contains(&w.worker_id)) {
            return Err(Ineligible::NotAllowed);
        }
        if self.excluded.contains(&w.worker_id) {
            return Err(Ineligible::MigrationExcluded);
        }
        if let Some(taint) = w.taints.iter().find(|t| !self.tolerated_taints.contains(t)) {
            return Err(Ineligible::TaintNotTolerated {
                taint: taint.clone(),
            });
        }
        if let Some(adapter) = self.adapter
            && needs_adapter_load(w, adapter)
            && !w.loads_adapters
        {
            return Err(Ineligible::AdapterNotServed {
                adapter: adapter.to_owned(),
            });
        }
        Ok(())
    }

    /// Checks one rank of the worker: the rank must exist, then the worker
    /// checks apply.
    pub(crate) fn check_rank(&self, w: &WorkerSnapshot, dp_rank: DpRank) -> Result<(), Ineligible> {
        if !w.has_rank(dp_rank) {
            return Err(Ineligible::NoSuchRank {
                dp_rank,
                dp_start_rank: w.dp_start_rank,
                dp_size: w.dp_size,
            });
        }
        self.check_worker(w)
    }
}

/// When a candidate counts as busy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BusyThresholds {
    /// Busy when booked prefill tokens exceed this many times the worker's
    /// `max_num_batched_tokens` (ignored when that is 0). Default 4.0.
    pub prefill_factor: f64,
    /// Busy when reported `kv_blocks_used / total_kv_blocks` of the rank
    /// exceeds this fraction (ignored when `total_kv_blocks` is 0). Default
    /// 0.95. `total_kv_blocks` is taken as the capacity of one dp rank.
    pub kv_usage_fraction: f64,
}

impl Default for BusyThresholds {
    fn default() -> Self {
        Self {
            prefill_factor: 4.0,
            kv_usage_fraction: 0.95,
        }
    }
}

/// Why a candidate is busy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Busy {
    PrefillBacklog {
        booked_prefill_tokens: u64,
        limit: f64,
    },
    KvUsage {
        used: u64,
        total: u64,
    },
}

impl fmt::Display for Busy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::PrefillBacklog {
                booked_prefill_tokens,
                limit,
            } => write!(
                f,
                "{booked_prefill_tokens} booked prefill tokens exceed {limit}"
            ),
            Self::KvUsage { used, total } => {
                write!(f, "{used} of {total} kv blocks in use")
            }
        }
    }
}

impl BusyThresholds {
    /// Whether rank `dp_rank` of `w` is busy, and why.
    pub(crate) fn check(
        &self,
        w: &WorkerSnapshot,
        dp_rank: DpRank,
        booked: &BookedLoad,
    ) -> Option<Busy> {
        if w.max_num_batched_tokens > 0 {
            let limit = self.prefill_factor * w.max_num_batched_tokens as f64;
            if booked.prefill_tokens as f64 > limit {
                return Some(Busy::PrefillBacklog {
                    booked_prefill_tokens: booked.prefill_tokens,
                    limit,
                });
            }
        }
        if w.total_kv_blocks > 0 {
            let used = w.rank_load(dp_rank).kv_blocks_used;
            if used as f64 / w.total_kv_blocks as f64 > self.kv_usage_fraction {
                return Some(Busy::KvUsage {
                    used,
                    total: w.total_kv_blocks,
                });
            }
        }
        None
    }
}

/// Whether `w` would have to load `adapter` first: it declares adapters,
/// and not this one.
pub fn needs_adapter_load(w: &WorkerSnapshot, adapter: &str) -> bool {
    !w.adapters.is_empty() && !w.adapters.iter().any(|a| a == adapter)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::RankLoad;

    fn worker(id: WorkerId) -> WorkerSnapshot {
        WorkerSnapshot {
            worker_id: id,
            model: "m".into(),
            endpoint: String::new(),
            block_size: 16,
            dp_size: 2,
            total_kv_blocks: 100,
            max_num_batched_tokens: 1000,
            ..Default::default()
        }
    }

    #[test]
    fn filters_in_order() {
        let allowed = HashSet::from([1, 2]);
        let excluded = HashSet::from([2]);
        let tolerated = vec!["gpu=a100".to_owned()];
        let e = Eligibility {
            model: "m",
            phase: RequestPhase::Prefill,
            allowed: Some(&allowed),
            excluded: &excluded,
            tolerated_taints: &tolerated,
            adapter: None,
        };
        assert_eq!(e.check_rank(&worker(1), 1), Ok(()));
        assert!(matches!(
            e.check_rank(&worker(1), 2),
            Err(Ineligible::NoSuchRank { .. })
        ));
        assert_eq!(e.check_worker(&worker(3)), Err(Ineligible::NotAllowed));
        assert_eq!(
            e.check_worker(&worker(2)),
            Err(Ineligible::MigrationExcluded)
        );
        let mut w = worker(1);
        w.role = WorkerRole::Decode;
        assert!(matches!(
            e.check_worker(&w),
            Err(Ineligible::RoleMismatch { .. })
        ));
        let mut w = worker(1);
        w.cordoned = true;
        assert_eq!(e.check_worker(&w), Err(Ineligible::Cordoned));
        let mut w = worker(1);
        w.taints = vec!["gpu=a100".into(), "spot".into()];
        assert_eq!(
            e.check_worker(&w),
            Err(Ineligible::TaintNotTolerated {
                taint: "spot".into()
            })
        );
        let mut w = worker(1);
        w.model = "other".into();
        assert!(matches!(
            e.check_worker(&w),
            Err(Ineligible::ModelMismatch { .. })
        ));
        // A worker that declares adapters serves only those; one that
        // declares none serves any.
        let sql = Eligibility {
            adapter: Some("sql"),
            ..e
        };
        let mut w = worker(1);
        w.adapters = vec!["chat".into()];
        assert_eq!(
            sql.check_worker(&w),
            Err(Ineligible::AdapterNotServed {
                adapter: "sql".into()
            })
        );
        assert_eq!(e.check_worker(&w), Ok(()), "a base-model request");
        let mut loader = w.clone();
        loader.loads_adapters = true;
        assert_eq!(sql.check_worker(&loader), Ok(()), "loads it on request");
        w.adapters.push("sql".into());
        assert_eq!(sql.check_worker(&w), Ok(()));
        assert_eq!(sql.check_worker(&worker(1)), Ok(()), "undeclared");
    }

    #[test]
    fn busy_by_prefill_backlog_and_kv_usage() {
        let t = BusyThresholds::default();
        let mut w = worker(1);
        let mut booked = BookedLoad {
            prefill_tokens: 4000,
            ..Default::default()
        };
        assert_eq!(t.check(&w, 0, &booked), None, "4.0x is not over 4.0x");
        booked.prefill_tokens = 4001;
        assert!(matches!(
            t.check(&w, 0, &booked),
            Some(Busy::PrefillBacklog { .. })
        ));
        booked.prefill_tokens = 0;
        w.load = vec![(
            1,
            RankLoad {
                kv_blocks_used: 96,
                ..Default::default()
            },
        )];
        assert_eq!(t.check(&w, 0, &booked), None, "rank 0 did not report");
        assert_eq!(
            t.check(&w, 1, &booked),
            Some(Busy::KvUsage {
                used: 96,
                total: 100
            })
        );
        // Unknown capacities never make a worker busy.
        w.total_kv_blocks = 0;
        w.max_num_batched_tokens = 0;
        booked.prefill_tokens = u64::MAX;
        assert_eq!(t.check(&w, 1, &booked), None);
    }
}
