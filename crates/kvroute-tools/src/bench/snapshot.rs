//! `kvroute bench snapshot`: how large a snapshot is, how long it takes to
//! write and to load, and how long it holds up routing, on a real server.
//!
//! The workload: `--workers` workers, each filled to `--blocks-per-worker`
//! blocks over `PublishEvents` with the prompts of a Mooncake trace, taken
//! in order and dealt round-robin to the workers. Each trace `hash_id` is one
//! block (its local hash); a block's engine hash is the hash of its whole
//! prefix, as engines name blocks by content, so two workers that served
//! the same prefix hold the same path and the index shares it (the sharing
//! a real fleet has). A worker stores only the part of a prompt it does not
//! hold yet, under the last block it holds. Without `--trace`, prompts are
//! synthetic: a shared system prompt, then a per-conversation history.
//!
//! Measured: a `SelectWorker` stream (QUERY_ONLY, one call at a time over
//! the same prompts) runs before and during `Admin/Snapshot`; its p99 and
//! longest call during the snapshot against before say what the snapshot
//! costs routing. Then the server stops and a new one loads the snapshot:
//! the load seconds are its `kvroute_snapshot_load_seconds`, and its index
//! digest must equal the first server's.

use std::{
    collections::HashSet,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use clap::Args;

use super::{BenchError, Latency, LocalServer, connect};
use crate::trace::Trace;
use kvroute::{
    config::ServeConfig,
    grpc::convert,
    pb::{
        self, admin_client::AdminClient, router_client::RouterClient, workers_client::WorkersClient,
    },
};
use kvroute_core::index::KvEvent;

/// Arguments of `kvroute bench snapshot`.
#[derive(Debug, Args)]
pub struct SnapshotBenchArgs {
    /// Registered workers.
    #[arg(long, default_value_t = 64)]
    pub workers: u64,
    /// Blocks each worker is filled to.
    #[arg(long, default_value_t = 16384)]
    pub blocks_per_worker: usize,
    /// A Mooncake-format trace whose prompts fill the workers (synthetic
    /// conversations without it).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Where the snapshots go (a fresh temporary directory without it).
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
}

/// The figures printed as one JSON line.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SnapshotReport {
    pub bench: &'static str,
    pub workers: u64,
    pub entries: u64,
    pub bytes: u64,
    pub bytes_per_entry: f64,
    pub capture_secs: f64,
    pub write_secs: f64,
    pub load_secs: f64,
    pub select_before: Latency,
    pub select_during: Latency,
    pub digest_equal: bool,
}

/// One worker's prompts as block chains: `(local hashes)` per prompt.
fn prompts(args: &SnapshotBenchArgs) -> Result<Vec<Vec<u64>>, BenchError> {
    if let Some(path) = &args.trace {
        let trace = Trace::load(path)?;
        return Ok(trace.records.into_iter().map(|r| r.hash_ids).collect());
    }
    // Synthetic: 16 system prompts of 64 blocks, conversations of 8 turns
    // adding 16 blocks each.
    let mut prompts = Vec::new();
    for conversation in 0..u64::MAX {
        let mut chain: Vec<u64> = (0..64).map(|i| (conversation % 16) * 1000 + i).collect();
        for turn in 0..8 {
            chain.extend((0..16).map(|i| (1 << 32) + conversation * 1000 + turn * 16 + i));
            prompts.push(chain.clone());
        }
        if prompts.len() as u64 * 64 > args.workers * args.blocks_per_worker as u64 * 4 {
            break;
        }
    }
    Ok(prompts)
}

/// The engine hash of every prefix of `chain`.
fn prefix_hashes(chain: &[u64]) -> Vec<u64> {
    let mut h = 0x6b76_7270_7265_6678_u64;
    chain
        .iter()
        .map(|&b| {
            h = xxhash_rust::xxh3::xxh3_64_with_seed(&b.to_le_bytes(), h);
            h
        })
        .collect()
}

/// The event batches that fill every worker, per worker.
fn fill(args: &SnapshotBenchArgs, prompts: &[Vec<u64>]) -> Vec<Vec<pb::KvEvent>> {
    let workers = args.workers as usize;
    let mut held: Vec<HashSet<u64>> = vec![HashSet::new(); workers];
    let mut events: Vec<Vec<pb::KvEvent>> = vec![Vec::new(); workers];
    let mut full = 0;
    for (i, chain) in prompts.iter().cycle().take(prompts.len() * 4).enumerate() {
        let w = i % workers;
        if held[w].len() >= args.blocks_per_worker {
            continue;
        }
        let engines = prefix_hashes(chain);
        let known = engines.iter().take_while(|e| held[w].contains(e)).count();
        let room = args.blocks_per_worker - held[w].len();
        let new: Vec<(u64, u64)> = engines[known..]
            .iter()
            .copied()
            .zip(chain[known..].iter().copied())
            .take(room)
            .collect();
        if new.is_empty() {
            continue;
        }
        held[w].extend(new.iter().map(|&(engine, _)| engine));
        let event_id = events[w].len() as u64;
        let stored = KvEvent::Stored {
            parent: known.checked_sub(1).map(|k| engines[k]),
            blocks: new,
        };
        events[w].push(convert::kv_event_to_pb(event_id, &stored));
        if held[w].len() >= args.blocks_per_worker {
            full += 1;
            if full == workers {
                break;
            }
        }
    }
    events
}

/// QUERY_ONLY SelectWorker calls, one at a time, until `stop`; their latencies.
async fn select_stream(
    channel: tonic::transport::Channel,
    prompts: Arc<Vec<Vec<u64>>>,
    stop: Arc<AtomicBool>,
) -> Vec<Duration> {
    let mut client = RouterClient::new(channel);
    let mut samples = Vec::new();
    let mut i = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let chain = &prompts[i % prompts.len()];
        i += 1;
        let request = pb::SelectWorkerRequest {
            request_id: format!("bench-{i}"),
            model: "bench".into(),
            mode: pb::SelectionMode::QueryOnly.into(),
            prompt: Some(pb::Prompt {
                content: Some(pb::prompt::Content::BlockHashes(pb::BlockHashes {
                    hashes: chain.clone(),
                })),
            }),
            ..Default::default()
        };
        let started = Instant::now();
        if client.select_worker(request).await.is_ok() {
            samples.push(started.elapsed());
        }
    }
    samples
}

async fn stats(channel: &tonic::transport::Channel) -> Result<pb::IndexStats, BenchError> {
    Ok(AdminClient::new(channel.clone())
        .get_index_stats(pb::GetIndexStatsRequest::default())
        .await?
        .into_inner())
}

/// Runs the benchmark and prints its JSON line.
pub async fn run(args: &SnapshotBenchArgs) -> Result<SnapshotReport, BenchError> {
    let dir = match &args.state_dir {
        Some(dir) => dir.clone(),
        None => std::env::temp_dir().join(format!("kvroute-bench-snapshot-{}", std::process::id())),
    };
    let _ = std::fs::remove_dir_all(&dir);
    let config = ServeConfig {
        state_dir: Some(dir.clone()),
        snapshot_interval: Duration::from_secs(24 * 3600),
        lease_ttl: Duration::from_secs(3600),
        block_size: 512,
        ..ServeConfig::for_tests()
    };
    let prompts = prompts(args)?;
    let batches = fill(args, &prompts);
    let server = LocalServer::start(config.clone()).await?;
    let channel = connect(&server.addr.to_string()).await?;
    let mut workers = WorkersClient::new(channel.clone());
    for w in 0..args.workers {
        workers
            .register_worker(pb::RegisterWorkerRequest {
                worker_id: w,
                model: "bench".into(),
                block_size: 512,
                dp_size: 1,
                total_kv_blocks: args.blocks_per_worker as u64,
                max_num_batched_tokens: 8192,
                lease_ttl_secs: 3600,
                ..Default::default()
            })
            .await?;
    }
    for (w, events) in batches.into_iter().enumerate() {
        for chunk in events.chunks(256) {
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            let mut replies = workers
                .publish_events(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await?
                .into_inner();
            let batch = pb::KvEventBatch {
                worker_id: w as u64,
                dp_rank: 0,
                events: chunk.to_vec(),
            };
            tx.send(batch)
                .await
                .map_err(|_| BenchError::Setup("event stream closed".into()))?;
            replies.message().await?;
        }
    }
    let before_stats = stats(&channel).await?;
    eprintln!(
        "bench snapshot: {} workers, {} entries ({} tree nodes)",
        args.workers, before_stats.entries, before_stats.nodes
    );
    let query_prompts = Arc::new(prompts.into_iter().take(2000).collect::<Vec<_>>());

    // Routing before the snapshot, then during it.
    let measure = |during: bool| {
        let channel = channel.clone();
        let query_prompts = query_prompts.clone();
        async move {
            let stop = Arc::new(AtomicBool::new(false));
            let stream = tokio::spawn(select_stream(channel.clone(), query_prompts, stop.clone()));
            let written = if during {
                let reply = AdminClient::new(channel.clone())
                    .snapshot(pb::SnapshotRequest {})
                    .await?
                    .into_inner();
                Some(reply)
            } else {
                tokio::time::sleep(Duration::from_secs(1)).await;
                None
            };
            stop.store(true, Ordering::Relaxed);
            let mut samples = stream.await.map_err(|e| BenchError::Setup(e.to_string()))?;
            Ok::<_, BenchError>((written, Latency::of(&mut samples)))
        }
    };
    let (_, select_before) = measure(false).await?;
    let (written, select_during) = measure(true).await?;
    let written = written.ok_or_else(|| BenchError::Setup("no snapshot written".into()))?;
    server.stop().await;

    // A new server loads it.
    let started = Instant::now();
    let restarted = LocalServer::start(config).await?;
    let channel = connect(&restarted.addr.to_string()).await?;
    let after_stats = stats(&channel).await?;
    let load_secs = scrape_load_seconds(&restarted)
        .await
        .unwrap_or(started.elapsed().as_secs_f64());
    restarted.stop().await;
    if args.state_dir.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let report = SnapshotReport {
        bench: "snapshot",
        workers: args.workers,
        entries: written.entries,
        bytes: written.bytes,
        bytes_per_entry: written.bytes as f64 / written.entries.max(1) as f64,
        capture_secs: written.capture_seconds,
        write_secs: written.write_seconds,
        load_secs,
        select_before,
        select_during,
        digest_equal: (after_stats.entries, after_stats.digest)
            == (before_stats.entries, before_stats.digest),
    };
    println!(
        "{}",
        serde_json::to_string(&report).map_err(|e| BenchError::Setup(e.to_string()))?
    );
    if !report.digest_equal {
        return Err(BenchError::Mismatch(format!(
            "the loaded index differs: {} entries {:016x} against {} {:016x}",
            after_stats.entries, after_stats.digest, before_stats.entries, before_stats.digest
        )));
    }
    Ok(report)
}

/// `kvroute_snapshot_load_seconds` from the server's metrics endpoint.
async fn scrape_load_seconds(server: &LocalServer) -> Option<f64> {
    let text = server.scrape().await?;
    text.lines()
        .find(|l| l.starts_with("kvroute_snapshot_load_seconds "))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}
