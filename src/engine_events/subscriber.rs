//! The tokio tasks that talk to the engines' ZeroMQ sockets.
//!
//! Why this exists: everything else in `engine_events` is pure; this module
//! owns the I/O. One task per (worker, dp_rank):
//! * connects a SUB socket to the rank's PUB endpoint and subscribes to the
//!   topic; on a failed connect or a lost peer it drops the socket and
//!   reconnects with exponential backoff (the worker's blocks stay: its
//!   lease or an `AllBlocksCleared` removes them, not a network blip);
//! * tells the [`RankProcessor`] of each new connection (a new connection's
//!   first sequence is judged apart: see `sequence`);
//! * feeds every live message to a [`RankProcessor`]; when the processor
//!   reports a gap (including the slow-joiner loss right after connecting)
//!   and the rank has a replay endpoint, it asks for the missing batches over
//!   a fresh DEALER socket (`["", seq as 8 bytes big-endian]`) and applies the
//!   replies until the `-1` end marker or a timeout, before the live batch;
//! * stops when its cancellation token fires, at whatever await it is in
//!   (sockets are dropped; an event batch is either fully handed to the sink
//!   or not at all, since the sink call is one await).
//!
//! The tasks are spawned on a caller's [`TaskTracker`], so the service's
//! shutdown waits for them.
//!
//! Nothing here can fail a worker's task for good: socket errors reconnect,
//! bad messages are counted and skipped.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use futures::channel::mpsc;
use tokio::task::JoinHandle;
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use zeromq::{
    DealerSocket, Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqMessage,
};

use super::wire::{self, ReplayFrame};
use super::{
    Backoff, ConfigError, EngineEventsConfig, EventSink, RankEndpoints, RankProcessor,
    RankProgress, SavedSalts, Unsynced, WorkerEventMetrics,
};
use kvroute_core::types::{DpRank, WorkerRank};

/// The running subscription of one worker (one task per dp rank).
pub struct WorkerSubscription {
    metrics: Arc<WorkerEventMetrics>,
    /// Each dp rank's progress, in configuration order.
    ranks: Vec<(DpRank, Arc<RankProgress>)>,
    cancel: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl WorkerSubscription {
    pub(crate) fn metrics(&self) -> &Arc<WorkerEventMetrics> {
        &self.metrics
    }

    /// Each dp rank's last applied engine sequence (handed to the sink and
    /// done with), ascending by rank; ranks that applied nothing yet (or
    /// since an engine restart) are left out. What a snapshot saves, to
    /// start again with [`EngineEventsConfig::resume_from`]. A batch may be
    /// applied right after this is read, so read it before the index: on
    /// resume such a batch is replayed again, and a resent event is
    /// harmless to the index, where a skipped one would be lost.
    pub fn last_sequences(&self) -> Vec<(DpRank, u64)> {
        let mut seqs: Vec<(DpRank, u64)> = self
            .ranks
            .iter()
            .filter_map(|(r, p)| p.last_applied().map(|s| (*r, s)))
            .collect();
        seqs.sort_unstable();
        seqs
    }

    /// The dp ranks whose blocks may differ from the engine's cache (lost
    /// batches, a sequence jump) until the engine reports `AllBlocksCleared`,
    /// ascending.
    pub fn unsynced_ranks(&self) -> Vec<DpRank> {
        let mut ranks: Vec<DpRank> = self
            .ranks
            .iter()
            .filter(|(_, p)| p.is_unsynced())
            .map(|(r, _)| *r)
            .collect();
        ranks.sort_unstable();
        ranks
    }

    /// Each dp rank's salted blocks (see [`RankProgress::salts`]), for ranks
    /// that have any.
    pub(crate) fn salts(&self) -> Vec<(DpRank, SavedSalts)> {
        self.ranks
            .iter()
            .map(|(r, p)| (*r, p.salts()))
            .filter(|(_, salts)| !salts.is_empty())
            .collect()
    }

    /// Stop every rank's task and wait for them.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        for t in self.tasks {
            if let Err(e) = t.await {
                tracing::warn!(%e, "engine-event task ended abnormally");
            }
        }
    }
}

#[derive(Clone, Debug)]
pub(crate) struct RankSettings {
    topic: String,
    connect_timeout: Duration,
    replay_timeout: Duration,
    reconnect_initial: Duration,
    reconnect_max: Duration,
    max_message_bytes: usize,
}

/// Start one subscriber task per configured dp rank of a worker on
/// `tracker`, counting into `metrics`; ranks in `cfg.resume_from` carry on
/// from their saved sequence. Must be called inside a tokio
/// runtime. `cancel` (or [`WorkerSubscription::shutdown`]) stops them.
pub fn spawn_worker<S: EventSink>(
    cfg: EngineEventsConfig,
    sink: Arc<S>,
    metrics: Arc<WorkerEventMetrics>,
    cancel: CancellationToken,
    tracker: &TaskTracker,
) -> Result<WorkerSubscription, ConfigError> {
    cfg.validate()?;
    let opts = Arc::new(cfg.translate_options());
    let settings = RankSettings {
        topic: cfg.topic.clone(),
        connect_timeout: cfg.connect_timeout,
        replay_timeout: cfg.replay_timeout,
        reconnect_initial: cfg.reconnect_initial,
        reconnect_max: cfg.reconnect_max,
        max_message_bytes: cfg.max_message_bytes,
    };
    let mut tasks = Vec::with_capacity(cfg.dp_ranks.len());
    let mut ranks = Vec::with_capacity(cfg.dp_ranks.len());
    for rank in &cfg.dp_ranks {
        let eps = cfg.endpoints_for(*rank)?;
        let mut proc = RankProcessor::new(
            WorkerRank::new(cfg.worker_id, *rank),
            cfg.dialect,
            Arc::clone(&opts),
            Arc::clone(&metrics),
            Arc::clone(&sink),
        );
        if let Some(salts) = cfg.resume_salts.get(rank) {
            proc.restore_salts(salts.iter().cloned());
        }
        match cfg.resume_from.get(rank) {
            Some(&last) => proc.resume_from(last, cfg.resume_unsynced.contains(rank)),
            None if cfg.resume_unsynced.contains(rank) => proc.mark_unsynced(Unsynced::Resumed),
            None => {}
        }
        ranks.push((*rank, Arc::clone(proc.progress())));
        let rank_cancel = cancel.child_token();
        let run = run_rank(proc, eps, settings.clone(), rank_cancel.clone());
        tasks.push(tracker.spawn(async move {
            tokio::select! {
                () = rank_cancel.cancelled() => {}
                () = run => {}
            }
        }));
    }
    Ok(WorkerSubscription {
        metrics,
        ranks,
        cancel,
        tasks,
    })
}

async fn run_rank<S: EventSink>(
    mut proc: RankProcessor<S>,
    eps: RankEndpoints,
    s: RankSettings,
    cancel: CancellationToken,
) {
    let target = proc.target();
    let metrics = Arc::clone(&proc.metrics);
    let mut backoff = Backoff::new(s.reconnect_initial, s.reconnect_max);
    loop {
        if cancel.is_cancelled() {
            return;
        }
        match connect_sub(&eps.endpoint, &s.topic, s.connect_timeout).await {
            Err(e) => {
                WorkerEventMetrics::inc(&metrics.connect_failures);
                tracing::debug!(%target, endpoint = %eps.endpoint, %e, "engine-event connect failed");
            }
            Ok((mut sub, mut monitor)) => {
                metrics.connected();
                proc.on_connected();
                tracing::info!(%target, endpoint = %eps.endpoint, "subscribed to engine KV events");
                backoff.reset();
                // First connection: fetch what was published before (or,
                // resumed from a snapshot, since) at once; an idle engine
                // sends no live batch to reveal the gap.
                if let (Some(start), Some(replay)) = (proc.take_catch_up(), &eps.replay_endpoint) {
                    replay_from(&mut proc, replay, start, &s).await;
                }
                let why = session(&mut proc, &mut sub, &mut monitor, &eps, &s, &cancel).await;
                drop(sub);
                if cancel.is_cancelled() {
                    return;
                }
                metrics.disconnected();
                tracing::info!(%target, %why, "engine-event connection lost; reconnecting");
            }
        }
        let delay = backoff.next_delay();
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
    }
}

async fn connect_sub(
    endpoint: &str,
    topic: &str,
    timeout: Duration,
) -> Result<(SubSocket, mpsc::Receiver<SocketEvent>), String> {
    let mut opts = SocketOptions::default();
    opts.connect_timeout(timeout);
    let mut sub = SubSocket::with_options(opts);
    let monitor = sub.monitor();
    tokio::time::timeout(timeout, sub.connect(endpoint))
        .await
        .map_err(|_| "connect timed out".to_owned())?
        .map_err(|e| e.to_string())?;
    sub.subscribe(topic).await.map_err(|e| e.to_string())?;
    Ok((sub, monitor))
}

/// Read live messages until the peer goes away or we are cancelled; returns
/// why the session ended.
async fn session<S: EventSink>(
    proc: &mut RankProcessor<S>,
    sub: &mut SubSocket,
    monitor: &mut mpsc::Receiver<SocketEvent>,
    eps: &RankEndpoints,
    s: &RankSettings,
    cancel: &CancellationToken,
) -> String {
    loop {
        tokio::select! {
            () = cancel.cancelled() => return "cancelled".to_owned(),
            ev = monitor.next() => match ev {
                Some(SocketEvent::Disconnected(_)) => return "peer disconnected".to_owned(),
                Some(_) => {}
                None => return "monitor closed".to_owned(),
            },
            msg = sub.recv() => match msg {
                Ok(m) => handle_live(proc, m, eps, s).await,
                Err(e) => return format!("receive failed: {e}"),
            },
        }
    }
}

async fn handle_live<S: EventSink>(
    proc: &mut RankProcessor<S>,
    msg: ZmqMessage,
    eps: &RankEndpoints,
    s: &RankSettings,
) {
    let frames = msg.into_vec();
    if let Err(e) = wire::check_message_size(&frames, s.max_message_bytes) {
        proc.count_error(&e);
        return;
    }
    let live = match wire::parse_live_frames(&frames) {
        Ok(l) => l,
        Err(e) => {
            proc.count_error(&e);
            return;
        }
    };
    if let Some(missing) = proc.on_live(live.seq).await
        && let Some(replay) = &eps.replay_endpoint
    {
        replay_from(proc, replay, missing.start, s).await;
    }
    proc.apply_batch(live.seq, live.payload).await;
}

/// Ask the engine's replay endpoint for every batch from `start` on and
/// apply them; a failure is counted and routing continues.
pub(crate) async fn replay_from<S: EventSink>(
    proc: &mut RankProcessor<S>,
    endpoint: &str,
    start: u64,
    s: &RankSettings,
) {
    let metrics = Arc::clone(&proc.metrics);
    WorkerEventMetrics::inc(&metrics.replays_requested);
    let target = proc.target();
    let run = async {
        let mut dealer = DealerSocket::new();
        dealer.connect(endpoint).await.map_err(|e| e.to_string())?;
        let mut req = ZmqMessage::from(Bytes::new());
        req.push_back(Bytes::copy_from_slice(&start.to_be_bytes()));
        dealer.send(req).await.map_err(|e| e.to_string())?;
        loop {
            let frames = dealer.recv().await.map_err(|e| e.to_string())?.into_vec();
            if let Err(e) = wire::check_message_size(&frames, s.max_message_bytes) {
                proc.count_error(&e);
                continue;
            }
            match wire::parse_replay_frames(&frames) {
                Ok(ReplayFrame::End) => return Ok::<(), String>(()),
                Ok(ReplayFrame::Batch { seq, payload }) => {
                    WorkerEventMetrics::inc(&metrics.replay_batches);
                    proc.apply_batch(seq, payload).await;
                }
                Err(e) => proc.count_error(&e),
            }
        }
    };
    match tokio::time::timeout(s.replay_timeout, run).await {
        Ok(Ok(())) => tracing::info!(%target, start, "replay complete"),
        Ok(Err(e)) => {
            WorkerEventMetrics::inc(&metrics.replay_failures);
            tracing::warn!(%target, start, %e, "replay failed");
        }
        Err(_) => {
            WorkerEventMetrics::inc(&metrics.replay_failures);
            tracing::warn!(%target, start, "replay timed out");
        }
    }
}
