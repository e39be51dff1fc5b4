//! Engine-native KV events through the running service, against a fake
//! engine built from the `zeromq` crate's PUB socket (no Python needed).
//!
//! A worker registers over gRPC with the fake engine's `events_endpoint`;
//! what the engine publishes must reach the index through the service's
//! ingest writer, so `SelectWorker` routes by it and Admin `GetWorker`
//! shows the subscription. The engine then misbehaves: malformed messages
//! (counted, skipped), going away (reconnect, blocks stay), coming back
//! restarted (sequence 0 again: the rank is cleared), a gap with no replay
//! endpoint (counted, the rank unsynced, routing continues), the same batch
//! again (a duplicate: skipped, nothing wiped), `AllBlocksCleared` (the rank
//! is exact again). Re-registration with another
//! endpoint restarts the subscription, deregistration and lease lapse stop
//! it, and `kvroute serve --engine` starts one with a lease that stays.
//!
//! A second fake engine also has a replay (ROUTER) socket that keeps its
//! last batches, as vLLM's and SGLang's publishers do. Against it,
//! subscriptions are driven through the library API (`spawn_worker` into a
//! `KvIndex`): one resumed from a saved sequence replays what it missed and
//! ends with the same blocks as one that never stopped; a batch sent again
//! with the same sequence wipes nothing; a replay that cannot reach back
//! leaves the rank unsynced until the engine reports `AllBlocksCleared`.
// std's clock: this test times real sockets and reconnects.
#![allow(clippy::disallowed_methods)]
#![allow(clippy::unwrap_used, clippy::expect_used)] // test-only helpers

use crate::common;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{TestServer, registration};
use kvroute::engine_events::{
    Dialect, EngineEventsConfig, MetricsSnapshot, WorkerEventMetrics, WorkerSubscription,
    spawn_worker,
};
use kvroute::metrics::Metrics;
use kvroute::{config::ServeConfig, pb};
use kvroute_core::index::KvIndex;
use kvroute_core::types::WorkerRank;
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// `[0.0, [["BlockStored", [h], parent, [t, t+1], 2, nil, "GPU", nil]], 0]`
/// (vLLM array form, block size 2).
pub(crate) fn stored(h: u8, parent: Option<u8>, t: u8) -> Vec<u8> {
    let mut v = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x98, 0xab];
    v.extend_from_slice(b"BlockStored");
    v.extend_from_slice(&[0x91, h, parent.unwrap_or(0xc0), 0x92, t, t + 1, 0x02, 0xc0]);
    v.extend_from_slice(&[0xa3, b'G', b'P', b'U', 0xc0, 0x00]);
    v
}

/// `[0.0, [["BlockRemoved", [h], "GPU"]], 0]`
fn removed(h: u8) -> Vec<u8> {
    let mut v = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x93, 0xac];
    v.extend_from_slice(b"BlockRemoved");
    v.extend_from_slice(&[0x91, h, 0xa3, b'G', b'P', b'U', 0x00]);
    v
}

/// `[0.0, [["AllBlocksCleared"]], 0]`
fn all_cleared() -> Vec<u8> {
    let mut v = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x91, 0xb0];
    v.extend_from_slice(b"AllBlocksCleared");
    v.push(0x00);
    v
}

pub(crate) async fn send(p: &mut PubSocket, frames: Vec<Vec<u8>>) {
    let frames: Vec<Bytes> = frames.into_iter().map(Bytes::from).collect();
    p.send(ZmqMessage::try_from(frames).unwrap()).await.unwrap();
}

pub(crate) fn seq(s: u64) -> Vec<u8> {
    s.to_be_bytes().to_vec()
}

async fn worker(server: &TestServer, id: u64) -> Result<pb::WorkerInfo, tonic::Status> {
    server
        .admin()
        .get_worker(pb::GetWorkerRequest { worker_id: id })
        .await
        .map(tonic::Response::into_inner)
}

/// Polls GetWorker until `f` holds (10 s at most).
async fn wait_worker(
    server: &TestServer,
    id: u64,
    what: &str,
    f: impl Fn(&pb::WorkerInfo) -> bool,
) -> pb::WorkerInfo {
    let t0 = Instant::now();
    loop {
        let info = worker(server, id).await.expect("worker registered");
        if f(&info) {
            return info;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn cached(info: &pb::WorkerInfo) -> u64 {
    info.ranks.iter().map(|r| r.cached_blocks).sum()
}

async fn select(server: &TestServer, tokens: &[u32]) -> pb::SelectWorkerResponse {
    server
        .router()
        .select_worker(pb::SelectWorkerRequest {
            request_id: "r".into(),
            model: "m".into(),
            prompt: Some(pb::Prompt {
                content: Some(pb::prompt::Content::TokenIds(pb::TokenIds {
                    ids: tokens.to_vec(),
                })),
            }),
            mode: pb::SelectionMode::QueryOnly.into(),
            ..Default::default()
        })
        .await
        .expect("select")
        .into_inner()
}

pub(crate) fn engine_registration(id: u64, endpoint: &str) -> pb::RegisterWorkerRequest {
    pb::RegisterWorkerRequest {
        block_size: 2,
        events_endpoint: endpoint.into(),
        events_dialect: "vllm".into(),
        lease_ttl_secs: 600,
        ..registration(id, "m")
    }
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_events_through_the_service() {
    let dir = temp_dir("engine-reconnect");
    let ep = format!("ipc://{}/pub.sock", dir.display());
    let server = TestServer::start().await;
    // A plain worker too, so routing has a choice to make.
    server
        .register(pb::RegisterWorkerRequest {
            block_size: 2,
            lease_ttl_secs: 600,
            ..registration(4, "m")
        })
        .await;
    // Subscriber first: it must retry until the engine binds.
    server.register(engine_registration(3, &ep)).await;
    let info = worker(&server, 3).await.unwrap();
    assert!(
        info.subscription.starts_with(&format!("vllm {ep} ")),
        "{info:?}"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;

    let mut engine = PubSocket::new();
    engine.bind(&ep).await.unwrap();
    wait_worker(&server, 3, "connected", |w| {
        w.subscription.contains(" connected,")
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    send(&mut engine, vec![vec![], seq(0), stored(1, None, 10)]).await;
    send(&mut engine, vec![vec![], seq(1), stored(2, Some(1), 12)]).await;
    send(&mut engine, vec![vec![], seq(2)]).await; // two frames
    send(&mut engine, vec![vec![], vec![0, 2], vec![0x90]]).await; // short seq
    send(&mut engine, vec![vec![], seq(2), vec![0x93, 0xcb]]).await; // bad msgpack
    send(&mut engine, vec![vec![], seq(3), stored(3, Some(2), 14)]).await;
    let info = wait_worker(&server, 3, "3 blocks", |w| cached(w) == 3).await;
    let s = &info.subscription;
    assert!(s.contains("last seq 3, 0 gaps, 0 replays"), "{s}");
    assert!(s.contains("3 decode errors"), "{s}");
    assert!(s.contains("s ago"), "{s}");

    // SelectWorker routes by what the engine published.
    let chosen = select(&server, &[10, 11, 12, 13, 14, 15, 16, 17]).await;
    assert_eq!((chosen.worker_id, chosen.overlap_blocks), (3, 3));

    // Per-worker Prometheus series.
    let (_, body) = server.http_get("/metrics").await;
    for line in [
        // the bad-msgpack batch was admitted (seq 2), then failed to decode
        r#"kvroute_engine_event_batches_total{worker="3"} 4"#,
        r#"kvroute_engine_events_total{kind="stored",worker="3"} 3"#,
        r#"kvroute_engine_event_decode_errors_total{reason="frame_count",worker="3"} 1"#,
        r#"kvroute_engine_event_decode_errors_total{reason="seq_length",worker="3"} 1"#,
        r#"kvroute_engine_event_decode_errors_total{reason="msgpack",worker="3"} 1"#,
        r#"kvroute_engine_event_connected_ranks{worker="3"} 1"#,
    ] {
        assert!(body.contains(line), "missing {line} in\n{body}");
    }
    assert!(body.contains(r#"kvroute_engine_event_last_age_seconds{worker="3"}"#));

    // The engine goes away: the subscriber reconnects, blocks stay.
    drop(engine);
    wait_worker(&server, 3, "disconnect", |w| {
        w.subscription.contains("disconnected")
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(cached(&worker(&server, 3).await.unwrap()), 3);
    let _ = std::fs::remove_file(dir.join("pub.sock"));

    // It comes back restarted: sequence 0 again -> rank cleared first.
    let mut engine = PubSocket::new();
    engine.bind(&ep).await.unwrap();
    wait_worker(&server, 3, "reconnect", |w| {
        w.subscription.contains(" connected,")
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    send(&mut engine, vec![vec![], seq(0), stored(9, None, 40)]).await;
    let info = wait_worker(&server, 3, "restart", |w| {
        w.subscription.contains("1 restart") && cached(w) == 1
    })
    .await;
    assert!(info.subscription.contains("last seq 0"), "{info:?}");
    // No replay endpoint: a gap is counted, the batch still applies.
    send(&mut engine, vec![vec![], seq(3), stored(10, None, 50)]).await;
    let info = wait_worker(&server, 3, "lost batches", |w| {
        w.subscription.contains("2 batches lost") && cached(w) == 2
    })
    .await;
    assert!(info.subscription.contains("1 gap,"), "{info:?}");
    assert!(info.subscription.contains("no replay endpoint"), "{info:?}");
    // The rank can no longer be exact: unsynced until AllBlocksCleared.
    assert!(info.subscription.contains("unsynced [0]"), "{info:?}");
    let (_, body) = server.http_get("/metrics").await;
    let line = r#"kvroute_engine_event_unsynced_ranks{worker="3"} 1"#;
    assert!(body.contains(line), "missing {line} in\n{body}");
    assert_eq!(select(&server, &[50, 51, 52, 53]).await.worker_id, 3);
    // The same batch again: a duplicate, skipped; nothing is wiped.
    send(&mut engine, vec![vec![], seq(3), stored(10, None, 50)]).await;
    let info = wait_worker(&server, 3, "a duplicate", |w| {
        w.subscription.contains("1 duplicate,")
    })
    .await;
    assert_eq!(cached(&info), 2);
    assert!(info.subscription.contains("1 restart,"), "{info:?}");
    // The engine drops its cache: the rank is exact again.
    send(&mut engine, vec![vec![], seq(4), all_cleared()]).await;
    send(&mut engine, vec![vec![], seq(5), stored(10, None, 50)]).await;
    let info = wait_worker(&server, 3, "cleared", |w| {
        w.subscription.contains("last seq 5") && cached(w) == 1
    })
    .await;
    assert!(!info.subscription.contains("unsynced"), "{info:?}");
    let (_, body) = server.http_get("/metrics").await;
    let line = r#"kvroute_engine_event_unsynced_ranks{worker="3"} 0"#;
    assert!(body.contains(line), "missing {line} in\n{body}");

    // Registering again, even with the same endpoint, starts the worker
    // anew (its engine may have restarted): the blocks go, the
    // subscription starts over, and the engine's next events apply.
    server.register(engine_registration(3, &ep)).await;
    assert_eq!(cached(&worker(&server, 3).await.unwrap()), 0);
    wait_worker(&server, 3, "subscribed again", |w| {
        w.subscription.contains(" connected,") && !w.subscription.contains("last seq 5")
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    send(&mut engine, vec![vec![], seq(6), stored(10, None, 50)]).await;
    wait_worker(&server, 3, "the new stream's block", |w| {
        w.subscription.contains("last seq 6") && cached(w) == 1
    })
    .await;

    // Another endpoint restarts it: the old publisher's blocks are dropped.
    let ep2 = format!("ipc://{}/pub2.sock", dir.display());
    server.register(engine_registration(3, &ep2)).await;
    let info = worker(&server, 3).await.unwrap();
    assert_eq!(cached(&info), 0);
    assert!(
        info.subscription.starts_with(&format!("vllm {ep2} ")),
        "{info:?}"
    );
    let mut engine2 = PubSocket::new();
    engine2.bind(&ep2).await.unwrap();
    wait_worker(&server, 3, "connected to the new endpoint", |w| {
        w.subscription.contains(" connected,")
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    send(&mut engine2, vec![vec![], seq(0), stored(20, None, 60)]).await;
    wait_worker(&server, 3, "new engine's block", |w| cached(w) == 1).await;
    // The old engine is no longer followed.
    send(&mut engine, vec![vec![], seq(7), stored(11, None, 70)]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(cached(&worker(&server, 3).await.unwrap()), 1);

    // Deregistration stops it and drops its series.
    let removed = server
        .workers()
        .deregister_worker(pb::DeregisterWorkerRequest { worker_id: 3 })
        .await
        .unwrap()
        .into_inner()
        .blocks_removed;
    assert_eq!(removed, 1);
    let (_, body) = server.http_get("/metrics").await;
    assert!(!body.contains(r#"worker="3""#), "{body}");
    send(&mut engine2, vec![vec![], seq(1), stored(21, Some(20), 62)]).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        worker(&server, 3).await.unwrap_err().code(),
        tonic::Code::NotFound
    );

    server.stop().await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_event_settings_are_invalid_arguments() {
    let server = TestServer::start().await;
    let cases = [
        ("tcp://127.0.0.1:5557", "trtllm", "", "events_dialect"),
        ("tcp://127.0.0.1:5557", "", "", "events_dialect is required"),
        ("tcp://127.0.0.1", "vllm", "", "tcp://HOST:PORT"),
        ("tcp://*:5557", "vllm", "", "connectable host"),
        ("udp://127.0.0.1:5557", "vllm", "", "only tcp://"),
        (
            "tcp://127.0.0.1:5557",
            "vllm",
            "http://x",
            "replay_endpoint",
        ),
        ("", "vllm", "", "need an events_endpoint"),
    ];
    for (endpoint, dialect, replay, message) in cases {
        let status = server
            .workers()
            .register_worker(pb::RegisterWorkerRequest {
                events_endpoint: endpoint.into(),
                events_dialect: dialect.into(),
                replay_endpoint: replay.into(),
                ..registration(1, "m")
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains(message), "{status:?}");
    }
    // Several ranks need derivable endpoints (ipc:// has no port to offset).
    let status = server
        .workers()
        .register_worker(pb::RegisterWorkerRequest {
            events_endpoint: "ipc:///tmp/kv.sock".into(),
            events_dialect: "sglang".into(),
            dp_size: 2,
            ..registration(1, "m")
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("dp rank 1"), "{status:?}");
    // Nothing was registered.
    assert_eq!(
        worker(&server, 1).await.unwrap_err().code(),
        tonic::Code::NotFound
    );
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_lapse_stops_the_subscription() {
    let server = TestServer::start().await;
    server
        .register(pb::RegisterWorkerRequest {
            lease_ttl_secs: 1,
            ..engine_registration(5, "tcp://127.0.0.1:9")
        })
        .await;
    assert!(!worker(&server, 5).await.unwrap().subscription.is_empty());
    let t0 = Instant::now();
    while worker(&server, 5).await.is_ok() {
        assert!(t0.elapsed() < Duration::from_secs(10), "lease never lapsed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (_, body) = server.http_get("/metrics").await;
    assert!(!body.contains(r#"worker="5""#), "{body}");
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configured_engine_is_registered_and_keeps_its_lease() {
    let dir = temp_dir("engine-configured");
    let ep = format!("ipc://{}/pub.sock", dir.display());
    let mut config = ServeConfig::for_tests();
    config.lease_ttl = Duration::from_millis(400);
    config.engine =
        vec![kvroute::config::parse_engine_spec(&format!("8:m:2:0:1:sglang:{ep}")).unwrap()];
    let server = TestServer::start_with(config).await;
    let mut engine = PubSocket::new();
    engine.bind(&ep).await.unwrap();
    wait_worker(&server, 8, "connected", |w| {
        w.subscription
            .starts_with(&format!("sglang {ep} connected"))
    })
    .await;
    // Well past the lease: still registered.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let info = worker(&server, 8).await.unwrap();
    assert_eq!((info.block_size, info.model.as_str()), (2, "m"));
    // It cannot be taken over over gRPC.
    let status = server
        .workers()
        .register_worker(engine_registration(8, &ep))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
    server.stop().await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

// --- a fake engine with a replay socket -------------------------------------

/// The batches an engine keeps for replays: `(sequence, payload)`, oldest first.
type Kept = Arc<Mutex<VecDeque<(u64, Vec<u8>)>>>;

/// A PUB socket plus a ROUTER replay socket that answers `["", start]` with
/// every kept batch from `start` on, then the `-1` end marker, as vLLM's and
/// SGLang's publishers do; it keeps the last `keep` batches.
struct ReplayEngine {
    publisher: PubSocket,
    kept: Kept,
    keep: usize,
    replays: tokio::task::JoinHandle<()>,
}

impl ReplayEngine {
    async fn bind(endpoint: &str, replay_endpoint: &str, keep: usize) -> Self {
        let mut publisher = PubSocket::new();
        publisher.bind(endpoint).await.unwrap();
        let mut router = RouterSocket::new();
        router.bind(replay_endpoint).await.unwrap();
        let kept = Kept::default();
        let buffer = Arc::clone(&kept);
        let replays = tokio::spawn(async move {
            while let Ok(request) = router.recv().await {
                // [identity, "", start as 8 bytes big-endian]
                let frames = request.into_vec();
                let id = frames[0].clone();
                let start = u64::from_be_bytes(frames[frames.len() - 1][..].try_into().unwrap());
                let batches: Vec<(u64, Vec<u8>)> = buffer
                    .lock()
                    .unwrap()
                    .iter()
                    .filter(|(s, _)| *s >= start)
                    .cloned()
                    .collect();
                let end = (-1i64).to_be_bytes().to_vec();
                for (seq, payload) in batches
                    .into_iter()
                    .map(|(s, p)| (s.to_be_bytes().to_vec(), p))
                    .chain([(end, Vec::new())])
                {
                    let frames = vec![id.clone(), Bytes::new(), seq.into(), payload.into()];
                    router
                        .send(ZmqMessage::try_from(frames).unwrap())
                        .await
                        .unwrap();
                }
            }
        });
        Self {
            publisher,
            kept,
            keep,
            replays,
        }
    }

    /// Publishes batch `s` live and keeps it for replays.
    async fn publish(&mut self, s: u64, payload: Vec<u8>) {
        {
            let mut kept = self.kept.lock().unwrap();
            kept.push_back((s, payload.clone()));
            while kept.len() > self.keep {
                kept.pop_front();
            }
        }
        send(&mut self.publisher, vec![vec![], seq(s), payload]).await;
    }
}

impl Drop for ReplayEngine {
    fn drop(&mut self) {
        self.replays.abort();
    }
}

/// A subscription of worker 1 (one rank, block size 2) into its own index,
/// counting into its own metrics registry.
struct Follower {
    index: Arc<KvIndex>,
    metrics: Arc<WorkerEventMetrics>,
    subscription: WorkerSubscription,
}

const TARGET: WorkerRank = WorkerRank {
    worker_id: 1,
    dp_rank: 0,
};

impl Follower {
    /// Subscribes to `engine` (`[endpoint, replay endpoint]`) into `index`,
    /// resuming after `resume` when given, and waits until it is connected.
    async fn start(engine: &[String; 2], index: Arc<KvIndex>, resume: Option<u64>) -> Self {
        let mut cfg = EngineEventsConfig::new(1, "m", 2, engine[0].clone(), Dialect::Vllm);
        cfg.replay_endpoint = Some(engine[1].clone());
        cfg.reconnect_initial = Duration::from_millis(20);
        if let Some(last) = resume {
            cfg.resume_from.insert(0, last);
        }
        let families = Metrics::new().unwrap().engine.clone();
        let metrics = Arc::new(WorkerEventMetrics::bound(&families, 1));
        let subscription = spawn_worker(
            cfg,
            Arc::clone(&index),
            Arc::clone(&metrics),
            CancellationToken::new(),
            &TaskTracker::new(),
        )
        .unwrap();
        let follower = Self {
            index,
            metrics,
            subscription,
        };
        follower.wait("connected", |f| f.m().connects == 1).await;
        // Past the slow-joiner window (a batch lost there is replayed anyway).
        tokio::time::sleep(Duration::from_millis(300)).await;
        follower
    }

    fn m(&self) -> MetricsSnapshot {
        self.metrics.snapshot()
    }

    fn blocks(&self) -> u64 {
        self.index.worker_blocks(TARGET)
    }

    /// Polls until `f` holds (10 s at most).
    async fn wait(&self, what: &str, f: impl Fn(&Self) -> bool) {
        let t0 = Instant::now();
        while !f(self) {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "timed out waiting for {what}: {:?}, unsynced {:?}, {:?}",
                self.subscription.last_sequences(),
                self.subscription.unsynced_ranks(),
                self.m()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn wait_seq(&self, last: u64) {
        self.wait(&format!("seq {last}"), |f| {
            f.subscription.last_sequences() == vec![(0, last)]
        })
        .await;
    }
}

fn engine_endpoints(dir: &std::path::Path, name: &str) -> [String; 2] {
    [
        format!("ipc://{}/{name}-pub.sock", dir.display()),
        format!("ipc://{}/{name}-replay.sock", dir.display()),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumed_subscription_replays_what_it_missed() {
    let dir = temp_dir("engine-resume");
    let eps = engine_endpoints(&dir, "e");
    let mut engine = ReplayEngine::bind(&eps[0], &eps[1], 1000).await;
    let batches: Vec<Vec<u8>> = vec![
        stored(1, None, 10),
        stored(2, Some(1), 12),
        stored(3, Some(2), 14),
        stored(4, Some(3), 16),
        stored(5, Some(4), 18),
        // published while the second follower is away:
        stored(6, Some(5), 20),
        stored(7, Some(6), 22),
        removed(7),
        stored(8, Some(6), 24),
        stored(9, None, 40),
        // the next live one, which shows the resumed follower its gap:
        stored(10, Some(9), 42),
    ];
    let steady = Follower::start(&eps, Arc::new(KvIndex::new(2)), None).await;
    let stopped = Follower::start(&eps, Arc::new(KvIndex::new(2)), None).await;
    for (s, batch) in batches[..5].iter().enumerate() {
        engine.publish(s as u64, batch.clone()).await;
    }
    steady.wait_seq(4).await;
    stopped.wait_seq(4).await;
    assert_eq!((steady.blocks(), stopped.blocks()), (5, 5));

    // What a snapshot saves; the index stands for the restored one.
    let saved = stopped.subscription.last_sequences();
    assert_eq!(saved, vec![(0, 4)]);
    assert!(stopped.subscription.unsynced_ranks().is_empty());
    let Follower {
        index,
        subscription,
        ..
    } = stopped;
    subscription.shutdown().await;
    for (s, batch) in batches.iter().enumerate().take(10).skip(5) {
        engine.publish(s as u64, batch.clone()).await;
    }
    steady.wait_seq(9).await;

    // At its first connection the resumed follower asks the replay socket
    // for everything after 4: 5..=9 arrive while the engine is idle.
    let resumed = Follower::start(&eps, index, Some(saved[0].1)).await;
    resumed.wait_seq(9).await;
    engine.publish(10, batches[10].clone()).await;
    steady.wait_seq(10).await;
    resumed.wait_seq(10).await;
    // 5..=9 came through the replay socket, the live 10 needed no replay.
    let m = resumed.m();
    assert_eq!(
        (m.gaps, m.replays_requested, m.replay_batches, m.batches),
        (0, 1, 5, 6),
        "{m:?}"
    );
    assert_eq!((m.batches_lost, m.restarts, m.index_rejected), (0, 0, 0));
    assert!(resumed.subscription.unsynced_ranks().is_empty());
    // The same blocks as the follower that never stopped, exactly.
    assert_eq!((steady.blocks(), resumed.blocks()), (9, 9));
    assert_eq!(
        steady.index.export_target(TARGET).digest(TARGET),
        resumed.index.export_target(TARGET).digest(TARGET)
    );

    // The engine sends batch 10 again, twice: duplicates, no wipe.
    let before = (steady.m(), resumed.m());
    engine.publish(10, batches[10].clone()).await;
    engine.publish(10, batches[10].clone()).await;
    for (f, b) in [(&steady, &before.0), (&resumed, &before.1)] {
        f.wait("two duplicates", |f| {
            f.m().skipped_duplicates == b.skipped_duplicates + 2
        })
        .await;
        let m = f.m();
        assert_eq!((m.restarts, m.batches, m.batches_lost), (0, b.batches, 0));
        assert_eq!(f.blocks(), 9);
        assert!(f.subscription.unsynced_ranks().is_empty());
    }
    engine.publish(11, stored(11, Some(10), 44)).await;
    steady.wait_seq(11).await;
    resumed.wait_seq(11).await;
    assert_eq!((steady.blocks(), resumed.blocks()), (10, 10));

    resumed.subscription.shutdown().await;
    steady.subscription.shutdown().await;
    drop(engine);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_that_cannot_reach_back_leaves_the_rank_unsynced_until_cleared() {
    let dir = temp_dir("engine-unsynced");
    let eps = engine_endpoints(&dir, "e");
    // The engine keeps only its last 3 batches.
    let mut engine = ReplayEngine::bind(&eps[0], &eps[1], 3).await;
    let chain = |s: u8| stored(s + 1, s.checked_sub(1).map(|p| p + 1), 2 * s);
    let first = Follower::start(&eps, Arc::new(KvIndex::new(2)), None).await;
    for s in 0..=2u8 {
        engine.publish(u64::from(s), chain(s)).await;
    }
    first.wait_seq(2).await;
    let saved = first.subscription.last_sequences();
    let Follower {
        index,
        subscription,
        ..
    } = first;
    subscription.shutdown().await;
    for s in 3..=9u8 {
        engine.publish(u64::from(s), chain(s)).await;
    }

    // Resumed after 2; the replay from 3, asked at the first connection,
    // only reaches back to 7 (the engine holds 7..=9).
    let resumed = Follower::start(&eps, index, Some(saved[0].1)).await;
    resumed.wait_seq(9).await;
    engine.publish(10, chain(10)).await;
    resumed.wait_seq(10).await;
    assert_eq!(resumed.subscription.unsynced_ranks(), vec![0]);
    let m = resumed.m();
    assert_eq!(
        (
            m.batches_lost,
            m.replay_batches,
            m.unsynced_ranks,
            m.restarts
        ),
        (4, 3, 1, 0),
        "{m:?}"
    );
    // Further batches keep it unsynced...
    engine.publish(11, chain(11)).await;
    resumed.wait_seq(11).await;
    assert_eq!(resumed.subscription.unsynced_ranks(), vec![0]);
    // ...until the engine reports AllBlocksCleared: exact again.
    engine.publish(12, all_cleared()).await;
    resumed.wait_seq(12).await;
    assert!(resumed.subscription.unsynced_ranks().is_empty());
    assert_eq!((resumed.blocks(), resumed.m().unsynced_ranks), (0, 0));
    engine.publish(13, stored(40, None, 80)).await;
    resumed.wait_seq(13).await;
    assert_eq!(resumed.blocks(), 1);
    assert!(resumed.subscription.unsynced_ranks().is_empty());

    resumed.subscription.shutdown().await;
    drop(engine);
    let _ = std::fs::remove_dir_all(&dir);
}

// --- bounds on what an engine's stream may cost -------------------------------

/// A message larger than `max_engine_message_bytes` is not decoded: it is
/// counted as `too_large` and the stream goes on. Engines past
/// `max_engine_metric_workers` are counted, not exported per worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_messages_and_series_past_the_cap() {
    let dir = temp_dir("engine-bounds");
    let mut config = ServeConfig::for_tests();
    config.limits.max_engine_message_bytes = 1 << 20;
    config.limits.max_engine_metric_workers = 1;
    let server = TestServer::start_with(config).await;
    let endpoints: Vec<String> = (0..2)
        .map(|i| format!("ipc://{}/pub{i}.sock", dir.display()))
        .collect();
    let mut engines = Vec::new();
    for (i, ep) in endpoints.iter().enumerate() {
        let mut engine = PubSocket::new();
        engine.bind(ep).await.unwrap();
        server
            .register(engine_registration(20 + i as u64, ep))
            .await;
        wait_worker(&server, 20 + i as u64, "connected", |w| {
            w.subscription.contains(" connected,")
        })
        .await;
        engines.push(engine);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let engine = &mut engines[0];
    // 2 MiB of msgpack nil inside a valid-looking batch.
    let mut huge = stored(1, None, 10);
    huge.extend(std::iter::repeat_n(0xc0, 2 << 20));
    send(engine, vec![vec![], seq(0), huge]).await;
    send(engine, vec![vec![], seq(1), stored(2, None, 12)]).await;
    let info = wait_worker(&server, 20, "the next batch", |w| cached(w) == 1).await;
    assert!(
        info.subscription.contains("1 decode error"),
        "{}",
        info.subscription
    );

    let (_, body) = server.http_get("/metrics").await;
    assert!(
        body.contains(
            r#"kvroute_engine_event_decode_errors_total{reason="too_large",worker="20"} 1"#
        ),
        "{body}"
    );
    // Worker 21 is past the cap of one: no series of its own, counted.
    assert!(!body.contains(r#"worker="21""#), "{body}");
    assert!(
        body.contains("kvroute_engine_event_workers_without_series 1"),
        "{body}"
    );
    // Its own counters still reach GetWorker.
    send(&mut engines[1], vec![vec![], seq(0), stored(3, None, 14)]).await;
    let info = wait_worker(&server, 21, "its batch", |w| cached(w) == 1).await;
    assert!(
        info.subscription.contains("last seq 0"),
        "{}",
        info.subscription
    );

    // When worker 20 goes, the next subscription may have series again.
    server
        .workers()
        .deregister_worker(pb::DeregisterWorkerRequest { worker_id: 20 })
        .await
        .unwrap();
    server
        .workers()
        .deregister_worker(pb::DeregisterWorkerRequest { worker_id: 21 })
        .await
        .unwrap();
    let (_, body) = server.http_get("/metrics").await;
    assert!(
        body.contains("kvroute_engine_event_workers_without_series 0"),
        "{body}"
    );
    server
        .register(engine_registration(22, &endpoints[1]))
        .await;
    let (_, body) = server.http_get("/metrics").await;
    assert!(body.contains(r#"worker="22""#), "{body}");
    server.stop().await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
