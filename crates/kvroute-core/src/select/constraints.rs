//! What a request allows before anything is scored: its explicit pin (the
//! phase's hints), migration exclusions (only without an explicit pin),
//! session affinity (a HARD worker-only target narrows the allowed set; a
//! HARD rank target pins; a SOFT target only prefers) and a planned worker,
//! merged as the reference does, with the first error in the reference's
//! order: exclusions that leave nothing, a HARD session's worker gone, a
//! planned worker the pins contradict, a pin that cannot be resolved, a
//! pinned target that is not eligible.

use std::collections::HashSet;

use super::{
    PinSource, SelectContext, SelectRequest,
    affinity::AffinityMode,
    eligibility::Eligibility,
    error::SelectError,
    pins::{self, PinTarget},
};
use crate::types::{WorkerId, WorkerRank, WorkerSnapshot};

/// The request's constraints, resolved against the model's workers.
pub(super) struct Constraints<'r> {
    req: &'r SelectRequest,
    /// The exclusions in force: the request's, or none under an explicit pin.
    excluded: &'r HashSet<WorkerId>,
    /// The allowed set, narrowed to a worker-only HARD session's worker.
    allowed: Option<HashSet<WorkerId>>,
    /// The one target every other candidate gives way to, and why.
    pub pinned: Option<(WorkerRank, PinSource)>,
    /// A SOFT session's target, preferred on ties.
    pub soft: Option<PinTarget>,
}

impl<'r> Constraints<'r> {
    /// Resolves `req`'s constraints; `no_exclusions` is an empty set the
    /// result may borrow when an explicit pin lifts the exclusions.
    pub(super) fn resolve(
        req: &'r SelectRequest,
        ctx: &SelectContext<'_>,
        workers: &[&WorkerSnapshot],
        no_exclusions: &'r HashSet<WorkerId>,
    ) -> Result<Self, SelectError> {
        let explicit_pin = pins::pinned_worker_hint(req.phase, &req.hints);
        // Migration exclusions apply only without an explicit pin.
        let excluded = if explicit_pin.is_none() {
            &req.excluded_worker_ids
        } else {
            no_exclusions
        };
        let mut constraints = Self {
            req,
            excluded,
            allowed: req.hints.allowed_worker_ids.clone(),
            pinned: None,
            soft: None,
        };
        if constraints.exclusions_in_force() {
            let base = constraints.eligibility();
            if !workers.iter().any(|w| base.check_worker(w).is_ok()) {
                return Err(exhausted(req));
            }
        }

        let session_target = req.session.as_ref().and_then(|s| {
            ctx.sessions
                .lookup(&s.session_id, ctx.now_ms)
                .map(|t| (t, s.mode))
        });
        let hard = session_target.and_then(|(t, m)| (m == AffinityMode::Hard).then_some(t));
        constraints.soft = session_target.and_then(|(t, m)| (m == AffinityMode::Soft).then_some(t));

        // A worker-only HARD affinity narrows the allowed set to its worker.
        let worker_only = hard.filter(|t| t.dp_rank.is_none());
        if let Some(t) = worker_only {
            match &mut constraints.allowed {
                Some(set) => set.retain(|id| *id == t.worker_id),
                None => constraints.allowed = Some(HashSet::from([t.worker_id])),
            }
        }
        // An explicit pin of that worker without a rank then adds nothing.
        let explicit_pin = match (explicit_pin, worker_only) {
            (Some(p), Some(t)) if p.dp_rank.is_none() && p.worker_id == t.worker_id => None,
            (p, _) => p,
        };
        let affinity_pin = hard.filter(|t| t.dp_rank.is_some());
        let requested = pins::merge_affinity_pin(explicit_pin, affinity_pin);
        let requested_source = if explicit_pin.is_some() {
            PinSource::Hint
        } else {
            PinSource::Affinity
        };

        let find = |id: WorkerId| workers.iter().copied().find(|w| w.worker_id == id);
        // A HARD session's worker that left the registry is a missing pin.
        if let Some(t) = worker_only
            && find(t.worker_id).is_none()
        {
            return Err(not_found(req, t.worker_id));
        }
        constraints.pinned = match (req.planned_worker, requested) {
            (Some(planned), Some(pin))
                if pin.worker_id != planned.worker_id
                    || pin.dp_rank.is_some_and(|r| r != planned.dp_rank) =>
            {
                return Err(SelectError::PlannedWorkerConflict {
                    request_id: req.request_id.clone(),
                    planned,
                    requested_worker: pin.worker_id,
                    requested_dp_rank: pin.dp_rank,
                });
            }
            (Some(planned), _) => Some((planned, PinSource::Planned)),
            (None, Some(pin)) => {
                let w = find(pin.worker_id).ok_or_else(|| not_found(req, pin.worker_id))?;
                let rank = pins::resolve_pinned_worker_rank(
                    &req.request_id,
                    pin.worker_id,
                    pin.dp_rank,
                    w.unique_dp_rank(),
                    w.dp_size,
                )?;
                Some((rank, requested_source))
            }
            (None, None) => None,
        };
        if let Some((target, _)) = constraints.pinned {
            let w = find(target.worker_id).ok_or_else(|| not_found(req, target.worker_id))?;
            // Busy never counts here: only static eligibility.
            constraints
                .eligibility()
                .check_rank(w, target.dp_rank)
                .map_err(|reason| SelectError::PinnedWorkerIneligible {
                    request_id: req.request_id.clone(),
                    target,
                    reason,
                })?;
        }
        Ok(constraints)
    }

    /// The static eligibility rules of the request.
    pub(super) fn eligibility(&self) -> Eligibility<'_> {
        Eligibility {
            model: &self.req.model,
            phase: self.req.phase,
            allowed: self.allowed.as_ref(),
            excluded: self.excluded,
            tolerated_taints: &self.req.hints.tolerated_taints,
            adapter: self.req.adapter.as_deref(),
        }
    }

    /// Whether migration exclusions narrow the candidates.
    pub(super) fn exclusions_in_force(&self) -> bool {
        !self.excluded.is_empty()
    }
}

/// Every worker the request may use was excluded by migration.
pub(super) fn exhausted(req: &SelectRequest) -> SelectError {
    let mut ids: Vec<WorkerId> = req.excluded_worker_ids.iter().copied().collect();
    ids.sort_unstable();
    SelectError::MigrationExhausted {
        request_id: req.request_id.clone(),
        excluded: ids,
    }
}

fn not_found(req: &SelectRequest, worker_id: WorkerId) -> SelectError {
    SelectError::PinnedWorkerNotFound {
        request_id: req.request_id.clone(),
        worker_id,
        model: req.model.clone(),
    }
}
