//! Ordered decisions on the shared log (`--decision-order ordered`; the
//! core's side is `crate::router::ordered`): a RESERVE call and each step
//! of its booking are appended as records, and the appender waits for its
//! own follower to apply them and answers with what that did.
//!
//! What a decision record carries: `decision_record.rs`.

use std::sync::Arc;

use futures::future::BoxFuture;
use prost::Message;
use tokio::sync::watch;

use super::{
    decision_record::decision_to_pb,
    log::{AppendError, Applied, Log},
};
use crate::{
    pb::{self, log_record::Body},
    router::{
        PreparedRequest, RouteError,
        ordered::{BookingStep, OrderedAnswer, OrderedLog, SeenWorker, Unordered},
    },
};

/// The cluster's log as the core's [`OrderedLog`].
pub struct LogOrder {
    pub log: Arc<Log>,
    /// The NATS connection's state: while it is down a call is decided
    /// locally at once, not after the append's acknowledgement times out.
    pub connected: watch::Receiver<bool>,
}

impl LogOrder {
    fn away(&self) -> Option<Unordered> {
        (!*self.connected.borrow()).then(|| Unordered::Unreachable("NATS is disconnected".into()))
    }
}

impl OrderedLog for LogOrder {
    fn decide<'a>(
        &'a self,
        prepared: &'a PreparedRequest,
        workers: Vec<SeenWorker>,
    ) -> BoxFuture<'a, Result<Result<OrderedAnswer, RouteError>, Unordered>> {
        Box::pin(async move {
            if let Some(away) = self.away() {
                return Err(away);
            }
            let record = decision_to_pb(prepared, &workers);
            if record.encoded_len() > self.log.max_record_bytes() {
                // A prompt longer than one NATS message holds (a server
                // with a small max_payload): decided here, and counted.
                return Err(Unordered::Unreachable(format!(
                    "the call's record ({} bytes) is larger than a NATS message",
                    record.encoded_len()
                )));
            }
            match self.log.append(Body::Decide(record), None, true).await {
                Ok(Applied::Decision(answer)) => Ok(*answer),
                Ok(_) => Err(Unordered::NotApplied("applied as another record".into())),
                Err(error) => Err(unordered(error)),
            }
        })
    }

    fn step(&self, step: BookingStep) -> BoxFuture<'_, Result<bool, Unordered>> {
        Box::pin(async move {
            if let Some(away) = self.away() {
                return Err(away);
            }
            let body = Body::Step(pb::BookingStep {
                request_id: step.request_id,
                release: step.release,
            });
            match self.log.append(body, None, true).await {
                Ok(Applied::Step(changed)) => Ok(changed),
                Ok(_) => Err(Unordered::NotApplied("applied as another record".into())),
                Err(error) => Err(unordered(error)),
            }
        })
    }
}

fn unordered(error: AppendError) -> Unordered {
    match error {
        AppendError::Unreachable(why) => Unordered::Unreachable(why),
        error @ AppendError::NotApplied(_) => Unordered::NotApplied(error.to_string()),
    }
}
