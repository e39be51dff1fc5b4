//! The shared log: one JetStream stream that orders every change to the
//! index, and this replica's follower, which applies it.
//!
//! Why one log: replicas that apply the same records in the same order from
//! the same state hold the same index (equal digests), whichever replica a
//! worker talks to. So nothing changes the index directly in cluster mode:
//! a `PublishEvents` batch, a registration, a removal and an engine
//! subscription's batch are appended here, and every replica's follower
//! (this file) applies them one at a time, in stream order, through the
//! same fleet calls a single process makes. The appender of a record
//! waits for its own follower to apply it, so a worker's reply still says
//! what the writer did (and is sent only once the record is in the log).
//!
//! Engine batches are appended by every replica that follows the engine,
//! each with the message id `engine.<worker>.<generation>.<rank>.<seq>.<n>`
//! (`n`: the event count, so a restart's batch with a reused sequence but
//! other content is not taken for a duplicate). JetStream keeps the first
//! within the duplicate window and acknowledges the others as duplicates,
//! so no owner needs electing and a replica's death loses nothing while
//! another follows the same engine.

use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use async_nats::jetstream::{
    self,
    consumer::{DeliverPolicy, pull::OrderedConfig},
    message::PublishMessage,
};
use futures::{StreamExt, future::BoxFuture};
use parking_lot::Mutex;
use prost::Message;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

use super::parts;
use crate::{
    engine_events::SinkOutcome,
    fleet::{Fleet, FleetError, state::FleetState, subscriptions::EngineForward},
    grpc::convert::{self, BatchLimits},
    ingest::{BatchOutcome, EngineBatch, EngineOutcome},
    metrics::Metrics,
    pb::{self, log_record::Body},
    router::{
        RouteError,
        ordered::{BookingStep, OrderedAnswer},
    },
};
use kvroute_core::registry::RegisterOutcome;

/// How long an append waits for JetStream's acknowledgement.
const ACK_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an appender waits for its own follower to apply the record.
const APPLY_TIMEOUT: Duration = Duration::from_secs(30);

/// Why an append did not reach the log (answered as UNAVAILABLE: the
/// caller retries).
#[derive(Debug, thiserror::Error)]
pub enum AppendError {
    #[error("the shared log is unreachable: {0}")]
    Unreachable(String),
    #[error("the record was appended but not applied here within {0:?}")]
    NotApplied(Duration),
}

/// What this replica's follower did with a record it appended.
#[derive(Debug)]
pub enum Applied {
    Register(Box<Result<RegisterOutcome, FleetError>>),
    Deregister(Result<u64, FleetError>),
    Events(Result<BatchOutcome, FleetError>),
    /// An ordered decision (`ordered.rs`).
    Decision(Box<Result<OrderedAnswer, RouteError>>),
    /// An ordered booking step: whether the booking changed.
    Step(bool),
    /// Records nobody waits on, and duplicates.
    Other,
}

/// A snapshot taken between two records.
pub struct Captured {
    /// Every record up to here is in `state`.
    pub position: u64,
    pub state: FleetState,
}

/// The appending side of the log, and what the follower reports back.
pub struct Log {
    /// The NATS server's largest message.
    max_payload: usize,
    js: jetstream::Context,
    stream: String,
    subject: String,
    replica: String,
    metrics: Arc<Metrics>,
    next_tag: AtomicU64,
    waiters: Mutex<HashMap<u64, oneshot::Sender<Applied>>>,
    /// The last stream position applied here.
    applied: watch::Sender<u64>,
    capture: mpsc::Sender<oneshot::Sender<Captured>>,
    capture_rx: Mutex<Option<mpsc::Receiver<oneshot::Sender<Captured>>>>,
}

impl std::fmt::Debug for Log {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Log")
            .field("stream", &self.stream)
            .finish_non_exhaustive()
    }
}

impl Log {
    pub(crate) fn new(
        js: jetstream::Context,
        stream: String,
        subject: String,
        replica: String,
        metrics: Arc<Metrics>,
        max_payload: usize,
    ) -> Self {
        let (capture, capture_rx) = mpsc::channel(4);
        Self {
            max_payload,
            js,
            stream,
            subject,
            replica,
            metrics,
            next_tag: AtomicU64::new(1),
            waiters: Mutex::new(HashMap::new()),
            applied: watch::Sender::new(0),
            capture,
            capture_rx: Mutex::new(Some(capture_rx)),
        }
    }

    /// The most bytes of events one record should carry: the server's
    /// largest message, less room for the record's other fields and the
    /// message's headers.
    pub(crate) fn max_record_bytes(&self) -> usize {
        parts::limit(self.max_payload)
    }

    /// The last stream position applied here.
    pub(crate) fn position(&self) -> u64 {
        *self.applied.borrow()
    }

    /// Waits until this replica has applied every record up to `position`.
    pub(crate) async fn wait_applied(&self, position: u64, timeout: Duration) -> bool {
        let mut applied = self.applied.subscribe();
        tokio::time::timeout(timeout, applied.wait_for(|p| *p >= position))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Appends a record; with `wait`, waits for this replica to apply it
    /// and returns what that did. `message_id` makes JetStream drop a
    /// repeat of the same record.
    pub(crate) async fn append(
        &self,
        body: Body,
        message_id: Option<String>,
        wait: bool,
    ) -> Result<Applied, AppendError> {
        let tag = if wait {
            self.next_tag.fetch_add(1, Ordering::Relaxed)
        } else {
            0
        };
        let receiver = wait.then(|| {
            let (tx, rx) = oneshot::channel();
            self.waiters.lock().insert(tag, tx);
            rx
        });
        let record = pb::LogRecord {
            origin: self.replica.clone(),
            origin_tag: tag,
            body: Some(body),
            appended_unix_us: unix_us(),
        };
        let ack = self.publish(record.encode_to_vec(), message_id).await;
        let ack = match ack {
            Ok(ack) => ack,
            Err(error) => {
                self.waiters.lock().remove(&tag);
                self.metrics
                    .cluster
                    .log_appends
                    .with_label_values(&["failed"])
                    .inc();
                return Err(error);
            }
        };
        let outcome = if ack.duplicate {
            "duplicate"
        } else {
            "appended"
        };
        self.metrics
            .cluster
            .log_appends
            .with_label_values(&[outcome])
            .inc();
        let Some(receiver) = receiver else {
            return Ok(Applied::Other);
        };
        if ack.duplicate {
            // The first copy was applied (or will be) in its place.
            self.waiters.lock().remove(&tag);
            return if self.wait_applied(ack.sequence, APPLY_TIMEOUT).await {
                Ok(Applied::Other)
            } else {
                Err(AppendError::NotApplied(APPLY_TIMEOUT))
            };
        }
        match tokio::time::timeout(APPLY_TIMEOUT, receiver).await {
            Ok(Ok(applied)) => Ok(applied),
            _ => {
                self.waiters.lock().remove(&tag);
                Err(AppendError::NotApplied(APPLY_TIMEOUT))
            }
        }
    }

    async fn publish(
        &self,
        payload: Vec<u8>,
        message_id: Option<String>,
    ) -> Result<jetstream::publish::PublishAck, AppendError> {
        let mut publish = PublishMessage::build().payload(payload.into());
        if let Some(id) = message_id {
            publish = publish.message_id(id);
        }
        let unreachable = |e: &dyn std::fmt::Display| AppendError::Unreachable(e.to_string());
        let future = self
            .js
            .send_publish(self.subject.clone(), publish)
            .await
            .map_err(|e| unreachable(&e))?;
        match tokio::time::timeout(ACK_TIMEOUT, future).await {
            Ok(Ok(ack)) => Ok(ack),
            Ok(Err(e)) => Err(unreachable(&e)),
            Err(_) => Err(AppendError::Unreachable(format!(
                "no acknowledgement within {ACK_TIMEOUT:?}"
            ))),
        }
    }

    /// Takes the fleet's state between two records (the follower pauses
    /// while the writer captures it).
    pub(crate) async fn capture(&self) -> Option<Captured> {
        let (tx, rx) = oneshot::channel();
        self.capture.send(tx).await.ok()?;
        rx.await.ok()
    }

    /// Applies the log from `from` on, until `stop`. The consumer is
    /// ordered: a gap or a lost connection makes it start again after the
    /// last record delivered, so no record is applied twice or skipped.
    pub(crate) async fn follow(
        self: Arc<Self>,
        fleet: Arc<Fleet>,
        from: u64,
        stop: CancellationToken,
    ) {
        let Some(mut captures) = self.capture_rx.lock().take() else {
            return;
        };
        self.applied.send_replace(from.saturating_sub(1));
        while !stop.is_cancelled() {
            let next = self.position() + 1;
            let messages = match ordered_from(&self.js, &self.stream, next).await {
                Ok(messages) => messages,
                Err(error) => {
                    tracing::warn!(%error, next, "shared log: cannot consume; retrying");
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(Duration::from_millis(500)) => continue,
                    }
                }
            };
            tokio::pin!(messages);
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    Some(reply) = captures.recv() => {
                        let state = fleet.capture().await;
                        let _ = reply.send(Captured { position: self.position(), state });
                    }
                    message = messages.next() => match message {
                        Some(Ok(message)) => {
                            let Ok(info) = message.info() else { continue };
                            let position = info.stream_sequence;
                            if position <= self.position() {
                                continue;
                            }
                            self.apply(&fleet, position, &message.payload).await;
                            self.applied.send_replace(position);
                            self.metrics.cluster.log_position.set(i64::try_from(position).unwrap_or(i64::MAX));
                        }
                        Some(Err(error)) => {
                            tracing::warn!(%error, "shared log: consumer error; resuming");
                            break;
                        }
                        None => break,
                    },
                }
            }
        }
    }

    /// Applies one record. A record this replica cannot decode is counted
    /// and skipped (every replica skips it alike).
    async fn apply(&self, fleet: &Fleet, position: u64, payload: &[u8]) {
        let record = match pb::LogRecord::decode(payload) {
            Ok(record) => record,
            Err(error) => {
                tracing::error!(position, %error, "shared log: undecodable record skipped");
                self.count("undecodable");
                return;
            }
        };
        let mine = record.origin == self.replica;
        // Ordered decisions run the routing clock on the log's time.
        fleet.router().log_time(record.appended_unix_us / 1000);
        if !mine && record.appended_unix_us > 0 {
            let lag_us = unix_us().saturating_sub(record.appended_unix_us);
            self.metrics.cluster.log_lag.observe(lag_us as f64 / 1e6);
        }
        let applied = match record.body {
            Some(Body::Register(request)) => {
                self.count("register");
                fleet.router().set_next_generation(position);
                Applied::Register(Box::new(register(fleet, request).await))
            }
            Some(Body::Deregister(worker_id)) => {
                self.count("deregister");
                Applied::Deregister(fleet.deregister(worker_id).await)
            }
            Some(Body::Lapsed(lapsed)) => {
                self.count("lapsed");
                fleet
                    .remove_generation(lapsed.worker_id, lapsed.generation)
                    .await;
                Applied::Other
            }
            Some(Body::Events(batch)) => {
                self.count("events");
                Applied::Events(events(fleet, batch).await)
            }
            Some(Body::Engine(engine)) => {
                self.count("engine");
                let (worker_id, generation) = (engine.worker_id, engine.generation);
                if let Some(outcome) = engine_events(fleet, engine).await
                    && mine
                    && outcome.rejected > 0
                {
                    // This replica's subscription forwarded it: its
                    // refusals count there, as a single process counts them.
                    fleet.count_engine_rejected(worker_id, generation, outcome.rejected);
                }
                Applied::Other
            }
            Some(Body::Decide(decision)) => {
                self.count("decide");
                let router = fleet.router();
                let max_blocks = router.config().limits.max_blocks_per_event as usize;
                let request_id = decision
                    .request
                    .as_ref()
                    .map(|r| r.request_id.clone())
                    .unwrap_or_default();
                let answer = match super::decision_record::decision_from_pb(decision, max_blocks) {
                    Ok(request) => router.apply_ordered(&request),
                    Err(why) => {
                        tracing::error!(position, request_id, why, "ordered decision refused here");
                        Err(RouteError::NotDecided {
                            request_id,
                            why: format!("its log record was refused: {why}"),
                        })
                    }
                };
                Applied::Decision(Box::new(answer))
            }
            Some(Body::Step(step)) => {
                self.count("step");
                Applied::Step(fleet.router().apply_step(&BookingStep {
                    request_id: step.request_id,
                    release: step.release,
                }))
            }
            None => {
                self.count("undecodable");
                Applied::Other
            }
        };
        if mine
            && record.origin_tag != 0
            && let Some(waiter) = self.waiters.lock().remove(&record.origin_tag)
        {
            let _ = waiter.send(applied);
        }
    }

    fn count(&self, kind: &str) {
        self.metrics
            .cluster
            .log_applied
            .with_label_values(&[kind])
            .inc();
    }
}

/// The messages of `stream` from position `start` on, in order: an ordered
/// consumer starts again after the last message it delivered when it
/// misses one or loses its connection.
pub(super) async fn ordered_from(
    js: &jetstream::Context,
    stream: &str,
    start: u64,
) -> Result<
    impl futures::Stream<Item = Result<jetstream::Message, jetstream::consumer::pull::OrderedError>>,
    String,
> {
    let stream = js.get_stream(stream).await.map_err(|e| e.to_string())?;
    let consumer = stream
        .create_consumer(OrderedConfig {
            deliver_policy: DeliverPolicy::ByStartSequence {
                start_sequence: start,
            },
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    consumer.messages().await.map_err(|e| e.to_string())
}

/// Unix microseconds (replicas on one host or NTP-synced hosts).
pub(crate) fn unix_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

async fn register(
    fleet: &Fleet,
    request: pb::RegisterWorkerRequest,
) -> Result<RegisterOutcome, FleetError> {
    // Checked by the replica that appended it; checked again, alike here.
    let worker_id = request.worker_id;
    let (registration, source) =
        convert::registration_from_pb(request).map_err(|e| FleetError::InvalidSource {
            worker_id,
            message: e.to_string(),
        })?;
    fleet.register(registration, source).await
}

async fn events(fleet: &Fleet, batch: pb::KvEventBatch) -> Result<BatchOutcome, FleetError> {
    let limits = fleet.router().config().limits;
    let limits = BatchLimits {
        max_events: limits.max_events_per_batch as usize,
        max_blocks_per_event: limits.max_blocks_per_event as usize,
    };
    let target = fleet.event_target(batch.worker_id, batch.dp_rank)?;
    let worker_id = target.worker_id;
    let validated =
        convert::batch_from_pb(batch, &target, limits).map_err(|e| FleetError::InvalidSource {
            worker_id,
            message: e.to_string(),
        })?;
    fleet.apply_events(validated).await
}

async fn engine_events(fleet: &Fleet, record: pb::EngineEvents) -> Option<EngineOutcome> {
    let model = match fleet.router().worker(record.worker_id) {
        Some(w) if w.generation == record.generation => w.registration.model,
        _ => return None, // the registration it was for is gone
    };
    let mut events = Vec::with_capacity(record.events.len());
    for event in record.events {
        match convert::index_event_from_pb(event) {
            Some(event) => events.push(event),
            None => return None,
        }
    }
    let batch = EngineBatch {
        worker_id: record.worker_id,
        generation: record.generation,
        model,
        dp_rank: record.dp_rank,
        events,
    };
    match fleet.apply_engine_events(batch).await {
        Ok(outcome) => Some(outcome),
        Err(error) => {
            tracing::debug!(%error, "engine events from the log dropped");
            None
        }
    }
}

/// Engine subscriptions' batches go to the log (see the module docs).
pub struct LogForward {
    pub log: Arc<Log>,
    /// The process stops: give up retrying.
    pub stop: CancellationToken,
}

impl EngineForward for LogForward {
    fn forward(&self, batch: EngineBatch, sequence: u64) -> BoxFuture<'_, SinkOutcome> {
        Box::pin(async move {
            let events: Vec<pb::KvEvent> = batch
                .events
                .iter()
                .map(|e| convert::tiered_event_to_pb(0, e))
                .collect();
            // One NATS message each: a large engine batch goes as parts.
            let limit = self.log.max_record_bytes();
            let parts = parts::in_parts(events, |e| e.encoded_len() + 8, limit);
            for (i, events) in parts.into_iter().enumerate() {
                let message_id = format!(
                    "engine.{}.{}.{}.{}.{}.{i}",
                    batch.worker_id,
                    batch.generation,
                    batch.dp_rank,
                    sequence,
                    batch.events.len()
                );
                let body = Body::Engine(pb::EngineEvents {
                    worker_id: batch.worker_id,
                    generation: batch.generation,
                    dp_rank: batch.dp_rank,
                    sequence,
                    events,
                });
                self.append_until_taken(body, message_id).await;
            }
            // What the index does with them is counted where they apply
            // (the follower, `Fleet::count_engine_rejected`).
            SinkOutcome::default()
        })
    }
}

impl LogForward {
    /// Appends, retrying until the log takes the record or the process
    /// stops: the subscriber reads no further meanwhile, and what the
    /// engine sends then is caught up through its replay socket like any
    /// gap. It does not wait for the record to apply: the follower may be
    /// stopping this very subscription (a deregistration before it in the
    /// log), which waits for the subscriber.
    async fn append_until_taken(&self, body: Body, message_id: String) {
        let mut delay = Duration::from_millis(50);
        let mut warned = false;
        while !self.stop.is_cancelled() {
            match self
                .log
                .append(body.clone(), Some(message_id.clone()), false)
                .await
            {
                Ok(_) => return,
                Err(error) => {
                    if !warned {
                        tracing::warn!(%error, "engine batch not yet in the shared log; retrying");
                        warned = true;
                    }
                    tokio::select! {
                        () = self.stop.cancelled() => return,
                        () = tokio::time::sleep(delay) => {}
                    }
                    delay = (delay * 2).min(Duration::from_secs(2));
                }
            }
        }
    }
}
