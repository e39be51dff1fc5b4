//! The one seam between the Workers and Admin handlers and the fleet.
//! Every change a worker or an operator asks for (register, heartbeat,
//! deregister, cordon, events) goes through [`FleetChanges`], in domain
//! types with [`FleetError`]. Alone, [`LocalChanges`] makes it on this
//! process's fleet. As one replica of a cluster, the cluster's
//! implementation orders what decides the index through the shared log and
//! shares leases, load and cordons. `app.rs` chooses one at start; the
//! handlers translate, call and never know which.

use std::{sync::Arc, time::Duration};

use futures::future::BoxFuture;

use super::{Fleet, FleetError, WorkerView};
use crate::{
    engine_events::EngineSource,
    ingest::{BatchOutcome, ValidatedBatch},
};
use kvroute_core::{
    registry::{RegisterOutcome, Registration},
    types::{DpRank, RankLoad, WorkerId},
};

/// What the handlers ask of the fleet. Each call validates what it must
/// before anything changes, so a refused call changes nothing.
pub trait FleetChanges: Send + Sync + 'static {
    /// Registers or updates a worker (and its engine subscription).
    fn register(
        &self,
        registration: Registration,
        source: Option<EngineSource>,
    ) -> BoxFuture<'_, Result<RegisterOutcome, FleetError>>;

    /// Renews a lease and records reported load; answers with the TTL.
    fn heartbeat<'a>(
        &'a self,
        worker_id: WorkerId,
        loads: &'a [(DpRank, RankLoad)],
    ) -> BoxFuture<'a, Result<Duration, FleetError>>;

    /// Removes a worker with its blocks; answers with the blocks removed.
    fn deregister(&self, worker_id: WorkerId) -> BoxFuture<'_, Result<u64, FleetError>>;

    /// Cordons or uncordons a worker; answers with its view after.
    fn set_cordoned(
        &self,
        worker_id: WorkerId,
        cordoned: bool,
    ) -> BoxFuture<'_, Result<WorkerView, FleetError>>;

    /// Applies a validated batch of events; answers with what the writer
    /// did.
    fn publish(&self, batch: ValidatedBatch) -> BoxFuture<'_, Result<BatchOutcome, FleetError>>;
}

/// Why a replica could not make a change: what the caller can do about
/// it, with the cluster's own error as its message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReplicationError {
    /// It could not be ordered or shared with the other replicas now (NATS
    /// away, the log slow, the replica still joining). Nothing changed:
    /// the caller retries.
    #[error("{0}")]
    Unavailable(String),
    /// It cannot go through the shared log as it is (an event over what
    /// one log record holds).
    #[error("{0}")]
    Refused(String),
    /// The log answered with something it should not have.
    #[error("{0}")]
    Inconsistent(String),
}

/// Changes made on this process's fleet alone.
#[derive(Clone)]
pub struct LocalChanges(pub Arc<Fleet>);

impl FleetChanges for LocalChanges {
    fn register(
        &self,
        registration: Registration,
        source: Option<EngineSource>,
    ) -> BoxFuture<'_, Result<RegisterOutcome, FleetError>> {
        Box::pin(self.0.register(registration, source))
    }

    fn heartbeat<'a>(
        &'a self,
        worker_id: WorkerId,
        loads: &'a [(DpRank, RankLoad)],
    ) -> BoxFuture<'a, Result<Duration, FleetError>> {
        Box::pin(async move { self.0.heartbeat(worker_id, loads) })
    }

    fn deregister(&self, worker_id: WorkerId) -> BoxFuture<'_, Result<u64, FleetError>> {
        Box::pin(self.0.deregister(worker_id))
    }

    fn set_cordoned(
        &self,
        worker_id: WorkerId,
        cordoned: bool,
    ) -> BoxFuture<'_, Result<WorkerView, FleetError>> {
        Box::pin(async move { self.0.set_cordoned(worker_id, cordoned) })
    }

    fn publish(&self, batch: ValidatedBatch) -> BoxFuture<'_, Result<BatchOutcome, FleetError>> {
        Box::pin(self.0.apply_events(batch))
    }
}
