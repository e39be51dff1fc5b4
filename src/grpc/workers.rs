//! The `kvroute.v1.Workers` service.

use std::sync::Arc;

use crate::core::RouterCore;

/// Handlers of `kvroute.v1.Workers`.
#[derive(Clone)]
pub struct WorkersService {
    #[allow(dead_code)]
    core: Arc<RouterCore>,
}

impl WorkersService {
    pub fn new(core: Arc<RouterCore>) -> Self {
        Self { core }
    }
}

#[tonic::async_trait]
impl crate::pb::workers_server::Workers for WorkersService {
    async fn register_worker(
        &self,
        _request: tonic::Request<crate::pb::RegisterWorkerRequest>,
    ) -> Result<tonic::Response<crate::pb::RegisterWorkerResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented(
            "kvroute.v1.Workers/RegisterWorker is not implemented yet",
        ))
    }
    async fn heartbeat(
        &self,
        _request: tonic::Request<crate::pb::HeartbeatRequest>,
    ) -> Result<tonic::Response<crate::pb::HeartbeatResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented(
            "kvroute.v1.Workers/Heartbeat is not implemented yet",
        ))
    }
    async fn deregister_worker(
        &self,
        _request: tonic::Request<crate::pb::DeregisterWorkerRequest>,
    ) -> Result<tonic::Response<crate::pb::DeregisterWorkerResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented(
            "kvroute.v1.Workers/DeregisterWorker is not implemented yet",
        ))
    }
    type PublishEventsStream = std::pin::Pin<
        Box<
            dyn tokio_stream::Stream<Item = Result<crate::pb::PublishEventsReply, tonic::Status>>
                + Send,
        >,
    >;
    async fn publish_events(
        &self,
        _request: tonic::Request<tonic::Streaming<crate::pb::KvEventBatch>>,
    ) -> Result<tonic::Response<Self::PublishEventsStream>, tonic::Status> {
        Err(tonic::Status::unimplemented(
            "kvroute.v1.Workers/PublishEvents is not implemented yet",
        ))
    }
}
