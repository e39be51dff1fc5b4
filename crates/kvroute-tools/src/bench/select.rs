//! `kvroute bench select`: many concurrent gRPC clients calling SelectWorker
//! on loopback with prompts from a Mooncake trace, against 64 workers whose
//! index was warmed with the trace's earlier requests, in rounds alternating
//! with the same load of `grpc.health.v1.Health/Check` on the same server, so
//! the two can be compared as ratios on a noisy machine.
//!
//! Prompts go as block hashes (default), token ids as varints
//! (`--send-tokens`) or packed little-endian (`--packed-tokens`). QUERY_ONLY
//! by default; `--lifecycle` is a frontend's whole path: SelectWorker
//! RESERVE, MarkPrefillComplete, ReleaseRequest, each call timed apart.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use clap::Args;
use tonic::transport::Channel;

use super::{BenchError, Latency, connect_as, target};
use crate::trace::Trace;
use kvroute::{
    config::ServeConfig,
    pb::{self, workers_client::WorkersClient},
};
use kvroute_core::hashing::{HashOptions, compute_block_hashes};

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
    /// Send token ids as `packed_token_ids` (4 bytes each, little-endian)
    /// instead of varints; implies --send-tokens.
    #[arg(long)]
    pub packed_tokens: bool,
    /// Book and release as a frontend does: SelectWorker with RESERVE, then
    /// MarkPrefillComplete, then ReleaseRequest, each call timed apart.
    #[arg(long)]
    pub lifecycle: bool,
    /// Rounds of alternating phases (SelectWorker then Health/Check, then
    /// the other way round, ...), --seconds shared among them, so that both
    /// RPCs see the same background load.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Pads each Health/Check request's service name to this many bytes (the
    /// check then answers NOT_FOUND, counted as errors): what moving a
    /// prompt-sized message costs the transport alone, to set beside
    /// SelectWorker.
    #[arg(long, default_value_t = 0)]
    pub health_padding: usize,
    /// Serve and call over mTLS with an auth policy (certificates made for
    /// the run), to measure what TLS and authorization cost.
    #[arg(long, conflicts_with = "addr")]
    pub tls: bool,
}

/// One RPC's figures over every round.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PhaseReport {
    pub rpc: &'static str,
    /// How the prompt was sent: `block_hashes`, `token_ids` or
    /// `packed_token_ids` (empty for Health/Check).
    pub prompt: &'static str,
    /// `query_only` or `lifecycle`.
    pub mode: &'static str,
    pub calls: u64,
    pub errors: u64,
    pub calls_per_s: f64,
    #[serde(flatten)]
    pub latency: Latency,
}

/// Every report of one run: SelectWorker, then MarkPrefillComplete and
/// ReleaseRequest with `--lifecycle`, then Health/Check.
#[derive(Clone, Debug)]
pub struct SelectBenchReport {
    pub router: Vec<PhaseReport>,
    pub health: PhaseReport,
}

const SELECT: &str = "/kvroute.v1.Router/SelectWorker";
const MARK: &str = "/kvroute.v1.Router/MarkPrefillComplete";
const RELEASE: &str = "/kvroute.v1.Router/ReleaseRequest";
const HEALTH: &str = "/grpc.health.v1.Health/Check";

/// Runs the benchmark and prints its JSON lines.
pub async fn run(args: &SelectBenchArgs) -> Result<SelectBenchReport, BenchError> {
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
    let prompt_kind = if args.packed_tokens {
        "packed_token_ids"
    } else if args.send_tokens {
        "token_ids"
    } else {
        "block_hashes"
    };
    let mode = if args.lifecycle {
        "lifecycle"
    } else {
        "query_only"
    };
    let rounds = args.rounds.max(1);
    eprintln!(
        "bench select: {} workers, index warmed with {} requests, {} clients on {} connections, \
         prompts as {prompt_kind}, {mode}, {}s per phase in {rounds} rounds",
        args.workers, args.warm, args.clients, args.connections, args.seconds
    );
    // Each request's every field but its request_id, encoded once: a call
    // sends a fresh request_id field and then these bytes (fields may come
    // in any order), so bookings are distinct and the clients, which share
    // the server's cores, do no encoding of the prompt.
    let bodies: Arc<Vec<bytes::Bytes>> = Arc::new(
        prompts[args.warm..]
            .iter()
            .zip(&hashes[args.warm..])
            .map(|(tokens, hashes)| {
                let content = if args.packed_tokens {
                    pb::prompt::Content::PackedTokenIds(
                        tokens.iter().flat_map(|t| t.to_le_bytes()).collect(),
                    )
                } else if args.send_tokens {
                    pb::prompt::Content::TokenIds(pb::TokenIds {
                        ids: tokens.clone(),
                    })
                } else {
                    pb::prompt::Content::BlockHashes(pb::BlockHashes {
                        hashes: hashes.clone(),
                    })
                };
                let request = pb::SelectWorkerRequest {
                    model: "bench".into(),
                    prompt: Some(pb::Prompt {
                        content: Some(content),
                    }),
                    mode: if args.lifecycle {
                        pb::SelectionMode::Reserve
                    } else {
                        pb::SelectionMode::QueryOnly
                    }
                    .into(),
                    ..Default::default()
                };
                bytes::Bytes::from(prost::Message::encode_to_vec(&request))
            })
            .collect(),
    );
    let health_request = bytes::Bytes::from(prost::Message::encode_to_vec(
        &tonic_health::pb::HealthCheckRequest {
            service: "x".repeat(args.health_padding),
        },
    ));
    let lifecycle = args.lifecycle;
    let router_call = move |channel: Channel, client: usize, i: usize| {
        let body = bodies[i % bodies.len()].clone();
        async move {
            let id = request_id_field(client, i);
            let mut steps = Vec::with_capacity(3);
            steps.push(raw_unary(&channel, SELECT, id.clone(), body).await);
            if lifecycle {
                for path in [MARK, RELEASE] {
                    steps.push(raw_unary(&channel, path, id.clone(), bytes::Bytes::new()).await);
                }
            }
            steps
        }
    };
    let health_call = move |channel: Channel, _: usize, _: usize| {
        let request = health_request.clone();
        async move { vec![raw_unary(&channel, HEALTH, request, bytes::Bytes::new()).await] }
    };
    let per_round = Duration::from_secs_f64(args.seconds.max(0.1) / f64::from(rounds));
    let router_rpcs: &[&'static str] = if lifecycle {
        &["SelectWorker", "MarkPrefillComplete", "ReleaseRequest"]
    } else {
        &["SelectWorker"]
    };
    let mut router = Tally::new(router_rpcs.len());
    let mut health = Tally::new(1);
    for round in 0..rounds {
        // Alternate which goes first, so neither always follows the other.
        if round % 2 == 0 {
            router.add(phase(&channels, args.clients, per_round, router_call.clone()).await);
            health.add(phase(&channels, args.clients, per_round, health_call.clone()).await);
        } else {
            health.add(phase(&channels, args.clients, per_round, health_call.clone()).await);
            router.add(phase(&channels, args.clients, per_round, router_call.clone()).await);
        }
    }
    let router = router.reports(router_rpcs, prompt_kind, mode);
    let health = health
        .reports(&["Health/Check"], "", mode)
        .pop()
        .ok_or_else(|| BenchError::Setup("no Health/Check figures".into()))?;
    for report in router.iter().chain([&health]) {
        println!("{}", serde_json::to_string(report).unwrap_or_default());
    }
    for report in &router {
        eprintln!(
            "{} ({prompt_kind}, {mode}) / Health: throughput {:.2}x, p50 {:.2}x, p99 {:.2}x",
            report.rpc,
            report.calls_per_s / health.calls_per_s.max(1e-9),
            report.latency.p50_us / health.latency.p50_us.max(1e-9),
            report.latency.p99_us / health.latency.p99_us.max(1e-9),
        );
    }
    if let Some(local) = local {
        local.stop().await;
    }
    Ok(SelectBenchReport { router, health })
}

/// Field 1 (`request_id`, a string) of a router request, encoded: unique
/// per client and call.
fn request_id_field(client: usize, i: usize) -> bytes::Bytes {
    let id = format!("bench-{client}-{i}");
    let mut out = Vec::with_capacity(id.len() + 3);
    prost::encoding::string::encode(1, &id, &mut out);
    out.into()
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
                tier: 0,
                parent_engine_hash: None,
                blocks,
                lora_name: String::new(),
                cache_namespace: String::new(),
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

/// One unary call of a request encoded in advance as `head` then `body`,
/// with the reply's bytes dropped undecoded: the load generator shares the
/// server's cores, so it spends as little as it can, the same way for every
/// RPC. The call's time and whether it succeeded.
async fn raw_unary(
    channel: &Channel,
    path: &'static str,
    head: bytes::Bytes,
    body: bytes::Bytes,
) -> (Duration, bool) {
    let started = Instant::now();
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    let ok = match grpc.ready().await {
        Ok(()) => {
            let path = http::uri::PathAndQuery::from_static(path);
            grpc.unary::<_, (), _>(tonic::Request::new((head, body)), path, RawCodec)
                .await
                .is_ok()
        }
        Err(_) => false,
    };
    (started.elapsed(), ok)
}

/// A codec of already-encoded messages (requests, in two parts) and ignored
/// replies.
#[derive(Clone, Copy, Debug, Default)]
struct RawCodec;

impl tonic::codec::Codec for RawCodec {
    type Encode = (bytes::Bytes, bytes::Bytes);
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
    type Item = (bytes::Bytes, bytes::Bytes);
    type Error = tonic::Status;
    fn encode(
        &mut self,
        (head, body): (bytes::Bytes, bytes::Bytes),
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        // One allocation of the whole message, not doublings from 8 KiB.
        dst.reserve(head.len() + body.len());
        bytes::BufMut::put_slice(dst, &head);
        bytes::BufMut::put_slice(dst, &body);
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

/// One phase's samples: per RPC of a client's iteration, every call's time.
struct PhaseSamples {
    samples: Vec<Vec<Duration>>,
    errors: Vec<u64>,
    elapsed: Duration,
}

/// The samples of one kind of phase over every round.
struct Tally {
    samples: Vec<Vec<Duration>>,
    errors: Vec<u64>,
    elapsed: Duration,
}

impl Tally {
    fn new(rpcs: usize) -> Self {
        Self {
            samples: vec![Vec::new(); rpcs],
            errors: vec![0; rpcs],
            elapsed: Duration::ZERO,
        }
    }

    fn add(&mut self, phase: PhaseSamples) {
        for (all, s) in self.samples.iter_mut().zip(phase.samples) {
            all.extend(s);
        }
        for (all, e) in self.errors.iter_mut().zip(phase.errors) {
            *all += e;
        }
        self.elapsed += phase.elapsed;
    }

    fn reports(
        mut self,
        rpcs: &[&'static str],
        prompt: &'static str,
        mode: &'static str,
    ) -> Vec<PhaseReport> {
        let elapsed = self.elapsed.as_secs_f64().max(1e-9);
        rpcs.iter()
            .zip(self.samples.iter_mut().zip(&self.errors))
            .map(|(&rpc, (samples, &errors))| PhaseReport {
                rpc,
                prompt,
                mode,
                calls: samples.len() as u64,
                errors,
                calls_per_s: samples.len() as f64 / elapsed,
                latency: Latency::of(samples),
            })
            .collect()
    }
}

/// Runs `clients` tasks for `duration`, each calling `call` (which makes one
/// or more RPCs and times each) in a loop.
async fn phase<F, Fut>(
    channels: &[Channel],
    clients: usize,
    duration: Duration,
    call: F,
) -> PhaseSamples
where
    F: Fn(Channel, usize, usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Vec<(Duration, bool)>> + Send,
{
    let started = Instant::now();
    let deadline = started + duration;
    let mut tasks = Vec::new();
    for client in 0..clients.max(1) {
        let channel = channels[client % channels.len()].clone();
        let call = call.clone();
        tasks.push(tokio::spawn(async move {
            let mut samples: Vec<Vec<Duration>> = Vec::new();
            let mut errors: Vec<u64> = Vec::new();
            let mut i = client * 7919;
            while Instant::now() < deadline {
                let steps = call(channel.clone(), client, i).await;
                if samples.len() < steps.len() {
                    samples.resize(steps.len(), Vec::new());
                    errors.resize(steps.len(), 0);
                }
                for (k, (took, ok)) in steps.into_iter().enumerate() {
                    samples[k].push(took);
                    errors[k] += u64::from(!ok);
                }
                i += 1;
            }
            (samples, errors)
        }));
    }
    let mut all = PhaseSamples {
        samples: Vec::new(),
        errors: Vec::new(),
        elapsed: Duration::ZERO,
    };
    for task in tasks {
        if let Ok((samples, errors)) = task.await {
            if all.samples.len() < samples.len() {
                all.samples.resize(samples.len(), Vec::new());
                all.errors.resize(samples.len(), 0);
            }
            for (k, s) in samples.into_iter().enumerate() {
                all.samples[k].extend(s);
            }
            for (k, e) in errors.into_iter().enumerate() {
                all.errors[k] += e;
            }
        }
    }
    all.elapsed = started.elapsed();
    all
}
