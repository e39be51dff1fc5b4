//! The soak's workers: simulated engines that publish their KV events
//! through PublishEvents, the dispatch of the trace's requests to them,
//! and the churn that cordons, lapses and deregisters them.

use super::*;

/// What the dispatcher and the churn see of a worker.
pub(super) struct WorkerSlot {
    pub(super) id: u64,
    /// Registered and publishing (false while the churn has it away).
    pub(super) up: AtomicBool,
    pub(super) jobs: mpsc::Sender<Job>,
}

impl WorkerSlot {
    pub(super) fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }
}

/// A trace request for an engine.
pub(super) struct Job {
    pub(super) id: u64,
    pub(super) tokens: Vec<u32>,
    pub(super) output_length: usize,
}

/// What the churn asks a worker to do.
#[derive(Clone, Copy, Debug)]
pub(super) enum Churn {
    /// Stop heartbeating until the lease lapses, then come back.
    Lapse,
    /// Deregister, then come back.
    Deregister,
}

/// One open PublishEvents stream.
pub(super) struct EventStream {
    pub(super) batches: mpsc::Sender<pb::KvEventBatch>,
    pub(super) replies: tonic::Streaming<pb::PublishEventsReply>,
}

/// One simulated worker: an engine, its event stream and its lease. It is
/// the only writer of its own events, so the reference index sees them in
/// the order the server does.
pub(super) struct Worker {
    pub(super) slot: Arc<WorkerSlot>,
    pub(super) channel: Channel,
    pub(super) engine_config: EngineConfig,
    pub(super) engine: SimEngine,
    pub(super) block_size: u32,
    pub(super) lease_secs: u32,
    pub(super) reference: Arc<KvIndex>,
    pub(super) tally: Arc<Tally>,
    pub(super) stream: Option<EventStream>,
    pub(super) next_event_id: u64,
}

impl Worker {
    /// Registers with a fresh engine (empty cache, events from id 0) and
    /// opens the event stream.
    pub(super) async fn start(&mut self) -> Result<(), tonic::Status> {
        self.engine = SimEngine::new(self.engine_config.clone());
        self.next_event_id = 0;
        self.stream = None;
        let mut workers = WorkersClient::new(self.channel.clone());
        workers
            .register_worker(pb::RegisterWorkerRequest {
                worker_id: self.slot.id,
                model: MODEL.into(),
                block_size: self.block_size,
                dp_size: 1,
                total_kv_blocks: self.engine_config.num_blocks as u64,
                max_num_batched_tokens: 1 << 20,
                lease_ttl_secs: self.lease_secs,
                ..Default::default()
            })
            .await?;
        let (batches, receiver) = mpsc::channel(4);
        let replies = workers
            .publish_events(tokio_stream::wrappers::ReceiverStream::new(receiver))
            .await?
            .into_inner();
        self.stream = Some(EventStream { batches, replies });
        self.slot.up.store(true, Ordering::Release);
        Ok(())
    }

    pub(super) async fn run(
        mut self,
        mut jobs: mpsc::Receiver<Job>,
        mut orders: mpsc::Receiver<Churn>,
        stop: CancellationToken,
    ) {
        let mut beat =
            tokio::time::interval(Duration::from_millis(u64::from(self.lease_secs) * 1000 / 3));
        beat.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                _ = stop.cancelled() => break,
                Some(order) = orders.recv() => self.churn(order, &mut jobs).await,
                _ = beat.tick() => self.heartbeat().await,
                Some(job) = jobs.recv() => self.serve(job).await,
            }
        }
    }

    pub(super) async fn heartbeat(&mut self) {
        if !self.slot.is_up() {
            return;
        }
        let load = self.engine.load();
        let request = pb::HeartbeatRequest {
            worker_id: self.slot.id,
            load: vec![pb::RankLoad {
                dp_rank: 0,
                running_requests: load.running as u32,
                waiting_requests: load.waiting as u32,
                kv_blocks_used: load.active_blocks as u64,
            }],
        };
        if let Err(status) = WorkersClient::new(self.channel.clone())
            .heartbeat(request)
            .await
        {
            self.tally.status("Heartbeat", &status, false);
        }
    }

    /// Runs one request on the engine to completion and publishes what its
    /// cache did.
    pub(super) async fn serve(&mut self, job: Job) {
        if !self.slot.is_up() {
            self.tally.shed();
            return;
        }
        let hashes = block_hashes(&job.tokens, self.engine_config.block_size);
        self.engine.enqueue(EngineRequest {
            id: job.id,
            tokens: job.tokens,
            block_hashes: hashes,
            output_length: job.output_length,
        });
        let mut events = Vec::new();
        let mut steps = 0;
        while self.engine.has_work() && steps < MAX_STEPS {
            let outcome = self.engine.step();
            events.extend(outcome.kv_events);
            steps += 1;
            if !outcome.did_work {
                break;
            }
        }
        let events: Vec<KvEvent> = events.into_iter().map(|e| self.to_index(e)).collect();
        for chunk in events.chunks(BATCH_EVENTS) {
            if !self.publish(chunk).await {
                break;
            }
        }
    }

    /// An engine event as the index sees it (local hashes of the tokens).
    /// The soak's engines have no host tier, so every event is the device's.
    pub(super) fn to_index(&self, event: EngineKvEvent) -> KvEvent {
        match event {
            EngineKvEvent::Stored { parent, blocks, .. } => KvEvent::Stored {
                parent,
                blocks: blocks
                    .into_iter()
                    .map(|(engine, tokens)| {
                        let local = compute_block_hashes(
                            &tokens,
                            self.block_size,
                            &HashOptions::default(),
                            None,
                        )
                        .first()
                        .copied()
                        .unwrap_or_default();
                        (engine, local)
                    })
                    .collect(),
            },
            EngineKvEvent::Removed { engine_hashes, .. } => KvEvent::Removed {
                blocks: engine_hashes,
            },
        }
    }

    /// Sends one batch and waits for its reply; the events go into the
    /// reference index once the server acknowledged them. False when the
    /// stream broke (it is reopened by the next registration only, so the
    /// worker's later events are not sent into a gap).
    pub(super) async fn publish(&mut self, events: &[KvEvent]) -> bool {
        let Some(stream) = self.stream.as_mut() else {
            return false;
        };
        let batch = pb::KvEventBatch {
            worker_id: self.slot.id,
            dp_rank: 0,
            events: events
                .iter()
                .enumerate()
                .map(|(i, e)| convert::kv_event_to_pb(self.next_event_id + i as u64, e))
                .collect(),
        };
        self.next_event_id += events.len() as u64;
        if stream.batches.send(batch).await.is_err() {
            self.tally.error("PublishEvents", "STREAM_CLOSED", false);
            self.stream = None;
            return false;
        }
        match stream.replies.message().await {
            Ok(Some(reply)) => {
                let target = WorkerRank::new(self.slot.id, 0);
                for event in events {
                    let _ = self.reference.apply(target, event);
                }
                self.tally.accepted(events.len() as u64);
                if reply.rejected > 0 {
                    self.tally.error("PublishEvents", "EVENTS_REJECTED", false);
                }
                if reply.resend_from_event_id.is_some() {
                    self.tally.error("PublishEvents", "RESEND_ASKED", false);
                }
                if reply.resync_required {
                    self.tally.error("PublishEvents", "RESYNC_REQUIRED", false);
                }
                true
            }
            Ok(None) => {
                self.tally.error("PublishEvents", "STREAM_ENDED", false);
                self.stream = None;
                false
            }
            Err(status) => {
                self.tally.status("PublishEvents", &status, false);
                self.stream = None;
                false
            }
        }
    }

    /// Goes away as the churn asks, then comes back with a fresh engine.
    pub(super) async fn churn(&mut self, order: Churn, jobs: &mut mpsc::Receiver<Job>) {
        self.slot.up.store(false, Ordering::Release);
        self.stream = None;
        let worker_id = self.slot.id;
        match order {
            Churn::Lapse => self.lapse(jobs).await,
            Churn::Deregister => {
                if let Err(status) = WorkersClient::new(self.channel.clone())
                    .deregister_worker(pb::DeregisterWorkerRequest { worker_id })
                    .await
                {
                    self.tally.status("DeregisterWorker", &status, false);
                }
            }
        }
        self.reference.remove_worker(worker_id);
        while jobs.try_recv().is_ok() {
            self.tally.shed();
        }
        if let Err(status) = self.start().await {
            self.tally.status("RegisterWorker", &status, false);
        }
    }

    /// Waits, without heartbeats, until the server forgot the worker; then
    /// heartbeats once as a returning engine would, which must be refused.
    pub(super) async fn lapse(&mut self, jobs: &mut mpsc::Receiver<Job>) {
        let worker_id = self.slot.id;
        let mut admin = AdminClient::new(self.channel.clone());
        let deadline = Instant::now() + Duration::from_secs(u64::from(self.lease_secs) * 4 + 30);
        loop {
            tokio::time::sleep(Duration::from_millis(250)).await;
            while jobs.try_recv().is_ok() {
                self.tally.shed();
            }
            match admin.get_worker(pb::GetWorkerRequest { worker_id }).await {
                Ok(_) if Instant::now() < deadline => continue,
                Ok(_) => {
                    // Deregister so the server and the reference agree again.
                    self.tally.error("Lease", "NEVER_LAPSED", false);
                    let _ = WorkersClient::new(self.channel.clone())
                        .deregister_worker(pb::DeregisterWorkerRequest { worker_id })
                        .await;
                    return;
                }
                Err(status) => {
                    let designed = status.code() == tonic::Code::NotFound;
                    self.tally.status("GetWorker", &status, designed);
                    break;
                }
            }
        }
        match WorkersClient::new(self.channel.clone())
            .heartbeat(pb::HeartbeatRequest {
                worker_id,
                load: Vec::new(),
            })
            .await
        {
            Ok(_) => self.tally.error("Heartbeat", "OK_AFTER_LAPSE", false),
            Err(status) => {
                let designed = status.code() == tonic::Code::NotFound;
                self.tally.status("Heartbeat", &status, designed);
            }
        }
    }
}

/// Hands the trace's requests to the engines at `rate_x` times the trace's
/// pace, looping over it; a conversation stays on one worker while it is up.
pub(super) async fn dispatch(
    trace: Arc<Trace>,
    slots: Vec<Arc<WorkerSlot>>,
    rate_x: f64,
    tally: Arc<Tally>,
    stop: CancellationToken,
) {
    let records = &trace.records;
    let span_ms = records.iter().map(|r| r.timestamp).max().unwrap_or(0) + 1000;
    let started = tokio::time::Instant::now();
    let workers = slots.len() as u64;
    let mut k: u64 = 0;
    loop {
        let n = records.len() as u64;
        let Some(record) = records.get((k % n) as usize) else {
            return;
        };
        let lap = k / n;
        let at_ms = (lap * span_ms + record.timestamp) as f64;
        let due = started
            + Duration::try_from_secs_f64(at_ms / 1000.0 / rate_x).unwrap_or(Duration::ZERO);
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep_until(due) => {}
        }
        let key = record
            .hash_ids
            .iter()
            .take(3)
            .fold(0u64, |acc, &h| mix(acc, h));
        let first = (key % workers) as usize;
        let mut job = Job {
            id: k,
            tokens: record.tokens(),
            output_length: record.output_length,
        };
        let mut placed = false;
        for j in 0..slots.len() {
            let slot = &slots[(first + j) % slots.len()];
            if !slot.is_up() {
                continue;
            }
            match slot.jobs.try_send(job) {
                Ok(()) => {
                    placed = true;
                    break;
                }
                Err(error) => job = error.into_inner(),
            }
        }
        if !placed {
            tally.shed();
        }
        k += 1;
    }
}

/// Every `period` one churn action on the next worker, in turn: cordon
/// (uncordoned half a period later), lease lapse, deregistration.
pub(super) async fn churn(
    mut admin: AdminClient<Channel>,
    slots: Vec<Arc<WorkerSlot>>,
    orders: Vec<mpsc::Sender<Churn>>,
    period: Duration,
    tally: Arc<Tally>,
    stop: CancellationToken,
) {
    let mut tick: usize = 0;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(period) => {}
        }
        let w = tick % slots.len().max(1);
        let (Some(slot), Some(order)) = (slots.get(w), orders.get(w)) else {
            return;
        };
        let worker_id = slot.id;
        match tick % 3 {
            0 => {
                // A worker the churn has away answers NOT_FOUND: designed.
                if let Err(status) = admin
                    .cordon_worker(pb::CordonWorkerRequest { worker_id })
                    .await
                {
                    tally.status("CordonWorker", &status, !slot.is_up());
                }
                tokio::select! {
                    _ = stop.cancelled() => {}
                    _ = tokio::time::sleep(period / 2) => {}
                }
                if let Err(status) = admin
                    .uncordon_worker(pb::UncordonWorkerRequest { worker_id })
                    .await
                {
                    tally.status("UncordonWorker", &status, !slot.is_up());
                }
            }
            1 => {
                let _ = order.try_send(Churn::Lapse);
            }
            _ => {
                let _ = order.try_send(Churn::Deregister);
            }
        }
        tick += 1;
    }
}
