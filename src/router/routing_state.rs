//! The routing side: bookings, sessions, the WAIT queue, peer estimates
//! and measured prefill times behind the `routing` lock, with the two
//! mutexes only the routing side takes: `feed`, where this core's own
//! changes go to the other replicas (cluster mode, `sync.rs`), and
//! `released`, the releases that came before their booking.
//!
//! Why a type: each operation here takes the lock itself, once, and makes
//! its whole change under that hold: decide (select → admit) and book,
//! release, mark prefill complete, drain the queue, expire, forget a
//! worker, apply a peer's change. Two RESERVE calls thus never both choose
//! before either booking shows. What a change does to the cache views (a
//! booking's prediction and expectation; a release settling them) is done
//! under the same hold through the [`CacheViews`] the caller passes:
//! `routing` → the views' locks. What needs the registry (a worker's mode,
//! whether it is still registered, a queued request's new inputs) the
//! caller passes as a function, read under the hold: `routing` → `members`.
//! Neither calls back into this side.

use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use rand::{RngCore, SeedableRng, rngs::StdRng};
use tokio::sync::{mpsc, oneshot};

use super::{
    ReplicaSettings, RouterConfig, ScorerChoice,
    clock::{Clock, millis},
    sync::{RecentReleases, RoutingChange},
    views::{CacheViews, Inputs},
};
use crate::metrics::Metrics;
use kvroute_core::{
    admission::{
        self, Admission, AdmissionError, AdmissionMode,
        bookings::{BookingLedger, SavedBooking},
        peers::{LoadView, PeerEstimates},
        prefill_times::PrefillTimes,
        queue::WaitQueue,
    },
    select::{
        self, CostScorer, Scorer, SelectConfig, SelectContext, SelectRequest, Selection,
        TtftScorer,
        affinity::{SavedSession, SessionTable},
        error::SelectError,
    },
    types::{BookedLoad, LocalHash, RankMap, RequestPhase, WorkerId, WorkerRank, WorkerSnapshot},
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
    /// Ordered decisions: the call is in the shared log but this replica
    /// did not decide it in time (it may still be booked: release it
    /// before routing it again).
    #[error("request {request_id}: {why}")]
    NotDecided { request_id: String, why: String },
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

/// The answer a queued call waits for.
pub(super) type Answer = oneshot::Receiver<Result<Selection, RouteError>>;

/// How a RESERVE call went under the write lock.
pub(super) enum Reserved {
    /// ADVISORY admission found every candidate busy: answered, nothing
    /// booked.
    Advisory(Selection),
    /// Decided and committed: `booked` unless the request books nothing.
    Committed { selection: Selection, booked: bool },
    /// Queued (WAIT): the answer comes on `answer`.
    Queued { answer: Answer, target: WorkerRank },
}

/// What a replica decided for a call read from the shared log (ordered
/// decisions, `ordered.rs`).
#[derive(Clone, Debug, PartialEq)]
pub enum OrderedAnswer {
    /// Decided and, unless it books nothing, booked.
    Decided { selection: Selection, booked: bool },
    /// ADVISORY admission found every candidate busy: nothing booked.
    Advisory(Selection),
    /// WAIT admission found every candidate busy: nothing booked; the
    /// replica that took the call tries it again.
    Busy { target: WorkerRank },
}

/// The state behind the `routing` lock (see the module docs): QUERY_ONLY,
/// ADVISORY and explain calls read it in parallel; RESERVE calls and the
/// queue write it.
struct RoutingState {
    ledger: BookingLedger,
    sessions: SessionTable,
    /// Load the peer replicas are estimated to book meanwhile (cluster
    /// mode, `admission::peers`); always empty for one router.
    estimates: PeerEstimates,
    queue: WaitQueue<Waiter>,
    /// Predicted against measured prefill times (TTFT policy).
    prefill_times: PrefillTimes,
    /// Seed of every call's tie-break and sampling draws.
    seed: u64,
}

impl RoutingState {
    /// `seed` 0 draws a seed for this process from the OS.
    fn new(config: &RouterConfig) -> Self {
        let seed = config.seed;
        Self {
            ledger: BookingLedger::with_limits(config.booking_limits),
            sessions: SessionTable::new(millis(config.session_ttl)),
            estimates: PeerEstimates::new(config.replicas.horizon_ms()),
            queue: WaitQueue::new(config.queue_capacity),
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
struct Waiter {
    prepared: PreparedRequest,
    reply: oneshot::Sender<Result<Selection, RouteError>>,
}

/// A decision: the selection, and where and how much the requests this
/// replica estimates its peers route meanwhile book (empty for one router;
/// see [`Routing::decide`]).
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

/// The routing side (see the module docs).
pub(super) struct Routing {
    routing: RwLock<RoutingState>,
    /// Where this core's own routing changes go (cluster mode).
    feed: Mutex<Option<mpsc::Sender<RoutingChange>>>,
    /// Releases that came before their booking.
    released: Mutex<RecentReleases>,
    select: SelectConfig,
    scorer: ScorerChoice,
    replicas: ReplicaSettings,
    booking_ttl_ms: u64,
    clock: Clock,
    metrics: Arc<Metrics>,
}

impl Routing {
    pub(super) fn new(config: &RouterConfig, metrics: Arc<Metrics>, clock: Clock) -> Self {
        Self {
            routing: RwLock::new(RoutingState::new(config)),
            feed: Mutex::new(None),
            released: Mutex::new(RecentReleases::default()),
            select: SelectConfig {
                overlap_weight: config.overlap_weight,
                temperature: config.temperature,
                busy: select::eligibility::BusyThresholds {
                    prefill_factor: config.busy_threshold,
                    kv_usage_fraction: config.kv_busy_fraction,
                },
                overlap_credit: config.overlap_credit,
                tier_savings: config.tier_savings,
                adapter_load_tokens: config.adapter_load_tokens,
                ..SelectConfig::default()
            },
            scorer: config.scorer,
            replicas: config.replicas,
            booking_ttl_ms: millis(config.booking_ttl),
            clock,
            metrics,
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
        let now_ms = self.clock.now_ms();
        let ttft_scorer;
        let scorer: &dyn Scorer = match self.scorer {
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
                tier_overlaps: &inputs.tier_overlaps,
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
            select::select(request, &context, &self.select, scorer, &mut rng)
        };
        let request = &prepared.request;
        let replicas = self.replicas;
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

    /// Decides under the read lock and changes nothing (QUERY_ONLY,
    /// ADVISORY, ExplainSelection): such calls decide in parallel.
    pub(super) fn preview(
        &self,
        prepared: &PreparedRequest,
        inputs: &Inputs,
    ) -> Result<Selection, SelectError> {
        Ok(self
            .decide(&self.routing.read(), prepared, inputs)?
            .selection)
    }

    /// Decides and admits a RESERVE call under one hold of the write lock:
    /// books it, answers it ADVISORY, or queues it (WAIT) when every
    /// eligible candidate is busy.
    pub(super) fn reserve(
        &self,
        views: &CacheViews,
        prepared: PreparedRequest,
        inputs: &Inputs,
    ) -> Result<Reserved, RouteError> {
        let request_id = prepared.request.request_id.clone();
        let mut state = self.routing.write();
        let decision = self.decide(&state, &prepared, inputs)?;
        match admission::admit(&request_id, prepared.admission, &decision.selection)? {
            Admission::Advisory => Ok(Reserved::Advisory(decision.selection)),
            Admission::Admit => {
                let booked = self.commit(&mut state, views, &prepared, inputs, &decision, true)?;
                Ok(Reserved::Committed {
                    selection: decision.selection,
                    booked,
                })
            }
            Admission::Queue => {
                let (reply, answer) = oneshot::channel();
                let request = &prepared.request;
                let (strict, jump) = (request.hints.strict_priority, request.hints.priority_jump);
                let now_ms = self.clock.now_ms();
                let target = decision.selection.target;
                state.queue.push(
                    &request_id,
                    strict,
                    jump,
                    now_ms,
                    Waiter { prepared, reply },
                )?;
                self.metrics.queue_depth.set(state.queue.len() as i64);
                Ok(Reserved::Queued { answer, target })
            }
        }
    }

    /// Decides and books at once, whatever the admission mode and however
    /// busy the fleet (the replay simulator's engines queue by
    /// themselves); returns the selection and whether it was booked.
    pub(super) fn book_now(
        &self,
        views: &CacheViews,
        prepared: &PreparedRequest,
        inputs: &Inputs,
    ) -> Result<(Selection, bool), RouteError> {
        let mut state = self.routing.write();
        let decision = self.decide(&state, prepared, inputs)?;
        let booked = self.commit(&mut state, views, prepared, inputs, &decision, true)?;
        Ok((decision.selection, booked))
    }

    /// Decides and admits a RESERVE call read from the shared log: as
    /// [`Self::reserve`], but nothing waits here and nothing is fed out
    /// (every replica makes the same booking from the same record). A call
    /// WAIT would queue is answered busy; its replica tries it again.
    pub(super) fn reserve_ordered(
        &self,
        views: &CacheViews,
        prepared: &PreparedRequest,
        inputs: &Inputs,
    ) -> Result<OrderedAnswer, RouteError> {
        let request_id = &prepared.request.request_id;
        let mut state = self.routing.write();
        let decision = self.decide(&state, prepared, inputs)?;
        Ok(
            match admission::admit(request_id, prepared.admission, &decision.selection)? {
                Admission::Advisory => OrderedAnswer::Advisory(decision.selection),
                Admission::Admit => {
                    let booked =
                        self.commit(&mut state, views, prepared, inputs, &decision, false)?;
                    OrderedAnswer::Decided {
                        selection: decision.selection,
                        booked,
                    }
                }
                Admission::Queue => OrderedAnswer::Busy {
                    target: decision.selection.target,
                },
            },
        )
    }

    /// Books a decision (RESERVE): the request's load, its session, its
    /// prediction and expectation in the cache views, and the load
    /// estimated for its peers, which ages out by itself. `share`: feed
    /// the booking to the other replicas (not when every replica makes it
    /// from the log).
    fn commit(
        &self,
        state: &mut RoutingState,
        views: &CacheViews,
        prepared: &PreparedRequest,
        inputs: &Inputs,
        decision: &Decision,
        share: bool,
    ) -> Result<bool, AdmissionError> {
        let now_ms = self.clock.now_ms();
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
            prepared.owner.as_ref(),
        )
        .inspect_err(|e| self.count_refusal(e))?;
        if booked {
            views.hold_booked(
                &prepared.request.request_id,
                inputs,
                selection.target,
                now_ms,
            );
            views.expect_report(&prepared.request, inputs, selection, now_ms);
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
        if booked && share && self.feeding() {
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

    /// Counts a RESERVE refused because open bookings hold their bound.
    fn count_refusal(&self, error: &AdmissionError) {
        if let AdmissionError::BookingsFull { owner, .. } = error {
            let bound = if owner.is_some() { "identity" } else { "all" };
            self.metrics
                .bookings_refused
                .with_label_values(&[bound])
                .inc();
        }
    }

    /// Drops a request's booked prefill; idempotent. `sends_events` says
    /// whether a worker is scored on events (a completed prefill there
    /// owes some); `share`: feed the change to the other replicas (not
    /// when each applies it from the log). Returns whether the booking
    /// changed.
    pub(super) fn mark_prefill_complete(
        &self,
        views: &CacheViews,
        request_id: &str,
        sends_events: impl Fn(WorkerId) -> bool,
        share: bool,
    ) -> bool {
        let now_ms = self.clock.now_ms();
        let changed = {
            let mut state = self.routing.write();
            state.prefill_times.completed(request_id, now_ms);
            views.settle(request_id, now_ms);
            if let Some(booking) = state.ledger.booking(request_id)
                && booking.prefill_outstanding
                && booking.prefill_blocks > 0
                && sends_events(booking.target.worker_id)
            {
                views.note_prefill_completed(
                    booking.target.worker_id,
                    booking.booked_at_ms,
                    now_ms,
                );
            }
            state.ledger.mark_prefill_complete(request_id)
        };
        // In a cluster the booking may be another replica's: tell them
        // whether or not this replica knew it.
        if share && (changed || self.feeding()) {
            self.feed(RoutingChange::PrefillComplete(request_id.to_owned()));
        }
        changed
    }

    /// Drops all of a request's booked load; idempotent; `share` as for
    /// [`Self::mark_prefill_complete`]. Returns whether there was any.
    pub(super) fn release(&self, views: &CacheViews, request_id: &str, share: bool) -> bool {
        let changed = {
            let mut state = self.routing.write();
            state.prefill_times.forget(request_id);
            views.settle(request_id, self.clock.now_ms());
            views.forget_expectation(request_id);
            let changed = state.ledger.release(request_id);
            self.metrics.bookings_active.set(state.ledger.len() as i64);
            changed
        };
        if share && (changed || self.feeding()) {
            if !changed {
                // Booked elsewhere and not yet heard of here.
                self.released.lock().insert(request_id);
            }
            self.feed(RoutingChange::Released(request_id.to_owned()));
        }
        changed
    }

    /// Drops bookings, sessions and prefill times of a worker that left.
    pub(super) fn forget_worker(&self, worker_id: WorkerId) {
        let mut state = self.routing.write();
        state.ledger.release_worker(worker_id);
        state.sessions.remove_worker(worker_id);
        state.prefill_times.forget_worker(worker_id);
        self.metrics.bookings_active.set(state.ledger.len() as i64);
    }

    /// Expires bookings never released and sessions unused, and what the
    /// cache views keep of them; returns the bookings expired.
    pub(super) fn expire(&self, views: &CacheViews) -> usize {
        let now_ms = self.clock.now_ms();
        let expired = {
            let mut state = self.routing.write();
            let expired = state.ledger.expire(now_ms, self.booking_ttl_ms);
            state.sessions.expire(now_ms);
            state.prefill_times.expire(now_ms, self.booking_ttl_ms);
            views.expire(now_ms, now_ms.saturating_sub(self.booking_ttl_ms));
            self.metrics.bookings_active.set(state.ledger.len() as i64);
            expired
        };
        if expired > 0 {
            self.metrics.bookings_expired.inc_by(expired as u64);
        }
        expired
    }

    /// Admits queued calls, head first, while their choice is not busy;
    /// `inputs_of` gathers a queued request's inputs anew (under the
    /// lock: the fleet may have changed while it waited).
    pub(super) fn drain(&self, views: &CacheViews, inputs_of: impl Fn(&PreparedRequest) -> Inputs) {
        let mut state = self.routing.write();
        while let Some(entry) = state.queue.pop() {
            let inputs = inputs_of(&entry.payload.prepared);
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
                .commit(&mut state, views, prepared, &inputs, &decision, true)
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

    /// Takes a queued call out of the queue (its deadline passed, or its
    /// caller went away) and releases a booking made for it that its
    /// caller never received.
    pub(super) fn leave_queue(&self, request_id: &str, answer: &mut Answer) {
        let mut state = self.routing.write();
        state.queue.remove(request_id);
        if let Ok(Ok(_)) = answer.try_recv()
            && state.ledger.release(request_id)
        {
            self.feed(RoutingChange::Released(request_id.to_owned()));
        }
        self.metrics.queue_depth.set(state.queue.len() as i64);
        self.metrics.bookings_active.set(state.ledger.len() as i64);
    }

    /// Fails every queued call (shutdown).
    pub(super) fn fail_queue(&self) {
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

    /// Whether an open booking was made by another identity than `caller`
    /// (bookings made without authentication belong to no one).
    pub(super) fn booked_by_other(&self, request_id: &str, caller: &str) -> bool {
        let state = self.routing.read();
        matches!(state.ledger.owner(request_id), Some(Some(owner)) if &**owner != caller)
    }

    /// Load booked on one (worker, rank) and not yet released.
    pub(super) fn booked_load(&self, target: WorkerRank) -> BookedLoad {
        self.routing.read().ledger.load(target)
    }

    /// Live sessions and open bookings, as a snapshot keeps them (one hold
    /// of the read lock).
    pub(super) fn export(&self) -> (Vec<SavedSession>, Vec<SavedBooking>) {
        let now_ms = self.clock.now_ms();
        let state = self.routing.read();
        (state.sessions.export(now_ms), state.ledger.export(now_ms))
    }

    /// One open booking as a snapshot keeps it, or `None` when the request
    /// has none.
    pub(super) fn export_one(&self, request_id: &str) -> Option<SavedBooking> {
        let now_ms = self.clock.now_ms();
        self.routing.read().ledger.export_one(request_id, now_ms)
    }

    /// Restores saved sessions and bookings of the workers `worker_of`
    /// finds registered (the others are dropped); returns how many
    /// bookings were refused.
    pub(super) fn restore(
        &self,
        views: &CacheViews,
        sessions: Vec<SavedSession>,
        bookings: Vec<SavedBooking>,
        worker_of: impl Fn(WorkerId) -> Option<WorkerSnapshot>,
    ) -> usize {
        let now_ms = self.clock.now_ms();
        let known = |worker_id: WorkerId| worker_of(worker_id).is_some();
        let sessions: Vec<SavedSession> = sessions
            .into_iter()
            .filter(|s| known(s.target.worker_id))
            .collect();
        let bookings: Vec<SavedBooking> = bookings
            .into_iter()
            .filter(|b| known(b.target.worker_id))
            .collect();
        let mut state = self.routing.write();
        for session in sessions {
            state.sessions.restore(session, now_ms);
        }
        let mut refused = 0;
        for booking in bookings {
            if state.ledger.restore(booking.clone(), now_ms).is_ok() {
                hold_restored(views, &booking, &worker_of, now_ms);
            } else {
                refused += 1;
            }
        }
        self.metrics.bookings_active.set(state.ledger.len() as i64);
        refused
    }

    /// Sends this core's own routing changes to `feed` from now on.
    pub(super) fn set_feed(&self, feed: mpsc::Sender<RoutingChange>) {
        *self.feed.lock() = Some(feed);
    }

    /// Sends a change on the feed, if there is one; a full feed drops it.
    fn feed(&self, change: RoutingChange) {
        let feed = self.feed.lock();
        if let Some(feed) = feed.as_ref()
            && feed.try_send(change).is_err()
        {
            self.metrics.cluster.changes_dropped.inc();
        }
    }

    /// Whether changes are fed out (cluster mode).
    fn feeding(&self) -> bool {
        self.feed.lock().is_some()
    }

    /// Makes a change another replica made, without feeding it out again.
    /// Bookings and sessions of workers `worker_of` does not find
    /// registered are dropped (the worker left meanwhile). Returns whether
    /// booked load changed.
    pub(super) fn apply_remote(
        &self,
        views: &CacheViews,
        change: RoutingChange,
        worker_of: impl Fn(WorkerId) -> Option<WorkerSnapshot>,
    ) -> bool {
        let now_ms = self.clock.now_ms();
        let known = |worker_id| worker_of(worker_id).is_some();
        let mut state = self.routing.write();
        let changed = match change {
            RoutingChange::Booked(booking) => {
                let released = self.released.lock().take(&booking.request_id);
                let booked = !released
                    && known(booking.target.worker_id)
                    && state.ledger.restore(booking.clone(), now_ms).is_ok();
                if booked {
                    hold_restored(views, &booking, &worker_of, now_ms);
                }
                booked
            }
            RoutingChange::PrefillComplete(request_id) => {
                views.settle(&request_id, now_ms);
                state.ledger.mark_prefill_complete(&request_id)
            }
            RoutingChange::Released(request_id) => {
                views.settle(&request_id, now_ms);
                let changed = state.ledger.release(&request_id);
                if !changed {
                    self.released.lock().insert(&request_id);
                }
                changed
            }
            RoutingChange::SessionBound(session) => {
                if known(session.target.worker_id) {
                    state.sessions.restore(session, now_ms);
                }
                false
            }
        };
        self.metrics.bookings_active.set(state.ledger.len() as i64);
        changed
    }
}

/// Holds the prompt of a booking this core did not make (another
/// replica's, or a snapshot's) for its target, when that target is scored
/// on predictions: its keys are the prompt's prefix keys.
fn hold_restored(
    views: &CacheViews,
    booking: &SavedBooking,
    worker_of: impl Fn(WorkerId) -> Option<WorkerSnapshot>,
    now_ms: u64,
) {
    if booking.prefill.is_none() {
        return;
    }
    if let Some(worker) = worker_of(booking.target.worker_id) {
        views.hold(
            &booking.request_id,
            booking.target,
            &worker,
            booking.keys.clone(),
            now_ms,
        );
    }
}
