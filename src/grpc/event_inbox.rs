//! The inbound side of a `PublishEvents` stream: its batches are read as
//! they arrive, into a bounded inbox, and applied from there.
//!
//! Why: a batch waits for the one before it to be applied and answered. Had
//! the handler read the next batch only then, a worker pipelining many
//! small batches while kvroute fell behind (or while it read no replies)
//! would leave them buffered in HTTP/2, whose guard against many small
//! DATA frames then closes the whole connection (GOAWAY
//! `too_many_data_frames`), every other stream on it included. Reading
//! eagerly keeps HTTP/2's buffers short; the inbox bounds what kvroute holds
//! instead, as HTTP/2's flow-control window did (1 MiB a stream): past
//! [`MAX_UNANSWERED_BATCHES`] batches or [`MAX_UNANSWERED_BYTES`]
//! unanswered (one batch always fits, up to the message size limit), this
//! stream alone ends with RESOURCE_EXHAUSTED after the batches already
//! taken are answered. The limit is documented in the proto, so a worker
//! can keep to it.

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use prost::Message;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tonic::{Status, Streaming};

use crate::pb;

/// Batches a worker may have sent on one stream and not yet had answered.
pub const MAX_UNANSWERED_BATCHES: usize = 1024;

/// Encoded bytes of those batches (beyond the first, which may be as large
/// as a message may be): what HTTP/2's window let one stream buffer.
pub const MAX_UNANSWERED_BYTES: usize = 1 << 20;

/// What a stream's inbox holds: batches in arrival order, then possibly
/// the status that ends the stream.
pub(crate) struct Inbox {
    items: mpsc::Receiver<Result<pb::KvEventBatch, Status>>,
    /// Encoded bytes of the batches in `items`.
    bytes: Arc<AtomicUsize>,
    count: Arc<AtomicUsize>,
}

impl Inbox {
    /// Starts reading `inbound` into an inbox that holds at most
    /// [`MAX_UNANSWERED_BATCHES`] batches and [`MAX_UNANSWERED_BYTES`] of
    /// them (one batch always fits); `overrun` is called once if the worker
    /// goes past either.
    pub(crate) fn read(
        mut inbound: Streaming<pb::KvEventBatch>,
        overrun: impl FnOnce() + Send + 'static,
    ) -> Self {
        let max_bytes = MAX_UNANSWERED_BYTES;
        // One slot more than the batches: the status that ends the stream
        // always fits.
        let (tx, items) = mpsc::channel(MAX_UNANSWERED_BATCHES + 1);
        let bytes = Arc::new(AtomicUsize::new(0));
        let count = Arc::new(AtomicUsize::new(0));
        let (held_bytes, held) = (bytes.clone(), count.clone());
        tokio::spawn(async move {
            while let Some(next) = inbound.next().await {
                let batch = match next {
                    Ok(batch) => batch,
                    Err(status) => {
                        let _ = tx.send(Err(status)).await;
                        return;
                    }
                };
                let size = batch.encoded_len();
                let queued = held.load(Ordering::Acquire);
                let queued_bytes = held_bytes.load(Ordering::Acquire);
                if queued >= MAX_UNANSWERED_BATCHES
                    || (queued > 0 && queued_bytes.saturating_add(size) > max_bytes)
                {
                    overrun();
                    let _ = tx
                        .send(Err(Status::resource_exhausted(format!(
                            "PublishEvents: more than {MAX_UNANSWERED_BATCHES} batches or {max_bytes} bytes sent unanswered on one stream; wait for replies before sending more (resend from the last acknowledged id)"
                        ))))
                        .await;
                    // Dropping `inbound` discards what the worker sends
                    // after this; the replies still go out.
                    return;
                }
                held.fetch_add(1, Ordering::AcqRel);
                held_bytes.fetch_add(size, Ordering::AcqRel);
                if tx.send(Ok(batch)).await.is_err() {
                    return; // the stream ended on kvroute's side
                }
            }
        });
        Self {
            items,
            bytes,
            count,
        }
    }

    /// The next batch, or the status that ends the stream; `None` once the
    /// worker closed its side.
    pub(crate) async fn next(&mut self) -> Option<Result<pb::KvEventBatch, Status>> {
        let item = self.items.recv().await?;
        if let Ok(batch) = &item {
            self.count.fetch_sub(1, Ordering::AcqRel);
            self.bytes.fetch_sub(batch.encoded_len(), Ordering::AcqRel);
        }
        Some(item)
    }
}
