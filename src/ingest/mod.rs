//! Event ingestion: the one writer of the KV index.
//!
//! Every change to an index (a worker's event batch, a worker's removal)
//! travels as a job over one bounded channel to one writer thread, which
//! applies it event by event under the index's write lock. Routing reads take
//! only the index's read lock, so they wait at most one event's worth of work
//! and never behind the queue.
//!
//! Backpressure and fairness: a `PublishEvents` stream sends one batch and
//! awaits its reply before reading the next, so each stream has at most one
//! job queued. A flooding worker therefore slows only its own stream (its
//! HTTP/2 flow control fills up), and with N streams the writer serves them
//! round-robin through the channel's FIFO.
//!
//! Each (worker, dp_rank) has an [`cursor::EventCursor`], which puts its
//! events in id order: events past a gap wait in the cursor until the gap
//! fills, or are dropped when the cursor asks the worker to resynchronise
//! (see the cursor's module docs). The cursors belong to this module's
//! [`EventWriter`]: the writer thread is their only writer, the Admin API
//! reads them through [`IngestHandle::cursor`]. Lock order: the cursor
//! table, then an index's own lock (an event is applied while its rank's
//! cursor is held); the registry is read and released before either.
//!
//! Engine-native subscriptions (`engine_events`, `fleet::subscriptions`) write
//! through here too, as [`EngineBatch`] jobs: their events carry no event
//! ids (the subscriber keeps each publisher's own sequence), so they bypass
//! the cursor but keep the registration-generation check.

pub mod cursor;

use std::{collections::HashMap, sync::Arc};

use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};

use crate::router::RouterCore;
use cursor::{EventCursor, SkipReason};
use kvroute_core::{
    index::{Holder, IndexError, KvIndex, TIERS, TargetContent, Tier, TieredEvent},
    types::{DpRank, WorkerId, WorkerRank, WorkerSnapshot},
};

pub use cursor::IngestEvent;

/// Jobs the writer can hold before senders wait.
pub const WRITE_QUEUE_CAPACITY: usize = 1024;

/// A batch checked for shape and limits, with local hashes computed.
#[derive(Clone, Debug)]
pub struct ValidatedBatch {
    pub worker_id: WorkerId,
    /// The registration the batch was validated against.
    pub generation: u64,
    pub model: String,
    pub dp_rank: DpRank,
    pub events: Vec<IngestEvent>,
}

/// What the writer did with a batch. The counts are of the events handled
/// while the batch was: its own, and held events of earlier batches that
/// were applied or dropped.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BatchOutcome {
    pub dp_rank: DpRank,
    /// Every event up to this id was applied or rejected, in order.
    pub last_applied: Option<u64>,
    /// Events past a gap are held: the worker should resend from this id.
    pub resend_from: Option<u64>,
    /// The cursor gave up on a gap: the worker must resynchronise.
    pub resync_required: bool,
    /// With `resync_required`: the lowest id the answer's `cleared` may
    /// carry.
    pub resync_floor: Option<u64>,
    pub applied: u32,
    pub skipped: u32,
    pub rejected: u32,
    /// Events the cursor holds after this batch.
    pub held: u32,
    /// The first rejection, for logs and the reply.
    pub first_rejection: Option<IndexError>,
}

/// Already-hashed events of one (worker, dp_rank) from a source without
/// kvroute event ids: the engine-native ZeroMQ subscriber, which orders and
/// de-duplicates by the engine's own batch sequence before sending. Applied
/// in order without an [`cursor::EventCursor`], but only while the worker's
/// registration still has `generation` (as for [`ValidatedBatch`]), so
/// events of a worker deregistered or re-registered meanwhile are dropped.
/// A rank is cleared by sending [`KvEvent::Cleared`]. The subscriber awaits
/// each job before sending the next, so one rank's jobs never overtake.
#[derive(Clone, Debug)]
pub struct EngineBatch {
    pub worker_id: WorkerId,
    pub generation: u64,
    pub model: String,
    pub dp_rank: DpRank,
    pub events: Vec<TieredEvent>,
}

/// What the writer did with an [`EngineBatch`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineOutcome {
    pub applied: u32,
    pub rejected: u32,
    /// Blocks of placeholder events no tier of the rank held (left out).
    pub unresolved: u64,
    /// The first rejection, for logs.
    pub first_rejection: Option<IndexError>,
}

/// Why a batch was not applied at all.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IngestError {
    #[error("worker {worker_id} was deregistered or re-registered while its batch was queued")]
    WorkerGone { worker_id: WorkerId },
    #[error("the event writer has stopped")]
    WriterStopped,
    #[error("a saved target could not be rebuilt: {0}")]
    Restore(IndexError),
}

enum Job {
    Batch {
        batch: ValidatedBatch,
        reply: oneshot::Sender<Result<BatchOutcome, IngestError>>,
    },
    Engine {
        batch: EngineBatch,
        reply: oneshot::Sender<Result<EngineOutcome, IngestError>>,
    },
    RemoveWorker {
        worker_id: WorkerId,
        model: String,
        reply: oneshot::Sender<u64>,
    },
    Reserve {
        worker: WorkerSnapshot,
    },
    Capture {
        target: RankRegistration,
        reply: oneshot::Sender<Option<CapturedTarget>>,
    },
    Restore {
        target: RankRegistration,
        captured: CapturedTarget,
        reply: oneshot::Sender<Result<(), IndexError>>,
    },
}

/// One (worker, rank) under one registration of its worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankRegistration {
    pub target: WorkerRank,
    pub generation: u64,
    pub model: String,
}

/// What a snapshot keeps of one (worker, rank): its blocks and the last
/// event id applied, taken together by the writer, so they agree.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CapturedTarget {
    pub content: TargetContent,
    pub last_event_id: Option<u64>,
}

/// The sending side of the writer, and read access to its cursors; cheap
/// to clone.
#[derive(Clone, Debug)]
pub struct IngestHandle {
    tx: mpsc::Sender<Job>,
    writer: Arc<EventWriter>,
}

impl IngestHandle {
    /// The cursor of one (worker, rank), if it has seen events.
    pub(crate) fn cursor(&self, target: WorkerRank) -> Option<EventCursor> {
        self.writer.cursor(target)
    }

    /// Events skipped and rejected by every cursor: `(skipped, rejected)`.
    pub(crate) fn cursor_totals(&self) -> (u64, u64) {
        self.writer.cursor_totals()
    }

    /// See [`EventWriter::count_rejected`].
    pub(crate) fn count_rejected(&self, target: WorkerRank, n: u64) {
        self.writer.count_rejected(target, n);
    }

    /// Queues a batch and waits for the writer's verdict.
    pub(crate) async fn apply(&self, batch: ValidatedBatch) -> Result<BatchOutcome, IngestError> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Job::Batch { batch, reply })
            .await
            .map_err(|_| IngestError::WriterStopped)?;
        answer.await.map_err(|_| IngestError::WriterStopped)?
    }

    /// Queues engine-native events (see [`EngineBatch`]) and waits for the
    /// writer's verdict.
    pub(crate) async fn apply_engine(
        &self,
        batch: EngineBatch,
    ) -> Result<EngineOutcome, IngestError> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Job::Engine { batch, reply })
            .await
            .map_err(|_| IngestError::WriterStopped)?;
        answer.await.map_err(|_| IngestError::WriterStopped)?
    }

    /// Holds a registered worker's dp ranks to their KV capacity in the
    /// index (declared, or the registry's default; see
    /// [`KvIndex::limit_capacity`]) and sizes their tables for a declared
    /// one (see [`KvIndex::reserve`]), in order with the jobs queued before.
    pub(crate) async fn reserve(&self, worker: &WorkerSnapshot) {
        let job = Job::Reserve {
            worker: worker.clone(),
        };
        let _ = self.tx.send(job).await;
    }

    /// A target's blocks and cursor, taken between two jobs (so they agree
    /// with each other); `None` if its registration changed or the writer
    /// stopped.
    pub(crate) async fn capture(&self, target: RankRegistration) -> Option<CapturedTarget> {
        let (reply, answer) = oneshot::channel();
        self.tx.send(Job::Capture { target, reply }).await.ok()?;
        answer.await.ok().flatten()
    }

    /// Rebuilds a target that holds nothing from a capture, in order with
    /// the jobs queued before.
    pub(crate) async fn restore(
        &self,
        target: RankRegistration,
        captured: CapturedTarget,
    ) -> Result<(), IngestError> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Job::Restore {
                target,
                captured,
                reply,
            })
            .await
            .map_err(|_| IngestError::WriterStopped)?;
        answer
            .await
            .map_err(|_| IngestError::WriterStopped)?
            .map_err(IngestError::Restore)
    }

    /// Drops every block of a worker (after the registry forgot it), in order
    /// with the batches queued before; returns the blocks dropped.
    pub(crate) async fn remove_worker(&self, worker_id: WorkerId, model: String) -> u64 {
        let (reply, answer) = oneshot::channel();
        if self
            .tx
            .send(Job::RemoveWorker {
                worker_id,
                model,
                reply,
            })
            .await
            .is_err()
        {
            return 0;
        }
        answer.await.unwrap_or(0)
    }
}

/// Starts the writer thread; it stops when every handle is dropped.
pub(crate) fn start_writer(writer: Arc<EventWriter>) -> std::io::Result<IngestHandle> {
    let (tx, mut rx) = mpsc::channel::<Job>(WRITE_QUEUE_CAPACITY);
    let thread_writer = writer.clone();
    std::thread::Builder::new()
        .name("kvroute-index-writer".into())
        .spawn(move || {
            let writer = thread_writer;
            while let Some(job) = rx.blocking_recv() {
                match job {
                    Job::Batch { batch, reply } => {
                        let _ = reply.send(writer.apply_batch(batch));
                    }
                    Job::Engine { batch, reply } => {
                        let _ = reply.send(writer.apply_engine_batch(batch));
                    }
                    Job::RemoveWorker {
                        worker_id,
                        model,
                        reply,
                    } => {
                        let _ = reply.send(writer.remove_worker(worker_id, &model));
                    }
                    Job::Reserve { worker } => writer.reserve(&worker),
                    Job::Capture { target, reply } => {
                        let _ = reply.send(writer.capture(&target));
                    }
                    Job::Restore {
                        target,
                        captured,
                        reply,
                    } => {
                        let _ = reply.send(writer.restore(&target, captured));
                    }
                }
            }
        })?;
    Ok(IngestHandle { tx, writer })
}

/// The index's one writer and the owner of every event cursor. The service
/// runs it on its own thread ([`start_writer`]); the replay simulator calls
/// it directly, without the channel.
#[derive(Debug)]
pub struct EventWriter {
    router: Arc<RouterCore>,
    cursors: Mutex<HashMap<WorkerRank, EventCursor>>,
}

impl EventWriter {
    pub fn new(router: Arc<RouterCore>) -> Self {
        Self {
            router,
            cursors: Mutex::new(HashMap::new()),
        }
    }

    /// The cursor of one (worker, rank), if it has seen events.
    pub fn cursor(&self, target: WorkerRank) -> Option<EventCursor> {
        self.cursors.lock().get(&target).cloned()
    }

    /// Counts `n` events of a registered (worker, rank) rejected outside its
    /// cursor (a malformed batch, an engine event the index refused), so
    /// `GetWorker` and `GetIndexStats` report what the metrics count.
    pub(crate) fn count_rejected(&self, target: WorkerRank, n: u64) {
        if n > 0 {
            self.cursors.lock().entry(target).or_default().rejected += n;
        }
    }

    /// Events skipped and rejected by every cursor: `(skipped, rejected)`.
    pub fn cursor_totals(&self) -> (u64, u64) {
        self.cursors
            .lock()
            .values()
            .fold((0, 0), |(s, r), c| (s + c.skipped, r + c.rejected))
    }

    /// Holds `worker`'s dp ranks to their KV capacity and sizes their
    /// tables; holds each declared lower tier to its capacity, and drops a
    /// tier the worker no longer declares.
    pub fn reserve(&self, worker: &WorkerSnapshot) {
        let capacity = self
            .router
            .config()
            .registry_limits
            .rank_capacity(worker.total_kv_blocks);
        if let Some(index) = self.router.index_of(&worker.model) {
            for rank in worker.ranks() {
                let target = WorkerRank::new(worker.worker_id, rank);
                index.limit_capacity(target, capacity);
                if worker.total_kv_blocks > 0 {
                    index.reserve(target, worker.total_kv_blocks);
                }
                for tier in &Tier::ALL[1..] {
                    let holder = Holder::new(target, *tier);
                    match worker.tiers.iter().find(|t| t.tier == *tier) {
                        Some(spec) => index.bound_tier(holder, spec.capacity_blocks),
                        None => {
                            index.remove_tier(holder);
                        }
                    }
                }
            }
        }
    }

    /// The tiers below the device `worker_id` declares (events for others
    /// are rejected: the index holds no tier it was not told the size of).
    fn declared_tiers(&self, worker_id: WorkerId) -> [bool; TIERS] {
        let mut declared = [false; TIERS];
        declared[Tier::Device.index()] = true;
        if let Some(worker) = self.router.worker(worker_id) {
            for spec in &worker.registration.tiers {
                declared[spec.tier.index()] = true;
            }
        }
        declared
    }

    /// A target's blocks and last applied event id, if its registration is
    /// still `target`'s.
    pub(crate) fn capture(&self, target: &RankRegistration) -> Option<CapturedTarget> {
        let w = target.target;
        let index = self
            .router
            .current_index(w.worker_id, target.generation, &target.model)?;
        Some(CapturedTarget {
            content: index.export_target(w),
            last_event_id: self.cursor(w).and_then(|c| c.last_applied()),
        })
    }

    /// Rebuilds a captured target (holding nothing yet) and its cursor.
    pub(crate) fn restore(
        &self,
        target: &RankRegistration,
        captured: CapturedTarget,
    ) -> Result<(), IndexError> {
        let w = target.target;
        let Some(index) = self
            .router
            .current_index(w.worker_id, target.generation, &target.model)
        else {
            return Ok(());
        };
        index.restore_target(w, &captured.content)?;
        self.cursors
            .lock()
            .insert(w, EventCursor::resumed(captured.last_event_id));
        Ok(())
    }

    /// Drops every block and cursor of a worker; returns the blocks dropped.
    /// Events its cursors still held are counted as rejected (worker gone).
    pub(crate) fn remove_worker(&self, worker_id: WorkerId, model: &str) -> u64 {
        let mut held = 0;
        self.cursors.lock().retain(|rank, cursor| {
            let keep = rank.worker_id != worker_id;
            if !keep {
                held += cursor.held_events() as u64;
            }
            keep
        });
        self.count_events("rejected", "worker_gone", held);
        self.router
            .index_of(model)
            .map(|index| index.remove_worker(worker_id))
            .unwrap_or(0)
    }

    /// The index a batch validated against registration `generation` of
    /// `worker_id` may write. The registration may have changed since
    /// validation (deregistered, re-registered): then the batch is dropped
    /// rather than write blocks for a worker the registry no longer has.
    fn current_index(
        &self,
        worker_id: WorkerId,
        generation: u64,
        model: &str,
        events: usize,
    ) -> Result<Arc<KvIndex>, IngestError> {
        self.router
            .current_index(worker_id, generation, model)
            .ok_or_else(|| {
                self.count_events("rejected", "worker_gone", events as u64);
                IngestError::WorkerGone { worker_id }
            })
    }

    /// Applies one validated batch through its rank's cursor: events in
    /// id order apply, events past a gap wait in the cursor (see
    /// [`cursor`]).
    pub fn apply_batch(&self, batch: ValidatedBatch) -> Result<BatchOutcome, IngestError> {
        let worker_id = batch.worker_id;
        let index = self.current_index(
            worker_id,
            batch.generation,
            &batch.model,
            batch.events.len(),
        )?;
        if !batch.events.is_empty() {
            self.router.note_events(worker_id);
        }
        let target = WorkerRank::new(worker_id, batch.dp_rank);
        let mut tally = Tally::new(self.declared_tiers(worker_id));
        let mut cursors = self.cursors.lock();
        let cursor = cursors.entry(target).or_default();
        // A batch that answers a resend request is catch-up (after a gap,
        // or after a restart from a snapshot).
        let catching_up = cursor.resend_from().is_some();
        let receipt = cursor.receive(batch.events, |event| tally.apply(&index, target, event));
        let mut outcome = BatchOutcome {
            dp_rank: batch.dp_rank,
            last_applied: cursor.last_applied(),
            resend_from: cursor.resend_from(),
            resync_required: cursor.resync_required(),
            resync_floor: cursor.resync_floor(),
            held: u32::try_from(cursor.held_events()).unwrap_or(u32::MAX),
            ..BatchOutcome::default()
        };
        drop(cursors);
        let gap_open = outcome.resend_from.is_some() || outcome.resync_required || outcome.held > 0;
        self.router.note_stream_gap(target, gap_open);
        for reason in SkipReason::ALL {
            tally.skip(reason.label(), u64::from(receipt.skipped(reason)));
        }
        let counts = tally.finish(self);
        if catching_up && counts.applied > 0 {
            self.router
                .metrics()
                .catchup_events
                .with_label_values(&["grpc"])
                .inc_by(u64::from(counts.applied));
        }
        outcome.applied = counts.applied;
        outcome.rejected = counts.rejected;
        outcome.skipped = receipt.skipped_total();
        outcome.first_rejection = counts.first_rejection;
        Ok(outcome)
    }

    /// Applies one engine-native batch (see [`EngineBatch`]): the generation
    /// check of [`Self::apply_batch`], then every event in order, no cursor.
    pub fn apply_engine_batch(&self, batch: EngineBatch) -> Result<EngineOutcome, IngestError> {
        let worker_id = batch.worker_id;
        let index = self.current_index(
            worker_id,
            batch.generation,
            &batch.model,
            batch.events.len(),
        )?;
        if !batch.events.is_empty() {
            self.router.note_events(worker_id);
        }
        let target = WorkerRank::new(worker_id, batch.dp_rank);
        let mut tally = Tally::new(self.declared_tiers(worker_id));
        for event in batch.events {
            tally.apply(&index, target, event);
        }
        // The Admin API reports them with the gRPC stream's, per rank.
        self.count_rejected(target, u64::from(tally.outcome.rejected));
        Ok(tally.finish(self))
    }

    fn count_events(&self, outcome: &str, reason: &str, count: u64) {
        if count > 0 {
            self.router
                .metrics()
                .events
                .with_label_values(&[outcome, reason])
                .inc_by(count);
        }
    }
}

/// Applies a batch's events one by one and counts what happened, for the
/// caller's outcome and the events metrics.
struct Tally {
    /// The tiers the worker declared, by [`Tier::index`].
    declared: [bool; TIERS],
    outcome: EngineOutcome,
    /// Events the index rejected, by reason.
    rejected: HashMap<&'static str, u64>,
    /// Events the cursor skipped, by reason.
    skipped: HashMap<&'static str, u64>,
}

impl Tally {
    fn new(declared: [bool; TIERS]) -> Self {
        Self {
            declared,
            outcome: EngineOutcome::default(),
            rejected: HashMap::new(),
            skipped: HashMap::new(),
        }
    }

    /// Applies `event` (handed over: a store keeps its block array); false
    /// if the index rejected it, or it names a tier the worker did not
    /// declare.
    fn apply(&mut self, index: &KvIndex, target: WorkerRank, event: TieredEvent) -> bool {
        let result = if self.declared[event.tier.index()] {
            index.apply_tiered(target, event)
        } else {
            Err(IndexError::TierNotDeclared {
                worker: target,
                tier: event.tier,
            })
        };
        match result {
            Ok(applied) => {
                self.outcome.applied += 1;
                self.outcome.unresolved += applied.unresolved;
                true
            }
            Err(error) => {
                self.outcome.rejected += 1;
                *self.rejected.entry(rejection_reason(&error)).or_default() += 1;
                self.outcome.first_rejection.get_or_insert(error);
                false
            }
        }
    }

    /// Counts `count` events skipped for `reason`.
    fn skip(&mut self, reason: &'static str, count: u64) {
        if count > 0 {
            *self.skipped.entry(reason).or_default() += count;
        }
    }

    /// Counts everything in the events metrics.
    fn finish(self, writer: &EventWriter) -> EngineOutcome {
        writer.count_events("applied", "ok", u64::from(self.outcome.applied));
        for (reason, count) in self.rejected {
            writer.count_events("rejected", reason, count);
        }
        for (reason, count) in self.skipped {
            writer.count_events("skipped", reason, count);
        }
        self.outcome
    }
}

fn rejection_reason(error: &IndexError) -> &'static str {
    match error {
        IndexError::UnknownParent { .. } => "unknown_parent",
        IndexError::EngineHashConflict { .. } => "engine_hash_conflict",
        IndexError::TooManyBlocks { .. } => "too_many_blocks",
        IndexError::OverCapacity { .. } => "over_capacity",
        IndexError::TierNotDeclared { .. } => "tier_not_declared",
    }
}
