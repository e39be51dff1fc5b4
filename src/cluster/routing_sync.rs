//! Booked load and sessions shared between replicas, so they do not herd.
//!
//! Every booking change a replica makes (RESERVE, MarkPrefillComplete,
//! Release, and their queue and deadline variants; `router::sync`) is
//! published at once on `<cluster>.bookings.<replica>` with that replica's
//! own sequence number. A JetStream stream keeps those subjects for the
//! booking TTL, and every replica reads it with an ordered consumer: from
//! its start when the replica starts (so it books the load still open),
//! then live, within a millisecond or two on one network. A jump in a
//! replica's sequence (it published while the stream could not take it)
//! is counted; the missed bookings lapse with the booking TTL.
//!
//! Session bindings go to the `<cluster>_sessions` bucket (its entries
//! age out with the session TTL) and every replica watches it.

use std::{collections::HashMap, sync::Arc, time::Duration};

use async_nats::jetstream::{
    self,
    consumer::{DeliverPolicy, pull::OrderedConfig},
    kv::{self, Operation},
};
use bytes::Bytes;
use futures::StreamExt;
use prost::Message;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::names::{Names, session_key};
use crate::{
    metrics::Metrics,
    pb::{self, booking_change::Change},
    router::{RouterCore, RoutingChange},
    snapshot::convert::{booking_from_pb, booking_to_pb, session_from_pb, session_to_pb},
};

/// Shares this replica's routing changes and applies the others'.
pub struct RoutingSync {
    pub client: async_nats::Client,
    pub js: jetstream::Context,
    pub sessions: kv::Store,
    pub names: Names,
    pub replica: String,
    pub router: Arc<RouterCore>,
}

impl std::fmt::Debug for RoutingSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoutingSync").finish_non_exhaustive()
    }
}

fn kind(change: &RoutingChange) -> &'static str {
    match change {
        RoutingChange::Booked(_) => "booked",
        RoutingChange::PrefillComplete(_) => "prefill_complete",
        RoutingChange::Released(_) => "released",
        RoutingChange::SessionBound(_) => "session",
    }
}

impl RoutingSync {
    fn metrics(&self) -> &Arc<Metrics> {
        self.router.metrics()
    }

    /// Publishes the changes of `feed` until it closes or `stop`.
    pub async fn publish(self: Arc<Self>, mut feed: mpsc::Receiver<RoutingChange>) {
        let subject = self.names.bookings_subject(&self.replica);
        let mut sequence = 0u64;
        while let Some(change) = feed.recv().await {
            let label = kind(&change);
            let sent = match change {
                RoutingChange::SessionBound(session) => {
                    let value = Bytes::from(session_to_pb(&session).encode_to_vec());
                    self.sessions
                        .put(session_key(&session.session_id), value)
                        .await
                        .is_ok()
                }
                change => {
                    sequence += 1;
                    let change = match change {
                        RoutingChange::Booked(b) => Change::Booked(booking_to_pb(&b)),
                        RoutingChange::PrefillComplete(id) => Change::PrefillComplete(id),
                        RoutingChange::Released(id) => Change::Released(id),
                        RoutingChange::SessionBound(_) => continue,
                    };
                    let message = pb::BookingChange {
                        origin: self.replica.clone(),
                        sequence,
                        change: Some(change),
                    };
                    self.client
                        .publish(subject.clone(), message.encode_to_vec().into())
                        .await
                        .is_ok()
                }
            };
            if sent {
                self.metrics()
                    .cluster
                    .booking_changes
                    .with_label_values(&["sent", label])
                    .inc();
            } else {
                self.metrics().cluster.changes_dropped.inc();
            }
        }
    }

    /// Applies the other replicas' booking changes, from the oldest the
    /// stream keeps, until `stop`.
    pub async fn receive(self: Arc<Self>, stop: CancellationToken) {
        let mut last: HashMap<String, u64> = HashMap::new();
        let mut next_stream_sequence = 1u64;
        while !stop.is_cancelled() {
            let messages = match self.consume(next_stream_sequence).await {
                Ok(messages) => messages,
                Err(error) => {
                    tracing::debug!(%error, "bookings stream: cannot consume; retrying");
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(Duration::from_millis(500)) => continue,
                    }
                }
            };
            tokio::pin!(messages);
            loop {
                let message = tokio::select! {
                    () = stop.cancelled() => return,
                    next = messages.next() => match next {
                        Some(Ok(message)) => message,
                        _ => break,
                    },
                };
                if let Ok(info) = message.info() {
                    next_stream_sequence = info.stream_sequence + 1;
                }
                let Ok(change) = pb::BookingChange::decode(message.payload.clone()) else {
                    continue;
                };
                if change.origin == self.replica {
                    continue;
                }
                let previous = last.insert(change.origin.clone(), change.sequence);
                if let Some(previous) = previous
                    && change.sequence > previous + 1
                {
                    self.metrics().cluster.booking_gaps.inc();
                }
                self.apply(change);
            }
        }
    }

    fn apply(&self, change: pb::BookingChange) {
        let change = match change.change {
            Some(Change::Booked(b)) => RoutingChange::Booked(booking_from_pb(b)),
            Some(Change::PrefillComplete(id)) => RoutingChange::PrefillComplete(id),
            Some(Change::Released(id)) => RoutingChange::Released(id),
            None => return,
        };
        self.metrics()
            .cluster
            .booking_changes
            .with_label_values(&["received", kind(&change)])
            .inc();
        self.router.apply_remote(change);
    }

    async fn consume(
        &self,
        start: u64,
    ) -> Result<
        impl futures::Stream<Item = Result<jetstream::Message, jetstream::consumer::pull::OrderedError>>,
        String,
    > {
        let stream = self
            .js
            .get_stream(&self.names.bookings_stream)
            .await
            .map_err(|e| e.to_string())?;
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

    /// Applies session bindings made at other replicas, until `stop`.
    pub async fn watch_sessions(self: Arc<Self>, stop: CancellationToken) {
        while !stop.is_cancelled() {
            let mut watch = match self.sessions.watch_all().await {
                Ok(watch) => watch,
                Err(error) => {
                    tracing::debug!(%error, "sessions bucket: cannot watch; retrying");
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(Duration::from_millis(500)) => continue,
                    }
                }
            };
            loop {
                let entry = tokio::select! {
                    () = stop.cancelled() => return,
                    next = watch.next() => match next {
                        Some(Ok(entry)) => entry,
                        _ => break,
                    },
                };
                if entry.operation != Operation::Put {
                    continue;
                }
                if let Ok(session) = pb::SnapshotSession::decode(entry.value) {
                    let session = session_from_pb(session);
                    self.router
                        .apply_remote(RoutingChange::SessionBound(session));
                }
            }
        }
    }
}
