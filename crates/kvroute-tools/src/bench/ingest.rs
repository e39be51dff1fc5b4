//! `kvroute bench ingest`: replays an op log's store / remove / clear events
//! through `PublishEvents` (one stream per worker) into a server, checks the
//! server's per-(worker, rank) block counts against an in-process replay of
//! the same events, and prints blocks/s over gRPC beside the in-process rate.

use std::{collections::BTreeMap, time::Instant};

use clap::Args;

use super::{BenchError, connect, target};
use crate::oplog::{Op, OpLog};
use kvroute::{
    config::ServeConfig,
    grpc::convert,
    pb::{self, admin_client::AdminClient, workers_client::WorkersClient},
};
use kvroute_core::{
    index::{KvEvent, KvIndex},
    types::{WorkerId, WorkerRank},
};

/// Arguments of `kvroute bench ingest`.
#[derive(Debug, Args)]
pub struct IngestBenchArgs {
    /// The op log (OPLOG v1; docs/BENCHMARKS.md says how to
    /// make one from a trace).
    #[arg(long)]
    pub oplog: std::path::PathBuf,
    /// Target an already running server instead of starting one.
    #[arg(long)]
    pub addr: Option<String>,
    /// Events per KvEventBatch.
    #[arg(long, default_value_t = 128)]
    pub batch: usize,
    /// Added to the log's worker ids, so this can share a server with
    /// another benchmark's workers (e.g. `bench select --addr`).
    #[arg(long, default_value_t = 0)]
    pub worker_offset: u64,
    /// Replays of the log, each from freshly registered workers (a sustained
    /// flood, e.g. beside `bench select --addr`); one JSON line each.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
}

/// The figures printed as one JSON line.
#[derive(Clone, Debug, serde::Serialize)]
pub struct IngestReport {
    pub bench: &'static str,
    pub workers: usize,
    pub events: u64,
    pub blocks: u64,
    pub secs: f64,
    pub blocks_per_s: f64,
    pub in_process_secs: f64,
    pub in_process_blocks_per_s: f64,
    pub ratio: f64,
    pub rejected: u64,
    pub exact: bool,
    /// Slowest and fastest stream, in blocks/s over its own duration: how
    /// evenly the single writer shares itself between streams.
    pub stream_blocks_per_s_min: f64,
    pub stream_blocks_per_s_max: f64,
}

const MODEL: &str = "bench-ingest";

/// Runs the benchmark; fails when the server's block counts differ from
/// the in-process replay's.
/// Unanswered batches (and their bytes) a stream keeps in flight: half of
/// what the server accepts before ending the stream (1,024 and 1 MiB).
const UNANSWERED_BATCHES: usize = 512;
const UNANSWERED_BYTES: usize = 512 * 1024;

pub async fn run(args: &IngestBenchArgs) -> Result<IngestReport, BenchError> {
    let Workload {
        block_size,
        events,
        blocks,
        in_process_secs,
        expected,
        per_worker,
        ranks,
    } = Workload::load(&args.oplog, args.batch, args.worker_offset)?;

    let config = ServeConfig {
        block_size,
        max_events_per_batch: args.batch.max(1) as u32,
        ..ServeConfig::for_tests()
    };
    let (addr, local) = target(args.addr.as_deref(), config).await?;
    let channel = connect(&addr).await?;
    let mut last = None;
    for _ in 0..args.rounds.max(1) {
        let round = Round {
            addr: &addr,
            channel: &channel,
            block_size,
            ranks: &ranks,
            per_worker: per_worker.clone(),
            expected: &expected,
        };
        let (secs, rejected, slowest, fastest, mismatches) = round.run().await?;
        let report = IngestReport {
            bench: "ingest",
            workers: ranks.len(),
            events: events.len() as u64,
            blocks,
            secs,
            blocks_per_s: blocks as f64 / secs.max(1e-9),
            in_process_secs,
            in_process_blocks_per_s: blocks as f64 / in_process_secs.max(1e-9),
            ratio: in_process_secs / secs.max(1e-9),
            rejected,
            exact: mismatches.is_empty(),
            stream_blocks_per_s_min: slowest,
            stream_blocks_per_s_max: fastest,
        };
        println!("{}", serde_json::to_string(&report).unwrap_or_default());
        if !mismatches.is_empty() {
            if let Some(local) = local {
                local.stop().await;
            }
            return Err(BenchError::Mismatch(mismatches.join("; ")));
        }
        last = Some(report);
    }
    if let Some(local) = local {
        local.stop().await;
    }
    last.ok_or_else(|| BenchError::Setup("no round ran".into()))
}

/// An op log's events ready to send: per worker, as protobuf batches in
/// log order, with the in-process replay's figures to compare against.
pub(super) struct Workload {
    pub block_size: u32,
    pub events: Vec<(WorkerRank, KvEvent)>,
    pub blocks: u64,
    pub in_process_secs: f64,
    /// Blocks per (worker, rank) after the in-process replay.
    pub expected: BTreeMap<WorkerRank, u64>,
    pub per_worker: BTreeMap<WorkerId, Vec<pb::KvEventBatch>>,
    /// dp ranks per worker.
    pub ranks: BTreeMap<WorkerId, u32>,
}

impl Workload {
    /// Loads the op log's events (worker ids offset by `worker_offset`)
    /// and replays them into an index in this process for reference.
    pub(crate) fn load(
        oplog: &std::path::Path,
        batch: usize,
        worker_offset: u64,
    ) -> Result<Self, BenchError> {
        let log = OpLog::load(oplog)?;
        let block_size = log.header.block_size;
        let events: Vec<(WorkerRank, KvEvent)> = log
            .ops
            .into_iter()
            .filter_map(|op| match op {
                Op::Event { worker, event } => Some((
                    WorkerRank::new(worker.worker_id + worker_offset, worker.dp_rank),
                    event,
                )),
                Op::Match(_) => None,
            })
            .collect();
        let blocks: u64 = events.iter().map(|(_, e)| e.block_count() as u64).sum();

        // The in-process reference: the same events straight into an index.
        let reference = KvIndex::new(block_size);
        let started = Instant::now();
        for (target, event) in &events {
            let _ = reference.apply(*target, event);
        }
        let in_process_secs = started.elapsed().as_secs_f64();
        let expected: BTreeMap<WorkerRank, u64> =
            reference.stats().per_worker.into_iter().collect();

        // Per worker, its events in log order as protobuf batches (not timed).
        let mut per_worker: BTreeMap<WorkerId, Vec<pb::KvEventBatch>> = BTreeMap::new();
        let mut next_id: BTreeMap<WorkerRank, u64> = BTreeMap::new();
        let mut ranks: BTreeMap<WorkerId, u32> = BTreeMap::new();
        for (target, event) in events.iter() {
            let id = next_id.entry(*target).or_default();
            let event = convert::kv_event_to_pb(*id, event);
            *id += 1;
            let span = ranks.entry(target.worker_id).or_default();
            *span = (*span).max(target.dp_rank + 1);
            let batches = per_worker.entry(target.worker_id).or_default();
            match batches.last_mut() {
                Some(b) if b.dp_rank == target.dp_rank && b.events.len() < batch => {
                    b.events.push(event)
                }
                _ => batches.push(pb::KvEventBatch {
                    worker_id: target.worker_id,
                    dp_rank: target.dp_rank,
                    events: vec![event],
                }),
            }
        }
        Ok(Self {
            block_size,
            events,
            blocks,
            in_process_secs,
            expected,
            per_worker,
            ranks,
        })
    }
}

/// One replay of the log's events into the server, from deregistered
/// workers (so ids start afresh and nothing is skipped as a duplicate).
pub(super) struct Round<'a> {
    pub addr: &'a str,
    pub channel: &'a tonic::transport::Channel,
    pub block_size: u32,
    pub ranks: &'a BTreeMap<WorkerId, u32>,
    pub per_worker: BTreeMap<WorkerId, Vec<pb::KvEventBatch>>,
    pub expected: &'a BTreeMap<WorkerRank, u64>,
}

/// Seconds, rejected events, slowest and fastest stream (blocks/s), and
/// the block-count mismatches against the in-process replay.
type RoundResult = (f64, u64, f64, f64, Vec<String>);

/// Seconds, rejected events, slowest and fastest stream (blocks/s).
pub(super) type Streamed = (f64, u64, f64, f64);

impl Round<'_> {
    async fn run(self) -> Result<RoundResult, BenchError> {
        self.register().await?;
        let (channel, ranks, expected) = (self.channel, self.ranks, self.expected);
        let (secs, rejected, slowest, fastest) = self.stream().await?;
        let mismatches = mismatches(channel, ranks, expected).await?;
        Ok((secs, rejected, slowest, fastest, mismatches))
    }

    /// Registers every worker afresh (deregistered first, so event ids
    /// start again at 0 and nothing is skipped as a duplicate).
    pub(crate) async fn register(&self) -> Result<(), BenchError> {
        let mut workers = WorkersClient::new(self.channel.clone());
        for (&worker_id, &dp_size) in self.ranks {
            // Ignore NOT_FOUND: the worker may not exist yet.
            let _ = workers
                .deregister_worker(pb::DeregisterWorkerRequest { worker_id })
                .await;
            workers
                .register_worker(pb::RegisterWorkerRequest {
                    worker_id,
                    model: MODEL.into(),
                    block_size: self.block_size,
                    dp_size,
                    total_kv_blocks: 1 << 20,
                    max_num_batched_tokens: 8192,
                    lease_ttl_secs: 3600,
                    ..Default::default()
                })
                .await?;
        }
        Ok(())
    }

    /// Sends every worker's batches on its own stream, pipelined within
    /// the server's window of unanswered batches, and waits for the last
    /// replies.
    pub(crate) async fn stream(self) -> Result<Streamed, BenchError> {
        let started = Instant::now();
        let mut tasks = Vec::new();
        for (worker_id, batches) in self.per_worker {
            let mut client = WorkersClient::new(connect(self.addr).await?);
            tasks.push(tokio::spawn(async move {
                let stream_started = Instant::now();
                let count = batches.len();
                let stream_blocks: u64 = batches
                    .iter()
                    .flat_map(|b| &b.events)
                    .map(|e| match &e.kind {
                        Some(pb::kv_event::Kind::Stored(s)) => s.blocks.len() as u64,
                        Some(pb::kv_event::Kind::Removed(r)) => r.engine_hashes.len() as u64,
                        _ => 0,
                    })
                    .sum();
                let (tx, rx) = tokio::sync::mpsc::channel(UNANSWERED_BATCHES);
                let mut replies = client
                    .publish_events(tokio_stream::wrappers::ReceiverStream::new(rx))
                    .await?
                    .into_inner();
                let mut rejected = 0u64;
                // Pipelined, within the server's window for unanswered
                // batches (a stream past it is ended RESOURCE_EXHAUSTED).
                let mut unanswered: std::collections::VecDeque<usize> = Default::default();
                let mut unanswered_bytes = 0usize;
                let mut answered = 0usize;
                for batch in batches {
                    let size = prost::Message::encoded_len(&batch);
                    while !unanswered.is_empty()
                        && (unanswered.len() >= UNANSWERED_BATCHES
                            || unanswered_bytes + size > UNANSWERED_BYTES)
                    {
                        match replies.message().await? {
                            Some(reply) => rejected += u64::from(reply.rejected),
                            None => break,
                        }
                        unanswered_bytes -= unanswered.pop_front().unwrap_or(0);
                        answered += 1;
                    }
                    if tx.send(batch).await.is_err() {
                        break;
                    }
                    unanswered.push_back(size);
                    unanswered_bytes += size;
                }
                drop(tx);
                for _ in answered..count {
                    match replies.message().await? {
                        Some(reply) => rejected += u64::from(reply.rejected),
                        None => break,
                    }
                }
                let secs = stream_started.elapsed().as_secs_f64().max(1e-9);
                Ok::<_, tonic::Status>((worker_id, rejected, stream_blocks as f64 / secs))
            }));
        }
        let mut rejected = 0;
        let (mut slowest, mut fastest) = (f64::INFINITY, 0.0_f64);
        for task in tasks {
            let (_, r, rate) = task.await.map_err(|e| BenchError::Setup(e.to_string()))??;
            rejected += r;
            slowest = slowest.min(rate);
            fastest = fastest.max(rate);
        }
        let secs = started.elapsed().as_secs_f64();
        let slowest = if slowest.is_finite() { slowest } else { 0.0 };
        Ok((secs, rejected, slowest, fastest))
    }
}

/// Exactness: where the server's per-rank block counts differ from the
/// reference's.
pub(super) async fn mismatches(
    channel: &tonic::transport::Channel,
    ranks: &BTreeMap<WorkerId, u32>,
    expected: &BTreeMap<WorkerRank, u64>,
) -> Result<Vec<String>, BenchError> {
    let mut admin = AdminClient::new(channel.clone());
    let mut mismatches = Vec::new();
    for &worker_id in ranks.keys() {
        let info = admin
            .get_worker(pb::GetWorkerRequest { worker_id })
            .await?
            .into_inner();
        for rank in info.ranks {
            let target = WorkerRank::new(worker_id, rank.dp_rank);
            let want = expected.get(&target).copied().unwrap_or(0);
            if rank.cached_blocks != want {
                mismatches.push(format!("{target}: server {} vs {want}", rank.cached_blocks));
            }
        }
    }
    Ok(mismatches)
}
