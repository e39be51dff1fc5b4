//! `kvroute bench decisions`: RESERVE decisions through one router, three
//! replicas deciding locally, and three deciding in the shared log's order
//! (`--decision-order ordered`), all in this process on one NATS
//! JetStream (started here unless `--nats-url`).
//!
//! Each call is a booking's whole life: RESERVE at one replica (round
//! robin), then ReleaseRequest at the next, so the fleet never fills and
//! in ordered mode both are log records. Two measurements per mode, one
//! JSON line each mode:
//! * saturation: `--concurrency` clients calling back to back for
//!   `--secs`: decisions per second across the cluster;
//! * paced: calls started at `--rate` per second for `--secs`, whatever the
//!   answers: the RESERVE latency a caller sees at that load (p50, p99).
//!
//! A last line gives what each cluster mode adds over one router. Clients,
//! replicas and NATS share this machine's cores, so the figures are for
//! comparing the modes in one run.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use clap::Args;
use tonic::transport::Channel;

use super::{BenchError, Latency, LocalServer, cluster::NatsProcess, connect};
use kvroute::{
    config::{ClusterOptions, DecisionOrder, ServeConfig},
    grpc::convert::kv_event_to_pb,
    pb::{self, router_client::RouterClient, workers_client::WorkersClient},
};
use kvroute_core::index::KvEvent;

const MODEL: &str = "m";
const BLOCK_SIZE: u32 = 16;

/// Arguments of `kvroute bench decisions`.
#[derive(Debug, Args)]
pub struct DecisionsBenchArgs {
    /// A NATS server with JetStream; unset: `nats-server -js` is started
    /// here on a free port with a temporary store.
    #[arg(long)]
    pub nats_url: Option<String>,
    /// Replicas of each cluster mode.
    #[arg(long, default_value_t = 3)]
    pub replicas: usize,
    /// Workers registered (each caches some of the shared prefixes).
    #[arg(long, default_value_t = 8)]
    pub workers: u64,
    /// Blocks of each prompt: a shared 32-block prefix (one of 16), then
    /// its own.
    #[arg(long, default_value_t = 64)]
    pub prompt_blocks: u64,
    /// Clients of the saturation run.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Calls per second of the paced run (over all replicas).
    #[arg(long, default_value_t = 1000.0)]
    pub rate: f64,
    /// How long each run of each mode sends.
    #[arg(long, default_value_t = 10.0)]
    pub secs: f64,
}

/// The figures of one mode.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DecisionsReport {
    pub bench: &'static str,
    /// one, local or ordered.
    pub mode: &'static str,
    pub replicas: usize,
    pub decisions_per_s: f64,
    pub saturation_p50_ms: f64,
    pub saturation_p99_ms: f64,
    pub paced_rate: f64,
    pub paced_p50_ms: f64,
    pub paced_p99_ms: f64,
    /// Calls answered with an error (none expected).
    pub errors: u64,
    /// RESERVE calls the replicas decided in the log's order, and those
    /// they decided locally (the log away): 0 unless ordered.
    pub decided_in_order: u64,
    pub decided_locally: u64,
}

/// What each cluster mode adds over one router.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DecisionsSummary {
    pub bench: &'static str,
    pub local_added_p50_ms: f64,
    pub local_added_p99_ms: f64,
    pub ordered_added_p50_ms: f64,
    pub ordered_added_p99_ms: f64,
    pub ordered_decisions_per_s: f64,
}

/// Runs the three modes.
pub async fn run(args: &DecisionsBenchArgs) -> Result<DecisionsSummary, BenchError> {
    let (nats, url) = NatsProcess::unless_given(args.nats_url.as_deref())?;
    let one = mode(args, "one", None).await?;
    let local = mode(args, "local", Some((&url, DecisionOrder::Local))).await?;
    let ordered = mode(args, "ordered", Some((&url, DecisionOrder::Ordered))).await?;
    drop(nats);
    let summary = DecisionsSummary {
        bench: "cluster_decisions_added",
        local_added_p50_ms: local.paced_p50_ms - one.paced_p50_ms,
        local_added_p99_ms: local.paced_p99_ms - one.paced_p99_ms,
        ordered_added_p50_ms: ordered.paced_p50_ms - one.paced_p50_ms,
        ordered_added_p99_ms: ordered.paced_p99_ms - one.paced_p99_ms,
        ordered_decisions_per_s: ordered.decisions_per_s,
    };
    println!("{}", serde_json::to_string(&summary).unwrap_or_default());
    Ok(summary)
}

/// Starts the servers of a mode (`cluster`: NATS and the decision order;
/// `None`: one router alone), measures, stops them.
async fn mode(
    args: &DecisionsBenchArgs,
    name: &'static str,
    cluster: Option<(&str, DecisionOrder)>,
) -> Result<DecisionsReport, BenchError> {
    let cluster_name = format!("decide{}{name}", std::process::id());
    let count = if cluster.is_some() {
        args.replicas.max(1)
    } else {
        1
    };
    let mut servers = Vec::new();
    for i in 0..count {
        let mut config = ServeConfig {
            block_size: BLOCK_SIZE,
            ..ServeConfig::for_tests()
        };
        if let Some((url, order)) = cluster {
            config.cluster = ClusterOptions {
                nats_url: Some(url.to_owned()),
                cluster_name: cluster_name.clone(),
                replica_id: Some(format!("{cluster_name}-r{i}")),
                decision_order: order,
                ..ClusterOptions::default()
            };
        }
        servers.push(LocalServer::start(config).await?);
    }
    let mut channels = Vec::new();
    for s in &servers {
        channels.push(connect(&s.addr.to_string()).await?);
    }
    fill(&channels[0], args).await?;
    // Every replica holds the fleet before the clock starts.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let channels = Arc::new(channels);
    let (decisions_per_s, saturation, errors_saturated) = saturate(&channels, args).await;
    let (paced, errors_paced) = paced(&channels, args).await;
    let (mut decided_in_order, mut decided_locally) = (0, 0);
    for s in &servers {
        let text = s.scrape().await.unwrap_or_default();
        decided_in_order += counter(&text, "ordered");
        decided_locally += counter(&text, "local");
    }
    for s in servers {
        s.stop().await;
    }
    let report = DecisionsReport {
        bench: "cluster_decisions",
        mode: name,
        replicas: count,
        decisions_per_s,
        saturation_p50_ms: saturation.p50_us / 1e3,
        saturation_p99_ms: saturation.p99_us / 1e3,
        paced_rate: args.rate,
        paced_p50_ms: paced.p50_us / 1e3,
        paced_p99_ms: paced.p99_us / 1e3,
        errors: errors_saturated + errors_paced,
        decided_in_order,
        decided_locally,
    };
    println!("{}", serde_json::to_string(&report).unwrap_or_default());
    Ok(report)
}

/// `kvroute_cluster_ordered_decisions_total{outcome}` in a scrape.
fn counter(text: &str, outcome: &str) -> u64 {
    let series = format!("kvroute_cluster_ordered_decisions_total{{outcome=\"{outcome}\"}}");
    super::series_value(text, &series).unwrap_or(0)
}

/// Registers the workers; worker `w` caches the shared prefixes `g` with
/// `g % workers == w - 1`.
async fn fill(channel: &Channel, args: &DecisionsBenchArgs) -> Result<(), BenchError> {
    let mut workers = WorkersClient::new(channel.clone());
    for worker_id in 1..=args.workers.max(1) {
        workers
            .register_worker(pb::RegisterWorkerRequest {
                worker_id,
                model: MODEL.into(),
                block_size: BLOCK_SIZE,
                dp_size: 1,
                total_kv_blocks: 1 << 20,
                max_num_batched_tokens: 1 << 20,
                lease_ttl_secs: 3600,
                ..Default::default()
            })
            .await?;
        let mut events = Vec::new();
        for group in (0..16u64).filter(|g| g % args.workers.max(1) == worker_id - 1) {
            let blocks: Vec<(u64, u64)> = prefix(group)
                .into_iter()
                .enumerate()
                .map(|(i, local)| (worker_id << 40 | group << 20 | i as u64, local))
                .collect();
            events.push(kv_event_to_pb(
                events.len() as u64,
                &KvEvent::Stored {
                    parent: None,
                    blocks,
                },
            ));
        }
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let _ = tx
            .send(pb::KvEventBatch {
                worker_id,
                dp_rank: 0,
                events,
            })
            .await;
        drop(tx);
        workers
            .publish_events(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await?
            .into_inner()
            .message()
            .await?;
    }
    Ok(())
}

/// Shared prefix `group`'s 32 local hashes.
fn prefix(group: u64) -> Vec<u64> {
    (0..32).map(|i| 1 + group * 1_000 + i).collect()
}

/// Call `n`'s prompt: a shared prefix, then blocks of its own.
fn prompt(n: u64, blocks: u64) -> Vec<u64> {
    let mut prompt = prefix(n % 16);
    prompt.extend((32..blocks.max(33)).map(|i| (1 << 50) + n * 1_000 + i));
    prompt
}

/// One booking's life: RESERVE at replica `n % replicas`, released at the
/// next; answers the RESERVE latency, or `None` when a call failed.
async fn booking(channels: &[Channel], n: u64, blocks: u64) -> Option<Duration> {
    let at = |k: u64| channels[(k % channels.len() as u64) as usize].clone();
    let request_id = format!("d-{n}");
    let request = pb::SelectWorkerRequest {
        request_id: request_id.clone(),
        model: MODEL.into(),
        prompt: Some(pb::Prompt {
            content: Some(pb::prompt::Content::BlockHashes(pb::BlockHashes {
                hashes: prompt(n, blocks),
            })),
        }),
        admission: pb::AdmissionMode::Reject.into(),
        ..Default::default()
    };
    let started = Instant::now();
    let reserved = RouterClient::new(at(n)).select_worker(request).await;
    let latency = started.elapsed();
    let released = RouterClient::new(at(n + 1))
        .release_request(pb::ReleaseRequestRequest {
            request_id,
            cached_tokens: None,
        })
        .await;
    (reserved.is_ok() && released.is_ok()).then_some(latency)
}

/// Clients calling back to back: decisions/s, their latency, errors.
async fn saturate(channels: &Arc<Vec<Channel>>, args: &DecisionsBenchArgs) -> (f64, Latency, u64) {
    let next = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + Duration::from_secs_f64(args.secs);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..args.concurrency.max(1) {
        let (channels, next, errors) = (channels.clone(), next.clone(), errors.clone());
        let blocks = args.prompt_blocks;
        tasks.push(tokio::spawn(async move {
            let mut samples = Vec::new();
            while Instant::now() < until {
                let n = next.fetch_add(1, Ordering::Relaxed);
                match booking(&channels, n, blocks).await {
                    Some(latency) => samples.push(latency),
                    None => {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            samples
        }));
    }
    let mut samples = Vec::new();
    for task in tasks {
        samples.extend(task.await.unwrap_or_default());
    }
    let secs = started.elapsed().as_secs_f64();
    let rate = samples.len() as f64 / secs.max(1e-9);
    (
        rate,
        Latency::of(&mut samples),
        errors.load(Ordering::Relaxed),
    )
}

/// Calls started at `args.rate` whatever the answers: their latency.
async fn paced(channels: &Arc<Vec<Channel>>, args: &DecisionsBenchArgs) -> (Latency, u64) {
    let total = (args.rate * args.secs).max(1.0) as u64;
    let started = tokio::time::Instant::now();
    let errors = Arc::new(AtomicU64::new(0));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for i in 0..total {
        tokio::time::sleep_until(started + Duration::from_secs_f64(i as f64 / args.rate)).await;
        let (channels, errors, tx) = (channels.clone(), errors.clone(), tx.clone());
        // Numbered past the saturation run's calls.
        let n = (1 << 32) + i;
        let blocks = args.prompt_blocks;
        tokio::spawn(async move {
            match booking(&channels, n, blocks).await {
                Some(latency) => {
                    let _ = tx.send(latency);
                }
                None => {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
    }
    drop(tx);
    let mut samples = Vec::new();
    while let Some(latency) = rx.recv().await {
        samples.push(latency);
    }
    (Latency::of(&mut samples), errors.load(Ordering::Relaxed))
}
