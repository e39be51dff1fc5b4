//! `kvroute mock-engine`: a GPU-free stand-in for a vLLM server.
//!
//! Why: no request had gone through kvroute over real sockets with real
//! streams, event delays and clocks, and a newcomer without GPUs had no
//! engine to point kvroute at. This serves what a router and its clients
//! see of vLLM:
//! * the OpenAI API (`/v1/completions`, `/v1/chat/completions`, streamed
//!   as server-sent events or not, `usage` with
//!   `prompt_tokens_details.cached_tokens`), `/v1/models`, `/health`;
//! * data-parallel ranks, picked by the `x-data-parallel-rank` header (or
//!   the least busy rank without it), each with its own engine and cache;
//! * the Prometheus series a vLLM server exposes for load (running and
//!   waiting requests, KV cache usage), on `/metrics`;
//! * KV events in vLLM's ZeroMQ format, live and on a replay socket
//!   (`events.rs`), so a router subscribes as to vLLM.
//!
//! Each rank's timing and cache are the replay simulator's engine model
//! (`rank.rs`), run in real time, scaled by `--speed`. Prompts are
//! tokenized as kvroute's front door does with `--tokenizer DIR`; without
//! one, each whitespace-separated word is one token (a hash of the word).
//! Bad requests are answered as vLLM answers them: a JSON error object
//! with its status.

pub mod digest;
pub mod events;
pub mod http;
pub mod rank;

use std::{net::SocketAddr, path::PathBuf, sync::Arc};

use anyhow::Context;
use kvroute_prompt::{Endpoint, ModelTokenizer, request};
use serde_json::{Value, json};
use tokio::{
    io::BufReader,
    net::{TcpListener, TcpStream},
    sync::{Semaphore, mpsc, oneshot},
};

use self::{
    http::{ReadError, Request, Streaming},
    rank::{Produced, RankHandle, Submitted},
};
use crate::sim::EngineConfig;

/// `kvroute mock-engine` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct MockEngineArgs {
    /// HTTP address to serve the OpenAI API on.
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub addr: SocketAddr,
    /// The model name it serves (requests for another get 404).
    #[arg(long, default_value = "mock")]
    pub model: String,
    /// Data-parallel ranks, each an engine of its own.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub dp_size: u32,
    /// KV events PUB endpoint of rank 0 (rank r binds the port plus r), as
    /// vLLM's `--kv-events-config` endpoint; none: no events.
    #[arg(long)]
    pub kv_events: Option<String>,
    /// The replay (ROUTER) endpoint of rank 0, offset likewise.
    #[arg(long, requires = "kv_events")]
    pub kv_replay: Option<String>,
    /// Tokenize as the model's tokenizer does (a directory with
    /// tokenizer.json and tokenizer_config.json); none: a word per token.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Real time runs this many times faster than the engine model's.
    #[arg(long, default_value_t = 1.0, value_parser = kvroute::config::parse_non_negative_f64)]
    pub speed: f64,
    /// KV cache blocks per rank.
    #[arg(long, default_value_t = 16_384)]
    pub num_blocks: usize,
    /// Tokens per KV block (as the engine's `--block-size`).
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Tokens per step (the chunked-prefill budget).
    #[arg(long, default_value_t = 8192)]
    pub max_num_batched_tokens: usize,
    /// Longest prompt plus output, in tokens.
    #[arg(long, default_value_t = 131_072)]
    pub max_model_len: usize,
    /// Largest request body, bytes.
    #[arg(long, default_value_t = 32 << 20)]
    pub max_body_bytes: usize,
    /// Most connections open at once; more are answered 503.
    #[arg(long, default_value_t = 8192)]
    pub max_connections: usize,
}

/// The server's shared state.
struct Engine {
    args: MockEngineArgs,
    tokenizer: Option<ModelTokenizer>,
    ranks: Vec<RankHandle>,
    counters: parking_lot::Mutex<std::collections::BTreeMap<&'static str, u64>>,
}

impl Engine {
    fn count(&self, outcome: &'static str) {
        *self.counters.lock().entry(outcome).or_default() += 1;
    }
}

/// Serves until Ctrl-C.
pub async fn run(args: &MockEngineArgs) -> anyhow::Result<()> {
    let listener = listen(args.addr).with_context(|| format!("binding {}", args.addr))?;
    start(args.clone(), listener).await?;
    eprintln!(
        "kvroute mock-engine serving {} on http://{} ({} rank(s){})",
        args.model,
        args.addr,
        args.dp_size,
        args.kv_events
            .as_deref()
            .map(|e| format!(", KV events on {e}"))
            .unwrap_or_default()
    );
    tokio::signal::ctrl_c().await?;
    Ok(())
}

/// Starts the ranks, publishers and HTTP server on `listener`; they run
/// on the current runtime until it stops.
pub async fn start(args: MockEngineArgs, listener: TcpListener) -> anyhow::Result<()> {
    if args.speed.is_nan() || args.speed <= 0.0 {
        anyhow::bail!("--speed must be above 0");
    }
    let tokenizer = match &args.tokenizer {
        Some(dir) => Some(
            ModelTokenizer::from_dir(dir)
                .with_context(|| format!("--tokenizer {}", dir.display()))?,
        ),
        None => None,
    };
    let config = EngineConfig {
        num_blocks: args.num_blocks,
        block_size: args.block_size.max(1),
        max_num_seqs: args.max_num_seqs.max(1),
        max_num_batched_tokens: args.max_num_batched_tokens.max(1),
        ..EngineConfig::default()
    };
    let mut ranks = Vec::new();
    for rank in 0..args.dp_size {
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        if let Some(endpoint) = &args.kv_events {
            let live = offset(endpoint, rank)?;
            let replay = match &args.kv_replay {
                Some(r) => offset(r, rank)?,
                None => "tcp://127.0.0.1:0".to_owned(),
            };
            let block_size = config.block_size;
            // Bound before the first request can produce an event.
            let (ready_tx, ready_rx) = oneshot::channel();
            tokio::spawn(async move {
                let result =
                    events::publish(live, replay, block_size, rank, events_rx, ready_tx).await;
                if let Err(error) = result {
                    eprintln!("kvroute mock-engine: rank {rank} events: {error:#}");
                }
            });
            ready_rx
                .await
                .context("the event publisher stopped")?
                .context("binding the KV event sockets")?;
        }
        ranks.push(rank::start(config.clone(), args.speed, 4096, events_tx));
    }
    let connections = Arc::new(Semaphore::new(args.max_connections.max(1)));
    let engine = Arc::new(Engine {
        args,
        tokenizer,
        ranks,
        counters: Default::default(),
    });
    tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            let Ok(permit) = connections.clone().try_acquire_owned() else {
                engine.count("refused_busy");
                tokio::spawn(http::refuse_busy(conn));
                continue;
            };
            let engine = engine.clone();
            tokio::spawn(async move {
                let _ = conn.set_nodelay(true);
                serve_connection(&engine, conn).await;
                drop(permit);
            });
        }
    });
    Ok(())
}

/// Most connections waiting to be accepted: a burst of clients connecting
/// at once is queued, not reset by the kernel (uvicorn, under vLLM, asks
/// for 2,048).
pub const LISTEN_BACKLOG: u32 = 4096;

/// A listener on `addr` with [`LISTEN_BACKLOG`].
pub fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// `tcp://host:port` with the port plus `rank`.
fn offset(endpoint: &str, rank: u32) -> anyhow::Result<String> {
    let (head, port) = endpoint
        .rsplit_once(':')
        .with_context(|| format!("{endpoint}: no port"))?;
    let port: u32 = port
        .parse()
        .with_context(|| format!("{endpoint}: bad port"))?;
    Ok(format!("{head}:{}", port + rank))
}

/// How long a kept-alive connection may wait for its next request
/// (uvicorn's default under vLLM), and how long a request may take to
/// arrive once it has begun: idle and slow clients give their slot back.
const KEEP_ALIVE: std::time::Duration = std::time::Duration::from_secs(5);
const REQUEST_READ: std::time::Duration = std::time::Duration::from_secs(60);

async fn serve_connection(engine: &Engine, conn: TcpStream) {
    use tokio::io::AsyncBufReadExt;
    let mut conn = BufReader::new(conn);
    loop {
        match tokio::time::timeout(KEEP_ALIVE, conn.fill_buf()).await {
            Ok(Ok(bytes)) if !bytes.is_empty() => {}
            _ => return,
        }
        let read = http::read_request(&mut conn, engine.args.max_body_bytes);
        let Ok(read) = tokio::time::timeout(REQUEST_READ, read).await else {
            engine.count("read_timeout");
            return;
        };
        let request = match read {
            Ok(request) => request,
            Err(ReadError::Closed) => return,
            Err(ReadError::TooLarge) => {
                engine.count("too_large");
                let _ = error(
                    conn.get_mut(),
                    413,
                    "BadRequestError",
                    "request body too large",
                    None,
                )
                .await;
                return;
            }
            Err(ReadError::Bad(why)) => {
                engine.count("malformed");
                let _ = error(conn.get_mut(), 400, "BadRequestError", &why, None).await;
                return;
            }
        };
        if handle(engine, conn.get_mut(), &request).await.is_err() {
            // The client is gone (or wrote garbage mid-stream).
            return;
        }
    }
}

/// A vLLM-style JSON error.
async fn error(
    conn: &mut TcpStream,
    status: u16,
    kind: &str,
    message: &str,
    param: Option<&str>,
) -> anyhow::Result<()> {
    let body = json!({"object": "error", "message": message, "type": kind, "param": param, "code": status});
    http::respond(
        conn,
        status,
        "application/json",
        body.to_string().as_bytes(),
    )
    .await
}

async fn handle(engine: &Engine, conn: &mut TcpStream, request: &Request) -> anyhow::Result<()> {
    let path = request.path.split('?').next().unwrap_or_default();
    match (request.method.as_str(), path) {
        ("GET", "/health") => http::respond(conn, 200, "text/plain", b"").await,
        ("GET", "/v1/models") => {
            let body = json!({"object": "list", "data": [{
                "id": engine.args.model, "object": "model", "owned_by": "kvroute-mock",
                "max_model_len": engine.args.max_model_len,
            }]});
            http::respond(conn, 200, "application/json", body.to_string().as_bytes()).await
        }
        ("GET", "/mock/digest") => {
            let worker_id = request
                .path
                .split_once('?')
                .and_then(|(_, query)| {
                    query
                        .split('&')
                        .find_map(|kv| kv.strip_prefix("worker_id="))
                })
                .and_then(|v| v.parse::<u64>().ok());
            let Some(worker_id) = worker_id else {
                return error(
                    conn,
                    400,
                    "BadRequestError",
                    "worker_id=N is required",
                    Some("worker_id"),
                )
                .await;
            };
            let mut total = kvroute_core::index::IndexDigest::default();
            let ranks: Vec<Value> = engine
                .ranks
                .iter()
                .enumerate()
                .map(|(rank, handle)| {
                    let target = kvroute_core::types::WorkerRank::new(worker_id, rank as u32);
                    let d = handle.ledger.lock().digest(target);
                    total.add(d);
                    json!({"dp_rank": rank, "entries": d.entries, "digest": d.digest})
                })
                .collect();
            let body = json!({"worker_id": worker_id, "entries": total.entries, "digest": total.digest, "ranks": ranks});
            http::respond(conn, 200, "application/json", body.to_string().as_bytes()).await
        }
        ("GET", "/metrics") => {
            let text = metrics(engine);
            http::respond(conn, 200, "text/plain; version=0.0.4", text.as_bytes()).await
        }
        ("POST", "/v1/completions") => complete(engine, conn, request, Endpoint::Completions).await,
        ("POST", "/v1/chat/completions") => {
            complete(engine, conn, request, Endpoint::ChatCompletions).await
        }
        (_, "/v1/completions" | "/v1/chat/completions" | "/v1/models" | "/health" | "/metrics") => {
            engine.count("bad_method");
            http::respond(
                conn,
                405,
                "application/json",
                br#"{"detail":"Method Not Allowed"}"#,
            )
            .await
        }
        _ => {
            engine.count("not_found");
            http::respond(conn, 404, "application/json", br#"{"detail":"Not Found"}"#).await
        }
    }
}

/// The prompt's token ids: the model's tokenizer, or a word per token.
fn prompt_ids(engine: &Engine, endpoint: Endpoint, body: &[u8]) -> Result<Vec<u32>, String> {
    let parsed = request::parse(Some(endpoint), body).map_err(|e| e.to_string())?;
    if let Some(tokenizer) = &engine.tokenizer {
        return tokenizer.prompt_ids(&parsed).map_err(|e| e.to_string());
    }
    let text = match parsed.prompt {
        kvroute_prompt::Prompt::TokenIds(ids) => return Ok(ids),
        kvroute_prompt::Prompt::Text { text, .. } => text,
        kvroute_prompt::Prompt::Chat(chat) => chat
            .messages
            .as_array()
            .into_iter()
            .flatten()
            .map(|m| {
                let content = match &m["content"] {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                format!("{}: {content}\n", m["role"].as_str().unwrap_or("user"))
            })
            .collect(),
        _ => return Err("this prompt cannot be tokenized by the mock engine".into()),
    };
    Ok(crate::loadgen::text::word_ids(&text))
}

async fn complete(
    engine: &Engine,
    conn: &mut TcpStream,
    request: &Request,
    endpoint: Endpoint,
) -> anyhow::Result<()> {
    let chat = endpoint == Endpoint::ChatCompletions;
    let Ok(body) = serde_json::from_slice::<Value>(&request.body) else {
        engine.count("bad_json");
        return error(
            conn,
            400,
            "BadRequestError",
            "the request body is not valid JSON",
            None,
        )
        .await;
    };
    let model = body["model"].as_str().unwrap_or_default();
    if model != engine.args.model {
        engine.count("unknown_model");
        let message = format!("The model `{model}` does not exist.");
        return error(conn, 404, "NotFoundError", &message, Some("model")).await;
    }
    let ids = match prompt_ids(engine, endpoint, &request.body) {
        Ok(ids) if !ids.is_empty() => ids,
        Ok(_) => {
            engine.count("empty_prompt");
            return error(conn, 400, "BadRequestError", "the prompt is empty", None).await;
        }
        Err(why) => {
            engine.count("bad_request");
            return error(conn, 400, "BadRequestError", &why, None).await;
        }
    };
    let max_tokens = match body
        .get(if chat {
            "max_completion_tokens"
        } else {
            "max_tokens"
        })
        .filter(|v| !v.is_null())
        .or_else(|| body.get("max_tokens").filter(|v| !v.is_null()))
    {
        None => 16,
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => n as usize,
            _ => {
                engine.count("bad_request");
                return error(
                    conn,
                    400,
                    "BadRequestError",
                    "max_tokens must be at least 1",
                    Some("max_tokens"),
                )
                .await;
            }
        },
    };
    if ids.len().saturating_add(max_tokens) > engine.args.max_model_len {
        engine.count("too_long");
        let message = format!(
            "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the messages, {max_tokens} in the completion). Please reduce the length of the messages or completion.",
            engine.args.max_model_len,
            ids.len() + max_tokens,
            ids.len()
        );
        return error(conn, 400, "BadRequestError", &message, None).await;
    }
    let rank = match request.header("x-data-parallel-rank") {
        Some(v) => match v.parse::<usize>() {
            Ok(r) if r < engine.ranks.len() => r,
            _ => {
                engine.count("bad_rank");
                let message = format!("data parallel rank {v} is not in 0..{}", engine.ranks.len());
                return error(conn, 400, "BadRequestError", &message, None).await;
            }
        },
        None => least_busy(&engine.ranks),
    };
    let (stream_tx, mut produced) = mpsc::unbounded_channel();
    let (id_tx, id_rx) = oneshot::channel();
    let prompt_tokens = ids.len();
    let submitted = Submitted {
        tokens: ids,
        output_length: max_tokens,
        stream: stream_tx,
        id: id_tx,
    };
    let handle = &engine.ranks[rank];
    let accepted = match handle.submit.send(submitted).await {
        Ok(()) => id_rx.await.ok(),
        Err(_) => None,
    };
    let Some(request_id) = accepted else {
        return error(
            conn,
            503,
            "ServiceUnavailableError",
            "the engine stopped",
            None,
        )
        .await;
    };
    // Whatever ends this answer early (the client gone mid-stream), the
    // request leaves the engine; after a normal end it is gone already.
    let _abort_on_drop = AbortOnDrop {
        abort: handle.abort.clone(),
        id: request_id,
    };
    let stream = body["stream"].as_bool().unwrap_or(false);
    let include_usage = body["stream_options"]["include_usage"]
        .as_bool()
        .unwrap_or(false);
    #[allow(clippy::disallowed_methods)] // the response's `created`, as vLLM's
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let id = format!(
        "{}-mock-{created}-{prompt_tokens}",
        if chat { "chatcmpl" } else { "cmpl" }
    );
    let model = engine.args.model.clone();
    let (mut cached, mut generated) = (0usize, 0usize);
    let usage = |cached: usize, generated: usize| {
        json!({"prompt_tokens": prompt_tokens, "completion_tokens": generated,
               "total_tokens": prompt_tokens + generated,
               "prompt_tokens_details": {"cached_tokens": cached}})
    };
    if !stream {
        let mut text = String::new();
        while let Some(p) = produced.recv().await {
            match p {
                Produced::Admitted { cached_tokens } => cached = cached_tokens,
                Produced::Token { done } => {
                    generated += 1;
                    text.push_str(" tok");
                    if done {
                        break;
                    }
                }
                Produced::Rejected => {
                    engine.count("rejected");
                    return error(
                        conn,
                        400,
                        "BadRequestError",
                        "the prompt does not fit the KV cache",
                        None,
                    )
                    .await;
                }
            }
        }
        engine.count("completed");
        let choice = if chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"})
        } else {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": "length"})
        };
        let body = json!({"id": id, "object": if chat { "chat.completion" } else { "text_completion" },
                          "created": created, "model": model, "choices": [choice],
                          "usage": usage(cached, generated)});
        return http::respond(conn, 200, "application/json", body.to_string().as_bytes()).await;
    }
    let mut out = Streaming::start(conn).await?;
    let object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    while let Some(p) = produced.recv().await {
        match p {
            Produced::Admitted { cached_tokens } => cached = cached_tokens,
            Produced::Token { done } => {
                generated += 1;
                let finish = if done { json!("length") } else { Value::Null };
                let choice = if chat {
                    let mut delta = json!({"content": " tok"});
                    if generated == 1 {
                        delta["role"] = json!("assistant");
                    }
                    json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
                } else {
                    json!({"index": 0, "text": " tok", "logprobs": null, "finish_reason": finish})
                };
                let chunk = json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]});
                out.event(&chunk.to_string()).await?;
                if done {
                    break;
                }
            }
            Produced::Rejected => {
                let chunk = json!({"object": "error", "message": "the prompt does not fit the KV cache", "type": "BadRequestError", "param": null, "code": 400});
                out.event(&chunk.to_string()).await?;
                break;
            }
        }
    }
    if include_usage {
        let chunk = json!({"id": id, "object": object, "created": created, "model": model,
                           "choices": [], "usage": usage(cached, generated)});
        out.event(&chunk.to_string()).await?;
    }
    out.event("[DONE]").await?;
    out.finish().await?;
    engine.count("completed");
    Ok(())
}

/// Drops its request from the engine when dropped (a no-op for a request
/// that finished).
struct AbortOnDrop {
    abort: mpsc::UnboundedSender<u64>,
    id: u64,
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        let _ = self.abort.send(self.id);
    }
}

/// The rank with the fewest requests (vLLM's own balancing, roughly).
fn least_busy(ranks: &[RankHandle]) -> usize {
    ranks
        .iter()
        .enumerate()
        .min_by_key(|(_, r)| {
            let load = *r.load.borrow();
            load.running + load.waiting
        })
        .map_or(0, |(i, _)| i)
}

/// The vLLM load series, per rank (`engine` label, as vLLM labels its
/// engine cores), and the mock's own counters.
fn metrics(engine: &Engine) -> String {
    let model = &engine.args.model;
    let mut out = String::new();
    let series = [
        (
            "vllm:num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
        ),
        (
            "vllm:num_requests_waiting",
            "gauge",
            "Number of requests waiting to be processed.",
        ),
        (
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
        ),
    ];
    for (name, kind, help) in series {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
        for (rank, handle) in engine.ranks.iter().enumerate() {
            let load = *handle.load.borrow();
            let value = match name {
                "vllm:num_requests_running" => load.running as f64,
                "vllm:num_requests_waiting" => load.waiting as f64,
                _ => load.active_blocks as f64 / load.total_blocks.max(1) as f64,
            };
            out.push_str(&format!(
                "{name}{{engine=\"{rank}\",model_name=\"{model}\"}} {value}\n"
            ));
        }
    }
    out.push_str("# HELP kvroute_mock_cached_blocks Blocks in the rank's prefix cache.\n# TYPE kvroute_mock_cached_blocks gauge\n");
    for (rank, handle) in engine.ranks.iter().enumerate() {
        let cached = handle.load.borrow().cached_blocks;
        out.push_str(&format!(
            "kvroute_mock_cached_blocks{{engine=\"{rank}\"}} {cached}\n"
        ));
    }
    out.push_str("# HELP kvroute_mock_requests_total Requests by outcome.\n# TYPE kvroute_mock_requests_total counter\n");
    for (outcome, count) in engine.counters.lock().iter() {
        out.push_str(&format!(
            "kvroute_mock_requests_total{{outcome=\"{outcome}\"}} {count}\n"
        ));
    }
    out
}
