//! `kvroute mock-engine` as kvroute sees it: the OpenAI API over a real
//! socket, and KV events that kvroute's vLLM subscriber applies so that
//! its index holds exactly the mock engine's cache, evictions included,
//! and a prompt's cached prefix is found where the engine has it.

use std::time::{Duration, Instant};

use kvroute::pb;
use kvroute_tools::loadgen::text::word_ids;
use kvroute_tools::mock_engine::{self, MockEngineArgs};
use serde_json::{Value, json};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};

use crate::common::{TestServer, cluster::free_addr, registration};

const WORKER: u64 = 41;

fn free_port() -> u16 {
    free_addr().port()
}

/// A small one-rank engine at `addr` publishing on `events` and `replay`.
fn engine_args(addr: std::net::SocketAddr, events: u16, replay: u16) -> MockEngineArgs {
    MockEngineArgs {
        addr,
        model: "mock".into(),
        dp_size: 1,
        kv_events: Some(format!("tcp://127.0.0.1:{events}")),
        kv_replay: Some(format!("tcp://127.0.0.1:{replay}")),
        tokenizer: None,
        speed: 50.0,
        num_blocks: 256,
        block_size: 16,
        max_num_seqs: 8,
        max_num_batched_tokens: 2048,
        max_model_len: 4096,
        max_body_bytes: 1 << 20,
        max_connections: 64,
    }
}

/// Worker 41: the engine at `endpoint`, its events on `events` and
/// `replay`, as vLLM's.
fn engine_registration(endpoint: &str, events: u16, replay: u16) -> pb::RegisterWorkerRequest {
    pb::RegisterWorkerRequest {
        endpoint: endpoint.to_owned(),
        events_endpoint: format!("tcp://127.0.0.1:{events}"),
        events_dialect: "vllm".into(),
        replay_endpoint: format!("tcp://127.0.0.1:{replay}"),
        lease_ttl_secs: 600,
        ..registration(WORKER, "mock")
    }
}

/// Waits (10 s at most) for `server` to be connected to worker 41's events.
async fn wait_subscribed(server: &TestServer, which: &str) {
    let t0 = Instant::now();
    while !server
        .worker_info(WORKER)
        .await
        .subscription
        .contains(" connected,")
    {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{which} never connected"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One HTTP/1.1 exchange on a fresh connection: (status, body).
async fn http(addr: std::net::SocketAddr, method: &str, path: &str, body: &Value) -> (u16, String) {
    let body = body.to_string();
    let mut conn = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nhost: mock\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(body.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    // The mock engine keeps connections alive: read the sized answer.
    let mut buf = [0u8; 65536];
    loop {
        let n = conn.read(&mut buf).await.unwrap();
        raw.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&raw).into_owned();
        if let Some((head, rest)) = text.split_once("\r\n\r\n") {
            let length = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length: "))
                .map(|v| v.trim().parse::<usize>().unwrap());
            let status = head.split(' ').nth(1).unwrap().parse().unwrap();
            match length {
                Some(length) if rest.len() >= length => return (status, rest[..length].to_owned()),
                None if rest.ends_with("0\r\n\r\n") => return (status, rest.to_owned()),
                _ => {}
            }
        }
        assert!(
            n > 0,
            "connection closed early: {:?}",
            String::from_utf8_lossy(&raw)
        );
    }
}

fn prompt(conversation: usize, words: usize) -> String {
    (0..words)
        .map(|i| format!("c{conversation}w{i} "))
        .collect()
}

async fn cached_blocks(server: &TestServer) -> u64 {
    server
        .worker_info(WORKER)
        .await
        .ranks
        .iter()
        .map(|r| r.cached_blocks)
        .sum()
}

/// (entries, digest) kvroute's index has for model `mock`.
async fn index_digest(server: &TestServer) -> (u64, u64) {
    let stats = server
        .admin()
        .get_index_stats(pb::GetIndexStatsRequest {
            model: Some("mock".into()),
        })
        .await
        .unwrap()
        .into_inner();
    (stats.entries, stats.digest)
}

/// (entries, digest) an exact index must have for the engine at `addr`
/// as worker 41.
async fn engine_digest(addr: std::net::SocketAddr) -> (u64, u64) {
    let (status, body) = http(
        addr,
        "GET",
        &format!("/mock/digest?worker_id={WORKER}"),
        &Value::Null,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    (
        v["entries"].as_u64().unwrap(),
        v["digest"].as_u64().unwrap(),
    )
}

fn metric(body: &str, series: &str) -> u64 {
    body.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvroute_indexes_exactly_what_the_mock_engine_caches() {
    let (events, replay) = (free_port(), free_port());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let args = MockEngineArgs {
        // 48 blocks of 16: the prompts below overflow it, so blocks are
        // evicted and kvroute must see the removals.
        num_blocks: 48,
        ..engine_args(addr, events, replay)
    };
    mock_engine::start(args, listener).await.unwrap();

    let server = TestServer::start().await;
    server
        .register(pb::RegisterWorkerRequest {
            total_kv_blocks: 48,
            ..engine_registration(&addr.to_string(), events, replay)
        })
        .await;
    wait_subscribed(&server, "kvroute").await;

    // Six conversations of 160 words (10 blocks each): 60 blocks into 48.
    for c in 0..6 {
        let (status, body) = http(
            addr,
            "POST",
            "/v1/completions",
            &json!({"model": "mock", "prompt": prompt(c, 160), "max_tokens": 3}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        let answer: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(answer["usage"]["prompt_tokens"], 160);
        assert_eq!(answer["usage"]["completion_tokens"], 3);
    }
    // The same first conversation again: the engine reports what it held.
    let (_, body) = http(
        addr,
        "POST",
        "/v1/completions",
        &json!({"model": "mock", "prompt": prompt(5, 160), "max_tokens": 1}),
    )
    .await;
    let again: Value = serde_json::from_str(&body).unwrap();
    let engine_cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        engine_cached > 0,
        "the last conversation is still cached: {again}"
    );

    // kvroute's index holds what the engine holds, block for block.
    let (_, metrics) = http(addr, "GET", "/metrics", &Value::Null).await;
    let engine_blocks = metric(&metrics, "kvroute_mock_cached_blocks{engine=\"0\"}");
    assert!(engine_blocks > 0 && engine_blocks <= 48, "{metrics}");
    let t0 = Instant::now();
    while cached_blocks(&server).await != engine_blocks {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "kvroute holds {} blocks, the engine {engine_blocks}",
            cached_blocks(&server).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Entry for entry: the index's digest is the engine's cache's.
    assert_eq!(index_digest(&server).await, engine_digest(addr).await);
    // ... and finds the cached prefix where the engine found it.
    let selected = server
        .router()
        .select_worker(pb::SelectWorkerRequest {
            request_id: "again".into(),
            model: "mock".into(),
            prompt: Some(pb::Prompt {
                content: Some(pb::prompt::Content::TokenIds(pb::TokenIds {
                    ids: word_ids(&prompt(5, 160)),
                })),
            }),
            mode: pb::SelectionMode::QueryOnly.into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    // All 10 blocks are cached; the engine, as vLLM, computes a prompt's
    // last token anyway, so it reported the 9 blocks before it.
    assert_eq!(selected.overlap_blocks, 10, "{selected:?}");
    assert_eq!(engine_cached, 16 * ((160 - 1) / 16));
    // `kvroute serve --engine` subscribes as RegisterWorker does: a second
    // kvroute configured so replays the engine's history and agrees.
    let mut config = kvroute::config::ServeConfig::default();
    config.engine = vec![
        kvroute::config::parse_engine_spec(&format!(
            "{WORKER}:mock:16:0:1:vllm:tcp://127.0.0.1:{events}:tcp://127.0.0.1:{replay}"
        ))
        .unwrap(),
    ];
    let configured = TestServer::start_with(config).await;
    let t0 = Instant::now();
    loop {
        if index_digest(&configured).await == engine_digest(addr).await {
            break;
        }
        // A live batch shows the subscriber where the engine is.
        if t0.elapsed() > Duration::from_millis(500) {
            let _ = http(
                addr,
                "POST",
                "/v1/completions",
                &json!({"model": "mock", "prompt": prompt(5, 160), "max_tokens": 1}),
            )
            .await;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "serve --engine never agreed with the engine"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The vLLM load series are there.
    for series in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    ] {
        assert!(
            metrics.contains(&format!("{series}{{engine=\"0\",model_name=\"mock\"}}")),
            "{metrics}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_vllms_errors_and_the_engine_goes_on() {
    let listener = mock_engine::listen("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = listener.local_addr().unwrap();
    let args = MockEngineArgs {
        dp_size: 2,
        kv_events: None,
        kv_replay: None,
        speed: 100.0,
        max_model_len: 512,
        max_body_bytes: 4096,
        max_connections: 1200,
        ..engine_args(addr, 0, 0)
    };
    mock_engine::start(args, listener).await.unwrap();
    let error_of = |body: &str| -> Value { serde_json::from_str(body).unwrap() };

    let (status, body) = http(
        addr,
        "POST",
        "/v1/completions",
        &json!({"model": "other", "prompt": "hi"}),
    )
    .await;
    assert_eq!(status, 404);
    assert_eq!(error_of(&body)["type"], "NotFoundError");
    let (status, body) = http(
        addr,
        "POST",
        "/v1/completions",
        &json!({"model": "mock", "prompt": 7}),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(error_of(&body)["object"], "error");
    let (status, body) = http(
        addr,
        "POST",
        "/v1/completions",
        &json!({"model": "mock", "prompt": "a ".repeat(600)}),
    )
    .await;
    assert_eq!(status, 400);
    assert!(
        error_of(&body)["message"]
            .as_str()
            .unwrap()
            .contains("maximum context length"),
        "{body}"
    );
    let (status, _) = http(
        addr,
        "POST",
        "/v1/completions",
        &json!({"model": "mock", "prompt": "x".repeat(5000)}),
    )
    .await;
    assert_eq!(status, 413);
    let (status, _) = http(addr, "POST", "/v1/nothing", &json!({})).await;
    assert_eq!(status, 404);
    // Malformed JSON, then a client that sends half a request and goes.
    let mut conn = TcpStream::connect(addr).await.unwrap();
    conn.write_all(b"POST /v1/completions HTTP/1.1\r\ncontent-length: 5\r\n\r\n{oops")
        .await
        .unwrap();
    let mut answer = vec![0u8; 1024];
    let n = conn.read(&mut answer).await.unwrap();
    assert!(String::from_utf8_lossy(&answer[..n]).starts_with("HTTP/1.1 400"));
    // A connection that never sends a request is closed after 5 s idle.
    let mut idle = TcpStream::connect(addr).await.unwrap();
    let idle_read = tokio::spawn(async move {
        let mut byte = [0u8; 1];
        tokio::time::timeout(Duration::from_secs(8), idle.read(&mut byte)).await
    });
    // A header line that never ends is cut at 64 KiB, not held.
    let mut endless = TcpStream::connect(addr).await.unwrap();
    endless
        .write_all(b"POST /v1/completions HTTP/1.1\r\nx-long: ")
        .await
        .unwrap();
    endless.write_all(&vec![b'a'; 70 << 10]).await.unwrap();
    let n = endless.read(&mut answer).await.unwrap();
    assert!(String::from_utf8_lossy(&answer[..n]).starts_with("HTTP/1.1 400"));
    let mut half = TcpStream::connect(addr).await.unwrap();
    half.write_all(b"POST /v1/completions HTTP/1.1\r\ncontent-length: 100\r\n\r\n{\"mo")
        .await
        .unwrap();
    drop(half);
    // A rank out of range is refused; both ranks serve.
    let mut conn = TcpStream::connect(addr).await.unwrap();
    let body = json!({"model": "mock", "prompt": "hello there", "max_tokens": 2}).to_string();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nx-data-parallel-rank: 2\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(body.as_bytes()).await.unwrap();
    let n = conn.read(&mut answer).await.unwrap();
    assert!(String::from_utf8_lossy(&answer[..n]).starts_with("HTTP/1.1 400"));
    // Still serving, streamed, with usage.
    let (status, body) = http(
        addr,
        "POST",
        "/v1/chat/completions",
        &json!({"model": "mock", "messages": [{"role": "user", "content": "hello there"}],
                "max_tokens": 3, "stream": true, "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(body.matches("\"content\":\" tok\"").count(), 3, "{body}");
    assert!(
        body.contains("\"completion_tokens\":3") && body.contains("data: [DONE]"),
        "{body}"
    );
    let (status, models) = http(addr, "GET", "/v1/models", &Value::Null).await;
    assert_eq!(status, 200);
    assert_eq!(error_of(&models)["data"][0]["id"], "mock");

    // Clients that vanish mid-stream leave nothing running.
    for _ in 0..20 {
        let mut conn = TcpStream::connect(addr).await.unwrap();
        let body = json!({"model": "mock", "prompt": "a long answer please", "max_tokens": 400, "stream": true}).to_string();
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        conn.write_all(head.as_bytes()).await.unwrap();
        conn.write_all(body.as_bytes()).await.unwrap();
        let n = conn.read(&mut answer).await.unwrap();
        assert!(String::from_utf8_lossy(&answer[..n]).starts_with("HTTP/1.1 200"));
        drop(conn);
    }
    let running = || async {
        let (_, metrics) = http(addr, "GET", "/metrics", &Value::Null).await;
        metrics
            .lines()
            .filter(|l| {
                l.starts_with("vllm:num_requests_running")
                    || l.starts_with("vllm:num_requests_waiting")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    let t0 = Instant::now();
    while running().await > 0.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "abandoned streams still run"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        matches!(idle_read.await.unwrap(), Ok(Ok(0))),
        "an idle connection is closed by the engine"
    );
    // A thousand streams at once all finish.
    let streams: Vec<_> = (0..1000)
        .map(|i| {
            let body = json!({"model": "mock", "prompt": format!("stream {i} of many"), "max_tokens": 4, "stream": true});
            tokio::spawn(async move { http(addr, "POST", "/v1/completions", &body).await })
        })
        .collect();
    for stream in streams {
        let (status, body) = stream.await.unwrap();
        assert_eq!(status, 200);
        assert_eq!(body.matches("\"text\":\" tok\"").count(), 4, "{body}");
    }
}

/// A `kvroute-tools mock-engine` process on fixed ports.
struct EngineProcess {
    child: std::process::Child,
    http: std::net::SocketAddr,
}

impl EngineProcess {
    async fn start(http: u16, events: u16, replay: u16) -> Self {
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute-tools"))
            .args(["mock-engine", "--addr", &format!("127.0.0.1:{http}")])
            .args(["--kv-events", &format!("tcp://127.0.0.1:{events}")])
            .args(["--kv-replay", &format!("tcp://127.0.0.1:{replay}")])
            .args(["--num-blocks", "48", "--block-size", "16", "--speed", "50"])
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let http = format!("127.0.0.1:{http}").parse().unwrap();
        let t0 = Instant::now();
        while TcpStream::connect(http).await.is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the mock engine did not start"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Self { child, http }
    }

    async fn cached_blocks(&self) -> u64 {
        let (_, metrics) = http(self.http, "GET", "/metrics", &Value::Null).await;
        metric(&metrics, "kvroute_mock_cached_blocks{engine=\"0\"}")
    }
}

impl Drop for EngineProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn complete(engine: &EngineProcess, conversation: usize) {
    let (status, body) = http(
        engine.http,
        "POST",
        "/v1/completions",
        &json!({"model": "mock", "prompt": prompt(conversation, 160), "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
}

/// Waits until `server` indexes exactly what `engine` caches as worker
/// 41 (block counts and digests equal); the count.
async fn agree(server: &TestServer, engine: &EngineProcess, what: &str) -> u64 {
    let t0 = Instant::now();
    loop {
        let want = engine.cached_blocks().await;
        let got = cached_blocks(server).await;
        if got == want && index_digest(server).await == engine_digest(engine.http).await {
            return want;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{what}: kvroute holds {got} blocks, the engine {want} (digests {:?} and {:?})",
            index_digest(server).await,
            engine_digest(engine.http).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_index_follows_an_engine_killed_and_restarted_and_a_new_kvroute_replays() {
    let (port, events, replay) = (free_port(), free_port(), free_port());
    let registration = pb::RegisterWorkerRequest {
        total_kv_blocks: 48,
        ..engine_registration(&format!("127.0.0.1:{port}"), events, replay)
    };
    let server = TestServer::start().await;
    let mut engine = EngineProcess::start(port, events, replay).await;
    server.register(registration.clone()).await;
    wait_subscribed(&server, "kvroute").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    for c in 0..4 {
        complete(&engine, c).await;
    }
    let before = agree(&server, &engine, "before the kill").await;
    assert!(before >= 40, "four 10-block prompts cached: {before}");

    // kill -9 and a new engine on the same ports: its cache starts empty,
    // its events number from 0 again, and kvroute drops the old blocks.
    drop(engine);
    engine = EngineProcess::start(port, events, replay).await;
    tokio::time::sleep(Duration::from_millis(500)).await; // kvroute reconnects
    complete(&engine, 10).await;
    complete(&engine, 11).await;
    let after = agree(&server, &engine, "after the restart").await;
    assert_eq!(after, 20, "only the new engine's two prompts");

    // A kvroute that starts now sees the engine's numbering mid-way: it
    // asks the replay socket for everything before, and agrees.
    let fresh = TestServer::start().await;
    fresh.register(registration).await;
    wait_subscribed(&fresh, "the new kvroute").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    complete(&engine, 12).await;
    let replayed = agree(&fresh, &engine, "the new kvroute").await;
    assert_eq!(replayed, 30);
    let (_, metrics) = fresh.http_get("/metrics").await;
    let replays: u64 = metrics
        .lines()
        .filter(|l| l.starts_with("kvroute_engine_event_replayed_batches_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum();
    assert!(
        replays > 0,
        "the new kvroute's index came through the replay socket"
    );
}

/// A word-level tokenizer directory: `w0` ... `w63` are ids 10 ... 73.
fn word_level_tokenizer(dir: &std::path::Path) {
    let vocab: serde_json::Map<String, Value> = (0..64)
        .map(|i| (format!("w{i}"), json!(10 + i)))
        .chain([("[UNK]".to_owned(), json!(0))])
        .collect();
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_tokenizer_the_engine_hashes_the_models_ids() {
    let dir = std::env::temp_dir().join(format!("kvroute-mock-tokenizer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    word_level_tokenizer(&dir);
    let (events, replay) = (free_port(), free_port());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let args = MockEngineArgs {
        tokenizer: Some(dir.clone()),
        ..engine_args(addr, events, replay)
    };
    mock_engine::start(args, listener).await.unwrap();
    let server = TestServer::start().await;
    server
        .register(engine_registration(&addr.to_string(), events, replay))
        .await;
    wait_subscribed(&server, "kvroute").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let text: String = (0..64).map(|i| format!("w{i} ")).collect();
    let (status, body) = http(
        addr,
        "POST",
        "/v1/completions",
        &json!({"model": "mock", "prompt": text, "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let t0 = Instant::now();
    while cached_blocks(&server).await < 4 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the engine's blocks never reached kvroute"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The model's ids (10 ..= 73) find the four blocks; the word-hash ids
    // the engine uses without a tokenizer find none.
    let overlap = |ids: Vec<u32>| {
        let mut router = server.router();
        async move {
            router
                .select_worker(pb::SelectWorkerRequest {
                    request_id: "q".into(),
                    model: "mock".into(),
                    prompt: Some(pb::Prompt {
                        content: Some(pb::prompt::Content::TokenIds(pb::TokenIds { ids })),
                    }),
                    mode: pb::SelectionMode::QueryOnly.into(),
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner()
                .overlap_blocks
        }
    };
    assert_eq!(overlap((10..74).collect()).await, 4);
    assert_eq!(overlap(word_ids(&text)).await, 0);
    let _ = std::fs::remove_dir_all(&dir);
}
