//! The seam between the gRPC handlers and cluster mode. Alone, a handler
//! changes the fleet directly; as one replica of a cluster, a change that
//! decides what the index holds (registration, removal, events) must go
//! through the shared log so every replica makes it in the same order, and
//! leases, cordons and load must reach the other replicas. `crate::cluster`
//! implements this trait; the handlers validate first, so nothing
//! malformed reaches the log.

use tonic::Status;

use crate::{
    ingest::{BatchOutcome, ValidatedBatch},
    pb,
};
use kvroute_core::{
    registry::RegisterOutcome,
    types::{DpRank, RankLoad, WorkerId},
};

#[tonic::async_trait]
pub trait Replication: Send + Sync + 'static {
    /// Appends a (validated) registration to the log and answers once this
    /// replica applied it.
    async fn register(&self, request: pb::RegisterWorkerRequest)
    -> Result<RegisterOutcome, Status>;

    /// Appends a deregistration; answers with the blocks it removed here.
    async fn deregister(&self, worker_id: WorkerId) -> Result<u64, Status>;

    /// Shares a heartbeat this replica has applied (its lease and load).
    async fn heartbeat(&self, worker_id: WorkerId, loads: &[(DpRank, RankLoad)]);

    /// Shares a cordon change this replica has applied.
    async fn set_cordoned(&self, worker_id: WorkerId, cordoned: bool) -> Result<(), Status>;

    /// Appends a validated batch; answers once this replica applied it,
    /// with what its writer did (the same on every replica).
    async fn publish(&self, batch: ValidatedBatch) -> Result<BatchOutcome, Status>;

    /// Writes the cluster's snapshot now (Admin `Snapshot`).
    async fn snapshot(&self) -> Result<pb::SnapshotResponse, Status>;
}
