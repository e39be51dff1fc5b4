//! A pick's booking, kept by a task of its own for the stream's life.
//!
//! Why: marking a prefill complete and releasing a booking are CPU work in
//! proportion to the prompt's blocks (a 120k-token prompt has 7,500 of
//! them: its predicted cache recorded, its booked blocks unreferenced),
//! about a millisecond each. Done inline, they held up the next ext_proc
//! message of the response, so every client waited for them. Here the
//! stream sends a step and goes on; the task applies the steps in the
//! order sent. Dropping the handle (the stream gone any way at all) ends
//! the task, and a booking not yet released is released as abandoned: no
//! mix of finished, failed and abandoned streams leaves load booked.

use std::sync::Arc;

use tokio::sync::mpsc;

use super::Gateway;
use crate::router::RouterCore;

/// What the stream tells its booking's task. At most one of each is sent
/// (the handle keeps count), so the channel holds at most two.
enum Step {
    PrefillDone,
    Release {
        end: &'static str,
        cached_tokens: Option<u64>,
    },
}

/// The stream's side of its booking.
pub(super) struct BookingHandle {
    steps: mpsc::UnboundedSender<Step>,
    prefill_sent: bool,
}

impl BookingHandle {
    /// Starts the task that keeps `request_id`'s booking.
    pub(super) fn start(gateway: Arc<Gateway>, core: Arc<RouterCore>, request_id: String) -> Self {
        let (steps, mut received) = mpsc::unbounded_channel();
        let mut booking = Booking {
            core,
            request_id,
            released: false,
            gateway,
        };
        tokio::spawn(async move {
            while let Some(step) = received.recv().await {
                match step {
                    Step::PrefillDone => booking.prefill_done().await,
                    Step::Release { end, cached_tokens } => {
                        booking.release(end, cached_tokens).await;
                    }
                }
            }
            // The handle dropped: released as abandoned if it was not.
            booking.release("abandoned", None).await;
        });
        Self {
            steps,
            prefill_sent: false,
        }
    }

    /// The response's first bytes: the engine has computed the prefill.
    pub(super) fn first_response_bytes(&mut self) {
        if !self.prefill_sent {
            self.prefill_sent = true;
            // The task lives as long as the handle: the send cannot fail.
            let _ = self.steps.send(Step::PrefillDone);
        }
    }

    /// The response is over: `end` names how (a metric label).
    pub(super) fn release(self, end: &'static str, cached_tokens: Option<u64>) {
        let _ = self.steps.send(Step::Release { end, cached_tokens });
    }
}

/// A booking: released once, by its stream's last step or when its task
/// ends without one.
struct Booking {
    core: Arc<RouterCore>,
    request_id: String,
    released: bool,
    gateway: Arc<Gateway>,
}

impl Booking {
    async fn prefill_done(&mut self) {
        if !self.released {
            self.core.finish_booking(&self.request_id, false).await;
        }
    }

    async fn release(&mut self, end: &'static str, cached_tokens: Option<u64>) {
        if self.released {
            return;
        }
        self.released = true;
        if let Some(cached) = cached_tokens {
            self.core.report_cached_tokens(&self.request_id, cached);
        }
        self.core.finish_booking(&self.request_id, true).await;
        self.gateway
            .metrics
            .streams_ended
            .with_label_values(&[end])
            .inc();
    }
}

impl Drop for Booking {
    /// The task was dropped before its end (the runtime stopping): the
    /// booking is released here, on this replica.
    fn drop(&mut self) {
        if !self.released {
            self.released = true;
            self.core.release_request(&self.request_id);
            self.gateway
                .metrics
                .streams_ended
                .with_label_values(&["abandoned"])
                .inc();
        }
    }
}
