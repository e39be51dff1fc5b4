//! Cluster snapshots in the `<cluster>_snapshots` object store: one
//! object, the newest, with the log position it covers. A replica that
//! starts loads it and reads the log from the next position, instead of
//! the whole log.
//!
//! One replica writes it per interval: each replica, every interval,
//! reads the `snapshot` entry of the control bucket, and when the last
//! write is an interval old tries to replace it at the revision it read;
//! the one replica that succeeds captures (between two log records, so
//! the state is exactly the log up to its position) and writes.

use std::{sync::Arc, time::Duration};

use async_nats::jetstream::{kv, object_store::ObjectStore};
use bytes::Bytes;
use prost::Message;
use tokio::io::AsyncReadExt;
use tokio_util::sync::CancellationToken;

use super::{
    error::ClusterError,
    log::{Log, unix_us},
};
use crate::{
    fleet::state::FleetState,
    metrics::Metrics,
    pb,
    snapshot::{Written, convert, format},
};

const OBJECT: &str = "snapshot";
const CONTROL_KEY: &str = "snapshot";

/// The newest snapshot, as loaded.
pub struct LoadedSnapshot {
    pub position: u64,
    pub state: FleetState,
    pub bytes: usize,
}

/// Writes and loads the cluster's snapshot.
pub struct ClusterSnapshots {
    pub store: ObjectStore,
    pub control: kv::Store,
    pub log: Arc<Log>,
    pub metrics: Arc<Metrics>,
}

impl std::fmt::Debug for ClusterSnapshots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterSnapshots").finish_non_exhaustive()
    }
}

impl ClusterSnapshots {
    /// The newest snapshot; `Ok(None)` when there is none yet. An object
    /// that does not decode is an error: starting from the log's start
    /// instead could miss records retention already dropped.
    pub(crate) async fn load(&self) -> Result<Option<LoadedSnapshot>, ClusterError> {
        let mut object = match self.store.get(OBJECT).await {
            Ok(object) => object,
            Err(error)
                if error.kind() == async_nats::jetstream::object_store::GetErrorKind::NotFound =>
            {
                return Ok(None);
            }
            Err(error) => return Err(ClusterError::nats("read the cluster snapshot", error)),
        };
        let mut bytes = Vec::new();
        object
            .read_to_end(&mut bytes)
            .await
            .map_err(|e| ClusterError::nats("read the cluster snapshot", e))?;
        let size = bytes.len();
        let (position, state) = tokio::task::spawn_blocking(move || {
            let unreadable = |e: String| ClusterError::SnapshotUnreadable(e.into());
            let snapshot = pb::ClusterSnapshot::decode(bytes.as_slice())
                .map_err(|e| ClusterError::SnapshotUnreadable(e.into()))?;
            let state = format::decode(&snapshot.state).map_err(|e| unreadable(e.to_string()))?;
            let state = convert::state_from_pb(state).map_err(|e| unreadable(e.to_string()))?;
            Ok::<_, ClusterError>((snapshot.log_position, state))
        })
        .await??;
        self.metrics
            .snapshot
            .outcomes
            .with_label_values(&["loaded"])
            .inc();
        Ok(Some(LoadedSnapshot {
            position,
            state,
            bytes: size,
        }))
    }

    /// Captures between two log records and writes the object.
    pub(crate) async fn write(&self) -> Result<Written, ClusterError> {
        let started = tokio::time::Instant::now();
        let captured = self
            .log
            .capture()
            .await
            .ok_or(ClusterError::FollowerStopped)?;
        let capture_seconds = started.elapsed().as_secs_f64();
        let (entries, workers) = (
            captured.state.entries(),
            captured.state.workers.len() as u64,
        );
        let position = captured.position;
        let started = tokio::time::Instant::now();
        let bytes = tokio::task::spawn_blocking(move || {
            let state = format::encode(&convert::state_to_pb(&captured.state, unix_us() / 1000));
            pb::ClusterSnapshot {
                log_position: position,
                state,
            }
            .encode_to_vec()
        })
        .await?;
        let size = bytes.len();
        let mut reader = bytes.as_slice();
        let written = self.store.put(OBJECT, &mut reader).await;
        let s = &self.metrics.snapshot;
        match written {
            Ok(_) => {
                s.outcomes.with_label_values(&["written"]).inc();
                s.bytes.set(i64::try_from(size).unwrap_or(i64::MAX));
                s.age.set(0.0);
                tracing::info!(position, bytes = size, "cluster snapshot written");
                Ok(Written {
                    path: format!("nats object store, log position {position}").into(),
                    bytes: size as u64,
                    entries,
                    workers,
                    capture_seconds,
                    write_seconds: started.elapsed().as_secs_f64(),
                })
            }
            Err(error) => {
                s.outcomes.with_label_values(&["write_failed"]).inc();
                Err(ClusterError::nats("write the cluster snapshot", error))
            }
        }
    }

    /// Every `interval` until `stop`: writes the snapshot if no replica
    /// has for an interval and this one wins the claim.
    pub(crate) async fn every(self: Arc<Self>, interval: Duration, stop: CancellationToken) {
        let interval_ms = u64::try_from(interval.as_millis()).unwrap_or(u64::MAX);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(interval) => {}
            }
            let now_ms = unix_us() / 1000;
            let claim = Bytes::from(now_ms.to_le_bytes().to_vec());
            let won = match self.control.entry(CONTROL_KEY).await {
                Ok(Some(entry)) => {
                    let last = entry
                        .value
                        .get(..8)
                        .and_then(|b| b.try_into().ok())
                        .map_or(0, u64::from_le_bytes);
                    // A little under an interval: the replicas' timers drift.
                    now_ms.saturating_sub(last) >= interval_ms * 9 / 10
                        && self
                            .control
                            .update(CONTROL_KEY, claim, entry.revision)
                            .await
                            .is_ok()
                }
                Ok(None) => self.control.create(CONTROL_KEY, claim).await.is_ok(),
                Err(_) => false,
            };
            if won && let Err(error) = self.write().await {
                tracing::warn!(%error, "cluster snapshot not written");
            }
        }
    }
}
