//! Ordered decisions (cluster mode, `--decision-order ordered`): a RESERVE
//! call becomes a record of the shared log, and every replica decides it
//! where it stands there, so all book what one router taking the calls in
//! the log's order would. The replica that took the call answers once its
//! own follower has decided it.
//!
//! Why: replicas that each decide at once and share their bookings after
//! decide a burst before they see each other's bookings, and herd (the
//! replay's figures: docs/CLUSTER.md, "Ordered decisions"). Deciding in one
//! order costs each call a NATS round trip and removes the race.
//!
//! What a decision reads, and why it is the same on every replica at the
//! same position:
//! * the index, registrations and lapses: log records, applied in order;
//! * bookings and sessions: made and changed only by log records (ordered
//!   decisions, [`BookingStep`]s) and expired on the log's clock;
//! * the routing clock: the log's own (each record's append time, never
//!   back; a snapshot carries it), so ages and expiry agree;
//! * cordons and reported load, which live in the workers bucket: the
//!   record carries them as the deciding replica read them;
//! * tie-breaks and sampling: seeded by the cluster's seed and the request
//!   id, as one router with that seed draws them.
//!
//! Not ordered: which view of its cache a worker is scored on when this
//! replica's own event subscription to it has a gap or stalls (trust), and
//! cached-token feedback. Replicas that differ there may decide apart until
//! the gap closes (docs/CLUSTER.md says so).
//!
//! Seam: the core knows an [`OrderedLog`] (the cluster's log implements it)
//! and never NATS. QUERY_ONLY and ADVISORY calls stay local; a call the log
//! cannot take (NATS away) is decided locally as in `local` mode and
//! counted.

use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use futures::future::BoxFuture;

pub use super::routing_state::OrderedAnswer;
use super::{
    RouterCore,
    clock::millis,
    members::ModelView,
    now,
    routing::{Admitted, RouteOutcome},
    routing_state::{PreparedRequest, RouteError},
};
use kvroute_core::{
    admission::AdmissionError,
    types::{DpRank, RankLoad, WorkerId, WorkerSnapshot},
};

/// The tie-break and sampling seed of replicas deciding in order when
/// none is set (`--seed 0`): every replica must draw alike.
pub const CLUSTER_SEED: u64 = 0x6b76_726f_7574_6531;

/// Booking steps held for the log while it is away, at most (a step is a
/// request id: this bounds what a NATS outage can make a replica hold).
const MAX_STEPS_AWAITING_LOG: usize = 65_536;

/// How long a call WAIT would queue waits before it is tried again, at
/// most: each booking step that frees load wakes one waiting call sooner,
/// so a slow retry only covers load reported lower by a heartbeat. Every
/// try is a log record, so waiting calls must not poll the log quickly.
const BUSY_RETRY: Duration = Duration::from_secs(1);

/// A RESERVE call as a log record gives it back to every replica.
#[derive(Clone, Debug)]
pub struct OrderedRequest {
    pub prepared: PreparedRequest,
    /// The model's workers' cordons and reported load, as the deciding
    /// replica read them.
    pub workers: Vec<SeenWorker>,
}

/// One worker's cordon and reported load as a decision read them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeenWorker {
    pub worker_id: WorkerId,
    pub cordoned: bool,
    pub load: Vec<(DpRank, RankLoad)>,
}

/// A change of one booking, in log order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BookingStep {
    pub request_id: String,
    /// Released (else its prefill completed).
    pub release: bool,
}

/// Why a call was not decided in the log's order.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unordered {
    /// The log did not take it: decide locally.
    #[error("the shared log is unreachable: {0}")]
    Unreachable(String),
    /// The log took it but this replica did not apply it in time: it may
    /// still be decided, so it must not be decided again here.
    #[error("appended to the shared log but not decided here: {0}")]
    NotApplied(String),
}

/// The shared log as ordered decisions use it (the cluster implements it).
pub trait OrderedLog: Send + Sync + 'static {
    /// Appends the decision of `prepared` on the cordons and loads of
    /// `workers`, and answers with what this replica's follower decided at
    /// its position.
    fn decide<'a>(
        &'a self,
        prepared: &'a PreparedRequest,
        workers: Vec<SeenWorker>,
    ) -> BoxFuture<'a, Result<Result<OrderedAnswer, RouteError>, Unordered>>;

    /// Appends a booking step; answers whether the booking changed here.
    fn step(&self, step: BookingStep) -> BoxFuture<'_, Result<bool, Unordered>>;
}

impl RouterCore {
    /// From now on RESERVE calls and booking steps go through `log`.
    pub(crate) fn decide_in_order(&self, log: Arc<dyn OrderedLog>) {
        let _ = self.ordered.set(log);
    }

    /// Whether RESERVE calls are decided in the log's order.
    pub(crate) fn decides_in_order(&self) -> bool {
        self.ordered.get().is_some()
    }

    /// A log record appended at `unix_ms` is being applied: with ordered
    /// decisions the routing clock (a manual one) moves there, never back,
    /// and bookings and sessions expire each time it enters a new second,
    /// so every replica expires the same ones at the same position.
    pub(crate) fn log_time(&self, unix_ms: u64) {
        if !self.decides_in_order() {
            return;
        }
        let before = self.clock.now_ms();
        self.clock.set_ms(unix_ms);
        if self.clock.now_ms() / 1000 != before / 1000 {
            self.expire_bookings();
        }
    }

    /// Routes a RESERVE call prepared on `model` through the log; `None`:
    /// the log is away and the caller decides locally.
    pub(super) async fn route_in_order(
        &self,
        model: &ModelView,
        prepared: &PreparedRequest,
        deadline: tokio::time::Instant,
    ) -> Option<Result<RouteOutcome, RouteError>> {
        let log = self.ordered.get()?;
        let request = &prepared.request;
        let named = (request.request_id.as_str(), request.model.as_str());
        let started = now();
        // Held once a try found every candidate busy (WAIT): a later
        // booking is then an admission after queueing.
        let mut waiting: Option<WaitingCall<'_>> = None;
        let not_decided = |why: String| RouteError::NotDecided {
            request_id: request.request_id.clone(),
            why,
        };
        // The model's view read again for each try after the first: loads
        // and cordons change while a call waits.
        let mut fresh: Option<ModelView> = None;
        loop {
            let workers = seen_workers(fresh.as_ref().unwrap_or(model));
            let answer = match tokio::time::timeout_at(deadline, log.decide(prepared, workers))
                .await
            {
                Err(_) => {
                    self.count_ordered("not_decided");
                    return Some(Err(not_decided(
                        "not decided within the call's deadline (it may still be booked)".into(),
                    )));
                }
                Ok(Err(Unordered::Unreachable(why))) => {
                    tracing::debug!(request_id = named.0, why, "decided locally: log away");
                    self.count_ordered("local");
                    return None;
                }
                Ok(Err(error @ Unordered::NotApplied(_))) => {
                    self.count_ordered("not_decided");
                    return Some(Err(not_decided(error.to_string())));
                }
                Ok(Ok(answer)) => answer,
            };
            let waited = now().saturating_duration_since(started);
            let outcome = match answer {
                Err(error) => Err(error),
                Ok(OrderedAnswer::Decided { selection, booked }) => {
                    let (admitted, outcome) = match (booked, waiting.is_some()) {
                        (false, _) => (Admitted::Untracked, "query_only"),
                        (true, false) => (Admitted::Now, "admitted"),
                        (true, true) => (Admitted::AfterQueue(waited), "admitted_after_queue"),
                    };
                    Ok(self.record(named, selection, admitted, outcome))
                }
                Ok(OrderedAnswer::Advisory(selection)) => {
                    Ok(self.record(named, selection, Admitted::Untracked, "advisory"))
                }
                Ok(OrderedAnswer::Busy { target }) => {
                    if waiting.is_none() {
                        // As many wait as the local queue holds, no more.
                        let capacity = self.config.queue_capacity;
                        waiting = WaitingCall::join(&self.ordered_waiting, capacity);
                        if waiting.is_none() {
                            self.count_ordered("ordered");
                            return Some(Err(AdmissionError::QueueFull {
                                request_id: request.request_id.clone(),
                                capacity,
                            }
                            .into()));
                        }
                    }
                    let changed = self.ordered_changed.notified();
                    let retry = (tokio::time::Instant::now() + BUSY_RETRY).min(deadline);
                    tokio::select! {
                        () = changed => {}
                        () = tokio::time::sleep_until(retry) => {}
                    }
                    if tokio::time::Instant::now() >= deadline {
                        self.metrics
                            .decisions
                            .with_label_values(&["deadline_exceeded"])
                            .inc();
                        Err(AdmissionError::DeadlineExceeded {
                            request_id: request.request_id.clone(),
                            target,
                            waited_ms: millis(now().saturating_duration_since(started)),
                        }
                        .into())
                    } else {
                        fresh = Some(self.model_view(&request.model));
                        continue;
                    }
                }
            };
            self.count_ordered("ordered");
            return Some(outcome);
        }
    }

    /// Decides a RESERVE call read from the log (every replica, in order),
    /// on the cordons and loads the record carries.
    pub(crate) fn apply_ordered(
        &self,
        request: &OrderedRequest,
    ) -> Result<OrderedAnswer, RouteError> {
        let prepared = &request.prepared;
        let model = self.model_view(&prepared.request.model);
        let mut inputs = self.views.inputs(&model, &prepared.hashes);
        inputs.workers = as_seen(&inputs.workers, &request.workers);
        self.routing.reserve_ordered(&self.views, prepared, &inputs)
    }

    /// Applies a booking step read from the log; returns whether the
    /// booking changed.
    pub(crate) fn apply_step(&self, step: &BookingStep) -> bool {
        let id = &step.request_id;
        let changed = if step.release {
            self.routing.release(&self.views, id, false)
        } else {
            self.routing
                .mark_prefill_complete(&self.views, id, |w| self.sends_events(w), false)
        };
        if changed {
            // One waiting call tries again per freed booking.
            self.ordered_changed.notify_one();
            self.drain_queue();
        }
        changed
    }

    /// MarkPrefillComplete (`release` false) or ReleaseRequest: through the
    /// log when decisions are ordered, else here. With the log away the
    /// step is applied here at once and appended once the log is back (a
    /// booking the others made from the log is released by the log only).
    /// Returns whether the booking changed.
    pub async fn finish_booking(&self, request_id: &str, release: bool) -> bool {
        if let Some(log) = self.ordered.get() {
            let step = BookingStep {
                request_id: request_id.to_owned(),
                release,
            };
            match log.step(step.clone()).await {
                Ok(changed) => return changed,
                Err(Unordered::Unreachable(why)) => {
                    tracing::debug!(request_id, why, "booking step applied here; appended later");
                    self.count_ordered("local_step");
                    self.append_when_back(log.clone(), step);
                }
                Err(error) => {
                    // In the log already: every replica applies it there.
                    tracing::debug!(request_id, %error, "booking step applied here too");
                    self.count_ordered("local_step");
                }
            }
        }
        if release {
            self.release_request(request_id)
        } else {
            self.mark_prefill_complete(request_id)
        }
    }

    /// Appends `step` once the log takes it (backing off to 2 s), so that
    /// every replica applies it. At most [`MAX_STEPS_AWAITING_LOG`] wait at
    /// once; past that a step is dropped and counted, and its booking
    /// expires on the other replicas.
    fn append_when_back(&self, log: Arc<dyn OrderedLog>, step: BookingStep) {
        let waiting = self.steps_awaiting_log.clone();
        if waiting.fetch_add(1, Ordering::Relaxed) >= MAX_STEPS_AWAITING_LOG {
            waiting.fetch_sub(1, Ordering::Relaxed);
            self.count_ordered("step_dropped");
            return;
        }
        tokio::spawn(async move {
            let mut delay = Duration::from_millis(100);
            loop {
                tokio::time::sleep(delay).await;
                match log.step(step.clone()).await {
                    Err(Unordered::Unreachable(_)) => {
                        delay = (delay * 2).min(Duration::from_secs(2))
                    }
                    _ => break,
                }
            }
            waiting.fetch_sub(1, Ordering::Relaxed);
        });
    }

    fn count_ordered(&self, outcome: &str) {
        self.metrics
            .cluster
            .ordered_decisions
            .with_label_values(&[outcome])
            .inc();
    }
}

/// The cordons and loads of the workers of `model`, as an ordered record
/// carries them.
fn seen_workers(model: &ModelView) -> Vec<SeenWorker> {
    model
        .workers()
        .iter()
        .map(|w| SeenWorker {
            worker_id: w.worker_id,
            cordoned: w.cordoned,
            load: w.load.clone(),
        })
        .collect()
}

/// One of the calls waiting for load to free, counted while it lives.
struct WaitingCall<'a>(&'a AtomicUsize);

impl<'a> WaitingCall<'a> {
    /// Counts a call in, unless `capacity` already wait.
    fn join(count: &'a AtomicUsize, capacity: usize) -> Option<Self> {
        if count.fetch_add(1, Ordering::Relaxed) >= capacity {
            count.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(Self(count))
    }
}

impl Drop for WaitingCall<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// `workers` with the cordons and loads of `seen`; a worker the deciding
/// replica did not see (registered since, in log order) as uncordoned and
/// with no load reported.
fn as_seen(workers: &Arc<[WorkerSnapshot]>, seen: &[SeenWorker]) -> Arc<[WorkerSnapshot]> {
    let seen: HashMap<WorkerId, &SeenWorker> = seen.iter().map(|w| (w.worker_id, w)).collect();
    workers
        .iter()
        .map(|w| {
            let mut w = w.clone();
            match seen.get(&w.worker_id) {
                Some(s) => {
                    w.cordoned = s.cordoned;
                    w.load.clone_from(&s.load);
                }
                None => {
                    w.cordoned = false;
                    w.load.clear();
                }
            }
            w
        })
        .collect()
}
