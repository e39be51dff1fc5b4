//! Booked load and sessions shared between replicas, so they do not herd.
//!
//! Every booking change a replica makes (RESERVE, MarkPrefillComplete,
//! Release, and their queue and deadline variants; `router::sync`) is
//! published at once on `<cluster>.bookings.<replica>` with that replica's
//! own sequence number. A JetStream stream keeps those subjects for the
//! booking TTL, and every replica reads it with an ordered consumer: from
//! its start when the replica starts (so it books the load still open),
//! then live, within a millisecond or two on one network.
//!
//! A change a replica could not publish (NATS away) never reaches the
//! stream; the others see a jump in its sequence (counted). So a replica
//! that failed to publish, and every replica whose connection comes back,
//! then publishes a resync: every booking it made that is still open. A
//! receiver books what it lacks and releases what it holds from that
//! replica and the resync does not list.
//!
//! Session bindings go to the `<cluster>_sessions` bucket (its entries
//! age out with the session TTL) and every replica watches it.

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
    time::Duration,
};

use async_nats::jetstream::{
    self,
    kv::{self, Operation},
};
use bytes::Bytes;
use futures::StreamExt;
use prost::Message;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::{
    error::ClusterError,
    log::ordered_from,
    names::{Names, session_key},
    parts,
};
use crate::{
    metrics::Metrics,
    pb::{self, booking_change::Change},
    router::{RouterCore, RoutingChange},
    snapshot::convert::{booking_from_pb, booking_to_pb, session_from_pb, session_to_pb},
};

/// Bookings of one origin tracked before those no longer booked here are
/// forgotten.
const MAX_TRACKED: usize = 65_536;

/// What the publisher keeps: its subject, sequence, the bookings it made
/// that may still be open, and whether the others need a resync.
struct Outbox {
    subject: String,
    sequence: u64,
    own: HashSet<String>,
    needs_resync: bool,
}

/// What a receiver keeps of one other replica.
#[derive(Default)]
struct Origin {
    /// Its last sequence seen.
    last: u64,
    /// Bookings it made, as far as this replica knows.
    booked: HashSet<String>,
    /// The ids of a resync being received.
    resync: HashSet<String>,
}

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

    /// Publishes the changes of `feed` until it closes. After a change
    /// could not be published, or the connection came back, it publishes
    /// a resync of every booking this replica made that is still open.
    pub(crate) async fn publish(
        self: Arc<Self>,
        mut feed: mpsc::Receiver<RoutingChange>,
        mut connected: watch::Receiver<bool>,
    ) {
        let mut out = Outbox {
            subject: self.names.bookings_subject(&self.replica),
            sequence: 0,
            own: HashSet::new(),
            needs_resync: false,
        };
        loop {
            tokio::select! {
                change = feed.recv() => match change {
                    Some(change) => {
                        let up = *connected.borrow();
                        self.send(&mut out, change, up).await;
                    }
                    None => return,
                },
                changed = connected.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    if *connected.borrow() {
                        out.needs_resync = true;
                    }
                }
            }
            let up = *connected.borrow();
            if out.needs_resync && up {
                out.needs_resync = !self.resync(&mut out).await;
            }
        }
    }

    async fn send(&self, out: &mut Outbox, change: RoutingChange, connected: bool) {
        let label = kind(&change);
        let sent = match change {
            RoutingChange::SessionBound(session) => {
                let value = Bytes::from(session_to_pb(&session).encode_to_vec());
                connected
                    && self
                        .sessions
                        .put(session_key(&session.session_id), value)
                        .await
                        .is_ok()
            }
            change => {
                let change = match change {
                    RoutingChange::Booked(b) => {
                        out.own.insert(b.request_id.clone());
                        Change::Booked(booking_to_pb(&b))
                    }
                    RoutingChange::PrefillComplete(id) => Change::PrefillComplete(id),
                    RoutingChange::Released(id) => {
                        out.own.remove(&id);
                        Change::Released(id)
                    }
                    RoutingChange::SessionBound(_) => return,
                };
                let sent = connected && self.emit(out, change).await;
                out.needs_resync |= !sent;
                sent
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

    /// Publishes one change with the next sequence number.
    async fn emit(&self, out: &mut Outbox, change: Change) -> bool {
        out.sequence += 1;
        let message = pb::BookingChange {
            origin: self.replica.clone(),
            sequence: out.sequence,
            change: Some(change),
        };
        self.client
            .publish(out.subject.clone(), message.encode_to_vec().into())
            .await
            .is_ok()
    }

    /// Publishes every booking this replica made that is still open, in
    /// parts that fit a message; returns whether all went out.
    async fn resync(&self, out: &mut Outbox) -> bool {
        let open: Vec<pb::SnapshotBooking> = {
            out.own.retain(|id| self.router.saved_booking(id).is_some());
            out.own
                .iter()
                .filter_map(|id| self.router.saved_booking(id))
                .map(|b| booking_to_pb(&b))
                .collect()
        };
        let limit = parts::limit(self.client.server_info().max_payload);
        let parts = parts::in_parts(open, |b| b.encoded_len() + 8, limit);
        let count = parts.len();
        for (i, bookings) in parts.into_iter().enumerate() {
            let resync = pb::BookingResync {
                bookings,
                last: i + 1 == count,
            };
            if !self.emit(out, Change::Resync(resync)).await {
                return false;
            }
        }
        tracing::info!(
            bookings = out.own.len(),
            "booked load resynchronised with the other replicas"
        );
        true
    }

    /// Applies the other replicas' booking changes, from the oldest the
    /// stream keeps, until `stop`.
    pub(crate) async fn receive(self: Arc<Self>, stop: CancellationToken) {
        let mut origins: HashMap<String, Origin> = HashMap::new();
        let mut next_stream_sequence = 1u64;
        while !stop.is_cancelled() {
            let messages =
                match ordered_from(&self.js, &self.names.bookings_stream, next_stream_sequence)
                    .await
                {
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
                let origin = origins.entry(change.origin.clone()).or_default();
                if origin.last > 0 && change.sequence > origin.last + 1 {
                    self.metrics().cluster.booking_gaps.inc();
                }
                origin.last = change.sequence;
                self.apply_from(origin, change);
            }
        }
    }

    /// Applies one change of `origin`, keeping track of the bookings it
    /// made (bounded by the bookings open here: ids no longer booked are
    /// forgotten at each resync).
    fn apply_from(&self, origin: &mut Origin, change: pb::BookingChange) {
        match change.change {
            Some(Change::Resync(part)) => {
                for booking in part.bookings {
                    let booking = booking_from_pb(booking);
                    origin.resync.insert(booking.request_id.clone());
                    if booking.prefill.is_none() {
                        self.router.apply_remote(RoutingChange::PrefillComplete(
                            booking.request_id.clone(),
                        ));
                    }
                    self.router.apply_remote(RoutingChange::Booked(booking));
                }
                if part.last {
                    let listed = std::mem::take(&mut origin.resync);
                    for stale in origin.booked.difference(&listed) {
                        self.router
                            .apply_remote(RoutingChange::Released(stale.clone()));
                    }
                    origin.booked = listed;
                    self.metrics().cluster.booking_resyncs.inc();
                }
            }
            Some(Change::Booked(b)) => {
                if origin.booked.len() >= MAX_TRACKED {
                    origin
                        .booked
                        .retain(|id| self.router.saved_booking(id).is_some());
                }
                origin.booked.insert(b.request_id.clone());
                self.apply(pb::BookingChange {
                    change: Some(Change::Booked(b)),
                    ..change
                });
            }
            Some(Change::Released(id)) => {
                origin.booked.remove(&id);
                self.apply(pb::BookingChange {
                    change: Some(Change::Released(id)),
                    ..change
                });
            }
            other => self.apply(pb::BookingChange {
                change: other,
                ..change
            }),
        }
    }

    fn apply(&self, change: pb::BookingChange) {
        let change = match change.change {
            Some(Change::Booked(b)) => RoutingChange::Booked(booking_from_pb(b)),
            Some(Change::PrefillComplete(id)) => RoutingChange::PrefillComplete(id),
            Some(Change::Released(id)) => RoutingChange::Released(id),
            Some(Change::Resync(_)) | None => return,
        };
        self.metrics()
            .cluster
            .booking_changes
            .with_label_values(&["received", kind(&change)])
            .inc();
        self.router.apply_remote(change);
    }

    /// Applies session bindings made at other replicas, until `stop`.
    /// Applies every session the bucket holds now; the watch returned
    /// goes on with later changes (for [`Self::watch_sessions`]).
    pub(crate) async fn read_sessions(&self) -> Result<kv::Watch, ClusterError> {
        super::watch_from_current(&self.sessions, |entry| self.session_entry(entry)).await
    }

    fn session_entry(&self, entry: kv::Entry) {
        if entry.operation != Operation::Put {
            return;
        }
        if let Ok(session) = pb::SnapshotSession::decode(entry.value) {
            let session = session_from_pb(session);
            self.router
                .apply_remote(RoutingChange::SessionBound(session));
        }
    }

    pub(crate) async fn watch_sessions(
        self: Arc<Self>,
        mut first: Option<kv::Watch>,
        stop: CancellationToken,
    ) {
        while !stop.is_cancelled() {
            let mut watch = match super::next_watch(&self.sessions, &mut first).await {
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
                self.session_entry(entry);
            }
        }
    }
}
