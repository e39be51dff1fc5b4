//! One data-parallel rank of the mock engine: the replay simulator's
//! engine model (`sim::engine`) run in real time.
//!
//! Why: the mock engine must behave as the simulator's engines do, so that
//! a run over real sockets can be compared with `kvroute replay` on the
//! same configuration. The loop takes new requests, runs one engine step,
//! sleeps the step's modelled duration (divided by the speed factor), then
//! delivers the step's tokens to their streams and its cache changes to
//! the event publisher, as a real engine's step ends.

use std::{collections::HashMap, sync::Arc, time::Duration};

use tokio::sync::{mpsc, oneshot, watch};

use super::digest::CacheLedger;
use crate::sim::{
    EngineConfig, EngineKvEvent, EngineLoad, SimEngine, block_hashes, engine::EngineRequest,
};

/// What a request's stream receives, in order.
#[derive(Debug, PartialEq, Eq)]
pub enum Produced {
    /// Admitted: prompt tokens found in the cache.
    Admitted { cached_tokens: usize },
    /// One output token; `done` on the last.
    Token { done: bool },
    /// The engine can never run it (prompt over the cache).
    Rejected,
}

/// A request for the rank.
pub struct Submitted {
    pub tokens: Vec<u32>,
    pub output_length: usize,
    pub stream: mpsc::UnboundedSender<Produced>,
    /// The id the rank gave it, sent back at once (to cancel it).
    pub id: oneshot::Sender<u64>,
}

/// The rank's side of the server: where requests go, where abandoned
/// ones are dropped, and its load.
#[derive(Clone)]
pub struct RankHandle {
    pub submit: mpsc::Sender<Submitted>,
    pub abort: mpsc::UnboundedSender<u64>,
    pub load: watch::Receiver<EngineLoad>,
    /// What the rank caches, for the index digest (`digest.rs`).
    pub ledger: Arc<parking_lot::Mutex<CacheLedger>>,
}

/// Starts rank `rank`'s loop; its KV events go to `events` (one batch per
/// step that changed the cache).
pub fn start(
    config: EngineConfig,
    speed: f64,
    queue: usize,
    events: mpsc::UnboundedSender<Vec<EngineKvEvent>>,
) -> RankHandle {
    let (submit, mut submitted) = mpsc::channel::<Submitted>(queue.max(1));
    let (abort, mut aborted) = mpsc::unbounded_channel::<u64>();
    let engine = SimEngine::new(config.clone());
    let (load_tx, load) = watch::channel(engine.load());
    let ledger = Arc::new(parking_lot::Mutex::new(CacheLedger::default()));
    let kept = ledger.clone();
    tokio::spawn(async move {
        let mut engine = engine;
        let mut streams: HashMap<u64, mpsc::UnboundedSender<Produced>> = HashMap::new();
        let mut next_id = 0u64;
        let mut accept = |s: Submitted, engine: &mut SimEngine, streams: &mut HashMap<_, _>| {
            next_id += 1;
            let _ = s.id.send(next_id);
            let hashes = block_hashes(&s.tokens, config.block_size);
            engine.enqueue(EngineRequest {
                id: next_id,
                tokens: s.tokens,
                block_hashes: hashes,
                output_length: s.output_length.max(1),
            });
            streams.insert(next_id, s.stream);
        };
        loop {
            // Idle: wait for a request (and end when the server is gone).
            if !engine.has_work() {
                match submitted.recv().await {
                    Some(s) => accept(s, &mut engine, &mut streams),
                    None => return,
                }
            }
            while let Ok(s) = submitted.try_recv() {
                accept(s, &mut engine, &mut streams);
            }
            // Clients gone: their requests leave the engine, blocks freed.
            while let Ok(id) = aborted.try_recv() {
                if streams.remove(&id).is_some() {
                    engine.abort(id);
                }
            }
            if !engine.has_work() {
                let _ = load_tx.send(engine.load());
                continue;
            }
            let outcome = engine.step();
            if outcome.duration_ms > 0.0 {
                tokio::time::sleep(Duration::from_secs_f64(
                    outcome.duration_ms / 1000.0 / speed,
                ))
                .await;
            }
            for (id, cached_tokens) in &outcome.admissions {
                if let Some(stream) = streams.get(id) {
                    let _ = stream.send(Produced::Admitted {
                        cached_tokens: *cached_tokens,
                    });
                }
            }
            for emit in &outcome.emitted {
                if let Some(stream) = streams.get(&emit.request_id) {
                    let _ = stream.send(Produced::Token { done: emit.done });
                }
                if emit.done {
                    streams.remove(&emit.request_id);
                }
            }
            for id in &outcome.rejected {
                if let Some(stream) = streams.remove(id) {
                    let _ = stream.send(Produced::Rejected);
                }
            }
            if !outcome.kv_events.is_empty() {
                kept.lock().apply(&outcome.kv_events, config.block_size);
                let _ = events.send(outcome.kv_events);
            }
            let _ = load_tx.send(engine.load());
            if !outcome.did_work {
                // Work that cannot be scheduled yet (no free blocks): let
                // time pass rather than spin.
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    });
    RankHandle {
        submit,
        abort,
        load,
        ledger,
    }
}
