//! SelectWorker on the core: one read of the members lock gives the
//! model's view (block size, workers, index; `members.rs`), the cache
//! views add what is predicted (`views.rs`), and the routing side decides
//! and books under its own lock (`routing_state.rs`). Also the request
//! lifecycle (prefill complete, release, expiry, a worker leaving), each a
//! change of the routing side followed by a drain of the WAIT queue.
//!
//! The queue: a waiting call holds a `QueueTicket`; every change that can
//! lower load (release, prefill complete, expiry, heartbeat, registration)
//! calls [`RouterCore::drain_queue`], which re-selects the head and, if it is
//! no longer busy, commits and hands it the selection. A caller that goes
//! away drops its ticket, which takes it out of the queue and releases a
//! booking made for it in the meantime, so nothing is left behind.

use std::time::Duration;

use tokio::sync::mpsc;

use super::{
    RouterCore,
    clock::millis,
    members::ModelView,
    now,
    routing_state::{Answer, PreparedRequest, Reserved, RouteError},
    sync::RoutingChange,
    views::Inputs,
};
use kvroute_core::{
    admission::{self, Admission, AdmissionError, AdmissionMode, bookings::SavedBooking},
    select::{SelectMode, Selection, affinity::SavedSession},
    types::{BookedLoad, Tier, WorkerId, WorkerRank},
};

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

impl RouterCore {
    /// The inputs of a decision for `prepared` on `model`'s view.
    fn inputs(&self, model: &ModelView, prepared: &PreparedRequest) -> Inputs {
        self.views.inputs(model, &prepared.hashes)
    }

    /// Scores a request without changing anything (ExplainSelection).
    pub(crate) fn explain(
        &self,
        model: &ModelView,
        prepared: &PreparedRequest,
    ) -> Result<Selection, RouteError> {
        let inputs = self.inputs(model, prepared);
        let mut selection = self.routing.preview(prepared, &inputs)?;
        for candidate in &mut selection.candidates {
            candidate.view = inputs.view(candidate.target);
        }
        Ok(selection)
    }

    /// Routes and books a request at once, whatever its admission mode and
    /// however busy the fleet (the replay simulator's engines queue by
    /// themselves).
    pub fn route_unqueued(&self, prepared: PreparedRequest) -> Result<RouteOutcome, RouteError> {
        let model = self.model_view(&prepared.request.model);
        let inputs = self.inputs(&model, &prepared);
        let (selection, booked) = self.routing.book_now(&self.views, &prepared, &inputs)?;
        let admitted = if booked {
            Admitted::Now
        } else {
            Admitted::Untracked
        };
        let request = &prepared.request;
        Ok(self.record(
            (&request.request_id, &request.model),
            selection,
            admitted,
            "admitted",
        ))
    }

    /// Routes a request prepared on `model`, the view of its model from
    /// [`Self::model_view`] it was hashed with; WAIT admission queues until
    /// `deadline`.
    pub(crate) async fn route(
        &self,
        model: &ModelView,
        prepared: PreparedRequest,
        deadline: tokio::time::Instant,
    ) -> Result<RouteOutcome, RouteError> {
        let inputs = self.inputs(model, &prepared);
        let request_id = prepared.request.request_id.clone();
        let model_name = prepared.request.model.clone();
        let named = (request_id.as_str(), model_name.as_str());
        let query_only = prepared.request.mode == SelectMode::QueryOnly;
        if !query_only
            && prepared.admission != AdmissionMode::Advisory
            && let Some(outcome) = self.route_in_order(model, &prepared, deadline).await
        {
            return outcome;
        }
        if query_only || prepared.admission == AdmissionMode::Advisory {
            // Nothing to book: decide under the read lock, in parallel.
            let selection = self.routing.preview(&prepared, &inputs)?;
            let outcome = match admission::admit(&request_id, prepared.admission, &selection)? {
                Admission::Advisory => "advisory",
                _ => "query_only",
            };
            return Ok(self.record(named, selection, Admitted::Untracked, outcome));
        }
        let (answer, target) = match self.routing.reserve(&self.views, prepared, &inputs)? {
            Reserved::Advisory(selection) => {
                return Ok(self.record(named, selection, Admitted::Untracked, "advisory"));
            }
            Reserved::Committed { selection, booked } => {
                let (admitted, outcome) = if booked {
                    (Admitted::Now, "admitted")
                } else {
                    (Admitted::Untracked, "query_only")
                };
                return Ok(self.record(named, selection, admitted, outcome));
            }
            Reserved::Queued { answer, target } => (answer, target),
        };
        // Timed on the routing clock, as the deadline is.
        let queued_at = now();
        let mut ticket = QueueTicket {
            core: self,
            request_id: request_id.clone(),
            answer: Some(answer),
        };
        let answer = match ticket.answer.as_mut() {
            Some(answer) => tokio::time::timeout_at(deadline, answer).await,
            None => return Err(RouteError::ShuttingDown { request_id }),
        };
        let waited = now().saturating_duration_since(queued_at);
        match answer {
            Ok(Ok(result)) => {
                ticket.answer = None;
                let selection = result?;
                self.metrics
                    .queue_wait
                    .with_label_values(&["admitted"])
                    .observe(waited.as_secs_f64());
                Ok(self.record(
                    named,
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

    /// Counts a decision and keeps it for the web view; `named`: its
    /// request id and model.
    pub(super) fn record(
        &self,
        named: (&str, &str),
        selection: Selection,
        admitted: Admitted,
        outcome: &'static str,
    ) -> RouteOutcome {
        self.metrics.decisions.with_label_values(&[outcome]).inc();
        self.decisions.record(named.0, named.1, outcome, &selection);
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
            for tier in Tier::ALL {
                let blocks = selection.tiers.get(tier);
                if blocks > 0 {
                    self.metrics
                        .overlap_tier_blocks
                        .with_label_values(&[tier.name()])
                        .inc_by(u64::from(blocks));
                }
            }
        }
        RouteOutcome {
            selection,
            admitted,
        }
    }

    /// The last decisions numbered after `after`, at most `limit`.
    pub fn decisions_after(
        &self,
        after: u64,
        limit: usize,
    ) -> Vec<std::sync::Arc<super::decisions::Decision>> {
        self.decisions.after(after, limit)
    }

    /// Whether an open booking was made by another identity than `caller`
    /// (bookings made without authentication belong to no one).
    pub(crate) fn booked_by_other(&self, request_id: &str, caller: &str) -> bool {
        self.routing.booked_by_other(request_id, caller)
    }

    /// Load booked on one (worker, rank) and not yet released.
    pub(crate) fn booked_load(&self, target: WorkerRank) -> BookedLoad {
        self.routing.booked_load(target)
    }

    /// Drops a request's booked prefill; idempotent.
    pub fn mark_prefill_complete(&self, request_id: &str) -> bool {
        let changed = self.routing.mark_prefill_complete(
            &self.views,
            request_id,
            |worker_id| self.sends_events(worker_id),
            true,
        );
        if changed {
            self.drain_queue();
        }
        changed
    }

    /// Drops all of a request's booked load; idempotent.
    pub fn release_request(&self, request_id: &str) -> bool {
        let changed = self.routing.release(&self.views, request_id, true);
        if changed {
            self.drain_queue();
        }
        changed
    }

    /// Drops bookings, sessions and cache views of a worker that left.
    pub(crate) fn forget_worker(&self, worker_id: WorkerId) {
        self.routing.forget_worker(worker_id);
        self.views.forget_worker(worker_id);
        self.drain_queue();
    }

    /// Expires bookings never released and sessions unused; returns the
    /// bookings expired.
    pub(crate) fn expire_bookings(&self) -> usize {
        let expired = self.routing.expire(&self.views);
        if expired > 0 {
            self.drain_queue();
        }
        expired
    }

    /// Admits queued calls, head first, while their choice is not busy.
    pub(crate) fn drain_queue(&self) {
        self.routing.drain(&self.views, |prepared| {
            self.inputs(&self.model_view(&prepared.request.model), prepared)
        });
    }

    /// Fails every queued call (shutdown).
    pub(crate) fn fail_queue(&self) {
        self.routing.fail_queue();
    }

    /// Live sessions and open bookings, as a snapshot keeps them (one hold
    /// of the routing read lock).
    pub(crate) fn saved_routing(&self) -> (Vec<SavedSession>, Vec<SavedBooking>) {
        self.routing.export()
    }

    /// One open booking as a snapshot keeps it, or `None` when the request
    /// has none: what another router replica books to learn of this
    /// routing ([`Self::restore_routing`]).
    pub fn saved_booking(&self, request_id: &str) -> Option<SavedBooking> {
        self.routing.export_one(request_id)
    }

    /// Restores saved sessions and bookings (those of workers not
    /// registered are dropped); returns how many bookings were refused.
    pub fn restore_routing(
        &self,
        sessions: Vec<SavedSession>,
        bookings: Vec<SavedBooking>,
    ) -> usize {
        self.routing
            .restore(&self.views, sessions, bookings, |worker_id| {
                self.worker_snapshot(worker_id)
            })
    }

    /// Sends this core's own routing changes to `feed` from now on
    /// (cluster mode, `sync.rs`).
    pub(crate) fn set_change_feed(&self, feed: mpsc::Sender<RoutingChange>) {
        self.routing.set_feed(feed);
    }

    /// Makes a change another replica made, without feeding it out again.
    /// Bookings of workers not registered here are dropped (the worker left
    /// meanwhile).
    pub(crate) fn apply_remote(&self, change: RoutingChange) {
        let changed = self.routing.apply_remote(&self.views, change, |worker_id| {
            self.worker_snapshot(worker_id)
        });
        if changed {
            self.drain_queue();
        }
    }
}

/// A queued call's place; dropping it (deadline, or the caller went away)
/// removes the call from the queue and releases a booking made for it that
/// it never received.
struct QueueTicket<'a> {
    core: &'a RouterCore,
    request_id: String,
    answer: Option<Answer>,
}

impl Drop for QueueTicket<'_> {
    fn drop(&mut self) {
        if let Some(mut answer) = self.answer.take() {
            self.core.routing.leave_queue(&self.request_id, &mut answer);
        }
    }
}
