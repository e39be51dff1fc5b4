//! Leases, cordons and reported load in the `<cluster>_workers` key-value
//! bucket (one entry per worker), and the removal of lapsed leases.
//!
//! A heartbeat or a cordon at any replica rewrites the worker's entry
//! (compare-and-set on the revision it read, so a cordon and a heartbeat
//! at two replicas never undo each other); every replica watches the
//! bucket and renews, cordons and loads its own registry to match.
//!
//! Expiry is decided once: each replica checks the entries' deadlines,
//! and to remove a lapsed worker it must first replace the entry, at the
//! revision it read, with one marked lapsed. Only one replica's replacement
//! succeeds (a heartbeat in between changes the revision and makes all
//! fail); that replica appends the lapse to the shared log, which removes
//! the worker on every replica. nats-server 2.9 has no per-message TTL,
//! so the deadline lives in the entry.
//!
//! After the NATS connection comes back, no replica reaps for one lease
//! length: heartbeats taken while NATS was away renewed only local leases,
//! and their workers get that long to write their entries again.

use std::{collections::HashMap, sync::Arc, time::Duration};

use async_nats::jetstream::kv::{self, Operation};
use bytes::Bytes;
use futures::StreamExt;
use parking_lot::Mutex;
use prost::Message;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{
    error::ClusterError,
    log::{Log, unix_us},
};
use crate::{
    fleet::Fleet,
    grpc::convert,
    pb::{self, log_record::Body},
};
use kvroute_core::types::{DpRank, RankLoad, WorkerId};

/// Tries of one compare-and-set before giving up (another replica keeps
/// winning).
const CAS_TRIES: usize = 8;

/// The workers bucket, and what this replica last saw of it.
pub struct Leases {
    kv: kv::Store,
    fleet: Arc<Fleet>,
    log: Arc<Log>,
    /// Each worker's newest entry and its revision.
    seen: Mutex<HashMap<WorkerId, (u64, pb::WorkerLease)>>,
    /// No reaping before this (see the module docs).
    hold_until: Mutex<Instant>,
}

impl std::fmt::Debug for Leases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leases").finish_non_exhaustive()
    }
}

fn key(worker_id: WorkerId) -> String {
    worker_id.to_string()
}

fn unix_ms() -> u64 {
    unix_us() / 1000
}

impl Leases {
    pub(crate) fn new(kv: kv::Store, fleet: Arc<Fleet>, log: Arc<Log>) -> Self {
        Self {
            kv,
            fleet,
            log,
            seen: Mutex::new(HashMap::new()),
            hold_until: Mutex::new(Instant::now()),
        }
    }

    /// The worker's entry as this replica holds it now.
    fn local_entry(&self, worker_id: WorkerId) -> Option<pb::WorkerLease> {
        let record = self.fleet.router().worker(worker_id)?;
        let ttl_ms = u64::try_from(record.lease_ttl.as_millis()).unwrap_or(u64::MAX);
        Some(pb::WorkerLease {
            generation: record.generation,
            lease_ttl_ms: ttl_ms,
            expires_unix_ms: unix_ms().saturating_add(ttl_ms),
            cordoned: record.cordoned,
            load: record
                .load
                .iter()
                .map(|(rank, load)| convert::rank_load_to_pb(*rank, *load))
                .collect(),
            lapsed: false,
        })
    }

    /// Rewrites a worker's entry with `change` applied to what the bucket
    /// holds (or to `local`, this replica's view, when the bucket holds
    /// nothing of this registration).
    async fn modify(
        &self,
        worker_id: WorkerId,
        local: &pb::WorkerLease,
        change: impl Fn(&mut pb::WorkerLease),
    ) -> Result<(), ClusterError> {
        for _ in 0..CAS_TRIES {
            let current = self
                .kv
                .entry(key(worker_id))
                .await
                .map_err(|e| ClusterError::nats("read a lease entry", e))?;
            let (revision, mut entry) = match current {
                Some(e) if e.operation == Operation::Put => {
                    let entry = pb::WorkerLease::decode(e.value).unwrap_or_default();
                    (Some(e.revision), entry)
                }
                Some(e) => (Some(e.revision), local.clone()),
                None => (None, local.clone()),
            };
            if entry.generation != local.generation || entry.lapsed {
                entry = local.clone();
            }
            change(&mut entry);
            let value = Bytes::from(entry.encode_to_vec());
            // A failed write means another replica wrote in between (or
            // the bucket is away): read again and retry.
            let written = match revision {
                Some(revision) => self
                    .kv
                    .update(key(worker_id), value, revision)
                    .await
                    .is_ok(),
                None => self.kv.create(key(worker_id), value).await.is_ok(),
            };
            if written {
                return Ok(());
            }
        }
        Err(ClusterError::EntryContended { worker_id })
    }

    /// A registration this replica applied: the entry starts (or a
    /// re-registration renews it, keeping the cordon).
    pub(crate) async fn registered(&self, worker_id: WorkerId) -> Result<(), ClusterError> {
        let Some(local) = self.local_entry(worker_id) else {
            return Ok(());
        };
        self.modify(worker_id, &local, |e| {
            e.expires_unix_ms = local.expires_unix_ms;
            e.lease_ttl_ms = local.lease_ttl_ms;
        })
        .await
    }

    /// A heartbeat this replica applied.
    pub(crate) async fn heartbeat(&self, worker_id: WorkerId, loads: &[(DpRank, RankLoad)]) {
        let Some(local) = self.local_entry(worker_id) else {
            return;
        };
        let loads: Vec<pb::RankLoad> = loads
            .iter()
            .map(|(rank, load)| convert::rank_load_to_pb(*rank, *load))
            .collect();
        let result = self
            .modify(worker_id, &local, |e| {
                e.expires_unix_ms = local.expires_unix_ms;
                e.lease_ttl_ms = local.lease_ttl_ms;
                if !loads.is_empty() {
                    e.load = loads.clone();
                }
            })
            .await;
        if let Err(error) = result {
            tracing::debug!(worker_id, %error, "heartbeat not shared");
        }
    }

    /// A cordon change this replica applied.
    pub(crate) async fn set_cordoned(
        &self,
        worker_id: WorkerId,
        cordoned: bool,
    ) -> Result<(), ClusterError> {
        let Some(local) = self.local_entry(worker_id) else {
            return Ok(()); // removed meanwhile
        };
        self.modify(worker_id, &local, |e| e.cordoned = cordoned)
            .await
    }

    /// A deregistration this replica applied.
    pub(crate) async fn forget(&self, worker_id: WorkerId) {
        if let Err(error) = self.kv.delete(key(worker_id)).await {
            tracing::debug!(worker_id, %error, "lease entry not deleted");
        }
        self.seen.lock().remove(&worker_id);
    }

    /// Applies every entry the bucket holds now; the watch returned goes
    /// on with later changes (for [`Self::watch`]).
    pub(crate) async fn read_current(&self) -> Result<kv::Watch, ClusterError> {
        super::watch_from_current(&self.kv, |entry| self.seen_entry(entry)).await
    }

    /// Follows the bucket until `stop`, making each entry true here: from
    /// `first` if given, then (after the watch breaks) from the bucket's
    /// current values again.
    pub(crate) async fn watch(
        self: Arc<Self>,
        mut first: Option<kv::Watch>,
        stop: CancellationToken,
    ) {
        while !stop.is_cancelled() {
            let mut watch = match super::next_watch(&self.kv, &mut first).await {
                Ok(watch) => watch,
                Err(error) => {
                    tracing::debug!(%error, "workers bucket: cannot watch; retrying");
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(Duration::from_millis(500)) => continue,
                    }
                }
            };
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    next = watch.next() => match next {
                        Some(Ok(entry)) => self.seen_entry(entry),
                        _ => break,
                    },
                }
            }
        }
    }

    fn seen_entry(&self, entry: kv::Entry) {
        let Ok(worker_id) = entry.key.parse::<WorkerId>() else {
            return;
        };
        if entry.operation != Operation::Put {
            self.seen.lock().remove(&worker_id);
            return;
        }
        let Ok(lease) = pb::WorkerLease::decode(entry.value) else {
            return;
        };
        self.apply_locally(worker_id, &lease);
        self.seen.lock().insert(worker_id, (entry.revision, lease));
    }

    /// Renews, cordons and loads the local registry to match an entry of
    /// the worker's current registration.
    fn apply_locally(&self, worker_id: WorkerId, lease: &pb::WorkerLease) {
        let router = self.fleet.router();
        let Some(record) = router.worker(worker_id) else {
            return;
        };
        if record.generation != lease.generation || lease.lapsed {
            return;
        }
        // The lease ends when the entry says, wherever it was renewed: a
        // whole TTL from now would keep a lease alive here that lapses
        // everywhere else, and differ between replicas.
        let remaining_ms = lease.expires_unix_ms.saturating_sub(unix_ms());
        if remaining_ms > 0 {
            let loads: Vec<_> = lease.load.iter().map(convert::rank_load_from_pb).collect();
            let _ = router.renew_until(worker_id, &loads, Duration::from_millis(remaining_ms));
        }
        if record.cordoned != lease.cordoned {
            let _ = self.fleet.set_cordoned(worker_id, lease.cordoned);
        }
    }

    /// NATS came back: hold reaping for a lease length and write the
    /// leases renewed here meanwhile.
    pub(crate) async fn reconnected(&self) {
        let longest = self
            .fleet
            .router()
            .workers(None)
            .iter()
            .map(|w| w.lease_ttl)
            .max()
            .unwrap_or_default();
        *self.hold_until.lock() = Instant::now() + longest;
        for worker in self.fleet.router().workers(None) {
            let id = worker.registration.worker_id;
            self.heartbeat(id, &[]).await;
        }
    }

    /// Every `period` until `stop`: entries of this replica's workers that
    /// the watch has not seen yet are applied (a cordon set before the
    /// registration reached here), and lapsed leases are claimed.
    pub(crate) async fn housekeeping(self: Arc<Self>, period: Duration, stop: CancellationToken) {
        let mut ticks = tokio::time::interval(period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = ticks.tick() => {}
            }
            let seen: Vec<_> = self
                .seen
                .lock()
                .iter()
                .map(|(id, (rev, lease))| (*id, *rev, lease.clone()))
                .collect();
            for (worker_id, _, lease) in &seen {
                self.apply_locally(*worker_id, lease);
            }
            if Instant::now() < *self.hold_until.lock() {
                continue;
            }
            let now = unix_ms();
            for (worker_id, revision, lease) in seen {
                if lease.lapsed {
                    // Claimed, but its removal is not in the log yet (the
                    // claimant failed to append, or died): finish it.
                    // The message id makes every replica's append one.
                    self.finish_lapse(worker_id, lease.generation).await;
                } else if now >= lease.expires_unix_ms {
                    self.claim_lapse(worker_id, revision, lease).await;
                }
            }
        }
    }

    /// Tries to be the replica that removes a lapsed worker.
    async fn claim_lapse(&self, worker_id: WorkerId, revision: u64, mut lease: pb::WorkerLease) {
        lease.lapsed = true;
        let value = Bytes::from(lease.encode_to_vec());
        if self
            .kv
            .update(key(worker_id), value, revision)
            .await
            .is_err()
        {
            return; // renewed, or another replica claimed it
        }
        self.fleet.router().metrics().cluster.leases_reaped.inc();
        tracing::warn!(
            worker_id,
            "lease lapsed: removing it through the shared log"
        );
        self.finish_lapse(worker_id, lease.generation).await;
    }

    /// Appends a claimed lapse to the log and deletes the entry.
    async fn finish_lapse(&self, worker_id: WorkerId, generation: u64) {
        let body = Body::Lapsed(pb::LeaseLapsed {
            worker_id,
            generation,
        });
        let message_id = format!("lapsed.{worker_id}.{generation}");
        match self.log.append(body, Some(message_id), false).await {
            Ok(_) => {
                let _ = self.kv.delete(key(worker_id)).await;
            }
            Err(error) => {
                tracing::warn!(worker_id, %error, "lapse not yet in the shared log; retrying");
            }
        }
    }
}
