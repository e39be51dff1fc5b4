//! The `kvroute.v1.Admin` service: what kvroute knows, and why it decides.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::{
    fleet::{Fleet, changes::FleetChanges},
    grpc::{convert, router::prepare_on, status::reason_label},
    pb,
    router::Admitted,
    snapshot::{SnapshotError, WriteSnapshot},
};
use kvroute_core::select::eligibility::Ineligible;

/// Handlers of `kvroute.v1.Admin`.
#[derive(Clone)]
pub struct AdminService {
    /// What the handlers read.
    fleet: Arc<Fleet>,
    /// Cordons, alone or through the cluster (`app.rs` chooses).
    changes: Arc<dyn FleetChanges>,
    /// The state directory's snapshots, or the cluster's; `None` alone
    /// without `--state-dir`.
    snapshots: Option<Arc<dyn WriteSnapshot>>,
}

type Res<T> = Result<Response<T>, Status>;

impl AdminService {
    pub(crate) fn new(
        fleet: Arc<Fleet>,
        changes: Arc<dyn FleetChanges>,
        snapshots: Option<Arc<dyn WriteSnapshot>>,
    ) -> Self {
        Self {
            fleet,
            changes,
            snapshots,
        }
    }

    /// In a cluster the cordon is shared first, so a replica that cannot
    /// share it changes nothing and answers UNAVAILABLE.
    async fn cordon(&self, worker_id: u64, cordoned: bool) -> Res<pb::WorkerInfo> {
        let view = self
            .changes
            .set_cordoned(worker_id, cordoned)
            .await
            .map_err(|e| self.fail(e.into()))?;
        Ok(Response::new(convert::worker_view_to_pb(&view)))
    }

    fn fail(&self, status: Status) -> Status {
        self.fleet
            .router()
            .metrics()
            .input_rejected
            .with_label_values(&["admin", reason_label(&status)])
            .inc();
        status
    }
}

fn reason_to_pb(reason: &Ineligible) -> pb::IneligibleReason {
    match reason {
        Ineligible::ModelMismatch { .. } | Ineligible::NotAllowed => {
            pb::IneligibleReason::NotAllowed
        }
        Ineligible::RoleMismatch { .. } => pb::IneligibleReason::Role,
        Ineligible::NoSuchRank { .. } | Ineligible::NotPinned => {
            pb::IneligibleReason::PinnedElsewhere
        }
        Ineligible::Cordoned => pb::IneligibleReason::Cordoned,
        Ineligible::MigrationExcluded => pb::IneligibleReason::Excluded,
        Ineligible::TaintNotTolerated { .. } => pb::IneligibleReason::Taint,
        Ineligible::AdapterNotServed { .. } => pb::IneligibleReason::Adapter,
    }
}

#[tonic::async_trait]
impl pb::admin_server::Admin for AdminService {
    async fn list_workers(
        &self,
        request: Request<pb::ListWorkersRequest>,
    ) -> Res<pb::ListWorkersResponse> {
        let model = request.into_inner().model;
        let workers = self
            .fleet
            .worker_views(model.as_deref())
            .iter()
            .map(convert::worker_view_to_pb)
            .collect();
        Ok(Response::new(pb::ListWorkersResponse { workers }))
    }

    async fn get_worker(&self, request: Request<pb::GetWorkerRequest>) -> Res<pb::WorkerInfo> {
        let view = self
            .fleet
            .worker_view(request.into_inner().worker_id)
            .map_err(|e| self.fail(e.into()))?;
        Ok(Response::new(convert::worker_view_to_pb(&view)))
    }

    async fn explain_selection(
        &self,
        request: Request<pb::SelectWorkerRequest>,
    ) -> Res<pb::ExplainSelectionResponse> {
        let router = self.fleet.router();
        let request = request.into_inner();
        // One read of the model's view: the prompt is hashed at its block
        // size and the decision explained on its workers and index.
        let model = router.model_view(&request.model);
        let prepared = prepare_on(router, &model, request).map_err(|s| self.fail(s))?;
        let selection = router
            .explain(&model, &prepared)
            .map_err(|e| self.fail(e.into()))?;
        let candidates = selection
            .candidates
            .iter()
            .map(|c| {
                let score = c.score.as_ref();
                pb::CandidateExplanation {
                    worker_id: c.target.worker_id,
                    dp_rank: c.target.dp_rank,
                    eligible: c.eligible.is_ok(),
                    reason: c
                        .eligible
                        .as_ref()
                        .err()
                        .map_or(pb::IneligibleReason::None, reason_to_pb)
                        .into(),
                    overlap_blocks: c.overlap_blocks,
                    prefill_cost: score
                        .map_or(c.potential_prefill_blocks as f64, |s| s.prefill_cost),
                    decode_cost: score.map_or(c.potential_decode_blocks as f64, |s| s.decode_cost),
                    logit: score.and_then(|s| s.logit).unwrap_or(0.0),
                    probability: score.map_or(0.0, |s| s.probability),
                    busy: c.busy.is_some(),
                    cost: score.map_or(0.0, |s| s.cost),
                    ttft: score.and_then(|s| s.ttft).map(|t| pb::TtftPrediction {
                        total_ms: t.total_ms(),
                        queued_prefill_ms: t.queued_prefill_ms,
                        own_prefill_ms: t.own_prefill_ms,
                        decode_ms: t.decode_ms,
                        scale: t.scale,
                        own_prefill_tokens: t.own_prefill_tokens,
                        queue_tracked: t.queue_tracked,
                    }),
                    cache_view: crate::grpc::convert::cache_view_to_pb(c.view).into(),
                    cache_view_reason: c.view.describe().to_owned(),
                    overlap_by_tier: Some(c.tiers.into()),
                    effective_overlap_blocks: c.effective_overlap_blocks,
                    loads_adapter: c.loads_adapter,
                }
            })
            .collect();
        let winner = convert::selection_to_pb(&selection, Admitted::Untracked, false);
        Ok(Response::new(pb::ExplainSelectionResponse {
            candidates,
            winner: Some(winner),
            policy: selection.policy.to_owned(),
        }))
    }

    async fn get_index_stats(
        &self,
        request: Request<pb::GetIndexStatsRequest>,
    ) -> Res<pb::IndexStats> {
        let model = request.into_inner().model;
        let view = self.fleet.index_view(model.as_deref());
        Ok(Response::new(convert::index_view_to_pb(&view)))
    }

    async fn cordon_worker(
        &self,
        request: Request<pb::CordonWorkerRequest>,
    ) -> Res<pb::WorkerInfo> {
        self.cordon(request.into_inner().worker_id, true).await
    }

    async fn uncordon_worker(
        &self,
        request: Request<pb::UncordonWorkerRequest>,
    ) -> Res<pb::WorkerInfo> {
        self.cordon(request.into_inner().worker_id, false).await
    }

    async fn snapshot(&self, _request: Request<pb::SnapshotRequest>) -> Res<pb::SnapshotResponse> {
        let Some(snapshots) = &self.snapshots else {
            return Err(self.fail(Status::failed_precondition(
                "kvroute runs without a state directory: start it with --state-dir to take snapshots",
            )));
        };
        let written = snapshots.write_now().await.map_err(|e| {
            tracing::warn!(error = %e, "snapshot on request failed");
            self.fail(match e {
                // The cluster's store is away: try again later.
                SnapshotError::Replicated(_) => Status::unavailable(e.to_string()),
                // The state directory cannot be written (read-only, full,
                // gone): the operator's to fix before asking again.
                SnapshotError::Dir { .. } | SnapshotError::Io { .. } => {
                    Status::failed_precondition(e.to_string())
                }
                SnapshotError::Unusable { .. } | SnapshotError::Task(_) => {
                    Status::internal(e.to_string())
                }
            })
        })?;
        Ok(Response::new(pb::SnapshotResponse {
            path: written.path.display().to_string(),
            bytes: written.bytes,
            entries: written.entries,
            workers: written.workers,
            capture_seconds: written.capture_seconds,
            write_seconds: written.write_seconds,
        }))
    }
}
