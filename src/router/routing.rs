//! SelectWorker orchestration: gathers the inputs of the pure decision
//! (registry snapshots, index overlaps, booked load, sessions), runs
//! select → admit → commit under one lock so two RESERVE calls never both
//! choose before either booking shows, and runs the WAIT queue.
//!
//! The queue: a waiting call holds a `QueueTicket`; every change that can
//! lower load (release, prefill complete, expiry, heartbeat, registration)
//! calls [`RouterCore::drain_queue`], which re-selects the head and, if it is
//! no longer busy, commits and hands it the selection. A caller that goes
//! away drops its ticket, which takes it out of the queue and releases a
//! booking made for it in the meantime, so nothing is left behind.

use std::{sync::Arc, time::Duration};

use rand::{RngCore, SeedableRng, rngs::StdRng};
use tokio::sync::oneshot;

use super::{RouterCore, ScorerChoice, now, sync::RoutingChange};
use kvroute_core::{
    admission::{
        self, Admission, AdmissionError, AdmissionMode,
        bookings::BookingLedger,
        peers::{LoadView, PeerEstimates},
        prefill_times::PrefillTimes,
        queue::WaitQueue,
    },
    select::{
        self, CostScorer, Scorer, SelectConfig, SelectContext, SelectMode, SelectRequest,
        Selection, TtftScorer,
        affinity::{SavedSession, SessionTable},
        error::SelectError,
    },
    types::{BookedLoad, CacheView, LocalHash, RankMap, RequestPhase, WorkerId, WorkerRank},
};

/// Why a SelectWorker call failed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum RouteError {
    #[error(transparent)]
    Select(#[from] SelectError),
    #[error(transparent)]
    Admission(#[from] AdmissionError),
    #[error("request {request_id}: the router is shutting down")]
    ShuttingDown { request_id: String },
}

/// A request ready to route: the decision's input plus the prompt's hashes.
#[derive(Clone, Debug)]
pub struct PreparedRequest {
    pub request: SelectRequest,
    pub hashes: Vec<LocalHash>,
    pub admission: AdmissionMode,
    /// The authenticated caller, who will own the booking.
    pub owner: Option<Arc<str>>,
}

/// How admission went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admitted {
    /// Booked at once.
    Now,
    /// Booked after waiting this long.
    AfterQueue(Duration),
    /// Nothing booked: QUERY_ONLY or ADVISORY.
    Untracked,
}

/// A routed request.
#[derive(Clone, Debug)]
pub struct RouteOutcome {
    pub selection: Selection,
    pub admitted: Admitted,
}

/// Mutable routing state, behind one read-write lock (see the module docs):
/// QUERY_ONLY, ADVISORY and explain calls read it in parallel; RESERVE
/// calls and the queue write it.
pub(super) struct RoutingState {
    pub(super) ledger: BookingLedger,
    pub(super) sessions: SessionTable,
    /// Load the peer replicas are estimated to book meanwhile (cluster
    /// mode, `admission::peers`); always empty for one router.
    estimates: PeerEstimates,
    queue: WaitQueue<Waiter>,
    /// Predicted against measured prefill times (TTFT policy).
    pub(super) prefill_times: PrefillTimes,
    /// Seed of every call's tie-break and sampling draws.
    seed: u64,
}

impl RoutingState {
    /// `seed` 0 draws a seed for this process from the OS.
    pub(super) fn new(
        queue_capacity: usize,
        session_ttl: Duration,
        seed: u64,
        estimate_horizon_ms: u64,
    ) -> Self {
        Self {
            ledger: BookingLedger::new(),
            sessions: SessionTable::new(millis(session_ttl)),
            estimates: PeerEstimates::new(estimate_horizon_ms),
            queue: WaitQueue::new(queue_capacity),
            prefill_times: PrefillTimes::new(),
            seed: if seed == 0 {
                StdRng::from_os_rng().next_u64()
            } else {
                seed
            },
        }
    }

    /// The random source of one call: the router's seed mixed with the
    /// request id, so a request's draws are reproducible (the same preview
    /// twice gives the same answer) without a shared, locked generator.
    fn rng_for(&self, request_id: &str) -> StdRng {
        let id = xxhash_rust::xxh3::xxh3_64_with_seed(request_id.as_bytes(), self.seed);
        StdRng::seed_from_u64(id)
    }
}

/// A queued call's request and the channel its answer goes to.
pub(super) struct Waiter {
    prepared: PreparedRequest,
    reply: oneshot::Sender<Result<Selection, RouteError>>,
}

pub(super) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A decision: the selection, and where and how much the requests this
/// replica estimates its peers route meanwhile book (empty for one router;
/// see [`RouterCore::decide`]).
#[derive(Debug)]
struct Decision {
    selection: Selection,
    peer_requests: Vec<(WorkerRank, BookedLoad)>,
}

/// Seed of the tie-breaks of a replica's placements: the same in every
/// replica, whatever its router seed ("kvplaces").
const PLACE_SEED: u64 = 0x6b76_706c_6163_6573;

/// The load a request books on its target once selected (what
/// `admission::commit` books, counting its blocks once for decode).
fn request_load(request: &SelectRequest, selection: &Selection) -> BookedLoad {
    let (prefill_tokens, prefill_blocks) = match request.phase {
        RequestPhase::Decode => (0, 0),
        RequestPhase::Prefill | RequestPhase::Aggregated => (
            selection.request_prefill_tokens,
            selection.request_prefill_blocks,
        ),
    };
    BookedLoad {
        prefill_tokens,
        prefill_blocks,
        decode_blocks: u64::from(selection.total_blocks),
        active_requests: 1,
    }
}

/// The inputs of one decision gathered from the registry and the index.
struct Inputs {
    workers: std::sync::Arc<[kvroute_core::types::WorkerSnapshot]>,
    overlaps: RankMap<u32>,
    cached_blocks: RankMap<u64>,
    /// Targets scored on their predicted cache, and why (the rest: exact).
    predicted: RankMap<CacheView>,
    /// The prompt's prefix keys, when some target is predicted.
    chain: Vec<u64>,
    /// The exact index's own overlap of blended targets (their `overlaps`
    /// entry is the blend).
    index_overlaps: RankMap<u32>,
}

impl Inputs {
    fn view(&self, target: WorkerRank) -> CacheView {
        self.predicted.get(&target).copied().unwrap_or_default()
    }

    /// The exact index's overlap of a target, if it sends events.
    fn index_overlap(&self, target: WorkerRank) -> Option<u32> {
        match self.view(target) {
            CacheView::Exact => Some(self.overlaps.get(&target).copied().unwrap_or(0)),
            CacheView::Blended(_) => Some(self.index_overlaps.get(&target).copied().unwrap_or(0)),
            CacheView::Predicted(_) => None,
        }
    }
}

impl RouterCore {
    /// Milliseconds on the routing clock (tokio's, so tests can pause it).
    pub fn now_ms(&self) -> u64 {
        match &self.manual_clock {
            Some(clock) => clock.load(std::sync::atomic::Ordering::Relaxed),
            None => millis(now().saturating_duration_since(self.started)),
        }
    }

    pub fn select_config(&self) -> SelectConfig {
        SelectConfig {
            overlap_weight: self.config.overlap_weight,
            temperature: self.config.temperature,
            busy: select::eligibility::BusyThresholds {
                prefill_factor: self.config.busy_threshold,
                kv_usage_fraction: self.config.kv_busy_fraction,
            },
            overlap_credit: self.config.overlap_credit,
            ..SelectConfig::default()
        }
    }

    fn gather(&self, request: &SelectRequest, hashes: &[LocalHash]) -> Inputs {
        let workers = self.members.read().registry.model_snapshots(&request.model);
        let targets: Vec<WorkerRank> = workers
            .iter()
            .flat_map(|w| w.ranks().map(|r| WorkerRank::new(w.worker_id, r)))
            .collect();
        let mut overlaps = RankMap::with_capacity_and_hasher(targets.len(), Default::default());
        let mut cached_blocks =
            RankMap::with_capacity_and_hasher(targets.len(), Default::default());
        if let Some(index) = self.index_of(&request.model) {
            for overlap in index.find_matches(hashes).scores {
                overlaps.insert(overlap.worker, overlap.blocks);
            }
            let counts = index.worker_blocks_many(&targets);
            cached_blocks.extend(targets.into_iter().zip(counts));
        }
        let mut predicted = RankMap::default();
        let trust = self.trust.read();
        for worker in workers.iter() {
            let view = self.view_with(worker, &trust);
            if view.reads_predictions() {
                predicted.extend(
                    worker
                        .ranks()
                        .map(|r| (WorkerRank::new(worker.worker_id, r), view)),
                );
            }
        }
        drop(trust);
        let mut chain = Vec::new();
        let mut index_overlaps = RankMap::default();
        if !predicted.is_empty() {
            chain = admission::bookings::prefix_keys(hashes);
            let now_ms = self.now_ms();
            let predictions = self.predictions.read();
            for &target in predicted.keys() {
                let mut blocks = predictions.overlap(target, &chain, now_ms);
                let mut held = predictions.blocks(target);
                if let Some(CacheView::Blended(_)) = predicted.get(&target) {
                    // The index up to the trouble, the predictions since.
                    let index = overlaps.get(&target).copied().unwrap_or(0);
                    index_overlaps.insert(target, index);
                    blocks = blocks.max(index);
                    held = held.max(cached_blocks.get(&target).copied().unwrap_or(0));
                }
                match blocks {
                    0 => overlaps.remove(&target),
                    blocks => overlaps.insert(target, blocks),
                };
                cached_blocks.insert(target, held);
            }
        }
        Inputs {
            workers,
            overlaps,
            cached_blocks,
            predicted,
            chain,
            index_overlaps,
        }
    }

    /// Selects a target for a request. One router selects once from its
    /// booked load. A replica that estimates its peers' load
    /// (`RouterConfig::replicas`, `admission::peers`) counts its estimates
    /// too, and takes the request as a sample of what each of the `count`
    /// replicas may be routing at this moment: it places `count` requests
    /// one after another, each seeing the ones before, as one router would
    /// place them, its own in its place (`index`) and the others, the
    /// peers', before and after it. It knows nothing of the peers'
    /// requests but their likely size: each books what this request books
    /// where it would go alone, and goes where load alone sends it (their
    /// cached prefixes are unknown; this request's is not theirs). The
    /// peers' placements are returned as the load they are estimated to
    /// book. A pinned request is no sample of what peers route: it
    /// estimates nothing.
    fn decide(
        &self,
        state: &RoutingState,
        prepared: &PreparedRequest,
        inputs: &Inputs,
    ) -> Result<Decision, SelectError> {
        let now_ms = self.now_ms();
        let ttft_scorer;
        let scorer: &dyn Scorer = match self.config.scorer {
            ScorerChoice::Cost => &CostScorer,
            ScorerChoice::Ttft(settings) => {
                ttft_scorer = TtftScorer { settings };
                &ttft_scorer
            }
        };
        // `place`: the decision's place among the replicas' (see above),
        // whose exact ties every replica breaks alike: a shared seed, not
        // the router's or the request's, or replicas with distinct places
        // could still choose alike among equal workers.
        let select_with = |request: &SelectRequest,
                           overlaps: &RankMap<u32>,
                           booked: &dyn select::BookedLoads,
                           place: Option<u32>| {
            let context = SelectContext {
                workers: &inputs.workers,
                overlaps,
                cached_blocks: &inputs.cached_blocks,
                booked,
                sessions: &state.sessions,
                now_ms,
                prefill_timing: &state.prefill_times,
            };
            let mut rng = match place {
                None => state.rng_for(&request.request_id),
                Some(place) => StdRng::seed_from_u64(PLACE_SEED ^ u64::from(place)),
            };
            select::select(request, &context, &self.select_config(), scorer, &mut rng)
        };
        let request = &prepared.request;
        let replicas = self.config.replicas;
        if !replicas.estimates_peers() {
            return Ok(Decision {
                selection: select_with(request, &inputs.overlaps, &state.ledger, None)?,
                peer_requests: Vec::new(),
            });
        }
        let mut placed: Vec<(WorkerRank, BookedLoad)> = Vec::with_capacity(replicas.count as usize);
        let alone = select_with(
            request,
            &inputs.overlaps,
            &LoadView {
                ledger: &state.ledger,
                estimates: &state.estimates,
                now_ms,
                placed: &placed,
            },
            Some(0),
        )?;
        if alone.route != select::Route::Scored {
            return Ok(Decision {
                selection: alone,
                peer_requests: Vec::new(),
            });
        }
        // A peer's request: this one's size, no session, no cached prefix.
        let peer_load = request_load(request, &alone);
        let peer_request = SelectRequest {
            session: None,
            planned_worker: None,
            ..request.clone()
        };
        let no_overlaps = RankMap::default();
        let own_place = replicas.index.min(replicas.count - 1);
        let mut own = None;
        for place in 0..replicas.count {
            let view = LoadView {
                ledger: &state.ledger,
                estimates: &state.estimates,
                now_ms,
                placed: &placed,
            };
            if place == own_place {
                let selection = if place == 0 {
                    alone.clone()
                } else {
                    select_with(request, &inputs.overlaps, &view, Some(place))?
                };
                let load = request_load(request, &selection);
                own = Some((placed.len(), selection.clone()));
                placed.push((selection.target, load));
            } else {
                let target = select_with(&peer_request, &no_overlaps, &view, Some(place))?.target;
                placed.push((target, peer_load));
            }
        }
        let (at, selection) = own.unwrap_or((placed.len(), alone));
        if at < placed.len() {
            placed.remove(at);
        }
        Ok(Decision {
            selection,
            peer_requests: placed,
        })
    }

    /// Scores a request without changing anything (ExplainSelection).
    pub fn explain(&self, prepared: &PreparedRequest) -> Result<Selection, RouteError> {
        let inputs = self.gather(&prepared.request, &prepared.hashes);
        let state = self.routing.read();
        let mut selection = self.decide(&state, prepared, &inputs)?.selection;
        for candidate in &mut selection.candidates {
            candidate.view = inputs.view(candidate.target);
        }
        Ok(selection)
    }

    /// Routes and books a request at once, whatever its admission mode and
    /// however busy the fleet (the replay simulator's engines queue by
    /// themselves).
    pub fn route_unqueued(&self, prepared: PreparedRequest) -> Result<RouteOutcome, RouteError> {
        let inputs = self.gather(&prepared.request, &prepared.hashes);
        let mut state = self.routing.write();
        let decision = self.decide(&state, &prepared, &inputs)?;
        let booked = self.commit(&mut state, &prepared, &inputs, &decision)?;
        let selection = decision.selection;
        drop(state);
        let admitted = if booked {
            Admitted::Now
        } else {
            Admitted::Untracked
        };
        Ok(self.record(selection, admitted, "admitted"))
    }

    /// Routes a request; WAIT admission queues until `deadline`.
    pub async fn route(
        &self,
        prepared: PreparedRequest,
        deadline: tokio::time::Instant,
    ) -> Result<RouteOutcome, RouteError> {
        let inputs = self.gather(&prepared.request, &prepared.hashes);
        let request_id = prepared.request.request_id.clone();
        let query_only = prepared.request.mode == SelectMode::QueryOnly;
        if query_only || prepared.admission == AdmissionMode::Advisory {
            // Nothing to book: decide under the read lock, in parallel.
            let selection = self
                .decide(&self.routing.read(), &prepared, &inputs)?
                .selection;
            let outcome = match admission::admit(&request_id, prepared.admission, &selection)? {
                Admission::Advisory => "advisory",
                _ => "query_only",
            };
            return Ok(self.record(selection, Admitted::Untracked, outcome));
        }
        let (receiver, target) = {
            let mut state = self.routing.write();
            let decision = self.decide(&state, &prepared, &inputs)?;
            match admission::admit(&request_id, prepared.admission, &decision.selection)? {
                Admission::Advisory => {
                    return Ok(self.record(decision.selection, Admitted::Untracked, "advisory"));
                }
                Admission::Admit => {
                    let booked = self.commit(&mut state, &prepared, &inputs, &decision)?;
                    let selection = decision.selection;
                    let (admitted, outcome) = if booked {
                        (Admitted::Now, "admitted")
                    } else {
                        (Admitted::Untracked, "query_only")
                    };
                    return Ok(self.record(selection, admitted, outcome));
                }
                Admission::Queue => {
                    let (reply, receiver) = oneshot::channel();
                    let request = &prepared.request;
                    let (strict, jump) =
                        (request.hints.strict_priority, request.hints.priority_jump);
                    let now_ms = self.now_ms();
                    let target = decision.selection.target;
                    state.queue.push(
                        &request_id,
                        strict,
                        jump,
                        now_ms,
                        Waiter { prepared, reply },
                    )?;
                    self.metrics.queue_depth.set(state.queue.len() as i64);
                    (receiver, target)
                }
            }
        };
        // Timed on the routing clock, as the deadline is.
        let queued_at = now();
        let mut ticket = QueueTicket {
            core: self,
            request_id: request_id.clone(),
            receiver: Some(receiver),
        };
        let answer = match ticket.receiver.as_mut() {
            Some(receiver) => tokio::time::timeout_at(deadline, receiver).await,
            None => return Err(RouteError::ShuttingDown { request_id }),
        };
        let waited = now().saturating_duration_since(queued_at);
        match answer {
            Ok(Ok(result)) => {
                ticket.receiver = None;
                let selection = result?;
                self.metrics
                    .queue_wait
                    .with_label_values(&["admitted"])
                    .observe(waited.as_secs_f64());
                Ok(self.record(
                    selection,
                    Admitted::AfterQueue(waited),
                    "admitted_after_queue",
                ))
            }
            Ok(Err(_)) => Err(RouteError::ShuttingDown { request_id }),
            Err(_) => {
                drop(ticket); // out of the queue; releases a booking that raced in
                self.metrics
                    .queue_wait
                    .with_label_values(&["deadline"])
                    .observe(waited.as_secs_f64());
                self.metrics
                    .decisions
                    .with_label_values(&["deadline_exceeded"])
                    .inc();
                Err(AdmissionError::DeadlineExceeded {
                    request_id,
                    target,
                    waited_ms: millis(waited),
                }
                .into())
            }
        }
    }

    /// Books a decision (RESERVE): the request's load, its session, and
    /// the load estimated for its peers, which ages out by itself.
    fn commit(
        &self,
        state: &mut RoutingState,
        prepared: &PreparedRequest,
        inputs: &Inputs,
        decision: &Decision,
    ) -> Result<bool, AdmissionError> {
        let now_ms = self.now_ms();
        let selection = &decision.selection;
        let RoutingState {
            ledger,
            sessions,
            estimates,
            prefill_times,
            ..
        } = state;
        let booked = admission::commit(
            &prepared.request,
            selection,
            &prepared.hashes,
            ledger,
            sessions,
            now_ms,
        )?;
        if booked && let Some(owner) = &prepared.owner {
            ledger.set_owner(&prepared.request.request_id, owner.clone());
        }
        if booked {
            self.predict_booked(
                &prepared.request.request_id,
                inputs,
                selection.target,
                now_ms,
            );
            self.expect_report(&prepared.request, inputs, selection, now_ms);
            for (target, load) in &decision.peer_requests {
                estimates.add(*target, *load, now_ms);
            }
            if let Some(parts) = selection.chosen_ttft() {
                prefill_times.predicted(
                    &prepared.request.request_id,
                    selection.target,
                    parts,
                    now_ms,
                );
            }
        }
        self.metrics.bookings_active.set(ledger.len() as i64);
        if booked && self.feeding() {
            let request = &prepared.request;
            if let Some(saved) = ledger.export_one(&request.request_id, now_ms) {
                self.feed(RoutingChange::Booked(saved));
            }
            let session = request.session.as_ref().and_then(|s| {
                let target = sessions.lookup(&s.session_id, now_ms)?;
                Some(SavedSession {
                    session_id: s.session_id.clone(),
                    target,
                    idle_ms: 0,
                })
            });
            if let Some(session) = session {
                self.feed(RoutingChange::SessionBound(session));
            }
        }
        Ok(booked)
    }

    /// Holds a booked prompt for its target, when the target is scored on
    /// its predicted cache: recorded at MarkPrefillComplete, or at Release
    /// if that comes first (`kvroute_core::predict`).
    fn predict_booked(&self, request_id: &str, inputs: &Inputs, target: WorkerRank, now_ms: u64) {
        if !inputs.view(target).reads_predictions() {
            return;
        }
        if let Some(worker) = inputs
            .workers
            .iter()
            .find(|w| w.worker_id == target.worker_id)
        {
            self.hold_prediction(request_id, target, worker, inputs.chain.clone(), now_ms);
        }
    }

    /// Leaves what the booked request's engine should report cached
    /// (`feedback.rs`).
    fn expect_report(
        &self,
        request: &SelectRequest,
        inputs: &Inputs,
        selection: &Selection,
        now_ms: u64,
    ) {
        let tokens = |blocks: u32| {
            (u64::from(blocks) * u64::from(request.block_size)).min(request.prompt_tokens)
        };
        let target = selection.target;
        self.feedback.lock().expect(
            &request.request_id,
            super::feedback::Expectation {
                target,
                prompt_tokens: request.prompt_tokens,
                block_size: request.block_size,
                scored_tokens: selection.cached_tokens,
                index_tokens: inputs.index_overlap(target).map(tokens),
                view: inputs.view(target),
                booked_ms: now_ms,
            },
        );
    }

    fn record(&self, selection: Selection, admitted: Admitted, outcome: &str) -> RouteOutcome {
        self.metrics.decisions.with_label_values(&[outcome]).inc();
        if selection.total_blocks > 0 {
            let mode = if admitted == Admitted::Untracked {
                "untracked"
            } else {
                "reserve"
            };
            self.metrics
                .overlap_ratio
                .with_label_values(&[mode])
                .observe(f64::from(selection.overlap_blocks) / f64::from(selection.total_blocks));
        }
        RouteOutcome {
            selection,
            admitted,
        }
    }

    /// Whether an open booking was made by another identity than `caller`
    /// (bookings made without authentication belong to no one).
    pub fn booked_by_other(&self, request_id: &str, caller: &str) -> bool {
        let state = self.routing.read();
        matches!(state.ledger.owner(request_id), Some(Some(owner)) if &**owner != caller)
    }

    /// Drops a request's booked prefill; idempotent.
    pub fn mark_prefill_complete(&self, request_id: &str) -> bool {
        let now_ms = self.now_ms();
        let changed = {
            let mut state = self.routing.write();
            state.prefill_times.completed(request_id, now_ms);
            self.predictions.write().settle(request_id, now_ms);
            if let Some(booking) = state.ledger.booking(request_id)
                && booking.prefill_outstanding
                && booking.prefill_blocks > 0
                && self.sends_events(booking.target.worker_id)
            {
                self.trust.write().note_prefill_completed(
                    booking.target.worker_id,
                    booking.booked_at_ms,
                    now_ms,
                );
            }
            state.ledger.mark_prefill_complete(request_id)
        };
        // In a cluster the booking may be another replica's: tell them
        // whether or not this replica knew it.
        if changed || self.feeding() {
            self.feed(RoutingChange::PrefillComplete(request_id.to_owned()));
        }
        if changed {
            self.drain_queue();
        }
        changed
    }

    /// Drops all of a request's booked load; idempotent.
    pub fn release_request(&self, request_id: &str) -> bool {
        let changed = {
            let mut state = self.routing.write();
            state.prefill_times.forget(request_id);
            self.predictions.write().settle(request_id, self.now_ms());
            self.feedback.lock().forget(request_id);
            let changed = state.ledger.release(request_id);
            self.metrics.bookings_active.set(state.ledger.len() as i64);
            changed
        };
        if changed || self.feeding() {
            if !changed {
                // Booked elsewhere and not yet heard of here.
                self.remember_release(request_id);
            }
            self.feed(RoutingChange::Released(request_id.to_owned()));
        }
        if changed {
            self.drain_queue();
        }
        changed
    }

    /// Drops bookings and sessions of a worker that left.
    pub fn forget_worker(&self, worker_id: WorkerId) {
        {
            let mut state = self.routing.write();
            state.ledger.release_worker(worker_id);
            state.sessions.remove_worker(worker_id);
            state.prefill_times.forget_worker(worker_id);
            self.metrics.bookings_active.set(state.ledger.len() as i64);
        }
        self.predictions.write().forget_worker(worker_id);
        self.events_seen.remove(&worker_id);
        self.trust.write().forget_worker(worker_id);
        self.forget_feedback(worker_id);
        self.drain_queue();
    }

    /// Expires bookings never released and sessions unused; returns the
    /// bookings expired.
    pub fn expire_bookings(&self) -> usize {
        let now_ms = self.now_ms();
        let expired = {
            let mut state = self.routing.write();
            let expired = state.ledger.expire(now_ms, millis(self.config.booking_ttl));
            state.sessions.expire(now_ms);
            state
                .prefill_times
                .expire(now_ms, millis(self.config.booking_ttl));
            let mut predictions = self.predictions.write();
            predictions.expire(now_ms);
            let cutoff = now_ms.saturating_sub(millis(self.config.booking_ttl));
            predictions.expire_pending(cutoff);
            drop(predictions);
            self.feedback.lock().expire(cutoff);
            self.metrics.bookings_active.set(state.ledger.len() as i64);
            expired
        };
        if expired > 0 {
            self.metrics.bookings_expired.inc_by(expired as u64);
            self.drain_queue();
        }
        expired
    }

    /// Admits queued calls, head first, while their choice is not busy.
    pub fn drain_queue(&self) {
        let mut state = self.routing.write();
        while let Some(entry) = state.queue.pop() {
            let inputs = self.gather(
                &entry.payload.prepared.request,
                &entry.payload.prepared.hashes,
            );
            let decision = match self.decide(&state, &entry.payload.prepared, &inputs) {
                Ok(decision) => decision,
                Err(error) => {
                    let _ = entry.payload.reply.send(Err(error.into()));
                    continue;
                }
            };
            if decision.selection.all_busy {
                // Still busy: back to its place, and the rest wait behind it.
                if state.queue.reinsert(entry).is_err() {
                    tracing::warn!("queue reinsert failed");
                }
                break;
            }
            let prepared = &entry.payload.prepared;
            let result = self
                .commit(&mut state, prepared, &inputs, &decision)
                .map(|_| decision.selection)
                .map_err(RouteError::from);
            let request_id = prepared.request.request_id.clone();
            if entry.payload.reply.send(result).is_err() {
                // The caller left between its deadline and now.
                if state.ledger.release(&request_id) {
                    self.feed(RoutingChange::Released(request_id));
                }
            }
        }
        self.metrics.queue_depth.set(state.queue.len() as i64);
        self.metrics.bookings_active.set(state.ledger.len() as i64);
    }

    /// Fails every queued call (shutdown).
    pub fn fail_queue(&self) {
        let mut state = self.routing.write();
        while let Some(entry) = state.queue.pop() {
            let request_id = entry.request_id.clone();
            let _ = entry
                .payload
                .reply
                .send(Err(RouteError::ShuttingDown { request_id }));
        }
        self.metrics.queue_depth.set(0);
    }
}

/// A queued call's place; dropping it (deadline, or the caller went away)
/// removes the call from the queue and releases a booking made for it that
/// it never received.
struct QueueTicket<'a> {
    core: &'a RouterCore,
    request_id: String,
    receiver: Option<oneshot::Receiver<Result<Selection, RouteError>>>,
}

impl Drop for QueueTicket<'_> {
    fn drop(&mut self) {
        let Some(mut receiver) = self.receiver.take() else {
            return;
        };
        let mut state = self.core.routing.write();
        state.queue.remove(&self.request_id);
        if let Ok(Ok(_)) = receiver.try_recv()
            && state.ledger.release(&self.request_id)
        {
            self.core
                .feed(RoutingChange::Released(self.request_id.clone()));
        }
        self.core.metrics.queue_depth.set(state.queue.len() as i64);
        self.core
            .metrics
            .bookings_active
            .set(state.ledger.len() as i64);
    }
}
