//! `kvroute loadgen`: a trace replayed against real engines over HTTP.
//!
//! Why: every routing figure kvroute had came from its in-process
//! simulator. This sends the trace's requests, at the trace's arrival
//! times (scaled by `--speedup`), to OpenAI-compatible engines as streamed
//! completions, and times what a client sees: TTFT, the gaps between
//! tokens and the whole request, plus the prompt tokens the engine served
//! from its cache (`usage.prompt_tokens_details.cached_tokens`). It prints
//! the table `kvroute replay` prints, so the two compare line for line.
//!
//! Where requests go: `--url` sends each to one address (an Envoy with
//! kvroute as its endpoint picker, or a single engine); `--engines`
//! spreads them round robin, the baseline; `--kvroute` makes the load
//! generator a frontend itself (`frontend.rs`): SelectWorker, the engine
//! it names, MarkPrefillComplete at the first token and ReleaseRequest at
//! the end, with the token ids of the mock engine's word tokenization. Text is made per trace block
//! (`text.rs`), so shared blocks are shared text. Open loop: a request is
//! sent at its time whatever the others are doing, at most
//! `--max-in-flight` at once (later ones wait, and their TTFT counts it).

mod frontend;
pub mod http;
pub mod text;

use std::{
    net::{SocketAddr, ToSocketAddrs},
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use tokio::{sync::Semaphore, task::JoinSet};

use crate::{
    sim::{
        SimConfig,
        report::{EngineStats, Report, RequestOutcome},
    },
    trace::Trace,
};

/// `kvroute loadgen` arguments.
#[derive(Debug, clap::Args)]
pub struct LoadgenArgs {
    /// A Mooncake trace (JSONL with timestamp, input_length, output_length
    /// and hash_ids).
    #[arg(long)]
    pub trace: PathBuf,
    /// Send every request to this address (`http://host:port`): an Envoy
    /// routing through kvroute, or one engine.
    #[arg(
        long,
        required_unless_present_any = ["engines", "kvroute"],
        conflicts_with_all = ["engines", "kvroute"]
    )]
    pub url: Option<String>,
    /// Be the frontend: ask this kvroute (gRPC, `http://host:port`) where
    /// each request goes, among the workers of `--model` it knows, and
    /// drive its booking. Prompts are tokenized a word per token, as the
    /// mock engine does without a tokenizer.
    #[arg(long, conflicts_with = "engines")]
    pub kvroute: Option<String>,
    /// Spread requests round robin over these engines
    /// (`http://host:port,...`): the baseline.
    #[arg(long, value_delimiter = ',')]
    pub engines: Vec<String>,
    /// Arrival times are the trace's timestamps divided by this.
    #[arg(long, default_value_t = 1.0, value_parser = kvroute::config::parse_non_negative_f64)]
    pub speedup: f64,
    /// Send only the first N requests.
    #[arg(long)]
    pub limit: Option<usize>,
    /// The `model` of every request.
    #[arg(long, default_value = "mock")]
    pub model: String,
    /// A request not finished within this many seconds failed.
    #[arg(long, default_value_t = 600.0)]
    pub timeout_secs: f64,
    /// Most requests in flight at once.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub max_in_flight: u32,
    /// One JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Multiplies every time measured, and divides the speedup shown: the
    /// demo's engines run this many times faster than the engine model,
    /// and its figures are given in the model's time.
    #[arg(skip = 1.0)]
    pub time_scale: f64,
}

/// Runs the load and prints its report.
pub async fn run(args: &LoadgenArgs) -> anyhow::Result<Report> {
    if args.speedup <= 0.0 {
        bail!("--speedup must be above 0");
    }
    let mut trace = Trace::load(&args.trace)?;
    if let Some(limit) = args.limit {
        trace.records.truncate(limit);
    }
    if trace.records.is_empty() {
        bail!("the trace has no requests");
    }
    let report = measure(args, &trace).await?;
    if args.json {
        println!("{}", report.to_json());
    } else {
        print!("{}", Report::table(std::slice::from_ref(&report)));
    }
    Ok(report)
}

/// Sends `trace` where `args` say and reports what the client saw,
/// printing nothing ([`run`] prints it; the demo prints its own).
pub(crate) async fn measure(args: &LoadgenArgs, trace: &Trace) -> anyhow::Result<Report> {
    if let Some(kvroute) = &args.kvroute {
        let frontend = frontend::Frontend::connect(kvroute, &args.model).await?;
        let targets = frontend.engines();
        return Ok(replay(trace, &targets, "kvroute", args, Some(Arc::new(frontend))).await);
    }
    let (label, targets) = match &args.url {
        Some(url) => ("url", vec![address(url)?]),
        None => (
            "round-robin",
            args.engines
                .iter()
                .map(|e| address(e))
                .collect::<Result<Vec<_>, _>>()?,
        ),
    };
    if targets.is_empty() {
        bail!("no --url, --engines or --kvroute given");
    }
    Ok(replay(trace, &targets, label, args, None).await)
}

/// `http://host:port` (or `host:port`) as a socket address.
fn address(url: &str) -> anyhow::Result<SocketAddr> {
    let rest = url.strip_prefix("http://").unwrap_or(url);
    let host_port = rest.split('/').next().unwrap_or_default();
    if url.starts_with("https://") {
        bail!("{url}: only http:// is supported");
    }
    host_port
        .to_socket_addrs()
        .with_context(|| format!("{url}: not host:port"))?
        .next()
        .with_context(|| format!("{url}: no address"))
}

/// What one request came to, in ms from the start of the run.
struct Timed {
    index: usize,
    engine: usize,
    outcome: RequestOutcome,
    gaps_ms: Vec<f64>,
    /// Why it failed, if it did (a status, an error, a timeout).
    failure: Option<String>,
}

async fn replay(
    trace: &Trace,
    targets: &[SocketAddr],
    label: &str,
    args: &LoadgenArgs,
    frontend: Option<Arc<frontend::Frontend>>,
) -> Report {
    let first = trace.records.iter().map(|r| r.timestamp).min().unwrap_or(0);
    let slots = Arc::new(Semaphore::new(args.max_in_flight as usize));
    let timeout = Duration::from_secs_f64(args.timeout_secs);
    let mut tasks = JoinSet::new();
    #[allow(clippy::disallowed_methods)] // the load generator's own clock
    let start = Instant::now();
    let started = tokio::time::Instant::now();
    for (index, record) in trace.records.iter().enumerate() {
        let wall_arrival_ms = (record.timestamp - first) as f64 / args.speedup;
        tokio::time::sleep_until(started + Duration::from_secs_f64(wall_arrival_ms / 1000.0)).await;
        let scale = args.time_scale;
        let arrival_ms = wall_arrival_ms * scale;
        let prompt = text::prompt_text(record);
        let body = request_body(&prompt, record.output_length, &args.model);
        let (slots, input_length) = (slots.clone(), record.input_length);
        let (frontend, round_robin) = (frontend.clone(), index % targets.len());
        let addr = targets[round_robin];
        tasks.spawn(async move {
            let _slot = slots.acquire_owned().await;
            let (engine, answer) = match &frontend {
                None => {
                    let streamed = http::post_streaming(addr, "/v1/completions", &[], &body, None);
                    (round_robin, tokio::time::timeout(timeout, streamed).await)
                }
                Some(frontend) => {
                    let request_id = format!("loadgen-{index}");
                    frontend.serve(&request_id, &prompt, &body, timeout).await
                }
            };
            let ms = |t: Instant| t.duration_since(start).as_secs_f64() * 1e3 * scale;
            let mut outcome = RequestOutcome {
                arrival_ms,
                engine,
                prompt_tokens: input_length,
                rejected: true,
                ..RequestOutcome::default()
            };
            let mut gaps_ms = Vec::new();
            let mut failure = None;
            match answer {
                Ok(Ok(streamed)) if streamed.status == 200 => {
                    let usage = streamed.usage.unwrap_or_default();
                    outcome.rejected = false;
                    outcome.first_token_ms = streamed.token_events.first().map(|&t| ms(t));
                    outcome.finish_ms = Some(ms(streamed.finished));
                    outcome.output_tokens = if usage.completion_tokens > 0 {
                        usage.completion_tokens as usize
                    } else {
                        streamed.token_events.len()
                    };
                    if usage.prompt_tokens > 0 {
                        outcome.prompt_tokens = usage.prompt_tokens as usize;
                    }
                    outcome.reused_tokens = usage.cached_tokens as usize;
                    gaps_ms = streamed
                        .token_events
                        .windows(2)
                        .map(|w| w[1].duration_since(w[0]).as_secs_f64() * 1e3 * scale)
                        .collect();
                }
                Ok(Ok(streamed)) => failure = Some(format!("HTTP {}", streamed.status)),
                Ok(Err(error)) => failure = Some(format!("{error:#}")),
                Err(_) => failure = Some("timed out".to_owned()),
            }
            Timed {
                index,
                engine,
                outcome,
                gaps_ms,
                failure,
            }
        });
    }
    let mut outcomes = vec![RequestOutcome::default(); trace.records.len()];
    let mut itl_ms = Vec::new();
    let mut engines = vec![EngineStats::default(); targets.len()];
    let mut failures: std::collections::BTreeMap<String, usize> = Default::default();
    while let Some(done) = tasks.join_next().await {
        let Ok(timed) = done else { continue };
        if let Some(failure) = timed.failure {
            *failures.entry(failure).or_default() += 1;
        }
        let stats = &mut engines[timed.engine];
        stats.requests += 1;
        stats.prompt_tokens += timed.outcome.prompt_tokens as u64;
        if !timed.outcome.rejected {
            stats.completed += 1;
            stats.prefill_tokens += (timed.outcome.prompt_tokens
                - timed.outcome.reused_tokens.min(timed.outcome.prompt_tokens))
                as u64;
        }
        itl_ms.extend(timed.gaps_ms);
        outcomes[timed.index] = timed.outcome;
    }
    for (failure, count) in &failures {
        eprintln!("kvroute loadgen: {count} request(s) failed: {failure}");
    }
    let config = SimConfig {
        workers: targets.len(),
        speedup: args.speedup / args.time_scale,
        ..SimConfig::default()
    };
    Report::build(
        label,
        &config,
        trace,
        &outcomes,
        itl_ms,
        engines,
        start.elapsed().as_secs_f64(),
    )
}

/// A streamed completion of `prompt`, generating exactly `output_length`
/// tokens.
fn request_body(prompt: &str, output_length: usize, model: &str) -> Vec<u8> {
    serde_json::json!({
        "model": model,
        "prompt": prompt,
        "max_tokens": output_length.max(1),
        "min_tokens": output_length.max(1),
        "ignore_eos": true,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
    .to_string()
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use crate::trace::TraceRequest;
    use tokio::{
        io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
        net::TcpListener,
    };

    use super::*;

    /// An engine that answers every completion with `tokens` streamed
    /// events 5 ms apart (chunked), then usage naming `cached` cached
    /// tokens; it counts the requests it served.
    async fn engine(
        tokens: usize,
        cached: u64,
    ) -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let served = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = served.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let count = count.clone();
                tokio::spawn(async move {
                    let mut stream = BufReader::new(stream);
                    let mut length = 0;
                    loop {
                        let mut line = String::new();
                        stream.read_line(&mut line).await.expect("head");
                        if let Some(v) = line.strip_prefix("content-length: ") {
                            length = v.trim().parse().expect("length");
                        }
                        if line == "\r\n" {
                            break;
                        }
                    }
                    let mut body = vec![0; length];
                    stream.read_exact(&mut body).await.expect("body");
                    let request: serde_json::Value = serde_json::from_slice(&body).expect("json");
                    let words = request["prompt"]
                        .as_str()
                        .expect("prompt")
                        .split(' ')
                        .count()
                        - 1;
                    count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let out = stream.get_mut();
                    let chunk = |text: String| format!("{:x}\r\n{text}\r\n", text.len());
                    out.write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                        .await
                        .expect("head");
                    for _ in 0..tokens {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        let event = "data: {\"choices\":[{\"text\":\" x\"}]}\n\n".to_owned();
                        out.write_all(chunk(event).as_bytes()).await.expect("event");
                    }
                    let usage = format!(
                        "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":{words},\"completion_tokens\":{tokens},\"prompt_tokens_details\":{{\"cached_tokens\":{cached}}}}}}}\n\ndata: [DONE]\n\n"
                    );
                    out.write_all(chunk(usage).as_bytes()).await.expect("usage");
                    out.write_all(b"0\r\n\r\n").await.expect("end");
                });
            }
        });
        (addr, served)
    }

    fn args(trace: PathBuf) -> LoadgenArgs {
        LoadgenArgs {
            trace,
            url: None,
            kvroute: None,
            engines: Vec::new(),
            speedup: 10.0,
            limit: None,
            model: "mock".into(),
            timeout_secs: 10.0,
            max_in_flight: 64,
            json: false,
            time_scale: 1.0,
        }
    }

    #[tokio::test]
    async fn round_robin_load_is_timed_as_the_client_sees_it() {
        let trace = Trace {
            records: (0..6)
                .map(|i| TraceRequest {
                    timestamp: 100 * i,
                    input_length: 600,
                    output_length: 4,
                    hash_ids: vec![1, 10 + i],
                })
                .collect(),
        };
        let (a, served_a) = engine(4, 512).await;
        let (b, served_b) = engine(4, 512).await;
        let report = replay(&trace, &[a, b], "round-robin", &args(PathBuf::new()), None).await;
        assert_eq!(report.completed, 6);
        assert_eq!(served_a.load(std::sync::atomic::Ordering::SeqCst), 3);
        assert_eq!(served_b.load(std::sync::atomic::Ordering::SeqCst), 3);
        // The first token comes 5 ms after the request at the earliest,
        // the four 5 ms apart; 512 of 600 prompt tokens were cached.
        assert!(report.ttft_ms.p50 >= 5.0, "{:?}", report.ttft_ms);
        assert!(report.e2e_ms.p50 >= 20.0, "{:?}", report.e2e_ms);
        assert!(report.itl_ms.mean >= 4.0, "{:?}", report.itl_ms);
        assert!((report.reuse_ratio - 512.0 / 600.0).abs() < 1e-9);
    }

    #[tokio::test]
    async fn refused_and_unreachable_requests_count_as_not_completed() {
        let trace = Trace {
            records: vec![TraceRequest {
                timestamp: 0,
                input_length: 10,
                output_length: 2,
                hash_ids: vec![1],
            }],
        };
        let closed = {
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            listener.local_addr().expect("addr")
        };
        let report = replay(
            &trace,
            &[closed],
            "round-robin",
            &args(PathBuf::new()),
            None,
        )
        .await;
        assert_eq!(report.completed, 0);
        assert_eq!(report.rejected, 1);
    }

    #[test]
    fn addresses_are_http_host_and_port() {
        assert_eq!(
            address("http://127.0.0.1:8000").expect("plain"),
            "127.0.0.1:8000".parse().expect("addr")
        );
        assert_eq!(
            address("127.0.0.1:9/v1").expect("no scheme, a path"),
            "127.0.0.1:9".parse().expect("addr")
        );
        assert!(address("https://127.0.0.1:443").is_err());
        assert!(address("http://nowhere").is_err());
    }
}
