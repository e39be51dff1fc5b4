//! `kvroute bench select`: many concurrent gRPC clients calling SelectWorker
//! on loopback with prompts from a Mooncake trace, against 64 workers whose
//! index was warmed with the trace's earlier requests; then the same load of
//! `grpc.health.v1.Health/Check` on the same server, in the same run, so the
//! two can be compared as ratios on a noisy machine.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use clap::Args;
use tonic::transport::Channel;

use super::{BenchError, Latency, connect_as, target};
use crate::{
    config::ServeConfig,
    hashing::{HashOptions, compute_block_hashes},
    pb::{self, workers_client::WorkersClient},
    trace::Trace,
};

/// Arguments of `kvroute bench select`.
#[derive(Debug, Args)]
pub struct SelectBenchArgs {
    /// A Mooncake-format trace (the conversation trace in shared/data/traces).
    #[arg(long)]
    pub trace: std::path::PathBuf,
    /// Target an already running server instead of starting one.
    #[arg(long)]
    pub addr: Option<String>,
    /// Registered workers.
    #[arg(long, default_value_t = 64)]
    pub workers: u64,
    /// Trace requests whose blocks warm the index before the load.
    #[arg(long, default_value_t = 4000)]
    pub warm: usize,
    /// Concurrent client tasks.
    #[arg(long, default_value_t = 64)]
    pub clients: usize,
    /// HTTP/2 connections the clients share.
    #[arg(long, default_value_t = 8)]
    pub connections: usize,
    /// Seconds of load per phase.
    #[arg(long, default_value_t = 5.0)]
    pub seconds: f64,
    /// Tokens per block of the registered workers.
    #[arg(long, default_value_t = 64)]
    pub block_size: u32,
    /// Send prompts as token ids (the server hashes them) instead of block hashes.
    #[arg(long)]
    pub send_tokens: bool,
    /// Serve and call over mTLS with an auth policy (certificates made for
    /// the run), to measure what TLS and authorization cost.
    #[arg(long, conflicts_with = "addr")]
    pub tls: bool,
}

/// One phase's figures.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PhaseReport {
    pub rpc: &'static str,
    pub calls: u64,
    pub errors: u64,
    pub calls_per_s: f64,
    #[serde(flatten)]
    pub latency: Latency,
}

/// Runs the benchmark and prints its JSON lines.
pub async fn run(args: &SelectBenchArgs) -> Result<(PhaseReport, PhaseReport), BenchError> {
    let trace = Trace::load(&args.trace)?;
    if trace.records.len() <= args.warm {
        return Err(BenchError::Setup(format!(
            "the trace has {} requests; --warm {} leaves none to send",
            trace.records.len(),
            args.warm
        )));
    }
    let mut config = ServeConfig {
        block_size: args.block_size,
        concurrency_limit: 1 << 20,
        ..ServeConfig::for_tests()
    };
    let tls = if args.tls {
        Some(super::tls::Fixture::make(&mut config)?)
    } else {
        None
    };
    let credentials = tls
        .as_ref()
        .map(|t| t.credentials().clone())
        .unwrap_or_default();
    let (addr, local) = match &tls {
        Some(_) => {
            let local = super::LocalServer::start_with_client(config, &credentials).await?;
            (local.addr.to_string(), Some(local))
        }
        None => target(args.addr.as_deref(), config).await?,
    };
    let mut channels = Vec::new();
    for _ in 0..args.connections.max(1) {
        channels.push(connect_as(&credentials, &addr).await?);
    }
    let options = HashOptions::default();
    let prompts: Vec<Vec<u32>> = trace.records.iter().map(|r| r.tokens()).collect();
    let hashes: Vec<Vec<u64>> = prompts
        .iter()
        .map(|t| compute_block_hashes(t, args.block_size, &options, None))
        .collect();
    warm(&channels[0], args, &hashes[..args.warm]).await?;
    eprintln!(
        "bench select: {} workers, index warmed with {} requests, {} clients on {} connections, {}s per phase",
        args.workers, args.warm, args.clients, args.connections, args.seconds
    );
    let load: Arc<Vec<bytes::Bytes>> = Arc::new(
        prompts[args.warm..]
            .iter()
            .zip(&hashes[args.warm..])
            .enumerate()
            .map(|(i, (tokens, hashes))| {
                let content = if args.send_tokens {
                    pb::prompt::Content::TokenIds(pb::TokenIds {
                        ids: tokens.clone(),
                    })
                } else {
                    pb::prompt::Content::BlockHashes(pb::BlockHashes {
                        hashes: hashes.clone(),
                    })
                };
                let request = pb::SelectWorkerRequest {
                    request_id: format!("bench-{i}"),
                    model: "bench".into(),
                    prompt: Some(pb::Prompt {
                        content: Some(content),
                    }),
                    mode: pb::SelectionMode::QueryOnly.into(),
                    ..Default::default()
                };
                bytes::Bytes::from(prost::Message::encode_to_vec(&request))
            })
            .collect(),
    );
    let health_request = bytes::Bytes::from(prost::Message::encode_to_vec(
        &tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        },
    ));
    let duration = Duration::from_secs_f64(args.seconds.max(0.1));
    let select = phase("SelectWorker", &channels, args.clients, duration, {
        let load = load.clone();
        move |channel: Channel, i: usize| {
            let request = load[i % load.len()].clone();
            raw_unary(channel, "/kvroute.v1.Router/SelectWorker", request)
        }
    })
    .await;
    let health = phase(
        "Health/Check",
        &channels,
        args.clients,
        duration,
        move |channel: Channel, _| {
            raw_unary(
                channel,
                "/grpc.health.v1.Health/Check",
                health_request.clone(),
            )
        },
    )
    .await;
    for report in [&select, &health] {
        println!("{}", serde_json::to_string(report).unwrap_or_default());
    }
    eprintln!(
        "SelectWorker / Health: throughput {:.2}x, p50 {:.2}x, p99 {:.2}x",
        select.calls_per_s / health.calls_per_s.max(1e-9),
        select.latency.p50_us / health.latency.p50_us.max(1e-9),
        select.latency.p99_us / health.latency.p99_us.max(1e-9),
    );
    if let Some(local) = local {
        local.stop().await;
    }
    Ok((select, health))
}

/// Registers the workers and stores each warm-up request's blocks on one of
/// them (chosen by the request's second block, so conversations stick).
async fn warm(
    channel: &Channel,
    args: &SelectBenchArgs,
    warm: &[Vec<u64>],
) -> Result<(), BenchError> {
    let mut workers = WorkersClient::new(channel.clone());
    for worker_id in 0..args.workers {
        workers
            .register_worker(pb::RegisterWorkerRequest {
                worker_id,
                model: "bench".into(),
                block_size: args.block_size,
                dp_size: 1,
                total_kv_blocks: 1 << 20,
                max_num_batched_tokens: 1 << 20,
                lease_ttl_secs: 3600,
                ..Default::default()
            })
            .await?;
    }
    let mut batches: Vec<Vec<pb::KvEvent>> = vec![Vec::new(); args.workers as usize];
    for hashes in warm {
        let Some(&key) = hashes.get(hashes.len().min(9) - 1) else {
            continue;
        };
        let worker = (crate::trace::mix(key, 7) % args.workers) as usize;
        let mut engine = 0u64;
        let blocks = hashes
            .iter()
            .map(|&local| {
                engine = crate::trace::mix(engine, local);
                pb::StoredBlock {
                    engine_hash: engine,
                    content: Some(pb::stored_block::Content::LocalHash(local)),
                    mm_info: None,
                }
            })
            .collect();
        let events = &mut batches[worker];
        events.push(pb::KvEvent {
            event_id: events.len() as u64,
            kind: Some(pb::kv_event::Kind::Stored(pb::BlocksStored {
                parent_engine_hash: None,
                blocks,
                lora_name: String::new(),
            })),
        });
    }
    for (worker_id, events) in batches.into_iter().enumerate() {
        for chunk in events.chunks(256) {
            let batch = pb::KvEventBatch {
                worker_id: worker_id as u64,
                dp_rank: 0,
                events: chunk.to_vec(),
            };
            let mut replies = workers
                .publish_events(tokio_stream::iter([batch]))
                .await?
                .into_inner();
            while replies.message().await?.is_some() {}
        }
    }
    Ok(())
}

/// One unary call with a request encoded in advance and the reply's bytes
/// dropped undecoded: the load generator shares the server's cores, so it
/// spends as little as it can, the same way for both phases.
async fn raw_unary(
    channel: Channel,
    path: &'static str,
    request: bytes::Bytes,
) -> Result<(), tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let path = http::uri::PathAndQuery::from_static(path);
    grpc.unary::<_, (), _>(tonic::Request::new(request), path, RawCodec)
        .await
        .map(|_| ())
}

/// A codec of already-encoded messages (requests) and ignored replies.
#[derive(Clone, Copy, Debug, Default)]
struct RawCodec;

impl tonic::codec::Codec for RawCodec {
    type Encode = bytes::Bytes;
    type Decode = ();
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }
    fn decoder(&mut self) -> Self::Decoder {
        RawCodec
    }
}

impl tonic::codec::Encoder for RawCodec {
    type Item = bytes::Bytes;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: bytes::Bytes,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        bytes::BufMut::put_slice(dst, &item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawCodec {
    type Item = ();
    type Error = tonic::Status;
    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<()>, tonic::Status> {
        let remaining = bytes::Buf::remaining(src);
        bytes::Buf::advance(src, remaining);
        Ok(Some(()))
    }
}

async fn phase<F, Fut>(
    rpc: &'static str,
    channels: &[Channel],
    clients: usize,
    duration: Duration,
    call: F,
) -> PhaseReport
where
    F: Fn(Channel, usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<(), tonic::Status>> + Send,
{
    let started = Instant::now();
    let deadline = started + duration;
    let mut tasks = Vec::new();
    for client in 0..clients.max(1) {
        let channel = channels[client % channels.len()].clone();
        let call = call.clone();
        tasks.push(tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut errors = 0u64;
            let mut i = client * 7919;
            while Instant::now() < deadline {
                let t = Instant::now();
                if call(channel.clone(), i).await.is_err() {
                    errors += 1;
                }
                samples.push(t.elapsed());
                i += 1;
            }
            (samples, errors)
        }));
    }
    let mut samples = Vec::new();
    let mut errors = 0;
    for task in tasks {
        if let Ok((s, e)) = task.await {
            samples.extend(s);
            errors += e;
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let calls = samples.len() as u64;
    PhaseReport {
        rpc,
        calls,
        errors,
        calls_per_s: calls as f64 / elapsed,
        latency: Latency::of(&mut samples),
    }
}
