//! Integration test against the engines' REAL ZeroMQ publishers, through the
//! running service.
//!
//! For each pinned engine version, `tests/python/kv_publisher/fetch.py`
//! downloads the wheel from PyPI (`pip download --no-deps`, into a cache
//! outside the repository) and extracts only its `kv_events.py`;
//! `driver.py` loads it unmodified (our stubs for the non-essential imports,
//! the real msgspec and pyzmq) and publishes conversations of the committed
//! trace (`tests/data/conversation_sample.jsonl`, expanded by
//! `kvroute_tools::trace::tokens_for`). The first batches are published before
//! kvroute subscribes, so they can only arrive through the replay socket
//! (the gap test). A real kvroute (`TestServer`) subscribes because the
//! worker registered over gRPC with the publisher's endpoints. At the end:
//! * GetWorker: the rank holds exactly the GPU blocks the publisher
//!   announced minus those it removed;
//! * ExplainSelection: every conversation (plain, LoRA, salted with an
//!   image, salted) matches exactly its leading still-held blocks, hashed by
//!   kvroute from the request as a frontend would send it; the same tokens
//!   without their adapter and salt match only what unkeyed conversations
//!   hold, and with another tenant's salt nothing;
//! * SelectWorker: a follow-up turn of a conversation goes to the worker
//!   that stored its prefix, not to the idle plain worker beside it;
//! * Prometheus: batches all applied once (some replayed, some live), no
//!   loss, no decode errors, no index rejections, one clear, two events on
//!   a medium kvroute does not know, counted by its name.
//!
//! The tier cases (`run_tier_case`) publish the host tier as each engine
//! announces it: vLLM's offloading connector (0.24's self-describing events
//! and its placeholder events, 0.23's placeholders named by raw digests) and
//! SGLang 0.5.23's HiCache `CPU_PINNED` events. kvroute must hold per tier
//! what the engine holds, keep the host copies when the device evicts, and
//! route a prompt to the device's copy over the host's over none.
//!
//! Two cases run three kvroute replicas of one cluster (a real nats-server)
//! that each subscribe to the engine: all three end exact, with equal
//! digests, and the shared log kept each batch once.
//!
//! Needs `KVROUTE_PUBLISHER_PYTHON`: a Python with msgspec and pyzmq (the
//! project venv; `scripts/test.sh` sets it). Without it each case prints
//! SKIPPED, unless `KVROUTE_REQUIRE_PUBLISHERS=1` (also set by
//! `scripts/test.sh`), which turns any missing prerequisite into a failure.
//! `KVROUTE_WHEEL_CACHE` names the wheel cache (default
//! `$XDG_CACHE_HOME/kvroute/engine-wheels` or `~/.cache/...`).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test-only helpers

use crate::common;

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use common::{TestServer, registration};
use kvroute::config::ServeConfig;
use kvroute::{engine_events::mm_identifier_hash, pb};
use kvroute_tools::trace;
use serde_json::{Value, json};

const BLOCK_SIZE: u32 = 16;
const WORKER: u64 = 7;
const PLAIN_WORKER: u64 = 8;

fn harness() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/python/kv_publisher")
}

fn python() -> Option<String> {
    let required = std::env::var("KVROUTE_REQUIRE_PUBLISHERS").is_ok_and(|v| v == "1");
    match std::env::var("KVROUTE_PUBLISHER_PYTHON") {
        Ok(p) if !p.is_empty() => Some(p),
        _ if required => {
            panic!("KVROUTE_REQUIRE_PUBLISHERS=1 but KVROUTE_PUBLISHER_PYTHON is not set")
        }
        _ => {
            eprintln!(
                "SKIPPED: set KVROUTE_PUBLISHER_PYTHON (scripts/publisher-test.sh does; scripts/test.sh runs it)"
            );
            None
        }
    }
}

fn wheel_cache() -> PathBuf {
    if let Ok(dir) = std::env::var("KVROUTE_WHEEL_CACHE") {
        return PathBuf::from(dir);
    }
    let base = std::env::var("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|_| std::env::var("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|_| std::env::temp_dir());
    base.join("kvroute/engine-wheels")
}

/// Token streams of the first five conversations of the committed trace.
fn trace_streams() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/data/conversation_sample.jsonl");
    let streams: Vec<Vec<u32>> = (1..=5)
        .map(|line| trace::read_line(&path, line).unwrap().tokens())
        .collect();
    json!({ "streams": streams })
}

struct Driver {
    child: Child,
    stdin: ChildStdin,
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
}

impl Driver {
    fn read_line(&mut self, prefix: &str) -> String {
        loop {
            let line = self
                .lines
                .next()
                .expect("driver ended early")
                .expect("driver stdout");
            if let Some(rest) = line.strip_prefix(prefix) {
                return rest.trim().to_owned();
            }
            eprintln!("driver: {line}");
        }
    }

    fn send(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").expect("driver stdin");
        self.stdin.flush().expect("flush");
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Case {
    engine: &'static str,
    version: &'static str,
    hash_kind: &'static str,
    tcp: bool,
}

impl Case {
    /// The driver's scenario options: the main one.
    fn scenario(&self) -> Vec<String> {
        Vec::new()
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The request a frontend would send for one expected sequence.
fn request(seq: &Value, tokens: Vec<u32>, mode: pb::SelectionMode) -> pb::SelectWorkerRequest {
    let blocks = tokens.len() / BLOCK_SIZE as usize;
    let mut mm: Vec<pb::BlockMultimodalInfo> = seq["mm"]
        .as_array()
        .unwrap()
        .iter()
        .map(|ids| pb::BlockMultimodalInfo {
            mm_hashes: ids
                .as_array()
                .unwrap()
                .iter()
                .map(|id| mm_identifier_hash(id.as_str().unwrap()))
                .collect(),
        })
        .collect();
    let has_mm = mm.iter().any(|b| !b.mm_hashes.is_empty());
    mm.resize(blocks, pb::BlockMultimodalInfo::default());
    // SGLang publishes only the adapter's id: kvroute names it by the
    // adapters the worker registered (id 5 is "adapter-a").
    let lora_name = seq["lora"].as_str().unwrap_or_default().to_string();
    pb::SelectWorkerRequest {
        request_id: "publisher-test".into(),
        model: "m".into(),
        prompt: Some(pb::Prompt {
            content: Some(pb::prompt::Content::TokenIds(pb::TokenIds { ids: tokens })),
        }),
        block_mm_infos: if has_mm { mm } else { Vec::new() },
        lora_name,
        cache_namespace: seq["salt"].as_str().unwrap_or_default().to_string(),
        mode: mode.into(),
        ..Default::default()
    }
}

fn seq_tokens(seq: &Value) -> Vec<u32> {
    seq["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| u32::try_from(t.as_u64().unwrap()).unwrap())
        .collect()
}

fn held_prefix(seq: &Value) -> u32 {
    seq["held"]
        .as_array()
        .unwrap()
        .iter()
        .take_while(|h| h.as_bool() == Some(true))
        .count() as u32
}

/// What Admin/GetWorker says of the test's worker.
async fn worker_info(server: &TestServer) -> pb::WorkerInfo {
    server
        .admin()
        .get_worker(pb::GetWorkerRequest { worker_id: WORKER })
        .await
        .unwrap()
        .into_inner()
}

async fn cached_blocks(server: &TestServer) -> u64 {
    let info = worker_info(server).await;
    info.ranks.iter().map(|r| r.cached_blocks).sum()
}

/// Does kvroute hold exactly the expected state? Returns a mismatch.
async fn check(server: &TestServer, expected: &Value) -> Option<String> {
    let want = expected["held_count"].as_u64().unwrap();
    let got = cached_blocks(server).await;
    if got != want {
        return Some(format!("cached_blocks {got} != {want}"));
    }
    for (i, seq) in expected["sequences"].as_array().unwrap().iter().enumerate() {
        let req = request(seq, seq_tokens(seq), pb::SelectionMode::QueryOnly);
        let got = overlap_of(server, req).await;
        let want = held_prefix(seq);
        if got != want {
            return Some(format!("sequence {i}: overlap {got} != held prefix {want}"));
        }
        // The same tokens without the adapter and the salt are another
        // prompt to the engine: they match none of the keyed blocks, only
        // what an unkeyed conversation holds of the same text (trace
        // conversations share leading blocks).
        let keyed = !seq["lora"].is_null() || !seq["salt"].is_null();
        if keyed && want > 0 {
            let mut bare = request(seq, seq_tokens(seq), pb::SelectionMode::QueryOnly);
            bare.lora_name.clear();
            bare.cache_namespace.clear();
            let got = overlap_of(server, bare).await;
            let unkeyed = unkeyed_overlap(seq, expected);
            if got != unkeyed {
                return Some(format!(
                    "sequence {i} without its adapter and salt: overlap {got} != {unkeyed} \
                     (what unkeyed conversations hold of it)"
                ));
            }
        }
        // Another tenant's salt matches none of it.
        if !seq["salt"].is_null() && want > 0 {
            let mut other = request(seq, seq_tokens(seq), pb::SelectionMode::QueryOnly);
            other.cache_namespace = "another-tenant".into();
            let got = overlap_of(server, other).await;
            if got != 0 {
                return Some(format!(
                    "sequence {i} with another salt: overlap {got} != 0"
                ));
            }
        }
    }
    None
}

/// The test worker as ExplainSelection describes it for `req` (the
/// default, no overlap, when it is no candidate).
async fn explained_candidate(
    server: &TestServer,
    req: pb::SelectWorkerRequest,
) -> pb::CandidateExplanation {
    let explained = server
        .admin()
        .explain_selection(req)
        .await
        .unwrap()
        .into_inner();
    explained
        .candidates
        .into_iter()
        .find(|c| c.worker_id == WORKER)
        .unwrap_or_default()
}

/// The test worker's overlap for `req`, as ExplainSelection reports it.
async fn overlap_of(server: &TestServer, req: pb::SelectWorkerRequest) -> u32 {
    explained_candidate(server, req).await.overlap_blocks
}

/// The blocks of `seq`'s tokens, taken without adapter or salt, that the
/// engine holds from conversations with neither: the longest run of
/// leading blocks some unkeyed conversation shares and still holds, ending
/// before `seq`'s first block with a multimodal item (which changes its
/// hash).
fn unkeyed_overlap(seq: &Value, expected: &Value) -> u32 {
    let tokens = seq_tokens(seq);
    let bs = BLOCK_SIZE as usize;
    let first_mm = seq["mm"].as_array().map_or(usize::MAX, |blocks| {
        blocks
            .iter()
            .position(|ids| ids.as_array().is_some_and(|a| !a.is_empty()))
            .unwrap_or(usize::MAX)
    });
    expected["sequences"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|u| u["lora"].is_null() && u["salt"].is_null())
        .map(|u| {
            let theirs = seq_tokens(u);
            let shared = tokens
                .chunks_exact(bs)
                .zip(theirs.chunks_exact(bs))
                .take_while(|(a, b)| a == b)
                .count();
            shared.min(held_prefix(u) as usize).min(first_mm) as u32
        })
        .max()
        .unwrap_or(0)
}

/// The value of one Prometheus series in a scrape (0 when absent).
fn metric(body: &str, series: &str) -> u64 {
    body.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// A running driver.py over the engine's real kv_events.py, with the
/// endpoints kvroute connects to.
struct Publisher {
    driver: Driver,
    /// Batches published before kvroute subscribed.
    phase1: u64,
    pub_ep: String,
    replay_ep: String,
    work: PathBuf,
    fetched: Duration,
}

/// Fetches the engine's kv_events.py and starts the driver, which
/// publishes its first phase at once and waits for "go".
fn start_publisher(py: &str, case: &Case) -> Publisher {
    start_publisher_with(py, case, &case.scenario())
}

/// [`start_publisher`] with the driver's scenario options.
fn start_publisher_with(py: &str, case: &Case, scenario: &[String]) -> Publisher {
    let started = Instant::now();
    let work = std::env::temp_dir().join(format!(
        "kvroute-publisher-{}-{}-{}",
        case.engine,
        case.version,
        std::process::id()
    ));
    std::fs::create_dir_all(&work).unwrap();
    let out = Command::new(py)
        .arg(harness().join("fetch.py"))
        .args(["--engine", case.engine, "--version", case.version])
        .arg("--cache")
        .arg(wheel_cache())
        .arg("--out")
        .arg(&work)
        .output()
        .expect("run fetch.py");
    assert!(
        out.status.success(),
        "fetch.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let kv_events = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    let fetched = started.elapsed();
    let trace_file = work.join("trace.json");
    std::fs::write(&trace_file, trace_streams().to_string()).unwrap();

    // (bind, connect) endpoints. Over TCP the engines bind only wildcard
    // addresses (given a host, their publisher connects out instead).
    let ((pub_bind, pub_ep), (replay_bind, replay_ep)) = if case.tcp {
        let tcp = |port: u16| (format!("tcp://*:{port}"), format!("tcp://127.0.0.1:{port}"));
        (tcp(free_port()), tcp(free_port()))
    } else {
        let ipc = |name: &str| {
            let ep = format!("ipc://{}/{name}.sock", work.display());
            (ep.clone(), ep)
        };
        (ipc("pub"), ipc("replay"))
    };
    let mut child = Command::new(py)
        .arg(harness().join("driver.py"))
        .args(["--engine", case.engine, "--kv-events", &kv_events])
        .args(["--endpoint", &pub_bind, "--replay", &replay_bind])
        .args(["--hash-kind", case.hash_kind])
        .args(["--block-size", &BLOCK_SIZE.to_string()])
        .args(scenario)
        .arg("--trace")
        .arg(&trace_file)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn driver.py");
    let mut driver = Driver {
        stdin: child.stdin.take().unwrap(),
        lines: BufReader::new(child.stdout.take().unwrap()).lines(),
        child,
    };
    let phase1: u64 = driver.read_line("PHASE1").parse().unwrap();
    Publisher {
        driver,
        phase1,
        pub_ep,
        replay_ep,
        work,
        fetched,
    }
}

/// Registers the plain worker and the publisher's worker (kvroute then
/// subscribes to it) and waits until the subscription is connected.
/// Registers the idle plain worker and the publisher's worker (declaring
/// `cache_tiers`), and waits until kvroute is subscribed to the engine.
async fn register_workers(
    server: &TestServer,
    case: &Case,
    publisher: &Publisher,
    cache_tiers: Vec<pb::CacheTierSpec>,
) {
    let plain_worker = pb::RegisterWorkerRequest {
        block_size: BLOCK_SIZE,
        lease_ttl_secs: 600,
        ..registration(PLAIN_WORKER, "m")
    };
    server.register(plain_worker).await;
    server
        .register(pb::RegisterWorkerRequest {
            events_endpoint: publisher.pub_ep.clone(),
            events_dialect: case.engine.into(),
            replay_endpoint: publisher.replay_ep.clone(),
            lease_ttl_secs: 600,
            // The driver's LORA_ID and LORA_NAME.
            adapters: vec![pb::LoraAdapter {
                id: 5,
                name: "adapter-a".into(),
            }],
            cache_tiers,
            ..registration(WORKER, "m")
        })
        .await;
    wait_connected(server).await;
}

async fn wait_connected(server: &TestServer) {
    let t0 = Instant::now();
    loop {
        let info = worker_info(server).await;
        if info.subscription.contains(" connected,") {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "never connected: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Let the subscription reach the publisher (anything lost is replayed).
    tokio::time::sleep(Duration::from_millis(300)).await;
}

/// Waits until kvroute holds the expected state; the last mismatch if not.
async fn settle(server: &TestServer, expected: &Value) -> Option<String> {
    let t0 = Instant::now();
    let mut mismatch = check(server, expected).await;
    while mismatch.is_some() && t0.elapsed() < Duration::from_secs(15) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        mismatch = check(server, expected).await;
    }
    mismatch
}

async fn run_case(case: Case) {
    let Some(py) = python() else { return };
    let started = Instant::now();
    let mut publisher = start_publisher(&py, &case);
    let (phase1, fetched) = (publisher.phase1, publisher.fetched);
    let pub_ep = publisher.pub_ep.clone();
    // kvroute subscribes only now, when the first batches are gone from
    // the PUB socket: they must come through the replay socket.
    let server = TestServer::start().await;
    register_workers(&server, &case, &publisher, Vec::new()).await;
    let driver = &mut publisher.driver;
    driver.send("go");
    let expected: Value = serde_json::from_str(&driver.read_line("DONE")).unwrap();

    let mismatch = settle(&server, &expected).await;
    let info = worker_info(&server).await;
    let (_, body) = server.http_get("/metrics").await;
    let m = |name: &str| metric(&body, &format!("kvroute_{name}"));
    let summary = info.subscription.clone();
    eprintln!(
        "{} {}: {summary} (wheel fetch {fetched:.1?}, case {:.1?})",
        case.engine,
        case.version,
        started.elapsed()
    );
    assert_eq!(mismatch, None, "index state differs; {summary}");
    assert!(expected["held_count"].as_u64().unwrap() > 40);

    // A follow-up turn of the plain conversation (its tokens so far plus the
    // next 64 of its trace stream) goes where its prefix is cached.
    let streams = trace_streams();
    let plain = &expected["sequences"][0];
    assert!(plain["lora"].is_null() && plain["salt"].is_null());
    let stream: Vec<u32> = streams["streams"][plain["stream"].as_u64().unwrap() as usize]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let follow_up = stream[..seq_tokens(plain).len() + 64].to_vec();
    let chosen = server
        .router()
        .select_worker(request(plain, follow_up, pb::SelectionMode::Reserve))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(chosen.worker_id, WORKER, "{chosen:?}");
    assert_eq!(chosen.overlap_blocks, held_prefix(plain), "{chosen:?}");
    assert!(chosen.overlap_blocks >= 32, "{chosen:?}");

    // The phase-1 batches came through the replay socket; every batch was
    // applied exactly once, some of them live.
    let w = r#"{worker="7"}"#;
    let total = expected["batches"].as_u64().unwrap();
    let replayed = m(&format!("engine_event_replayed_batches_total{w}"));
    assert!(
        m(r#"engine_event_replays_total{outcome="requested",worker="7"}"#) >= 1,
        "{body}"
    );
    assert!(replayed >= phase1 && replayed < total, "{summary}\n{body}");
    assert_eq!(
        m(&format!("engine_event_batches_total{w}")),
        total,
        "{body}"
    );
    assert_eq!(m(&format!("engine_event_batches_lost_total{w}")), 0);
    // Nothing was lost, nor did a sequence jump: the rank is exact, and no
    // repeat or replay overlap was taken for a restart.
    assert_eq!(m(&format!("engine_event_unsynced_ranks{w}")), 0, "{body}");
    assert!(!summary.contains("unsynced"), "{summary}");
    assert_eq!(m(&format!("engine_event_restarts_total{w}")), 0, "{body}");
    assert_eq!(
        m(r#"engine_event_skipped_batches_total{reason="jump",worker="7"}"#),
        0,
        "{body}"
    );
    assert!(
        !body.lines().any(
            |l| l.starts_with("kvroute_engine_event_decode_errors_total") && !l.ends_with(" 0")
        ),
        "{body}"
    );
    let ignored = |reason: &str| {
        m(&format!(
            r#"engine_events_ignored_total{{reason="{reason}",worker="7"}}"#
        ))
    };
    assert_eq!(ignored("index_rejected"), 0, "{body}");
    assert_eq!(ignored("unknown_medium"), 2, "{body}");
    assert_eq!(
        m(r#"engine_event_unknown_media_total{value="DISK"}"#),
        2,
        "{body}"
    );
    assert_eq!(
        m(&format!("engine_event_rank_mismatch_total{w}")),
        0,
        "{body}"
    );
    assert_eq!(m(r#"engine_events_total{kind="cleared",worker="7"}"#), 1);
    assert!(summary.starts_with(&format!("{} {pub_ep} connected, last seq", case.engine)));

    driver.send("quit");
    let _ = driver.child.wait();
    server.stop().await.unwrap();
    let _ = std::fs::remove_dir_all(&publisher.work);
}

/// kvroute goes down after a snapshot; the engine publishes the rest of
/// its conversations meanwhile; the restarted kvroute loads the snapshot,
/// resumes from the saved publisher sequence and gets what it missed
/// through the engine's replay socket, ending exact.
async fn run_restart_case(case: Case) {
    let Some(py) = python() else { return };
    let mut publisher = start_publisher(&py, &case);
    let state = std::env::temp_dir().join(format!(
        "kvroute-publisher-state-{}-{}-{}",
        case.engine,
        case.version,
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&state);
    let config = || ServeConfig {
        state_dir: Some(state.clone()),
        snapshot_interval: Duration::from_secs(3600),
        ..ServeConfig::for_tests()
    };
    let server = TestServer::start_with(config()).await;
    register_workers(&server, &case, &publisher, Vec::new()).await;
    // Phase 1 came through the replay socket; snapshot that state.
    let last_of_phase1 = format!("last seq {}", publisher.phase1 - 1);
    let t0 = Instant::now();
    while !worker_info(&server)
        .await
        .subscription
        .contains(&last_of_phase1)
    {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "phase 1 never arrived"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let taken = server
        .admin()
        .snapshot(pb::SnapshotRequest {})
        .await
        .unwrap()
        .into_inner();
    server.stop().await.unwrap();
    // As if killed right after that snapshot: keep it alone.
    for entry in std::fs::read_dir(&state).unwrap().flatten() {
        if entry.path().to_string_lossy() != taken.path {
            std::fs::remove_file(entry.path()).unwrap();
        }
    }
    // The engine goes on while kvroute is down: nobody hears these batches live.
    let driver = &mut publisher.driver;
    driver.send("go");
    let expected: Value = serde_json::from_str(&driver.read_line("DONE")).unwrap();

    let server = TestServer::start_with(config()).await;
    wait_connected(&server).await;
    let mismatch = settle(&server, &expected).await;
    let info = worker_info(&server).await;
    let (_, body) = server.http_get("/metrics").await;
    let m = |name: &str| metric(&body, &format!("kvroute_{name}"));
    assert_eq!(mismatch, None, "after the restart: {}", info.subscription);
    let w = r#"{worker="7"}"#;
    let missed = expected["batches"].as_u64().unwrap() - publisher.phase1;
    // Exactly those: the subscription resumed after the saved sequence.
    assert_eq!(
        m(&format!("engine_event_replayed_batches_total{w}")),
        missed,
        "only the batches published while down came through the replay socket\n{body}"
    );
    assert_eq!(
        m(&format!("engine_event_batches_lost_total{w}")),
        0,
        "{body}"
    );
    assert_eq!(m(&format!("engine_event_restarts_total{w}")), 0, "{body}");
    assert_eq!(m(&format!("engine_event_unsynced_ranks{w}")), 0, "{body}");
    assert_eq!(m("snapshots_total{outcome=\"loaded\"}"), 1, "{body}");
    driver.send("quit");
    let _ = driver.child.wait();
    server.stop().await.unwrap();
    let _ = std::fs::remove_dir_all(&state);
    let _ = std::fs::remove_dir_all(&publisher.work);
}

/// Three kvroute replicas of one cluster (cluster mode, a real
/// nats-server) each subscribe to the engine; every batch reaches the
/// shared log (appended by each replica, kept once) and every replica ends
/// exact, with equal digests.
async fn run_cluster_case(case: Case) {
    let Some(py) = python() else { return };
    let mut publisher = start_publisher(&py, &case);
    let nats = common::cluster::Nats::start(&format!("publisher-{}", case.engine));
    let mut replicas = Vec::new();
    for i in 0..3 {
        let mut config = ServeConfig::for_tests();
        config.cluster.nats_url = Some(nats.url());
        config.cluster.cluster_name = format!("pub{}", case.engine);
        config.cluster.replica_id = Some(format!("pub-r{i}"));
        config.cluster.log_max_bytes = 64 << 20;
        replicas.push(TestServer::start_with(config).await);
    }
    register_workers(&replicas[0], &case, &publisher, Vec::new()).await;
    for r in &replicas[1..] {
        wait_connected(r).await;
    }
    let driver = &mut publisher.driver;
    driver.send("go");
    let expected: Value = serde_json::from_str(&driver.read_line("DONE")).unwrap();
    let mut digests = Vec::new();
    let mut duplicates = 0;
    for (i, r) in replicas.iter().enumerate() {
        let mismatch = settle(r, &expected).await;
        assert_eq!(mismatch, None, "replica {i}: index state differs");
        let stats = r
            .admin()
            .get_index_stats(pb::GetIndexStatsRequest::default())
            .await
            .unwrap()
            .into_inner();
        digests.push((stats.entries, stats.digest));
        let (_, body) = r.http_get("/metrics").await;
        duplicates += metric(
            &body,
            r#"kvroute_cluster_log_appends_total{outcome="duplicate"}"#,
        );
    }
    eprintln!(
        "{} {} in a cluster of three: digests {digests:?}, {duplicates} duplicate appends",
        case.engine, case.version
    );
    assert!(digests.windows(2).all(|p| p[0] == p[1]), "{digests:?}");
    assert!(
        duplicates > 0,
        "replicas append the same engine batches; the log keeps one"
    );
    driver.send("quit");
    let _ = driver.child.wait();
    for r in replicas {
        r.stop().await.unwrap();
    }
    let _ = std::fs::remove_dir_all(&publisher.work);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_0_24_three_replicas_follow_one_engine() {
    run_cluster_case(Case {
        engine: "vllm",
        version: "0.24.0",
        hash_kind: "bytes",
        tcp: true,
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_0_5_20_three_replicas_follow_one_engine() {
    run_cluster_case(Case {
        engine: "sglang",
        version: "0.5.20",
        hash_kind: "signed",
        tcp: true,
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_0_24_resumes_through_the_replay_socket_after_a_restart() {
    run_restart_case(Case {
        engine: "vllm",
        version: "0.24.0",
        hash_kind: "bytes",
        tcp: true,
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_0_5_20_resumes_through_the_replay_socket_after_a_restart() {
    run_restart_case(Case {
        engine: "sglang",
        version: "0.5.20",
        hash_kind: "signed",
        tcp: true,
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_0_23_array_events_int_hashes_ipc() {
    run_case(Case {
        engine: "vllm",
        version: "0.23.0",
        hash_kind: "int",
        tcp: false,
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_0_24_map_events_bytes_hashes_tcp() {
    run_case(Case {
        engine: "vllm",
        version: "0.24.0",
        hash_kind: "bytes",
        tcp: true,
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_0_5_19_array_events_signed_hashes_ipc() {
    run_case(Case {
        engine: "sglang",
        version: "0.5.19",
        hash_kind: "signed",
        tcp: false,
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_0_5_20_map_events_signed_hashes_tcp() {
    run_case(Case {
        engine: "sglang",
        version: "0.5.20",
        hash_kind: "signed",
        tcp: true,
    })
    .await;
}

// ---- cache tiers ----------------------------------------------------------

/// One tier case: an engine version and how it announces its host tier
/// (the driver's `--host-events`).
struct TierCase {
    case: Case,
    host_events: &'static str,
}

/// The expected split of a sequence's overlap: its leading blocks held in
/// some tier, each counted on the device when the device holds it.
fn expected_split(seq: &Value) -> (u32, u32) {
    let flags = |k: &str| -> Vec<bool> {
        seq[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_bool().unwrap())
            .collect()
    };
    let (device, host) = (flags("held"), flags("host"));
    let mut split = (0, 0);
    for (d, h) in device.iter().zip(&host) {
        match (d, h) {
            (true, _) => split.0 += 1,
            (false, true) => split.1 += 1,
            (false, false) => break,
        }
    }
    split
}

/// Does kvroute hold per tier what the engine holds? Returns a mismatch.
async fn check_tiers(server: &TestServer, expected: &Value) -> Option<String> {
    let stats = server.index_stats().await;
    let tiers = stats.blocks_by_tier.unwrap_or_default();
    let want = (
        expected["held_count"].as_u64().unwrap(),
        expected["host_count"].as_u64().unwrap(),
    );
    if (tiers.device, tiers.host) != want {
        return Some(format!("blocks by tier {tiers:?} != {want:?}"));
    }
    for (i, seq) in expected["sequences"].as_array().unwrap().iter().enumerate() {
        let req = request(seq, seq_tokens(seq), pb::SelectionMode::QueryOnly);
        let c = explained_candidate(server, req).await;
        let got = c.overlap_by_tier.map(|t| (t.device as u32, t.host as u32));
        let (device, host) = expected_split(seq);
        if got != Some((device, host)) || c.overlap_blocks != device + host {
            return Some(format!(
                "sequence {i}: overlap {} split {got:?} != ({device}, {host})",
                c.overlap_blocks
            ));
        }
    }
    None
}

async fn run_tier_case(tier_case: TierCase) {
    let Some(py) = python() else { return };
    let case = &tier_case.case;
    let scenario = [
        "--scenario".to_string(),
        "tiers".into(),
        "--host-events".into(),
        tier_case.host_events.into(),
    ];
    let mut publisher = start_publisher_with(&py, case, &scenario);
    let server = TestServer::start().await;
    let host = pb::CacheTierSpec {
        tier: pb::CacheTier::Host as i32,
        capacity_blocks: 100_000,
        prefill_saving: None,
    };
    register_workers(&server, case, &publisher, vec![host]).await;
    let driver = &mut publisher.driver;
    driver.send("go");
    let expected: Value = serde_json::from_str(&driver.read_line("DONE")).unwrap();

    let t0 = Instant::now();
    let mut mismatch = check_tiers(&server, &expected).await;
    while mismatch.is_some() && t0.elapsed() < Duration::from_secs(15) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        mismatch = check_tiers(&server, &expected).await;
    }
    let info = worker_info(&server).await;
    let (_, body) = server.http_get("/metrics").await;
    assert_eq!(mismatch, None, "{}\n{body}", info.subscription);
    // Evictions from the device left the host copies: three conversations
    // are held only in host memory, one on both.
    let sequences = expected["sequences"].as_array().unwrap();
    let host_only = sequences
        .iter()
        .filter(|s| expected_split(s) == (0, held_prefix_any(s)) && held_prefix_any(s) > 0)
        .count();
    assert_eq!(host_only, 3, "{expected}");
    assert!(expected["host_count"].as_u64().unwrap() > 40);

    // No event was malformed, refused or of an unknown medium.
    let m = |name: &str| metric(&body, &format!("kvroute_{name}"));
    assert!(
        !body.lines().any(
            |l| l.starts_with("kvroute_engine_event_decode_errors_total") && !l.ends_with(" 0")
        ),
        "{body}"
    );
    for reason in ["index_rejected", "unknown_medium"] {
        let series = format!(r#"engine_events_ignored_total{{reason="{reason}",worker="7"}}"#);
        assert_eq!(m(&series), 0, "{reason}: {body}");
    }
    let host_medium = if case.engine == "sglang" {
        "CPU_PINNED"
    } else {
        "CPU"
    };
    assert!(
        m(&format!(
            r#"engine_event_media_total{{medium="{host_medium}"}}"#
        )) > 0,
        "{body}"
    );

    // The plain conversation now only in host memory: kvroute sends it
    // there rather than to the worker that holds nothing ...
    let plain = &sequences[1];
    assert!(plain["lora"].is_null() && plain["salt"].is_null());
    let tokens = seq_tokens(plain);
    let ask = |tokens: Vec<u32>| {
        let mut router = server.router();
        let req = request(plain, tokens, pb::SelectionMode::QueryOnly);
        async move { router.select_worker(req).await.unwrap().into_inner() }
    };
    let chosen = ask(tokens.clone()).await;
    assert_eq!(chosen.worker_id, WORKER, "{chosen:?}");
    let held = held_prefix_any(plain);
    assert_eq!(
        chosen.overlap_by_tier.map(|t| (t.device, t.host)),
        Some((0, u64::from(held)))
    );
    // ... and to a worker holding it on the device over both.
    let locals = kvroute_core::hashing::compute_block_hashes(
        &tokens,
        BLOCK_SIZE,
        &kvroute_core::hashing::HashOptions::plain(),
        None,
    );
    let blocks: Vec<(u64, u64)> = locals
        .iter()
        .enumerate()
        .map(|(i, l)| (i as u64 + 1, *l))
        .collect();
    let reply = server
        .publish(common::batch(
            PLAIN_WORKER,
            0,
            vec![common::stored(0, None, &blocks)],
        ))
        .await
        .unwrap();
    assert_eq!(reply.rejected, 0, "{reply:?}");
    let chosen = ask(tokens).await;
    assert_eq!(chosen.worker_id, PLAIN_WORKER, "{chosen:?}");
    eprintln!(
        "{} {} ({}): {} device, {} host blocks; {}",
        case.engine,
        case.version,
        tier_case.host_events,
        expected["held_count"],
        expected["host_count"],
        info.subscription
    );

    driver.send("quit");
    let _ = driver.child.wait();
    server.stop().await.unwrap();
    let _ = std::fs::remove_dir_all(&publisher.work);
}

/// Leading blocks of a sequence held in any tier.
fn held_prefix_any(seq: &Value) -> u32 {
    let (device, host) = expected_split(seq);
    device + host
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_0_24_self_describing_host_events() {
    run_tier_case(TierCase {
        case: Case {
            engine: "vllm",
            version: "0.24.0",
            hash_kind: "int",
            tcp: true,
        },
        host_events: "self-describing",
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_0_24_placeholder_host_events() {
    run_tier_case(TierCase {
        case: Case {
            engine: "vllm",
            version: "0.24.0",
            hash_kind: "int",
            tcp: true,
        },
        host_events: "placeholder",
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_0_23_placeholder_host_events_named_by_digest() {
    run_tier_case(TierCase {
        case: Case {
            engine: "vllm",
            version: "0.23.0",
            hash_kind: "int",
            tcp: false,
        },
        host_events: "placeholder-bytes",
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_0_5_23_hicache_cpu_pinned_events() {
    run_tier_case(TierCase {
        case: Case {
            engine: "sglang",
            version: "0.5.23",
            hash_kind: "signed",
            tcp: true,
        },
        host_events: "sglang",
    })
    .await;
}
