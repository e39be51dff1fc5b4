//! The mock engine's KV events, published as vLLM publishes them.
//!
//! Why: kvroute (or any router) must subscribe to the mock engine exactly
//! as to vLLM. Each rank publishes on a PUB socket (rank r on the base
//! port plus r), frames `[topic, sequence (8 bytes, big-endian), payload]`,
//! the payload a msgpack `[timestamp, events, dp_rank]` with events in
//! vLLM's named-field encoding (0.24 and later): `BlockStored` with the
//! block hashes, the parent's, the token ids and block size, medium `GPU`;
//! `BlockRemoved`. A ROUTER socket beside it (the replay port plus r)
//! answers a `[identity, "", start]` request with every kept batch from
//! `start` on and an end marker (sequence all ones), as vLLM's replay
//! buffer does; the last `REPLAY_BATCHES` batches are kept.

use std::collections::VecDeque;
use std::sync::Arc;

use anyhow::Context;
use bytes::Bytes;
use parking_lot::Mutex;
use rmpv::Value;
use tokio::sync::{mpsc, oneshot};
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use kvroute_core::types::Tier;

use crate::sim::EngineKvEvent;

/// Batches the replay socket keeps per rank.
pub const REPLAY_BATCHES: usize = 10_000;

/// The end of a replay: a sequence of all ones.
const END_OF_REPLAY: [u8; 8] = [0xff; 8];

/// Kept batches, oldest first: (sequence, payload).
type Kept = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// The `medium` vLLM names a tier with (its offloading connector's host
/// tier is `CPU`).
fn medium(tier: Tier) -> &'static str {
    match tier {
        Tier::Device => "GPU",
        Tier::Host => "CPU",
        Tier::Storage => "FS",
        Tier::External => "OBJ",
    }
}

/// Encodes one step's events as a vLLM batch payload.
pub fn encode_batch(events: &[EngineKvEvent], block_size: usize, dp_rank: u32, ts: f64) -> Vec<u8> {
    let int = |v: u64| Value::from(v);
    let events: Vec<Value> = events
        .iter()
        .map(|event| match event {
            EngineKvEvent::Stored {
                tier,
                parent,
                blocks,
            } => Value::Map(vec![
                ("type".into(), "BlockStored".into()),
                (
                    "block_hashes".into(),
                    Value::Array(blocks.iter().map(|(h, _)| int(*h)).collect()),
                ),
                ("parent_block_hash".into(), parent.map_or(Value::Nil, int)),
                (
                    "token_ids".into(),
                    Value::Array(
                        blocks
                            .iter()
                            .flat_map(|(_, tokens)| tokens.iter().map(|&t| Value::from(t)))
                            .collect(),
                    ),
                ),
                ("block_size".into(), int(block_size as u64)),
                ("lora_id".into(), Value::Nil),
                ("medium".into(), medium(*tier).into()),
            ]),
            EngineKvEvent::Removed {
                tier,
                engine_hashes,
            } => Value::Map(vec![
                ("type".into(), "BlockRemoved".into()),
                (
                    "block_hashes".into(),
                    Value::Array(engine_hashes.iter().map(|h| int(*h)).collect()),
                ),
                ("medium".into(), medium(*tier).into()),
            ]),
        })
        .collect();
    let batch = Value::Array(vec![
        Value::from(ts),
        Value::Array(events),
        Value::from(dp_rank),
    ]);
    let mut out = Vec::new();
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, &batch);
    out
}

/// Binds rank `dp_rank`'s PUB and ROUTER sockets and publishes every batch
/// `batches` yields until it closes.
pub async fn publish(
    pub_endpoint: String,
    replay_endpoint: String,
    block_size: usize,
    dp_rank: u32,
    mut batches: mpsc::UnboundedReceiver<Vec<EngineKvEvent>>,
    ready: oneshot::Sender<anyhow::Result<()>>,
) -> anyhow::Result<()> {
    let bound = async {
        let mut live = PubSocket::new();
        live.bind(&pub_endpoint)
            .await
            .with_context(|| format!("binding {pub_endpoint}"))?;
        let mut router = RouterSocket::new();
        router
            .bind(&replay_endpoint)
            .await
            .with_context(|| format!("binding {replay_endpoint}"))?;
        anyhow::Ok((live, router))
    }
    .await;
    let (mut live, router) = match bound {
        Ok(sockets) => {
            let _ = ready.send(Ok(()));
            sockets
        }
        Err(error) => {
            let message = format!("{error:#}");
            let _ = ready.send(Err(error));
            anyhow::bail!(message);
        }
    };
    let kept: Kept = Arc::default();
    tokio::spawn(serve_replays(router, kept.clone()));
    let mut sequence = 0u64;
    #[allow(clippy::disallowed_methods)] // the batch's wall-clock timestamp, as vLLM's
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64())
    };
    while let Some(events) = batches.recv().await {
        let payload = Bytes::from(encode_batch(&events, block_size, dp_rank, now()));
        {
            let mut kept = kept.lock();
            if kept.len() >= REPLAY_BATCHES {
                kept.pop_front();
            }
            kept.push_back((sequence, payload.clone()));
        }
        let mut message = ZmqMessage::from(Bytes::new());
        message.push_back(Bytes::copy_from_slice(&sequence.to_be_bytes()));
        message.push_back(payload);
        // A PUB socket drops what no subscriber takes; an error here is a
        // closed socket, and the replay buffer still holds the batch.
        let _ = live.send(message).await;
        sequence += 1;
    }
    Ok(())
}

/// Answers replay requests: `[identity, "", start]`.
async fn serve_replays(mut router: RouterSocket, kept: Kept) {
    while let Ok(request) = router.recv().await {
        let frames = request.into_vec();
        let (Some(identity), Some(start)) = (frames.first(), frames.last()) else {
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()).map(u64::from_be_bytes) else {
            continue;
        };
        let batches: Vec<(u64, Bytes)> = kept
            .lock()
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect();
        let reply = |seq: &[u8], payload: Bytes| {
            let mut message = ZmqMessage::from(identity.clone());
            message.push_back(Bytes::new());
            message.push_back(Bytes::copy_from_slice(seq));
            message.push_back(payload);
            message
        };
        for (seq, payload) in batches {
            if router
                .send(reply(&seq.to_be_bytes(), payload))
                .await
                .is_err()
            {
                break;
            }
        }
        let _ = router.send(reply(&END_OF_REPLAY, Bytes::new())).await;
    }
}
