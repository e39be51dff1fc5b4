//! Cluster mode (`kvroute serve --nats-url`): several kvroute replicas in
//! front of one fleet, with one exact index and shared booked load, on
//! NATS JetStream. Alone (no `--nats-url`) kvroute needs no other server.
//!
//! Who owns what:
//! * `log`: the ordered record of every index change (events,
//!   registrations, removals); every replica applies it in order, so all
//!   hold the same index at the same position.
//! * `leases`: leases, cordons and reported load in a key-value bucket; a
//!   lapse is decided once by compare-and-set and removed through the log.
//! * `routing_sync`: booked load on a subject per replica (kept by a
//!   stream), sessions in a bucket.
//! * `snapshots`: the newest snapshot and its log position, in an object
//!   store, written by one replica per interval; a starting replica loads
//!   it and reads the log from there.
//!
//! While NATS is unreachable a replica keeps routing on what it has;
//! changes that must be in the log (registration, events) answer
//! UNAVAILABLE, so workers retry and nothing accepted is lost; the
//! Workers service reports NOT_SERVING in the health service.

mod decision_record;
mod error;
mod leases;
mod log;
mod names;
mod ordered;
mod parts;
mod routing_sync;
mod snapshots;

use std::{
    sync::{Arc, OnceLock},
    time::Duration,
};

use async_nats::jetstream::{self, kv, object_store, stream};
use futures::{StreamExt, future::BoxFuture};
use tokio::sync::{mpsc, watch};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

use crate::{
    config::ClusterOptions,
    engine_events::EngineSource,
    fleet::{Fleet, FleetError, WorkerView, changes::FleetChanges},
    grpc::convert,
    ingest::{BatchOutcome, ValidatedBatch},
    pb::{self, log_record::Body},
    router::sync::{FEED_CAPACITY, RoutingChange},
    snapshot::{SnapshotError, WriteSnapshot, Written},
};
pub use error::ClusterError;
use kvroute_core::{
    registry::{RegisterOutcome, Registration},
    types::{DpRank, RankLoad, WorkerId},
};
use leases::Leases;
use log::{Applied, Log, LogForward};
use names::Names;
use routing_sync::RoutingSync;
use snapshots::ClusterSnapshots;

/// Heartbeats being shared at once, at most.
const SHARING_HEARTBEATS: usize = 256;
/// How often leases are checked and the watch's view re-applied.
const LEASE_CHECK: Duration = Duration::from_secs(1);
/// How long a start waits for NATS before each retry.
const SETUP_RETRY: Duration = Duration::from_secs(1);

/// What the replica needs at start besides its flags.
#[derive(Clone, Debug)]
pub struct ClusterSettings {
    pub snapshot_interval: Duration,
    pub booking_ttl: Duration,
    pub session_ttl: Duration,
}

/// One replica's membership of its cluster.
pub struct Cluster {
    replica: String,
    fleet: Arc<Fleet>,
    log: Arc<Log>,
    leases: Arc<Leases>,
    snapshots: Arc<ClusterSnapshots>,
    connected: watch::Receiver<bool>,
    sharing: Arc<tokio::sync::Semaphore>,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("replica", &self.replica)
            .finish_non_exhaustive()
    }
}

impl Cluster {
    /// Connects, creates what is missing, loads the newest snapshot into
    /// `fleet` (which has no worker yet), catches up with the log and
    /// starts the replica's tasks on `tasks`, which end with `stop`.
    pub(crate) async fn start(
        options: &ClusterOptions,
        url: &str,
        settings: ClusterSettings,
        fleet: Arc<Fleet>,
        tasks: &TaskTracker,
        stop: CancellationToken,
    ) -> Result<Arc<Self>, ClusterError> {
        let replica = options.replica();
        let names = Names::new(&options.cluster_name);
        let (connected_tx, connected) = watch::channel(false);
        let client = connect(options, url, &replica, connected_tx).await?;
        let js = jetstream::new(client.clone());
        let made = setup_until_ready(&js, &names, options, &settings, &stop).await?;
        let metrics = fleet.router().metrics().clone();
        let log = Arc::new(Log::new(
            js.clone(),
            names.log_stream.clone(),
            names.log_subject.clone(),
            replica.clone(),
            metrics.clone(),
            client.server_info().max_payload,
        ));
        let (feed_tx, feed_rx) = mpsc::channel(FEED_CAPACITY);
        fleet.join_cluster(
            Arc::new(LogForward {
                log: log.clone(),
                stop: stop.clone(),
            }),
            feed_tx,
        );
        if options.ordered() {
            // Before the catch-up: the log's decisions are applied alike
            // whether this replica is starting or not.
            fleet.router().decide_in_order(Arc::new(ordered::LogOrder {
                log: log.clone(),
                connected: connected.clone(),
            }));
        }
        let snapshots = Arc::new(ClusterSnapshots {
            store: made.store,
            control: made.control,
            log: log.clone(),
            metrics,
        });
        let position = catch_up(&fleet, &log, &snapshots, &made.log_stream, tasks, &stop).await?;
        tracing::info!(replica, position, "cluster: caught up with the shared log");

        // Cordons, leases and sessions as the buckets hold them now, before
        // this replica serves (`watch_from_current`).
        let leases = Arc::new(Leases::new(made.workers, fleet.clone(), log.clone()));
        let workers_watch = leases.read_current().await?;
        tasks.spawn(leases.clone().watch(Some(workers_watch), stop.clone()));
        tasks.spawn(leases.clone().housekeeping(LEASE_CHECK, stop.clone()));
        let sync = Arc::new(RoutingSync {
            client: client.clone(),
            js: js.clone(),
            sessions: made.sessions,
            names: names.clone(),
            replica: replica.clone(),
            router: fleet.router().clone(),
        });
        let sessions_watch = sync.read_sessions().await?;
        share_routing(
            sync,
            sessions_watch,
            feed_rx,
            connected.clone(),
            tasks,
            &stop,
        );
        tasks.spawn(
            snapshots
                .clone()
                .every(settings.snapshot_interval, stop.clone()),
        );

        let cluster = Arc::new(Self {
            replica,
            fleet,
            log,
            leases,
            snapshots,
            connected,
            sharing: Arc::new(tokio::sync::Semaphore::new(SHARING_HEARTBEATS)),
        });
        tasks.spawn(cluster.clone().follow_connection(stop));
        Ok(cluster)
    }

    /// True while the NATS connection is up; changes when it drops or
    /// comes back.
    pub(crate) fn connection(&self) -> watch::Receiver<bool> {
        self.connected.clone()
    }

    async fn follow_connection(self: Arc<Self>, stop: CancellationToken) {
        let mut connected = self.connected.clone();
        let gauge = self.fleet.router().metrics().cluster.connected.clone();
        let mut was = *connected.borrow();
        gauge.set(i64::from(was));
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                changed = connected.changed() => if changed.is_err() { return },
            }
            let now = *connected.borrow();
            gauge.set(i64::from(now));
            if now && !was {
                tracing::info!("cluster: NATS connection back");
                self.leases.reconnected().await;
            } else if !now && was {
                tracing::warn!("cluster: NATS unreachable; routing on the state held");
            }
            was = now;
        }
    }
}

/// What the cluster keeps in NATS, opened or created.
struct Made {
    log_stream: stream::Stream,
    workers: kv::Store,
    sessions: kv::Store,
    control: kv::Store,
    store: object_store::ObjectStore,
}

/// [`setup`], retried each `SETUP_RETRY` until NATS is ready or `stop`.
async fn setup_until_ready(
    js: &jetstream::Context,
    names: &Names,
    options: &ClusterOptions,
    settings: &ClusterSettings,
    stop: &CancellationToken,
) -> Result<Made, ClusterError> {
    loop {
        match setup(js, names, options, settings).await {
            Ok(made) => return Ok(made),
            Err(error) => {
                tracing::warn!(%error, "cluster: NATS not ready; retrying");
                tokio::select! {
                    () = stop.cancelled() => return Err(ClusterError::Stopped),
                    () = tokio::time::sleep(SETUP_RETRY) => {}
                }
            }
        }
    }
}

/// Loads the newest cluster snapshot into `fleet`, then follows the log
/// from there (on `tasks`) until this replica has applied every record
/// the log held when it started; answers with that position.
async fn catch_up(
    fleet: &Arc<Fleet>,
    log: &Arc<Log>,
    snapshots: &ClusterSnapshots,
    log_stream: &stream::Stream,
    tasks: &TaskTracker,
    stop: &CancellationToken,
) -> Result<u64, ClusterError> {
    let from = match snapshots.load().await? {
        Some(loaded) => {
            let report = fleet.restore(loaded.state).await;
            tracing::info!(
                position = loaded.position,
                bytes = loaded.bytes,
                workers = report.workers,
                entries = report.entries,
                targets_refused = report.targets_refused,
                "cluster snapshot loaded"
            );
            for (worker_id, why) in &report.workers_refused {
                tracing::warn!(worker_id, %why, "saved worker not restored");
            }
            loaded.position + 1
        }
        None => 1,
    };
    let first = log_stream.cached_info().state.first_sequence;
    if from < first {
        tracing::warn!(
            from,
            first,
            "the shared log no longer holds every record after the snapshot (retention): the index may miss events until workers resynchronise"
        );
    }
    let end = log_stream.cached_info().state.last_sequence;
    tasks.spawn(log.clone().follow(fleet.clone(), from, stop.clone()));
    if !log.wait_applied(end, Duration::from_secs(600)).await {
        return Err(ClusterError::NotCaughtUp { position: end });
    }
    Ok(end)
}

/// How long a starting replica waits to read a bucket's current values.
const BUCKET_READ_LIMIT: Duration = Duration::from_secs(30);

/// A watch of every key's newest value and then of each change, after
/// giving each value the bucket holds now to `apply`: a replica that
/// starts routes on the buckets' whole state (cordons, leases, sessions),
/// not only on what changes after it started. (A watch from `watch_all`
/// would see only later changes.)
pub(crate) async fn watch_from_current(
    bucket: &kv::Store,
    mut apply: impl FnMut(kv::Entry),
) -> Result<kv::Watch, ClusterError> {
    let mut watch = next_watch(bucket, &mut None)
        .await
        .map_err(|e| ClusterError::nats("watch a bucket", e))?;
    let held = bucket
        .status()
        .await
        .map_err(|e| ClusterError::nats("read a bucket's status", e))?
        .values();
    if held == 0 {
        return Ok(watch);
    }
    let until = tokio::time::Instant::now() + BUCKET_READ_LIMIT;
    loop {
        match tokio::time::timeout_at(until, watch.next()).await {
            Ok(Some(Ok(entry))) => {
                // `delta`: values still to come of those the watch began with.
                let last = entry.delta == 0;
                apply(entry);
                if last {
                    return Ok(watch);
                }
            }
            Ok(Some(Err(error))) => return Err(ClusterError::nats("read a bucket", error)),
            Ok(None) => return Err(ClusterError::nats("read a bucket", "the watch ended")),
            Err(_) => {
                tracing::warn!(
                    "cluster: a bucket's current values not all read in {BUCKET_READ_LIMIT:?}; serving, and applying the rest as they come"
                );
                return Ok(watch);
            }
        }
    }
}

/// The watch a bucket's follower reads next: `first` if it holds one (the
/// watch [`watch_from_current`] began), else a new one from every key's
/// newest value.
pub(crate) async fn next_watch(
    bucket: &kv::Store,
    first: &mut Option<kv::Watch>,
) -> Result<kv::Watch, kv::WatchError> {
    match first.take() {
        Some(watch) => Ok(watch),
        None => bucket.watch_with_history(">").await,
    }
}

/// Sends this replica's bookings and sessions (its router's `feed`) to
/// the others, and theirs to this replica's router, on `tasks` until
/// `stop`.
fn share_routing(
    sync: Arc<RoutingSync>,
    sessions_watch: kv::Watch,
    feed: mpsc::Receiver<RoutingChange>,
    connected: watch::Receiver<bool>,
    tasks: &TaskTracker,
    stop: &CancellationToken,
) {
    tasks.spawn(sync.clone().publish(feed, connected));
    tasks.spawn(sync.clone().receive(stop.clone()));
    tasks.spawn(sync.watch_sessions(Some(sessions_watch), stop.clone()));
}

/// Connects to NATS. The client reconnects by itself for as long as the
/// process runs; `events` hears of each disconnect and reconnect.
async fn connect(
    flags: &ClusterOptions,
    url: &str,
    replica: &str,
    events: tokio::sync::watch::Sender<bool>,
) -> Result<async_nats::Client, ClusterError> {
    let mut options = async_nats::ConnectOptions::new()
        .name(format!("kvroute {replica}"))
        .retry_on_initial_connect()
        .max_reconnects(None)
        .event_callback(move |event| {
            let events = events.clone();
            async move {
                match event {
                    async_nats::Event::Connected => {
                        let _ = events.send(true);
                    }
                    async_nats::Event::Disconnected => {
                        let _ = events.send(false);
                    }
                    other => tracing::debug!(event = %other, "nats"),
                }
            }
        });
    if let Some(creds) = &flags.nats_creds {
        options = options
            .credentials_file(creds)
            .await
            .map_err(|e| ClusterError::nats("read the credentials file", e))?;
    }
    if let (Some(user), Some(password)) = (&flags.nats_user, &flags.nats_password) {
        options = options.user_and_password(user.clone(), password.clone());
    }
    if let Some(token) = &flags.nats_token {
        options = options.token(token.clone());
    }
    if let Some(ca) = &flags.nats_tls_ca {
        options = options.add_root_certificates(ca.clone()).require_tls(true);
    }
    if let (Some(cert), Some(key)) = (&flags.nats_tls_cert, &flags.nats_tls_key) {
        options = options.add_client_certificate(cert.clone(), key.clone());
    }
    options
        .connect(url)
        .await
        .map_err(|e| ClusterError::nats("connect", e))
}

/// Creates (or opens) the cluster's stream, buckets and object store.
async fn setup(
    js: &jetstream::Context,
    names: &Names,
    options: &ClusterOptions,
    settings: &ClusterSettings,
) -> Result<Made, ClusterError> {
    let log = js
        .get_or_create_stream(stream::Config {
            name: names.log_stream.clone(),
            subjects: vec![names.log_subject.clone()],
            max_age: options.log_max_age,
            max_bytes: options.log_max_bytes,
            duplicate_window: options.log_duplicate_window,
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await
        .map_err(|e| ClusterError::nats("open the log stream", e))?;
    js.get_or_create_stream(stream::Config {
        name: names.bookings_stream.clone(),
        subjects: vec![format!("{}.>", names.bookings_prefix)],
        max_age: settings.booking_ttl,
        storage: stream::StorageType::File,
        ..Default::default()
    })
    .await
    .map_err(|e| ClusterError::nats("open the bookings stream", e))?;
    let bucket = |bucket: &str, max_age: Duration| kv::Config {
        bucket: bucket.to_owned(),
        history: 1,
        max_age,
        storage: stream::StorageType::File,
        ..Default::default()
    };
    let workers = open_bucket(js, bucket(&names.workers_bucket, Duration::ZERO)).await?;
    let sessions = open_bucket(js, bucket(&names.sessions_bucket, settings.session_ttl)).await?;
    let control = open_bucket(js, bucket(&names.control_bucket, Duration::ZERO)).await?;
    let store = match js.get_object_store(&names.snapshots_bucket).await {
        Ok(store) => store,
        Err(_) => js
            .create_object_store(object_store::Config {
                bucket: names.snapshots_bucket.clone(),
                storage: stream::StorageType::File,
                ..Default::default()
            })
            .await
            .map_err(|e| ClusterError::nats("create the snapshot store", e))?,
    };
    Ok(Made {
        log_stream: log,
        workers,
        sessions,
        control,
        store,
    })
}

/// Opens a key-value bucket, creating its stream first if missing. The
/// stream is made here as the client's `create_key_value` would make it:
/// that call first asks for the account's API level, an answer
/// nats-server 2.9 (Debian's) gives in a form the client cannot read.
async fn open_bucket(
    js: &jetstream::Context,
    config: kv::Config,
) -> Result<kv::Store, ClusterError> {
    js.get_or_create_stream(stream::Config {
        name: format!("KV_{}", config.bucket),
        subjects: vec![format!("$KV.{}.>", config.bucket)],
        max_messages_per_subject: config.history.max(1),
        max_age: config.max_age,
        storage: config.storage,
        allow_rollup: true,
        deny_delete: true,
        allow_direct: true,
        num_replicas: 1,
        discard: stream::DiscardPolicy::New,
        ..Default::default()
    })
    .await
    .map_err(|e| ClusterError::nats("open a bucket's stream", e))?;
    js.get_key_value(&config.bucket)
        .await
        .map_err(|e| ClusterError::nats("open a bucket", e))
}

impl Cluster {
    /// Appends a registration to the log; answers once this replica has
    /// applied it, with what its fleet did.
    async fn register(
        &self,
        request: pb::RegisterWorkerRequest,
    ) -> Result<RegisterOutcome, FleetError> {
        let worker_id = request.worker_id;
        let applied = self
            .log
            .append(Body::Register(request), None, true)
            .await
            .map_err(ClusterError::from)?;
        let Applied::Register(outcome) = applied else {
            return Err(ClusterError::WrongRecord.into());
        };
        let outcome = (*outcome)?;
        if let Err(error) = self.leases.registered(worker_id).await {
            tracing::warn!(worker_id, %error, "lease entry not written; the next heartbeat writes it");
        }
        Ok(outcome)
    }

    /// Appends a deregistration; answers with the blocks it removed here.
    async fn deregister(&self, worker_id: WorkerId) -> Result<u64, FleetError> {
        let applied = self
            .log
            .append(Body::Deregister(worker_id), None, true)
            .await
            .map_err(ClusterError::from)?;
        self.leases.forget(worker_id).await;
        match applied {
            Applied::Deregister(outcome) => outcome,
            _ => Err(ClusterError::WrongRecord.into()),
        }
    }

    /// Shares a heartbeat this replica has applied, in the background:
    /// the worker's call does not wait on NATS. While NATS is away nothing
    /// is sent (the lease was renewed here; `Leases::reconnected` writes
    /// it later), and at most `SHARING_HEARTBEATS` are in flight, so a
    /// flood costs no memory.
    fn share_heartbeat(&self, worker_id: WorkerId, loads: &[(DpRank, RankLoad)]) {
        if !*self.connected.borrow() {
            return;
        }
        let Ok(permit) = self.sharing.clone().try_acquire_owned() else {
            return; // the worker's next heartbeat carries the same news
        };
        let (leases, loads) = (self.leases.clone(), loads.to_vec());
        tokio::spawn(async move {
            leases.heartbeat(worker_id, &loads).await;
            drop(permit);
        });
    }

    /// Shares a cordon change before this replica makes it, so that a
    /// replica that cannot share it changes nothing.
    async fn share_cordon(&self, worker_id: WorkerId, cordoned: bool) -> Result<(), ClusterError> {
        if !*self.connected.borrow() {
            return Err(ClusterError::CordonNotShared);
        }
        self.leases.set_cordoned(worker_id, cordoned).await
    }

    /// Appends a validated batch; answers once this replica applied it,
    /// with what its writer did (the same on every replica). A record must
    /// fit in one NATS message: a batch over that is sent as several
    /// records, in order, and answered as one.
    async fn publish(&self, batch: ValidatedBatch) -> Result<BatchOutcome, FleetError> {
        let limit = self.log.max_record_bytes();
        let mut merged: Option<BatchOutcome> = None;
        for part in split_to_fit(batch, limit)? {
            let outcome = self.publish_part(part).await?;
            merged = Some(match merged {
                None => outcome,
                Some(before) => merge(before, outcome),
            });
        }
        Ok(merged.unwrap_or_default())
    }

    async fn publish_part(&self, part: Part) -> Result<BatchOutcome, FleetError> {
        let Part { batch, events } = part;
        let (first, last) = match (batch.events.first(), batch.events.last()) {
            (Some(f), Some(l)) => (f.event_id, l.event_id),
            _ => (0, 0),
        };
        let message_id = format!(
            "events.{}.{}.{}.{first}.{last}",
            batch.worker_id, batch.generation, batch.dp_rank
        );
        let body = Body::Events(pb::KvEventBatch {
            worker_id: batch.worker_id,
            dp_rank: batch.dp_rank,
            events,
        });
        let applied = self
            .log
            .append(body, Some(message_id), true)
            .await
            .map_err(ClusterError::from)?;
        match applied {
            Applied::Events(outcome) => outcome,
            // A resend of a batch already in the log: the cursor has it.
            _ => {
                let cursor = self
                    .fleet
                    .worker_view(batch.worker_id)
                    .ok()
                    .and_then(|v| v.ranks.into_iter().find(|r| r.dp_rank == batch.dp_rank))
                    .map(|r| r.cursor);
                Ok(BatchOutcome {
                    dp_rank: batch.dp_rank,
                    last_applied: cursor.and_then(|c| c.last_applied()),
                    ..BatchOutcome::default()
                })
            }
        }
    }
}

/// One log record's share of a batch: its validated events and the same
/// events in wire form, converted once.
struct Part {
    batch: ValidatedBatch,
    events: Vec<pb::KvEvent>,
}

/// Splits a batch into parts whose events, in wire form, take at most
/// `limit` bytes each; an event larger than that on its own is refused.
fn split_to_fit(batch: ValidatedBatch, limit: usize) -> Result<Vec<Part>, ClusterError> {
    use prost::Message;
    let events: Vec<pb::KvEvent> = batch
        .events
        .iter()
        .map(|e| convert::tiered_event_to_pb(e.event_id, &e.event))
        .collect();
    let sizes: Vec<usize> = events.iter().map(|e| e.encoded_len() + 8).collect();
    if sizes.iter().sum::<usize>() <= limit {
        return Ok(vec![Part { batch, events }]);
    }
    if let Some((index, &size)) = sizes.iter().enumerate().find(|(_, s)| **s > limit) {
        return Err(ClusterError::RecordTooLarge { index, size, limit });
    }
    let sized = batch.events.iter().cloned().zip(events).zip(sizes);
    let parts = parts::in_parts(sized, |(_, size)| *size, limit);
    Ok(parts
        .into_iter()
        .map(|part| {
            let (validated, wire) = part.into_iter().map(|(pair, _)| pair).unzip();
            Part {
                batch: ValidatedBatch {
                    events: validated,
                    ..batch.clone()
                },
                events: wire,
            }
        })
        .collect())
}

/// One answer for a batch sent as parts: the cursor's state after the last
/// part, the counts of all.
fn merge(before: BatchOutcome, after: BatchOutcome) -> BatchOutcome {
    BatchOutcome {
        dp_rank: after.dp_rank,
        last_applied: after.last_applied.or(before.last_applied),
        resend_from: after.resend_from,
        resync_required: after.resync_required,
        resync_floor: after.resync_floor,
        applied: before.applied + after.applied,
        skipped: before.skipped + after.skipped,
        rejected: before.rejected + after.rejected,
        held: after.held,
        first_rejection: before.first_rejection.or(after.first_rejection),
    }
}

/// Cluster mode's side of the fleet's seam (`fleet::changes`): what
/// decides the index (registration, removal, events) goes through the
/// shared log, so every replica makes it in the same order; leases, load
/// and cordons reach the other replicas through their bucket. It exists
/// before the replica has joined (the handlers are built then, behind the
/// startup gate); until [`Self::attach`], every change answers
/// UNAVAILABLE.
pub struct ReplicatedChanges {
    fleet: Arc<Fleet>,
    cluster: OnceLock<Arc<Cluster>>,
}

impl std::fmt::Debug for ReplicatedChanges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicatedChanges")
            .field("joined", &self.cluster.get().is_some())
            .finish_non_exhaustive()
    }
}

impl ReplicatedChanges {
    pub(crate) fn new(fleet: Arc<Fleet>) -> Self {
        Self {
            fleet,
            cluster: OnceLock::new(),
        }
    }

    /// The replica has joined: changes go through `cluster` from now on.
    pub(crate) fn attach(&self, cluster: Arc<Cluster>) {
        let _ = self.cluster.set(cluster);
    }

    fn cluster(&self) -> Result<&Arc<Cluster>, ClusterError> {
        self.cluster.get().ok_or(ClusterError::Joining)
    }
}

impl FleetChanges for ReplicatedChanges {
    fn register(
        &self,
        registration: Registration,
        source: Option<EngineSource>,
    ) -> BoxFuture<'_, Result<RegisterOutcome, FleetError>> {
        Box::pin(async move {
            // Checked before the log: a refusal reaches no replica.
            self.fleet
                .check_registration(&registration, source.as_ref())?;
            let request = convert::registration_to_pb(&registration, source.as_ref());
            self.cluster()?.register(request).await
        })
    }

    fn heartbeat<'a>(
        &'a self,
        worker_id: WorkerId,
        loads: &'a [(DpRank, RankLoad)],
    ) -> BoxFuture<'a, Result<Duration, FleetError>> {
        Box::pin(async move {
            let ttl = self.fleet.heartbeat(worker_id, loads)?;
            if let Ok(cluster) = self.cluster() {
                cluster.share_heartbeat(worker_id, loads);
            }
            Ok(ttl)
        })
    }

    fn deregister(&self, worker_id: WorkerId) -> BoxFuture<'_, Result<u64, FleetError>> {
        Box::pin(async move {
            // Unknown here: unknown everywhere that has caught up.
            self.fleet.worker_view(worker_id)?;
            self.cluster()?.deregister(worker_id).await
        })
    }

    fn set_cordoned(
        &self,
        worker_id: WorkerId,
        cordoned: bool,
    ) -> BoxFuture<'_, Result<WorkerView, FleetError>> {
        Box::pin(async move {
            self.fleet.worker_view(worker_id)?;
            self.cluster()?.share_cordon(worker_id, cordoned).await?;
            self.fleet.set_cordoned(worker_id, cordoned)
        })
    }

    fn publish(&self, batch: ValidatedBatch) -> BoxFuture<'_, Result<BatchOutcome, FleetError>> {
        Box::pin(async move { self.cluster()?.publish(batch).await })
    }
}

/// Admin `Snapshot` in cluster mode: the cluster's object, now.
impl WriteSnapshot for ReplicatedChanges {
    fn write_now(&self) -> BoxFuture<'_, Result<Written, SnapshotError>> {
        Box::pin(async move {
            let replicated = |e: ClusterError| SnapshotError::Replicated(Box::new(e));
            let cluster = self.cluster().map_err(replicated)?;
            cluster.snapshots.write().await.map_err(replicated)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ingest::IngestEvent;
    use kvroute_core::index::{KvEvent, TieredEvent};

    fn batch(events: usize, blocks: u64) -> ValidatedBatch {
        ValidatedBatch {
            worker_id: 1,
            generation: 3,
            model: "m".into(),
            dp_rank: 0,
            events: (0..events as u64)
                .map(|id| IngestEvent {
                    event_id: id,
                    event: TieredEvent::device(KvEvent::Stored {
                        parent: None,
                        blocks: (0..blocks).map(|b| (id * 1000 + b, b)).collect(),
                    }),
                })
                .collect(),
        }
    }

    #[test]
    fn a_batch_over_the_limit_goes_in_ordered_parts() {
        let parts = split_to_fit(batch(10, 50), 2000).expect("fits in parts");
        assert!(parts.len() > 1);
        let ids: Vec<u64> = parts
            .iter()
            .flat_map(|p| p.batch.events.iter().map(|e| e.event_id))
            .collect();
        assert_eq!(ids, (0..10).collect::<Vec<_>>());
        // Each part's wire events are its validated events, converted once.
        for part in &parts {
            let wire: Vec<u64> = part.events.iter().map(|e| e.event_id).collect();
            let validated: Vec<u64> = part.batch.events.iter().map(|e| e.event_id).collect();
            assert_eq!(wire, validated);
        }
        assert_eq!(split_to_fit(batch(3, 5), 1 << 20).expect("one").len(), 1);
    }

    #[test]
    fn an_event_over_the_limit_is_refused() {
        let Err(error) = split_to_fit(batch(2, 500), 2000) else {
            panic!("an event over the limit was split");
        };
        assert!(
            matches!(error, ClusterError::RecordTooLarge { index: 0, .. }),
            "{error:?}"
        );
        assert!(error.to_string().contains("events[0]"), "{error}");
        // It reaches the worker as INVALID_ARGUMENT: refused, not retried.
        assert!(matches!(
            FleetError::from(error),
            FleetError::Replication(crate::fleet::changes::ReplicationError::Refused(_))
        ));
    }

    #[test]
    fn parts_answer_as_one_batch() {
        let first = BatchOutcome {
            dp_rank: 0,
            last_applied: Some(4),
            applied: 5,
            rejected: 1,
            first_rejection: None,
            ..BatchOutcome::default()
        };
        let second = BatchOutcome {
            dp_rank: 0,
            last_applied: Some(9),
            applied: 5,
            resync_required: true,
            ..BatchOutcome::default()
        };
        let merged = merge(first, second);
        assert_eq!(merged.last_applied, Some(9));
        assert_eq!((merged.applied, merged.rejected), (10, 1));
        assert!(merged.resync_required);
    }
}
