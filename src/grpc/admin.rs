//! The `kvroute.v1.Admin` service.

use std::sync::Arc;

use crate::core::RouterCore;

/// Handlers of `kvroute.v1.Admin`.
#[derive(Clone)]
pub struct AdminService {
    #[allow(dead_code)]
    core: Arc<RouterCore>,
}

impl AdminService {
    pub fn new(core: Arc<RouterCore>) -> Self {
        Self { core }
    }
}

type Res<T> = Result<tonic::Response<T>, tonic::Status>;

#[tonic::async_trait]
impl crate::pb::admin_server::Admin for AdminService {
    async fn list_workers(
        &self,
        _r: tonic::Request<crate::pb::ListWorkersRequest>,
    ) -> Res<crate::pb::ListWorkersResponse> {
        Err(tonic::Status::unimplemented(
            "kvroute.v1.Admin/ListWorkers is not implemented yet",
        ))
    }
    async fn get_worker(
        &self,
        _r: tonic::Request<crate::pb::GetWorkerRequest>,
    ) -> Res<crate::pb::WorkerInfo> {
        Err(tonic::Status::unimplemented(
            "kvroute.v1.Admin/GetWorker is not implemented yet",
        ))
    }
    async fn explain_selection(
        &self,
        _r: tonic::Request<crate::pb::SelectWorkerRequest>,
    ) -> Res<crate::pb::ExplainSelectionResponse> {
        Err(tonic::Status::unimplemented(
            "kvroute.v1.Admin/ExplainSelection is not implemented yet",
        ))
    }
    async fn get_index_stats(
        &self,
        _r: tonic::Request<crate::pb::GetIndexStatsRequest>,
    ) -> Res<crate::pb::IndexStats> {
        Err(tonic::Status::unimplemented(
            "kvroute.v1.Admin/GetIndexStats is not implemented yet",
        ))
    }
    async fn cordon_worker(
        &self,
        _r: tonic::Request<crate::pb::CordonWorkerRequest>,
    ) -> Res<crate::pb::WorkerInfo> {
        Err(tonic::Status::unimplemented(
            "kvroute.v1.Admin/CordonWorker is not implemented yet",
        ))
    }
    async fn uncordon_worker(
        &self,
        _r: tonic::Request<crate::pb::UncordonWorkerRequest>,
    ) -> Res<crate::pb::WorkerInfo> {
        Err(tonic::Status::unimplemented(
            "kvroute.v1.Admin/UncordonWorker is not implemented yet",
        ))
    }
}
