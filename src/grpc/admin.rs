//! The `kvroute.v1.Admin` service: what kvroute knows, and why it decides.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::{
    core::{RouterCore, now},
    grpc::{convert, router::prepare, status::reason_label},
    pb,
    registry::WorkerRecord,
    select::eligibility::Ineligible,
    subscriptions::Subscriptions,
    types::WorkerRank,
};

/// Handlers of `kvroute.v1.Admin`.
#[derive(Clone)]
pub struct AdminService {
    core: Arc<RouterCore>,
    subscriptions: Arc<Subscriptions>,
}

type Res<T> = Result<Response<T>, Status>;

impl AdminService {
    pub fn new(core: Arc<RouterCore>, subscriptions: Arc<Subscriptions>) -> Self {
        Self {
            core,
            subscriptions,
        }
    }

    fn fail(&self, status: Status) -> Status {
        self.core
            .metrics
            .input_rejected
            .with_label_values(&["admin", reason_label(&status)])
            .inc();
        status
    }

    fn worker_info(&self, record: &WorkerRecord) -> pb::WorkerInfo {
        let r = &record.registration;
        let booked: Vec<_> = {
            let state = self.core.routing.read();
            (0..r.dp_size)
                .map(|i| {
                    state
                        .ledger
                        .load(WorkerRank::new(r.worker_id, r.dp_start_rank + i))
                })
                .collect()
        };
        let ranks = (0..r.dp_size)
            .zip(booked)
            .map(|(i, booked)| {
                let dp_rank = r.dp_start_rank + i;
                let target = WorkerRank::new(r.worker_id, dp_rank);
                let cursor = self.core.cursor(target).unwrap_or_default();
                pb::RankInfo {
                    dp_rank,
                    reported_load: Some(convert::rank_load_to_pb(
                        dp_rank,
                        record.load.get(&dp_rank).copied().unwrap_or_default(),
                    )),
                    booked_load: Some(convert::booked_load_to_pb(booked)),
                    cached_blocks: self.core.cached_blocks(&r.model, target),
                    last_event_id: cursor.last_applied().unwrap_or(0),
                    events_skipped: cursor.skipped,
                    events_rejected: cursor.rejected,
                }
            })
            .collect();
        pb::WorkerInfo {
            worker_id: r.worker_id,
            model: r.model.clone(),
            role: convert::role_to_pb(r.role).into(),
            endpoint: r.endpoint.clone(),
            block_size: r.block_size,
            dp_start_rank: r.dp_start_rank,
            dp_size: r.dp_size,
            total_kv_blocks: r.total_kv_blocks,
            max_num_batched_tokens: r.max_num_batched_tokens,
            taints: r.taints.clone(),
            lease_remaining_ms: u64::try_from(record.lease_remaining(now()).as_millis())
                .unwrap_or(u64::MAX),
            cordoned: record.cordoned,
            ranks,
            subscription: self.subscriptions.summary(r.worker_id),
        }
    }

    fn lookup(&self, worker_id: u64) -> Result<WorkerRecord, Status> {
        self.core
            .registry
            .read()
            .get(worker_id)
            .cloned()
            .ok_or_else(|| {
                self.fail(Status::not_found(format!(
                    "worker {worker_id} is not registered"
                )))
            })
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
    }
}

#[tonic::async_trait]
impl pb::admin_server::Admin for AdminService {
    async fn list_workers(
        &self,
        request: Request<pb::ListWorkersRequest>,
    ) -> Res<pb::ListWorkersResponse> {
        let model = request.into_inner().model;
        let records: Vec<WorkerRecord> = self
            .core
            .registry
            .read()
            .all()
            .into_iter()
            .filter(|w| model.as_ref().is_none_or(|m| &w.registration.model == m))
            .cloned()
            .collect();
        let workers = records.iter().map(|r| self.worker_info(r)).collect();
        Ok(Response::new(pb::ListWorkersResponse { workers }))
    }

    async fn get_worker(&self, request: Request<pb::GetWorkerRequest>) -> Res<pb::WorkerInfo> {
        let record = self.lookup(request.into_inner().worker_id)?;
        Ok(Response::new(self.worker_info(&record)))
    }

    async fn explain_selection(
        &self,
        request: Request<pb::SelectWorkerRequest>,
    ) -> Res<pb::ExplainSelectionResponse> {
        let prepared = prepare(&self.core, request.into_inner()).map_err(|s| self.fail(s))?;
        let selection = self
            .core
            .explain(&prepared)
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
                }
            })
            .collect();
        let winner =
            convert::selection_to_pb(&selection, crate::routing::Admitted::Untracked, false);
        Ok(Response::new(pb::ExplainSelectionResponse {
            candidates,
            winner: Some(winner),
        }))
    }

    async fn get_index_stats(
        &self,
        request: Request<pb::GetIndexStatsRequest>,
    ) -> Res<pb::IndexStats> {
        let model = request.into_inner().model;
        let stats = match model {
            Some(model) => self
                .core
                .index_of(&model)
                .map(|index| index.stats())
                .unwrap_or_default(),
            None => self.core.index_totals(),
        };
        let (skipped, rejected) = {
            let cursors = self.core.cursors.lock();
            cursors
                .values()
                .fold((0, 0), |(s, r), c| (s + c.skipped, r + c.rejected))
        };
        Ok(Response::new(pb::IndexStats {
            blocks: stats.blocks,
            nodes: stats.nodes,
            workers: stats.workers,
            events_applied: stats.events_applied,
            events_skipped: skipped,
            events_rejected: rejected,
            memory_bytes: stats.bytes_used,
        }))
    }

    async fn cordon_worker(
        &self,
        request: Request<pb::CordonWorkerRequest>,
    ) -> Res<pb::WorkerInfo> {
        let worker_id = request.into_inner().worker_id;
        let record = self
            .core
            .set_cordoned(worker_id, true)
            .map_err(|e| self.fail(e.into()))?;
        tracing::info!(worker_id, "worker cordoned");
        Ok(Response::new(self.worker_info(&record)))
    }

    async fn uncordon_worker(
        &self,
        request: Request<pb::UncordonWorkerRequest>,
    ) -> Res<pb::WorkerInfo> {
        let worker_id = request.into_inner().worker_id;
        let record = self
            .core
            .set_cordoned(worker_id, false)
            .map_err(|e| self.fail(e.into()))?;
        self.core.drain_queue();
        tracing::info!(worker_id, "worker uncordoned");
        Ok(Response::new(self.worker_info(&record)))
    }
}
