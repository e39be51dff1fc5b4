//! Engine-native KV events through the running service, against a fake
//! engine built from the `zeromq` crate's PUB socket (no Python needed).
//!
//! A worker registers over gRPC with the fake engine's `events_endpoint`;
//! what the engine publishes must reach the index through the service's
//! ingest writer, so `SelectWorker` routes by it and Admin `GetWorker`
//! shows the subscription. The engine then misbehaves: malformed messages
//! (counted, skipped), going away (reconnect, blocks stay), coming back
//! restarted (sequence 0 again: the rank is cleared), a gap with no replay
//! endpoint (counted, routing continues). Re-registration with another
//! endpoint restarts the subscription, deregistration and lease lapse stop
//! it, and `kvroute serve --engine` starts one with a lease that stays.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test-only helpers

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{TestServer, registration};
use kvroute::{config::ServeConfig, pb};
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

/// `[0.0, [["BlockStored", [h], parent, [t, t+1], 2, nil, "GPU", nil]], 0]`
/// (vLLM array form, block size 2).
fn stored(h: u8, parent: Option<u8>, t: u8) -> Vec<u8> {
    let mut v = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x98, 0xab];
    v.extend_from_slice(b"BlockStored");
    v.extend_from_slice(&[0x91, h, parent.unwrap_or(0xc0), 0x92, t, t + 1, 0x02, 0xc0]);
    v.extend_from_slice(&[0xa3, b'G', b'P', b'U', 0xc0, 0x00]);
    v
}

async fn send(p: &mut PubSocket, frames: Vec<Vec<u8>>) {
    let frames: Vec<Bytes> = frames.into_iter().map(Bytes::from).collect();
    p.send(ZmqMessage::try_from(frames).unwrap()).await.unwrap();
}

fn seq(s: u64) -> Vec<u8> {
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

fn engine_registration(id: u64, endpoint: &str) -> pb::RegisterWorkerRequest {
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

    // Re-registration with the same endpoint keeps the subscription and blocks.
    server.register(engine_registration(3, &ep)).await;
    assert_eq!(cached(&worker(&server, 3).await.unwrap()), 2);
    assert!(
        worker(&server, 3)
            .await
            .unwrap()
            .subscription
            .contains("last seq 3")
    );

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
    send(&mut engine, vec![vec![], seq(4), stored(11, None, 70)]).await;
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
