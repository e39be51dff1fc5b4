//! The fleet's state as a snapshot keeps it: taken while the router serves,
//! and restored into a fleet that has no worker yet, at start.
//!
//! Why here: the state spans the router core (registry, sessions,
//! bookings), the writer (each target's blocks and cursor) and the
//! subscriptions (each engine's source and publisher sequence), and only
//! the fleet owns all of them. Taking it never stops routing or ingestion
//! for long: the registry and the routing state are copied under their
//! locks at once (small), then each target is captured by the writer as
//! one job between the others, so its blocks and cursor agree with each
//! other without holding up any other target's events.

use std::{collections::HashMap, sync::Arc};

use super::Fleet;
use crate::{
    engine_events::{EngineSource, ResumePoint},
    ingest::{CapturedTarget, RankRegistration},
};
use kvroute_core::{
    admission::bookings::SavedBooking,
    registry::{SavedWorker, WorkerRecord},
    select::affinity::SavedSession,
    types::{EngineHash, WorkerId, WorkerRank},
};

/// A worker as a snapshot keeps it.
#[derive(Clone, Debug, PartialEq)]
pub struct FleetWorker {
    pub worker: SavedWorker,
    /// The engine kvroute subscribes to for it.
    pub source: Option<EngineSource>,
    /// Started from `kvroute serve --engine` (restarted from the
    /// configuration, not from the snapshot).
    pub configured: bool,
}

/// One (worker, rank) as a snapshot keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FleetTarget {
    pub target: WorkerRank,
    pub captured: CapturedTarget,
    /// The last engine publisher sequence applied, for ZeroMQ engines.
    pub engine_sequence: Option<u64>,
    /// The engine's events for it were lost for good (it stays unsynced
    /// until the engine reports `AllBlocksCleared`).
    pub engine_unsynced: bool,
    /// The engine's cache salt of each salted block the rank holds (a chain
    /// continued after the restart hashes with it).
    pub engine_salts: Vec<(EngineHash, Arc<str>)>,
}

/// Everything a snapshot keeps.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FleetState {
    pub workers: Vec<FleetWorker>,
    pub targets: Vec<FleetTarget>,
    pub sessions: Vec<SavedSession>,
    pub bookings: Vec<SavedBooking>,
    /// The routing clock the sessions' and bookings' ages are from (0:
    /// not recorded).
    pub routing_clock_ms: u64,
}

impl FleetState {
    /// Cached (target, block) entries.
    pub(crate) fn entries(&self) -> u64 {
        self.targets
            .iter()
            .map(|t| t.captured.content.held() as u64)
            .sum()
    }
}

/// What a restore did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RestoreReport {
    pub workers: usize,
    pub targets: usize,
    pub entries: u64,
    /// Saved workers the registry refused now (e.g. a block size another
    /// restored worker of their model contradicts), with why.
    pub workers_refused: Vec<(WorkerId, String)>,
    /// Saved targets that could not be rebuilt.
    pub targets_refused: usize,
    pub bookings_refused: usize,
}

impl Fleet {
    /// Takes the fleet's state (see the module docs).
    pub(crate) async fn capture(&self) -> FleetState {
        let records = self.router.workers(None);
        let (sessions, bookings) = self.router.saved_routing();
        let now = crate::router::now();
        let mut state = FleetState {
            sessions,
            bookings,
            routing_clock_ms: self.router.clock_ms(),
            ..FleetState::default()
        };
        for record in &records {
            let r = &record.registration;
            let (source, configured) = self.subscriptions.source_of(r.worker_id).unzip();
            // Read before the blocks: a batch applied in between is then
            // replayed again on resume (harmless), never skipped.
            let mut resume = self.subscriptions.resume_point(r.worker_id);
            for dp_rank in r.dp_start_rank..r.dp_start_rank.saturating_add(r.dp_size) {
                let target = WorkerRank::new(r.worker_id, dp_rank);
                let rank = RankRegistration {
                    target,
                    generation: record.generation,
                    model: r.model.clone(),
                };
                // None: the worker left or re-registered since; its blocks
                // are not what the saved registration describes.
                let Some(captured) = self.ingest.capture(rank).await else {
                    continue;
                };
                state.targets.push(FleetTarget {
                    target,
                    captured,
                    engine_sequence: resume.sequences.get(&dp_rank).copied(),
                    engine_unsynced: resume.unsynced.contains(&dp_rank),
                    engine_salts: resume.salts.remove(&dp_rank).unwrap_or_default(),
                });
            }
            state.workers.push(FleetWorker {
                worker: record.saved(now),
                source,
                configured: configured.unwrap_or(false),
            });
        }
        state
    }

    /// Restores `state` into this fleet, which must have no worker yet:
    /// the workers (with the lease time they had left), their blocks and
    /// cursors, sessions and bookings; then the engine subscriptions of
    /// workers registered over gRPC (configured engines are started from
    /// the configuration afterwards). What cannot be restored is reported,
    /// never fatal.
    pub(crate) async fn restore(&self, state: FleetState) -> RestoreReport {
        let mut report = RestoreReport::default();
        let mut restored: HashMap<WorkerId, WorkerRecord> = HashMap::new();
        let mut seen = std::collections::HashSet::new();
        let mut sources = Vec::new();
        let mut configured = std::collections::HashSet::new();
        for saved in state.workers {
            let worker_id = saved.worker.registration.worker_id;
            if !seen.insert(worker_id) {
                report.workers_refused.push((
                    worker_id,
                    "saved more than once in the snapshot; the first kept".into(),
                ));
                continue;
            }
            if let (Some(source), false) = (&saved.source, saved.configured)
                && let Some(endpoint) = [Some(&source.endpoint), source.replay_endpoint.as_ref()]
                    .into_iter()
                    .flatten()
                    .find(|endpoint| !(self.restored_endpoints)(endpoint))
            {
                report.workers_refused.push((
                    worker_id,
                    format!(
                        "its engine endpoint {endpoint} is not one kvroute may connect to on its own (see --engine-endpoint-allow); it must register again"
                    ),
                ));
                continue;
            }
            let _turn = self.turn(worker_id).await;
            match self.router.restore_worker(saved.worker) {
                Ok(outcome) => {
                    let r = &outcome.record;
                    restored.insert(worker_id, r.clone());
                    self.ingest.reserve(&r.snapshot()).await;
                    match (saved.source, saved.configured) {
                        (Some(source), false) => sources.push((outcome.record, source)),
                        (_, true) => {
                            configured.insert(worker_id);
                        }
                        (None, false) => {}
                    }
                    report.workers += 1;
                }
                Err(error) => report.workers_refused.push((worker_id, error.to_string())),
            }
        }
        let mut resume: HashMap<WorkerId, ResumePoint> = HashMap::new();
        for saved in state.targets {
            let entry = resume.entry(saved.target.worker_id).or_default();
            let rank = saved.target.dp_rank;
            if let Some(sequence) = saved.engine_sequence {
                entry.sequences.insert(rank, sequence);
            }
            if saved.engine_unsynced {
                entry.unsynced.push(rank);
            }
            if !saved.engine_salts.is_empty() {
                entry.salts.insert(rank, saved.engine_salts);
            }
            // Blocks of a worker not restored, or of a rank it does not
            // have, would sit in the index where nothing reads them
            // (counted in the report, which the caller logs once).
            let Some(record) = restored
                .get(&saved.target.worker_id)
                .filter(|r| r.has_rank(saved.target.dp_rank))
            else {
                report.targets_refused += 1;
                continue;
            };
            let entries = saved.captured.content.held() as u64;
            let rank = RankRegistration {
                target: saved.target,
                generation: record.generation,
                model: record.registration.model.clone(),
            };
            match self.ingest.restore(rank, saved.captured).await {
                Ok(()) => {
                    report.targets += 1;
                    report.entries += entries;
                }
                Err(error) => {
                    tracing::warn!(target = %saved.target, %error, "saved target not restored");
                    report.targets_refused += 1;
                }
            }
        }
        // A core on the log's clock (ordered decisions) resumes it where
        // the snapshot was taken, so restored ages match the other replicas'.
        self.router.set_clock_ms(state.routing_clock_ms);
        report.bookings_refused = self.router.restore_routing(state.sessions, state.bookings);
        // Configured engines restart from the configuration, resuming there.
        let (configured_resume, mut resume): (HashMap<_, _>, HashMap<_, _>) = resume
            .into_iter()
            .partition(|(worker_id, _)| configured.contains(worker_id));
        self.configured_resume.lock().extend(configured_resume);
        for (record, source) in sources {
            let worker_id = record.registration.worker_id;
            let saved = resume.remove(&worker_id).unwrap_or_default();
            let _turn = self.turn(worker_id).await;
            let started = self
                .subscriptions
                .update_resuming(&record, Some(source), false, saved)
                .await;
            if let Err(message) = started {
                tracing::warn!(worker_id, %message, "saved engine subscription not restarted");
            }
        }
        self.router.drain_queue();
        report
    }
}
