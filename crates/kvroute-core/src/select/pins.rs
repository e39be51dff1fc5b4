//! Pin resolution: which (worker, dp rank), if any, a request is bound to
//! before any scoring happens.
//!
//! Why it exists: a request can be pinned by its phase's routing hints, by a
//! HARD session affinity, or by a previewed ("planned") worker, and these
//! sources must be combined the same way every time. Invariants:
//! * the phase picks the hints: PREFILL reads `prefill_worker_id` then
//!   `backend_instance_id` with `prefill_dp_rank` then `dp_rank`; DECODE and
//!   AGGREGATED read `decode_worker_id` then `backend_instance_id` with
//!   `dp_rank`;
//! * an explicit dp rank (0 included) always wins; otherwise the worker's only
//!   rank is used; a worker with several ranks needs an explicit one;
//! * an explicit pin of the affinity's worker without a rank borrows the
//!   affinity's rank; an explicit pin with a rank keeps it.

use crate::types::{DpRank, RequestPhase, WorkerId, WorkerRank};

use super::RoutingHints;
use super::error::SelectError;

/// A worker, optionally narrowed to one dp rank. Used both for pins taken
/// from hints and for session-affinity targets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PinTarget {
    pub worker_id: WorkerId,
    pub dp_rank: Option<DpRank>,
}

impl PinTarget {
    pub const fn new(worker_id: WorkerId, dp_rank: Option<DpRank>) -> Self {
        Self { worker_id, dp_rank }
    }

    /// Whether `rank` is (one of) the target's routing targets.
    pub(crate) fn covers(&self, rank: WorkerRank) -> bool {
        self.worker_id == rank.worker_id && self.dp_rank.is_none_or(|r| r == rank.dp_rank)
    }
}

impl From<WorkerRank> for PinTarget {
    fn from(rank: WorkerRank) -> Self {
        Self::new(rank.worker_id, Some(rank.dp_rank))
    }
}

/// The pin the routing hints ask for in `phase`, if any.
pub(crate) fn pinned_worker_hint(phase: RequestPhase, hints: &RoutingHints) -> Option<PinTarget> {
    match phase {
        RequestPhase::Prefill => {
            let worker_id = hints.prefill_worker_id.or(hints.backend_instance_id)?;
            Some(PinTarget::new(
                worker_id,
                hints.prefill_dp_rank.or(hints.dp_rank),
            ))
        }
        RequestPhase::Decode | RequestPhase::Aggregated => {
            let worker_id = hints.decode_worker_id.or(hints.backend_instance_id)?;
            Some(PinTarget::new(worker_id, hints.dp_rank))
        }
    }
}

/// Combines an explicit pin with a rank-carrying affinity pin. An explicit
/// pin of the affinity's worker without a rank borrows the affinity's rank;
/// any other explicit pin wins as it is; without an explicit pin the affinity
/// pin applies.
pub(crate) fn merge_affinity_pin(
    explicit: Option<PinTarget>,
    affinity: Option<PinTarget>,
) -> Option<PinTarget> {
    match (explicit, affinity) {
        (Some(pin), Some(aff)) if pin.dp_rank.is_none() && pin.worker_id == aff.worker_id => {
            Some(PinTarget::new(pin.worker_id, aff.dp_rank))
        }
        (Some(pin), _) => Some(pin),
        (None, aff) => aff,
    }
}

/// Turns a pin into a routing target: the requested rank if given (0
/// included), else the worker's only rank, else an error.
/// `dp_size` is only used to say why no rank could be chosen.
pub(crate) fn resolve_pinned_worker_rank(
    request_id: &str,
    worker_id: WorkerId,
    requested_dp_rank: Option<DpRank>,
    unique_dp_rank: Option<DpRank>,
    dp_size: u32,
) -> Result<WorkerRank, SelectError> {
    match requested_dp_rank.or(unique_dp_rank) {
        Some(dp_rank) => Ok(WorkerRank::new(worker_id, dp_rank)),
        None => Err(SelectError::DpRankRequired {
            request_id: request_id.to_owned(),
            worker_id,
            dp_size,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::select::error::ErrorCode;

    #[test]
    fn resolve_rank_explicit_wins_including_zero() {
        let r = resolve_pinned_worker_rank("r", 7, Some(0), Some(3), 1).unwrap();
        assert_eq!(r, WorkerRank::new(7, 0));
    }

    #[test]
    fn resolve_rank_falls_back_to_unique_rank() {
        let r = resolve_pinned_worker_rank("r", 7, None, Some(3), 1).unwrap();
        assert_eq!(r, WorkerRank::new(7, 3));
    }

    #[test]
    fn resolve_rank_without_unique_rank_fails() {
        let e = resolve_pinned_worker_rank("req-9", 7, None, None, 4).unwrap_err();
        assert_eq!(e.code(), ErrorCode::FailedPrecondition);
        let msg = e.to_string();
        assert!(msg.contains("requires an explicit dp_rank"), "{msg}");
        assert!(msg.contains("req-9") && msg.contains("worker 7"), "{msg}");
    }

    #[test]
    fn affinity_supplies_rank_to_matching_explicit_worker() {
        let p = |w, r| Some(PinTarget::new(w, r));
        assert_eq!(merge_affinity_pin(p(7, None), p(7, Some(0))), p(7, Some(0)));
        assert_eq!(
            merge_affinity_pin(p(7, Some(2)), p(7, Some(3))),
            p(7, Some(2))
        );
        // A different worker: the explicit pin wins unchanged.
        assert_eq!(merge_affinity_pin(p(8, None), p(7, Some(3))), p(8, None));
        assert_eq!(merge_affinity_pin(None, p(7, Some(3))), p(7, Some(3)));
        assert_eq!(merge_affinity_pin(None, None), None);
    }

    #[test]
    fn prefill_hint_prefers_prefill_worker_and_rank() {
        let hints = RoutingHints {
            backend_instance_id: Some(1),
            prefill_worker_id: Some(2),
            dp_rank: Some(3),
            prefill_dp_rank: Some(4),
            ..Default::default()
        };
        assert_eq!(
            pinned_worker_hint(RequestPhase::Prefill, &hints),
            Some(PinTarget::new(2, Some(4)))
        );
        // Fallbacks: backend instance and plain dp_rank.
        let hints = RoutingHints {
            backend_instance_id: Some(1),
            dp_rank: Some(3),
            decode_worker_id: Some(9),
            ..Default::default()
        };
        assert_eq!(
            pinned_worker_hint(RequestPhase::Prefill, &hints),
            Some(PinTarget::new(1, Some(3)))
        );
    }

    #[test]
    fn decode_hint_prefers_decode_worker() {
        let hints = RoutingHints {
            backend_instance_id: Some(1),
            decode_worker_id: Some(5),
            prefill_worker_id: Some(2),
            dp_rank: Some(6),
            prefill_dp_rank: Some(8),
            ..Default::default()
        };
        assert_eq!(
            pinned_worker_hint(RequestPhase::Decode, &hints),
            Some(PinTarget::new(5, Some(6)))
        );
    }

    #[test]
    fn aggregated_hint_prefers_decode_worker() {
        let hints = RoutingHints {
            backend_instance_id: Some(9),
            decode_worker_id: Some(5),
            dp_rank: Some(7),
            ..Default::default()
        };
        assert_eq!(
            pinned_worker_hint(RequestPhase::Aggregated, &hints),
            Some(PinTarget::new(5, Some(7)))
        );
        let only_backend = RoutingHints {
            backend_instance_id: Some(9),
            prefill_worker_id: Some(2),
            ..Default::default()
        };
        assert_eq!(
            pinned_worker_hint(RequestPhase::Aggregated, &only_backend),
            Some(PinTarget::new(9, None))
        );
        assert_eq!(
            pinned_worker_hint(RequestPhase::Aggregated, &RoutingHints::default()),
            None
        );
    }

    #[test]
    fn covers() {
        assert!(PinTarget::new(1, None).covers(WorkerRank::new(1, 5)));
        assert!(PinTarget::new(1, Some(5)).covers(WorkerRank::new(1, 5)));
        assert!(!PinTarget::new(1, Some(4)).covers(WorkerRank::new(1, 5)));
        assert!(!PinTarget::new(2, None).covers(WorkerRank::new(1, 5)));
    }
}
