//! The `kvroute.v1.Workers` service: registration, leases, load and the
//! `PublishEvents` stream. Handlers translate and call the core; batches go
//! to the single index writer (`ingest`). A registration with an
//! `events_endpoint` starts (or restarts) the worker's engine-native ZeroMQ
//! subscription (`subscriptions`); deregistration stops it.

use std::{pin::Pin, sync::Arc};

use tokio::sync::mpsc;
use tokio_stream::{Stream, StreamExt, wrappers::ReceiverStream};
use tonic::{Request, Response, Status, Streaming};

use crate::{
    core::RouterCore,
    grpc::{
        convert::{self, BatchLimits},
        status::reason_label,
    },
    ingest::IngestHandle,
    pb,
    subscriptions::{EngineSource, Subscriptions},
};

/// Handlers of `kvroute.v1.Workers`.
#[derive(Clone)]
pub struct WorkersService {
    core: Arc<RouterCore>,
    ingest: IngestHandle,
    subscriptions: Arc<Subscriptions>,
}

impl WorkersService {
    pub fn new(
        core: Arc<RouterCore>,
        ingest: IngestHandle,
        subscriptions: Arc<Subscriptions>,
    ) -> Self {
        Self {
            core,
            ingest,
            subscriptions,
        }
    }

    fn rejected(&self, reason: &'static str, status: Status) -> Status {
        self.core
            .metrics
            .input_rejected
            .with_label_values(&["workers", reason])
            .inc();
        status
    }

    fn fail(&self, status: Status) -> Status {
        let label = reason_label(&status);
        self.rejected(label, status)
    }
}

type ReplyStream = Pin<Box<dyn Stream<Item = Result<pb::PublishEventsReply, Status>> + Send>>;

#[tonic::async_trait]
impl pb::workers_server::Workers for WorkersService {
    async fn register_worker(
        &self,
        request: Request<pb::RegisterWorkerRequest>,
    ) -> Result<Response<pb::RegisterWorkerResponse>, Status> {
        let request = request.into_inner();
        let worker_id = request.worker_id;
        let invalid = |message: String| {
            self.rejected(
                "invalid_argument",
                Status::invalid_argument(format!("worker {worker_id}: {message}")),
            )
        };
        let source = EngineSource::from_fields(
            &request.events_endpoint,
            &request.events_dialect,
            &request.replay_endpoint,
        )
        .map_err(invalid)?;
        if let Some(source) = &source {
            source
                .events_config(
                    worker_id,
                    &request.model,
                    request.block_size.max(1),
                    request.dp_start_rank,
                    request.dp_size,
                )
                .map_err(invalid)?;
        }
        if self.subscriptions.is_configured(worker_id) {
            return Err(self.rejected(
                "failed_precondition",
                Status::failed_precondition(format!(
                    "worker {worker_id} is configured by `kvroute serve --engine`; it cannot be registered over gRPC"
                )),
            ));
        }
        let registration =
            convert::registration_from_pb(request).map_err(|e| self.fail(e.into()))?;
        let outcome = self
            .core
            .register_worker(registration)
            .map_err(|e| self.fail(e.into()))?;
        if let Some(previous) = outcome.invalidated {
            let removed = self.ingest.remove_worker(worker_id, previous.model).await;
            tracing::info!(
                worker_id,
                removed,
                "re-registration changed layout: blocks dropped"
            );
        }
        let record = self.core.registry.read().get(worker_id).cloned();
        if let Some(record) = record {
            self.ingest.reserve(&record.snapshot()).await;
            self.subscriptions
                .update(&record, source, false)
                .await
                .map_err(invalid)?;
        }
        tracing::info!(worker_id, created = outcome.created, "worker registered");
        self.core.drain_queue();
        Ok(Response::new(pb::RegisterWorkerResponse {
            created: outcome.created,
            lease_ttl_secs: u32::try_from(outcome.lease_ttl.as_secs()).unwrap_or(u32::MAX),
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let request = request.into_inner();
        let loads: Vec<_> = request
            .load
            .iter()
            .map(convert::rank_load_from_pb)
            .collect();
        let ttl = self
            .core
            .heartbeat(request.worker_id, &loads)
            .map_err(|e| self.fail(e.into()))?;
        self.core.drain_queue();
        Ok(Response::new(pb::HeartbeatResponse {
            lease_ttl_secs: u32::try_from(ttl.as_secs()).unwrap_or(u32::MAX),
        }))
    }

    async fn deregister_worker(
        &self,
        request: Request<pb::DeregisterWorkerRequest>,
    ) -> Result<Response<pb::DeregisterWorkerResponse>, Status> {
        let worker_id = request.into_inner().worker_id;
        let record = self
            .core
            .deregister_worker(worker_id)
            .map_err(|e| self.fail(e.into()))?;
        self.subscriptions.stop(worker_id).await;
        let blocks_removed = self
            .ingest
            .remove_worker(worker_id, record.registration.model)
            .await;
        self.core.forget_worker(worker_id);
        tracing::info!(worker_id, blocks_removed, "worker deregistered");
        Ok(Response::new(pb::DeregisterWorkerResponse {
            blocks_removed,
        }))
    }

    type PublishEventsStream = ReplyStream;

    async fn publish_events(
        &self,
        request: Request<Streaming<pb::KvEventBatch>>,
    ) -> Result<Response<Self::PublishEventsStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel::<Result<pb::PublishEventsReply, Status>>(4);
        let service = self.clone();
        self.core.metrics.event_streams.inc();
        tokio::spawn(async move {
            while let Some(next) = inbound.next().await {
                let batch = match next {
                    Ok(batch) => batch,
                    Err(status) => {
                        // The client's side broke (reset, oversized message):
                        // report it if the client still listens.
                        let _ = tx.send(Err(service.fail(status))).await;
                        break;
                    }
                };
                let reply = service.apply_batch(batch).await;
                let failed = reply.is_err();
                if tx.send(reply).await.is_err() || failed {
                    break;
                }
            }
            service.core.metrics.event_streams.dec();
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

impl WorkersService {
    /// Validates one batch against its worker, applies it through the
    /// writer and builds the reply. An error ends the stream it came on.
    async fn apply_batch(&self, batch: pb::KvEventBatch) -> Result<pb::PublishEventsReply, Status> {
        let limits = BatchLimits {
            max_events: self.core.config.max_events_per_batch as usize,
            max_blocks_per_event: self.core.config.max_blocks_per_event as usize,
        };
        let count = batch.events.len() as u64;
        let validated = {
            let registry = self.core.registry.read();
            let worker = registry
                .rank(batch.worker_id, batch.dp_rank)
                .map_err(Status::from);
            worker.and_then(|w| convert::batch_from_pb(batch, w, limits).map_err(Status::from))
        };
        let validated = match validated {
            Ok(v) => v,
            Err(status) => {
                let reason = match status.code() {
                    tonic::Code::NotFound => "unknown_worker",
                    _ => "malformed",
                };
                self.core.count_events("rejected", reason, count);
                return Err(self.rejected(reason, status));
            }
        };
        let worker_id = validated.worker_id;
        let outcome = self
            .ingest
            .apply(validated)
            .await
            .map_err(|e| self.fail(e.into()))?;
        if let Some(rejection) = &outcome.first_rejection {
            tracing::debug!(worker_id, %rejection, rejected = outcome.rejected, "events rejected");
        }
        Ok(pb::PublishEventsReply {
            dp_rank: outcome.dp_rank,
            last_applied_event_id: outcome.last_applied.unwrap_or(0),
            resend_from_event_id: outcome.resend_from,
            skipped: outcome.skipped,
            rejected: outcome.rejected,
        })
    }
}
