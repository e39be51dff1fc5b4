//! The `kvroute.v1.Workers` service: registration, leases, load and the
//! `PublishEvents` stream. Handlers translate (`convert`) and call the
//! fleet's seam (`fleet::changes`), alone or as a replica without knowing
//! which; event batches are validated here, with no lock held, and applied
//! by the index's one writer.

use std::{pin::Pin, sync::Arc};

use tokio::sync::mpsc;
use tokio_stream::{Stream, wrappers::ReceiverStream};
use tonic::{Request, Response, Status, Streaming};

use crate::{
    fleet::{Fleet, FleetError, changes::FleetChanges},
    grpc::{
        convert::{self, BatchLimits},
        event_inbox::Inbox,
        status::reason_label,
    },
    pb,
    security::{self, EndpointAllow, Identity, endpoint_allow},
};
use kvroute_core::registry::RegistryError;

/// Handlers of `kvroute.v1.Workers`.
#[derive(Clone)]
pub struct WorkersService {
    /// What the handlers read (views, event targets, limits).
    fleet: Arc<Fleet>,
    /// What they change, alone or through the cluster (`app.rs` chooses).
    changes: Arc<dyn FleetChanges>,
    /// Hosts a registration's events endpoint may point at.
    endpoint_allow: Arc<EndpointAllow>,
}

impl WorkersService {
    pub(crate) fn new(fleet: Arc<Fleet>, changes: Arc<dyn FleetChanges>) -> Self {
        Self {
            fleet,
            changes,
            endpoint_allow: Arc::default(),
        }
    }

    /// Checks registrations' events endpoints against `allow`.
    pub(crate) fn with_endpoint_allow(self, allow: EndpointAllow) -> Self {
        Self {
            endpoint_allow: Arc::new(allow),
            ..self
        }
    }

    fn rejected(&self, reason: &'static str, status: Status) -> Status {
        self.fleet
            .router()
            .metrics()
            .input_rejected
            .with_label_values(&["workers", reason])
            .inc();
        status
    }

    fn fail(&self, status: Status) -> Status {
        let label = reason_label(&status);
        self.rejected(label, status)
    }

    /// A worker identity may act only for its own worker ids.
    fn check_worker_id(
        &self,
        caller: Option<&Identity>,
        method: &str,
        worker_id: u64,
    ) -> Result<(), Status> {
        security::check_worker_id(caller, worker_id).inspect_err(|_| {
            self.fleet
                .router()
                .metrics()
                .security
                .auth_decisions
                .with_label_values(&[method, "worker", "denied"])
                .inc();
        })
    }
}

type ReplyStream = Pin<Box<dyn Stream<Item = Result<pb::PublishEventsReply, Status>> + Send>>;

#[tonic::async_trait]
impl pb::workers_server::Workers for WorkersService {
    async fn register_worker(
        &self,
        request: Request<pb::RegisterWorkerRequest>,
    ) -> Result<Response<pb::RegisterWorkerResponse>, Status> {
        let peer = request.remote_addr().map(|a| a.ip());
        self.check_worker_id(
            security::caller(request.extensions()).map(|c| &**c),
            "/kvroute.v1.Workers/RegisterWorker",
            request.get_ref().worker_id,
        )?;
        let request = request.into_inner();
        let (registration, source) =
            convert::registration_from_pb(request).map_err(|e| self.fail(e.into()))?;
        // No connection is made to a host the worker may not name; the
        // answer is the same whether or not anything listens there.
        // The HTTP endpoint too: the endpoint picker sends requests there.
        if let Some(field) =
            self.endpoint_allow
                .refused_field(&registration.endpoint, source.as_ref(), peer)
        {
            self.fleet
                .router()
                .metrics()
                .security
                .endpoints_refused
                .inc();
            return Err(self.fail(Status::permission_denied(format!(
                "worker {}: {field}: {}",
                registration.worker_id,
                endpoint_allow::REFUSED
            ))));
        }
        let outcome = self
            .changes
            .register(registration, source)
            .await
            .map_err(|e| self.fail(e.into()))?;
        Ok(Response::new(pb::RegisterWorkerResponse {
            created: outcome.created,
            lease_ttl_secs: u32::try_from(outcome.lease_ttl.as_secs()).unwrap_or(u32::MAX),
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        self.check_worker_id(
            security::caller(request.extensions()).map(|c| &**c),
            "/kvroute.v1.Workers/Heartbeat",
            request.get_ref().worker_id,
        )?;
        let request = request.into_inner();
        if request.load.len() > kvroute_core::registry::MAX_DP_SIZE as usize {
            return Err(self.fail(Status::invalid_argument(format!(
                "worker {}: load: {} entries is over the limit of {} (one per dp rank)",
                request.worker_id,
                request.load.len(),
                kvroute_core::registry::MAX_DP_SIZE
            ))));
        }
        let loads: Vec<_> = request
            .load
            .iter()
            .map(convert::rank_load_from_pb)
            .collect();
        let ttl = self
            .changes
            .heartbeat(request.worker_id, &loads)
            .await
            .map_err(|e| self.fail(e.into()))?;
        Ok(Response::new(pb::HeartbeatResponse {
            lease_ttl_secs: u32::try_from(ttl.as_secs()).unwrap_or(u32::MAX),
        }))
    }

    async fn deregister_worker(
        &self,
        request: Request<pb::DeregisterWorkerRequest>,
    ) -> Result<Response<pb::DeregisterWorkerResponse>, Status> {
        self.check_worker_id(
            security::caller(request.extensions()).map(|c| &**c),
            "/kvroute.v1.Workers/DeregisterWorker",
            request.get_ref().worker_id,
        )?;
        let worker_id = request.into_inner().worker_id;
        let blocks_removed = self
            .changes
            .deregister(worker_id)
            .await
            .map_err(|e| self.fail(e.into()))?;
        Ok(Response::new(pb::DeregisterWorkerResponse {
            blocks_removed,
        }))
    }

    type PublishEventsStream = ReplyStream;

    async fn publish_events(
        &self,
        request: Request<Streaming<pb::KvEventBatch>>,
    ) -> Result<Response<Self::PublishEventsStream>, Status> {
        let caller = security::caller(request.extensions()).cloned();
        let metrics = self.fleet.router().metrics();
        let overruns = metrics
            .input_rejected
            .with_label_values(&["workers", "unanswered"]);
        let mut inbox = Inbox::read(request.into_inner(), move || overruns.inc());
        let (tx, rx) = mpsc::channel::<Result<pb::PublishEventsReply, Status>>(4);
        let service = self.clone();
        let streams = metrics.event_streams.clone();
        streams.inc();
        tokio::spawn(async move {
            while let Some(next) = inbox.next().await {
                let batch = match next {
                    Ok(batch) => batch,
                    Err(status) => {
                        // The client's side broke (reset, oversized message):
                        // report it if the client still listens.
                        let _ = tx.send(Err(service.fail(status))).await;
                        break;
                    }
                };
                let reply = match service.check_worker_id(
                    caller.as_deref(),
                    "/kvroute.v1.Workers/PublishEvents",
                    batch.worker_id,
                ) {
                    Ok(()) => service.apply_batch(batch).await,
                    Err(status) => Err(status),
                };
                let failed = reply.is_err();
                if tx.send(reply).await.is_err() || failed {
                    break;
                }
            }
            streams.dec();
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

impl WorkersService {
    /// Validates one batch against its worker, applies it through the
    /// writer and builds the reply. An error ends the stream it came on.
    async fn apply_batch(&self, batch: pb::KvEventBatch) -> Result<pb::PublishEventsReply, Status> {
        let limits = self.fleet.router().config().limits;
        let limits = BatchLimits {
            max_events: limits.max_events_per_batch as usize,
            max_blocks_per_event: limits.max_blocks_per_event as usize,
        };
        let count = batch.events.len() as u64;
        let validated = match self.fleet.event_target(batch.worker_id, batch.dp_rank) {
            Err(error) => Err((not_a_target(&error), Status::from(error))),
            Ok(target) => convert::batch_from_pb(batch, &target, limits).map_err(|e| {
                // A registered rank's malformed batch: its events count
                // as rejected in the Admin API too.
                self.fleet.count_rejected(target, count);
                ("malformed", Status::from(e))
            }),
        };
        let validated = match validated {
            Ok(v) => v,
            Err((reason, status)) => {
                if count > 0 {
                    self.fleet
                        .router()
                        .metrics()
                        .events
                        .with_label_values(&["rejected", reason])
                        .inc_by(count);
                }
                return Err(self.rejected(reason, status));
            }
        };
        let worker_id = validated.worker_id;
        let outcome = self
            .changes
            .publish(validated)
            .await
            .map_err(|e| self.fail(e.into()))?;
        if let Some(rejection) = &outcome.first_rejection {
            tracing::debug!(worker_id, %rejection, rejected = outcome.rejected, "events rejected");
        }
        if outcome.resync_required {
            tracing::debug!(worker_id, dp_rank = outcome.dp_rank, "resync required");
        }
        Ok(convert::publish_reply_to_pb(&outcome))
    }
}

/// The metric label of a batch whose (worker, rank) takes no events: an
/// unknown worker, one that publishes none (APPROXIMATE), or else a batch
/// naming what it may not (a rank the worker does not have).
fn not_a_target(error: &FleetError) -> &'static str {
    match error {
        FleetError::Registry(RegistryError::UnknownWorker { .. })
        | FleetError::Ingest(crate::ingest::IngestError::WorkerGone { .. }) => "unknown_worker",
        FleetError::Registry(RegistryError::PublishesNoEvents { .. }) => "approximate_worker",
        _ => "malformed",
    }
}
