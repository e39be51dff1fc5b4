//! The `kvroute.v1.Router` service.

use std::sync::Arc;

use crate::core::RouterCore;

/// Handlers of `kvroute.v1.Router`.
#[derive(Clone)]
pub struct RouterService {
    #[allow(dead_code)]
    core: Arc<RouterCore>,
}

impl RouterService {
    pub fn new(core: Arc<RouterCore>) -> Self {
        Self { core }
    }
}

#[tonic::async_trait]
impl crate::pb::router_server::Router for RouterService {
    async fn select_worker(
        &self,
        _request: tonic::Request<crate::pb::SelectWorkerRequest>,
    ) -> Result<tonic::Response<crate::pb::SelectWorkerResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented(
            "kvroute.v1.Router/SelectWorker is not implemented yet",
        ))
    }
    async fn mark_prefill_complete(
        &self,
        _request: tonic::Request<crate::pb::MarkPrefillCompleteRequest>,
    ) -> Result<tonic::Response<crate::pb::MarkPrefillCompleteResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented(
            "kvroute.v1.Router/MarkPrefillComplete is not implemented yet",
        ))
    }
    async fn release_request(
        &self,
        _request: tonic::Request<crate::pb::ReleaseRequestRequest>,
    ) -> Result<tonic::Response<crate::pb::ReleaseRequestResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented(
            "kvroute.v1.Router/ReleaseRequest is not implemented yet",
        ))
    }
}
