//! Why something of cluster mode failed, typed, so that a caller can tell
//! what to do: the start stops with one line; a worker's or operator's
//! change answers through `fleet::changes::ReplicationError` (unavailable,
//! refused or inconsistent), which the gRPC layer maps to a code in one
//! place.

use super::log::AppendError;
use crate::fleet::{FleetError, changes::ReplicationError};
use kvroute_core::types::WorkerId;

/// Another crate's error, kept whole for its message and source chain.
pub type Source = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// A NATS call failed (connection, stream, bucket, object store).
    #[error("NATS: {what}: {source}")]
    Nats {
        what: &'static str,
        #[source]
        source: Source,
    },
    #[error(transparent)]
    Append(#[from] AppendError),
    #[error("stopped before NATS was reachable")]
    Stopped,
    #[error("the shared log was not caught up with (position {position})")]
    NotCaughtUp { position: u64 },
    #[error("the log follower has stopped")]
    FollowerStopped,
    #[error("the cluster snapshot does not decode: {0}")]
    SnapshotUnreadable(#[source] Source),
    #[error("worker {worker_id}: entry kept changing")]
    EntryContended { worker_id: WorkerId },
    #[error("NATS is unreachable: a cordon could not reach the other replicas")]
    CordonNotShared,
    #[error("this replica is still joining its cluster")]
    Joining,
    #[error(
        "events[{index}] takes {size} bytes, over the {limit} a cluster log record holds (NATS max_payload)"
    )]
    RecordTooLarge {
        index: usize,
        size: usize,
        limit: usize,
    },
    #[error("the log applied another record")]
    WrongRecord,
    #[error("a background task ended abnormally: {0}")]
    Task(#[from] tokio::task::JoinError),
}

impl ClusterError {
    pub(crate) fn nats(what: &'static str, error: impl Into<Source>) -> Self {
        ClusterError::Nats {
            what,
            source: error.into(),
        }
    }
}

/// What a caller of the fleet's seam can do about it.
impl From<ClusterError> for ReplicationError {
    fn from(error: ClusterError) -> Self {
        let message = error.to_string();
        match error {
            ClusterError::RecordTooLarge { .. } => ReplicationError::Refused(message),
            ClusterError::WrongRecord => ReplicationError::Inconsistent(message),
            _ => ReplicationError::Unavailable(message),
        }
    }
}

impl From<ClusterError> for FleetError {
    fn from(error: ClusterError) -> Self {
        FleetError::Replication(error.into())
    }
}
